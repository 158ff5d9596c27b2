"""The tiny GGUF fixtures load in llama.cpp and generate, and each variant is what it claims."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specgguf.gguf.tiny import CHANGED_TOKEN_ID, fixture_specs, gpt2_vocab
from specgguf.llama.backend import LlamaModel
from specgguf.llama.runtime import build_info

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


@pytest.mark.parametrize("name", sorted(fixture_specs()))
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
