"""The arm of the draft model: drafts that cost a forward pass per token, made only when
taken, judged by two rates, with the cost of catching up after idle steps."""

from __future__ import annotations

from specgguf.speculative.arms.base import Offer, Step, StepPlan
from specgguf.speculative.costmodel import Timings, best_k, expected_tokens, verify_time_at
from specgguf.speculative.draft import Draft
from specgguf.speculative.drafters.model import ModelDrafter
from specgguf.speculative.drafters.mtp import MtpDrafter
from specgguf.speculative.estimates import Acceptance, upper
from specgguf.speculative.tuning import AUTO_TUNING, AutoTuning


class ModelArm:
    """A draft model, or the target's MTP layers, as auto mode weighs it: both cost an
    evaluation per draft token (``Timings.draft``) and stop where the draft grows unsure.

    The draft model drafts greedily until its path probability falls below ``p_stop``
    (:meth:`p_stop_at`) or it gives a token less than ``p_min`` (llama.cpp's
    ``--spec-draft-p-min``), so two rates describe it: how often drafting goes on past a
    token (prior: the target's confidence) and how often a token it went on past is
    accepted (prior: ``model_prior``); E(K) uses their product, and the cost of a step the
    expected number of draft evaluations and verified tokens.

    Its state matters: a model that has been idle must first evaluate the tokens it missed
    (that cost is spread over the steps it is expected to stay in use, at most
    ``catch_up_horizon``), so a model in step is judged generously: optimistically (one
    standard error, drafts of at most ``explore_k``) in its first ``explore_steps`` steps
    of a generation, and in step (a sticky offer: kept while it beats the target alone,
    replaced only by an arm ``switch_margin`` times faster) once it has drafted and is at
    most ``near_sync`` tokens behind. When an idle model's estimate falls just short
    (``probe_share`` of the threshold) and nothing recent was measured, a short draft
    measures it (a probe, at most every ``probe_every`` steps).

    Args:
        drafter: the draft model's drafter, or the MTP layers'.
        draft_max: its longest draft.
        p_min: it stops at a token it gives less than this (per token, beside the path's
            ``p_stop``).
    """

    def __init__(self, drafter: ModelDrafter | MtpDrafter, *, draft_max: int, p_min: float) -> None:
        self.drafter = drafter
        self.name = drafter.name
        self.draft_max = draft_max
        self.p_min = p_min
        self._fresh(AUTO_TUNING)

    def reset(self, timings: Timings, tuning: AutoTuning) -> bool:
        """Also: whether the model could be faster than the target alone on these timings
        at all, where batches are cheapest (the calibration's depth): some draft length up
        to ``draft_max`` beats the target alone by the margin even if every draft token
        were accepted. Where it cannot (a draft token that costs most of a target step,
        batches that cost nearly their rows: 0.6 and 1.5x on a 2-core AMD EPYC), the
        model neither reads the prompt nor drafts."""
        self.drafter.reset()
        self._fresh(tuning)
        _, rate = best_k(1.0, timings, self.draft_max)
        return rate > tuning.margin / timings.verify_time(1)

    def _fresh(self, tuning: AutoTuning) -> None:
        t = self.tuning = tuning
        # how often a token drafting went on past is accepted, and how often it goes on
        self.accepted = Acceptance.fading(t, t.model_prior)
        self._p_stop = t.p_stop
        self.passed = Acceptance.of(t)
        self.steps = 0  # steps it drafted in this generation
        self.idle = 0  # steps since it last drafted
        # consecutive steps it drafted, now and on average: a catch-up is paid back only
        # over the steps the model stays in use
        self.streak = 0
        self.mean_streak = t.streak_start

    def tick(self) -> None:
        self.accepted.tick()
        self.passed.tick()

    def offer(self, step: Step) -> Offer | None:
        t, history = self.tuning, step.history
        a_acc = self.accepted.rate
        a_pass = self.passed.rate_with(step.confidence)
        near = len(history) - self.drafter.cached_tokens(history) <= t.near_sync
        k_top = min(step.k_max, self.draft_max)
        if near and self.steps < t.explore_steps:
            # Little evidence yet: judged by an upper bound, so that one early rejection,
            # or a misleading confidence, does not rule out a draft model that pays.
            a_acc = upper(a_acc, self.accepted.trials, self.accepted.prior_weight)
            a_pass = upper(a_pass, self.passed.trials, self.passed.prior_weight)
            k_top = min(k_top, max(t.explore_k, step.k_min))
        k, rate = self._best(a_acc, a_pass, k_top, step)
        self.idle += 1
        sticky = near and self.steps > 0
        if step.admits(rate, sticky):
            return Offer(self, k, rate, sticky=sticky)
        if (
            rate > t.probe_share * step.threshold
            and self.accepted.trials < t.probe_trials
            and self.idle >= t.probe_every
        ):
            # The confidence proxy says "almost": measure instead of guessing.
            k = max(step.k_min, min(t.explore_k, k or t.explore_k))
            return Offer(self, k, rate, sticky=sticky, probe=True)
        return None

    def _best(self, a_acc: float, a_pass: float, k_top: int, step: Step) -> tuple[int, float]:
        """The draft length up to ``k_top`` (at least ``k_min``; 0: none) with the highest
        expected rate, and that rate (tokens/s). Draft token i is proposed when drafting
        went on past the i before it (a_pass^i) and yields a token when all of them are
        accepted too (c^i, c = a_acc * a_pass). (One rate for every depth: a stop on the
        path probability comes later in a sure draft and sooner in an unsure one, which
        the learnt rate averages.)"""
        t = step.timings
        first = self._first_eval_cost(step)
        c = a_acc * a_pass
        best = (0, 0.0)
        proposed = evals = 0.0
        for k in range(1, k_top + 1):
            evals = proposed  # the k-th proposal needs no evaluation of its own
            proposed += a_pass**k
            cost = (
                first
                + evals * t.draft
                + verify_time_at(t, 1.0 + proposed, step.cached)
                + t.rollback_time(k + 1, c, step.cached)
            )
            rate = expected_tokens(c, k) / cost
            if k >= step.k_min and rate > best[1]:
                best = (k, rate)
        return best

    def _first_eval_cost(self, step: Step) -> float:
        """Seconds for the model's first evaluation of a step: the tokens it has not seen
        (usually the last 1-2: the final draft token and the target's own). A longer
        catch-up after idle steps is spread over the steps the model is expected to stay
        in use (its mean run of consecutive steps, at most ``catch_up_horizon``)."""
        t, history = step.timings, step.history
        behind = max(1, len(history) - self.drafter.cached_tokens(history))
        per = t.draft / t.curve(1)
        if behind <= 2:
            return per * t.curve(behind)
        extra = per * max(0.0, t.curve(behind) - t.curve(2))
        horizon = min(float(self.tuning.catch_up_horizon), max(1.0, self.mean_streak))
        return per * t.curve(2) + extra / horizon

    def settle(self, step: Step, taken: Offer | None) -> None:
        if taken is not None and taken.arm is self:
            self.idle = 0
            self.streak += 1
            self.steps += 1
        elif self.streak:
            self.mean_streak += self.tuning.streak_weight * (self.streak - self.mean_streak)
            self.streak = 0

    @property
    def p_stop(self) -> float:
        """The path probability below which it stopped at its latest draft (see
        :meth:`p_stop_at`); before any, the tuning's ``p_stop``."""
        return self._p_stop

    def p_stop_at(self, timings: Timings) -> float:
        """The path probability (the product of the draft's probabilities of the tokens
        drafted so far, the next one's included) below which it stops drafting on
        ``timings``: ``p_stop_cost`` times what one more draft token costs relative to a
        target row (its evaluation, and the row it adds to a verification of
        ``explore_k`` drafts, from the calibrated curve), within [``p_stop_min``,
        ``p_stop``]. The whole draft up to a token is accepted about as often as that
        product, so drafting it no longer pays once the product falls below what the
        token costs: where draft tokens and batch rows are nearly free (a GPU) the draft
        goes on to paths a CPU stops before (the cumulative confidence of EAGLE-2, Li et
        al. 2024, section 4.1, on a chain; llama.cpp's ``--spec-draft-p-min`` is per
        token, and stays ``p_min``). The same rule serves the MTP layers' arm (not
        simulated: no trace records MTP drafts)."""
        t = self.tuning
        if t.p_stop_cost <= 0.0:
            return t.p_stop
        # (the calibrated curve's shape, one correction for both: the learned single and
        # batch corrections differ by Python's share of a step, not by what a row adds)
        one = timings.curve(1)
        k = max(1, t.explore_k)
        row = max(0.0, timings.curve(1 + k) - one) / k
        rule = t.p_stop_cost * (timings.draft / timings.scale_single + row) / one
        return min(t.p_stop, max(t.p_stop_min, rule))

    def draft(self, offer: Offer, step: Step) -> Draft:
        """The model's draft of ``offer.k`` tokens, stopped at a token below ``p_min`` or
        a path below :meth:`p_stop_at`; one that stopped early below ``k_min`` is too
        short to verify: what it taught about going on counts, and the step runs without
        drafts."""
        self._p_stop = stop = self.p_stop_at(step.timings)
        path = self.tuning.p_stop_path
        draft = self.drafter.propose(step.history, offer.k, step.sampler, step.rng,
                                     p_min=self.p_min if path else max(stop, self.p_min),
                                     p_path_min=stop if path else 0.0)  # fmt: skip
        if len(draft.tokens) < step.k_min:
            self.passed.observe(len(draft.tokens), draft.stopped)
            return Draft([])
        return draft

    def observe(self, plan: StepPlan, accepted: int, rejected: bool) -> None:
        self.accepted.observe(accepted, rejected)
        self.passed.observe(len(plan.draft.tokens), plan.draft.stopped)
