"""What a generation did: counters and timings, overall and per drafter."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class DrafterStats:
    """What one drafter did in a generation: verification ``steps`` it drafted for (for
    "none": steps without drafts), tokens ``drafted`` and ``accepted``."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    def add(self, other: DrafterStats) -> None:
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted


@dataclasses.dataclass
class GenerationStats:
    """Counters and timings of one generation (seconds of wall time).

    ``drafted``: draft tokens sent to verification; ``accepted``: those the target kept;
    ``steps``: target verification passes (one per generated token without a drafter);
    ``rejected_steps``: steps where a draft token was rejected (for a token tree: at the
    last node accepted); ``tree_steps``: steps that verified a token tree of several
    branches (their ``drafted`` counts every node); ``grammar_cut``: draft tokens a grammar
    cut before verification (not in ``drafted``; the grammar's own forced tokens are drafts
    of the drafter "grammar"); ``constrained``: the output followed a grammar;
    ``prompt_cached``: prompt tokens the target's cache held from earlier generations (not
    read again; ``prompt_tokens`` counts them too, ``prompt_read`` the rest);
    ``draft_max``: the largest draft length this generation could use; ``last_draft``,
    ``last_drafter``: the latest step's; ``plan_seconds``: the planner's own part of
    :attr:`python_seconds` (choosing and learning; its drafters' time is theirs). Several
    generations' statistics pool with :meth:`add`.
    """

    prompt_tokens: int = 0
    prompt_cached: int = 0
    prompt_seconds: float = 0.0
    generated: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    plan_seconds: float = 0.0
    draft_max: int = 0
    last_draft: int = 0
    last_drafter: str = "none"
    rejected_steps: int = 0
    tree_steps: int = 0
    grammar_cut: int = 0
    constrained: bool = False
    by_drafter: dict[str, DrafterStats] = dataclasses.field(default_factory=dict)

    @property
    def prompt_read(self) -> int:
        """Prompt tokens evaluated by this generation (its last one always is)."""
        return self.prompt_tokens - self.prompt_cached

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean draft tokens accepted per verification step."""
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of generation (prompt processing excluded)."""
        return self.generated / self.seconds if self.seconds > 0 else 0.0

    @property
    def python_seconds(self) -> float:
        """Generation time spent outside target and draft evaluation."""
        return max(0.0, self.seconds - self.target_seconds - self.draft_seconds)

    def add(self, other: GenerationStats) -> None:
        """Pool ``other`` into these counters and times (``draft_max`` becomes the larger;
        ``last_*`` are left as they are)."""
        for f in ("prompt_tokens", "prompt_cached", "prompt_seconds", "generated", "steps",
                  "drafted", "accepted", "seconds", "target_seconds", "draft_seconds",
                  "plan_seconds", "rejected_steps", "tree_steps", "grammar_cut"):  # fmt: skip
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.draft_max = max(self.draft_max, other.draft_max)
        self.constrained = self.constrained or other.constrained
        for name, row in other.by_drafter.items():
            self.by_drafter.setdefault(name, DrafterStats()).add(row)

    def as_dict(self) -> dict[str, Any]:
        """JSON-able: every field and rate; ``by_drafter`` maps a drafter's name to
        ``[steps, drafted, accepted]``."""
        d = dataclasses.asdict(self)
        d["by_drafter"] = {
            name: [r.steps, r.drafted, r.accepted] for name, r in self.by_drafter.items()
        }
        d.update(
            acceptance_rate=round(self.acceptance_rate, 4),
            mean_accepted=round(self.mean_accepted, 4),
            tokens_per_s=round(self.tokens_per_s, 3),
            python_seconds=round(self.python_seconds, 4),
        )
        for k in ("prompt_seconds", "seconds", "target_seconds", "draft_seconds", "plan_seconds"):
            d[k] = round(d[k], 4)
        return d

    def record_step(
        self, drafter: str, drafted: int, kept: int, *, rejected: bool, tree: bool
    ) -> None:
        """Count one verification step: ``drafted`` tokens from ``drafter`` ("none": no
        drafts), ``kept`` of them in the output, ``rejected``: a rejected draft token was
        replaced by the target's own in the output, ``tree``: a token tree."""
        self.steps += 1
        self.drafted += drafted
        self.accepted += kept
        self.rejected_steps += rejected
        self.tree_steps += tree
        self.last_draft = drafted
        self.last_drafter = drafter
        row = self.by_drafter.get(drafter)
        if row is None:  # (setdefault would build a DrafterStats at every step)
            row = self.by_drafter[drafter] = DrafterStats()
        row.steps += 1
        row.drafted += drafted
        row.accepted += kept
