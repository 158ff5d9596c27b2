"""Acceptance estimates: per-token acceptance rates from exponentially decaying counts,
blended with a prior, and their one-standard-error bounds."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from specgguf.speculative.tuning import AUTO_TUNING, AutoTuning


@dataclasses.dataclass
class Acceptance:
    """Per-token acceptance rate of one drafter, from exponentially decaying counts: a
    verification adds its accepted drafts as successes and its first rejection as a
    failure. The counts are blended with a prior worth ``weight`` trials; the prior can be
    passed at each reading (auto mode passes one scaled by the target's recent confidence,
    which tracks acceptance closely), and :meth:`tick` fades old observations at every
    step, used or not, so that the estimate follows the text. The defaults are
    :data:`~specgguf.speculative.tuning.AUTO_TUNING`'s."""

    prior: float = AUTO_TUNING.confidence_start
    weight: float = AUTO_TUNING.prior_trials
    decay: float = AUTO_TUNING.decay
    fade: float = AUTO_TUNING.fade
    successes: float = 0.0
    trials: float = 0.0
    #: the prior's weight fades with the counts at each verification, down to this
    #: share of ``weight`` (1: it never fades): where verifications keep saying the
    #: prior was wrong, the estimate can fall below the floor a fixed-weight prior sets
    #: (about ``prior * weight / (weight + 1 / (1 - decay))``)
    prior_floor: float = 1.0
    _faded: float = dataclasses.field(default=1.0, init=False, repr=False)

    def rate_with(self, prior: float | None = None, weight: float | None = None) -> float:
        """The counts blended with ``prior`` (default: :attr:`prior`) worth ``weight``
        trials (default: :attr:`weight`, faded as :attr:`prior_floor` says; a weight
        given is used as it is)."""
        p = self.prior if prior is None else prior
        w = self.prior_weight if weight is None else weight
        return (self.successes + p * w) / (self.trials + w)

    @property
    def prior_weight(self) -> float:
        """The prior's weight now, in trials: :attr:`weight`, faded as
        :attr:`prior_floor` says (what a standard error of :attr:`rate` counts)."""
        return self.weight * self._faded

    @classmethod
    def of(cls, tuning: AutoTuning, prior: float | None = None) -> Acceptance:
        """Empty counts with ``tuning``'s prior weight, decay and fade, and ``prior``
        (default: the confidence assumed before any step)."""
        p = tuning.confidence_start if prior is None else prior
        return cls(p, tuning.prior_trials, tuning.decay, tuning.fade)

    @classmethod
    def fading(cls, tuning: AutoTuning, prior: float) -> Acceptance:
        """As :meth:`of`, with a prior that fades to ``tuning.prior_floor`` of its weight."""
        return cls(prior, tuning.prior_trials, tuning.decay, tuning.fade,
                   prior_floor=tuning.prior_floor)  # fmt: skip

    @property
    def rate(self) -> float:
        return self.rate_with(None)

    def observe(self, accepted: int, rejected: bool) -> None:
        """A verification: ``accepted`` draft tokens kept, then a rejection or not (the end
        of the draft). Older counts fade by ``decay`` first; nothing drafted teaches
        nothing."""
        if accepted <= 0 and not rejected:
            return
        self._faded = max(self.prior_floor, self._faded * self.decay)
        self.successes = self.decay * self.successes + accepted
        self.trials = self.decay * self.trials + accepted + rejected

    def tick(self) -> None:
        """A step passed: fade the counts by ``fade``."""
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


def tick_all(estimates: Iterable[Acceptance]) -> None:
    """:meth:`Acceptance.tick` of each of ``estimates``, the same arithmetic without a
    call each (an arm fades a dozen of them at every step)."""
    for acc in estimates:
        f = acc.fade
        acc.successes *= f
        acc.trials *= f


def upper(a: float, trials: float, prior_trials: float) -> float:
    """A rate plus one standard error (the prior counted as ``prior_trials`` trials)."""
    return min(1.0, a + math.sqrt(a * (1.0 - a) / (trials + prior_trials)))


def lower(a: float, trials: float, z: float, prior_trials: float) -> float:
    """A rate less ``z`` standard errors (the prior counted as ``prior_trials`` trials)."""
    return max(0.0, a - z * math.sqrt(a * (1.0 - a) / (trials + prior_trials)))
