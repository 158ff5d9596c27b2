"""Checks that run llama.cpp in a child process, so that a build that crashes (a
segmentation fault in a kernel cannot be caught in-process) is reported instead of taking
the caller down: the repack probe of :mod:`specgguf.llama.runtime` and the smoke test of
``doctor``. The child side is :mod:`specgguf.llama.checks`; this module only starts it and
reads its one line of JSON."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class ChildResult:
    """Outcome of a child check: ``ok``, its JSON answer (``data``), wall ``seconds``, and
    for a failure how it died (``failure``: "crashed with SIGSEGV", "exit code 1: ...",
    "timed out after 300 s")."""

    ok: bool
    data: dict[str, Any]
    seconds: float
    failure: str = ""


def run_child(
    check: str, *args: str, env: Mapping[str, str] | None = None, timeout: float = 300.0
) -> ChildResult:
    """Run ``python -m specgguf.llama.checks CHECK ARGS`` and read its last stdout line as
    JSON. Never raises for a failing build: a crash, an error or a timeout is the result.
    """
    t0 = time.perf_counter()
    try:
        res = subprocess.run(
            [sys.executable, "-m", "specgguf.llama.checks", check, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
            check=False,
        )
    except subprocess.TimeoutExpired:
        return ChildResult(False, {}, timeout, f"timed out after {timeout:.0f} s")
    dt = time.perf_counter() - t0
    if res.returncode < 0:
        try:
            name = signal.Signals(-res.returncode).name
        except ValueError:
            name = f"signal {-res.returncode}"
        return ChildResult(False, {}, dt, f"crashed with {name}")
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        return ChildResult(False, {}, dt, f"exit code {res.returncode}: {last}")
    try:
        data = json.loads(res.stdout.strip().splitlines()[-1])
        if not isinstance(data, dict):
            raise ValueError(data)
    except (ValueError, IndexError):
        return ChildResult(False, {}, dt, f"unexpected output: {res.stdout[-200:]!r}")
    return ChildResult(True, data, dt)
