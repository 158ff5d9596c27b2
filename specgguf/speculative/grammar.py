"""Constrained decoding in the speculative loop: a grammar decides which tokens may come
next, at every position a verification step decides.

A :class:`Constraint` follows the committed output. At each step the loop

1. drafts without a drafter where the grammar allows exactly one continuation
   (:meth:`Constraint.forced`: JSON keys, punctuation, fixed words; "jump-forward"
   decoding, as SGLang calls it, ``compute_ff_tokens`` in llguidance);
2. otherwise cuts the drafter's proposal before the first token the grammar forbids
   (:meth:`Constraint.valid_prefix`): such a token could never be accepted, and its row
   would be wasted;
3. masks every row of the verification batch with the tokens the grammar allows after the
   draft's prefix up to that row (:meth:`Constraint.masks`), so that acceptance judges the
   draft against the constrained target: greedy, the target's argmax among allowed tokens;
   sampled, the target's distribution renormalized over them (as llama.cpp's grammar
   sampler does, before the other samplers);
4. advances the grammar over the committed tokens (:meth:`Constraint.commit`).

Greedy output is therefore the constrained target's own, token for token, whatever the
drafter. Sampled output keeps the constrained target's distribution exactly because drafts
are point masses under a grammar (Leviathan et al. 2023, section 2.3: a rejected point
mass x is replaced by a draw from p without x; a forbidden x has p(x) = 0, so cutting the
draft there and drawing from p is the same rule).

This module holds the interface and the request's description; the implementation over a
grammar library lives in the engine (:mod:`specgguf.engine.constraints`), so that the loop
is tested with any constraint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt

GrammarKind = Literal["json_object", "json_schema", "gbnf", "lark", "regex"]

#: What each kind of :class:`GrammarSpec` holds in ``text``.
GRAMMAR_KINDS: dict[str, str] = {
    "json_object": "nothing (any JSON object)",
    "json_schema": "a JSON Schema, as JSON text",
    "gbnf": "a grammar in llama.cpp's GBNF",
    "lark": "a grammar in llguidance's Lark syntax",
    "regex": "a regular expression the whole output must match",
}


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """A constraint on a generation's output, as the caller gave it.

    ``kind``: one of :data:`GRAMMAR_KINDS`; ``text``: the schema (JSON text), grammar or
    regular expression ("" for ``json_object``). Nothing is checked here: the engine
    compiles it before any token is generated and raises
    :class:`~specgguf.errors.GrammarError` for what cannot be used.
    """

    kind: GrammarKind
    text: str = ""


class Constraint(Protocol):
    """The grammar's state after the prompt and the committed output of one generation.

    Token ids are the target's; masks are ``bool[rows, n_vocab]``, True where a token is
    allowed. End-of-generation tokens are allowed exactly where the grammar is complete.
    """

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens that the grammar alone allows next, in order (empty when
        more than one continuation is possible)."""
        ...

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (a draft after the committed output) the grammar allows,
        from the first."""
        ...

    def masks(self, draft: Sequence[int]) -> npt.NDArray[np.bool_]:
        """``bool[len(draft) + 1, n_vocab]``: row i holds the tokens allowed after the
        committed output and ``draft[:i]``. ``draft`` must be a valid prefix."""
        ...

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance over ``tokens``, the step's committed output (each one allowed where it
        stands; an end-of-generation token is not passed)."""
        ...

    @property
    def done(self) -> bool:
        """Whether the grammar allows nothing more but the end of generation."""
        ...
