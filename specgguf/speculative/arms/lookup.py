"""The arms of the lookup drafters (n-gram lookup, suffix matching): free drafts judged by
the length of the match they continue, learnt from even when not drafted (shadow drafts);
suffix matching's token trees."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from specgguf.speculative.arms.base import Offer, Step, StepPlan
from specgguf.speculative.costmodel import Timings, best_k, best_tree
from specgguf.speculative.draft import Draft, Drafter, TreeDrafter
from specgguf.speculative.drafters.ngram import LONG_MATCH
from specgguf.speculative.estimates import Acceptance, lower, tick_all
from specgguf.speculative.tree import depths, first_branch
from specgguf.speculative.tuning import AUTO_TUNING, AutoTuning


@dataclasses.dataclass
class Shadow:
    """A lookup draft that was not verified (see :meth:`LookupArm._check_shadow`)."""

    start: int  # the history index of its first token
    tokens: list[int]
    bucket: int  # the estimate it was proposed from (LookupArm.key)
    accepted: int = 0  # tokens the target has produced as proposed so far
    counted: bool = False  # whether any of its evidence has been counted


class LookupArm:
    """A lookup drafter as auto mode weighs it: its drafts cost nothing to make, and are
    judged by the length of the match they continue (the buckets of
    :attr:`AutoTuning.lookup_priors`), each bucket with its own acceptance estimate and mean
    accepted length.

    A bucket's acceptance prior is its share of the target's confidence, at most
    ``lookup_prior_max`` (``copy_prior_max`` for a copy: a match of ``copy_match`` tokens,
    or one that resumes a copy after an edit); where ``copies`` (n-gram lookup in the text
    itself) and decoding is greedy, a match of ``LONG_MATCH`` tokens is a long copy, with
    its own prior ``long_copy_prior`` worth ``long_copy_weight`` trials. Below a copy, each
    bucket has a twin for matches whose earlier occurrences went on with the draft's first
    token less than ``lookup_share_min`` of the time (as the drafter counts it:
    :meth:`key`), with ``varied_prior`` of the bucket's prior. Below a copy, a bucket (or
    twin) is judged at its estimate less ``lookup_z`` standard errors, fewer where draft
    rows are cheap (:meth:`z`). A draft is at most ``cap_slope`` times its bucket's mean
    accepted length plus ``cap_base`` long (starting at ``first_length``, or the copy
    caps), so that it grows while drafts are accepted whole and shrinks when they break
    early; within that, its length is the cost model's best
    (:func:`~specgguf.speculative.costmodel.best_k`, no draft cost).

    A proposal that is not drafted becomes a shadow draft: its first ``shadow_len`` tokens
    are checked against the tokens the target goes on to produce (:meth:`_check_shadow`).

    Args:
        drafter: the lookup drafter (its drafts carry ``match`` and ``resumed``).
        copies: whether its long matches are copies of the text itself (n-gram lookup);
            suffix matching's may come from another generation.
    """

    def __init__(self, drafter: Drafter, *, copies: bool = True) -> None:
        self.drafter = drafter
        self.name = drafter.name
        self.copies = copies
        self._fresh(AUTO_TUNING)

    def first_length(self, tuning: AutoTuning) -> float:
        """A bucket's mean accepted length before any draft (copies aside)."""
        return tuning.ngram_first_length

    def reset(self, timings: Timings, tuning: AutoTuning) -> bool:
        self.drafter.reset()
        self._fresh(tuning)
        return True

    def _fresh(self, tuning: AutoTuning) -> None:
        """Every estimate at its prior, no shadow."""
        self.tuning = t = tuning
        first = self.first_length(t)
        # a bucket below a copy has a twin, keyed -bucket, for matches whose earlier
        # continuations varied (:meth:`key`)
        keys = [*t.buckets, *(-b for b in t.buckets if 0 < b < t.copy_match)]
        self.rates = {b: Acceptance.of(t) for b in keys}
        self.lengths = {b: t.first_length(abs(b), first, long_copies=self.copies) for b in keys}
        self.shadow: Shadow | None = None
        # this step's proposal, as a shadow would watch it: (tokens, bucket)
        self._proposal: tuple[list[int], int] | None = None

    def tick(self) -> None:
        tick_all(self.rates.values())

    def offer(self, step: Step) -> Offer | None:
        self._check_shadow(step.history)
        self._proposal = None
        return self._offer(step)

    def _offer(self, step: Step) -> Offer | None:
        t = self.tuning
        cand = self.drafter.propose(step.history, step.k_max, step.sampler, step.rng)
        if len(cand.tokens) < step.k_min:
            return None
        bucket = self.key(cand)
        long_copy = self.copies and step.sampler.greedy
        a = self.estimate(bucket, step.confidence, long_copy=long_copy, z=self.z(step))
        cap = min(len(cand.tokens), max(step.k_min, t.cap(self.lengths[bucket])))
        self._proposal = (cand.tokens[: min(cap, t.shadow_len)], bucket)
        k, rate = best_k(a, step.timings, cap, cached=step.cached, draft_cost=0.0,
                         k_min=step.k_min, greedy=step.sampler.greedy)  # fmt: skip
        return Offer(self, k, rate, cand.head(k), bucket)

    def key(self, draft: Draft) -> int:
        """The estimate that judges a lookup ``draft``: the bucket of its match length (a
        resumed copy's at least ``copy_match``), negated (its twin) below a copy where
        ``draft.probs[0]``, the share the drafter counted for the first token, is below
        ``lookup_share_min``. N-gram lookup counts the latest unbroken run of occurrences
        followed by that token over all of them; suffix matching the majority's count over
        the latest occurrences (a statistic like llama.cpp's lookup cache's,
        common/ngram-cache.cpp). Such a draft's first token is accepted about a third as
        often (``AutoTuning.varied_prior``; docs/performance.md), so it learns apart. Suffix
        trees keep their bucket: their node estimates already carry the shares."""
        t = self.tuning
        bucket = t.bucket(max(draft.match, t.copy_match) if draft.resumed else draft.match)
        if 0 < bucket < t.copy_match and draft.probs and draft.probs[0] < t.lookup_share_min:
            return -bucket
        return bucket

    def z(self, step: Step) -> float:
        """How many standard errors short of its estimate a bucket below a copy is judged
        at this step: ``lookup_z`` where a draft row costs ``lookup_z_row`` of a lone row
        (beside other sequences: of this sequence's share of the batch) or more
        (:func:`~specgguf.speculative.costmodel.row_share` of ``explore_k`` rows, at the
        step's depth), in proportion where rows cost less. A draft judged too
        hopefully costs its rows: nearly a step per token deep in a context on a CPU whose
        batches cost their rows, next to nothing where a batch costs what a lone row does,
        and there a pessimistic estimate only forgoes drafts that pay."""
        t = self.tuning
        if t.lookup_z_row <= 0.0:
            return t.lookup_z
        return t.lookup_z * min(1.0, step.explore_share / t.lookup_z_row)

    def estimate(
        self, bucket: int, confidence: float, *, long_copy: bool, z: float | None = None
    ) -> float:
        """The per-token acceptance a draft from ``bucket`` is judged at (see the class;
        ``long_copy``: a long match is a long copy; ``z``: the standard errors below a copy,
        default ``lookup_z``)."""
        t = self.tuning
        acc = self.rates[bucket]
        long = long_copy and bucket >= LONG_MATCH
        a = acc.rate_with(self.prior(bucket, confidence, long_copy=long_copy),
                          t.long_copy_weight if long else None)  # fmt: skip
        if bucket < t.copy_match:
            a = lower(a, acc.trials, t.lookup_z if z is None else z, t.prior_trials)
        return a

    def prior(self, bucket: int, confidence: float, *, long_copy: bool) -> float:
        """A bucket's acceptance before evidence (see the class)."""
        t = self.tuning
        if bucket >= LONG_MATCH and long_copy:
            return t.long_copy_prior
        if bucket < 0:  # a twin: a match whose continuations varied
            return t.varied_prior * self.prior(-bucket, confidence, long_copy=long_copy)
        cap = t.copy_prior_max if bucket >= t.copy_match else t.lookup_prior_max
        return min(cap, t.lookup_prior(bucket) * confidence)

    def settle(self, step: Step, taken: Offer | None) -> None:
        if self._proposal is None:
            return
        if taken is not None and taken.arm is self:
            # its draft is verified now, and teaches the same positions: the shadow's
            # tokens counted so far stay counted, the rest are the draft's
            self.shadow = None
        elif self.shadow is None:
            tokens, bucket = self._proposal
            self.shadow = Shadow(len(step.history), tokens, bucket)

    def draft(self, offer: Offer, step: Step) -> Draft:
        assert offer.draft is not None
        return offer.draft

    def observe(self, plan: StepPlan, accepted: int, rejected: bool) -> None:
        b = plan.bucket
        self.rates[b].observe(accepted, rejected)
        self.lengths[b] += self.tuning.length_weight * (accepted - self.lengths[b])

    def _check_shadow(self, history: Sequence[int]) -> None:
        """Learn from the lookup draft that was proposed but not verified (the shadow
        draft), token by token as the target produces the tokens it proposed: each one
        it produced counts as an accepted draft token, the first it did not as a
        rejection, which ends the shadow (as does reaching its end).

        The evidence is free, and it is what a verification would have found: a greedy
        target accepts a draft token exactly when it produces that token, and a sampling
        one accepts a point-mass draft token with its probability p(token) (modified
        rejection sampling, Leviathan et al. 2023, section 2.3), the probability that it
        samples that token. So a bucket's estimate follows the text without paying for
        drafts that lose.

        The counts are those :meth:`Acceptance.observe` would make for the verification,
        faded once at the shadow's first evidence; as they arrive over several steps,
        each step's tick has faded the older counts a little more."""
        shadow = self.shadow
        if shadow is None:
            return
        seen = history[shadow.start : shadow.start + len(shadow.tokens)]
        if not seen:
            return
        m = shadow.accepted
        while m < len(seen) and seen[m] == shadow.tokens[m]:
            m += 1
        rejected = m < len(seen)
        acc = self.rates[shadow.bucket]
        if not shadow.counted:  # its first evidence: older counts fade, as in observe
            acc.decay_once()
            shadow.counted = True
        acc.add(m - shadow.accepted, rejected)
        shadow.accepted = m
        w, b = self.tuning.length_weight, shadow.bucket
        if rejected:
            self.shadow = None
            self.lengths[b] += w * (m - self.lengths[b])
        elif m == len(shadow.tokens):
            # cut at its end, not broken: a lower bound of the accepted length, which may
            # raise the bucket's mean but never lowers it
            self.shadow = None
            self.lengths[b] += w * max(0.0, m - self.lengths[b])


class SuffixArm(LookupArm):
    """Suffix matching as auto mode weighs it: its chains as a lookup's (no long copies:
    its long matches may come from another generation); with ``tree_branches`` of 2 or
    more, on greedy steps, its tree of the continuations seen instead, cut to the size the
    cost model expects to pay most (:func:`~specgguf.speculative.costmodel.best_tree`).

    A node's acceptance is estimated as its share product times a^depth, a the bucket's
    per-token rate; at most ``k_max`` nodes, and at most the bucket's cap of suffix chains,
    so that a match nothing has confirmed yet costs a short batch when it is wrong. A tree
    not drafted is watched along its first branch."""

    def __init__(self, drafter: TreeDrafter, *, tree_branches: int = 0) -> None:
        self.trees = drafter
        self.tree_branches = tree_branches if tree_branches >= 2 else 0
        super().__init__(drafter, copies=False)

    def first_length(self, tuning: AutoTuning) -> float:
        return tuning.suffix_first_length

    def _offer(self, step: Step) -> Offer | None:
        if not (self.tree_branches and step.sampler.greedy):
            return super()._offer(step)
        t = self.tuning

        def wanted(match: int) -> int:  # the nodes read below, for a match this long
            return min(step.k_max, max(step.k_min, t.cap(self.lengths[t.bucket(match)])))

        tree = self.trees.propose_tree(step.history, step.k_max, self.tree_branches,
                                       wanted=wanted, branch=t.shadow_len)  # fmt: skip
        if len(tree.tokens) < step.k_min or tree.parents is None or not tree.probs:
            return None
        bucket = t.bucket(tree.match)
        a = self.estimate(bucket, step.confidence, long_copy=False, z=self.z(step))
        cap = max(step.k_min, t.cap(self.lengths[bucket]))
        est = [p * a**d for p, d in zip(tree.probs, depths(tree.parents), strict=True)]
        m, rate = best_tree(est[: min(step.k_max, cap)], step.timings, cached=step.cached,
                            k_min=step.k_min)  # fmt: skip
        branch = [tree.tokens[j] for j in first_branch(tree.parents)]
        self._proposal = (branch[: t.shadow_len], bucket)
        cut = Draft(tree.tokens[:m], parents=tree.parents[:m])
        return Offer(self, m, rate, cut, bucket)
