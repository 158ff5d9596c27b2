"""AutoPlanner's single decisions and bookkeeping against numbers worked out by hand from
the documented model (module docstring of specgguf.speculative.planner: E(K) = (1 - a^(K+1)) /
(1 - a), a step costs its draft evaluations and a verification of K + 1 tokens), not
read off the code: the n-gram buckets, caps and margin, the optimistic first steps of the
draft model, the streak of model steps, what a verification teaches, FixedPlanner's
limits."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import pytest

from specgguf.speculative.arms import Step, StepPlan
from specgguf.speculative.costmodel import Timings, best_k
from specgguf.speculative.draft import Draft
from specgguf.speculative.drafters import ModelDrafter, NgramDrafter, SuffixDrafter
from specgguf.speculative.loop import GenerationParams, SpeculativeDecoder
from specgguf.speculative.planner import AutoPlanner, FixedPlanner
from specgguf.speculative.sampling import SamplerParams
from specgguf.speculative.tuning import AUTO_TUNING

from . import fakes
from .fakes import (
    FakeContext,
    FakeVocab,
    ScriptedDrafter,
    auto_planner,
    first_eval_cost,
    one_hot_rule,
    tuned,
)
from .test_speculative_logic import target_next, truth

V = 32
GREEDY = SamplerParams(temperature=0.0)
RNG = np.random.default_rng(0)
#: t_verify(1, 2, 4, 8) (t_verify(3) = 0.014, t_verify(5) = 0.0195 interpolated)
HAND = {1: 0.010, 2: 0.012, 4: 0.016, 8: 0.030}
#: every batch size costs 10 ms: E(K) / 0.010 grows with K, so K is the cap
FLAT = {1: 0.010, 2: 0.010}
#: the estimates of matches whose continuations varied (keyed -bucket), at their first
#: lengths: a draft that matched text with one continuation leaves them untouched
TWINS = {-1: 4.0, -2: 4.0, -4: 4.0}
SUFFIX_TWINS = {-1: 1.0, -2: 1.0, -4: 1.0}


@pytest.fixture
def mean_lookups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Short lookup matches judged at their acceptance estimate itself, not less one
    standard error (``lookup_z``): the hand computations of buckets, caps, margins and
    costs below are written for the estimate; the lower bound has tests of its own
    (test_short_lookup_matches_draft_on_their_acceptance_less_one_standard_error)."""
    monkeypatch.setattr(fakes, "TUNING", tuned(lookup_z=0.0))


@pytest.fixture
def constant_z(monkeypatch: pytest.MonkeyPatch) -> None:
    """Short lookup matches judged at their acceptance less ``lookup_z`` standard errors
    whatever a draft row costs (``lookup_z_row`` 0): the hand computations of the bound;
    how it follows the cost of a row has a test of its own
    (test_the_lookup_bound_follows_what_a_draft_row_costs)."""
    monkeypatch.setattr(fakes, "TUNING", tuned(lookup_z_row=0.0))


def e(a: float, k: int) -> float:
    """E(K) by its definition: 1 + a + ... + a^K."""
    return sum(a**i for i in range(k + 1))


def plus_one(prefix: Sequence[int]) -> int:
    return prefix[-1] % 30 + 1


def model_drafter() -> ModelDrafter:
    return ModelDrafter(FakeContext(one_hot_rule(plus_one, V), V), V)  # type: ignore[arg-type]


def ngram_planner(timings: dict[int, float], **kw: object) -> AutoPlanner:
    return auto_planner(Timings(dict(timings)), ngram=NgramDrafter(1, 8), learn_timings=False,
                       **kw)  # type: ignore[arg-type]  # fmt: skip


@pytest.mark.usefixtures("mean_lookups")
def test_ngram_drafts_are_judged_by_their_match_length() -> None:
    # A 4-token match at confidence 0.9: a = 1.0 * 0.9. With HAND's timings, free drafts:
    # K=1: 1.9 / 0.012 = 158.33, K=2: 2.71 / 0.014 = 193.57, K=3: 3.439 / 0.016 = 214.94,
    # K=4: 4.0951 / 0.0195 = 210.01: K = 3.
    p = ngram_planner(HAND)
    p.confidence = 0.9
    plan = p.plan([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4], 16, GREEDY, RNG)
    assert plan.drafter is p.arm("ngram").drafter and plan.draft.tokens == [5, 6, 7]
    assert plan.expected_rate == pytest.approx(3.439 / 0.016)
    # A 3-token match counts as 2 (prior 0.7 of the confidence 0.6: a = 0.42); all four
    # tokens found are drafted at flat timings.
    p = ngram_planner(FLAT)
    plan = p.plan([7, 8, 9, 5, 7, 8, 9], 16, GREEDY, RNG)
    assert plan.draft.tokens == [5, 7, 8, 9] and plan.bucket == 2
    assert plan.expected_rate == pytest.approx(e(0.42, 4) / 0.010)
    # A 1-token match: prior 0.3 of the confidence (a = 0.18).
    p = ngram_planner(FLAT)
    plan = p.plan([5, 6, 9, 1, 6], 16, GREEDY, RNG)
    assert plan.draft.tokens == [9, 1, 6] and plan.bucket == 1
    assert plan.expected_rate == pytest.approx(e(0.18, 3) / 0.010)


@pytest.mark.usefixtures("mean_lookups")
def test_a_lookup_prior_is_at_most_0_9() -> None:
    # A 4-token match at confidence 0.99 is judged at a = 0.9, not 0.99: K = 3 at 3.439 /
    # 0.016 as in the test above (at a = 0.99, K = 4 would rate 4.901 / 0.0195 = 251.3).
    p = ngram_planner(HAND)
    p.confidence = 0.99
    plan = p.plan([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4], 16, GREEDY, RNG)
    assert plan.draft.tokens == [5, 6, 7]
    assert plan.expected_rate == pytest.approx(3.439 / 0.016)
    # Below the cap the prior is the bucket's times the confidence (0.7 * 0.99 = 0.693).
    ngram = p.arm("ngram")
    assert ngram.prior(2, 0.99, long_copy=True) == pytest.approx(0.693)
    assert ngram.prior(4, 0.99, long_copy=True) == 0.9


@pytest.mark.usefixtures("mean_lookups")
def test_a_match_whose_continuations_varied_is_judged_apart() -> None:
    # A numbered list (Spec-Bench RAG, question 540): after "word NL" the n-gram proposes
    # the previous item's number, which the target never repeats. 5, 6 was followed by 9
    # and then 8: the draft 8 has a share of 1/2, below 0.75, and is judged by the twin
    # of bucket 2 at 0.3 of its prior (0.3 * 0.7 * 0.6 = 0.126): on HAND's timings one
    # draft token rates 1.126 / 0.012 = 93.8, below the target alone's 100 x the margin.
    varied = [5, 6, 9, 1, 5, 6, 8, 2, 5, 6]
    p = ngram_planner(HAND)
    assert p.plan(varied, 16, GREEDY, RNG).draft.tokens == []
    ngram = p.arm("ngram")
    assert ngram.prior(-2, 0.6, long_copy=True) == pytest.approx(0.126)
    # not drafted, it is watched as a shadow, whose evidence (the target wrote 7, not 8)
    # is the twin's
    assert ngram.shadow is not None and ngram.shadow.bucket == -2
    p.plan([*varied, 7], 16, GREEDY, RNG)
    assert ngram.rates[-2].trials == 1.0 and ngram.rates[-2].successes == 0.0
    assert ngram.rates[2].trials == 0.0
    # where both occurrences went on alike (9, 9) it is bucket 2's draft, at a = 0.42:
    # K = 1 rates 1.42 / 0.012 = 118.3
    plan = ngram_planner(HAND).plan([5, 6, 9, 1, 5, 6, 9, 2, 5, 6], 16, GREEDY, RNG)
    assert plan.draft.tokens[:1] == [9] and plan.bucket == 2
    # the rule off (the previous one): the varied match is bucket 2's too, and drafted
    off = auto_planner(Timings(dict(HAND)), ngram=NgramDrafter(1, 8), learn_timings=False,
                       tuning=fakes.tuned(lookup_z=0.0, lookup_share_min=0.0))  # fmt: skip
    plan = off.plan(varied, 16, GREEDY, RNG)
    assert plan.draft.tokens[:1] == [8] and plan.bucket == 2
    # What a rejected varied draft teaches stays with the twin: bucket 2 keeps its prior.
    p = ngram_planner(FLAT)
    plan = p.plan(varied, 16, GREEDY, RNG)
    assert plan.draft.tokens[:1] == [8] and plan.bucket == -2
    p.observe(plan, 0, 0.010)
    assert p.arm("ngram").rates[-2].trials == 1.0 and p.arm("ngram").rates[2].trials == 0.0
    assert p.arm("ngram").lengths[-2] == 2.0 and p.arm("ngram").lengths[2] == 4.0


#: a 2-core AMD EPYC's verification curve relative to a lone row of 10 ms (measured: a
#: batch of 2 rows costs 2.01 lone steps, 4 rows 3.04)
ROWS_COST = {1: 0.010, 2: 0.0201, 3: 0.0244, 4: 0.0304, 5: 0.0366, 8: 0.0655}


def lower(a: float, trials: float) -> float:
    """An acceptance estimate less one standard error, the prior counted as 2 trials."""
    return a - math.sqrt(a * (1 - a) / (trials + 2))


@pytest.mark.usefixtures("constant_z")
def test_short_lookup_matches_draft_on_their_acceptance_less_one_standard_error() -> None:
    history = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4]  # a 4-token match: 5, 6, 7, ...
    # No evidence yet: a = 0.9 (the prior), less sqrt(0.9 x 0.1 / 2) = 0.21213: 0.68787.
    # With HAND's timings, free drafts: K=1: 1.68787 / 0.012 = 140.66, K=2: 2.16103 /
    # 0.014 = 154.36, K=3: 2.48650 / 0.016 = 155.41, K=4: 2.71038 / 0.0195 = 138.99.
    a = lower(0.9, 0)
    assert a == pytest.approx(0.68787, abs=1e-5)
    p = ngram_planner(HAND)
    p.confidence = 0.9
    plan = p.plan(history, 16, GREEDY, RNG)
    assert plan.draft.tokens == [5, 6, 7] and plan.expected_rate == pytest.approx(e(a, 3) / 0.016)
    # Where a batch of 2 rows costs two lone steps, the estimate itself (0.9) would draft
    # K=3 (3.439 / 0.0304 = 113.13 > 105), but 0.68787 pays at no K (K=2: 2.16103 /
    # 0.0244 = 88.57; the target alone: 100): the target alone, and the proposal is
    # watched instead (a shadow draft of ``shadow_len`` tokens).
    assert e(0.9, 3) / 0.0304 > 105 > max(e(a, k) / ROWS_COST[k + 1] for k in (1, 2, 3, 4))
    p = ngram_planner(ROWS_COST)
    p.confidence = 0.9
    plan = p.plan(history, 16, GREEDY, RNG)
    assert plan.drafter is None
    assert p.arm("ngram").shadow.tokens == [5, 6, 7, 8] and p.arm("ngram").shadow.bucket == 4


#: the 2-core Xeon of ../shared/machines (2026-12-02), a lone row of 10 ms: 5 rows cost 1.82
XEON = {1: 0.010, 2: 0.0134, 3: 0.0171, 5: 0.0182, 9: 0.0301}


def test_the_lookup_bound_follows_what_a_draft_row_costs() -> None:
    # The bound is lookup_z (1) standard errors where each of explore_k (4) draft rows adds
    # lookup_z_row (0.8) of a lone row or more, in proportion below. Rows' shares:
    # ROWS_COST (0.0366 - 0.010) / 0.040 = 0.665, z = 0.83125; XEON (0.0182 - 0.010) /
    # 0.040 = 0.205, z = 0.25625; FLAT 0, z = 0; a curve where 5 rows cost 5 lone rows, 1.
    history = [7, 1, 2, 5, 6, 3, 4, 1, 2]  # a 2-token match: 5, 6, 3, ...
    cases = ((ROWS_COST, 0.83125), (XEON, 0.25625), (FLAT, 0.0),
             ({1: 0.010, 5: 0.050}, 1.0))  # fmt: skip
    for timings, z in cases:
        p = ngram_planner(timings)
        arm = p.arm("ngram")
        step = Step(history, 1, 16, GREEDY, RNG, p.timings, len(history) - 1, 0.9,
                    1.0 / p.timings.verify_time(1), AUTO_TUNING)  # fmt: skip
        assert arm.z(step) == pytest.approx(z)
    # On XEON at confidence 0.9 the 2-token match's prior is 0.7 x 0.9 = 0.63, its standard
    # error with no evidence sqrt(0.63 x 0.37 / 2) = 0.34140. Less 0.25625 of it: 0.54252;
    # K=1: 1.54252 / 0.0134 = 115.11 > 105 (K=2: 1.83685 / 0.0171 = 107.42; K=4: 2.08316 /
    # 0.0182 = 114.46): one token drafted. Less the whole of it (0.28860), no K pays
    # (K=1: 1.28860 / 0.0134 = 96.16): the target alone, as before the bound followed rows.
    a = 0.63 - 0.25625 * math.sqrt(0.63 * 0.37 / 2)
    assert a == pytest.approx(0.54252, abs=1e-5)
    p = ngram_planner(XEON)
    p.confidence = 0.9
    plan = p.plan(history, 16, GREEDY, RNG)
    assert plan.draft.tokens == [5] and plan.expected_rate == pytest.approx((1 + a) / 0.0134)
    p = ngram_planner(XEON, tuning=tuned(lookup_z_row=0.0))
    p.confidence = 0.9
    assert p.plan(history, 16, GREEDY, RNG).drafter is None


@pytest.mark.usefixtures("constant_z")
def test_a_shadow_draft_teaches_its_bucket_token_by_token() -> None:
    """Evidence from tokens the target produced as a lookup proposed, without verifying
    them: each counts as an accepted draft token, the first that differs as a
    rejection. Each plan's tick fades the counts by 0.97 first."""
    history = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4]
    p = ngram_planner(ROWS_COST)
    p.confidence = 0.9
    assert p.plan(history, 16, GREEDY, RNG).drafter is None  # the test above
    acc = p.arm("ngram").rates[4]
    # The target produced 5: 1 accepted in 1 trial. a = (1 + 0.9 x 2) / 3 = 0.93333, less
    # 0.14402: 0.78931, which pays at no K.
    assert p.plan([*history, 5], 16, GREEDY, RNG).drafter is None
    assert (acc.successes, acc.trials) == (1, 1)
    # ... then 6: faded to 0.97, plus 1: 1.97 / 1.97. a = 3.77 / 3.97 = 0.94962, less
    # 0.10978: 0.83984 (K=2: 2.54516 / 0.0244 = 104.31 < 105): still the target alone.
    assert p.plan([*history, 5, 6], 16, GREEDY, RNG).drafter is None
    assert acc.trials == pytest.approx(1.97)
    # ... then 7: 1.9109 + 1 = 2.9109 / 2.9109. a = 4.7109 / 4.9109 = 0.95927, less 0.08920:
    # 0.87008. K=3: 3.28581 / 0.0304 = 108.09 > 105 (K=2: 2.62709 / 0.0244 = 107.67): the
    # 7-token match drafts 8, 9, 1.
    plan = p.plan([*history, 5, 6, 7], 16, GREEDY, RNG)
    s = 0.97 * 1.97 + 1
    a = lower((s + 1.8) / (s + 2), s)
    assert a == pytest.approx(0.87008, abs=1e-5)
    assert plan.drafter is p.arm("ngram").drafter and plan.draft.tokens == [8, 9, 1]
    assert plan.expected_rate == pytest.approx(e(a, 3) / 0.0304)
    # The draft is verified and teaches its positions (8 is also the shadow's 4th token):
    # the shadow ends, so 8 is counted once. All 3 accepted: 0.9 x 2.9109 + 3 = 5.6198,
    # faded by the next step's tick to 5.4512.
    assert p.arm("ngram").shadow is None
    p.observe(plan, 3, 0.03, None, rows=4)
    p.plan([*history, 5, 6, 7, 8, 9, 1, 2], 16, GREEDY, RNG)
    assert acc.successes == pytest.approx(0.97 * (0.9 * s + 3))
    # A token that differs from the proposal is a rejection, and ends the shadow.
    p = ngram_planner(ROWS_COST)
    p.confidence = 0.9
    p.plan(history, 16, GREEDY, RNG)
    p.plan([*history, 5], 16, GREEDY, RNG)
    p.plan([*history, 5, 20], 16, GREEDY, RNG)
    assert (p.arm("ngram").rates[4].successes, p.arm("ngram").rates[4].trials) == (
        pytest.approx(0.97),
        pytest.approx(1.97),
    )
    assert p.arm("ngram").shadow is None


def test_a_shadow_draft_cut_short_never_shortens_the_accepted_length() -> None:
    """A shadow matched to its end (``shadow_len`` tokens) says its copy went on at least
    that far, not that it stopped there: a copy's mean accepted length (6 at first,
    drafts up to 16) is not pulled down by it; a shadow broken after 1 token is an
    accepted length of 1, and moves the mean halfway to it."""
    src = list(range(100, 140))
    history = [*src, 1, 2, *src[:20]]  # a 20-token match: the copy bucket, 16
    p = ngram_planner(ROWS_COST)
    p.confidence = 0.3  # a = 0.3 at first and at most 0.76 below: nothing drafts
    assert p.plan(history, 16, GREEDY, RNG).drafter is None
    assert p.arm("ngram").shadow.bucket == 16 and p.arm("ngram").lengths[16] == 6.0
    for n in range(1, 5):
        p.plan(history + src[20 : 20 + n], 16, GREEDY, RNG)
    assert (
        p.arm("ngram").rates[16].trials > 0 and p.arm("ngram").lengths[16] == 6.0
    )  # 4 of 4: not lowered
    history += src[20:24]
    assert p.arm("ngram").shadow.start == len(history)  # the next shadow, from here
    p.plan([*history, src[24], 7], 16, GREEDY, RNG)  # the copy breaks after 1 token
    assert p.arm("ngram").lengths[16] == pytest.approx(3.5)


def test_a_shadow_draft_is_not_kept_for_the_drafter_that_drafts() -> None:
    # With HAND's timings the 4-token match drafts (the test above): its evidence comes
    # from its verification, and no shadow is kept for n-gram lookup.
    p = ngram_planner(HAND)
    p.confidence = 0.9
    plan = p.plan([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4], 16, GREEDY, RNG)
    assert plan.drafter is p.arm("ngram").drafter and p.arm("ngram").shadow is None


@pytest.mark.usefixtures("mean_lookups")
def test_ngram_drafts_must_beat_the_target_alone_by_the_margin() -> None:
    # A 1-token match with HAND's timings: K=1 at a = 0.3 * confidence. Confidence 0.85:
    # 1.255 / 0.012 = 104.58, faster than the target alone (100) but not by 5%: no drafts.
    history = [5, 6, 9, 1, 6]
    p = ngram_planner(HAND)
    p.confidence = 0.85
    plan = p.plan(history, 16, GREEDY, RNG)
    assert plan.drafter is None and plan.expected_rate == pytest.approx(100.0)
    # Confidence 1: 1.3 / 0.012 = 108.33 (K=2: 1.39 / 0.014 = 99.29): one token.
    p.confidence = 1.0
    plan = p.plan(history, 16, GREEDY, RNG)
    assert plan.draft.tokens == [9] and plan.expected_rate == pytest.approx(1.3 / 0.012)
    # Room for fewer drafts than draft_min: the target alone, nothing proposed.
    p = ngram_planner(HAND, draft_min=3)
    p.confidence = 1.0
    assert p.plan(history, 2, GREEDY, RNG).drafter is None


@pytest.mark.usefixtures("mean_lookups")
def test_a_padded_lone_row_makes_one_draft_token_free() -> None:
    """Deterministic mode past its lone-row limit decodes a lone row with a throw-away
    row: the target alone costs t_verify(2), and drafting one token costs nothing more."""
    # The margin case above (a = 0.3 * 0.85 = 0.255; K=1: 1.255 / 0.012 = 104.58 against
    # 100: no drafts) with lone rows padded past 4 cached positions: the 5-token history
    # has 4 cached and its last token would be the 5th, so the target alone costs 0.012
    # (83.33/s) and K=1 (104.58) wins by 25%.
    history = [5, 6, 9, 1, 6]
    timings = Timings(dict(HAND), lone_max=4)
    p = auto_planner(timings, ngram=NgramDrafter(1, 8), learn_timings=False)
    p.confidence = 0.85
    plan = p.plan(history, 16, GREEDY, RNG)
    assert p.cached == 4 and timings.padded(4)
    assert plan.draft.tokens == [9] and plan.expected_rate == pytest.approx(1.255 / 0.012)
    # Up to the limit, a lone row costs its own time: no drafts, as without a limit.
    timings.lone_max = 5
    plan = p.plan(history, 16, GREEDY, RNG)
    assert not timings.padded(4)
    assert plan.drafter is None and plan.expected_rate == pytest.approx(100.0)
    # A padded lone row's measured time teaches the batch correction, not the single one.
    timings.lone_max = 4
    timings.observe_verify(1, 0.012 * 1.2, 4, weight=0.5)
    assert timings.scale_batch == pytest.approx(1.1) and timings.scale_single == 1.0


def test_batches_cost_more_deeper_in_the_context() -> None:
    """Every row of a batch attends to every cached position: past the calibration's
    depth, a batch of n rows costs n * position_row per position more, a lone row
    position_single."""
    t = Timings(dict(HAND), depth=64, position_single=1e-6, position_row=2e-6)
    # 10 cached, above the calibration's depth: the curve as measured
    assert t.verify_time(1, 10) == pytest.approx(0.010)
    assert t.verify_time(4, 10) == pytest.approx(0.016)
    deep = 1064  # 1000 positions deeper
    assert t.verify_time(1, deep) == pytest.approx(0.010 + 1000 * 1e-6)
    assert t.verify_time(3, deep) == pytest.approx(0.014 + 1000 * 3 * 2e-6)  # 0.020
    assert t.verify_time(4, deep) == pytest.approx(0.016 + 1000 * 4 * 2e-6)  # 0.024
    # A measurement teaches the correction against the cost at that depth: 0.030 for the
    # 0.024 expected is 1.25x, half of which (weight 0.5) is learnt.
    t.observe_verify(4, 0.030, deep, weight=0.5)
    assert t.scale_batch == pytest.approx(1.125) and t.scale_single == 1.0
    assert t.verify_time(2, deep) == pytest.approx((0.012 + 1000 * 2 * 2e-6) * 1.125)
    # A padded lone row (deterministic mode) costs two rows at that depth.
    padded = Timings(dict(HAND), lone_max=4, position_single=1e-6, position_row=2e-6)
    assert padded.verify_time(1, 1000) == pytest.approx(0.012 + 1000 * 2 * 2e-6)


@pytest.mark.usefixtures("mean_lookups")
def test_a_lookup_draft_that_pays_near_the_start_does_not_deep_in_the_context() -> None:
    # n-gram lookup finds the 8-token pattern again (bucket 4: a = min(0.9, 1.0 * 1.0) =
    # 0.9), free drafts, HAND timings plus 5 us per row and cached position (16 cached):
    # K=1: 1.9/0.01216 = 156.3, K=2: 2.71/0.01424 = 190.3, K=3: 3.439/0.01632 = 210.7,
    # K=4: 4.0951/0.0199 = 205.8 -> K=3.
    pattern = [1, 2, 3, 4, 5, 6, 7, 8]
    timings = Timings(dict(HAND), position_row=5e-6)
    p = auto_planner(timings, ngram=NgramDrafter(1, 8), learn_timings=False)
    p.confidence = 1.0
    plan = p.plan(pattern * 2 + [1], 16, GREEDY, RNG)
    assert p.cached == 16 and plan.draft.tokens == [2, 3, 4]
    assert plan.expected_rate == pytest.approx(e(0.9, 3) / 0.01632)
    # 1000 positions cached: each row of a batch costs 5 ms more: K=1: 1.9/0.022 = 86.4,
    # K=2: 2.71/0.029 = 93.4, K=3: 3.439/0.036 = 95.5, K=4: 4.0951/0.0445 = 92.0, all
    # below the target alone (100, its lone row unchanged): no drafts. (The same 9-token
    # match after other text: a longer one would be a copy, ``copy_match``.)
    plan = p.plan([20] * 984 + pattern * 2 + [1], 16, GREEDY, RNG)
    assert p.cached == 1000
    assert plan.drafter is None and plan.expected_rate == pytest.approx(100.0)


def test_expected_verification_cost_when_greedy_verification_stops_at_a_rejection() -> None:
    # 7 rows in calls of at most 3: 3, 2, 2. The second call runs when the 3 drafts the
    # first verified were accepted (a^3), the third after 5 (a^5): at a = 0.5,
    # 0.014 + 0.125 * 0.012 + 0.03125 * 0.012 = 0.015875.
    t = Timings(dict(HAND), chunk_rows=3)
    assert t.expected_verify_time(7, 0.5) == pytest.approx(0.015875)
    assert t.expected_verify_time(7, 1.0) == pytest.approx(0.014 + 0.012 + 0.012)
    assert t.expected_verify_time(3, 0.5) == pytest.approx(0.014)  # one call
    assert Timings(dict(HAND)).expected_verify_time(7, 0.5) == Timings(dict(HAND)).verify_time(7)
    # best_k weighs the expected cost only for greedy verification: at a = 0.5, K=6
    # (7 rows) rates e(0.5, 6) / 0.015875 = 124.0 against the whole cost of 7 rows.
    k, rate = best_k(0.5, t, 6, draft_cost=0.0, k_min=6, greedy=True)
    assert k == 6 and rate == pytest.approx(e(0.5, 6) / 0.015875)
    k, rate = best_k(0.5, t, 6, draft_cost=0.0, k_min=6)
    assert rate == pytest.approx(max(100.0, e(0.5, 6) / t.verify_time(7)))


@pytest.mark.usefixtures("mean_lookups")
def test_ngram_draft_length_follows_the_accepted_length() -> None:
    # 16 tokens found after a 4-token match; the cap is 2 * (mean accepted length) + 4:
    # 12 at first (mean 4), 9 at a mean of 2.6, and never below draft_min.
    history = [*range(20), 0, 1, 2, 3]
    p = ngram_planner(FLAT)
    assert p.plan(history, 16, GREEDY, RNG).draft.tokens == list(range(4, 16))
    p.arm("ngram").lengths[4] = 2.6
    assert p.plan(history, 16, GREEDY, RNG).draft.tokens == list(range(4, 13))
    p = ngram_planner(FLAT, draft_min=10)
    p.arm("ngram").lengths[4] = 0.0
    assert p.plan(history, 16, GREEDY, RNG).draft.tokens == list(range(4, 14))
    # What a verification of 4 drafts with 0 accepted teaches bucket 4: the mean accepted
    # length halves towards 0 (4 -> 2: cap 8); acceptance 0 of 1 trial, faded by 0.97
    # at the next step: a = (0 + 0.6 * 2) / (0.97 + 2).
    p = ngram_planner(FLAT)
    plan = p.plan(history, 16, GREEDY, RNG)
    p.observe(dataclasses.replace(plan, draft=Draft(plan.draft.tokens[:4])), 0, 0.010)
    assert p.arm("ngram").lengths == {1: 4.0, 2: 4.0, 4: 2.0, 16: 6.0, 32: 14.0, **TWINS}
    plan = p.plan(history, 16, GREEDY, RNG)
    assert plan.draft.tokens == list(range(4, 12))
    assert plan.expected_rate == pytest.approx(e(1.2 / 2.97, 8) / 0.010)


def test_a_draft_model_is_judged_optimistically_in_its_first_steps() -> None:
    # Nothing measured: the acceptance prior 0.95 and the confidence 0.6 as rates, each
    # raised by one standard error (prior worth 2 trials): 0.95 + sqrt(0.0475 / 2) -> 1,
    # 0.6 + sqrt(0.24 / 2) = 0.94641; K at most 4. The first evaluation costs
    # t_draft = 0.002; draft token i is evaluated when the i - 1 before it passed:
    #   K=4: proposed p = 0.94641 + ... + 0.94641^4 = 3.49206 after 2.68979 evaluations,
    #        step 0.002 + 2.68979 * 0.002 + t_verify(4.49206) = 0.0251018,
    #        E = 1 + p = 4.49206 (c = 1 * 0.94641): 178.95 tokens/s, the best of K <= 4.
    p = auto_planner(Timings(dict(HAND), 0.002), model=model_drafter(), learn_timings=False)
    plan = p.plan([1], 16, GREEDY, RNG)
    assert plan.drafter is p.arm("model").drafter and len(plan.draft.tokens) == 4
    assert plan.expected_rate == pytest.approx(178.9537, rel=1e-5)
    assert (p.arm("model").steps, p.arm("model").idle, p.arm("model").streak) == (1, 0, 1)


#: A 2-core AMD EPYC's curve (llama-bench pp1..pp17: 2 rows 1.5x one, 3 rows 2x, 5 rows
#: 2.8x, 9 rows 4.7x, 17 rows 8.1x).
EPYC = {1: 0.010, 2: 0.015, 3: 0.020, 5: 0.028, 9: 0.047, 17: 0.081}


def test_a_draft_model_that_cannot_pay_even_when_always_accepted_is_left_out() -> None:
    # A draft token at 0.6 of a target step, on the EPYC's curve: every draft accepted,
    # K + 1 tokens in K * 0.006 + t_verify(K + 1): K=1 2 / 0.021 = 95.2, K=4 5 / 0.052 =
    # 96.2, K=8 9 / 0.095 = 94.7, K=16 17 / 0.177 = 96.0 tokens/s, never the 105 that the
    # margin asks over the target alone's 100.
    dear = auto_planner(Timings(dict(EPYC), 0.006), model=model_drafter(), learn_timings=False)
    assert dear.active == [] and dear.drafters == []
    dear.arm("model").idle, dear.confidence = 100, 0.99  # the probe's conditions: still no draft
    assert dear.plan([1, 2, 3], 16, GREEDY, RNG).drafter is None
    # At 0.2 of a step it pays: K=4 5 / (0.008 + 0.028) = 138.9 tokens/s.
    cheap = auto_planner(Timings(dict(EPYC), 0.002), model=model_drafter(), learn_timings=False)
    assert cheap.active == cheap.arms and cheap.drafters == [cheap.arm("model").drafter]
    # Judged where batches are cheapest, whatever depth the last generation ended at (1000
    # positions at 20 us per row and position: 5 rows 0.028 + 0.1, K=4 5 / 0.136 = 36.8).
    deep = Timings(dict(EPYC), 0.002, position_row=2e-5)
    assert best_k(1.0, deep, 16, cached=1000)[0] == 0  # there, no draft length pays
    far = auto_planner(deep, model=model_drafter(), learn_timings=False)
    far.plan(list(range(1001)), 16, GREEDY, RNG)  # a generation that ended 1000 deep
    far.reset()
    assert far.active == far.arms
    # In the loop: the draft model that cannot pay never reads the prompt; the output is
    # the target's own.
    for planner, reads in ((dear, False), (cheap, True)):
        assert planner.arm("model").drafter is not None
        ctx = FakeContext(one_hot_rule(target_next, V), V)
        dec = SpeculativeDecoder(ctx, FakeVocab(V))  # type: ignore[arg-type]
        res = dec.generate([1, 5, 9, 2], GenerationParams(n_predict=10, sampler=GREEDY), planner)
        res = res.run()
        assert res.tokens == truth([1, 5, 9, 2], 10)
        draft_ctx = planner.arm("model").drafter.ctx
        assert (len(draft_ctx.log) > 0) == reads, draft_ctx.log  # type: ignore[attr-defined]


#: The calibration of a 2-core AMD EPYC (13 rows 8.3x one), as measured by specgguf
STUCK = {1: 0.0467, 2: 0.0854, 3: 0.12, 4: 0.141, 5: 0.1788, 7: 0.2402, 9: 0.326,
         13: 0.3899, 17: 0.3767}  # fmt: skip


def test_a_verbatim_copy_of_16_tokens_is_drafted_where_a_shorter_match_is_not() -> None:
    # Lone rows measured at 0.8 of the calibration (scale_single): the target alone runs
    # at 1 / (0.8 * 0.0467) = 26.77 tokens/s, and a draft must beat 28.11.
    # A 9-token match (bucket 4, a = min(0.9, 1.0 * 1.0) = 0.9, drafts capped at 12):
    # K=1 1.9 / 0.0854 = 22.2, K=2 2.71 / 0.12 = 22.6, K=3 3.439 / 0.141 = 24.4,
    # K=4 4.095 / 0.1788 = 22.9, K=12 7.458 / 0.3899 = 19.1: no draft, ever, for nothing
    # is verified that could correct the prior.
    src = list(range(100, 140))

    def planner() -> AutoPlanner:
        p = auto_planner(Timings(dict(STUCK), scale_single=0.8), ngram=NgramDrafter(1, 8),
                        learn_timings=False)  # fmt: skip
        p.confidence = 1.0
        return p

    p = planner()
    plan = p.plan([*src[:30], 1, 2, *src[:9]], 16, GREEDY, RNG)
    assert match_of([*src[:30], 1, 2, *src[:9]]) == 9
    assert plan.drafter is None and plan.expected_rate == pytest.approx(1 / (0.8 * 0.0467))
    # A 20-token verbatim match (the indexed 8 extended back to the text's start): a copy,
    # a = 0.97 and up to 16 drafts (``copy_cap``): K=16 e(0.97, 16) / 0.3767 =
    # 13.472 / 0.3767 = 35.76, above K=15 12.858 / 0.3800 = 33.8 and K=12 10.899 / 0.3899.
    p = planner()
    plan = p.plan([*src, 1, 2, *src[:20]], 16, GREEDY, RNG)
    assert plan.draft.match == 20
    assert plan.drafter is p.arm("ngram").drafter and plan.draft.tokens == src[20:36]
    assert plan.expected_rate == pytest.approx(e(0.97, 16) / 0.3767)
    assert plan.bucket == 16


def test_a_long_verbatim_copy_drafts_longer_with_its_own_prior() -> None:
    # A 32-token verbatim match (LONG_MATCH) is a long copy: a = LONG_COPY_PRIOR = 0.98
    # whatever the target's confidence (0.5 here: a 20-token copy gets min(0.97, 0.5)),
    # and drafts start at up to ``long_copy_cap`` = 32. On FLAT timings (every batch costs
    # one row) the longest draft allowed pays most: 32 tokens, e(0.98, 32) per 0.010 s.
    src = list(range(100, 180))

    def planner() -> AutoPlanner:
        p = auto_planner(Timings(dict(FLAT)), ngram=NgramDrafter(1, 8), learn_timings=False)
        p.confidence = 0.5
        return p

    p = planner()
    plan = p.plan([*src, 1, 2, *src[:40]], 64, GREEDY, RNG)
    assert plan.draft.match == 32
    assert plan.draft.tokens == src[40:72]
    assert plan.expected_rate == pytest.approx(e(0.98, 32) / 0.010)
    assert plan.bucket == 32
    p = planner()
    plan = p.plan([*src, 1, 2, *src[:20]], 64, GREEDY, RNG)
    assert plan.draft.match == 20 and plan.draft.tokens == src[20:36]  # copy_cap 16
    assert plan.expected_rate == pytest.approx(e(0.5, 16) / 0.010)
    # Sampled, a copied token is accepted with the target's probability of it: the
    # confidence, 0.5, not 0.98 (the same 32 drafts on flat timings).
    p = planner()
    plan = p.plan([*src, 1, 2, *src[:40]], 64, SamplerParams(temperature=1.0), RNG)
    assert plan.draft.tokens == src[40:72]
    assert plan.expected_rate == pytest.approx(e(0.5, 32) / 0.010)
    # Suffix matching's long matches (maybe another generation's) are copies of 16, not
    # long copies.
    p = auto_planner(Timings(dict(FLAT)), suffix=SuffixDrafter(), learn_timings=False)
    p.confidence = 0.5
    plan = p.plan([*src, 1, 2, *src[:40]], 64, GREEDY, RNG)
    assert plan.draft.match == 32
    assert plan.drafter is p.arm("suffix").drafter and len(plan.draft.tokens) == 16
    assert plan.expected_rate == pytest.approx(e(0.5, 16) / 0.010)


#: The calibration of a 2-core AMD EPYC up to 49 rows, as auto mode measured it (2026-12-02)
LONG = {1: 0.0461, 2: 0.0928, 3: 0.1119, 4: 0.139, 5: 0.1673, 7: 0.2486, 9: 0.3522,
        13: 0.4289, 17: 0.4646, 25: 0.6067, 33: 0.6893, 49: 0.9944}  # fmt: skip


@pytest.mark.parametrize(("weight", "k"), [(AUTO_TUNING.long_copy_weight, 32), (2.0, 48)])
def test_one_long_copy_accepted_whole_does_not_make_the_next_one_longer(
    weight: float, k: int
) -> None:
    # A long copy's first draft: 32 tokens (``long_copy_cap``), all accepted. Its bucket then
    # holds 32 successes in 32 trials, faded once by the next step's tick to 31.04 / 31.04,
    # and its cap is 2 x (14 + 0.5 x (32 - 14)) + 4 = 50. With the prior 0.98 weighing 50
    # tokens, a = (31.04 + 49) / (31.04 + 50) = 0.98766: K=32 e(a, 32) / 0.6893 = 27.244 /
    # 0.6893 = 39.52 tokens/s, above K=48 36.936 / 0.9944 = 37.14. Weighing 2 tokens, as
    # other priors do, a = 33 / 33.04 = 0.99879 and K=48 wins (47.603 / 0.9944 = 47.87,
    # K=32 46.96): the draft that the rename in code editing broke at its 20th token,
    # 0.99 s where 32 cost 0.69 s.
    assert round(AUTO_TUNING.long_copy_weight) == 50
    p = auto_planner(Timings(dict(LONG)), ngram=NgramDrafter(1, 8), learn_timings=False,
                     tuning=tuned(long_copy_weight=weight))  # fmt: skip
    p.confidence = 0.9
    src = list(range(100, 300))
    text = [*src, 1, 2, *src[:40]]
    first = p.plan(text, 64, GREEDY, RNG)
    assert first.draft.tokens == src[40:72] and first.bucket == 32
    p.observe(first, 32, 0.69, 0.99, rows=33)
    plan = p.plan([*text, *src[40:73]], 64, GREEDY, RNG)
    assert plan.bucket == 32 and plan.draft.tokens == src[73 : 73 + k]
    a = (31.04 + weight * 0.98) / (31.04 + weight)
    verify = {32: 0.6893, 48: 0.9944}[k]  # 33 and 49 rows
    assert plan.expected_rate == pytest.approx(e(a, k) / verify)


def test_a_copy_broken_by_an_edit_resumes_where_its_source_goes_on() -> None:
    from specgguf.speculative.drafters.ngram import RESUME_SPAN, RESUME_WINDOW

    assert (RESUME_SPAN, RESUME_WINDOW) == (32, 8)  # the geometry below
    # The source: a long text with the name 7 in it, and later 3, 4 (its suffix after the
    # edit) followed by something else. The copy renames 7 to 8, 9; after the edit the
    # latest occurrence of 3, 4 is the later one (50, 51, ...), the copy's is 21, 22, ...
    head, tail = list(range(100, 120)), list(range(200, 230))
    source = [*head, 7, 3, 4, *tail, 60, 3, 4, 50, 51, 52, 53]
    copy = [*head, 8, 9, 3, 4]
    d = NgramDrafter(2, 8)
    first = d.propose([*source, 1, *head], 8, GREEDY, RNG)  # a 20-token match: a copy
    assert first.match == 20 and not first.resumed
    draft = d.propose([*source, 1, *copy], 8, GREEDY, RNG)
    assert draft.tokens == tail[:8] and draft.resumed and draft.match == 2
    # Without a long copy before, the latest occurrence.
    fresh = NgramDrafter(2, 8).propose([*source, 1, *copy], 4, GREEDY, RNG)
    assert fresh.tokens == [50, 51, 52, 53] and not fresh.resumed
    # Nor once the text has gone more than RESUME_SPAN tokens past the copy's last long
    # match, resumes in between or not (a resume realigns the copy, it does not extend
    # the span). Here 30 tokens of the source (500-529) are replaced by new ones.
    s2 = [*head, 500, 501, 4, 50, *range(504, 530), 3, 4, *tail, 60, 3, 4, 50, 51, 52, 53]
    start = [*s2, 1, *head]  # a 20-token match: the long match, source position 20
    for extra, resumes in (([], True), ([5], False)):
        d = NgramDrafter(2, 8)
        d.propose(start, 8, GREEDY, RNG)
        # 32 tokens on (33 with the extra one): the copy's 3, 4 ends at 52 = 20 + 32
        draft = d.propose([*start, *range(300, 330), *extra, 3, 4], 4, GREEDY, RNG)
        assert draft.resumed == resumes, extra
    d = NgramDrafter(2, 8)
    d.propose(start, 8, GREEDY, RNG)
    text = [*start, 9, 9, 9, 504, 505]  # 5 on: 504, 505 ends at 26 in the source
    draft = d.propose(text, 4, GREEDY, RNG)
    assert draft.tokens == [506, 507, 508, 509] and draft.resumed
    text = [*text, *range(300, 325), 3, 4]  # 32 on: resumed (expected 53, at 52)
    draft = d.propose(text, 4, GREEDY, RNG)
    assert draft.tokens == tail[:4] and draft.resumed
    text = [*text, 5, 5, 5, 3, 4]  # 37 on, 5 past the last resume: not
    assert not d.propose(text, 4, GREEDY, RNG).resumed
    # A longer match elsewhere wins: 5 tokens on, the text copies 60, 3, 4, 50 from the
    # source's end; near the copy's source (position 25) only 4, 50 occurs.
    d = NgramDrafter(2, 8)
    d.propose(start, 8, GREEDY, RNG)
    draft = d.propose([*start, 8, 60, 3, 4, 50], 2, GREEDY, RNG)
    assert draft.tokens == [51, 52] and draft.match == 4 and not draft.resumed
    d = NgramDrafter(2, 8)  # (without the longer match, the resume)
    d.propose(start, 8, GREEDY, RNG)
    draft = d.propose([*start, 8, 7, 6, 4, 50], 2, GREEDY, RNG)
    assert draft.tokens == [504, 505] and draft.resumed
    # The planner judges a resumed match as a copy (bucket 16), not by its 2 tokens.
    p = auto_planner(Timings(dict(FLAT)), ngram=NgramDrafter(2, 8), learn_timings=False)
    p.confidence = 1.0
    p.plan([*source, 1, *head], 16, GREEDY, RNG)
    plan = p.plan([*source, 1, *copy], 16, GREEDY, RNG)
    assert plan.drafter is p.arm("ngram").drafter and plan.draft.tokens == tail[:16]
    assert plan.bucket == 16


def test_match_length_extends_the_indexed_match_as_far_as_the_texts_agree() -> None:
    from specgguf.speculative.drafters import LONG_MATCH, match_length

    src = list(range(100, 160))

    matched = match_of
    assert matched([*src, 1, *src[:25]]) == 25  # back to the text's start
    assert matched([*src, 1, *src]) == LONG_MATCH == 32  # at most LONG_MATCH
    assert matched([5, 6, 7, 9, *src[:12], 5, 6, 8, *src[:12]]) == 12  # 9 against 8
    assert matched([5, 6, 7, *src[:6], 5, 6, 8, *src[:6]]) == 6  # shorter than n_max
    # A stop token ends it, even where both texts have one (the suffix drafter's separator
    # between generations: no match runs across it).
    text = [-1, 4, 5, 9, -1, 4, 5]
    assert match_length(text, 3, 7, 2, stop=-1) == 2
    assert match_length(text, 3, 7, 2) == 3  # without: -1 agrees with -1


def match_of(text: list[int]) -> int:
    """The match n-gram lookup (1 to 8 tokens) finds at the end of ``text``."""
    return NgramDrafter(1, 8).propose(text, 4, GREEDY, RNG).match


def test_the_streak_of_model_steps_is_averaged_when_it_ends() -> None:
    p = auto_planner(Timings(dict(HAND), 0.002), model=model_drafter(), learn_timings=False)
    kinds = []
    for conf in (0.9, 0.9, 0.9, 0.05, 0.9, 0.05, 0.05):
        # Confidence 0.05: even optimistic (a = 0.204), K=1 gives 97.04 < 100 tokens/s.
        p.confidence = conf
        kinds.append(p.plan([1], 16, GREEDY, RNG).drafter is not None)
        if len(kinds) == 4:  # a run of 3 ended: the mean run moves halfway from 1 to 3
            assert (p.arm("model").mean_streak, p.arm("model").streak, p.arm("model").idle) == (
                2.0,
                0,
                1,
            )
    assert kinds == [True, True, True, False, True, False, False]
    assert (
        p.arm("model").mean_streak == 1.5 and p.arm("model").streak == 0
    )  # then halfway from 2 to a run of 1
    assert p.arm("model").idle == 2 and p.arm("model").steps == 4


def test_what_a_verification_teaches() -> None:
    model = model_drafter()
    ngram = NgramDrafter(1, 4)
    p = auto_planner(Timings(dict(HAND), 0.002), model=model, ngram=ngram)
    # The confidence: a running mean over the first ten steps, then a moving average.
    none = StepPlan(None, Draft([]), 100.0)
    arm, ngram_arm = p.arm("model"), p.arm("ngram")

    def model_plan(tokens: list[int], seconds: float, stopped: bool = False) -> StepPlan:
        draft = Draft(tokens, token_seconds=seconds, stopped=stopped)
        return StepPlan(model, draft, 0.0, arm)

    p.observe(none, 0, 0.0125, confidence=0.9)
    assert p.confidence == pytest.approx(0.9)
    # The decode step took 1.25 times the calibrated 0.010 s: its correction moves 5%.
    assert p.timings.scale_single == pytest.approx(1.0125) and p.timings.scale_batch == 1.0
    p.observe(none, 0, 0.010, confidence=0.5)
    assert p.confidence == pytest.approx(0.7)
    p.observe(none, 0, 0.010)  # none given: unchanged
    assert p.confidence == pytest.approx(0.7) and p._n_confidence == 2
    for _ in range(8):
        p.observe(none, 0, 0.010, confidence=0.7)
    p.observe(none, 0, 0.010, confidence=1.7)  # the 11th: weight 0.1
    assert p.confidence == pytest.approx(0.8)
    # A model draft of 3, 2 accepted, not stopped: 2 successes of 3 trials; its 3 tokens
    # drafting went on past (3 of 3); t_draft moves 5% towards the 0.004 s measured per token; the
    # batch of 4 took 1.2 times t_verify(4).
    p.observe(model_plan([1, 2, 3], 0.004), 2, 0.0192)
    assert (p.arm("model").accepted.successes, p.arm("model").accepted.trials) == (2.0, 3.0)
    assert (p.arm("model").passed.successes, p.arm("model").passed.trials) == (3.0, 3.0)
    assert p.timings.draft == pytest.approx(0.0021)
    assert p.timings.scale_batch == pytest.approx(1.01)
    # An empty model draft teaches no draft time; a one-token draft does.
    p.observe(model_plan([], 0.012), 0, 0.010)
    assert p.timings.draft == pytest.approx(0.0021)
    p.observe(model_plan([1], 0.012), 1, 0.012)
    assert p.timings.draft == pytest.approx(0.0021 + 0.05 * (0.012 - 0.0021))
    p.timings.draft = 0.0021
    arm.accepted = type(arm.accepted)(prior=0.95, successes=2.0, trials=3.0)
    arm.passed = type(arm.passed)(successes=3.0, trials=3.0)
    # Stopped at an unsure token after 2: the continuation failed once more; not measured:
    # t_draft unchanged.
    p.observe(model_plan([1, 2], 0.0, stopped=True), 2, 0.012)
    assert p.arm("model").passed.successes == pytest.approx(0.9 * 3 + 2)
    assert p.arm("model").passed.trials == pytest.approx(0.9 * 3 + 3)
    assert p.timings.draft == pytest.approx(0.0021)
    # An n-gram draft counts for the bucket of its match, and only a non-empty one.
    p.observe(StepPlan(ngram, Draft([]), 0.0, ngram_arm, 2), 0, 0.010)
    assert p.arm("ngram").lengths[2] == 4.0 and p.arm("ngram").rates[2].trials == 0.0
    p.observe(StepPlan(ngram, Draft([1, 2, 3, 4]), 0.0, ngram_arm, 2), 2, 0.010)
    assert p.arm("ngram").lengths == {1: 4.0, 2: 3.0, 4: 4.0, 16: 6.0, 32: 14.0, **TWINS}
    assert (p.arm("ngram").rates[2].successes, p.arm("ngram").rates[2].trials) == (2.0, 3.0)
    # Without learn_timings nothing about timings moves.
    q = auto_planner(Timings(dict(HAND), 0.002), model=model, learn_timings=False)
    q.observe(StepPlan(model, Draft([1, 2, 3], token_seconds=0.004), 0.0, q.arm("model")), 2,
              0.05)  # fmt: skip
    assert (q.timings.draft, q.timings.scale_batch, q.timings.scale_single) == (0.002, 1.0, 1.0)


def test_reset_starts_from_the_priors() -> None:
    ngram = NgramDrafter(1, 4)
    ngram.propose([1, 2, 1, 3, 1], 4, GREEDY, RNG)
    assert ngram.index_tables()[1][1] == {(1,): (2, 1)}
    p = auto_planner(Timings(dict(HAND), 0.002), model=model_drafter(), ngram=ngram)
    assert ngram._fresh  # the drafters were reset too
    for _ in range(3):
        p.confidence = 0.9
        p.plan([1], 16, GREEDY, RNG)
    assert not ngram.index_tables()[1][1]  # [1] does not extend the text indexed: indexed anew
    p.observe(StepPlan(p.arm("model").drafter, Draft([1, 2]), 0.0, p.arm("model")), 0, 0.02,
              confidence=0.1)  # fmt: skip
    p.reset()
    assert p.confidence == 0.6 and p._n_confidence == 0
    assert (p.arm("model").accepted.rate, p.arm("model").passed.rate) == (0.95, 0.6)
    assert all(a.rate == 0.6 and a.trials == 0.0 for a in p.arm("ngram").rates.values())
    arm = p.arm("model")
    assert (arm.steps, arm.idle, arm.streak, arm.mean_streak) == (0, 0, 0, 1.0)
    assert p.arm("ngram").lengths == {1: 4.0, 2: 4.0, 4: 4.0, 16: 6.0, 32: 14.0, **TWINS}
    assert p.arm("ngram").shadow is None
    assert p.draft_min == 1 and arm.p_stop == 0.5 and p.drafters == [ngram, arm.drafter]
    q = auto_planner(Timings(dict(HAND)), model=model_drafter(), p_min=0.7, draft_min=3)
    assert q.arm("model").p_min == 0.7 and q.arm("model").p_stop == 0.5 and q.draft_min == 3


def test_fixed_planner_limits() -> None:
    d = ScriptedDrafter(lambda history, k: [7] * k)
    p = FixedPlanner(d, 5, draft_min=3)
    assert p.drafters == [d] and p.draft_max == 5
    assert p.plan([1], 5, GREEDY, RNG).draft.tokens == [7] * 5
    assert p.plan([1], 3, GREEDY, RNG).draft.tokens == [7] * 3
    assert p.plan([1], 2, GREEDY, RNG).drafter is None  # room below draft_min
    assert FixedPlanner(d, 5).plan([1], 0, GREEDY, RNG).drafter is None
    short = FixedPlanner(ScriptedDrafter(lambda history, k: [7, 7]), 5, draft_min=3)
    assert short.plan([1], 5, GREEDY, RNG).drafter is None  # a draft below draft_min
    alone = FixedPlanner(None, 5)
    assert alone.draft_max == 0 and alone.drafters == []
    assert alone.plan([1], 5, GREEDY, RNG).drafter is None
    # No cost model: no expected rate (nan), whichever the outcome.
    plans = [p.plan([1], 5, GREEDY, RNG), p.plan([1], 2, GREEDY, RNG),
             short.plan([1], 5, GREEDY, RNG), alone.plan([1], 5, GREEDY, RNG)]  # fmt: skip
    assert all(math.isnan(plan.expected_rate) for plan in plans)
    # No minimum by default: an empty draft is the drafter's own (nothing to verify).
    empty = ScriptedDrafter(lambda history, k: [])
    assert FixedPlanner(empty, 5).plan([1], 5, GREEDY, RNG).drafter is empty


@pytest.mark.usefixtures("mean_lookups")
def test_ngram_replaces_a_draft_model_in_use_only_when_clearly_faster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The model holds the history (one token behind); no optimistic steps. Confidence 0.7:
    # the model's best is K=7 at 140.73 tokens/s (a_acc 0.95, a_cont 0.7), n-gram lookup
    # after a 4-token match K=3 at E(0.7, 3) / 0.016 = 158.31: 1.125 times faster, which
    # takes over a model not in use but not one in use (1.25 needed). Confidence 0.9: the
    # model's best is K=4 at 161.37, n-gram K=3 at 214.94: 1.33 times, it takes over.
    monkeypatch.setattr(fakes, "TUNING", dataclasses.replace(fakes.TUNING, explore_steps=0))
    history = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4]
    for steps, conf, kind, n, rate in (
        (1, 0.7, "model", 7, 140.7310),
        (0, 0.7, "ngram", 3, e(0.7, 3) / 0.016),
        (1, 0.9, "ngram", 3, e(0.9, 3) / 0.016),
    ):
        model = model_drafter()
        model.prefill(history)
        p = auto_planner(Timings(dict(HAND), 0.002), model=model, ngram=NgramDrafter(1, 8),
                        learn_timings=False)  # fmt: skip
        p.arm("model").steps, p.arm("model").streak, p.confidence = steps, 3, conf
        plan = p.plan(history, 16, GREEDY, RNG)
        assert plan.drafter is not None and plan.drafter.name == kind, (steps, conf)
        assert len(plan.draft.tokens) == n and plan.expected_rate == pytest.approx(rate, rel=1e-5)
        # A run of 3 model steps ends when n-gram lookup takes over: mean 1 -> 2.
        want = (2.0, 0) if kind == "ngram" else (1.0, 4)
        assert (p.arm("model").mean_streak, p.arm("model").streak) == want


def test_the_draft_model_length_and_sync_limits() -> None:
    # Confidence 0.9 after the optimistic steps: the model's best is K=4 (161.37), or
    # K=2 (150.18) when draft_max_model is 2.
    for cap, n, rate in ((16, 4, 161.3663), (2, 2, 150.1757)):
        p = auto_planner(Timings(dict(HAND), 0.002), model=model_drafter(),
                        draft_max_model=cap, learn_timings=False)  # fmt: skip
        p.arm("model").steps, p.confidence = AUTO_TUNING.explore_steps, 0.9
        plan = p.plan([1], 16, GREEDY, RNG)
        assert len(plan.draft.tokens) == n and plan.expected_rate == pytest.approx(rate, rel=1e-5)
    # A model 8 tokens behind counts as in step: judged optimistically (as in
    # test_a_draft_model_is_judged_optimistically_in_its_first_steps, with a catch-up of
    # 0.2 * t_verify(2) + 0.2 * (t_verify(8) - t_verify(2)) = 0.006 s): K=4 at 154.36.
    p = auto_planner(Timings(dict(HAND), 0.002), model=model_drafter(), learn_timings=False)
    plan = p.plan(list(range(1, 9)), 16, GREEDY, RNG)
    assert plan.draft.tokens == [9, 10, 11, 12]
    assert plan.expected_rate == pytest.approx(154.3568, rel=1e-5)
    # 9 behind: judged plainly (a_acc 0.95, a_cont 0.6, catch-up 0.0067 s): K=11 at
    # 102.46, below the margin: the target alone.
    p = auto_planner(Timings(dict(HAND), 0.002), model=model_drafter(), learn_timings=False)
    assert p.plan(list(range(1, 10)), 16, GREEDY, RNG).drafter is None


def three_way(prefix: Sequence[int]) -> np.ndarray:
    """Token 10 after 1 (sure), then a tie of three (1/3 each: below ``p_stop``)."""
    row = np.full(V, -100.0, np.float32)
    if prefix[-1] == 1:
        row[10] = 0.0
    else:
        row[20] = row[21] = row[22] = 0.0
    return row


def sure_at_60(prefix: Sequence[int]) -> np.ndarray:
    """The next id after the last, at probability 0.6 (the other 31 ids share 0.4)."""
    row = np.full(V, np.log(0.4 / (V - 1)), np.float32)
    row[(prefix[-1] + 1) % V] = np.log(0.6)
    return row


def test_the_draft_model_stops_where_its_path_probability_falls_below_p_stop() -> None:
    # HAND's 5 rows cost 19.5 ms (a row 2.375 ms over one), a draft token 2 ms: p_stop is
    # (2 + 2.375) / 10 = 0.4375. Each token at 0.6 passes it on its own; the path 0.6,
    # 0.36 does not past the first: one token drafted, stopped, and drafting went on past
    # 1 token of 2.
    model = ModelDrafter(FakeContext(sure_at_60, V), V)  # type: ignore[arg-type]
    p = auto_planner(Timings(dict(HAND), 0.002), model=model, learn_timings=False)
    p.confidence = 0.9
    plan = p.plan([1], 16, GREEDY, RNG)
    assert plan.drafter is model and plan.draft.tokens == [2] and plan.draft.stopped
    assert p.arm("model").p_stop == pytest.approx(0.4375)
    p.observe(plan, 1, 0.012)
    assert (p.arm("model").passed.successes, p.arm("model").passed.trials) == (1.0, 2.0)


def test_a_model_draft_that_stops_below_draft_min_is_dropped_and_counted() -> None:
    model = ModelDrafter(FakeContext(three_way, V), V)  # type: ignore[arg-type]
    p = auto_planner(Timings(dict(HAND), 0.002), model=model, draft_min=3, learn_timings=False)
    p.confidence = 0.9
    plan = p.plan([1], 16, GREEDY, RNG)
    assert plan.drafter is None and plan.expected_rate == pytest.approx(100.0)
    # Drafting went on past one token, not past the next (1/3, below ``p_stop`` on the
    # path and per token alike): 1 success of 2 trials.
    assert (p.arm("model").passed.successes, p.arm("model").passed.trials) == (1.0, 2.0)
    assert p.arm("model").accepted.trials == 0.0 and (
        p.arm("model").steps,
        p.arm("model").streak,
    ) == (1, 1)


def test_optimistic_drafts_are_at_most_4_and_time_units_do_not_matter() -> None:
    # Flat 10 ms verification, t_draft 2 ms, optimistic rates 1 and 0.94641 (as above):
    # K=1..4 at 162.20, 204.57, 235.26, 258.47 tokens/s, still rising, cut at K = 4.
    p = auto_planner(Timings(dict(FLAT), 0.002), model=model_drafter(), learn_timings=False)
    plan = p.plan([1], 16, GREEDY, RNG)
    assert len(plan.draft.tokens) == 4 and plan.expected_rate == pytest.approx(258.4675, rel=1e-5)
    # The same machine 1000 times slower: the same choice at a thousandth of the rate.
    slow = {n: 1000 * s for n, s in HAND.items()}
    p = auto_planner(Timings(slow, 2.0), model=model_drafter(), learn_timings=False)
    plan = p.plan([1], 16, GREEDY, RNG)
    assert len(plan.draft.tokens) == 4
    assert plan.expected_rate == pytest.approx(0.1789537, rel=1e-5)


def test_a_probe_drafts_the_best_k_up_to_4_only_while_nothing_was_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Not in use, judged plainly (a_acc 0.95, a_cont = confidence), HAND's timings:
    # confidence 0.3: best K=2 at 102.11 tokens/s, below the margin (105) but above
    # 0.85 of it (89.25): after ``probe_every`` idle steps a probe of K=2. Confidence 0.05:
    # K=1 at 86.57, no probe. Measured before (2 trials, fading by 0.97 a step: still
    # above 1 after 20 steps): no probe either.
    monkeypatch.setattr(fakes, "TUNING", dataclasses.replace(fakes.TUNING, explore_steps=0))

    def kinds(conf: float, trials: float = 0.0) -> list[int]:
        p = auto_planner(Timings(dict(HAND), 0.002), model=model_drafter(), learn_timings=False)
        p.arm("model").accepted.successes, p.arm("model").accepted.trials = 0.95 * trials, trials
        out = []
        for _ in range(AUTO_TUNING.probe_every + 4):
            p.confidence = conf
            plan = p.plan([1], 16, GREEDY, RNG)
            out.append(len(plan.draft.tokens))
            if plan.drafter is not None:
                break
        return out

    assert kinds(0.3) == [0] * (AUTO_TUNING.probe_every - 1) + [2]
    assert kinds(0.05) == [0] * (AUTO_TUNING.probe_every + 4)
    assert kinds(0.3, trials=2.0) == [0] * (AUTO_TUNING.probe_every + 4)


def test_a_model_far_behind_is_not_in_use() -> None:
    # Past its optimistic steps, 9 tokens behind (not in step): judged against the
    # margin, 102.46 (K=11, as above) is not enough, though it beats the target alone.
    p = auto_planner(Timings(dict(HAND), 0.002), model=model_drafter(), learn_timings=False)
    p.arm("model").steps = AUTO_TUNING.explore_steps
    assert p.plan(list(range(1, 10)), 16, GREEDY, RNG).drafter is None
    # In step (one behind) at the same estimate: kept, it beats the target alone.
    model = model_drafter()
    model.prefill(list(range(1, 10)))
    p = auto_planner(Timings(dict(HAND), 0.002), model=model, learn_timings=False)
    p.arm("model").steps = AUTO_TUNING.explore_steps
    p.confidence = 0.3
    plan = p.plan(list(range(1, 10)), 16, GREEDY, RNG)
    assert plan.drafter is model and plan.expected_rate == pytest.approx(102.1095, rel=1e-5)


@pytest.mark.usefixtures("mean_lookups")
def test_ngram_k_respects_draft_min_and_costs_no_draft_time() -> None:
    # As in test_ngram_drafts_are_judged_by_their_match_length (K=3 at 214.94), with a
    # draft model's time in the timings (n-gram drafts cost none of it) and draft_min 4:
    # K=4 at 4.0951 / 0.0195 = 210.01.
    history = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4]
    for draft_min, n, rate in ((0, 3, 3.439 / 0.016), (4, 4, 4.0951 / 0.0195)):
        p = auto_planner(Timings(dict(HAND), 0.05), ngram=NgramDrafter(1, 8),
                        draft_min=draft_min, learn_timings=False)  # fmt: skip
        p.confidence = 0.9
        plan = p.plan(history, 16, GREEDY, RNG)
        assert len(plan.draft.tokens) == n and plan.expected_rate == pytest.approx(rate)
    # A continuation exactly draft_min long is drafted (1-token match, a = 0.18, FLAT).
    p = ngram_planner(FLAT, draft_min=3)
    assert p.plan([5, 6, 9, 1, 6], 16, GREEDY, RNG).draft.tokens == [9, 1, 6]


def test_sampled_model_drafts_carry_their_distributions() -> None:
    p = auto_planner(Timings(dict(HAND), 0.002), model=model_drafter(), learn_timings=False)
    sampled = SamplerParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    plan = p.plan([1], 16, sampled, np.random.default_rng(5))
    assert plan.drafter is p.arm("model").drafter and plan.draft.dists is not None
    assert len(plan.draft.dists) == len(plan.draft.tokens) == 4


def test_best_k_minimum_and_ties() -> None:
    # HAND at a = 0.8 (test_cost_model_against_hand_computed_numbers): K=2 is best
    # (135.56); from K=3 on: K=3 at 2.952 / 0.022 = 134.18.
    t = Timings(dict(HAND), draft=0.002)
    assert best_k(0.8, t, 4, k_min=3) == (3, pytest.approx(2.952 / 0.022))
    # Drafts that gain nothing (a = 0, free, flat timings) tie with the target alone:
    # no drafts.
    assert best_k(0.0, Timings(dict(FLAT)), 4, draft_cost=0.0) == (0, pytest.approx(100.0))


def test_outliers_by_hand() -> None:
    from specgguf.engine.calibration import _drop_outliers

    # 0.5 is over 1.5 times the next two (0.2, 0.3), though not the third (0.4): replaced
    # by the interpolation of its neighbours, 0.15.
    assert _drop_outliers({1: 0.1, 2: 0.5, 3: 0.2, 4: 0.3, 5: 0.4})[2] == pytest.approx(0.15)
    # Exactly 1.5 times (in binary: 0.75 = 1.5 * 0.5) is kept.
    assert _drop_outliers({1: 0.25, 2: 0.75, 3: 0.5, 4: 0.5})[2] == 0.75
    # The size before the last is checked too (against the last only).
    assert _drop_outliers({1: 0.1, 2: 0.2, 3: 0.9, 4: 0.3})[3] == pytest.approx(0.25)


def test_first_evaluation_cost_three_behind_is_spread() -> None:
    # Three behind, a mean run of 4: 0.2 * t_verify(2) + 0.2 * (0.014 - 0.012) / 4.
    p = auto_planner(Timings(dict(HAND), 0.002), model=model_drafter(), learn_timings=False)
    p.arm("model").mean_streak = 4.0
    assert first_eval_cost(p, [1, 2, 3]) == pytest.approx(0.0025)


#: A calibration measured on the 2-core AMD EPYC (Qwen2.5-Coder 1.5B, 17 rows at most),
#: where 13 rows came out slower than 17.
REVERSED_TAIL = {1: 0.0333, 2: 0.0648, 3: 0.0841, 4: 0.0964, 5: 0.114, 7: 0.1858, 9: 0.2961,
                 13: 0.3497, 17: 0.3324}  # fmt: skip


def test_a_long_catch_up_is_never_free_when_the_curves_last_sizes_are_reversed() -> None:
    # The case found on Spec-Bench's math questions: the draft model idle for 83 steps,
    # 93 tokens behind, was planned for one token because its catch-up was costed at 3 ms
    # (the curve extrapolated from 13 and 17 rows fell towards 0 at 93); it took 0.5 s.
    # Past 17 rows each row now adds the mean over the sizes, (0.3324 - 0.0333) / 16.
    t = Timings(dict(REVERSED_TAIL), 0.020)
    slope = (0.3324 - 0.0333) / 16
    assert t.verify_time(93) == pytest.approx(0.3324 + 76 * slope)
    assert t.verify_time(17) == 0.3324 and t.verify_time(15) == pytest.approx(0.34105)
    model = model_drafter()
    p = auto_planner(t, model=model, learn_timings=False)
    text = [i % 30 + 1 for i in range(160)]
    model.prefill(text[:67])  # it holds the first 66 tokens: 94 behind the 160
    per = 0.020 / 0.0333
    catch_up = per * 0.0648 + per * (t.verify_time(94) - 0.0648)  # a first run: whole
    assert first_eval_cost(p, text) == pytest.approx(catch_up) and catch_up > 1.0
    # Nothing measured yet and idle long enough for a probe: still no draft model.
    p.arm("model").idle, p.confidence = 83, 0.975
    plan = p.plan(text, 16, GREEDY, RNG)
    assert plan.drafter is None and model.cached_tokens(text) == 66


def test_calibration_log_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    from specgguf.engine import calibration
    from specgguf.engine.calibration import calibrate

    # (a size measured slower than a larger one is measured again: the fakes' times are
    # the clock's, and a loaded machine made one seem so, which this log does not show)
    monkeypatch.setattr(calibration, "OUTLIER_RATIO", math.inf)

    # Room 8, sizes 1 and 2 (need 2): a prefix of 8 - 2 - 1 = 5 tokens, a warm-up, 3
    # repeats per size (the default) each after one draft token, then 5 draft timings
    # each after one target token; both caches emptied.
    target = FakeContext(one_hot_rule(plus_one, V), V, n_ctx=8)
    draft = FakeContext(one_hot_rule(plus_one, V), V, n_ctx=16)
    calibrate(target, draft, [5, 6, 7], sizes=(1, 2))
    prefix = [5, 6, 7, 5, 6]

    def timed(tokens: list[int], mode: str) -> list[tuple[object, ...]]:
        return [("rollback", 5), ("eval", 5, tokens, mode)]

    assert target.log == [
        ("rollback", 0), ("eval", 0, prefix, "none"), *timed([5], "all"),
        *timed([5], "all") * 3, *timed([5, 6], "all") * 3, *timed([5], "last") * 5,
        ("rollback", 0),
    ]  # fmt: skip
    assert draft.log == [("rollback", 0), ("eval", 0, prefix, "none"),
                         *timed([5], "last") * 12, ("rollback", 0)]  # fmt: skip
    # A long context: a prefix of 64 tokens at most.
    big = FakeContext(one_hot_rule(plus_one, V), V, n_ctx=256)
    calibrate(big, None, [5], sizes=(1, 2), repeats=1)
    assert big.log[1] == ("eval", 0, [5] * 64, "none")
    # No room for a prefix (3 - 2 - 1 = 0): none.
    small = FakeContext(one_hot_rule(plus_one, V), V, n_ctx=3)
    calibrate(small, None, [5], sizes=(1, 2), repeats=1)
    assert all(e[3] != "none" for e in small.log if e[0] == "eval")
    # The batch bounds the sizes, whatever the outputs allow; a 1-token context: size 1.
    narrow = FakeContext(one_hot_rule(plus_one, V), V, n_ctx=64, n_batch=2)
    narrow.n_outputs_max = 64  # type: ignore[attr-defined]
    assert sorted(calibrate(narrow, None, [5], sizes=(1, 2, 4), repeats=1).verify) == [1, 2]
    one = FakeContext(one_hot_rule(plus_one, V), V, n_ctx=1)
    assert sorted(calibrate(one, None, [5], repeats=1).verify) == [1]


def suffix_planner(timings: dict[int, float], **kw: object) -> AutoPlanner:
    return auto_planner(Timings(dict(timings)), ngram=NgramDrafter(2, 8), suffix=SuffixDrafter(),
                       learn_timings=False, **kw)  # type: ignore[arg-type]  # fmt: skip


@pytest.mark.usefixtures("mean_lookups")
def test_suffix_matching_drafts_from_earlier_generations_where_ngram_finds_nothing() -> None:
    # An earlier generation held 11 12 13 14 15 16; the text now ends on 11 12 13 14 and has
    # no repeated bigram, so n-gram lookup (2..8) finds nothing. Suffix matching: a 4-token
    # match (bucket 4, prior 1.0 x confidence 0.6 = a 0.6) with 2 tokens after it.
    # HAND: K=1: 1.6 / 0.012 = 133.33; K=2: 1.96 / 0.014 = 140.0: K = 2.
    p = suffix_planner(HAND)
    assert p.drafters == [p.arm("ngram").drafter, p.arm("suffix").drafter]
    assert p.arm("suffix").drafter is not None
    p.arm("suffix").drafter.propose([11, 12, 13, 14, 15, 16], 4, GREEDY, RNG)
    p.reset()  # a new generation: the earlier one stays in the suffix corpus
    plan = p.plan([1, 2, 11, 12, 13, 14], 16, GREEDY, RNG)
    assert NgramDrafter(2, 8).propose([1, 2, 11, 12, 13, 14], 4, GREEDY, RNG).match == 0
    assert plan.drafter is p.arm("suffix").drafter and plan.draft.tokens == [15, 16]
    assert plan.expected_rate == pytest.approx(1.96 / 0.014)
    assert plan.bucket == 4 and plan.arm is p.arm("suffix")
    # Verified: 1 of the 2 accepted. Only suffix matching's bucket 4 learns.
    p.observe(plan, 1, 0.014)
    assert (p.arm("suffix").rates[4].successes, p.arm("suffix").rates[4].trials) == (1.0, 2.0)
    # 1 accepted: 1 + (1 - 1) / 2
    assert p.arm("suffix").lengths == {1: 1.0, 2: 1.0, 4: 1.0, 16: 6.0, 32: 6.0, **SUFFIX_TWINS}
    assert (
        all(a.trials == 0.0 for a in p.arm("ngram").rates.values())
        and p.arm("ngram").lengths[4] == 4.0
    )
    # An empty suffix draft teaches nothing.
    p.observe(dataclasses.replace(plan, draft=Draft([])), 0, 0.010)
    assert p.arm("suffix").rates[4].trials == 2.0 and p.arm("suffix").lengths[4] == 1.0


@pytest.mark.usefixtures("mean_lookups")
def test_the_faster_lookup_draft_wins_and_ngram_on_a_tie() -> None:
    # Both find the same 3-token match (bucket 2 for n-gram, whose match is 3 tokens; the
    # suffix drafter's longest length that matches is 2: bucket 2) and the same two tokens
    # after it: equal rates, n-gram lookup drafts.
    history = [7, 8, 9, 5, 6, 7, 8, 9]
    p = suffix_planner(FLAT)
    plan = p.plan(history, 16, GREEDY, RNG)
    assert plan.drafter is p.arm("ngram").drafter and plan.draft.tokens == [5, 6, 7, 8, 9]
    # Suffix matching measured better in bucket 2 (a = (3 + 0.6 * 0.7 * 2) / (3 + 2)): it
    # drafts now, with the same tokens, at its own rate.
    p = suffix_planner(FLAT)
    p.arm("suffix").rates[2] = type(p.arm("suffix").rates[2])(successes=3.0, trials=3.0)
    plan = p.plan(history, 16, GREEDY, RNG)
    a = (3.0 * 0.97 + 0.42 * 2) / (3.0 * 0.97 + 2)
    assert plan.drafter is p.arm("suffix").drafter and plan.draft.tokens == [5, 6, 7, 8, 9]
    assert plan.expected_rate == pytest.approx(e(a, 5) / 0.010)
    assert plan.bucket == 2
    # reset: suffix matching's estimates start from the priors again
    p.arm("suffix").lengths[2] = 3.0
    p.reset()
    assert all(x.trials == 0.0 for x in p.arm("suffix").rates.values())
    assert p.arm("suffix").lengths == {1: 1.0, 2: 1.0, 4: 1.0, 16: 6.0, 32: 6.0, **SUFFIX_TWINS}
    assert p.arm("suffix").shadow is None


def test_suffix_chains_start_at_a_cap_of_six_and_grow_with_what_is_accepted() -> None:
    # 10 tokens followed an earlier 4-token match. The first suffix chain is capped at
    # 2 * 1.0 + 4 = 6 tokens (flat timings: the cap is K); 6 accepted: the mean accepted
    # length moves halfway, 1 -> 3.5, and the cap to 2 * 3.5 + 4 = 11.
    p = suffix_planner(FLAT)
    assert p.arm("suffix").drafter is not None
    p.arm("suffix").drafter.propose([21, 22, 23, 24, *range(30, 40)], 16, GREEDY, RNG)
    p.reset()
    history = [1, 2, 21, 22, 23, 24]
    plan = p.plan(history, 16, GREEDY, RNG)
    assert plan.drafter is p.arm("suffix").drafter and plan.draft.tokens == list(range(30, 36))
    p.observe(plan, 6, 0.010)
    assert p.arm("suffix").lengths[4] == 3.5
    assert p.plan(history, 16, GREEDY, RNG).draft.tokens == list(range(30, 40))[:11]


#: A calibration on a 2-core AMD EPYC (seconds): the lone row's slope past 64 positions
#: measured 60 us per position, a batch row's 14 us; llama-bench -d 64,384,800 showed no
#: slope for a lone row (43.0, 37.9, 41.3 ms per token).
EPYC_DEEP = {1: 0.03029, 2: 0.05513, 3: 0.07192, 4: 0.09512, 5: 0.12458, 7: 0.19902,
             9: 0.21646, 13: 0.23682, 17: 0.22190}  # fmt: skip


def test_a_lone_row_never_costs_more_per_cached_position_than_a_row_of_a_batch() -> None:
    # Spec-Bench's rag question 492, 779 tokens cached: its 16 tokens took 0.692 s over
    # 17 target steps alone (40.7 ms a step). The lone row's measured slope would make a
    # step 0.03029 + 715 * 60e-6 = 73.2 ms, about what two rows cost (75.9 ms), so a draft
    # model drafting one token looked free; capped at the batch row's 14.02 us: 40.3 ms.
    t = Timings(dict(EPYC_DEEP), 0.02008, depth=64, position_single=6.015e-5,
                position_row=1.4025e-5)  # fmt: skip
    assert t.verify_time(1, 779) == pytest.approx(0.03029 + 715 * 1.4025e-5)
    assert t.verify_time(2, 779) == pytest.approx(0.05513 + 715 * 2 * 1.4025e-5)
    # The draft model in step with a confident target (0.99) and nothing measured yet: at
    # 20 ms a draft token (two thirds of a target step here) it does not pay. One token
    # at its optimistic bound (acceptance 1.0): 2 / (0.02008 + 0.07519) = 21.0 tokens/s,
    # against 1 / 0.04032 = 24.8 for the target alone.
    model = model_drafter()
    p = auto_planner(t, model=model, learn_timings=False)
    text = [i % 30 + 1 for i in range(780)]
    model.prefill(text)
    p.confidence = 0.99
    plan = p.plan(text, 16, GREEDY, RNG)
    assert plan.drafter is None and plan.expected_rate == pytest.approx(1 / t.verify_time(1, 779))


def test_steps_pass_without_asking_while_asking_costs_more_than_its_budget() -> None:
    # Asking costs 1 ms, a lone row 10 ms: 10% of a step against a budget of 3%, so the
    # planner asks once in ceil(0.1 / 0.03) = 4 steps, ramping up: 1, 2, 3, 3, ... passed.
    p = ngram_planner(HAND)
    p.plan_cost = 0.001
    history = [1, 2, 3, 4, 5]  # (no repeated n-gram: nothing to draft)
    asked, passed = [], []
    for _ in range(6):
        plan = p.plan(history, 16, GREEDY, RNG)
        assert plan.drafter is None and not p.skipped and p.wants_confidence
        asked.append(len(history))
        n = p.pass_steps()
        passed.append(n)
        history = [*history, *range(100 + len(history), 100 + len(history) + n + 1)]
    assert passed == [1, 2, 3, 3, 3, 3]
    assert p.pass_steps() == 0  # taken by the loop
    # Steps the loop does not take are let pass by plan() itself, without confidence.
    p.plan(history, 16, GREEDY, RNG)
    assert [p.plan(history, 16, GREEDY, RNG).drafter for _ in range(3)] == [None] * 3
    assert p.skipped and not p.wants_confidence
    p.plan(history, 16, GREEDY, RNG)
    assert not p.skipped and p.wants_confidence  # asked again


@pytest.mark.parametrize("cost,budget", [(0.0003, 0.03), (0.001, 0.0), (0.0, 0.03)])
def test_no_step_passes_when_asking_is_within_its_budget(cost: float, budget: float) -> None:
    p = ngram_planner(HAND, tuning=tuned(plan_budget=budget))
    p.plan_cost = cost  # 0.0003 is 3% of the 10 ms lone row: within
    for n in range(5, 40):
        p.plan(list(range(n)), 16, GREEDY, RNG)
        assert not p.skipped and p.pass_steps() == 0


def test_steps_passed_are_at_most_plan_skip_max() -> None:
    p = ngram_planner(HAND, tuning=tuned(plan_skip_max=2, check_steps=False))
    p.plan_cost = 0.05  # five lone rows: would let 166 steps pass
    history = [1, 2, 3, 4, 5]
    passed = []
    for extra in ([], [6], [6, 7, 8]):
        p.plan([*history, *extra], 16, GREEDY, RNG)
        passed.append(p.pass_steps())
    assert passed == [1, 2, 2]


def test_after_a_draft_vain_asks_go_on_from_halfway_up_the_ramp() -> None:
    p = ngram_planner(HAND, tuning=tuned(check_steps=False))
    p.plan_cost = 0.05
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # (nothing repeats: nothing to draft)
    passed = []
    for n in (5, 6, 7, 8):
        p.plan(text[:n], 16, GREEDY, RNG)
        passed.append(p.pass_steps())
    assert passed == [1, 2, 4, 8]
    # A repeated 4-gram at full confidence pays: drafted, and no step let pass after it.
    p.confidence = 1.0
    plan = p.plan([*text, 7, 8, 9], 16, GREEDY, RNG)
    assert plan.drafter is not None and p.pass_steps() == 0
    # The copy is over: the next vain asks let 4, then 8, 16 pass (the ramp the draft
    # ended was at 8; from 1 it would take three more asks to get there).
    p.confidence = 0.5
    passed = []
    for tail in ([100], [100, 101], [100, 101, 102]):
        assert p.plan([*text, 7, 8, 9, 10, *tail], 16, GREEDY, RNG).drafter is None
        passed.append(p.pass_steps())
    assert passed == [4, 8, 16]


#: A text whose last 4-gram occurred before: the n-gram arm drafts "9 5 6 7 8 ..." at
#: full confidence (see the test above).
REPEAT = [5, 6, 7, 8, 9, 5, 6, 7, 8]


def clocked(pythons: list[float], kept: int | None = None, **kw: object) -> list[int]:
    """An n-gram planner on HAND (10 ms lone rows) under a fake clock: drafted steps whose
    verification takes HAND's time for its rows and the clock that plus ``pythons[i]``
    (the step's Python), each keeping ``kept`` drafts (None: all), each step let pass
    10 ms; returns what ``pass_steps`` let pass after each drafted step. Its first draft
    is 3 tokens at 195 tokens/s: 3.12 tokens expected of a 16 ms verification, 15.2 ms
    gained by the cost model; its drafts all kept, the next 3.61, 4.58, 5.55 tokens
    expected (the arm's estimate rising), the second gaining 20.1 ms.
    """
    kw.setdefault("tuning", tuned(check_steps=True))
    p = ngram_planner(HAND, **kw)
    p.confidence = 1.0
    now = [0.0]
    p.clock = lambda: now[0]
    assert p.pass_steps() == 0  # (as the loop asks first: it runs the steps let pass)
    passed = []
    for python in pythons:
        plan = p.plan(REPEAT, 16, GREEDY, RNG)
        n = len(plan.draft.tokens)
        assert plan.drafter is not None and n >= 1
        verify = p.timings.verify_time(n + 1)
        p.observe(plan, n if kept is None else kept, verify)
        now[0] += verify + python
        passed.append(p.pass_steps())
        now[0] += 0.010 * passed[-1]
    return passed


def test_drafted_steps_whose_python_outweighs_their_gain_let_the_next_steps_pass() -> None:
    # 31.2 ms of tokens expected in 16 + 30 ms by the clock: -14.8 ms a step. Each drafted
    # step is taken as a vain ask (the ramp 1, 2, 4, 8), and the steps let pass are timed
    # (10 ms a token) for the next check.
    assert clocked([0.030] * 5) == [1, 2, 4, 8, 16]
    assert clocked([0.030] * 4, tuning=tuned(plan_skip_max=2, check_steps=True)) == [1, 2, 2, 2]


def test_drafted_steps_that_pay_by_the_clock_let_no_step_pass() -> None:
    # 1 ms of Python: +14.2 ms a step; every step asks.
    assert clocked([0.001] * 5) == [0] * 5


def test_drafts_are_judged_by_their_expected_tokens_not_those_kept() -> None:
    # Every draft rejected (1 token a step, where the cost model expected 3.12): the
    # acceptance is the arms' to learn; the clock judges only the Python. (By the tokens
    # kept, a few rejected long drafts of a copy that pays would stop auto mode asking.)
    assert clocked([0.001] * 5, kept=0) == [0] * 5


def test_the_clock_check_is_off_when_tuned_off_or_beside_other_sequences() -> None:
    assert clocked([0.030] * 4, tuning=tuned(check_steps=False)) == [0] * 4
    p = ngram_planner(HAND, tuning=tuned(check_steps=True))
    p.timings.share_batch((), solo=False)  # other sequences' work is in the clock
    p.confidence = 1.0
    now = [0.0]
    p.clock = lambda: now[0]
    assert p.pass_steps() == 0
    for _ in range(3):
        plan = p.plan(REPEAT, 16, GREEDY, RNG)
        p.observe(plan, 3, 0.016)
        now[0] += 0.046
        assert plan.drafter is not None and p.pass_steps() == 0


def test_a_drafted_step_at_a_loss_is_made_up_by_later_gains() -> None:
    # -14.8 ms (30 ms of Python), then +19.1 ms (1 ms of Python): the averages (running
    # means) -14.8, +2.2, ...; with 20 ms of Python on the second (+0.1 ms), -7.3 there
    # (the second step of that ramp: 2), then +3.6.
    assert clocked([0.030, 0.001, 0.001, 0.001]) == [1, 0, 0, 0]
    assert clocked([0.030, 0.020, 0.001, 0.001]) == [1, 2, 0, 0]


def test_steps_asked_in_vain_weigh_against_the_drafts_that_pay_a_little() -> None:
    # Two vain asks of 30 ms by the clock (one token each, 10 ms alone: -20 ms each; their
    # cost of asking within plan_budget: neither lets a step pass), then a drafted step
    # gaining 14.2 ms: the average, (-20 - 20 + 14.2) / 3, is below 0, so one step is let
    # pass after it (the drafted steps' own ramp starts at 1).
    p = ngram_planner(HAND, tuning=tuned(check_steps=True))
    p.plan_cost = 0.0  # (within plan_budget, whatever this machine's clock says)
    p.confidence = 1.0
    now = [0.0]
    p.clock = lambda: now[0]
    assert p.pass_steps() == 0
    text = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8]  # (the last 4-gram repeats the first)
    for n in (5, 6):
        assert p.plan(text[:n], 16, GREEDY, RNG).drafter is None
        now[0] += 0.030
        assert p.pass_steps() == 0
    plan = p.plan(text, 16, GREEDY, RNG)
    p.observe(plan, 3, 0.016)
    now[0] += 0.017
    assert plan.drafter is not None and p.pass_steps() == 1


@pytest.mark.parametrize("by_clock,passed", [(True, [0, 1, 1, 1, 1]), (False, [0] * 5)])
def test_asking_costs_what_a_vain_step_takes_beyond_a_step_let_pass(
    by_clock: bool, passed: list[int]
) -> None:
    # The arms' Python is a few microseconds (within the budget of 3% of HAND's 10 ms
    # lone row), but each vain ask takes 10.45 ms by the clock: 0.45 ms beyond a lone row
    # (its general step, the drafters' upkeep), 1.5 budgets. Counted (from the second
    # ask on: the first is timed at the next), asking lets ceil(1.5) - 1 = 1 step pass
    # for each ask (within the ramp: 2, 4, ...).
    p = ngram_planner(HAND, tuning=tuned(check_steps=True, ask_by_clock=by_clock))
    p.plan_cost = None  # (measured, as the engine's planner does)
    now = [0.0]
    p.clock = lambda: now[0]
    assert p.pass_steps() == 0
    history, got = [1, 2, 3, 4, 5], []
    for _ in range(5):
        assert p.plan(history, 16, GREEDY, RNG).drafter is None
        now[0] += 0.01045
        got.append(n := p.pass_steps())
        now[0] += 0.010 * n
        history = [*history, *range(100 + len(history), 100 + len(history) + n + 1)]
    assert got == passed


def test_a_drafters_prompt_reading_is_left_out_of_the_steps_seconds() -> None:
    # A drafter that reads the prompt at its first draft (as a draft model defers it), 100
    # ms by the clock, counted as its prompt_seconds: the loop counts that as the prompt's
    # time, and the cost model weighs the prompt as read. The step is judged without it
    # (+14.2 ms: no step let pass); counted, it would be -86 ms.
    now = [0.0]

    class Reading(NgramDrafter):
        def propose(self, history, k, sampler, rng, *, p_min=0.0, p_path_min=0.0):  # type: ignore[no-untyped-def]
            if not self.prompt_seconds:
                self.prompt_seconds += 0.100
                self.seconds += 0.100
                now[0] += 0.100
            return super().propose(history, k, sampler, rng)

    p = auto_planner(Timings(dict(HAND)), ngram=Reading(1, 8), learn_timings=False,
                     tuning=tuned(check_steps=True))  # fmt: skip
    p.confidence = 1.0
    p.clock = lambda: now[0]
    assert p.pass_steps() == 0
    plan = p.plan(REPEAT, 16, GREEDY, RNG)
    assert plan.drafter is not None and len(plan.draft.tokens) == 3
    p.observe(plan, 3, 0.016)
    now[0] += 0.017
    assert p.pass_steps() == 0 and p._net > 0.0


def test_without_the_loops_steps_let_pass_nothing_is_judged() -> None:
    # Under a grammar or in deterministic mode the loop never asks pass_steps (its forced
    # steps neither plan nor observe; its verification stops at a rejection): the clock's
    # check stays off there, however slow the steps.
    p = ngram_planner(HAND, tuning=tuned(check_steps=True))
    p.confidence = 1.0
    now = [0.0]
    p.clock = lambda: now[0]
    for _ in range(5):
        plan = p.plan(REPEAT, 16, GREEDY, RNG)
        assert plan.drafter is not None and not p.skipped
        p.observe(plan, len(plan.draft.tokens), 0.016)
        now[0] += 0.046
    assert p._n_net == 0


def test_steps_timed_beside_other_sequences_are_not_judged_when_alone_again() -> None:
    p = ngram_planner(HAND, tuning=tuned(check_steps=True))
    p.confidence = 1.0
    now = [0.0]
    p.clock = lambda: now[0]
    p.timings.share_batch((), solo=False)
    assert p.pass_steps() == 0
    for _ in range(3):  # slow steps beside others: not this sequence's own time
        plan = p.plan(REPEAT, 16, GREEDY, RNG)
        p.observe(plan, len(plan.draft.tokens), 0.016)
        now[0] += 1.0
        assert p.pass_steps() == 0
    p.timings.share_batch((), solo=True)
    plan = p.plan(REPEAT, 16, GREEDY, RNG)  # (the interval begun beside them: dropped)
    p.observe(plan, len(plan.draft.tokens), 0.016)
    now[0] += 0.017
    assert p.pass_steps() == 0 and p._n_net == 1 and p._net > 0.0


def test_a_sequence_left_alone_while_it_drafts_is_neither_judged_nor_broken() -> None:
    # serve --parallel: a draft model's evaluation lets the other sequences run; one that
    # ends leaves this one alone (timings.solo True) in the middle of plan(). The step
    # began beside others: it is not judged (a first version raised ValueError here).
    p = ngram_planner(HAND, tuning=tuned(check_steps=True))
    p.confidence = 1.0
    p.clock = lambda: 0.0
    p.timings.share_batch((), solo=False)
    assert p.pass_steps() == 0
    drafter = p.arm("ngram").drafter
    propose = drafter.propose

    def others_end(*args, **kw):  # type: ignore[no-untyped-def]
        p.timings.share_batch((), solo=True)
        return propose(*args, **kw)

    drafter.propose = others_end  # type: ignore[method-assign]
    plan = p.plan(REPEAT, 16, GREEDY, RNG)
    assert plan.drafter is not None
    p.observe(plan, len(plan.draft.tokens), 0.016)
    assert p.pass_steps() == 0 and p._n_net == 0


def test_a_draft_cut_short_after_a_prompt_read_is_not_judged() -> None:
    # A draft model can read the prompt (or catch up) and then draft nothing (its first
    # token below p_stop_at): that step's time is not the asking's, nor the drafts'.
    p = ngram_planner(HAND, tuning=tuned(check_steps=True))
    p.confidence = 1.0
    now = [0.0]
    p.clock = lambda: now[0]
    assert p.pass_steps() == 0
    arm = p.arm("ngram")

    def read_then_nothing(offer, step):  # type: ignore[no-untyped-def]
        arm.drafter.prompt_seconds += 0.100
        now[0] += 0.100
        return Draft([])

    arm.draft = read_then_nothing  # type: ignore[method-assign]
    assert p.plan(REPEAT, 16, GREEDY, RNG).drafter is None
    now[0] += 0.011
    assert p.pass_steps() == 0 and p._n_net == 0


def test_the_planners_own_time_is_measured_when_not_given() -> None:
    p = ngram_planner({1: 1e-7, 2: 1.2e-7})  # a lone row of 0.1 us: asking costs more
    p.plan_cost = None
    p.plan([1, 2, 3, 4, 5], 16, GREEDY, RNG)
    assert p.pass_steps() == 1 and p._measured_cost > 3e-9


def test_auto_mode_letting_steps_pass_gives_the_target_alones_output() -> None:
    # A fast target (a lone row of 20 us) and asking at 100 us: most steps pass, in the
    # loop's lean steps; every token is the target's own.
    ctx = FakeContext(one_hot_rule(target_next, V), V)
    p = auto_planner(Timings({1: 2e-5, 2: 2.4e-5}), ngram=NgramDrafter(1, 8), learn_timings=False)
    p.plan_cost = 1e-4
    asked = []
    plan = p.plan

    def counted(history, *a):  # type: ignore[no-untyped-def]
        asked.append(len(history))
        return plan(history, *a)

    p.plan = counted  # type: ignore[method-assign]
    dec = SpeculativeDecoder(ctx, FakeVocab(V))  # type: ignore[arg-type]
    res = dec.generate([1, 2], GenerationParams(n_predict=60, sampler=GREEDY), p).run()
    assert res.tokens == truth([1, 2], 60)
    assert res.stats.generated == 60 and res.stats.steps <= 60
    assert len(asked) < res.stats.steps / 2  # the rest were the loop's lean steps


def test_a_lone_row_of_almost_no_time_lets_the_most_steps_pass() -> None:
    # (found in review: a ratio too large for math.ceil raised OverflowError)
    p = ngram_planner({1: 1e-300, 2: 1.2e-300})
    p.plan_cost = 1e-4
    p.plan([1, 2, 3, 4, 5], 16, GREEDY, RNG)
    assert p.pass_steps() == 1  # the ramp's first step: min(plan_skip_max, 1)
    for n in range(6, 40):
        p.plan(list(range(n)), 16, GREEDY, RNG)
        p.pass_steps()
    p.plan(list(range(40)), 16, GREEDY, RNG)
    assert p.pass_steps() == AUTO_TUNING.plan_skip_max
