"""Every tuning number of auto mode, in one frozen object.

Each field says what it trades, where its value came from, and the values it has had (the
git history of ``specgguf/costmodel.py``, later ``specgguf/spec/planner.py``, 2026-11-30 to
2026-12-02). "EPYC" and "Xeon" are the 2-core VMs of ``../shared/machines`` (their
verification batch costs differ: on the EPYC a batch costs nearly its rows one by one, on
the Xeon 5 rows cost 1.8 lone rows). Where no measurement is recorded, the field says so
and gives the reason the value was chosen. Most values came from no sweep: each
measurement compared one change with the code before it, on one machine, within that
machine's noise of about 10%. Since 2026-12-04 a change is first replayed on recorded
traces against every measured machine's cost curve and a GPU-like one
(``scripts/simulate-planner``, :mod:`specgguf.measure.simulate`), which is where
``p_stop_cost``, ``p_stop_min`` and ``prior_floor`` come from. ``docs/auto-mode.md``
describes how auto mode uses them.

A planner takes one :class:`AutoTuning` (``AutoPlanner(tuning=...)``); tests and
experiments pass another with :func:`dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
import functools

from specgguf.speculative.drafters.ngram import LONG_MATCH


@dataclasses.dataclass(frozen=True)
class AutoTuning:
    """Auto mode's tuning (see the module).

    Units: rates are per-token probabilities, lengths are tokens, weights are the share a
    new observation moves an average by, margins are ratios of expected tokens/s.
    """

    # -- choosing an arm ------------------------------------------------------------------

    #: Speculate only when expected to beat the target alone by this ratio: noisy estimates
    #: against the risk of a loss. Was 1.05, 1.1, then 1.05 ("n-gram lookup on summaries
    #: pays at small margins"; Xeon, `specgguf bench --draft 4,8 --rounds 2`).
    margin: float = 1.05
    #: An arm in step (a draft model in use) is left only for one expected this much
    #: faster: leaving costs a catch-up when it returns. No measurement recorded; only value.
    switch_margin: float = 1.25

    # -- the target's confidence (the prior of acceptance) ------------------------------

    #: The target's top-1 probability assumed before any step: the prior of every
    #: acceptance estimate scaled by it. No measurement recorded; only value.
    confidence_start: float = 0.6
    #: Its average is a running mean while 1/n is above this, then a moving average with
    #: this weight ("a running mean over the first ten steps"). No measurement; only value.
    confidence_weight: float = 0.1

    # -- acceptance estimates ------------------------------------------------------------

    #: A prior is worth this many trials: how fast evidence overrides it; also the prior's
    #: trials in the one-standard-error bounds. No measurement recorded; only value.
    prior_trials: float = 2.0
    #: Older counts are multiplied by this at each verification: how fast an estimate
    #: follows the text. No measurement recorded; only value.
    decay: float = 0.9
    #: Counts are multiplied by this at every step, drafted or not, so that an arm left
    #: idle returns towards its prior. No measurement recorded; only value.
    fade: float = 0.97

    # -- lookups: n-gram lookup and suffix matching -------------------------------------

    #: Acceptance prior of a lookup, relative to the confidence, by match length, shortest
    #: first (the buckets: a match counts in the longest bucket it reaches). Measured a =
    #: 0.1-0.6 after one token on six kinds of text, 0.7-0.98 after four (no command
    #: recorded); 0.7 for two tokens is not explained. Buckets 16 and 32 came with copies;
    #: values never changed.
    lookup_priors: tuple[tuple[int, float], ...] = (
        (1, 0.3), (2, 0.7), (4, 1.0), (16, 1.0), (LONG_MATCH, 1.0),
    )  # fmt: skip
    #: A lookup prior is at most this: on code the confidence is 0.95-0.99 and 4-8 token
    #: matches drafted 8-12 tokens for 1-2 accepted (EPYC: auto at 0.90x of the target
    #: alone); with the cap, code generation 33.8 -> 35.1 tokens/s. Only value.
    lookup_prior_max: float = 0.9
    #: A match of this many tokens is a copy (code editing: 109 of 115 drafts accepted):
    #: its own prior and first cap. Only value; 16 itself not measured against others.
    copy_match: int = 16
    #: A copy's prior is at most this: with 0.9 and a cap of 12, code editing ran 128
    #: steps without a draft (EPYC, 13 rows cost 8.3 lone rows). Only value; 0.97 itself
    #: not measured.
    copy_prior_max: float = 0.97
    #: A copy's first drafts are at most this long (the cap it starts from). Was 20, then
    #: 16 (auto mode's largest model draft); no measurement recorded for either.
    copy_cap: int = 16
    #: A verbatim match of ``LONG_MATCH`` tokens in the text itself, greedy, is a long
    #: copy: this prior, not scaled by the confidence (a copy is accepted while the text is
    #: copied). Only value; not measured on its own (code editing 1.59x of the target alone
    #: with it, EPYC, `scripts/bench-llama-cpp --server --rounds 4`).
    long_copy_prior: float = 0.98
    #: A long copy's first drafts are at most this long: at 0.98 a 32-token draft pays best
    #: by the cost model (a row of a 49-row batch costs 20 ms against a 46 ms lone step,
    #: EPYC), a reason worked out, not a measurement of other caps. Only value.
    long_copy_cap: int = 32
    #: The long-copy prior weighs the tokens it expects between breaks, 1 / (1 -
    #: ``long_copy_prior``) (set both together), not ``prior_trials``: with 2, one 32-token
    #: draft accepted whole read as 0.999 and the next was 48 tokens, broken at 20. Was 2;
    #: 50 measured against it (code editing, EPYC, one process, alternating, 6 rounds:
    #: median 30.91 -> 32.95 tokens/s).
    long_copy_weight: float = 1 / (1 - 0.98)
    #: Below ``copy_match``, a lookup is judged at its acceptance less this many standard
    #: errors (shadow drafts bring evidence free), where a draft row costs ``lookup_z_row``
    #: of a lone row (of a sequence's share, beside others) or more. Tried against 0 (no
    #: bound, no shadows), measured on EPYC: 1.065x and 0.954x on code generation, 8 and 5
    #: rounds: within noise. Simulated (2026-12-04, traces C and D): 0 gains 1.5-4% on the
    #: Xeon curves and loses 0.3-0.8% on the EPYC's with what depth costs, with twice the
    #: columns below 1.0x on D; 0.5 lies between. So the bound now follows the cost of a row
    #: (below).
    lookup_z: float = 1.0
    #: ... and ``lookup_z`` times (a row's share / this) where a draft row costs less
    #: (``LookupArm.z``; 0: always ``lookup_z``, the rule before it): a draft judged too
    #: hopefully costs its rows. Tried against 0, simulated on traces C and D
    #: (scripts/simulate-planner, 2026-12-04, docs/performance.md): 0.8 gains 1.1-3.4% on
    #: the Xeon curves, 0.5-0.9% on the GPU-like one, and is within 0.2% on the EPYC's with
    #: depth; 0.65 within 0.5% of it; 0.5, 1.0 and 1.2 each met the bar of issue 34 in
    #: fewer columns on one trace, and ``lookup_z`` 1.5 with 1.0 came out about the same.
    #: Measured on the EPYC against 0 (scripts/bench-tuning): 0.989x, within noise, where
    #: the two rules are nearly one (its rows cost 0.69 of a lone row).
    lookup_z_row: float = 0.8
    #: A lookup draft below a copy whose first token has less than this share of the
    #: match's earlier occurrences (as the drafter counts it) is judged apart
    #: (``LookupArm.key``; 0: never, the rule before it). Measured on the three Spec-Bench
    #: traces (every position of the target's output, 2026-12-05): below 0.75 the first
    #: token was accepted 10-35% of the time, at 0.75 or more and for a match seen once
    #: 52-93%.
    #: Simulated against 0 (scripts/simulate-planner, traces C, D, E): +0.2-1.0% overall
    #: on the CPU curves, the same on the GPU-like one; 0.6 and 0.99 within 0.2% of it.
    lookup_share_min: float = 0.75
    #: ... with this share of the prior of its bucket: measured 0.25-0.3 (the acceptance
    #: rates above, by bucket and drafter). Simulated against 0.15 and 0.5: within 0.1%; 1.0
    #: (apart, at the same prior) loses up to 0.4%.
    varied_prior: float = 0.3
    #: A lookup proposal not drafted is checked against the target's tokens up to this many
    #: (a shadow draft): evidence against bookkeeping. No measurement recorded; only value.
    shadow_len: int = 4
    #: A lookup draft is at most ``cap_slope`` x its bucket's mean accepted length +
    #: ``cap_base``: drafts grow while accepted whole, shrink when broken early. The slope
    #: was always 2 (only value); no measurement recorded.
    cap_slope: float = 2.0
    #: ... plus this, so that a bucket whose drafts broke early still drafts a few tokens.
    #: Was 2, then 4 ("wider cap"); no measurement recorded.
    cap_base: int = 4
    #: An n-gram bucket's mean accepted length before any draft (a first cap of 12). No
    #: measurement recorded; only value.
    ngram_first_length: float = 4.0
    #: A suffix-matching bucket's (a first cap of 6): matches in other generations are
    #: weaker evidence; at 4, code generation's 4 suffix steps drafted 35 tokens for 8
    #: accepted (measured where 5 rows cost 3 lone rows). Was 4.0, then 1.0.
    suffix_first_length: float = 1.0
    #: The weight of a new accepted length in a bucket's mean. No measurement; only value.
    length_weight: float = 0.5

    # -- the draft model ---------------------------------------------------------------

    #: Acceptance of a draft token drafting went on past, before any verification. Before
    #: it, the confidence was the prior; measured nearby: the target agreed with 98-100% of
    #: the tokens at or above 0.5 (per token) on code and JSON, 84-89% on prose. Only value;
    #: not measured again for the path stop, which lets a GPU draft a token down to 0.1.
    model_prior: float = 0.95
    #: The share of its weight the draft model's acceptance prior fades to as
    #: verifications come in. Was 1 (a fixed weight), whose floor was an acceptance of
    #: about 0.2 however often the drafts failed: on the GPU-like curve a draft model that
    #: is always wrong ran at 0.91x of the target alone, 0.97x with 0.1; on the two
    #: recorded Spec-Bench traces within 0.6% either way (scripts/simulate-planner,
    #: 2026-12-04; docs/performance.md).
    prior_floor: float = 0.1
    #: The draft model stops where its path probability (the product of its probabilities
    #: of the tokens drafted so far, the next one's included) falls below this at most
    #: (per token it was, as llama.cpp's --spec-draft-p-min: the target agreed with 35-50%
    #: of the tokens below 0.5 on prose, Qwen pair, greedy, 128 tokens per kind of text).
    #: The path since 2026-12-05: on the recorded traces C, D and E (scripts/simulate-planner,
    #: docs/performance.md), with ``p_stop_min`` 0.1, 1.2-2.0% more on the GPU-like curve,
    #: the Xeon curves within 0.9% and the EPYC's unchanged (its draft model does not pay);
    #: 0.7 within 0.8% of 0.5 on every curve.
    p_stop: float = 0.5
    #: ... on the path (True), or per token as before 2026-12-05 (False: with ``p_stop_min``
    #: 0.3 the rule of then, to measure the change against, ``--set p_stop_path=False``).
    p_stop_path: bool = True
    #: ... unless this times what one more draft token costs relative to a target row
    #: (its evaluation and its verification row) is lower (0: always ``p_stop``); see
    #: ``ModelArm.p_stop_at``. Was 0 (always 0.5): on the two recorded Spec-Bench traces
    #: (scripts/simulate-planner, 2026-12-04, docs/performance.md), this with
    #: ``p_stop_min`` and ``prior_floor`` took the GPU-like curve from 2.84x to 3.03x and
    #: from 2.71x to 2.83x of the target alone, and left the CPU curves as they were
    #: overall (their draft tokens cost 0.4-0.6 of a row: the rule gives more than 0.5);
    #: 0.5 lost 3% on the Xeon curves, 1.5 with a cap of 0.7 lost 2.5%. With the path
    #: (2026-12-05): 0.7 and 1.5 within 0.5% of 1.0 on every curve.
    p_stop_cost: float = 1.0
    #: ... but never below this. Simulated per token, it was 0.3 (0.1-0.3 within 0.4% of
    #: each other on the GPU-like curve, where the rule gives 0.09); simulated on the path
    #: (2026-12-05, traces C, D and E) 0.3 loses 4-6% there against 0.1, and 0.05 is
    #: within 0.4% of 0.1, the CPU curves alike.
    p_stop_min: float = 0.1
    #: Steps of a generation in which the draft model is judged at its estimates plus one
    #: standard error: one early rejection must not rule out a model that gains about 20%
    #: at best (test timings of the Qwen pair). Only value. Simulated on traces C, D and E
    #: with the path stop (2026-12-05): 0 gains up to 3% on the Xeon curves and the GPU-like
    #: one overall, but loses ``bench``'s structured output and code generation on the Xeon
    #: curves (1.38x -> 1.19x, 1.32x -> 1.12x: the draft model left after one draft half
    #: rejected, and not brought back) and keeps out a draft model wrong at its first step
    #: only (tests/test_costmodel.py); 2 loses the latter too; 3 within 1% of 4 everywhere.
    explore_steps: int = 4
    #: The longest draft of those optimistic steps and of a probe: a wrong guess stays
    #: cheap. Also the draft whose rows ``ModelArm.p_stop_at`` and ``LookupArm.z`` weigh
    #: (what one more draft row costs). No measurement recorded; only value.
    explore_k: int = 4
    #: A draft model at most this many tokens behind the text counts as in step (no long
    #: catch-up to try it). No measurement recorded; only value.
    near_sync: int = 8
    #: An idle draft model whose estimate comes within this share of the margin is
    #: measured with a short draft (a probe): the confidence proxy underestimates agreement
    #: on code (0.93 against 0.98 measured). Only value.
    probe_share: float = 0.85
    #: A probe only while the model's acceptance counts hold fewer trials than this
    #: (nothing recent was measured). No measurement recorded; only value.
    probe_trials: float = 1.0
    #: A probe at most once in this many steps: a wrong guess costs a short batch that
    #: often. No measurement recorded; only value.
    probe_every: int = 16
    #: A catch-up of a draft model that was idle is paid back over its mean run of steps,
    #: at most this many. First a fixed horizon of 8, then this cap; not measured.
    catch_up_horizon: int = 8
    #: The mean run of draft-model steps before any run ended: 1 charges a first catch-up
    #: whole. A reason, not a measurement; only value.
    streak_start: float = 1.0
    #: The weight of a finished run in that mean. No measurement recorded; only value.
    streak_weight: float = 0.5

    # -- timings learnt online -----------------------------------------------------------

    #: The weight of a measured step in the learnt correction of the calibrated costs
    #: (draft and target). Was 0.1, then 0.05; no measurement recorded.
    timing_weight: float = 0.05
    #: A measured step moves the correction by at most this ratio of the calibration, so
    #: that one wild measurement cannot run away. Was (0.5, 3.0); no measurement recorded.
    timing_clamp: tuple[float, float] = (0.8, 1.5)

    # -- the planner's own time ----------------------------------------------------------

    #: While no arm pays, asking the arms for offers may cost at most this share of the
    #: target alone's step (``AutoPlanner.plan_cost`` against the calibrated lone row):
    #: where it costs more (a fast target, whose steps take hundreds of microseconds), the
    #: planner lets steps pass as the target's alone without asking (0: it always asks).
    #: On the tiny generated pair (steps of 180-370 us) auto mode ran at 0.66-0.73x the
    #: target alone, asking at every step for 105 us (2-core Xeon, 2026-12-06); 3% is the
    #: bar issue 56 sets for Python's share of a GPU's step.
    plan_budget: float = 0.03
    #: ... letting twice as many steps pass for every step in a row that it asked in vain
    #: (1, 2, 4, ...), at most this many. Was 16 with one more step each time (1, 2, 3):
    #: on the tiny generated pair (steps of 300-450 us, asking 0.3-0.6 ms) auto mode then
    #: asked 37 times in 512 tokens (2-core EPYC, 2026-12-07). With the doubling, at most
    #: 16 and at most 64 measured alike there (0.871x and 0.872x the target alone, without
    #: check_steps: docs/performance.md); 64 is a draft that starts to pay found within
    #: 64 steps there (20 ms), and lets asking's share reach plan_budget where it costs
    #: 20 lone rows or more.
    plan_skip_max: int = 64
    #: The weight of a step's measured cost of asking in its average (``AutoPlanner``'s
    #: measured ``plan_cost``): a running mean while 1/n is above it. No measurement
    #: recorded; only value.
    plan_cost_weight: float = 0.1
    #: Whether that cost is also read off the clock where the steps are timed
    #: (``check_steps``): a step asked in vain less a step let pass, the larger of the two
    #: counting. The arms' Python alone leaves out the general step an asked step runs
    #: instead of a lean one and the drafters' catching up on the steps let pass. On the
    #: tiny generated pair, asking at about 240 us of the arms' Python, auto mode measured
    #: 0.927x the target alone with it and 0.906x without (medians of six runs of
    #: scripts/bench-auto-alone --rounds 48 --cpu-time, 2-core EPYC, 2026-12-07). Was
    #: the arms' Python alone before that day.
    ask_by_clock: bool = True
    #: Whether the steps that drafted are checked against the steps let pass, by the
    #: clock (``AutoPlanner._time_steps``): where the asked steps' expected tokens, their
    #: Python included, came slower than as many steps of the target alone, on average
    #: (weighted as ``plan_cost_weight``), drafted steps let steps pass as vain asks do.
    #: The cost model weighs no Python: on the tiny generated pair (steps of 300-450 us)
    #: auto mode ran at 0.872-0.885x the target alone without the check and 0.911-0.923x
    #: with it (measured on a 2-core EPYC, 2026-12-07, CPU time, 16 rounds paired). Judged by
    #: the tokens kept instead of those expected, the simulator's replay of a trace of
    #: copies on the Xeon curves fell from 1.28x to 1.04x the target alone; by those
    #: expected it is unchanged (tests/test_simulate.py). Was off in a commit of that day.
    check_steps: bool = True

    # -- draft lengths -----------------------------------------------------------------

    #: The longest draft of the draft model: its tokens cost a forward pass each and its
    #: acceptance falls along a draft. Only value (16); no measurement recorded.
    draft_max_model: int = 16
    #: The longest lookup draft: a row of a 65-row batch costs 0.7 of a row of a 17-row
    #: one (EPYC, `llama-bench -p 17,65`). Was 48, then 16 (code editing 29-33 tokens/s at
    #: 16 against 25-29 at 48, machine not named), then 64 with long copies.
    draft_max_lookup: int = 64

    # (cached: read at every step of every lookup arm)
    @functools.cached_property
    def buckets(self) -> tuple[int, ...]:
        """The match lengths of ``lookup_priors``, shortest first."""
        return tuple(b for b, _ in self.lookup_priors)

    @functools.cached_property
    def _priors(self) -> dict[int, float]:
        return dict(self.lookup_priors)

    def bucket(self, match: int) -> int:
        """The longest bucket a match of ``match`` tokens reaches (at least the first)."""
        buckets = self.buckets
        reached = buckets[0]
        for b in buckets:
            if b <= match:
                reached = b
        return reached

    def lookup_prior(self, bucket: int) -> float:
        """The prior of ``bucket`` relative to the confidence."""
        return self._priors[bucket]

    def first_length(self, bucket: int, length: float, *, long_copies: bool) -> float:
        """A bucket's mean accepted length before any draft: ``length``, or for copies the
        one whose cap is ``copy_cap`` (``long_copy_cap`` for long ones, where
        ``long_copies``)."""
        if bucket >= LONG_MATCH and long_copies:
            return (self.long_copy_cap - self.cap_base) / self.cap_slope
        if bucket >= self.copy_match:
            return (self.copy_cap - self.cap_base) / self.cap_slope
        return length

    def cap(self, mean_length: float) -> int:
        """The longest draft of a bucket whose mean accepted length is ``mean_length``."""
        return int(self.cap_slope * mean_length) + self.cap_base


#: The tuning auto mode uses unless given another.
AUTO_TUNING = AutoTuning()
