"""Auto mode's arms and rule, verification and acceptance, and the tuning object: a drafter
added in a test alone (one class and one entry in the engine's name -> factory map) is
weighed by auto mode like the built-in ones; the planner's choice between offers by hand;
the acceptance rules by hand; every tuning number named and documented in one place."""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Sequence

import numpy as np
import pytest

from specgguf.engine import drafter_map
from specgguf.engine.drafter_map import DRAFTERS, Drafting, DraftSettings, make_planner
from specgguf.errors import UsageError
from specgguf.speculative.arms import ChainArm, Offer, Step
from specgguf.speculative.costmodel import Timings
from specgguf.speculative.draft import Draft, Drafter
from specgguf.speculative.drafters import SuffixDrafter
from specgguf.speculative.loop import GenerationParams, SpeculativeDecoder
from specgguf.speculative.planner import AutoPlanner, FixedPlanner
from specgguf.speculative.sampling import SamplerParams
from specgguf.speculative.tuning import AUTO_TUNING, AutoTuning
from specgguf.speculative.verification import accept, verifiable

from .fakes import FakeContext, FakeVocab, one_hot_rule
from .helpers import ROOT

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


def generate_with_walk(
    monkeypatch: pytest.MonkeyPatch, offset: int, verify: dict[int, float], n: int = 60
) -> tuple[list[int], dict[str, list[int]]]:
    """Auto mode, as the engine builds it from the map, with the walk drafter registered
    in the test: the output and the steps, drafted and accepted tokens per drafter."""
    monkeypatch.setitem(DRAFTERS, "walk", lambda d, s: ChainArm(WalkDrafter(offset)))
    drafting = Drafting(None, (2, 8), SuffixDrafter(), lambda det: Timings(dict(verify)))
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
    drafting = Drafting(None, (2, 8), SuffixDrafter(), lambda det: Timings(dict(FLAT)))
    fixed = make_planner("walk", drafting, DraftSettings(draft_max=3))
    assert isinstance(fixed, FixedPlanner) and fixed.plan([1], 3, GREEDY, RNG).draft.tokens == [
        2, 3, 4,
    ]  # fmt: skip
    assert "walk" in drafter_map.drafter_kinds()


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


# --- the tuning -----------------------------------------------------------------------


def test_every_tuning_number_is_a_documented_field() -> None:
    """Each field of AutoTuning has a comment above it that says where its value came
    from (a measurement, or "no measurement recorded") and what values it has had ("was",
    "only value", or the values compared)."""
    source = (ROOT / "specgguf" / "speculative" / "tuning.py").read_text()
    lines = source.splitlines()
    names = [f.name for f in dataclasses.fields(AutoTuning)]
    assert len(names) >= 30
    for name in names:
        at = next(i for i, ln in enumerate(lines) if re.match(rf"    {name}: ", ln))
        doc = []
        i = at - 1
        while lines[i].startswith("    #:"):  # its own comment, right above it
            doc.insert(0, lines[i])
            i -= 1
        text = " ".join(doc).lower()
        assert text, f"{name} has no comment"
        assert re.search(r"measur|reason|not measured|\(epyc|xeon|\bqwen", text), name
        assert re.search(r"\bwas\b|only value|tried|never changed|against|unchanged", text), name


#: The numbers the arms and the planner may write as literals: structure, not tuning (a
#: count of 0 or 1, a tree of 2 branches, a lone row and its throw-away row).
STRUCTURAL = {0, 1, 2, -1}


def test_no_tuning_number_is_written_into_the_planner_or_the_arms() -> None:
    code = [ROOT / "specgguf" / "speculative" / "planner.py",
            *sorted((ROOT / "specgguf" / "speculative" / "arms").glob("*.py"))]  # fmt: skip
    found = []
    for path in code:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, int | float)
                and not isinstance(node.value, bool)
                and node.value not in STRUCTURAL
            ):
                found.append((path.name, node.lineno, node.value))
    assert found == []


def test_an_unknown_drafter_is_refused_with_the_names_there_are() -> None:
    drafting = Drafting(None, (2, 8), SuffixDrafter(), lambda det: Timings({1: 0.01}))
    with pytest.raises(UsageError, match="auto, ngram, suffix, model, none, not 'walk'"):
        make_planner("walk", drafting, DraftSettings(draft_max=4))
    with pytest.raises(UsageError, match="the model drafter needs a draft model"):
        make_planner("model", drafting, DraftSettings(draft_max=4))
