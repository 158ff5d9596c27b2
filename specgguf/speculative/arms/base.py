"""What an arm of auto mode is (:class:`Arm`), what it sees at a step (:class:`Step`), what
it offers (:class:`Offer`), and what the planner decides (:class:`StepPlan`); and
:class:`ChainArm`, the arm of any drafter that brings no estimates of its own.

Auto mode treats each drafter as an arm of a bandit: at every step each arm offers its best
draft by the shared cost model (:mod:`specgguf.speculative.costmodel`), weighed with its own
acceptance estimates and its own cost per drafted token; the planner takes the fastest
offer that beats the target alone (:class:`specgguf.speculative.planner.AutoPlanner`), and
the verification teaches the arm that drafted.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from specgguf.speculative.costmodel import Timings, best_k, row_share
from specgguf.speculative.draft import Draft, Drafter
from specgguf.speculative.estimates import Acceptance
from specgguf.speculative.sampling import SamplerParams
from specgguf.speculative.tuning import AutoTuning


@dataclasses.dataclass(frozen=True)
class Step:
    """What every arm sees when it offers a draft for one step.

    Args:
        history: the prompt and the committed output (ids).
        k_min, k_max: the shortest draft worth verifying and the longest that fits.
        sampler, rng: the generation's sampling (drafts are greedy when it is).
        timings: the pair's timings (the shared cost model reads them at ``cached``).
        cached: positions cached before the step's first row (the last committed token is
            evaluated with the drafts).
        confidence: the target's recent top-1 probability, the prior of acceptance.
        base_rate: tokens/s of the target alone at this step.
        tuning: auto mode's tuning.
    """

    history: Sequence[int]
    k_min: int
    k_max: int
    sampler: SamplerParams
    rng: np.random.Generator
    timings: Timings
    cached: int
    confidence: float
    base_rate: float
    tuning: AutoTuning

    @property
    def threshold(self) -> float:
        """The rate (tokens/s) an offer must beat: the target alone's times the margin."""
        return self.base_rate * self.tuning.margin

    @functools.cached_property
    def explore_share(self) -> float:
        """:func:`~specgguf.speculative.costmodel.row_share` of ``tuning.explore_k`` rows
        at this step's depth (each lookup arm reads it: computed once a step)."""
        return row_share(self.timings, self.tuning.explore_k, self.cached)

    def admits(self, rate: float, sticky: bool) -> bool:
        """Whether an offer at ``rate`` is worth taking: above :attr:`threshold`, or for an
        arm in step (``sticky``: leaving it costs a catch-up) above the target alone."""
        return rate > (self.base_rate if sticky else self.threshold)


@dataclasses.dataclass
class Offer:
    """An arm's best draft at a step.

    Args:
        arm: who offers it.
        k: its length (a tree: its nodes; 0: nothing pays).
        rate: the tokens/s the cost model expects of it.
        draft: the draft, when the arm made it to offer it (lookups); None: the arm drafts
            only when taken (:meth:`Arm.draft`: a model's tokens cost evaluations).
        bucket: which of the arm's acceptance estimates judged it (a lookup's
            :meth:`~specgguf.speculative.arms.LookupArm.key`: its match's bucket, or minus
            it for the twin of matches that went on differently; 0 for an arm with one).
        sticky: the arm is in step: the offer is admitted above the target alone, and
            others must beat it by the switch margin.
        probe: take it even below the threshold, to measure the arm.
    """

    arm: Arm
    k: int
    rate: float
    draft: Draft | None = None
    bucket: int = 0
    sticky: bool = False
    probe: bool = False


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What a step does: verify ``draft`` from ``drafter`` (None: the target alone), and
    the rate the cost model expects (tokens/s; NaN for a fixed drafter). In auto mode
    ``arm`` is the arm that offered it and ``bucket`` the estimate that judged it."""

    drafter: Drafter | None
    draft: Draft
    expected_rate: float
    arm: Arm | None = None
    bucket: int = 0


class Arm(Protocol):
    """A drafter as auto mode weighs it.

    ``drafter`` is what proposes (the loop lets it read the prompt and counts its time);
    ``name`` is its drafter's. Each generation starts with :meth:`reset`; each step calls
    :meth:`tick` on every arm, then :meth:`offer` and :meth:`settle` on those reset
    accepted, :meth:`draft` on the one taken, and after the verification :meth:`observe`
    on it.
    """

    @property
    def name(self) -> str: ...

    @property
    def drafter(self) -> Drafter: ...

    def reset(self, timings: Timings, tuning: AutoTuning) -> bool:
        """A new generation: estimates back to their priors. Returns whether the arm can
        pay at all on these timings (an arm that cannot sits the generation out)."""
        ...

    def tick(self) -> None:
        """A step passed: fade the estimates (drafted or not)."""
        ...

    def offer(self, step: Step) -> Offer | None:
        """The best draft this arm has for the step, by its estimates and the cost model;
        None when it has nothing (or nothing worth taking)."""
        ...

    def settle(self, step: Step, taken: Offer | None) -> None:
        """The planner took ``taken`` (None: the target alone): bookkeeping that depends on
        whether it was this arm's (a draft model's run of steps, a lookup's shadow)."""
        ...

    def draft(self, offer: Offer, step: Step) -> Draft:
        """The draft to verify for ``offer``, taken (shorter than ``step.k_min``: none)."""
        ...

    def observe(self, plan: StepPlan, accepted: int, rejected: bool) -> None:
        """The verification of ``plan`` kept ``accepted`` draft tokens, and ``rejected``
        says whether a token was rejected (False: the draft was accepted to its end)."""
        ...


class ChainArm:
    """The arm of a drafter that brings no estimates of its own: it proposes at every step
    (its proposal must cost little, or be needed to know what it offers: a lookup, tokens
    a grammar forces), is judged by one acceptance estimate whose prior is the target's
    confidence, and pays ``token_cost`` seconds per drafted token. A drafter whose tokens
    cost model evaluations needs an arm that drafts only once taken, as
    :class:`~specgguf.speculative.arms.model.ModelArm` does.
    """

    def __init__(self, drafter: Drafter, *, token_cost: float = 0.0) -> None:
        self.drafter = drafter
        self.name = drafter.name
        self.token_cost = token_cost
        self.acceptance: Acceptance  # made by reset, at the tuning's values

    def reset(self, timings: Timings, tuning: AutoTuning) -> bool:
        self.drafter.reset()
        self.acceptance = Acceptance.of(tuning)
        return True

    def tick(self) -> None:
        self.acceptance.tick()

    def offer(self, step: Step) -> Offer | None:
        cand = self.drafter.propose(step.history, step.k_max, step.sampler, step.rng)
        if len(cand.tokens) < step.k_min:
            return None
        a = self.acceptance.rate_with(step.confidence)
        k, rate = best_k(a, step.timings, len(cand.tokens), cached=step.cached,
                         draft_cost=self.token_cost, k_min=step.k_min,
                         greedy=step.sampler.greedy)  # fmt: skip
        return Offer(self, k, rate, cand.head(k))

    def settle(self, step: Step, taken: Offer | None) -> None:
        pass

    def draft(self, offer: Offer, step: Step) -> Draft:
        assert offer.draft is not None
        return offer.draft

    def observe(self, plan: StepPlan, accepted: int, rejected: bool) -> None:
        self.acceptance.observe(accepted, rejected)
