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
    deterministic: bool = False,
) -> Engine:
    """An engine over ``target`` (and ``draft``) with the checks on; ``draft_max`` sizes
    the largest draft length a generation may ask for."""
    from specgguf.engine import Engine, EngineConfig, ModelConfig, SpeculativeConfig

    return Engine(
        EngineConfig(
            ModelConfig(target, n_ctx=n_ctx, n_batch=n_batch),
            ModelConfig(draft, n_ctx=n_ctx, n_batch=n_batch) if draft is not None else None,
            SpeculativeConfig(drafter=drafter, draft_max=draft_max),
            deterministic=deterministic,
        )
    )
