"""The speculative loop's logic on a fake backend with exact integer logits."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from specgguf.errors import ContextOverflowError, UsageError
from specgguf.speculative.draft import Drafter
from specgguf.speculative.drafters import ModelDrafter, NgramDrafter
from specgguf.speculative.loop import Generation, GenerationParams, SpeculativeDecoder
from specgguf.speculative.planner import FixedPlanner
from specgguf.speculative.sampling import SamplerParams

from .fakes import FakeContext, FakeVocab, Rule, ScriptedDrafter, auto_planner, one_hot_rule

V = 32
EOS = 31
GREEDY = SamplerParams(temperature=0.0)


def target_next(prefix: Sequence[int]) -> int:
    """The fake target: a fixed walk 1, 2, ..., 30, 1, 2, ... after the last token."""
    return prefix[-1] % 30 + 1


class Decoder:
    """A decoder over the fake target with one drafter (or none); ``generate`` takes the
    draft length as ``GenerationParams.draft_max`` and makes the fixed planner."""

    def __init__(self, ctx: FakeContext, vocab: FakeVocab, drafter: object | None) -> None:
        self.dec = SpeculativeDecoder(ctx, vocab)  # type: ignore[arg-type]
        self.drafter = drafter

    def generate(self, prompt: list[int], params: GenerationParams) -> Generation:
        drafter: Drafter | None = self.drafter  # type: ignore[assignment]
        planner = FixedPlanner(drafter, params.draft_max or 0, draft_min=params.draft_min or 0)
        return self.dec.generate(prompt, params, planner)


def make(
    drafter: object | None = None, *, n_ctx: int = 256, n_batch: int = 64, eos: bool = True
) -> tuple[Decoder, FakeContext]:
    ctx = FakeContext(one_hot_rule(target_next, V), V, n_ctx=n_ctx, n_batch=n_batch)
    vocab = FakeVocab(V, eog_ids=[EOS] if eos else [])
    return Decoder(ctx, vocab, drafter), ctx


def truth(prompt: list[int], n: int) -> list[int]:
    out, seq = [], list(prompt)
    for _ in range(n):
        seq.append(target_next(seq))
        out.append(seq[-1])
    return out


def oracle_drafter(wrong_every: int = 0) -> ScriptedDrafter:
    """Proposes the target's own continuation, with every ``wrong_every``-th draft
    position replaced by a wrong token."""

    def script(history: Sequence[int], k: int) -> list[int]:
        out = truth(list(history), k)
        if wrong_every:
            for i in range(wrong_every - 1, k, wrong_every):
                out[i] = (out[i] + 7) % 30 + 1
        return out

    return ScriptedDrafter(script)


def run(dec: Decoder, prompt: list[int], **kw: object):  # type: ignore[no-untyped-def]
    params = GenerationParams(sampler=GREEDY, **kw)  # type: ignore[arg-type]
    return dec.generate(prompt, params).run()


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, 16])
def test_output_equals_target_alone(k: int) -> None:
    base = run(make(None)[0], [3, 4], n_predict=40)
    for drafter in (oracle_drafter(), oracle_drafter(3), NgramDrafter(1, 4)):
        res = run(make(drafter)[0], [3, 4], n_predict=40, draft_max=k)
        assert res.tokens == base.tokens == truth([3, 4], 40)
        assert res.text == base.text


def test_oracle_drafter_accepts_everything_and_counts_steps() -> None:
    res = run(make(oracle_drafter())[0], [1], n_predict=20, draft_max=4)
    s = res.stats
    # 4 accepted + 1 bonus per step; the last step is clamped to what n_predict leaves.
    assert s.steps == 4 and s.drafted == 16 and s.accepted == 16
    assert s.acceptance_rate == 1.0 and s.generated == 20


def test_rejection_keeps_prefix_and_rolls_back_to_committed_length() -> None:
    drafter = oracle_drafter(wrong_every=3)  # positions 3, 6, ... are wrong
    dec, ctx = make(drafter)
    res = run(dec, [1, 2], n_predict=9, draft_max=4)
    assert res.tokens == truth([1, 2], 9)
    # Step 1: verify [2, d1..d4] at positions 1..5; d1 d2 accepted, d3 wrong: commit
    # d1 d2 + correction -> history length 5, target keeps 4 positions.
    evals = [e for e in ctx.log if e[0] == "eval"]
    assert evals[0] == ("eval", 0, [1], "none")  # the prompt minus its last token
    assert evals[1][1] == 1 and len(evals[1][2]) == 5 and evals[1][3] == "all"
    assert ctx.log[ctx.log.index(evals[1]) + 1] == ("rollback", 4)
    # Drafts of 4, 4 and (clamped by n_predict) 2; two accepted in each.
    assert (res.stats.steps, res.stats.drafted, res.stats.accepted) == (3, 10, 6)
    assert res.stats.acceptance_rate == pytest.approx(0.6)


def test_eos_accepted_mid_draft_truncates_output() -> None:
    def to_eos(prefix: Sequence[int]) -> int:
        return EOS if len(prefix) == 6 else prefix[-1] % 30 + 1

    ctx = FakeContext(one_hot_rule(to_eos, V), V)

    def script(history: Sequence[int], k: int) -> list[int]:
        seq = list(history)
        for _ in range(k):
            seq.append(to_eos(seq))
        return seq[len(history) :]

    # The script follows the target's rule, so the draft holds EOS in the middle (followed
    # by more tokens) and the target accepts it.
    drafter = ScriptedDrafter(script)
    vocab = FakeVocab(V, eog_ids=[EOS], pieces={EOS: b"<EOS>"})
    dec = Decoder(ctx, vocab, drafter)
    res = dec.generate([1, 2, 3], GenerationParams(draft_max=8, sampler=GREEDY)).run()
    assert res.finish_reason == "stop"
    assert res.tokens == [4, 5, 6]  # the prefix reaches length 6 after these; next is EOS
    assert "<EOS>" not in res.text and res.text == "efg"
    # Accepted drafts past EOS are not counted: only the three kept.
    assert res.stats.steps == 1 and res.stats.accepted == 3
    assert res.stats.by_drafter[drafter.name].accepted == 3


def test_context_full_stops_with_length_and_never_overflows() -> None:
    dec, ctx = make(oracle_drafter(), n_ctx=20)
    res = run(dec, list(range(1, 11)), draft_max=8)
    assert res.finish_reason == "length"
    assert len(res.tokens) == 10  # prompt 10 + output 10 = n_ctx
    assert res.tokens == truth(list(range(1, 11)), 10)
    assert max(e[1] + len(e[2]) for e in ctx.log if e[0] == "eval") <= 20


def test_k_clamped_to_batch_and_to_tokens_left() -> None:
    drafter = oracle_drafter()
    dec, ctx = make(drafter, n_batch=4)
    res = run(dec, [1], n_predict=10, draft_max=16)
    assert ctx.max_batch <= 4
    assert max(drafter.ks) == 3  # K + 1 <= n_batch
    assert drafter.ks[-1] <= 10 - 8 - 1  # the last step only drafts what n_predict leaves
    assert len(res.tokens) == 10 and res.finish_reason == "length"


def test_drafter_that_returns_nothing() -> None:
    drafter = ScriptedDrafter(lambda h, k: [])
    res = run(make(drafter)[0], [5], n_predict=12, draft_max=8)
    assert res.tokens == truth([5], 12)
    assert res.stats.drafted == 0 and res.stats.steps == 12
    assert set(res.stats.by_drafter) == {"none"}  # steps without drafts count as "none"


def test_prompt_that_does_not_fit_is_refused_before_any_evaluation() -> None:
    dec, ctx = make(None, n_ctx=8)
    with pytest.raises(ContextOverflowError) as ei:
        run(dec, list(range(1, 9)))
    assert (ei.value.n_prompt, ei.value.n_ctx) == (8, 8)
    assert [e for e in ctx.log if e[0] == "eval"] == []
    with pytest.raises(UsageError, match="prompt is empty"):
        run(make(None)[0], [])


def test_small_draft_context_pauses_drafting_without_abort() -> None:
    draft_ctx = FakeContext(one_hot_rule(target_next, V), V, n_ctx=12)
    drafter = ModelDrafter(draft_ctx, V)  # type: ignore[arg-type]
    dec, _ = make(drafter, n_ctx=64)
    res = run(dec, [1, 2, 3], n_predict=30, draft_max=4)
    assert res.tokens == truth([1, 2, 3], 30)
    assert res.stats.accepted > 0  # drafted while the draft context had room
    assert draft_ctx.n_past <= 12


def test_model_drafter_does_not_reevaluate_what_it_holds() -> None:
    draft_ctx = FakeContext(one_hot_rule(target_next, V), V)
    drafter = ModelDrafter(draft_ctx, V)  # type: ignore[arg-type]
    run(make(drafter)[0], [1, 2, 3], n_predict=15, draft_max=3)
    evals = [e for e in draft_ctx.log if e[0] == "eval"]
    # Each token is evaluated by the draft once: all accepted, so after the first step
    # only the last draft token and the bonus token are new (2 per step).
    # The prompt is read ahead of generation (all but its last token), like the target's.
    assert evals[0][2:] == ([1, 2], "none") and evals[1][2] == [3]
    new_per_step = [len(e[2]) for e in evals[2:] if len(e[2]) > 1]
    assert len(new_per_step) >= 3 and all(n == 2 for n in new_per_step)
    # Nothing was evaluated twice: every evaluated token is still in the cache.
    assert sum(len(e[2]) for e in evals) == draft_ctx.n_past


def test_draft_tokens_beyond_target_vocab_are_never_proposed() -> None:
    big = V + 8

    def rule(prefix: Sequence[int]) -> np.ndarray:
        row = np.zeros(big, np.float32)
        row[V + 3] = 100  # the draft's favourite is an id the target does not have
        row[target_next(prefix)] = 10
        return row

    drafter = ModelDrafter(FakeContext(rule, big), V)  # type: ignore[arg-type]
    res = run(make(drafter)[0], [1], n_predict=10, draft_max=4)
    assert res.tokens == truth([1], 10)
    assert res.stats.acceptance_rate == 1.0


def test_seeded_sampling_is_reproducible() -> None:
    # Temperature 5 flattens the fake target (top-1 probability 0.18): draws matter.
    params = SamplerParams(temperature=5.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)

    def go(seed: int, k: int) -> list[int]:
        p = GenerationParams(n_predict=25, draft_max=k, sampler=params.__class__(
            **{**params.__dict__, "seed": seed}))  # fmt: skip
        return make(oracle_drafter(2))[0].generate([1], p).run().tokens

    assert go(42, 4) == go(42, 4)
    assert go(42, 4) != go(43, 4)


def test_stop_string_ends_output_before_it() -> None:
    res = run(make(oracle_drafter())[0], [1], n_predict=30, draft_max=4, stop=("fgh",))
    assert res.finish_reason == "stop"
    assert res.text == "cde"  # tokens 2, 3, 4 -> "cde"; then "fgh" is the stop string


def test_drafters_start_afresh_for_each_generation() -> None:
    draft_ctx = FakeContext(one_hot_rule(target_next, V), V)
    model = ModelDrafter(draft_ctx, V)  # type: ignore[arg-type]
    ngram = NgramDrafter(1, 3)
    for drafter in (model, ngram):
        dec, _ = make(drafter)
        for prompt in ([1, 2, 3, 4, 5, 6, 7, 8], [20, 21], [1, 2, 3]):
            res = run(dec, prompt, n_predict=12, draft_max=4)
            assert res.tokens == truth(prompt, 12)
            if drafter is model:  # the fake draft is the target: nothing is ever rejected
                assert res.stats.acceptance_rate == 1.0


def test_cancel_ends_the_generation_before_its_next_step() -> None:
    dec, ctx = make(oracle_drafter())
    gen = dec.generate([1], GenerationParams(n_predict=40, draft_max=4, sampler=GREEDY))
    first = next(gen)  # one step: 5 tokens
    gen.cancel()
    rest = list(gen)
    assert gen.result is not None and gen.result.finish_reason == "interrupted"
    assert gen.result.tokens == truth([1], 5) and gen.result.text == first + "".join(rest)
    assert gen.result.stats.steps == 1
    assert len([e for e in ctx.log if e[0] == "eval" and e[3] == "all"]) == 1


@pytest.mark.parametrize("k", [1, 3, 8])
def test_every_stop_cuts_tokens_text_and_counters_where_the_target_alone_stops(k: int) -> None:
    # Whatever ends a generation inside a multi-token step (a stop string, n_predict, an
    # end-of-generation token) ends the tokens, the text and the statistics at the token
    # where the target alone ends: drafts accepted past it are not output, nor counted.
    def to_eos(prefix: Sequence[int]) -> int:
        return EOS if len(prefix) == 20 else prefix[-1] % 30 + 1

    baseline = truth([1], 30)
    text = "".join(chr(ord("a") + t % 26) for t in baseline)
    cases: list[dict[str, object]] = [{"stop": (text[i : i + 2],)} for i in range(1, 12)]
    cases += [{"n_predict": n} for n in (1, 2, 5, 7, 9)]
    for kw in cases:
        kw.setdefault("n_predict", 30)
        alone = run(make(None)[0], [1], **kw)
        for drafter in (oracle_drafter(), oracle_drafter(3), NgramDrafter(1, 4)):
            res = run(make(drafter)[0], [1], draft_max=k, **kw)
            s = res.stats
            assert (res.tokens, res.text, res.finish_reason) == (
                alone.tokens, alone.text, alone.finish_reason), (kw, drafter)  # fmt: skip
            assert s.generated == len(res.tokens) == alone.stats.generated
            assert s.accepted <= s.generated - s.steps + (res.finish_reason != "length")
            assert sum(r.accepted for r in s.by_drafter.values()) == s.accepted
            assert sum(r.steps for r in s.by_drafter.values()) == s.steps
    # An end-of-generation token the drafts run past: the output stops before it.
    ctx = FakeContext(one_hot_rule(to_eos, V), V)
    dec = Decoder(ctx, FakeVocab(V, eog_ids=[EOS]), oracle_drafter())
    res = dec.generate([1], GenerationParams(draft_max=k, sampler=GREEDY)).run()
    assert res.tokens == truth([1], 19) and res.finish_reason == "stop"
    assert res.stats.accepted <= 19 - res.stats.steps + 1


def test_ngram_step_past_a_stop_string_keeps_only_tokens_before_it() -> None:
    # The reported case in miniature: n-gram lookup has a whole repeated run accepted in
    # one step, and the stop string completes at its third token. Right: three tokens, as
    # the target alone gives, and only the kept drafts counted as accepted.
    def repeat(prefix: Sequence[int]) -> int:
        return prefix[len(prefix) % 10] if len(prefix) >= 10 else prefix[-1] + 1

    prompt = list(range(1, 11)) * 2 + [1, 2, 3]  # "a b c d e f g h i j" x2, then "a b c"
    stop = ("fg",)
    params = GenerationParams(n_predict=32, draft_max=8, stop=stop, sampler=GREEDY)
    ctx = FakeContext(one_hot_rule(repeat, V), V)
    alone = Decoder(ctx, FakeVocab(V), None).generate(prompt, params).run()
    ctx = FakeContext(one_hot_rule(repeat, V), V)
    res = Decoder(ctx, FakeVocab(V), NgramDrafter(2, 8)).generate(prompt, params).run()
    assert alone.tokens == [4, 5, 6] and alone.text == "e"  # pieces e f g; "fg" ends at 6
    assert (res.tokens, res.text) == (alone.tokens, alone.text)
    assert res.stats.steps == 1 and res.stats.drafted == 8  # 8 drafted and verified...
    assert res.stats.accepted == 3 and res.stats.generated == 3  # ...3 of them output


def test_draft_context_smaller_than_the_prompt_drafts_from_a_window(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A 40-token prompt and a draft context of 16: the draft works on the most recent
    # tokens that fit, the output is the target's, and a warning says so once.
    draft_ctx = FakeContext(one_hot_rule(target_next, V), V, n_ctx=16)
    drafter = ModelDrafter(draft_ctx, V)  # type: ignore[arg-type]
    prompt = truth([1], 40)
    res = run(make(drafter, n_ctx=128)[0], prompt, n_predict=50, draft_max=4)
    assert res.tokens == truth(prompt, 50)
    assert res.stats.accepted >= 30  # the fake draft agrees wherever it runs
    assert max(e[1] + len(e[2]) for e in draft_ctx.log if e[0] == "eval") <= 16
    warnings = [r for r in caplog.records if "draft model's context" in r.getMessage()]
    assert len(warnings) == 1


def test_model_drafter_notices_a_cache_rolled_back_by_someone_else() -> None:
    # A calibration between two generations empties the draft's KV cache behind the
    # drafter's back: the next generation must not assume the prompt is still there.
    draft_ctx = FakeContext(one_hot_rule(target_next, V), V)
    drafter = ModelDrafter(draft_ctx, V)  # type: ignore[arg-type]
    dec = make(drafter)[0]
    run(dec, [1, 2, 3, 4], n_predict=8, draft_max=4)
    draft_ctx.rollback(0)
    res = run(dec, [1, 2, 3, 4], n_predict=8, draft_max=4)
    assert res.tokens == truth([1, 2, 3, 4], 8) and res.stats.acceptance_rate == 1.0


def test_drafts_shorter_than_draft_min_are_not_verified_alternating() -> None:
    # The drafter proposes 2 tokens, then 5, alternating; with draft_min 3 only the drafts
    # of 5 reach the target, and a skipped draft costs a plain one-token step.
    sizes = iter([2, 5] * 20)

    def script(history: Sequence[int], k: int) -> list[int]:
        return truth(list(history), next(sizes))

    dec, ctx = make(ScriptedDrafter(script))
    res = run(dec, [1], n_predict=21, draft_max=8, draft_min=3)
    assert res.tokens == truth([1], 21)
    batches = [len(e[2]) for e in ctx.log if e[0] == "eval" and e[3] == "all"]
    assert batches == [1, 6, 1, 6, 1, 6], batches  # 1 + 6 tokens per pair of steps
    assert (res.stats.drafted, res.stats.accepted) == (15, 15)
    assert res.stats.by_drafter["none"].steps == 3
    # Control: without draft_min every draft is verified.
    sizes = iter([2, 5] * 20)
    dec, ctx = make(ScriptedDrafter(script))
    run(dec, [1], n_predict=20, draft_max=8)
    batches = [len(e[2]) for e in ctx.log if e[0] == "eval" and e[3] == "all"]
    assert batches[:2] == [3, 6]


# --- the minimum draft length (llama.cpp's --spec-draft-n-min) ---------------------------


def _verified_draft_lengths(ctx: FakeContext) -> list[int]:
    """Draft lengths of the target's verifications: each is [last token, d1..dK]."""
    return [len(e[2]) - 1 for e in ctx.log if e[0] == "eval" and e[3] == "all"]


def _run_fixed(drafter: object, draft_min: int, **kw: object):  # type: ignore[no-untyped-def]
    ctx = FakeContext(one_hot_rule(target_next, V), V)
    dec = SpeculativeDecoder(ctx, FakeVocab(V))  # type: ignore[arg-type]
    planner = FixedPlanner(drafter, 4, draft_min=draft_min)  # type: ignore[arg-type]
    params = GenerationParams(sampler=GREEDY, **kw)  # type: ignore[arg-type]
    return dec.generate([1], params, planner).run(), ctx


def test_drafts_shorter_than_draft_min_are_not_verified() -> None:
    # The drafter only ever finds 2 tokens: with a minimum of 3 nothing is verified.
    two = ScriptedDrafter(lambda h, k: truth(list(h), 2))
    res, ctx = _run_fixed(two, 3, n_predict=12)
    assert res.tokens == truth([1], 12)
    assert res.stats.drafted == 0 and res.stats.steps == 12
    assert set(_verified_draft_lengths(ctx)) == {0}
    # Control: a minimum of 2 lets the same drafts through, and they are accepted.
    res, ctx = _run_fixed(ScriptedDrafter(lambda h, k: truth(list(h), 2)), 2, n_predict=12)
    assert res.tokens == truth([1], 12)
    assert res.stats.accepted == res.stats.drafted > 0 and res.stats.steps == 4
    assert set(_verified_draft_lengths(ctx)) == {2}


def test_a_step_with_room_for_fewer_than_draft_min_drafts_does_not_draft() -> None:
    # n_predict 8, K 4: the first step yields 5 tokens and leaves room for a draft of 2.
    drafter = oracle_drafter()
    res, ctx = _run_fixed(drafter, 4, n_predict=8)
    assert res.tokens == truth([1], 8)
    assert _verified_draft_lengths(ctx) == [4, 0, 0, 0]
    assert drafter.ks == [4]  # the drafter was not even asked once room fell below 4
    # Control: without a minimum, the second step drafts the 2 tokens that fit.
    res, ctx = _run_fixed(oracle_drafter(), 0, n_predict=8)
    assert _verified_draft_lengths(ctx) == [4, 2]


def test_a_draft_model_that_stops_early_is_dropped_below_draft_min() -> None:
    # A draft model sure of its first token only (p_min stops it after one token).
    def rule(prefix: Sequence[int]) -> np.ndarray:
        row = np.zeros(V, np.float32)
        row[target_next(prefix)] = 10.0 if prefix[-1] % 2 else 0.5
        return row

    def run_model(draft_min: int) -> list[int]:
        ctx = FakeContext(one_hot_rule(target_next, V), V)
        drafter = ModelDrafter(FakeContext(rule, V), V)  # type: ignore[arg-type]
        dec = SpeculativeDecoder(ctx, FakeVocab(V))  # type: ignore[arg-type]
        planner = FixedPlanner(drafter, 4, p_min=0.5, draft_min=draft_min)
        res = dec.generate([1], GenerationParams(n_predict=16, sampler=GREEDY), planner).run()
        assert res.tokens == truth([1], 16)
        return _verified_draft_lengths(ctx)

    assert max(run_model(0)) == 1  # drafts of one token are verified without a minimum
    assert set(run_model(2)) == {0}  # and dropped with a minimum of 2


def test_ngram_drafter_prefers_the_most_recent_occurrence() -> None:
    # "1 2" occurred twice before the end: after position 2 (then 7) and after position
    # 7 (then 8 9 1): the later one is proposed.
    rng = np.random.default_rng(0)
    d = NgramDrafter(1, 3)
    draft = d.propose([5, 1, 2, 7, 1, 2, 8, 9, 1, 2], 3, GREEDY, rng)
    assert draft.tokens == [8, 9, 1] and draft.match == 2


def test_ngram_drafter_prefers_the_longest_match() -> None:
    # The suffix "4 1 2" occurred once (then 7 3 2); its shorter suffix "1 2" and "2"
    # occurred later too (then 8 and 8 4 1): the longest n-gram wins.
    rng = np.random.default_rng(0)
    d = NgramDrafter(1, 3)
    draft = d.propose([4, 1, 2, 7, 3, 2, 8, 4, 1, 2], 3, GREEDY, rng)
    assert draft.tokens == [7, 3, 2] and draft.match == 3


def test_ngram_drafter_limits_and_incremental_index() -> None:
    rng = np.random.default_rng(0)
    d = NgramDrafter(2, 3)
    # A 1-gram match is below n_min: nothing.
    draft = d.propose([1, 5, 6, 1], 4, GREEDY, rng)
    assert draft.tokens == [] and draft.match == 0
    # The continuation stops at the end of the history; k bounds it too; k = 0: nothing.
    d = NgramDrafter(2, 3)
    assert d.propose([1, 2, 3, 1, 2], 8, GREEDY, rng).tokens == [3, 1, 2]
    assert d.propose([1, 2, 3, 1, 2], 2, GREEDY, rng).tokens == [3, 1]
    assert d.propose([1, 2, 3, 1, 2], 0, GREEDY, rng).tokens == []
    # The index follows the history as it grows, one call at a time, as in a generation:
    # the same answers as a fresh drafter that sees the whole history at once.
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8]
    grown = NgramDrafter(1, 4)
    for end in range(1, len(seq) + 1):
        fresh = NgramDrafter(1, 4).propose(seq[:end], 5, GREEDY, rng).tokens
        assert grown.propose(seq[:end], 5, GREEDY, rng).tokens == fresh, end
    # A history that is not an extension of the last one needs reset(), as the loop does.
    grown.reset()
    assert grown.propose([7, 7], 3, GREEDY, rng).tokens == [7]
    with pytest.raises(ValueError):
        NgramDrafter(3, 2)
    with pytest.raises(ValueError):
        NgramDrafter(0, 2)


def brute_force_ngram(history: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Prompt lookup by its definition: for n from n_max down to n_min, the latest earlier
    start j of the last n tokens; propose what follows it."""
    size = len(history)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = list(history[size - n :])
        for j in range(size - n - 1, -1, -1):
            if list(history[j : j + n]) == suffix:
                return list(history[j + n : j + n + k])
    return []


def test_ngram_drafter_against_brute_force() -> None:
    rng = np.random.default_rng(3)
    for trial in range(200):
        vocab = int(rng.integers(2, 6))
        seq = rng.integers(0, vocab, int(rng.integers(1, 40))).tolist()
        n_min = int(rng.integers(1, 4))
        n_max = n_min + int(rng.integers(0, 4))
        k = int(rng.integers(1, 9))
        got = NgramDrafter(n_min, n_max).propose(seq, k, GREEDY, rng).tokens
        assert got == brute_force_ngram(seq, k, n_min, n_max), (trial, seq, n_min, n_max, k)


def test_rejected_steps_counts_steps_whose_draft_was_cut() -> None:
    # Every third draft position is wrong: with K = 4 the two full steps keep two drafts
    # and the target's correction (rejected steps); the last step, clamped to K = 2 by
    # n_predict, is accepted whole and not counted. With K = 2 every draft is right.
    res = run(make(oracle_drafter(wrong_every=3))[0], [1, 2], n_predict=9, draft_max=4)
    assert res.stats.rejected_steps == 2 and res.stats.steps == 3
    res = run(make(oracle_drafter(wrong_every=3))[0], [1, 2], n_predict=9, draft_max=2)
    assert res.stats.rejected_steps == 0 and res.stats.accepted == res.stats.drafted
    # A rejection at the first position: every step with a draft is a rejected step (the
    # last, with one token left to generate, has none).
    res = run(make(oracle_drafter(wrong_every=1))[0], [1], n_predict=6, draft_max=3)
    assert res.stats.rejected_steps == res.stats.by_drafter["scripted"].steps == 5
    assert res.stats.steps == 6 and res.stats.accepted == 0
    # Pooled statistics add them up.
    total = res.stats.__class__()
    total.add(res.stats)
    total.add(res.stats)
    assert total.rejected_steps == 10 and total.as_dict()["rejected_steps"] == 10


# --- what mutation testing found untested in the loop ------------------------------------


class TimedContext(FakeContext):
    """A fake target whose every evaluation counts 0.25 s of model time and moves the
    fake wall clock ``now`` on by 0.125 s (nothing else moves it)."""

    def __init__(self, rule: Rule, n_vocab: int, *, now: list[float]) -> None:
        super().__init__(rule, n_vocab)
        self.now = now

    def eval(self, tokens, *, logits="last"):  # type: ignore[no-untyped-def]
        self.eval_seconds += 0.25
        self.now[0] += 0.125
        return super().eval(tokens, logits=logits)


def test_statistics_of_a_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import specgguf.speculative.loop as loop_module

    # A fake clock: the times below are exact whatever the machine's load.
    now = [1000.0]
    monkeypatch.setattr(loop_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    ctx = TimedContext(one_hot_rule(target_next, V), V, now=now)
    drafter = oracle_drafter(wrong_every=3)
    dec = Decoder(ctx, FakeVocab(V), drafter)
    res = dec.generate([1, 2, 3], GenerationParams(n_predict=9, draft_max=4, sampler=GREEDY)).run()
    s = res.stats
    assert s.prompt_tokens == 3 and s.generated == 9 and s.draft_max == 4
    # The prompt's evaluation (0.25 s) is prompt time; three verifications are generation.
    assert s.target_seconds == 0.75 and s.draft_seconds == 0.0
    # On the wall clock: one evaluation for the prompt, three for the generation.
    assert s.prompt_seconds == 0.125 and s.seconds == 0.375
    assert s.last_draft == 2 and s.last_drafter == "scripted"  # the last step: K = 2
    d = s.as_dict()
    assert d["target_seconds"] == 0.75 and d["generated"] == 9 and d["rejected_steps"] == 2
    assert d["by_drafter"] == {"scripted": [3, 10, 6]}
    assert d["acceptance_rate"] == 0.6 and d["mean_accepted"] == 2.0
    assert d["python_seconds"] == 0.0  # the fake's model time exceeds the wall time
    assert d["tokens_per_s"] == 24.0  # 9 tokens in 0.375 s
    assert set(d) >= {f.name for f in s.__dataclass_fields__.values()}


def test_statistics_pool_with_add() -> None:
    from specgguf.speculative.loop import DrafterStats, GenerationStats

    a = GenerationStats(prompt_tokens=3, prompt_seconds=0.5, generated=10, steps=4, drafted=8,
                        accepted=6, seconds=2.0, target_seconds=1.5, draft_seconds=0.25,
                        draft_max=4, rejected_steps=1, last_draft=3, last_drafter="model",
                        by_drafter={"model": DrafterStats(4, 8, 6)})  # fmt: skip
    b = GenerationStats(prompt_tokens=2, prompt_seconds=0.25, generated=5, steps=5, drafted=2,
                        accepted=1, seconds=1.0, target_seconds=0.5, draft_seconds=0.125,
                        draft_max=8, rejected_steps=1, last_draft=1, last_drafter="ngram",
                        by_drafter={"ngram": DrafterStats(1, 2, 1),
                                    "none": DrafterStats(4)})  # fmt: skip
    a.add(b)
    assert (a.prompt_tokens, a.prompt_seconds, a.generated, a.steps, a.drafted, a.accepted) == (
        5, 0.75, 15, 9, 10, 7)  # fmt: skip
    assert (a.seconds, a.target_seconds, a.draft_seconds, a.rejected_steps) == (3.0, 2.0, 0.375, 2)
    assert a.draft_max == 8 and (a.last_draft, a.last_drafter) == (3, "model")
    assert a.by_drafter == {"model": DrafterStats(4, 8, 6), "ngram": DrafterStats(1, 2, 1),
                            "none": DrafterStats(4, 0, 0)}  # fmt: skip
    a.add(b)
    assert a.by_drafter["ngram"] == DrafterStats(2, 4, 2) and a.draft_max == 8
    assert a.python_seconds == pytest.approx(4.0 - 2.5 - 0.5)
    assert a.tokens_per_s == pytest.approx(20 / 4.0) and a.mean_accepted == pytest.approx(8 / 14)
    empty = GenerationStats()
    assert (empty.acceptance_rate, empty.mean_accepted, empty.tokens_per_s) == (0.0, 0.0, 0.0)


def test_interrupt_keeps_what_was_committed() -> None:
    dec, _ = make(oracle_drafter())
    gen = dec.generate([1], GenerationParams(n_predict=40, draft_max=4, sampler=GREEDY))
    first = next(gen)
    res = gen.interrupt()
    assert res.finish_reason == "interrupted" and res.text == first
    assert res.tokens == truth([1], 5) and res.stats.generated == 5
    assert gen.interrupt() is res  # a second interrupt changes nothing
    # After the end, interrupt returns the finished result.
    done = dec.generate([1], GenerationParams(n_predict=3, sampler=GREEDY))
    final = done.run()
    assert done.interrupt() is final and final.finish_reason == "length"


def test_generate_without_a_planner_is_the_target_alone() -> None:
    ctx = FakeContext(one_hot_rule(target_next, V), V)
    dec = SpeculativeDecoder(ctx, FakeVocab(V))  # type: ignore[arg-type]
    res = dec.generate([4], GenerationParams(n_predict=6, sampler=GREEDY)).run()
    assert res.tokens == truth([4], 6) and res.stats.steps == 6 and res.stats.drafted == 0
    assert res.stats.draft_max == 0 and set(res.stats.by_drafter) == {"none"}
    with pytest.raises(UsageError) as ei:
        dec.generate([], GenerationParams())
    assert str(ei.value) == "the prompt is empty: nothing to continue from"


def test_n_predict_0_and_a_one_token_prompt() -> None:
    dec, ctx = make(oracle_drafter())
    res = run(dec, [7], n_predict=0, draft_max=4)
    assert res.tokens == [] and res.text == "" and res.finish_reason == "length"
    assert res.stats.steps == 0
    # A one-token prompt has nothing to evaluate before the first step.
    dec, ctx = make(oracle_drafter())
    run(dec, [7], n_predict=3, draft_max=2)
    evals = [e for e in ctx.log if e[0] == "eval"]
    assert evals[0] == ("eval", 0, [7, 8, 9], "all")


def test_last_step_drafts_everything_the_context_leaves() -> None:
    # Prompt 10, context 20: one step of K = 9 fills it (K + 1 = 10 new tokens).
    drafter = oracle_drafter()
    dec, _ = make(drafter, n_ctx=20)
    res = run(dec, list(range(1, 11)), draft_max=16)
    assert drafter.ks == [9] and res.stats.steps == 1 and len(res.tokens) == 10


def test_ignore_eos_takes_the_next_best_token() -> None:
    # The target's favourite is EOS after 6 tokens; its second choice is token 0 (the
    # one_hot_rule gives (EOS + 1) % V logit 5). With --ignore-eos the output goes on.
    def to_eos(prefix: Sequence[int]) -> int:
        return EOS if len(prefix) == 6 else prefix[-1] % 30 + 1

    for drafter in (None, oracle_drafter()):
        ctx = FakeContext(one_hot_rule(to_eos, V), V)
        dec = Decoder(ctx, FakeVocab(V, eog_ids=[EOS]), drafter)
        params = GenerationParams(n_predict=6, draft_max=3, sampler=GREEDY, ignore_eos=True)
        res = dec.generate([1, 2, 3], params).run()
        assert res.tokens == [4, 5, 6, 0, 1, 2] and res.finish_reason == "length"
        stop = dec.generate([1, 2, 3], GenerationParams(n_predict=6, draft_max=3,
                                                         sampler=GREEDY)).run()  # fmt: skip
        assert stop.tokens == [4, 5, 6] and stop.finish_reason == "stop"
    # Sampled: EOS never appears, whatever the seed.
    ctx = FakeContext(one_hot_rule(to_eos, V), V)
    dec = Decoder(ctx, FakeVocab(V, eog_ids=[EOS]), oracle_drafter())
    for seed in range(20):
        sampler = SamplerParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
        params = GenerationParams(n_predict=5, draft_max=2, sampler=sampler, ignore_eos=True)
        res = dec.generate([1, 2, 3], params).run()
        assert EOS not in res.tokens and len(res.tokens) == 5


def test_text_held_for_a_stop_string_is_released_at_the_end() -> None:
    # The output ends (n_predict) on "e", which could start the stop string "ef": the
    # end of generation releases it.
    dec, _ = make(oracle_drafter())
    gen = dec.generate([1], GenerationParams(n_predict=3, draft_max=4, sampler=GREEDY,
                                             stop=("ef",)))  # fmt: skip
    pieces = list(gen)
    assert gen.result is not None and gen.result.text == "cde" == "".join(pieces)
    assert pieces[-1] == "e" and gen.result.finish_reason == "length"


def test_an_auto_planner_learns_from_the_loop() -> None:
    from specgguf.speculative.costmodel import Timings

    ctx = FakeContext(one_hot_rule(target_next, V), V)
    model = ModelDrafter(FakeContext(one_hot_rule(target_next, V), V), V)  # type: ignore[arg-type]
    # Calibrated at 10 s per step: the fake runs far faster, so the learned corrections
    # fall to their floor of 0.8.
    timings = Timings({1: 10.0, 2: 10.0, 17: 10.0}, draft=1.0)
    planner = auto_planner(timings, model=model, ngram=NgramDrafter(2, 4))
    dec = SpeculativeDecoder(ctx, FakeVocab(V))  # type: ignore[arg-type]
    res = dec.generate([1, 2, 3], GenerationParams(n_predict=60, sampler=GREEDY), planner).run()
    assert res.tokens == truth([1, 2, 3], 60)
    assert timings.scale_single < 1.0 or timings.scale_batch < 1.0
    assert min(timings.scale_single, timings.scale_batch) >= 0.8
    # The target's confidence (top-1 probability 0.99 here) reached the planner.
    assert planner.confidence > 0.95


def test_deterministic_mode_drafts_greedily_and_keys_draws_by_output_position() -> None:
    from specgguf.speculative.draft import Draft

    class Recording(ScriptedDrafter):
        def propose(self, history, k, sampler, rng, *, p_min=0.0):  # type: ignore[no-untyped-def]
            self.greedy = [*getattr(self, "greedy", []), sampler.greedy]
            return Draft(self.script(history, k)[:k])

    flat = FakeContext(lambda kv: np.zeros(V, np.float32), V)  # the same p everywhere
    sampler = SamplerParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    outs = []
    for prompt in ([1], [1, 2, 3, 4, 5]):
        drafter = Recording(lambda h, k: [0] * k)
        dec = Decoder(flat, FakeVocab(V), drafter)
        params = GenerationParams(n_predict=12, draft_max=3, sampler=sampler, deterministic=True)
        outs.append(dec.generate(prompt, params).run().tokens)
        assert drafter.greedy and all(drafter.greedy)  # point-mass drafts
    # Output position i draws with the key (seed, i), whatever the prompt's length.
    assert outs[0] == outs[1]


def test_statistics_as_json_are_rounded_as_documented() -> None:
    from specgguf.speculative.loop import GenerationStats

    s = GenerationStats(generated=7, steps=3, drafted=3, accepted=2, seconds=1 / 3)
    s.target_seconds, s.draft_seconds, s.prompt_seconds = 1 / 7, 1 / 9, 1 / 6
    d = s.as_dict()
    assert d["acceptance_rate"] == 0.6667 and d["mean_accepted"] == 0.6667
    assert d["tokens_per_s"] == 21.0 and d["python_seconds"] == 0.0794
    assert (d["seconds"], d["target_seconds"], d["draft_seconds"], d["prompt_seconds"]) == (
        0.3333, 0.1429, 0.1111, 0.1667)  # fmt: skip


def test_ngram_drafter_with_a_single_length() -> None:
    rng = np.random.default_rng(0)
    d = NgramDrafter(2, 2)
    draft = d.propose([1, 2, 9, 3, 1, 2], 2, GREEDY, rng)
    assert draft.tokens == [9, 3] and draft.match == 2
    # Only n = 2: the trailing 1-gram "2" alone, matched earlier, is not enough.
    assert NgramDrafter(2, 2).propose([2, 5, 1, 2], 3, GREEDY, rng).tokens == []
    assert NgramDrafter(1, 1).propose([2, 5, 1, 2], 3, GREEDY, rng).tokens == [5, 1, 2]


def test_the_loop_cuts_a_draft_longer_than_the_step_allows() -> None:
    # A drafter that ignores k and proposes 20 tokens: near n_predict's end the loop
    # verifies only what fits (K + 1 new tokens within n_predict).
    greedy_walk = ScriptedDrafter(lambda h, k: truth(list(h), 20))
    dec, ctx = make(None)
    planner = FixedPlanner(greedy_walk, 16)
    res = dec.dec.generate([3, 4], GenerationParams(n_predict=10, sampler=GREEDY), planner).run()
    assert res.tokens == truth([3, 4], 10) and res.finish_reason == "length"
    batches = [len(e[2]) for e in ctx.log if e[0] == "eval" and e[3] == "all"]
    assert batches == [10]  # the last token and 9 drafts: 10 tokens, n_predict exactly


def test_a_rejection_whose_correction_ends_the_generation_is_not_a_rejected_step() -> None:
    # A target that ends after 29: drafts 29, 5 after 28; 29 accepted, 5 rejected, and
    # the target's own token there is EOS: nothing more is output, and the step does not
    # count as one whose correction was kept.
    def rule(prefix: Sequence[int]) -> np.ndarray:
        row = np.zeros(V, np.float32)
        row[EOS if prefix[-1] == 29 else prefix[-1] + 1] = 10.0
        return row

    ctx = FakeContext(rule, V)
    dec = SpeculativeDecoder(ctx, FakeVocab(V, eog_ids=[EOS]))  # type: ignore[arg-type]
    planner = FixedPlanner(ScriptedDrafter(lambda h, k: [29, 5][:k]), 2)
    res = dec.generate([27, 28], GenerationParams(n_predict=10, sampler=GREEDY), planner).run()
    assert res.tokens == [29] and res.finish_reason == "stop"
    assert (res.stats.drafted, res.stats.accepted, res.stats.rejected_steps) == (2, 1, 0)


def test_draft_time_counts_the_drafts_not_the_prompt() -> None:
    class Timed(ScriptedDrafter):
        def prefill(self, history: Sequence[int]) -> None:
            self.seconds += 5.0  # reading the prompt: prompt time

        def propose(self, history, k, sampler, rng, *, p_min=0.0):  # type: ignore[no-untyped-def]
            self.seconds += 0.25
            return super().propose(history, k, sampler, rng, p_min=p_min)

    drafter = Timed(lambda h, k: truth(list(h), k))
    dec, _ = make(drafter)
    res = run(dec, [3, 4], n_predict=9, draft_max=2)
    assert res.stats.steps == 3 and res.stats.draft_seconds == pytest.approx(0.75)


class _GeneralPlanner(FixedPlanner):
    """The target alone through the loop's general steps (the lean path takes only a
    FixedPlanner itself): the reference the lean path must equal."""


def _hashed_rule(prefix: Sequence[int]) -> np.ndarray:
    """Varied logits, a function of the last two tokens: draws matter when sampled, and
    the end of generation (EOS) comes up now and then."""
    rng = np.random.default_rng(prefix[-1] * 131 + (prefix[-2] if len(prefix) > 1 else 0))
    row = rng.integers(0, 12, V).astype(np.float32)
    row[EOS] += 5 * (prefix[-1] % 9 == 3)  # (often the top token there)
    return row


#: pieces that split a UTF-8 character (4, 5: "€"), end in a stop string's first
#: character (6) or spell one across tokens (7, 8): text held back and released
SPLIT_PIECES = {4: b"\xe2\x82", 5: b"\xac!", 6: b"x.", 7: b"\nU", 8: b"ser:", 9: b"\n"}


@pytest.mark.parametrize(
    "kw",
    [
        {"sampler": GREEDY},
        {"sampler": GREEDY, "ignore_eos": True},
        {"sampler": GREEDY, "stop": ("ei", "q")},
        {"sampler": GREEDY, "stop": (".", "\nUser:")},
        {"sampler": GREEDY, "stop": ("!",), "ignore_eos": True},
        {"sampler": SamplerParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0, seed=7)},
        {"sampler": SamplerParams(temperature=1.5, top_k=5, top_p=0.9, min_p=0.0, seed=3),
         "ignore_eos": True},
        {"sampler": SamplerParams(temperature=1.0, seed=11), "stop": ("c",)},
    ],
)  # fmt: skip
@pytest.mark.parametrize("n_predict,n_ctx", [(60, 256), (-1, 40), (1, 256)])
@pytest.mark.parametrize("pieces", [None, SPLIT_PIECES])
def test_the_target_alones_lean_steps_equal_its_general_steps(
    kw: dict[str, object],
    n_predict: int,
    n_ctx: int,
    pieces: dict[int, bytes] | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lean_runs = []
    lean = SpeculativeDecoder._run_alone

    def counted(self, gen, run, steps):  # type: ignore[no-untyped-def]
        lean_runs.append(gen)
        return (yield from lean(self, gen, run, steps))

    monkeypatch.setattr(SpeculativeDecoder, "_run_alone", counted)
    results = []
    for planner in (FixedPlanner(None, 0), _GeneralPlanner(None, 0)):
        ctx = FakeContext(_hashed_rule, V, n_ctx=n_ctx)
        vocab = FakeVocab(V, eog_ids=[EOS], pieces=pieces)
        dec = SpeculativeDecoder(ctx, vocab)  # type: ignore[arg-type]
        params = GenerationParams(n_predict=n_predict, **kw)  # type: ignore[arg-type]
        gen = dec.generate([5, 9, 2], params, planner)
        streamed = "".join(gen)
        assert gen.result is not None
        res, s = gen.result, gen.result.stats
        assert streamed == res.text
        results.append((res.tokens, res.text, res.finish_reason, s.steps, s.generated,
                         s.drafted, ctx.kv, [e for e in ctx.log if e[0] == "eval"]))  # fmt: skip
    assert len(lean_runs) == 1  # the first took the lean path, the second did not
    assert results[0] == results[1]
    tokens, _, finish, steps, generated, *_ = results[0]
    assert steps == generated + (finish == "stop" and EOS not in tokens and steps > generated)
    if kw.get("ignore_eos"):
        assert EOS not in tokens and finish == "length"


class _TimedContext(FakeContext):
    """Each evaluation takes a millisecond of the target's time (``eval_seconds``)."""

    def eval(self, tokens, *, logits="last"):  # type: ignore[no-untyped-def]
        self.eval_seconds += 0.001
        return super().eval(tokens, logits=logits)


def test_the_lean_path_counts_its_time_as_the_general_one_does() -> None:
    ctx = _TimedContext(_hashed_rule, V)
    dec = SpeculativeDecoder(ctx, FakeVocab(V, eog_ids=[EOS]))  # type: ignore[arg-type]
    res = dec.generate([1, 2], GenerationParams(n_predict=30, sampler=GREEDY,
                                                ignore_eos=True)).run()  # fmt: skip
    s = res.stats
    assert s.generated == s.steps == 30 and s.drafted == 0
    assert s.by_drafter["none"].steps == 30
    # 30 steps of one evaluation each; the prompt's (before them) is the prompt's time
    assert s.target_seconds == pytest.approx(0.030) and s.seconds > 0


@pytest.mark.parametrize("stop,streamed", [((".",), "d\u20ac!x"), (("!",), "d\u20ac")])
def test_text_held_back_reaches_the_stream_when_a_stop_string_ends_the_target_alone(
    stop: tuple[str, ...], streamed: str
) -> None:
    # (found in review: the lean steps returned at a stop string without yielding the
    # text it released.) Tokens 3, 4, 5, 6, ...: "d", half of "\u20ac", its rest and "!",
    # "x." ...: the stop string's text before it, held back until then, is streamed.
    def rule(prefix: Sequence[int]) -> np.ndarray:
        row = np.zeros(V, np.float32)
        row[prefix[-1] + 1] = 1
        return row

    vocab = FakeVocab(V, eog_ids=[0], pieces={6: b"x.", 4: b"\xe2\x82", 5: b"\xac!"})
    for planner in (FixedPlanner(None, 0), _GeneralPlanner(None, 0)):
        dec = SpeculativeDecoder(FakeContext(rule, V), vocab)  # type: ignore[arg-type]
        gen = dec.generate([1, 2], GenerationParams(n_predict=20, sampler=GREEDY, stop=stop),
                           planner)  # fmt: skip
        assert "".join(gen) == streamed
        assert gen.result is not None and gen.result.text == streamed
        assert gen.result.finish_reason == "stop"


def _exact_top_probability(row: np.ndarray) -> float:
    """softmax(row).max() in float64 over the whole row: the reference."""
    x = row.astype(np.float64)
    return float(1.0 / np.exp(x - x.max()).sum())


def _top(row: np.ndarray) -> float:
    from specgguf.speculative.loop import RowBuffers, top_probability

    return top_probability(row, RowBuffers())


def test_the_top_probability_of_a_peaked_row_reads_the_near_logits_within_its_bound() -> None:
    from specgguf.speculative.loop import NEAR_MAX

    rng = np.random.default_rng(3)
    n = 151_936
    row = (rng.standard_normal(n) * 3).astype(np.float32)
    row[7] = 22.0  # a confident step: most logits 20 or more below the top
    exact = _exact_top_probability(row)
    got = _top(row)
    assert got >= exact * (1 - 1e-6)  # the logits left out only ever lower it
    assert got <= exact * (1 + n * np.exp(-NEAR_MAX))
    assert got == pytest.approx(exact, rel=1e-3)


def test_the_top_probability_leaves_out_only_logits_past_its_cut() -> None:
    from specgguf.speculative.loop import NEAR_MAX

    n = 151_936
    row = np.full(n, -(NEAR_MAX + 0.5), np.float32)
    row[0] = 0.0
    # every other logit just past the cut: the whole error the bound allows, about 1%
    exact = 1.0 / (1.0 + (n - 1) * np.exp(-(NEAR_MAX + 0.5)))
    assert _top(row) == pytest.approx(1.0)
    assert 1.0 / exact - 1.0 <= n * np.exp(-NEAR_MAX)
    # just inside the cut, they count
    row[1:] = -(NEAR_MAX - 0.5)
    assert _top(row) == pytest.approx(_exact_top_probability(row), rel=1e-5)


def test_the_top_probability_of_a_flat_row_sums_it_whole() -> None:
    row = np.zeros(1000, np.float32)
    assert _top(row) == pytest.approx(1e-3, rel=1e-6)
    # most of the row near its top (not at its start): summed whole, for speed (whether
    # the few far logits are left out or not changes the sum by e^-16 of them at most)
    row[700:] = 2.0
    row[10] = -30.0
    assert _top(row) == pytest.approx(_exact_top_probability(row), rel=1e-6)


def test_the_top_probability_reads_only_the_near_logits_below_a_quarter_of_the_row() -> None:
    from specgguf.speculative.loop import NEAR_MAX

    n = 1000
    row = np.full(n, -(NEAR_MAX + 0.5), np.float32)
    row[:249] = 0.0  # just under a quarter near the top
    near = 1.0 / 249
    assert _top(row) == near  # the far ones left out: 249 ones summed
    assert _exact_top_probability(row) < near * (1 - 1e-7)  # (they weigh 2e-7 of it)


def test_the_top_probability_reuses_its_buffers_across_rows_of_other_sizes() -> None:
    from specgguf.speculative.loop import RowBuffers, top_probability

    buffers = RowBuffers()
    for n in (300, 1000, 300, 4000):
        flat = np.zeros(n, np.float32)  # the whole-row path
        assert top_probability(flat, buffers) == pytest.approx(1.0 / n, rel=1e-6)
        peaked = np.full(n, -40.0, np.float32)  # the near path
        peaked[n // 2] = 0.0
        assert top_probability(peaked, buffers) == pytest.approx(1.0, rel=1e-6)


def test_the_top_probability_of_a_row_without_a_finite_maximum_does_not_raise() -> None:
    row = np.zeros(100, np.float32)
    row[5] = np.nan
    assert np.isnan(_top(row))
