"""The sequences an engine generates on, and what each holds between generations.

A :class:`Slot` is one sequence (llama-server's ``server_slot``): the loop over its
sequence of the target's context, its drafters (a draft model's sequence, the MTP layers,
the lookups' indexes) and, under ``--parallel``, its own timings. What it holds outlives a
generation: the next one keeps the prefix its prompt shares with it (the loop's
``cache_prompt``, :meth:`specgguf.llama.backend.LlamaContext.reuse`), and the whole of it
can be copied out of llama.cpp into a :class:`SavedPrompt` and back (a host-memory or disk
prompt cache, ``run --prompt-cache``). The engine owns the slots; a scheduler asks the
engine which slot a prompt should go to (:func:`best_slot`) and never reaches into one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from specgguf.engine.drafter_map import Drafting
from specgguf.llama.backend import DraftHead, LlamaContext, SequenceState
from specgguf.speculative.costmodel import Timings
from specgguf.speculative.draft import TargetEvaluator
from specgguf.speculative.drafters import ModelDrafter, MtpDrafter
from specgguf.speculative.loop import SpeculativeDecoder

_D = TypeVar("_D")


@dataclasses.dataclass(frozen=True, eq=False)
class HeadState:
    """What a head (the MTP layers, an EAGLE-3 head) held: its KV cache (``data``,
    llama.cpp's sequence state), the tokens it holds, and the target's hidden state after
    its last position (``row_at``, ``row``: float32[n_embd]; -1 and None: none)."""

    data: bytes
    tokens: npt.NDArray[np.int32]
    row_at: int = -1
    row: npt.NDArray[np.float32] | None = None

    @property
    def nbytes(self) -> int:
        row = self.row.nbytes if self.row is not None else 0
        return len(self.data) + self.tokens.nbytes + row


@dataclasses.dataclass(frozen=True, eq=False)
class SavedPrompt:
    """Everything one sequence held, out of llama.cpp: the target's sequence state
    (tokens, KV cells, recurrent state and its checkpoints), the draft model's (its
    tokens start at history position ``draft_offset``) and the head's (the MTP layers', an
    EAGLE-3 head's)."""

    target: SequenceState
    draft: SequenceState | None = None
    draft_offset: int = 0
    head: HeadState | None = None

    @property
    def tokens(self) -> npt.NDArray[np.int32]:
        """The target's tokens: what a prompt must start with to reuse it."""
        return self.target.tokens

    @property
    def nbytes(self) -> int:
        """Bytes held (states, checkpoints, tokens)."""
        draft = self.draft.nbytes if self.draft is not None else 0
        return self.target.nbytes + draft + (self.head.nbytes if self.head is not None else 0)


def common_prefix(a: npt.NDArray[np.int32], b: Sequence[int] | npt.NDArray[np.int32]) -> int:
    """The length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != np.asarray(b[:n], np.int32))
    return int(differ[0]) if len(differ) else n


@dataclasses.dataclass(eq=False)
class Slot:
    """One sequence: its loop (``decoder``, over ``target``: the context itself, or its
    view through the batcher of ``--parallel``), its target sequence (``ctx``), its
    drafting (a draft model's sequence ``draft_ctx``, a head ``head``: the MTP layers or an
    EAGLE-3 head), its
    timings by deterministic mode (``--parallel``: its own, told which other sequences
    share its batches), and when it last started a generation (``last_used``, by
    :func:`time.monotonic`)."""

    index: int
    decoder: SpeculativeDecoder
    target: TargetEvaluator
    ctx: LlamaContext
    drafting: Drafting
    draft_ctx: LlamaContext | None = None
    head: DraftHead | None = None
    timings: dict[bool, Timings] = dataclasses.field(default_factory=dict)
    last_used: float = 0.0

    def batch_others(self, others: tuple[int, ...], active: int = 1) -> None:
        """The ids of the other sequences in the next target batch, for auto mode's costs
        (:meth:`Timings.share_batch`); a deterministic generation's batches are its own,
        as a recurrent target's (the batcher decodes each of their evaluations alone: no
        ``others``). With no other sequence ``active``, its steps' times are its own, and
        auto mode learns from them."""
        for det, t in self.timings.items():
            t.share_batch(() if det else others, solo=active <= 1)

    @property
    def n_cached(self) -> int:
        """Positions the target's sequence holds."""
        return self.ctx.n_past

    @property
    def holds_media(self) -> bool:
        """Whether the target's sequence holds a medium's rows (not kept in the prompt
        cache: it matches prompts by their tokens)."""
        return self.ctx.holds_media

    @property
    def media_end(self) -> int:
        """The position after the last medium's rows the target's sequence holds (0:
        none)."""
        return self.ctx.media_end

    def cached_prefix(self, tokens: Sequence[int], media: Sequence[object] = ()) -> int:
        """How many leading ``tokens`` the target's sequence holds (up to the first medium
        it and the prompt's ``media`` do not share: :meth:`LlamaContext.cached_prefix`)."""
        return self.ctx.cached_prefix(tokens, media)

    def state_bytes(self) -> int:
        """What :meth:`save` would copy of the target's and the draft model's states, in
        bytes (llama.cpp sizes them without copying)."""
        draft = self.draft_ctx.state_bytes() if self.draft_ctx is not None else 0
        return self.ctx.state_bytes() + draft

    def drafter(self, kind: type[_D]) -> _D | None:
        """The sequence's drafter of class ``kind`` (those over a state :meth:`save`
        copies, the draft model's sequence or the MTP layers' cache, follow what it
        holds), or None."""
        return next((d for d in self.drafting.drafters.values() if isinstance(d, kind)), None)

    def save(self) -> SavedPrompt:
        """A copy of what the sequence holds (target, draft model, head).

        Raises:
            BackendError: llama.cpp could not copy a state.
        """
        draft, offset = None, 0
        model = self.drafter(ModelDrafter)
        if self.draft_ctx is not None and model is not None:
            draft, offset = self.draft_ctx.save_state(), model.offset
        kept = None
        drafter = self.drafter(MtpDrafter)
        if self.head is not None and drafter is not None:
            held, row = drafter.held()
            at, vec = row if row is not None else (-1, None)
            kept = HeadState(self.head.save_state(), np.asarray(held, np.int32), at, vec)
        return SavedPrompt(self.ctx.save_state(), draft, offset, kept)

    def load(self, saved: SavedPrompt) -> None:
        """Make the sequence hold ``saved`` (from :meth:`save` on a slot of this engine,
        or of one loaded alike: the prompt-cache files check that). A part the engine
        does not have is skipped; one it has that ``saved`` lacks is emptied.

        Raises:
            BackendError: llama.cpp refused a state (that part is then empty).
        """
        self.ctx.load_state(saved.target)
        model = self.drafter(ModelDrafter)
        if self.draft_ctx is not None and model is not None:
            if saved.draft is not None:
                self.draft_ctx.load_state(saved.draft)
                model.follow(saved.draft_offset, saved.draft.tokens.tolist())
            else:
                self.draft_ctx.rollback(0)
                model.follow(0, [])
        drafter = self.drafter(MtpDrafter)
        if self.head is not None and drafter is not None:
            if saved.head is not None:
                self.head.load_state(saved.head.data, len(saved.head.tokens))
                kept = saved.head
                row = (kept.row_at, kept.row) if kept.row is not None else None
                drafter.follow(kept.tokens.tolist(), row)
            else:
                self.head.rollback(0)
                drafter.follow([], None)


def best_slot(
    slots: Sequence[Slot],
    free: Sequence[int],
    tokens: Sequence[int],
    similarity: float,
    media: Sequence[object] = (),
) -> int:
    """The free slot a prompt of ``tokens`` (with ``media`` at their positions) should go
    to, as llama-server chooses (``get_available_slot``, tools/server/server-context.cpp):
    the one whose cache shares the longest prefix with it (up to the first medium they do
    not share), when that is more than ``similarity`` of the prompt
    (``--slot-prompt-similarity``; 0: never by prefix); else the least recently used
    (ties: the lowest index, whose batches cost llama.cpp fewest micro-batches). Unlike
    llama-server, a slot holding images that the prompt would drop is not taken by
    prefix, and is the last taken by age: the prompt cache does not keep images, so they
    would be read again at their conversation's next turn.

    Raises:
        ValueError: no slot is free.
    """
    if not free:
        raise ValueError("no free slot")
    if similarity > 0 and tokens:
        shared = {i: slots[i].cached_prefix(tokens, media) for i in free}
        best = max(free, key=lambda i: (shared[i], -slots[i].last_used, -i))
        if shared[best] / len(tokens) > similarity and shared[best] >= slots[best].media_end:
            return best
    return min(free, key=lambda i: (slots[i].holds_media, slots[i].last_used, i))
