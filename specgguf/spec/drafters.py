"""Drafters: what proposes the tokens the target verifies.

- :class:`ModelDrafter`: a small draft model (a second GGUF) evaluated through the same
  backend layer, autoregressively, K tokens per step. Its KV cache follows the committed
  sequence: after a step only the tokens it does not already hold are evaluated.
- :class:`NgramDrafter`: prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; llama.cpp's
  ngram-simple in common/ngram-map.cpp): find the longest recent n-gram of the text so far
  that occurred before, and propose what followed it. Costs no model evaluation, and pays
  when the output repeats its input (editing given code, extracting from given text).

Both implement :class:`Drafter`. A draft is deterministic (``dists is None``: n-gram lookup,
or any greedy draft) or carries the draft distribution q for each token (sampled drafts
from a model), as modified rejection sampling needs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt

from specgguf.spec.sampling import Distribution, SamplerParams, distribution, sample


@dataclasses.dataclass
class Draft:
    """Proposed token ids, and for sampled model drafts the distribution each was drawn
    from (``dists[i]`` is q for ``tokens[i]``)."""

    tokens: list[int]
    dists: list[Distribution] | None = None


class Evaluator(Protocol):
    """What the speculative loop needs from a model context (see ``backend.LlamaContext``):
    evaluate tokens at the next positions and read logits, roll the KV cache back."""

    n_ctx: int
    n_batch: int
    n_vocab: int
    n_past: int
    eval_seconds: float

    def eval(
        self, tokens: Sequence[int], *, logits: Literal["last", "all", "none"] = "last"
    ) -> npt.NDArray[np.float32]: ...

    def rollback(self, n_keep: int) -> None: ...


class Drafter(Protocol):
    """Proposes up to ``k`` tokens to follow ``history`` (prompt + committed output).

    ``history`` only ever grows by appending between calls. ``seconds`` is the wall time
    spent in model evaluation for drafting (0 for lookup drafters). ``p_min``: a drafter
    with probabilities stops at a token it gives less than this (llama.cpp's
    ``--draft-p-min``); lookup drafters ignore it.

    A new kind of drafter is one class implementing this protocol and one entry in the
    engine's name -> factory map (:data:`specgguf.engine.drafting.DRAFTERS`).
    """

    name: str
    seconds: float

    def reset(self) -> None:
        """A new generation starts: the next history need not extend the previous one."""
        ...

    def propose(
        self,
        history: Sequence[int],
        k: int,
        sampler: SamplerParams,
        rng: np.random.Generator,
        *,
        p_min: float = 0.0,
    ) -> Draft: ...


class ModelDrafter:
    """Drafts with a small model whose vocabulary matches the target's.

    Args:
        ctx: the draft model's context (its own n_ctx, n_batch and threads).
        n_vocab_target: ids at or beyond this are never proposed (a draft vocabulary may
            be padded past the target's; those logits are cut off before choosing).
    """

    name = "model"

    def __init__(self, ctx: Evaluator, n_vocab_target: int) -> None:
        self.ctx = ctx
        self.n_vocab = min(n_vocab_target, ctx.n_vocab)
        self._held: list[int] = []  # the tokens in the draft's KV cache, in order
        self._synced = 0  # a prefix of _held known to equal the history's prefix
        self.seconds = 0.0
        #: seconds per drafted token in the last proposal, catch-up evaluation excluded
        self.last_token_seconds = 0.0
        #: whether the last proposal stopped below ``p_min`` (before ``k`` tokens)
        self.last_stopped = False

    def reset(self) -> None:
        # The cache is kept: a new prompt that shares a prefix with it reuses that prefix.
        self._synced = 0

    def prefill(self, history: Sequence[int]) -> None:
        """Evaluate the prompt (all but its last token) ahead of generation, as the target
        does, so that drafting starts without a long catch-up."""
        t0 = time.perf_counter()
        keep = min(self._common_prefix(history), len(history) - 1)
        self.ctx.rollback(keep)
        del self._held[keep:]
        if len(history) - 1 > keep:
            self.ctx.eval(history[keep:-1], logits="none")
            self._held.extend(history[keep:-1])
        self._synced = len(history) - 1
        self.seconds += time.perf_counter() - t0

    def cached_tokens(self, history: Sequence[int]) -> int:
        """How many leading tokens of ``history`` the draft's cache holds (its drafts that
        the target accepted included)."""
        return self._common_prefix(history)

    def propose(
        self,
        history: Sequence[int],
        k: int,
        sampler: SamplerParams,
        rng: np.random.Generator,
        *,
        p_min: float = 0.0,
    ) -> Draft:
        """Up to ``k`` draft tokens after ``history``; greedy drafting stops early at a
        token whose probability under the draft is below ``p_min`` (0: never), and
        ``last_stopped`` tells whether it did."""
        self.last_stopped = False
        # Positions the draft needs: len(history) - 1 + k (the k-th token is not evaluated).
        k = min(k, self.ctx.n_ctx - len(history) + 1)
        if k <= 0 or not history:
            return Draft([])  # drafting pauses when the draft's context is full
        t0 = time.perf_counter()
        common = self._common_prefix(history)
        # At least the last history token is evaluated, to get logits after it.
        keep = min(common, len(history) - 1)
        self.ctx.rollback(keep)
        del self._held[keep:]
        logits = self.ctx.eval(history[keep:], logits="last")
        self._held.extend(history[keep:])
        self._synced = len(history)
        t_first = time.perf_counter()
        tokens: list[int] = []
        dists: list[Distribution] | None = None if sampler.greedy else []
        for i in range(k):
            row = logits[-1, : self.n_vocab]
            if dists is None:
                tok = int(row.argmax())
                if p_min > 0.0:
                    top = 1.0 / float(np.exp(row - row[tok]).sum())
                    if top < p_min:
                        self.last_stopped = True
                        break
            else:
                q = distribution(row, sampler)
                tok = sample(q, rng)
                dists.append(q)
            tokens.append(tok)
            if i + 1 < k:
                logits = self.ctx.eval([tok], logits="last")
                self._held.append(tok)
        t_end = time.perf_counter()
        self.seconds += t_end - t0
        # The first evaluation may catch up on many tokens; the others are one token each.
        if len(tokens) > 1:
            self.last_token_seconds = (t_end - t_first) / (len(tokens) - 1)
        elif keep >= len(history) - 2:
            self.last_token_seconds = t_end - t0
        return Draft(tokens, dists)

    def _common_prefix(self, history: Sequence[int]) -> int:
        """How many leading tokens of the cache equal the history's (only the tail past
        the last sync can differ: the history is append-only)."""
        n = min(self._synced, len(self._held))
        limit = min(len(self._held), len(history))
        while n < limit and self._held[n] == history[n]:
            n += 1
        return n


class NgramDrafter:
    """Prompt-lookup drafting over the prompt and the output so far.

    For n from ``n_max`` down to ``n_min``: if the last n tokens occurred earlier, propose
    the tokens that followed their most recent earlier occurrence. The index of n-grams is
    updated incrementally (O(n_max - n_min + 1) per committed token).
    """

    name = "ngram"

    def __init__(self, n_min: int = 2, n_max: int = 8) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.seconds = 0.0
        self.reset()

    def reset(self) -> None:
        # _index[n][ngram] = position right after the latest indexed occurrence
        self._index: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(self.n_min, self.n_max + 1)
        }
        self._indexed_to = 0  # n-grams ending before this position are indexed
        self.last_match = 0  # n of the last match (0: none)

    def _update(self, history: Sequence[int]) -> None:
        # Index n-grams ending at positions up to len(history) - 1, so that the current
        # suffix (ending at len(history)) finds only earlier occurrences.
        end = len(history) - 1
        for j in range(max(self._indexed_to, 1), end + 1):
            for n, table in self._index.items():
                if j >= n:
                    table[tuple(history[j - n : j])] = j
        self._indexed_to = max(self._indexed_to, end + 1)

    def propose(
        self,
        history: Sequence[int],
        k: int,
        sampler: SamplerParams,
        rng: np.random.Generator,
        *,
        p_min: float = 0.0,
    ) -> Draft:
        """The tokens that followed the most recent earlier occurrence of the longest
        suffix n-gram (n_max down to n_min), at most ``k``; ``p_min`` is ignored."""
        self._update(history)
        self.last_match = 0
        if k <= 0:
            return Draft([])
        size = len(history)
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            j = self._index[n].get(tuple(history[size - n :]))
            if j is not None:
                self.last_match = n
                return Draft(list(history[j : min(j + k, size)]))
        return Draft([])
