"""Saved prompts kept for later requests: in host memory (llama-server's ``--cache-ram``),
on disk beyond it (``--cache-dir``, surviving a restart), and as one file (``run
--prompt-cache``, llama.cpp's flag).

A slot about to be given a prompt that shares little with what it holds is saved first
(:class:`~specgguf.engine.slots.SavedPrompt`); a later prompt that shares more with a saved
one than with its slot gets it back instead of reading it again. Entries go least recently
used first, as llama-server's ``server_prompt_cache`` (tools/server/server-task.cpp): an
entry whose tokens another holds whole is dropped, and one held whole by another is not
kept.

A file holds one saved prompt behind a header that names what it belongs to
(:func:`identity`: the models' files, the llama.cpp build, the context's size, cache type
and sequences) and a checksum of the rest; one that does not match, is cut short or is
not ours is refused with the reason (:class:`PromptCacheFileError`), never restored into
a context it does not belong to. Files are written whole or not at all (a temporary file
renamed over the old one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from specgguf.engine.slots import HeadState, SavedPrompt, common_prefix
from specgguf.errors import SpecggufError, UsageError
from specgguf.llama.backend import Checkpoint, MediaSpan, SequenceState, media_prefix

log = logging.getLogger("specgguf")

MAGIC = b"specgguf-prompt\x00"
VERSION = 1
#: A saved prompt is found for a prompt only when they share at least this share of the
#: saved one's tokens (llama-server's "don't trash large prompts", f_keep 0.25).
KEEP_MIN = 0.25
#: The suffix of prompt-cache files in a ``--cache-dir``.
SUFFIX = ".sgpc"
#: A temporary file of the folder this old (seconds) was left by a process that stopped
#: while writing it: it goes when the folder is indexed.
STALE_TMP = 3600


class PromptCacheFileError(SpecggufError):
    """A prompt-cache file that cannot be used here: ``reason`` says why (another model,
    build or context; truncated; not a prompt-cache file)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def file_fingerprint(path: Path) -> dict[str, Any]:
    """A model file's identity: its name, size and a hash of its first, middle and last
    MiB (the metadata, and weights from two places: cheap, and a re-download of the same
    file matches where a modification time would not). Of a split model, its first
    shard's."""
    size = path.stat().st_size
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for at in sorted({0, max(0, size // 2 - (1 << 19)), max(0, size - (1 << 20))}):
            f.seek(at)
            h.update(f.read(1 << 20))
    return {"name": path.name, "size": size, "hash": h.hexdigest()}


def identity(**parts: Any) -> dict[str, Any]:
    """What a saved prompt belongs to, JSON-able: the format's version and ``parts`` (the
    engine gives its models' fingerprints, the build and each context's settings)."""
    return {"format": VERSION, **parts}


# -- one saved prompt as bytes ----------------------------------------------------------


def _state_parts(state: SequenceState | None) -> tuple[dict[str, Any] | None, list[bytes]]:
    if state is None:
        return None, []
    meta = {"n": len(state.tokens), "exact": state.exact,
            "checkpoints": [c.n for c in state.checkpoints]}  # fmt: skip
    blobs = [state.tokens.astype("<i4").tobytes(), state.data,
             *(c.data for c in state.checkpoints)]  # fmt: skip
    return meta, blobs


def write_file(path: Path, saved: SavedPrompt, ident: Mapping[str, Any]) -> int:
    """Write ``saved`` to ``path`` with the header ``ident`` (:func:`identity`), whole or
    not at all; returns the bytes written.

    Raises:
        OSError: the file could not be written (nothing is left behind).
        UsageError: the prompt holds images (their rows are kept in memory only).
    """
    if saved.target.media:
        raise UsageError("a prompt with images cannot be saved to a file yet")
    target, t_blobs = _state_parts(saved.target)
    draft, d_blobs = _state_parts(saved.draft)
    head_meta: dict[str, Any] | None = None
    h_blobs: list[bytes] = []
    if saved.head is not None:
        h = saved.head
        row = h.row.astype("<f4").tobytes() if h.row is not None else b""
        head_meta = {"n": len(h.tokens), "row_at": h.row_at, "row": len(row) // 4}
        h_blobs = [h.tokens.astype("<i4").tobytes(), h.data, row]
    blobs = [*t_blobs, *d_blobs, *h_blobs]
    fields = {"identity": dict(ident), "target": target, "draft": draft,
              "draft_offset": saved.draft_offset, "head": head_meta,
              "sizes": [len(b) for b in blobs], "created": time.time()}  # fmt: skip
    header = json.dumps({**fields, "checksum": _checksum(fields, blobs)}).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<II", VERSION, len(header)) + header)
            for b in blobs:
                f.write(b)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return len(MAGIC) + 8 + len(header) + sum(len(b) for b in blobs)


def _checksum(fields: Mapping[str, Any], blobs: Sequence[bytes]) -> str:
    """The checksum of a file: of its header's fields (but the checksum) and its data."""
    digest = hashlib.blake2b(json.dumps(fields, sort_keys=True).encode(), digest_size=16)
    for b in blobs:
        digest.update(b)
    return digest.hexdigest()


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The header of a prompt-cache file and where its data starts.

    Raises:
        PromptCacheFileError: not a prompt-cache file, another version, a bad header.
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        head = f.read(len(MAGIC) + 8)
        if len(head) < len(MAGIC) + 8 or head[: len(MAGIC)] != MAGIC:
            raise PromptCacheFileError(path, "not a specgguf prompt-cache file")
        version, n = struct.unpack("<II", head[len(MAGIC) :])
        if version != VERSION:
            raise PromptCacheFileError(path, f"format version {version}, not {VERSION}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict) or len(raw) != n:
            raise ValueError
    except ValueError:
        raise PromptCacheFileError(path, "its header is damaged or cut short") from None
    return header, len(MAGIC) + 8 + n


def read_file(path: Path, ident: Mapping[str, Any]) -> SavedPrompt:
    """The saved prompt in ``path``, if it belongs to ``ident``.

    Raises:
        PromptCacheFileError: another model, build or context (which, named), cut short,
            damaged, or not a prompt-cache file.
        OSError: the file cannot be read.
    """
    header, start = read_header(path)
    theirs = header.get("identity")
    if theirs != dict(ident):
        raise PromptCacheFileError(path, "made for " + _difference(theirs, ident))
    sizes = header.get("sizes")
    try:
        if not isinstance(sizes, list) or not all(isinstance(n, int) and n >= 0 for n in sizes):
            raise ValueError
        with open(path, "rb") as f:
            f.seek(start)
            blobs = [f.read(n) for n in sizes]
            extra = f.read(1)
        if any(len(b) != n for b, n in zip(blobs, sizes, strict=True)):
            raise PromptCacheFileError(path, "cut short")
        if extra:
            raise PromptCacheFileError(path, "longer than its header says")
        fields = {k: v for k, v in header.items() if k != "checksum"}
        if _checksum(fields, blobs) != header.get("checksum"):
            raise PromptCacheFileError(path, "its data does not match its checksum")
        parts = iter(blobs)
        target = _state(header["target"], parts)
        if target is None:
            raise ValueError
        draft = _state(header.get("draft"), parts)
        head = None
        if (m := header.get("head")) is not None:
            tokens = np.frombuffer(next(parts), "<i4").astype(np.int32)
            data = next(parts)
            row_bytes = next(parts)
            row = np.frombuffer(row_bytes, "<f4").astype(np.float32) if row_bytes else None
            row_at = int(m["row_at"])
            if row is not None and row_at != len(tokens) - 1:
                raise ValueError
            head = HeadState(data, tokens, row_at, row)
        offset = int(header.get("draft_offset", 0))
        if offset < 0 or offset > len(target.tokens):
            raise ValueError
        return SavedPrompt(target, draft, offset, head)
    except (KeyError, TypeError, ValueError, StopIteration):
        raise PromptCacheFileError(path, "its header does not describe its data") from None


def _state(meta: Any, parts: Iterator[bytes]) -> SequenceState | None:
    """A sequence's state from its header entry and its parts; ValueError for positions
    that cannot be (a checkpoint past the tokens, out of order)."""
    if meta is None:
        return None
    tokens = np.frombuffer(next(parts), "<i4").astype(np.int32)
    n = len(tokens)
    at = [int(c) for c in meta["checkpoints"]]
    exact = int(meta["exact"])
    if n != int(meta["n"]) or at != sorted(set(at)) or any(not 0 < c <= n for c in at):
        raise ValueError
    if not 0 <= exact <= n:
        raise ValueError
    data = next(parts)
    return SequenceState(tokens, data, tuple(Checkpoint(c, next(parts)) for c in at), exact)


def _difference(theirs: Any, ours: Mapping[str, Any]) -> str:
    """What differs between two identities, in words: ``another target model (a.gguf)``."""
    if not isinstance(theirs, dict):
        return "something else"
    names = {"target": "target model", "draft": "draft model", "build": "llama.cpp build",
             "format": "format"}  # fmt: skip
    for key, value in ours.items():
        if theirs.get(key) != value:
            other = theirs.get(key)
            what = names.get(key, key.replace("_", " "))
            if isinstance(other, dict) and "name" in other:
                return f"another {what} (the file's: {other['name']})"
            if isinstance(other, dict) and isinstance(value, dict):
                differ = ", ".join(f"{k} {other.get(k)!r}, here {value.get(k)!r}"
                                   for k in sorted(value.keys() | other.keys())
                                   if other.get(k) != value.get(k))  # fmt: skip
                return f"another {what} ({differ})"
            return f"another {what} ({other!r}, here {value!r})"
    return "another setup"


# -- many saved prompts -----------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _OnDisk:
    path: Path
    tokens: npt.NDArray[np.int32]
    nbytes: int


def _shared(
    entry: SavedPrompt | _OnDisk,
    tokens: Sequence[int] | npt.NDArray[np.int32],
    media: Sequence[MediaSpan],
) -> int:
    """How many leading rows ``entry`` shares with a prompt of ``tokens`` holding
    ``media``: its tokens', up to the first medium they do not share (a file holds none)."""
    n = common_prefix(entry.tokens, tokens)
    held = entry.target.media if isinstance(entry, SavedPrompt) else ()
    return media_prefix(n, held, media) if held or media else n


class PromptCache:
    """Saved prompts by least recent use, within ``limit`` bytes of host memory; with a
    ``disk`` folder and ``disk_limit`` bytes there, those evicted from memory go to files
    (found again after a restart: the folder's files that belong to ``ident`` are indexed
    at start, others left alone).

    Changed from the engine's thread only; its sizes and counters may be read from any
    (a scrape of ``/metrics`` may see them a step old).
    """

    def __init__(
        self,
        limit: int,
        *,
        ident: Mapping[str, Any] | None = None,
        disk: Path | None = None,
        disk_limit: int = 0,
    ) -> None:
        self.limit = max(0, limit)
        self.ident = dict(ident or {})
        self.disk = disk if disk is not None and disk_limit > 0 else None
        self.disk_limit = disk_limit if self.disk is not None else 0
        self._memory: list[SavedPrompt] = []  # least recently used first
        self._files: list[_OnDisk] = []  # least recently used first
        #: saves into the cache, restores out of it, files written (totals)
        self.saves = self.restores = self.files_written = 0
        if self.disk is not None:
            self._index_disk()

    @property
    def nbytes(self) -> int:
        """Bytes held in memory."""
        return sum(e.nbytes for e in self._memory)

    @property
    def disk_bytes(self) -> int:
        """Bytes held in files."""
        return sum(f.nbytes for f in self._files)

    def __len__(self) -> int:
        return len(self._memory) + len(self._files)

    def best(
        self, tokens: Sequence[int], media: Sequence[MediaSpan] = ()
    ) -> tuple[SavedPrompt | _OnDisk | None, int]:
        """The entry sharing the longest prefix with ``tokens`` and their ``media`` (at
        least :data:`KEEP_MIN` of its own), and that prefix's length; (None, 0): none."""
        best: SavedPrompt | _OnDisk | None = None
        shared = 0
        entries: list[SavedPrompt | _OnDisk] = [*self._memory, *self._files]
        for entry in entries:
            n = _shared(entry, tokens, media)
            if n > shared and n >= KEEP_MIN * len(entry.tokens):
                best, shared = entry, n
        return best, shared

    def has_room(self, nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` can be kept (in memory, or on disk)."""
        return nbytes <= self.limit or (self.disk is not None and nbytes <= self.disk_limit)

    def take(self, entry: SavedPrompt | _OnDisk) -> SavedPrompt:
        """Remove ``entry`` (from :meth:`best`) from memory and return it; a file is read
        and kept (it goes when a prompt that holds it whole is saved, or by age).

        Raises:
            PromptCacheFileError, OSError: a file that can no longer be used (it is
                forgotten; one that is damaged or not ours is deleted).
        """
        if isinstance(entry, _OnDisk):
            try:
                saved = read_file(entry.path, self.ident)
            except PromptCacheFileError:
                self._drop_file(entry)
                raise
            except OSError:
                self._files.remove(entry)
                raise
            self._files.remove(entry)
            self._files.append(entry)  # used: the most recent now
            with contextlib.suppress(OSError):
                os.utime(entry.path)
        else:
            self._memory.remove(entry)
            saved = entry
        self.restores += 1
        return saved

    def put(self, saved: SavedPrompt) -> bool:
        """Keep ``saved``, unless an entry holds its tokens whole already; entries whose
        tokens it holds whole go; the least recently used go to disk (or away) until it
        fits. Returns whether it was kept (one larger than the whole cache is not)."""
        tokens, media = saved.tokens, saved.target.media
        if not len(tokens):
            return False
        entries: list[SavedPrompt | _OnDisk] = [*self._memory, *self._files]
        for entry in entries:
            if _shared(entry, tokens, media) == len(tokens):
                return False
        self._memory = [e for e in self._memory
                        if _shared(e, tokens, media) < len(e.tokens)]  # fmt: skip
        for f in [f for f in self._files if _shared(f, tokens, media) == len(f.tokens)]:
            self._drop_file(f)
        if saved.nbytes > self.limit:
            kept = self._to_disk(saved)
        else:
            while self._memory and self.nbytes + saved.nbytes > self.limit:
                self._to_disk(self._memory.pop(0))
            self._memory.append(saved)
            kept = True
        self.saves += kept
        return kept

    def flush(self) -> int:
        """Every entry held in memory into the folder's files, least recently used first
        (the oldest go first where the folder is full); returns the files written. Without
        a folder, nothing.

        Raises:
            Nothing: a file that cannot be written is said in the log and skipped.
        """
        written = self.files_written
        if self.disk is not None:
            while self._memory:
                self._to_disk(self._memory.pop(0))
        return self.files_written - written

    # -- the disk ---------------------------------------------------------------------

    def _to_disk(self, saved: SavedPrompt) -> bool:
        """``saved`` into a file of the folder, the oldest going beyond its size; whether
        it is there (no folder, a failed write or a file larger than the folder: not)."""
        if self.disk is None or saved.nbytes > self.disk_limit or saved.target.media:
            return False  # (media are kept in memory only)
        name = hashlib.blake2b(json.dumps(self.ident, sort_keys=True).encode()
                               + saved.tokens.tobytes(), digest_size=16).hexdigest()  # fmt: skip
        path = self.disk / f"{name}{SUFFIX}"
        try:
            size = write_file(path, saved, self.ident)
        except OSError as e:
            log.warning("prompt cache: could not write %s: %s", path, e)
            return False
        self.files_written += 1
        mine = _OnDisk(path, saved.tokens.copy(), size)
        self._files = [*(f for f in self._files if f.path != path), mine]
        while self.disk_bytes > self.disk_limit:
            self._drop_file(self._files[0])
        return mine in self._files

    def _drop_file(self, f: _OnDisk) -> None:
        self._files.remove(f)
        with contextlib.suppress(OSError):
            f.path.unlink()

    def _index_disk(self) -> None:
        """The folder's files of this identity, least recently used first (by their
        modification time); others are left alone, unreadable ones skipped."""
        assert self.disk is not None
        found: list[tuple[float, _OnDisk]] = []
        with contextlib.suppress(OSError):
            self.disk.mkdir(parents=True, exist_ok=True)
        try:
            paths = list(self.disk.glob(f"*{SUFFIX}"))
            stale = [p for p in self.disk.glob(f".*{SUFFIX}.*.tmp")
                     if time.time() - p.stat().st_mtime > STALE_TMP]  # fmt: skip
        except OSError:
            paths, stale = [], []
        for tmp in stale:  # left by a process that stopped while writing
            with contextlib.suppress(OSError):
                tmp.unlink()
        for path in paths:
            try:
                header, start = read_header(path)
                if header.get("identity") != self.ident:
                    continue
                n = int(header["target"]["n"])
                with open(path, "rb") as f:
                    f.seek(start)
                    tokens = np.frombuffer(f.read(4 * n), "<i4").astype(np.int32)
                if len(tokens) != n:
                    continue
                st = path.stat()
                found.append((st.st_mtime, _OnDisk(path, tokens, st.st_size)))
            except (PromptCacheFileError, OSError, KeyError, TypeError, ValueError):
                continue
        self._files = [f for _, f in sorted(found, key=lambda x: x[0])]
        while self._files and self.disk_bytes > self.disk_limit:
            self._drop_file(self._files[0])
