"""Prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; llama.cpp's ngram-simple in
common/ngram-map.cpp): find the longest recent n-gram of the text so far that occurred
before, and propose what followed it. Costs no model evaluation, and pays when the output
repeats its input (editing given code, extracting from given text)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from specgguf.speculative.draft import Draft, Drafter
from specgguf.speculative.drafters import compiled
from specgguf.speculative.sampling import SamplerParams

if TYPE_CHECKING:
    from specgguf.speculative.drafters._lookup import NgramTable

#: The longest match a lookup drafter measures (``Draft.match``): its indexed n-gram
#: extended backwards, token by token, as far as the two texts agree. A long verbatim
#: match is the evidence of copying that long drafts need (llama.cpp's ngram-mod drafts
#: only after 24 matching tokens: common/speculative.cpp, ``--spec-default``).
LONG_MATCH = 32

#: A copy (a match of this many tokens or more) that breaks is looked for again, for
#: ``RESUME_SPAN`` tokens of text, within ``RESUME_WINDOW`` tokens of where its source
#: would be had the text kept pace with it.
RESUME_MATCH = 16
RESUME_SPAN = 32
RESUME_WINDOW = 8


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


class NgramDrafter(Drafter):
    """Prompt-lookup drafting over the prompt and the output so far.

    For n from ``n_max`` down to ``n_min``: if the last n tokens occurred earlier, propose
    the tokens that followed their most recent earlier occurrence. The index of n-grams is
    updated incrementally (O(n_max - n_min + 1) per committed token: about 4 us a token in
    pure Python, 0.3 compiled, :mod:`~specgguf.speculative.drafters.compiled`). Each n-gram seen
    more than once also counts its occurrences, and how many of the latest ones in an
    unbroken run were followed by the same token as the latest: the draft's ``probs`` are
    that run over the occurrences, for its first token (the only one counted; followers
    9, 8, 8 give 2/3, and 8, 9, 8 give 1/3: the share of the recent past that agrees).
    llama.cpp's lookup cache (common/ngram-cache.cpp) drafts by a statistic like it, each
    token's count over all occurrences. A list's item numbers after the same words are
    the usual case of a share of 1/2 or less.

    An edit inside a copy (a renamed name) breaks a long match; the copy goes on a few
    tokens later, but its short suffix usually occurs elsewhere too, later in the text
    (``(items):`` after every ``def``), where the latest occurrence is the wrong one. So
    after a match of ``RESUME_MATCH`` or more, for ``RESUME_SPAN`` tokens, an occurrence
    within ``RESUME_WINDOW`` tokens of the copy's expected source position is taken unless
    the latest occurrence matches longer, and the draft says ``resumed`` (the planner then
    judges it as a copy).

    Raises:
        ValueError: not ``1 <= n_min <= n_max``.
    """

    name = "ngram"

    def __init__(self, n_min: int = 2, n_max: int = 8) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.seconds = 0.0
        # the compiled index (compiled.py) where it was built and takes n-grams this long;
        # chosen once, so that every text this drafter indexes uses the same one
        lookup = compiled.lookup
        self._lookup = lookup if lookup is not None and n_max <= lookup.MAX_LENGTH else None
        self._clear()
        self.reset()

    def reset(self) -> None:
        """A new generation: its text is indexed from where the last one's index agrees
        with it (a conversation's next turn extends the index; another text rebuilds it)."""
        self._fresh = True

    def _clear(self) -> None:
        # _index[n][ngram] = position right after the latest indexed occurrence
        self._index: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(self.n_min, self.n_max + 1)
        }
        # _repeats[n][ngram] = (occurrences, how many of the latest ones in a row were
        # followed by the same token): only for n-grams that occurred more than once
        self._repeats: dict[int, dict[tuple[int, ...], tuple[int, int]]] = {
            n: {} for n in self._index
        }
        self._indexed_to = 0  # n-grams ending before this position are indexed
        self._text: list[int] = []  # the text indexed: its first _indexed_to tokens
        # the same index compiled (compiled.py), which then stands for the two above
        self._table: NgramTable | None = (
            self._lookup.NgramTable(self.n_min, self.n_max) if self._lookup else None
        )
        # the latest long copy: the text length at its last long match, and the text
        # length and source position of its latest (long or resumed) match
        self._copy: tuple[int, int, int] | None = None

    def _update(self, history: Sequence[int]) -> None:
        if self._fresh:
            self._fresh = False
            text = self._text
            if list(history[: len(text)]) != text:
                self._clear()
            self._copy = None
        # Index n-grams ending at positions up to len(history) - 1, so that the current
        # suffix (ending at len(history)) finds only earlier occurrences.
        end = len(history) - 1
        if self._table is not None:
            self._table.extend(history, end + 1)
        else:
            self._index_from(history, end)
        if end + 1 > self._indexed_to:
            self._text.extend(history[self._indexed_to : end + 1])
            self._indexed_to = end + 1

    def _index_from(self, history: Sequence[int], end: int) -> None:
        """The pure-Python index (the compiled one's reference): the n-grams ending right
        before each position from ``_indexed_to`` (at least 1) to ``end``."""
        top = self.n_max
        tables = [(n, self._index[n], self._repeats[n]) for n in range(self.n_min, top + 1)]
        for j in range(max(self._indexed_to, 1), end + 1):
            token = history[j]
            # one tuple of the longest n-gram, the shorter ones its tails
            w = tuple(history[j - top : j] if j >= top else history[:j])
            lw = len(w)
            for n, table, repeats in tables:
                if n > lw:
                    break
                gram = w[lw - n :]
                before = table.get(gram)
                table[gram] = j
                if before is not None:
                    seen, run = repeats.get(gram, (1, 1))
                    repeats[gram] = (seen + 1, run + 1 if history[before] == token else 1)

    def index_tables(
        self,
    ) -> tuple[
        dict[int, dict[tuple[int, ...], int]], dict[int, dict[tuple[int, ...], tuple[int, int]]]
    ]:
        """The index as the pure-Python one holds it, whichever is in use (for tests): by
        n, each n-gram's position right after its latest occurrence, and for those seen more
        than once, (occurrences, the latest ones in a row followed by the same token)."""
        if self._table is None:
            return self._index, self._repeats
        index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self._index}
        repeats: dict[int, dict[tuple[int, ...], tuple[int, int]]] = {n: {} for n in self._index}
        for n, pos, seen, run in self._table.entries():
            gram = tuple(self._text[pos - n : pos])
            index[n][gram] = pos
            if seen > 1:
                repeats[n][gram] = (seen, run)
        return index, repeats

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
        """The tokens that followed the most recent earlier occurrence of the longest
        suffix n-gram (n_max down to n_min), at most ``k``, with the match's length
        (``match``, 0: none), whether it ``resumed`` a copy, and ``probs``: the latest
        run of the n-gram's earlier occurrences followed by the first token, over all of
        them (see the class; 1.0 for a resumed copy), once per token; ``p_min`` and
        ``p_path_min`` are ignored."""
        self._update(history)
        if k <= 0:
            return Draft([])
        size, match, resumed = len(history), 0, False
        share = 1.0
        j: int | None = None
        if hit := self._latest(history, size):
            n, j, seen, run = hit
            measure = self._lookup.match_length if self._lookup is not None else match_length
            match = measure(history, j, size, n)
            share = run / seen
        if match < RESUME_MATCH and self._copy is not None:
            long_at, at, src = self._copy
            if size - long_at > RESUME_SPAN:
                self._copy = None
            elif (r := self._resume(history, src + size - at)) is not None and (
                r[1] >= match  # a longer match elsewhere wins
            ):
                j, match, resumed, share = r[0], r[1], True, 1.0
                self._copy = (long_at, size, j)  # realigned; the span still from the copy
        if j is None:
            return Draft([])
        if match >= RESUME_MATCH:
            self._copy = (size, size, j)
        tokens = list(history[j : min(j + k, size)])
        return Draft(tokens, probs=[share] * len(tokens), match=match, resumed=resumed)

    def _latest(self, history: Sequence[int], size: int) -> tuple[int, int, int, int] | None:
        """The longest suffix n-gram of ``history`` (n_max down to n_min) that was indexed:
        (n, the position right after its latest occurrence, its occurrences, the latest of
        them in a row followed by the same token); None if none was."""
        top = min(self.n_max, size - 1)
        if self._table is not None:
            return self._table.find(history, size, top)
        for n in range(top, self.n_min - 1, -1):
            gram = tuple(history[size - n :])
            j = self._index[n].get(gram)
            if j is not None:
                return (n, j, *self._repeats[n].get(gram, (1, 1)))
        return None

    def _resume(self, history: Sequence[int], expected: int) -> tuple[int, int] | None:
        """The source position and match length of the longest suffix n-gram (n_max down
        to n_min) that occurs ending within ``RESUME_WINDOW`` of ``expected``, nearest
        first; None if none does."""
        size = len(history)
        lo, hi = max(0, expected - RESUME_WINDOW), min(size - 1, expected + RESUME_WINDOW)
        nearest = sorted(range(lo, hi + 1), key=lambda p: abs(p - expected))
        # each position's agreement with the text's end, counted back token by token: the
        # longest n-gram found is the most any position agrees (the nearest such first)
        top = min(self.n_max, size - 1)
        best, found = self.n_min - 1, None
        for j in nearest:
            m = 0
            while m < top and m < j and history[j - 1 - m] == history[size - 1 - m]:
                m += 1
            if m > best:
                best, found = m, j
                if m == top:
                    break
        return None if found is None else (found, match_length(history, found, size, best))
