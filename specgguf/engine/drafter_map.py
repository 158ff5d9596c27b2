"""Drafters by name: one name -> factory map, so that a new kind of drafter is one class
(:class:`specgguf.speculative.drafters.Drafter`) and one entry in :data:`DRAFTERS`.

A factory makes the planner of one generation from what the engine loaded
(:class:`Drafting`) and that generation's settings (:class:`DraftSettings`): a fixed
drafter is a :class:`~specgguf.speculative.planner.FixedPlanner`; auto mode an
:class:`~specgguf.speculative.planner.AutoPlanner` over every drafter that is loaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from specgguf.errors import UsageError
from specgguf.speculative.drafters import ModelDrafter, NgramDrafter, SuffixDrafter
from specgguf.speculative.planner import AUTO_DRAFT_MAX, AutoPlanner, FixedPlanner, Planner, Timings


@dataclasses.dataclass
class Drafting:
    """What the engine loaded for drafting: the draft model's drafter (one per engine: it
    follows the draft model's KV cache across generations), the n-gram settings, and the
    pair's timings for auto mode (measured on first use)."""

    model: ModelDrafter | None
    ngram: tuple[int, int]
    #: suffix matching over everything this engine has seen (kept across generations)
    suffix: SuffixDrafter
    #: the pair's timings, measured on first use, for normal (False) or deterministic
    #: (True) verification batches
    timings: Callable[[bool], Timings]

    def require_model(self) -> ModelDrafter:
        """Raises UsageError when no draft model was loaded."""
        if self.model is None:
            raise UsageError("the model drafter needs a draft model, and none was loaded")
        return self.model


@dataclasses.dataclass(frozen=True)
class DraftSettings:
    """One generation's drafting: the draft length, p_min, deterministic mode, the
    shortest draft worth verifying (``draft_min``; 0: any), and the most branches of a
    token tree (``tree_branches``; 0: chains only)."""

    draft_max: int
    p_min: float = 0.0
    deterministic: bool = False
    draft_min: int = 0
    tree_branches: int = 0


PlannerFactory = Callable[[Drafting, DraftSettings], Planner]


def _auto(d: Drafting, s: DraftSettings) -> Planner:
    return AutoPlanner(
        d.timings(s.deterministic), model=d.model, ngram=NgramDrafter(*d.ngram), suffix=d.suffix,
        draft_max=s.draft_max, draft_max_model=min(AUTO_DRAFT_MAX, s.draft_max), p_min=s.p_min,
        draft_min=s.draft_min,
        tree_branches=0 if s.deterministic else s.tree_branches,
    )  # fmt: skip


#: Drafter kind -> the planner for one generation.
DRAFTERS: dict[str, PlannerFactory] = {
    "auto": _auto,
    "model": lambda d, s: FixedPlanner(
        d.require_model(), s.draft_max, p_min=s.p_min, draft_min=s.draft_min
    ),
    "ngram": lambda d, s: FixedPlanner(NgramDrafter(*d.ngram), s.draft_max, draft_min=s.draft_min),
    "suffix": lambda d, s: FixedPlanner(
        d.suffix,
        s.draft_max,
        p_min=s.p_min,
        draft_min=s.draft_min,
        tree_branches=0 if s.deterministic else s.tree_branches,
    ),
    "none": lambda d, s: FixedPlanner(None, 0),
}
