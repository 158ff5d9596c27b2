"""A fake backend with exact integer logits, for testing the speculative loop's logic."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

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
    """An ``Evaluator``: a KV cache that is a list of token ids, logits from ``rule``.

    Records every call in ``log`` (("eval", n_past, tokens, mode) / ("rollback", n_keep))
    and refuses to go past ``n_ctx`` or ``n_batch``, as llama.cpp would.
    """

    def __init__(self, rule: Rule, n_vocab: int, n_ctx: int = 256, n_batch: int = 64) -> None:
        self.rule = rule
        self.n_vocab = n_vocab
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.kv: list[int] = []
        self.log: list[tuple[object, ...]] = []
        self.eval_seconds = 0.0
        self.max_batch = 0

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
        assert 0 <= n_keep <= len(self.kv)
        del self.kv[n_keep:]


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


class ScriptedDrafter:
    """Proposes what ``script(history, k)`` returns; records the k it was given."""

    name = "scripted"

    def __init__(self, script: Callable[[Sequence[int], int], list[int]]) -> None:
        self.script = script
        self.seconds = 0.0
        self.ks: list[int] = []

    def reset(self) -> None:
        pass

    def propose(self, history, k, sampler, rng, *, p_min=0.0):  # type: ignore[no-untyped-def]
        from specgguf.spec.drafters import Draft

        self.ks.append(k)
        return Draft(self.script(history, k)[:k])
