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
import heapq
import logging
import time
from collections.abc import Sequence
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt

from specgguf.speculative.sampling import Distribution, SamplerParams, distribution, sample

log = logging.getLogger("specgguf")


@dataclasses.dataclass
class Draft:
    """Proposed token ids, and for sampled model drafts the distribution each was drawn
    from (``dists[i]`` is q for ``tokens[i]``).

    A tree draft (several continuations, :mod:`specgguf.speculative.tree`) also has ``parents``:
    the index of each token's parent in ``tokens``, -1 for the last committed token
    (parents come first); None is a chain. ``probs``: the drafter's estimate, per token,
    that the target reaches and keeps it (for a suffix tree, the product of the shares of
    earlier occurrences along its branch), which the planner calibrates.
    """

    tokens: list[int]
    dists: list[Distribution] | None = None
    parents: list[int] | None = None
    probs: list[float] | None = None


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


class TreeEvaluator(Evaluator, Protocol):
    """An :class:`Evaluator` that also verifies token trees in one batch (see
    ``backend.LlamaContext.eval_tree``): ``tree_branches`` is the most leaves a tree may
    have (0: none; the loop then verifies chains only)."""

    tree_branches: int

    def eval_tree(
        self, root: int, tokens: Sequence[int], parents: Sequence[int]
    ) -> npt.NDArray[np.float32]: ...

    def keep_tree_path(self, path: Sequence[int]) -> None: ...


class Drafter(Protocol):
    """Proposes up to ``k`` tokens to follow ``history`` (prompt + committed output).

    ``history`` only ever grows by appending between calls. ``seconds`` is the wall time
    spent in model evaluation for drafting (0 for lookup drafters). ``p_min``: a drafter
    with probabilities stops at a token it gives less than this (llama.cpp's
    ``--draft-p-min``); lookup drafters ignore it.

    A new kind of drafter is one class implementing this protocol and one entry in the
    engine's name -> factory map (:data:`specgguf.engine.drafter_map.DRAFTERS`).
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

    The draft's KV cache holds the history from ``offset`` on. When the history (and the
    draft) would not fit the draft's context, the cache starts again on the most recent
    half of its context: the draft model then sees only the recent text, which costs
    acceptance, never correctness (the target verifies every token). A warning says so
    once.

    Args:
        ctx: the draft model's context (its own n_ctx, n_batch and threads).
        n_vocab_target: ids at or beyond this are never proposed (a draft vocabulary may
            be padded past the target's; those logits are cut off before choosing).
    """

    name = "model"

    def __init__(self, ctx: Evaluator, n_vocab_target: int) -> None:
        self.ctx = ctx
        self.n_vocab = min(n_vocab_target, ctx.n_vocab)
        self.offset = 0  # the history index of the first token in the draft's KV cache
        self._held: list[int] = []  # the tokens in the draft's KV cache, in order
        self._synced = 0  # a prefix of _held known to equal the history's prefix
        self._warned = False
        self.seconds = 0.0
        #: seconds per drafted token in the last proposal, catch-up evaluation excluded
        self.last_token_seconds = 0.0
        #: whether the last proposal stopped below ``p_min`` (before ``k`` tokens)
        self.last_stopped = False

    def reset(self) -> None:
        # The cache is kept: a new prompt that shares a prefix with it reuses that prefix.
        self._synced = 0

    def _fit(self, history: Sequence[int], k: int) -> None:
        """Keep the cache's window on ``history`` such that its tokens and ``k`` more
        positions fit the draft's context; when they do not, start the window again on
        the most recent half of the context (the cache is emptied)."""
        n_ctx = self.ctx.n_ctx
        if len(history) - self.offset + k <= n_ctx:
            return
        keep = max(1, min(n_ctx // 2, n_ctx - k))
        if not self._warned:
            self._warned = True
            log.warning(
                "the draft model's context (%d tokens) is smaller than the text so far "
                "(%d tokens): it drafts from the most recent %d tokens",
                n_ctx, len(history) + k, keep,
            )  # fmt: skip
        self.offset = len(history) - keep
        self.ctx.rollback(0)
        self._held.clear()
        self._synced = 0

    def prefill(self, history: Sequence[int]) -> None:
        """Evaluate the prompt (all but its last token) ahead of generation, as the target
        does, so that drafting starts without a long catch-up."""
        t0 = time.perf_counter()
        if self.offset > len(history) - 1 or self._common_prefix(history) == 0:
            self.offset = 0  # another text: the window starts at its beginning
        self._fit(history, 1)
        keep = min(self._common_prefix(history), len(history) - 1 - self.offset)
        self.ctx.rollback(keep)
        del self._held[keep:]
        start = self.offset + keep
        if len(history) - 1 > start:
            self.ctx.eval(history[start:-1], logits="none")
            self._held.extend(history[start:-1])
        self._synced = len(history) - 1 - self.offset
        self.seconds += time.perf_counter() - t0

    def cached_tokens(self, history: Sequence[int]) -> int:
        """How many leading tokens of ``history`` need no evaluation by the draft: those
        before its window and those its cache holds (its accepted drafts included)."""
        return self.offset + self._common_prefix(history)

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
        # A draft of k tokens evaluates k - 1 of them: never more than half the context.
        k = min(k, max(1, self.ctx.n_ctx // 2))
        if k <= 0 or not history:
            return Draft([])
        t0 = time.perf_counter()
        self._fit(history, k - 1)
        common = self._common_prefix(history)
        # At least the last history token is evaluated, to get logits after it.
        keep = min(common, len(history) - 1 - self.offset)
        self.ctx.rollback(keep)
        del self._held[keep:]
        start = self.offset + keep
        logits = self.ctx.eval(history[start:], logits="last")
        self._held.extend(history[start:])
        self._synced = len(history) - self.offset
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
        elif start >= len(history) - 2:
            self.last_token_seconds = t_end - t0
        return Draft(tokens, dists)

    def _common_prefix(self, history: Sequence[int]) -> int:
        """How many leading tokens of the cache equal the history's from ``offset`` on
        (only the tail past the last sync can differ: the history is append-only). A cache
        rolled back by someone else (a calibration) holds only its first ``n_past``."""
        if len(self._held) > self.ctx.n_past:
            del self._held[self.ctx.n_past :]
        n = min(self._synced, len(self._held))
        limit = min(len(self._held), len(history) - self.offset)
        while n < limit and self._held[n] == history[self.offset + n]:
            n += 1
        return n


#: The longest match a lookup drafter measures (``last_match``): its indexed n-gram
#: extended backwards, token by token, as far as the two texts agree. A long verbatim
#: match is the evidence of copying that long drafts need (llama.cpp's ngram-mod drafts
#: only after 24 matching tokens: common/speculative.cpp, ``--spec-default``).
LONG_MATCH = 32


def match_length(text: Sequence[int], after: int, end: int, n: int, stop: int | None = None) -> int:
    """How many tokens before ``end`` equal those before ``after`` in ``text`` (at least
    ``n``, known to match; at most :data:`LONG_MATCH`; never past a ``stop`` token)."""
    m = n
    while m < LONG_MATCH and after - 1 - m >= 0:
        t = text[after - 1 - m]
        if t == stop or t != text[end - 1 - m]:
            break
        m += 1
    return m


#: A copy (a match of this many tokens or more) that breaks is looked for again, for
#: ``RESUME_SPAN`` tokens of text, within ``RESUME_WINDOW`` tokens of where its source
#: would be had the text kept pace with it.
RESUME_MATCH = 16
RESUME_SPAN = 32
RESUME_WINDOW = 8


class NgramDrafter:
    """Prompt-lookup drafting over the prompt and the output so far.

    For n from ``n_max`` down to ``n_min``: if the last n tokens occurred earlier, propose
    the tokens that followed their most recent earlier occurrence. The index of n-grams is
    updated incrementally (O(n_max - n_min + 1) per committed token).

    An edit inside a copy (a renamed name) breaks a long match; the copy goes on a few
    tokens later, but its short suffix usually occurs elsewhere too, later in the text
    (``(items):`` after every ``def``), where the latest occurrence is the wrong one. So
    after a match of ``RESUME_MATCH`` or more, for ``RESUME_SPAN`` tokens, an occurrence
    within ``RESUME_WINDOW`` tokens of the copy's expected source position is taken unless
    the latest occurrence matches longer, and ``resumed`` is set (the planner then judges
    it as a copy).
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
        self.last_match = 0  # length of the last match (0: none)
        self.resumed = False  # whether the last match resumed a broken copy
        # the latest long copy: the text length at its last long match, and the text
        # length and source position of its latest (long or resumed) match
        self._copy: tuple[int, int, int] | None = None

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
        self.last_match, self.resumed = 0, False
        if k <= 0:
            return Draft([])
        size = len(history)
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            j = self._index[n].get(tuple(history[size - n :]))
            if j is not None:
                self.last_match = match_length(history, j, size, n)
                break
        else:
            j = None
        if self.last_match < RESUME_MATCH and self._copy is not None:
            long_at, at, src = self._copy
            if size - long_at > RESUME_SPAN:
                self._copy = None
            elif (r := self._resume(history, src + size - at)) is not None and (
                r[1] >= self.last_match  # a longer match elsewhere wins
            ):
                j, self.last_match, self.resumed = r[0], r[1], True
                self._copy = (long_at, size, j)  # realigned; the span still from the copy
        if j is None:
            return Draft([])
        if self.last_match >= RESUME_MATCH:
            self._copy = (size, size, j)
        return Draft(list(history[j : min(j + k, size)]))

    def _resume(self, history: Sequence[int], expected: int) -> tuple[int, int] | None:
        """The source position and match length of the longest suffix n-gram (n_max down
        to n_min) that occurs ending within ``RESUME_WINDOW`` of ``expected``, nearest
        first; None if none does."""
        size = len(history)
        lo, hi = max(0, expected - RESUME_WINDOW), min(size - 1, expected + RESUME_WINDOW)
        nearest = sorted(range(lo, hi + 1), key=lambda p: abs(p - expected))
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            gram = tuple(history[size - n :])
            for j in nearest:
                if j >= n and tuple(history[j - n : j]) == gram:
                    return j, match_length(history, j, size, n)
        return None


class SuffixDrafter:
    """Suffix matching over everything seen, with counts: the prompt, the output so far,
    and the earlier generations drafted for (a server's earlier responses, a benchmark's
    earlier questions), after SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975) and
    llama.cpp's lookup caches (``common/ngram-cache.cpp``).

    The longest suffix of the text (one of ``LENGTHS`` tokens) that occurred before selects
    its earlier occurrences (the most recent ``max_occurrences`` of each n-gram; ``last_match``
    is the latest one's agreement with the text, up to :data:`LONG_MATCH`); the draft
    then follows them token by token, taking at each step the continuation most of the
    surviving occurrences share and keeping only those, and stops when no more than
    ``min_share`` of them agree. ``last_match`` is the matched length, ``last_confidence``
    the product of the shares (an estimate of the draft's acceptance).

    Memory: the last ``capacity`` tokens seen and an index of ``len(LENGTHS)`` n-grams per
    token, each with at most ``max_occurrences`` positions: at the default 32,768 tokens at
    most about 22 MB (every n-gram distinct; 4 MB on source code), measured in
    tests/test_suffix.py. Older generations are forgotten first.
    """

    name = "suffix"
    resumed = False  # (n-gram lookup's resumed copies; never here)
    LENGTHS = (1, 2, 4, 8)
    SEPARATOR = -1  # between generations: no match runs across

    def __init__(
        self, *, capacity: int = 32768, max_occurrences: int = 16, min_share: float = 0.5
    ) -> None:
        self.capacity = capacity
        self.max_occurrences = max_occurrences
        self.min_share = min_share
        self.seconds = 0.0
        self._corpus: list[int] = []
        # hash of an n-gram -> the corpus positions right after its latest occurrences (a
        # hash collision only ever costs a worse draft, never a wrong output)
        self._index: dict[int, list[int]] = {}
        self._indexed = 0  # n-grams ending before this corpus position are indexed
        self._start = 0  # where the current generation starts in the corpus
        self._synced = 0  # history tokens appended to the corpus
        self.last_match = 0
        self.last_confidence = 0.0

    def reset(self) -> None:
        """A new generation: the text so far stays in the corpus, behind a separator."""
        if len(self._corpus) > self._start:
            self._corpus.append(self.SEPARATOR)
        self._start = len(self._corpus)
        self._synced = 0

    def _sync(self, history: Sequence[int]) -> None:
        if len(history) < self._synced or (
            self._synced
            and self._corpus[self._start + self._synced - 1] != history[self._synced - 1]
        ):
            # not an extension of what was seen: start a new generation
            self.reset()
        self._corpus.extend(history[self._synced :])
        self._synced = len(history)
        if len(self._corpus) > self.capacity:
            self._forget(len(self._corpus) - self.capacity // 2)
        # Index n-grams that end before the last token: the current suffix must find
        # only earlier occurrences.
        c, limit = self._corpus, len(self._corpus) - 1
        for j in range(max(self._indexed, 1), limit + 1):
            for n in self.LENGTHS:
                if j < n:
                    break
                gram = tuple(c[j - n : j])
                if self.SEPARATOR in gram:
                    continue
                occ = self._index.setdefault(hash(gram), [])
                occ.append(j)
                if len(occ) > self.max_occurrences:
                    del occ[0]
        self._indexed = max(self._indexed, limit + 1)

    def _forget(self, drop: int) -> None:
        """Drop the oldest ``drop`` corpus tokens and rebuild the index."""
        drop = min(drop, self._start)  # the current generation is kept whole
        if drop <= 0:
            return
        self._corpus = self._corpus[drop:]
        self._start -= drop
        self._index.clear()
        self._indexed = 0

    def _match(self, history: Sequence[int]) -> list[int]:
        """Take in the history; the corpus positions right after the earlier occurrences
        of its longest suffix of ``LENGTHS`` tokens (``last_match``: that length)."""
        self._sync(history)
        self.last_match, self.last_confidence = 0, 0.0
        c, end = self._corpus, len(self._corpus)
        for n in reversed(self.LENGTHS):
            if n <= len(history):
                occ = self._index.get(hash(tuple(c[end - n : end])), [])
                if occ:
                    # the longest of the latest occurrence's agreement, within this text
                    n_max = min(len(history), LONG_MATCH)
                    self.last_match = min(n_max, match_length(c, occ[-1], end, n, self.SEPARATOR))
                    return occ
        return []

    def propose(
        self,
        history: Sequence[int],
        k: int,
        sampler: SamplerParams,
        rng: np.random.Generator,
        *,
        p_min: float = 0.0,
    ) -> Draft:
        """Up to ``k`` tokens following the longest earlier occurrence of the text's
        suffix, by majority of its occurrences; ``p_min`` raises ``min_share``."""
        t0 = time.perf_counter()
        occ = self._match(history)
        c, end = self._corpus, len(self._corpus)
        tokens: list[int] = []
        confidence = 1.0
        share_min = max(self.min_share, p_min)
        while occ and len(tokens) < k:
            counts: dict[int, int] = {}
            for pos in occ:
                t = c[pos + len(tokens)] if pos + len(tokens) < end else self.SEPARATOR
                if t != self.SEPARATOR:
                    counts[t] = counts.get(t, 0) + 1
            if not counts:
                break
            best = max(counts, key=lambda t: (counts[t], t))
            share = counts[best] / len(occ)
            if share <= share_min and tokens:
                break
            confidence *= share
            tokens.append(best)
            occ = [
                pos
                for pos in occ
                if pos + len(tokens) - 1 < end and c[pos + len(tokens) - 1] == best
            ]
        self.last_confidence = confidence if tokens else 0.0
        self.seconds += time.perf_counter() - t0
        return Draft(tokens)

    def propose_tree(
        self, history: Sequence[int], max_nodes: int, max_leaves: int, *, min_prob: float = 0.05
    ) -> Draft:
        """A token tree of the continuations of the longest earlier occurrences of the
        text's suffix, branching where they split (SuffixDecoding, Oliaro et al. 2024,
        section 4.2: the speculation tree grown greedily by estimated probability).

        The occurrences a node keeps are those that continue with its branch; a child's
        probability is its parent's times the share of the parent's occurrences that
        continue with the child's token. Nodes are added best first (ties: the earlier
        candidate), while their probability is at least ``min_prob``, up to ``max_nodes``
        and ``max_leaves`` leaves; so ``probs`` never increases along the list and every
        prefix of the tree is the best tree of its size by these estimates.

        Returns:
            a :class:`Draft` with ``parents`` and ``probs`` (empty when nothing matched);
            ``last_match`` is the matched suffix length.
        """
        t0 = time.perf_counter()
        occ = self._match(history)
        c, end = self._corpus, len(self._corpus)
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        has_child: list[bool] = []
        n_leaves = 0
        # candidates: (-probability, order, parent, depth, token, occurrences)
        heap: list[tuple[float, int, int, int, int, list[int]]] = []
        order = 0

        def expand(parent: int, depth: int, prob: float, occs: list[int]) -> None:
            nonlocal order
            groups: dict[int, list[int]] = {}
            for pos in occs:
                t = c[pos + depth] if pos + depth < end else self.SEPARATOR
                if t != self.SEPARATOR:
                    groups.setdefault(t, []).append(pos)
            for t, g in sorted(groups.items(), key=lambda kv: (-len(kv[1]), -kv[0])):
                p = prob * len(g) / len(occs)
                if p >= min_prob:
                    heapq.heappush(heap, (-p, order, parent, depth + 1, t, g))
                    order += 1

        if occ and max_nodes > 0 and max_leaves > 0:
            expand(-1, 0, 1.0, occ)
        while heap and len(tokens) < max_nodes:
            neg, _, parent, depth, t, g = heapq.heappop(heap)
            opens_branch = bool(tokens) if parent < 0 else has_child[parent]
            if opens_branch and n_leaves >= max_leaves:
                continue  # a new leaf beside others: no room
            n_leaves += opens_branch or not tokens
            if parent >= 0:
                has_child[parent] = True
            tokens.append(t)
            parents.append(parent)
            probs.append(-neg)
            has_child.append(False)
            expand(len(tokens) - 1, depth, -neg, g)
        self.last_confidence = probs[0] if probs else 0.0
        self.seconds += time.perf_counter() - t0
        return Draft(tokens, parents=parents, probs=probs)
