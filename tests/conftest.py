"""Shared fixtures: an isolated environment, tiny GGUF models, and the real test models.

No test reaches the network: every Hugging Face and config path points into a temp dir
and HF_HUB_OFFLINE is set; hub tests start their own server on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from specgguf.gguf.tiny import write_fixtures
from specgguf.hub import testmodels
from specgguf.speculative.drafters import compiled

# Hypothesis judges wall time by default (a 200 ms deadline per example, and the too_slow
# health check): under load, both fail a property test whose property holds. Off for
# every property test here; speed is for the benchmarks in scripts/.
settings.register_profile("specgguf", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("specgguf")

# Resolved before any test changes HOME, so that the real models stay findable.
_REAL_MODELS_DIR = testmodels.test_models_dir()
_REAL_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


@pytest.fixture(autouse=True)
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """HOME, XDG config, the Hugging Face cache and token all inside ``tmp_path``."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    # The repack-probe verdict is per build, not per test: keep the real cache for it.
    monkeypatch.setenv("XDG_CACHE_HOME", str(_REAL_CACHE))
    monkeypatch.setenv("HF_HOME", str(home / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hf" / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.setenv("SPECGGUF_TEST_MODELS", str(_REAL_MODELS_DIR))
    monkeypatch.delenv("SPECGGUF_DEBUG", raising=False)
    monkeypatch.setenv("NO_COLOR", "1")
    yield home


@pytest.fixture(params=["compiled", "python"])
def lookup_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each implementation of the lookup drafters' indexes in turn, for the drafters made
    in the test: the compiled one (_lookup.c) and its pure-Python reference. Where the
    compiled one was not built the test skips, unless SPECGGUF_REQUIRE_COMPILED is set (CI)."""
    if request.param == "python":
        monkeypatch.setattr(compiled, "lookup", None)
    elif compiled.lookup is None:
        if os.environ.get("SPECGGUF_REQUIRE_COMPILED"):
            pytest.fail("the compiled lookup indexes were not built (setup.py's _lookup.c)")
        pytest.skip("the compiled lookup indexes were not built (no C compiler at install)")
    return str(request.param)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every tiny fixture of :mod:`specgguf.gguf.tiny`, written once per session."""
    return write_fixtures(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def real_models() -> dict[str, Path]:
    """The real test models; the test is skipped when any is absent."""
    out: dict[str, Path] = {}
    for name in testmodels.TEST_MODELS:
        path = testmodels.test_model_path(name)
        if path is None:
            if os.environ.get("SPECGGUF_REQUIRE_REAL_MODELS"):
                pytest.fail(f"SPECGGUF_REQUIRE_REAL_MODELS is set but {name} is absent")
            pytest.skip(
                f"real test model {name} is absent from {_REAL_MODELS_DIR} "
                "(run scripts/fetch-test-models)"
            )
        out[name] = path
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def require_rpc() -> None:
    """Skip (fail with SPECGGUF_REQUIRE_RPC set, as in CI) unless this llama.cpp build has
    the RPC backend and an rpc-server to go with it (scripts/install builds both)."""
    from specgguf.llama import rpc

    missing = None
    if not rpc.supported():
        missing = "this llama.cpp build has no RPC backend (scripts/install builds it in)"
    elif rpc.server_binary() is None:
        missing = "no rpc-server for this installation (scripts/install builds it)"
    if missing:
        if os.environ.get("SPECGGUF_REQUIRE_RPC"):
            pytest.fail(f"SPECGGUF_REQUIRE_RPC is set but {missing}")
        pytest.skip(missing)


@contextlib.contextmanager
def rpc_servers_running(n: int, *, threads: int = 1) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` rpc-servers (through ``specgguf rpc-server``) on free ports of 127.0.0.1,
    each ready for a connection; stopped at the end. Each process has ``.endpoint``."""
    require_rpc()
    procs: list[subprocess.Popen[bytes]] = []
    stack = contextlib.ExitStack()
    try:
        while len(procs) < n:
            port = free_port()
            # a file, not a pipe: a pipe nobody reads could fill and block the server
            log = stack.enter_context(tempfile.TemporaryFile())  # noqa: SIM115
            p = subprocess.Popen(
                [sys.executable, "-m", "specgguf", "rpc-server", "--port", str(port),
                 "-t", str(threads)],
                stdout=subprocess.DEVNULL, stderr=log,
            )  # fmt: skip
            p.endpoint = f"127.0.0.1:{port}"  # type: ignore[attr-defined]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and p.poll() is None:
                with (
                    contextlib.suppress(OSError),
                    socket.create_connection(("127.0.0.1", port), timeout=1),
                ):
                    break
                time.sleep(0.1)
            else:
                p.kill()
                p.wait()
                log.seek(0)
                err = log.read().decode(errors="replace")
                if "bind" in err or "socket" in err:
                    continue  # the port was taken in between: another one
                raise RuntimeError(f"rpc-server on port {port} did not start: {err[-500:]}")
            procs.append(p)
        yield procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        stack.close()


@pytest.fixture(scope="session")
def rpc_servers() -> Iterator[list[str]]:
    """Two rpc-servers on 127.0.0.1 for the whole session: their ``host:port``."""
    with rpc_servers_running(2) as procs:
        yield [p.endpoint for p in procs]  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def tools() -> Path:
    """The folder of llama.cpp's own tools built from the vendored source (the oracle of
    tests/test_mtp_oracle.py and tests/test_eagle3.py); skipped when they are not built,
    unless ``SPECGGUF_REQUIRE_LLAMA_TOOLS=1``."""
    from .test_mtp_oracle import TOOL, llama_tools_dir

    bindir = llama_tools_dir()
    if bindir is None:
        why = f"{TOOL} is not built (scripts/bench-llama-cpp --build-only)"
        if os.environ.get("SPECGGUF_REQUIRE_LLAMA_TOOLS") == "1":
            pytest.fail(f"SPECGGUF_REQUIRE_LLAMA_TOOLS=1 but {why}")
        pytest.skip(why)
    return bindir
