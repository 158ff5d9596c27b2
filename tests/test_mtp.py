"""The MTP drafter (:mod:`specgguf.speculative.drafters.mtp`) on a fake head: which hidden
state each head row reads (llama.cpp's draft-mtp pairing: the token at p with the
target's hidden state after p - 1), what its cache holds after a step, and sampled MTP
drafts against the exact joint distribution of two tokens (chi-square, as for the draft
model in tests/test_oracles.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from specgguf.speculative.drafters import MtpDrafter
from specgguf.speculative.loop import GenerationParams, SpeculativeDecoder
from specgguf.speculative.planner import FixedPlanner
from specgguf.speculative.sampling import SamplerParams

from .fakes import FakeContext, FakeVocab, one_hot_rule
from .test_oracles import DRAFT, PLAIN, TARGET, V, softmax
from .test_sampling import chi2_critical

E = 3  # the fake hidden state's width


class HiddenTarget(FakeContext):
    """A fake target whose hidden state after position p is [p, token at p, 1]."""

    def hidden_rows(self, start: int, end: int) -> npt.NDArray[np.float32]:
        assert 0 <= start <= end <= self.n_past, (start, end, self.n_past)
        assert start >= self.forgotten, (start, self.forgotten)
        return np.array([[p, self.kv[p], 1.0] for p in range(start, end)], np.float32)

    forgotten = 0
    #: the media it holds: first position -> content key
    media: dict[int, bytes] = {}  # noqa: RUF012 (replaced, never changed in place)

    @property
    def holds_media(self) -> bool:
        return bool(self.media)

    def media_keys(self) -> dict[int, bytes]:
        return {p: k for p, k in self.media.items() if p < self.n_past}

    def forget_hidden(self, before: int) -> None:
        self.forgotten = max(self.forgotten, before)

    def rollback(self, n_keep: int) -> None:
        super().rollback(n_keep)
        self.forgotten = min(self.forgotten, n_keep)


class FakeHead:
    """A head whose logits after a row are ``rule(token)`` and whose hidden state is
    [-1, token, row's input first value]; records every row as (position, token,
    input)."""

    n_ctx, n_embd, n_heads = 256, E, 1

    def __init__(self, rule: npt.NDArray[np.float32]) -> None:
        self.rule = rule
        self.n_vocab = rule.shape[1]
        self.rows: list[tuple[int, int, tuple[float, ...]]] = []
        self.n_past = 0

    def encode(self, inputs: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        return inputs

    def eval(
        self, tokens: Sequence[int], inputs: npt.NDArray[np.float32], *, last: bool
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]] | None:
        assert inputs.shape == (len(tokens), E)
        for t, x in zip(tokens, inputs, strict=True):
            self.rows.append((self.n_past, t, tuple(float(v) for v in x)))
            self.n_past += 1
        if not last:
            return None
        h = np.array([-1.0, tokens[-1], inputs[-1][0]], np.float32)
        return self.rule[tokens[-1]], h

    def rollback(self, n_keep: int) -> None:
        assert 0 <= n_keep <= self.n_past
        self.n_past = n_keep


def walk(prefix: Sequence[int]) -> int:
    return prefix[-1] % 7 + 1


G = SamplerParams(temperature=0.0)


def test_each_head_row_reads_the_targets_state_before_it_and_its_own_when_chained() -> None:
    rule = np.array([one_hot_rule(walk, 8)([t]) for t in range(8)], np.float32)
    target = HiddenTarget(one_hot_rule(walk, 8), 8)
    head = FakeHead(rule)
    drafter = MtpDrafter(head, target, 8)
    dec = SpeculativeDecoder(target, FakeVocab(8))  # type: ignore[arg-type]
    res = dec.generate([1, 2, 3], GenerationParams(n_predict=9, sampler=G),
                       FixedPlanner(drafter, 3)).run()  # fmt: skip
    assert res.tokens == [4, 5, 6, 7, 1, 2, 3, 4, 5]
    assert res.stats.accepted == res.stats.drafted == 6  # two steps of 3 + 1
    prompt_rows = [r for r in head.rows[:2]]
    # The prompt's committed positions 0 and 1: position 0 reads zeros, 1 reads [0, 1, 1].
    assert prompt_rows == [(0, 1, (0.0, 0.0, 0.0)), (1, 2, (0.0, 1.0, 1.0))]
    # First step: the last prompt token at 2 reads the target's state after 1 ([1, 2, 1]);
    # the chain's rows read the head's own state ([-1, previous token, ...]).
    assert head.rows[2] == (2, 3, (1.0, 2.0, 1.0))
    assert head.rows[3][:2] == (3, 4) and head.rows[3][2][:2] == (-1.0, 3.0)
    assert head.rows[4][:2] == (4, 5) and head.rows[4][2][:2] == (-1.0, 4.0)
    # Second step: the committed 3, 4, 5, 6 (positions 2..5) read again with the target's
    # states after 1..4 (its verification evaluated them), then the chain.
    second = head.rows[5:9]
    assert [r[:2] for r in second] == [(2, 3), (3, 4), (4, 5), (5, 6), (6, 7)][:4]
    assert [r[2] for r in second] == [(p - 1.0, float(t), 1.0) for p, t in
                                      [(2, 2), (3, 3), (4, 4), (5, 5)]]  # fmt: skip


def test_the_heads_cache_ends_at_the_committed_text_after_a_step() -> None:
    rule = np.array([one_hot_rule(walk, 8)([t]) for t in range(8)], np.float32)
    target = HiddenTarget(one_hot_rule(walk, 8), 8)
    head = FakeHead(rule)
    drafter = MtpDrafter(head, target, 8)
    target.eval([1, 2, 3, 4], logits="none")
    draft = drafter.propose([1, 2, 3, 4, 5], 4, G, np.random.default_rng(0))
    assert draft.tokens == [6, 7, 1, 2]
    # the draft's rows and the last history token's (not yet evaluated by the target) go
    assert head.n_past == 4 and drafter.cached_tokens([1, 2, 3, 4, 5]) == 4


def test_the_heads_cache_is_kept_only_up_to_a_medium_the_target_now_reads_otherwise() -> None:
    # A medium's positions hold placeholder tokens whatever the image: the head's rows
    # there read the target's hidden states of the image it held, so a prompt whose
    # image differs is read again by the head from that image's first position.
    rule = np.array([one_hot_rule(walk, 8)([t]) for t in range(8)], np.float32)
    target = HiddenTarget(one_hot_rule(walk, 8), 8)
    head = FakeHead(rule)
    drafter = MtpDrafter(head, target, 8)
    prompt = [1, 2, 0, 0, 0, 3, 4]  # an image's three placeholders at 2..4
    target.media = {2: b"cat"}
    target.eval(prompt[:-1], logits="none")
    drafter.prefill(prompt)
    assert head.n_past == 6 and drafter.cached_tokens(prompt) == 6
    # the same image: all kept; another image: kept up to it; none now: the same
    assert drafter.cached_tokens(prompt) == 6
    target.media = {2: b"dog"}
    assert drafter.cached_tokens(prompt) == 2
    target.media = {}
    assert drafter.cached_tokens(prompt) == 2
    # read again: the rows from position 2 on, with the new image's hidden states (the
    # target reads the new image from the position before it, as a hidden-state target's
    # reuse cuts there: the head's first row again reads the state after position 1)
    target.media = {2: b"dog"}
    target.rollback(1)
    target.eval(prompt[1:-1], logits="none")
    head.rows.clear()
    drafter.prefill(prompt)
    assert [r[0] for r in head.rows] == [2, 3, 4, 5]
    assert drafter.cached_tokens(prompt) == 6
    # an image where the head read text placeholders before (none recorded there)
    target.media = {2: b"dog", 5: b"cat"}
    assert drafter.cached_tokens(prompt) == 5


def test_greedy_mtp_drafting_stops_below_p_min() -> None:
    rule = np.zeros((8, 8), np.float32)  # a flat head: every token at 1/8
    target = HiddenTarget(one_hot_rule(walk, 8), 8)
    drafter = MtpDrafter(FakeHead(rule), target, 8)
    target.eval([1, 2], logits="none")
    draft = drafter.propose([1, 2, 3], 4, G, np.random.default_rng(0), p_min=0.2)
    assert draft.tokens == [] and draft.stopped
    assert drafter.propose([1, 2, 3], 4, G, np.random.default_rng(0), p_min=0.1).tokens
    # the path: 1/8, then 1/64 (below 0.1 and 0.02, not 0.01)
    for p_path_min, n in ((0.1, 1), (0.02, 1), (0.01, 2)):
        draft = drafter.propose([1, 2, 3], 4, G, np.random.default_rng(0), p_path_min=p_path_min)
        assert (len(draft.tokens), draft.stopped) == (n, True), p_path_min


def test_sampled_mtp_drafts_keep_the_exact_joint_of_two_tokens() -> None:
    """As tests/test_oracles.py for the draft model: the head's q differs from one
    position to the next (DRAFT rolled by the token read), acceptance is high, and the
    first two output tokens must follow p1(x) * p2(y | x)."""
    n = 10_000
    p1 = softmax(TARGET[0])
    exact = {(x, y): float(p1[x] * softmax(TARGET[x])[y]) for x in range(V) for y in range(V)}
    target = HiddenTarget(lambda kv: TARGET[kv[-1]], V)
    head = FakeHead(DRAFT)
    drafter = MtpDrafter(head, target, V)
    decoder = SpeculativeDecoder(target, FakeVocab(V))  # type: ignore[arg-type]
    counts: Counter[tuple[int, int]] = Counter()
    accepted = drafted = 0
    for seed in range(n):
        sampler = SamplerParams(**{**PLAIN.__dict__, "seed": seed})
        res = decoder.generate([0], GenerationParams(n_predict=3, sampler=sampler),
                               FixedPlanner(drafter, 2)).run()  # fmt: skip
        counts[res.tokens[0], res.tokens[1]] += 1
        accepted += res.stats.accepted
        drafted += res.stats.drafted
        target.log.clear()
        head.rows.clear()
    assert drafted >= 2 * n and accepted / drafted > 0.7
    stat = sum((counts[c] - n * p) ** 2 / (n * p) for c, p in exact.items())
    assert stat < chi2_critical(len(exact) - 1), (stat, counts)


def test_each_sequence_of_one_batch_keeps_the_hidden_states_of_its_own_rows(
    tiny_models: dict[str, Path],
) -> None:
    """``decode_many`` of two sequences (llama.cpp splits the batch into micro-batches of
    equal rows per sequence and puts the rows back in the batch's order): each sequence
    keeps the hidden states its rows give when it is decoded alone."""
    from specgguf.llama.backend import LlamaModel

    texts = [[5, 17, 29, 31, 2, 9], [40, 3, 3, 12, 7, 21]]
    with LlamaModel(tiny_models["mtp"], load_mtp=True) as model:
        alone = []
        for tokens in texts:
            with model.new_context(n_ctx=256, n_batch=64, hidden=True) as ctx:
                ctx.eval(tokens, logits="none")
                alone.append(ctx.hidden_rows(0, len(tokens)))
        with model.new_context(n_ctx=256, n_batch=64, hidden=True, n_parallel=2) as ctx:
            seqs = [ctx.sequence(0), ctx.sequence(1)]
            ctx.decode_many([(s, t, "last") for s, t in zip(seqs, texts, strict=True)])
            together = [s.hidden_rows(0, len(t)) for s, t in zip(seqs, texts, strict=True)]
    assert not np.allclose(alone[0], alone[1])
    for a, b in zip(alone, together, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)
