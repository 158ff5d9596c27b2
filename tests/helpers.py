"""Helpers for tests that run the real ``specgguf`` entry point as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

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
