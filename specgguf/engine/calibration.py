"""Timings of the loaded pair on this machine, for auto mode's cost model
(:class:`specgguf.speculative.costmodel.Timings`): measured once (:func:`calibrate`, at two
depths of the context: 10-20 seconds on two CPU cores for a 1.5B target) and cached in
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
from typing import Literal

from specgguf.cache import cache_dir, read_json_cache, update_json_cache
from specgguf.speculative.costmodel import Timings
from specgguf.speculative.draft import Evaluator

#: Verification batch sizes measured by calibration (others are interpolated): every size
#: a draft length up to 48 needs, denser where drafts are usually short. Unchanged since
#: the first calibration; measuring them takes about 22 s of a 2-core VM with a 1.5B target.
CALIBRATION_SIZES = (1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49)

#: The sizes measured again deeper in the context (calibrate's ``deep``), and how deep:
#: every row of a batch attends to every cached position, so batches cost more there (4
#: rows: 2.8x one row at 64 positions, 3.6x at 1024, on a 2-core AMD EPYC; 8-11 us per
#: row and position). The probe's prefix takes about 4 s there.
DEPTH_SIZES = (1, 5, 17)
DEPTH_PROBE = 384
#: The least distance between the two depths for a slope to be measured.
DEPTH_SPAN_MIN = 128

#: A batch size that took this many times longer than the larger sizes after it was a
#: hiccup of the machine, not of the kernel: it is interpolated from its neighbours.
OUTLIER_RATIO = 1.5


def calibration_sizes(
    target: Evaluator, draft: Evaluator | None, sizes: Sequence[int] = CALIBRATION_SIZES
) -> list[int]:
    """The verification batch sizes of ``sizes`` that :func:`calibrate` measures: those
    the target's batch, its outputs (K + 1 for a draft length K) and both contexts allow."""
    room = min(ctx.n_ctx for ctx in (target, draft) if ctx is not None)
    cap = min(target.n_batch, target.n_outputs_max, room - 1)
    return [n for n in sizes if n <= cap] or [1]


def calibrate(
    target: Evaluator,
    draft: Evaluator | None,
    tokens: Sequence[int],
    *,
    sizes: Sequence[int] = CALIBRATION_SIZES,
    repeats: int = 3,
    deep: int = 0,
) -> Timings:
    """Measure t_verify(n) on the target and t_draft on the draft (the minimum of
    ``repeats``), after a prefix of up to 64 of ``tokens`` (any valid ids: the timing, not
    the text, matters), for the batch sizes the target's batch, outputs and context allow.
    With ``deep``, measure the sizes of :data:`DEPTH_SIZES` again after a prefix of up to
    ``deep`` tokens (at least 128 more than the first), for what each cached position adds
    (:attr:`Timings.position_single`, :attr:`Timings.position_row`: a lone row's slope,
    and the batches' pooled over their rows; the lone row's at most the batches'). Both
    caches are left empty.

    Raises:
        BackendError: an evaluation failed.
    """
    toks = list(tokens) or [0]
    room = min(ctx.n_ctx for ctx in (target, draft) if ctx is not None)
    sizes = calibration_sizes(target, draft, sizes)
    need = max(sizes)
    n_prefix = max(0, min(64, room - need - 1))

    def ids(start: int, n: int) -> list[int]:
        return [toks[i % len(toks)] for i in range(start, start + n)]

    prefix = ids(0, n_prefix)
    body = ids(0, need)

    def timed(
        ctx: Evaluator,
        batch: list[int],
        logits: Literal["last", "all"],
        other: Evaluator | None,
        at: int,
    ) -> float:
        # As in a real step, the other model has just run and evicted our weights from
        # the CPU caches.
        if other is not None:
            _rewind(other, len(prefix), 1)
            other.eval(body[:1], logits="last")
        _rewind(ctx, at, len(batch))
        t0 = time.perf_counter()
        ctx.eval(batch, logits=logits)
        return time.perf_counter() - t0

    def curve(at: int, ns: Sequence[int]) -> dict[int, float]:
        # The minimum of the repeats: other work on the machine only ever adds time.
        return {n: min(timed(target, body[:n], "all", draft, at) for _ in range(repeats))
                for n in ns}  # fmt: skip

    for ctx in (target, draft):
        if ctx is not None:
            ctx.rollback(0)
            if prefix:
                ctx.eval(prefix, logits="none")
    timed(target, body[:1], "all", draft, n_prefix)  # warm-up
    verify = curve(n_prefix, sizes)
    td = 0.0
    if draft is not None:
        td = min(timed(draft, body[:1], "last", target, n_prefix) for _ in range(repeats + 2))
    timings = Timings(_drop_outliers(verify), td, depth=n_prefix)
    deep_sizes = [n for n in DEPTH_SIZES if n in verify]
    at = min(deep, target.n_ctx - max(deep_sizes, default=1) - 1)
    if deep and at - n_prefix >= DEPTH_SPAN_MIN and 1 in verify:
        target.rollback(n_prefix)
        target.eval(ids(n_prefix, at - n_prefix), logits="none")
        _add_depth(timings, curve(at, deep_sizes), at - n_prefix)
    for ctx in (target, draft):
        if ctx is not None:
            ctx.rollback(0)
    return timings


def _rewind(ctx: Evaluator, at: int, n: int) -> None:
    """Go back to ``at`` cached positions before measuring ``n`` more; a recurrent state
    goes back only as far as its snapshots allow (each measurement then starts a few
    positions deeper than the last, which costs the same), rather than reading the
    prefix again, unless the context would overflow."""
    room = ctx.rollback_room
    keep = at if room is None else max(at, ctx.n_past - room)
    if keep + n > ctx.n_ctx:
        keep = at
    ctx.rollback(keep)


def _add_depth(timings: Timings, deeper: dict[int, float], span: int) -> None:
    """Set what each cached position adds from a curve measured ``span`` positions deeper:
    a lone row's slope, and the batches' pooled over their rows; the lone row's at most
    the batches' (see :meth:`Timings._at_depth`)."""
    base = timings.verify
    single = max(0.0, (deeper[1] - base[1]) / span)
    rows = [n for n in deeper if n > 1]
    if rows:
        extra = sum(deeper[n] - base[n] for n in rows)
        timings.position_row = max(0.0, extra / (span * sum(rows)))
    timings.position_single = min(single, timings.position_row)


def _drop_outliers(verify: dict[int, float]) -> dict[int, float]:
    """Replace a batch size that took far longer than the larger ones (a hiccup of the
    machine, not of the kernel) by the interpolation of its neighbours."""
    xs = sorted(verify)
    out = dict(verify)
    for i, n in enumerate(xs[:-1]):
        larger = [verify[m] for m in xs[i + 1 : i + 3]]
        if verify[n] > OUTLIER_RATIO * max(larger) and i > 0:
            lo, hi = xs[i - 1], xs[i + 1]
            out[n] = verify[lo] + (n - lo) / (hi - lo) * (verify[hi] - verify[lo])
    return out


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
