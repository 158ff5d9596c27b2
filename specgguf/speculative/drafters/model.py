"""A small draft model (a second GGUF) evaluated through the same backend layer,
autoregressively, K tokens per step. Its KV cache follows the committed sequence: after a
step only the tokens it does not already hold are evaluated."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np
import numpy.typing as npt

from specgguf.speculative.draft import Draft, Drafter, Evaluator
from specgguf.speculative.sampling import Distribution, SamplerParams, distribution, sample

log = logging.getLogger("specgguf")

#: A catch-up of more tokens than this is read without logits first (see propose).
_CATCH_UP_SPLIT = 8


def greedy_goes_on(
    scores: npt.NDArray[np.float32], best: int, path: float, p_min: float, p_path_min: float
) -> tuple[bool, float]:
    """Whether greedy drafting goes on with ``best``, the argmax of ``scores`` (logits,
    float32[n]): its softmax probability is at least ``p_min`` and ``path`` (the product
    of those of the tokens drafted before it) times it at least ``p_path_min``; and that
    product (``path`` unchanged where both thresholds are 0, which skips the softmax)."""
    if p_min <= 0.0 and p_path_min <= 0.0:
        return True, path
    p = 1.0 / float(np.exp(scores - scores[best]).sum())
    path *= p
    return p >= p_min and path >= p_path_min, path


def pick_token(
    row: npt.NDArray[np.float32],
    sampler: SamplerParams,
    rng: np.random.Generator,
    p_min: float,
    dists: list[Distribution] | None,
    *,
    path: float = 1.0,
    p_path_min: float = 0.0,
) -> tuple[int | None, float]:
    """A drafter's next token from its logits ``row`` (float32[n_vocab]), and the draft's
    path probability with it. Greedy when ``dists`` is None: the argmax, or None (drafting
    stops) when its probability is below ``p_min``, or when ``path`` (the product of the
    probabilities of the tokens drafted before it) times it is below ``p_path_min``. Else
    drawn from the sampler's distribution q, which is appended to ``dists`` for the
    acceptance rule (Leviathan et al. 2023, section 2.3); no threshold applies."""
    if dists is None:
        tok = int(row.argmax())
        goes_on, path = greedy_goes_on(row, tok, path, p_min, p_path_min)
        return (tok if goes_on else None), path
    q = distribution(row, sampler)
    dists.append(q)
    return sample(q, rng), path


class ModelDrafter(Drafter):
    """Drafts with a small model whose vocabulary matches the target's.

    The draft's KV cache holds the history from ``offset`` on. When the history (and the
    draft) would not fit the draft's context, the cache starts again on the most recent
    half of its context: the draft model then sees only the recent text, which costs
    acceptance, never correctness (the target verifies every token). A warning says so
    once.

    A generation's media (:meth:`see_media`) that carry rows for the draft model are read
    as rows at their positions, where its window starts at the history's beginning; else
    the draft reads their placeholder tokens. Its cache is kept across generations only
    up to the first medium it read otherwise than the new prompt has it.

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
        self._owed = 0  # history positions counted as read before they are (defer)
        self._warned = False
        # the generation's media with rows for the draft, by history position
        self._rows: dict[int, Any] = {}
        self._rows_end = 0  # (the row after the last of them)
        # the media the cache holds as rows: history position -> content key
        self._read: dict[int, bytes] = {}
        self.seconds = 0.0
        # seconds per drafted token at the latest proposal that measured it
        self._token_seconds = 0.0

    def reset(self) -> None:
        # The cache is kept: a new prompt that shares a prefix with it reuses that prefix.
        self._synced = 0
        self._owed = 0

    def follow(self, offset: int, tokens: Sequence[int]) -> None:
        """The draft's context was made to hold ``tokens``, the history from position
        ``offset`` on (a saved prompt restored into it, with the media it read as rows)."""
        self.offset = offset
        self._held = list(tokens)
        keys = getattr(self.ctx, "media_keys", None)
        self._read = {p + offset: k for p, k in keys().items()} if keys is not None else {}
        self._synced = 0
        self._owed = 0

    def see_media(self, media: Sequence[object]) -> None:
        """The generation's media (``backend.MediaSpan``\\ s): those with rows for the
        draft model (their ``draft``) are read as rows."""
        self._rows = {d.start: d for m in media if (d := getattr(m, "draft", None)) is not None}
        self._rows_end = max((m.end for m in self._rows.values()), default=0)

    def _media_bound(self, n: int) -> int:
        """``n`` leading positions of the window, cut before the first medium the cache
        and this generation's media hold differently (or read differently), and never
        inside one read as rows."""
        rows = self._rows if self.offset == 0 else {}
        for p in sorted({*self._read, *rows}):
            if p - self.offset >= n:
                break
            want = rows.get(p)
            if self._read.get(p) != (want.key if want is not None else None):
                return max(0, p - self.offset)
            if want is not None and want.end - self.offset > n:  # (inside it)
                return p - self.offset
        return n

    def _read_text(self, history: Sequence[int], start: int, stop: int) -> None:
        """Read ``history[start:stop]`` into the cache (no logits): the media among them
        with rows for the draft as their rows."""
        inside = [m for p, m in self._rows.items() if start <= p and m.end <= stop] if (
            self.offset == 0) else []  # fmt: skip
        if inside:
            self.ctx.prompt(history[start:stop], media=inside)  # (in position order)
            self._read.update((m.start, m.key) for m in inside)
        else:
            self.ctx.eval(history[start:stop], logits="none")
        self._held.extend(history[start:stop])

    def defer(self, history: Sequence[int]) -> None:
        """Read the prompt (all but its last token) at the first draft, not now: until
        then :meth:`cached_tokens` counts it as read, so that auto mode weighs this drafter
        as if it had read it (its offers and catch-up costs as with :meth:`prefill`), and a
        generation that never drafts with it never pays for it."""
        self._owed = len(history) - 1

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
        self._read = {}
        self._synced = 0

    def prefill(self, history: Sequence[int]) -> None:
        """Evaluate the prompt (all but its last token) ahead of generation, as the target
        does, so that drafting starts without a long catch-up."""
        t0 = time.perf_counter()
        self._realign(history)
        self._fit(history, 1)
        keep = self._rewind(min(self._common_prefix(history), len(history) - 1 - self.offset))
        start = self.offset + keep
        if len(history) - 1 > start:
            self._read_text(history, start, len(history) - 1)
        self._synced = len(history) - 1 - self.offset
        self.seconds += time.perf_counter() - t0

    def _realign(self, history: Sequence[int]) -> None:
        """At a generation's first read: another text than the cache's starts its window
        at its beginning; so does a prompt with media the draft reads as rows where it
        fits the context (a window slid in an earlier generation would read their
        placeholders)."""
        if self.offset > len(history) - 1 or self._common_prefix(history) == 0:
            self.offset = 0
        elif self.offset and self._rows and len(history) < self.ctx.n_ctx:
            self.offset = 0
            self.ctx.rollback(0)
            self._held.clear()
            self._read = {}
            self._synced = 0

    def _rewind(self, keep: int) -> int:
        """Cut the cache to its first ``keep`` tokens and return how many it keeps: all
        of them, or none where a recurrent state would have to go back past its
        snapshots (a prompt that repeats an earlier text's prefix, after a step that
        dropped none): it is then read from the start of the window, in one pass, rather
        than read again up to ``keep`` and then on."""
        if not self._within_room(keep):
            keep = 0
        self.ctx.rollback(keep)
        del self._held[keep:]
        if self._read:
            self._read = {p: k for p, k in self._read.items() if p - self.offset < keep}
        return keep

    def cached_tokens(self, history: Sequence[int]) -> int:
        """How many leading tokens of ``history`` need no evaluation by the draft: those
        before its window and those its cache holds (its accepted drafts included), none
        of the window's where a recurrent state could not go back to them (``_rewind``)."""
        common = self._common_prefix(history)
        keep = min(common, len(history) - 1 - self.offset)
        held = self.offset + (common if self._within_room(keep) else 0)
        return max(held, min(self._owed, len(history)))

    def _within_room(self, keep: int) -> bool:
        """Whether the cache can be cut to its first ``keep`` tokens without reading any
        again: always for a KV cache, within the snapshots for a recurrent state."""
        room = self.ctx.rollback_room
        return room is None or self.ctx.n_past - keep <= room

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
        """Up to ``k`` draft tokens after ``history``; greedy drafting stops early at a
        token whose probability under the draft is below ``p_min``, or at which the
        product of the draft's probabilities along the draft falls below ``p_path_min``
        (0: never), and the draft's ``stopped`` says whether it did. Its ``token_seconds``
        is the latest measured time per drafted token (a proposal of one token after a
        catch-up measures none, and repeats the one before)."""
        # A draft of k tokens evaluates k - 1 of them: never more than half the context.
        k = min(k, max(1, self.ctx.n_ctx // 2))
        if k <= 0 or not history:
            return Draft([], token_seconds=self._token_seconds)
        t0 = time.perf_counter()
        if self._owed:  # the first read of a deferred prompt
            self._realign(history)
        self._fit(history, k - 1)
        common = self._common_prefix(history)
        # At least the last history token is evaluated, to get logits after it.
        keep = self._rewind(min(common, len(history) - 1 - self.offset))
        start = self.offset + keep
        if start < self._owed:  # the deferred prompt: prompt time, as when read ahead
            t_prompt = time.perf_counter()
            self._read_text(history, start, self._owed)
            start = self._owed
            self.prompt_seconds += time.perf_counter() - t_prompt
        last = start
        if len(history) - start > _CATCH_UP_SPLIT or (
                self._rows_end > start):  # fmt: skip
            # A long catch-up without logits first (after idle steps): a batcher reads it
            # in pieces beside the other sequences' steps, where a request for logits
            # would go first and hold their verifications up; its last token then alone.
            # (A medium's rows are read so too.)
            self._read_text(history, start, len(history) - 1)
            last = len(history) - 1
        logits = self.ctx.eval(history[last:], logits="last")
        self._held.extend(history[last:])
        self._synced = len(history) - self.offset
        self._owed = 0
        t_first = time.perf_counter()
        tokens: list[int] = []
        dists: list[Distribution] | None = None if sampler.greedy else []
        stopped = False
        path = 1.0
        # A recurrent draft cannot drop its own draft tokens again: it drafts in a copy
        # of its sequence, and reads the accepted ones with the next step's catch-up.
        forked = self.ctx.rollback_room is not None
        with self.ctx.scratch() if forked else nullcontext():
            for i in range(k):
                tok, path = pick_token(logits[-1, : self.n_vocab], sampler, rng, p_min, dists,
                                       path=path, p_path_min=p_path_min)  # fmt: skip
                if tok is None:
                    stopped = True
                    break
                tokens.append(tok)
                if i + 1 < k:
                    logits = self.ctx.eval([tok], logits="last")
                    if not forked:
                        self._held.append(tok)
        t_end = time.perf_counter()
        self.seconds += t_end - t0
        # The first evaluation may catch up on many tokens; the others are one token each.
        if len(tokens) > 1:
            self._token_seconds = (t_end - t_first) / (len(tokens) - 1)
        elif start >= len(history) - 2:
            self._token_seconds = t_end - t0
        return Draft(tokens, dists, stopped=stopped, token_seconds=self._token_seconds)

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
        return self._media_bound(n) if self._read or self._rows else n
