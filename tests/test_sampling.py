"""Sampling distributions and modified rejection sampling: the output follows p exactly."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specgguf.llama.backend import LlamaModel
from specgguf.speculative.loop import GenerationParams
from specgguf.speculative.sampling import (
    Distribution,
    SamplerParams,
    accept_or_resample,
    accept_point_mass,
    distribution,
    sample,
    top_k_ids,
)

from .helpers import llama_cpp_chain, load_engine


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper quantile of chi-square(df) at the normal z (3.719: alpha = 1e-4), by the
    Wilson-Hilferty approximation."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_vs(counts: Counter[int], probs: dict[int, float], n: int) -> tuple[float, int]:
    """Goodness of fit of ``counts`` (n draws) to ``probs``: (statistic, degrees of
    freedom). Bins with an expected count below 5 are merged, smallest first, into groups
    of at least 5, whose observed counts are merged with them; a remainder joins the last
    group. Every draw must fall in ``probs``' support."""
    outside = n - sum(counts.get(t, 0) for t in probs)
    assert outside == 0, f"{outside} draws outside p's support"
    groups: list[list[float]] = []  # [expected, observed]
    pool = [0.0, 0.0]
    for t, p in sorted(probs.items(), key=lambda item: item[1]):
        pool[0] += n * p
        pool[1] += counts.get(t, 0)
        if pool[0] >= 5:
            groups.append(pool)
            pool = [0.0, 0.0]
    if pool[1] or pool[0]:
        if groups:
            groups[-1][0] += pool[0]
            groups[-1][1] += pool[1]
        else:
            groups.append(pool)
    stat = sum((o - e) ** 2 / e for e, o in groups if e > 0)
    return stat, len(groups) - 1


def test_chi2_vs_merges_small_bins_with_their_counts() -> None:
    # Expected 2, 2, 2 (n = 100): one group of 6 holding all three bins' draws, plus the
    # large bin. Dropping the small bins' draws would hide 10 draws where 6 are expected.
    probs = {0: 0.02, 1: 0.02, 2: 0.02, 3: 0.94}
    stat, df = chi2_vs(Counter({0: 4, 1: 3, 2: 3, 3: 90}), probs, 100)
    assert df == 1
    assert stat == pytest.approx((10 - 6) ** 2 / 6 + (90 - 94) ** 2 / 94)
    # A remainder below 5 joins the last group: expected 3 + 3 make a group, the 4 left
    # join it: one group of 10, df 0.
    stat, df = chi2_vs(Counter({0: 1, 1: 1, 2: 8}), {0: 0.3, 1: 0.3, 2: 0.4}, 10)
    assert (stat, df) == (0.0, 0)
    # Small bins merged in a group of their own: expected 3 + 3 = 6, observed 0 + 12.
    stat, df = chi2_vs(Counter({0: 0, 1: 12, 2: 88}), {0: 0.03, 1: 0.03, 2: 0.94}, 100)
    assert df == 1 and stat == pytest.approx(36 / 6 + 36 / 94)
    with pytest.raises(AssertionError, match="outside"):
        chi2_vs(Counter({0: 1, 9: 1}), {0: 1.0}, 2)


P = {0: 0.05, 1: 0.40, 2: 0.25, 3: 0.15, 4: 0.10, 5: 0.05}
Q = {0: 0.45, 1: 0.05, 2: 0.05, 3: 0.05, 4: 0.10, 6: 0.30}  # q far from p, own support


def dist(d: dict[int, float]) -> Distribution:
    ids = np.array(sorted(d, key=lambda t: -d[t]), np.int64)
    return Distribution(ids, np.array([d[int(t)] for t in ids], np.float64))


def test_rejection_sampling_output_follows_p() -> None:
    p, q = dist(P), dist(Q)
    rng = np.random.default_rng(0)
    n = 120_000
    counts: Counter[int] = Counter()
    accepted = 0
    for _ in range(n):
        x = sample(q, rng)
        ok, y = accept_or_resample(p, q, x, rng)
        accepted += ok
        counts[y] += 1
    stat, df = chi2_vs(counts, P, n)
    assert stat < chi2_critical(df), (stat, df, counts)
    # Acceptance probability is sum(min(p, q)) (Leviathan et al. 2023, section 3.1).
    expected = sum(min(P.get(t, 0), Q.get(t, 0)) for t in set(P) | set(Q))
    assert accepted / n == pytest.approx(expected, abs=0.01)
    # Always accepting would give q, with 30% of draws at token 6, outside p's support:
    # chi2_vs refuses such counts, so a wrong acceptance rule fails this test.


def test_a_draft_token_outside_q_is_judged_as_a_point_mass() -> None:
    # Token 5 is not in Q's support: a drafter that proposes it anyway is treated as a
    # deterministic drafter, accepted with probability p(5) = 0.05, and the output follows p.
    p, q = dist(P), dist(Q)
    rng = np.random.default_rng(5)
    n = 40_000
    counts: Counter[int] = Counter()
    accepted = 0
    for _ in range(n):
        ok, y = accept_or_resample(p, q, 5, rng)
        accepted += ok
        counts[y] += 1
    assert accepted / n == pytest.approx(P[5], abs=0.005)
    stat, df = chi2_vs(counts, P, n)
    assert stat < chi2_critical(df), (stat, df, counts)


def test_point_mass_draft_output_follows_p() -> None:
    p = dist(P)
    rng = np.random.default_rng(1)
    n = 100_000
    counts: Counter[int] = Counter()
    accepted: Counter[int] = Counter()
    for i in range(n):
        x = (2, 5, 0)[i % 3]  # a deterministic drafter's guesses, right or wrong
        ok, y = accept_point_mass(p, x, rng)
        counts[y] += 1
        accepted[x] += ok
        assert not ok or y == x
    stat, df = chi2_vs(counts, P, n)
    assert stat < chi2_critical(df), (stat, df, counts)
    # A guess x is accepted with probability p(x) (3 sigma bounds over n / 3 guesses each).
    for x in (2, 5, 0):
        rate, m = accepted[x] / (n / 3), n / 3
        assert abs(rate - P[x]) < 3 * math.sqrt(P[x] * (1 - P[x]) / m) + 1e-3, (x, rate)
    # A point mass at x accepts x always.
    one = Distribution(np.array([4], np.int64), np.array([1.0]))
    assert all(accept_point_mass(one, 4, rng) == (True, 4) for _ in range(100))


def test_distribution_follows_llama_cpp_chain_order() -> None:
    logits = np.array([5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0], np.float32)
    # top-k 3 keeps the three largest.
    d = distribution(logits, SamplerParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0))
    assert list(d.ids) == [0, 1, 2]
    e = np.exp([0.0, -1.0, -2.0])
    np.testing.assert_allclose(d.probs, e / e.sum())
    # top-p on temperature-1 probabilities: 0.5 keeps the first token whose cumulative
    # probability reaches it (p0 = 0.634 of the full softmax).
    d = distribution(logits, SamplerParams(temperature=2.0, top_k=0, top_p=0.5, min_p=0.0))
    assert list(d.ids) == [0]
    # min-p 0.3: p_i / p_max >= 0.3 -> e^-1 = 0.37 kept, e^-2 = 0.14 not.
    d = distribution(logits, SamplerParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.3))
    assert list(d.ids) == [0, 1]
    # Temperature applies after truncation: at T=2 the kept pair is flatter.
    d = distribution(logits, SamplerParams(temperature=2.0, top_k=0, top_p=1.0, min_p=0.3))
    np.testing.assert_allclose(d.probs, np.array([1.0, math.exp(-0.5)]) / (1 + math.exp(-0.5)))
    with pytest.raises(ValueError, match="greedy"):
        distribution(logits, SamplerParams(temperature=0.0))


def _first_two_exact(
    target: Path, prompt: str, sampler: SamplerParams
) -> tuple[dict[int, float], dict[int, float]]:
    """The exact distributions of the first and second generated token: p1 after the
    prompt, and sum over x of p1(x) * p2(. | x), each from llama.cpp's own sampler chain
    (not from the :func:`distribution` under test)."""
    with LlamaModel(target) as m, m.new_context(n_ctx=128) as ctx:
        ids = m.tokenize(prompt)
        p1 = llama_cpp_chain(ctx.eval(ids, logits="last")[-1].copy(), sampler)
        second: dict[int, float] = {}
        for x, px in p1.items():
            ctx.rollback(len(ids))
            p2 = llama_cpp_chain(ctx.eval([x], logits="last")[-1].copy(), sampler)
            for y, py in p2.items():
                second[y] = second.get(y, 0.0) + px * py
    return p1, second


class _NoEog:
    def __init__(self, model: LlamaModel) -> None:
        self.n_vocab = model.n_vocab
        self.eog_ids: frozenset[int] = frozenset()
        self.token_to_piece = model.token_to_piece


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_end_to_end_sampled_tokens_follow_target(
    tiny_models: dict[str, Path], drafter: str
) -> None:
    sampler = SamplerParams(temperature=2.5, top_k=12, top_p=1.0, min_p=0.0)
    prompt = "The fox jumps over the fox jumps over the"
    p1, p2 = _first_two_exact(tiny_models["target"], prompt, sampler)
    n = 1500
    c1: Counter[int] = Counter()
    c2: Counter[int] = Counter()
    with load_engine(tiny_models["target"], tiny_models["draft-partial"], drafter=drafter,
                     n_ctx=128) as e:  # fmt: skip
        ids = e.tokenize(prompt)
        # Count end-of-generation tokens like any other: the exact distributions include them.
        e.decoder.vocab = _NoEog(e.target_model)
        drafted = 0
        for seed in range(n):
            s = SamplerParams(**{**sampler.__dict__, "seed": seed})
            res = e.generate(ids, GenerationParams(n_predict=4, draft_max=3, sampler=s)).run()
            c1[res.tokens[0]] += 1
            c2[res.tokens[1]] += 1
            drafted += res.stats.drafted
    assert drafted >= 2 * n  # speculation really happened, several tokens per draft
    for counts, exact in ((c1, p1), (c2, p2)):
        stat, df = chi2_vs(counts, exact, n)
        assert df >= 3
        assert stat < chi2_critical(df), (stat, df)


@settings(max_examples=80, deadline=None, derandomize=True)  # (mutation testing: the same cases)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.sampled_from([100, 10_240, 10_241, 20_000, 151_936]),
    k=st.integers(1, 40),
    ties=st.sampled_from([None, 1.0, 4.0]),
    masked=st.floats(0.0, 1.0),
    infinite=st.booleans(),
)
def test_top_k_ids_are_the_k_largest_ties_by_smallest_id(
    seed: int, n: int, k: int, ties: float | None, masked: float, infinite: bool
) -> None:
    # Against a full sort by (-logit, id): logits masked to -inf as a grammar masks them
    # (a row may have fewer than k finite), rounded for ties, one +inf.
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal(n) * 4).astype(np.float32)
    if ties is not None:
        logits = (np.round(logits / ties) * ties).astype(np.float32)
    logits[rng.random(n) < masked] = -np.inf
    if infinite:
        logits[rng.integers(0, n)] = np.inf
    want = np.sort(np.lexsort((np.arange(n), -logits.astype(np.float64)))[:k])
    ids = top_k_ids(logits, k)
    assert ids.dtype == np.int64 and np.array_equal(ids, want)


def test_equal_logits_are_kept_and_ordered_by_smallest_id() -> None:
    # Three logits at 5 (ids 100, 90,000, 150,000) in 151,936: top-k 2 keeps the two
    # smallest ids (in different blocks than the third), and the distribution lists
    # equal logits by ascending id, whatever np.argpartition would have done.
    logits = np.zeros(151_936, np.float32)
    logits[[150_000, 90_000, 100]] = 5.0
    assert top_k_ids(logits, 2).tolist() == [100, 90_000]
    d = distribution(logits, SamplerParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0))
    assert d.ids.tolist() == [100, 90_000, 150_000]


@pytest.mark.parametrize("where", [5, 19_999])
def test_top_k_ids_with_nan_takes_what_argpartition_takes(where: int) -> None:
    # NaN in a whole block (5) or in the tail past the last whole block (19,999 of 20,000).
    logits = np.arange(20_000, dtype=np.float32)
    logits[where] = np.nan
    ids = top_k_ids(logits, 3)
    want = np.argpartition(logits, 20_000 - 3)[20_000 - 3 :]
    assert ids.dtype == np.int64 and ids.tolist() == sorted(want.tolist())
    assert where in ids.tolist()


def test_top_k_ids_search_the_tail_past_the_last_whole_block() -> None:
    # 10,241 logits: 160 blocks of 64 and a tail of one, the largest.
    logits = np.zeros(10_241, np.float32)
    logits[10_240], logits[7] = 2.0, 1.0
    assert top_k_ids(logits, 2).tolist() == [7, 10_240]
