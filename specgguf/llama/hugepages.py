"""Transparent huge pages for the weights llama.cpp holds in the process's own memory.

When the CPU's weights are repacked (or read rather than mapped), llama.cpp keeps them in
anonymous memory from ``posix_memalign`` (ggml/src/ggml.c, ``ggml_aligned_malloc``). Linux
backs that memory with 4 KiB pages unless the process asks for transparent huge pages
(2 MiB) with ``madvise(MADV_HUGEPAGE)``: the kernel's THP mode ``madvise`` (this
project's test machines run it) grants them only where asked, ``always`` everywhere,
``never`` nowhere (Documentation/admin-guide/mm/transhuge.rst). Every generated
token reads every weight once; with 4 KiB pages a 1 GB model is 260,000 page-table entries
per token, with 2 MiB pages 500. ``scripts/bench-hugepages`` measures the step time of the
same model loaded both ways in one process: 3-4% less with huge pages for Qwen2.5-Coder
1.5B Q4_K_M on a 2-core EPYC.

The price is at load, on some machines: on this project's test VMs loading the same model
took 4.3-4.9 s instead of 1.6-2.5 s, with no compaction stall counted (``/proc/vmstat``);
writing 1 GiB of fresh huge pages took 3.3 s the first time and 0.18 s the second (4 KiB
pages: 0.67 s both times), as when the host backs guest memory only on first touch and
takes freed memory back. A server loads once and gains
on every token, so ``specgguf serve`` advises by default; ``run`` and the benchmarks,
which load for one generation, do not. ``SPECGGUF_HUGEPAGES=1`` or ``0`` decides for every
command.

llama.cpp has no call that returns its weight buffers' addresses, so :class:`LoadAdvice`
compares the process's anonymous mappings (``/proc/self/maps``) before the load with those
at the load's first progress callback: llama.cpp calls it once the buffers are allocated
and before the first tensor is read (src/llama-model-loader.cpp ``load_all_data``), so the
pages are first touched, and backed, after the advice. Of the mappings that appeared in
that window only the 2 MiB pages not yet touched are advised (``mincore``): a malloc arena
another thread grew meanwhile, already in use, is left as it is. Off Linux, and where THP
is ``never``, nothing is advised.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import sys
from pathlib import Path

import numpy as np

log = logging.getLogger("specgguf")

MADV_HUGEPAGE = 14
#: The size of a transparent huge page on x86-64 and arm64 with 4 KiB base pages.
HUGE_PAGE = 2 << 20
#: Mappings smaller than this are left alone: llama.cpp's weight buffers are hundreds of MB
#: and a huge page needs an aligned 2 MiB inside the range.
MIN_RANGE = 8 << 20

Range = tuple[int, int]


def thp_mode(path: str = "/sys/kernel/mm/transparent_hugepage/enabled") -> str | None:
    """The kernel's THP mode (``always``, ``madvise`` or ``never``: the bracketed word of
    ``path``), or None where the file is missing (not Linux, no THP)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


_YES = ("1", "true", "yes", "on")
_NO = ("0", "false", "no", "off")


def enabled(default: bool) -> bool:
    """Whether a load is advised: ``SPECGGUF_HUGEPAGES`` if it says (1, true, yes, on or
    0, false, no, off), else ``default``; and only on Linux where the THP mode is not
    ``never``."""
    env = os.environ.get("SPECGGUF_HUGEPAGES", "").strip().lower()
    wanted = True if env in _YES else False if env in _NO else default
    return wanted and sys.platform.startswith("linux") and thp_mode() in ("madvise", "always")


def anonymous_ranges(maps: str) -> list[Range]:
    """The writable anonymous mappings of a ``/proc/PID/maps`` text: (start, end) byte
    addresses, end exclusive. Named mappings (files, ``[heap]``, ``[stack]``) are left out."""
    out = []
    for line in maps.splitlines():
        parts = line.split()
        if len(parts) == 5 and parts[1].startswith("rw") and parts[4] == "0":
            lo, hi = parts[0].split("-")
            out.append((int(lo, 16), int(hi, 16)))
    return out


def new_ranges(before: list[Range], after: list[Range]) -> list[Range]:
    """The parts of ``after``'s ranges that no range of ``before`` covers (a mapping that
    grew is new where it grew), in ``after``'s order."""
    out: list[Range] = []
    for start, end in after:
        pieces = [(start, end)]
        for b0, b1 in before:
            if b1 <= start or b0 >= end:
                continue
            rest = []
            for s, e in pieces:
                if b1 <= s or b0 >= e:
                    rest.append((s, e))
                    continue
                if s < b0:
                    rest.append((s, b0))
                if b1 < e:
                    rest.append((b1, e))
            pieces = rest
        out.extend(pieces)
    return out


def huge_aligned(ranges: list[Range], min_size: int = MIN_RANGE) -> list[Range]:
    """Each range of at least ``min_size`` bytes shrunk to whole 2 MiB pages (madvise
    wants a page-aligned start; only whole huge pages can be backed by one)."""
    out = []
    for start, end in ranges:
        if end - start < min_size:
            continue
        lo = -(-start // HUGE_PAGE) * HUGE_PAGE
        hi = end // HUGE_PAGE * HUGE_PAGE
        if hi > lo:
            out.append((lo, hi))
    return out


def _read_maps() -> str:
    return Path("/proc/self/maps").read_text()


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library with ``madvise`` and ``mincore`` typed."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    libc.mincore.restype = ctypes.c_int
    return libc


def anon_huge_bytes(pid: int | str = "self") -> int:
    """A process's anonymous memory backed by transparent huge pages, bytes
    (``AnonHugePages`` of ``/proc/PID/smaps_rollup``; 0 where it is not given).

    Raises:
        OSError: the file cannot be read (not Linux, no such process).
    """
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def untouched(ranges: list[Range]) -> list[Range]:
    """The parts of ``ranges`` (2 MiB-aligned) whose 2 MiB pages have no page resident
    yet (``mincore``): memory allocated and not yet written, as a load's weight buffers
    are at its first progress callback, unlike a malloc arena that grew meanwhile."""
    fn = _libc().mincore
    per_huge = HUGE_PAGE // mmap.PAGESIZE
    out: list[Range] = []
    for start, end in ranges:
        n = (end - start) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * n)()
        if fn(start, end - start, vec) != 0:
            continue
        pages = np.ctypeslib.as_array(vec).reshape(-1, per_huge)
        busy_at = [bool(x) for x in np.any(pages & 1, axis=1).tolist()]
        run: int | None = None  # the first free huge page of the current run
        for i, busy in enumerate([*busy_at, True]):
            if not busy and run is None:
                run = i
            elif busy and run is not None:
                out.append((start + run * HUGE_PAGE, start + i * HUGE_PAGE))
                run = None
    return out


def advise(ranges: list[Range]) -> int:
    """``madvise(MADV_HUGEPAGE)`` each range (page-aligned); returns the bytes advised.
    A range the kernel refuses is skipped (logged at debug level)."""
    fn = _libc().madvise
    done = 0
    for start, end in ranges:
        if fn(start, end - start, MADV_HUGEPAGE) == 0:
            done += end - start
        else:
            log.debug("madvise(MADV_HUGEPAGE) %#x-%#x: errno %d", start, end, ctypes.get_errno())
    return done


class LoadAdvice:
    """Advises huge pages for the buffers a model load allocates: create it just before
    the load (it reads the mappings), and call :meth:`on_progress` from the load's progress
    callback; the first call advises the mappings that appeared since. ``advised`` is the
    byte count (0 when disabled or nothing qualified)."""

    def __init__(self, default: bool = False) -> None:
        self.active = enabled(default)
        self.advised = 0
        self._before: list[Range] | None = None
        if self.active:
            try:
                self._before = anonymous_ranges(_read_maps())
            except OSError:
                self.active = False

    def on_progress(self, value: float) -> None:
        """The load's progress callback's hook: the first call advises, later ones return."""
        if not self.active or self._before is None:
            return
        before, self._before = self._before, None
        try:  # an optimisation: whatever goes wrong here must not stop the load
            new = huge_aligned(new_ranges(before, anonymous_ranges(_read_maps())))
            self.advised = advise(untouched(new))
        except Exception as e:
            log.debug("huge pages not advised: %s", e)
            return
        log.debug("huge pages advised for %.0f MB of weights", self.advised / 1e6)
