"""Independent oracles: the algorithm checked against numbers computed another way, not
against itself.

- sampled speculative decoding on the fake backend, with draft distributions that differ
  from position to position, against the exact joint distribution of the first two
  tokens, p1(x) * p2(y | x), computed here from the rules' logits with plain numpy;
- :func:`~specgguf.speculative.sampling.distribution` against llama.cpp's own sampler chain
  (``llama_sampler_init_top_k/top_p/min_p/temp`` through llama-cpp-python) on random
  logits.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pytest

from specgguf.speculative.drafters import ModelDrafter
from specgguf.speculative.loop import GenerationParams, SpeculativeDecoder
from specgguf.speculative.planner import FixedPlanner
from specgguf.speculative.sampling import SamplerParams, distribution

from .fakes import FakeContext, FakeVocab
from .helpers import llama_cpp_chain
from .test_sampling import chi2_critical

V = 4
#: Target logits after token a: the row rolled by a (most likely next token: a + 1).
TARGET_ROW = np.array([0.0, 3.0, 1.2, 0.4])
#: Draft logits: close to the target's (acceptance about 94% at every position), and a
#: function of the last token, so the draft's q differs from one position to the next.
DRAFT_ROW = np.array([0.3, 3.0, 1.0, 1.1])
TARGET = np.array([np.roll(TARGET_ROW, a) for a in range(V)], np.float32)
DRAFT = np.array([np.roll(DRAFT_ROW, a) for a in range(V)], np.float32)
PLAIN = SamplerParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


def softmax(z: npt.NDArray[np.floating]) -> npt.NDArray[np.float64]:
    e = np.exp(z.astype(np.float64) - z.max())
    return e / e.sum()


def test_sampled_speculation_follows_the_exact_joint_of_two_tokens() -> None:
    """Each generation drafts two tokens (q1, then q2 given the first draft token: another
    distribution), the target verifies both; the first two output tokens (x, y) must
    follow p1(x) * p2(y | x) exactly.

    Power: judging the second position with the first position's q (a planted bug)
    moves 6% of the probability mass here (chi-square non-centrality 0.075 per draw: about
    750 at 10,000 draws against a critical value near 45), and so does any other error
    at position 2, which the first draft token is accepted into 94% of the time.
    """
    n = 10_000
    prompt = [0]
    p1 = softmax(TARGET[0])
    exact = {(x, y): float(p1[x] * softmax(TARGET[x])[y]) for x in range(V) for y in range(V)}
    # The setting is what the docstring says: per-position q differ, acceptance high.
    q1, q2 = softmax(DRAFT[0]), softmax(DRAFT[1])
    assert np.abs(q1 - q2).sum() > 1.0
    assert min(np.minimum(softmax(TARGET[a]), softmax(DRAFT[a])).sum() for a in range(V)) > 0.9

    target = FakeContext(lambda kv: TARGET[kv[-1]], V)
    draft = ModelDrafter(FakeContext(lambda kv: DRAFT[kv[-1]], V), V)  # type: ignore[arg-type]
    decoder = SpeculativeDecoder(target, FakeVocab(V))  # type: ignore[arg-type]
    planner = FixedPlanner(draft, 2)
    counts: Counter[tuple[int, int]] = Counter()
    accepted = drafted = 0
    for seed in range(n):
        sampler = SamplerParams(**{**PLAIN.__dict__, "seed": seed})
        # n_predict 3: the first step drafts two tokens, and the first two output tokens
        # come from the acceptance of both draft positions (or a resample).
        res = decoder.generate(prompt, GenerationParams(n_predict=3, sampler=sampler),
                               planner).run()  # fmt: skip
        counts[res.tokens[0], res.tokens[1]] += 1
        accepted += res.stats.accepted
        drafted += res.stats.drafted
        target.log.clear()
        draft.ctx.log.clear()  # type: ignore[attr-defined]
    assert accepted / drafted > 0.7  # position 2 is reached most of the time
    stat = sum((counts[c] - n * p) ** 2 / (n * p) for c, p in exact.items())
    assert sum(counts.values()) == n
    assert stat < chi2_critical(len(exact) - 1), (stat, counts)


# --- distribution() against llama.cpp's sampler chain ----------------------------------


GRID = [
    SamplerParams(temperature=t, top_k=k, top_p=tp, min_p=mp)
    for t in (0.3, 1.0, 2.5)
    for k in (0, 1, 7, 40)
    for tp in (1.0, 0.9, 0.5)
    for mp in (0.0, 0.05, 0.3)
]


@pytest.mark.parametrize("n_vocab", [10, 300])
def test_distribution_equals_llama_cpp_sampler_chain(n_vocab: int) -> None:
    rng = np.random.default_rng(n_vocab)
    compared = kept_sizes = 0
    sizes: set[int] = set()
    for params in GRID:
        for scale in (0.5, 2.0, 6.0):
            logits = (rng.standard_normal(n_vocab) * scale).astype(np.float32)
            ours = distribution(logits, params)
            theirs = llama_cpp_chain(logits, params)
            assert sorted(ours.ids.tolist()) == sorted(theirs), (params, scale)
            mine = dict(zip(ours.ids.tolist(), ours.probs.tolist(), strict=True))
            for t, p in theirs.items():
                assert mine[t] == pytest.approx(p, rel=1e-4, abs=1e-7), (params, scale, t)
            # Descending probability, as Distribution promises.
            assert np.all(np.diff(ours.probs) <= 1e-12)
            compared += 1
            kept_sizes += len(theirs)
            sizes.add(len(theirs))
    # The grid exercised truncation of every kind, not only the whole vocabulary.
    assert compared == len(GRID) * 3
    assert 1 in sizes and n_vocab in sizes and len(sizes) >= 10, sorted(sizes)


def test_distribution_drops_minus_infinity_like_llama_cpp() -> None:
    # Banned tokens (-inf logits, as --ignore-eos sets them) never get probability.
    logits = np.array([1.0, -np.inf, 0.5, -np.inf, 2.0], np.float32)
    d = distribution(logits, PLAIN)
    assert sorted(d.ids.tolist()) == [0, 2, 4]
    np.testing.assert_allclose(
        [d.prob(4), d.prob(0), d.prob(2)], softmax(np.array([2.0, 1.0, 0.5])), rtol=1e-12
    )
    assert d.prob(1) == 0.0
    with pytest.raises(ValueError, match="no finite logit"):
        distribution(np.full(3, -np.inf, np.float32), PLAIN)


def _ids(seq: Sequence[int]) -> list[int]:
    return [int(t) for t in seq]


def test_top_k_keeps_exactly_the_k_largest_and_ties_stay_sorted() -> None:
    logits = np.array([0.1, 3.0, -2.0, 2.0, 1.0, 2.5], np.float32)
    for k in range(1, 7):
        d = distribution(logits, SamplerParams(temperature=1.0, top_k=k, top_p=1.0, min_p=0.0))
        assert _ids(d.ids) == [1, 5, 3, 4, 0, 2][:k]
        z = np.sort(logits)[::-1][:k].astype(np.float64)
        np.testing.assert_allclose(d.probs, softmax(z), rtol=1e-12)
    assert math.isclose(float(d.probs.sum()), 1.0)


def test_distribution_orders_ties_by_token_id_and_survives_large_logits() -> None:
    from specgguf.speculative.sampling import keyed_uniform, sample_at

    # 64 tokens, four values repeated: within equal logits, ascending ids (a stable sort),
    # so that keyed draws (sample_at) pick the same token on every platform.
    logits = np.array([float(i % 4) for i in range(64)], np.float32)
    d = distribution(logits, PLAIN)
    assert _ids(d.ids[:16]) == list(range(3, 64, 4))
    assert _ids(d.ids[16:32]) == list(range(2, 64, 4))
    # Logits far from 0 (a model without final normalisation): no overflow, same p.
    big = np.array([1000.0, 999.0, 998.0], np.float32)
    d = distribution(big, SamplerParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0))
    np.testing.assert_allclose(d.probs, softmax(np.array([2.0, 0.0, -2.0])), rtol=1e-12)
    assert sample_at(d, 0.0) == 0 and sample_at(d, 0.999999) == 2
    # Keyed draws: in [0, 1), a function of (seed, index); None draws afresh.
    u = keyed_uniform(None, 3)
    assert 0.0 <= u < 1.0
    assert keyed_uniform(7, 3) == keyed_uniform(7, 3) != keyed_uniform(7, 4)
    with pytest.raises(ValueError) as ei:
        distribution(logits, SamplerParams(temperature=0.0))
    assert str(ei.value) == "greedy decoding has no sampling distribution"
    with pytest.raises(ValueError) as ei:
        distribution(np.full(3, -np.inf, np.float32), PLAIN)
    assert str(ei.value) == "no finite logit to sample from"
