"""Drafting with the target's own multi-token-prediction (MTP) layers, as llama.cpp's
``--spec-type draft-mtp`` does (common/speculative.cpp, ``common_speculative_impl_mtp``;
the layers: DeepSeek-V3 technical report, section 2.2).

The head's row for position p reads the token there and the target's hidden state after
position p - 1, and predicts the token at p + 1. Its own KV cache holds the committed
text: before drafting, it reads the positions the target committed since (the target's
hidden states of those positions, :class:`HiddenStates`); then one row for the last
committed token (the target has not evaluated it yet: it opens the next verification)
gives the first draft token, and each further row feeds the head's own hidden state back
with the token it just drafted. The draft's rows are dropped again at the end.

With several MTP blocks (``Head.n_heads``), they draft in turn, as llama.cpp chains them:
block j gives the draft's (j + 1)-th token from the rows of the last committed token and
the j tokens drafted before it, each with the hidden state that came with it; a draft then
has at most as many tokens as there are blocks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from specgguf.speculative.draft import Draft, Drafter
from specgguf.speculative.drafters.model import pick_token
from specgguf.speculative.sampling import Distribution, SamplerParams


class HiddenStates(Protocol):
    """The target's context as the head reads it: ``n_past`` committed positions and the
    hidden state after each (float32[end - start, n_embd] for positions start..end - 1);
    ``forget_hidden`` drops the rows before a position, read for good; ``media_keys``: the
    first position of each medium it holds, and its content's key (``holds_media``: any).
    A medium's positions hold placeholder tokens, whose hidden states saw the medium."""

    @property
    def n_past(self) -> int: ...

    def hidden_rows(self, start: int, end: int) -> npt.NDArray[np.float32]: ...

    def forget_hidden(self, before: int) -> None: ...

    @property
    def holds_media(self) -> bool: ...

    def media_keys(self) -> dict[int, bytes]: ...


class Head(Protocol):
    """The MTP layers' context (see ``backend.MtpHead``; an EAGLE-3 head's, see
    ``backend.Eagle3Head``): ``encode`` maps the target's hidden states (float32[m,
    n_embd]) to the rows ``eval`` reads for them; ``eval`` rows of (token, input row) at
    the next positions, returning the logits and the head's own hidden state after the
    last when ``last`` (None where nothing was decoded); ``rollback`` cuts its cache.
    With ``n_heads`` MTP blocks above 1, ``chain(j, tokens, inputs)`` decodes the draft's
    rows again with block j and returns the same as ``eval`` (``backend.MtpHead.chain``)."""

    n_ctx: int
    n_vocab: int
    n_embd: int
    n_heads: int

    @property
    def n_past(self) -> int: ...

    def encode(self, inputs: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]: ...

    def eval(
        self, tokens: Sequence[int], inputs: npt.NDArray[np.float32], *, last: bool
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]] | None: ...

    def rollback(self, n_keep: int) -> None: ...

    def chain(
        self, block: int, tokens: Sequence[int], inputs: npt.NDArray[np.float32]
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]: ...


class MtpDrafter(Drafter):
    """Drafts up to K tokens per step with the target's MTP layers, one head evaluation
    per draft token, greedily (stopping below ``p_min``) or sampled from the head's
    distribution (whose q the acceptance rule uses, as for a draft model).

    Args:
        head: the MTP layers' context.
        target: the target's context, which keeps its hidden states.
        n_vocab_target: ids at or beyond this are never proposed.
    """

    name = "mtp"
    #: whether the row of the last token of the history stays in the head's cache after
    #: a draft (llama.cpp's draft-mtp decodes it again at the next draft, its draft-eagle3
    #: keeps it: the same batches as llama.cpp's, and so the same drafts)
    keep_seed = False

    def __init__(self, head: Head, target: HiddenStates, n_vocab_target: int) -> None:
        self.head = head
        self.target = target
        self.n_vocab = min(n_vocab_target, head.n_vocab)
        self._held: list[int] = []  # the tokens in the head's cache, by position
        # the media whose placeholders the head read (their hidden states saw them): their
        # first positions and content keys, as the target's media_keys gave them
        self._media: dict[int, bytes] = {}
        # the target's hidden state after the head's last position (position,
        # float32[n_embd]), kept
        # across generations: the next one's first row reads it, and the target may have
        # kept that position from its cache without computing it again
        self._row: tuple[int, npt.NDArray[np.float32]] | None = None
        self._synced = 0  # a prefix of _held known to equal this generation's history
        # the row the last catch-up with ``last`` decoded for the last token (what
        # chained blocks read again with it)
        self._seed: npt.NDArray[np.float32] | None = None
        self.seconds = 0.0
        self._token_seconds = 0.0

    @property
    def most(self) -> int | None:
        """The most tokens a draft can have whatever K (several MTP blocks: one each;
        None: K's)."""
        return self.head.n_heads if self.head.n_heads > 1 else None

    def reset(self) -> None:
        """A new generation: the head's cache is kept (a prompt that shares a prefix with
        it is read from there on), and the hidden state after its last position taken
        while the target still holds it."""
        self._synced = 0
        p = self.head.n_past - 1
        if p >= 0 and (self._row is None or self._row[0] != p):
            try:
                self._row = (p, self.target.hidden_rows(p, p + 1)[0])
            except ValueError:  # forgotten: reuse_limit has the target compute it again
                self._row = None

    def held(self) -> tuple[list[int], tuple[int, npt.NDArray[np.float32]] | None]:
        """The tokens the head's cache holds, and the target's hidden state kept after
        its last position (position, float32[n_embd]; None: none)."""
        return list(self._held), self._row

    def follow(
        self, tokens: Sequence[int], row: tuple[int, npt.NDArray[np.float32]] | None
    ) -> None:
        """The head's context was made to hold ``tokens`` (a saved prompt restored into
        it), and ``row`` is the hidden state kept after its last position (the target was
        made to hold the same prompt first: its media are the ones the head read)."""
        self._held = list(tokens)
        self._media = {}
        self._note_media(0, len(tokens))
        self._synced = 0
        self._row = row if row is not None and row[0] == len(tokens) - 1 else None

    def reuse_limit(self, history: Sequence[int]) -> int | None:
        """The head goes on from the longest prefix of ``history`` it holds (H
        positions); its rows read the target's hidden states of the positions before
        theirs, which the target has only for what it computes in this generation (none
        after a saved prompt was restored). So the target keeps at most H positions when
        the hidden state after the head's last one was kept, else at most H - 1."""
        # (the target holds at most all but the last token before the first step)
        keep = min(self.cached_tokens(history), len(history) - 1)
        row = self._row
        if keep and keep == len(self._held) and row is not None and row[0] == keep - 1:
            # the positions after the head's are read again by the target, for their
            # hidden states (a target whose state was restored has none of its own)
            return keep
        return max(0, keep - 1)

    def prefill(self, history: Sequence[int]) -> None:
        """Read what the target has committed of the prompt (all but its last token)."""
        t0 = time.perf_counter()
        self._catch_up(history, last=False)
        self.seconds += time.perf_counter() - t0

    def _cut(self, n: int) -> None:
        """Drop the head's positions from ``n`` on (and the kept hidden state of one of
        them: it followed other tokens)."""
        self.head.rollback(n)
        del self._held[n:]
        if self._media:
            self._media = {p: k for p, k in self._media.items() if p < n}
        self._synced = min(self._synced, n)
        if self._row is not None and self._row[0] >= n:
            self._row = None

    def _rows(self, start: int, end: int) -> npt.NDArray[np.float32]:
        """The target's hidden states after positions ``start .. end - 1``, the first
        from the one kept across generations where the target no longer has it.

        Raises:
            ValueError: one the target has not computed (or forgot) and none kept.
        """
        try:
            return self.target.hidden_rows(start, end)
        except ValueError:
            if self._row is None or self._row[0] != start:
                raise
        first = self._row[1][None, :]
        return np.concatenate([first, self.target.hidden_rows(start + 1, end)]) if (
            end > start + 1) else first  # fmt: skip

    def cached_tokens(self, history: Sequence[int]) -> int:
        """How many leading tokens of ``history`` the head's cache holds (within a
        generation, only what it read since the last catch-up is compared). A cache cut
        by someone else (a calibration) holds only its first ``n_past``."""
        if len(self._held) > self.head.n_past:
            self._cut(self.head.n_past)
        n = min(self._synced, len(self._held), len(history))
        limit = min(len(self._held), len(history))
        while n < limit and self._held[n] == history[n]:
            n += 1
        if self._media or self.target.holds_media:
            # (a medium's placeholder tokens are the same whatever the image: the head's
            # rows there and after are the target's hidden states of the one it read)
            now = self.target.media_keys()
            for p in sorted({*self._media, *now}):
                if p >= n:
                    break
                if self._media.get(p) != now.get(p):
                    return p
        return n

    def _catch_up(
        self, history: Sequence[int], *, last: bool
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]] | None:
        """Evaluate the committed positions the head has not read (and, with ``last``,
        the last history token, whose logits and hidden state are returned)."""
        end = self.target.n_past  # committed and evaluated by the target: history[:end]
        keep = min(self.cached_tokens(history), end)
        if keep < self.head.n_past:
            self._cut(keep)
        stop = end + 1 if last else end
        if stop <= keep:
            return None
        tokens = list(history[keep:stop])
        inputs = np.zeros((len(tokens), self.head.n_embd), np.float32)
        lo = max(keep - 1, 0)
        if stop - 1 > lo:
            # row for position p reads the hidden state after p - 1 (position 0: zeros)
            rows = self._rows(lo, stop - 1)
            inputs[len(tokens) - len(rows) :] = rows
        rows = self.head.encode(inputs)
        out = self.head.eval(tokens, rows, last=last)
        self._seed = rows[-1] if last else None
        self._note_media(keep, stop)
        self._held.extend(tokens)
        self._synced = len(self._held)
        # the next catch-up starts at the head's end: it reads from the state before it
        self.target.forget_hidden(min(end, stop) - 1)
        return out

    def _note_media(self, start: int, end: int) -> None:
        """Remember the target's media among positions ``start .. end - 1``, which the
        head has just read."""
        if self.target.holds_media:
            self._media.update((p, k) for p, k in self.target.media_keys().items()
                               if start <= p < end)  # fmt: skip

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
        """Up to ``k`` draft tokens after ``history`` (whose all but last token the target
        has evaluated); greedy drafting stops early at a token whose probability under the
        head is below ``p_min``, or at which the product of the head's probabilities along
        the draft falls below ``p_path_min``, and the draft's ``stopped`` says so.
        ``token_seconds`` is the latest measured time per drafted token after the first.
        With several MTP blocks, at most one token per block (see the module)."""
        blocks = self.head.n_heads
        k = min(k, self.head.n_ctx - len(history), blocks if blocks > 1 else k)
        if k <= 0 or not history:
            return Draft([], token_seconds=self._token_seconds)
        t0 = time.perf_counter()
        out = self._catch_up(history, last=True)
        if out is None:  # (an EAGLE-3 head has no row for a text of one token)
            self._cut(len(history) - 1)
            return Draft([], token_seconds=self._token_seconds)
        logits, h = out
        base = len(history)  # the head's rows past this are the draft's own
        chain = [self._seed] if self._seed is not None else []
        t_first = time.perf_counter()
        tokens: list[int] = []
        dists: list[Distribution] | None = None if sampler.greedy else []
        stopped = False
        path = 1.0
        for i in range(k):
            tok, path = pick_token(logits[: self.n_vocab], sampler, rng, p_min, dists,
                                   path=path, p_path_min=p_path_min)  # fmt: skip
            if tok is None:
                stopped = True
                break
            tokens.append(tok)
            if i + 1 < k and blocks > 1:
                assert self._seed is not None
                chain.append(h)
                logits, h = self.head.chain(i + 1, [history[-1], *tokens], np.stack(chain))
            elif i + 1 < k:
                step = self.head.eval([tok], h[None, :], last=True)
                assert step is not None
                logits, h = step
        # The last history token's row goes too: the target has not evaluated it, and
        # the head reads it again with the target's hidden state once it has (unless
        # keep_seed: its row reads the state before it, as llama.cpp keeps it).
        self._cut(base if self.keep_seed else base - 1)
        t_end = time.perf_counter()
        self.seconds += t_end - t0
        if len(tokens) > 1:
            self._token_seconds = (t_end - t_first) / (len(tokens) - 1)
        return Draft(tokens, dists, stopped=stopped, token_seconds=self._token_seconds)
