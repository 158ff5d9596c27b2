"""The cost model, the choice of K, and the automatic planner against fake timings."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from specgguf.engine.calibration import (
    calibration_key,
    load_calibration,
    measured_draft_cost,
    save_calibration,
)
from specgguf.speculative.costmodel import (
    Timings,
    best_k,
    cheapest_micro_batches,
    expected_tokens,
    micro_batches,
    row_share,
    verify_time_at,
)
from specgguf.speculative.drafters import ModelDrafter, NgramDrafter
from specgguf.speculative.estimates import Acceptance
from specgguf.speculative.loop import DrafterStats, GenerationParams, SpeculativeDecoder
from specgguf.speculative.planner import FixedPlanner
from specgguf.speculative.sampling import SamplerParams
from specgguf.speculative.tuning import AUTO_TUNING

from . import fakes
from .fakes import FakeContext, FakeVocab, auto_planner, first_eval_cost, one_hot_rule

FLAT_10MS = Timings({1: 0.010, 2: 0.010, 17: 0.010}, draft=0.001)


def test_expected_tokens_formula() -> None:
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert expected_tokens(0.0, 8) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.9, 3) == pytest.approx(3.439)  # 1 + 0.9 + 0.81 + 0.729
    assert expected_tokens(0.8, 4) == pytest.approx(3.3616)
    assert expected_tokens(0.7, -1) == 1.0


#: A small timing table for numbers worked out by hand: t_verify(1..4, 8) and t_draft.
HAND = {1: 0.010, 2: 0.012, 4: 0.016, 8: 0.030}


def test_cost_model_against_hand_computed_numbers() -> None:
    t = Timings(dict(HAND), draft=0.002)
    # Interpolation between calibrated sizes and extrapolation past the last two.
    assert t.verify_time(3) == pytest.approx(0.014)  # halfway from 0.012 to 0.016
    assert t.verify_time(5) == pytest.approx(0.0195)  # 0.016 + 1/4 * 0.014
    assert t.verify_time(6) == pytest.approx(0.023)
    assert t.verify_time(10) == pytest.approx(0.037)  # 0.016 + 6/4 * 0.014
    assert t.verify_time(0) == pytest.approx(0.010)  # below the table: its first size
    # Rates E(K) / (K * 0.002 + t_verify(K + 1)) at a = 0.8:
    #   K=0: 1/0.010 = 100; K=1: 1.8/0.014 = 128.57; K=2: 2.44/0.018 = 135.56;
    #   K=3: 2.952/0.022 = 134.18; K=4: 3.3616/0.0275 = 122.24 -> K = 2.
    assert best_k(0.8, t, 4) == (2, pytest.approx(135.5556, rel=1e-5))
    assert best_k(0.8, t, 1) == (1, pytest.approx(128.5714, rel=1e-5))
    assert best_k(0.8, t, 0) == (0, pytest.approx(100.0))
    # a = 0.3: K=1: 1.3/0.014 = 92.86 < 100: no speculation...
    assert best_k(0.3, t, 4) == (0, pytest.approx(100.0))
    # ...but free drafts (n-gram lookup): K=1: 1.3/0.012 = 108.33, K=2: 1.39/0.014 = 99.29.
    assert best_k(0.3, t, 4, draft_cost=0.0) == (1, pytest.approx(108.3333, rel=1e-5))
    # Online corrections: decode steps 1.25x slower; batches clipped to 0.8x.
    t.observe_verify(1, 0.0125, weight=1.0)
    t.observe_verify(3, 0.007, weight=1.0)
    assert t.scale_single == pytest.approx(1.25) and t.scale_batch == pytest.approx(0.8)
    assert t.verify_time(1) == pytest.approx(0.0125) and t.verify_time(3) == pytest.approx(0.0112)
    t.observe_draft(0.004, weight=0.25)
    assert t.draft == pytest.approx(0.0025)  # 0.002 + 0.25 * (0.004 - 0.002)


def test_checkpoint_and_replay_against_hand_computed_numbers() -> None:
    """A target without snapshots (issue 53): each verification copies its state (save),
    and a rejection after j accepted drafts loads it back (restore) and decodes the j + 1
    rows kept again (t(j + 1) on the curve); best_k weighs that against the drafts."""
    t = Timings(dict(HAND), draft=0.002, replay=(0.001, 0.0005, False))
    assert t.rollback_time(1, 0.8) == 0.0  # a lone row copies nothing
    # n = 3 rows, a = 0.5: 0.001 + 0.5 * (0.0005 + t(1) 0.010)
    #                            + 0.5 * 0.5 * (0.0005 + t(2) 0.012) = 0.009375
    assert t.rollback_time(3, 0.5) == pytest.approx(0.009375)
    assert t.rollback_time(3, 1.0) == pytest.approx(0.001)  # never rejected: the copy
    assert Timings(dict(HAND)).rollback_time(3, 0.5) == 0.0  # cut from the cache: free
    # a = 0.8, as in the test above (K = 2 at 135.56 tokens/s without replay):
    #   K=1: 1.8 / (0.002 + 0.012 + 0.001 + 0.2 * 0.0105) = 1.8/0.0171 = 105.26
    #   K=2: 2.44 / (0.004 + 0.014 + 0.001 + 0.2 * 0.0105 + 0.16 * 0.0125) = 2.44/0.0231
    #        = 105.63
    #   K=3: 2.952 / (0.006 + 0.016 + 0.001 + 0.0021 + 0.0020 + 0.128 * 0.0145) = 103.32
    assert best_k(0.8, t, 4) == (2, pytest.approx(105.6277, rel=1e-5))
    # a = 0.6: K=1: 1.6 / (0.002 + 0.012 + 0.001 + 0.4 * 0.0105) = 83.33 < 100: none,
    # where without replay K = 1 paid (1.6 / 0.014 = 114.29)
    assert best_k(0.6, Timings(dict(HAND), draft=0.002), 4)[0] == 1
    assert best_k(0.6, t, 4) == (0, pytest.approx(100.0))
    # Lazily: the kept rows join the next batch (taken as 3 rows too); a rejection of
    # such a joined step decodes its rows and the earlier ones at once. n = 3, a = 0.5:
    # r = 0.75 rejected, x = r / (1 + r) = 3/7 of the steps joined (no copy), a
    # rejection keeps p = (0.5 * 1 + 0.25 * 2) / 0.75 = 4/3 rows on average:
    #   4/7 * 0.001
    #   + 0.5  * (0.0005 + 4/7 * (t(4) - t(3)) + 3/7 * t(1 + 4/3 = 2.333 rows: 0.012667))
    #   + 0.25 * (0.0005 + 4/7 * (t(5) - t(3)) + 3/7 * t(2 + 4/3 = 3.333 rows: 0.014667))
    #   = 0.000571 + 0.5 * 0.0070714 + 0.25 * 0.0099286 = 0.0065893
    lazy = Timings(dict(HAND), draft=0.002, replay=(0.001, 0.0005, True))
    assert lazy.rollback_time(3, 0.5) == pytest.approx(0.0065893, rel=1e-4)
    assert lazy.rollback_time(3, 0.5) < t.rollback_time(3, 0.5)  # cheaper than at once


def test_acceptance_counts_against_hand_computed_numbers() -> None:
    acc = Acceptance()  # prior 0.6 worth 2 trials, decay 0.9, fade 0.97
    assert acc.rate == pytest.approx(0.6)
    acc.observe(accepted=2, rejected=True)  # 2 successes, 3 trials (the first rejection)
    assert acc.rate == pytest.approx(0.64)  # (2 + 1.2) / (3 + 2)
    acc.observe(accepted=4, rejected=False)  # 0.9 * 2 + 4 = 5.8 of 0.9 * 3 + 4 = 6.7
    assert acc.rate == pytest.approx(7.0 / 8.7)
    acc.observe(accepted=0, rejected=False)  # nothing drafted: nothing learned
    assert acc.rate == pytest.approx(7.0 / 8.7)
    acc.tick()  # 5.626 of 6.499
    assert acc.rate_with(0.5) == pytest.approx(6.626 / 8.499)
    assert (acc.successes, acc.trials) == (pytest.approx(5.626), pytest.approx(6.499))


def test_planner_draft_model_rate_against_hand_computed_numbers() -> None:
    # Nothing measured yet, past the optimistic first steps: the draft model's tokens are
    # accepted at the prior 0.95 and drafting goes on past each at the confidence 0.9, so
    # c = 0.855. The model holds nothing, the history is one token: the first evaluation
    # costs t_draft * t_verify(1) / t_verify(1) = 0.002 s.
    #   K=1: proposed 0.9, step 0.002 + t_verify(1.9) = 0.002 + 0.0118 = 0.0138,
    #        rate 1.855 / 0.0138 = 134.42
    #   K=2: proposed 1.71 after 0.9 evaluations, step 0.002 + 0.0018 + t_verify(2.71)
    #        = 0.0038 + 0.01342 = 0.01722, rate 2.586025 / 0.01722 = 150.18
    model = ModelDrafter(FakeContext(one_hot_rule(target_next, V), V), V)  # type: ignore[arg-type]
    planner = auto_planner(Timings(dict(HAND), 0.002), model=model, learn_timings=False)
    planner.arm("model").steps = AUTO_TUNING.explore_steps
    greedy, rng = SamplerParams(temperature=0), np.random.default_rng(0)
    assert verify_time_at(planner.timings, 2.71) == pytest.approx(0.01342)
    assert first_eval_cost(planner, [1]) == pytest.approx(0.002)
    for k_max, k, rate in ((2, 2, 150.1757), (1, 1, 134.4203)):
        planner.confidence = 0.9
        plan = planner.plan([1], k_max, greedy, rng)
        assert plan.drafter is model and len(plan.draft.tokens) == k
        assert plan.expected_rate == pytest.approx(rate, rel=1e-5)
    # Confidence 0.3 (c = 0.285): K=1 at 1.285 / (0.002 + t_verify(1.3) = 0.0106) = 101.98,
    # K=2 at 1.366225 / (0.0026 + t_verify(1.39) = 0.01078) = 102.11. A model in use (in
    # step, it drafted before) stays while it beats the target alone (100)...
    planner.confidence = 0.3
    plan = planner.plan([1], 2, greedy, rng)
    assert plan.drafter is model and len(plan.draft.tokens) == 2
    assert plan.expected_rate == pytest.approx(102.1095, rel=1e-5)
    # ...one 12 tokens behind pays a catch-up of 0.2 * (t_verify(12) - t_verify(2)) =
    # 0.0064 more and is not used: the target alone, at 100 tokens/s.
    planner = auto_planner(Timings(dict(HAND), 0.002), model=model, learn_timings=False)
    planner.arm("model").steps = AUTO_TUNING.explore_steps
    planner.confidence = 0.3
    plan = planner.plan([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], 2, greedy, rng)
    assert plan.drafter is None and plan.expected_rate == pytest.approx(100.0)


def test_k_choice_with_fake_timings() -> None:
    # A draft at 1 ms per token, a target at 10 ms per batch whatever its size.
    assert best_k(0.0, FLAT_10MS, 16)[0] == 0
    k, rate = best_k(0.9, FLAT_10MS, 16)
    assert k > 2 and rate > 1 / 0.010
    # A draft as slow as the target never pays, even at 90% acceptance, when verifying
    # costs more per token of batch.
    costly = Timings({1: 0.010, 2: 0.014, 3: 0.017, 5: 0.023, 9: 0.031}, draft=0.010)
    assert best_k(0.9, costly, 8)[0] == 0
    # n-gram lookup: no draft cost, so it pays at lower acceptance.
    assert best_k(0.5, costly, 8, draft_cost=0.0)[0] >= 1


def test_timings_interpolate_and_learn() -> None:
    t = Timings({1: 1.0, 3: 3.0, 5: 4.0}, 0.5)
    assert t.verify_time(2) == 2.0 and t.verify_time(4) == 3.5
    # Past the last size: the last two add 0.5 a row, less than the mean over the sizes,
    # (4 - 1) / (5 - 1) = 0.75, which is used: 4 + 2 * 0.75.
    assert t.verify_time(7) == pytest.approx(5.5)
    t.observe_verify(1, 1.4, weight=0.5)  # decode steps run 1.4x slower than calibrated
    assert t.verify_time(1) == pytest.approx(1.2) and t.verify[1] == 1.0  # calibration kept
    t.observe_verify(5, 5.2, weight=1.0)  # batches 1.3x slower
    assert t.verify_time(3) == pytest.approx(3.9) and t.verify_time(1) == pytest.approx(1.2)
    t.observe_verify(5, 40.0, weight=1.0)  # one wild measurement cannot run away
    assert t.scale_batch == 1.5
    t.observe_draft(1.5, weight=0.5)
    assert t.draft == 1.0


def test_calibration_outliers_are_replaced() -> None:
    from specgguf.engine.calibration import _drop_outliers

    raw = {1: 0.08, 2: 0.12, 3: 0.50, 4: 0.12, 5: 0.17, 9: 0.25, 13: 0.99, 17: 0.32, 25: 0.4}
    clean = _drop_outliers(raw)
    assert clean[3] == pytest.approx(0.12) and clean[13] == pytest.approx(0.285)
    assert {n: clean[n] for n in (1, 2, 4, 5, 9, 17, 25)} == {
        n: raw[n] for n in (1, 2, 4, 5, 9, 17, 25)
    }


def test_acceptance_tracks_the_text() -> None:
    acc = Acceptance(prior=0.5, weight=2)
    for _ in range(40):
        acc.observe(accepted=4, rejected=False)
    assert acc.rate > 0.95
    for _ in range(40):
        acc.observe(accepted=0, rejected=True)
    assert acc.rate < 0.15  # the prior (0.5 worth 2 trials) keeps it off zero
    assert acc.rate_with(0.0) < 0.06
    for _ in range(300):  # unused for long: old observations fade, the prior takes over
        acc.tick()
    assert acc.rate_with(0.9) > 0.85


def test_calibration_cache_follows_files(tmp_path: Path) -> None:
    target = tmp_path / "t.gguf"
    target.write_bytes(b"x")
    key = calibration_key("build", target, None, 2, True)
    save_calibration(key, Timings({1: 0.1, 2: 0.15}, 0.05, depth=64, position_single=1e-6,
                                  position_row=3e-6))  # fmt: skip
    loaded = load_calibration(key)
    assert loaded is not None and loaded.verify == {1: 0.1, 2: 0.15} and loaded.draft == 0.05
    assert (loaded.depth, loaded.position_single, loaded.position_row) == (64, 1e-6, 3e-6)
    # A calibration cached before depth was measured is measured again.
    from specgguf.cache import update_json_cache
    from specgguf.engine.calibration import _cache_file

    update_json_cache(_cache_file(), key, {"verify": {"1": 0.1}, "draft": 0.05, "time": 0})
    assert load_calibration(key) is None
    os.utime(target, ns=(1, 1))  # the file changed: another key, nothing cached
    assert calibration_key("build", target, None, 2, True) != key
    assert calibration_key("other build", target, None, 2, True) != key


def test_a_pairs_draft_cost_is_looked_up_by_its_files_whatever_the_threads(
    tiny_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    target.write_bytes(tiny_models["target"].read_bytes())
    draft.write_bytes(tiny_models["draft-identical"].read_bytes())
    assert measured_draft_cost(target, draft) is None  # nothing cached

    def plant(n_threads: int, verify_1: float, t_draft: float, when: float, rows: int = 0) -> None:
        key = calibration_key("build", target, draft, n_threads, True, rows)
        timings = Timings({1: verify_1, 2: 0.9}, t_draft, depth=64)
        assert save_calibration(key, timings, measured_at=when)

    plant(4, 0.040, 0.030, when=1000.0)  # an older one, with other threads
    plant(2, 0.050, 0.012, when=2000.0)  # the most recent: c = 0.012 / 0.050
    plant(2, 0.010, 0.009, when=3000.0, rows=4)  # deterministic mode's: not one row's
    plant(3, 2.000, 0.012, when=2500.0)  # a lone row slower than 2 rows: a busy machine
    assert measured_draft_cost(target, draft) == pytest.approx(0.24)
    # The other way round, or the target alone, is not this pair.
    assert measured_draft_cost(draft, target) is None
    save_calibration(calibration_key("build", target, None, 2, True), Timings({1: 0.05}, 0.0))
    assert measured_draft_cost(target, target) is None
    # An entry cached before entries recorded their files is not found.
    from specgguf.cache import read_json_cache, update_json_cache
    from specgguf.engine.calibration import _cache_file

    newest = {k: v for k, v in read_json_cache(_cache_file()).items() if v["time"] == 2000.0}
    ((key, old),) = newest.items()
    update_json_cache(_cache_file(), key, {k: v for k, v in old.items() if "file" not in k})
    assert measured_draft_cost(target, draft) == pytest.approx(0.030 / 0.040)
    # A changed draft file is another file: its old timings are not its own.
    os.utime(draft, ns=(1, 1))
    assert measured_draft_cost(target, draft) is None


V = 32


def target_next(prefix: Sequence[int]) -> int:
    return prefix[-1] % 30 + 1


def wrong_next(prefix: Sequence[int]) -> int:
    return (prefix[-1] + 13) % 30 + 1


def run_auto(draft_rule, prompt: list[int], n: int = 120, draft_s: float = 0.001):  # type: ignore[no-untyped-def]
    target = FakeContext(one_hot_rule(target_next, V), V)
    model = ModelDrafter(FakeContext(one_hot_rule(draft_rule, V), V), V)  # type: ignore[arg-type]
    timings = Timings(dict(FLAT_10MS.verify), draft_s)
    planner = auto_planner(timings, model=model, ngram=NgramDrafter(2, 6), draft_max=16,
                          learn_timings=False)  # fmt: skip
    dec = SpeculativeDecoder(target, FakeVocab(V))  # type: ignore[arg-type]
    params = GenerationParams(n_predict=n, sampler=SamplerParams(temperature=0))
    return dec.generate(prompt, params, planner).run(), planner


def test_planner_drafts_long_when_the_draft_is_right() -> None:
    res, planner = run_auto(target_next, [1, 2, 3])
    s = res.stats
    assert s.acceptance_rate > 0.9
    assert s.mean_accepted > 4  # K grew well beyond 2
    assert planner.arm("model").accepted.rate > 0.9


def test_planner_stops_drafting_when_the_draft_is_wrong() -> None:
    # 29 tokens: the fake target's cycle of 30 has not repeated, so no n-gram matches.
    # The fake target is confident (top-1 probability 0.99), which makes the planner try
    # the draft model; its rejections then outweigh that prior and it stops.
    res, _ = run_auto(wrong_next, [7], n=29, draft_s=0.005)
    s = res.stats
    model_steps = s.by_drafter.get("model", DrafterStats())
    assert model_steps.steps <= 8 and model_steps.accepted == 0, s.by_drafter
    assert s.by_drafter["none"].steps >= s.steps - 8
    assert res.tokens == _truth([7], 29)


def test_planner_prefers_ngram_when_the_text_repeats() -> None:
    # The fake target cycles 1..30, so once 30 tokens are out every n-gram recurs.
    res, _ = run_auto(wrong_next, [1, 2, 3], n=200)
    ng = res.stats.by_drafter.get("ngram", DrafterStats())
    assert ng.accepted > 100  # most tokens came from accepted n-gram drafts
    assert res.tokens == _truth([1, 2, 3], 200)


def _truth(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(target_next(seq))
    return seq[len(prompt) :]


def test_fake_rng_is_unused_in_greedy() -> None:
    # Greedy planning must not consume randomness (reproducibility of seeded runs).
    rng = np.random.default_rng(0)
    before = rng.bit_generator.state
    NgramDrafter().propose([1, 2, 1, 2], 4, SamplerParams(temperature=0), rng)
    assert rng.bit_generator.state == before


def test_catch_up_is_spread_only_over_the_models_runs() -> None:
    # A draft model 100 tokens behind pays a batched catch-up before drafting. Charged
    # whole at first; spread over the mean run of consecutive model steps once runs are
    # long, so that an occasional model step between long n-gram runs is not favoured.
    # By hand, with HAND's table and t_draft 0.002: the draft costs 0.2 of a target decode
    # step; 100 tokens cost 0.2 * t_verify(100) = 0.2 * (0.016 + 96/4 * 0.014) = 0.0704.
    model = ModelDrafter(FakeContext(one_hot_rule(target_next, V), V), V)  # type: ignore[arg-type]
    planner = auto_planner(Timings(dict(HAND), 0.002), model=model, learn_timings=False)
    history = list(range(100))
    assert first_eval_cost(planner, history) == pytest.approx(0.0704)
    # Spread over a mean run of 8 steps: 0.2 * 0.012 + 0.2 * (0.352 - 0.012) / 8 = 0.0109;
    # over 4: 0.0194; the spread never goes beyond ``catch_up_horizon`` (8) steps.
    planner.arm("model").mean_streak = 8.0
    assert first_eval_cost(planner, history) == pytest.approx(0.0109)
    planner.arm("model").mean_streak = 4.0
    assert first_eval_cost(planner, history) == pytest.approx(0.0194)
    planner.arm("model").mean_streak = 20.0
    assert first_eval_cost(planner, history) == pytest.approx(0.0109)
    # Two tokens behind or fewer is a normal step: 0.2 * t_verify(2) = 0.0024.
    assert first_eval_cost(planner, history[:2]) == pytest.approx(0.0024)
    assert first_eval_cost(planner, history[:1]) == pytest.approx(0.002)


def test_planner_probes_a_draft_model_that_nearly_pays() -> None:
    # With nothing measured, the model's estimate rests on the target's confidence (and
    # on the prior acceptance of tokens drafting goes on past). Pick a confidence whose best
    # expected rate is just short of the target alone's: no speculation at first, then a
    # short probe (K <= 4) after ``probe_every`` idle steps, and not again right after.
    timings = Timings({1: 0.010, 2: 0.015, 5: 0.021, 17: 0.050}, 0.004)
    base = 1.0 / timings.verify_time(1)
    prior = Acceptance(prior=0.95).rate

    def verify(x: float) -> float:  # t_verify at an expected (fractional) batch size
        lo = int(x)
        return timings.verify_time(lo) + (x - lo) * (
            timings.verify_time(lo + 1) - timings.verify_time(lo)
        )

    def best_rate(conf: float) -> float:
        first = timings.draft  # one token to evaluate before drafting
        rates, proposed = [], 0.0
        for k in range(1, 17):
            evals, proposed = proposed, proposed + conf**k
            step = first + evals * timings.draft + verify(1 + proposed)
            rates.append(expected_tokens(prior * conf, k) / step)
        return max(rates)

    conf = next(c / 1000 for c in range(300, 1000) if best_rate(c / 1000) > 0.95 * base)
    assert best_rate(conf) < base
    model = ModelDrafter(FakeContext(one_hot_rule(target_next, V), V), V)  # type: ignore[arg-type]
    planner = auto_planner(timings, model=model, learn_timings=False)
    planner.arm("model").steps = AUTO_TUNING.explore_steps  # past its optimistic first steps
    greedy, rng = SamplerParams(temperature=0), np.random.default_rng(0)
    history = [1]
    kinds = []
    for _ in range(2 * AUTO_TUNING.probe_every - 1):
        planner.confidence = conf
        plan = planner.plan(history, 16, greedy, rng)
        kinds.append(len(plan.draft.tokens) if plan.drafter is model else 0)
        # The history stays one token long: the model is never behind (no catch-up cost).
    probes = [i for i, k in enumerate(kinds) if k]
    assert probes == [AUTO_TUNING.probe_every - 1], kinds
    assert 1 <= kinds[probes[0]] <= 4


#: Timings measured on the Qwen pair (seconds), where a draft model gains about 20% at
#: best: one early rejection can make it look like a loss.
QWEN_LIKE = {1: 0.063, 2: 0.095, 3: 0.127, 4: 0.110, 5: 0.139, 9: 0.219, 17: 0.302}


def test_an_early_rejection_does_not_rule_out_the_draft_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The draft model is wrong once, at the first step, and right ever after. Judged
    # optimistically while it is in step and has few steps behind it, it stays in use;
    # judged by its plain estimate (no exploration), the one rejection makes it look
    # like a loss and it is left idle.
    def once_wrong(prefix: Sequence[int]) -> int:
        return wrong_next(prefix) if len(prefix) == 5 else target_next(prefix)

    def model_tokens() -> int:
        target = FakeContext(one_hot_rule(target_next, V), V)
        model = ModelDrafter(FakeContext(one_hot_rule(once_wrong, V), V), V)  # type: ignore[arg-type]
        planner = auto_planner(Timings(dict(QWEN_LIKE), 0.029), model=model, learn_timings=False)
        dec = SpeculativeDecoder(target, FakeVocab(V))  # type: ignore[arg-type]
        params = GenerationParams(n_predict=26, sampler=SamplerParams(temperature=0))
        res = dec.generate([1, 2, 3], params, planner).run()
        assert res.tokens == _truth([1, 2, 3], 26)
        return res.stats.by_drafter.get("model", DrafterStats()).accepted

    assert model_tokens() >= 15  # accepted model drafts: most of the 26 tokens
    monkeypatch.setattr(fakes, "TUNING", dataclasses.replace(fakes.TUNING, explore_steps=0))
    assert model_tokens() <= 3


def test_the_draft_model_stops_at_an_unsure_token(monkeypatch: pytest.MonkeyPatch) -> None:
    # A draft that is right where it is sure and unsure (flat logits, so its top token
    # is wrong) after every multiple of 5: it stops before the unsure tokens, so every
    # token it proposes is accepted. Without ``p_stop`` it proposes them and they fail.
    def unsure_rule(prefix: Sequence[int]) -> np.ndarray:
        if prefix[-1] % 5 == 0:
            return np.zeros(V, np.float32)  # argmax: token 0, never the target's
        return one_hot_rule(target_next, V)(prefix)

    def model_row() -> list[int]:
        target = FakeContext(one_hot_rule(target_next, V), V)
        model = ModelDrafter(FakeContext(unsure_rule, V), V)  # type: ignore[arg-type]
        planner = auto_planner(Timings(dict(FLAT_10MS.verify), 0.001), model=model,
                              learn_timings=False)  # fmt: skip
        dec = SpeculativeDecoder(target, FakeVocab(V))  # type: ignore[arg-type]
        params = GenerationParams(n_predict=28, sampler=SamplerParams(temperature=0))
        res = dec.generate([1, 2, 3], params, planner).run()
        assert res.tokens == _truth([1, 2, 3], 28)
        return res.stats.by_drafter.get("model", DrafterStats())

    row = model_row()
    assert row.drafted >= 15 and row.accepted == row.drafted
    monkeypatch.setattr(fakes, "TUNING", dataclasses.replace(fakes.TUNING, p_stop=0.0))
    row = model_row()
    assert row.accepted < row.drafted


def test_model_drafter_reports_where_it_stopped() -> None:
    def rule(prefix: Sequence[int]) -> np.ndarray:
        row = np.zeros(V, np.float32)
        row[target_next(prefix)] = 10.0 if len(prefix) < 4 else 0.5  # sure, then unsure
        return row

    drafter = ModelDrafter(FakeContext(rule, V), V)  # type: ignore[arg-type]
    greedy, rng = SamplerParams(temperature=0), np.random.default_rng(0)
    draft = drafter.propose([1, 2], 8, greedy, rng, p_min=0.5)
    assert draft.tokens == [3, 4] and draft.stopped
    draft = drafter.propose([1, 2], 8, greedy, rng, p_min=0.0)
    assert len(draft.tokens) == 8 and not draft.stopped
    # A fixed drafter's p_min reaches the drafter (llama.cpp's --draft-p-min).
    assert FixedPlanner(drafter, 8, p_min=0.5).plan([1, 2], 8, greedy, rng).draft.tokens == [3, 4]
    assert len(FixedPlanner(drafter, 8).plan([1, 2], 8, greedy, rng).draft.tokens) == 8


@pytest.mark.parametrize("draft_min", [5, 8])
def test_auto_planner_verifies_no_draft_shorter_than_draft_min(draft_min: int) -> None:
    def run(minimum: int) -> tuple[list[int], list[int]]:
        target = FakeContext(one_hot_rule(target_next, V), V)
        model = ModelDrafter(FakeContext(one_hot_rule(target_next, V), V), V)  # type: ignore[arg-type]
        planner = auto_planner(Timings(dict(FLAT_10MS.verify), 0.001), model=model,
                              ngram=NgramDrafter(2, 6), draft_max=16, draft_min=minimum,
                              learn_timings=False)  # fmt: skip
        dec = SpeculativeDecoder(target, FakeVocab(V))  # type: ignore[arg-type]
        params = GenerationParams(n_predict=90, sampler=SamplerParams(temperature=0))
        res = dec.generate([1, 2, 3], params, planner).run()
        lengths = [len(e[2]) - 1 for e in target.log if e[0] == "eval" and e[3] == "all"]
        return res.tokens, lengths

    tokens, lengths = run(draft_min)
    assert tokens == _truth([1, 2, 3], 90)
    drafted = [k for k in lengths if k]
    assert drafted and min(drafted) >= draft_min
    # Control: without a minimum the planner starts with shorter drafts (exploration: 4).
    _, free = run(0)
    assert min(k for k in free if k) < draft_min


class Clock:
    """A fake ``time.perf_counter``: advanced only by the fake contexts' evaluations."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class ClockedContext(FakeContext):
    """A fake model whose evaluation of n tokens takes ``base + per_token * n`` seconds
    on ``clock``, and ``hiccup`` seconds more for the second evaluation of each
    size (a machine hiccup that the minimum of the repeats must drop)."""

    def __init__(
        self, clock: Clock, base: float, per_token: float, hiccup: float = 0.5, **kw: int
    ) -> None:
        super().__init__(one_hot_rule(target_next, V), V, **kw)
        self.clock, self.base, self.per_token, self.hiccup = clock, base, per_token, hiccup
        self.seen: dict[int, int] = {}

    def eval(self, tokens, *, logits="last"):  # type: ignore[no-untyped-def]
        n = len(tokens)
        self.seen[n] = self.seen.get(n, 0) + 1
        self.clock.now += (
            self.base + self.per_token * n + (self.hiccup if self.seen[n] == 2 else 0.0)
        )
        return super().eval(tokens, logits=logits)


def test_calibrate_measures_each_batch_size_and_the_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    from specgguf.engine import calibration as planner_module
    from specgguf.engine.calibration import calibrate

    clock = Clock()
    monkeypatch.setattr(planner_module.time, "perf_counter", clock)
    target = ClockedContext(clock, 0.010, 0.001, n_ctx=40, n_batch=16)
    draft = ClockedContext(clock, 0.002, 0.0, n_ctx=64)
    t = calibrate(target, draft, [5, 6, 7], sizes=(1, 2, 4, 9, 13, 17, 25), repeats=3)
    # Sizes past the batch (16) are not measured; each is its own minimum over 3 repeats
    # (the second evaluation of each size is 0.5 s slower and is dropped).
    assert sorted(t.verify) == [1, 2, 4, 9, 13]
    for n, s in t.verify.items():
        assert s == pytest.approx(0.010 + 0.001 * n), n
    assert t.draft == pytest.approx(0.002)
    # Both caches are left empty; the prefix (room 40 - 13 - 1 = 26 tokens of the given
    # ids) was evaluated first, and every measured batch started after it.
    assert target.n_past == 0 and draft.n_past == 0
    first = next(e for e in target.log if e[0] == "eval")
    assert first == ("eval", 0, ([5, 6, 7] * 9)[:26], "none")
    measured = [e for e in target.log if e[0] == "eval" and e[3] == "all"]
    assert all(e[1] == 26 for e in measured)
    assert {len(e[2]) for e in measured} == {1, 2, 4, 9, 13}
    assert len([e for e in measured if len(e[2]) == 4]) == 3  # the repeats
    assert measured[-1][2] == ([5, 6, 7] * 5)[:13]
    # Before each measurement the other model ran one token (it evicts the caches).
    draft_evals = [e for e in draft.log if e[0] == "eval" and e[3] == "last"]
    assert len(draft_evals) >= 1 + 5 * 3 and all(len(e[2]) == 1 for e in draft_evals[:16])
    # Without a draft model: no draft time; a context of 8 leaves sizes up to 7.
    small = ClockedContext(clock, 0.010, 0.001, n_ctx=8, n_batch=64)
    t = calibrate(small, None, [], repeats=2)
    assert sorted(t.verify) == [1, 2, 3, 4, 5, 7] and t.draft == 0.0
    assert next(e for e in small.log if e[0] == "eval")[2] == [0]  # no ids: token 0
    # A target whose outputs are fewer than its batch is measured up to its outputs.
    narrow = ClockedContext(clock, 0.010, 0.001, n_ctx=64, n_batch=64)
    narrow.n_outputs_max = 3  # type: ignore[attr-defined]
    assert sorted(calibrate(narrow, None, [1], repeats=1).verify) == [1, 2, 3]
    # Nothing fits: size 1 only.
    tiny = ClockedContext(clock, 0.010, 0.001, n_ctx=2, n_batch=1)
    assert sorted(calibrate(tiny, None, [1], repeats=1).verify) == [1]


class DeepClockedContext(ClockedContext):
    """A :class:`ClockedContext` whose evaluations also cost ``lone`` seconds per cached
    position for one token, and ``row`` per cached position for each token of a batch."""

    def __init__(self, clock: Clock, lone: float, row: float, **kw: int) -> None:
        super().__init__(clock, 0.010, 0.001, hiccup=0.0, **kw)
        self.lone, self.row = lone, row

    def eval(self, tokens, *, logits="last"):  # type: ignore[no-untyped-def]
        if logits != "none":
            n = len(tokens)
            self.clock.now += self.n_past * (self.lone if n == 1 else n * self.row)
        return super().eval(tokens, logits=logits)


def test_calibrate_measures_what_each_cached_position_adds(monkeypatch: pytest.MonkeyPatch) -> None:
    from specgguf.engine import calibration as planner_module
    from specgguf.engine.calibration import calibrate

    clock = Clock()
    monkeypatch.setattr(planner_module.time, "perf_counter", clock)
    target = DeepClockedContext(clock, 1e-6, 4e-6, n_ctx=1024, n_batch=64)
    draft = ClockedContext(clock, 0.002, 0.0, hiccup=0.0, n_ctx=1024)
    t = calibrate(target, draft, [5, 6, 7], sizes=(1, 2, 3, 5, 9, 17), repeats=2, deep=512)
    # The curve at the 64-token prefix: 0.010 + 0.001 n + 64 positions' worth.
    assert t.depth == 64
    assert t.verify[1] == pytest.approx(0.011 + 64 * 1e-6)
    assert t.verify[9] == pytest.approx(0.019 + 64 * 9 * 4e-6)
    # Measured again after 512 tokens (the sizes of DEPTH_SIZES that fit), the slopes.
    assert t.position_single == pytest.approx(1e-6) and t.position_row == pytest.approx(4e-6)
    deep = [e for e in target.log if e[0] == "eval" and e[3] == "all" and e[1] == 512]
    assert sorted({len(e[2]) for e in deep}) == [1, 5, 17] and len(deep) == 6
    # The prefix was extended from 64 to 512 with the calibration ids, then both caches
    # were emptied; the draft's cache held only the short prefix.
    assert ("eval", 64, ([5, 6, 7] * 171)[64:512], "none") in target.log
    assert target.n_past == 0 and draft.n_past == 0
    assert max(e[1] for e in draft.log if e[0] == "eval") == 64
    # Its cost model: 4 rows at 1064 cached positions cost 1000 * 4 * 4 us more.
    assert t.verify_time(4, 1064) == pytest.approx(0.014 + 64 * 4 * 4e-6 + 1000 * 4 * 4e-6)
    # Without deep, or without 128 positions more room than the first prefix: flat.
    for kw in ({}, {"deep": 150}):
        flat = calibrate(DeepClockedContext(clock, 1e-6, 4e-6, n_ctx=1024, n_batch=64), None,
                         [5], sizes=(1, 2, 3), repeats=1, **kw)  # type: ignore[arg-type]  # fmt: skip
        assert flat.position_single == 0.0 and flat.position_row == 0.0
    # A context too small for the probe: as deep as it allows (room for 5 rows after it).
    small = DeepClockedContext(clock, 1e-6, 4e-6, n_ctx=300, n_batch=64)
    t = calibrate(small, None, [5], sizes=(1, 2, 3, 5), repeats=1, deep=512)
    assert t.position_row == pytest.approx(4e-6)
    assert {e[1] for e in small.log if e[0] == "eval" and e[3] == "all"} == {64, 294}


class DeepBusyContext(DeepClockedContext):
    """A :class:`DeepClockedContext` whose lone rows deep in the context (past 256 cached
    positions) are slow by different amounts each time (a machine busy only then)."""

    busy = 0

    def eval(self, tokens, *, logits="last"):  # type: ignore[no-untyped-def]
        if logits == "all" and len(tokens) == 1 and self.n_past > 256:
            self.busy += 1
            self.clock.now += 0.05 * self.busy
        return super().eval(tokens, logits=logits)


def test_the_deep_curves_hiccups_are_measured_again_and_keep_it_from_the_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from specgguf.engine import calibration as module
    from specgguf.engine.calibration import _calibrate

    clock = Clock()
    monkeypatch.setattr(module.time, "perf_counter", clock)
    target = DeepBusyContext(clock, 1e-6, 4e-6, n_ctx=1024, n_batch=64)
    t, left, kept = _calibrate(target, None, [5, 6, 7], sizes=(1, 2, 3, 5, 9, 17), repeats=2,
                               deep=512)  # fmt: skip
    assert (left, kept) == ([1], [])
    # the deep lone row tried 1 + 2 times (of 2 repeats), then interpolated: 5 rows' time
    # in proportion, below the shallow row's, so no lone-row slope; the rows' slope holds
    deep_lone = [e for e in target.log if e[0] == "eval" and e[3] == "all" and e[1] == 512
                 and len(e[2]) == 1]  # fmt: skip
    assert len(deep_lone) == 3 * 2
    assert t.position_single == 0.0 and t.position_row == pytest.approx(4e-6)
    assert t.verify[1] == pytest.approx(0.011 + 64 * 1e-6)  # the shallow curve is right


def test_model_drafter_times_its_tokens_and_keeps_to_half_its_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from specgguf.speculative.drafters import model as drafters_module

    clock = Clock()
    monkeypatch.setattr(drafters_module.time, "perf_counter", clock)
    ctx = ClockedContext(clock, 0.004, 0.001, hiccup=0.0, n_ctx=64)
    drafter = ModelDrafter(ctx, V)  # type: ignore[arg-type]
    greedy, rng = SamplerParams(temperature=0), np.random.default_rng(0)
    # First call: the history (5 tokens) in one evaluation, then 3 one-token evaluations.
    draft = drafter.propose([1, 2, 3, 4, 5], 4, greedy, rng)
    assert draft.tokens == [6, 7, 8, 9] and draft.dists is None
    assert draft.token_seconds == pytest.approx(0.005)  # the catch-up excluded
    assert drafter.seconds == pytest.approx(0.009 + 3 * 0.005)
    # A one-token draft in step (the last token only): its one evaluation is its cost.
    draft = drafter.propose([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 1, greedy, rng)
    assert draft.token_seconds == pytest.approx(0.006)  # 2 tokens: 9 and 10
    # A draft never takes more than half the draft's context.
    small = ModelDrafter(FakeContext(one_hot_rule(target_next, V), V, n_ctx=10), V)  # type: ignore[arg-type]
    assert len(small.propose([1, 2], 8, greedy, rng).tokens) == 5
    # Sampled drafting keeps each token's distribution, all different here.
    sampled = SamplerParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    draft = ModelDrafter(FakeContext(one_hot_rule(target_next, V), V), V).propose(  # type: ignore[arg-type]
        [1, 2], 3, sampled, np.random.default_rng(1)
    )
    assert draft.dists is not None and len(draft.dists) == 3 == len(draft.tokens)
    for q, t in zip(draft.dists, draft.tokens, strict=True):
        assert q.prob(t) > 0 and q.ids.size == V
    assert len({int(q.ids[0]) for q in draft.dists}) == 3
    # Nothing to draft from, or nothing asked: no draft and no evaluation.
    assert drafter.propose([], 4, greedy, rng).tokens == []
    assert drafter.propose([1, 2], 0, greedy, rng).tokens == []


def test_timings_curve_edges_upper_bound_and_outliers_by_hand() -> None:
    from specgguf.engine.calibration import _drop_outliers
    from specgguf.speculative.estimates import upper as _upper

    t = Timings({2: 0.1, 6: 0.3})
    assert t.verify_time(3) == pytest.approx(0.15) and t.verify_time(5) == pytest.approx(0.25)
    assert t.verify_time(8) == pytest.approx(0.4)  # slope 0.05 per token past 6
    assert t.verify_time(1) == pytest.approx(0.1)  # below the table: its first size
    one = Timings({4: 0.02})  # a single size: proportional to the batch
    assert one.verify_time(8) == pytest.approx(0.04) and one.verify_time(4) == 0.02
    assert _upper(0.5, 2.0, 2.0) == pytest.approx(0.75)  # 0.5 + sqrt(0.25 / 4)
    assert _upper(0.99, 0.0, 2.0) == 1.0
    assert _upper(0.0, 5.0, 2.0) == 0.0
    # The first size too, with nothing below it: the next size's time in proportion to
    # the rows, 0.1 * 1 / 2 (too low makes drafts look dear, never free); exactly 1.5
    # times a larger one is kept; any larger size counts, not only the next two.
    assert _drop_outliers({1: 1.0, 2: 0.1, 3: 0.1}) == {1: 0.05, 2: 0.1, 3: 0.1}
    assert _drop_outliers({1: 0.1, 2: 0.3, 3: 0.2, 4: 0.2})[2] == 0.3
    assert _drop_outliers({1: 0.1, 2: 0.5, 3: 0.2, 4: 0.4, 5: 0.4})[2] == pytest.approx(0.15)
    assert _drop_outliers({1: 0.1, 2: 0.7, 3: 0.2, 4: 0.4})[2] == pytest.approx(0.15)


# A calibration cached on the 2-core EPYC on 2026-12-04 while a test suite ran beside
# another (tiny models: a row costs about 60 us): batches of 1 to 3 rows took up to 2,000
# times what 4 rows did. Auto mode reused it for a day, and with a margin of 1000 over the
# target alone still drafted (`scripts/bench-tuning --set margin=1000`: 32 tokens).
BUSY_CALIBRATION = {1: 0.22, 2: 0.22, 3: 0.1101, 4: 0.0001121, 5: 0.0001244, 7: 0.0001613,
                    9: 0.0001917, 13: 0.0002632, 17: 0.0003218, 25: 0.000464}  # fmt: skip


def test_batch_sizes_slower_than_a_larger_one_are_hiccups() -> None:
    from specgguf.engine.calibration import _drop_outliers, hiccups

    assert hiccups(BUSY_CALIBRATION) == [1, 2, 3]
    clean = _drop_outliers(BUSY_CALIBRATION)
    # nothing below them: 4 rows' time in proportion, 0.0001121 * n / 4
    assert [clean[n] for n in (1, 2, 3)] == pytest.approx([0.000028025, 0.00005605, 0.000084075])
    assert {n: clean[n] for n in BUSY_CALIBRATION if n > 3} == {
        n: v for n, v in BUSY_CALIBRATION.items() if n > 3
    }
    # two in a row between kept sizes: both from the sizes around them, 0.1 and 0.4
    assert hiccups({1: 0.1, 2: 0.9, 3: 0.8, 4: 0.4}) == [2, 3]
    assert _drop_outliers({1: 0.1, 2: 0.9, 3: 0.8, 4: 0.4}) == pytest.approx(
        {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4}
    )
    # a curve that only rises, or falls by less than the ratio, has none
    assert hiccups({1: 0.1, 2: 0.14, 3: 0.13, 5: 0.2}) == [] == hiccups({1: 0.1})


def test_a_cached_calibration_of_shorter_batches_is_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A context set up for longer drafts (auto mode's 64) than the cached calibration
    # measured (up to 17 rows: a context for drafts of 16) is measured again, up to the
    # largest size its outputs allow; a calibration that measured enough is kept.
    from specgguf.engine.calibration import calibration_sizes, pair_timings

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    clock = Clock()
    monkeypatch.setattr("specgguf.engine.calibration.time.perf_counter", clock)
    target = ClockedContext(clock, 0.010, 0.001, n_ctx=1024, n_batch=512)
    target.n_outputs_max = 65  # type: ignore[attr-defined]
    assert max(calibration_sizes(target, None)) == 49
    short = {n: 0.010 + 0.001 * n for n in (1, 2, 3, 4, 5, 7, 9, 13, 17)}
    save_calibration("k", Timings(dict(short), 0.0, depth=64))
    assert max(pair_timings("k", target, None, [1, 2, 3]).verify) == 49
    loaded = load_calibration("k")
    assert loaded is not None and max(loaded.verify) == 49  # cached for the next time
    # Enough measured (and one decode step agreeing with it): the cache as it is.
    planted = {**short, 25: 0.5, 33: 0.6, 49: 0.7}
    save_calibration("k", Timings(dict(planted), 0.0, depth=64))
    assert pair_timings("k", target, None, [1, 2, 3]).verify == planted
    target.n_outputs_max = 17  # type: ignore[attr-defined]
    save_calibration("k", Timings(dict(short), 0.0, depth=64))
    assert pair_timings("k", target, None, [1, 2, 3]).verify == short


class BusyContext(ClockedContext):
    """A :class:`ClockedContext` on a busy machine: the first ``busy_for`` evaluations of
    each size in ``slow`` (None: all of them; a size 1's first is calibrate's warm-up)
    take ``extra`` seconds more, or with ``vary`` ``extra`` times how many of that size it
    has evaluated (a machine busy by different amounts at different times)."""

    def __init__(
        self,
        clock: Clock,
        slow: set[int],
        extra: float,
        busy_for: int | None,
        vary: bool = False,
        **kw: int,
    ) -> None:
        super().__init__(clock, 0.010, 0.001, hiccup=0.0, **kw)
        self.slow, self.extra, self.busy_for, self.vary = slow, extra, busy_for, vary

    def eval(self, tokens, *, logits="last"):  # type: ignore[no-untyped-def]
        n = len(tokens)
        out = super().eval(tokens, logits=logits)
        if n in self.slow and (self.busy_for is None or self.seen[n] <= self.busy_for):
            self.clock.now += self.extra * (self.seen[n] if self.vary else 1)
        return out


class LateContext(ClockedContext):
    """A :class:`ClockedContext` whose evaluations of each size n in ``busy`` take
    ``busy[n][0]`` seconds more for the first ``busy[n][1]`` of them."""

    def __init__(self, clock: Clock, busy: dict[int, tuple[float, int]], **kw: int) -> None:
        super().__init__(clock, 0.010, 0.001, hiccup=0.0, **kw)
        self.busy = busy

    def eval(self, tokens, *, logits="last"):  # type: ignore[no-untyped-def]
        n = len(tokens)
        out = super().eval(tokens, logits=logits)
        extra, count = self.busy.get(n, (0.0, 0))
        if self.seen[n] <= count:
            self.clock.now += extra
        return out


def test_a_busy_machines_calibration_is_measured_again_and_never_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from specgguf.engine import calibration as module
    from specgguf.engine.calibration import calibrate, calibration_source, pair_timings

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    clock = Clock()
    monkeypatch.setattr(module.time, "perf_counter", clock)
    right = {n: 0.010 + 0.001 * n for n in (1, 2, 3, 4, 5, 7, 9, 13)}

    def busy(slow: set[int], extra: float, busy_for: int | None, vary: bool) -> BusyContext:
        return BusyContext(clock, slow, extra, busy_for, vary, n_ctx=40, n_batch=16)

    # Sizes 1-3 slow for their first 4 evaluations (the warm-up or a first try again, and
    # the repeats), then not: measured again, and right.
    assert calibrate(busy({1, 2, 3}, 0.2, 4, False), None, [1, 2]).verify == pytest.approx(right)
    # Slow every time, by different amounts: interpolated (4 rows' time in proportion)
    # after 2 more tries of 3
    ctx = busy({1, 2, 3}, 0.2, None, True)
    t = calibrate(ctx, None, [1, 2])
    assert [t.verify[n] for n in (1, 2, 3)] == pytest.approx([0.014 * n / 4 for n in (1, 2, 3)])
    measured = [e for e in ctx.log if e[0] == "eval" and e[3] == "all" and len(e[2]) == 2]
    assert len(measured) == 3 + 2 * 3
    # pair_timings: the calm machine's calibration is cached; the busy one's is not, and
    # says so
    calm = pair_timings("calm", busy({1, 2, 3}, 0.2, 4, False), None, [1, 2])
    assert calm.verify == pytest.approx(right)
    cached = load_calibration("calm")
    assert cached is not None and cached.verify == pytest.approx(right)
    with caplog.at_level("WARNING", logger="specgguf"):
        pair_timings("busy", busy({1, 2, 3}, 0.2, None, True), None, [1, 2])
    assert load_calibration("busy") is None
    source = calibration_source("busy")
    assert source is not None and not source.saved
    assert source.unsaved.startswith("batches of 1, 2, 3 row(s) stayed slower than larger "
                                      "ones, differently each of 3 times")  # fmt: skip
    assert source.unsaved in caplog.text
    # A size first slower than a larger one after the last try: 9 rows busy (0.2 s more)
    # at their first 6 evaluations, 5 rows by 0.015 s at their only try (0.030 s, under
    # 1.5 x 13 rows' 0.023 then, over 1.5 x 9 rows' 0.019 at last): measured too few times
    # to be the kernel's
    late = LateContext(clock, {9: (0.2, 6), 5: (0.015, 3)}, n_ctx=40, n_batch=16)
    _, left, kept = module._calibrate(late, None, [1, 2], sizes=(1, 2, 3, 4, 5, 9, 13),
                                      repeats=3, deep=0)  # fmt: skip
    assert (left, kept) == ([5], [])
    # A size slower than a larger one by the same amount each time is the kernel's: kept
    # as measured, cached, and reused (3 rows 0.023 s against 4 rows' 0.014)
    kernel = pair_timings("kernel", busy({3}, 0.01, None, False), None, [1, 2])
    assert kernel.verify == pytest.approx({**right, 3: 0.023})
    source = calibration_source("kernel")
    assert source is not None and source.saved and not source.reused
    assert load_calibration("kernel") is not None
    pair_timings("kernel", busy({3}, 0.01, None, False), None, [1, 2])
    source = calibration_source("kernel")
    assert source is not None and source.reused
    # The reported calibration, cached: measured again, and why; a fresh decode step as
    # slow as its lone row would have kept it
    assert save_calibration("reported", Timings(dict(BUSY_CALIBRATION), 0.0, depth=26))
    assert load_calibration("reported") is None  # what reads the cache never sees it
    assert pair_timings("reported", busy({1}, 0.21, None, True), None, [1, 2]).verify[1] < 0.22
    source = calibration_source("reported")
    assert source is not None and not source.reused
    assert source.why.startswith("in the cached one a batch of 1 row(s) took 1962.53x as "
                                 "long as one of 4")  # fmt: skip


def test_bench_reports_a_busy_calibration_as_not_saved_and_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `bench`'s calibration entry (its --json) and the lines it prints: a calibration from a
    # busy machine is "not saved", with the reason calibration gave, and a calm one is
    # "saved to" the cache file
    import io

    from rich.console import Console

    from specgguf.cli.bench import _print_calibration
    from specgguf.engine import calibration as module
    from specgguf.engine.calibration import pair_timings
    from specgguf.measure.bench import calibrate_pair

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    clock = Clock()
    monkeypatch.setattr(module.time, "perf_counter", clock)

    class Engine:  # what calibrate_pair reads of an engine
        deterministic_rows = 0

        def __init__(self, key: str, ctx: BusyContext) -> None:
            self.key, self.ctx = key, ctx

        def calibration_key(self, det: bool) -> str:
            return self.key

        def timings(self, det: bool, *, recalibrate: bool) -> Timings:
            return pair_timings(self.key, self.ctx, None, [1, 2], recalibrate=recalibrate)

    def busy(slow: set[int], busy_for: int | None) -> BusyContext:
        return BusyContext(clock, slow, 0.2, busy_for, True, n_ctx=40, n_batch=16)

    said: list[str] = []
    [entry] = calibrate_pair(Engine("busy", busy({1, 2, 3}, None)), progress=said.append)  # type: ignore[arg-type]
    assert (entry["saved"], entry["reused"]) == (False, False)
    why = ("batches of 1, 2, 3 row(s) stayed slower than larger ones, differently each of "
           "3 times")  # fmt: skip
    assert entry["unsaved"].startswith(why)
    assert f"not saved: {why}" in said[-1]
    [calm] = calibrate_pair(Engine("calm", busy({1, 2, 3}, 4)), progress=said.append)  # type: ignore[arg-type]
    assert (calm["saved"], calm["unsaved"]) == (True, None)
    out = io.StringIO()
    _print_calibration(Console(file=out, width=300), [entry, calm])
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("calibration: measured in this run (")
    assert f"), not saved: {why}" in lines[0]
    assert lines[1].endswith(f"), saved to {calm['file']}")
    assert calm["file"] == str(tmp_path / "specgguf" / "calibration.json")
    cached = json.loads(Path(calm["file"]).read_text())
    assert "calm" in cached and "busy" not in cached


def test_acceptance_observed_in_parts_and_a_lone_accepted_token() -> None:
    # One accepted token, no rejection: a success in a trial (nothing is skipped but an
    # empty verification).
    acc = Acceptance()
    acc.observe(accepted=1, rejected=False)
    assert (acc.successes, acc.trials) == (1.0, 1.0)
    # In parts (a shadow draft's evidence): faded by decay (0.9) once, then counted.
    acc.decay_once()
    assert (acc.successes, acc.trials) == (pytest.approx(0.9), pytest.approx(0.9))
    acc.add(2, True)
    assert (acc.successes, acc.trials) == (pytest.approx(2.9), pytest.approx(3.9))


def test_every_cost_is_read_at_the_depth_it_is_given() -> None:
    # A lone row costs 1 ms more and a batch row 2 ms more per 1000 cached positions past
    # the calibration's depth (0): at depth 1000 a lone row costs 0.011, 2 rows 0.016, 3
    # rows 0.020, 4 rows 0.024. Depth 0 is the default: the curve as calibrated.
    t = Timings(dict(HAND), position_single=1e-6, position_row=2e-6)
    assert t.verify_time(1) == 0.010 and t.verify_time(2) == 0.012
    assert t.verify_time(1, 1000) == pytest.approx(0.011)
    assert verify_time_at(t, 1.5) == pytest.approx(0.011)
    assert verify_time_at(t, 1.5, 1000) == pytest.approx(0.0135)  # halfway 0.011 -> 0.016
    assert verify_time_at(t, 2.0, 1000) == pytest.approx(0.016)
    chunked = Timings(dict(HAND), position_single=1e-6, position_row=2e-6, chunk_rows=2)
    # 4 rows in calls of 2 and 2, the second after 2 accepted (a = 0.5): 0.016 + 0.25 x 0.016
    assert chunked.expected_verify_time(4, 0.5, 1000) == pytest.approx(0.016 * 1.25)
    assert chunked.expected_verify_time(4, 0.5) == pytest.approx(0.012 * 1.25)
    assert chunked.expected_verify_time(2, 0.5) == 0.012  # one call: the batch's cost
    # best_k and best_tree against the target alone at that depth (1 / 0.011 = 90.9): free
    # drafts at a = 0.8, K=1 1.8 / 0.016 = 112.5, K=2 2.44 / 0.020 = 122, K=3 2.952 /
    # 0.024 = 123, K=4 3.3616 / (0.0195 + 0.010) = 113.95: K=3.
    assert best_k(0.8, t, 4, cached=1000, draft_cost=0.0) == (3, pytest.approx(123.0))
    assert best_k(0.0, t, 4, cached=1000, draft_cost=0.0) == (0, pytest.approx(1 / 0.011))
    # at the default depth, 0: K=3 at 2.952 / 0.016 (K=4: 3.3616 / 0.0195)
    assert best_k(0.8, t, 4, draft_cost=0.0) == (3, pytest.approx(2.952 / 0.016))
    from specgguf.speculative.costmodel import best_tree

    # a tree of estimates 0.8, 0.64, 0.512 at depth 1000 is the chain above
    assert best_tree([0.8, 0.64, 0.512], t, cached=1000) == (3, pytest.approx(123.0))
    assert best_tree([0.0], t, cached=1000) == (0, pytest.approx(1 / 0.011))
    assert best_tree([0.8, 0.64], t) == (2, pytest.approx(2.44 / 0.014))
    # k_min: one node is allowed by default, not below it
    assert best_tree([0.8], Timings({1: 0.010, 2: 0.011}))[0] == 1
    assert best_tree([0.8], Timings({1: 0.010, 2: 0.011}), k_min=2)[0] == 0
    # a measurement's correction at the default depth 0
    t.observe_verify(1, 0.012, weight=1.0)
    assert t.scale_single == pytest.approx(1.2)


def test_the_curve_between_and_at_its_measured_sizes() -> None:
    t = Timings({2: 0.020, 4: 0.030, 8: 0.040})
    assert t.curve(2) == 0.020 and t.curve(1) == 0.020  # at and below the first size
    assert t.curve(3) == pytest.approx(0.025) and t.curve(5) == pytest.approx(0.0325)
    # past the last: at least the mean slope over the sizes, (0.040 - 0.020) / 6, not the
    # last two's (0.0025): 0.040 + 2 x 0.00333
    assert t.curve(10) == pytest.approx(0.040 + 2 * 0.02 / 6)
    # the last two reversed and the first two too: the slope is 0 at least
    flat = Timings({1: 0.05, 2: 0.04, 3: 0.03})
    assert flat.curve(5) == pytest.approx(0.03)
    assert expected_tokens(0.5, 0) == 1.0


def test_a_draft_rows_share_is_read_on_the_calibrated_curve_at_depth() -> None:
    # An EPYC-like curve: a lone row 40 ms, 5 rows 112.4 ms at depth 0; each cached
    # position adds 6 us to a lone row and 16 us to each row of a batch. At 0 positions
    # each of 4 draft rows adds (112.4 - 40) / (4 x 40) = 0.4525 of a lone row; at 700,
    # (112.4 + 56 - 44.2) / (4 x 44.2) = 0.70249.
    t = Timings({1: 0.040, 5: 0.1124}, position_single=6e-6, position_row=16e-6)
    assert row_share(t, 4) == pytest.approx(0.4525)
    assert row_share(t, 4, 700) == pytest.approx(0.70249, abs=1e-5)
    # The curve's shape: not the learnt corrections or deterministic mode's padded lone
    # row, which would each move it without a row costing more (other sequences' rows:
    # tests/test_parallel.py).
    for other in (dict(scale_single=1.3, scale_batch=0.9), dict(lone_max=256)):
        moved = dataclasses.replace(t, verify=dict(t.verify), **other)  # type: ignore[arg-type]
        assert moved.verify_time(5, 700) / moved.verify_time(1, 700) != pytest.approx(
            t.verify_time(5, 700) / t.verify_time(1, 700)
        )
        assert row_share(moved, 4, 700) == pytest.approx(0.70249, abs=1e-5)
    # A curve measured flatter at 5 rows than at 1 (noise): no row costs less than nothing.
    assert row_share(Timings({1: 0.010, 5: 0.009}), 4) == 0.0


# Read from llama.cpp's llama_batch_allocr::split_equal (src/llama-batch.cpp); the same
# shapes are checked against llama.cpp itself in tests/test_parallel_server.py.
MICRO_BATCH_CASES = [
    ([], []),
    ([(0, 1)], [1]),
    ([(0, 5)], [5]),
    ([(0, 1), (1, 1), (2, 1), (3, 1)], [4]),  # one row each: one micro-batch
    ([(0, 5), (1, 5)], [10]),  # as many rows each
    ([(0, 5), (1, 1), (2, 1), (3, 1)], [4, 4]),  # one row of each, then sequence 0's 4
    ([(0, 2), (1, 1)], [2, 1]),
    ([(0, 3), (1, 3), (2, 2)], [6, 2]),  # 2 of each, then 1 of 0 and 1
    ([(0, 1), (2, 1), (3, 1)], [1, 2]),  # a gap in the ids: 0, then 2 and 3
    ([(1, 1), (0, 1)], [1, 1]),  # ids must rise one by one in the batch's order
    ([(0, 0), (1, 1), (2, 1)], [2]),  # a sequence without rows is not in the batch
    ([(0, 100), (1, 100)], [128, 72]),  # at most n_ubatch // 2 = 64 rows of each
]


@pytest.mark.parametrize(("rows", "expected"), MICRO_BATCH_CASES)
def test_micro_batches_as_llama_cpp_splits_a_batch(
    rows: list[tuple[int, int]], expected: list[int]
) -> None:
    assert micro_batches(rows, 128) == expected


def test_micro_batches_hold_at_most_n_ubatch_plus_one_sequences() -> None:
    # split_equal stops taking sequences once it holds more than n_ubatch of them, and
    # then a row of each
    assert micro_batches([(0, 1), (1, 1), (2, 1), (3, 1)], 2) == [3, 1]


def test_the_cheaper_of_split_and_padded_for_each_run_of_consecutive_ids() -> None:
    def gpu(m: int) -> float:  # a pass over the weights 1.0 s, a row 0.001 s
        return 1.0 + 0.001 * m

    def cpu(m: int) -> float:  # a row costs ten passes
        return 0.1 + 1.0 * m

    # 5, 1, 1 rows: split a row of each, then 4 of sequence 0 (2.007 s); padded to 5
    # each, one micro-batch of 15 (1.015 s)
    assert cheapest_micro_batches([(0, 5), (1, 1), (2, 1)], 128, gpu) == ([15], [0, 4, 4])
    assert cheapest_micro_batches([(0, 5), (1, 1), (2, 1)], 128, cpu) == ([3, 4], [0, 0, 0])
    # ids 0 | 2, 3: two runs, never in one micro-batch; only the second is padded
    assert cheapest_micro_batches([(0, 1), (2, 2), (3, 1)], 128, gpu) == ([1, 4], [0, 0, 1])
    # even rows, or one sequence: nothing to pad
    assert cheapest_micro_batches([(0, 2), (1, 2)], 128, gpu) == ([4], [0, 0])
    assert cheapest_micro_batches([(0, 3)], 128, gpu) == ([3], [0])


def test_a_shared_steps_costs_follow_what_changes_between_steps() -> None:
    # Timings keeps T(n) for the step it was last asked about (best_k asks for every K of
    # every arm); each thing a step's cost depends on, changed on the same object, must
    # give what a fresh object gives.
    gpu = {1: 0.010, 2: 0.0101, 5: 0.0104, 17: 0.011, 65: 0.016}
    cpu = {1: 0.040, 2: 0.054, 5: 0.1124, 17: 0.30}
    t = Timings(gpu, others=(1, 2, 3), solo=False)
    for change in (dict(others=(1,)), dict(others=(2, 3)), dict(seq=1),
                   dict(seq=2, others=(0, 1, 3)), dict(n_ubatch=2), dict(position_row=4e-6),
                   dict(depth=50), dict(position_single=5e-7),
                   dict(position_single=1e-6, position_row=1e-6),
                   dict(verify=cpu)):  # fmt: skip
        before = [dataclasses.replace(t).verify_time(n, c) for c in (100, 300) for n in (1, 5, 9)]
        for name, value in change.items():
            setattr(t, name, value)
        after = []
        for cached in (100, 300, 100):  # the step asked last first, as before the change
            for n in (1, 5, 9):
                fresh = dataclasses.replace(t)  # asked nothing yet
                assert t.verify_time(n, cached) == fresh.verify_time(n, cached), (change, n)
                after.append(fresh.verify_time(n, cached))
        assert after[:6] != before, change  # each change moves some cost
    # between measured sizes, the curve of the dict now in place
    t3 = Timings({1: 1.0, 3: 3.0})
    assert t3.curve(2) == 2.0
    t3.verify = {1: 1.0, 3: 5.0}
    assert t3.curve(2) == 3.0


def test_a_timings_remembered_values_follow_every_change_of_its_fields() -> None:
    """verify_time and what depth adds are kept between two changes of the fields (auto
    mode's arms ask for the same sizes many times a step): after any change, each must be
    what a fresh Timings with the same fields gives."""
    rng = np.random.default_rng(3)
    t = Timings({1: 0.010, 2: 0.012, 5: 0.020, 17: 0.050}, depth=64)

    def others() -> None:
        ids = rng.choice(6, int(rng.integers(0, 4)), replace=False)
        t.share_batch(tuple(int(s) for s in ids if s), solo=False)

    def curve() -> None:
        t.verify = {n: v * float(rng.uniform(0.5, 2.0)) for n, v in t.verify.items()}

    def observed() -> None:
        n, cached = int(rng.integers(1, 6)), int(rng.integers(0, 500))
        t.observe_verify(n, float(rng.uniform(0.005, 0.05)), cached)

    changes = [
        lambda: setattr(t, "scale_single", float(rng.uniform(0.5, 2.0))),
        lambda: setattr(t, "scale_batch", float(rng.uniform(0.5, 2.0))),
        lambda: setattr(t, "position_row", float(rng.uniform(0.0, 1e-4))),
        lambda: setattr(t, "position_single", float(rng.uniform(0.0, 1e-4))),
        lambda: setattr(t, "depth", int(rng.integers(0, 400))),
        lambda: setattr(t, "lone_max", None if rng.random() < 0.5 else int(rng.integers(0, 400))),
        lambda: setattr(t, "n_ubatch", int(rng.integers(1, 9))),
        others,
        curve,
        observed,
    ]
    for _ in range(300):
        changes[int(rng.integers(len(changes)))]()
        fresh = dataclasses.replace(t)
        for _ask in range(6):
            # (few sizes and depths: the same ones asked again after a change)
            n, cached = int(rng.integers(1, 6)), int(rng.choice([0, 100, 300, 700]))
            assert t.verify_time(n, cached) == fresh.verify_time(n, cached)
            assert t.batch_time(n, cached) == fresh.batch_time(n, cached)
            assert row_share(t, n, cached) == row_share(fresh, n, cached)
    # a shallow copy keeps values of its own (reviewed: it shared the memo, and read the
    # original's values after either changed)
    c = copy.copy(t)
    c.scale_batch = t.scale_batch * 3
    assert (
        t.verify_time(2, 100) != c.verify_time(2, 100) == dataclasses.replace(c).verify_time(2, 100)
    )
