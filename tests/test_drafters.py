"""The drafters' bookkeeping, pinned call by call: what the draft model's cache evaluates
(the fake context's log) after a prefill, an accepted or a rejected draft, a new prompt and
a window shift, and the n-gram drafter's bounds. Each expected log is worked out by hand
from the documented behaviour (the cache holds the history from ``offset`` on; a shift
keeps the most recent half of the context), not read off the code."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pytest

from specgguf.speculative.drafters import ModelDrafter, NgramDrafter
from specgguf.speculative.drafters import model as drafters_module
from specgguf.speculative.sampling import SamplerParams

from .fakes import FakeContext, one_hot_rule

# Every test twice: with the compiled lookup indexes and with their pure-Python reference.
pytestmark = pytest.mark.usefixtures("lookup_impl")

V = 64
GREEDY = SamplerParams(temperature=0.0)
RNG = np.random.default_rng(0)


def plus_one(prefix: Sequence[int]) -> int:
    return (prefix[-1] + 1) % V


def drafter(n_ctx: int = 256) -> tuple[ModelDrafter, FakeContext]:
    ctx = FakeContext(one_hot_rule(plus_one, V), V, n_ctx=n_ctx)
    return ModelDrafter(ctx, V), ctx  # type: ignore[arg-type]


def log_of(ctx: FakeContext) -> list[tuple[object, ...]]:
    out, ctx.log = ctx.log, []
    return out


def last(n_past: int, tokens: list[int]) -> tuple[object, ...]:
    return ("eval", n_past, tokens, "last")


def test_prefill_then_drafts_evaluate_each_token_once() -> None:
    d, ctx = drafter()
    assert d.seconds == 0.0
    d.prefill([1, 2, 3, 4, 5])
    assert log_of(ctx) == [("rollback", 0), ("eval", 0, [1, 2, 3, 4], "none")]
    # The same prompt again: all but its last token are held; nothing to evaluate.
    d.prefill([1, 2, 3, 4, 5])
    assert log_of(ctx) == [("rollback", 4)]
    # A longer prompt sharing it: only the new tokens but the last.
    d.prefill([1, 2, 3, 4, 5, 6])
    assert log_of(ctx) == [("rollback", 4), ("eval", 4, [5], "none")]
    # Drafting: the last history token, then one evaluation per draft token but the last.
    assert d.propose([1, 2, 3, 4, 5, 6], 3, GREEDY, RNG).tokens == [7, 8, 9]
    assert log_of(ctx) == [("rollback", 5), last(5, [6]), last(6, [7]), last(7, [8])]
    # Two of the three accepted and the target's own token (20) after them: the cache
    # keeps the accepted drafts and evaluates only the new token.
    assert d.propose([1, 2, 3, 4, 5, 6, 7, 8, 20], 2, GREEDY, RNG).tokens == [21, 22]
    assert log_of(ctx) == [("rollback", 8), last(8, [20]), last(9, [21])]
    # The same history again: its last token is evaluated again for its logits.
    assert d.propose([1, 2, 3, 4, 5, 6, 7, 8, 20], 2, GREEDY, RNG).tokens == [21, 22]
    assert log_of(ctx) == [("rollback", 8), last(8, [20]), last(9, [21])]
    # Nothing asked: nothing evaluated, even with a history to catch up on.
    assert d.propose([1, 2, 3, 4, 5, 6, 7, 8, 20, 30, 31], 0, GREEDY, RNG).tokens == []
    assert log_of(ctx) == []


def test_a_new_prompt_reuses_only_the_prefix_it_shares() -> None:
    d, ctx = drafter()
    d.prefill([1, 2, 3, 4, 5])
    d.propose([1, 2, 3, 4, 5], 3, GREEDY, RNG)
    log_of(ctx)
    # A new generation: the cache is kept, and a prompt sharing "1 2" reuses those two.
    d.reset()
    d.prefill([1, 2, 9, 9, 9])
    assert log_of(ctx) == [("rollback", 2), ("eval", 2, [9, 9], "none")]
    # A prompt sharing nothing re-evaluates from the start.
    d.reset()
    d.prefill([40, 41, 42])
    assert log_of(ctx) == [("rollback", 0), ("eval", 0, [40, 41], "none")]
    # The whole last history as the next prompt: its last token is left for drafting.
    d.propose([40, 41, 42], 2, GREEDY, RNG)
    log_of(ctx)
    d.reset()
    d.prefill([40, 41, 42])
    assert log_of(ctx) == [("rollback", 2)]


def test_the_window_shifts_to_the_recent_half_of_the_draft_context(
    caplog: pytest.LogCaptureFixture,
) -> None:
    d, ctx = drafter(n_ctx=16)
    h = list(range(20))
    # 20 tokens and 3 draft evaluations do not fit 16: the window restarts on the most
    # recent 8 (16 // 2) tokens, at offset 12.
    assert d.propose(h, 4, GREEDY, RNG).tokens == [20, 21, 22, 23]
    assert log_of(ctx) == [
        ("rollback", 0), ("rollback", 0), last(0, list(range(12, 20))),
        last(8, [20]), last(9, [21]), last(10, [22]),
    ]  # fmt: skip
    assert d.offset == 12 and d.cached_tokens(h) == 20
    assert [r.getMessage() for r in caplog.records] == [
        "the draft model's context (16 tokens) is smaller than the text so far (23 tokens): "
        "it drafts from the most recent 8 tokens"
    ]
    # All accepted and the bonus 24: 25 - 12 tokens and 3 evaluations fill 16 exactly.
    h2 = list(range(25))
    assert d.propose(h2, 4, GREEDY, RNG).tokens == [25, 26, 27, 28]
    assert log_of(ctx) == [("rollback", 11), last(11, [23, 24]), last(13, [25]),
                           last(14, [26]), last(15, [27])]  # fmt: skip
    # The same history again: its last token is evaluated again, inside the window.
    assert d.propose(h2, 4, GREEDY, RNG).tokens == [25, 26, 27, 28]
    assert log_of(ctx) == [("rollback", 12), last(12, [24]), last(13, [25]),
                           last(14, [26]), last(15, [27])]  # fmt: skip
    # Rejected at the first draft token: 30 and 31 follow 24; the cache keeps 12..24.
    assert d.propose([*h2, 30, 31], 1, GREEDY, RNG).tokens == [32]
    assert log_of(ctx) == [("rollback", 13), last(13, [30, 31])]
    # 26 - 12 tokens and 3 draft evaluations are one too many: the window shifts again.
    h3 = list(range(26))
    d.reset()
    assert d.propose(h3, 4, GREEDY, RNG).tokens == [26, 27, 28, 29]
    assert log_of(ctx) == [
        ("rollback", 0), ("rollback", 0), last(0, list(range(18, 26))),
        last(8, [26]), last(9, [27]), last(10, [28]),
    ]  # fmt: skip
    assert d.offset == 18 and len(caplog.records) == 1  # warned once


def test_prefill_keeps_a_window_the_prompt_reaches_and_leaves_one_it_does_not() -> None:
    d, ctx = drafter(n_ctx=16)
    d.propose(list(range(20)), 4, GREEDY, RNG)  # window at offset 12, as above
    log_of(ctx)
    # The same text, longer: the window stays; only the tokens past the cache are read.
    d.reset()
    d.prefill(list(range(24)))
    assert log_of(ctx) == [("rollback", 11)]  # 12..22 held (the drafts 20..22 included)
    assert d.offset == 12
    d.reset()
    d.prefill(list(range(13)))  # ends at the window's first token: nothing to read
    assert log_of(ctx) == [("rollback", 0)] and d.offset == 12
    # Another text of the same length: the window starts again at its beginning.
    d.reset()
    other = list(range(30, 44))
    d.prefill(other)
    assert log_of(ctx) == [("rollback", 0), ("eval", 0, other[:-1], "none")]
    assert d.offset == 0
    # A prompt that fills the context but one position fits without a shift.
    d2, ctx2 = drafter(n_ctx=16)
    d2.prefill(list(range(15)))
    assert log_of(ctx2) == [("rollback", 0), ("eval", 0, list(range(14)), "none")]
    assert d2.offset == 0


def test_a_tiny_draft_context_drafts_one_token_from_the_last_one() -> None:
    d, ctx = drafter(n_ctx=3)
    # Half of 3 is 1: one token drafted, from a window holding only the last token.
    assert d.propose([1, 2, 3, 4, 5], 4, GREEDY, RNG).tokens == [6]
    assert log_of(ctx) == [("rollback", 0), ("rollback", 0), last(0, [5])]
    assert d.offset == 4


def two_way(prefix: Sequence[int]) -> npt.NDArray[np.float32]:
    """Token 10 after 1, then a tie between 20 and 21 (probability 1/2 each)."""
    row = np.full(V, -100.0, np.float32)
    if prefix[-1] == 1:
        row[10] = 0.0
    else:
        row[20] = row[21] = 0.0
    return row


def test_p_min_stops_at_the_first_token_below_it() -> None:
    for p_min, tokens, stopped in [(0.5, [10, 20, 20], False), (0.51, [10], True)]:
        d = ModelDrafter(FakeContext(two_way, V), V)  # type: ignore[arg-type]
        draft = d.propose([1], 3, GREEDY, RNG, p_min=p_min)
        assert (draft.tokens, draft.stopped) == (tokens, stopped), p_min


def test_p_path_min_stops_where_the_product_of_the_drafts_probabilities_falls_below_it() -> None:
    # 10 (probability 1), then 20 at 1/2 (path 1/2), 20 again (path 1/4): 0.3 lets two
    # tokens through, 0.25 all three, 0.6 only the first; the sampled draft ignores it.
    for p_path_min, tokens, stopped in [(0.3, [10, 20], True), (0.25, [10, 20, 20], False),
                                        (0.6, [10], True)]:  # fmt: skip
        d = ModelDrafter(FakeContext(two_way, V), V)  # type: ignore[arg-type]
        draft = d.propose([1], 3, GREEDY, RNG, p_path_min=p_path_min)
        assert (draft.tokens, draft.stopped) == (tokens, stopped), p_path_min
    d = ModelDrafter(FakeContext(two_way, V), V)  # type: ignore[arg-type]
    sampled = d.propose([1], 3, SamplerParams(temperature=1.0), RNG, p_path_min=0.9)
    assert len(sampled.tokens) == 3 and not sampled.stopped


def test_seconds_add_up_over_prefills_and_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    times = iter([10.0, 10.5, 20.0, 20.25, 30.0, 30.0625, 30.125])
    monkeypatch.setattr(drafters_module.time, "perf_counter", lambda: next(times))
    d, _ = drafter()
    d.prefill([1, 2, 3])
    assert d.seconds == 0.5
    d.prefill([1, 2, 3, 4])
    assert d.seconds == 0.75
    draft = d.propose([1, 2, 3, 4], 1, GREEDY, RNG)  # started at 30.0, ended at 30.125
    assert d.seconds == 0.875 and draft.token_seconds == 0.125


def test_ngram_defaults_bounds_and_state() -> None:
    d = NgramDrafter()
    assert (d.n_min, d.n_max, d.seconds) == (2, 8, 0.0)
    # Default n_min 2: a repeated 2-gram is enough.
    draft = d.propose([1, 2, 9, 1, 2], 3, GREEDY, RNG)
    assert draft.tokens == [9, 1, 2] and draft.match == 2
    d.reset()  # the index is emptied: no match
    assert d.propose([1, 2], 3, GREEDY, RNG).match == 0
    # Default n_max 8: the suffix 1..9 occurred whole once (then 50), and its last 8
    # tokens later too (then 60): an 8-gram is the longest looked up.
    h = [*range(1, 10), 50, 0, *range(2, 10), 60, *range(1, 10)]
    assert NgramDrafter().propose(h, 3, GREEDY, RNG).tokens == [60, 1, 2]
    assert NgramDrafter(2, 9).propose(h, 3, GREEDY, RNG).tokens == [50, 0, 2]  # control
    # k = 0: no draft and no match reported, though one exists.
    d = NgramDrafter()
    draft = d.propose([1, 2, 9, 1, 2], 0, GREEDY, RNG)
    assert draft.tokens == [] and draft.match == 0
    with pytest.raises(ValueError, match=r"need 1 <= n_min <= n_max, got 3, 2"):
        NgramDrafter(3, 2)


def test_ngram_drafts_carry_the_share_of_their_continuation() -> None:
    # The share of the matched n-gram's occurrences, latest first, followed by the draft's
    # first token in an unbroken run: 5, 6 was followed by 9, 8, 8 -> 8 with 2 of 3.
    d = NgramDrafter(2, 8)
    draft = d.propose([5, 6, 9, 1, 5, 6, 8, 2, 5, 6, 8, 3, 5, 6], 3, GREEDY, RNG)
    assert draft.tokens == [8, 3, 5] and draft.probs == [pytest.approx(2 / 3)] * 3
    # 9 then 8 -> 8 with 1 of 2; 9 then 9 -> all; an n-gram seen once -> 1
    assert NgramDrafter().propose([5, 6, 9, 1, 5, 6, 8, 2, 5, 6], 2, GREEDY, RNG).probs == [
        0.5, 0.5]  # fmt: skip
    assert NgramDrafter().propose([5, 6, 9, 1, 5, 6, 9, 2, 5, 6], 2, GREEDY, RNG).probs == [
        1.0, 1.0]  # fmt: skip
    assert NgramDrafter().propose([1, 2, 9, 1, 2], 3, GREEDY, RNG).probs == [1.0] * 3
    # 9, 8, 9: the run is the latest one only (an older agreeing occurrence is not in it)
    h = [5, 6, 9, 1, 5, 6, 8, 2, 5, 6, 9, 3, 5, 6]
    assert NgramDrafter().propose(h, 1, GREEDY, RNG).probs == [pytest.approx(1 / 3)]
    # 8, 8, 9, 9: a run of 2 of 4 (not the 3 of 4 neighbours that agree)
    h = [5, 6, 8, 1, 5, 6, 8, 2, 5, 6, 9, 3, 5, 6, 9, 4, 5, 6]
    assert NgramDrafter().propose(h, 1, GREEDY, RNG).probs == [0.5]
    # the counts are of the longest n-gram matched: 1, 5, 6 occurred once (then 9)
    h = [1, 5, 6, 9, 4, 5, 6, 8, 2, 5, 6, 7, 1, 5, 6]
    draft = NgramDrafter().propose(h, 1, GREEDY, RNG)
    assert draft.tokens == [9] and draft.match == 3 and draft.probs == [1.0]
    # indexed a token at a time, as a generation grows, the counts are the same: 5, 6 was
    # followed by 9, 8, 7 (its last occurrence is the suffix, with nothing after it yet)
    d = NgramDrafter()
    for end in range(2, len(h) + 1):
        last = d.propose(h[:end], 1, GREEDY, RNG)
    assert last.probs == [1.0] and d.index_tables()[1][2][(5, 6)] == (3, 1)


def test_seconds_per_token_leave_out_a_catch_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # perf_counter at the start, after the first evaluation and at the end of each draft.
    times = iter([0.0, 0.5, 0.625, 1.0, 1.0, 1.375])
    monkeypatch.setattr(drafters_module.time, "perf_counter", lambda: next(times))
    d, _ = drafter()
    # Two tokens after a 3-token catch-up: the second token's evaluation, 0.125 s.
    draft = d.propose([1, 2, 3], 2, GREEDY, RNG)
    assert draft.tokens == [4, 5] and draft.token_seconds == 0.125
    # One token after a catch-up of 3 (history 6 7 8 new): not a per-token time; kept.
    d2, _ = drafter()
    draft = d2.propose([6, 7, 8], 1, GREEDY, RNG)
    assert draft.tokens == [9] and draft.token_seconds == 0.0 and d2.seconds == 0.375


def test_a_resumed_copy_is_looked_for_nearest_its_expected_source_first() -> None:
    from specgguf.speculative.drafters.ngram import RESUME_WINDOW

    assert RESUME_WINDOW == 8  # the geometry below
    d = NgramDrafter(2, 8)
    # 3, 4 ends at 10 and at 16; expected 15: the window is 7..23, 16 is nearer
    h = list(range(100, 140))
    h[8:10] = h[14:16] = [3, 4]
    h += [3, 4]
    assert d._resume(h, 15) == (16, 2)
    assert d._resume(h, 11) == (10, 2)
    assert d._resume(h, 13) == (10, 2)  # a tie: the earlier one
    h[14:16] = [0, 0]
    assert d._resume(h, 19) is None  # 10 is outside the window 11..27
    # an occurrence ending at the text's last token but one; the suffix itself is not one
    run = [*range(100, 110), 7, 7, 7]
    assert d._resume(run, len(run)) == (len(run) - 1, 2)
    assert d._resume([7, 7, 7], 3) == (2, 2)
    # an occurrence at the very start of the text
    assert d._resume([3, 4, *range(100, 105), 3, 4], 2) == (2, 2)
    # the longest n-gram in the window wins over a nearer shorter one, every n tried
    h = [*range(100, 120), 5, 6, 7, *range(200, 203), 6, 7, *range(300, 310), 5, 6, 7]
    assert d._resume(h, 28) == (23, 3)
    # below n_min nothing is looked for: the token 7 alone occurs in the window
    assert d._resume([*range(100, 110), 7, 1, 2, 3, 9, 7], 12) is None


def test_a_copy_starts_at_a_match_of_exactly_resume_match_tokens() -> None:
    from specgguf.speculative.drafters.ngram import RESUME_MATCH, RESUME_SPAN

    assert (RESUME_MATCH, RESUME_SPAN) == (16, 32)
    head, tail = list(range(100, 116)), list(range(200, 230))
    source = [*head, 7, 3, 4, *tail, 60, 3, 4, 50, 51, 52, 53]
    d = NgramDrafter(2, 8)
    first = d.propose([*source, 1, *head], 8, GREEDY, RNG)
    assert first.match == 16 and not first.resumed
    # the same text again: a match of 16 is not a broken copy, nothing to resume
    again = d.propose([*source, 1, *head], 8, GREEDY, RNG)
    assert again.match == 16 and not again.resumed
    draft = d.propose([*source, 1, *head, 8, 9, 3, 4], 8, GREEDY, RNG)
    assert draft.tokens == tail[:8] and draft.resumed and draft.match == 2
    # (3, 4 was followed by 50 before, then by tail: a resumed copy is not counted)
    assert draft.probs == [1.0] * 8
    # past the span the copy is dropped, and later short matches are plain ones
    # (60, 3 occurs once, in the source)
    text = [*source, 1, *head, 8, 9, 3, 4, *range(300, 340), 60, 3]
    assert d.propose(text, 4, GREEDY, RNG).tokens == [4, 50, 51, 52]
    later = d.propose([*text, 4, 50], 2, GREEDY, RNG)
    assert later.tokens == [51, 52] and later.match == 4 and not later.resumed


def test_a_match_stops_at_the_start_of_the_text() -> None:
    from specgguf.speculative.drafters.ngram import match_length

    # 1, 2 ends at 2 and at 5; before 2 there is nothing to compare (the text's last
    # token, 2, is not the token before the start)
    assert match_length([1, 2, 2, 1, 2], 2, 5, 2) == 2
    assert match_length([1, 2, 2, 1, 2], 5, 5, 2) == 5  # the text against itself


# References written plainly, one n-gram at a time: the drafter's index and its search for
# a broken copy build each n-gram once per token (or compare token by token) and must
# agree with them exactly.


def _reference_ngram_index(
    history: Sequence[int], n_min: int, n_max: int
) -> tuple[
    dict[int, dict[tuple[int, ...], int]], dict[int, dict[tuple[int, ...], tuple[int, int]]]
]:
    index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
    repeats: dict[int, dict[tuple[int, ...], tuple[int, int]]] = {n: {} for n in index}
    for j in range(1, len(history)):
        for n in range(n_min, n_max + 1):
            if j >= n:
                gram = tuple(history[j - n : j])
                before = index[n].get(gram)
                index[n][gram] = j
                if before is not None:
                    seen, run = repeats[n].get(gram, (1, 1))
                    same = history[before] == history[j]
                    repeats[n][gram] = (seen + 1, run + 1 if same else 1)
    return index, repeats


def _reference_resume(
    history: Sequence[int], expected: int, n_min: int, n_max: int
) -> tuple[int, int] | None:
    from specgguf.speculative.drafters.ngram import RESUME_WINDOW, match_length

    size = len(history)
    lo, hi = max(0, expected - RESUME_WINDOW), min(size - 1, expected + RESUME_WINDOW)
    nearest = sorted(range(lo, hi + 1), key=lambda p: abs(p - expected))
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        gram = tuple(history[size - n :])
        for j in nearest:
            if j >= n and tuple(history[j - n : j]) == gram:
                return j, match_length(history, j, size, n)
    return None


def test_the_ngram_index_and_copy_search_agree_with_plain_references() -> None:
    rng = np.random.default_rng(11)
    found = 0
    for _ in range(600):
        n_min = int(rng.integers(1, 4))
        n_max = int(rng.integers(n_min, 10))
        text = [int(t) for t in rng.integers(0, int(rng.choice([2, 3, 6])), rng.integers(1, 70))]
        d = NgramDrafter(n_min, n_max)
        end = 1
        while end <= len(text):  # taken in a few tokens at a time, as a generation goes
            d._update(text[:end])
            end += int(rng.integers(1, 8))
        d._update(text)
        index, repeats = _reference_ngram_index(text, n_min, n_max)
        assert d.index_tables() == (index, repeats)
        expected = int(rng.integers(-12, len(text) + 12))  # windows past either end too
        got = d._resume(text, expected)
        assert got == _reference_resume(text, expected, n_min, n_max)
        found += got is not None
    assert found > 100  # (the search found something often enough to be tested)
