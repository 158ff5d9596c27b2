"""Timings of the loaded pair on this machine, for auto mode's cost model: measured once
(:func:`specgguf.speculative.planner.calibrate`, at two depths of the context: 10-20 seconds on
two CPU cores for a 1.5B target) and cached in
``~/.cache/specgguf/calibration.json``, keyed by the llama.cpp build, the model files, the
threads, the repacking setting and the layers' placement (RPC servers). A cached
calibration is checked against one fresh decode step first: one taken while the machine
was busy would mislead every run after it.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from pathlib import Path

from specgguf.cache import cache_dir, read_json_cache, update_json_cache
from specgguf.speculative.drafters import Evaluator
from specgguf.speculative.planner import DEPTH_PROBE, Timings, calibrate, calibration_sizes


def _file_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


def calibration_key(
    build: str,
    target: Path,
    draft: Path | None,
    n_threads: int,
    repack: bool,
    rows_per_decode: int = 0,
    *,
    placement: str = "",
    type_k: str = "f16",
) -> str:
    """The cache key of one pair on one build: files by path, size and modification time,
    deterministic mode's rows per decode (0: off), where the layers are (RPC servers
    and the split; "" on this machine alone) and the target's K cache type."""
    parts = [build, _file_key(target), _file_key(draft) if draft else "-", str(n_threads),
             str(repack)] + ([f"rows={rows_per_decode}"] if rows_per_decode else [])  # fmt: skip
    parts += [f"placement={placement}"] if placement else []
    parts += [f"type_k={type_k}"] if type_k != "f16" else []
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def _cache_file() -> Path:
    return cache_dir() / "calibration.json"


def load_calibration(key: str) -> Timings | None:
    """The cached timings for ``key``; None when absent or unreadable (or cached before
    calibrations measured what depth costs)."""
    try:
        data = read_json_cache(_cache_file())[key]
        return Timings(
            {int(k): float(v) for k, v in data["verify"].items()}, float(data["draft"]),
            depth=int(data["depth"]), position_single=float(data["position_single"]),
            position_row=float(data["position_row"]),
        )  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def save_calibration(key: str, timings: Timings) -> None:
    value = {
        "verify": timings.verify, "draft": timings.draft, "depth": timings.depth,
        "position_single": timings.position_single, "position_row": timings.position_row,
        "time": time.time(),
    }  # fmt: skip
    update_json_cache(_cache_file(), key, value)


def pair_timings(
    key: str,
    target: Evaluator,
    draft: Evaluator | None,
    sample_ids: Sequence[int],
    *,
    recalibrate: bool = False,
) -> Timings:
    """The timings of ``key``: from the cache when one fresh decode step agrees with it
    (within a factor of 2) and it measured the largest batch the target's outputs allow
    now (a context set up for longer drafts measures again), else measured now and cached.
    Both KV caches end empty.

    Raises:
        BackendError: an evaluation failed.
    """
    cached = None if recalibrate else load_calibration(key)
    if cached is not None and max(cached.verify) >= max(calibration_sizes(target, draft)):
        now = calibrate(target, None, sample_ids, sizes=(1,), repeats=3)
        if 0.5 <= now.verify[1] / cached.verify[1] <= 2.0:
            return cached
    timings = calibrate(target, draft, sample_ids, deep=DEPTH_PROBE)
    save_calibration(key, timings)
    return timings
