"""specgguf's GGUF reader against an independent one, gguf-py's ``GGUFReader``: every key
(type and value) and every tensor info (name, shape, type, data offset, size) of the tiny
fixtures and of the real models; and metadata strings that are not UTF-8, which llama.cpp
loads and the reader now reads too."""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFReader, GGUFValueType

from specgguf.gguf.info import read_model_info
from specgguf.gguf.metadata import ArrayRef, GGUFMetadata
from specgguf.gguf.tiny import fixture_specs, write_tiny_model

from .helpers import llama_cpp_load


def _theirs(field: Any) -> tuple[str, Any]:
    """A gguf-py field as (type name, value); strings as raw bytes."""
    main = field.types[0]
    if main == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == GGUFValueType.STRING:
            value: Any = [field.parts[i].tobytes() for i in field.data]
        else:
            value = [v for i in field.data for v in field.parts[i].tolist()]
        return f"array[{sub.name.lower()}]", value
    if main == GGUFValueType.STRING:
        return "string", field.parts[-1].tobytes()
    return main.name.lower(), field.parts[-1].tolist()[0]


def _ours(meta: GGUFMetadata, key: str) -> tuple[str, Any]:
    value = meta.get(key)
    if isinstance(value, ArrayRef):
        if value.type_name == "array[string]":
            return value.type_name, [bytes(b) for b in meta.strings(value)]
        return value.type_name, list(meta.numbers(value))
    if isinstance(value, str):
        return meta.kv_types[key], value.encode()
    return meta.kv_types[key], value


def assert_same_as_gguf_py(path: Path) -> int:
    """Every key and tensor of ``path`` read alike by both readers; returns the key count."""
    theirs = GGUFReader(path)
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    with GGUFMetadata.open(path) as meta:
        assert list(meta.kv) == list(fields)  # same keys, same order
        for key, field in fields.items():
            assert _ours(meta, key) == _theirs(field), key
        ours_t = meta.tensors()
        assert [t.name for t in ours_t] == [t.name for t in theirs.tensors]
        for o, t in zip(ours_t, theirs.tensors, strict=True):
            assert o.shape == tuple(int(d) for d in t.shape), o.name
            assert o.ggml_type == int(t.tensor_type), o.name
            assert meta.data_offset + o.offset == int(t.data_offset), o.name
            assert o.n_bytes == int(t.n_bytes), o.name
            assert o.n_elements == int(t.n_elements), o.name
        assert meta.data_offset == theirs.data_offset or not ours_t
    return len(fields)


def test_tiny_fixtures_read_alike(tiny_models: dict[str, Path]) -> None:
    paths = list(tiny_models.values())
    paths += sorted(tiny_models["split"].parent.glob("tiny-split-0000[23]-of-00003.gguf"))
    counts = [assert_same_as_gguf_py(p) for p in paths]
    assert min(counts) >= 3 and max(counts) >= 25


@pytest.mark.real_models
@pytest.mark.parametrize("name", ["target", "draft", "foreign", "gemma"])
def test_real_models_read_alike(real_models: dict[str, Path], name: str) -> None:
    from specgguf.hub import testmodels

    file = {
        "target": testmodels.TARGET,
        "draft": testmodels.DRAFT,
        "foreign": testmodels.FOREIGN,
        "gemma": testmodels.FOREIGN_GEMMA,
    }[name]
    assert assert_same_as_gguf_py(real_models[file]) >= 20


def test_strings_that_are_not_utf8(tmp_path: Path) -> None:
    """llama.cpp does not check UTF-8: a value that is not is read with U+FFFD (info warns),
    and two keys that differ only in bad bytes stay two keys."""
    from gguf import GGUFValueType as T

    spec = dataclasses.replace(
        fixture_specs()["target"],
        set_keys=(
            ("general.name", b"caf\xe9 \xff", T.STRING, None),
            ("x.kA", 1, T.UINT32, None),
            ("x.kB", 2, T.UINT32, None),
        ),
    )
    path = write_tiny_model(tmp_path / "latin1.gguf", spec)[0]
    # gguf-py reads the value's bytes (it cannot read a key that is not UTF-8)
    assert GGUFReader(path).fields["general.name"].parts[-1].tobytes() == b"caf\xe9 \xff"
    data = path.read_bytes().replace(b"x.kA", b"x.k\xff").replace(b"x.kB", b"x.k\xfe")
    path.write_bytes(data)
    with GGUFMetadata.open(path) as meta:
        assert meta.get("general.name") == "caf\ufffd \ufffd"
        keys = [k for k in meta.kv if k.startswith("x.k")]
        assert len(keys) == 2 and [meta.get(k) for k in keys] == [1, 2]
        assert meta.non_utf8_keys[0] == "general.name"
    info = read_model_info(path)
    assert [f.code for f in info.findings] == ["utf8", "utf8", "utf8"]
    assert info.load_errors == []
    rc, log = llama_cpp_load(path)
    assert rc == 0, log[-2000:]


def test_key_bytes_past_utf8_in_check(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """A file whose only oddity is a non-UTF-8 key still checks compatible."""
    from specgguf.gguf.vocab import check_compatibility

    data = bytearray(tiny_models["target"].read_bytes())
    i = data.index(b"general.size_label")
    data[i + 8] = 0xFF  # general.\xffize_label
    path = tmp_path / "key.gguf"
    path.write_bytes(bytes(data))
    assert check_compatibility(tiny_models["target"], path).compatible
    assert struct.unpack_from("<Q", data, i - 8) == (18,)
