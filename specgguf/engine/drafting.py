"""Drafters by name: one name -> factory map, so that a new kind of drafter is one class
(:class:`specgguf.spec.drafters.Drafter`) and one entry in :data:`DRAFTERS`.

A factory makes the planner of one generation from what the engine loaded
(:class:`Drafting`), the draft length and ``p_min`` of that generation: a fixed drafter is
a :class:`~specgguf.spec.planner.FixedPlanner`; auto mode an
:class:`~specgguf.spec.planner.AutoPlanner` over every drafter that is loaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from specgguf.errors import UsageError
from specgguf.spec.drafters import ModelDrafter, NgramDrafter
from specgguf.spec.planner import AUTO_DRAFT_MAX, AutoPlanner, FixedPlanner, Planner, Timings


@dataclasses.dataclass
class Drafting:
    """What the engine loaded for drafting: the draft model's drafter (one per engine: it
    follows the draft model's KV cache across generations), the n-gram settings, and the
    pair's timings for auto mode (measured on first use)."""

    model: ModelDrafter | None
    ngram: tuple[int, int]
    timings: Callable[[], Timings]

    def require_model(self) -> ModelDrafter:
        """Raises UsageError when no draft model was loaded."""
        if self.model is None:
            raise UsageError("the model drafter needs a draft model, and none was loaded")
        return self.model


PlannerFactory = Callable[[Drafting, int, float], Planner]


def _auto(d: Drafting, draft_max: int, p_min: float) -> Planner:
    return AutoPlanner(
        d.timings(), model=d.model, ngram=NgramDrafter(*d.ngram), draft_max=draft_max,
        draft_max_model=min(AUTO_DRAFT_MAX, draft_max), p_min=p_min,
    )  # fmt: skip


#: Drafter kind -> the planner for one generation, given the draft length and p_min.
DRAFTERS: dict[str, PlannerFactory] = {
    "auto": _auto,
    "model": lambda d, k, p: FixedPlanner(d.require_model(), k, p_min=p),
    "ngram": lambda d, k, p: FixedPlanner(NgramDrafter(*d.ngram), k),
    "none": lambda d, k, p: FixedPlanner(None, 0),
}
