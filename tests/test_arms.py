"""Auto mode's arms and rule, and acceptance: a drafter added in a test alone (one class and
one entry in the engine's name -> factory map) is weighed by auto mode like the built-in
ones; the planner's choice between offers by hand; each arm's estimates and costs; the
acceptance rules by hand. (That every tuning number is a documented field of one object:
tests/test_layout.py.)"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest

from specgguf.engine import drafter_map
from specgguf.engine.drafter_map import (
    DRAFTERS,
    DrafterEntry,
    Drafting,
    DraftSettings,
    Sources,
    make_drafters,
    make_planner,
)
from specgguf.errors import UsageError
from specgguf.speculative.arms import ChainArm, Offer, Step
from specgguf.speculative.costmodel import Timings
from specgguf.speculative.draft import Draft, Drafter
from specgguf.speculative.drafters import NgramDrafter, SuffixDrafter
from specgguf.speculative.loop import GenerationParams, SpeculativeDecoder
from specgguf.speculative.planner import AutoPlanner, FixedPlanner
from specgguf.speculative.sampling import SamplerParams
from specgguf.speculative.tuning import AUTO_TUNING, AutoTuning
from specgguf.speculative.verification import accept, verifiable

from .fakes import FakeContext, FakeVocab, one_hot_rule

V = 32
GREEDY = SamplerParams(temperature=0.0)
RNG = np.random.default_rng(0)


def target_next(prefix: Sequence[int]) -> int:
    """The fake target's greedy walk: 1, 2, ..., 30, 1, 2, ..."""
    return prefix[-1] % 30 + 1


def truth(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(target_next(seq))
    return seq[len(prompt) :]


class WalkDrafter(Drafter):
    """A new kind of drafter, defined in this test only: it proposes the fake target's own
    walk shifted by ``offset`` (0: always right; otherwise always wrong)."""

    name = "walk"

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.seconds = 0.0

    def propose(self, history, k, sampler, rng, *, p_min=0.0):  # type: ignore[no-untyped-def]
        seq = list(history)
        for _ in range(k):
            seq.append(target_next(seq))
        return Draft([(t + self.offset - 1) % 30 + 1 for t in seq[len(history) :]])


#: Every batch costs one lone row (a GPU-like machine, at its extreme): drafts are free to
#: verify; and a 2-core AMD EPYC's curve, where a batch costs nearly its rows (issue 14).
FLAT = {1: 0.010, 2: 0.010}
EPYC = {1: 0.010, 2: 0.015, 3: 0.020, 5: 0.028, 9: 0.047, 17: 0.081}


def register_walk(monkeypatch: pytest.MonkeyPatch, offset: int) -> None:
    """The walk drafter's registry entry: the one place a new drafter is declared."""
    monkeypatch.setitem(DRAFTERS, "walk", DrafterEntry(
        "walk", "the fake target's walk, shifted",
        make=lambda src: [WalkDrafter(offset) for _ in range(src.n)],
        arm=lambda d, s, t: ChainArm(d), spec_types=("draft-walk",),
    ))  # fmt: skip


def generate_with_walk(
    monkeypatch: pytest.MonkeyPatch, offset: int, verify: dict[int, float], n: int = 60
) -> tuple[list[int], dict[str, list[int]]]:
    """Auto mode, as the engine builds it from the registry, with the walk drafter
    registered in the test: the output and the steps, drafted and accepted tokens per
    drafter."""
    register_walk(monkeypatch, offset)
    (drafters,) = make_drafters(Sources(1, V))
    drafting = Drafting(drafters, lambda det: Timings(dict(verify)))
    planner = make_planner("auto", drafting, DraftSettings(draft_max=8))
    assert isinstance(planner, AutoPlanner)
    assert [arm.name for arm in planner.arms] == ["ngram", "suffix", "walk"]
    dec = SpeculativeDecoder(FakeContext(one_hot_rule(target_next, V), V), FakeVocab(V))  # type: ignore[arg-type]
    prompt = [3, 9, 17, 4]
    res = dec.generate(prompt, GenerationParams(n_predict=n, sampler=GREEDY), planner).run()
    assert res.tokens == truth(prompt, n)  # whatever drafts: the target alone's output
    return res.tokens, res.stats.as_dict()["by_drafter"]


def test_a_drafter_added_in_the_test_alone_is_chosen_where_it_pays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Always right, on flat costs: at any acceptance the longest draft allowed pays most
    # (every batch costs one row), all accepted: 6 steps of 8 drafts and the target's own
    # token (54 tokens), then a last one of the 5 drafts that n_predict leaves room for.
    _, by = generate_with_walk(monkeypatch, 0, FLAT)
    assert by == {"walk": [7, 53, 53]}
    # It is a drafter like the others: --drafter walk drafts with it at a fixed length.
    (drafters,) = make_drafters(Sources(1, V))
    drafting = Drafting(drafters, lambda det: Timings(dict(FLAT)))
    fixed = make_planner("walk", drafting, DraftSettings(draft_max=3))
    assert isinstance(fixed, FixedPlanner) and fixed.plan([1], 3, GREEDY, RNG).draft.tokens == [
        2, 3, 4,
    ]  # fmt: skip
    assert "walk" in drafter_map.drafter_kinds()
    # and the one entry is all the faces read: llama.cpp's name for it, --drafter's help,
    # a request's speculative.drafter (an unknown name is refused there)
    from pydantic import ValidationError

    from specgguf.cli.options import spec_type_drafter
    from specgguf.server.schemas import ChatCompletionRequest

    assert spec_type_drafter("draft-walk") == ("walk", None)
    assert "walk (the fake target's walk, shifted)" in drafter_map.drafter_help()
    msgs = [{"role": "user", "content": "hi"}]
    req = ChatCompletionRequest.model_validate({"messages": msgs, "speculative.drafter": "walk"})
    assert req.spec_drafter == "walk"
    with pytest.raises(
        ValidationError,
        match="must be one of auto, assistant, dflash, eagle3, model, mtp, ngram, suffix",
    ):
        ChatCompletionRequest.model_validate({"messages": msgs, "speculative.drafter": "eagle"})


def test_a_drafter_added_in_the_test_alone_is_left_where_it_does_not_pay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Always wrong, where a batch costs nearly its rows. Its first step is judged at the
    # prior, the confidence before any step (0.6): K=1 at 1.6 / 0.015 = 106.7 tokens/s,
    # above the margin (105). Rejected; the confidence is now the target's (0.992), the
    # rejection faded by a step to 0.97 of a trial: a = 0.992 x 2 / 2.97 = 0.668, K=1 at
    # 1.668 / 0.01485 = 112.3 (a batch of 2 measured faster than calibrated: the fake
    # runs in microseconds, and the correction moved 5% towards its floor of 0.8).
    # Rejected again: 0.992 x 2 / (1.873 x 0.97 + 2) = 0.520, K=1 at 103.3: left out. As
    # the rejections fade, the target alone's own measured steps raise the bar faster,
    # and the lookups find the walk once it repeats: never again in 60 tokens.
    _, by = generate_with_walk(monkeypatch, 5, EPYC)
    assert by["walk"] == [2, 2, 0]


# --- the planner's rule -------------------------------------------------------------


class Fixed:
    """An arm with a set offer (rate, sticky, probe) of one token, recording its settles."""

    def __init__(self, name: str, rate: float, *, sticky: bool = False, probe: bool = False):
        self.name, self.rate, self.sticky, self.probe = name, rate, sticky, probe
        self.drafter = WalkDrafter(0)
        self.settled: list[str | None] = []

    def reset(self, timings: Timings, tuning: AutoTuning) -> bool:
        return True

    def tick(self) -> None:
        pass

    def offer(self, step: Step) -> Offer:
        return Offer(self, 1, self.rate, Draft([7]), sticky=self.sticky, probe=self.probe)  # type: ignore[arg-type]

    def settle(self, step: Step, taken: Offer | None) -> None:
        self.settled.append(taken.arm.name if taken else None)  # type: ignore[attr-defined]

    def draft(self, offer: Offer, step: Step) -> Draft:
        assert offer.draft is not None
        return offer.draft

    def observe(self, plan: object, accepted: int, rejected: bool) -> None:
        pass


def chosen(*arms: Fixed) -> str | None:
    """The arm auto mode takes among ``arms`` where the target alone runs at 100 tokens/s."""
    p = AutoPlanner(Timings({1: 0.010}), list(arms))  # type: ignore[list-item]
    plan = p.plan([1, 2], 4, GREEDY, RNG)
    assert all(a.settled == [plan.arm.name if plan.arm else None] for a in arms)  # type: ignore[attr-defined]
    return plan.arm.name if plan.arm else None  # type: ignore[attr-defined]


def test_the_fastest_admitted_offer_is_taken_an_arm_in_step_counting_more() -> None:
    # Admitted above 105 tokens/s (the margin over 100); the fastest; ties to the first.
    assert chosen(Fixed("a", 104.0)) is None
    assert chosen(Fixed("a", 106.0), Fixed("b", 107.0)) == "b"
    assert chosen(Fixed("a", 107.0), Fixed("b", 107.0)) == "a"
    # An arm in step is admitted above the target alone (101 > 100) and counts 1.25 times
    # its rate: 120 x 1.25 = 150 beats 149 but not 151.
    assert chosen(Fixed("m", 101.0, sticky=True)) == "m"
    assert chosen(Fixed("a", 149.0), Fixed("m", 120.0, sticky=True)) == "m"
    assert chosen(Fixed("a", 150.0), Fixed("m", 120.0, sticky=True)) == "a"  # a tie: first
    # A probe is taken below the margin, unless a faster offer is admitted.
    assert chosen(Fixed("m", 90.0, probe=True)) == "m"
    assert chosen(Fixed("a", 106.0), Fixed("m", 90.0, probe=True)) == "a"
    # The margin is the tuning's: at 1.02, 104 is admitted.
    p = AutoPlanner(Timings({1: 0.010}), [Fixed("a", 104.0)], tuning=tuned(margin=1.02))  # type: ignore[list-item]
    assert p.plan([1, 2], 4, GREEDY, RNG).drafter is not None


def tuned(**fields: object) -> AutoTuning:
    return dataclasses.replace(AUTO_TUNING, **fields)  # type: ignore[arg-type]


# --- verification and acceptance ----------------------------------------------------


def rows(*best: int) -> np.ndarray:
    """Logits rows whose argmax is each of ``best`` (10 there, 0 elsewhere)."""
    out = np.zeros((len(best), V), np.float32)
    for i, b in enumerate(best):
        out[i, b] = 10.0
    return out


def test_greedy_acceptance_of_a_chain_and_a_tree_by_hand() -> None:
    # chain 5 6 7 against argmax 5 6 9 (and 4 after 7): 5 and 6 kept, then 9
    v = accept(Draft([5, 6, 7]), rows(5, 6, 9, 4), GREEDY, RNG)
    assert (v.accepted, v.token, v.row, v.rejected, v.path) == ([5, 6], 9, 2, True, None)
    v = accept(Draft([5, 6]), rows(5, 6, 4), GREEDY, RNG)  # all kept, and a bonus token
    assert (v.accepted, v.token, v.row, v.rejected) == ([5, 6], 4, 2, False)
    # tree: root -> 5 (node 0) -> 6 (node 2); root -> 8 (node 1). Argmax after the root 5,
    # after node 0: 6, after node 1: 3, after node 2: 11 (node 2 has no child: not a
    # rejection, the bonus)
    tree = Draft([5, 8, 6], parents=[-1, -1, 0])
    v = accept(tree, rows(5, 6, 3, 11), GREEDY, RNG)
    assert (v.accepted, v.token, v.row, v.rejected, v.path) == ([5, 6], 11, 3, False, [0, 2])
    # argmax 8 after the root: node 1, a leaf
    v = accept(tree, rows(8, 6, 3, 11), GREEDY, RNG)
    assert (v.accepted, v.token, v.path) == ([8], 3, [1])
    # argmax 9 after node 0, which has a child (6): a rejection at depth 2
    v = accept(tree, rows(5, 9, 3, 11), GREEDY, RNG)
    assert (v.accepted, v.token, v.rejected) == ([5], 9, True)


def test_keyed_acceptance_does_not_depend_on_the_draft() -> None:
    # Deterministic mode: the token at output position i is drawn with the key (seed, i);
    # a draft token is kept when it equals that draw, so the tokens are the same whatever
    # was drafted.
    sampler = SamplerParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    logits = np.zeros((5, V), np.float32)
    out = accept(Draft([]), logits[:1], sampler, RNG, keyed_at=7)
    first = out.token
    wrong = (first + 1) % V
    v = accept(Draft([wrong, 3]), logits[:3], sampler, RNG, keyed_at=7)
    assert (v.accepted, v.token, v.rejected) == ([], first, True)
    v = accept(Draft([first]), logits[:2], sampler, RNG, keyed_at=7)
    assert v.accepted == [first] and not v.rejected
    assert v.token == accept(Draft([]), logits[:1], sampler, RNG, keyed_at=8).token


def test_a_tree_is_verified_as_a_tree_only_where_trees_are() -> None:
    tree = Draft([5, 8, 6, 7], parents=[-1, -1, 0, 2], probs=[0.5, 0.4, 0.3, 0.2])
    assert verifiable(tree, 4, 2).parents == [-1, -1, 0, 2]
    assert verifiable(tree, 3, 2) == Draft([5, 8, 6], parents=[-1, -1, 0])  # cut to K
    assert verifiable(tree, 4, 0) == Draft([5, 6, 7])  # no trees: its first branch
    assert verifiable(tree, 4, 1) == Draft([5, 6, 7])
    three = Draft([5, 8, 9], parents=[-1, -1, -1])
    assert verifiable(three, 3, 2) == Draft([5])  # more leaves than sequences
    chain_tree = Draft([5, 6], parents=[-1, 0])
    assert verifiable(chain_tree, 2, 4) == Draft([5, 6])  # one branch: a chain
    chain = Draft([1, 2, 3], probs=[0.9, 0.8, 0.7], match=4)
    assert verifiable(chain, 2, 4) == Draft([1, 2], probs=[0.9, 0.8], match=4)


def test_an_unknown_drafter_is_refused_with_the_names_there_are() -> None:
    (drafters,) = make_drafters(Sources(1, V))  # nothing loaded: the lookups only
    assert sorted(drafters) == ["ngram", "suffix"]
    drafting = Drafting(drafters, lambda det: Timings({1: 0.01}))
    with pytest.raises(
        UsageError,
        match="auto, assistant, dflash, eagle3, model, mtp, ngram, suffix, none, not 'walk'",
    ):
        make_planner("walk", drafting, DraftSettings(draft_max=4))
    with pytest.raises(UsageError, match=r"the model drafter needs a draft model, and none "
                       r"was loaded \(drafters here: ngram, suffix, auto, none\)$"):  # fmt: skip
        make_planner("model", drafting, DraftSettings(draft_max=4))
    with pytest.raises(
        UsageError, match="the mtp drafter needs the target's multi-token-prediction layers"
    ):
        make_planner("mtp", drafting, DraftSettings(draft_max=4))
    with pytest.raises(UsageError, match="the eagle3 drafter needs an EAGLE-3 head as its"):
        make_planner("eagle3", drafting, DraftSettings(draft_max=4))


def test_a_request_names_a_drafter_as_llama_cpp_does_and_hears_why_not_in_plain_words() -> None:
    """``speculative.drafter`` takes llama.cpp's ``--spec-type`` names too; an unknown one
    is a 400 whose message is the rule, without pydantic's "Value error," in front."""
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    from specgguf.server.errors import validation_error
    from specgguf.server.schemas import CompletionRequest

    for name, kind in (("draft-mtp", "mtp"), ("draft-eagle3", "eagle3"), ("ngram-mod", "ngram")):
        req = CompletionRequest.model_validate({"prompt": "x", "speculative.drafter": name})
        assert req.spec_drafter == kind
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": "x", "speculative.drafter": "bogus"})
    err = validation_error(RequestValidationError(e.value.errors()).errors())
    want = "speculative.drafter: must be one of auto, assistant, dflash, eagle3"
    assert str(err.message).startswith(want), err


class Recording(Drafter):
    """Proposes 1, 2, ..., 8 and records the sampler and generator it was given."""

    name = "recording"

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls: list[tuple[object, object, int]] = []

    def propose(self, history, k, sampler, rng, *, p_min=0.0):  # type: ignore[no-untyped-def]
        self.calls.append((sampler, rng, k))
        return Draft(list(range(1, 9))[:k])


def chain_offer(
    arm: ChainArm,
    timings: Timings,
    *,
    k_min: int = 1,
    cached: int = 1,
    confidence: float = 0.9,
    sampler: SamplerParams = GREEDY,
) -> Offer | None:
    step = Step([1] * (cached + 1), k_min, 8, sampler, RNG, timings, cached, confidence,
                1.0 / timings.verify_time(1, cached), AUTO_TUNING)  # fmt: skip
    return arm.offer(step)


def test_a_chain_arm_weighs_its_cost_per_token_its_k_min_and_the_depth() -> None:
    # Flat timings (10 ms a batch), acceptance at its prior, the confidence 0.9, 5 ms a
    # drafted token: K=1 1.9 / 0.015 = 126.7, K=2 2.71 / 0.02 = 135.5, K=3 3.439 / 0.025
    # = 137.6, K=4 4.0951 / 0.03 = 136.5: K = 3.
    drafter = Recording()
    arm = ChainArm(drafter, token_cost=0.005)
    assert arm.reset(Timings(dict(FLAT)), tuned(prior_trials=4.0, decay=0.5, fade=0.25))
    assert (arm.acceptance.weight, arm.acceptance.decay, arm.acceptance.fade) == (4.0, 0.5, 0.25)
    arm.reset(Timings(dict(FLAT)), AUTO_TUNING)
    offer = chain_offer(arm, Timings(dict(FLAT)))
    assert offer is not None and offer.draft is not None
    assert (offer.k, offer.draft.tokens) == (3, [1, 2, 3])
    assert offer.rate == pytest.approx(3.439 / 0.025)
    assert drafter.calls == [(GREEDY, RNG, 8)]
    # At least 4 tokens: K=4.
    offer = chain_offer(arm, Timings(dict(FLAT)), k_min=4)
    assert offer is not None and (offer.k, offer.rate) == (4, pytest.approx(4.0951 / 0.03))
    # Fewer tokens proposed than k_min (8 of 9): no offer; exactly k_min: one.
    assert chain_offer(arm, Timings(dict(FLAT)), k_min=9) is None
    assert chain_offer(arm, Timings(dict(FLAT)), k_min=8) is not None
    # Free tokens: all 8 (flat costs).
    free = ChainArm(Recording())
    free.reset(Timings(dict(FLAT)), AUTO_TUNING)
    offer = chain_offer(free, Timings(dict(FLAT)))
    assert offer is not None and offer.k == 8
    # 100 positions deep at 0.1 ms per row and position, a lone row not: a batch of n rows
    # costs 0.01 + 0.01 n, the target alone 0.01: K=1 1.9 / 0.03 = 63.3 ... none pays.
    deep = Timings(dict(FLAT), position_row=1e-4)
    offer = chain_offer(free, deep, cached=100)
    assert offer is not None and (offer.k, offer.rate) == (0, pytest.approx(100.0))
    # Greedy verification in calls of 2 rows (deterministic mode) stops at a rejection:
    # 8 drafts (9 rows: calls of 2, 2, 2, 2, 1) cost 0.01 x (1 + 0.9^2 + 0.9^4 + 0.9^6 +
    # 0.9^8) in expectation; sampled, the whole batch, 0.01.
    chunked = Timings(dict(FLAT), chunk_rows=2)
    offer = chain_offer(free, chunked, k_min=8)
    expected = 0.010 * sum(0.9 ** (2 * j) for j in range(5))
    assert offer is not None and offer.rate == pytest.approx(e8(0.9) / expected)
    offer = chain_offer(free, chunked, k_min=8, sampler=SamplerParams(temperature=1.0))
    assert offer is not None and offer.rate == pytest.approx(e8(0.9) / 0.010)


def e8(a: float) -> float:
    """E(8) = 1 + a + ... + a^8."""
    return sum(a**i for i in range(9))


def test_an_offer_exactly_at_the_margin_is_not_taken() -> None:
    # 100 tokens/s alone, a margin of 1.05: 105 exactly is not above it; 105.01 is.
    assert 100.0 * AUTO_TUNING.margin == 105.0
    assert chosen(Fixed("a", 105.0)) is None and chosen(Fixed("a", 105.01)) == "a"
    # an arm in step exactly at the target alone's rate: not taken either
    assert chosen(Fixed("m", 100.0, sticky=True)) is None
    # an offer not admitted does not stop the ones after it
    assert chosen(Fixed("a", 104.0), Fixed("b", 110.0)) == "b"


def test_arms_by_name() -> None:
    p = AutoPlanner(Timings({1: 0.010}), [Fixed("a", 1.0), Fixed("b", 1.0)])  # type: ignore[list-item]
    assert p.arm("b").name == "b"
    with pytest.raises(KeyError, match="no 'c' arm: a, b"):
        p.arm("c")
    with pytest.raises(KeyError, match="no 'c' arm: none"):
        AutoPlanner(Timings({1: 0.010}), []).arm("c")


def test_the_head_of_a_draft_keeps_its_distributions_estimates_and_metadata() -> None:
    from specgguf.speculative.sampling import Distribution

    dists = [Distribution(np.array([i], np.int64), np.array([1.0])) for i in range(3)]
    d = Draft([4, 5, 6], dists=dists, probs=[0.9, 0.8, 0.7], match=7, stopped=True)
    head = d.head(2)
    assert head.tokens == [4, 5] and head.dists == dists[:2] and head.probs == [0.9, 0.8]
    assert (head.match, head.stopped) == (7, True)
    assert Draft([1, 2]).head(1) == Draft([1])
    other = Draft([1], parents=[-1], resumed=True, token_seconds=0.25).head(1)
    assert (other.parents, other.resumed, other.token_seconds) == ([-1], True, 0.25)


def test_a_verification_teaches_the_timings_by_the_tuning_at_the_step_s_depth() -> None:
    from specgguf.speculative.arms import StepPlan

    # 100 positions cached: a batch of 2 rows costs 0.012 + 100 x 2 x 1e-5 = 0.014, a lone
    # row 0.010 + 100 x 1e-5 = 0.011. Weight 0.5, ratios clamped to [0.5, 1.2].
    t = Timings({1: 0.010, 2: 0.012, 4: 0.016}, position_row=1e-5, position_single=1e-5)
    tuning = tuned(timing_weight=0.5, timing_clamp=(0.5, 1.2))
    p = AutoPlanner(t, [Fixed("a", 1000.0)], tuning=tuning)  # type: ignore[list-item]
    plan = p.plan(list(range(101)), 4, GREEDY, RNG)
    assert plan.draft.tokens == [7] and p.cached == 100
    p.observe(plan, 1, 0.0168, rows=2)  # 1.2x
    assert t.scale_batch == pytest.approx(1.1)
    p.observe(plan, 0, 0.5, rows=1)  # fewer rows than the whole batch: not learnt
    assert t.scale_batch == pytest.approx(1.1)
    p.observe(StepPlan(None, Draft([]), 100.0), 0, 0.011 * 3)  # 3x, clamped at 1.2
    assert t.scale_single == pytest.approx(1.1)
    timed = dataclasses.replace(plan, draft=Draft([7], token_seconds=0.004))
    p.observe(timed, 1, 0.014, rows=2)  # a draft token's time, by the tuning's weight
    assert t.draft == pytest.approx(0.002) and t.scale_batch == pytest.approx(1.05)


def test_every_arm_takes_its_estimates_from_the_tuning() -> None:
    from specgguf.speculative.arms import LookupArm, ModelArm, SuffixArm
    from specgguf.speculative.drafters import ModelDrafter

    tuning = tuned(prior_trials=3.0, decay=0.5, fade=0.25, model_prior=0.7,
                   confidence_start=0.4)  # fmt: skip
    model = ModelDrafter(FakeContext(one_hot_rule(target_next, V), V), V)  # type: ignore[arg-type]
    arms = [LookupArm(NgramDrafter()), SuffixArm(SuffixDrafter()), ModelArm(model, draft_max=4,
            p_min=0.0)]  # fmt: skip
    for arm in arms:
        arm.reset(Timings({1: 0.010, 2: 0.011}, 0.001), tuning)
    found = [*arms[0].rates.values(), *arms[1].rates.values(), arms[2].accepted, arms[2].passed]
    assert {(a.weight, a.decay, a.fade) for a in found} == {(3.0, 0.5, 0.25)}
    assert (arms[2].accepted.prior, arms[2].passed.prior) == (0.7, 0.4)


def lookup_step(history: list[int], timings: Timings, sampler: SamplerParams = GREEDY,
                k_min: int = 1) -> Step:  # fmt: skip
    return Step(history, k_min, 8, sampler, RNG, timings, len(history) - 1, 0.9,
                1.0 / timings.verify_time(1), AUTO_TUNING)  # fmt: skip


def test_a_lookup_arm_passes_the_step_s_sampling_and_weighs_lazy_verification() -> None:
    from specgguf.speculative.arms import LookupArm

    drafter = Recording()
    arm = LookupArm(drafter)
    arm.reset(Timings(dict(FLAT)), AUTO_TUNING)
    for _ in range(30):  # evidence enough that a draft of 8 pays either way
        arm.rates[1].observe(8, False)
    chunked = Timings(dict(FLAT), chunk_rows=2)
    greedy = arm.offer(lookup_step([1, 2], chunked, k_min=8))
    sampled = SamplerParams(temperature=1.0)
    plain = arm.offer(lookup_step([1, 2], chunked, sampled, k_min=8))
    assert drafter.calls == [(GREEDY, RNG, 8), (sampled, RNG, 8)]
    assert greedy is not None and plain is not None and (greedy.k, plain.k) == (8, 8)
    # the same estimate a (no match: bucket 1; every row costs what a lone row does, so no
    # standard error off), verified in calls of 2 rows greedily (each call after the one
    # before was accepted whole) or in one batch
    a = arm.estimate(1, 0.9, long_copy=False, z=0.0)
    expected = 0.010 * sum(a ** (2 * j) for j in range(5))
    assert plain.rate / greedy.rate == pytest.approx(expected / 0.010)


def test_a_shadow_s_first_evidence_fades_older_counts_and_a_full_one_raises_a_low_mean() -> None:
    from specgguf.speculative.arms import LookupArm, Shadow

    arm = LookupArm(Recording())
    arm.reset(Timings(dict(FLAT)), AUTO_TUNING)
    acc = arm.rates[4]
    acc.successes, acc.trials = 2.0, 4.0
    arm.lengths[4] = 2.0
    arm.shadow = Shadow(3, [7, 8, 9, 10], 4)
    arm._check_shadow([0, 1, 2, 7, 8])  # two produced as proposed: older counts x 0.9
    assert (acc.successes, acc.trials) == (pytest.approx(3.8), pytest.approx(5.6))
    arm._check_shadow([0, 1, 2, 7, 8, 9, 10])  # then its end: no more fading, 2 more
    assert (acc.successes, acc.trials) == (pytest.approx(5.8), pytest.approx(7.6))
    # matched to its end (4 tokens): the mean accepted length moves halfway up, 2 -> 3
    assert arm.shadow is None and arm.lengths[4] == 3.0


def test_a_lookup_draft_is_judged_by_its_match_and_the_share_of_its_continuation() -> None:
    from specgguf.speculative.arms import LookupArm, SuffixArm

    for arm in (LookupArm(Recording()), SuffixArm(SuffixDrafter())):
        arm.reset(Timings(dict(FLAT)), AUTO_TUNING)
        assert AUTO_TUNING.lookup_share_min == 0.75 and AUTO_TUNING.copy_match == 16
        assert arm.key(Draft([5], probs=[0.5], match=3)) == -2
        assert arm.key(Draft([5], probs=[0.74], match=4)) == -4
        assert arm.key(Draft([5], probs=[0.75], match=4)) == 4
        assert arm.key(Draft([5], match=4)) == 4  # no share counted
        assert arm.key(Draft([5], probs=[0.5], match=0)) == -1
        # a copy is a copy whatever went on after its shorter suffixes
        assert arm.key(Draft([5], probs=[0.5], match=16)) == 16
        assert arm.key(Draft([5], probs=[0.5], match=2, resumed=True)) == 16
        # a twin starts at its bucket's first length, its prior at 0.3 of the bucket's
        assert arm.lengths[-2] == arm.lengths[2]
        assert arm.prior(-4, 0.99, long_copy=True) == pytest.approx(0.3 * 0.9)
        assert arm.prior(-2, 0.5, long_copy=False) == pytest.approx(0.3 * 0.35)
        assert set(arm.rates) == {1, 2, 4, 16, 32, -1, -2, -4}
        # below a copy, a twin too is judged a standard error short of its estimate
        assert arm.estimate(-2, 0.6, long_copy=False, z=1.0) < arm.prior(-2, 0.6, long_copy=False)
    # a bucket of no match at all has no twin (-0 would be itself)
    arm = LookupArm(Recording())
    arm.reset(Timings(dict(FLAT)), AutoTuning(lookup_priors=((0, 0.3), (2, 0.7), (16, 1.0))))
    assert set(arm.rates) == {0, 2, 16, -2}
    assert arm.key(Draft([5], probs=[0.5], match=1)) == 0
    assert arm.prior(0, 0.5, long_copy=False) == pytest.approx(0.3 * 0.5)  # not a twin's
    assert arm.key(Draft([5], probs=[0.5], match=3)) == -2


def test_a_probe_of_a_draft_model_in_step_is_sticky_and_costs_are_at_the_step_s_depth() -> None:
    from specgguf.speculative.arms import ModelArm
    from specgguf.speculative.drafters import ModelDrafter

    # In step (it drafted before, one token behind), nothing measured for long, the target
    # at confidence 0.2: a_pass 0.2, a_acc 0.95, c = 0.19. K=1: its first evaluation
    # 0.002 s, a verification of 1.2 rows in expectation (0.0104): 1.19 / 0.0124 = 95.97
    # tokens/s, below the target alone (100) but above 0.85 of the margin's 105: a probe,
    # as sticky as the model is in step.
    hand = {1: 0.010, 2: 0.012, 4: 0.016, 8: 0.030}
    history = list(range(1, 11))
    model = ModelDrafter(FakeContext(one_hot_rule(target_next, V), V), V)  # type: ignore[arg-type]
    model.prefill(history)
    arm = ModelArm(model, draft_max=16, p_min=0.0)
    t = Timings(dict(hand), 0.002)
    arm.reset(t, AUTO_TUNING)
    arm.steps, arm.idle = 5, 100
    step = Step(history, 1, 16, GREEDY, RNG, t, 9, 0.2, 100.0, AUTO_TUNING)
    offer = arm.offer(step)
    assert offer is not None and (offer.probe, offer.sticky, offer.k) == (True, True, 1)
    assert offer.rate == pytest.approx(1.19 / 0.0124)
    # 1009 positions deep at 1 us per row and position (a lone row: none): 1.2 rows cost
    # 0.010 + 0.2 x (0.012 + 2 x 1009e-6 - 0.010)
    deep = Timings(dict(hand), 0.002, position_row=1e-6)
    arm.reset(deep, AUTO_TUNING)
    arm.steps, arm.idle = 5, 100
    step = Step(history, 1, 16, GREEDY, RNG, deep, 1009, 0.2, 100.0, AUTO_TUNING)
    offer = arm.offer(step)
    cost = 0.002 + 0.010 + 0.2 * (0.012 + 2 * 1009e-6 - 0.010)
    assert offer is not None and offer.rate == pytest.approx(1.19 / cost)


def test_auto_mode_s_defaults_come_from_its_tuning() -> None:
    from specgguf.engine.drafter_map import drafter_kinds

    timings = Timings(dict(FLAT))
    assert AutoPlanner(timings, []).draft_max == AUTO_TUNING.draft_max_lookup == 64
    assert AutoPlanner(timings, [], tuning=tuned(draft_max_lookup=5)).draft_max == 5
    assert AutoPlanner(timings, [], draft_max=7, tuning=tuned(draft_max_lookup=5)).draft_max == 7
    # a long copy's prior weighs the tokens it expects between breaks
    assert AUTO_TUNING.long_copy_weight == pytest.approx(1 / (1 - AUTO_TUNING.long_copy_prior))
    # --drafter's choices, as its error lists them
    assert drafter_kinds() == (
        "auto", "assistant", "dflash", "eagle3", "model", "mtp", "ngram", "suffix", "none",
    )  # fmt: skip


def test_a_match_counts_in_the_longest_bucket_it_reaches() -> None:
    got = [AUTO_TUNING.bucket(m) for m in (0, 1, 2, 3, 4, 15, 16, 31, 32, 100)]
    assert got == [1, 1, 2, 2, 4, 4, 16, 16, 32, 32]
    assert (AUTO_TUNING.lookup_prior(2), AUTO_TUNING.lookup_prior(16)) == (0.7, 1.0)
    # another tuning has its own buckets (nothing cached from the default one)
    other = tuned(lookup_priors=((3, 0.5), (8, 0.9)))
    assert (other.buckets, other.bucket(0), other.bucket(5), other.bucket(9)) == ((3, 8), 3, 3, 8)
    assert other.lookup_prior(8) == 0.9 and AUTO_TUNING.buckets == (1, 2, 4, 16, 32)


# --- the draft model's stopping probability and its acceptance prior (issue 34) ------


def test_the_draft_model_stops_where_its_next_token_costs_more_than_it_is_likely_to_give() -> None:
    from specgguf.speculative.arms import ModelArm

    class Idle:
        name = "model"

        def reset(self) -> None:
            pass

    arm = ModelArm(Idle(), draft_max=16, p_min=0.0)  # type: ignore[arg-type]
    arm.reset(Timings({1: 0.010}, 0.001), AUTO_TUNING)
    assert arm.p_stop == AUTO_TUNING.p_stop  # before any step
    # one row 10 ms; 5 rows (explore_k = 4 drafts) 10.4 ms: a row 0.1 ms
    gpu = Timings({1: 0.010, 5: 0.0104}, 0.003)
    assert arm.p_stop_at(gpu) == pytest.approx((3.0 + 0.1) / 10.0)
    assert arm.p_stop_at(Timings({1: 0.010, 5: 0.0104}, 0.0002)) == pytest.approx(0.1)  # floor
    # a CPU: a draft token 4.1 ms, 5 rows 18.2 ms (a row 2.05 ms): 0.615, capped at 0.5
    assert arm.p_stop_at(Timings({1: 0.010, 5: 0.0182}, 0.0041)) == 0.5
    arm.reset(gpu, tuned(p_stop_cost=0.0))
    assert arm.p_stop_at(gpu) == 0.5  # the rule off
    # --spec-draft-p-min stays a per-token stop beside the path's
    asking = ModelArm(Idle(), draft_max=16, p_min=0.7)  # type: ignore[arg-type]
    asking.reset(gpu, AUTO_TUNING)
    assert asking.p_stop_at(gpu) == pytest.approx(0.31) and asking.p_min == 0.7


def test_the_draft_model_arm_drafts_with_the_users_p_min_and_its_own_path_stop() -> None:
    from specgguf.speculative.arms import ModelArm

    seen: list[tuple[float, float]] = []

    class Asked:
        name = "model"

        def reset(self) -> None:
            pass

        def propose(self, history, k, sampler, rng, *, p_min=0.0, p_path_min=0.0):  # type: ignore[no-untyped-def]
            seen.append((p_min, p_path_min))
            return Draft([1] * k)

    gpu = Timings({1: 0.010, 5: 0.0104}, 0.003)
    arm = ModelArm(Asked(), draft_max=16, p_min=0.7)  # type: ignore[arg-type]
    arm.reset(gpu, AUTO_TUNING)
    step = Step([1, 2], 1, 8, GREEDY, RNG, gpu, 1, 0.9, 100.0, AUTO_TUNING)
    assert arm.draft(Offer(arm, 4, 1.0), step).tokens == [1] * 4  # type: ignore[arg-type]
    assert seen == [(0.7, pytest.approx(0.31))] and arm.p_stop == pytest.approx(0.31)
    # the rule before the path (p_stop_path False): one per-token stop, the higher of both
    for p_min, want in ((0.7, 0.7), (0.0, 0.31)):
        seen.clear()
        arm = ModelArm(Asked(), draft_max=16, p_min=p_min)  # type: ignore[arg-type]
        arm.reset(gpu, tuned(p_stop_path=False))
        arm.draft(Offer(arm, 4, 1.0), step)  # type: ignore[arg-type]
        assert seen == [(pytest.approx(want), 0.0)]


def test_a_draft_models_acceptance_falls_below_what_a_fixed_prior_allows() -> None:
    from specgguf.speculative.estimates import Acceptance

    fixed = Acceptance.of(tuned(prior_floor=1.0), 0.95)
    fading = Acceptance.fading(tuned(prior_floor=0.1), 0.95)
    for _ in range(200):
        for a in (fixed, fading):
            a.tick()
            a.observe(0, True)
    # counts saturate at 1 / (1 - 0.97 * 0.9) = 7.87 trials with no success: a prior of
    # 2 trials keeps 0.95 * 2 / 9.87 = 0.192; one faded to 0.2 trials, 0.024
    assert fixed.rate == pytest.approx(0.95 * 2 / (2 + 1 / (1 - 0.97 * 0.9)), rel=1e-3)
    assert fading.rate == pytest.approx(0.95 * 0.2 / (0.2 + 1 / (1 - 0.97 * 0.9)), rel=1e-3)
    # before any verification, both are the prior
    assert Acceptance.fading(AUTO_TUNING, 0.95).rate == pytest.approx(0.95)
    # and a standard error counts the weight the prior has now
    assert (fixed.prior_weight, fading.prior_weight) == (2.0, pytest.approx(0.2))
