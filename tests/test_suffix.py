"""The suffix drafter: longest suffix, majority of earlier occurrences, memory across
generations, a bounded corpus, and exactness in the loop."""

from __future__ import annotations

import tracemalloc
from collections.abc import Sequence

import numpy as np
import pytest

from specgguf.speculative.draft import Draft
from specgguf.speculative.drafters import SuffixDrafter, compiled, match_length
from specgguf.speculative.loop import GenerationParams, SpeculativeDecoder
from specgguf.speculative.planner import FixedPlanner
from specgguf.speculative.sampling import SamplerParams

from .fakes import FakeContext, FakeVocab, one_hot_rule

# Every test twice: with the compiled lookup indexes and with their pure-Python reference.
pytestmark = pytest.mark.usefixtures("lookup_impl")

GREEDY = SamplerParams(temperature=0.0)
RNG = np.random.default_rng(0)


#: each drafter's latest draft, by id
LAST: dict[int, Draft] = {}


def draft(d: SuffixDrafter, history: Sequence[int], k: int = 4) -> list[int]:
    LAST[id(d)] = out = d.propose(history, k, GREEDY, RNG)
    return out.tokens


def match(d: SuffixDrafter) -> int:
    """The match length of ``d``'s latest draft."""
    return LAST[id(d)].match


def confidence(d: SuffixDrafter) -> float:
    """The estimated acceptance of ``d``'s latest draft as a whole (the product of the
    shares: its last token's probability; 0 for an empty draft)."""
    probs = LAST[id(d)].probs
    return probs[-1] if probs else 0.0


def test_the_continuation_most_occurrences_share() -> None:
    # "1 2" was followed by 3 4 three times and by 9 9 once (most recently): the majority
    # wins, where prompt lookup takes the most recent occurrence.
    text = [1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 9, 9, 0, 1, 2]
    d = SuffixDrafter(min_share=0.5)
    assert draft(d, text) == [3, 4, 0, 1]
    # matched on "1 2"; the latest occurrence agrees with the text for 3 tokens ("0 1 2")
    assert match(d) == 3 and abs(confidence(d) - 3 / 4) < 1e-9
    from specgguf.speculative.drafters import NgramDrafter

    assert NgramDrafter(1, 8).propose(text, 2, GREEDY, RNG).tokens == [9, 9]


def test_the_longest_suffix_wins() -> None:
    # "7 1 2" occurred once, followed by 5; "1 2" more often, followed by 3.
    text = [1, 2, 3, 0, 1, 2, 3, 0, 7, 1, 2, 5, 0, 7, 1, 2]
    d = SuffixDrafter()
    assert draft(d, text, k=1) == [5] and match(d) == 4  # "0 7 1 2"


def test_drafts_stop_where_occurrences_disagree() -> None:
    text = [1, 2, 3, 4, 0, 1, 2, 3, 5, 0, 1, 2, 3, 6, 0, 1, 2]
    d = SuffixDrafter(min_share=0.5)
    assert draft(d, text, k=8) == [3]  # then 5 and 6: a tie, no majority


def test_earlier_generations_are_remembered_but_not_crossed() -> None:
    d = SuffixDrafter()
    first = [10, 11, 12, 13, 14, 15, 16]
    draft(d, first)
    d.reset()  # a new generation, e.g. the next request to a server
    assert draft(d, [20, 12, 13]) == [14, 15, 16]  # drafted from the earlier generation
    # The separator: the end of the first generation is not followed by the second's start.
    d2 = SuffixDrafter()
    draft(d2, [5, 6, 7])
    d2.reset()
    assert draft(d2, [8, 9, 6, 7]) == [8, 9, 6, 7][:0] or draft(d2, [8, 9, 6, 7]) != [8]


def test_a_finished_generation_is_remembered_whole() -> None:
    # The corpus took in a generation only up to the history of its latest draft: the
    # tokens after it, or a whole generation where the suffix drafter never drafted
    # (auto mode chose another), were forgotten. finish() takes in all of it.
    text = list(range(100, 130))
    d = SuffixDrafter()
    draft(d, text[:10])
    d.finish(text)
    assert draft(d, [7, *text[18:21]]) == text[21:25]
    never = SuffixDrafter()
    never.finish(text)  # never drafted in that generation
    assert draft(never, [7, *text[3:6]]) == text[6:10]


def test_a_group_shares_finished_generations_from_each_ones_next_generation_on() -> None:
    # serve --parallel: a drafter per sequence, one corpus. What one sequence finished is
    # drafted from by another's next generation, not in the middle of its current one.
    a, b = SuffixDrafter.group(2)
    answer = list(range(200, 220))
    assert draft(b, [1, 2, 3]) == []  # b is mid-generation
    a.finish([5, 6, *answer])
    assert draft(b, [1, 2, 3, *answer[:3]]) == []  # not yet: b's generation goes on
    b.finish([1, 2, 3, *answer[:3]])
    assert draft(b, [9, *answer[4:7]]) == answer[7:11]  # b's next generation
    # and back: b's generations reach a when its next one starts (the loop resets)
    assert draft(a, [8, 1, 2]) == []
    a.reset()
    assert draft(a, [8, 1, 2]) == [3, 200, 201, 202]
    # A drafter of no group keeps its own.
    solo, alone = SuffixDrafter(), list(range(300, 310))
    solo.finish(alone)
    a.reset()
    assert draft(a, [0, 300, 301]) == [] and draft(solo, [0, 300, 301]) == [302, 303, 304, 305]


def test_a_groups_waiting_generations_are_bounded_by_the_capacity() -> None:
    a, b = SuffixDrafter.group(2, capacity=256)
    for i in range(50):  # b never starts another generation meanwhile
        a.finish([i, *range(1000 + 20 * i, 1020 + 20 * i)])
    assert sum(len(t) for t in b._inbox) < 256 + 21
    b.reset()
    assert len(b._corpus) <= 256 + 21  # the newest kept, the corpus trimmed to capacity
    assert draft(b, [7, 1980, 1981]) == [1982, 1983, 1984, 1985]  # the latest one


def test_memory_is_bounded() -> None:
    d = SuffixDrafter(capacity=4096)
    rng = np.random.default_rng(1)
    tracemalloc.start()
    for _ in range(40):
        d.reset()
        text = rng.integers(0, 5000, 400).tolist()
        for end in range(50, 401, 50):
            draft(d, text[:end])
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(d._corpus) <= 4096 + 400
    assert sum(len(v) for v in d.index_table().values()) <= len(d.LENGTHS) * (4096 + 400)
    assert peak + d.index_bytes() < 8 << 20  # 16,000 tokens seen, at most 4,096 kept: a few MB


def test_default_capacity_memory_stated_in_the_docstring() -> None:
    # The docstring states at most about 22 MB at the default 32,768 tokens (all n-grams
    # distinct, the worst case; text with repeats needs less).
    d = SuffixDrafter()
    rng = np.random.default_rng(2)
    tracemalloc.start()
    d._sync(rng.integers(0, 50_000, 32_000).tolist())
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert current + d.index_bytes() < 24 << 20, current


def test_output_equals_the_target_alone_with_suffix_drafts() -> None:
    def target_next(prefix: Sequence[int]) -> int:
        return prefix[-1] % 10 + 1 if len(prefix) % 7 else 3

    V = 16
    base = None
    for k in (0, 1, 3, 8):
        dec = SpeculativeDecoder(FakeContext(one_hot_rule(target_next, V), V), FakeVocab(V))  # type: ignore[arg-type]
        planner = FixedPlanner(SuffixDrafter() if k else None, k)
        res = dec.generate([1, 2, 3], GenerationParams(n_predict=60, sampler=GREEDY), planner).run()
        base = base or res.tokens
        assert res.tokens == base, k
        if k == 8:
            assert res.stats.accepted > 20


def test_defaults_and_the_state_before_any_match() -> None:
    d = SuffixDrafter()
    assert (d.capacity, d.max_occurrences, d.min_share) == (32768, 16, 0.5)
    assert d.seconds == 0.0
    # Nothing matched: no draft, no match, no confidence.
    assert draft(d, [1, 2, 3]) == [] and (match(d), confidence(d)) == (0, 0.0)


def test_a_growing_history_drafts_as_the_whole_of_it() -> None:
    # Fed one token more at each call, as in a generation, the drafter answers what a
    # fresh one answers for the whole history (same drafts, matches and confidences).
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8]
    seq = seq + seq[:12] + [1, 4, 1]
    grown = SuffixDrafter()
    for end in range(1, len(seq) + 1):
        fresh = SuffixDrafter()
        want = (draft(fresh, seq[:end]), match(fresh), confidence(fresh))
        got = (draft(grown, seq[:end]), match(grown), confidence(grown))
        assert got == want, end
    # The same history twice: the same answer (it is not a new generation).
    again = (draft(grown, seq), match(grown), confidence(grown))
    assert again == want


def test_the_latest_token_pair_and_a_one_token_history_are_matched() -> None:
    # "2" occurred right before the last token: its continuation (the last token) counts.
    assert draft(SuffixDrafter(), [1, 2, 2]) == [2]
    # "1" at the very start: followed by 2, then by the last 1.
    assert draft(SuffixDrafter(), [1, 2, 1]) == [2, 1]
    # A one-token history is matched against earlier generations.
    d = SuffixDrafter()
    draft(d, [3, 4])
    d.reset()
    assert draft(d, [3]) == [4] and match(d) == 1


def test_a_history_that_is_not_an_extension_starts_a_new_generation() -> None:
    d = SuffixDrafter()
    draft(d, [1, 2, 3, 4])
    # Longer but different: a new generation behind a separator (no reset() called).
    assert draft(d, [9, 9, 9, 9, 9]) == [9] and match(d) == 4
    # Control: the four 9s would not match had they been appended to 1 2 3 4.
    assert draft(SuffixDrafter(), [1, 2, 3, 4, 9]) == []


def test_only_the_latest_occurrences_are_kept() -> None:
    # "1" was followed by 9, 6 and 2; with two occurrences kept, 6 and 2 remain: a tie,
    # won by the larger id, at a share of one half.
    d = SuffixDrafter(max_occurrences=2)
    assert draft(d, [1, 9, 1, 6, 1, 2, 1], k=1) == [6] and confidence(d) == 0.5
    # With all three: 9, 6 and 2 once each: 9, at a third.
    d = SuffixDrafter(max_occurrences=3)
    assert draft(d, [1, 9, 1, 6, 1, 2, 1], k=1) == [9] and abs(confidence(d) - 1 / 3) < 1e-9


def test_a_share_of_exactly_min_share_ends_the_draft() -> None:
    # "1" was followed by 2 twice, then by 5 and by 6: the second token has a share of 1/2.
    d = SuffixDrafter(min_share=0.5)
    assert draft(d, [1, 2, 5, 1, 2, 6, 1], k=4) == [2] and confidence(d) == 1.0
    assert draft(SuffixDrafter(min_share=0.4), [1, 2, 5, 1, 2, 6, 1], k=2) == [2, 6]


def test_the_corpus_keeps_the_most_recent_half_of_its_capacity() -> None:
    # Capacity 12: 9 tokens, a separator and 3 more are 13: the oldest 7 are dropped, so
    # that 6 remain: "8 9 | 20 21 8". "8" is still followed by 9; "7" was forgotten.
    for last, want in ((8, [9]), (7, [])):
        d = SuffixDrafter(capacity=12)
        draft(d, list(range(1, 10)))
        d.reset()
        assert draft(d, [20, 21, last]) == want, last
    # Exactly at capacity (4 + separator + 3 = 8 of 8): nothing is forgotten.
    d = SuffixDrafter(capacity=8)
    draft(d, [1, 2, 3, 4])
    d.reset()
    assert draft(d, [5, 1, 2]) == [3, 4]


def test_seconds_add_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from specgguf.speculative.drafters import suffix as drafters_module

    times = iter([1.0, 1.25, 2.0, 2.5])
    monkeypatch.setattr(drafters_module.time, "perf_counter", lambda: next(times))
    d = SuffixDrafter()
    draft(d, [1, 2, 1])
    draft(d, [1, 2, 1, 2])
    assert d.seconds == 0.75


def tree(d: SuffixDrafter, history: Sequence[int], max_nodes: int, max_leaves: int,
         min_prob: float = 0.05) -> tuple[list[int], list[int], list[float]]:  # fmt: skip
    out = d.propose_tree(history, max_nodes, max_leaves, min_prob=min_prob)
    assert out.parents is not None and out.probs is not None
    return out.tokens, out.parents, out.probs


def test_a_tree_s_tied_branches_come_largest_token_first() -> None:
    # 1 was followed once each by 9, 8 and 7: three branches of 1/3, ties broken as the
    # chain drafter breaks them (the larger token), then in the order they were found
    third = pytest.approx(1 / 3)
    h = [1, 9, 2, 1, 8, 3, 1, 7, 4, 1]
    assert tree(SuffixDrafter(), h, 3, 3) == ([9, 8, 7], [-1, -1, -1], [third] * 3)
    assert tree(SuffixDrafter(), h, 5, 3) == ([9, 8, 7, 2, 3], [-1, -1, -1, 0, 1], [third] * 5)


def test_a_tree_s_leaves_and_nodes_are_bounded() -> None:
    h = [1, 9, 2, 1, 8, 3, 1]  # 1 was followed by 9, 2, 1, 8, 3 and by 8, 3, 1
    # one leaf: the other branch is passed over, and the first one goes on to the text's end
    assert tree(SuffixDrafter(), h, 4, 1) == ([9, 2, 1, 8], [-1, 0, 1, 2], [0.5] * 4)
    assert tree(SuffixDrafter(), h, 4, 2) == ([9, 8, 2, 3], [-1, -1, 0, 1], [0.5] * 4)
    assert tree(SuffixDrafter(), h, 1, 1) == ([9], [-1], [0.5])
    assert tree(SuffixDrafter(), h, 4, 0) == ([], [], [])
    assert tree(SuffixDrafter(), h, 0, 2) == ([], [], [])
    # a probability of exactly min_prob is kept, one below it is not
    assert tree(SuffixDrafter(), h, 2, 2, min_prob=0.5) == ([9, 8], [-1, -1], [0.5, 0.5])
    assert tree(SuffixDrafter(), h, 2, 2, min_prob=0.51) == ([], [], [])


def test_a_tree_follows_an_occurrence_up_to_the_end_of_the_text() -> None:
    # 5 was followed by 6, 5 and then the text ends: the branch ends there
    d = SuffixDrafter()
    assert tree(d, [5, 6, 5], 8, 1) == ([6, 5], [-1, 0], [1.0, 1.0])
    assert d.propose_tree([5, 6, 5], 8, 1).match == 1


def test_tree_seconds_add_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from specgguf.speculative.drafters import suffix as drafters_module

    times = iter([1.0, 1.25])
    monkeypatch.setattr(drafters_module.time, "perf_counter", lambda: next(times))
    d = SuffixDrafter()
    d.seconds = 1.0
    d.propose_tree([1, 2, 1], 4, 2)
    assert d.seconds == 1.25


@pytest.mark.parametrize("seed", range(12))
def test_a_tree_stopped_early_is_a_prefix_of_the_whole_tree(seed: int) -> None:
    # wanted(match) nodes and a first branch of `branch` nodes: a prefix of the tree that
    # is not stopped, as long as both (what SuffixArm reads of it: the nodes best_tree
    # weighs and the shadow's first branch)
    from specgguf.speculative.tree import first_branch

    rng = np.random.default_rng(seed)
    text = [int(t) for t in rng.integers(0, 6, 300)]  # 6 tokens: many occurrences
    for end in range(40, 300, 23):
        whole = SuffixDrafter().propose_tree(text[:end], 16, 4)
        asked: list[int] = []

        def wanted(match: int, asked: list[int] = asked) -> int:
            asked.append(match)
            return int(rng.integers(1, 17))

        d = SuffixDrafter()
        cut = d.propose_tree(text[:end], 16, 4, wanted=wanted, branch=3)
        assert asked == [whole.match]
        n = len(cut.tokens)
        assert cut.tokens == whole.tokens[:n] and cut.parents == whole.parents[:n]
        assert cut.probs == whole.probs[:n] and cut.match == whole.match
        if asked:
            full_branch = first_branch(whole.parents or [])
            assert n >= min(len(whole.tokens), asked[0])
            assert first_branch(cut.parents or [])[:3] == full_branch[:3]


def test_the_suffix_index_agrees_with_a_plain_reference() -> None:
    """The index builds each position's longest n-gram once and hashes its tails; a plain
    reference, one n-gram at a time, skipping those across a separator, must agree."""
    rng = np.random.default_rng(5)
    sep = SuffixDrafter.SEPARATOR
    for _ in range(150):
        d = SuffixDrafter(max_occurrences=int(rng.integers(1, 5)))
        for _gen in range(int(rng.integers(1, 4))):
            d.reset()
            text = [int(t) for t in rng.integers(0, 4, rng.integers(1, 60))]
            end = 1
            while end <= len(text):
                d._sync(text[:end])
                end += int(rng.integers(1, 8))
            d._sync(text)
        c = d._corpus
        index: dict[int, list[int]] = {}
        for j in range(1, len(c)):
            for n in SuffixDrafter.LENGTHS:
                if j >= n and sep not in c[j - n : j]:
                    occ = index.setdefault(hash(tuple(c[j - n : j])), [])
                    occ.append(j)
                    del occ[: -d.max_occurrences]
        assert d.index_table() == index


@pytest.mark.parametrize("seed", range(4))
def test_the_compiled_drafts_equal_the_pure_python_ones(
    seed: int, lookup_impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """_lookup.c's chains, trees and match lengths against suffix.py's and ngram.py's
    pure-Python references, on random texts over few tokens (many occurrences, ties,
    separators between generations), each drafter asked the same thing in turn."""
    if lookup_impl == "python":
        pytest.skip("compares both implementations: once is enough")
    module = compiled.lookup
    assert module is not None
    rng = np.random.default_rng(seed)
    for _trial in range(12):
        settings = {
            "max_occurrences": int(rng.integers(1, 20)),
            "min_share": float(rng.choice([0.0, 0.3, 0.5, 0.7])),
        }
        monkeypatch.setattr(compiled, "lookup", None)
        pure = SuffixDrafter(**settings)
        monkeypatch.setattr(compiled, "lookup", module)
        fast = SuffixDrafter(**settings)
        for _gen in range(int(rng.integers(1, 4))):
            text = [int(t) for t in rng.integers(0, int(rng.integers(2, 9)), rng.integers(1, 160))]
            end = 1
            while end <= len(text):
                h, k = text[:end], int(rng.integers(0, 20))
                p_min = float(rng.choice([0.0, 0.4, 0.6]))
                a, b = (d.propose(h, k, GREEDY, RNG, p_min=p_min) for d in (pure, fast))
                assert (a.tokens, a.probs, a.match) == (b.tokens, b.probs, b.match)
                nodes, leaves = int(rng.integers(0, 20)), int(rng.integers(0, 5))
                min_prob = float(rng.choice([0.0, 0.05, 0.2, 0.5]))
                shift = int(rng.integers(0, 17))
                wanted = None if rng.random() < 0.5 else (lambda m, s=shift: (7 * m + s) % 17)
                branch = int(rng.integers(0, 5))
                a, b = (
                    d.propose_tree(
                        h, nodes, leaves, min_prob=min_prob, wanted=wanted, branch=branch
                    )
                    for d in (pure, fast)
                )
                assert (a.tokens, a.parents, a.probs, a.match) == (
                    b.tokens, b.parents, b.probs, b.match)  # fmt: skip
                end += int(rng.integers(1, 6))
            for d in (pure, fast):
                d.finish(text)
        for _ in range(50):
            text = [int(t) for t in rng.integers(0, 3, rng.integers(1, 80))]
            end = int(rng.integers(0, len(text) + 1))
            after = int(rng.integers(0, end + 1))
            n, stop = int(rng.integers(0, 4)), rng.choice([None, 0, 1])
            stop = None if stop is None else int(stop)
            assert module.match_length(text, after, end, n, stop) == match_length(
                text, after, end, n, stop
            )


def test_a_compiled_module_older_than_the_code_is_not_used() -> None:
    # (an editable install whose _lookup was built before suffix_tree existed)
    import types

    module = compiled.load()
    assert module is None or compiled.usable(module)
    old = types.SimpleNamespace(NgramTable=object, SuffixTable=object, MAX_LENGTH=64)
    assert not compiled.usable(old)  # type: ignore[arg-type]


def test_the_compiled_drafting_takes_any_length_and_an_occurrence_list_that_changes(
    lookup_impl: str,
) -> None:
    if lookup_impl == "python":
        pytest.skip("the compiled functions only")
    module = compiled.lookup
    assert module is not None
    text = list(range(1000)) * 3
    # k and max_nodes far past what any buffer could be sized by: the draft is what
    # follows the occurrences (from position 0: the rest of the text)
    assert module.suffix_chain(text, len(text), [0, 1000], 2**61, 0.0, -1)[0] == text
    assert module.suffix_tree(text, len(text), [0, 1000], 2**61, 4, 0.0, 2**61, 0, -1)[0] == text
    occ: list[object] = []

    class Clears:  # an item whose conversion empties the list being read
        def __index__(self) -> int:
            occ.clear()
            return 0

    occ += [Clears(), 1, 2]
    with pytest.raises(IndexError, match="changed while they were read"):
        module.suffix_chain([1, 2, 3, 4], 4, occ, 3, 0.0, -1)
