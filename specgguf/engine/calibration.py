"""Timings of the loaded pair on this machine, for auto mode's cost model
(:class:`specgguf.speculative.costmodel.Timings`): measured once (:func:`calibrate`, at two
depths of the context: 10-20 seconds on two CPU cores for a 1.5B target) and cached in
``~/.cache/specgguf/calibration.json``, keyed by the llama.cpp build, the model files, the
threads, the repacking setting and the layers' placement (RPC servers). A cached
calibration is checked against one fresh decode step first: one taken while the machine
was busy would mislead every run after it (and so would one taken now, when the machine
is busier than it was then: the cached one is kept). Where the timings of a key came from
in this process (read from the cache or measured, which file, when, why measured) is kept
for the callers that report it (:func:`calibration_source`). Each entry also records its two
files, so that the draft search can judge a pair by what a draft token cost here
(:func:`measured_draft_cost`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from specgguf.cache import cache_dir, read_json_cache, update_json_cache
from specgguf.speculative.costmodel import Timings
from specgguf.speculative.draft import Evaluator

log = logging.getLogger("specgguf")

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

#: A cached calibration is measured again when a fresh decode step takes less than this
#: share of its one (it was measured while the machine was busy).
FRESH_STEP_MIN = 0.5

#: A batch size that took this many times longer than a larger size is measured again,
#: :data:`HICCUP_TRIES` times at most. A batch reads every weight a smaller one does and
#: other work only ever adds time, so it was a hiccup of the machine, unless all its
#: measurements agree within :data:`REPRODUCED` (then a kernel of llama.cpp's is slower at
#: that size, and the size is kept as measured). One that stays slow and does not repeat
#: is interpolated from its neighbours, and the calibration is not cached. (A machine
#: busy by the same amount at each of a size's measurements and idle at the larger
#: sizes' would pass for a kernel; the run's own steps then correct the costs.)
OUTLIER_RATIO = 1.5
HICCUP_TRIES = 2
REPRODUCED = 1.25


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

    A batch size slower than :data:`OUTLIER_RATIO` times a larger one is measured again
    (:func:`hiccups`); one that stays so and did not measure alike each time is
    interpolated (:func:`_drop_outliers`).

    Raises:
        BackendError: an evaluation failed.
    """
    return _calibrate(target, draft, tokens, sizes=sizes, repeats=repeats, deep=deep)[0]


def _calibrate(
    target: Evaluator,
    draft: Evaluator | None,
    tokens: Sequence[int],
    *,
    sizes: Sequence[int],
    repeats: int,
    deep: int,
) -> tuple[Timings, list[int], list[int]]:
    """:func:`calibrate`; the batch sizes that stayed slower than a larger one after
    :data:`HICCUP_TRIES` more measurements, differently each time (interpolated: the
    machine was busy); and those that stayed so alike each time (kept: the kernel's)."""
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

    def measure(at: int, n: int) -> float:
        # The minimum of the repeats: other work on the machine only ever adds time.
        return min(timed(target, body[:n], "all", draft, at) for _ in range(repeats))

    def curve(at: int, ns: Sequence[int]) -> tuple[dict[int, float], list[int], list[int]]:
        """The curve, its sizes slower than a larger one that measured differently each
        time, and those that measured alike."""
        tries = {n: [measure(at, n)] for n in ns}
        for _ in range(HICCUP_TRIES):
            slow = hiccups({n: min(m) for n, m in tries.items()})
            if not slow:
                break
            for n in slow:
                tries[n].append(measure(at, n))
        out = {n: min(m) for n, m in tries.items()}
        slow = hiccups(out)
        # (a size first flagged after the last try, as a larger one came down, was
        # measured too few times to tell: a busy machine's)
        kept = [n for n in slow if len(tries[n]) > HICCUP_TRIES
                and max(tries[n]) <= REPRODUCED * min(tries[n])]  # fmt: skip
        return out, [n for n in slow if n not in kept], kept

    for ctx in (target, draft):
        if ctx is not None:
            ctx.rollback(0)
            if prefix:
                ctx.eval(prefix, logits="none")
    timed(target, body[:1], "all", draft, n_prefix)  # warm-up
    verify, left, kept = curve(n_prefix, sizes)
    td = 0.0
    if draft is not None:
        td = min(timed(draft, body[:1], "last", target, n_prefix) for _ in range(repeats + 2))
    timings = Timings(_drop_outliers(verify, kept), td, depth=n_prefix)
    deep_sizes = [n for n in DEPTH_SIZES if n in verify]
    at = min(deep, target.n_ctx - max(deep_sizes, default=1) - 1)
    if deep and at - n_prefix >= DEPTH_SPAN_MIN and 1 in verify:
        target.rollback(n_prefix)
        target.eval(ids(n_prefix, at - n_prefix), logits="none")
        deeper, busy, alike = curve(at, deep_sizes)
        left += [n for n in busy if n not in left]
        _add_depth(timings, _drop_outliers(deeper, alike), at - n_prefix)
    for ctx in (target, draft):
        if ctx is not None:
            ctx.rollback(0)
    return timings, sorted(left), kept


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


def hiccups(verify: dict[int, float]) -> list[int]:
    """The batch sizes of a measured curve (rows: seconds) that took more than
    :data:`OUTLIER_RATIO` times what some larger size took: hiccups of the machine, not
    of the kernel (a batch reads every weight a smaller one does, and other work only ever
    adds time to a measurement). Rising."""
    out: list[int] = []
    least = float("inf")
    for n in sorted(verify, reverse=True):
        if verify[n] > OUTLIER_RATIO * least:
            out.append(n)
        least = min(least, verify[n])
    return out[::-1]


def _drop_outliers(verify: dict[int, float], kept: Sequence[int] = ()) -> dict[int, float]:
    """Replace each of :func:`hiccups` but ``kept`` by the interpolation of the nearest
    sizes below and above it that are not; one below every such size, by the next larger
    one's time in proportion to the rows (what it would cost were rows no cheaper in a
    batch: a lone row's time too low makes drafts look dear, never free)."""
    slow = set(hiccups(verify)) - set(kept)
    good = [n for n in sorted(verify) if n not in slow and n not in kept]
    out = dict(verify)
    for n in slow:
        lo = max((m for m in good if m < n), default=None)
        hi = min(m for m in good if m > n)  # the largest size is never a hiccup
        if lo is None:
            out[n] = verify[hi] * n / hi
        else:
            out[n] = verify[lo] + (n - lo) / (hi - lo) * (verify[hi] - verify[lo])
    return out


def _file_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


#: What each key :func:`calibration_key` made in this process says of its pair (the two
#: files' identities, as the key hashes them, and deterministic mode's rows per decode):
#: :func:`save_calibration` records it in the key's entry, where a hash cannot be read back.
_KEY_FILES: dict[str, dict[str, Any]] = {}


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
    and the split; "" on this machine alone) and the target's K cache type. Remembers
    the files of the key in this process, for :func:`save_calibration` to record."""
    parts = [build, _file_key(target), _file_key(draft) if draft else "-", str(n_threads),
             str(repack)] + ([f"rows={rows_per_decode}"] if rows_per_decode else [])  # fmt: skip
    parts += [f"placement={placement}"] if placement else []
    parts += [f"type_k={type_k}"] if type_k != "f16" else []
    key = hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]
    _KEY_FILES[key] = {
        "target_file": parts[1], "draft_file": parts[2] if draft else None,
        "rows_per_decode": rows_per_decode,
    }  # fmt: skip
    return key


def _cache_file() -> Path:
    return cache_dir() / "calibration.json"


def load_calibration(key: str) -> Timings | None:
    """The cached timings for ``key``; None when absent or unreadable (or cached before
    calibrations measured what depth costs), or measured while the machine was busy
    (:func:`busy_sizes`)."""
    entry = _load_entry(key)
    return entry[0] if entry is not None and not busy_sizes(entry[0].verify, entry[2]) else None


def busy_sizes(verify: dict[int, float], kept: Sequence[int] = ()) -> list[int]:
    """The batch sizes of a curve slower than a larger one (:func:`hiccups`) but those
    ``kept`` (measured alike each time: the kernel's), rising: a curve with any was
    measured while the machine was busy."""
    return [n for n in hiccups(verify) if n not in kept]


def _load_entry(key: str) -> tuple[Timings, float, tuple[int, ...]] | None:
    """The cached timings for ``key``, when they were measured (Unix time; 0 when the
    entry does not say), and the sizes slower than a larger one that its calibration
    measured alike each time (kept)."""
    try:
        data = read_json_cache(_cache_file())[key]
        timings = Timings(
            {int(k): float(v) for k, v in data["verify"].items()}, float(data["draft"]),
            depth=int(data["depth"]), position_single=float(data["position_single"]),
            position_row=float(data["position_row"]),
        )  # fmt: skip
        kept = tuple(int(n) for n in data.get("slower_kept", ()))
        return timings, float(data.get("time", 0.0)), kept
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def save_calibration(
    key: str, timings: Timings, measured_at: float | None = None, kept: Sequence[int] = ()
) -> bool:
    """Cache ``timings`` under ``key``, measured at ``measured_at`` (Unix time; default
    now), with the identities of the pair's files (path, size, modification time) when
    :func:`calibration_key` made ``key`` in this process, for :func:`measured_draft_cost`,
    and ``kept``, the sizes slower than a larger one that measured alike each time.
    Returns whether the cache file holds them now (a cache that cannot be written is
    skipped)."""
    when = time.time() if measured_at is None else measured_at
    value = {
        "verify": timings.verify, "draft": timings.draft, "depth": timings.depth,
        "position_single": timings.position_single, "position_row": timings.position_row,
        "time": when, **({"slower_kept": list(kept)} if kept else {}),
        **_KEY_FILES.get(key, {}),
    }  # fmt: skip
    update_json_cache(_cache_file(), key, value)
    entry = _load_entry(key)
    return entry is not None and entry[1] == when


def measured_draft_cost(target: Path, draft: Path) -> float | None:
    """What one token of the draft model ``draft`` cost on this machine relative to one
    row of the target model ``target``: t_draft / t_verify(1) (seconds over seconds; the
    cost coefficient c of Leviathan et al. 2023, section 3.4) of the most recent
    calibration cached for these two files (path, size and modification time, as
    :func:`calibration_key` knows them), whatever the llama.cpp build, threads, repacking
    or placement it was measured with; None when none is cached. The shape of
    :data:`specgguf.hub.draft_search.MeasuredCost`.

    Not found: entries cached before calibrations recorded their files (their key is a hash
    of them, which cannot be read back), entries of a file changed since, entries measured
    on a busy machine (:func:`busy_sizes`), and deterministic mode's (a lone row may carry a
    throw-away second row there, so its t_verify(1) is not one row's). An unreadable cache
    or file gives None; nothing is raised.
    """
    try:
        t_file, d_file = _file_key(Path(target)), _file_key(Path(draft))
    except OSError:
        return None
    best: tuple[float, float] | None = None
    for entry in read_json_cache(_cache_file()).values():
        if not isinstance(entry, dict) or entry.get("rows_per_decode"):
            continue
        if entry.get("target_file") != t_file or entry.get("draft_file") != d_file:
            continue
        try:
            one_row, t_draft = float(entry["verify"]["1"]), float(entry["draft"])
            when = float(entry.get("time", 0.0))
            busy = busy_sizes({int(k): float(v) for k, v in entry["verify"].items()},
                              [int(n) for n in entry.get("slower_kept", ())])  # fmt: skip
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
        if busy:  # a lone row measured on a busy machine makes the draft look cheap
            continue
        if one_row > 0 and t_draft > 0 and (best is None or when > best[0]):
            best = (when, t_draft / one_row)
    return None if best is None else best[1]


@dataclasses.dataclass(frozen=True)
class CalibrationSource:
    """Where the timings of one calibration key came from, the last time this process
    asked :func:`pair_timings` for them.

    Attributes:
        key: the cache key (:func:`calibration_key`).
        file: the cache file, ``calibration.json`` in specgguf's cache folder
            (:func:`specgguf.cache.cache_dir`).
        reused: True when read from ``file`` (a fresh decode step was not more than twice
            as fast as theirs), False when measured in this process.
        measured_at: when they were measured (Unix time, seconds).
        seconds: how long :func:`pair_timings` took this time (seconds): the check of a
            cached calibration, or the whole measurement.
        saved: whether ``file`` holds them.
        why: why they were measured ("" when reused).
        unsaved: why they were not cached ("" when saved or reused): the file cannot be
            written, or they were measured while the machine was busy.
        fresh_step_ratio: a fresh decode step's time over the cached one's, when the
            cache was checked and reused (above 1: the machine is busier now than when
            they were measured); None otherwise.
    """

    key: str
    file: Path
    reused: bool
    measured_at: float
    seconds: float
    saved: bool
    why: str = ""
    fresh_step_ratio: float | None = None
    unsaved: str = ""


#: The last :class:`CalibrationSource` of each key in this process.
_SOURCES: dict[str, CalibrationSource] = {}


def calibration_source(key: str) -> CalibrationSource | None:
    """Where the timings of ``key`` came from the last time this process asked
    :func:`pair_timings` for them; None when it has not."""
    return _SOURCES.get(key)


def pair_timings(
    key: str,
    target: Evaluator,
    draft: Evaluator | None,
    sample_ids: Sequence[int],
    *,
    recalibrate: bool = False,
) -> Timings:
    """The timings of ``key``: from the cache when it measured the largest batch the
    target's outputs allow now (a context set up for longer drafts measures again), it has
    no :func:`busy_sizes`, and one fresh decode step is not more than twice as fast as the
    cached one (both: it was measured while the machine was busy), else (or with
    ``recalibrate``) measured now and cached, unless a batch size stayed slower than a
    larger one and measured differently each time (:func:`calibrate`). A
    fresh step slower than the cached one keeps the cache: the machine is busy now, and
    what it measured now would mislead every run after it (other work only ever adds time;
    the runs' own steps correct the costs, :class:`Timings`). Both KV caches end empty.
    Where the timings came from: :func:`calibration_source`.

    Raises:
        BackendError: an evaluation failed.
    """
    t0 = time.perf_counter()
    entry = None if recalibrate else _load_entry(key)
    why = "recalibration asked for" if recalibrate else "none cached for this pair"
    if entry is not None:
        cached, measured_at, slower_kept = entry
        need = max(calibration_sizes(target, draft))
        slow = busy_sizes(cached.verify, slower_kept)
        if max(cached.verify) < need:
            why = (f"the cached one measured batches of up to {max(cached.verify)} rows, "
                   f"this context verifies {need}")  # fmt: skip
        elif slow:
            n = slow[0]
            m = min((m for m in cached.verify if m > n), key=cached.verify.__getitem__)
            why = (f"in the cached one a batch of {n} row(s) took "
                   f"{cached.verify[n] / cached.verify[m]:.2f}x as long as one of {m}: it was "
                   "measured while the machine was busy")  # fmt: skip
        else:
            now = calibrate(target, None, sample_ids, sizes=(1,), repeats=3)
            ratio = now.verify[1] / cached.verify[1]
            if ratio >= FRESH_STEP_MIN:
                _SOURCES[key] = CalibrationSource(
                    key, _cache_file(), True, measured_at, time.perf_counter() - t0, True,
                    fresh_step_ratio=ratio,
                )  # fmt: skip
                return cached
            why = (f"a fresh decode step was {1 / ratio:.3g}x as fast as the cached one: that "
                   "one was measured while the machine was busy")  # fmt: skip
    timings, left, kept = _calibrate(target, draft, sample_ids, sizes=CALIBRATION_SIZES,
                                     repeats=3, deep=DEPTH_PROBE)  # fmt: skip
    measured_at = time.time()
    unsaved = ""
    if left:
        unsaved = (f"batches of {', '.join(map(str, left))} row(s) stayed slower than larger "
                   f"ones, differently each of {HICCUP_TRIES + 1} times (a busy machine): "
                   "interpolated for this run")  # fmt: skip
        log.warning("calibration not cached: %s", unsaved)
    elif not save_calibration(key, timings, measured_at, kept):
        unsaved = f"cannot write {_cache_file()}"
    _SOURCES[key] = CalibrationSource(
        key, _cache_file(), False, measured_at, time.perf_counter() - t0, not unsaved, why,
        unsaved=unsaved,
    )  # fmt: skip
    return timings
