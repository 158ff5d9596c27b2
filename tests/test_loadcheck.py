"""What llama.cpp refuses to load is found from the metadata before any weights load.

Each mirrored check runs on a tiny model that differs from a loadable one in one thing, and
llama.cpp itself (in a child process) must refuse that same file with the message of the
check mirrored, or load it where the check only warns. Then the faces: ``info`` warns,
``check`` exits 3 whichever side the file is on, ``run`` refuses before loading any weights.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from gguf import GGUFReader, GGUFWriter
from gguf import GGUFValueType as T

from specgguf.errors import EXIT_MODEL_FILE, GGUFFormatError, ModelLoadError
from specgguf.gguf.info import read_model_info
from specgguf.gguf.loadcheck import LLAMA_ARCHS
from specgguf.gguf.metadata import GGML_TYPES, GGUFMetadata
from specgguf.gguf.tiny import TinySpec, fixture_specs, gpt2_vocab, spm_vocab, write_tiny_model
from specgguf.gguf.vocab import BPE_PRE_TOKENIZERS, check_compatibility

from .helpers import ROOT, llama_cpp_load, run_cli

_r = dataclasses.replace


def _target() -> TinySpec:
    return fixture_specs()["target"]


def _keys(*kv: tuple[str, object, T, T | None]) -> TinySpec:
    return _r(_target(), set_keys=kv)


def _t5(*kv: tuple[str, object, T, T | None]) -> TinySpec:
    """The SentencePiece fixture's tokens as a T5 (UGM) vocabulary."""
    spec = TinySpec(vocab=spm_vocab())
    return _r(spec, set_keys=(("tokenizer.ggml.model", "t5", T.STRING, None), *kv))


def _dup_tokens() -> TinySpec:
    tokens = list(gpt2_vocab().tokens)
    tokens[301] = tokens[300]
    return _r(_target(), vocab=_r(gpt2_vocab(), tokens=tuple(tokens)))


@dataclasses.dataclass(frozen=True)
class Case:
    """A variant of the tiny target, what specgguf finds first (severity, code), and what
    llama.cpp logs when it refuses it ("" when llama.cpp loads it)."""

    spec: Callable[[], TinySpec]
    severity: str
    code: str
    llama_cpp: str


BPE = gpt2_vocab()
CASES: dict[str, Case] = {
    # llama_vocab::impl::load (src/llama-vocab.cpp)
    "gpt2-without-merges": Case(
        lambda: _r(_target(), vocab=_r(BPE, merges=())),
        "error", "merges", "cannot find tokenizer merges in model file",
    ),
    "merges-not-strings": Case(
        lambda: _keys(("tokenizer.ggml.merges", [1, 2], T.ARRAY, T.INT32)),
        "error", "merges", "invalid gguf type for tokenizer.ggml.merges",
    ),
    "no-tokenizer-model": Case(
        lambda: _r(_target(), drop_keys=frozenset({"tokenizer.ggml.model"})),
        "error", "tokenizer", "key not found in model: tokenizer.ggml.model",
    ),
    "unknown-tokenizer": Case(
        lambda: _keys(("tokenizer.ggml.model", "nosuch", T.STRING, None)),
        "error", "tokenizer", "unknown tokenizer: 'nosuch'",
    ),
    "unknown-pre-tokenizer": Case(
        lambda: _keys(("tokenizer.ggml.pre", "nosuch-pre", T.STRING, None)),
        "error", "pre-tokenizer", "unknown pre-tokenizer type: 'nosuch-pre'",
    ),
    "no-token-list": Case(
        lambda: _r(_target(), drop_keys=frozenset({"tokenizer.ggml.tokens"})),
        "error", "tokens", "cannot find tokenizer vocab in model file",
    ),
    "token-list-not-strings": Case(
        lambda: _keys(("tokenizer.ggml.tokens", list(range(512)), T.ARRAY, T.INT32)),
        "error", "tokens", "invalid gguf type for tokenizer.ggml.tokens",
    ),
    "token-types-shorter-than-tokens": Case(
        lambda: _keys(("tokenizer.ggml.token_type", [1] * 10, T.ARRAY, T.INT32)),
        "error", "key-type", "Index out of array bounds for toktypes (10 < 512)",
    ),
    "token-types-uint8": Case(
        lambda: _keys(("tokenizer.ggml.token_type", [1] * 512, T.ARRAY, T.UINT8)),
        "error", "key-type", "invalid gguf type for tokenizer.ggml.token_type",
    ),
    "scores-uint8": Case(
        lambda: _keys(("tokenizer.ggml.scores", [1] * 512, T.ARRAY, T.UINT8)),
        "error", "key-type", "invalid gguf type for tokenizer.ggml.scores",
    ),
    "duplicate-token-text": Case(
        _dup_tokens, "error", "duplicate-token",
        "GGML_ASSERT(id_to_token.size() == token_to_id.size()) failed",
    ),
    "bos-id-int32": Case(
        lambda: _keys(("tokenizer.ggml.bos_token_id", 0, T.INT32, None)),
        "error", "key-type", "key tokenizer.ggml.bos_token_id has wrong type i32",
    ),
    "add-bos-uint8": Case(
        lambda: _keys(("tokenizer.ggml.add_bos_token", 1, T.UINT8, None)),
        "error", "key-type", "key tokenizer.ggml.add_bos_token has wrong type u8",
    ),
    "eot-id-out-of-range": Case(
        lambda: _keys(("tokenizer.ggml.eot_token_id", 99999, T.UINT32, None)),
        "warning", "special-token", "",
    ),
    "no-pre-tokenizer": Case(
        lambda: _r(_target(), drop_keys=frozenset({"tokenizer.ggml.pre"})),
        "warning", "pre-tokenizer", "",
    ),
    "t5-charsmap-header-past-its-end": Case(
        lambda: _t5(("tokenizer.ggml.precompiled_charsmap", [255] * 4 + [0] * 4, T.ARRAY,
                     T.UINT8)),
        "error", "charsmap", "Index out of array bounds in precompiled charsmap!",
    ),
    "t5-charsmap-not-bytes": Case(
        lambda: _t5(("tokenizer.ggml.precompiled_charsmap", [1, 2], T.ARRAY, T.INT32)),
        "error", "charsmap", "invalid gguf type for tokenizer.ggml.precompiled_charsmap",
    ),
    "t5-without-charsmap": Case(lambda: _t5(), "", "", ""),
    # llama_model_create (src/llama-model.cpp), llama_model_load (src/llama.cpp)
    "unknown-architecture": Case(
        lambda: _keys(("general.architecture", "nosucharch", T.STRING, None)),
        "error", "architecture", "unknown model architecture: 'nosucharch'",
    ),
    "clip-architecture": Case(
        lambda: _keys(("general.architecture", "clip", T.STRING, None)),
        "error", "architecture", "CLIP cannot be used as main model",
    ),
    # llama_model_base::load_hparams (src/llama-model.cpp)
    "no-block-count": Case(
        lambda: _r(_target(), drop_keys=frozenset({"llama.block_count"})),
        "error", "missing-key", "key not found in model: llama.block_count",
    ),
    "no-context-length": Case(
        lambda: _r(_target(), drop_keys=frozenset({"llama.context_length"})),
        "error", "missing-key", "key not found in model: llama.context_length",
    ),
    "no-embedding-length": Case(
        lambda: _r(_target(), drop_keys=frozenset({"llama.embedding_length"})),
        "error", "missing-key", "key not found in model: llama.embedding_length",
    ),
    "block-count-int32": Case(
        lambda: _keys(("llama.block_count", 2, T.INT32, None)),
        "error", "key-type", "key llama.block_count has wrong type i32 but expected type u32",
    ),
    "block-count-0": Case(
        lambda: _keys(("llama.block_count", 0, T.UINT32, None)),
        "error", "block-count", "GGML_ASSERT(hparams.n_layer_all > 0",
    ),
    "block-count-600": Case(
        lambda: _keys(("llama.block_count", 600, T.UINT32, None)),
        "error", "block-count", "hparams.n_layer_all <= LLAMA_MAX_LAYERS) failed",
    ),
    "head-count-array-of-3-for-2-layers": Case(
        lambda: _keys(("llama.attention.head_count", [4, 4, 4], T.ARRAY, T.UINT32)),
        "error", "key-type", "key llama.attention.head_count has wrong array length",
    ),
    "head-count-per-layer-int32": Case(
        lambda: _keys(("llama.attention.head_count", [4, 4], T.ARRAY, T.INT32)), "", "", "",
    ),
    "head-count-float": Case(
        lambda: _keys(("llama.attention.head_count", 4.0, T.FLOAT32, None)),
        "error", "key-type", "key llama.attention.head_count has wrong type f32",
    ),
    "rope-dimension-not-head-size": Case(
        lambda: _keys(("llama.rope.dimension_count", 8, T.UINT32, None)),
        "error", "rope-dimension", "invalid n_rot: 8, expected 16",
    ),
    "rope-scaling-unknown": Case(
        lambda: _keys(("llama.rope.scaling.type", "sideways", T.STRING, None)),
        "error", "rope-scaling",
        "GGML_ASSERT(hparams.rope_scaling_type_train != LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED)",
    ),
    "rope-scaling-yarn": Case(
        lambda: _keys(("llama.rope.scaling.type", "yarn", T.STRING, None)), "", "", "",
    ),
    "experts-used-without-experts": Case(
        lambda: _keys(("llama.expert_used_count", 2, T.UINT32, None)),
        "error", "experts", "GGML_ASSERT(n_expert_used_max <= hparams.n_expert) failed",
    ),
    "file-type-string": Case(
        lambda: _keys(("general.file_type", "Q8_0", T.STRING, None)),
        "error", "key-type", "key general.file_type has wrong type str but expected type u32",
    ),
    "name-uint32": Case(
        lambda: _keys(("general.name", 7, T.UINT32, None)),
        "error", "key-type", "key general.name has wrong type u32 but expected type str",
    ),
    "split-count-uint32": Case(
        lambda: _keys(("split.count", 1, T.UINT32, None)),
        "error", "key-type", "key split.count has wrong type u32 but expected type u16",
    ),
    # llama_model_llama::load_arch_hparams / load_arch_tensors (src/models/llama.cpp)
    "no-rms-epsilon": Case(
        lambda: _r(_target(), drop_keys=frozenset({"llama.attention.layer_norm_rms_epsilon"})),
        "error", "missing-key",
        "key not found in model: llama.attention.layer_norm_rms_epsilon",
    ),
    "rms-epsilon-float64": Case(
        lambda: _keys(("llama.attention.layer_norm_rms_epsilon", 1e-5, T.FLOAT64, None)),
        "error", "key-type", "has wrong type f64 but expected type f32",
    ),
    "vocab-size-uint64": Case(
        lambda: _keys(("llama.vocab_size", 512, T.UINT64, None)),
        "error", "key-type", "key llama.vocab_size has wrong type u64 but expected type u32",
    ),
    "missing-ffn-up": Case(
        lambda: _r(_target(), drop_tensors=frozenset({"blk.1.ffn_up.weight"})),
        "error", "missing-tensor", "tensor 'blk.1.ffn_up.weight' not found",
    ),
    "missing-token-embd": Case(
        lambda: _r(_target(), drop_tensors=frozenset({"token_embd.weight"})),
        "error", "missing-tensor", "tensor 'token_embd.weight' not found",
    ),
    "missing-output-is-optional": Case(
        lambda: _r(_target(), drop_tensors=frozenset({"output.weight"})), "", "", "",
    ),
    "token-count-not-embedding-rows": Case(
        lambda: _keys(
            ("tokenizer.ggml.tokens", [*BPE.tokens, "[X]"], T.ARRAY, T.STRING),
            ("tokenizer.ggml.token_type", [*BPE.types, 1], T.ARRAY, T.INT32),
        ),
        "error", "tensor-shape", "tensor 'token_embd.weight' has wrong shape",
    ),
    # llama_tensor_weight (src/llama-model-loader.h): data past the end of the file, with
    # the data section aligned to 64 bytes while the writer padded tensors to 32
    "alignment-64-data-past-end": Case(
        lambda: _keys(("general.alignment", 64, T.UINT32, None)),
        "error", "truncated", "data is not within the file bounds",
    ),
    # the controls: loadable files with no finding, or only a warning
    "target": Case(_target, "", "", ""),
    "spm-without-scores": Case(lambda: TinySpec(vocab=_r(spm_vocab(), scores=())), "", "", ""),
    "name-not-utf8": Case(
        lambda: _keys(("general.name", b"caf\xe9", T.STRING, None)), "warning", "utf8", "",
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def case_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("loadcheck")
    return {
        name: write_tiny_model(folder / f"{name}.gguf", c.spec())[0] for name, c in CASES.items()
    }


@pytest.mark.parametrize("name", sorted(CASES))
def test_check_agrees_with_llama_cpp(name: str, case_files: dict[str, Path]) -> None:
    case, path = CASES[name], case_files[name]
    info = read_model_info(path)
    first = info.findings[0] if info.findings else None
    if case.code:
        assert first is not None and (first.severity, first.code) == (case.severity, case.code)
    else:
        assert info.findings == ()
    rc, log = llama_cpp_load(path)
    if case.llama_cpp:
        assert rc != 0 and case.llama_cpp in log, log[-2000:]
        assert info.load_errors and not info.as_dict()["llama_cpp_loadable"]
    else:
        assert rc == 0, log[-2000:]
        assert info.load_errors == [] and info.as_dict()["llama_cpp_loadable"]


# -- what llama.cpp's GGUF reader refuses: GGUFMetadata.open raises -----------------------


def _patched(src: Path, dst: Path, edit: Callable[[bytearray, GGUFReader], None]) -> None:
    data = bytearray(src.read_bytes())
    edit(data, GGUFReader(src))
    dst.write_bytes(bytes(data))


def _tensor_fields(r: GGUFReader, name: str) -> dict[str, int]:
    """Byte offsets of a tensor info's fields (located by gguf-py, not by specgguf)."""
    t = next(t for t in r.tensors if t.name == name)
    at = t.field.offset
    n_name = len(name.encode())
    n_dims = len(t.shape)
    dims = at + 8 + n_name + 4
    return {"n_dims": at + 8 + n_name, "dims": dims, "type": dims + 8 * n_dims,
            "offset": dims + 8 * n_dims + 4}  # fmt: skip


def _replace_once(data: bytearray, old: bytes, new: bytes) -> None:
    assert len(old) == len(new) and data.count(old) == 1
    i = data.index(old)
    data[i : i + len(old)] = new


def _set(data: bytearray, at: int, fmt: str, value: int) -> None:
    struct.pack_into(fmt, data, at, value)


def _end_of_tensor_infos(r: GGUFReader) -> int:
    last = r.tensors[-1]
    return int(last.field.offset) + sum(int(p.nbytes) for p in last.field.parts)


GGUF_CASES: dict[str, tuple[Callable[[bytearray, GGUFReader], None], str, str]] = {
    "duplicate-key": (
        lambda d, r: _replace_once(d, b"ggml.eot_token_id", b"ggml.eos_token_id"),
        "duplicate metadata key 'tokenizer.ggml.eos_token_id'", "duplicate key",
    ),
    "duplicate-tensor-name": (
        lambda d, r: _replace_once(d, b"blk.0.attn_k.weight", b"blk.0.attn_q.weight"),
        "duplicate tensor name 'blk.0.attn_q.weight'", "duplicate tensor name",
    ),
    "five-dimensions": (
        lambda d, r: _set(d, _tensor_fields(r, "output.weight")["n_dims"], "<I", 5),
        "tensor 'output.weight' claims 5 dimensions", "invalid number of dimensions: 5 > 4",
    ),
    "negative-dimension": (
        lambda d, r: _set(d, _tensor_fields(r, "token_embd.weight")["dims"] + 8, "<q", -1),
        "tensor 'token_embd.weight': dimension 1 is negative", "has invalid number of elements",
    ),
    "element-count-past-int64": (
        lambda d, r: _set(d, _tensor_fields(r, "token_embd.weight")["dims"] + 8, "<q", 2**62),
        "has more elements than int64 holds", "may cause overflow errors",
    ),
    "unknown-ggml-type": (
        lambda d, r: _set(d, _tensor_fields(r, "output_norm.weight")["type"], "<I", 99),
        "unknown ggml type 99", "has invalid ggml type 99",
    ),
    "removed-ggml-type-4": (
        lambda d, r: _set(d, _tensor_fields(r, "output_norm.weight")["type"], "<I", 4),
        "unknown ggml type 4 (removed from ggml)", "not a multiple of block size",
    ),
    "row-not-a-multiple-of-the-block": (
        lambda d, r: _set(d, _tensor_fields(r, "token_embd.weight")["dims"], "<q", 48),
        "rows of 48 elements, not a multiple of its block size 32",
        "not a multiple of block size (32)",
    ),
    "offset-out-of-order": (
        lambda d, r: _set(d, _tensor_fields(r, "blk.0.attn_norm.weight")["offset"], "<Q", 0),
        "tensor 'blk.0.attn_norm.weight' has data offset 0, expected",
        "tensor 'blk.0.attn_norm.weight' has offset 0, expected",
    ),
    "data-section-past-the-end": (
        lambda d, r: d.__delitem__(slice(_end_of_tensor_infos(r) + 1, None)),
        "the tensor data would start at byte", "failed to seek to beginning of data section",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(GGUF_CASES))
def test_gguf_reader_refuses_what_llama_cpp_refuses(
    name: str, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    edit, ours, theirs = GGUF_CASES[name]
    path = tmp_path / f"{name}.gguf"
    _patched(tiny_models["target"], path, edit)
    with pytest.raises(GGUFFormatError) as ei:
        GGUFMetadata.open(path)
    assert ours in str(ei.value)
    assert ei.value.offset is None or ei.value.offset <= path.stat().st_size
    rc, log = llama_cpp_load(path)
    assert rc != 0 and theirs in log, log[-2000:]


def _write(path: Path, build: Callable[[GGUFWriter], None]) -> Path:
    w = GGUFWriter(path, "llama")
    build(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tensor_name_of_64_bytes_and_empty_key_refused(tmp_path: Path) -> None:
    import numpy as np

    name63, name64 = "t" * 63, "t" * 64
    ok = _write(tmp_path / "63.gguf", lambda w: w.add_tensor(name63, np.zeros(32, np.float32)))
    assert [t.name for t in GGUFMetadata.open(ok).tensors()] == [name63]
    long = _write(tmp_path / "64.gguf", lambda w: w.add_tensor(name64, np.zeros(32, np.float32)))
    with pytest.raises(GGUFFormatError, match=r"is 64 bytes long; llama\.cpp allows at most 63"):
        GGUFMetadata.open(long)
    rc, log = llama_cpp_load(long)
    assert rc != 0 and "tensor name 0 is too long: 64 >= 64" in log
    empty = _write(tmp_path / "empty.gguf", lambda w: w.add_key_value("", 1, T.UINT32))
    with pytest.raises(GGUFFormatError, match="an empty metadata key"):
        GGUFMetadata.open(empty)
    rc, log = llama_cpp_load(empty)
    assert rc != 0 and "key 1 is empty" in log


@pytest.mark.parametrize(
    ("value", "vtype", "ours", "theirs"),
    [
        (32, T.UINT64, "general.alignment must be a uint32, not uint64", "must be of type u32"),
        (48, T.UINT32, "general.alignment 48 is not a power of 2", "is not a power of 2"),
        (0, T.UINT32, "general.alignment 0 is not a power of 2", "is not a power of 2"),
    ],
)
def test_bad_alignment_refused(
    value: int, vtype: T, ours: str, theirs: str, tmp_path: Path
) -> None:
    spec = _keys(("general.alignment", value, vtype, None))
    path = write_tiny_model(tmp_path / "a.gguf", spec)[0]
    with pytest.raises(GGUFFormatError, match=ours):
        GGUFMetadata.open(path)
    rc, log = llama_cpp_load(path)
    assert rc != 0 and theirs in log


def _sparse_gguf(path: Path, body: bytes, size: int) -> Path:
    """A GGUF file of ``size`` bytes (sparse: it takes no disk) that starts with ``body``."""
    with path.open("wb") as f:
        f.write(body)
        f.truncate(size)
    return path


def test_string_and_array_past_llama_cpp_limits(tmp_path: Path) -> None:
    """Strings and arrays of more than 2**30 bytes or elements, in a file big enough to hold
    them (sparse), are refused as llama.cpp refuses them."""
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k"
    big = _sparse_gguf(tmp_path / "s.gguf", head + struct.pack("<IQ", 8, 2**30 + 1), 2**30 + 64)
    with pytest.raises(GGUFFormatError, match=r"more than llama\.cpp's limit of 1,073,741,824"):
        GGUFMetadata.open(big)
    rc, log = llama_cpp_load(big)
    assert rc != 0 and "exceeds maximum 1073741824" in log
    arr_head = head + struct.pack("<IIQ", 9, 0, 2**30 + 1)
    arr = _sparse_gguf(tmp_path / "a.gguf", arr_head, 2**30 + 64)
    with pytest.raises(GGUFFormatError, match="k: an array claims 1,073,741,825 elements"):
        GGUFMetadata.open(arr)
    rc, log = llama_cpp_load(arr)
    assert rc != 0 and "failed to read key-value pairs" in log


def test_ggml_type_table_matches_gguf_py() -> None:
    """Block and type sizes (ggml.c's type_traits, transcribed) agree with gguf-py's."""
    from gguf.constants import GGML_QUANT_SIZES

    ours = {i: (block, size) for i, (_, block, size) in GGML_TYPES.items()}
    theirs = {int(t): v for t, v in GGML_QUANT_SIZES.items()}
    assert {i: ours[i] for i in theirs} == theirs
    assert set(ours) - set(theirs) <= {42}  # Q2_0: newer than this gguf-py


# -- the tables of names, against this llama.cpp build ------------------------------------

_VOCAB_LOADS = """
import sys
from specgguf.errors import BackendError
from specgguf.llama.backend import LlamaModel
for path in sys.argv[1:]:
    try:
        with LlamaModel(path, vocab_only=True):
            print(1)
    except BackendError:
        print(0)
"""


def _vocab_loads(paths: list[Path]) -> list[bool]:
    res = subprocess.run(
        [sys.executable, "-c", _VOCAB_LOADS, *map(str, paths)],
        capture_output=True, timeout=300, check=True, cwd=ROOT,
    )  # fmt: skip
    return [line == "1" for line in res.stdout.decode().split()]


def _vocab_file(path: Path, *kv: tuple[str, object, T, T | None]) -> Path:
    """The tiny target's vocabulary without any tensors (a vocab-only load needs none)."""
    names = frozenset(GGUFMetadata.open(_control()).tensors()[i].name for i in range(21))
    return write_tiny_model(path, _r(_target(), set_keys=kv, drop_tensors=names))[0]


@functools.cache
def _control() -> Path:
    import tempfile

    return write_tiny_model(Path(tempfile.mkdtemp()) / "t.gguf", _target())[0]


def test_architecture_table_matches_llama_cpp(tmp_path: Path) -> None:
    """Every architecture named in LLAMA_ARCHS is one this llama.cpp build creates a model
    for, and names outside it are refused (vocab-only loads; clip is refused on purpose,
    gptj is named in llama-arch.cpp but has no model class)."""
    archs = [*sorted(LLAMA_ARCHS), "gptj", "nosucharch", "llama5", "qwen9"]
    paths = [
        _vocab_file(tmp_path / f"{i}.gguf", ("general.architecture", a, T.STRING, None))
        for i, a in enumerate(archs)
    ]
    loads = dict(zip(archs, _vocab_loads(paths), strict=True))
    refused = {a for a, ok in loads.items() if not ok}
    assert refused == {"clip", "gptj", "nosucharch", "llama5", "qwen9"}


def test_pre_tokenizer_table_matches_llama_cpp(tmp_path: Path) -> None:
    pres = [*sorted(BPE_PRE_TOKENIZERS), "nosuch", "qwen-2"]
    paths = [
        _vocab_file(tmp_path / f"{i}.gguf", ("tokenizer.ggml.pre", p, T.STRING, None))
        for i, p in enumerate(pres)
    ]
    loads = dict(zip(pres, _vocab_loads(paths), strict=True))
    assert {p for p, ok in loads.items() if not ok} == {"nosuch", "qwen-2"}


# -- split models -------------------------------------------------------------------------


def _split(tmp_path: Path) -> list[Path]:
    return write_tiny_model(tmp_path / "s.gguf", _r(_target(), split_max_tensors=8))


def test_split_model_problems(tmp_path: Path) -> None:
    files = _split(tmp_path)
    assert read_model_info(files[0]).findings == ()
    renamed = files[0].with_name("renamed.gguf")
    files[0].rename(renamed)
    info = read_model_info(renamed)
    assert info.load_errors[0].code == "split"
    assert "must be named *-00001-of-00003.gguf" in info.load_errors[0].message
    rc, log = llama_cpp_load(renamed)
    assert rc != 0 and "invalid split file name" in log
    renamed.rename(files[0])
    files[1].unlink()
    info = read_model_info(files[0])
    assert info.load_errors[0].message.startswith("shard 2 of 3 is missing")
    rc, log = llama_cpp_load(files[0])
    assert rc != 0 and "failed to load GGUF split" in log


def test_split_shard_with_the_wrong_number(tmp_path: Path) -> None:
    files = _split(tmp_path)
    field = GGUFReader(files[2]).fields["split.no"]
    value_at = int(field.offset) + sum(int(p.nbytes) for p in field.parts[:-1])
    data = bytearray(files[2].read_bytes())
    assert struct.unpack_from("<H", data, value_at) == (2,)
    struct.pack_into("<H", data, value_at, 1)
    files[2].write_bytes(bytes(data))
    info = read_model_info(files[0])
    assert info.load_errors[0].message.endswith("says it is shard 2, expected 3")
    rc, log = llama_cpp_load(files[0])
    assert rc != 0 and "invalid split file idx: 1" in log


# -- the faces: info, check, run ----------------------------------------------------------


@pytest.fixture(scope="module")
def bad(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A gpt2 (BPE) vocabulary without merges: llama.cpp refuses it."""
    folder = tmp_path_factory.mktemp("bad")
    return write_tiny_model(folder / "no-merges.gguf", CASES["gpt2-without-merges"].spec())[0]


def test_info_warns_on_stderr_and_in_json(bad: Path, tiny_models: dict[str, Path]) -> None:
    res = run_cli("info", str(bad))
    assert res.returncode == 0
    err = res.stderr.decode().strip().splitlines()
    assert err == [
        "specgguf: warning: llama.cpp cannot load this file: a BPE vocabulary (gpt2) without "
        "tokenizer.ggml.merges: llama.cpp refuses it"
    ]
    assert b"warning" not in res.stdout and b"tiny target" in res.stdout  # data only
    # the verdict is data too: one row of the table, the reason as on stderr
    assert re.search(rb"^loadable +no: a BPE vocabulary \(gpt2\) without", res.stdout, re.M)
    data = json.loads(run_cli("info", "--json", str(bad)).stdout)
    assert data["llama_cpp_loadable"] is False
    assert [f["code"] for f in data["findings"]] == ["merges"]
    ok = run_cli("info", "--json", str(tiny_models["target"]))
    assert ok.stderr == b""
    assert json.loads(ok.stdout)["findings"] == []


def test_check_fails_whichever_side(bad: Path, tiny_models: dict[str, Path]) -> None:
    ok = str(tiny_models["target"])
    for args in ([str(bad), str(bad)], [ok, str(bad)], [str(bad), ok], ["--json", ok, str(bad)]):
        res = run_cli("check", *args)
        assert res.returncode == EXIT_MODEL_FILE, res.stderr
        assert res.stdout == b""
        lines = res.stderr.decode().strip().splitlines()
        assert len(lines) == 1
        assert lines[0].startswith(f"specgguf: error: {bad}: llama.cpp cannot load this file: ")
        assert "without tokenizer.ggml.merges" in lines[0]
        assert f"(hint: `specgguf info {bad}` lists every problem)" in lines[0]
    with pytest.raises(ModelLoadError) as ei:
        check_compatibility(ok, bad)
    assert ei.value.path == bad and len(ei.value.reasons) == 1


def test_run_refuses_before_loading_any_weights(bad: Path, tiny_models: dict[str, Path]) -> None:
    """With -v, llama.cpp logs every model it loads ("llama_model_loader: loaded meta
    data ..."): the control run shows that line; the refused runs never reach it."""
    ok = str(tiny_models["target"])
    control = run_cli("run", "-m", ok, "--drafter", "none", "-v", "-n", "1", "-c", "256", "hi")
    assert control.returncode == 0, control.stderr
    assert b"llama_model_loader: loaded meta data" in control.stderr
    for args in (["-m", ok, "-md", str(bad), "--drafter", "model"],
                 ["-m", str(bad), "--drafter", "none"],
                 ["-m", str(bad), "-md", ok, "--drafter", "model"]):  # fmt: skip
        res = run_cli("run", *args, "-v", "-n", "1", "-c", "256", "hi")
        assert res.returncode == EXIT_MODEL_FILE, res.stderr
        assert b"llama_model_load" not in res.stderr
        lines = res.stderr.decode().strip().splitlines()
        assert len(lines) == 1 and "llama.cpp cannot load this file" in lines[0]
        assert res.stdout == b""


@pytest.mark.parametrize("side", ["target", "draft"])
def test_engine_refuses_before_any_llama_model(
    side: str, bad: Path, tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In process: a LlamaModel created at all fails the test."""
    from specgguf.engine import Engine, EngineConfig, ModelConfig, SpeculativeConfig
    from specgguf.engine import engine as engine_mod

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(engine_mod, "LlamaModel", no_load)
    ok = tiny_models["target"]
    target, draft = (bad, ok) if side == "target" else (ok, bad)
    config = EngineConfig(
        ModelConfig(target), ModelConfig(draft), SpeculativeConfig(drafter="model")
    )
    with pytest.raises(ModelLoadError) as ei:
        Engine(config)
    assert ei.value.path == bad
    # the control: a loadable pair gets as far as loading
    good = EngineConfig(ModelConfig(ok), ModelConfig(ok), SpeculativeConfig(drafter="model"))
    with pytest.raises(AssertionError, match="a model was loaded"):
        Engine(good)


_TOKENIZE = """
import sys
from specgguf.llama.backend import LlamaModel
with LlamaModel(sys.argv[1], vocab_only=True) as m:
    print(m.tokenize("hello", add_special=True))
"""


def test_bos_to_add_but_none_aborts_when_tokenizing(tmp_path: Path) -> None:
    """chatglm-bpe has no BOS in llama.cpp; with add_bos set, llama.cpp loads the file but
    aborts on the first prompt: a load error here, before any weights load."""
    spec = _keys(
        ("tokenizer.ggml.pre", "chatglm-bpe", T.STRING, None),
        ("tokenizer.ggml.add_bos_token", True, T.BOOL, None),
    )
    spec = _r(spec, drop_keys=frozenset({"tokenizer.ggml.bos_token_id"}))
    path = write_tiny_model(tmp_path / "nobos.gguf", spec)[0]
    info = read_model_info(path)
    assert info.vocab.bos is None and info.vocab.add_bos
    assert [f.code for f in info.load_errors] == ["special-token"]
    assert "add_bos is set but the vocabulary has no BOS token" in info.load_errors[0].message
    assert llama_cpp_load(path)[0] == 0  # it loads...
    res = subprocess.run(
        [sys.executable, "-c", _TOKENIZE, str(path)], capture_output=True, timeout=120, cwd=ROOT
    )
    assert res.returncode < 0  # ...and aborts on tokenizing
    assert b"GGML_ASSERT(vocab.token_bos() != LLAMA_TOKEN_NULL) failed" in res.stderr
    # the control: the same with add_bos unset tokenizes
    ctl = _r(spec, set_keys=(spec.set_keys[0],))
    ctl_path = write_tiny_model(tmp_path / "ctl.gguf", ctl)[0]
    assert read_model_info(ctl_path).load_errors == []
    ok = subprocess.run(
        [sys.executable, "-c", _TOKENIZE, str(ctl_path)], capture_output=True, timeout=120, cwd=ROOT
    )
    assert ok.returncode == 0, ok.stderr
