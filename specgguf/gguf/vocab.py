"""Vocabulary compatibility of a target and a draft model, decided from GGUF metadata alone.

The verify step compares token ids, so a draft is only useful when its ids mean the target's
strings. :func:`check_compatibility` applies the rules llama.cpp applies after loading both
models (``common_speculative_are_compatible`` in common/speculative.cpp, llama-cpp-python
0.3.36) and more, in well under a second, before any weights load:

llama.cpp's rules (errors)
    same vocabulary type; ``add_bos`` equal, and BOS ids equal when it is set; the same for
    EOS; token counts differ by at most 128 (``SPEC_VOCAB_MAX_SIZE_DIFFERENCE``); token texts
    identical for every id from 5 (``SPEC_VOCAB_CHECK_START_TOKEN_ID``) up to the smaller
    count.
beyond llama.cpp
    errors: an end-of-generation token of the target (EOS, EOT, EOM, and
    the tokens llama.cpp treats as EOG by their text, such as ``<|im_end|>``) missing from
    the draft or with another text there.
    warnings: draft ids the target does not have (never proposed: their draft probability
    is set to zero); the draft ending generation on other tokens; a different pre-tokenizer
    or different BPE merges (ids still match, but the draft may split a prompt differently).

Special-token ids and the ``add_bos``/``add_eos`` flags follow llama.cpp's defaults when a
file lacks the key (src/llama-vocab.cpp, ``llama_vocab::impl::load``).

:func:`vocab_findings` mirrors what that same ``load`` refuses (or warns about) in one
file's tokenizer section, so that a vocabulary llama.cpp cannot load is found before any
weights load: see its docstring for the list.
"""

from __future__ import annotations

import bisect
import dataclasses
import struct
import time
from pathlib import Path
from typing import Any

from specgguf.errors import ModelLoadError
from specgguf.gguf.arch import (
    DRAFT_HEAD_ARCHS,
    article,
    head_fit,
    head_width,
    memory_kind,
    rolls_back,
)
from specgguf.gguf.loadcheck import load_findings
from specgguf.gguf.metadata import ArrayRef, Finding, GGUFMetadata, Severity, shown

__all__ = [
    "CompatReport",
    "Finding",
    "Severity",
    "TokenDiff",
    "VocabInfo",
    "check_compatibility",
    "compare_vocabs",
    "read_vocab",
    "vocab_findings",
]

#: llama.cpp's limits (common/speculative.cpp).
SPEC_VOCAB_MAX_SIZE_DIFFERENCE = 128
SPEC_VOCAB_CHECK_START_TOKEN_ID = 5

# tokenizer.ggml.model -> llama.cpp vocabulary type (enum llama_vocab_type).
_VOCAB_TYPES = {
    "no_vocab": "none", "none": "none", "llama": "spm", "gpt2": "bpe", "hybriddna": "bpe",
    "whitespace": "bpe", "gemma4": "bpe", "bert": "wpm", "t5": "ugm", "rwkv": "rwkv",
    "plamo2": "plamo2",
}  # fmt: skip

# Default (BOS, EOS) ids per tokenizer model when the keys are absent (None: no token).
_DEFAULT_SPECIAL: dict[str, tuple[int | None, int | None]] = {
    "llama": (1, 2), "bert": (101, None), "gpt2": (11, 11), "hybriddna": (11, 11),
    "whitespace": (11, 11), "t5": (None, 1), "rwkv": (None, None), "plamo2": (1, 2),
    "gemma4": (None, None),
}  # fmt: skip

# BPE pre-tokenizers for which llama.cpp defaults add_bos to true.
_BPE_ADD_BOS_PRE = {
    "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
    "jina-v5-nano", "tekken", "chameleon", "gemma4",
}  # fmt: skip
_BPE_NO_BOS_PRE = {"chatglm-bpe", "glm4", "glm5"}

# Token texts llama.cpp marks as end-of-generation wherever they appear (llama-vocab.cpp).
EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
    "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>",
    "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>",
    "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
)  # fmt: skip


# Tokenizer models llama.cpp knows (llama_vocab::impl::load).
_TOKENIZER_MODELS = frozenset(_VOCAB_TYPES) | {"test"}
_BPE_MODELS_WITH_MERGES = frozenset({"gpt2", "hybriddna", "whitespace", "gemma4"})

# BPE pre-tokenizers llama.cpp knows (the tokenizer_pre branches of llama_vocab::impl::load).
BPE_PRE_TOKENIZERS = frozenset({
    "a.x-4.0", "afmoe", "bailingmoe", "bailingmoe2", "bloom", "chameleon", "chatglm-bpe",
    "codeshell", "cohere2moe", "command-r", "dbrx", "deepseek-coder", "deepseek-llm",
    "deepseek-r1-qwen", "deepseek-v3", "default", "exaone", "exaone-moe", "exaone4",
    "f2llmv2", "falcon", "falcon-h1", "falcon3", "gemma4", "gigachat", "glm4", "glm5",
    "gpt-2", "gpt-4o", "gpt3-finnish", "granite-docling", "granite-embed-multi-311m",
    "granite-embed-multi-97m", "grok-2", "hunyuan", "hunyuan-dense", "hy_v4", "jais",
    "jais-2", "jina-de", "jina-es", "jina-v1-en", "jina-v2-code", "jina-v2-de", "jina-v2-es",
    "jina-v5-nano", "joyai-llm", "kanana2", "kimi-k2", "kormo", "laguna", "lfm2", "llada-moe",
    "llama-bpe", "llama-v3", "llama3", "llama4", "megrez", "mellum", "mellum2", "midm-2.0",
    "minerva-7b", "minicpm5", "minimax-m2", "modern-bert", "mpt", "olmo", "phi-2", "pixtral",
    "poro-chat", "qwen2", "qwen35", "refact", "roberta-bpe", "sarvam-moe", "seed-coder",
    "smaug-bpe", "smollm", "solar-open", "spark2_5", "stablelm2", "starcoder", "superbpe",
    "talkie", "tekken", "tiny_aya", "trillion", "ufakzeka", "viking", "whitespace", "youtu",
})  # fmt: skip

# Special-token ids llama.cpp reads as uint32 (llama_vocab::impl::load, special_token_types).
_SPECIAL_ID_KEYS = tuple(
    f"tokenizer.ggml.{k}_token_id"
    for k in (
        "bos", "eos", "eot", "eom", "unknown", "seperator", "padding", "mask", "fim_pre",
        "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep", "prefix", "suffix", "middle",
    )
)  # fmt: skip
# Keys llama.cpp reads with get_key and a fixed type.
_VOCAB_KEY_TYPES = {
    "tokenizer.ggml.model": "string",
    "tokenizer.ggml.pre": "string",
    "tokenizer.ggml.token_type_count": "uint32",
    "tokenizer.ggml.add_space_prefix": "bool",
    "tokenizer.ggml.remove_extra_whitespaces": "bool",
    **dict.fromkeys(_SPECIAL_ID_KEYS, "uint32"),
    "tokenizer.ggml.add_bos_token": "bool",
    "tokenizer.ggml.add_eos_token": "bool",
    "tokenizer.ggml.add_sep_token": "bool",
    "tokenizer.ggml.normalizer.lowercase": "bool",
    "tokenizer.ggml.normalizer.strip_accents": "bool",
}


@dataclasses.dataclass(frozen=True)
class VocabInfo:
    """The vocabulary facts of one GGUF file (ids are token ids, -1 never appears: absent
    special tokens are None)."""

    path: Path
    architecture: str | None
    tokenizer_model: str
    vocab_type: str
    pre: str | None
    n_tokens: int
    bos: int | None
    eos: int | None
    eot: int | None
    eom: int | None
    pad: int | None
    add_bos: bool
    add_eos: bool
    eog_ids: tuple[int, ...]
    n_merges: int
    meta: GGUFMetadata = dataclasses.field(repr=False, compare=False)
    tokens: ArrayRef | None = dataclasses.field(repr=False, compare=False, default=None)
    #: Texts of the special tokens, read while the file was open.
    special_texts: dict[int, str] = dataclasses.field(repr=False, default_factory=dict)
    #: What llama.cpp's vocabulary loader refuses or warns about (:func:`vocab_findings`).
    findings: tuple[Finding, ...] = ()

    def text(self, token: int | None) -> str | None:
        """The stored text of ``token`` (``tokenizer.ggml.tokens[token]``), or None.
        Special tokens are always available; others only while the file is open."""
        if token is None or self.tokens is None or not 0 <= token < self.n_tokens:
            return None
        if token in self.special_texts:
            return self.special_texts[token]
        return self.meta.string_at(self.tokens, token).decode("utf-8", errors="replace")

    def as_dict(self) -> dict[str, Any]:
        def tok(t: int | None) -> dict[str, Any] | None:
            return None if t is None else {"id": t, "text": self.text(t)}

        return {
            "tokenizer_model": self.tokenizer_model,
            "vocab_type": self.vocab_type,
            "pre_tokenizer": self.pre,
            "n_tokens": self.n_tokens,
            "n_merges": self.n_merges,
            "bos": tok(self.bos),
            "eos": tok(self.eos),
            "eot": tok(self.eot),
            "eom": tok(self.eom),
            "padding": tok(self.pad),
            "add_bos": self.add_bos,
            "add_eos": self.add_eos,
            "eog": [tok(t) for t in self.eog_ids],
        }


def read_vocab(meta: GGUFMetadata) -> VocabInfo:
    """The vocabulary of an open GGUF file, with llama.cpp's defaults for absent keys.

    A file with no tokenizer section gives ``tokenizer_model = "none"`` and no tokens.
    """
    model = str(meta.get("tokenizer.ggml.model", "none"))
    pre = meta.get("tokenizer.ggml.pre")
    pre = str(pre) if pre is not None else None
    vtype = _VOCAB_TYPES.get(model, f"unknown ({model})")
    tokens = meta.get("tokenizer.ggml.tokens")
    tokens = tokens if isinstance(tokens, ArrayRef) and tokens.offsets is not None else None
    n = tokens.count if tokens is not None else _nonneg_int(meta.arch_key("vocab_size")) or 0

    def special(key: str, default: int | None) -> int | None:
        # llama.cpp disables a default id out of range, and keeps the default when the
        # stored id is out of range.
        if default is not None and default >= n:
            default = None
        v = _nonneg_int(meta.get(f"tokenizer.ggml.{key}"))
        return v if v is not None and v < n else default

    d_bos, d_eos = _DEFAULT_SPECIAL.get(model, (None, None))
    if vtype == "bpe" and pre in _BPE_NO_BOS_PRE:
        d_bos = None
    bos = special("bos_token_id", d_bos)
    eos = special("eos_token_id", d_eos)
    eot = special("eot_token_id", None)
    eom = special("eom_token_id", None)
    pad = special("padding_token_id", None)
    add_bos_default = {"spm": True, "wpm": True}.get(
        vtype, vtype == "bpe" and pre in _BPE_ADD_BOS_PRE
    )
    add_eos_default = vtype == "ugm"
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    add_eos = meta.get("tokenizer.ggml.add_eos_token")
    add_bos = bool(add_bos) if isinstance(add_bos, bool) else add_bos_default
    if pre == "gemma4":
        add_bos = True
    add_eos = bool(add_eos) if isinstance(add_eos, bool) else add_eos_default
    eog = {t for t in (eos, eot, eom) if t is not None}
    if tokens is not None:
        eog |= _ids_with_texts(meta, tokens, EOG_TEXTS)
    merges = meta.get("tokenizer.ggml.merges")
    specials = {t for t in (bos, eos, eot, eom, pad, *eog) if t is not None}
    texts = (
        {t: meta.string_at(tokens, t).decode("utf-8", errors="replace") for t in specials}
        if tokens is not None
        else {}
    )
    return VocabInfo(
        path=meta.path,
        architecture=meta.architecture,
        tokenizer_model=model,
        vocab_type=vtype,
        pre=pre,
        n_tokens=n,
        bos=bos,
        eos=eos,
        eot=eot,
        eom=eom,
        pad=pad,
        add_bos=add_bos,
        add_eos=add_eos,
        eog_ids=tuple(sorted(eog)),
        n_merges=merges.count if isinstance(merges, ArrayRef) else 0,
        meta=meta,
        tokens=tokens,
        special_texts=texts,
        findings=tuple(vocab_findings(meta, bos=bos, eos=eos, add_bos=add_bos, add_eos=add_eos)),
    )


def _nonneg_int(v: Any) -> int | None:
    """``v`` when it is a non-negative int (not a bool), else None."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def vocab_findings(
    meta: GGUFMetadata,
    *,
    bos: int | None = None,
    eos: int | None = None,
    add_bos: bool = False,
    add_eos: bool = False,
) -> list[Finding]:
    """What llama.cpp refuses (``error``) or warns about (``warning``) in a file's
    tokenizer section, in the order ``llama_vocab::impl::load`` (src/llama-vocab.cpp)
    checks it; ``bos``/``eos``/``add_bos``/``add_eos`` are the effective values
    (:func:`read_vocab`).

    Errors: ``tokenizer.ggml.model`` missing or unknown; a key of the wrong GGUF type (the
    special-token ids are uint32, the flags bool); a BPE vocabulary (``gpt2``,
    ``hybriddna``, ``whitespace``, ``gemma4``) without ``tokenizer.ggml.merges`` (only the
    ``kimi-k2`` pre-tokenizer goes without) or with merges that are not strings; an unknown
    BPE pre-tokenizer; a T5 ``precompiled_charsmap`` that is not bytes or whose header
    points past its end; no token list, or one that is not strings; scores or token types
    of the wrong type or shorter than the token list; two tokens with the same text
    (llama.cpp aborts); BOS or EOS to be added but absent (llama.cpp aborts when
    tokenizing). Warnings: a BPE vocabulary without a pre-tokenizer; a special-token id
    out of range (llama.cpp ignores it).
    """
    out: list[Finding] = []

    def add(sev: Severity, code: str, msg: str) -> None:
        out.append(Finding(sev, code, msg))

    def wrong_type(key: str, want: str) -> bool:
        have = meta.kv_types.get(key)
        if have is not None and have != want:
            add(
                "error",
                "key-type",
                f"{key} is {have}; llama.cpp reads it as {want} and refuses the file",
            )
            return True
        return False

    model = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.model" not in meta.kv:
        add("error", "tokenizer", "no tokenizer.ggml.model: llama.cpp needs a tokenizer")
        return out
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.token_type_count"):
        if wrong_type(key, _VOCAB_KEY_TYPES[key]):
            return out
    if model in ("none", "no_vocab"):
        wrong_type(f"{meta.architecture}.vocab_size", "uint32")
        return out
    if model not in _TOKENIZER_MODELS:
        add("error", "tokenizer", f"unknown tokenizer model {shown(model, quote=True)}")
        return out
    pre = meta.get("tokenizer.ggml.pre") or ""
    if model in _BPE_MODELS_WITH_MERGES:
        merges = meta.kv_types.get("tokenizer.ggml.merges")
        if merges is None and (model == "gemma4" or pre != "kimi-k2"):
            add(
                "error",
                "merges",
                f"a BPE vocabulary ({model}) without tokenizer.ggml.merges: llama.cpp refuses it",
            )
            return out
        if merges is not None and merges != "array[string]":
            add("error", "merges", f"tokenizer.ggml.merges is {merges}, not array[string]")
            return out
        if model == "gemma4":
            pre = "gemma4"
        if not pre:
            add(
                "warning",
                "pre-tokenizer",
                "no tokenizer.ggml.pre: llama.cpp uses 'default' and warns that generation "
                "quality will be degraded",
            )
        elif pre not in BPE_PRE_TOKENIZERS:
            add(
                "error",
                "pre-tokenizer",
                f"unknown pre-tokenizer {shown(pre, quote=True)}: this llama.cpp build refuses it",
            )
            return out
    if model == "t5" and (msg := _charsmap_problem(meta)):
        add("error", "charsmap", msg)
        return out
    for key in ("tokenizer.ggml.add_space_prefix", "tokenizer.ggml.remove_extra_whitespaces"):
        if wrong_type(key, "bool"):
            return out
    tokens_type = meta.kv_types.get("tokenizer.ggml.tokens")
    if tokens_type is None:
        add("error", "tokens", "no tokenizer.ggml.tokens: llama.cpp needs the token list")
        return out
    if tokens_type != "array[string]":
        add("error", "tokens", f"tokenizer.ggml.tokens is {tokens_type}, not array[string]")
        return out
    tokens: ArrayRef = meta.get("tokenizer.ggml.tokens")
    n = tokens.count
    for key, types in (
        ("tokenizer.ggml.scores", ("array[int32]", "array[float32]")),
        ("tokenizer.ggml.token_type", ("array[int32]",)),
    ):
        have = meta.kv_types.get(key)
        if have is None:
            continue
        if have not in types:
            add("error", "key-type", f"{key} is {have}, not {' or '.join(types)}")
            return out
        if meta.get(key).count < n:
            add("error", "key-type", f"{key} has {meta.get(key).count:,} values for {n:,} tokens")
            return out
    if dup := _duplicate_token(meta, tokens):
        add(
            "error",
            "duplicate-token",
            f"tokens {dup[0]} and {dup[1]} have the same text {dup[2]!r}: llama.cpp aborts "
            "on such a vocabulary",
        )
        return out
    for key in _SPECIAL_ID_KEYS:
        if wrong_type(key, "uint32"):
            return out
        v = meta.get(key)
        if v is not None and v >= n:
            add(
                "warning",
                "special-token",
                f"{key} is {v}, past the {n:,} tokens: llama.cpp ignores it",
            )
    for key in (
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.add_eos_token",
        "tokenizer.ggml.add_sep_token",
        "tokenizer.ggml.normalizer.lowercase",
        "tokenizer.ggml.normalizer.strip_accents",
    ):
        if wrong_type(key, "bool"):
            return out
    suppress = meta.kv_types.get("tokenizer.ggml.suppress_tokens")
    if suppress is not None and suppress != "array[int32]":
        add("error", "key-type", f"tokenizer.ggml.suppress_tokens is {suppress}, not array[int32]")
        return out
    for name, flag, token in (("BOS", add_bos, bos), ("EOS", add_eos, eos)):
        if flag and token is None:
            add(
                "error",
                "special-token",
                f"add_{name.lower()} is set but the vocabulary has no {name} token: "
                "llama.cpp aborts when it tokenizes a prompt",
            )
    return out


def _charsmap_problem(meta: GGUFMetadata) -> str | None:
    """A T5 tokenizer's precompiled_charsmap as llama.cpp checks it: bytes, a uint32 size
    of the XCDA blob first, the blob inside the array."""
    key = "tokenizer.ggml.precompiled_charsmap"
    have = meta.kv_types.get(key)
    if have is None:
        return None
    if have not in ("array[int8]", "array[uint8]"):
        return f"{key} is {have}, not an array of bytes"
    ref: ArrayRef = meta.get(key)
    if ref.count < 4:
        return f"{key} holds {ref.count} bytes, too few for its header"
    (blob,) = struct.unpack("<I", meta.span(ref, 0, 4))
    if blob + 4 >= ref.count:
        return f"{key}: its header claims {blob:,} bytes, past its end ({ref.count:,} bytes)"
    return None


def _duplicate_token(meta: GGUFMetadata, tokens: ArrayRef) -> tuple[int, int, str] | None:
    """Two ids with the same text, as llama.cpp sees them (an empty text reads as
    ``[EMPTY_<id>]``), or None. llama.cpp's ``token_to_id`` map would then be smaller than
    the token list, which ends the process (GGML_ASSERT in llama_vocab::impl::load)."""
    texts = meta.strings(tokens)
    unique = set(texts)  # ~40 ms for Qwen2.5's 151,936 tokens: the cost of this check
    if len(unique) == len(texts) and b"" not in unique:
        return None
    seen: dict[bytes, int] = {}
    for i, t in enumerate(texts):
        key = bytes(t) or f"[EMPTY_{i}]".encode()
        if key in seen:
            return seen[key], i, key.decode("utf-8", errors="replace")
        seen[key] = i
    return None


def _ids_with_texts(meta: GGUFMetadata, tokens: ArrayRef, texts: tuple[str, ...]) -> set[int]:
    """Ids whose text is exactly one of ``texts``: a byte search for each encoded element
    (length prefix + text) in the raw array, kept only where it starts an element."""
    assert tokens.offsets is not None
    raw = meta.span(tokens)
    base = tokens.offsets[0]
    offsets = tokens.offsets
    found: set[int] = set()
    for text in texts:
        b = text.encode()
        needle = struct.pack("<Q", len(b)) + b
        pos = raw.find(needle)
        while pos != -1:
            i = bisect.bisect_left(offsets, base + pos, 0, tokens.count)
            if i < tokens.count and offsets[i] == base + pos:
                found.add(i)
            pos = raw.find(needle, pos + 1)
    return found


@dataclasses.dataclass(frozen=True)
class TokenDiff:
    """Token ids whose texts differ: how many among the ids compared, and the first one."""

    n_compared: int
    n_different: int
    first_id: int | None
    first_target: str | None
    first_draft: str | None


@dataclasses.dataclass(frozen=True)
class CompatReport:
    """The outcome of :func:`check_compatibility`.

    ``compatible`` is False when any finding is an error; ``llama_cpp_compatible`` tells
    what llama.cpp's own rules alone would have said. ``seconds`` is the check's wall time.
    """

    target: VocabInfo
    draft: VocabInfo
    findings: tuple[Finding, ...]
    token_diff: TokenDiff
    llama_cpp_compatible: bool
    seconds: float

    @property
    def compatible(self) -> bool:
        return not self.errors

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    def verdict(self) -> str:
        """The one-line conclusion."""
        t, d = self.target.path.name, self.draft.path.name
        if self.compatible:
            extra = f" ({len(self.warnings)} warning(s))" if self.warnings else ""
            return f"compatible: {d} can draft for {t}{extra}"
        return f"INCOMPATIBLE: {d} cannot draft for {t}: {self.errors[0].message}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "compatible": self.compatible,
            "llama_cpp_compatible": self.llama_cpp_compatible,
            "verdict": self.verdict(),
            "target": {
                "path": str(self.target.path),
                **_arch(self.target),
                **self.target.as_dict(),
            },
            "draft": {"path": str(self.draft.path), **_arch(self.draft), **self.draft.as_dict()},
            "findings": [dataclasses.asdict(f) for f in self.findings],
            "token_diff": dataclasses.asdict(self.token_diff),
            "seconds": round(self.seconds, 4),
        }


def _arch(v: VocabInfo) -> dict[str, Any]:
    """The architecture and what its memory holds, as facts of a report."""
    return {"architecture": v.architecture, "memory": memory_kind(v.architecture),
            "rolls_back": rolls_back(v.architecture)}  # fmt: skip


def check_compatibility(target: Path | str, draft: Path | str) -> CompatReport:
    """Can ``draft`` speculate for ``target``? Reads only the two files' metadata.

    Raises:
        ModelNotFoundError: a file does not exist.
        GGUFFormatError: a file is not a readable GGUF file (the message says why).
        ModelLoadError: llama.cpp would refuse to load a file (what
            :func:`specgguf.gguf.loadcheck.load_findings` finds, vocabulary included).
    """
    t0 = time.perf_counter()
    with GGUFMetadata.open(target) as tm, GGUFMetadata.open(draft) as dm:
        t, d = read_vocab(tm), read_vocab(dm)
        _require_loadable(tm, t)
        _require_loadable(dm, d)
        report = compare_vocabs(t, d, started=t0)
        heads = [Finding("error", code, msg) for code, msg in _head_rules(tm, dm)]
    if heads:
        report = dataclasses.replace(report, findings=(*heads, *report.findings))
    return report


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _head_rules(tm: GGUFMetadata, dm: GGUFMetadata) -> list[tuple[str, str]]:
    """(code, message) of each reason a draft head cannot be used this way: a head given
    as the target (``head-as-target``), or an EAGLE-3 head made for another target
    (``head-fit``: :func:`specgguf.gguf.arch.head_fit`)."""
    out = []
    if tm.architecture in DRAFT_HEAD_ARCHS:
        arch = tm.architecture
        out.append(("head-as-target", f"the target is {article(arch)} {arch} draft head, not a "
                    "model: it drafts for a target, as the draft"))  # fmt: skip
    layers = dm.arch_key("target_layers")
    n_layer = (_int(tm.arch_key("block_count")) or 0) - (
        _int(tm.arch_key("nextn_predict_layers")) or 0)  # fmt: skip
    fit = head_fit(
        tm.architecture, _int(tm.arch_key("embedding_length")), n_layer or None,
        dm.architecture, tuple(int(x) for x in dm.numbers(layers)) if isinstance(
            layers, ArrayRef) else (),
        head_width(dm.architecture, lambda key: _int(dm.arch_key(key))),
    )  # fmt: skip
    return out + [("head-fit", msg) for msg in fit]


def _require_loadable(meta: GGUFMetadata, vocab: VocabInfo) -> None:
    """Raise when llama.cpp would refuse the model whose first file is ``meta``.

    Raises:
        ModelLoadError: with every error of
            :func:`specgguf.gguf.loadcheck.load_findings` (and ``vocab.findings``).
        GGUFFormatError: a shard of a split model is not a readable GGUF file.
    """
    errors = [f.message for f in load_findings(meta, vocab.findings) if f.severity == "error"]
    if errors:
        raise ModelLoadError(meta.path, errors)


def _show(text: str | None) -> str:
    return "(none)" if text is None else repr(text)


def compare_vocabs(t: VocabInfo, d: VocabInfo, *, started: float | None = None) -> CompatReport:
    """Apply every rule to two vocabularies (whose files must still be open)."""
    started = time.perf_counter() if started is None else started
    out: list[Finding] = []

    def add(sev: Severity, code: str, msg: str) -> None:
        out.append(Finding(sev, code, msg))

    if not rolls_back(t.architecture):
        add("info", "replay",
            f"the target's architecture {t.architecture!r} keeps no snapshots of its "
            "recurrent state in this llama.cpp: rejected drafts are dropped by checkpoint "
            "and replay (the state is copied before each verification; after a rejection "
            "the copy comes back and the accepted drafts are decoded again)")  # fmt: skip
    for role, v in (("target", t), ("draft", d)):
        if v.tokens is None:
            add("error", "no-vocabulary", f"the {role} has no tokenizer.ggml.tokens list")

    # -- llama.cpp's rules --------------------------------------------------------------
    llama_ok = True
    if t.vocab_type != d.vocab_type:
        llama_ok = False
        add("error", "vocab-type",
            f"vocabulary types differ: target {t.vocab_type.upper()} ({t.tokenizer_model}), "
            f"draft {d.vocab_type.upper()} ({d.tokenizer_model})")  # fmt: skip
    for name, ta, da, ti, di in (
        ("bos", t.add_bos, d.add_bos, t.bos, d.bos),
        ("eos", t.add_eos, d.add_eos, t.eos, d.eos),
    ):
        flag = f"add_{name}"
        if ta != da:
            llama_ok = False
            add("error", name,
                f"{flag} differs: target {str(ta).lower()}, draft {str(da).lower()} "
                f"(one would start prompts with {name.upper()}, the other not)")  # fmt: skip
        elif ta and ti != di:
            llama_ok = False
            add("error", name,
                f"{name.upper()} ids differ with {flag} set: target {ti} {_show(t.text(ti))}, "
                f"draft {di} {_show(d.text(di))}")  # fmt: skip
    size_diff = abs(t.n_tokens - d.n_tokens)
    if size_diff > SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
        llama_ok = False
        add("error", "vocab-size",
            f"token counts differ by {size_diff:,} (target {t.n_tokens:,}, draft "
            f"{d.n_tokens:,}); llama.cpp allows at most "
            f"{SPEC_VOCAB_MAX_SIZE_DIFFERENCE}")  # fmt: skip
    diff = _token_diff(t, d)
    if diff.n_different:
        llama_ok = False
        add("error", "token-text",
            f"{diff.n_different:,} of {diff.n_compared:,} token ids compared have different "
            f"texts; the first is id {diff.first_id}: target {_show(diff.first_target)}, "
            f"draft {_show(diff.first_draft)}")  # fmt: skip

    # -- beyond llama.cpp ---------------------------------------------------------------
    if t.tokens is not None and d.tokens is not None:
        for tok in t.eog_ids:
            tt = t.text(tok)
            if tok >= d.n_tokens:
                add("error", "eog-missing",
                    f"the target's end-of-generation token {tok} {_show(tt)} does not exist "
                    f"in the draft ({d.n_tokens:,} tokens)")  # fmt: skip
            elif d.text(tok) != tt:
                add("error", "eog-text",
                    f"the target's end-of-generation token {tok} {_show(tt)} is "
                    f"{_show(d.text(tok))} in the draft")  # fmt: skip
        missing = sorted(set(t.eog_ids) - set(d.eog_ids))
        if missing and not any(f.code.startswith("eog") for f in out):
            add("warning", "eog-ids",
                "the draft does not end generation on the target's token(s) "
                + ", ".join(f"{i} {_show(t.text(i))}" for i in missing)
                + ": it may draft past the end of an answer (the target still stops)")  # fmt: skip
        if d.n_tokens > t.n_tokens:
            add("warning", "draft-extra-ids",
                f"the draft has {d.n_tokens - t.n_tokens:,} token ids "
                f"({t.n_tokens}..{d.n_tokens - 1}) the target does not have; specgguf never "
                "proposes them (their draft probability is set to zero)")  # fmt: skip
        elif t.n_tokens > d.n_tokens:
            add("info", "target-extra-ids",
                f"the target has {t.n_tokens - d.n_tokens:,} token ids "
                f"({d.n_tokens}..{t.n_tokens - 1}) the draft cannot propose")  # fmt: skip
        head = min(SPEC_VOCAB_CHECK_START_TOKEN_ID, t.n_tokens, d.n_tokens)
        differing_head = [i for i in range(head) if t.text(i) != d.text(i)]
        if differing_head:
            add("info", "head-token-text",
                f"ids below {SPEC_VOCAB_CHECK_START_TOKEN_ID} (not compared by llama.cpp) "
                f"differ: {', '.join(map(str, differing_head))}")  # fmt: skip
    same_ids = llama_ok and not any(f.code.startswith("eog") for f in out)
    if same_ids and t.pre != d.pre:
        add("warning", "pre-tokenizer",
            f"pre-tokenizers differ: target {_show(t.pre)}, draft {_show(d.pre)}; ids still "
            "match, but the draft may split text differently")  # fmt: skip
    merge_msg = _merges_differ(t, d) if same_ids else None
    if merge_msg:
        add("warning", "merges", merge_msg)

    # Errors first, in the order found.
    order = {"error": 0, "warning": 1, "info": 2}
    out.sort(key=lambda f: order[f.severity])
    return CompatReport(
        target=t,
        draft=d,
        findings=tuple(out),
        token_diff=diff,
        llama_cpp_compatible=llama_ok,
        seconds=time.perf_counter() - started,
    )


def _token_diff(t: VocabInfo, d: VocabInfo) -> TokenDiff:
    """Compare token texts from id 5 up to the smaller count (llama.cpp's range): one byte
    comparison of the two raw spans when they are identical, element by element when not."""
    lo = SPEC_VOCAB_CHECK_START_TOKEN_ID
    hi = min(t.n_tokens, d.n_tokens)
    if t.tokens is None or d.tokens is None or hi <= lo:
        return TokenDiff(0, 0, None, None, None)
    n = hi - lo
    if t.meta.span(t.tokens, lo, hi) == d.meta.span(d.tokens, lo, hi):
        return TokenDiff(n, 0, None, None, None)
    a = t.meta.strings(t.tokens, lo, hi)
    b = d.meta.strings(d.tokens, lo, hi)
    different = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    first = different[0]
    return TokenDiff(
        n,
        len(different),
        lo + first,
        bytes(a[first]).decode("utf-8", errors="replace"),
        bytes(b[first]).decode("utf-8", errors="replace"),
    )


def _merges_differ(t: VocabInfo, d: VocabInfo) -> str | None:
    if t.vocab_type != "bpe" or d.vocab_type != "bpe":
        return None
    tm, dm = t.meta.get("tokenizer.ggml.merges"), d.meta.get("tokenizer.ggml.merges")
    if not isinstance(tm, ArrayRef) or not isinstance(dm, ArrayRef):
        return None if tm is None and dm is None else "only one model has BPE merges"
    if tm.count == dm.count and t.meta.span(tm) == d.meta.span(dm):
        return None
    a, b = t.meta.strings(tm), d.meta.strings(dm)
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    where = (
        f"first difference at merge {first}"
        if first is not None
        else f"one list extends the other ({tm.count:,} vs {dm.count:,})"
    )
    return (
        f"BPE merges differ (target {tm.count:,}, draft {dm.count:,}; {where}): ids match, "
        "but the draft may split text differently"
    )
