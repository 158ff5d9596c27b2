"""Drafting with a DFlash block-diffusion draft (Chen et al. 2026, "DFlash: Block
Diffusion for Flash Speculative Decoding"), as llama.cpp's ``--spec-type draft-dflash``
does (common/speculative.cpp, ``common_speculative_impl_draft_dflash``).

The draft's cache holds, at each position the target committed, K/V made from the inputs
of some of the target's layers there (the target's own rows of that position: no
shift, unlike the MTP layers and EAGLE-3). A draft of K tokens is one decode of the block
[last token, mask x K] at the next positions, attending over the cache and the whole
block at once; the logits of the block's rows 1..K are the draft's, taken greedily
(llama.cpp's top-1) or sampled, each row's distribution the acceptance rule's q. So a
draft costs one decode whatever K (up to the trained block size less one), where the MTP
layers and EAGLE-3 pay one per token.

A DSpark draft (llama.cpp's ``--spec-type draft-dspark``: a DFlash draft with a Markov
head) drafts the same way from its head's block (:class:`BlockHead`), whose row 0 may
predict too (a block of K rows, up to the whole block), and with a confidence head stops
at the first token whose confidence is below ``p_min`` instead of its probability, as
llama.cpp does. A DFlash2 draft (a selector) gives, for each block row, its best
candidates and their scores after each candidate of the row before; the draft is the
greedy walk through them (:func:`walk_lattice`), a deterministic draft even when sampling.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from specgguf.speculative.draft import Draft
from specgguf.speculative.drafters.model import greedy_goes_on, pick_token
from specgguf.speculative.drafters.mtp import Head, HiddenStates, MtpDrafter
from specgguf.speculative.sampling import Distribution, SamplerParams


class BlockHead(Head, Protocol):
    """A DFlash draft's context (see ``backend.DFlashHead``): :meth:`Head.eval` writes the
    target's rows at the next positions; ``block`` gives the logits of ``n`` draft tokens
    (1 .. ``max_draft``) after ``first`` (float32[n, n_vocab]) and leaves the cache as it
    was; with ``confidence_head``, ``confidence`` gives the latest block's estimates that
    the target accepts each token (float32[n]); with ``selector_top_k``, ``block`` gives
    a DFlash2 selector's lattice rows instead of logits (:func:`walk_lattice`)."""

    block_size: int
    max_draft: int
    confidence_head: bool
    selector_top_k: int

    def block(self, first: int, n: int) -> npt.NDArray[np.float32]: ...

    def confidence(self) -> npt.NDArray[np.float32]: ...


def walk_lattice(
    rows: npt.NDArray[np.float32],
    top_k: int,
    n_vocab: int,
    p_min: float = 0.0,
    p_path_min: float = 0.0,
) -> tuple[list[int], bool]:
    """The greedy path through a DFlash2 selector's lattice, as llama.cpp walks it
    (common/speculative.cpp, ``common_speculative_impl_draft_dflash::draft``).

    Each of ``rows`` (float32[n, width], one per draft token) holds the ids of its
    ``top_k`` candidates (as floats), then ``top_k`` x ``top_k`` scores: those of its
    candidates after candidate j of the row before at ``top_k * (1 + j)``. The walk starts
    at j = 0 (the first row's scores do not depend on it: its predecessor is the last
    token) and takes the best-scoring candidate each time. It stops before a candidate
    whose softmax over its row's scores is below ``p_min``, or at which the product of
    those along the walk is below ``p_path_min``, or whose id is not below ``n_vocab``.

    Returns:
        The draft's ids, and whether it stopped before its last row.
    """
    tokens: list[int] = []
    pred = 0
    path = 1.0
    for row in rows:
        scores = row[top_k * (1 + pred) : top_k * (2 + pred)]
        pred = int(scores.argmax())
        goes_on, path = greedy_goes_on(scores, pred, path, p_min, p_path_min)
        if not goes_on:
            return tokens, True
        tok = int(row[pred])
        if not 0 <= tok < n_vocab:
            return tokens, True
        tokens.append(tok)
    return tokens, False


class DFlashDrafter(MtpDrafter):
    """Drafts up to the head's ``max_draft`` tokens per step (the block less one, or the
    whole block for a DSpark draft whose block row 0 predicts) with a DFlash, DSpark or
    DFlash2 draft, one decode per draft (see the module).

    Args:
        head: the draft's context.
        target: the target's context, keeping the inputs of the draft's target layers.
        n_vocab_target: ids at or beyond this are never proposed.
    """

    name = "dflash"

    def __init__(self, head: BlockHead, target: HiddenStates, n_vocab_target: int) -> None:
        super().__init__(head, target, n_vocab_target)
        self.block_head = head

    @property
    def most(self) -> int | None:
        """The most tokens a draft can have whatever K (what its block holds)."""
        return self.block_head.max_draft

    def reset(self) -> None:
        """A new generation: the draft's cache is kept (a prompt that shares a prefix with
        it is read from there on)."""
        self._synced = 0

    def follow(
        self, tokens: Sequence[int], row: tuple[int, npt.NDArray[np.float32]] | None
    ) -> None:
        """The draft's context was made to hold ``tokens`` (``row`` is not used: each
        position reads the target's rows of its own)."""
        self._held = list(tokens)
        self._media = {}
        self._note_media(0, len(tokens))
        self._synced = 0
        self._row = None

    def reuse_limit(self, history: Sequence[int]) -> int | None:
        """The target keeps at most the prefix of ``history`` the draft holds (H): it
        computes the rows of the positions after again, which the draft reads."""
        return min(self.cached_tokens(history), len(history) - 1)

    def _catch_up(
        self, history: Sequence[int], *, last: bool
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]] | None:
        """Write the rows of the committed positions the draft has not read (``last`` has
        no meaning here: the last token is read by :meth:`propose`'s block)."""
        end = self.target.n_past  # committed and evaluated by the target: history[:end]
        keep = min(self.cached_tokens(history), end)
        if keep < self.head.n_past:
            self._cut(keep)
        if end > keep:
            tokens = list(history[keep:end])
            self.head.eval(tokens, self.target.hidden_rows(keep, end), last=False)
            self._note_media(keep, end)
            self._held.extend(tokens)
        self._synced = len(self._held)
        self.target.forget_hidden(end)
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
    ) -> Draft:
        """Up to ``k`` draft tokens after ``history`` (whose all but last token the target
        has evaluated), at most the head's ``max_draft``, from one block (llama.cpp
        decodes its configured draft length's block even where a step keeps fewer: the
        rows attend to each other, so such a step's drafts differ); greedy drafting stops
        early at a token whose probability under the draft is below ``p_min``, or at which
        the product of the probabilities along the draft falls below ``p_path_min``, and
        the draft's ``stopped`` says so. With a confidence head, ``p_min`` is compared with
        its confidence instead, greedy or sampled (common/speculative.cpp, DSpark); a
        DFlash2 draft's is its walk through its selector's lattice, greedy whatever the
        sampler (:func:`walk_lattice`).
        ``token_seconds`` is the latest draft's time over its tokens."""
        head = self.block_head
        room = head.n_ctx - len(history)
        k = min(k, head.max_draft, room)
        if k <= 0 or not history:
            return Draft([], token_seconds=self._token_seconds)
        t0 = time.perf_counter()
        self._catch_up(history, last=False)
        t_block = time.perf_counter()
        logits = head.block(history[-1], k)
        if head.selector_top_k:
            walked, cut = walk_lattice(logits, head.selector_top_k, self.n_vocab, p_min,
                                       p_path_min)  # fmt: skip
            return self._drafted(Draft(walked, stopped=cut), t0, t_block, k)
        tokens: list[int] = []
        dists: list[Distribution] | None = None if sampler.greedy else []
        stopped = False
        path = 1.0
        conf = head.confidence() if p_min > 0.0 and head.confidence_head else None
        p_token = 0.0 if conf is not None else p_min
        for i, row in enumerate(logits):
            if conf is not None and conf[i] < p_min:
                stopped = True
                break
            tok, path = pick_token(row[: self.n_vocab], sampler, rng, p_token, dists,
                                   path=path, p_path_min=p_path_min)  # fmt: skip
            if tok is None:
                stopped = True
                break
            tokens.append(tok)
        return self._drafted(Draft(tokens, dists, stopped=stopped), t0, t_block, k)

    def _drafted(self, draft: Draft, t0: float, t_block: float, k: int) -> Draft:
        """``draft``, with the time of its block over ``k`` as its ``token_seconds`` (and
        this drafter's latest), its time since ``t0`` counted."""
        t_end = time.perf_counter()
        self.seconds += t_end - t0
        self._token_seconds = draft.token_seconds = (t_end - t_block) / k
        return draft
