"""Reading GGUF metadata: real values from the fixtures, and every kind of bad file refused
with a specific one-line message (library and CLI), in bounded memory."""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
from gguf import GGUFEndian, GGUFWriter

from specgguf.errors import EXIT_MODEL_FILE, GGUFFormatError, ModelNotFoundError
from specgguf.gguf.metadata import GGUFMetadata
from specgguf.gguf.tiny import gpt2_vocab

from .helpers import run_cli


def test_reads_fixture_metadata(tiny_models: dict[str, Path]) -> None:
    with GGUFMetadata.open(tiny_models["target"]) as m:
        assert m.version == 3
        assert m.architecture == "llama"
        assert m.get("general.name") == "tiny target"
        assert m.arch_key("embedding_length") == 64
        tokens = m.get("tokenizer.ggml.tokens")
        assert tokens.count == 512
        vocab = gpt2_vocab()
        assert m.string_at(tokens, 300).decode() == vocab.tokens[300]
        assert [b.decode() for b in m.strings(tokens, 0, 3)] == list(vocab.tokens[:3])
        types = m.numbers(m.get("tokenizer.ggml.token_type"))
        assert list(types[:4]) == [3, 3, 3, 1]
        names = [t.name for t in m.tensors()]
        assert names[0] == "token_embd.weight" and names[-1] == "output.weight"
        assert m.tensors()[0].shape == (64, 512)  # ggml order: ne[0] = n_embd


def test_split_fixture_names_its_shards(tiny_models: dict[str, Path]) -> None:
    with GGUFMetadata.open(tiny_models["split"]) as m:
        assert m.split_count == 3
        assert [p.name for p in m.shard_paths()] == [
            f"tiny-split-0000{i}-of-00003.gguf" for i in (1, 2, 3)
        ]


def _header(version: int = 3, n_tensors: int = 0, n_kv: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _kv_string(key: str, value: str) -> bytes:
    k, v = key.encode(), value.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", 8) + struct.pack("<Q", len(v)) + v


def _big_endian(path: Path) -> None:
    w = GGUFWriter(path, "llama", endianess=GGUFEndian.BIG)
    w.add_name("big")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _truncated(tiny: Path, path: Path, at: int) -> None:
    path.write_bytes(tiny.read_bytes()[:at])  # inside the token list


BAD_FILES: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "empty": (lambda p, t: p.write_bytes(b""), "the file is empty (0 bytes)"),
    "3-bytes": (lambda p, t: p.write_bytes(b"GGU"), "the file is only 3 bytes"),
    "100-bytes": (
        lambda p, t: p.write_bytes(bytes(range(100))),
        "not a GGUF file (the first bytes are",
    ),
    "html": (
        lambda p, t: p.write_bytes(b"<!DOCTYPE html><html><body>502 Bad Gateway</body></html>"),
        "an HTML page, not a GGUF file",
    ),
    "lfs-pointer": (
        lambda p, t: p.write_bytes(
            b"version https://git-lfs.github.com/spec/v1\noid sha256:"
            + b"ab" * 32
            + b"\nsize 1117320768\n"
        ),
        "a Git LFS pointer file, not the model itself",
    ),
    "version-1": (lambda p, t: p.write_bytes(_header(1) + bytes(64)), "GGUF version 1"),
    "version-99": (lambda p, t: p.write_bytes(_header(99) + bytes(64)), "unknown GGUF version 99"),
    "big-endian": (lambda p, t: _big_endian(p), "a big-endian GGUF file (version 3)"),
    "truncated-early": (
        lambda p, t: _truncated(t, p, 3000),
        "tokenizer.ggml.tokens: an array claims 512 elements, more than the",
    ),
    "truncated-late": (
        lambda p, t: _truncated(t, p, 5000),
        "tokenizer.ggml.tokens: the file ends inside a string array, at element 403 of 512",
    ),
    "huge-kv-count": (
        lambda p, t: p.write_bytes(_header(3, 0, 2**60) + bytes(100)),
        "claims 1,152,921,504,606,846,976 key-value pairs",
    ),
    "huge-tensor-count": (
        lambda p, t: p.write_bytes(_header(3, 2**40, 0) + bytes(100)),
        "tensors, more than a file of",
    ),
    "huge-array": (
        lambda p, t: p.write_bytes(
            _header(3, 0, 1)
            + struct.pack("<Q", 3)
            + b"key"
            + struct.pack("<IIQ", 9, 8, 2**50)
            + bytes(64)
        ),
        "key: an array claims 1,125,899,906,842,624 elements",
    ),
    "huge-string": (
        lambda p, t: p.write_bytes(
            _header(3, 0, 1) + struct.pack("<Q", 3) + b"key" + struct.pack("<IQ", 8, 2**40)
        ),
        "a string claims 1,099,511,627,776 bytes, past the end of the file",
    ),
    "truncated-value": (
        lambda p, t: p.write_bytes(_header(3, 0, 2) + _kv_string("general.name", "x")[:-3]),
        "truncated",
    ),
    "json": (
        lambda p, t: p.write_bytes(b'{"error": "Repository not found"}\n'),
        "a JSON document, not a GGUF file",
    ),
    "zip": (lambda p, t: _zip(p), "a zip archive, not a GGUF file"),
    **{
        f"legacy-{magic}": (
            lambda p, t, magic=magic: p.write_bytes(magic.encode()[::-1] + bytes(60)),
            "a legacy GGML file (before GGUF)",
        )
        for magic in ("ggml", "ggmf", "ggjt")
    },
    "unknown-value-type": (
        lambda p, t: p.write_bytes(_header(3, 0, 1) + _kv("k", 13) + bytes(16)),
        "k: unknown value type 13",
    ),
    "unknown-array-type": (
        lambda p, t: p.write_bytes(
            _header(3, 0, 1) + _kv("k", 9) + struct.pack("<IQ", 13, 1) + bytes(16)
        ),
        "k: unsupported array element type 13",
    ),
    "array-of-arrays": (
        lambda p, t: p.write_bytes(
            _header(3, 0, 1) + _kv("k", 9) + struct.pack("<IQ", 9, 1) + bytes(16)
        ),
        "k: unsupported array element type 9",
    ),
    "key-with-a-newline": (
        lambda p, t: p.write_bytes(_header(3, 0, 1) + _kv("a\nb", 13) + bytes(16)),
        "'a\\nb': unknown value type 13",
    ),
    "truncated-tensor-infos": (
        lambda p, t: p.write_bytes(t.read_bytes()[: _in_tensor_infos(t)]),
        "the file ends inside the tensor infos (truncated?)",
    ),
}


def _kv(key: str, vtype: int) -> bytes:
    """A key and its value type (the value left to the caller)."""
    return struct.pack("<Q", len(key.encode())) + key.encode() + struct.pack("<I", vtype)


def _zip(path: Path) -> None:
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr("model.gguf", b"GGUF")


def _in_tensor_infos(path: Path) -> int:
    """A byte inside the 5th tensor info's shape, located by gguf-py's reader."""
    from gguf import GGUFReader

    t = GGUFReader(path).tensors[4]
    return int(t.field.offset) + 8 + len(t.name.encode()) + 4 + 3


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_bad_file_is_refused_with_a_specific_message(
    kind: str, tmp_path: Path, tiny_models: dict[str, Path]
) -> None:
    make, expected = BAD_FILES[kind]
    path = tmp_path / f"{kind}.gguf"
    make(path, tiny_models["target"])
    tracemalloc.start()
    with pytest.raises(GGUFFormatError) as ei:
        GGUFMetadata.open(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert expected in str(ei.value)
    assert str(path) in str(ei.value)
    assert peak < 4 << 20, f"{peak:,} bytes allocated for a bad header"


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_bad_file_cli_exit_code_and_one_line(
    kind: str, tmp_path: Path, tiny_models: dict[str, Path]
) -> None:
    make, expected = BAD_FILES[kind]
    path = tmp_path / f"{kind}.gguf"
    make(path, tiny_models["target"])
    for args in (["info", str(path)], ["check", str(tiny_models["target"]), str(path)]):
        res = run_cli(*args)
        err = res.stderr.decode()
        assert res.returncode == EXIT_MODEL_FILE, err
        assert res.stdout == b""
        lines = err.strip().splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith("specgguf: error: ") and expected in lines[0]
        assert "Traceback" not in err


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="model file not found"):
        GGUFMetadata.open(tmp_path / "nope.gguf")
    with pytest.raises(GGUFFormatError, match="is a directory"):
        GGUFMetadata.open(tmp_path)
    res = run_cli("info", str(tmp_path / "nope.gguf"))
    assert res.returncode == EXIT_MODEL_FILE
    assert (
        res.stderr.decode().strip()
        == f"specgguf: error: model file not found: {tmp_path}/nope.gguf"
    )
