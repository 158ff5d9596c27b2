"""Suffix matching over everything seen, with counts (SuffixDecoding, Oliaro et al. 2024,
arXiv 2411.04975; llama.cpp's lookup caches, ``common/ngram-cache.cpp``): chains that follow
the majority of earlier occurrences, and token trees of their continuations."""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from specgguf.speculative.draft import Draft, Drafter
from specgguf.speculative.drafters import compiled
from specgguf.speculative.drafters.ngram import LONG_MATCH, match_length
from specgguf.speculative.sampling import SamplerParams

if TYPE_CHECKING:
    from specgguf.speculative.drafters._lookup import SuffixTable


def _by_size(group: tuple[int, list[int]]) -> tuple[int, int]:
    """The order of a node's children: the most occurrences first, ties to the larger id."""
    return -len(group[1]), -group[0]


class SuffixDrafter(Drafter):
    """Suffix matching over everything seen, with counts: the prompt, the output so far,
    and the earlier generations drafted for (a server's earlier responses, a benchmark's
    earlier questions).

    The longest suffix of the text (one of ``LENGTHS`` tokens) that occurred before selects
    its earlier occurrences (the most recent ``max_occurrences`` of each n-gram; the draft's
    ``match`` is the latest one's agreement with the text, up to :data:`LONG_MATCH`); the
    draft then follows them token by token, taking at each step the continuation most of
    the surviving occurrences share and keeping only those, and stops when no more than
    ``min_share`` of them agree. The draft's ``probs`` are the running products of the
    shares (an estimate of each token's acceptance).

    Memory: the last ``capacity`` tokens seen and an index of ``len(LENGTHS)`` n-grams per
    token, each with at most ``max_occurrences`` positions: at the default 32,768 tokens at
    most about 22 MB (every n-gram distinct; 4 MB on source code) in pure Python, 15 MB
    compiled (:mod:`~specgguf.speculative.drafters.compiled`), measured in
    tests/test_suffix.py. Older generations are forgotten first.

    Several sequences (``serve --parallel``) share what they have seen through a group
    (:meth:`group`): a drafter each, and a generation that ends (:meth:`finish`) is taken
    into the others' corpora when they start their next one (:meth:`reset`), never in the
    middle of one, after the drafter's own latest (so a sequence forgets its own newest
    generation before the others' that ended while it ran). Each holds its own copy and
    index (up to ``capacity`` tokens each), and indexes what it takes in at its next draft
    (about 2 us a token in pure Python, 0.5 compiled).

    Raises:
        ValueError: ``max_occurrences`` below 1.
    """

    name = "suffix"
    LENGTHS = (1, 2, 4, 8)
    SEPARATOR = -1  # between generations: no match runs across

    def __init__(
        self, *, capacity: int = 32768, max_occurrences: int = 16, min_share: float = 0.5
    ) -> None:
        if max_occurrences < 1:
            raise ValueError(f"max_occurrences must be at least 1, got {max_occurrences}")
        self.capacity = capacity
        self.max_occurrences = max_occurrences
        self.min_share = min_share
        self.seconds = 0.0
        self._corpus: list[int] = []
        # hash of an n-gram -> the corpus positions right after its latest occurrences (a
        # hash collision only ever costs a worse draft, never a wrong output)
        self._index: dict[int, list[int]] = {}
        # the same index compiled (compiled.py), which then stands for the one above, and
        # its drafting from the index's occurrences (chosen once, as the index)
        self._lookup = compiled.lookup
        self._table: SuffixTable | None = (
            self._lookup.SuffixTable(self.LENGTHS, max_occurrences, self.SEPARATOR)
            if self._lookup
            else None
        )
        self._indexed = 0  # n-grams ending before this corpus position are indexed
        self._start = 0  # where the current generation starts in the corpus
        self._synced = 0  # history tokens appended to the corpus
        self._peers: list[SuffixDrafter] = [self]  # the group, this one included
        self._inbox: list[list[int]] = []  # the others' generations, not yet taken in
        # this drafter's latest generation in the corpus (start, end): the next one goes
        # on from it where it extends it (a conversation's next turn), and how much of
        # the current generation the group has already been sent
        self._last: tuple[int, int] | None = None
        self._sent = 0

    @classmethod
    def group(cls, n: int, **settings: Any) -> list[SuffixDrafter]:
        """``n`` drafters (``settings``: the constructor's) that share every generation
        any of them has seen: one per sequence of a parallel context."""
        drafters = [cls(**settings) for _ in range(n)]
        for d in drafters:
            d._peers = drafters
        return drafters

    def reset(self) -> None:
        """A new generation: the text so far stays in the corpus, behind a separator, and
        goes to the group's other drafters; what they finished since is taken in."""
        if len(self._corpus) > self._start:
            if len(self._peers) > 1 and len(self._corpus) > self._start + self._sent:
                done = self._corpus[self._start + self._sent :]
                for peer in self._peers:
                    if peer is not self:
                        peer._receive(done)
            self._last = (self._start, len(self._corpus))
            self._corpus.append(self.SEPARATOR)
        self._sent = 0
        for text in self._inbox:
            self._corpus += text
            self._corpus.append(self.SEPARATOR)
        self._inbox.clear()
        self._start = len(self._corpus)
        self._synced = 0
        if len(self._corpus) > self.capacity:
            self._forget(len(self._corpus) - self.capacity // 2)

    def finish(self, history: Sequence[int]) -> None:
        """The generation ended with ``history``: all of it in the corpus (also what came
        after the last draft, or all of it where this drafter never drafted), and to the
        group's other drafters."""
        t0 = time.perf_counter()
        self._sync(history)
        self.reset()
        self.seconds += time.perf_counter() - t0

    def _receive(self, text: list[int]) -> None:
        """Another drafter's finished generation, taken in at this one's next reset (the
        newest ``capacity`` tokens of them kept)."""
        self._inbox.append(text)
        held = sum(len(t) for t in self._inbox)
        while len(self._inbox) > 1 and held - len(self._inbox[0]) >= self.capacity:
            held -= len(self._inbox.pop(0))

    def _resume(self, history: Sequence[int]) -> None:
        """At a generation's first sync: where ``history`` extends this drafter's latest
        generation and nothing came into the corpus after it, that generation goes on
        (its separator dropped) instead of being appended again."""
        last = self._last
        self._last = None
        if last is None or self._start != last[1] + 1 or len(self._corpus) != last[1] + 1:
            return
        start, end = last
        if len(history) < end - start or self._corpus[start:end] != list(history[: end - start]):
            return
        self._corpus.pop()  # the separator
        self._start, self._synced = start, end - start
        self._sent = self._synced  # the group has it already
        self._indexed = min(self._indexed, end)

    def _sync(self, history: Sequence[int]) -> None:
        if self._synced == 0 and self._last is not None:
            self._resume(history)
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
        limit = len(self._corpus) - 1
        if self._table is not None:
            self._table.index(self._corpus, max(self._indexed, 1), limit + 1)
        else:
            self._index_to(limit)
        self._indexed = max(self._indexed, limit + 1)

    def _index_to(self, limit: int) -> None:
        """The pure-Python index (the compiled one's reference): the n-grams ending right
        before each position from ``_indexed`` (at least 1) to ``limit``."""
        c = self._corpus
        index, sep, most = self._index, self.SEPARATOR, self.max_occurrences
        lengths = self.LENGTHS
        top = lengths[-1]
        for j in range(max(self._indexed, 1), limit + 1):
            # one tuple of the longest n-gram, the shorter ones its tails (a separator
            # ends every n-gram that reaches past it)
            w = tuple(c[j - top : j] if j >= top else c[:j])
            if sep in w:
                w = w[len(w) - w[::-1].index(sep) :]
            lw = len(w)
            for n in lengths:
                if n > lw:
                    break
                if (occ := index.get(h := hash(w[lw - n :]))) is None:
                    index[h] = [j]
                    continue
                occ.append(j)
                if len(occ) > most:
                    del occ[0]

    def index_table(self) -> dict[int, list[int]]:
        """The index as the pure-Python one holds it, whichever is in use (for tests): the
        hash of each n-gram -> the positions right after its latest occurrences, oldest
        first."""
        if self._table is None:
            return self._index
        c = self._corpus
        return {hash(tuple(c[occ[0] - n : occ[0]])): occ for n, occ in self._table.entries()}

    def index_bytes(self) -> int:
        """The compiled index's memory (bytes; 0 for the pure-Python one, whose memory
        Python's own allocator counts)."""
        return 0 if self._table is None else self._table.nbytes

    def _forget(self, drop: int) -> None:
        """Drop the oldest ``drop`` corpus tokens and rebuild the index."""
        drop = min(drop, self._start)  # the current generation is kept whole
        if drop <= 0:
            return
        self._corpus = self._corpus[drop:]
        self._start -= drop
        if self._last is not None:
            start, end = self._last
            self._last = (start - drop, end - drop) if start >= drop else None
        self._index.clear()
        if self._table is not None:
            self._table.clear()
        self._indexed = 0

    def _match(self, history: Sequence[int]) -> tuple[list[int], int]:
        """Take in the history; the corpus positions right after the earlier occurrences
        of its longest suffix of ``LENGTHS`` tokens, and that match's length (0: none)."""
        self._sync(history)
        c, end = self._corpus, len(self._corpus)
        n_max = min(len(history), LONG_MATCH)
        if self._table is not None and self._lookup is not None:
            if hit := self._table.match(c, end, len(history)):
                n, occ = hit
                m = self._lookup.match_length(c, occ[-1], end, n, self.SEPARATOR)
                return occ, min(n_max, m)
            return [], 0
        for n in reversed(self.LENGTHS):
            if n <= len(history):
                occ = self._index.get(hash(tuple(c[end - n : end])), [])
                if occ:
                    # the longest of the latest occurrence's agreement, within this text
                    return occ, min(n_max, match_length(c, occ[-1], end, n, self.SEPARATOR))
        return [], 0

    def propose(
        self,
        history: Sequence[int],
        k: int,
        sampler: SamplerParams,
        rng: np.random.Generator,
        *,
        p_min: float = 0.0,
        p_path_min: float = 0.0,
    ) -> Draft:
        """Up to ``k`` tokens following the longest earlier occurrence of the text's
        suffix, by majority of its occurrences; ``p_min`` raises ``min_share``;
        ``p_path_min`` is ignored."""
        t0 = time.perf_counter()
        occ, match = self._match(history)
        c, end = self._corpus, len(self._corpus)
        share_min = max(self.min_share, p_min)
        sep = self.SEPARATOR
        if self._lookup is not None:
            chain = self._lookup.suffix_chain(c, end, occ, k, share_min, sep)
            self.seconds += time.perf_counter() - t0
            return Draft(chain[0], probs=chain[1], match=match)
        tokens: list[int] = []
        probs: list[float] = []
        confidence = 1.0
        while occ and len(tokens) < k:
            # the occurrences by the token they continue with: the majority's are the
            # next position's occurrences
            d = len(tokens)
            groups: dict[int, list[int]] = {}
            for pos in occ:
                if pos + d < end and (t := c[pos + d]) != sep:
                    if (g := groups.get(t)) is None:
                        groups[t] = [pos]
                    else:
                        g.append(pos)
            if not groups:
                break
            best = max(groups, key=lambda t: (len(groups[t]), t))
            share = len(groups[best]) / len(occ)
            if share <= share_min and tokens:
                break
            confidence *= share
            tokens.append(best)
            probs.append(confidence)
            occ = groups[best]
        self.seconds += time.perf_counter() - t0
        return Draft(tokens, probs=probs, match=match)

    def propose_tree(
        self,
        history: Sequence[int],
        max_nodes: int,
        max_leaves: int,
        *,
        min_prob: float = 0.05,
        wanted: Callable[[int], int] | None = None,
        branch: int = 0,
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

        ``wanted(match)``: the nodes the caller will read of a tree whose match is ``match``
        tokens long; the tree stops growing once it has that many and its first branch
        (:func:`~specgguf.speculative.tree.first_branch`) has ``branch`` nodes: what it
        returns is then a prefix of the whole tree, the same in every node read.

        Returns:
            a :class:`Draft` with ``parents``, ``probs`` and ``match`` (the matched suffix
            length; empty when nothing matched).
        """
        t0 = time.perf_counter()
        occ, match = self._match(history)
        c, end = self._corpus, len(self._corpus)
        enough = max_nodes if wanted is None else min(max_nodes, wanted(match))
        if self._lookup is not None:
            tree = self._lookup.suffix_tree(
                c, end, occ, max_nodes, max_leaves, min_prob, enough, branch, self.SEPARATOR
            )
            self.seconds += time.perf_counter() - t0
            return Draft(tree[0], parents=tree[1], probs=tree[2], match=match)
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        has_child: list[bool] = []
        n_leaves = 0
        # candidates: (-probability, order, parent, depth, token, occurrences)
        heap: list[tuple[float, int, int, int, int, list[int]]] = []
        order = 0

        sep = self.SEPARATOR

        def expand(parent: int, depth: int, prob: float, occs: list[int]) -> None:
            nonlocal order
            groups: dict[int, list[int]] = {}
            for pos in occs:
                if pos + depth < end and (t := c[pos + depth]) != sep:
                    if (g := groups.get(t)) is None:
                        groups[t] = [pos]
                    else:
                        g.append(pos)
            # (one continuation, the usual case, needs no ordering)
            items = groups.items() if len(groups) < 2 else sorted(groups.items(), key=_by_size)
            for t, g in items:
                p = prob * len(g) / len(occs)
                if p >= min_prob:
                    heapq.heappush(heap, (-p, order, parent, depth + 1, t, g))
                    order += 1

        # the first branch's last node (-1: the root) and its length
        first, first_len = -1, 0
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
            if parent == first:
                first, first_len = len(tokens) - 1, first_len + 1
            if len(tokens) >= enough and first_len >= branch:
                break  # (the rest is read by no one)
            expand(len(tokens) - 1, depth, -neg, g)
        self.seconds += time.perf_counter() - t0
        return Draft(tokens, parents=parents, probs=probs, match=match)
