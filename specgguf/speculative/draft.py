"""What a drafter proposes (:class:`Draft`), what a drafter is (:class:`Drafter`), and what the
loop needs from a model context (:class:`Evaluator`, :class:`TargetEvaluator`) and from the
target's vocabulary (:class:`Vocabulary`).

A draft is deterministic (``dists is None``: lookups, or any greedy draft) or carries the
draft distribution q of each token (sampled drafts from a model), as modified rejection
sampling needs. It also carries what its drafter knows about it, so that auto mode can
weigh it without asking the drafter afterwards: the length of a lookup's match, whether it
resumes a copy, whether a model's draft stopped at an unsure token, and what its tokens
cost.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from specgguf.speculative.sampling import Distribution, SamplerParams
from specgguf.speculative.tree import depths


@dataclasses.dataclass
class Draft:
    """Proposed token ids and what the drafter knows about them.

    Args:
        tokens: the proposed ids.
        dists: for sampled model drafts, ``dists[i]`` is the distribution q ``tokens[i]``
            was drawn from; None for deterministic drafts.
        parents: for a token tree (:mod:`specgguf.speculative.tree`), the index of each
            token's parent in ``tokens``, -1 for the last committed token (parents come
            first); None for a chain.
        probs: the drafter's estimate per token that the target reaches and keeps it:
            for a suffix tree, the product of the shares of earlier occurrences along the
            token's branch, which the planner calibrates; for a lookup chain, shares the
            same way (n-gram lookup counts the first token's only, repeated so that
            :meth:`head` keeps the lengths aligned), of which the planner reads the
            first (``LookupArm.key``).
        match: for a lookup, the length in tokens of the match it continues (0: none).
        resumed: for n-gram lookup, whether the match resumes a copy broken by an edit.
        stopped: for a model, whether drafting stopped at a token below ``p_min``, or
            where its path probability fell below ``p_path_min``, before the length asked
            for.
        token_seconds: for a model, its latest measurement of seconds per drafted token
            (catch-up evaluation excluded; 0: none yet).
    """

    tokens: list[int]
    dists: list[Distribution] | None = None
    parents: list[int] | None = None
    probs: list[float] | None = None
    match: int = 0
    resumed: bool = False
    stopped: bool = False
    token_seconds: float = 0.0

    def head(self, k: int) -> Draft:
        """The first ``k`` tokens of a chain, with their distributions, estimates and the
        drafter's metadata."""
        # (built directly: dataclasses.replace costs as much as the rest of a lookup offer)
        return Draft(
            self.tokens[:k],
            None if self.dists is None else self.dists[:k],
            self.parents,
            None if self.probs is None else self.probs[:k],
            self.match,
            self.resumed,
            self.stopped,
            self.token_seconds,
        )

    @property
    def depth(self) -> int:
        """The longest branch in tokens (a chain's length): a verification that accepts
        fewer tokens than this rejected one."""
        if self.parents:
            return max(depths(self.parents))
        return len(self.tokens)


class Evaluator(Protocol):
    """What drafting and calibration need from a model context (see
    ``backend.LlamaContext``): evaluate tokens at the next positions and read logits, roll
    the KV cache back.

    ``n_outputs_max``: the most rows of one evaluation that return logits (a verification
    of K + 1 tokens needs K + 1). ``eval_seconds``: wall time spent evaluating, in seconds.
    ``rollback_room``: how many positions a rollback can drop now without decoding the
    rest again (None: any; a recurrent state's snapshots of the latest evaluation: see
    ``backend.LlamaContext``). ``scratch()``: evaluations inside it are dropped whole at
    its end (contexts made for it).
    """

    n_ctx: int
    n_batch: int
    n_vocab: int
    n_outputs_max: int
    eval_seconds: float

    @property
    def n_past(self) -> int: ...

    @property
    def rollback_room(self) -> int | None: ...

    def eval(
        self, tokens: Sequence[int], *, logits: Literal["last", "all", "none"] = "last"
    ) -> npt.NDArray[np.float32]: ...

    def rollback(self, n_keep: int) -> None: ...

    def scratch(self) -> AbstractContextManager[None]: ...

    def prompt(
        self, tokens: Sequence[int], *, exact: bool = False, media: Sequence[object] = ()
    ) -> None:
        """Append a prompt's tokens, without logits (a recurrent state keeps checkpoints
        of itself on the way; ``exact``: read as deterministic mode reads; ``media``: read
        at their positions instead of the tokens there)."""
        ...


class TargetEvaluator(Evaluator, Protocol):
    """What the loop needs from the target's context: an :class:`Evaluator` that also
    verifies token trees in one batch (``eval_tree``, ``keep_tree_path``; at most
    ``tree_branches`` leaves, 0: none, chains only) and, in deterministic mode, decodes in
    calls of at most ``rows_per_decode`` rows (None: any number; changed only through
    ``set_rows_per_decode``, which validates it). ``rollback_max``: the most positions a
    rollback right after an evaluation can drop without decoding the rest again (None:
    any; a recurrent state's snapshots per sequence), which bounds the draft length.
    What it holds outlives a generation: the next one keeps the prefix its prompt shares
    with it (:meth:`reuse`) and reads the rest (:meth:`prompt`)."""

    @property
    def tree_branches(self) -> int: ...

    @property
    def rollback_max(self) -> int | None: ...

    @property
    def rows_per_decode(self) -> int | None: ...

    def set_rows_per_decode(self, rows: int | None) -> None: ...

    def eval_tree(
        self, root: int, tokens: Sequence[int], parents: Sequence[int]
    ) -> npt.NDArray[np.float32]: ...

    def keep_tree_path(self, path: Sequence[int]) -> None: ...

    def reuse(
        self, tokens: Sequence[int], *, exact: bool = False, media: Sequence[object] = ()
    ) -> int:
        """Keep the longest prefix of ``tokens`` the cache holds and can be cut to, drop
        the rest; returns its length, the new ``n_past`` (``exact``: only what reading
        the rest after it gives bit-identical logits for; ``media``: what the prompt
        holds at some positions instead of tokens, the same cached only where it is the
        same; see ``backend.LlamaContext``)."""
        ...


class Vocabulary(Protocol):
    """The target's vocabulary as the loop needs it (see ``backend.LlamaModel``)."""

    n_vocab: int
    eog_ids: frozenset[int]

    def token_to_piece(self, token: int) -> bytes: ...


class Drafter(Protocol):
    """Proposes up to ``k`` tokens to follow ``history`` (prompt + committed output).

    ``history`` only ever grows by appending between calls, until :meth:`reset`.
    ``seconds`` is the wall time spent drafting, in seconds, ``prompt_seconds`` the part
    of it spent reading a prompt at the first draft (:meth:`defer`). ``p_min``: a drafter with
    probabilities stops at a token it gives less than this (llama.cpp's
    ``--spec-draft-p-min``); ``p_path_min``: ... or at which the product of its
    probabilities of the tokens drafted so far, that token's included, falls below this
    (auto mode's stop, ``ModelArm.p_stop_at``). Lookup drafters ignore ``p_path_min``;
    n-gram lookup ignores ``p_min`` too, suffix matching reads it as a least share.

    A new kind of drafter is one class implementing this protocol and one entry in the
    engine's drafter registry (:data:`specgguf.engine.drafter_map.DRAFTERS`), which also
    gives auto mode its arm (:mod:`specgguf.speculative.arms`). A class that subclasses
    this protocol inherits :meth:`reset`, :meth:`prefill`, :meth:`defer`, :meth:`finish`
    and :meth:`reuse_limit`, which do nothing (or the obvious).
    """

    name: str
    seconds: float
    #: of ``seconds``, those spent reading a deferred prompt (:meth:`defer`)
    prompt_seconds: float = 0.0

    def reset(self) -> None:
        """A new generation starts: the next history need not extend the previous one."""
        return None

    def finish(self, history: Sequence[int]) -> None:
        """The generation ended with ``history`` (prompt + output, whatever was drafted);
        a drafter that learns from what it has seen takes it in whole."""
        return None

    def prefill(self, history: Sequence[int]) -> None:
        """Read the prompt ahead of generation, as the target does (a draft model fills its
        KV cache); lookups need nothing."""
        return None

    def defer(self, history: Sequence[int]) -> None:
        """As :meth:`prefill`, when the drafter may never draft in this generation (auto
        mode): one whose reading costs model evaluations reads the prompt at its first
        draft instead, and counts it as read until then; others read it now."""
        self.prefill(history)

    def reuse_limit(self, history: Sequence[int]) -> int | None:
        """The most leading positions of ``history`` the target may keep from its cache
        for this drafter to follow it (the MTP layers read the target's hidden state of
        the positions before theirs); None: any."""
        return None

    def propose(
        self,
        history: Sequence[int],
        k: int,
        sampler: SamplerParams,
        rng: np.random.Generator,
        *,
        p_min: float = 0.0,
        p_path_min: float = 0.0,
    ) -> Draft: ...


@runtime_checkable
class TreeDrafter(Drafter, Protocol):
    """A drafter that also proposes token trees (:mod:`specgguf.speculative.tree`)."""

    # A tree of at most max_nodes nodes and max_leaves leaves, its nodes in an order where
    # parents come first; wanted and branch (None, 0: none) allow it to stop early (see
    # SuffixDrafter.propose_tree). No defaults and no docstring here: mutation testing would
    # wrap the method, and the runtime check of the protocol would then ask every tree
    # drafter for the wrapper's names.
    def propose_tree(
        self,
        history: Sequence[int],
        max_nodes: int,
        max_leaves: int,
        *,
        wanted: Callable[[int], int] | None,
        branch: int,
    ) -> Draft: ...
