"""Deterministic mode: the same input gives the same output whatever the drafter, the draft
length and the timings: exactly on the fake backend, and on llama.cpp with the tiny and the
real models."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from specgguf.errors import BackendError
from specgguf.hub import testmodels
from specgguf.speculative.drafters import NgramDrafter
from specgguf.speculative.loop import GenerationParams, SpeculativeDecoder
from specgguf.speculative.planner import FixedPlanner
from specgguf.speculative.sampling import SamplerParams

from .fakes import FakeContext, FakeVocab, ScriptedDrafter
from .helpers import load_engine, run_cli

V = 12


def soft_rule(prefix: Sequence[int]) -> np.ndarray:
    """Integer logits with several likely tokens, a function of the last two tokens."""
    a, b = prefix[-1], prefix[-2] if len(prefix) > 1 else 0
    row = np.zeros(V, np.float32)
    for j in range(4):
        row[(a * 3 + b + j) % V] = 3 - j
    return row


def fake_run(drafter: object | None, k: int, sampler: SamplerParams, n: int = 40) -> list[int]:
    ctx = FakeContext(soft_rule, V)
    dec = SpeculativeDecoder(ctx, FakeVocab(V))  # type: ignore[arg-type]
    params = GenerationParams(n_predict=n, sampler=sampler, deterministic=True)
    planner = FixedPlanner(drafter, k)  # type: ignore[arg-type]
    return dec.generate([1, 2], params, planner).run().tokens


def test_sampled_output_does_not_depend_on_the_drafter_or_k() -> None:
    sampler = SamplerParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    alone = fake_run(None, 0, sampler)
    wrong = ScriptedDrafter(lambda h, k: [(h[-1] + 5) % V] * k)
    for drafter in (NgramDrafter(1, 3), wrong, ScriptedDrafter(lambda h, k: [1, 2, 3][:k])):
        for k in (1, 2, 4, 8):
            assert fake_run(drafter, k, sampler) == alone, (drafter, k)
    # Without deterministic mode a seed gives the same output with every drafter too
    # (its draws are keyed by output position: the seeds of issue 35).
    for drafter, k in ((wrong, 4), (NgramDrafter(1, 3), 8), (None, 0)):
        ctx = FakeContext(soft_rule, V)
        params = GenerationParams(n_predict=40, sampler=sampler)
        normal = SpeculativeDecoder(ctx, FakeVocab(V)).generate(  # type: ignore[arg-type]
            [1, 2], params, FixedPlanner(drafter, k)).run().tokens  # fmt: skip
        assert normal == alone, (drafter, k)
    assert fake_run(None, 0, SamplerParams(**{**sampler.__dict__, "seed": 12})) != alone


def test_greedy_verification_stops_at_the_decode_call_that_shows_a_rejection() -> None:
    """With rows per decode (deterministic mode's batch shapes), greedy verification of a
    long draft decodes its calls one by one and stops after the one in which the target
    disagrees: the output is the target alone's, and the rows after it are never
    evaluated."""
    greedy = SamplerParams(temperature=0.0)

    def truth(h: Sequence[int]) -> int:
        return int(np.argmax(soft_rule(h)))

    def right_then_wrong(h: Sequence[int], k: int) -> list[int]:
        out = list(h)
        for _ in range(3):  # three right tokens, then wrong ones
            out.append(truth(out))
        return [*out[len(h) :], *[(out[-1] + 5) % V] * (k - 3)][:k]

    def run(rows: int | None, drafter: object | None, k: int) -> tuple[list[int], FakeContext]:
        ctx = FakeContext(soft_rule, V)
        ctx.set_rows_per_decode(rows)  # type: ignore[attr-defined]
        dec = SpeculativeDecoder(ctx, FakeVocab(V))  # type: ignore[arg-type]
        params = GenerationParams(n_predict=30, sampler=greedy, deterministic=True)
        planner = FixedPlanner(drafter, k)  # type: ignore[arg-type]
        return dec.generate([1, 2], params, planner).run().tokens, ctx

    alone, _ = run(None, None, 0)
    drafter = ScriptedDrafter(right_then_wrong)
    tokens, ctx = run(3, drafter, 8)
    assert tokens == alone
    evals = [e for e in ctx.log if e[0] == "eval" and e[3] == "all"]
    # 9 rows in calls of 3, 3, 3: drafts 1-3 right, draft 4 (in the second call) wrong:
    # the third call is never made, and every call has at most 3 rows.
    assert max(len(e[2]) for e in evals) == 3
    first_step = evals[:2]
    assert [len(e[2]) for e in first_step] == [3, 3]
    assert evals[2][1] == first_step[0][1] + 4  # the next step starts 4 tokens later
    # A wrong first draft stops at the first call: one call of 3 rows per step, one token
    # per step; the output never changes.
    got, ctx = run(3, ScriptedDrafter(lambda h, k: [(h[-1] + 5) % V] * k), 8)
    assert got == alone
    calls = [e for e in ctx.log if e[0] == "eval" and e[3] == "all"]
    text = [1, 2, *alone]
    rejected_first = [i for i, (_, at, rows, _) in enumerate(calls)
                      if len(rows) > 1 and truth(text[: at + 1]) != rows[1]]  # fmt: skip
    assert len(rejected_first) >= 5
    for i in rejected_first:  # the next call is the next step's, one token later
        assert i + 1 == len(calls) or calls[i + 1][1] == calls[i][1] + 1
    # Without rows per decode, one evaluation of all 9 rows.
    got, ctx = run(None, ScriptedDrafter(right_then_wrong), 8)
    assert got == alone
    assert next(len(e[2]) for e in ctx.log if e[0] == "eval" and e[3] == "all") == 9


def test_deterministic_sampling_follows_the_target_distribution() -> None:
    # The first token over many seeds, drafted by a drafter that proposes token 0: its
    # frequencies match softmax(logits / T) exactly as computed here from the rule.
    sampler = SamplerParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.0)
    z = soft_rule([1, 2]).astype(np.float64) / 0.7
    p = np.exp(z - z.max())
    p /= p.sum()
    n = 4000
    counts: Counter[int] = Counter()
    for seed in range(n):
        s = SamplerParams(**{**sampler.__dict__, "seed": seed})
        # n_predict 2: the first token is verified against a one-token draft
        counts[fake_run(ScriptedDrafter(lambda h, k: [5] * k), 2, s, n=2)[0]] += 1
    stat = sum((counts[t] - n * p[t]) ** 2 / (n * p[t]) for t in range(V))
    assert stat < 31.26  # chi-square, 11 degrees of freedom, p = 0.001
    assert 0 < counts[5] < n


CONFIGS = [("none", 0), ("model", 1), ("model", 2), ("model", 4), ("model", 8), ("model", 16),
           ("ngram", 4), ("auto", 16)]  # fmt: skip


def test_tiny_models_greedy_and_seeded_sampling_bit_identical(tiny_models: dict[str, Path]) -> None:
    prompts = ["def is_palindrome(text):", "The quick brown fox " * 40]  # the second past 256
    greedy = SamplerParams(temperature=0)
    sampled = SamplerParams(temperature=1.0, seed=5)
    with load_engine(tiny_models["target"], tiny_models["draft-partial"], drafter="auto",
                     n_ctx=1024, deterministic=True) as e:  # fmt: skip
        assert e.deterministic_rows >= 2
        for prompt in prompts:
            for sampler in (greedy, sampled):
                outs = {
                    (kind, k): e.generate(prompt, GenerationParams(
                        n_predict=48, sampler=sampler, drafter=kind, draft_max=k,
                        deterministic=True)).run().tokens
                    for kind, k in CONFIGS
                }  # fmt: skip
                first = outs[("none", 0)]
                assert len(first) > 10
                assert all(v == first for v in outs.values()), (prompt[:20], sampler)


def test_deterministic_mode_refused_where_no_batch_shape_is_invariant(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from specgguf.engine import Engine, EngineConfig, ModelConfig
    from specgguf.llama import invariance

    monkeypatch.setattr(invariance, "deterministic_rows",
                        lambda *a, **kw: (0, {0: 0.0, 1: 0.4, 2: 0.2, 3: 0.3}))  # fmt: skip
    config = EngineConfig(ModelConfig(tiny_models["target"], n_ctx=256), deterministic=True)
    with pytest.raises(BackendError, match="deterministic mode is not possible"):
        Engine(config)


def test_run_deterministic_flag(tiny_models: dict[str, Path]) -> None:
    models = ["-m", str(tiny_models["target"]), "-md", str(tiny_models["draft-partial"])]
    base = ["run", *models, "-c", "512", "-n", "32", "--temp", "0", "--json", "--deterministic",
            "hello"]  # fmt: skip
    outs = []
    for extra in (["--drafter", "none"], ["--drafter", "model", "--draft", "5"], []):
        res = run_cli(*base, *extra)
        assert res.returncode == 0, res.stderr.decode()
        out = json.loads(res.stdout)
        assert out["params"]["deterministic"] is True
        outs.append(out["tokens"])
    assert outs[0] == outs[1] == outs[2]


#: scripts/determinism-check's prompts but its prose and JSON ones (left out for CI's
#: time): code, a near-tie, and a long prompt past 256 positions
PROMPTS = {
    "code": "Write a Python function that merges two sorted lists.",
    "near-tie": "Write a haiku about autumn leaves.",
    "long": "Summarise this code:\n"
    + "\n".join(f"def f{i}(x):\n    return x * {i}" for i in range(40)),
}


@pytest.mark.real_models
def test_real_pair_deterministic_matrix(real_models: dict[str, Path]) -> None:
    # Greedy, every drafter and K: bit-identical to the deterministic target alone (the
    # full matrix, 128 tokens and 3 runs each: scripts/determinism-check).
    target, draft = real_models[testmodels.TARGET], real_models[testmodels.DRAFT]
    greedy = SamplerParams(temperature=0)
    with load_engine(target, draft, drafter="auto", n_ctx=2048, deterministic=True) as e:
        for name, text in PROMPTS.items():
            prompt = [{"role": "user", "content": text}]
            ref = None
            for kind, k in (("none", 0), ("model", 1), ("model", 4), ("model", 16), ("ngram", 8),
                            ("auto", 16)):  # fmt: skip
                res = e.generate(prompt, GenerationParams(
                    n_predict=32, sampler=greedy, drafter=kind, draft_max=k)).run()  # fmt: skip
                ref = ref or res.tokens
                assert res.tokens == ref, (name, kind, k)
        # What the matrix went through: a q8_0 K cache and lone rows never padded (the
        # long prompt is past 256 positions, where an f16 K cache would need padding).
        assert e.target_ctx.type_k == "q8_0" and e.target_ctx.lone_rows_max > 10**9


@pytest.mark.real_models
def test_a_q8_0_k_cache_makes_lone_rows_agree_with_batches_past_256_positions(
    real_models: dict[str, Path],
) -> None:
    # Why deterministic mode keeps K in q8_0: with f16, FlashAttention takes its split-KV
    # path for a lone row once 512 cells are attended (past 256 positions) and that row's
    # logits differ from the same row in a batch; with q8_0 every row takes one path.
    from specgguf.llama.backend import LlamaModel
    from specgguf.llama.invariance import _PROBE_TEXT, lone_row_difference

    with LlamaModel(real_models[testmodels.TARGET]) as model:
        prompt = model.tokenize(_PROBE_TEXT, add_special=False)[:300]
        diffs = {}
        for type_k in ("f16", "q8_0"):
            with model.new_context(
                n_ctx=512, n_batch=64, n_outputs_max=4, reserve=1, type_k=type_k
            ) as ctx:
                assert ctx.type_k == type_k
                diffs[type_k] = (lone_row_difference(ctx, prompt),
                                 lone_row_difference(ctx, prompt, past=True))  # fmt: skip
    assert diffs["q8_0"] == (0.0, 0.0), diffs
    assert diffs["f16"][0] == 0.0 and diffs["f16"][1] > 0.0, diffs


def test_lone_rows_go_unpadded_only_up_to_the_limit_the_probe_allows(
    tiny_models: dict[str, Path],
) -> None:
    from specgguf.llama.backend import LlamaModel
    from specgguf.llama.invariance import (
        LONE_ROW_LIMIT,
        NO_LIMIT,
        lone_row_difference,
        lone_rows_max,
    )

    # The probe's verdict: the limit only when lone rows were found equal below it (key
    # -1), no limit when also past it (key -2).
    assert lone_rows_max({-1: 0.0, 0: 0.0, 2: 0.0}) == LONE_ROW_LIMIT == 256
    assert lone_rows_max({-1: 0.0, -2: 0.4, 0: 0.0, 2: 0.0}) == LONE_ROW_LIMIT
    assert lone_rows_max({-1: 0.0, -2: 0.0, 0: 0.0, 2: 0.0}) == NO_LIMIT
    assert lone_rows_max({-1: 1e-6, -2: 0.0, 0: 0.0, 2: 0.0}) == 0
    assert lone_rows_max({0: 0.0, 2: 0.0}) == 0  # not measured: padded
    with LlamaModel(tiny_models["target"]) as model:
        prompt = model.tokenize("The quick brown fox " * 80, add_special=False)[:300]
        with model.new_context(n_ctx=512, n_batch=64, n_outputs_max=8, reserve=1) as ctx:
            diff = lone_row_difference(ctx, prompt)
            assert diff >= 0.0 and ctx.n_past == 0 and ctx.rows_per_decode is None
            with pytest.raises(ValueError, match="256 tokens at least"):
                lone_row_difference(ctx, prompt[:100])
            with pytest.raises(ValueError, match="292 tokens at least"):
                lone_row_difference(ctx, prompt[:291], past=True)
            # A lone row: one row decoded below the limit, two (a throw-away row) from it on.
            ctx.set_rows_per_decode(2)
            ctx.set_lone_rows_max(LONE_ROW_LIMIT)
            sizes = []
            for n in (10, LONE_ROW_LIMIT - 1, LONE_ROW_LIMIT):
                ctx.rollback(0)
                ctx.eval(prompt[:n], logits="none")
                ctx.eval([prompt[n]], logits="last")
                sizes.append(ctx._batch.n_tokens)
                assert ctx.n_past == n + 1
            assert sizes == [1, 1, 2]
            ctx.set_lone_rows_max(0)  # no limit measured: always padded
            ctx.rollback(0)
            ctx.eval(prompt[:10], logits="none")
            ctx.eval([prompt[10]], logits="last")
            assert ctx._batch.n_tokens == 2


def test_a_lazy_verification_reports_the_rows_it_evaluated() -> None:
    """The planner learns timings only from a verification of every row: the loop tells
    it how many rows a lazy verification evaluated."""
    greedy = SamplerParams(temperature=0.0)

    class Rows(FixedPlanner):
        seen: list[tuple[int, int | None]]

        def observe(self, plan, accepted, verify_seconds, confidence=None, *, rows=None):  # type: ignore[no-untyped-def]
            self.seen.append((len(plan.draft.tokens), rows))

    for det, want in ((True, (8, 3)), (False, (8, 9))):
        ctx = FakeContext(soft_rule, V)
        ctx.set_rows_per_decode(3 if det else None)
        # after 1, 2 the target's argmax is 2 x 3 + 1 = 7; the drafts are 8: wrong at once
        planner = Rows(ScriptedDrafter(lambda h, k: [(h[-1] + 6) % V] * k), 8)
        planner.seen = []
        dec = SpeculativeDecoder(ctx, FakeVocab(V))  # type: ignore[arg-type]
        params = GenerationParams(n_predict=12, sampler=greedy, deterministic=det)
        dec.generate([1, 2], params, planner).run()
        assert planner.seen[0] == want, det
