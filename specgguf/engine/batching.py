"""Several generations at once, their evaluations decoded together: continuous batching
over the sequences of one llama.cpp context (``serve --parallel N``, llama-server's
``-np N`` slots).

Each generation runs, unchanged, as a task: a greenlet on the thread that owns the
engine. Where a generation evaluates tokens (its target's verification, its prompt, its
draft model's steps) it hands the evaluation to the :class:`Batcher` and is parked; once
every task is parked, the batcher decodes what they wait for, one context at a time, in
one ``llama_decode`` (:meth:`specgguf.llama.backend.LlamaContext.decode_many`), and
resumes them with their logits. A step of the server is then one target batch holding,
for every active sequence, its last token and its draft under its own sequence id, as
llama-server's ``pre_decode()`` builds it (tools/server/server-context.cpp), and a draft
model drafts for every sequence together, one draft batch per draft position.

Which context is decoded next: the draft model's when a task waits for a draft token
(drafting comes before the verification it feeds), else the target's and, after it, a
piece of what the draft model has to read of new prompts (so that neither stalls the
other). A batch takes verifications whole (all their logits in one
decode), then fills the rows left (``n_batch``) with pieces of prompts, so that a new
request's prompt is read in chunks beside the running sequences' steps instead of
stalling them; what it takes goes into the batch in sequence order, as llama.cpp's
micro-batches want it (:func:`specgguf.speculative.costmodel.micro_batches`). A target
batch of verifications alone is padded with throw-away rows to as many rows for each
sequence (of a run of consecutive ids) where the calibrated curve says one micro-batch of
them costs less than the several llama.cpp would make (a GPU's); the pads leave the cache
right after the decode.

Decoded alone, in a ``llama_decode`` of their own: evaluations of a context whose memory
holds a recurrent state (a multi-sequence batch would be split by llama.cpp's equal-length
micro-batches, and a state's snapshots are per decode), and those of a deterministic
generation (its batch shapes are fixed, :mod:`specgguf.llama.invariance`: its output is
then what the same request gives alone).

Everything here runs on one thread: llama.cpp is called from no other (see
``server.scheduler.engine_thread``), and tasks never run at the same time, so a task's
rollbacks and reads need no lock.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal

import greenlet
import numpy as np
import numpy.typing as npt

from specgguf.llama.backend import LlamaContext
from specgguf.speculative.costmodel import cheapest_micro_batches

log = logging.getLogger("specgguf")

Want = Literal["all", "last", "none"]


@dataclasses.dataclass(eq=False)
class _Request:
    """An evaluation a task waits for: ``tokens`` appended to sequence ``ctx``; ``done``
    of them decoded so far (prompts are decoded in pieces)."""

    task: Task
    ctx: LlamaContext
    tokens: Sequence[int]
    want: Want
    done: int = 0
    #: instead of an evaluation: a decode of its own (:meth:`Batcher.call_alone`)
    call: Callable[[], object] | None = None

    @property
    def outputs(self) -> bool:
        return self.want != "none"


class Task:
    """One generation's greenlet on sequence ``slot``, which the others' planning counts
    (:meth:`Batcher.others`)."""

    def __init__(self, batcher: Batcher, slot: int, run: Callable[[], None]) -> None:
        self.slot = slot
        #: whether its latest target evaluation was decoded alone (not in a shared batch)
        self.alone = False
        self._g = greenlet.greenlet(run, parent=batcher.hub)

    @property
    def done(self) -> bool:
        return bool(self._g.dead)


class Batcher:
    """Runs tasks (:meth:`add`) and decodes their evaluations together (the module's
    rule); made on the thread that calls llama.cpp, which then calls :meth:`step` until
    :attr:`active` is empty.

    Args:
        target: the target's parallel context (``n_parallel`` sequences).
        draft: the draft model's, when one is loaded.
        cost: seconds of a target micro-batch of n rows after so many cached positions
            (:meth:`~specgguf.speculative.costmodel.Timings.batch_time`): where it says
            so, a target batch of verifications is padded to even rows
            (:func:`~specgguf.speculative.costmodel.cheapest_micro_batches`); None: never.
        company: called before every resumption of a task with its slot, the other tasks'
            slots in its target batches (:meth:`others`) and the number of active tasks
            (auto mode plans each step with them).
    """

    def __init__(
        self,
        target: LlamaContext,
        draft: LlamaContext | None = None,
        cost: Callable[[int, int], float] | None = None,
        company: Callable[[int, tuple[int, ...], int], None] | None = None,
    ) -> None:
        self.target = target
        self.draft = draft
        self.cost = cost
        self.company = company
        self.hub = greenlet.getcurrent()
        self.active: list[Task] = []
        self._tasks: dict[greenlet.greenlet, Task] = {}  # the active tasks by greenlet
        self._ready: deque[tuple[Task, Any, bool]] = deque()
        self._pending: list[_Request] = []

    def add(self, slot: int, run: Callable[[], None]) -> Task:
        """Start ``run`` (which must catch its own errors) as a task at the next
        :meth:`step`; ``slot`` orders the tasks of a batch."""
        task = Task(self, slot, run)
        self.active.append(task)
        self._tasks[task._g] = task
        self.active.sort(key=lambda t: t.slot)
        self._ready.append((task, None, False))
        return task

    def evaluate(self, ctx: LlamaContext, tokens: Sequence[int], want: Want) -> Any:
        """``ctx.eval(tokens, logits=want)``, batched with the other tasks' when called
        from a task, else at once."""
        task = self._tasks.get(greenlet.getcurrent())
        if task is None:  # the hub, or not one of ours
            return ctx.eval(tokens, logits=want)
        if ctx.base is self.target:
            task.alone = self._alone(ctx)
        return self.hub.switch(_Request(task, ctx, list(tokens), want))

    def call_alone(self, ctx: LlamaContext, call: Callable[[], object]) -> None:
        """Run ``call`` (a decode of ``ctx``'s of its own: a medium's embeddings) where the
        batcher decodes evaluations alone, between two batches, when called from a task
        (a decode in a task would overwrite the logits of the batch the other tasks have
        not read yet); at once from elsewhere. Raises what ``call`` raises."""
        task = self._tasks.get(greenlet.getcurrent())
        if task is None:
            call()
            return
        self.hub.switch(_Request(task, ctx, [], "none", call=call))

    def others(self, task: Task) -> tuple[int, ...]:
        """The slots (sequence ids) of the other active tasks that share the target's
        batches, rising; none for a task decoded alone (the module)."""
        if task.alone:
            return ()
        return tuple(t.slot for t in self.active if t is not task and not t.done and not t.alone)

    def _alone(self, ctx: LlamaContext) -> bool:
        """Whether evaluations of ``ctx`` are decoded alone (the module's rule)."""
        return bool(ctx.base.recurrent or ctx.rows_per_decode)

    def step(self) -> None:
        """Run every task that can run until it waits for an evaluation or ends, then
        decode one context's batch (the module's rule) and ready the tasks it served."""
        while self._ready:
            task, value, failed = self._ready.popleft()
            self._resume(task, value, failed)
        if any(t.done for t in self.active):
            self.active = [t for t in self.active if not t.done]
            self._tasks = {t._g: t for t in self.active}
        if not self._pending:
            return
        drafting = [r for r in self._pending if r.ctx.base is not self.target]
        if any(r.outputs for r in drafting):  # draft tokens first: the verification waits
            bases = [next(r for r in drafting if r.outputs).ctx.base]
        else:  # the target's batch, and a piece of a draft model's prompt beside it
            bases = [self.target, *({id(r.ctx.base): r.ctx.base
                                     for r in drafting}.values())]  # fmt: skip
        for base in bases:
            mine = [r for r in self._pending if r.ctx.base is base]
            self._pending = [r for r in self._pending if r.ctx.base is not base]
            if mine:
                self._decode(base, mine)

    def _resume(self, task: Task, value: Any, failed: bool) -> None:
        if self.company is not None:
            self.company(task.slot, self.others(task), sum(not t.done for t in self.active))
        if not task._g:  # not started: a greenlet's first switch passes its arguments
            out = task._g.switch()
        else:
            out = task._g.throw(value) if failed else task._g.switch(value)
        if isinstance(out, _Request):
            self._pending.append(out)

    def _decode(self, base: LlamaContext, requests: list[_Request]) -> None:
        """Decode ``requests`` of ``base``'s sequences: alone where the module says, else
        batched; requests not finished (a prompt's later pieces, or verifications that
        did not fit) wait for the next batch."""
        batched: list[_Request] = []
        for r in requests:
            if r.call is not None or self._alone(r.ctx):
                self._serve(r)
            else:
                batched.append(r)
        parts: list[tuple[LlamaContext, Sequence[int], Want]] = []
        taken: list[tuple[_Request, int]] = []
        rows, outs = base.n_batch, base.n_outputs_max
        # Verifications whole, first; then draft steps; then pieces of prompts in the rows
        # left; each kind in sequence order.
        order = {"all": 0, "last": 1, "none": 2}
        for r in sorted(batched, key=lambda r: (order[r.want], r.task.slot)):
            left = len(r.tokens) - r.done
            want: Want
            if r.want == "all":
                if left > rows or left > outs:
                    continue
                n, want = left, r.want
            else:
                n = min(left, rows)
                last = n == left
                if n == 0 or (r.want == "last" and last and outs < 1):
                    continue
                want = r.want if last else "none"
            parts.append((r.ctx, r.tokens[r.done : r.done + n], want))
            taken.append((r, n))
            rows -= n
            outs -= len(parts[-1][1]) if want == "all" else int(want == "last")
        if not parts:
            self._pending.extend(r for r in batched)
            return
        # In sequence order, whatever the priority that chose them: llama.cpp's micro-batch
        # takes only sequences whose ids follow one another in the batch's order
        # (specgguf.speculative.costmodel.micro_batches), so a prompt's piece after the
        # others' verifications could cost one more.
        by_seq = sorted(range(len(parts)), key=lambda j: taken[j][0].task.slot)
        parts, taken = [parts[j] for j in by_seq], [taken[j] for j in by_seq]
        pads = self._padding(base, parts, [r.task.slot for r, _ in taken])
        if any(pads):
            parts = [(c, [*t, *[t[-1]] * p], w) for (c, t, w), p in zip(parts, pads, strict=True)]
        try:
            results = base.decode_many(parts)
        except Exception as e:  # every task of the batch learns of it
            for r, _ in taken:
                self._ready.append((r.task, e, True))
            self._pending.extend(r for r in batched if all(r is not t for t, _ in taken))
            return
        served = set()
        for (r, n), logits, pad in zip(taken, results, pads, strict=True):
            if pad:  # the throw-away rows leave the cache before the task sees its logits
                r.ctx.rollback(r.ctx.n_past - pad)
                logits = logits[: len(logits) - pad]
            r.done += n
            if r.done == len(r.tokens):
                self._ready.append((r.task, logits, False))
                served.add(id(r))
        self._pending.extend(r for r in batched if id(r) not in served)

    def _padding(
        self, base: LlamaContext, parts: Sequence[tuple[LlamaContext, Sequence[int], Want]],
        seqs: Sequence[int],
    ) -> list[int]:  # fmt: skip
        """Throw-away rows to append to each part: on the target's batch of verifications
        alone (2 or more, every row's logits wanted), each run of consecutive sequence ids
        brought to the most rows any of its sequences brings where :attr:`cost` says that
        costs less than llama.cpp's micro-batches of it (at the deepest sequence's depth),
        and the padded batch fits the context's rows, outputs and every sequence's room;
        else none. Their last token repeated: after a sequence's own rows they change none
        of its logits (each row attends to the positions before it)."""
        none = [0] * len(parts)
        if self.cost is None or base is not self.target or len(parts) < 2:
            return none
        if any(w != "all" or not t for _, t, w in parts):
            return none
        rows = [(seq, len(t)) for seq, (_, t, _) in zip(seqs, parts, strict=True)]
        deepest = max(c.n_past for c, _, _ in parts)
        cost = self.cost

        def at(m: int) -> float:
            return cost(m, deepest)

        _, pads = cheapest_micro_batches(rows, base.n_ubatch, at)
        if sum(n for _, n in rows) + sum(pads) > min(base.n_batch, base.n_outputs_max):
            return none
        if any(c.n_past + len(t) + p > c.n_ctx for (c, t, _), p in zip(parts, pads, strict=True)):
            return none
        return pads

    def _serve(self, r: _Request) -> None:
        """Decode ``r`` alone (its sequence's own ``eval``, or its call); its logits copied,
        as the next request's decode reuses llama.cpp's buffer before the task reads them."""
        try:
            if r.call is not None:
                self._ready.append((r.task, r.call(), False))
                return
            self._ready.append((r.task, np.array(r.ctx.eval(r.tokens, logits=r.want)), False))
        except Exception as e:
            self._ready.append((r.task, e, True))


class BatchedSequence:
    """One sequence of a parallel context as a generation sees it (the loop's
    ``TargetEvaluator``, a drafter's ``Evaluator``): every evaluation goes through the
    :class:`Batcher`; the rest is the sequence's own. No token trees
    (``tree_branches`` 0)."""

    tree_branches = 0

    def __init__(self, ctx: LlamaContext, batcher: Callable[[], Batcher | None]) -> None:
        self.ctx = ctx
        self._batcher = batcher
        self.n_ctx = ctx.n_ctx
        self.n_batch = ctx.n_batch
        self.n_vocab = ctx.n_vocab
        # the share of one sequence: the batch holds every sequence's verification
        self.n_outputs_max = max(1, ctx.n_outputs_max // ctx.n_parallel)

    @property
    def eval_seconds(self) -> float:
        return self.ctx.eval_seconds

    @eval_seconds.setter
    def eval_seconds(self, seconds: float) -> None:
        self.ctx.eval_seconds = seconds

    @property
    def n_past(self) -> int:
        return self.ctx.n_past

    @property
    def rollback_room(self) -> int | None:
        return self.ctx.rollback_room

    @property
    def rollback_max(self) -> int | None:
        return self.ctx.rollback_max

    @property
    def rows_per_decode(self) -> int | None:
        return self.ctx.rows_per_decode

    def set_rows_per_decode(self, rows: int | None) -> None:
        self.ctx.set_rows_per_decode(rows)

    def eval(self, tokens: Sequence[int], *, logits: Want = "last") -> npt.NDArray[np.float32]:
        batcher = self._batcher()
        if batcher is None:
            return self.ctx.eval(tokens, logits=logits)
        out: npt.NDArray[np.float32] = batcher.evaluate(self.ctx, tokens, logits)
        return out

    def rollback(self, n_keep: int) -> None:
        self.ctx.rollback(n_keep)

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        return self.ctx.cached_prefix(tokens)

    def media_keys(self) -> dict[int, bytes]:
        return self.ctx.media_keys()

    def reuse(
        self, tokens: Sequence[int], *, exact: bool = False, media: Sequence[object] = ()
    ) -> int:
        return self.ctx.reuse(tokens, exact=exact, media=media)

    def prompt(
        self, tokens: Sequence[int], *, exact: bool = False, media: Sequence[object] = ()
    ) -> None:
        """The sequence's prompt, read through the batcher (in pieces beside the other
        sequences' steps), with the sequence's checkpoints between pieces; its media each
        decoded alone between two batches."""
        read = self.eval
        if not media:
            self.ctx.prompt(tokens, lambda t: read(t, logits="none"), exact=exact)
            return
        batcher = self._batcher()
        alone = None if batcher is None else functools.partial(batcher.call_alone, self.ctx)
        self.ctx.prompt(tokens, lambda t: read(t, logits="none"), exact=exact, media=media,
                        alone=alone)  # fmt: skip

    def scratch(self) -> AbstractContextManager[None]:
        return self.ctx.scratch()

    def eval_tree(
        self, root: int, tokens: Sequence[int], parents: Sequence[int]
    ) -> npt.NDArray[np.float32]:
        raise ValueError("parallel sequences verify no token trees")

    def keep_tree_path(self, path: Sequence[int]) -> None:
        raise ValueError("parallel sequences verify no token trees")
