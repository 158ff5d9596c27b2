"""The GGUF reader under mutated files (Hypothesis): truncations in every region, counts,
lengths, types, dimensions and offsets set to small, huge and boundary values, bytes
changed, inserted and deleted, and split models with renamed, missing or renumbered shards,
all made from the tiny fixtures.

Whatever the file, ``read_model_info`` and ``check_compatibility`` (either side) end in a
valid result or a :class:`SpecggufError` with exit code 3 or 4 and a one-line message (under
1,000 characters); never
another exception, never more than 2 MiB of Python memory (tracemalloc) or a second per
file; a format error's byte offset lies inside the file. A few through the real CLI.

About 2,500 examples run by default (~60 s); ``SPECGGUF_FUZZ_EXAMPLES=N`` runs N in the main
test (the others scale with it). Inputs that once crashed the reader are kept as regression
tests at the end, with the mutations that made them.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import struct
import time
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFReader
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specgguf.errors import EXIT_INCOMPATIBLE, EXIT_MODEL_FILE, GGUFFormatError, SpecggufError
from specgguf.gguf.info import read_model_info
from specgguf.gguf.vocab import check_compatibility

from .helpers import run_cli

N_EXAMPLES = int(os.environ.get("SPECGGUF_FUZZ_EXAMPLES", "2000"))
MAX_BYTES = 2 << 20
SETTINGS = settings(
    max_examples=N_EXAMPLES,
    # The second per file is checked as CPU time in _ends_well: wall time on a shared
    # machine made Hypothesis's deadline flaky.
    deadline=None,
    # isolated_env (autouse) only sets environment variables, the same for every example.
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)


# -- where the fields are: located with gguf-py's reader, not specgguf's ------------------


@dataclasses.dataclass(frozen=True)
class Field:
    """An integer field of the file: where it is, its width (4 or 8 bytes), what it is."""

    offset: int
    width: int
    what: str


def _fields(path: Path) -> tuple[list[Field], list[int]]:
    """The integer fields of a GGUF file (header counts, key and string lengths, value and
    array types, array counts, tensor name lengths, n_dims, dimensions, ggml types, data
    offsets) and the region boundaries (each key-value pair and tensor info starts)."""
    r = GGUFReader(path)
    out = [Field(4, 4, "version"), Field(8, 8, "n_tensors"), Field(16, 8, "n_kv")]
    bounds = [0, 4, 8, 16, 24]
    for f in r.fields.values():
        if f.name.startswith("GGUF."):
            continue
        bounds.append(int(f.offset))
        at = int(f.offset)
        kept = 0
        for i, part in enumerate(f.parts):
            size = int(part.nbytes)
            # the first parts (key length, type, array type and count, string length) and
            # a few elements of long arrays
            wanted = i < 6 or kept < 3 or i == len(f.parts) - 2
            if part.dtype.kind in "ui" and size in (4, 8) and part.size == 1 and wanted:
                out.append(Field(at, size, f"{f.name}[{i}]"))
                kept += i >= 6
            at += size
    for t in r.tensors:
        at = int(t.field.offset)
        bounds.append(at)
        for i, part in enumerate(t.field.parts):
            size = int(part.nbytes)
            if part.dtype.kind in "ui" and part.itemsize in (4, 8):
                for j in range(part.size):
                    out.append(Field(at + j * part.itemsize, part.itemsize, f"{t.name}[{i}]"))
            at += size
    bounds.append(int(r.data_offset))
    bounds.append(path.stat().st_size)
    return out, sorted(set(bounds))


def _interesting(width: int, size: int) -> list[int]:
    top = (1 << (8 * width)) - 1
    vals = [0, 1, 2, 3, 4, 5, 8, 9, 12, 13, 31, 32, 63, 64, 255, 2**16 - 1, 2**30, 2**30 + 1,
            2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1,
            size - 1, size, size + 1]  # fmt: skip
    return sorted({v for v in vals if 0 <= v <= top})


# -- mutations ----------------------------------------------------------------------------

Mutation = tuple[Any, ...]


def apply(data: bytes, mutations: Sequence[Mutation]) -> bytes:
    """Apply mutations in order: ("truncate", at), ("int", offset, width, value),
    ("byte", at, value), ("delete", at, n), ("insert", at, bytes)."""
    buf = bytearray(data)
    for m in mutations:
        kind = m[0]
        if kind == "truncate":
            del buf[m[1] :]
        elif kind == "int" and m[1] + m[2] <= len(buf):
            buf[m[1] : m[1] + m[2]] = m[3].to_bytes(m[2], "little")
        elif kind == "byte" and m[1] < len(buf):
            buf[m[1]] = m[2]
        elif kind == "delete":
            del buf[m[1] : m[1] + m[2]]
        elif kind == "insert":
            buf[m[1] : m[1]] = m[2]
    return bytes(buf)


def mutations(data: bytes, fields: list[Field], bounds: list[int]) -> st.SearchStrategy[Any]:
    size = len(data)
    near = st.sampled_from(bounds).flatmap(lambda b: st.integers(max(b - 16, 0), min(b + 16, size)))
    where = st.one_of(near, st.integers(0, size))
    field = st.sampled_from(fields)
    int_mut = field.flatmap(
        lambda f: st.one_of(
            st.sampled_from(_interesting(f.width, size)),
            st.integers(0, (1 << (8 * f.width)) - 1),
        ).map(lambda v: ("int", f.offset, f.width, v))
    )
    one = st.one_of(
        where.map(lambda at: ("truncate", at)),
        int_mut,
        int_mut,
        st.tuples(st.just("byte"), where, st.integers(0, 255)),
        st.tuples(st.just("delete"), where, st.integers(1, 64)),
        st.tuples(st.just("insert"), where, st.binary(min_size=1, max_size=16)),
    )
    return st.lists(one, min_size=1, max_size=3)


# -- the property -------------------------------------------------------------------------


def _ends_well(call: Callable[[], object], path: Path) -> None:
    """``call`` returns, or raises a SpecggufError with exit code 3 or 4 and one short
    line; in bounded memory and CPU time; a format error's offset inside the file."""
    size = path.stat().st_size
    tracemalloc.start()
    t0 = time.process_time()
    try:
        call()
    except SpecggufError as e:
        assert e.exit_code in (EXIT_MODEL_FILE, EXIT_INCOMPATIBLE), repr(e)
        assert "\n" not in str(e) and 0 < len(str(e)) < 1000, repr(e)[:2000]
        if isinstance(e, GGUFFormatError) and e.offset is not None:
            assert 0 <= e.offset <= size, repr(e)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < MAX_BYTES, f"{peak:,} bytes allocated"
    assert time.process_time() - t0 < 1.0


def check_file(path: Path, good: Path) -> None:
    _ends_well(lambda: read_model_info(path), path)
    _ends_well(lambda: check_compatibility(good, path), path)
    _ends_well(lambda: check_compatibility(path, good), path)


class Seeds(dict[str, tuple[bytes, list[Field], list[int]]]):
    """Seed files by name: bytes, integer fields, region boundaries (a short repr, for
    Hypothesis's report of a failing example)."""

    def __repr__(self) -> str:
        return f"<seeds {sorted(self)}>"


@pytest.fixture(scope="module")
def seeds(tiny_models: dict[str, Path]) -> Seeds:
    out = Seeds()
    for name in ("target", "draft-spm"):
        path = tiny_models[name]
        out[name] = (path.read_bytes(), *_fields(path))
    return out


@pytest.fixture(scope="module")
def good(tiny_models: dict[str, Path]) -> Path:
    """The loadable tiny target, the other side of ``check``."""
    return tiny_models["target"]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@SETTINGS
@given(data=st.data())
def test_mutated_files_end_well(
    data: st.DataObject,
    seeds: Seeds,
    work: Path,
    good: Path,
) -> None:
    name = data.draw(st.sampled_from(sorted(seeds)), label="seed")
    raw, fields, bounds = seeds[name]
    muts = data.draw(mutations(raw, fields, bounds), label="mutations")
    path = work / "mutated.gguf"
    path.write_bytes(apply(raw, muts))
    check_file(path, good)


# -- split models: shard names, counts and numbers ----------------------------------------


class SplitSeed(list[tuple[bytes, int, int]]):
    def __repr__(self) -> str:
        return "<split shards>"


@pytest.fixture(scope="module")
def split_seed(tiny_models: dict[str, Path]) -> SplitSeed:
    """Each shard's bytes and the offsets of its split.no and split.count values."""
    out = SplitSeed()
    for i in range(1, 4):
        path = tiny_models["split"].with_name(f"tiny-split-0000{i}-of-00003.gguf")
        r = GGUFReader(path)
        offsets = []
        for key in ("split.no", "split.count"):
            f = r.fields[key]
            offsets.append(int(f.offset) + sum(int(p.nbytes) for p in f.parts[:-1]))
        out.append((path.read_bytes(), offsets[0], offsets[1]))
    return out


SHARD_NAMES = [
    "s-00001-of-00003.gguf", "s-00002-of-00003.gguf", "s-00003-of-00003.gguf",
    "s-00001-of-00002.gguf", "s-00004-of-00003.gguf", "-00001-of-00003.gguf", "s.gguf",
    "s-1-of-3.gguf", "s-00001-of-65535.gguf", None,
]  # fmt: skip


@settings(SETTINGS, max_examples=max(N_EXAMPLES // 8, 20))
@given(
    names=st.lists(st.sampled_from(SHARD_NAMES), min_size=3, max_size=3),
    numbers=st.lists(st.tuples(st.integers(0, 65535), st.integers(0, 65535)), max_size=3),
    first=st.integers(0, 2),
)
def test_split_models_end_well(
    names: list[str | None],
    numbers: list[tuple[int, int]],
    first: int,
    split_seed: SplitSeed,
    work: Path,
    good: Path,
) -> None:
    """Shards renamed, missing (None), renumbered (split.no, split.count as uint16)."""
    written = write_split(work / "split", split_seed, names, numbers)
    if written:
        check_file(written[min(first, len(written) - 1)], good)


def write_split(
    folder: Path,
    seed: Sequence[tuple[bytes, int, int]],
    names: Sequence[str | None],
    numbers: Sequence[tuple[int, int]],
) -> list[Path]:
    """The three shards of the split fixture as ``names`` (None: left out), the first ones
    with (split.no, split.count) set to ``numbers``."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    written: list[Path] = []
    for i, (raw, no_at, count_at) in enumerate(seed):
        name = names[i]
        if name is None:
            continue
        buf = bytearray(raw)
        if i < len(numbers):
            struct.pack_into("<H", buf, no_at, numbers[i][0])
            struct.pack_into("<H", buf, count_at, numbers[i][1])
        path = folder / name
        path.write_bytes(bytes(buf))
        written.append(path)
    return written


# -- through the real command line --------------------------------------------------------


@settings(SETTINGS, max_examples=max(N_EXAMPLES // 200, 8), deadline=None)
@given(data=st.data())
def test_mutated_files_through_the_cli(
    data: st.DataObject,
    seeds: Seeds,
    work: Path,
    good: Path,
) -> None:
    raw, fields, bounds = seeds["target"]
    muts = data.draw(mutations(raw, fields, bounds), label="mutations")
    path = work / "cli.gguf"
    path.write_bytes(apply(raw, muts))
    for args in (["info", str(path)], ["check", str(good), str(path)]):
        res = run_cli(*args)
        err = res.stderr.decode()
        assert "Traceback" not in err and "internal error" not in err, err
        assert res.returncode in (0, EXIT_MODEL_FILE, EXIT_INCOMPATIBLE), err
        if res.returncode == EXIT_MODEL_FILE:
            assert res.stdout == b"" and len(err.strip().splitlines()) == 1, err


# -- inputs the fuzzer found ----------------------------------------------------------------

# Each was a failure of the properties above, found by these tests (the first five on the
# reader as it was before them), kept with the mutations that made it.
FOUND: dict[str, tuple[str, list[Mutation]]] = {
    # A string length that ran past the end inside the token list: the error's byte offset
    # was past the end of the file (at byte 5,062 of 5,052; or 16e18 for a huge length).
    "offset-past-end-after-truncation": ("target", [("truncate", 5052)]),
    "offset-past-end-huge-length": ("target", [("int", 1027, 8, 2**64 - 1)]),
    # The same walk with a length near 2**64: the kept offset overflowed an int64 array
    # ("OverflowError: int too big to convert", exit 1 with "internal error").
    "overflow-byte-changed": ("target", [("byte", 1027, 1)]),
    "overflow-byte-inserted": ("draft-spm", [("insert", 4453, b"\x00")]),
    "overflow-byte-deleted": ("target", [("delete", 767, 1)]),
    # A key of 84,383 bytes of garbage: the message quoted all of it (4 MiB allocated for
    # an error line); names are now cut at 80 characters.
    "huge-garbage-key-in-message": ("draft-spm", [("int", 305, 8, 84383)]),
    # Then a key of 117,776 characters: cut, but only after repr() of all of it (4.2 MB).
    "huge-garbage-key-repr": ("draft-spm", [("int", 679, 8, 120288)]),
}


@pytest.mark.parametrize("name", sorted(FOUND))
def test_found_inputs(name: str, seeds: Seeds, work: Path, good: Path) -> None:
    seed, muts = FOUND[name]
    path = work / f"{name}.gguf"
    path.write_bytes(apply(seeds[seed][0], muts))
    check_file(path, good)


def test_found_split_count_65535(split_seed: SplitSeed, work: Path, good: Path) -> None:
    """split.count 65,535 on a first shard named for it: every shard path was built and
    looked for (2.9 s, 25 MB); now the walk stops at the 8th missing one."""
    names = ["s-00001-of-65535.gguf", None, None]
    (first,) = write_split(work / "split65535", split_seed, names, [(0, 65535)])
    check_file(first, good)
    info = read_model_info(first)
    assert len(info.missing_shards) == 8 and info.split_count == 65535
    assert info.load_errors[0].message.startswith("shard 2 of 65535 is missing")


@pytest.mark.parametrize(
    "muts",
    [
        [("insert", 546, b"\x00")],  # a key with a newline: a two-line error
        [("insert", 1573, b"\x80")],  # the OverflowError above, as "internal error", exit 1
    ],
)
def test_found_cli_inputs(muts: list[Mutation], seeds: Seeds, work: Path, good: Path) -> None:
    path = work / "found-cli.gguf"
    path.write_bytes(apply(seeds["target"][0], muts))
    for args in (["info", str(path)], ["check", str(good), str(path)]):
        res = run_cli(*args)
        err = res.stderr.decode()
        assert res.returncode == EXIT_MODEL_FILE, err
        assert res.stdout == b"" and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("blocks", [163_391, 4_000_000_000])
def test_a_huge_block_count_sizes_no_table(
    tiny_models: dict[str, Path], tmp_path: Path, blocks: int
) -> None:
    # Found by the fuzzer: block_count 163391 made read_model_info allocate 2.6 MB (a
    # per-layer table sized by the file's own number; 4e9 would have been 64 GB).
    from specgguf.gguf.info import read_model_info
    from specgguf.llama.memory import model_memory, place_model

    raw = tiny_models["draft-spm"].read_bytes()
    key = b"llama.block_count"
    at = raw.index(key) + len(key) + 4  # after the key, its uint32 value type
    assert int.from_bytes(raw[at : at + 4], "little") == 2  # the tiny model's 2 layers
    path = tmp_path / "blocks.gguf"
    path.write_bytes(apply(raw, [("int", at, 4, blocks)]))
    _ends_well(lambda: read_model_info(path), path)
    info = read_model_info(path)
    assert info.block_count == blocks and info.layout is None
    assert any(f"block_count is {blocks}" in f.message for f in info.findings)
    _ends_well(lambda: place_model(info, model_memory(info, n_ctx=512), []), path)
