"""The compiled lookup indexes (specgguf/speculative/drafters/_lookup.c) against their
pure-Python references: the same drafts from the n-gram and suffix drafters on random
texts, across generations, groups and a corpus trimmed to its capacity; and bad arguments
refused with Python's errors, never a crash."""

from __future__ import annotations

import array
import os
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from specgguf.speculative.draft import Draft
from specgguf.speculative.drafters import NgramDrafter, SuffixDrafter, compiled
from specgguf.speculative.sampling import SamplerParams

GREEDY = SamplerParams(temperature=0.0)
RNG = np.random.default_rng(0)


@pytest.fixture
def lookup() -> object:
    if compiled.lookup is None:
        if os.environ.get("SPECGGUF_REQUIRE_COMPILED"):
            pytest.fail("the compiled lookup indexes were not built (setup.py's _lookup.c)")
        pytest.skip("the compiled lookup indexes were not built (no C compiler at install)")
    return compiled.lookup


def _made(monkeypatch: pytest.MonkeyPatch, make: Callable[[], object], pure: bool) -> object:
    with monkeypatch.context() as m:
        if pure:
            m.setattr(compiled, "lookup", None)
        return make()


def _texts(rng: np.random.Generator, n: int) -> Iterator[list[int]]:
    """Texts with repeats: pieces of a few earlier texts between random tokens."""
    seen: list[list[int]] = []
    for _ in range(n):
        vocab = int(rng.choice([3, 8, 50]))
        text = [int(t) for t in rng.integers(0, vocab, rng.integers(1, 12))]
        while len(text) < int(rng.integers(5, 120)):
            if seen and rng.random() < 0.5:
                src = seen[int(rng.integers(len(seen)))]
                a = int(rng.integers(len(src)))
                text += src[a : a + int(rng.integers(1, 30))]
            else:
                text += [int(t) for t in rng.integers(0, vocab, rng.integers(1, 6))]
        seen.append(text)
        yield text


def _same(a: Draft, b: Draft) -> bool:
    return (a.tokens, a.probs, a.match, a.parents, a.resumed) == (
        b.tokens, b.probs, b.match, b.parents, b.resumed
    )  # fmt: skip


def test_the_ngram_drafter_drafts_the_same_with_either_index(
    lookup: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(3)
    compared = drafted = 0
    for _ in range(40):
        n_min = int(rng.integers(1, 4))
        n_max = int(rng.integers(n_min, 10))
        fast = _made(monkeypatch, lambda a=n_min, b=n_max: NgramDrafter(a, b), False)
        pure = _made(monkeypatch, lambda a=n_min, b=n_max: NgramDrafter(a, b), True)
        assert isinstance(fast, NgramDrafter) and isinstance(pure, NgramDrafter)
        assert fast._table is not None and pure._table is None
        conversation: list[int] = []
        for text in _texts(rng, 5):
            # a conversation's next turn extends the text, or another text starts over
            history = conversation + text if rng.random() < 0.5 else text
            conversation = history
            for d in (fast, pure):
                d.reset()
            end = 1
            while end <= len(history):
                k = int(rng.integers(0, 9))
                a = fast.propose(history[:end], k, GREEDY, RNG)
                b = pure.propose(history[:end], k, GREEDY, RNG)
                assert _same(a, b), (history[:end], k)
                # each keeps its index through every new text (chosen when made)
                assert fast._table is not None and pure._table is None
                compared += 1
                drafted += bool(a.tokens)
                end += int(rng.integers(1, 6))
        assert fast.index_tables() == pure.index_tables()
    assert drafted > compared // 4  # (enough drafts to compare)


def test_the_suffix_drafter_drafts_the_same_with_either_index(
    lookup: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(4)
    compared = drafted = 0
    for _ in range(25):
        # a small capacity: the corpus is trimmed and the index rebuilt now and then
        settings = {"capacity": int(rng.choice([64, 300, 32768])),
                    "max_occurrences": int(rng.integers(1, 20))}  # fmt: skip
        fast_group = _made(monkeypatch, lambda s=settings: SuffixDrafter.group(2, **s), False)
        pure_group = _made(monkeypatch, lambda s=settings: SuffixDrafter.group(2, **s), True)
        assert isinstance(fast_group, list) and isinstance(pure_group, list)
        for text in _texts(rng, 8):
            i = int(rng.integers(2))  # which of the group's two drafters generates
            fast, pure = fast_group[i], pure_group[i]
            for d in (fast, pure):
                d.reset()
            end = 1
            while end <= len(text):
                h = text[:end]
                if rng.random() < 0.5:
                    k, p_min = int(rng.integers(1, 9)), float(rng.random() * 0.6)
                    a = fast.propose(h, k, GREEDY, RNG, p_min=p_min)
                    b = pure.propose(h, k, GREEDY, RNG, p_min=p_min)
                else:
                    nodes, leaves = int(rng.integers(1, 17)), int(rng.integers(1, 5))
                    a = fast.propose_tree(h, nodes, leaves)
                    b = pure.propose_tree(h, nodes, leaves)
                assert _same(a, b), h
                compared += 1
                drafted += bool(a.tokens)
                end += int(rng.integers(1, 6))
            fast.finish(text)
            pure.finish(text)
            assert all(d._table is not None for d in fast_group)
            assert all(d._table is None for d in pure_group)
            assert fast._corpus == pure._corpus
            assert fast.index_table() == pure.index_table()
    assert drafted > compared // 4


def test_the_ngram_table_refuses_bad_arguments(lookup: object) -> None:
    table = compiled.lookup.NgramTable  # type: ignore[union-attr]
    for n_min, n_max in ((0, 3), (3, 2), (1, 65)):
        with pytest.raises(ValueError, match="n_min"):
            table(n_min, n_max)
    t = table(2, 4)
    with pytest.raises(IndexError):
        t.extend([1, 2, 3], 5)  # past the history's end
    with pytest.raises(TypeError):
        t.extend([1, "x", 3], 3)
    with pytest.raises(OverflowError):
        t.extend([1, 2**70, 3], 3)
    assert t.length == 0 and t.entries() == []  # nothing taken in from a refused call
    # any sequence of ints: a list, a tuple, an array
    for history in ([5, 6, 7, 5, 6], (5, 6, 7, 5, 6), array.array("i", [5, 6, 7, 5, 6])):
        t = table(2, 4)
        t.extend(history, 4)
        assert t.find(history, 5, 4) == (2, 2, 1, 1)  # 5, 6 occurred before, then 7
        assert t.find(history, 5, 1) is None  # below n_min
        assert t.find(history, 0, 4) is None and t.find(history, 1, 4) is None


def test_the_suffix_table_refuses_bad_arguments(lookup: object) -> None:
    table = compiled.lookup.SuffixTable  # type: ignore[union-attr]
    for lengths in ((), (2, 1), (0, 1), (1, 65), tuple(range(1, 10))):
        with pytest.raises(ValueError):
            table(lengths, 16, -1)
    with pytest.raises(ValueError):
        table((1, 2), 0, -1)
    t = table((1, 2, 4, 8), 2, -1)
    with pytest.raises(IndexError):
        t.index([1, 2, 3], 1, 9)
    with pytest.raises(IndexError):
        t.match([1, 2, 3], 9, 2)
    corpus = [4, 5, 4, 5, -1, 4, 5, 4]
    t.index(corpus, 1, len(corpus))
    assert t.match(corpus, len(corpus), 3) == (2, [3])  # 5, 4 before position 3
    assert t.match(corpus, len(corpus), 1) == (1, [3, 6])  # 4: the latest two of three
    entries = t.entries()
    assert len(entries) == 5  # 4; 5; 4 5; 5 4; 4 5 4 5: none across the -1
    assert all(-1 not in corpus[p - n : p] for n, occ in entries for p in occ)
    assert t.match(corpus, 0, 8) is None  # an empty text has no suffix


def test_the_tables_refuse_what_could_crash_them(lookup: object) -> None:
    mod = compiled.lookup
    assert mod is not None
    # made without __init__: refused, not a null pointer read
    for t in (mod.NgramTable.__new__(mod.NgramTable), mod.SuffixTable.__new__(mod.SuffixTable)):
        with pytest.raises(RuntimeError, match="not initialised"):
            t.entries()
    # an item whose conversion calls the table again while it reads the text
    table = mod.NgramTable(1, 2)

    class Sneaky:
        def __index__(self) -> int:
            table.extend([7, 7, 7, 7], 4)
            return 5

    with pytest.raises(RuntimeError, match="changed"):
        table.extend([1, Sneaky(), 3], 3)
    # and one that empties the list being read
    history: list[object] = [1, 2, 3]

    class Emptier:
        def __index__(self) -> int:
            history.clear()
            return 5

    history[1] = Emptier()
    with pytest.raises(IndexError, match="changed"):
        mod.NgramTable(1, 2).extend(history, 3)
    # a table refused at re-initialisation keeps its settings
    s = mod.SuffixTable((1, 2), 2, -1)
    with pytest.raises(ValueError):
        s.__init__((3, 5, 70), 16, -1)
    s.index([4, 5, 4, 5], 1, 4)
    assert sorted(n for n, _ in s.entries()) == [1, 1, 2, 2]  # 4; 5; 4 5; 5 4
    # many occurrences kept: memory grows with what is indexed, not with the setting
    assert mod.SuffixTable((1, 2, 4, 8), 100_000, -1).nbytes < 1 << 20


def test_the_drafters_fall_back_where_the_compiled_index_cannot_go(lookup: object) -> None:
    mod = compiled.lookup
    assert mod is not None
    long = NgramDrafter(2, mod.MAX_LENGTH + 1)  # longer n-grams than it takes: pure Python
    assert long._table is None
    h = [1, 2, 3, 1, 2]
    assert (
        long.propose(h, 2, GREEDY, RNG).tokens
        == NgramDrafter(2, 8).propose(h, 2, GREEDY, RNG).tokens
        == [3, 1]
    )
    with pytest.raises(ValueError, match="max_occurrences"):
        SuffixDrafter(max_occurrences=0)
