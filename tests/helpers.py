"""Helpers for tests (and scripts/): the real ``specgguf`` entry point as a subprocess (a
command, a server, a timed chat completion), an engine over given models, and llama.cpp's
own sampler chain as an oracle."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from specgguf.engine import Engine
    from specgguf.speculative.sampling import SamplerParams

ROOT = Path(__file__).resolve().parent.parent


def run_cli(
    *args: str,
    input: str | bytes | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
    stdin: int | None = None,
) -> subprocess.CompletedProcess[bytes]:
    """Run ``python -m specgguf ARGS`` with stdout and stderr captured separately (bytes)."""
    full_env = {**os.environ, **(env or {})}
    data = input.encode() if isinstance(input, str) else input
    return subprocess.run(
        [sys.executable, "-m", "specgguf", *args],
        input=data,
        stdin=stdin if data is None else None,
        capture_output=True,
        env=full_env,
        timeout=timeout,
        check=False,
        cwd=ROOT,
    )


def mtmd_cli(tools: Path, *args: str) -> bytes:
    """What llama.cpp's ``llama-mtmd-cli`` in ``tools`` prints with ``args``, its newlines
    around the text stripped; skipped (failed with SPECGGUF_REQUIRE_LLAMA_TOOLS=1) where it
    is not built. Its generated text goes through llama.cpp's log thread, which a process
    ending under load can cut short (seen here: nothing printed, exit 0), so it runs again
    until two runs agree (at most five), and the longest text is kept."""
    import pytest

    cli = tools / "llama-mtmd-cli"
    if not cli.is_file():
        why = "llama-mtmd-cli is not built (scripts/bench-llama-cpp --build-only)"
        if os.environ.get("SPECGGUF_REQUIRE_LLAMA_TOOLS") == "1":
            pytest.fail(why)
        pytest.skip(why)
    seen: list[bytes] = []
    for _ in range(5):
        out = subprocess.run([str(cli), *args], capture_output=True, timeout=300,
                             check=True).stdout.strip(b"\n")  # fmt: skip
        if out and out in seen:
            return out
        seen.append(out)
    return max(seen, key=len)


def load_engine(
    target: Path,
    draft: Path | None = None,
    *,
    drafter: str = "model",
    n_ctx: int = 4096,
    draft_max: int = 16,
    n_batch: int = 512,
    deterministic: bool = False,
    draft_tree: int = -1,
) -> Engine:
    """An engine over ``target`` (and ``draft``) with the checks on; ``draft_max`` sizes
    the largest draft length a generation may ask for, ``draft_tree`` the most branches
    of a token tree (-1: the drafter's default)."""
    from specgguf.engine import Engine, EngineConfig, ModelConfig, SpeculativeConfig

    return Engine(
        EngineConfig(
            ModelConfig(target, n_ctx=n_ctx, n_batch=n_batch),
            ModelConfig(draft, n_ctx=n_ctx, n_batch=n_batch) if draft is not None else None,
            SpeculativeConfig(drafter=drafter, draft_max=draft_max, draft_tree=draft_tree),
            deterministic=deterministic,
        )
    )


class ServerProcess:
    """``specgguf serve ARGS --port 0`` as a subprocess on 127.0.0.1: waits for its
    "listening on" line on stderr and reads the port from it; stderr is collected in
    ``stderr_lines`` (a thread drains it). Stop it with :meth:`stop` (a signal) or use it
    as a context manager. ``cwd``: the checkout whose ``specgguf`` runs (``python -m``
    imports it from there: another checkout's, to compare with).

    Raises:
        RuntimeError: the server exited, or said nothing, before listening.
    """

    def __init__(
        self,
        *args: str,
        env: Mapping[str, str] | None = None,
        timeout: float = 300,
        cwd: Path = ROOT,
    ) -> None:
        import re
        import threading
        import time

        self.args = ["serve", "--host", "127.0.0.1", "--port", "0", *args]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specgguf", *self.args], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **(env or {})},
            cwd=cwd, text=True,
        )  # fmt: skip
        self.stderr_lines: list[str] = []
        ready = threading.Event()
        self.url = ""

        def drain() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.stderr_lines.append(line)
                m = re.search(r"listening on (http://\S+)", line)
                if m and not self.url:
                    self.url = m[1]
                    ready.set()
            ready.set()

        self._drain = threading.Thread(target=drain, daemon=True)
        self._drain.start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.1) and time.monotonic() < deadline:
            pass
        if not self.url:
            self.proc.kill()
            self.proc.wait()
            self._drain.join(5)
            raise RuntimeError(f"specgguf serve did not start: {self.stderr}")
        self.port = int(self.url.rsplit(":", 1)[1])
        self.base_url = f"{self.url}/v1"

    @property
    def stderr(self) -> str:
        return "".join(self.stderr_lines)

    def stop(self, sig: int | None = None, timeout: float = 30) -> int:
        """Send ``sig`` (default SIGTERM) and wait; returns the exit code (the process is
        killed, and the test fails, if it does not exit within ``timeout`` seconds)."""
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM if sig is None else sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the server did not exit within {timeout} s") from None
        self._drain.join(5)
        return code

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.stop()


@dataclasses.dataclass
class Completion:
    """One chat completion as a client saw it: the text, the chunk ids (one id when
    nothing was mixed), seconds to the first text (``ttft``) and to the end, and the
    server's ``usage`` and ``timings`` (llama.cpp's names), or its HTTP ``status`` and
    error."""

    status: int
    text: str = ""
    ids: set[str] = dataclasses.field(default_factory=set)
    ttft: float = 0.0
    seconds: float = 0.0
    usage: dict[str, Any] = dataclasses.field(default_factory=dict)
    timings: dict[str, Any] = dataclasses.field(default_factory=dict)
    finish_reason: str | None = None
    error: Any = None


def chat_completion(
    base_url: str, body: dict[str, Any], *, stream: bool, timeout: float = 600
) -> Completion:
    """POST ``body`` to ``base_url``/chat/completions (streamed or not) with httpx and time
    it; a non-200 answer is returned with its status and error, not raised."""
    import json
    import time

    import httpx

    url = f"{base_url}/chat/completions"
    t0 = time.perf_counter()
    if not stream:
        r = httpx.post(url, json={**body, "stream": False}, timeout=timeout)
        seconds = time.perf_counter() - t0
        data = r.json()
        if r.status_code != 200:
            return Completion(r.status_code, seconds=seconds, error=data.get("error"))
        choice = data["choices"][0]
        return Completion(
            200, choice["message"]["content"], {data["id"]}, seconds, seconds,
            data.get("usage") or {}, data.get("timings") or {}, choice["finish_reason"],
        )  # fmt: skip
    out = Completion(200)
    parts: list[str] = []
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url, json=body, timeout=timeout) as r:
        if r.status_code != 200:
            r.read()
            return Completion(r.status_code, error=r.json().get("error"))
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out.error = chunk["error"]
                continue
            out.ids.add(chunk["id"])
            for choice in chunk.get("choices") or []:
                text = choice.get("delta", {}).get("content") or ""
                if text and not out.ttft:
                    out.ttft = time.perf_counter() - t0
                parts.append(text)
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
            out.usage = chunk.get("usage") or out.usage
            out.timings = chunk.get("timings") or out.timings
    out.seconds = time.perf_counter() - t0
    out.text = "".join(parts)
    return out


_LOAD_SCRIPT = """
import logging, sys
from specgguf.errors import BackendError
from specgguf.llama.backend import LlamaModel
log = logging.getLogger("specgguf.llama_cpp")
log.setLevel(logging.DEBUG)
log.addHandler(logging.StreamHandler(sys.stderr))
try:
    with LlamaModel(sys.argv[1], n_gpu_layers=0, use_extra_bufts=False,
                    vocab_only=sys.argv[2] == "vocab"):
        pass
except BackendError:
    sys.exit(3)
"""


def llama_cpp_load(path: Path, *, vocab_only: bool = False) -> tuple[int, str]:
    """Load ``path`` with llama.cpp itself, in a child process (an abort ends only the
    child): the exit status (0 loaded, 3 llama.cpp refused, negative: killed by a signal,
    as GGML_ASSERT's abort does) and llama.cpp's log, the oracle of what it refuses."""
    res = subprocess.run(
        [sys.executable, "-c", _LOAD_SCRIPT, str(path), "vocab" if vocab_only else "all"],
        capture_output=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )
    return res.returncode, res.stderr.decode(errors="replace")


def llama_cpp_chain(logits: npt.NDArray[np.float32], params: SamplerParams) -> dict[int, float]:
    """The candidates and probabilities llama.cpp's chain top_k -> top_p -> min_p -> temp
    leaves (common/sampling.cpp's order), with a softmax over the remaining logits (what
    ``llama_sampler_init_dist`` samples from). Filters that are off are not added, as in
    common/sampling.cpp."""
    import llama_cpp as lc

    n = logits.shape[0]
    data = (lc.llama_token_data * n)()
    for i, v in enumerate(logits.tolist()):
        data[i].id, data[i].logit, data[i].p = i, v, 0.0
    cur = lc.llama_token_data_array(data=data, size=n, selected=-1, sorted=False)
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    try:
        if params.top_k > 0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(params.top_k))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(params.top_p, 1))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_min_p(params.min_p, 1))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(params.temperature))
        lc.llama_sampler_apply(chain, ctypes.byref(cur))
        ids = [int(cur.data[i].id) for i in range(cur.size)]
        z = np.array([cur.data[i].logit for i in range(cur.size)], np.float64)
    finally:
        lc.llama_sampler_free(chain)
    p = np.exp(z - z.max())
    p /= p.sum()
    return dict(zip(ids, p.tolist(), strict=True))


def record_drafts(monkeypatch: Any, cls: type) -> list[list[int]]:
    """Every draft ``cls.propose`` makes from now on (a step that asked for none left
    out), in order: the list fills as the drafter drafts."""
    drafts: list[list[int]] = []
    propose = cls.propose

    def recording(self: Any, history: Any, k: int, *a: Any, **kw: Any) -> Any:
        draft = propose(self, history, k, *a, **kw)
        if k > 0:
            drafts.append(list(draft.tokens))
        return draft

    monkeypatch.setattr(cls, "propose", recording)
    return drafts


def check_head_choice(
    base: list[str], drafter: str, taken: list[list[str]], refused: list[tuple[list[str], str]]
) -> None:
    """``run`` with ``base`` and each of ``taken``'s flags drafts with ``drafter`` (its
    ``--json`` says so); with each of ``refused``'s it exits 2 with the needle in one
    line of stderr."""
    for extra in taken:
        res = run_cli(*base, *extra)
        assert res.returncode == 0, res.stderr
        assert f'"{drafter}"'.encode() in res.stdout, res.stdout
    for extra, needle in refused:
        res = run_cli(*base, *extra)
        err = res.stderr.decode()
        assert res.returncode == 2 and needle in err and len(err.strip().splitlines()) == 1, err
