"""Model references as llama.cpp writes them: ``REPO[:QUANT]`` (``-hf org/name-GGUF:Q4_K_M``).

:func:`parse_hf_ref` splits a reference into the repository and the quant tag;
:func:`match_quant` finds the model's files in a repository's file list the way llama.cpp's
``find_best_model`` and ``get_split_files`` do (``common/download.cpp`` in the llama.cpp
that llama-cpp-python 0.3.36 vendors):

- only ``.gguf`` files that are models count: not ``mmproj``, ``imatrix``, ``mtp-``,
  ``eagle3-``, ``dflash-`` or ``dspark-`` sidecars;
- the tag matches a path containing ``TAG`` followed by ``.`` or ``-``, case-insensitively
  (``q8_0`` finds ``model-Q8_0.gguf`` and ``model-Q8_0-00001-of-00003.gguf``);
- of a split model only the first shard is matched; every shard with the same prefix and
  count is returned;
- without a tag, ``Q4_K_M``, then ``Q8_0``, then the repository's only model.

Two deliberate differences: where llama.cpp takes the first of several matching models, an
ambiguous tag is an error here unless exactly one match carries the tag as its quant suffix
(``-Q4_K_M.gguf`` against ``-IQ4_K_M.gguf``), and without a tag a repository with several
models and no Q4_K_M or Q8_0 is an error rather than its first file. The tag may also be a
file's path in the repository (``REPO:sub/model-Q4_K_M.gguf``), which names it exactly.
"""

from __future__ import annotations

import dataclasses
import re

from specgguf.errors import HubError, QuantNotFoundError, UsageError

#: The quant tags tried, in order, when a reference has none (llama.cpp's default).
DEFAULT_TAGS = ("Q4_K_M", "Q8_0")

_SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})$", re.I)
_TAG = re.compile(r"[-.](?P<tag>[A-Z0-9_]+)$", re.I)
_SIDECARS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
# Hugging Face repository ids: two names of letters, digits, '-', '_' and '.'.
_REF = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_])(?::(?P<tag>[^:]+))?$")


@dataclasses.dataclass(frozen=True)
class HfRef:
    """A model on the hub named as llama.cpp does: ``repo`` (``org/name``) and an optional
    ``tag`` (a quant such as ``Q4_K_M``, matched case-insensitively, or a file's path)."""

    repo: str
    tag: str | None = None

    def __str__(self) -> str:
        return f"{self.repo}:{self.tag}" if self.tag else self.repo


def looks_like_hf_ref(name: str) -> bool:
    """Whether ``name`` has the form ``org/name[:TAG]`` (a repository id, not a path such as
    ``./x``, ``dir/file.gguf`` or ``/abs/path``). Whether it is also an existing file is
    for the caller to check first."""
    m = _REF.match(name)
    return m is not None and (m["tag"] is not None or not name.lower().endswith(".gguf"))


def parse_hf_ref(ref: str, *, quant: str | None = None) -> HfRef:
    """``REPO[:QUANT]`` as an :class:`HfRef`; ``quant`` is the tag when the reference has
    none.

    Raises:
        UsageError: not of the form ``org/name[:QUANT]``, or a tag given twice that differs.
    """
    m = _REF.match(ref.strip())
    if m is None or ".." in m["repo"] or "--" in m["repo"]:
        raise UsageError(f"{ref!r} is not a hub model reference of the form org/name[:QUANT]")
    tag = m["tag"]
    if tag and quant and tag.upper() != quant.upper():
        raise UsageError(f"{ref!r} names quant {tag} and another quant, {quant}, was given too")
    return HfRef(m["repo"], tag or quant or None)


@dataclasses.dataclass(frozen=True)
class SplitInfo:
    """What a GGUF file name says (llama.cpp's ``get_gguf_split_info``): the path without
    ``.gguf`` and the split suffix, the quant tag after the last ``-`` or ``.`` (upper case,
    "" when none), the shard number and the shard count (1 and 1 when not split)."""

    prefix: str
    tag: str
    index: int
    count: int


def split_info(path: str) -> SplitInfo | None:
    """The :class:`SplitInfo` of ``path``; None for a name that does not end in ``.gguf``."""
    if not path.endswith(".gguf"):  # as llama.cpp: case-sensitive
        return None
    prefix, index, count = path[: -len(".gguf")], 1, 1
    if m := _SPLIT.match(prefix):
        prefix, index, count = m["prefix"], int(m["no"]), int(m["count"])
    t = _TAG.search(prefix)
    return SplitInfo(prefix, t["tag"].upper() if t else "", index, count)


def is_model_file(path: str) -> bool:
    """A ``.gguf`` file that is a model, not a sidecar (projector, imatrix, MTP heads...)."""
    base = path.rsplit("/", 1)[-1]
    return base.endswith(".gguf") and not any(s in base for s in _SIDECARS)


def quants_of(files: list[str]) -> list[str]:
    """The quant tags of the models in ``files`` (sorted, each once)."""
    tags = set()
    for f in files:
        info = split_info(f)
        if info is not None and is_model_file(f) and info.index == 1:
            tags.add(info.tag or f)
    return sorted(tags)


def shards_of(first: str, files: list[str]) -> list[str]:
    """Every shard of the model whose first shard is ``first`` (just ``[first]`` when it is
    not split), in order.

    Raises:
        HubError: ``files`` lacks some of the shards.
    """
    info = split_info(first)
    if info is None or info.count == 1:
        return [first]
    found = {}
    for f in files:
        i = split_info(f)
        if i is not None and i.count == info.count and i.prefix == info.prefix:
            found[i.index] = f
    missing = [n for n in range(1, info.count + 1) if n not in found]
    if missing:
        raise HubError(
            f"{first} is split in {info.count} shards, but shard(s) "
            f"{', '.join(str(n) for n in missing)} are missing from the file list"
        )
    return [found[n] for n in range(1, info.count + 1)]


def match_quant(files: list[str], tag: str | None, *, repo: str, cached: bool = False) -> list[str]:
    """The files (all shards, in order) of the model that ``tag`` names among ``files``,
    a repository's file list, as llama.cpp picks it (see the module docstring).

    Args:
        files: paths in the repository, as ``HfApi.list_repo_files`` returns them.
        tag: a quant (case-insensitive), a file's path, or None for the default.
        repo: the repository, for messages.
        cached: ``files`` lists the local cache's snapshot, not the hub's repository.

    Raises:
        QuantNotFoundError: no model matches (the message lists the quants there are).
        HubError: several models match, or a split model lacks shards.
    """
    where = f"{repo} (in the local cache)" if cached else repo
    firsts = [f for f in files if is_model_file(f) and (i := split_info(f)) and i.index == 1]
    if tag is not None and tag.lower().endswith(".gguf"):
        exact = [f for f in firsts if f == tag] or [f for f in firsts if f.lower() == tag.lower()]
        if len(exact) == 1:
            return shards_of(exact[0], files)
        raise _not_found(f"{where} has no GGUF model file {tag}", repo, tag, firsts)
    for t in [tag] if tag is not None else list(DEFAULT_TAGS):
        pattern = re.compile(re.escape(t) + "[.-]", re.I)
        hits = [f for f in firsts if pattern.search(f)]
        if len(hits) > 1:
            suffixed = [f for f in hits if (i := split_info(f)) and i.tag == t.upper()]
            hits = suffixed if len(suffixed) == 1 else hits
        if len(hits) == 1:
            return shards_of(hits[0], files)
        if hits:
            hits.sort()
            raise HubError(
                f"{where}: quant {t} matches several models: {', '.join(hits)}",
                hint=f"name one by its file, e.g. {repo}:{hits[0]}",
            )
    if tag is None and len(firsts) == 1:
        return shards_of(firsts[0], files)
    if not firsts:
        raise _not_found(f"{where} has no GGUF model file", repo, tag, firsts)
    wanted = tag if tag is not None else " or ".join(DEFAULT_TAGS)
    raise _not_found(f"{where} has no GGUF model of quant {wanted}", repo, tag, firsts)


def _not_found(msg: str, repo: str, tag: str | None, firsts: list[str]) -> QuantNotFoundError:
    quants = quants_of(firsts)
    if quants:
        msg += f"; available: {', '.join(quants)}"
    return QuantNotFoundError(msg, repo=repo, tag=tag, available=quants)


def _quant_bits(path: str) -> int:
    """The first number of a file's quant tag (4 for ``Q4_K_M``, 16 for ``F16``; 0: none),
    as llama.cpp's ``extract_quant_bits``."""
    info = split_info(path)
    m = re.search(r"\d+", info.tag) if info is not None else None
    return int(m[0]) if m else 0


def best_sibling(files: list[str], model: str, keyword: str) -> str | None:
    """The sidecar of ``model`` (a path in a repository's file list ``files``) whose path
    holds ``keyword`` (``mmproj``), as llama.cpp's ``find_best_sibling`` picks it
    (common/download.cpp): a ``.gguf`` file in the model's folder or a folder above it,
    the deepest first, then the quant nearest the model's in bits (``mmproj-Q8_0`` beside
    a ``Q4_K_M`` model before ``mmproj-F16``), ties to the first listed. None: there is
    none."""
    model_dirs = model.split("/")[:-1]
    best: str | None = None
    best_key = (-1, 0)
    want = _quant_bits(model)
    for f in files:
        if not f.endswith(".gguf") or keyword not in f:
            continue
        dirs = f.split("/")[:-1]
        if dirs != model_dirs[: len(dirs)]:
            continue
        key = (len(dirs), -abs(_quant_bits(f) - want))
        if best is None or key > best_key:
            best, best_key = f, key
    return best
