"""Read a GGUF file's header and metadata fast and safely, without touching tensor data.

Layout (GGUF v2/v3, ggml/docs/gguf.md): magic ``GGUF``, uint32 version, uint64 tensor count,
uint64 key-value count, then the key-value pairs, then the tensor infos (name, dims, type,
offset), then aligned tensor data, which this module never reads.

Why not gguf-py's ``GGUFReader``: it builds NumPy views for every array element, which
takes about 10 s for the 151,936-token list of Qwen2.5 (measured on the 2-core machines of
this project), and importing ``gguf`` alone costs 0.3 s. Here the file is memory-mapped;
scalars are decoded, numeric arrays are kept as (offset, count) and decoded on request,
and string arrays are walked once to find their element offsets. Every length and count is
checked against the bytes left in the file before it is used, so a corrupt header cannot
make the reader allocate more than the file holds.

:meth:`GGUFMetadata.open` refuses (``GGUFFormatError``) every file that llama.cpp's GGUF
reader refuses (``gguf_init_from_reader`` in ggml/src/gguf.cpp, llama-cpp-python 0.3.36):
bad magic or version; counts and lengths past the end of the file or past llama.cpp's limits
(strings and arrays of at most 2**30 bytes or elements); an empty or duplicate key; an
unknown value or array element type; ``general.alignment`` not a uint32 power of two; a
tensor name of 64 bytes or more, or a duplicate one; more than 4 dimensions, a negative one,
or an element count past int64; an unknown or removed ggml type; a row not a multiple of the
type's block size; a data section that starts past the end of the file; tensor data offsets
not in order (each tensor must start where the previous one ends, padded to the alignment).
What llama.cpp's model loader refuses after that is in :mod:`specgguf.gguf.loadcheck`.

Strings are not required to be UTF-8 (llama.cpp does not check): a value that is not is
read with U+FFFD in place of the bad bytes and listed in :attr:`GGUFMetadata.non_utf8_keys`.

GGUF keys are spelled as in GGUF (``tokenizer.ggml.tokens``); the names are written out
here rather than taken from gguf-py's ``Keys`` to keep that import off this fast path.
"""

from __future__ import annotations

import array
import dataclasses
import mmap
import struct
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from specgguf.errors import GGUFFormatError, ModelNotFoundError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)

# llama.cpp's limits (ggml/src/gguf.cpp, ggml/include/ggml.h).
GGUF_MAX_STRING_LENGTH = 1 << 30
GGUF_MAX_ARRAY_ELEMENTS = 1 << 30
GGUF_DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4
GGML_MAX_NAME = 64
_INT64_MAX = (1 << 63) - 1
_SIZE_MAX = (1 << 64) - 1

# GGUF value types (ggml/include/gguf.h, enum gguf_type).
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL = range(8)
T_STRING, T_ARRAY, T_UINT64, T_INT64, T_FLOAT64 = range(8, 13)

_SCALAR_FMT = {
    T_UINT8: "B", T_INT8: "b", T_UINT16: "H", T_INT16: "h", T_UINT32: "I", T_INT32: "i",
    T_FLOAT32: "f", T_BOOL: "?", T_UINT64: "Q", T_INT64: "q", T_FLOAT64: "d",
}  # fmt: skip
_ARRAY_CODE = {
    T_UINT8: "B", T_INT8: "b", T_UINT16: "H", T_INT16: "h", T_UINT32: "I", T_INT32: "i",
    T_FLOAT32: "f", T_BOOL: "b", T_UINT64: "Q", T_INT64: "q", T_FLOAT64: "d",
}  # fmt: skip
_TYPE_NAMES = {
    T_UINT8: "uint8", T_INT8: "int8", T_UINT16: "uint16", T_INT16: "int16",
    T_UINT32: "uint32", T_INT32: "int32", T_FLOAT32: "float32", T_BOOL: "bool",
    T_STRING: "string", T_ARRAY: "array", T_UINT64: "uint64", T_INT64: "int64",
    T_FLOAT64: "float64",
}  # fmt: skip

# llama.cpp's file types (include/llama.h, enum llama_ftype), named as quantizations are.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
    10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M",
    16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S",
    22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M",
    28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0",
    37: "TQ2_0", 38: "MXFP4",
}  # fmt: skip

#: ggml tensor types: id -> (name, elements per block, bytes per block), from ``type_traits``
#: in ggml/src/ggml.c. Ids 4, 5, 31-33 and 36-38 were removed from ggml (block size 0 there)
#: and, like ids from ``GGML_TYPE_COUNT`` (43) on, are refused by llama.cpp.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18), 42: ("Q2_0", 64, 18),
}  # fmt: skip
GGML_TYPE_COUNT = 43

#: String arrays whose element offsets are kept while parsing (random access by id).
_INDEXED = frozenset({"tokenizer.ggml.tokens"})

# Smallest encoding of one element, used to bound counts by the bytes left in the file.
_MIN_SIZE = {t: struct.calcsize("<" + f) for t, f in _SCALAR_FMT.items()} | {
    T_STRING: 8,
    T_ARRAY: 12,
}


@dataclasses.dataclass(frozen=True)
class ArrayRef:
    """A GGUF array kept in the file: element type, count, and where it lies (bytes).

    For the token list ``offsets`` holds the offset of each element's uint64 length
    prefix, plus one final entry at the end of the array (other string arrays are indexed
    on demand).
    """

    elem_type: int
    count: int
    start: int
    end: int
    offsets: Sequence[int] | None = None

    @property
    def type_name(self) -> str:
        return f"array[{_TYPE_NAMES.get(self.elem_type, '?')}]"


Severity = Literal["error", "warning", "info"]


@dataclasses.dataclass(frozen=True)
class Finding:
    """One result of a check: ``code`` names the rule, ``message`` says what is wrong.

    For a file's own checks, ``error`` means llama.cpp refuses (or aborts on) the file and
    ``warning`` that it loads it but warns or ignores a value.
    """

    severity: Severity
    code: str
    message: str


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor's name, shape (ggml order: ne[0] first), ggml type id, and data offset
    (bytes from the start of the data section)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def n_bytes(self) -> int:
        """Size of the data in bytes (``ggml_nbytes`` for a contiguous tensor)."""
        _, block, size = GGML_TYPES[self.ggml_type]
        if any(d <= 0 for d in self.shape):
            return 0
        return self.n_elements // block * size


class GGUFMetadata:
    """The header and key-value metadata of one GGUF file (one shard of a split model).

    Open with :meth:`open` (or as a context manager); values are read from a read-only
    memory map, so nothing but the metadata pages is ever read from disk.

    Raises (from :meth:`open`):
        ModelNotFoundError: the path does not exist.
        GGUFFormatError: the file is not a GGUF file this reader (and llama.cpp) can read,
            with the reason and the byte offset where reading failed.
    """

    def __init__(self, path: Path, buf: mmap.mmap | bytes, file_size: int) -> None:
        self.path = path
        self._buf = buf
        self.file_size = file_size
        self.version = 0
        self.n_tensors = 0
        self.n_kv = 0
        self.kv: dict[str, Any] = {}
        self.kv_types: dict[str, str] = {}
        self.kv_end = 0
        #: Byte alignment of the tensor data (``general.alignment``, default 32).
        self.alignment = GGUF_DEFAULT_ALIGNMENT
        #: Absolute file offset of the tensor data section (0 without tensors).
        self.data_offset = 0
        #: Keys whose string value (or key itself) is not valid UTF-8 (read with U+FFFD).
        self.non_utf8_keys: list[str] = []
        self._tensors: list[TensorInfo] = []

    # -- construction -------------------------------------------------------------------

    @classmethod
    def open(cls, path: Path | str) -> GGUFMetadata:
        path = Path(path)
        if not path.exists():
            raise ModelNotFoundError(f"model file not found: {path}", path=path)
        if path.is_dir():
            raise GGUFFormatError(path, "is a directory, not a GGUF file")
        try:
            with path.open("rb") as f:
                size = f.seek(0, 2)
                if size == 0:
                    raise GGUFFormatError(path, "the file is empty (0 bytes), not a GGUF file")
                buf: mmap.mmap | bytes = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except PermissionError as e:
            raise GGUFFormatError(path, f"cannot be read: {e.strerror}") from None
        except OSError as e:
            raise GGUFFormatError(path, f"cannot be read: {e.strerror or e}") from None
        meta = cls(path, buf, size)
        try:
            meta._parse_header()
            meta._parse_tensors()
        except BaseException:
            meta.close()
            raise
        return meta

    def close(self) -> None:
        if isinstance(self._buf, mmap.mmap) and not self._buf.closed:
            self._buf.close()

    def __enter__(self) -> GGUFMetadata:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- parsing ------------------------------------------------------------------------

    def _fail(self, reason: str, offset: int | None = None) -> GGUFFormatError:
        if offset is not None:  # never past the end: where the bad item starts, at most
            offset = min(offset, self.file_size)
        return GGUFFormatError(self.path, reason, offset=offset)

    def _parse_header(self) -> None:
        buf, size = self._buf, self.file_size
        head = bytes(buf[:64])
        if head[:4] != GGUF_MAGIC:
            raise self._fail(_not_gguf_reason(head, size))
        if size < 24:
            raise self._fail(f"the file is only {size} bytes: too short for a GGUF header")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version not in SUPPORTED_VERSIONS:
            (big,) = struct.unpack_from(">I", buf, 4)
            if big in SUPPORTED_VERSIONS:
                raise self._fail(
                    f"a big-endian GGUF file (version {big}); llama.cpp on this "
                    f"{sys.byteorder}-endian machine cannot load it"
                )
            if version == 1:
                raise self._fail(
                    "GGUF version 1 is not supported (llama.cpp reads versions 2 and 3); "
                    "convert the model again with a current llama.cpp"
                )
            raise self._fail(f"unknown GGUF version {version} (this reader knows 2 and 3)")
        self.version = version
        self.n_tensors, self.n_kv = struct.unpack_from("<QQ", buf, 8)
        left = size - 24
        if self.n_kv * 14 > left:  # key length (8) + 1 byte + type (4) + 1 byte at least
            raise self._fail(
                f"the header claims {self.n_kv:,} key-value pairs, more than a file of "
                f"{size:,} bytes can hold",
                16,
            )
        if self.n_tensors * 24 > left:  # name length + n_dims + type + offset at least
            raise self._fail(
                f"the header claims {self.n_tensors:,} tensors, more than a file of "
                f"{size:,} bytes can hold",
                8,
            )
        off = 24
        try:
            for _ in range(self.n_kv):
                key_at = off
                key, off, utf8 = self._read_str(off, name=True)
                if not utf8:
                    self.non_utf8_keys.append(f"key {shown(key)}")
                if not key:
                    raise self._fail("an empty metadata key", key_at)
                if key in self.kv:
                    raise self._fail(f"duplicate metadata key {shown(key, quote=True)}", key_at)
                (vtype,) = struct.unpack_from("<I", buf, off)
                off += 4
                value, off = self._read_value(vtype, off, key)
                self.kv[key] = value
                self.kv_types[key] = (
                    value.type_name if isinstance(value, ArrayRef) else _TYPE_NAMES[vtype]
                )
        except struct.error:
            raise self._fail("the file ends inside the metadata (truncated?)", off) from None
        self.kv_end = off
        if "general.alignment" in self.kv:
            align = self.kv["general.alignment"]
            have = self.kv_types["general.alignment"]
            if have != "uint32":
                raise self._fail(f"general.alignment must be a uint32, not {have}")
            if align == 0 or align & (align - 1):
                raise self._fail(f"general.alignment {align} is not a power of 2")
            self.alignment = align

    def _read_str(self, off: int, *, name: bool = False) -> tuple[str, int, bool]:
        """The string at ``off`` (a uint64 length, then bytes), the offset after it, and
        whether it was valid UTF-8 (llama.cpp does not check). Bad bytes become U+FFFD in
        a value; in a name (``name``: a key or tensor name) they are kept distinct as
        surrogate escapes, so that two different names never read as one."""
        (n,) = struct.unpack_from("<Q", self._buf, off)
        end = off + 8 + n
        if end > self.file_size:
            raise self._fail(
                f"a string claims {n:,} bytes, past the end of the file (truncated?)", off
            )
        if n > GGUF_MAX_STRING_LENGTH:
            raise self._fail(
                f"a string claims {n:,} bytes, more than llama.cpp's limit of "
                f"{GGUF_MAX_STRING_LENGTH:,}",
                off,
            )
        raw = self._buf[off + 8 : end]
        try:
            return raw.decode("utf-8"), end, True
        except UnicodeDecodeError:
            errors = "surrogateescape" if name else "replace"
            return raw.decode("utf-8", errors=errors), end, False

    def _read_value(self, vtype: int, off: int, key: str) -> tuple[Any, int]:
        fmt = _SCALAR_FMT.get(vtype)
        if fmt is not None:
            (v,) = struct.unpack_from("<" + fmt, self._buf, off)
            return v, off + struct.calcsize("<" + fmt)
        if vtype == T_STRING:
            value, end, utf8 = self._read_str(off)
            if not utf8:
                self.non_utf8_keys.append(key)
            return value, end
        if vtype == T_ARRAY:
            etype, count = struct.unpack_from("<IQ", self._buf, off)
            start = off + 12
            if etype not in _MIN_SIZE or etype == T_ARRAY:
                raise self._fail(f"{shown(key)}: unsupported array element type {etype}", off)
            if count * _MIN_SIZE[etype] > self.file_size - start:
                raise self._fail(
                    f"{shown(key)}: an array claims {count:,} elements, more than the "
                    f"{max(self.file_size - start, 0):,} bytes left in the file can hold "
                    "(truncated?)",
                    off,
                )
            if count > GGUF_MAX_ARRAY_ELEMENTS:
                raise self._fail(
                    f"{shown(key)}: an array claims {count:,} elements, more than llama.cpp's "
                    f"limit of {GGUF_MAX_ARRAY_ELEMENTS:,}",
                    off,
                )
            if etype == T_STRING:
                # Element offsets are kept for the token list (random access by id); other
                # string arrays (merges) only need their end, and are indexed on demand.
                offsets, end = self._walk_strings(start, count, key, keep=key in _INDEXED)
                return ArrayRef(etype, count, start, end, offsets), end
            end = start + count * _MIN_SIZE[etype]
            return ArrayRef(etype, count, start, end), end
        raise self._fail(f"{shown(key)}: unknown value type {vtype}", off - 4)

    def _walk_strings(
        self, off: int, count: int, key: str, *, keep: bool = True
    ) -> tuple[array.array[int] | None, int]:
        """Offsets of ``count`` length-prefixed strings from ``off`` (when ``keep``), and
        where they end.

        The hot loop of the reader (two 151,936-entry arrays per Qwen file): one
        ``unpack_from`` per element, with no bound check; a length that runs past the end
        surfaces at the next element or at the end, and the array is then walked again,
        checking each element, to name the first bad one.
        """
        unpack = struct.Struct("<Q").unpack_from
        buf = self._buf
        start = off
        offsets = array.array("q", bytes(8 * (count + 1))) if keep else None
        try:
            if offsets is not None:
                for i in range(count):
                    offsets[i] = off
                    off += 8 + unpack(buf, off)[0]
            else:
                for _ in range(count):
                    off += 8 + unpack(buf, off)[0]
        except (struct.error, OverflowError):
            off = self.file_size + 1
        if off > self.file_size:
            self._bad_string(start, count, key)
        if offsets is not None:
            offsets[count] = off
        return offsets, off

    def _bad_string(self, off: int, count: int, key: str) -> None:
        """Raise for the first element of a string array that runs past the end of the
        file or past llama.cpp's string limit (the slow path of :meth:`_walk_strings`)."""
        for i in range(count):
            if off + 8 > self.file_size:
                raise self._fail(
                    f"{shown(key)}: the file ends inside a string array, at element {i:,} of "
                    f"{count:,} (truncated?)",
                    off,
                )
            (n,) = struct.unpack_from("<Q", self._buf, off)
            if n > GGUF_MAX_STRING_LENGTH or off + 8 + n > self.file_size:
                raise self._fail(
                    f"{shown(key)}: element {i:,} of {count:,} claims {n:,} bytes, past the end of "
                    "the file (truncated?)",
                    off,
                )
            off += 8 + n
        raise AssertionError("_bad_string found no bad string")  # pragma: no cover

    def _parse_tensors(self) -> None:
        """The tensor infos that follow the metadata, checked as llama.cpp checks them."""
        buf, off = self._buf, self.kv_end
        out: list[TensorInfo] = []
        seen: set[str] = set()
        where: list[int] = []  # offset of each tensor info, for error messages
        try:
            for _ in range(self.n_tensors):
                at = off
                name, off, utf8 = self._read_str(off, name=True)
                if not utf8:
                    self.non_utf8_keys.append(f"tensor name {shown(name)}")
                n_name = off - at - 8
                if n_name >= GGML_MAX_NAME:
                    raise self._fail(
                        f"tensor name {name[:40]!r}... is {n_name} bytes long; llama.cpp "
                        f"allows at most {GGML_MAX_NAME - 1}",
                        at,
                    )
                if name in seen:
                    raise self._fail(f"duplicate tensor name {name!r}", at)
                seen.add(name)
                (n_dims,) = struct.unpack_from("<I", buf, off)
                if n_dims > GGML_MAX_DIMS:
                    raise self._fail(
                        f"tensor {name!r} claims {n_dims} dimensions; llama.cpp allows at "
                        f"most {GGML_MAX_DIMS}",
                        off,
                    )
                shape = struct.unpack_from(f"<{n_dims}q", buf, off + 4)
                self._check_shape(name, shape, off)
                off += 4 + 8 * n_dims
                ggml_type, offset = struct.unpack_from("<iQ", buf, off)
                self._check_type(name, shape, ggml_type, off)
                off += 12
                where.append(at)
                out.append(TensorInfo(name, tuple(shape), ggml_type, offset))
        except struct.error:
            raise self._fail("the file ends inside the tensor infos (truncated?)", off) from None
        self._tensors = out
        if not out:
            return
        # The data section starts at the next multiple of the alignment.
        self.data_offset = -(-off // self.alignment) * self.alignment
        if self.data_offset > self.file_size:
            raise self._fail(
                f"the tensor data would start at byte {self.data_offset:,}, past the end of "
                f"the file ({self.file_size:,} bytes; truncated?)",
                off,
            )
        expected = 0
        for t, at in zip(out, where, strict=True):
            if t.offset != expected:
                raise self._fail(
                    f"tensor {t.name!r} has data offset {t.offset:,}, expected {expected:,} "
                    "(llama.cpp needs the tensors stored in order, each padded to "
                    f"{self.alignment} bytes)",
                    at,
                )
            expected += -(-t.n_bytes // self.alignment) * self.alignment

    def _check_shape(self, name: str, shape: Sequence[int], off: int) -> None:
        """Non-negative dimensions whose running product fits int64 (llama.cpp's test)."""
        for j, d in enumerate(shape):
            if d < 0:
                raise self._fail(f"tensor {name!r}: dimension {j} is negative ({d})", off)
        ne = [*shape, *[1] * (GGML_MAX_DIMS - len(shape))]
        n = ne[0]
        for d in ne[1:]:
            if d > 1 and _INT64_MAX // d < n:
                raise self._fail(
                    f"tensor {name!r}: shape {tuple(shape)} has more elements than int64 holds",
                    off,
                )
            n *= d

    def _check_type(self, name: str, shape: Sequence[int], ggml_type: int, off: int) -> None:
        """A ggml type llama.cpp knows, rows a multiple of its block, a size that fits."""
        if ggml_type not in GGML_TYPES:
            why = (
                "removed from ggml"
                if 0 <= ggml_type < GGML_TYPE_COUNT
                else f"llama.cpp knows 0..{GGML_TYPE_COUNT - 1}"
            )
            raise self._fail(f"tensor {name!r} has unknown ggml type {ggml_type} ({why})", off)
        type_name, block, size = GGML_TYPES[ggml_type]
        ne0 = shape[0] if shape else 1
        if ne0 % block:
            raise self._fail(
                f"tensor {name!r} of type {type_name} has rows of {ne0} elements, not a "
                f"multiple of its block size {block}",
                off,
            )
        n = 1
        for d in shape:
            n *= d
        if n // block > _SIZE_MAX // size:
            raise self._fail(f"tensor {name!r}: its size in bytes does not fit 64 bits", off)

    def _offsets(self, ref: ArrayRef) -> Sequence[int]:
        """Element offsets of a string array, walking it again if they were not kept."""
        if ref.offsets is not None:
            return ref.offsets
        offsets, _ = self._walk_strings(ref.start, ref.count, "array")
        assert offsets is not None
        return offsets

    # -- access -------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        """A scalar value, or ``default``; arrays come back as :class:`ArrayRef`."""
        return self.kv.get(key, default)

    def string_at(self, ref: ArrayRef, i: int) -> bytes:
        """Element ``i`` of a string array, as raw bytes.

        Raises:
            IndexError: ``i`` out of range.
        """
        if not 0 <= i < ref.count:
            raise IndexError(i)
        offs = self._offsets(ref)
        return bytes(self._buf[offs[i] + 8 : offs[i + 1]])

    def strings(self, ref: ArrayRef, lo: int = 0, hi: int | None = None) -> list[bytes]:
        """Elements ``lo:hi`` of a string array, as raw bytes."""
        hi = ref.count if hi is None else min(hi, ref.count)
        offs, buf = self._offsets(ref), self._buf
        return [buf[offs[i] + 8 : offs[i + 1]] for i in range(lo, hi)]

    def span(self, ref: ArrayRef, lo: int = 0, hi: int | None = None) -> bytes:
        """The raw encoded bytes of elements ``lo:hi`` (a whole array compares in one go)."""
        hi = ref.count if hi is None else min(hi, ref.count)
        if lo == 0 and hi == ref.count:
            return bytes(self._buf[ref.start : ref.end])
        if ref.elem_type == T_STRING:
            offs = self._offsets(ref)
            return bytes(self._buf[offs[lo] : offs[hi]])
        size = _MIN_SIZE[ref.elem_type]
        return bytes(self._buf[ref.start + lo * size : ref.start + hi * size])

    def numbers(self, ref: ArrayRef) -> array.array[Any]:
        """A numeric array's values (an ``array.array``; bools as 0/1)."""
        out = array.array(_ARRAY_CODE[ref.elem_type])
        out.frombytes(self._buf[ref.start : ref.end])
        if sys.byteorder == "big":  # pragma: no cover - GGUF here is little-endian
            out.byteswap()
        return out

    def number_at(self, ref: ArrayRef, i: int) -> Any:
        if not 0 <= i < ref.count:
            raise IndexError(i)
        fmt = "<" + _ARRAY_CODE[ref.elem_type]
        return struct.unpack_from(fmt, self._buf, ref.start + i * _MIN_SIZE[ref.elem_type])[0]

    def tensors(self) -> list[TensorInfo]:
        """The tensor infos that follow the metadata (names, shapes, types; no data),
        read and checked when the file was opened."""
        return self._tensors

    # -- convenient facts -----------------------------------------------------------------

    @property
    def architecture(self) -> str | None:
        a = self.get("general.architecture")
        return a if isinstance(a, str) else None

    def arch_key(self, suffix: str) -> Any:
        """``{general.architecture}.{suffix}``, e.g. ``arch_key("context_length")``."""
        return self.get(f"{self.architecture}.{suffix}")

    @property
    def split_count(self) -> int:
        """``split.count`` (1 when absent, or not the uint16 llama.cpp reads)."""
        n = self.get("split.count")
        return int(n) if self.kv_types.get("split.count") == "uint16" and n > 0 else 1

    @property
    def split_no(self) -> int:
        """``split.no``, 0-based (0 when absent, or not the uint16 llama.cpp reads)."""
        n = self.get("split.no")
        return int(n) if self.kv_types.get("split.no") == "uint16" else 0

    def shard_paths(self) -> Iterator[Path]:
        """Every shard of a split model in order, named as llama.cpp names them
        (``stem-00001-of-00003.gguf``, ``llama_split_prefix`` in src/llama.cpp); only
        ``path`` for a single file, or when this file's name does not fit its ``split.no``
        and ``split.count``. Lazy: ``split.count`` can be up to 65,535."""
        n = self.split_count
        postfix = f"-{self.split_no + 1:05d}-of-{n:05d}.gguf"
        name = self.path.name
        if n == 1 or not name.endswith(postfix):
            yield self.path
            return
        stem = name[: -len(postfix)]
        for i in range(1, n + 1):
            yield self.path.with_name(f"{stem}-{i:05d}-of-{n:05d}.gguf")

    def items(self) -> Iterator[tuple[str, Any]]:
        return iter(self.kv.items())


def shown(name: str, limit: int = 80, *, quote: bool = False) -> str:
    """A key or name from a file as a message shows it: as it is when printable (quoted
    with ``quote``), else quoted with escapes (a key can hold a newline, which would break
    a one-line error); past ``limit`` characters, cut, with its length (a corrupt key can
    be megabytes)."""
    head = name[:limit]  # cut first: repr() of a long name would take megabytes
    text = head if head.isprintable() and not quote else repr(head)
    if len(name) > limit or len(text) > limit:
        return f"{text[: limit - 20]}... ({len(name):,} characters)"
    return text


def _not_gguf_reason(head: bytes, size: int) -> str:
    """Name the common things found in place of a GGUF file."""
    if size < 4:
        return f"the file is only {size} bytes, not a GGUF file"
    text = head.lstrip().lower()
    if text.startswith(b"version https://git-lfs"):
        return "a Git LFS pointer file, not the model itself (run `git lfs pull`)"
    if text.startswith((b"<!doctype html", b"<html", b"<?xml", b"<head")):
        return "an HTML page, not a GGUF file (a failed or redirected download?)"
    if text.startswith((b"{", b"[")):
        return "a JSON document, not a GGUF file (an error response from a server?)"
    if head[:4] == b"FUGG":
        return "byte-swapped GGUF magic: a big-endian file, which llama.cpp cannot load here"
    if head[:4] in (b"ggml", b"ggmf", b"ggjt", b"lmgg", b"fmgg", b"tjgg"):
        return "a legacy GGML file (before GGUF); convert it with llama.cpp"
    if head[:2] == b"PK":
        return "a zip archive, not a GGUF file"
    return f"not a GGUF file (the first bytes are {head[:4]!r}, expected b'GGUF')"
