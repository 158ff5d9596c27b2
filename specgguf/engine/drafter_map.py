"""Drafters by name: one name -> factory map, so that a new kind of drafter is one class
(:class:`specgguf.speculative.draft.Drafter`) and one entry in :data:`DRAFTERS`.

A factory makes the drafter's arm for one generation (:mod:`specgguf.speculative.arms`)
from what the engine loaded (:class:`Drafting`) and that generation's settings
(:class:`DraftSettings`), or None where the drafter needs a draft model and none was
loaded. Auto mode
is an :class:`~specgguf.speculative.planner.AutoPlanner` over the arms of every entry, in
the map's order (on a tie, the earlier wins: free drafters first); a fixed drafter
(``--drafter NAME``) is a :class:`~specgguf.speculative.planner.FixedPlanner` over the
drafter of its arm.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from specgguf.errors import UsageError
from specgguf.speculative.arms import Arm, LookupArm, ModelArm, SuffixArm
from specgguf.speculative.costmodel import Timings
from specgguf.speculative.drafters import ModelDrafter, MtpDrafter, NgramDrafter, SuffixDrafter
from specgguf.speculative.planner import AutoPlanner, FixedPlanner, Planner
from specgguf.speculative.tuning import AUTO_TUNING, AutoTuning


@dataclasses.dataclass
class Drafting:
    """What a sequence drafts with: the draft model's drafter (one per sequence: it
    follows the draft model's KV cache across generations), the n-gram and suffix
    drafters (their indexes kept across generations), and the pair's timings for auto
    mode (measured on first use)."""

    model: ModelDrafter | None
    #: n-gram lookup over the text so far (its index extended by a next turn's text)
    ngram: NgramDrafter
    #: suffix matching over everything this engine has seen (kept across generations)
    suffix: SuffixDrafter
    #: the pair's timings, measured on first use, for normal (False) or deterministic
    #: (True) verification batches
    timings: Callable[[bool], Timings]
    #: auto mode's tuning
    tuning: AutoTuning = AUTO_TUNING
    #: the target's multi-token-prediction layers, when loaded
    mtp: MtpDrafter | None = None


@dataclasses.dataclass(frozen=True)
class DraftSettings:
    """One generation's drafting: the draft length, p_min, deterministic mode, the
    shortest draft worth verifying (``draft_min``; 0: any), the most branches of a
    token tree (``tree_branches``; 0: chains only), and whether the drafter runs under
    auto mode (``auto``: a draft model then drafts at most ``draft_max_model``)."""

    draft_max: int
    p_min: float = 0.0
    deterministic: bool = False
    draft_min: int = 0
    tree_branches: int = 0
    auto: bool = False

    @property
    def trees(self) -> int:
        """The most branches of a tree this generation verifies (none in deterministic
        mode, whose verification batches have fixed shapes)."""
        return 0 if self.deterministic else self.tree_branches


ArmFactory = Callable[[Drafting, DraftSettings], Arm | None]


def _model(d: Drafting, s: DraftSettings) -> Arm | None:
    if d.model is None:
        return None
    draft_max = min(d.tuning.draft_max_model, s.draft_max) if s.auto else s.draft_max
    return ModelArm(d.model, draft_max=draft_max, p_min=s.p_min)


def _mtp(d: Drafting, s: DraftSettings) -> Arm | None:
    if d.mtp is None:
        return None
    draft_max = min(d.tuning.draft_max_model, s.draft_max) if s.auto else s.draft_max
    return ModelArm(d.mtp, draft_max=draft_max, p_min=s.p_min)


#: Drafter name -> its arm for one generation, in the order auto mode weighs them.
DRAFTERS: dict[str, ArmFactory] = {
    "ngram": lambda d, s: LookupArm(d.ngram),
    "suffix": lambda d, s: SuffixArm(d.suffix, tree_branches=s.trees),
    "model": _model,
    "mtp": _mtp,
}


def drafter_kinds() -> tuple[str, ...]:
    """What ``--drafter`` takes: auto mode, a drafter of :data:`DRAFTERS`, or none."""
    return ("auto", *sorted(DRAFTERS), "none")


def make_planner(kind: str, d: Drafting, s: DraftSettings) -> Planner:
    """The planner of one generation for drafter ``kind`` (see :func:`drafter_kinds`).

    Raises:
        UsageError: an unknown kind, or a drafter that cannot run here (the model drafter
            without a loaded draft model, the MTP drafter without MTP layers loaded).
    """
    if kind == "none":
        return FixedPlanner(None, 0)
    if kind == "auto":
        s = dataclasses.replace(s, auto=True)
        arms = [arm for make in DRAFTERS.values() if (arm := make(d, s)) is not None]
        return AutoPlanner(d.timings(s.deterministic), arms, draft_max=s.draft_max,
                           draft_min=s.draft_min, tuning=d.tuning)  # fmt: skip
    if kind not in DRAFTERS:
        raise UsageError(f"the drafter must be {', '.join(drafter_kinds())}, not {kind!r}")
    arm = DRAFTERS[kind](d, s)
    if arm is None:
        needs = "the target's MTP layers" if kind == "mtp" else "a draft model"
        raise UsageError(f"the {kind} drafter needs {needs}, and none was loaded")
    return FixedPlanner(arm.drafter, s.draft_max, p_min=s.p_min, draft_min=s.draft_min,
                        tree_branches=s.trees)  # fmt: skip
