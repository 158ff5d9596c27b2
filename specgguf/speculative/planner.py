"""Planners choose the drafter and the draft of every step: :class:`FixedPlanner` one
drafter at a fixed draft length (``--drafter NAME --draft K``), :class:`AutoPlanner` auto
mode, the fastest of its arms (:mod:`specgguf.speculative.arms`) by the cost model
(:mod:`specgguf.speculative.costmodel`), or the target alone.

Auto mode's rule, at every step: each arm offers its best draft for the step (its own
acceptance estimates and cost per drafted token, on the shared cost model); an offer is
admitted when its expected rate beats the target alone's by ``margin`` (an arm in step,
whose leaving costs a catch-up: at all; a probe: always); of those admitted, the fastest is
taken, an arm in step counting ``switch_margin`` times its rate, and ties going to the
arm listed first. Every number of the rule is a field of
:class:`~specgguf.speculative.tuning.AutoTuning`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from specgguf.speculative.arms.base import Arm, Offer, Step, StepPlan
from specgguf.speculative.costmodel import Timings
from specgguf.speculative.draft import Draft, Drafter, TreeDrafter
from specgguf.speculative.sampling import SamplerParams
from specgguf.speculative.tuning import AUTO_TUNING, AutoTuning

__all__ = ["AutoPlanner", "FixedPlanner", "Planner", "StepPlan"]

#: A step without drafts, whose rate a fixed drafter does not estimate.
_ALONE = StepPlan(None, Draft([]), math.nan)


class Planner(Protocol):
    """Chooses the drafter and the draft of each step for one generation.

    ``draft_max``: the largest draft length it proposes (the loop clamps it further to the
    room left); ``drafters``: the drafters it may use (the loop lets them read the prompt
    ahead and sums their time); ``wants_confidence``: whether :meth:`observe` needs the
    target's top-1 probability (costs a softmax per step); ``pass_steps()``: the steps it
    lets pass now as the target's alone without being asked (0: none), which the loop runs
    as such, neither planned nor observed.
    """

    draft_max: int
    drafters: list[Drafter]
    wants_confidence: bool

    def reset(self) -> None: ...

    def prefill(self, history: Sequence[int]) -> None:
        """Let the drafters read the prompt ``history`` ahead of the first step (each as
        this planner will use it: :meth:`Drafter.prefill` or :meth:`Drafter.defer`)."""

    def plan(
        self, history: Sequence[int], k_max: int, sampler: SamplerParams, rng: np.random.Generator
    ) -> StepPlan: ...

    def pass_steps(self) -> int: ...

    def observe(
        self,
        plan: StepPlan,
        accepted: int,
        verify_seconds: float,
        confidence: float | None = None,
        *,
        rows: int | None = None,
    ) -> None:
        """Learn from a verification of ``plan``: ``accepted`` drafts, in
        ``verify_seconds`` over ``rows`` target rows (None: all, the drafts and the last
        token; fewer when deterministic mode's verification stopped at a rejection)."""


class FixedPlanner:
    """One drafter (or none: the target alone) with a fixed draft length K (``--draft K``)
    and, for a draft model, the probability below which drafting stops (``p_min``).

    A draft shorter than ``draft_min`` tokens is not verified: the step runs without
    drafts, as llama.cpp's ``--spec-draft-n-min`` does (tools/server: a step whose room
    for drafts is below n_min does not draft; a shorter draft is ignored).

    With ``tree_branches`` of 2 or more and a drafter that proposes trees
    (:class:`~specgguf.speculative.draft.TreeDrafter`: the suffix drafter), greedy steps
    verify a token tree of up to K nodes and that many leaves instead of a chain (sampled
    steps draft chains)."""

    wants_confidence = False

    def __init__(
        self,
        drafter: Drafter | None,
        draft_max: int,
        *,
        p_min: float = 0.0,
        draft_min: int = 0,
        tree_branches: int = 0,
    ) -> None:
        self.drafter = drafter
        self.draft_max = draft_max if drafter is not None else 0
        self.p_min = p_min
        self.draft_min = draft_min
        self.drafters = [drafter] if drafter else []
        self.trees = drafter if isinstance(drafter, TreeDrafter) and tree_branches >= 2 else None
        self.tree_branches = tree_branches if self.trees is not None else 0

    def reset(self) -> None:
        if self.drafter:
            self.drafter.reset()

    def prefill(self, history: Sequence[int]) -> None:
        """The drafter drafts at every step: it reads the prompt now."""
        if self.drafter:
            self.drafter.prefill(history)

    def pass_steps(self) -> int:
        return 0

    def plan(
        self, history: Sequence[int], k_max: int, sampler: SamplerParams, rng: np.random.Generator
    ) -> StepPlan:
        if self.drafter is None or k_max <= 0 or k_max < self.draft_min:
            return _ALONE
        if self.trees is not None and sampler.greedy:
            draft = self.trees.propose_tree(
                history, k_max, self.tree_branches, wanted=None, branch=0
            )
        else:
            draft = self.drafter.propose(history, k_max, sampler, rng, p_min=self.p_min)
        if len(draft.tokens) < self.draft_min:
            return _ALONE
        return StepPlan(self.drafter, draft, math.nan)

    def observe(
        self,
        plan: StepPlan,
        accepted: int,
        verify_seconds: float,
        confidence: float | None = None,
        *,
        rows: int | None = None,
    ) -> None:
        pass


class AutoPlanner:
    """Auto mode: at every step, the fastest of its arms' offers, or the target alone (the
    rule in the module's docstring).

    Acceptance is estimated by each arm from recent verifications, blended with the
    target's recent confidence (the mean top-1 probability of the tokens it produced,
    which needs no draft evaluation and tracks acceptance closely).

    Args:
        timings: calibrated timings (refined online unless ``learn_timings`` is False, or
            while other sequences run beside this one: ``timings.solo`` False, when a
            step's time is not its own).
        arms: the drafters as auto mode weighs them, in the order ties are broken (the
            engine's are built from :data:`specgguf.engine.drafter_map.DRAFTERS`).
        draft_max: the largest draft length of any arm (default: the tuning's
            ``draft_max_lookup``).
        draft_min: drafts shorter than this are neither planned nor verified (as
            :class:`FixedPlanner`); 0 or 1: no minimum.
        tuning: every tuning number (:class:`~specgguf.speculative.tuning.AutoTuning`).
    """

    wants_confidence = True

    def __init__(
        self,
        timings: Timings,
        arms: Sequence[Arm],
        *,
        draft_max: int | None = None,
        draft_min: int = 0,
        learn_timings: bool = True,
        tuning: AutoTuning = AUTO_TUNING,
    ) -> None:
        self.timings = timings
        self.arms = list(arms)
        self.draft_max = tuning.draft_max_lookup if draft_max is None else draft_max
        self.draft_min = max(1, draft_min)
        self.learn_timings = learn_timings
        self.tuning = tuning
        #: the positions cached at the step last planned
        self.cached = 0
        #: seconds of Python asking the arms costs a step (None: measured, a moving
        #: average over the steps whose offers all came to nothing, whose time is the
        #: arms' Python alone, or where the steps are timed (``_time_steps``) and more,
        #: such a step's whole time less a step let pass; a number: taken as it is, as
        #: the simulator gives it)
        self.plan_cost: float | None = None
        self._measured_cost, self._n_costs = 0.0, 0
        #: the same by the clock (``tuning.ask_by_clock``): a step asked in vain less a
        #: step let pass, its general step and the drafters' catching up included; a
        #: moving average as ``_measured_cost``'s
        self._ask_cost, self._n_asks = 0.0, 0
        #: the clock the drafted steps are checked by (``tuning.check_steps``): seconds,
        #: monotonic; the simulator gives its own
        self.clock: Callable[[], float] = time.perf_counter
        self.reset()

    def arm(self, name: str) -> Arm:
        """The arm of the drafter called ``name``.

        Raises:
            KeyError: no such arm.
        """
        for arm in self.arms:
            if arm.name == name:
                return arm
        raise KeyError(f"no {name!r} arm: {', '.join(a.name for a in self.arms) or 'none'}")

    def reset(self) -> None:
        """A new generation: every estimate at its prior, and the arms that can pay on the
        timings as they are now."""
        self.confidence = self.tuning.confidence_start
        self._n_confidence = 0
        #: whether the latest step was let pass as the target's alone without asking the
        #: arms (:meth:`plan`); its verification reads no confidence
        self.skipped = False
        self.wants_confidence = True
        self._idle = 0  # steps asked in a row whose offers all came to nothing
        self._resume = 0  # the run of them a draft ended (see _idle_step)
        self._skip = 0  # steps still to let pass
        # The clock's check of the steps that drafted (tuning.check_steps, _time_steps):
        self._lean = False  # the loop runs the steps let pass (pass_steps): the check's on
        self._mark: float | None = None  # when the steps being timed began (None: none)
        self._passed = 0  # of them, steps let pass
        self._asked = False  # or a step asked its arms
        # the tokens the cost model expected of the draft it took (0: none taken; None: a
        # probe's, or not verified), and the seconds of the step it did not weigh (a draft
        # model's reading of the prompt, and its catch-up past its own draft's rows)
        self._expected: float | None = 0.0
        self._unweighed = 0.0
        self._probe = False
        self._lone_row = self.timings.verify_time(1, self.cached)
        # the asked steps' average gain over the target alone (seconds a step) and the
        # steps let pass's seconds a token (None: none timed; a lone row stands in)
        self._net, self._n_net = 0.0, 0
        self._lone_token: float | None = None
        self._n_lone = 0
        self._losses = 0  # drafted steps in a row judged while that average was below 0
        self.active = [arm for arm in self.arms if arm.reset(self.timings, self.tuning)]
        self.drafters: list[Drafter] = [arm.drafter for arm in self.active]

    def prefill(self, history: Sequence[int]) -> None:
        """Its arms may never draft: a draft model reads the prompt at its first draft
        (:meth:`Drafter.defer`), so that a generation where it does not pay starts as fast
        as the target alone; its offers weigh the prompt as read, as when it was."""
        for drafter in self.drafters:
            drafter.defer(history)

    def plan(
        self, history: Sequence[int], k_max: int, sampler: SamplerParams, rng: np.random.Generator
    ) -> StepPlan:
        self.cached = len(history) - 1  # the last token is evaluated with the drafts
        self._time_steps()
        if self._skip > 0:  # (see _idle_step)
            self._skip -= 1
            self._passed = 1
            self.skipped, self.wants_confidence = True, False
            return _ALONE
        self.skipped, self.wants_confidence = False, True
        self._asked, self._expected = True, 0.0
        # Whether this step is judged, decided once: a draft model's evaluation can let
        # other sequences run and end (serve --parallel), and timings.solo change with it.
        checking = self._checking()
        # (each drafter's reading of the prompt and drafting so far: see _time_steps)
        before = [(d.prompt_seconds, d.seconds) for d in self.drafters] if checking else []
        t0 = time.perf_counter()
        for arm in self.arms:
            arm.tick()
        lone_row = self._lone_row = self.timings.verify_time(1, self.cached)
        alone = StepPlan(None, Draft([]), 1.0 / lone_row)
        if k_max < self.draft_min:
            return alone
        step = Step(history, self.draft_min, k_max, sampler, rng, self.timings, self.cached,
                    self.confidence, 1.0 / lone_row, self.tuning)  # fmt: skip
        offers = [offer for arm in self.active if (offer := arm.offer(step)) is not None]
        taken = self._choose(offers, step)
        for arm in self.active:
            arm.settle(step, taken)
        if taken is None:  # (the arms' Python alone: nothing drafted, nothing evaluated)
            self._idle_step(time.perf_counter() - t0, lone_row)
            return alone
        draft = taken.arm.draft(taken, step)
        if len(draft.tokens) < step.k_min:
            # (not judged: its time may hold a draft model's prompt or catch-up, which the
            # cost model weighs over the steps it drafts)
            self._expected = None
            self._idle_step(None, lone_row)
            return alone
        self._resume, self._idle = max(self._resume, self._idle), 0
        if checking:
            reads = [d.prompt_seconds - b[0] for d, b in zip(self.drafters, before, strict=True)]
            rows = len(draft.tokens) * draft.token_seconds  # (0 for lookups)
            i = next(j for j, arm in enumerate(self.active) if arm is taken.arm)
            caught_up = self.drafters[i].seconds - before[i][1] - reads[i] - rows
            self._unweighed = sum(reads) + (max(0.0, caught_up) if rows > 0 else 0.0)
            self._expected = None  # (set by observe, from the verification's seconds)
            self._probe = taken.probe
        return StepPlan(taken.arm.drafter, draft, taken.rate, taken.arm, taken.bucket)

    def pass_steps(self) -> int:
        """The steps still to let pass (see :meth:`_idle_step`), now the loop's to run."""
        self._lean = True
        self._time_steps()
        n, self._skip = self._skip, 0
        self._passed = n
        return n

    def _checking(self) -> bool:
        """Whether the drafted steps are checked by the clock: ``tuning.check_steps``; the
        steps' time is this sequence's own (``timings.solo``); and the loop runs the steps
        let pass (it asks :meth:`pass_steps`: not under a grammar, whose forced steps
        neither plan nor observe, nor in deterministic mode, whose verification stops at a
        rejection)."""
        return self.tuning.check_steps and self.timings.solo and self._lean

    def _time_steps(self) -> None:
        """End the timing of the steps since the last call (``tuning.check_steps``): steps
        let pass refine the seconds a token of the target alone; a step that asked the
        arms refines the asked steps' average gain: the tokens the cost model expected of
        it (its rate times the draft's and the verification's seconds; 1 where nothing was
        drafted) at the target alone's seconds a token, less the step's own seconds by
        the clock (the arms', the draft's, the verification's and the loop's: all of it,
        Python included, which the cost model does not weigh). Expected tokens, not the
        tokens kept: a few rejected long drafts would outweigh the copies that pay. While
        the average is below 0, each drafted step lets the next steps pass on a ramp of
        its own (as :meth:`_idle_step`'s: 1, 2, 4, ... for such steps in a row), and one
        at or above it ends the ramp; a step asked in vain is judged by
        :meth:`_idle_step`'s budget as it is, and a probe (taken to measure its arm) is
        not judged. A draft model's reading of the prompt and its catch-up past its
        draft's own rows are left out of the step's seconds: the cost model weighs the
        prompt as read, and a catch-up spread over the steps the draft model stays in
        step."""
        if not self._checking():
            self._mark = None  # (an interval begun before, beside other sequences: not timed)
            return
        now = self.clock()
        mark, passed, asked, expected = self._mark, self._passed, self._asked, self._expected
        self._mark, self._passed, self._asked, self._expected = now, 0, False, 0.0
        unweighed, self._unweighed = self._unweighed, 0.0
        if mark is None or not (passed or asked):
            return
        w_min, seconds = self.tuning.plan_cost_weight, now - mark - unweighed
        if passed:
            self._n_lone += 1
            per = seconds / passed
            w = max(w_min, 1.0 / self._n_lone)
            lone = per if self._lone_token is None else self._lone_token
            self._lone_token = lone + w * (per - lone)
            return
        if expected is None:  # a probe
            return
        lone = self._lone_row if self._lone_token is None else self._lone_token
        if not expected and self.tuning.ask_by_clock:
            # a step asked in vain: what it took beyond a step let pass is asking's cost
            # (not clipped at 0: the average of a slow target's noise is then 0)
            self._n_asks += 1
            w = max(w_min, 1.0 / self._n_asks)
            self._ask_cost += w * (seconds - lone - self._ask_cost)
        self._n_net += 1
        w = max(w_min, 1.0 / self._n_net)
        self._net += w * (max(1.0, expected) * lone - seconds - self._net)
        if not expected:
            return
        if self._net < 0.0:
            self._losses += 1
            self._skip = _ramp(self._losses, self.tuning.plan_skip_max)
        else:
            self._losses = 0

    def _idle_step(self, seconds: float | None, lone_row: float) -> None:
        """A step was asked in vain, its offers' Python taking ``seconds`` (None: a draft
        was made and came out too short; not a measure of asking): let the next steps
        pass without asking while asking (:attr:`plan_cost`; None: the average of those
        seconds, or the clock's if larger, ``ask_by_clock``) would cost more than
        ``plan_budget`` of the target alone's steps (``lone_row`` seconds each), twice as
        many for each step in a row asked in vain (1, 2, 4, ...), at most
        ``plan_skip_max``."""
        t = self.tuning
        if self.plan_cost is None and seconds is not None:
            self._n_costs += 1  # a running mean at first, then a moving average
            w = max(t.plan_cost_weight, 1.0 / self._n_costs)
            self._measured_cost += w * (seconds - self._measured_cost)
        cost = (
            max(self._measured_cost, self._ask_cost) if self.plan_cost is None else self.plan_cost
        )
        # After a draft, a vain ask goes on from halfway up the ramp the draft ended: the
        # copy that drafted is over, and what asking costs has not changed.
        self._idle = max(self._idle + 1, self._resume - 1)
        self._resume = 0
        budget = t.plan_budget * lone_row
        if t.plan_budget > 0 and cost > budget:
            # asking once in n + 1 steps costs cost / (n + 1) a step
            ratio = cost / budget if budget > 0 else math.inf
            wanted = math.ceil(ratio) - 1 if ratio <= t.plan_skip_max else t.plan_skip_max
            self._skip = min(wanted, _ramp(self._idle, t.plan_skip_max))

    def _choose(self, offers: Sequence[Offer], step: Step) -> Offer | None:
        """The offer taken (see the module): admitted, and the fastest, an arm in step
        counting ``switch_margin`` times its rate; ties to the first."""
        taken, score = None, 0.0
        for offer in offers:
            if not (offer.probe or (offer.k > 0 and step.admits(offer.rate, offer.sticky))):
                continue
            s = offer.rate * (self.tuning.switch_margin if offer.sticky else 1.0)
            if taken is None or s > score:
                taken, score = offer, s
        return taken

    def observe(
        self,
        plan: StepPlan,
        accepted: int,
        verify_seconds: float,
        confidence: float | None = None,
        *,
        rows: int | None = None,
    ) -> None:
        """Learn from a verification: the target's confidence (top-1 probability of its
        last token), the timings (only from a verification of all ``n + 1`` rows: ``rows``
        fewer is one deterministic mode stopped early), and the acceptance of the arm that
        drafted (a token rejected when fewer were accepted than the draft's depth)."""
        t, n = self.tuning, len(plan.draft.tokens)
        if confidence is not None:
            # A running mean over the first steps, then a moving average.
            self._n_confidence += 1
            w = max(t.confidence_weight, 1.0 / self._n_confidence)
            self.confidence += w * (confidence - self.confidence)
        learn = self.learn_timings and self.timings.solo
        if learn and (rows is None or rows == n + 1):
            self.timings.observe_verify(n + 1, verify_seconds, self.cached,
                                        weight=t.timing_weight, clamp=t.timing_clamp)  # fmt: skip
        if plan.arm is None or not n:
            return
        if self._checking() and not self._probe:
            draft_s = plan.draft.token_seconds * n
            self._expected = max(1.0, plan.expected_rate * (verify_seconds + draft_s))
        plan.arm.observe(plan, accepted, accepted < plan.draft.depth)
        if learn and plan.draft.token_seconds > 0:
            self.timings.observe_draft(plan.draft.token_seconds, weight=t.timing_weight)


def _ramp(idle: int, most: int) -> int:
    """The steps let pass after ``idle`` (at least 1) steps in a row asked in vain: 1, 2,
    4, ..., at most ``most`` (doubling, so that asking that costs many steps' worth is
    soon asked rarely enough)."""
    return most if idle > most.bit_length() else min(1 << (idle - 1), most)
