"""The suffix drafter: longest suffix, majority of earlier occurrences, memory across
generations, a bounded corpus, and exactness in the loop."""

from __future__ import annotations

import tracemalloc
from collections.abc import Sequence

import numpy as np

from specgguf.spec.drafters import SuffixDrafter
from specgguf.spec.loop import GenerationParams, SpeculativeDecoder
from specgguf.spec.planner import FixedPlanner
from specgguf.spec.sampling import SamplerParams

from .fakes import FakeContext, FakeVocab, one_hot_rule

GREEDY = SamplerParams(temperature=0.0)
RNG = np.random.default_rng(0)


def draft(d: SuffixDrafter, history: Sequence[int], k: int = 4) -> list[int]:
    return d.propose(history, k, GREEDY, RNG).tokens


def test_the_continuation_most_occurrences_share() -> None:
    # "1 2" was followed by 3 4 three times and by 9 9 once (most recently): the majority
    # wins, where prompt lookup takes the most recent occurrence.
    text = [1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 9, 9, 0, 1, 2]
    d = SuffixDrafter(min_share=0.5)
    assert draft(d, text) == [3, 4, 0, 1]
    assert d.last_match == 2 and abs(d.last_confidence - 3 / 4) < 1e-9
    from specgguf.spec.drafters import NgramDrafter

    assert NgramDrafter(1, 8).propose(text, 2, GREEDY, RNG).tokens == [9, 9]


def test_the_longest_suffix_wins() -> None:
    # "7 1 2" occurred once, followed by 5; "1 2" more often, followed by 3.
    text = [1, 2, 3, 0, 1, 2, 3, 0, 7, 1, 2, 5, 0, 7, 1, 2]
    d = SuffixDrafter()
    assert draft(d, text, k=1) == [5] and d.last_match == 4  # "0 7 1 2"


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
    assert sum(len(v) for v in d._index.values()) <= len(d.LENGTHS) * (4096 + 400)
    assert peak < 8 << 20  # 16,000 tokens seen, at most 4,096 kept: a few MB


def test_default_capacity_memory_stated_in_the_docstring() -> None:
    # The docstring states at most about 22 MB at the default 32,768 tokens (all n-grams
    # distinct, the worst case; text with repeats needs less).
    d = SuffixDrafter()
    rng = np.random.default_rng(2)
    tracemalloc.start()
    d._sync(rng.integers(0, 50_000, 32_000).tolist())
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert current < 24 << 20, current


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
