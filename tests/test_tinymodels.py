"""The tiny GGUF fixtures load in llama.cpp and generate, and each variant is what it claims."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specgguf.gguf.arch import DRAFT_HEAD_ARCHS
from specgguf.gguf.info import read_model_info
from specgguf.gguf.metadata import GGUFMetadata
from specgguf.gguf.tiny import CHANGED_TOKEN_ID, fixture_specs, gpt2_vocab
from specgguf.llama.backend import LlamaModel
from specgguf.llama.runtime import build_info, llama

PROMPT = "def is_palindrome(text):"


def greedy(path: Path, prompt: str, n: int) -> tuple[list[int], list[np.ndarray]]:
    with LlamaModel(path) as model, model.new_context(n_ctx=256, n_batch=64) as ctx:
        logits = ctx.eval(model.tokenize(prompt), logits="last")
        out: list[int] = []
        rows: list[np.ndarray] = []
        for _ in range(n):
            rows.append(logits[-1].copy())
            tok = int(logits[-1].argmax())
            out.append(tok)
            logits = ctx.eval([tok], logits="last")
    return out, rows


@pytest.mark.parametrize(
    "name",
    sorted(n for n, s in fixture_specs().items() if s.architecture not in DRAFT_HEAD_ARCHS),
)  # (a draft head generates only beside its target: tests/test_eagle3.py, test_dflash.py,
# test_assistant.py)
def test_every_fixture_loads_and_generates(tiny_models: dict[str, Path], name: str) -> None:
    tokens, rows = greedy(tiny_models[name], PROMPT, 6)
    assert len(tokens) == 6
    with LlamaModel(tiny_models[name], vocab_only=True) as m:
        n_vocab = m.n_vocab
    assert all(0 <= t < n_vocab for t in tokens)
    # Real, non-degenerate logits: finite and not all equal.
    assert all(np.isfinite(r).all() and r.std() > 0.1 for r in rows)


def test_identical_draft_produces_identical_logits(tiny_models: dict[str, Path]) -> None:
    t_tokens, t_rows = greedy(tiny_models["target"], PROMPT, 8)
    d_tokens, d_rows = greedy(tiny_models["draft-identical"], PROMPT, 8)
    assert t_tokens == d_tokens
    for a, b in zip(t_rows, d_rows, strict=True):
        np.testing.assert_array_equal(a, b)


def test_partial_draft_differs_from_target(tiny_models: dict[str, Path]) -> None:
    # Teacher-forced along the target's greedy path: the partial draft's argmax agrees
    # at some positions and not at others.
    t_tokens, _ = greedy(tiny_models["target"], PROMPT, 24)
    with LlamaModel(tiny_models["draft-partial"]) as m, m.new_context(n_ctx=256) as ctx:
        logits = ctx.eval(m.tokenize(PROMPT), logits="last")
        agree = 0
        for tok in t_tokens:
            agree += int(logits[-1].argmax()) == tok
            logits = ctx.eval([tok], logits="last")
    assert 0 < agree < len(t_tokens), agree


def test_split_fixture_is_three_shards_and_matches_unsplit(tiny_models: dict[str, Path]) -> None:
    first = tiny_models["split"]
    assert first.name.endswith("-00001-of-00003.gguf")
    shards = sorted(first.parent.glob("tiny-split-0000*-of-00003.gguf"))
    assert len(shards) == 3
    # Same weights as the target, so the same greedy continuation.
    assert greedy(first, PROMPT, 5)[0] == greedy(tiny_models["target"], PROMPT, 5)[0]


def test_vocab_variants_differ_where_they_say(tiny_models: dict[str, Path]) -> None:
    with (
        LlamaModel(tiny_models["target"], vocab_only=True) as t,
        LlamaModel(tiny_models["draft-token-changed"], vocab_only=True) as changed,
        LlamaModel(tiny_models["draft-pad128"], vocab_only=True) as pad128,
        LlamaModel(tiny_models["draft-pad129"], vocab_only=True) as pad129,
        LlamaModel(tiny_models["draft-bos-id"], vocab_only=True) as bos,
        LlamaModel(tiny_models["draft-add-bos"], vocab_only=True) as add_bos,
        LlamaModel(tiny_models["draft-spm"], vocab_only=True) as spm,
    ):
        assert t.token_text(CHANGED_TOKEN_ID) != changed.token_text(CHANGED_TOKEN_ID)
        assert t.token_text(CHANGED_TOKEN_ID - 1) == changed.token_text(CHANGED_TOKEN_ID - 1)
        assert pad128.n_vocab - t.n_vocab == 128
        assert pad129.n_vocab - t.n_vocab == 129
        assert (t.add_bos, add_bos.add_bos) == (False, True)
        assert bos.add_bos and bos.bos != t.bos
        assert spm.n_vocab != t.n_vocab
        # The SPM model adds BOS (id 1) by itself; the byte-level BPE one does not.
        assert spm.tokenize("hi")[0] == 1
        assert t.tokenize("hi")[0] != t.bos


def test_bpe_vocab_round_trips_text_including_a_4_byte_emoji(
    tiny_models: dict[str, Path],
) -> None:
    text = "The fox \U0001f680 caf\u00e9 def add(a, b):"
    with LlamaModel(tiny_models["target"], vocab_only=True) as m:
        ids = m.tokenize(text, add_special=False)
        assert m.detokenize(ids).decode("utf-8") == text
        # Merges learned from the corpus are used: fewer tokens than bytes.
        assert len(ids) < len(text.encode())
    assert len(gpt2_vocab().tokens) == 512


def test_context_micro_batch_follows_the_build(tiny_models: dict[str, Path]) -> None:
    # A prompt longer than n_ubatch is split into several llama.cpp graphs; the result must
    # not depend on the split (the same last-position logits as one large micro-batch).
    with LlamaModel(tiny_models["target"]) as m:
        lc = m._lc
        prompt = m.tokenize(PROMPT * 12)
        assert len(prompt) > 64
        with m.new_context(n_ctx=512, n_batch=256) as ctx:
            # A GPU of this machine, not llama_supports_gpu_offload(): that also says yes
            # for a CPU-only build with the RPC backend, which computes here on the CPU.
            expected = 512 if build_info().gpu_offload else 128
            assert lc.llama_n_ubatch(ctx._ctx) == min(256, expected)
            whole = ctx.eval(prompt, logits="last")[-1].copy()
        with m.new_context(n_ctx=512, n_batch=256, n_ubatch=16) as ctx:
            assert lc.llama_n_ubatch(ctx._ctx) == 16
            split = ctx.eval(prompt, logits="last")[-1].copy()
    assert int(whole.argmax()) == int(split.argmax())
    # Different graph sizes take different kernels: equal up to llama.cpp's kernel noise
    # (see README, "Exactness"), 0.13 here.
    np.testing.assert_allclose(whole, split, atol=0.3)


#: The tiny BPE vocabulary's control tokens (ids 0-2, see specgguf.gguf.tiny), and pieces
#: of them that are not special.
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
NEAR_SPECIALS = ["<|", "|>", "<|im_", "im_end|>", "<", "|"]


def test_min_tokens_counts_each_special_text_as_one_token(tiny_models: dict[str, Path]) -> None:
    with LlamaModel(tiny_models["target"], vocab_only=True) as m:
        # 80 special texts, one token each, and 40 pieces of text between them, at least
        # one token each
        text = "<|im_start|>user\nhi<|im_end|>" * 40
        assert m.min_tokens(text) == 120 <= len(m.tokenize(text, add_special=False))
        assert m.tokenize(text, add_special=False).count(2) == 40  # <|im_end|>: one token
        pure = "<|im_end|><|endoftext|>" * 50
        assert m.min_tokens(pure) == 100 == len(m.tokenize(pure, add_special=False))
        assert m.min_tokens("no special text here <| im_end |>") == 1
        assert m.min_tokens("<|im_end|>  <|im_end|>") == 2  # whitespace may join a special
        # Fewer characters than at_least: not looked at, and 0 is still a lower bound.
        assert m.min_tokens("<|im_end|>" * 5, at_least=100) == 0
        assert m.min_tokens("<|im_end|>" * 5, at_least=5) == 5


@pytest.fixture(scope="module")
def tiny_vocab(tiny_models: dict[str, Path]) -> Iterator[LlamaModel]:
    with LlamaModel(tiny_models["target"], vocab_only=True) as m:
        yield m


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.one_of(st.sampled_from(TINY_SPECIALS + NEAR_SPECIALS),
                                st.text(max_size=6)), max_size=40))  # fmt: skip
def test_min_tokens_is_a_lower_bound_on_the_token_count(
    tiny_vocab: LlamaModel, parts: list[str]
) -> None:
    text = "".join(parts)
    assert tiny_vocab.min_tokens(text) <= len(tiny_vocab.tokenize(text, add_special=False))


# -- The fixtures with recurrent state: qwen35 (gated delta-net + attention), mamba2 -------
# Loaded through llama_cpp's own API: the rollback snapshots (llama_context_params.n_rs_seq)
# and MTP (load_mtp, LLAMA_CONTEXT_TYPE_MTP) are set there.

#: fixture -> (architecture, block_count, llama_model_n_layer)
RECURRENT = {
    "hybrid": ("qwen35", 4, 4),
    "hybrid-draft": ("qwen35", 2, 2),
    "recurrent": ("mamba2", 2, 2),
    "mtp": ("qwen35", 5, 4),  # block_count counts the MTP block, n_layer does not
}
N_RS_SEQ = 16


@pytest.mark.parametrize("name", sorted(RECURRENT))
def test_recurrent_fixtures_read_by_our_reader(tiny_models: dict[str, Path], name: str) -> None:
    arch, n_blocks, _ = RECURRENT[name]
    info = read_model_info(tiny_models[name])
    assert (info.architecture, info.block_count, info.embedding_length) == (arch, n_blocks, 64)
    assert info.findings == ()
    assert info.vocab.n_tokens == 512
    with (
        GGUFMetadata.open(tiny_models[name]) as meta,
        GGUFMetadata.open(tiny_models["target"]) as target,
    ):
        assert meta.get("general.architecture") == arch
        # The target's vocabulary, token for token.
        key = "tokenizer.ggml.tokens"
        assert meta.strings(meta.get(key)) == target.strings(target.get(key))
        assert meta.arch_key("nextn_predict_layers") == (1 if name == "mtp" else None)
        assert meta.arch_key("ssm.state_size") == (128 if arch == "mamba2" else 16)
        tensors = {t.name: t for t in meta.tensors()}
    if arch == "qwen35":
        # full_attention_interval 2: layer 0 gated delta-net, layer 1 attention.
        assert {"blk.0.ssm_a", "blk.0.attn_qkv.weight", "blk.1.attn_q.weight"} <= tensors.keys()
        assert "blk.1.ssm_a" not in tensors and "blk.0.attn_q.weight" not in tensors
        assert tensors["blk.1.attn_q.weight"].shape == (64, 128)  # query and gate
    else:
        assert not any("attn_q" in t for t in tensors)
        assert tensors["blk.1.ssm_in.weight"].shape == (64, 2 * 128 + 2 * 128 + 8)
    assert ("blk.4.nextn.eh_proj.weight" in tensors) == (name == "mtp")


@contextlib.contextmanager
def raw_model(path: Path, *, load_mtp: bool = False) -> Iterator[Any]:
    lc = llama()
    params = lc.llama_model_default_params()
    params.load_mtp = load_mtp
    model = lc.llama_model_load_from_file(str(path).encode(), params)
    assert model
    try:
        yield model
    finally:
        lc.llama_model_free(model)


@contextlib.contextmanager
def raw_context(model: Any, **params: Any) -> Iterator[Any]:
    lc = llama()
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = 512, 512, 512
    cp.n_threads = cp.n_threads_batch = 1
    cp.n_rs_seq = N_RS_SEQ
    for key, value in params.items():
        setattr(cp, key, value)
    ctx = lc.llama_init_from_model(model, cp)
    assert ctx
    try:
        yield ctx
    finally:
        lc.llama_free(ctx)


def raw_decode(ctx: Any, model: Any, tokens: list[int], pos: int) -> np.ndarray:
    """Decode ``tokens`` at ``pos``.. in one batch; the last position's logits."""
    lc = llama()
    batch = lc.llama_batch_init(len(tokens), 0, 1)
    try:
        for i, tok in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == len(tokens) - 1
        batch.n_tokens = len(tokens)
        assert lc.llama_decode(ctx, batch) == 0
    finally:
        lc.llama_batch_free(batch)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    return np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()


def raw_prompt(model: Any, n: int = 20) -> list[int]:
    lc = llama()
    text = (PROMPT + " the quick brown fox jumps over the lazy dog.\n" * 4).encode()
    buf = (lc.llama_token * 256)()
    n_tok = lc.llama_tokenize(
        lc.llama_model_get_vocab(model), text, len(text), buf, 256, False, True
    )
    assert n_tok >= n
    return list(buf[:n])


def raw_greedy(
    ctx: Any, model: Any, prompt: list[int], n: int
) -> tuple[list[int], list[np.ndarray]]:
    logits = raw_decode(ctx, model, prompt, 0)
    out: list[int] = []
    rows: list[np.ndarray] = []
    for i in range(n):
        rows.append(logits)
        out.append(int(logits.argmax()))
        logits = raw_decode(ctx, model, [out[-1]], len(prompt) + i)
    return out, rows


@pytest.mark.parametrize("name", sorted(RECURRENT))
def test_recurrent_fixtures_load_and_generate_varied_text(
    tiny_models: dict[str, Path], name: str
) -> None:
    lc = llama()
    with raw_model(tiny_models[name]) as model, raw_context(model) as ctx:
        assert lc.llama_model_n_layer(model) == RECURRENT[name][2]
        assert lc.llama_model_is_recurrent(model) == (name == "recurrent")
        assert lc.llama_model_is_hybrid(model) == (name != "recurrent")
        tokens, rows = raw_greedy(ctx, model, raw_prompt(model), 30)
    assert all(np.isfinite(r).all() and r.std() > 0.1 for r in rows)
    # Not a token repeated: random weights, but varied greedy text (the MTP fixture's
    # trunk is nearly a bigram model, whose greedy path cycles sooner).
    assert len(set(tokens)) >= (5 if name == "mtp" else 15), tokens


def test_hybrid_draft_agrees_with_the_hybrid_only_sometimes(tiny_models: dict[str, Path]) -> None:
    # The draft is the hybrid's first two layers, perturbed: teacher-forced along the
    # hybrid's greedy path, its argmax agrees at some positions and not at others.
    with raw_model(tiny_models["hybrid"]) as model, raw_context(model) as ctx:
        prompt = raw_prompt(model)
        path, _ = raw_greedy(ctx, model, prompt, 40)
    with raw_model(tiny_models["hybrid-draft"]) as model, raw_context(model) as ctx:
        logits = raw_decode(ctx, model, prompt, 0)
        agree = 0
        for i, tok in enumerate(path):
            agree += int(logits.argmax()) == tok
            logits = raw_decode(ctx, model, [tok], len(prompt) + i)
    assert 0 < agree < len(path) // 2, agree


@pytest.mark.parametrize(("n_batch", "k"), [(8, 1), (8, 7), (24, N_RS_SEQ)])
def test_hybrid_rolls_back_within_the_last_batch(
    tiny_models: dict[str, Path], n_batch: int, k: int
) -> None:
    # Decode n_batch tokens in one batch, remove the last k (the recurrent layers restore
    # a snapshot), decode on: the same logits as a context that never saw them.
    lc = llama()
    probe = [5, 77]
    with raw_model(tiny_models["hybrid"]) as model:
        base = raw_prompt(model, 50)
        extra = [(37 * i) % 500 + 3 for i in range(n_batch)]
        with raw_context(model) as ctx:
            assert lc.llama_n_rs_seq(ctx) == N_RS_SEQ
            raw_decode(ctx, model, base, 0)
            raw_decode(ctx, model, extra, len(base))
            p = len(base) + n_batch - k
            assert lc.llama_memory_seq_rm(lc.llama_get_memory(ctx), 0, p, -1)
            assert lc.llama_memory_seq_pos_max(lc.llama_get_memory(ctx), 0) == p - 1
            rolled_back = raw_decode(ctx, model, probe, p)
        with raw_context(model) as ctx:
            fresh = raw_decode(ctx, model, base + extra[: n_batch - k] + probe, 0)
    assert int(rolled_back.argmax()) == int(fresh.argmax())
    # Exactly equal on the CPU; other graph sizes, other kernels elsewhere (see README,
    # "Exactness"). A stale state is off by several units.
    np.testing.assert_allclose(rolled_back, fresh, atol=0.3)


def test_rollback_limits(tiny_models: dict[str, Path]) -> None:
    lc = llama()
    with raw_model(tiny_models["hybrid"]) as model, raw_context(model) as ctx:
        raw_decode(ctx, model, raw_prompt(model), 0)
        raw_decode(ctx, model, list(range(3, 3 + 24)), 20)
        # More than n_rs_seq back: refused, the sequence is unchanged.
        assert not lc.llama_memory_seq_rm(lc.llama_get_memory(ctx), 0, 44 - N_RS_SEQ - 1, -1)
        assert lc.llama_memory_seq_pos_max(lc.llama_get_memory(ctx), 0) == 43
    # mamba2 has no rollback snapshots in llama.cpp: n_rs_seq is clamped to 0 and removing
    # the end of the sequence is refused.
    with raw_model(tiny_models["recurrent"]) as model, raw_context(model) as ctx:
        assert lc.llama_n_rs_seq(ctx) == 0
        raw_decode(ctx, model, raw_prompt(model), 0)
        raw_decode(ctx, model, list(range(3, 11)), 20)
        assert not lc.llama_memory_seq_rm(lc.llama_get_memory(ctx), 0, 27, -1)
        assert lc.llama_memory_seq_pos_max(lc.llama_get_memory(ctx), 0) == 27


def raw_mtp_decode(ctx: Any, model: Any, token: int, pos: int, h: np.ndarray) -> np.ndarray:
    """Decode one row of an MTP context: ``token`` at ``pos`` with the trunk's hidden state
    ``h`` (float32[n_embd_out]) in the batch's embd, as llama.cpp's draft-mtp does. A row
    without it would read an input tensor nothing wrote (llm_graph_input_embd_h)."""
    import ctypes

    lc = llama()
    batch = lc.llama_batch_init(1, h.shape[0], 1)
    tokens = (ctypes.c_int32 * 1)(token)
    batch.token = tokens
    try:
        np.ctypeslib.as_array(batch.embd, shape=h.shape)[:] = h
        batch.pos[0], batch.n_seq_id[0], batch.logits[0] = pos, 1, 1
        batch.seq_id[0][0] = 0
        batch.n_tokens = 1
        assert lc.llama_decode(ctx, batch) == 0
    finally:
        batch.token = ctypes.POINTER(ctypes.c_int32)()
        lc.llama_batch_free(batch)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    return np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()


def test_mtp_fixture_loads_with_and_without_its_mtp_block(tiny_models: dict[str, Path]) -> None:
    from llama_cpp import llama_cpp_ext

    lc = llama()
    with raw_model(tiny_models["mtp"]) as model, raw_context(model) as ctx:
        prompt = raw_prompt(model)
        hybrid = raw_decode(ctx, model, prompt, 0)
    for load_mtp in (False, True):
        with raw_model(tiny_models["mtp"], load_mtp=load_mtp) as model:
            assert lc.llama_model_n_layer(model) == 4
            assert lc.llama_model_n_layer_nextn(model) == 1
            with raw_context(model) as ctx:
                llama_cpp_ext.llama_set_embeddings_nextn(ctx, True, False)
                # The trunk's logits do not depend on the MTP block being loaded.
                np.testing.assert_array_equal(raw_decode(ctx, model, prompt, 0), hybrid)
                if not load_mtp:
                    continue
                n_embd = lc.llama_model_n_embd_out(model)
                rows = np.ctypeslib.as_array(
                    llama_cpp_ext.llama_get_embeddings_nextn(ctx), shape=(len(prompt), n_embd)
                )
                h = rows[-1].copy()
                assert np.isfinite(h).all() and h.std() > 0
                token = int(hybrid.argmax())
                # The MTP block runs on its own KV cache: a token decodes, its logits read
                # the hidden state given (another one changes them) and nothing else.
                heads = []
                for hidden in (h, h, -h):
                    with raw_context(
                        model, ctx_type=lc.LLAMA_CONTEXT_TYPE_MTP, ctx_other=ctx, n_rs_seq=0
                    ) as mtp:
                        heads.append(raw_mtp_decode(mtp, model, token, len(prompt), hidden))
                assert all(np.isfinite(x).all() and x.std() > 0.1 for x in heads)
                np.testing.assert_array_equal(heads[0], heads[1])
                assert np.abs(heads[0] - heads[2]).max() > 0.1
