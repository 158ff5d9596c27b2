"""Tiny, real GGUF models for tests and experiments, written with gguf-py's ``GGUFWriter``.

Each model has deterministic weights drawn from a seed and a real tokenizer section: a
byte-level BPE vocabulary (``tokenizer.ggml.model = gpt2``, 256 byte tokens + merges learned
from a small built-in corpus + ChatML control tokens) or a SentencePiece one (``llama``).
llama.cpp loads such a file in milliseconds and generates from it, so every test run
exercises the real loading and decoding code. Three architectures (``TinySpec.architecture``):

- ``llama``: a transformer (2 layers, n_embd 64); any other name not below gets its
  tensors and keys too (files for metadata-only tests; ``qwen2vl``, Qwen2-VL's text
  model, with M-RoPE's sections besides, which llama.cpp loads and runs);
- ``qwen35``: Qwen3.5's hybrid of gated delta-net (linear attention, recurrent state) and
  gated full-attention layers, every ``full_attention_interval``-th layer attention,
  optionally with MTP (NextN) blocks after the trunk (``nextn_layers``);
- ``mamba2``: purely recurrent (Mamba-2 SSM layers, no KV cache).

Variants (``FIXTURES``) cover what the other parts of specgguf need: a target, a draft
identical to it, a draft that agrees only partly, drafts whose vocabularies are
incompatible in one specific way each, a split model, and models with recurrent state
that share the target's vocabulary: ``hybrid`` (qwen35), ``hybrid-draft`` (its first two
layers, perturbed), ``recurrent`` (mamba2) and ``mtp`` (``hybrid`` with small layers, plus
one MTP block whose drafts the target accepts only sometimes).
``scripts/make-tiny-models`` writes them all into a folder.
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
    #: qwen35: layer i is full attention when (i + 1) is a multiple of this, else a gated
    #: delta-net (recurrent) layer; ``nextn_layers`` MTP blocks follow the ``n_layer``
    #: trunk layers (``block_count`` counts both, as in llama.cpp).
    full_attention_interval: int = 2
    nextn_layers: int = 0
    #: qwen3vl: how many of its first layers add an image's "deepstack" rows (its input
    #: rows are then as wide as ``n_embd`` times one more than this)
    deepstack_layers: int = 0
    #: The recurrent layers' shapes (qwen35 and mamba2): the ``ssm.*`` keys of llama.cpp
    #: (``ssm_dt_rank``: the number of heads, the value heads of qwen35).
    ssm_d_conv: int = 4
    ssm_d_state: int = 16
    ssm_d_inner: int = 64
    ssm_n_group: int = 2
    ssm_dt_rank: int = 4
    #: qwen35: a factor on the output projections of every block (``attn_output``,
    #: ``ssm_out``, ``ffn_down``, trunk and MTP alike). Small, each block adds little to
    #: the residual stream, so the next token depends mostly on the current one.
    layer_scale: float = 1.0
    #: qwen35 MTP blocks: None draws ``nextn.eh_proj`` at random; ``(e, h, r)`` makes it
    #: ``e * [I | 0] + h * [0 | I] + r * (the random draw)``, i.e. it reads mostly the
    #: normalised token embedding (the first half of its input in llama.cpp) when ``e``
    #: dominates.
    nextn_eh_proj: tuple[float, float, float] | None = None
    #: eagle3 (a draft head, llama.cpp's ``draft-eagle3``): the target's layers whose
    #: inputs it reads (``eagle3.target_layers``, three), the target's width, the size of
    #: its own reduced vocabulary mapped onto the target's by ``d2t`` (0: none, the
    #: target's), and whether it carries its own token embeddings and LM head (else it
    #: uses the target's, through llama.cpp's ``ctx_other``).
    target_layers: tuple[int, ...] = ()
    target_hidden: int = 0
    draft_vocab: int = 0
    own_embeddings: bool = True
    #: dflash (a block-diffusion draft, llama.cpp's ``draft-dflash``): ``target_layers``
    #: (any number) of a target as wide as itself, the trained block size
    #: (``dflash.block_size``: it drafts at most one less) and its mask token's id
    #: (``tokenizer.ggml.mask_token_id``); ``draft_vocab`` and ``own_embeddings`` as above.
    block_size: int = 0
    mask_token: int = 0
    #: dflash: rope sections [n_rot / 2, 0, 0, 0], which make llama.cpp run it with M-RoPE
    #: (as the drafts for qwen35 targets are written)
    mrope: bool = False
    #: dflash as DSpark (llama.cpp's ``draft-dspark``): the rank of its Markov head
    #: (``markov_w1``, ``markov_w2``; 0: none, plain DFlash), whether it has a confidence
    #: head (``conf_proj``), and ``dflash.sample_from_anchor`` (None: no key, which
    #: llama.cpp reads as true: block row 0 predicts, a block of K drafts K tokens)
    markov_rank: int = 0
    confidence_head: bool = False
    sample_from_anchor: bool | None = None
    #: dflash as DFlash2 (a selector): the selector's top-k and rank (0: none) and each
    #: layer's convolution over the block (``dflash.conv_kernel_size``, ``conv_group_size``)
    selector_top_k: int = 0
    selector_rank: int = 0
    conv_kernel: int = 0
    conv_group: int = 0
    #: gemma4 and gemma4-assistant: which layers use sliding-window attention (as many as
    #: ``n_layer``), and the assistant's own width (its ``embedding_length``; the target's,
    #: ``n_embd``, is its ``embedding_length_out``)
    gemma4_swa: tuple[bool, ...] = ()
    assistant_embd: int = 0
    #: Variants for tests of what llama.cpp refuses, applied after everything else is
    #: added: keys left out, keys added or replaced as (key, value, GGUF type, element type
    #: of an array or None), tensors left out.
    drop_keys: frozenset[str] = frozenset()
    set_keys: tuple[tuple[str, object, GGUFValueType, GGUFValueType | None], ...] = ()
    drop_tensors: frozenset[str] = frozenset()
    #: tensors added (float32 zeros of these shapes, numpy order) by name
    add_tensors: tuple[tuple[str, tuple[int, ...]], ...] = ()


class _Weights:
    """Deterministic weights: Gaussian ones from ``spec.seed``, perturbed by
    ``spec.perturb`` (see :class:`TinySpec`), and other draws from the same generator."""

    def __init__(self, spec: TinySpec) -> None:
        self.rng = np.random.default_rng(spec.seed)
        self.noise = np.random.default_rng(spec.perturb_seed)
        self.perturb = spec.perturb

    def normal(self, shape: tuple[int, ...], scale: float) -> np.ndarray:
        x = self.rng.standard_normal(shape).astype(np.float32) * scale
        if self.perturb:
            x += self.noise.standard_normal(shape).astype(np.float32) * scale * self.perturb
        return x

    def uniform(self, shape: tuple[int, ...], low: float, high: float) -> np.ndarray:
        return self.rng.uniform(low, high, shape).astype(np.float32)


def _ones(*shape: int) -> np.ndarray:
    return np.ones(shape, np.float32)


def _embeddings(spec: TinySpec, n_vocab: int, w: _Weights) -> tuple[np.ndarray, np.ndarray]:
    """``token_embd`` and ``output``, with the padding rows of ``extra_padding_tokens``."""
    d = spec.n_embd
    base_vocab = n_vocab - spec.extra_padding_tokens
    emb = w.normal((base_vocab, d), 1.0)
    out = w.normal((base_vocab, d), spec.logit_scale)
    if spec.extra_padding_tokens:
        # Padding rows: embeddings that are never looked up and logits far below the rest,
        # as in real models whose vocabulary is padded to a round number.
        pad = spec.extra_padding_tokens
        emb = np.concatenate([emb, np.zeros((pad, d), np.float32)])
        out = np.concatenate([out, np.zeros((pad, d), np.float32)])
    return emb, out


def _ffn(
    spec: TinySpec, w: _Weights, p: str, out_scale: float = 1.0
) -> list[tuple[str, np.ndarray]]:
    """SwiGLU feed-forward; ``out_scale`` multiplies ``ffn_down`` (``TinySpec.layer_scale``)."""
    d, dff = spec.n_embd, spec.n_ff
    return [
        (f"{p}.ffn_gate.weight", w.normal((dff, d), d**-0.5)),
        (f"{p}.ffn_up.weight", w.normal((dff, d), d**-0.5)),
        (f"{p}.ffn_down.weight", w.normal((d, dff), dff**-0.5 * out_scale)),
    ]


def _llama_tensors(spec: TinySpec, n_vocab: int) -> list[tuple[str, np.ndarray]]:
    w = _Weights(spec)
    d, hd = spec.n_embd, spec.n_embd // spec.n_head
    dkv = hd * spec.n_head_kv
    emb, out = _embeddings(spec, n_vocab, w)
    ts: list[tuple[str, np.ndarray]] = [("token_embd.weight", emb)]
    for i in range(spec.n_layer):
        p = f"blk.{i}"
        ts += [
            (f"{p}.attn_norm.weight", _ones(d)),
            (f"{p}.attn_q.weight", w.normal((d, d), d**-0.5)),
            (f"{p}.attn_k.weight", w.normal((dkv, d), d**-0.5)),
            (f"{p}.attn_v.weight", w.normal((dkv, d), d**-0.5)),
            (f"{p}.attn_output.weight", w.normal((d, d), d**-0.5)),
            (f"{p}.ffn_norm.weight", _ones(d)),
            *_ffn(spec, w, p),
        ]
    ts += [("output_norm.weight", _ones(d)), ("output.weight", out)]
    return ts


def _qwen35_is_recurrent(spec: TinySpec, il: int) -> bool:
    """As llama.cpp's qwen35 loader decides from ``full_attention_interval``."""
    return (il + 1) % spec.full_attention_interval != 0


def _qwen35_attention(
    spec: TinySpec, w: _Weights, p: str, out_scale: float = 1.0
) -> list[tuple[str, np.ndarray]]:
    """Gated full attention: ``attn_q`` projects to query and gate (twice n_head heads);
    ``out_scale`` multiplies ``attn_output``."""
    d, hd = spec.n_embd, spec.n_embd // spec.n_head
    dkv = hd * spec.n_head_kv
    return [
        (f"{p}.attn_q.weight", w.normal((2 * hd * spec.n_head, d), d**-0.5)),
        (f"{p}.attn_k.weight", w.normal((dkv, d), d**-0.5)),
        (f"{p}.attn_v.weight", w.normal((dkv, d), d**-0.5)),
        (
            f"{p}.attn_output.weight",
            w.normal((d, hd * spec.n_head), (hd * spec.n_head) ** -0.5 * out_scale),
        ),
        (f"{p}.attn_q_norm.weight", _ones(hd)),
        (f"{p}.attn_k_norm.weight", _ones(hd)),
    ]


def _qwen35_delta_net(
    spec: TinySpec, w: _Weights, p: str, out_scale: float = 1.0
) -> list[tuple[str, np.ndarray]]:
    """Gated delta-net: ``ssm_n_group`` key heads, ``ssm_dt_rank`` value heads, each of
    ``ssm_d_state`` dimensions, a causal convolution over q, k and v; ``out_scale``
    multiplies ``ssm_out``."""
    d, n_v = spec.n_embd, spec.ssm_dt_rank
    key_dim, value_dim = spec.ssm_d_state * spec.ssm_n_group, spec.ssm_d_inner
    conv_dim = 2 * key_dim + value_dim
    return [
        (f"{p}.attn_qkv.weight", w.normal((conv_dim, d), d**-0.5)),
        (f"{p}.attn_gate.weight", w.normal((value_dim, d), d**-0.5)),
        (f"{p}.ssm_conv1d.weight", w.normal((conv_dim, spec.ssm_d_conv), spec.ssm_d_conv**-0.5)),
        # softplus(alpha + dt) * a is the log of each head's decay per token: a < 0, dt
        # around the inverse softplus of 0.001..0.1 as in the model's initialisation.
        (f"{p}.ssm_dt.bias", np.log(np.expm1(w.uniform((n_v,), 0.001, 0.1)))),
        (f"{p}.ssm_a", -w.uniform((n_v,), 1.0, 16.0)),
        (f"{p}.ssm_beta.weight", w.normal((n_v, d), d**-0.5)),
        (f"{p}.ssm_alpha.weight", w.normal((n_v, d), d**-0.5)),
        (f"{p}.ssm_norm.weight", _ones(spec.ssm_d_state)),
        (f"{p}.ssm_out.weight", w.normal((d, value_dim), value_dim**-0.5 * out_scale)),
    ]


def _eh_proj(spec: TinySpec, w: _Weights) -> np.ndarray:
    """``nextn.eh_proj`` (see ``TinySpec.nextn_eh_proj``): llama.cpp's MTP graph
    (src/models/qwen35.cpp) multiplies it by concat(enorm(embedding), hnorm(hidden))."""
    d = spec.n_embd
    x = w.normal((d, 2 * d), (2 * d) ** -0.5)
    if spec.nextn_eh_proj is None:
        return x
    e, h, r = spec.nextn_eh_proj
    eye = np.eye(d, dtype=np.float32)
    return np.concatenate([eye * e, eye * h], axis=1) + x * r


def _qwen35_tensors(spec: TinySpec, n_vocab: int) -> list[tuple[str, np.ndarray]]:
    """Trunk layers first, then the MTP blocks (``blk.{n_layer + j}``): each an attention
    layer plus ``nextn.*`` (the projection of the normalised token embedding and hidden
    state, and the norm before the shared LM head)."""
    w = _Weights(spec)
    d = spec.n_embd
    emb, out = _embeddings(spec, n_vocab, w)
    ts: list[tuple[str, np.ndarray]] = [("token_embd.weight", emb)]
    for i in range(spec.n_layer):
        p = f"blk.{i}"
        ts += [(f"{p}.attn_norm.weight", _ones(d)), (f"{p}.post_attention_norm.weight", _ones(d))]
        if _qwen35_is_recurrent(spec, i):
            ts += _qwen35_delta_net(spec, w, p, spec.layer_scale)
        else:
            ts += _qwen35_attention(spec, w, p, spec.layer_scale)
        ts += _ffn(spec, w, p, spec.layer_scale)
    for i in range(spec.n_layer, spec.n_layer + spec.nextn_layers):
        p = f"blk.{i}"
        ts += [
            (f"{p}.attn_norm.weight", _ones(d)),
            (f"{p}.post_attention_norm.weight", _ones(d)),
            *_qwen35_attention(spec, w, p, spec.layer_scale),
            *_ffn(spec, w, p, spec.layer_scale),
            (f"{p}.nextn.eh_proj.weight", _eh_proj(spec, w)),
            (f"{p}.nextn.enorm.weight", _ones(d)),
            (f"{p}.nextn.hnorm.weight", _ones(d)),
            (f"{p}.nextn.shared_head_norm.weight", _ones(d)),
        ]
    ts += [("output_norm.weight", _ones(d)), ("output.weight", out)]
    return ts


def _hy_v3_tensors(spec: TinySpec, n_vocab: int) -> list[tuple[str, np.ndarray]]:
    """Hunyuan V3 (src/models/hy-v3.cpp) with dense FFNs (its leading dense blocks' kind:
    no expert router): llama's layers with Q/K norms, then the MTP blocks, each a whole
    decoder layer plus ``nextn.*``; llama.cpp chains several of them
    (``llama_set_nextn_layer_offset``)."""
    w = _Weights(spec)
    d, hd = spec.n_embd, spec.n_embd // spec.n_head
    dkv = hd * spec.n_head_kv
    emb, out = _embeddings(spec, n_vocab, w)
    ts: list[tuple[str, np.ndarray]] = [("token_embd.weight", emb)]
    for i in range(spec.n_layer + spec.nextn_layers):
        p = f"blk.{i}"
        ts += [
            (f"{p}.attn_norm.weight", _ones(d)),
            (f"{p}.attn_q.weight", w.normal((d, d), d**-0.5)),
            (f"{p}.attn_k.weight", w.normal((dkv, d), d**-0.5)),
            (f"{p}.attn_v.weight", w.normal((dkv, d), d**-0.5)),
            (f"{p}.attn_output.weight", w.normal((d, d), d**-0.5)),
            (f"{p}.attn_q_norm.weight", _ones(hd)),
            (f"{p}.attn_k_norm.weight", _ones(hd)),
            (f"{p}.ffn_norm.weight", _ones(d)),
            *_ffn(spec, w, p),
        ]
        if i >= spec.n_layer:
            ts += [
                (f"{p}.nextn.eh_proj.weight", _eh_proj(spec, w)),
                (f"{p}.nextn.enorm.weight", _ones(d)),
                (f"{p}.nextn.hnorm.weight", _ones(d)),
                (f"{p}.nextn.shared_head_norm.weight", _ones(d)),
            ]
    ts += [("output_norm.weight", _ones(d)), ("output.weight", out)]
    return ts


def _mamba2_tensors(spec: TinySpec, n_vocab: int) -> list[tuple[str, np.ndarray]]:
    """Mamba-2 layers: ``ssm_in`` projects to z, x, B, C and dt (``ssm_dt_rank`` heads of
    ``ssm_d_inner / ssm_dt_rank`` dimensions, ``ssm_n_group`` groups of B and C)."""
    w = _Weights(spec)
    d, d_inner, n_head, k_conv = spec.n_embd, spec.ssm_d_inner, spec.ssm_dt_rank, spec.ssm_d_conv
    conv_dim = d_inner + 2 * spec.ssm_n_group * spec.ssm_d_state
    emb, out = _embeddings(spec, n_vocab, w)
    ts: list[tuple[str, np.ndarray]] = [("token_embd.weight", emb)]
    for i in range(spec.n_layer):
        p = f"blk.{i}"
        ts += [
            (f"{p}.attn_norm.weight", _ones(d)),
            (f"{p}.ssm_in.weight", w.normal((d_inner + conv_dim + n_head, d), d**-0.5)),
            (f"{p}.ssm_conv1d.weight", w.normal((conv_dim, k_conv), k_conv**-0.5)),
            (f"{p}.ssm_conv1d.bias", np.zeros(conv_dim, np.float32)),
            (f"{p}.ssm_dt.bias", np.log(np.expm1(w.uniform((n_head,), 0.001, 0.1)))),
            (f"{p}.ssm_a", -w.uniform((n_head, 1), 1.0, 16.0)),
            (f"{p}.ssm_d", _ones(n_head, 1)),
            (f"{p}.ssm_norm.weight", _ones(spec.ssm_n_group, d_inner // spec.ssm_n_group)),
            (f"{p}.ssm_out.weight", w.normal((d, d_inner), d_inner**-0.5)),
        ]
    ts += [("output_norm.weight", _ones(d)), ("output.weight", out)]
    return ts


def _eagle3_tensors(spec: TinySpec, n_vocab: int) -> list[tuple[str, np.ndarray]]:
    """One decoder layer whose attention reads concat(norm(token embedding), norm(g)),
    g = ``fc`` of the target's three layer inputs (src/models/eagle3.cpp); the LM head over
    ``draft_vocab`` ids mapped by ``d2t`` (int64 target ids) when it is set."""
    w = _Weights(spec)
    d, hd = spec.n_embd, spec.n_embd // spec.n_head
    dkv = hd * spec.n_head_kv
    emb, out = _embeddings(spec, n_vocab, w)
    ts: list[tuple[str, np.ndarray]] = []
    if spec.own_embeddings:
        ts.append(("token_embd.weight", emb))
    wide = 3 * spec.target_hidden
    ts += [
        ("fc.weight", w.normal((d, wide), wide**-0.5)),
        ("blk.0.attn_norm.weight", _ones(d)),
        ("blk.0.attn_norm_2.weight", _ones(d)),
        ("blk.0.attn_q.weight", w.normal((d, 2 * d), (2 * d) ** -0.5)),
        ("blk.0.attn_k.weight", w.normal((dkv, 2 * d), (2 * d) ** -0.5)),
        ("blk.0.attn_v.weight", w.normal((dkv, 2 * d), (2 * d) ** -0.5)),
        ("blk.0.attn_output.weight", w.normal((d, d), d**-0.5)),
        ("blk.0.ffn_norm.weight", _ones(d)),
        *_ffn(spec, w, "blk.0"),
        ("output_norm.weight", _ones(d)),
    ]
    if spec.draft_vocab:
        # every other id of the target's, the byte tokens first
        ids = np.arange(0, 2 * spec.draft_vocab, 2, dtype=np.int64) % n_vocab
        ts += [("output.weight", out[ids]), ("d2t", ids)]
    else:
        ts.append(("output.weight", out))
    return ts


def _dflash_tensors(spec: TinySpec, n_vocab: int) -> list[tuple[str, np.ndarray]]:
    """``fc`` of the target's layer inputs and its norm (``enc.output_norm``), whose K/V
    every layer writes into its cache at the target's positions, and ``n_layer`` decoder
    layers with Q/K norms that attend over those and the block without a causal mask
    (src/models/dflash.cpp); the LM head over ``draft_vocab`` ids mapped by ``d2t``."""
    w = _Weights(spec)
    d, hd = spec.n_embd, spec.n_embd // spec.n_head
    dkv = hd * spec.n_head_kv
    emb, out = _embeddings(spec, n_vocab, w)
    ts: list[tuple[str, np.ndarray]] = []
    if spec.own_embeddings:
        ts.append(("token_embd.weight", emb))
    wide = len(spec.target_layers) * d
    ts += [("fc.weight", w.normal((d, wide), wide**-0.5)), ("enc.output_norm.weight", _ones(d))]
    for il in range(spec.n_layer):
        p = f"blk.{il}"
        ts += [
            (f"{p}.attn_norm.weight", _ones(d)),
            (f"{p}.attn_q.weight", w.normal((d, d), d**-0.5)),
            (f"{p}.attn_k.weight", w.normal((dkv, d), d**-0.5)),
            (f"{p}.attn_v.weight", w.normal((dkv, d), d**-0.5)),
            (f"{p}.attn_output.weight", w.normal((d, d), d**-0.5)),
            (f"{p}.attn_q_norm.weight", _ones(hd)),
            (f"{p}.attn_k_norm.weight", _ones(hd)),
            (f"{p}.ffn_norm.weight", _ones(d)),
            *_ffn(spec, w, p),
        ]
        if spec.selector_top_k:
            # DFlash2: a convolution over the block before the attention and the FFN,
            # each a base kernel and coefficients projected from the row
            k, groups = spec.conv_kernel, d // spec.conv_group
            for part in ("attn", "ffn"):
                proj = w.normal((2 * k * groups, d), 0.1 * d**-0.5)
                ts += [(f"{p}.{part}_conv_base", w.normal((2, k, d), 0.1)),
                       (f"{p}.{part}_conv_proj.weight", proj)]  # fmt: skip
    ts.append(("output_norm.weight", _ones(d)))
    if spec.selector_top_k:
        r = spec.selector_rank
        ts += [("selector_predecessor.weight", w.normal((n_vocab, r), 1.0)),
               ("selector_successor.weight", w.normal((n_vocab, r), 1.0)),
               ("selector_hidden.weight", w.normal((r, d), d**-0.5))]  # fmt: skip
    if spec.draft_vocab:
        ids = np.arange(0, 2 * spec.draft_vocab, 2, dtype=np.int64) % n_vocab
        ts += [("output.weight", out[ids]), ("d2t", ids)]
    elif spec.own_embeddings:
        ts.append(("output.weight", out))
    if spec.markov_rank:
        # DSpark: a bias on each block row's logits from the row before's token,
        # w2 @ w1[token] (src/models/dflash.cpp, build_dspark_markov_head), about N(0, 1)
        r = spec.markov_rank
        n_out = spec.draft_vocab or n_vocab
        ts += [("markov_w1.weight", w.normal((n_vocab, r), 1.0)),
               ("markov_w2.weight", w.normal((n_out, r), r**-0.5))]  # fmt: skip
        if spec.confidence_head:
            ts += [("conf_proj.weight", w.normal((1, d + r), (d + r) ** -0.5)),
                   ("conf_proj.bias", np.zeros(1, np.float32))]  # fmt: skip
    return ts


def _gemma4_layer(
    spec: TinySpec, w: _Weights, p: str, d: int, n_head: int, *, kv: bool
) -> list[tuple[str, np.ndarray]]:
    """A Gemma 4 block (src/models/gemma4.cpp, gemma4-assistant.cpp): Q (and K, V) with
    their norms, post-attention and post-FFN norms, a GELU FFN; the assistant's blocks
    have no K or V (they read the target's cache) and scale their output."""
    hd = spec.n_embd // spec.n_head  # (the target's head size: the assistant reads its cache)
    dkv = hd * spec.n_head_kv
    ts = [
        (f"{p}.attn_norm.weight", _ones(d)),
        (f"{p}.attn_q.weight", w.normal((n_head * hd, d), d**-0.5)),
        (f"{p}.attn_output.weight", w.normal((d, n_head * hd), (n_head * hd) ** -0.5)),
        (f"{p}.attn_q_norm.weight", _ones(hd)),
        (f"{p}.post_attention_norm.weight", _ones(d)),
        (f"{p}.ffn_norm.weight", _ones(d)),
        (f"{p}.ffn_gate.weight", w.normal((spec.n_ff, d), d**-0.5)),
        (f"{p}.ffn_up.weight", w.normal((spec.n_ff, d), d**-0.5)),
        (f"{p}.ffn_down.weight", w.normal((d, spec.n_ff), spec.n_ff**-0.5)),
        (f"{p}.post_ffw_norm.weight", _ones(d)),
    ]
    if kv:
        ts += [
            (f"{p}.attn_k.weight", w.normal((dkv, d), d**-0.5)),
            (f"{p}.attn_v.weight", w.normal((dkv, d), d**-0.5)),
            (f"{p}.attn_k_norm.weight", _ones(hd)),
        ]
    else:
        ts.append((f"{p}.layer_output_scale.weight", np.full(1, spec.layer_scale, np.float32)))
    return ts


def _gemma4_tensors(spec: TinySpec, n_vocab: int) -> list[tuple[str, np.ndarray]]:
    """A dense Gemma 4 target without per-layer embeddings: sliding-window and full
    attention layers by ``gemma4_swa``, the LM head tied to the token embeddings."""
    w = _Weights(spec)
    d, hd = spec.n_embd, spec.n_embd // spec.n_head
    emb, _ = _embeddings(spec, n_vocab, w)
    ts = [("token_embd.weight", emb), ("output_norm.weight", _ones(d)),
          ("rope_freqs.weight", _ones(hd // 2))]  # fmt: skip
    for il in range(spec.n_layer):
        ts += _gemma4_layer(spec, w, f"blk.{il}", d, spec.n_head, kv=True)
    return ts


def _gemma4_assistant_tensors(spec: TinySpec, n_vocab: int) -> list[tuple[str, np.ndarray]]:
    """Gemma 4's MTP assistant (src/models/gemma4-assistant.cpp) of width
    ``assistant_embd`` for a target ``n_embd`` wide: (token embedding, the target's hidden
    state) projected in, ``n_layer`` blocks attending over the target's cache, its own tied
    LM head, and the hidden state projected back out."""
    w = _Weights(spec)
    d, big = spec.assistant_embd, spec.n_embd
    hd = big // spec.n_head
    ts = [
        ("token_embd.weight", w.normal((n_vocab, d), 1.0)),
        ("output_norm.weight", _ones(d)),
        ("rope_freqs.weight", _ones(hd // 2)),
        ("nextn.pre_projection.weight", w.normal((d, 2 * big), (2 * big) ** -0.5)),
        ("nextn.post_projection.weight", w.normal((big, d), d**-0.5)),
    ]
    for il in range(spec.n_layer):
        ts += _gemma4_layer(spec, w, f"blk.{il}", d, spec.n_head, kv=False)
    return ts


def _check(spec: TinySpec) -> None:
    """The shape constraints llama.cpp asserts (or silently relies on) for ``spec``."""
    if spec.nextn_layers and spec.architecture not in ("qwen35", "hy_v3"):
        raise ValueError("nextn_layers: only qwen35 and hy_v3 tiny models have MTP blocks")
    if spec.architecture == "qwen35":
        if spec.ssm_d_inner != spec.ssm_d_state * spec.ssm_dt_rank:
            raise ValueError("qwen35: ssm_d_inner must be ssm_d_state * ssm_dt_rank")
        if spec.ssm_dt_rank % spec.ssm_n_group:
            raise ValueError("qwen35: ssm_dt_rank (value heads) must be a multiple of ssm_n_group")
        if not 0 < spec.full_attention_interval <= spec.n_layer:
            raise ValueError("qwen35: full_attention_interval must be in 1..n_layer")
    if spec.architecture == "eagle3" and (
        len(spec.target_layers) != 3 or spec.n_layer != 1 or spec.target_hidden <= 0
    ):
        raise ValueError("eagle3: one layer, three target layers and the target's width")
    if spec.architecture == "dflash" and (not spec.target_layers or spec.block_size < 2):
        raise ValueError("dflash: target layers and a block of two or more")
    if spec.architecture == "mamba2" and (
        spec.ssm_d_inner % spec.ssm_dt_rank or spec.ssm_d_inner % spec.ssm_n_group
    ):
        raise ValueError("mamba2: ssm_d_inner must be a multiple of ssm_dt_rank and ssm_n_group")


def _tensors(spec: TinySpec, n_vocab: int) -> list[tuple[str, np.ndarray]]:
    """The tensors of ``spec.architecture``, float32, shapes in numpy order (rows, columns).
    Another architecture than qwen35 and mamba2 gets llama's tensors and keys under its own
    name (metadata-only tests write such files; llama.cpp may refuse to load them)."""
    _check(spec)
    return _ARCHITECTURES.get(spec.architecture, _llama_tensors)(spec, n_vocab)


_ARCHITECTURES = {"qwen35": _qwen35_tensors, "mamba2": _mamba2_tensors,
                  "eagle3": _eagle3_tensors, "dflash": _dflash_tensors,
                  "hy_v3": _hy_v3_tensors, "qwen3vl": _hy_v3_tensors,
                  "gemma4": _gemma4_tensors,
                  "gemma4-assistant": _gemma4_assistant_tensors}  # fmt: skip

#: Tensors kept in float32 whatever ``TinySpec.quant`` says (as llama.cpp's converter
#: does: the SSM kernels read them as float32).
_F32_TENSORS = ("ssm_conv1d", "ssm_a", "ssm_d", "ssm_norm")


def _quantized(name: str, arr: np.ndarray, quant: GGMLQuantizationType) -> bool:
    return (
        quant != GGMLQuantizationType.F32
        and arr.ndim == 2
        and arr.shape[1] % gguf.GGML_QUANT_SIZES[quant][0] == 0
        and not set(name.split(".")) & set(_F32_TENSORS)
    )


def _gemma4_keys(writer: GGUFWriter, spec: TinySpec) -> None:
    """The Gemma 4 keys (conversion/gemma.py, ``Gemma4Model``, ``Gemma4AssistantModel``)."""
    hd = spec.n_embd // spec.n_head
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_key_length_swa(hd)
    writer.add_value_length_swa(hd)
    writer.add_rope_dimension_count_swa(hd)
    writer.add_rope_freq_base_swa(10000.0)
    writer.add_sliding_window(64)
    writer.add_sliding_window_pattern(list(spec.gemma4_swa))
    writer.add_embedding_length_per_layer_input(0)
    writer.add_shared_kv_layers(0)
    if spec.architecture == "gemma4-assistant":
        writer.add_embedding_length_out(spec.n_embd)
        writer.add_nextn_predict_layers(spec.n_layer)


def _arch_keys(writer: GGUFWriter, spec: TinySpec) -> None:
    """The ``{arch}.*`` hyperparameters before the vocabulary size."""
    writer.add_context_length(spec.n_ctx_train)
    writer.add_embedding_length(
        spec.assistant_embd if spec.architecture == "gemma4-assistant" else spec.n_embd
    )
    writer.add_block_count(spec.n_layer + spec.nextn_layers)
    if spec.architecture == "mamba2":
        # As llama.cpp's converter writes Mamba-2: no attention, no feed-forward.
        writer.add_feed_forward_length(0)
        writer.add_head_count(0)
    else:
        writer.add_feed_forward_length(spec.n_ff)
        writer.add_head_count(spec.n_head)
        writer.add_head_count_kv(spec.n_head_kv)
    if spec.architecture == "qwen35":
        hd = spec.n_embd // spec.n_head
        writer.add_key_length(hd)
        writer.add_value_length(hd)
    writer.add_layer_norm_rms_eps(1e-5)
    if spec.architecture != "mamba2":
        writer.add_rope_freq_base(10000.0)
        writer.add_rope_dimension_count(spec.n_embd // spec.n_head)
    if spec.architecture in ("qwen35", "qwen2vl", "qwen3vl"):
        # (Interleaved) M-RoPE: sections of the rotated pairs (a text position is the same
        # in each); they add up to half the rotated dimensions, as in the real models.
        half = spec.n_embd // spec.n_head // 2
        writer.add_rope_dimension_sections([(half + 2) // 3, (half + 1) // 3, half // 3, 0])
    if spec.architecture == "qwen35":
        writer.add_full_attention_interval(spec.full_attention_interval)
        if spec.nextn_layers:
            writer.add_nextn_predict_layers(spec.nextn_layers)
    if spec.architecture == "qwen3vl":
        writer.add_uint32("qwen3vl.n_deepstack_layers", spec.deepstack_layers)
    if spec.architecture == "hy_v3":
        writer.add_nextn_predict_layers(spec.nextn_layers)
        # (read for every layer; its experts' width, which dense blocks do not use)
        writer.add_expert_feed_forward_length(spec.n_ff)
    if spec.architecture.startswith("gemma4"):
        _gemma4_keys(writer, spec)
    if spec.architecture == "eagle3":
        arch = spec.architecture
        writer.add_array(f"{arch}.target_layers", list(spec.target_layers))
        writer.add_uint32(f"{arch}.target_hidden_size", spec.target_hidden)
    if spec.architecture == "dflash":
        writer.add_array("dflash.target_layers", list(spec.target_layers))
        writer.add_uint32("dflash.block_size", spec.block_size)
        if spec.selector_top_k:
            for key, value in (("conv_kernel_size", spec.conv_kernel),
                               ("conv_group_size", spec.conv_group),
                               ("selector_rank", spec.selector_rank),
                               ("selector_top_k", spec.selector_top_k)):  # fmt: skip
                writer.add_uint32(f"dflash.{key}", value)
        if spec.sample_from_anchor is not None:
            writer.add_bool("dflash.sample_from_anchor", spec.sample_from_anchor)
        if spec.mrope:
            writer.add_rope_dimension_sections([spec.n_embd // spec.n_head // 2, 0, 0, 0])
    if spec.architecture in ("qwen35", "mamba2"):
        writer.add_ssm_conv_kernel(spec.ssm_d_conv)
        writer.add_ssm_inner_size(spec.ssm_d_inner)
        writer.add_ssm_state_size(spec.ssm_d_state)
        writer.add_ssm_time_step_rank(spec.ssm_dt_rank)
        writer.add_ssm_group_count(spec.ssm_n_group)


def write_tiny_model(path: Path, spec: TinySpec) -> list[Path]:
    """Write ``spec`` as a GGUF file at ``path``; returns the files written (several when
    ``spec.split_max_tensors`` splits it into ``-0000i-of-0000n.gguf`` shards, whose first
    one is then the path to load).

    Raises:
        ValueError: ``spec``'s shapes break a constraint of its architecture in llama.cpp.
        OSError: the file cannot be written.
    """
    _check(spec)
    v = spec.vocab
    tokens = list(v.tokens) + [f"[PAD{i}]" for i in range(spec.extra_padding_tokens)]
    types = list(v.types) + [int(TokenType.USER_DEFINED)] * spec.extra_padding_tokens
    n_vocab = len(tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, spec.architecture, split_max_tensors=spec.split_max_tensors)
    writer.add_name(spec.name)
    writer.add_size_label("tiny")
    _arch_keys(writer, spec)
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
    if spec.architecture == "dflash":
        writer.add_mask_token_id(spec.mask_token)
    for key in spec.drop_keys:
        writer.kv_data[0].pop(key, None)
    for key, value, vtype, sub_type in spec.set_keys:
        writer.kv_data[0][key] = GGUFValue(value=value, type=vtype, sub_type=sub_type)
    added = [(name, np.zeros(shape, np.float32)) for name, shape in spec.add_tensors]
    for name, arr in _tensors(spec, n_vocab) + added:
        if name in spec.drop_tensors:
            continue
        if arr.dtype != np.float32:  # (d2t: int64 ids)
            writer.add_tensor(name, arr)
        elif _quantized(name, arr, spec.quant):
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
    # Gated delta-net, attention, gated delta-net, attention.
    hybrid = dataclasses.replace(
        target, name="tiny hybrid", architecture="qwen35", n_layer=4, full_attention_interval=2
    )
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
        # Recurrent state (see the module docstring), in the target's vocabulary.
        "hybrid": hybrid,
        # The hybrid's first two layers (its embeddings and LM head drawn first, the same),
        # perturbed: agrees with it only sometimes.
        "hybrid-draft": dataclasses.replace(
            hybrid, name="tiny hybrid draft", n_layer=2, perturb=0.2
        ),
        "recurrent": dataclasses.replace(
            target,
            name="tiny recurrent",
            architecture="mamba2",
            # 8 heads of 16 dimensions, state 128: shapes that llama.cpp's CUDA kernels
            # take too (ssm_scan: d_state 96/128/256, ssm_conv: 128 channels a block).
            ssm_d_inner=128,
            ssm_d_state=128,
            ssm_n_group=1,
            ssm_dt_rank=8,
        ),
        # The hybrid with one MTP block, which agrees with it only sometimes: its layers
        # scaled down, the trunk predicts the next token mostly from the current one, as
        # the MTP block does from the embedding of the token it reads (llama.cpp's
        # draft-mtp accepts about 30% of 4-token drafts, 50-60% of 1-token drafts).
        "mtp": dataclasses.replace(
            hybrid,
            name="tiny mtp",
            nextn_layers=1,
            layer_scale=0.15,
            nextn_eh_proj=(1.0, 0.2, 0.1),
        ),
        # EAGLE-3 heads for the target: reading the inputs of its layers 0, 1 and 1 (a
        # two-layer target has no third), with its own embeddings and LM head, and with
        # a reduced vocabulary of 256 ids (d2t) and the target's embeddings.
        "eagle3": dataclasses.replace(
            target,
            name="tiny eagle3",
            architecture="eagle3",
            n_layer=1,
            target_layers=(0, 1, 1),
            target_hidden=target.n_embd,
            seed=77,
        ),
        "eagle3-d2t": dataclasses.replace(
            target,
            name="tiny eagle3 d2t",
            architecture="eagle3",
            n_layer=1,
            target_layers=(0, 1, 1),
            target_hidden=target.n_embd,
            seed=78,
            draft_vocab=256,
            own_embeddings=False,
        ),
        # DFlash drafts for the target: two layers reading the inputs of its layers 0 and
        # 1, blocks of 8 (7 draft tokens), the mask token <|im_start|>; with its own
        # embeddings and LM head, and with the target's (llama.cpp's ctx_other).
        "dflash": dataclasses.replace(
            target,
            name="tiny dflash",
            architecture="dflash",
            target_layers=(0, 1),
            block_size=8,
            mask_token=1,
            seed=79,
        ),
        # A DFlash draft for the hybrid (qwen35, M-RoPE) target, reading its layers 1 and 3.
        "dflash-mrope": dataclasses.replace(
            target,
            name="tiny dflash mrope",
            architecture="dflash",
            target_layers=(1, 3),
            block_size=8,
            mask_token=1,
            seed=81,
            mrope=True,
        ),
        # Qwen2-VL's (and Qwen2.5-VL's) text model: the target's, with M-RoPE; Qwen3-VL's,
        # with Q/K norms, whose first layer adds an image's deepstack rows.
        "qwen2vl": dataclasses.replace(target, name="tiny qwen2vl", architecture="qwen2vl"),
        "qwen3vl": dataclasses.replace(
            target, name="tiny qwen3vl", architecture="qwen3vl", deepstack_layers=1, seed=95
        ),
        # Gemma 4: a dense target of a sliding-window and a full-attention layer, and its
        # MTP assistant (two blocks reading those layers' cache, half its width).
        "gemma4": dataclasses.replace(
            target, name="tiny gemma4", architecture="gemma4", gemma4_swa=(True, False), seed=82
        ),
        "gemma4-assistant": dataclasses.replace(
            target,
            name="tiny gemma4 assistant",
            architecture="gemma4-assistant",
            gemma4_swa=(True, False),
            assistant_embd=32,
            n_ff=64,
            seed=83,
        ),
        # Hunyuan V3 with two MTP blocks, which llama.cpp chains: block j drafts the
        # (j + 1)-th token of a draft.
        "mtp-heads": dataclasses.replace(
            target,
            name="tiny hy_v3 mtp heads",
            architecture="hy_v3",
            nextn_layers=2,
            nextn_eh_proj=(1.0, 0.5, 0.1),
            seed=89,
        ),
        # DSpark drafts (DFlash with a Markov head): one with a confidence head whose block
        # row 0 predicts; one whose row 0 is the last token (sample_from_anchor false),
        # without a confidence head, over a reduced vocabulary (d2t) with the target's
        # token embeddings.
        "dspark": dataclasses.replace(
            target,
            name="tiny dspark",
            architecture="dflash",
            target_layers=(0, 1),
            block_size=8,
            mask_token=1,
            seed=84,
            markov_rank=8,
            confidence_head=True,
        ),
        "dspark-bonus": dataclasses.replace(
            target,
            name="tiny dspark bonus",
            architecture="dflash",
            target_layers=(1,),
            block_size=8,
            mask_token=1,
            seed=85,
            markov_rank=8,
            sample_from_anchor=False,
            draft_vocab=256,
            own_embeddings=False,
        ),
        # A DFlash2 draft (a selector over each row's top 4, a convolution of 3 in groups
        # of 16 in each layer), reading the target's layers 0 and 1.
        "dflash2": dataclasses.replace(
            target,
            name="tiny dflash2",
            architecture="dflash",
            target_layers=(0, 1),
            block_size=8,
            mask_token=1,
            seed=86,
            selector_top_k=4,
            selector_rank=8,
            conv_kernel=3,
            conv_group=16,
        ),
        "dflash-shared": dataclasses.replace(
            target,
            name="tiny dflash shared",
            architecture="dflash",
            target_layers=(1,),
            block_size=8,
            mask_token=1,
            seed=80,
            own_embeddings=False,
        ),
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
