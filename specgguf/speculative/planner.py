"""When does speculation pay? A cost model from measured timings, and the automatic planner
that picks the drafter and the draft length K at every step.

Expected tokens per step for per-token acceptance rate ``a`` and draft length K (Leviathan
et al. 2023, section 3.1, equation 1, with i.i.d. acceptance)::

    E(K) = (1 - a^(K+1)) / (1 - a)          (E(0) = 1)

Cost of a step: K draft evaluations plus one verification of K + 1 tokens::

    C(K) = K * t_draft + t_verify(K + 1)

The planner chooses the K (0 included: no speculation) that maximises E(K) / C(K) tokens per
second, for each drafter: n-gram lookup (t_draft = 0, K bounded by the continuation it
found) and the draft model, and takes the best of them and of the target alone.

Timings come from a short calibration (:func:`calibrate`; the engine caches it per
machine, build and pair in :mod:`specgguf.engine.calibration`) and are refined online from
every evaluation. Acceptance is tracked online per drafter with exponentially decaying
counts, so K follows the text.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import ClassVar, Protocol

import numpy as np

from specgguf.speculative.drafters import (
    LONG_MATCH,
    Draft,
    Drafter,
    Evaluator,
    ModelDrafter,
    NgramDrafter,
    SuffixDrafter,
)
from specgguf.speculative.sampling import SamplerParams
from specgguf.speculative.tree import depths, first_branch

#: The largest draft length of the draft model in auto mode: its tokens cost a forward
#: pass each, and its acceptance falls along a draft.
AUTO_DRAFT_MAX = 16

#: The largest draft length of auto mode (its lookup drafts, which cost nothing to make).
#: Drafts this long are chosen by the cost model where acceptance is high (a long verbatim
#: copy: :attr:`AutoPlanner.LONG_COPY_PRIOR`; any match whose drafts keep being accepted
#: whole, whose cap grows with the accepted length): on a
#: CPU a row of a 65-row batch costs 0.7x one of a 17-row batch (``llama-bench -p
#: 17,65``, 2-core AMD EPYC), so a copy verified 64 tokens at a time is faster, as
#: llama.cpp's ngram-mod does (common/speculative.cpp). A verification of K + 1 tokens
#: sizes llama.cpp's logits buffer (0.6 MB per row for a 151,936-token vocabulary).
AUTO_LOOKUP_MAX = 64

#: Verification batch sizes measured by calibration (others are interpolated).
CALIBRATION_SIZES = (1, 2, 3, 4, 5, 7, 9, 13, 17, 25, 33, 49)

#: The sizes measured again deeper in the context (calibrate's ``deep``), and how deep:
#: every row of a batch attends to every cached position, so batches cost more there (4
#: rows: 2.8x one row at 64 positions, 3.6x at 1024, on a 2-core AMD EPYC; 8-11 us per
#: row and position). The probe's prefix takes about 4 s there.
DEPTH_SIZES = (1, 5, 17)
DEPTH_PROBE = 384


def expected_tokens(a: float, k: int) -> float:
    """E(K) = (1 - a^(K+1)) / (1 - a): tokens a step yields with K drafts accepted
    independently with probability ``a`` (the +1 is the target's own token)."""
    if k <= 0:
        return 1.0
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def call_sizes(n: int, rows_per_call: int) -> list[int]:
    """The sizes of the decode calls that evaluate ``n`` rows at most ``rows_per_call`` at a
    time, as even as possible, larger first (the split of deterministic mode's
    :meth:`specgguf.llama.backend.LlamaContext.eval`)."""
    calls = -(-n // rows_per_call)
    return [n // calls + (i < n % calls) for i in range(calls)]


@dataclasses.dataclass
class Timings:
    """Seconds per evaluation: ``verify[n]`` for a target batch of n tokens (n = 1 is a
    plain decode step), as calibrated, and ``draft`` per draft-model token (0 without a
    draft model).

    Online refinement keeps the calibrated curve and learns two correction factors, one
    for decode steps and one for batches (``scale_single``, ``scale_batch``): during a run
    the target and the draft evict each other's weights from the CPU caches, which makes
    real steps slower than calibrated ones (about 1.3x for 10-token batches, measured).

    The curve holds at ``depth`` cached positions (the calibration's prefix). Every row of
    a verification attends to every cached position, so a batch costs more deeper in the
    context: ``position_row`` seconds per row and cached position past ``depth``, and a
    lone row ``position_single``, at most ``position_row`` (llama.cpp's CPU FlashAttention
    splits a lone row's positions over the threads: ``ggml-cpu/ops.cpp``, its split-KV
    path). The planner sets
    ``cached`` to the step's cached positions. Measured on Qwen2.5-Coder 1.5B, 2-core AMD
    EPYC: 4 rows cost 2.8x one row at 64 positions and 3.6x at 1024.

    Deterministic mode decodes a lone row with a throw-away second row once more than
    ``lone_max`` positions are cached (:attr:`specgguf.llama.backend.LlamaContext.
    lone_rows_max`; with an f16 K cache 256, with q8_0 never): the planner sets
    ``cached`` to the step's cached positions, and a lone row past the limit costs what
    two rows do. Then drafting one token costs no more verification than drafting none.
    """

    verify: dict[int, float]
    draft: float = 0.0
    scale_single: float = 1.0
    scale_batch: float = 1.0
    #: positions up to which a lone row is decoded alone (None: always)
    lone_max: int | None = None
    #: positions cached before the step being planned (set by the planner)
    cached: int = 0
    #: deterministic mode's most rows per decode call; its greedy verification stops after
    #: the first call that shows a rejection (None: one evaluation of every row)
    chunk_rows: int | None = None
    #: cached positions at which ``verify`` was measured
    depth: int = 0
    #: seconds each cached position past ``depth`` adds to a lone row, and to each row of
    #: a batch
    position_single: float = 0.0
    position_row: float = 0.0

    @property
    def padded(self) -> bool:
        """Whether a lone row is decoded with a throw-away row at this step."""
        return self.lone_max is not None and self.cached + 1 > self.lone_max

    def _curve(self, n: int) -> float:
        if n in self.verify:
            return self.verify[n]
        xs = sorted(self.verify)
        if n <= xs[0]:
            return self.verify[xs[0]]
        lo = max((x for x in xs if x < n), default=xs[0])
        hi = min((x for x in xs if x > n), default=None)
        if hi is None:
            # Past the largest size, from the last two, each row adding at least the mean
            # of what a row added over the measured sizes: noise can make the last two
            # flat or reversed (13 rows measured slower than 17), and a catch-up of 90
            # tokens then cost nothing.
            last = xs[-1]
            if len(xs) == 1:
                return self.verify[last] * n / last
            v = self.verify
            slope = max((v[last] - v[xs[-2]]) / (last - xs[-2]),
                        (v[last] - v[xs[0]]) / (last - xs[0]), 0.0)  # fmt: skip
            return v[last] + (n - last) * slope
        w = (n - lo) / (hi - lo)
        return self.verify[lo] + w * (self.verify[hi] - self.verify[lo])

    def _at_depth(self, n: int) -> float:
        """The calibrated curve at n rows, plus what attention to the positions cached past
        the calibration's ``depth`` adds."""
        deeper = max(0, self.cached - self.depth)
        # A lone row attends to the positions one row of a batch does, and llama.cpp's
        # split-KV path only makes that cheaper: its slope is at most a batch row's. Its
        # measurement is the noisiest (one row, about 1 ms over 320 positions), and a
        # measured 60 us (against 14 for a batch row, and no slope by llama-bench -d
        # 64,384,800) made one row at 779 positions cost what two did: the draft model
        # looked free and auto ran at 0.83x of the target alone on Spec-Bench's rag.
        single = min(self.position_single, self.position_row)
        per = single if n == 1 else n * self.position_row
        return self._curve(n) + deeper * per

    def verify_time(self, n: int) -> float:
        """t_verify(n): the calibrated curve, linearly interpolated (and extrapolated), at
        the step's cached positions (:attr:`cached`), times the learned correction; a lone
        row that is padded (:attr:`padded`) costs two rows."""
        if n == 1 and self.padded:
            n = 2
        return self._at_depth(n) * (self.scale_single if n == 1 else self.scale_batch)

    def expected_verify_time(self, n: int, a: float) -> float:
        """The expected t_verify of ``n`` rows (the last token, then n - 1 drafts each
        accepted with probability ``a``) when greedy verification is decoded in calls of
        at most ``chunk_rows`` rows (sizes as even as possible, larger first, as
        :meth:`specgguf.llama.backend.LlamaContext.eval` splits them) and stops after the
        first call that shows a rejection: call j runs only when the s_0 + ... + s_(j-1)
        drafts the calls before it verified were all accepted, so the expectation is
        sum_j a^(s_0 + ... + s_(j-1)) t_verify(s_j). Without ``chunk_rows``, or for one
        call, t_verify(n)."""
        r = self.chunk_rows
        if not r or n <= r:
            return self.verify_time(n)
        total, before = 0.0, 0
        for size in call_sizes(n, r):
            total += a**before * self.verify_time(size)
            before += size
        return total

    def observe_verify(self, n: int, seconds: float, weight: float = 0.05) -> None:
        """Refine the correction for batches of ``n`` with a measurement (a padded lone
        row is a batch of two)."""
        if n == 1 and self.padded:
            n = 2
        ratio = min(1.5, max(0.8, seconds / self._at_depth(n)))
        if n == 1:
            self.scale_single += weight * (ratio - self.scale_single)
        else:
            self.scale_batch += weight * (ratio - self.scale_batch)

    def observe_draft(self, seconds_per_token: float, weight: float = 0.05) -> None:
        self.draft += weight * (seconds_per_token - self.draft)


def best_k(
    a: float,
    timings: Timings,
    k_max: int,
    *,
    draft_cost: float | None = None,
    k_min: int = 1,
    greedy: bool = False,
) -> tuple[int, float]:
    """The draft length maximising E(K) / C(K), and that rate (tokens/s); K is 0 (no
    drafts) or between ``k_min`` and ``k_max``. ``draft_cost`` overrides t_draft (0 for
    n-gram lookup). ``greedy``: the verification's expected cost where it stops at a
    rejection (:meth:`Timings.expected_verify_time`)."""
    td = timings.draft if draft_cost is None else draft_cost
    best, rate = 0, 1.0 / timings.verify_time(1)
    for k in range(max(1, k_min), max(0, k_max) + 1):
        verify = timings.expected_verify_time(k + 1, a) if greedy else timings.verify_time(k + 1)
        r = expected_tokens(a, k) / (k * td + verify)
        if r > rate:
            best, rate = k, r
    return best, rate


def best_tree(probs: Sequence[float], timings: Timings, *, k_min: int = 1) -> tuple[int, float]:
    """The number of nodes m (0, or ``k_min`` to ``len(probs)``) of a tree draft whose
    first m nodes maximise E(m) / t_verify(m + 1), and that rate (tokens/s).

    ``probs[i]`` is the estimated probability that node i is accepted (that the target's
    argmax follows its whole branch), in an order where parents come first, so that every
    prefix is a tree. A step yields one token of the target's own plus every accepted
    node, and at most one node per depth is accepted, so E(m) = 1 + sum(probs[:m])
    (SpecInfer, Miao et al. 2023; Sequoia, Chen et al. 2024, section 3.1). A chain with
    i.i.d. acceptance ``a`` has probs a, a^2, ..., and E(m) is :func:`expected_tokens`.
    The verification is one batch of m + 1 rows, costed from the measured curve."""
    best, rate = 0, 1.0 / timings.verify_time(1)
    e = 1.0
    for m, p in enumerate(probs, start=1):
        e += p
        r = e / timings.verify_time(m + 1)
        if m >= k_min and r > rate:
            best, rate = m, r
    return best, rate


@dataclasses.dataclass
class Acceptance:
    """Per-token acceptance rate of one drafter, from exponentially decaying counts: a
    verification adds its accepted drafts as successes and its first rejection as a
    failure. The counts are blended with a prior worth ``weight`` trials; the prior can be
    passed at each reading (the planner passes the target's recent confidence, which tracks
    acceptance closely), and ``tick`` fades old observations at every step, used or not,
    so that the estimate follows the text."""

    prior: float = 0.6
    weight: float = 2.0
    decay: float = 0.9
    fade: float = 0.97
    successes: float = 0.0
    trials: float = 0.0

    def rate_with(self, prior: float | None = None, weight: float | None = None) -> float:
        """The counts blended with ``prior`` (default: :attr:`prior`) worth ``weight``
        trials (default: :attr:`weight`)."""
        p = self.prior if prior is None else prior
        w = self.weight if weight is None else weight
        return (self.successes + p * w) / (self.trials + w)

    @property
    def rate(self) -> float:
        return self.rate_with(None)

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.successes = self.decay * self.successes + accepted
        self.trials = self.decay * self.trials + accepted + (1 if accepted < drafted else 0)

    def tick(self) -> None:
        self.successes *= self.fade
        self.trials *= self.fade

    def decay_once(self) -> None:
        """Fade the counts as :meth:`observe` does before a verification's counts, for
        one observed in parts with :meth:`add`."""
        self.successes *= self.decay
        self.trials *= self.decay

    def add(self, accepted: int, rejected: bool) -> None:
        """Part of a verification: ``accepted`` more draft tokens accepted, then a
        rejection or not."""
        self.successes += accepted
        self.trials += accepted + rejected


# --- calibration ----------------------------------------------------------------------


def calibration_sizes(
    target: Evaluator, draft: Evaluator | None, sizes: Sequence[int] = CALIBRATION_SIZES
) -> list[int]:
    """The verification batch sizes of ``sizes`` that :func:`calibrate` measures: those
    the target's batch, its outputs (K + 1 for a draft length K) and both contexts allow."""
    room = min(ctx.n_ctx for ctx in (target, draft) if ctx is not None)
    cap = min(target.n_batch, getattr(target, "n_outputs_max", target.n_batch), room - 1)
    return [n for n in sizes if n <= cap] or [1]


def calibrate(
    target: Evaluator,
    draft: Evaluator | None,
    tokens: Sequence[int],
    *,
    sizes: Sequence[int] = CALIBRATION_SIZES,
    repeats: int = 3,
    deep: int = 0,
) -> Timings:
    """Measure t_verify(n) on the target and t_draft on the draft (the minimum of
    ``repeats``), after a prefix of up to 64 of ``tokens`` (any valid ids: the timing, not
    the text, matters), for the batch sizes the target's batch, outputs and context allow.
    With ``deep``, measure the sizes of :data:`DEPTH_SIZES` again after a prefix of up to
    ``deep`` tokens (at least 128 more than the first), for what each cached position adds
    (:attr:`Timings.position_single`, :attr:`Timings.position_row`: a lone row's slope,
    and the batches' pooled over their rows; the lone row's at most the batches'). Both
    caches are left empty.

    Raises:
        BackendError: an evaluation failed.
    """
    toks = list(tokens) or [0]
    room = min(ctx.n_ctx for ctx in (target, draft) if ctx is not None)
    sizes = calibration_sizes(target, draft, sizes)
    need = max(sizes)
    n_prefix = max(0, min(64, room - need - 1))

    def ids(start: int, n: int) -> list[int]:
        return [toks[i % len(toks)] for i in range(start, start + n)]

    prefix = ids(0, n_prefix)
    body = ids(0, need)

    def timed(
        ctx: Evaluator, batch: list[int], logits: str, other: Evaluator | None, at: int
    ) -> float:
        # As in a real step, the other model has just run and evicted our weights from
        # the CPU caches.
        if other is not None:
            other.rollback(len(prefix))
            other.eval(body[:1], logits="last")
        ctx.rollback(at)
        t0 = time.perf_counter()
        ctx.eval(batch, logits=logits)  # type: ignore[arg-type]
        return time.perf_counter() - t0

    def curve(at: int, ns: Sequence[int]) -> dict[int, float]:
        # The minimum of the repeats: other work on the machine only ever adds time.
        return {n: min(timed(target, body[:n], "all", draft, at) for _ in range(repeats))
                for n in ns}  # fmt: skip

    for ctx in (target, draft):
        if ctx is not None:
            ctx.rollback(0)
            if prefix:
                ctx.eval(prefix, logits="none")
    timed(target, body[:1], "all", draft, n_prefix)  # warm-up
    verify = curve(n_prefix, sizes)
    td = 0.0
    if draft is not None:
        td = min(timed(draft, body[:1], "last", target, n_prefix) for _ in range(repeats + 2))
    timings = Timings(_drop_outliers(verify), td, depth=n_prefix)
    deep_sizes = [n for n in DEPTH_SIZES if n in verify]
    at = min(deep, target.n_ctx - max(deep_sizes, default=1) - 1)
    if deep and at - n_prefix >= 128 and 1 in verify:
        target.rollback(n_prefix)
        target.eval(ids(n_prefix, at - n_prefix), logits="none")
        deeper = curve(at, deep_sizes)
        span, base = at - n_prefix, timings.verify
        single = max(0.0, (deeper[1] - base[1]) / span)
        rows = [n for n in deep_sizes if n > 1]
        if rows:
            extra = sum(deeper[n] - base[n] for n in rows)
            timings.position_row = max(0.0, extra / (span * sum(rows)))
        timings.position_single = min(single, timings.position_row)  # see _at_depth
    for ctx in (target, draft):
        if ctx is not None:
            ctx.rollback(0)
    return timings


def _drop_outliers(verify: dict[int, float]) -> dict[int, float]:
    """Replace a batch size that took far longer than the larger ones (a hiccup of the
    machine, not of the kernel) by the interpolation of its neighbours."""
    xs = sorted(verify)
    out = dict(verify)
    for i, n in enumerate(xs[:-1]):
        larger = [verify[m] for m in xs[i + 1 : i + 3]]
        if verify[n] > 1.5 * max(larger) and i > 0:
            lo, hi = xs[i - 1], xs[i + 1]
            out[n] = verify[lo] + (n - lo) / (hi - lo) * (verify[hi] - verify[lo])
    return out


def _upper(a: float, trials: float) -> float:
    """A rate plus one standard error (the prior counted as two trials)."""
    return min(1.0, a + math.sqrt(a * (1.0 - a) / (trials + 2.0)))


def _lower(a: float, trials: float, z: float = 1.0) -> float:
    """A rate less ``z`` standard errors (the prior counted as two trials)."""
    return max(0.0, a - z * math.sqrt(a * (1.0 - a) / (trials + 2.0)))


# --- the automatic planner --------------------------------------------------------------


@dataclasses.dataclass
class _Shadow:
    """A lookup draft that was not verified (see :meth:`AutoPlanner._check_shadows`)."""

    start: int  # the history index of its first token
    tokens: list[int]
    bucket: int  # the match-length bucket it was proposed from
    accepted: int = 0  # tokens the target has produced as proposed so far
    counted: bool = False  # whether any of its evidence has been counted


@dataclasses.dataclass
class Plan:
    """What a step does: propose ``draft`` tokens from ``drafter`` (None: no drafts), and
    the rate the cost model expects (tokens/s)."""

    drafter: Drafter | None
    draft: Draft
    expected_rate: float


class Planner(Protocol):
    """Chooses the drafter and the draft of each step for one generation.

    ``draft_max``: the largest draft length it proposes (the loop clamps it further to the
    room left); ``drafters``: the drafters it may use (the loop lets a draft model read
    the prompt ahead and sums their time); ``wants_confidence``: whether :meth:`observe`
    needs the target's top-1 probability (costs a softmax per step).
    """

    draft_max: int
    drafters: list[Drafter]
    wants_confidence: bool

    def reset(self) -> None: ...

    def plan(
        self, history: Sequence[int], k_max: int, sampler: SamplerParams, rng: np.random.Generator
    ) -> Plan: ...

    def observe(
        self,
        plan: Plan,
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
    (``propose_tree``: the suffix drafter), greedy steps verify a token tree of up to K
    nodes and that many leaves instead of a chain (sampled steps draft chains)."""

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
        self.tree_branches = tree_branches if hasattr(drafter, "propose_tree") else 0

    def reset(self) -> None:
        if self.drafter:
            self.drafter.reset()

    def plan(
        self, history: Sequence[int], k_max: int, sampler: SamplerParams, rng: np.random.Generator
    ) -> Plan:
        if self.drafter is None or k_max <= 0 or k_max < self.draft_min:
            return Plan(None, Draft([]), math.nan)
        if self.tree_branches >= 2 and sampler.greedy:
            propose_tree = self.drafter.propose_tree  # type: ignore[attr-defined]
            draft = propose_tree(history, k_max, self.tree_branches)
        else:
            draft = self.drafter.propose(history, k_max, sampler, rng, p_min=self.p_min)
        if len(draft.tokens) < self.draft_min:
            return Plan(None, Draft([]), math.nan)
        return Plan(self.drafter, draft, math.nan)

    def observe(
        self,
        plan: Plan,
        accepted: int,
        verify_seconds: float,
        confidence: float | None = None,
        *,
        rows: int | None = None,
    ) -> None:
        pass


class AutoPlanner:
    """Chooses, at every step, a lookup draft (n-gram lookup, or suffix matching over
    everything seen, whichever the cost model expects to be faster) when it found a
    continuation that is expected to pay, else the draft model with its best K, else no
    speculation.

    Acceptance is estimated per drafter from recent verifications, blended with the
    target's recent confidence (the mean top-1 probability of the tokens it produced),
    which needs no draft evaluation. Lookup drafts are also learnt from without being
    verified: a proposal the planner did not take is checked against the tokens the
    target goes on to produce (a shadow draft, :meth:`_check_shadows`), and short lookup
    matches draft only when their acceptance less one standard error pays. The draft
    model drafts greedily until it gives a token less than ``P_STOP`` (as llama.cpp's
    ``--draft-p-min``), so two rates describe it: how often a token passes ``P_STOP``
    (prior: the confidence) and how often a token that passed is accepted; E(K) uses
    their product, and the cost of a step the expected number of draft evaluations and
    verified tokens.

    The draft model's state matters: one that has been idle must first evaluate the
    tokens it missed (its cost is spread over the steps it is expected to stay in use),
    so a draft model in step is judged generously: optimistically (one standard error)
    in its first ``EXPLORE_STEPS`` steps of a generation, kept while it beats the target
    alone at all, and replaced by a lookup draft only when that is expected to be
    ``SWITCH_MARGIN`` times faster. When an idle draft model's estimate falls just short
    and nothing recent was measured, a short draft (K <= 4, every ``PROBE_EVERY`` steps at
    most) measures it.

    Args:
        timings: calibrated timings (refined online unless ``learn_timings`` is False).
        model: the draft-model drafter, if any.
        ngram: the n-gram drafter, if any.
        suffix: the suffix-matching drafter, if any; its chains are judged as n-gram
            lookup's are (by the length of its match, with their own acceptance and
            draft-length estimates). With ``tree_branches`` of 2 or more, on greedy steps,
            its tree of the continuations seen instead, cut to the size that the cost model
            expects to pay most (:func:`best_tree`); the faster lookup draft is weighed
            against the draft model and no drafts.
        tree_branches: the most leaves of a tree (0: no trees, chains only).
        draft_max: the largest draft length considered (n-gram lookup, whose drafts cost
            nothing, pays up to long drafts when its acceptance is high).
        draft_max_model: the largest draft length for the draft model.
        p_min: a draft model stops at a token it gives less than this probability, or
            ``P_STOP`` if that is higher.
        draft_min: drafts shorter than this are neither planned nor verified (as
            :class:`FixedPlanner`); 0 or 1: no minimum.
    """

    wants_confidence = True
    CATCH_UP_HORIZON = 8  # at most this many steps share a draft model's catch-up cost
    MARGIN = 1.05  # speculate only when the model expects at least this gain: the estimates
    # are noisy, and a marginal gain is not worth the risk of a loss
    #: n-gram acceptance prior, relative to the target's confidence, by match length: one
    #: token of context predicts little (measured a = 0.1-0.6 on six kinds of text), four or
    #: more about as well as the confidence itself (0.7-0.98).
    NGRAM_PRIOR: ClassVar[dict[int, float]] = {1: 0.3, 2: 0.7, 4: 1.0, 16: 1.0, LONG_MATCH: 1.0}
    #: ... but never more than this: on code the target's confidence is 0.95-0.99, and a
    #: 4- or 8-token match then looked good for 8-12 drafts, of which 1-2 were accepted
    #: (code generation, 2-core AMD EPYC: auto at 0.90x of the target alone)
    LOOKUP_PRIOR_MAX = 0.9
    #: ... except after a verbatim match of ``COPY_MATCH`` tokens or more: text being
    #: copied (code editing: 109 of 115 drafts accepted), whose drafts start at up to
    #: ``COPY_CAP`` tokens. With 0.9 and a cap of 12, on a machine
    #: where batches cost nearly their rows (13 rows 8.3x one), no draft length paid,
    #: nothing was verified and so the prior was never corrected: code editing ran 128
    #: steps without a draft after another generation had refined the timings (2-core AMD
    #: EPYC), where drafts gave 1.3-1.9x.
    COPY_MATCH = 16
    COPY_PRIOR_MAX = 0.97
    COPY_CAP = 16
    #: A verbatim match of ``LONG_MATCH`` (32) tokens is a long copy: its acceptance prior
    #: is this, not scaled by the target's confidence (a copy is accepted as long as the
    #: text is copied, however sure the target is of each token), and its drafts start
    #: at up to ``LONG_COPY_CAP`` tokens.
    LONG_COPY_PRIOR = 0.98
    LONG_COPY_CAP = 32
    #: ... and that prior weighs as many tokens as it expects between two breaks, 1 / (1 -
    #: 0.98) = 50, not the 2 of other priors: a copy breaks where the text is edited, a
    #: rare event whose rate a few drafts accepted whole cannot tell. With 2, one 32-token
    #: draft accepted whole read as 0.999 a token, and the next draft was 48 tokens where
    #: 32 pay best at 0.98 (a row of a 49-row batch costs 20 ms against a 46 ms lone step);
    #: the rename in code editing broke it at 20 (2-core AMD EPYC).
    LONG_COPY_WEIGHT = 1 / (1 - LONG_COPY_PRIOR)
    #: A lookup draft that is not verified is still checked against the tokens the target
    #: goes on to produce, up to this many (see :meth:`_check_shadows`).
    SHADOW_LEN = 4
    #: Below ``COPY_MATCH``, a lookup draft is judged by its bucket's acceptance less this
    #: many standard errors: a lookup that loses costs the steps its batch costs (a batch
    #: of 4 rows costs 3 lone steps on a 2-core AMD EPYC), and its evidence comes free
    #: from shadow drafts, so waiting for evidence costs a few tokens of a copy. Measured
    #: there (greedy, 128 tokens): code generation drafted 0-7 tokens a request instead of
    #: 10-22; against the planner without shadows or the bound, in one process,
    #: alternating, 8 rounds and (after fixes from a review) 5: code generation 1.065x
    #: and 0.954x, code editing 1.018x and 0.962x, chat 1.022x and 1.03x, all within that
    #: machine's noise.
    LOOKUP_Z = 1.0
    SWITCH_MARGIN = 1.25  # n-gram lookup replaces a draft model in use only when this much faster
    NEAR_SYNC = 8  # a draft model at most this many tokens behind counts as in step
    EXPLORE_STEPS = 4  # steps of a generation in which the draft model is judged optimistically
    #: the draft model stops at a token it gives less than this probability (llama.cpp's
    #: --draft-p-min). Measured on the Qwen pair (greedy, 128 tokens per kind of text):
    #: the target agreed with 98-100% of the draft's tokens at or above 0.5 on code and
    #: JSON (where 99% of tokens are), 84-89% on prose, and 35-50% below 0.5 on prose.
    P_STOP = 0.5
    PROBE_EVERY = 16  # steps between probes of a draft model the proxy nearly favours

    def __init__(
        self,
        timings: Timings,
        *,
        model: ModelDrafter | None = None,
        ngram: NgramDrafter | None = None,
        suffix: SuffixDrafter | None = None,
        draft_max: int = AUTO_LOOKUP_MAX,
        draft_max_model: int = AUTO_DRAFT_MAX,
        p_min: float = 0.0,
        draft_min: int = 0,
        learn_timings: bool = True,
        tree_branches: int = 0,
    ) -> None:
        self.timings = timings
        self.draft_min = max(1, draft_min)
        self.learn_timings = learn_timings
        self.model = model
        self.ngram = ngram
        self.suffix = suffix
        self.draft_max = draft_max
        self.draft_max_model = draft_max_model
        self.p_min = max(self.P_STOP, p_min)
        self.tree_branches = tree_branches if tree_branches >= 2 else 0
        self.drafters: list[Drafter] = []
        self.reset()

    def model_can_pay(self) -> bool:
        """Whether the draft model could be faster than the target alone on these timings
        at all: some draft length up to ``draft_max_model`` beats the target alone by
        ``MARGIN`` even if every draft token were accepted. Where it cannot (a draft token
        that costs most of a target step, batches that cost nearly their rows: 0.6 and
        1.5x on a 2-core AMD EPYC), the draft model neither reads the prompt nor drafts."""
        if self.model is None:
            return False
        t = self.timings
        cached, t.cached = t.cached, 0  # at the calibration's depth, where batches are cheapest
        try:
            _, rate = best_k(1.0, t, self.draft_max_model)
            return rate > self.MARGIN / t.verify_time(1)
        finally:
            t.cached = cached

    def reset(self) -> None:
        """A new generation: the priors again, and the drafters it may use (the draft
        model only when :meth:`model_can_pay`, judged on the timings as they are now)."""
        for d in (self.ngram, self.suffix, self.model):
            if d is not None:
                d.reset()
        self.model_on = self.model_can_pay()
        model = self.model if self.model_on else None
        self.drafters = [d for d in (self.ngram, self.suffix, model) if d is not None]
        # The draft model's drafts: how often a token passes P_STOP (prior: the target's
        # confidence), and how often a token that passed is accepted.
        self.acc_model = Acceptance(prior=0.95)
        self.cont_model = Acceptance()
        # n-gram proposals are judged by the length of the match they come from.
        self.acc_ngram = {n: Acceptance() for n in self.NGRAM_PRIOR}
        self.confidence = 0.6
        self._n_confidence = 0
        self._model_steps = 0  # steps drafted by the draft model in this generation
        self.idle_model = 0
        # Consecutive steps drafted by the model, now and on average: a catch-up is paid
        # back only over the steps the model stays in use.
        self._streak = 0
        self.mean_streak = 1.0  # a first catch-up is charged whole
        # Mean accepted length of n-gram drafts per bucket: caps the next draft, so that it
        # grows while drafts are accepted whole and shrinks when they break early.
        self.ngram_len = {n: self._first_len(n, 4.0) for n in self.NGRAM_PRIOR}
        self._last_ngram_bucket = 1
        # The same for suffix matching, by the length of its match (for its chains and
        # trees: a tree node's estimate is its share product times a^depth).
        self.acc_suffix = {n: Acceptance() for n in self.NGRAM_PRIOR}
        # Suffix chains start shorter (a cap of 6, not 12; copies: COPY_CAP): matches in earlier
        # generations are weaker evidence than the prompt's, and on a machine where a batch
        # costs its rows (5 rows 3x one) a long wrong draft costs several steps (measured:
        # 4 suffix steps drafting 35 tokens, 8 accepted, on code generation).
        self.suffix_len = {n: self._first_len(n, 1.0, long_copy=False) for n in self.NGRAM_PRIOR}
        self._last_suffix_bucket = 1
        # Lookup drafts proposed but not verified, one per lookup drafter (0: n-gram
        # lookup, 1: suffix matching).
        self._shadows: dict[int, _Shadow] = {}

    def _tree_size(self, tree: Draft, k_min: int, k_max: int) -> tuple[int, float, int]:
        """How many of a suffix tree's nodes to verify, the rate expected, and the match
        bucket: node i's acceptance is estimated as its share product times a^depth, a
        the bucket's per-token rate (prior: the n-gram prior times the confidence); at most
        ``k_max`` nodes, and at most the bucket's cap of suffix chains (2 x the mean
        accepted length + 4: 6 at first, ``COPY_CAP`` for a copy), so that a match nothing
        has confirmed yet costs a short batch when it is wrong."""
        assert self.suffix is not None and tree.parents is not None and tree.probs is not None
        bucket = max(b for b in self.NGRAM_PRIOR if b <= max(1, self.suffix.last_match))
        a = self.acc_suffix[bucket].rate_with(self._lookup_prior(bucket, long_copy=False))
        if bucket < self.COPY_MATCH:
            a = _lower(a, self.acc_suffix[bucket].trials, self.LOOKUP_Z)
        cap = max(k_min, int(2 * self.suffix_len[bucket]) + 4)
        est = [p * a**d for p, d in zip(tree.probs, depths(tree.parents), strict=True)]
        est = est[: min(k_max, cap)]
        m, rate = best_tree(est, self.timings, k_min=k_min)
        return m, rate, bucket

    def _first_len(self, bucket: int, length: float, *, long_copy: bool = True) -> float:
        """A bucket's mean accepted length before any draft: ``length``, or for copies
        the one that caps their drafts at ``COPY_CAP`` (``LONG_COPY_CAP`` for long ones;
        the cap is 2 x it + 4; ``long_copy`` False: no long copies, for suffix matching)."""
        if bucket >= LONG_MATCH and long_copy:
            return (self.LONG_COPY_CAP - 4) / 2
        return (self.COPY_CAP - 4) / 2 if bucket >= self.COPY_MATCH else length

    def _lookup_prior(self, bucket: int, *, long_copy: bool = True) -> float:
        """A lookup draft's acceptance before its bucket has evidence: the bucket's prior
        times the target's confidence, at most ``LOOKUP_PRIOR_MAX`` (``COPY_PRIOR_MAX``
        after a match of ``COPY_MATCH`` tokens; ``LONG_COPY_PRIOR`` after one of
        ``LONG_MATCH``, where ``long_copy``: n-gram lookup in the text itself when greedy;
        a sampled token is accepted with the target's probability of it, and suffix
        matching's long matches may come from another generation)."""
        if bucket >= LONG_MATCH and long_copy:
            return self.LONG_COPY_PRIOR
        cap = self.COPY_PRIOR_MAX if bucket >= self.COPY_MATCH else self.LOOKUP_PRIOR_MAX
        return min(cap, self.NGRAM_PRIOR[bucket] * self.confidence)

    def _check_shadows(
        self,
        history: Sequence[int],
        lookups: Sequence[tuple[object, dict[int, Acceptance], dict[int, float]]],
    ) -> None:
        """Learn from lookup drafts that were proposed but not verified (shadow drafts),
        token by token as the target produces the tokens they proposed: each one it
        produced counts as an accepted draft token, the first it did not as a rejection,
        which ends the shadow (as do ``SHADOW_LEN`` accepted).

        The evidence is free, and it is what a verification would have found: a greedy
        target accepts a draft token exactly when it produces that token, and a sampling
        one accepts a point-mass draft token with its probability p(token) (modified
        rejection sampling, Leviathan et al. 2023, section 2.3), the probability that it
        samples that token. So an unverified bucket's estimate follows the text without
        paying for drafts that lose: on a machine where a batch of 2, 3 or 4 rows costs
        2.0, 2.4 or 3.0 lone steps, only a bucket accepting about 0.85 a token or more
        pays (by ``MARGIN``), and exploring drafts (10-22 tokens a request, about 60%
        accepted) cost code generation 3-7% (2-core AMD EPYC).

        The counts are those :meth:`Acceptance.observe` would make for the verification,
        faded once at the shadow's first evidence; as they arrive over several steps,
        each step's ``tick`` has faded the older counts a little more (0.97 a step)."""
        for i, shadow in list(self._shadows.items()):
            seen = history[shadow.start : shadow.start + len(shadow.tokens)]
            if not seen:
                continue
            m = shadow.accepted
            while m < len(seen) and seen[m] == shadow.tokens[m]:
                m += 1
            _, rates, lens = lookups[i]
            rejected = m < len(seen)
            acc = rates[shadow.bucket]
            if not shadow.counted:  # its first evidence: older counts fade, as in observe
                acc.decay_once()
                shadow.counted = True
            acc.add(m - shadow.accepted, rejected)
            shadow.accepted = m
            if rejected:
                del self._shadows[i]
                lens[shadow.bucket] += 0.5 * (m - lens[shadow.bucket])
            elif m == len(shadow.tokens):
                # cut at SHADOW_LEN, not broken: a lower bound of the accepted length,
                # which may raise the bucket's mean but never lowers it
                del self._shadows[i]
                lens[shadow.bucket] += 0.5 * max(0.0, m - lens[shadow.bucket])

    def _verify_time(self, n: float) -> float:
        """t_verify at a fractional batch size (an expected number of tokens)."""
        lo = int(n)
        w = n - lo
        t = self.timings.verify_time(lo)
        return t if w == 0.0 else t + w * (self.timings.verify_time(lo + 1) - t)

    def _first_eval_cost(self, history: Sequence[int]) -> float:
        """Seconds for the draft model's first evaluation of a step: the tokens it has not
        seen (usually the last 1-2: the final draft token and the target's own). A longer
        catch-up after idle steps is spread over the steps the model is expected to stay
        in use (its mean run of consecutive steps, at most ``CATCH_UP_HORIZON``)."""
        assert self.model is not None
        t = self.timings
        behind = max(1, len(history) - self.model.cached_tokens(history))
        per = t.draft / t._curve(1)
        if behind <= 2:
            return per * t._curve(behind)
        extra = per * max(0.0, t._curve(behind) - t._curve(2))
        horizon = min(float(self.CATCH_UP_HORIZON), max(1.0, self.mean_streak))
        return per * t._curve(2) + extra / horizon

    def plan(
        self, history: Sequence[int], k_max: int, sampler: SamplerParams, rng: np.random.Generator
    ) -> Plan:
        t = self.timings
        t.cached = len(history) - 1  # the last token is evaluated with the drafts
        for acc in (self.acc_model, self.cont_model, *self.acc_ngram.values(),
                    *self.acc_suffix.values()):  # fmt: skip
            acc.tick()
        base_rate = 1.0 / t.verify_time(1)
        best = Plan(None, Draft([]), base_rate)
        k_min = self.draft_min
        if k_max < k_min:
            return best
        threshold = base_rate * self.MARGIN
        trees = self.suffix is not None and self.tree_branches >= 2 and sampler.greedy
        lookup_plan: tuple[int, float, list[int], int] | None = None
        lookup: NgramDrafter | SuffixDrafter | None = None
        lookups: tuple[tuple[NgramDrafter | SuffixDrafter | None, dict[int, Acceptance],
                             dict[int, float]], ...] = (
            (self.ngram, self.acc_ngram, self.ngram_len),
            (None if trees else self.suffix, self.acc_suffix, self.suffix_len),
        )  # fmt: skip
        self._check_shadows(history, lookups)
        # this step's lookup proposals, as they would be verified: (drafter, tokens, bucket)
        proposals: dict[int, tuple[NgramDrafter | SuffixDrafter, list[int], int]] = {}
        for i, (drafter, rates, lens) in enumerate(lookups):
            if drafter is None:
                continue
            cand = drafter.propose(history, k_max, sampler, rng)
            if len(cand.tokens) < k_min:
                continue
            match = max(1, drafter.last_match)
            if drafter.resumed:  # a copy resumed after an edit
                match = max(match, self.COPY_MATCH)
            bucket = max(b for b in self.NGRAM_PRIOR if b <= match)
            long_copy = drafter is self.ngram and sampler.greedy
            weight = self.LONG_COPY_WEIGHT if long_copy and bucket >= LONG_MATCH else None
            a = rates[bucket].rate_with(self._lookup_prior(bucket, long_copy=long_copy), weight)
            if bucket < self.COPY_MATCH:
                a = _lower(a, rates[bucket].trials, self.LOOKUP_Z)
            cap = min(len(cand.tokens), max(k_min, int(2 * lens[bucket]) + 4))
            proposals[i] = (drafter, cand.tokens[: min(cap, self.SHADOW_LEN)], bucket)
            k, rate = best_k(a, t, cap, draft_cost=0.0, k_min=k_min, greedy=sampler.greedy)
            # the faster lookup draft; n-gram lookup on a tie
            if k > 0 and rate > threshold and (lookup_plan is None or rate > lookup_plan[1]):
                lookup_plan = (k, rate, cand.tokens, bucket)
                lookup = drafter
        # A suffix tree replaces the chain when it is expected to be faster.
        tree_plan: tuple[float, Draft, int] | None = None
        if trees:
            assert self.suffix is not None
            tree = self.suffix.propose_tree(history, k_max, self.tree_branches)
            if len(tree.tokens) >= k_min and tree.parents is not None and tree.probs:
                m, rate, bucket = self._tree_size(tree, k_min, k_max)
                branch = [tree.tokens[j] for j in first_branch(tree.parents)]
                proposals[1] = (self.suffix, branch[: self.SHADOW_LEN], bucket)
                if m > 0 and rate > threshold and (lookup_plan is None or rate > lookup_plan[1]):
                    assert tree.probs is not None
                    cut = Draft(tree.tokens[:m], parents=tree.parents[:m], probs=tree.probs[:m])
                    tree_plan = (rate, cut, bucket)
                    lookup_plan = None
        model_plan: tuple[int, float] | None = None
        in_use = False
        if self.model is not None and self.model_on:
            a_acc = self.acc_model.rate
            a_cont = self.cont_model.rate_with(self.confidence)
            # Near sync, trying the draft model costs no long catch-up.
            near = len(history) - self.model.cached_tokens(history) <= self.NEAR_SYNC
            k_top = min(k_max, self.draft_max_model)
            if near and self._model_steps < self.EXPLORE_STEPS:
                # Little evidence yet: judge by an upper bound (one standard error), so
                # that one early rejection, or a misleading confidence, does not rule out
                # a draft model that pays; short drafts keep a wrong guess cheap.
                a_acc = _upper(a_acc, self.acc_model.trials)
                a_cont = _upper(a_cont, self.cont_model.trials)
                k_top = min(k_top, max(4, k_min))
            first = self._first_eval_cost(history)
            best_model = (0, 0.0)
            # Draft token i is proposed when the i before it passed P_STOP (a_cont^i) and
            # yields a token when all of them are accepted too (c^i, c = a_acc * a_cont).
            c = a_acc * a_cont
            proposed = evals = 0.0
            for k in range(1, k_top + 1):
                evals = proposed  # the k-th proposal needs no evaluation of its own
                proposed += a_cont**k
                step = first + evals * t.draft + self._verify_time(1.0 + proposed)
                rate = expected_tokens(c, k) / step
                if k >= k_min and rate > best_model[1]:
                    best_model = (k, rate)
            self.idle_model += 1
            # Hysteresis: a draft model in use stays while it pays at all, for leaving it
            # costs a catch-up when it comes back.
            in_use = near and self._model_steps > 0
            if best_model[1] > (base_rate if in_use else threshold):
                model_plan = best_model
            elif (
                best_model[1] > 0.85 * threshold
                and self.acc_model.trials < 1.0
                and self.idle_model >= self.PROBE_EVERY
            ):
                # The confidence proxy says "almost": measure instead of guessing. It
                # underestimates agreement on code (0.93 against 0.98 measured).
                model_plan = (max(k_min, min(4, best_model[0] or 4)), best_model[1])
        # n-gram estimates rest on few, mixed matches; a draft model in step has measured
        # acceptance and loses step when n-gram drafts are taken: n-gram must clearly win.
        switch = self.SWITCH_MARGIN if in_use else 1.0
        lookup_rate = (
            tree_plan[0] if tree_plan is not None else lookup_plan[1] if lookup_plan else None
        )
        lookup_wins = lookup_rate is not None and (
            model_plan is None or lookup_rate >= switch * model_plan[1]
        )
        if self._streak and (lookup_wins or model_plan is None):
            self.mean_streak += 0.5 * (self._streak - self.mean_streak)
            self._streak = 0
        chosen = None  # the lookup drafter whose draft is verified now, if any
        if lookup_wins:
            chosen = self.suffix if tree_plan is not None else lookup
        for i, (drafter, tokens, bucket) in proposals.items():
            if drafter is chosen:
                # its draft is verified now, and teaches the same positions: the shadow's
                # tokens counted so far stay counted, the rest are the draft's
                self._shadows.pop(i, None)
            elif i not in self._shadows:
                self._shadows[i] = _Shadow(len(history), tokens, bucket)
        if tree_plan is not None and lookup_wins:
            rate, cut, bucket = tree_plan
            self._last_suffix_bucket = bucket
            return Plan(self.suffix, cut, rate)
        if lookup_plan is not None and lookup_wins:
            k, rate, tokens, bucket = lookup_plan
            if lookup is self.ngram:
                self._last_ngram_bucket = bucket
            else:
                self._last_suffix_bucket = bucket
            return Plan(lookup, Draft(tokens[:k]), rate)
        if model_plan is not None:
            assert self.model is not None
            k, rate = model_plan
            self.idle_model = 0
            self._streak += 1
            self._model_steps += 1
            draft = self.model.propose(history, k, sampler, rng, p_min=self.p_min)
            if len(draft.tokens) < k_min:
                # Stopped early (an unsure token): too short to verify. What it learnt
                # about the draft's continuation counts; the step runs without drafts.
                m = len(draft.tokens)
                self.cont_model.observe(m + self.model.last_stopped, m)
                return best
            return Plan(self.model, draft, rate)
        return best

    def observe(
        self,
        plan: Plan,
        accepted: int,
        verify_seconds: float,
        confidence: float | None = None,
        *,
        rows: int | None = None,
    ) -> None:
        """Learn from a verification: acceptance of the drafter used, the target's
        confidence (top-1 probability of its last token), and timings (only from a
        verification of all ``n + 1`` rows: ``rows`` fewer is one deterministic mode
        stopped early)."""
        n = len(plan.draft.tokens)
        if confidence is not None:
            # A running mean over the first ten steps, then a moving average.
            self._n_confidence += 1
            w = max(0.1, 1.0 / self._n_confidence)
            self.confidence += w * (confidence - self.confidence)
        if self.learn_timings and (rows is None or rows == n + 1):
            self.timings.observe_verify(n + 1, verify_seconds)
        if plan.drafter is self.model and self.model is not None:
            self.acc_model.observe(n, accepted)
            self.cont_model.observe(n + self.model.last_stopped, n)
            if n > 0 and self.learn_timings and self.model.last_token_seconds > 0:
                self.timings.observe_draft(self.model.last_token_seconds)
        elif plan.drafter is self.ngram and n:
            b = self._last_ngram_bucket
            self.acc_ngram[b].observe(n, accepted)
            self.ngram_len[b] += 0.5 * (accepted - self.ngram_len[b])
        elif plan.drafter is self.suffix and self.suffix is not None and n:
            b = self._last_suffix_bucket
            parents = plan.draft.parents
            if parents:
                # A token was rejected when the accepted branch stops above the tree's
                # depth (an approximation: it may have ended at a shorter branch's leaf).
                deepest = max(depths(parents))
                self.acc_suffix[b].observe(accepted + (accepted < deepest), accepted)
                self.suffix_len[b] += 0.5 * (accepted - self.suffix_len[b])
            else:
                self.acc_suffix[b].observe(n, accepted)
                self.suffix_len[b] += 0.5 * (accepted - self.suffix_len[b])
