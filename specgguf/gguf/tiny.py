"""Tiny, real GGUF models for tests and experiments, written with gguf-py's ``GGUFWriter``.

Each model is a llama-architecture transformer (2 layers, n_embd 64) with deterministic
weights drawn from a seed, and a real tokenizer section: a byte-level BPE vocabulary
(``tokenizer.ggml.model = gpt2``, 256 byte tokens + merges learned from a small built-in
corpus + ChatML control tokens) or a SentencePiece one (``llama``). llama.cpp loads such a
file in milliseconds and generates from it, so every test run exercises the real loading
and decoding code.

Variants (``FIXTURES``) cover what the other parts of specgguf need: a target, a draft
identical to it, a draft that agrees only partly, drafts whose vocabularies are
incompatible in one specific way each, and a split model. ``scripts/make-tiny-models``
writes them all into a folder.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections import Counter
from collections.abc import Iterable
from functools import cache
from pathlib import Path

# GGUF keys are spelled as in GGUF through gguf-py's constants.
import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter, TokenType
from gguf.gguf_writer import GGUFValue

_CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun, and the fox
runs into the forest. A speculative decoder drafts a few tokens with a small model and
the large model verifies them in one batch. When the draft agrees with the target, the
tokens are accepted; when it does not, the target's own token replaces the first wrong
one. This keeps the output exactly the same as the target alone would produce.
def is_palindrome(text: str) -> bool:
    cleaned = [c.lower() for c in text if c.isalnum()]
    return cleaned == cleaned[::-1]

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))
Speculative decoding makes local inference faster. The target model and the draft model
share one vocabulary, so their token ids mean the same strings. Tokens per second and
the acceptance rate tell how well the draft predicts the target. Caf\u00e9, na\u00efve,
r\u00e9sum\u00e9, \u00fcber, stra\u00dfe, \u65e5\u672c\u8a9e,
\U0001f600 and \U0001f680 are here too.
"""

# GPT-2's byte-to-unicode table: every byte becomes a printable character, so byte-level
# BPE token texts are valid strings (used by llama.cpp's BPE tokenizer in llama-vocab.cpp).


@cache
def _bytes_to_unicode() -> dict[int, str]:
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


_GPT2_SPLIT = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|\s+""")


def _learn_merges(words: Iterable[tuple[str, ...]], n_merges: int) -> list[tuple[str, str]]:
    """Plain BPE training (Sennrich et al. 2016): repeatedly merge the most frequent pair."""
    vocab = Counter(words)
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, freq in vocab.items():
            for a, b in itertools.pairwise(word):
                pairs[a, b] += freq
        if not pairs:
            break
        # Most frequent, ties broken by the pair itself so that the result is deterministic.
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        new_vocab: Counter[tuple[str, ...]] = Counter()
        for word, freq in vocab.items():
            out: list[str] = []
            i = 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            new_vocab[tuple(out)] += freq
        vocab = new_vocab
    return merges


CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclasses.dataclass(frozen=True)
class Vocab:
    """A tokenizer section: token texts, types, and (BPE) merges or (SPM) scores."""

    model: str  # tokenizer.ggml.model: "gpt2" or "llama"
    pre: str | None  # tokenizer.ggml.pre
    tokens: tuple[str, ...]
    types: tuple[int, ...]
    merges: tuple[str, ...] = ()
    scores: tuple[float, ...] = ()
    bos: int = 0
    eos: int = 0
    eot: int | None = None
    pad: int | None = None
    unk: int | None = None
    add_bos: bool = False
    add_eos: bool = False


@cache
def gpt2_vocab(n_merges: int = 253) -> Vocab:
    """Byte-level BPE vocabulary: 256 byte tokens, ``n_merges`` merges, 3 control tokens.

    Layout (ids): 0..2 ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``; 3..258 the 256
    bytes; then one token per merge. 512 tokens with the default ``n_merges``.
    """
    b2u = _bytes_to_unicode()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    byte_tokens = [b2u[b] for b in range(256)]
    words = [tuple(b2u[b] for b in piece.encode("utf-8")) for piece in _GPT2_SPLIT.findall(_CORPUS)]
    merges = _learn_merges(words, n_merges)
    tokens = specials + byte_tokens + [a + b for a, b in merges]
    if len(set(tokens)) != len(tokens):  # pragma: no cover - guards the corpus above
        raise AssertionError("duplicate token texts in the tiny BPE vocabulary")
    types = [int(TokenType.CONTROL)] * 3 + [int(TokenType.NORMAL)] * (len(tokens) - 3)
    return Vocab(
        model="gpt2",
        pre="gpt-2",
        tokens=tuple(tokens),
        types=tuple(types),
        merges=tuple(f"{a} {b}" for a, b in merges),
        bos=0,
        eos=0,
        eot=2,
        pad=0,
        add_bos=False,
    )


@cache
def spm_vocab(n_pieces: int = 200) -> Vocab:
    """SentencePiece (``llama``) vocabulary: ``<unk> <s> </s>``, 256 byte-fallback tokens,
    the corpus's characters, then merged pieces scored by merge order."""
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    text = "\u2581" + _CORPUS.replace(" ", "\u2581").replace("\n", "\u2581")
    chars = sorted({c for c in text if c not in "\t"})
    words = [tuple(w) for w in re.findall("\u2581?[^\u2581]+", text)]
    merges = _learn_merges(words, n_pieces)
    pieces = list(chars)
    for a, b in merges:
        if a + b not in pieces:
            pieces.append(a + b)
    tokens = specials + byte_tokens + pieces
    types = (
        [int(TokenType.UNKNOWN), int(TokenType.CONTROL), int(TokenType.CONTROL)]
        + [int(TokenType.BYTE)] * 256
        + [int(TokenType.NORMAL)] * len(pieces)
    )
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(pieces))]
    return Vocab(
        model="llama",
        pre="default",
        tokens=tuple(tokens),
        types=tuple(types),
        scores=tuple(scores),
        bos=1,
        eos=2,
        unk=0,
        add_bos=True,
    )


@dataclasses.dataclass(frozen=True)
class TinySpec:
    """What to write: the vocabulary, the shape of the network and its weights.

    ``perturb`` adds Gaussian noise of that standard deviation (relative to each weight
    tensor's own scale) to the weights drawn from ``seed``, with a second seed
    ``perturb_seed``: 0 gives the exact target weights, a small value a draft that agrees
    with the target most of the time.
    """

    vocab: Vocab
    name: str = "tiny target"
    seed: int = 1234
    perturb: float = 0.0
    perturb_seed: int = 99
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_layer: int = 2
    n_ctx_train: int = 1024
    logit_scale: float = 0.6
    quant: GGMLQuantizationType = GGMLQuantizationType.Q8_0
    extra_padding_tokens: int = 0
    chat_template: str | None = CHATML_TEMPLATE
    architecture: str = "llama"
    split_max_tensors: int = 0
    #: Variants for tests of what llama.cpp refuses, applied after everything else is
    #: added: keys left out, keys added or replaced as (key, value, GGUF type, element type
    #: of an array or None), tensors left out.
    drop_keys: frozenset[str] = frozenset()
    set_keys: tuple[tuple[str, object, GGUFValueType, GGUFValueType | None], ...] = ()
    drop_tensors: frozenset[str] = frozenset()


def _tensors(spec: TinySpec, n_vocab: int) -> list[tuple[str, np.ndarray]]:
    """The llama-architecture tensors, float32, shapes in numpy order (rows, columns)."""
    rng = np.random.default_rng(spec.seed)
    noise = np.random.default_rng(spec.perturb_seed)
    d, dff, hd = spec.n_embd, spec.n_ff, spec.n_embd // spec.n_head
    dkv = hd * spec.n_head_kv

    def w(shape: tuple[int, ...], scale: float) -> np.ndarray:
        x = rng.standard_normal(shape).astype(np.float32) * scale
        if spec.perturb:
            x += noise.standard_normal(shape).astype(np.float32) * scale * spec.perturb
        return x

    base_vocab = n_vocab - spec.extra_padding_tokens
    emb = w((base_vocab, d), 1.0)
    out = w((base_vocab, d), spec.logit_scale)
    if spec.extra_padding_tokens:
        # Padding rows: embeddings that are never looked up and logits far below the rest,
        # as in real models whose vocabulary is padded to a round number.
        pad = spec.extra_padding_tokens
        emb = np.concatenate([emb, np.zeros((pad, d), np.float32)])
        out = np.concatenate([out, np.zeros((pad, d), np.float32)])
    ts: list[tuple[str, np.ndarray]] = [("token_embd.weight", emb)]
    for i in range(spec.n_layer):
        ts += [
            (f"blk.{i}.attn_norm.weight", np.ones(d, np.float32)),
            (f"blk.{i}.attn_q.weight", w((d, d), d**-0.5)),
            (f"blk.{i}.attn_k.weight", w((dkv, d), d**-0.5)),
            (f"blk.{i}.attn_v.weight", w((dkv, d), d**-0.5)),
            (f"blk.{i}.attn_output.weight", w((d, d), d**-0.5)),
            (f"blk.{i}.ffn_norm.weight", np.ones(d, np.float32)),
            (f"blk.{i}.ffn_gate.weight", w((dff, d), d**-0.5)),
            (f"blk.{i}.ffn_up.weight", w((dff, d), d**-0.5)),
            (f"blk.{i}.ffn_down.weight", w((d, dff), dff**-0.5)),
        ]
    ts += [("output_norm.weight", np.ones(d, np.float32)), ("output.weight", out)]
    return ts


def write_tiny_model(path: Path, spec: TinySpec) -> list[Path]:
    """Write ``spec`` as a GGUF file at ``path``; returns the files written (several when
    ``spec.split_max_tensors`` splits it into ``-0000i-of-0000n.gguf`` shards, whose first
    one is then the path to load).

    Raises:
        OSError: the file cannot be written.
    """
    v = spec.vocab
    tokens = list(v.tokens) + [f"[PAD{i}]" for i in range(spec.extra_padding_tokens)]
    types = list(v.types) + [int(TokenType.USER_DEFINED)] * spec.extra_padding_tokens
    n_vocab = len(tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, spec.architecture, split_max_tensors=spec.split_max_tensors)
    writer.add_name(spec.name)
    writer.add_size_label("tiny")
    writer.add_context_length(spec.n_ctx_train)
    writer.add_embedding_length(spec.n_embd)
    writer.add_block_count(spec.n_layer)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(spec.n_embd // spec.n_head)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(
        int(gguf.LlamaFileType.MOSTLY_Q8_0)
        if spec.quant == GGMLQuantizationType.Q8_0
        else int(gguf.LlamaFileType.ALL_F32)
    )
    writer.add_tokenizer_model(v.model)
    if v.pre is not None:
        writer.add_tokenizer_pre(v.pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if v.merges:
        writer.add_token_merges(list(v.merges))
    if v.scores:
        writer.add_token_scores(list(v.scores) + [0.0] * spec.extra_padding_tokens)
    writer.add_bos_token_id(v.bos)
    writer.add_eos_token_id(v.eos)
    if v.eot is not None:
        writer.add_eot_token_id(v.eot)
    if v.pad is not None:
        writer.add_pad_token_id(v.pad)
    if v.unk is not None:
        writer.add_unk_token_id(v.unk)
    writer.add_add_bos_token(v.add_bos)
    writer.add_add_eos_token(v.add_eos)
    if spec.chat_template is not None:
        writer.add_chat_template(spec.chat_template)
    for key in spec.drop_keys:
        writer.kv_data[0].pop(key, None)
    for key, value, vtype, sub_type in spec.set_keys:
        writer.kv_data[0][key] = GGUFValue(value=value, type=vtype, sub_type=sub_type)
    for name, arr in _tensors(spec, n_vocab):
        if name in spec.drop_tensors:
            continue
        if arr.ndim == 2 and spec.quant != GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(arr, spec.quant), raw_dtype=spec.quant)
        else:
            writer.add_tensor(name, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert writer.path is not None
    return writer.format_shard_names(path)


def _replace(v: Vocab, **changes: object) -> Vocab:
    return dataclasses.replace(v, **changes)  # type: ignore[arg-type]


def _changed_token(v: Vocab, token_id: int, text: str) -> Vocab:
    tokens = list(v.tokens)
    tokens[token_id] = text
    return _replace(v, tokens=tuple(tokens))


#: The id whose text differs in the ``draft-token-changed`` fixture.
CHANGED_TOKEN_ID = 300


def fixture_specs() -> dict[str, TinySpec]:
    """Every tiny fixture, by file stem. See the module docstring for what each is for."""
    bpe = gpt2_vocab()
    target = TinySpec(vocab=bpe, name="tiny target")
    return {
        "target": target,
        "draft-identical": dataclasses.replace(target, name="tiny draft identical"),
        "draft-partial": dataclasses.replace(target, name="tiny draft partial", perturb=0.35),
        "draft-spm": TinySpec(vocab=spm_vocab(), name="tiny draft spm"),
        "draft-token-changed": dataclasses.replace(
            target,
            name="tiny draft token changed",
            vocab=_changed_token(bpe, CHANGED_TOKEN_ID, "\u0120CHANGED"),
        ),
        "draft-bos-id": dataclasses.replace(
            target,
            name="tiny draft bos id",
            vocab=_replace(bpe, bos=1, add_bos=True),
        ),
        "target-add-bos": dataclasses.replace(
            target, name="tiny target add bos", vocab=_replace(bpe, add_bos=True)
        ),
        "draft-add-bos": dataclasses.replace(
            target, name="tiny draft add bos", vocab=_replace(bpe, add_bos=True)
        ),
        "draft-pad128": dataclasses.replace(
            target, name="tiny draft pad128", extra_padding_tokens=128
        ),
        "draft-pad129": dataclasses.replace(
            target, name="tiny draft pad129", extra_padding_tokens=129
        ),
        "split": dataclasses.replace(target, name="tiny split", split_max_tensors=8),
        "spm-target": TinySpec(vocab=spm_vocab(), name="tiny spm target", chat_template=None),
    }


def write_fixtures(folder: Path, names: Iterable[str] | None = None) -> dict[str, Path]:
    """Write the tiny fixtures into ``folder``; returns the path to load for each name
    (for the split model, its first shard)."""
    specs = fixture_specs()
    out: dict[str, Path] = {}
    for name in names if names is not None else specs:
        files = write_tiny_model(folder / f"tiny-{name}.gguf", specs[name])
        out[name] = files[0]
    return out
