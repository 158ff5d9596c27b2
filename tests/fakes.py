"""A fake backend with exact integer logits, for testing the speculative loop's logic."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from specgguf.speculative.arms import Arm, LookupArm, ModelArm, Step, SuffixArm
from specgguf.speculative.costmodel import Timings
from specgguf.speculative.draft import Draft, Drafter, TreeDrafter
from specgguf.speculative.drafters import ModelDrafter
from specgguf.speculative.planner import AutoPlanner
from specgguf.speculative.sampling import SamplerParams
from specgguf.speculative.tuning import AUTO_TUNING, AutoTuning

#: rule(prefix) -> float32[n_vocab] integer-valued logits for the token after ``prefix``.
Rule = Callable[[Sequence[int]], npt.NDArray[np.float32]]


def one_hot_rule(next_token: Callable[[Sequence[int]], int], n_vocab: int) -> Rule:
    """Logits 10 for ``next_token(prefix)``, 5 for the token after it, 0 elsewhere."""

    def rule(prefix: Sequence[int]) -> npt.NDArray[np.float32]:
        row = np.zeros(n_vocab, np.float32)
        t = next_token(prefix)
        row[(t + 1) % n_vocab] = 5
        row[t] = 10
        return row

    return rule


class FakeContext:
    """A ``TargetEvaluator`` without token trees: a KV cache that is a list of token ids,
    logits from ``rule``.

    Records every call in ``log`` (("eval", n_past, tokens, mode) / ("rollback", n_keep))
    and refuses to go past ``n_ctx`` or ``n_batch``, as llama.cpp would. ``rows_per_decode``
    is only recorded: the loop splits its lazy verification itself.
    """

    tree_branches = 0

    def __init__(self, rule: Rule, n_vocab: int, n_ctx: int = 256, n_batch: int = 64) -> None:
        self.rule = rule
        self.n_vocab = n_vocab
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.n_outputs_max = n_batch
        self.rows_per_decode: int | None = None
        self.kv: list[int] = []
        self.log: list[tuple[object, ...]] = []
        self.eval_seconds = 0.0
        self.max_batch = 0
        self._tree: object = None

    @property
    def n_past(self) -> int:
        return len(self.kv)

    def eval(
        self, tokens: Sequence[int], *, logits: Literal["last", "all", "none"] = "last"
    ) -> npt.NDArray[np.float32]:
        self.log.append(("eval", len(self.kv), list(tokens), logits))
        if len(self.kv) + len(tokens) > self.n_ctx:
            raise AssertionError(f"KV overflow: {len(self.kv)} + {len(tokens)} > {self.n_ctx}")
        if logits == "all" and len(tokens) > self.n_batch:
            raise AssertionError(f"batch of {len(tokens)} > n_batch {self.n_batch}")
        self.max_batch = max(self.max_batch, min(len(tokens), self.n_batch))
        rows = []
        for t in tokens:
            assert 0 <= t < self.n_vocab, t
            self.kv.append(t)
            rows.append(self.rule(self.kv))
        if logits == "none" or not rows:
            return np.empty((0, self.n_vocab), np.float32)
        if logits == "last":
            return np.stack(rows[-1:])
        return np.stack(rows)

    def rollback(self, n_keep: int) -> None:
        self.log.append(("rollback", n_keep))
        self._tree = None
        assert 0 <= n_keep <= len(self.kv)
        del self.kv[n_keep:]

    rollback_max: int | None = None
    rollback_room: int | None = None

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        n = 0
        for a, b in zip(self.kv, tokens, strict=False):
            if a != b:
                break
            n += 1
        return n

    def reuse(
        self, tokens: Sequence[int], *, exact: bool = False, media: Sequence[object] = ()
    ) -> int:
        """Keep the longest common prefix of the cache and ``tokens`` (logged as
        ("reuse", kept)); a recurrent fake goes to 0 when that is past its snapshots."""
        n = self.cached_prefix(tokens)
        room = self.rollback_room
        if room is not None and len(self.kv) - n > room:
            n = 0
        self.log.append(("reuse", n))
        if n < len(self.kv):
            self.rollback(n)
        return n

    def prompt(
        self,
        tokens: Sequence[int],
        evaluate: Callable[[Sequence[int]], object] | None = None,
        *,
        exact: bool = False,
        media: Sequence[object] = (),
    ) -> None:
        if tokens:
            (evaluate or (lambda t: self.eval(t, logits="none")))(tokens)

    @contextlib.contextmanager
    def scratch(self) -> Iterator[None]:
        kv = list(self.kv)
        self.log.append(("scratch", len(kv)))
        try:
            yield
        finally:
            self.kv = kv
            self.log.append(("scratch end", len(kv)))

    def set_rows_per_decode(self, rows: int | None) -> None:
        self.rows_per_decode = rows

    def eval_tree(
        self, root: int, tokens: Sequence[int], parents: Sequence[int]
    ) -> npt.NDArray[np.float32]:
        raise AssertionError("a tree verified on a context without trees")

    def keep_tree_path(self, path: Sequence[int]) -> None:
        raise AssertionError("a tree kept on a context without trees")


class FakeRecurrentContext(FakeContext):
    """A :class:`FakeContext` whose memory is a recurrent state with ``n_rs_seq``
    snapshots, as llama.cpp keeps them: right after an evaluation of m tokens, a rollback
    may drop up to ``min(n_rs_seq, m - 1)`` positions, once. A deeper rollback (other than
    to 0) is logged as ("reread", n_keep) and counted in ``rereads``: the real context
    decodes the kept tokens again."""

    def __init__(self, *args: object, n_rs_seq: int = 4, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.rollback_max = n_rs_seq
        self.rollback_room = 0
        self.rereads = 0
        self.deepest = 0

    def eval(
        self, tokens: Sequence[int], *, logits: Literal["last", "all", "none"] = "last"
    ) -> npt.NDArray[np.float32]:
        out = super().eval(tokens, logits=logits)
        assert self.rollback_max is not None
        self.rollback_room = min(self.rollback_max, len(tokens) - 1) if tokens else 0
        return out

    @contextlib.contextmanager
    def scratch(self) -> Iterator[None]:
        # As LlamaContext.scratch: the snapshots were the scratch sequence's, none is left.
        with super().scratch():
            yield
        self.rollback_room = 0

    def rollback(self, n_keep: int) -> None:
        depth = len(self.kv) - n_keep
        assert self.rollback_room is not None
        if n_keep and depth > self.rollback_room:
            self.rereads += 1
            self.log.append(("reread", n_keep))
        elif n_keep:
            self.deepest = max(self.deepest, depth)
        if depth:
            self.rollback_room = 0
        super().rollback(n_keep)


class FakeTreeContext(FakeContext):
    """A :class:`FakeContext` that also verifies token trees
    (``TargetEvaluator.eval_tree``): each node's logits come from ``rule`` on the committed
    tokens, the root and the node's own branch, as llama.cpp's tree attention gives them.
    Logs ("tree", n_past, root, tokens, parents) and ("keep", path)."""

    def __init__(self, *args: object, tree_branches: int = 4, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.tree_branches = tree_branches  # type: ignore[misc]
        self._tree: tuple[int, list[int], list[int]] | None = None

    def eval(
        self, tokens: Sequence[int], *, logits: Literal["last", "all", "none"] = "last"
    ) -> npt.NDArray[np.float32]:
        assert self._tree is None, "a tree was left unresolved"
        return super().eval(tokens, logits=logits)

    def eval_tree(
        self, root: int, tokens: Sequence[int], parents: Sequence[int]
    ) -> npt.NDArray[np.float32]:
        from specgguf.speculative.tree import check_tree, leaves

        self.log.append(("tree", len(self.kv), root, list(tokens), list(parents)))
        assert self._tree is None
        check_tree(parents)
        assert len(leaves(parents)) <= self.tree_branches, "more leaves than sequences"
        assert len(tokens) + 1 <= self.n_batch
        self.max_batch = max(self.max_batch, len(tokens) + 1)

        def branch(i: int) -> list[int]:
            out: list[int] = []
            while i >= 0:
                out.append(tokens[i])
                i = parents[i]
            return out[::-1]

        base = [*self.kv, root]
        assert len(base) + max((len(branch(i)) for i in range(len(tokens))), default=0) <= (
            self.n_ctx
        )
        rows = [self.rule(base)] + [self.rule(base + branch(i)) for i in range(len(tokens))]
        self._tree = (root, list(tokens), list(parents))
        return np.stack(rows)

    def keep_tree_path(self, path: Sequence[int]) -> None:
        self.log.append(("keep", list(path)))
        assert self._tree is not None
        root, tokens, parents = self._tree
        for a, b in zip([-1, *path], path, strict=False):
            assert parents[b] == a, "not a path from the root"
        self.kv.extend([root, *(tokens[i] for i in path)])
        self._tree = None


class FakeVocab:
    """A ``Vocabulary``: pieces by id (default: one ASCII letter per id)."""

    def __init__(
        self,
        n_vocab: int,
        eog_ids: Sequence[int] = (),
        pieces: dict[int, bytes] | None = None,
    ) -> None:
        self.n_vocab = n_vocab
        self.eog_ids = frozenset(eog_ids)
        self.pieces = pieces or {}

    def token_to_piece(self, token: int) -> bytes:
        if token in self.pieces:
            return self.pieces[token]
        return bytes([ord("a") + token % 26])


class ScriptedDrafter(Drafter):
    """Proposes what ``script(history, k)`` returns; records the k it was given."""

    name = "scripted"

    def __init__(self, script: Callable[[Sequence[int], int], list[int]]) -> None:
        self.script = script
        self.seconds = 0.0
        self.ks: list[int] = []

    def propose(self, history, k, sampler, rng, *, p_min=0.0):  # type: ignore[no-untyped-def]
        self.ks.append(k)
        return Draft(self.script(history, k)[:k])


def auto_planner(
    timings: Timings,
    *,
    model: ModelDrafter | None = None,
    ngram: Drafter | None = None,
    suffix: TreeDrafter | None = None,
    draft_max: int = AUTO_TUNING.draft_max_lookup,
    draft_max_model: int = AUTO_TUNING.draft_max_model,
    p_min: float = 0.0,
    draft_min: int = 0,
    learn_timings: bool = True,
    tree_branches: int = 0,
    tuning: AutoTuning | None = None,
) -> AutoPlanner:
    """Auto mode over the arms of the drafters given, in the engine's order (n-gram lookup,
    suffix matching, the draft model): :func:`specgguf.engine.drafter_map.make_planner`
    without an engine, its asking the arms costing nothing (``plan_cost`` 0). ``tuning``:
    default :data:`TUNING`, which a test may replace."""
    arms: list[Arm] = []
    if ngram is not None:
        arms.append(LookupArm(ngram))
    if suffix is not None:
        arms.append(SuffixArm(suffix, tree_branches=tree_branches))
    if model is not None:
        arms.append(ModelArm(model, draft_max=draft_max_model, p_min=p_min))
    planner = AutoPlanner(timings, arms, draft_max=draft_max, draft_min=draft_min,
                          learn_timings=learn_timings, tuning=tuning or TUNING)  # fmt: skip
    # asking the arms costs nothing here: no step is let pass for this machine's own time
    # (tests of letting steps pass set it)
    planner.plan_cost = 0.0
    return planner


#: The tuning of :func:`auto_planner` when none is given (a fixture may replace it with
#: ``monkeypatch.setattr(fakes, "TUNING", ...)``).
TUNING = AUTO_TUNING


def tuned(**fields: object) -> AutoTuning:
    """Auto mode's tuning with ``fields`` replaced."""
    return dataclasses.replace(AUTO_TUNING, **fields)  # type: ignore[arg-type]


def first_eval_cost(p: AutoPlanner, history: Sequence[int]) -> float:
    """Seconds the draft-model arm of ``p`` expects its first evaluation to take at a step
    after ``history`` (its catch-up, spread over its expected run)."""
    step = Step(history, 1, 16, SamplerParams(temperature=0.0), np.random.default_rng(0),
                p.timings, len(history) - 1, p.confidence, 0.0, p.tuning)  # fmt: skip
    return p.arm("model")._first_eval_cost(step)  # type: ignore[attr-defined,no-any-return]


class FakeSequence(FakeContext):
    """One sequence of a :class:`FakeParallelContext`."""

    lone_rows_max = 0
    recurrent = False

    def __init__(self, base: FakeParallelContext, rule: Rule, n_vocab: int, n_ctx: int) -> None:
        super().__init__(rule, n_vocab, n_ctx=n_ctx, n_batch=base.n_batch)
        self._base = base
        self.base = base
        self.n_parallel = base.n_parallel
        self.n_outputs_max = base.n_outputs_max

    def eval(
        self, tokens: Sequence[int], *, logits: Literal["last", "all", "none"] = "last"
    ) -> npt.NDArray[np.float32]:
        if not self._base.batching:  # a decode of this sequence alone
            self._base.alone.append((self._base.seqs.index(self), list(tokens), logits))
        return super().eval(tokens, logits=logits)


class FakeParallelContext:
    """A parallel context (``LlamaContext(n_parallel=...)``) over :class:`FakeSequence`
    sequences: :meth:`decode_many` evaluates each part on its sequence and records the
    batch in ``batches`` as (sequence index, tokens, logits wanted) per part; a sequence's
    own ``eval`` is a decode of that sequence alone (recorded in its ``log``)."""

    recurrent = False

    def __init__(
        self, rule: Rule, n_vocab: int, n_parallel: int, *, n_ctx: int = 256, n_batch: int = 64,
        n_outputs_max: int | None = None,
    ) -> None:  # fmt: skip
        self.n_batch = n_batch
        self.n_ubatch = n_batch
        self.n_outputs_max = n_outputs_max or n_batch
        self.n_parallel = n_parallel
        self.n_vocab = n_vocab
        self.seqs = [FakeSequence(self, rule, n_vocab, n_ctx) for _ in range(n_parallel)]
        self.batches: list[list[tuple[int, list[int], str]]] = []
        #: decodes of one sequence alone, as (sequence index, tokens, logits wanted)
        self.alone: list[tuple[int, list[int], str]] = []
        self.batching = False

    def sequence(self, i: int) -> FakeSequence:
        return self.seqs[i]

    def decode_many(
        self, parts: Sequence[tuple[FakeSequence, Sequence[int], Literal["all", "last", "none"]]]
    ) -> list[npt.NDArray[np.float32]]:
        rows = sum(len(t) for _, t, _ in parts)
        outs = sum(len(t) if w == "all" else w == "last" for _, t, w in parts)
        assert rows <= self.n_batch and outs <= self.n_outputs_max, (rows, outs)
        assert len({id(c) for c, _, _ in parts}) == len(parts), "a sequence twice in a batch"
        self.batches.append([(self.seqs.index(c), list(t), w) for c, t, w in parts])
        self.batching = True
        try:
            return [c.eval(t, logits=w) for c, t, w in parts]
        finally:
            self.batching = False
