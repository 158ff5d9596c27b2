"""Verification and acceptance (specgguf.speculative.verification) on the fake backend, by
hand: what the target evaluates for a chain, a tree and deterministic mode's lazy calls, the
banned tokens, the time measured, and the acceptance rules' edge cases."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from specgguf.speculative import verification
from specgguf.speculative.draft import Draft
from specgguf.speculative.sampling import SamplerParams
from specgguf.speculative.verification import accept, evaluate, verifiable

from .fakes import FakeContext, FakeTreeContext, one_hot_rule

V = 16
GREEDY = SamplerParams(temperature=0.0)
RNG = np.random.default_rng(0)


def plus_one(prefix: Sequence[int]) -> int:
    return (prefix[-1] + 1) % V


def ready(ctx: FakeContext, text: list[int]) -> FakeContext:
    """``ctx`` holding all of ``text`` but its last token (the loop's state before a step)."""
    ctx.eval(text[:-1], logits="none")
    ctx.log.clear()
    return ctx


def test_a_chain_is_one_batch_of_the_root_and_its_drafts() -> None:
    ctx = ready(FakeContext(one_hot_rule(plus_one, V), V), [1, 2, 3])
    logits, rows, _ = evaluate(ctx, 3, Draft([4, 9, 10]))
    assert rows == 4 and ctx.log == [("eval", 2, [3, 4, 9, 10], "all")]
    assert list(logits.argmax(axis=1)) == [4, 5, 10, 11]
    # A long draft without lazy rows (the default): still one batch.
    ctx = ready(FakeContext(one_hot_rule(plus_one, V), V), [1, 2, 3])
    assert evaluate(ctx, 3, Draft([4, 5, 6, 7, 8]))[1] == 6 and len(ctx.log) == 1


def test_a_tree_is_one_batch_of_the_root_and_every_node() -> None:
    ctx = ready(FakeTreeContext(one_hot_rule(plus_one, V), V), [1, 2, 3])
    tree = Draft([4, 7, 5], parents=[-1, -1, 0])
    logits, rows, _ = evaluate(ctx, 3, tree)
    assert rows == 4 and ctx.log == [("tree", 2, 3, [4, 7, 5], [-1, -1, 0])]
    assert list(logits.argmax(axis=1)) == [4, 5, 8, 6]


def test_lazy_verification_stops_at_the_call_that_shows_a_rejection() -> None:
    # Deterministic mode's calls of at most 2 rows: [3, 4], [5, 9], [10, 11] for 5 drafts;
    # 9 is wrong (the target says 6) in the second call: the third is never made.
    ctx = ready(FakeContext(one_hot_rule(plus_one, V), V), [1, 2, 3])
    logits, rows, _ = evaluate(ctx, 3, Draft([4, 5, 9, 10, 11]), lazy_rows=2)
    assert rows == 4 and logits.shape == (4, V)
    assert [e[2] for e in ctx.log] == [[3, 4], [5, 9]]
    # All right: every call, 6 rows.
    ctx = ready(FakeContext(one_hot_rule(plus_one, V), V), [1, 2, 3])
    assert evaluate(ctx, 3, Draft([4, 5, 6, 7, 8]), lazy_rows=2)[1] == 6
    assert [e[2] for e in ctx.log] == [[3, 4], [5, 6], [7, 8]]
    # Rows that fit one call (3 rows at most 3): one evaluation, as without lazy rows.
    ctx = ready(FakeContext(one_hot_rule(plus_one, V), V), [1, 2, 3])
    assert evaluate(ctx, 3, Draft([4, 9]), lazy_rows=3)[1] == 3 and len(ctx.log) == 1
    # One row more than a call: two calls, the second after an accepted first.
    ctx = ready(FakeContext(one_hot_rule(plus_one, V), V), [1, 2, 3])
    assert evaluate(ctx, 3, Draft([4, 5, 6]), lazy_rows=3)[1] == 4 and len(ctx.log) == 2


@pytest.mark.parametrize("lazy", [0, 2])
def test_banned_tokens_are_minus_infinity_in_every_row(lazy: int) -> None:
    ctx = ready(FakeContext(one_hot_rule(plus_one, V), V), [1, 2, 3])
    banned = np.array([5, 7], np.int64)
    logits, rows, _ = evaluate(ctx, 3, Draft([4, 5, 6]), lazy_rows=lazy, banned=banned)
    assert np.all(logits[:, [5, 7]] == -np.inf) and np.isfinite(logits[:, 6]).all()
    # the target's own choice after 4 is 5, banned: its next best (6, at 5) is the argmax,
    # which rejects the draft's 5 (lazily: in the first call of 2 rows)
    assert logits.argmax(axis=1)[1] == 6 and rows == (2 if lazy else 4)


@pytest.mark.parametrize(("draft", "lazy"), [(Draft([4, 5, 6]), 0), (Draft([4, 5, 6]), 2),
                                             (Draft([4, 7], parents=[-1, -1]), 0)])  # fmt: skip
def test_the_seconds_measured_are_the_evaluation_s(
    monkeypatch: pytest.MonkeyPatch, draft: Draft, lazy: int
) -> None:
    clock = iter([10.0, 10.25, 99.0])
    monkeypatch.setattr(verification.time, "perf_counter", lambda: next(clock))
    ctx = ready(FakeTreeContext(one_hot_rule(plus_one, V), V), [1, 2, 3])
    assert evaluate(ctx, 3, draft, lazy_rows=lazy)[2] == 0.25


def rows_of(*best: int) -> np.ndarray:
    out = np.zeros((len(best), V), np.float32)
    out[np.arange(len(best)), list(best)] = 10.0
    return out


def test_a_tree_rejected_at_the_root_keeps_the_root_s_token() -> None:
    # Neither child of the root (4, 7) is the target's 9: nothing accepted, row 0's token,
    # a rejection (the root has children).
    v = accept(Draft([4, 7], parents=[-1, -1]), rows_of(9, 5, 8), GREEDY, RNG)
    assert (v.accepted, v.token, v.row, v.rejected, v.path) == ([], 9, 0, True, [])


def test_sampled_acceptance_of_a_certain_point_mass_token() -> None:
    # The target gives token 5 all its probability: a lookup's 5 is kept, and the token
    # after it drawn from the next row (all on 6).
    logits = np.full((2, V), -np.inf, np.float32)
    logits[0, 5] = logits[1, 6] = 0.0
    sampled = SamplerParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    v = accept(Draft([5]), logits, sampled, np.random.default_rng(1))
    assert (v.accepted, v.token, v.rejected) == ([5], 6, False)


def test_a_chain_that_fits_is_verified_as_it_is() -> None:
    chain = Draft([1, 2, 3], probs=[0.9, 0.8, 0.7], match=5)
    assert verifiable(chain, 3, 0) is chain
    assert verifiable(chain, 8, 4) is chain
