"""The GGUF reader (:mod:`specgguf.gguf.metadata`) on hand-built files: every refusal with
its full reason and byte offset, the boundaries of each count, length and limit (the last
accepted value and the first refused one), and exact values read, with gguf-py's
``GGUFWriter`` and ``GGUFReader`` as the independent oracle. Asked for by mutation testing
(scripts/mutation-test): each group kills mutants that the substring checks of
tests/test_gguf_metadata.py let through.

The files are built with ``struct.pack`` from the layout in ggml/docs/gguf.md; offsets in
the expected values are computed from the same builders (lengths of the pieces), never
from the reader under test.
"""

from __future__ import annotations

import mmap
import struct
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specgguf.errors import GGUFFormatError, ModelNotFoundError
from specgguf.gguf.metadata import ArrayRef, GGUFMetadata, TensorInfo

# -- builders: GGUF bytes by hand ---------------------------------------------------------

HEAD = 24  # magic, version, tensor count, key-value count


def header(n_tensors: int = 0, n_kv: int = 0, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def string(text: bytes | str) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: bytes | str, vtype: int, payload: bytes) -> bytes:
    return string(key) + struct.pack("<I", vtype) + payload


def u32(key: str, value: int) -> bytes:
    return kv(key, 4, struct.pack("<I", value))


def tinfo(name: bytes | str, shape: tuple[int, ...], ggml_type: int = 0, offset: int = 0) -> bytes:
    return (
        string(name)
        + struct.pack("<I", len(shape))
        + struct.pack(f"<{len(shape)}q", *shape)
        + struct.pack("<iQ", ggml_type, offset)
    )


def write(tmp_path: Path, data: bytes, name: str = "x.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def refusal(path: Path) -> tuple[str, int | None]:
    with pytest.raises(GGUFFormatError) as ei:
        GGUFMetadata.open(path)
    err = ei.value
    where = f" (at byte {err.offset})" if err.offset is not None else ""
    assert str(err) == f"{path}: {err.reason}{where}"
    return err.reason, err.offset


def refused(tmp_path: Path, data: bytes) -> tuple[str, int | None]:
    return refusal(write(tmp_path, data))


# -- header ---------------------------------------------------------------------------------


def test_the_smallest_gguf_file_is_24_bytes_and_one_less_is_refused(tmp_path: Path) -> None:
    with GGUFMetadata.open(write(tmp_path, header())) as m:
        assert (m.version, m.n_tensors, m.n_kv, m.kv_end) == (3, 0, 0, HEAD)
        assert (m.file_size, m.data_offset, m.alignment) == (24, 0, 32)
        assert m.kv == {} and m.tensors() == [] and m.non_utf8_keys == []
        assert list(m.items()) == [] and m.architecture is None
    assert refused(tmp_path, header()[:23]) == (
        "the file is only 23 bytes: too short for a GGUF header",
        None,
    )
    assert refused(tmp_path, b"GGUF") == (
        "the file is only 4 bytes: too short for a GGUF header",
        None,
    )


def test_a_file_that_is_not_gguf_is_refused_without_an_offset(tmp_path: Path) -> None:
    assert refused(tmp_path, b"GGUG" + bytes(40)) == (
        "not a GGUF file (the first bytes are b'GGUG', expected b'GGUF')",
        None,
    )
    # Only the first 64 bytes are looked at: JSON after 64 bytes of blanks is not named.
    assert refused(tmp_path, b" " * 64 + b"{}")[0].startswith("not a GGUF file")
    assert refused(tmp_path, b" " * 63 + b"{}")[0].startswith("a JSON document")


@pytest.mark.parametrize(
    ("version", "reason"),
    [
        (1, "GGUF version 1 is not supported (llama.cpp reads versions 2 and 3); convert the "
         "model again with a current llama.cpp"),
        (0, "unknown GGUF version 0 (this reader knows 2 and 3)"),
        (4, "unknown GGUF version 4 (this reader knows 2 and 3)"),
        (2 << 24, f"a big-endian GGUF file (version 2); llama.cpp on this {sys.byteorder}-endian "
         "machine cannot load it"),
        (3 << 24, f"a big-endian GGUF file (version 3); llama.cpp on this {sys.byteorder}-endian "
         "machine cannot load it"),
        (1 << 24, "unknown GGUF version 16777216 (this reader knows 2 and 3)"),
        # unsigned: the high bit set is a large version, not a negative one
        (2**32 - 1, "unknown GGUF version 4294967295 (this reader knows 2 and 3)"),
        (2**31 + 3, "unknown GGUF version 2147483651 (this reader knows 2 and 3)"),
    ],
)  # fmt: skip
def test_versions_refused(tmp_path: Path, version: int, reason: str) -> None:
    assert refused(tmp_path, header(version=version) + bytes(40)) == (reason, None)


def test_version_2_is_read(tmp_path: Path) -> None:
    with GGUFMetadata.open(write(tmp_path, header(n_kv=1, version=2) + u32("a", 7))) as m:
        assert (m.version, m.get("a")) == (2, 7)


def test_key_value_count_against_the_file_size(tmp_path: Path) -> None:
    # One key "k" with a uint8 value is 14 bytes, the smallest a pair can be: a count of 1
    # in 38 bytes is read, in 37 it is refused before reading any pair.
    data = header(n_kv=1) + kv("k", 0, b"\x07")
    assert len(data) == HEAD + 14
    with GGUFMetadata.open(write(tmp_path, data)) as m:
        assert (m.kv, m.kv_types, m.kv_end) == ({"k": 7}, {"k": "uint8"}, 38)
    assert refused(tmp_path, data[:-1]) == (
        "the header claims 1 key-value pairs, more than a file of 37 bytes can hold",
        16,
    )
    assert refused(tmp_path, header(n_kv=3000) + bytes(41_976)) == (
        "the header claims 3,000 key-value pairs, more than a file of 42,000 bytes can hold",
        16,
    )


def test_tensor_count_against_the_file_size(tmp_path: Path) -> None:
    # The smallest tensor info (empty name, no dimension) is 24 bytes: a count of 1 in
    # 48 bytes passes the count check and is refused for its data, past the end.
    data = header(n_tensors=1) + tinfo("", ())
    assert len(data) == 48
    assert refused(tmp_path, data) == (
        "the tensor data would start at byte 64, past the end of the file (48 bytes; truncated?)",
        48,
    )
    assert refused(tmp_path, data[:-1]) == (
        "the header claims 1 tensors, more than a file of 47 bytes can hold",
        8,
    )
    assert refused(tmp_path, header(n_tensors=5000) + bytes(119_976)) == (
        "the header claims 5,000 tensors, more than a file of 120,000 bytes can hold",
        8,
    )
    # Unsigned counts: the high bit set is a huge count, not a negative one.
    assert refused(tmp_path, header(n_kv=2**64 - 1) + bytes(40)) == (
        "the header claims 18,446,744,073,709,551,615 key-value pairs, more than a file of "
        "64 bytes can hold",
        16,
    )
    assert refused(tmp_path, header(n_tensors=2**63) + bytes(40)) == (
        "the header claims 9,223,372,036,854,775,808 tensors, more than a file of 64 bytes "
        "can hold",
        8,
    )
    # Both counts too large: the key-value count is named first.
    assert refused(tmp_path, header(n_tensors=10, n_kv=10) + bytes(10))[1] == 16


def test_a_tensor_of_no_dimension_ending_at_its_data(tmp_path: Path) -> None:
    data = header(n_tensors=1) + tinfo("", ())
    with GGUFMetadata.open(write(tmp_path, data + bytes(16))) as m:
        assert m.tensors() == [TensorInfo("", (), 0, 0)]
        assert (m.data_offset, m.kv_end) == (64, 24)
        t = m.tensors()[0]
        assert (t.n_elements, t.n_bytes) == (1, 4)


# -- keys and values ----------------------------------------------------------------------


def test_empty_and_duplicate_keys_are_refused_where_the_key_starts(tmp_path: Path) -> None:
    first = u32("a", 1)
    assert refused(tmp_path, header(n_kv=2) + first + u32("", 2)) == (
        "an empty metadata key",
        HEAD + len(first),
    )
    assert refused(tmp_path, header(n_kv=2) + first + u32("a", 2)) == (
        "duplicate metadata key 'a'",
        HEAD + len(first),
    )
    assert refused(tmp_path, header(n_kv=1) + u32("", 2)) == ("an empty metadata key", HEAD)


def test_a_truncated_pair_is_refused_where_the_missing_item_starts(tmp_path: Path) -> None:
    first = u32("a", 1)
    key = string("bb")
    full = header(n_kv=2) + first + key + struct.pack("<I", 4) + struct.pack("<I", 9)
    # the type of the second value missing: at its start; its value missing: at the value
    at_type = HEAD + len(first) + len(key)
    assert refused(tmp_path, full[: at_type + 2]) == (
        "the file ends inside the metadata (truncated?)",
        at_type,
    )
    assert refused(tmp_path, full[: at_type + 4 + 3]) == (
        "the file ends inside the metadata (truncated?)",
        at_type + 4,
    )


def test_a_string_value_past_the_end(tmp_path: Path) -> None:
    base = header(n_kv=1) + string("s") + struct.pack("<I", 8)
    at = len(base)
    with GGUFMetadata.open(write(tmp_path, base + string("hello"))) as m:
        assert (m.get("s"), m.kv_types["s"], m.kv_end) == ("hello", "string", at + 13)
    # the last byte missing: the string's length is past the end by one
    assert refused(tmp_path, base + string("hello")[:-1]) == (
        "a string claims 5 bytes, past the end of the file (truncated?)",
        at,
    )
    assert refused(tmp_path, base + struct.pack("<Q", 2**64 - 1)) == (
        "a string claims 18,446,744,073,709,551,615 bytes, past the end of the file (truncated?)",
        at,
    )


def test_a_key_past_the_end(tmp_path: Path) -> None:
    data = header(n_kv=1) + struct.pack("<Q", 20) + b"k" * 6
    assert refused(tmp_path, data) == (
        "a string claims 20 bytes, past the end of the file (truncated?)",
        HEAD,
    )


def test_unknown_value_type_is_refused_at_the_type(tmp_path: Path) -> None:
    first = u32("a", 1)
    data = header(n_kv=2) + first + kv("bad", 13, bytes(16))
    assert refused(tmp_path, data) == (
        "bad: unknown value type 13",
        HEAD + len(first) + len(string("bad")),
    )
    assert refused(tmp_path, header(n_kv=1) + kv("b", 2**32 - 1, bytes(16))) == (
        "b: unknown value type 4294967295",
        HEAD + 9,
    )


@pytest.mark.parametrize(("etype", "name"), [(9, "9"), (13, "13"), (2**32 - 1, "4294967295")])
def test_unsupported_array_element_types_are_refused_at_the_array(
    tmp_path: Path, etype: int, name: str
) -> None:
    first = u32("a", 1)
    data = header(n_kv=2) + first + kv("arr", 9, struct.pack("<IQ", etype, 1) + bytes(16))
    at = HEAD + len(first) + len(string("arr")) + 4
    assert refused(tmp_path, data) == (f"arr: unsupported array element type {name}", at)


@pytest.mark.parametrize(
    ("etype", "width"),
    [(0, 1), (1, 1), (2, 2), (3, 2), (4, 4), (5, 4), (6, 4), (7, 1), (8, 8), (10, 8),
     (11, 8), (12, 8)],
)  # fmt: skip
def test_array_count_against_the_bytes_left(tmp_path: Path, etype: int, width: int) -> None:
    # Three elements of the smallest size fit exactly (then the file ends); one byte less
    # is refused, naming the bytes left.
    base = header(n_kv=1) + kv("arr", 9, struct.pack("<IQ", etype, 3))
    at = len(base) - 12
    body = string("") * 3 if etype == 8 else bytes(3 * width)
    with GGUFMetadata.open(write(tmp_path, base + body)) as m:
        ref = m.get("arr")
        assert ref == ArrayRef(etype, 3, len(base), len(base) + 3 * width, ref.offsets)
        assert m.kv_end == len(base) + 3 * width
    assert refused(tmp_path, base + body[:-1]) == (
        f"arr: an array claims 3 elements, more than the {3 * width - 1} bytes left in the "
        "file can hold (truncated?)",
        at,
    )


def test_an_array_with_no_byte_left(tmp_path: Path) -> None:
    base = header(n_kv=1) + kv("arr", 9, struct.pack("<IQ", 0, 1))
    assert refused(tmp_path, base) == (
        "arr: an array claims 1 elements, more than the 0 bytes left in the file can hold "
        "(truncated?)",
        len(base) - 12,
    )
    with GGUFMetadata.open(
        write(tmp_path, header(n_kv=1) + kv("e", 9, struct.pack("<IQ", 8, 0)))
    ) as m:
        ref = m.get("e")
        assert (ref.count, m.strings(ref), m.span(ref), m.kv_types["e"]) == (
            0,
            [],
            b"",
            "array[string]",
        )


def _sparse(tmp_path: Path, head: bytes, size: int) -> Path:
    """``head``, then zeros up to ``size`` bytes, written as a sparse file (no disk used)."""
    path = tmp_path / "big.gguf"
    with path.open("wb") as f:
        f.write(head)
        f.truncate(size)
    return path


LIMIT = 1 << 30  # llama.cpp's GGUF_MAX_ARRAY_ELEMENTS and GGUF_MAX_STRING_LENGTH


def test_array_count_at_and_past_llama_cpps_limit(tmp_path: Path) -> None:
    base = header(n_kv=1) + kv("arr", 9, struct.pack("<IQ", 0, LIMIT))
    with GGUFMetadata.open(_sparse(tmp_path, base, len(base) + LIMIT)) as m:
        ref = m.get("arr")
        assert (ref.count, ref.end - ref.start, m.number_at(ref, LIMIT - 1)) == (LIMIT, LIMIT, 0)
    base = header(n_kv=1) + kv("arr", 9, struct.pack("<IQ", 0, LIMIT + 1))
    path = _sparse(tmp_path, base, len(base) + LIMIT + 1)
    assert refusal(path) == (
        "arr: an array claims 1,073,741,825 elements, more than llama.cpp's limit of 1,073,741,824",
        len(base) - 12,
    )


def test_string_past_llama_cpps_limit(tmp_path: Path) -> None:
    base = header(n_kv=1) + string("s") + struct.pack("<I", 8)
    path = _sparse(tmp_path, base + struct.pack("<Q", LIMIT + 1), len(base) + 8 + LIMIT + 1)
    assert refusal(path) == (
        "a string claims 1,073,741,825 bytes, more than llama.cpp's limit of 1,073,741,824",
        len(base),
    )


def test_a_string_of_the_limit_in_an_array_is_not_the_bad_one(tmp_path: Path) -> None:
    # Element 0 is 2**30 bytes (allowed), element 1 runs past the end: element 1 is named.
    base = header(n_kv=1) + kv("k", 9, struct.pack("<IQ", 8, 2))
    first = struct.pack("<Q", LIMIT)
    size = len(base) + 8 + LIMIT + 8 + 4
    path = tmp_path / "big.gguf"
    with path.open("wb") as f:
        f.write(base + first)
        f.seek(len(base) + 8 + LIMIT)
        f.write(struct.pack("<Q", 5) + b"abcd")
    assert path.stat().st_size == size
    assert refusal(path) == (
        "k: element 1 of 2 claims 5 bytes, past the end of the file (truncated?)",
        len(base) + 8 + LIMIT,
    )


# -- general.alignment ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pair", "reason"),
    [
        (u32("general.alignment", 0), "general.alignment 0 is not a power of 2"),
        (u32("general.alignment", 48), "general.alignment 48 is not a power of 2"),
        (u32("general.alignment", 3), "general.alignment 3 is not a power of 2"),
        (kv("general.alignment", 10, struct.pack("<Q", 64)),
         "general.alignment must be a uint32, not uint64"),
        (kv("general.alignment", 5, struct.pack("<i", 64)),
         "general.alignment must be a uint32, not int32"),
    ],
)  # fmt: skip
def test_bad_alignment_refused_exactly(tmp_path: Path, pair: bytes, reason: str) -> None:
    assert refused(tmp_path, header(n_kv=1) + pair) == (reason, None)


@pytest.mark.parametrize("align", [1, 2, 8, 64, 1 << 31])
def test_alignment_sets_where_the_data_starts(tmp_path: Path, align: int) -> None:
    pair = u32("general.alignment", align)
    infos = tinfo("a", (3,), 0, 0) + tinfo("b", (5,), 0, -(-12 // align) * align)
    end = HEAD + len(pair) + len(infos)
    data_at = -(-end // align) * align
    data = header(n_tensors=2, n_kv=1) + pair + infos
    if data_at > 1 << 20:
        assert refused(tmp_path, data) == (
            f"the tensor data would start at byte {data_at:,}, past the end of the file "
            f"({end:,} bytes; truncated?)",
            end,
        )
        return
    with GGUFMetadata.open(write(tmp_path, data + bytes(data_at - end))) as m:
        assert (m.alignment, m.data_offset) == (align, data_at)
        assert [t.offset for t in m.tensors()] == [0, -(-12 // align) * align]


# -- tensor infos -----------------------------------------------------------------------------


def _tensors(tmp_path: Path, *infos: bytes, extra: int = 64) -> tuple[Path, list[int]]:
    """A file with these tensor infos (no keys) and ``extra`` bytes after; returns the
    offset of each info."""
    at, pos = [], HEAD
    for i in infos:
        at.append(pos)
        pos += len(i)
    return write(tmp_path, header(n_tensors=len(infos)) + b"".join(infos) + bytes(extra)), at


def test_tensor_names_up_to_63_bytes(tmp_path: Path) -> None:
    ok, at = _tensors(tmp_path, tinfo("n" * 63, (4,)))
    with GGUFMetadata.open(ok) as m:
        assert [t.name for t in m.tensors()] == ["n" * 63]
    path, at = _tensors(tmp_path, tinfo("a", (8,)), tinfo("é" * 32, (4,), 0, 32))
    assert refusal(path) == (
        f"tensor name {'é' * 32!r}... is 64 bytes long; llama.cpp allows at most 63",
        at[1],
    )
    path, at = _tensors(tmp_path, tinfo("x" * 100, (4,)))
    assert refusal(path) == (
        f"tensor name {'x' * 40!r}... is 100 bytes long; llama.cpp allows at most 63",
        HEAD,
    )


def test_duplicate_tensor_name(tmp_path: Path) -> None:
    path, at = _tensors(tmp_path, tinfo("a", (8,)), tinfo("b", (8,), 0, 32), tinfo("a", (8,)))
    assert refusal(path) == ("duplicate tensor name 'a'", at[2])


def test_dimension_count(tmp_path: Path) -> None:
    path, _ = _tensors(tmp_path, tinfo("t", (1, 2, 3, 4)), extra=96)
    with GGUFMetadata.open(path) as m:
        assert m.tensors()[0].shape == (1, 2, 3, 4)
    path, at = _tensors(tmp_path, tinfo("a", (8,)), tinfo("t", (1, 1, 1, 1, 1), 0, 32))
    assert refusal(path) == (
        "tensor 't' claims 5 dimensions; llama.cpp allows at most 4",
        at[1] + len(string("t")),
    )


def test_dimension_count_is_unsigned(tmp_path: Path) -> None:
    info = string("t") + struct.pack("<I", 2**32 - 1) + bytes(60)
    path, _ = _tensors(tmp_path, info)
    assert refusal(path) == (
        "tensor 't' claims 4294967295 dimensions; llama.cpp allows at most 4",
        HEAD + 9,
    )


def test_data_offset_is_unsigned(tmp_path: Path) -> None:
    path, at = _tensors(tmp_path, tinfo("a", (8,)), tinfo("b", (8,), 0, 2**64 - 1))
    assert refusal(path) == (
        "tensor 'b' has data offset 18,446,744,073,709,551,615, expected 32 (llama.cpp needs "
        "the tensors stored in order, each padded to 32 bytes)",
        at[1],
    )


def test_negative_dimension(tmp_path: Path) -> None:
    path, at = _tensors(tmp_path, tinfo("a", (8,)), tinfo("t", (4, 5, -3), 0, 32))
    assert refusal(path) == (
        "tensor 't': dimension 2 is negative (-3)",
        at[1] + len(string("t")),
    )
    path, at = _tensors(tmp_path, tinfo("t", (-1,)))
    assert refusal(path) == ("tensor 't': dimension 0 is negative (-1)", HEAD + 9)


def test_element_count_at_and_past_int64(tmp_path: Path) -> None:
    # (2**62 - 1) * 2 = 2**63 - 2 elements of one byte (I8, type 24) fit; 2**62 * 2 do not.
    path, _ = _tensors(tmp_path, tinfo("t", (2**62 - 1, 2), 24))
    with GGUFMetadata.open(path) as m:
        assert m.tensors()[0].n_bytes == 2**63 - 2
    path, _ = _tensors(tmp_path, tinfo("t", (2**62, 1, 2), 24))
    assert refusal(path) == (
        f"tensor 't': shape {(2**62, 1, 2)} has more elements than int64 holds",
        HEAD + 9,
    )
    path, _ = _tensors(tmp_path, tinfo("t", (2**31, 2**31, 2, 1), 24))
    assert refusal(path)[0].endswith("has more elements than int64 holds")
    # A zero dimension makes any other size fit.
    path, _ = _tensors(tmp_path, tinfo("t", (0, 2**62, 2**62), 24))
    with GGUFMetadata.open(path) as m:
        assert (m.tensors()[0].n_elements, m.tensors()[0].n_bytes) == (0, 0)


@pytest.mark.parametrize(
    ("ggml_type", "why"),
    [(4, "removed from ggml"), (5, "removed from ggml"), (31, "removed from ggml"),
     (38, "removed from ggml"), (43, "llama.cpp knows 0..42"), (-1, "llama.cpp knows 0..42"),
     (2**31 - 1, "llama.cpp knows 0..42")],
)  # fmt: skip
def test_unknown_ggml_types(tmp_path: Path, ggml_type: int, why: str) -> None:
    path, at = _tensors(tmp_path, tinfo("a", (8,)), tinfo("t", (256,), ggml_type, 32))
    assert refusal(path) == (
        f"tensor 't' has unknown ggml type {ggml_type} ({why})",
        at[1] + len(string("t")) + 4 + 8,
    )


def test_the_last_ggml_type_is_known(tmp_path: Path) -> None:
    path, _ = _tensors(tmp_path, tinfo("t", (64,), 42))  # Q2_0: 64 elements in 18 bytes
    with GGUFMetadata.open(path) as m:
        assert m.tensors()[0].n_bytes == 18


@pytest.mark.parametrize(
    ("shape", "ggml_type", "reason"),
    [
        ((48, 2), 2, "tensor 't' of type Q4_0 has rows of 48 elements, not a multiple of its "
         "block size 32"),
        ((), 12, "tensor 't' of type Q4_K has rows of 1 elements, not a multiple of its block "
         "size 256"),
        ((257,), 12, "tensor 't' of type Q4_K has rows of 257 elements, not a multiple of its "
         "block size 256"),
    ],
)  # fmt: skip
def test_rows_not_a_multiple_of_the_block(
    tmp_path: Path, shape: tuple[int, ...], ggml_type: int, reason: str
) -> None:
    path, _ = _tensors(tmp_path, tinfo("t", shape, ggml_type))
    assert refusal(path) == (reason, HEAD + 9 + 4 + 8 * len(shape))


def test_size_in_bytes_at_and_past_64_bits(tmp_path: Path) -> None:
    # F32: 4 bytes an element; 2**62 - 1 elements fit in 64 bits, 2**62 do not.
    path, _ = _tensors(tmp_path, tinfo("t", (2**62 - 1,), 0))
    with GGUFMetadata.open(path) as m:
        assert m.tensors()[0].n_bytes == (2**62 - 1) * 4
    path, _ = _tensors(tmp_path, tinfo("t", (2**61, 2), 0))
    assert refusal(path) == ("tensor 't': its size in bytes does not fit 64 bits", HEAD + 9 + 20)
    # F64: 8 bytes an element; 2**61 - 1 elements fit, 2**61 do not. (No type of blocks
    # larger than 1 element reaches the limit within int64 elements.)
    path, _ = _tensors(tmp_path, tinfo("t", (2**61 - 1,), 28))
    with GGUFMetadata.open(path) as m:
        assert m.tensors()[0].n_bytes == (2**61 - 1) * 8
    path, _ = _tensors(tmp_path, tinfo("t", (2, 2**60), 28))
    assert refusal(path)[0] == "tensor 't': its size in bytes does not fit 64 bits"


def test_truncated_tensor_infos_at_each_field(tmp_path: Path) -> None:
    # A key with a long value first, so that the counts pass and the file ends at the cut.
    pair = kv("pad", 8, string("x" * 40))
    info = tinfo("abc", (32, 2), 0, 0)
    at = HEAD + len(pair)
    name_end = at + 11
    ends = "the file ends inside the tensor infos (truncated?)"
    # cut inside: the name length, the name, n_dims, the shape, the type, the data offset
    for cut, expected in [
        (4, (ends, at)),
        (9, ("a string claims 3 bytes, past the end of the file (truncated?)", at)),
        (13, (ends, name_end)),
        (20, (ends, name_end)),
        (33, (ends, name_end + 20)),
        (40, (ends, name_end + 20)),
    ]:
        assert refused(tmp_path, header(n_tensors=1, n_kv=1) + pair + info[:cut]) == expected, cut


def test_tensor_data_start_boundary(tmp_path: Path) -> None:
    info = tinfo("t", (8,))  # 33 bytes: infos end at 57, data starts at 64
    data = header(n_tensors=1) + info
    assert len(data) == 57
    with GGUFMetadata.open(write(tmp_path, data + bytes(7))) as m:
        assert m.data_offset == 64 == m.file_size
    assert refused(tmp_path, data + bytes(6)) == (
        "the tensor data would start at byte 64, past the end of the file (63 bytes; truncated?)",
        57,
    )


def test_tensor_data_offsets_in_order_padded_to_the_alignment(tmp_path: Path) -> None:
    # a: 3 floats (12 bytes, padded to 32); b: 40 floats (160 bytes); c after b at 192.
    good = (tinfo("a", (3,), 0, 0), tinfo("b", (40,), 0, 32), tinfo("c", (1,), 0, 192))
    path, _ = _tensors(tmp_path, *good)
    with GGUFMetadata.open(path) as m:
        assert [(t.name, t.offset, t.n_bytes) for t in m.tensors()] == [
            ("a", 0, 12), ("b", 32, 160), ("c", 192, 4)
        ]  # fmt: skip
    for i, wrong, expected in [(0, 32, 0), (1, 12, 32), (1, 64, 32), (2, 160, 192), (2, 224, 192)]:
        infos = list(good)
        name, shape = "abc"[i], [(3,), (40,), (1,)][i]
        infos[i] = tinfo(name, shape, 0, wrong)
        path, at = _tensors(tmp_path, *infos)
        assert refusal(path) == (
            f"tensor '{name}' has data offset {wrong:,}, expected {expected:,} (llama.cpp "
            "needs the tensors stored in order, each padded to 32 bytes)",
            at[i],
        ), (i, wrong)


def test_data_offset_message_names_the_alignment(tmp_path: Path) -> None:
    pair = u32("general.alignment", 64)
    infos = tinfo("a", (3,), 0, 0) + tinfo("b", (1,), 0, 32)
    data = header(n_tensors=2, n_kv=1) + pair + infos + bytes(64)
    at_b = HEAD + len(pair) + len(tinfo("a", (3,)))
    assert refused(tmp_path, data) == (
        "tensor 'b' has data offset 32, expected 64 (llama.cpp needs the tensors stored in "
        "order, each padded to 64 bytes)",
        at_b,
    )


# -- UTF-8 ------------------------------------------------------------------------------------


def test_names_and_values_that_are_not_utf8_are_listed(tmp_path: Path) -> None:
    pairs = u32("ok", 1) + kv(b"k\xff", 4, struct.pack("<I", 2)) + kv("v", 8, string(b"a\xfeb"))
    infos = tinfo(b"t\xfd", (8,))
    data = header(n_tensors=1, n_kv=3) + pairs + infos
    with GGUFMetadata.open(write(tmp_path, data + bytes(64))) as m:
        assert m.non_utf8_keys == ["key 'k\\udcff'", "v", "tensor name 't\\udcfd'"]
        assert m.get("v") == "a\ufffdb"
        assert m.get("k\udcff") == 2
        assert m.tensors()[0].name == "t\udcfd"


# -- values against gguf-py -------------------------------------------------------------------

SCALARS: dict[GGUFValueType, st.SearchStrategy[Any]] = {
    GGUFValueType.UINT8: st.integers(0, 2**8 - 1),
    GGUFValueType.INT8: st.integers(-(2**7), 2**7 - 1),
    GGUFValueType.UINT16: st.integers(0, 2**16 - 1),
    GGUFValueType.INT16: st.integers(-(2**15), 2**15 - 1),
    GGUFValueType.UINT32: st.integers(0, 2**32 - 1),
    GGUFValueType.INT32: st.integers(-(2**31), 2**31 - 1),
    GGUFValueType.UINT64: st.integers(0, 2**64 - 1),
    GGUFValueType.INT64: st.integers(-(2**63), 2**63 - 1),
    GGUFValueType.FLOAT32: st.floats(width=32, allow_nan=False),
    GGUFValueType.FLOAT64: st.floats(allow_nan=False),
    GGUFValueType.BOOL: st.booleans(),
    GGUFValueType.STRING: st.text(max_size=6),
}
_NP = {
    GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8, GGUFValueType.UINT16: np.uint16,
    GGUFValueType.INT16: np.int16, GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
    GGUFValueType.UINT64: np.uint64, GGUFValueType.INT64: np.int64,
    GGUFValueType.FLOAT32: np.float32, GGUFValueType.FLOAT64: np.float64,
    GGUFValueType.BOOL: np.bool_,
}  # fmt: skip


@st.composite
def typed_values(draw: st.DrawFn) -> list[tuple[GGUFValueType, bool, Any]]:
    """(type, is an array, value) for each key: a scalar or a short array of each type."""
    out = []
    for t in draw(st.lists(st.sampled_from(sorted(SCALARS)), min_size=1, max_size=14)):
        if draw(st.booleans()):
            out.append((t, True, draw(st.lists(SCALARS[t], min_size=1, max_size=5))))
        else:
            out.append((t, False, draw(SCALARS[t])))
    return out


def _write_with_gguf_py(path: Path, items: list[tuple[GGUFValueType, bool, Any]]) -> None:
    w = GGUFWriter(path, arch="llama")
    for i, (t, is_array, value) in enumerate(items):
        if is_array:
            w.add_key_value(f"k{i}", value, GGUFValueType.ARRAY, sub_type=t)
        else:
            w.add_key_value(f"k{i}", value, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(items=typed_values())
def test_values_written_by_gguf_py_are_read_back(
    tmp_path_factory: pytest.TempPathFactory, items: list[tuple[GGUFValueType, bool, Any]]
) -> None:
    path = tmp_path_factory.mktemp("values") / "v.gguf"
    _write_with_gguf_py(path, items)
    theirs = GGUFReader(path)
    with GGUFMetadata.open(path) as m:
        assert m.get("general.architecture") == "llama" == m.architecture
        assert m.kv_end == int(theirs.fields[f"k{len(items) - 1}"].offset) + sum(
            int(p.nbytes) for p in theirs.fields[f"k{len(items) - 1}"].parts
        )
        for i, (t, is_array, value) in enumerate(items):
            key = f"k{i}"
            got = m.get(key)
            name = t.name.lower()
            if not is_array:
                assert m.kv_types[key] == name
                assert got == value and type(got) is type(value), key
                continue
            assert m.kv_types[key] == f"array[{name}]" == got.type_name
            assert got.count == len(value)
            field = theirs.fields[key]
            assert got.start == int(field.offset) + sum(int(p.nbytes) for p in field.parts[:5])
            if t == GGUFValueType.STRING:
                raw = [v.encode() for v in value]
                assert m.strings(got) == raw
                assert [m.string_at(got, j) for j in range(len(value))] == raw
                assert m.strings(got, 1, 99) == raw[1:]
                assert m.span(got, 1) == b"".join(string(r) for r in raw[1:])
                assert m.span(got, 0, 1) == b"".join(string(r) for r in raw[:1])
                continue
            expected = [int(v) if t == GGUFValueType.BOOL else v for v in value]
            assert list(m.numbers(got)) == expected
            assert [m.number_at(got, j) for j in range(len(value))] == [
                bool(v) if t == GGUFValueType.BOOL else v for v in value
            ]
            width = np.dtype(_NP[t]).itemsize
            packed = np.array(value, dtype=_NP[t]).astype(f"<{np.dtype(_NP[t]).str[1:]}").tobytes()
            assert m.span(got) == packed
            assert m.span(got, 1, 3) == packed[width : 3 * width]
            assert m.span(got, 2) == packed[2 * width :]


def test_array_access_out_of_range(tmp_path: Path) -> None:
    data = (
        header(n_kv=2)
        + kv("n", 9, struct.pack("<IQ", 4, 3) + struct.pack("<3I", 10, 20, 30))
        + kv("s", 9, struct.pack("<IQ", 8, 2) + string("ab") + string("cde"))
    )
    with GGUFMetadata.open(write(tmp_path, data)) as m:
        n, s = m.get("n"), m.get("s")
        assert s.offsets is None  # only the token list keeps its offsets
        assert (m.number_at(n, 0), m.number_at(n, 2)) == (10, 30)
        assert (m.string_at(s, 0), m.string_at(s, 1)) == (b"ab", b"cde")
        for bad in (-1, 3):
            with pytest.raises(IndexError) as ei:
                m.number_at(n, bad)
            assert ei.value.args == (bad,)  # the index asked for, not another error's
        for bad in (-1, 2):
            with pytest.raises(IndexError) as ei:
                m.string_at(s, bad)
            assert ei.value.args == (bad,)
        assert m.strings(s, 1) == [b"cde"] and m.strings(s, 0, 1) == [b"ab"]
        assert m.span(s, 1, 2) == string("cde") and m.span(n, 1, 2) == struct.pack("<I", 20)
        assert m.get("missing") is None and m.get("missing", 5) == 5
        assert list(m.items()) == [("n", n), ("s", s)]


def test_the_token_list_keeps_its_offsets(tmp_path: Path) -> None:
    toks = [b"a", b"bc", b"", b"def"]
    body = b"".join(string(t) for t in toks)
    base = header(n_kv=1) + kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 4))
    with GGUFMetadata.open(write(tmp_path, base + body)) as m:
        ref = m.get("tokenizer.ggml.tokens")
        starts = [len(base)]
        for t in toks:
            starts.append(starts[-1] + 8 + len(t))
        assert list(ref.offsets) == starts
        assert [m.string_at(ref, i) for i in range(4)] == toks


# -- split models, open and close --------------------------------------------------------------


@pytest.mark.parametrize(
    ("count", "no", "count_type", "shards"),
    [
        (3, 1, 2, ["m-00001-of-00003.gguf", "m-00002-of-00003.gguf", "m-00003-of-00003.gguf"]),
        (3, 1, 4, ["m-00002-of-00003.gguf"]),  # uint32: not read as a split
        (0, 0, 2, ["m-00001-of-00000.gguf"]),  # count 0: one file
        (1, 0, 2, ["m-00001-of-00001.gguf"]),
        (2, 1, 2, ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"]),
    ],
)
def test_split_keys(
    tmp_path: Path, count: int, no: int, count_type: int, shards: list[str]
) -> None:
    fmt = "<H" if count_type == 2 else "<I"
    pairs = kv("split.count", count_type, struct.pack(fmt, count))
    pairs += kv("split.no", count_type, struct.pack(fmt, no))
    name = f"m-{no + 1:05d}-of-{count:05d}.gguf"
    path = write(tmp_path, header(n_kv=2) + pairs, name)
    with GGUFMetadata.open(path) as m:
        expected_count = count if count_type == 2 and count > 0 else 1
        assert m.split_count == expected_count
        assert m.split_no == (no if count_type == 2 else 0)
        assert [p.name for p in m.shard_paths()] == shards
        assert all(p.parent == tmp_path for p in m.shard_paths())


def test_a_split_file_whose_name_does_not_fit_is_only_itself(tmp_path: Path) -> None:
    pairs = kv("split.count", 2, struct.pack("<H", 3)) + kv("split.no", 2, struct.pack("<H", 0))
    for name in ("m-00002-of-00003.gguf", "m.gguf", "m-00001-of-00004.gguf"):
        path = write(tmp_path, header(n_kv=2) + pairs, name)
        with GGUFMetadata.open(path) as m:
            assert list(m.shard_paths()) == [path]


def test_missing_directory_empty_and_unreadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ModelNotFoundError) as e1:
        GGUFMetadata.open(str(tmp_path / "nope.gguf"))
    assert str(e1.value) == f"model file not found: {tmp_path / 'nope.gguf'}"
    assert e1.value.path == tmp_path / "nope.gguf"
    assert refusal(tmp_path) == ("is a directory, not a GGUF file", None)
    assert refusal(write(tmp_path, b"")) == ("the file is empty (0 bytes), not a GGUF file", None)

    path = write(tmp_path, header())

    def denied(*a: object, **k: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(mmap, "mmap", denied)
    assert refusal(path) == ("cannot be read: Permission denied", None)

    def failing(*a: object, **k: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(mmap, "mmap", failing)
    assert refusal(path) == ("cannot be read: Input/output error", None)

    def bare(*a: object, **k: object) -> None:
        raise OSError("no strerror")

    monkeypatch.setattr(mmap, "mmap", bare)
    assert refusal(path) == ("cannot be read: no strerror", None)


def test_a_refused_file_is_closed_and_a_read_one_closes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed: list[bool] = []
    real_close = GGUFMetadata.close

    def spy(self: GGUFMetadata) -> None:
        real_close(self)
        closed.append(isinstance(self._buf, mmap.mmap) and self._buf.closed)

    monkeypatch.setattr(GGUFMetadata, "close", spy)
    refused(tmp_path, header(n_kv=1) + u32("", 1))
    assert closed == [True]
    m = GGUFMetadata.open(write(tmp_path, header()))
    assert isinstance(m._buf, mmap.mmap) and not m._buf.closed
    with m:
        pass
    assert m._buf.closed and closed == [True, True]
    m.close()  # twice is fine
    GGUFMetadata(tmp_path, b"GGUF", 4).close()  # bytes: nothing to close
