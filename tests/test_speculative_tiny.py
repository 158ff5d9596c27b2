"""The speculative loop on real llama.cpp with the tiny GGUF fixtures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specgguf.errors import ContextOverflowError
from specgguf.llama.backend import LlamaModel
from specgguf.speculative.loop import GenerationParams
from specgguf.speculative.sampling import SamplerParams

from .helpers import load_engine

GREEDY = SamplerParams(temperature=0.0)
PROMPTS = ["def is_palindrome(text):", "The quick brown fox", "for i in range(10):\n"]


def greedy_alone(path: Path, prompt_ids: list[int], n: int) -> list[int]:
    """The target alone, greedily, written out independently of the speculative decoder:
    the prompt in one batch, then one token at a time, argmax, until an end-of-generation
    token (llama.cpp's own list) or ``n`` tokens."""
    out: list[int] = []
    with LlamaModel(path) as model, model.new_context(n_ctx=512) as ctx:
        logits = ctx.eval(prompt_ids, logits="last")
        while len(out) < n:
            tok = int(logits[-1].argmax())
            if tok in model.eog_ids:
                break
            out.append(tok)
            logits = ctx.eval([tok], logits="last")
    return out


@pytest.fixture(scope="module")
def baseline(tiny_models: dict[str, Path]) -> dict[str, list[int]]:
    with load_engine(tiny_models["target"], drafter="none", n_ctx=512) as e:
        ids = {p: e.prompt_ids(p) for p in PROMPTS}  # the engine's prompt rendering
    out = {p: greedy_alone(tiny_models["target"], ids[p], 48) for p in PROMPTS}
    assert all(len(t) >= 8 for t in out.values()), out
    return out


def test_target_alone_through_the_decoder_equals_the_plain_loop(
    tiny_models: dict[str, Path], baseline: dict[str, list[int]]
) -> None:
    with load_engine(tiny_models["target"], drafter="none", n_ctx=512) as e:
        for p in PROMPTS:
            res = e.generate(p, GenerationParams(n_predict=48, sampler=GREEDY)).run()
            assert res.tokens == baseline[p]
            assert res.stats.drafted == 0 and res.stats.steps >= len(res.tokens)


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_lone_evaluation_decodes_as_eval_does(
    tiny_models: dict[str, Path], parallel: int
) -> None:
    """``eval_lone`` (the target alone's step) gives the logits, positions and timing of
    ``eval`` of one token, to the end of the context; with parallel sequences, in the
    sequence it is called on (the other one's cache holds other tokens)."""
    with (
        LlamaModel(tiny_models["target"]) as model,
        model.new_context(n_ctx=48, n_parallel=parallel) as a,
        model.new_context(n_ctx=48, n_parallel=parallel) as b,
    ):
        other = None
        if parallel > 1:  # sequence 1 of each, sequence 0 holding other text
            a.eval([9, 10], logits="none")
            b.eval([20, 21], logits="none")
            other, a, b = b, a.sequence(1), b.sequence(1)
        a.eval([5, 6, 7], logits="none")
        b.eval([5, 6, 7], logits="none")
        t, steps = 8, 0
        while a.n_past < a.n_ctx:
            want = a.eval([t], logits="all")[0].copy()
            if other is not None:  # (the batch last decoded for the other sequence)
                other.eval([3], logits="none")
            s0 = b.eval_seconds
            got = b.eval_lone(t)
            assert got.shape == (model.n_vocab,) and got.dtype == np.float32
            np.testing.assert_array_equal(got, want)
            assert (b.n_past, b.eval_seconds > s0) == (a.n_past, True)
            t, steps = int(want.argmax()), steps + 1
        assert steps == 45
        with pytest.raises(ContextOverflowError):
            b.eval_lone(t)
        assert b.n_past == b.n_ctx


@pytest.mark.parametrize("draft", ["draft-identical", "draft-partial", "draft-pad128"])
def test_greedy_equivalence_k_1_to_16(
    tiny_models: dict[str, Path], baseline: dict[str, list[int]], draft: str
) -> None:
    with load_engine(tiny_models["target"], tiny_models[draft], n_ctx=512) as e:
        for k in range(1, 17):
            for p in PROMPTS:
                res = e.generate(p, GenerationParams(n_predict=48, draft_max=k,
                                                     sampler=GREEDY)).run()  # fmt: skip
                assert res.tokens == baseline[p], (draft, k, p)


def test_greedy_equivalence_ngram(
    tiny_models: dict[str, Path], baseline: dict[str, list[int]]
) -> None:
    with load_engine(tiny_models["target"], drafter="ngram", n_ctx=512) as e:
        for k in (1, 4, 16):
            for p in PROMPTS:
                res = e.generate(p, GenerationParams(n_predict=48, draft_max=k,
                                                     sampler=GREEDY)).run()  # fmt: skip
                assert res.tokens == baseline[p]


def test_identical_draft_accepts_every_token(tiny_models: dict[str, Path]) -> None:
    with load_engine(tiny_models["target"], tiny_models["draft-identical"]) as e:
        s = e.generate(PROMPTS[0], GenerationParams(n_predict=40, draft_max=4,
                                                    sampler=GREEDY)).run().stats  # fmt: skip
    assert s.drafted > 0 and s.accepted == s.drafted
    assert s.steps == 8  # 5 tokens per step


def test_partial_draft_accepts_some_and_rejects_some(tiny_models: dict[str, Path]) -> None:
    with load_engine(tiny_models["target"], tiny_models["draft-partial"]) as e:
        s = e.generate(PROMPTS[0], GenerationParams(n_predict=40, draft_max=4,
                                                    sampler=GREEDY)).run().stats  # fmt: skip
    assert 0 < s.accepted < s.drafted
    assert s.target_seconds > 0 and s.draft_seconds > 0


def test_sampled_generation_is_seeded(tiny_models: dict[str, Path]) -> None:
    sampler = SamplerParams(temperature=1.2, seed=7)
    with load_engine(tiny_models["target"], tiny_models["draft-partial"]) as e:
        a = e.generate(PROMPTS[1], GenerationParams(n_predict=30, draft_max=4,
                                                    sampler=sampler)).run()  # fmt: skip
        b = e.generate(PROMPTS[1], GenerationParams(n_predict=30, draft_max=4,
                                                    sampler=sampler)).run()  # fmt: skip
    assert a.tokens == b.tokens and len(a.tokens) == 30
