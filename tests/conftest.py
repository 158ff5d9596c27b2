"""Shared fixtures: an isolated environment, tiny GGUF models, and the real test models.

No test reaches the network: every Hugging Face and config path points into a temp dir
and HF_HUB_OFFLINE is set; hub tests start their own server on 127.0.0.1.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from specgguf.gguf.tiny import write_fixtures
from specgguf.hub import testmodels

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
