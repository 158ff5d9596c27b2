"""Several sequences in one target batch (``serve --parallel``): the batcher on a fake
backend with exact integer logits, and auto mode's cost of a step in a shared batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from specgguf.engine.batching import BatchedSequence, Batcher, Task
from specgguf.speculative.costmodel import (
    Timings,
    best_k,
    expected_tokens,
    micro_batches,
    row_share,
)
from specgguf.speculative.draft import Drafter
from specgguf.speculative.drafters import ModelDrafter, NgramDrafter
from specgguf.speculative.loop import (
    Generation,
    GenerationParams,
    GenerationResult,
    SpeculativeDecoder,
)
from specgguf.speculative.planner import FixedPlanner, Planner
from specgguf.speculative.sampling import SamplerParams

from .fakes import FakeContext, FakeParallelContext, FakeVocab, ScriptedDrafter, one_hot_rule

V = 32
EOS = 31
GREEDY = SamplerParams(temperature=0.0)


def target_next(prefix: Sequence[int]) -> int:
    """The fake target: a walk 1, 2, ..., 30, 1, ... after the last token."""
    return prefix[-1] % 30 + 1


def draft_next(prefix: Sequence[int]) -> int:
    """The fake draft model: the target's walk, wrong at every fifth position."""
    t = target_next(prefix)
    return t if len(prefix) % 5 else t % 30 + 1


def oracle(wrong_every: int) -> ScriptedDrafter:
    """The target's own continuation, every ``wrong_every``-th draft token wrong."""

    def script(history: Sequence[int], k: int) -> list[int]:
        out, seq = [], list(history)
        for _ in range(k):
            t = target_next(seq)
            if (len(seq) + 1) % wrong_every == 0:
                t = t % 30 + 1
            out.append(t)
            seq.append(t)
        return out

    return ScriptedDrafter(script)


#: A sequence's drafter by name -> (drafter or None, draft length)
Spec = tuple[str, int]


class Harness:
    """``n`` sequences of a fake parallel target (and draft model), run by a batcher."""

    def __init__(
        self, n: int, *, n_batch: int = 64, n_ctx: int = 256,
        cost: Callable[[int, int], float] | None = None,
    ) -> None:  # fmt: skip
        self.target = FakeParallelContext(one_hot_rule(target_next, V), V, n, n_ctx=n_ctx,
                                          n_batch=n_batch)  # fmt: skip
        self.draft = FakeParallelContext(one_hot_rule(draft_next, V), V, n, n_ctx=n_ctx,
                                         n_batch=n_batch)  # fmt: skip
        self.batcher = Batcher(self.target, self.draft, cost)  # type: ignore[arg-type]
        self.vocab = FakeVocab(V, eog_ids=[EOS])
        self.n_batch, self.n_ctx = n_batch, n_ctx
        self.results: dict[int, GenerationResult] = {}
        self.generations: dict[int, Generation] = {}
        self.views = [BatchedSequence(self.target.sequence(i), lambda: self.batcher)  # type: ignore[arg-type]
                      for i in range(n)]  # fmt: skip

    def planner(self, spec: Spec, draft_ctx: object) -> Planner:
        kind, k = spec
        drafter: Drafter | None = {
            "oracle": lambda: oracle(3),
            "ngram": lambda: NgramDrafter(1, 4),
            "model": lambda: ModelDrafter(draft_ctx, V),  # type: ignore[arg-type]
            "none": lambda: None,
        }[kind]()
        return FixedPlanner(drafter, k)

    def start(
        self,
        i: int,
        prompt: list[int],
        spec: Spec,
        params: GenerationParams,
        on_piece: Callable[[Generation, int], None] | None = None,
    ) -> Task:
        draft = BatchedSequence(self.draft.sequence(i), lambda: self.batcher)  # type: ignore[arg-type]
        dec = SpeculativeDecoder(self.views[i], self.vocab)
        gen = dec.generate(prompt, params, self.planner(spec, draft))
        self.generations[i] = gen

        def run() -> None:
            for n, _ in enumerate(gen, start=1):
                if on_piece is not None:
                    on_piece(gen, n)
            assert gen.result is not None
            self.results[i] = gen.result

        return self.batcher.add(i, run)

    def run(self, steps: int | None = None) -> None:
        while self.batcher.active and steps != 0:
            self.batcher.step()
            steps = None if steps is None else steps - 1

    def alone(self, prompt: list[int], spec: Spec, params: GenerationParams) -> GenerationResult:
        """The same generation on a context of its own, without a batcher."""
        target = FakeContext(one_hot_rule(target_next, V), V, n_ctx=self.n_ctx,
                             n_batch=self.n_batch)  # fmt: skip
        draft = FakeContext(one_hot_rule(draft_next, V), V, n_ctx=self.n_ctx, n_batch=self.n_batch)
        dec = SpeculativeDecoder(target, self.vocab)
        return dec.generate(prompt, params, self.planner(spec, draft)).run()


PROMPTS = [[3, 4, 5], [10, 11, 12, 13, 14], [20, 21], [7, 8, 9, 10]]
SPECS: list[Spec] = [("oracle", 4), ("ngram", 6), ("none", 0), ("model", 3)]


def params(n: int) -> GenerationParams:
    return GenerationParams(n_predict=n, sampler=GREEDY)


def test_sequences_in_one_batch_equal_each_generated_alone() -> None:
    h = Harness(4)
    for i, (prompt, spec) in enumerate(zip(PROMPTS, SPECS, strict=True)):
        h.start(i, prompt, spec, params(40))
    h.run()
    for i, (prompt, spec) in enumerate(zip(PROMPTS, SPECS, strict=True)):
        alone = h.alone(prompt, spec, params(40))
        assert h.results[i].tokens == alone.tokens and len(alone.tokens) == 40
        assert h.results[i].stats.drafted == alone.stats.drafted
        assert h.results[i].stats.accepted == alone.stats.accepted
    # Every evaluation of the target went through a shared batch, each sequence at most
    # once per batch, and the four sequences' steps were verified together.
    assert h.target.alone == []
    assert max(len(b) for b in h.target.batches) == 4
    steps = max(r.stats.steps for r in h.results.values())
    assert len(h.target.batches) <= steps + 1  # + the prompts, read in one batch
    assert [(i, w) for i, _, w in h.target.batches[0]] == [(i, "none") for i in range(4)]


def test_draft_model_drafts_every_sequence_in_one_batch_per_position() -> None:
    h = Harness(3)
    for i in range(3):
        h.start(i, [5 + i, 6 + i, 7 + i], ("model", 4), params(30))
    h.run()
    # The same control flow in each sequence: every draft batch holds all three.
    assert h.draft.batches and all(len(b) == 3 for b in h.draft.batches)
    assert h.draft.alone == []
    for i in range(3):
        assert (
            h.results[i].tokens == h.alone([5 + i, 6 + i, 7 + i], ("model", 4), params(30)).tokens
        )


def test_finished_cancelled_and_joining_sequences_leave_the_others_unchanged() -> None:
    h = Harness(4)
    p = [params(5), params(60), params(60), params(40)]

    def cancel_third(gen: Generation, n: int) -> None:
        if n == 3:
            gen.cancel()

    h.start(0, PROMPTS[0], SPECS[0], p[0])
    h.start(1, PROMPTS[1], SPECS[1], p[1], on_piece=cancel_third)
    h.start(2, PROMPTS[2], ("oracle", 5), p[2])
    h.run(steps=12)
    assert 0 in h.results and 3 not in h.results
    h.start(3, PROMPTS[3], SPECS[3], p[3])  # joins while 2 runs
    h.run()
    assert h.results[1].finish_reason == "interrupted"
    cut = h.results[1].tokens
    assert 0 < len(cut) < 60 and cut == h.alone(PROMPTS[1], SPECS[1], p[1]).tokens[: len(cut)]
    for i, spec in ((0, SPECS[0]), (2, ("oracle", 5)), (3, SPECS[3])):
        assert h.results[i].tokens == h.alone(PROMPTS[i], spec, p[i]).tokens
    # The joining sequence shared batches with the running one.
    assert any({i for i, _, _ in b} >= {2, 3} for b in h.target.batches)


def test_a_long_prompt_is_read_in_chunks_beside_the_running_steps() -> None:
    h = Harness(2, n_batch=16)
    h.start(0, PROMPTS[0], ("oracle", 3), params(80))
    h.run(steps=6)
    long_prompt = [(i % 29) + 1 for i in range(61)]
    h.start(1, long_prompt, ("none", 0), params(10))
    h.run()
    chunks = [b for b in h.target.batches if any(i == 1 and w == "none" for i, _, w in b)]
    # 60 prompt tokens beside a verification of 4 rows: 12 at a time, 5 batches, each
    # also holding sequence 0's step.
    assert [len(t) for b in chunks for i, t, _ in b if i == 1] == [12, 12, 12, 12, 12]
    assert all(any(i == 0 and w == "all" and len(t) == 4 for i, t, w in b) for b in chunks)
    assert h.results[0].tokens == h.alone(PROMPTS[0], ("oracle", 3), params(80)).tokens
    assert h.results[1].tokens == h.alone(long_prompt, ("none", 0), params(10)).tokens


def test_a_batch_holds_its_parts_in_sequence_order_whatever_took_its_rows_first() -> None:
    """A prompt read on sequence 2 beside the verifications of sequences 0, 1 and 3:
    the verifications take their rows first, and the batch still holds the sequences in
    order, as llama.cpp's micro-batches want (costmodel.micro_batches): in the order the
    rows were taken, 0, 1, 3, 2, the batch is three micro-batches (0, 1 and 2 one row
    each; 3; the rest of 2), in sequence order two (a row of each; the rest of 2)."""
    h = Harness(4, n_batch=32)
    for i in (0, 1, 3):
        h.start(i, PROMPTS[i], ("oracle", 3), params(80))
    h.run(steps=6)
    long_prompt = [(i % 29) + 1 for i in range(61)]
    h.start(2, long_prompt, ("none", 0), params(10))
    h.run()
    chunks = [b for b in h.target.batches if any(i == 2 and w == "none" for i, _, w in b)]
    assert chunks
    assert all([i for i, _, _ in b] == [0, 1, 2, 3] for b in chunks)
    assert all(len(micro_batches([(i, len(t)) for i, t, _ in b], 128)) == 2 for b in chunks)
    for i in (0, 1, 3):
        assert h.results[i].tokens == h.alone(PROMPTS[i], ("oracle", 3), params(80)).tokens
    assert h.results[2].tokens == h.alone(long_prompt, ("none", 0), params(10)).tokens


def test_where_rows_cost_little_verifications_are_padded_to_even_rows_the_pads_dropped() -> None:
    """A GPU-like cost (a micro-batch 1.0 s and 0.001 s a row): sequences verifying 5, 3
    and 1 rows are padded to 5 each (one micro-batch of 15 rows, 1.015 s, against 3, 4
    and 2 rows in three, 3.009 s), with each one's last token repeated; the pads leave
    the cache before the next step, and every output is what it is alone."""
    specs: list[Spec] = [("oracle", 4), ("oracle", 2), ("none", 0)]
    h = Harness(3, cost=lambda n, cached: 1.0 + 0.001 * n)
    for i, spec in enumerate(specs):
        h.start(i, PROMPTS[i], spec, params(30))
    h.run()
    steps = [b for b in h.target.batches if all(w == "all" for _, _, w in b) and len(b) == 3]
    assert steps and all(len({len(t) for _, t, _ in b}) == 1 for b in steps)
    assert any([len(t) for _, t, _ in b] == [5, 5, 5] for b in steps)
    padded = next(b for b in steps if [len(t) for _, t, _ in b] == [5, 5, 5])
    assert padded[2][1] == [padded[2][1][0]] * 5  # sequence 2's token and 4 copies of it
    for i, spec in enumerate(specs):
        alone = h.alone(PROMPTS[i], spec, params(30))
        assert h.results[i].tokens == alone.tokens
        assert h.target.seqs[i].kv == PROMPTS[i] + alone.tokens[:-1]  # no pad left


def test_where_rows_cost_what_micro_batches_do_nothing_is_padded() -> None:
    h = Harness(3, cost=lambda n, cached: 0.1 + 1.0 * n)  # a row: ten passes over the weights
    for i, spec in enumerate([("oracle", 4), ("oracle", 2), ("none", 0)]):
        h.start(i, PROMPTS[i], spec, params(30))
    h.run()
    steps = [b for b in h.target.batches if all(w == "all" for _, _, w in b) and len(b) > 1]
    assert any(len({len(t) for _, t, _ in b}) > 1 for b in steps)


def test_a_deterministic_sequence_is_decoded_alone() -> None:
    h = Harness(2)
    h.views[0].set_rows_per_decode(2)  # deterministic mode's batch shapes
    det = GenerationParams(n_predict=20, sampler=GREEDY, deterministic=True)
    h.start(0, PROMPTS[0], ("oracle", 4), det)
    h.start(1, PROMPTS[1], ("oracle", 4), params(20))
    h.run()
    assert all(i != 0 for b in h.target.batches for i, _, _ in b)
    assert {i for i, _, _ in h.target.alone} == {0} and h.target.batches
    assert h.results[0].tokens == h.alone(PROMPTS[0], ("oracle", 4), det).tokens


Others = tuple[int, ...]


def test_each_step_is_planned_with_the_others_in_the_batch() -> None:
    h = Harness(3)
    seen: dict[int, list[Others]] = {0: [], 1: [], 2: []}
    h.batcher.company = lambda i, others, _: seen[i].append(others)
    for i, k in enumerate((4, 2, 0)):
        h.start(i, PROMPTS[i], ("oracle", k) if k else ("none", 0), params(12))
    h.run()
    # every sequence planned beside the two others, by their ids
    assert (1, 2) in seen[0] and (0, 2) in seen[1] and (0, 1) in seen[2]


def test_a_sequence_decoded_alone_is_neither_costed_shared_nor_counted_by_the_others() -> None:
    h = Harness(3)
    h.views[2].set_rows_per_decode(2)  # deterministic: decoded alone
    seen: dict[int, list[Others]] = {0: [], 1: [], 2: []}
    h.batcher.company = lambda i, others, _: seen[i].append(others)
    det = GenerationParams(n_predict=12, sampler=GREEDY, deterministic=True)
    for i, k in enumerate((4, 2, 4)):
        h.start(i, PROMPTS[i], ("oracle", k), det if i == 2 else params(12))
    h.run()
    # once sequence 2 was decoded alone, the others planned without it, and it alone
    assert (1,) in seen[0] and (0,) in seen[1]
    assert set(seen[2][2:]) == {()}


# -- auto mode's cost of a step in a shared batch (hand-computed) ---------------------------

#: a CPU-like curve: a lone row 1.0 s, each further row 0.5 s (F = 2 t(1) - t(2) = 0.5)
CPU = {1: 1.0, 2: 1.5, 4: 2.5, 8: 4.5, 16: 8.5}
#: the GPU-like curve of the planner's checks: 17 rows 1.1x one, 65 rows 1.6x
GPU = {1: 1.0, 17: 1.1, 65: 1.6}


#: three other sequences, ids 1-3
OTHERS = (1, 2, 3)
#: the same beside sequence 1
OTHERS_BUT_1 = (0, 2, 3)


def test_a_step_in_a_shared_batch_costs_its_share_and_its_rows() -> None:
    # (On these linear curves the batch's cost per sequence equals what a sequence's last
    # token adds to it; the Xeon's curve below tells the two apart.)
    t = Timings(dict(CPU))
    assert t.verify_time(3) == pytest.approx(2.0)  # alone: the curve
    t.others = OTHERS
    assert t.sharing == 4
    # The others at a row each: T(1) = t(4) = 2.5; the step alone T(1) / 4
    assert t.verify_time(1) == pytest.approx(0.625)
    # 3 rows: llama.cpp splits the batch into a row of each (4 rows), then its other 2:
    # T(3) = t(4) + t(2) = 4.0 (padded to 3 rows each, t(12) = 6.5, costs more)
    assert t.verify_time(3) == pytest.approx(0.625 + 1.5)
    g = Timings(dict(GPU), others=OTHERS)
    # each row 0.1 / 16 = 0.00625 s: T(1) = t(4) = 1.01875
    assert g.verify_time(1) == pytest.approx(1.01875 / 4)
    # 4 rows: padded to 4 each, t(16) = 1.09375, against t(4) + t(3) = 2.03125 split
    assert g.verify_time(4) == pytest.approx(1.01875 / 4 + 12 * 0.00625)


def test_drafts_pay_less_in_a_compute_bound_batch_and_as_much_on_a_gpu() -> None:
    alone = Timings(dict(CPU))
    # a = 0.7: alone K = 1 (1.7 / 1.5 = 1.133 tokens/s against 1.0; K = 2: 2.19 / 2.0)
    assert best_k(0.7, alone, 8) == (1, pytest.approx(1.7 / 1.5))
    # beside 3 other sequences: alone 0.625 s, 1.6 tokens/s; K = 1 adds a micro-batch of
    # its second row: 0.625 + t(1) = 1.625, 1.7 / 1.625 = 1.05: no drafts
    shared = Timings(dict(CPU), others=OTHERS)
    assert best_k(0.7, shared, 8) == (0, pytest.approx(1.6))
    # GPU-like, a = 0.6: K draft tokens pad the others to K + 1 rows, one micro-batch of
    # 4 (K + 1): 0.2546875 + t(4 (K + 1)) - t(4); K = 3 pays most, E(3) / 0.3296875 =
    # 6.60 tokens/s against 3.93 alone (K = 2: 6.43; K = 4, past 17 rows: 6.28)
    gpu = Timings(dict(GPU), others=OTHERS)
    k, rate = best_k(0.6, gpu, 8)
    assert k == 3
    assert rate == pytest.approx(expected_tokens(0.6, 3) / (0.2546875 + 12 * 0.00625))
    # Split instead, K = 3 would cost a second micro-batch, t(3) = 1.0125 s more, and
    # would not pay (2.176 / 1.2671875 = 1.72 tokens/s)
    assert gpu.verify_time(4) < 0.2546875 + 1.0125


#: the 2-core Xeon's curve of 2026-12-02 (../shared/machines/curves.json), to 9 rows
XEON = {1: 1.0, 2: 1.34, 3: 1.71, 5: 1.82, 9: 3.01}


def test_a_sequence_that_fills_a_gap_counts_its_drafts_from_its_last_token() -> None:
    """Sequence 1 beside sequences 0, 2 and 3 of one row (Xeon curve): without it the ids
    have a gap, two micro-batches, t(1) + t(2) = 2.34; with its last token one, T(1) =
    t(4) = 1.765; with a draft token two again (4 rows, then 1: 2.765) or padded, t(8) =
    2.7125, the cheaper. The step alone costs T(1) / 4 = 0.44125, and the draft token
    T(2) - T(1) = 0.9475 more (counted from the batch without it, 0.3725)."""
    xeon = Timings(dict(XEON), others=OTHERS_BUT_1, seq=1)
    assert xeon.verify_time(1) == pytest.approx(0.44125)
    assert xeon.verify_time(2) == pytest.approx(0.44125 + 0.9475)
    # a = 0.9: K = 1 gives 1.9 / 1.38875 = 1.37 tokens/s against 2.27 alone
    assert best_k(0.9, xeon, 8) == (0, pytest.approx(1 / 0.44125))


def test_a_draft_pays_beside_others_when_the_batch_yields_more_with_it() -> None:
    """Sequence 0 beside sequences 1-3 of one row, Xeon curve: the batch yields 4 tokens
    in T(1) = t(4) = 1.765, 2.266 tokens per lone row's time. A copy accepted at 0.98,
    K = 8: 9 rows of sequence 0 split into a row of each, then its other 8: t(4) + t(8) =
    1.765 + 2.7125 (padded, 36 rows, far more); E(8) = (1 - 0.98^9) / 0.02 = 8.3125
    tokens, and the batch yields 3 + 8.3125 tokens in 4.4775, 2.527: more. Its share:
    8.3125 / (0.44125 + 2.7125) = 2.636 tokens/s against 1 / 0.44125 = 2.266. Counted at
    the marginal cost of its last token (F / 4 + t(4) - t(3) = 0.165 + 0.055), the step
    alone would be 4.55 tokens/s and the copy (2.83) would not be drafted. At a = 0.9,
    E(8) = 6.126, the batch would yield less (3 + 6.126 in 4.4775: 2.04) and K = 0."""
    xeon = Timings(dict(XEON), others=OTHERS)
    assert xeon.verify_time(1) == pytest.approx(0.44125)
    k, rate = best_k(0.98, xeon, 8)
    assert k == 8 and rate == pytest.approx(8.3125 / (0.44125 + 2.7125), rel=1e-4)
    assert best_k(0.9, xeon, 8)[0] == 0


def test_a_draft_rows_share_beside_others_is_of_this_sequences_share() -> None:
    """Xeon curve, 2 draft rows: alone (t(3) - t(1)) / (2 t(1)) = 0.71 / 2 = 0.355.
    Beside sequences 1-3 of one row: T(1) / 4 = 0.44125; 3 rows split into a row of each,
    then its other 2, t(4) + t(2) = 3.105 (padded, 12 rows, 3.9025); (3.105 - 1.765) /
    (2 x 0.44125) = 1.51841."""
    assert row_share(Timings(dict(XEON)), 2) == pytest.approx(0.355)
    assert row_share(Timings(dict(XEON), others=OTHERS), 2) == pytest.approx(1.51841, abs=1e-5)


def test_a_decode_of_its_own_waits_until_the_batch_it_follows_is_read() -> None:
    # A task's medium is decoded in a llama_decode of its own, which would overwrite the
    # logits of the batch the other tasks have not read yet: the batcher makes it once
    # every task it resumed has read its logits, and the task goes on after it.
    h = Harness(3)
    order: list[str] = []

    def task(i: int, call: Callable[[], object] | None) -> Callable[[], None]:
        def run() -> None:
            h.views[i].eval([1 + i, 2], logits="all")  # (the three in one batch)
            order.append(f"read {i}")
            if call is not None:
                try:
                    h.batcher.call_alone(h.views[i].ctx, call)  # type: ignore[arg-type]
                    order.append(f"after {i}")
                except ValueError as e:
                    order.append(f"{i} failed: {e}")

        return run

    def fail() -> None:
        raise ValueError("no")

    h.batcher.add(0, task(0, lambda: order.append("decode 0")))
    h.batcher.add(1, task(1, fail))
    h.batcher.add(2, task(2, None))
    h.run()
    assert order == ["read 0", "read 1", "read 2", "decode 0", "after 0", "1 failed: no"]
    # From outside a task: at once.
    h.batcher.call_alone(h.views[0].ctx, lambda: order.append("now"))  # type: ignore[arg-type]
    assert order[-1] == "now"
