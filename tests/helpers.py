"""Helpers for tests that run the real ``specgguf`` entry point as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specgguf.engine import Engine

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


def load_engine(
    target: Path,
    draft: Path | None = None,
    *,
    drafter: str = "model",
    n_ctx: int = 4096,
    draft_max: int = 16,
    n_batch: int = 512,
) -> Engine:
    """An engine over ``target`` (and ``draft``) with the checks on; ``draft_max`` sizes
    the largest draft length a generation may ask for."""
    from specgguf.engine import Engine, EngineConfig, ModelConfig, SpeculativeConfig

    return Engine(
        EngineConfig(
            ModelConfig(target, n_ctx=n_ctx, n_batch=n_batch),
            ModelConfig(draft, n_ctx=n_ctx, n_batch=n_batch) if draft is not None else None,
            SpeculativeConfig(drafter=drafter, draft_max=draft_max),
        )
    )


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
