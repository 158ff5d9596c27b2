"""Sampling distributions from logits, and the accept/resample step of speculative sampling.

The sampler chain mirrors llama.cpp's default order (common/sampling.cpp: ... top_k, top_p,
min_p, temperature, dist): truncation by top-k, then top-p and min-p on the probabilities
at temperature 1, then temperature, then a softmax over what is left. Target and draft
distributions p and q go through the same chain, so speculative sampling reproduces the
target's distribution under exactly these settings.

The acceptance rule is modified rejection sampling (Leviathan et al. 2023, "Fast Inference
from Transformers via Speculative Decoding", Algorithm 1 and Appendix A.1; Chen et al. 2023,
"Accelerating Large Language Model Decoding with Speculative Sampling", Algorithm 2): a
draft token x ~ q is kept with probability min(1, p(x)/q(x)); otherwise the token is drawn
from normalize(max(0, p - q)). For a deterministic drafter (n-gram lookup) q is a point
mass at x: x is kept with probability p(x), otherwise drawn from p with x removed.

Seeded sampling and deterministic mode (:func:`sample_at`, :func:`keyed_uniform`) couple
the draws instead: the
target's token at output position i is ``sample_at(p_i, u_i)`` with u_i keyed by the seed
and i, and a point-mass draft token is accepted when it equals that token. A draft token x
is then accepted with probability p(x) and the output follows p exactly, as in the rule
above; in addition the output is the same whatever was drafted.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import numpy.typing as npt


@dataclasses.dataclass(frozen=True)
class SamplerParams:
    """Sampling settings with llama.cpp's names and defaults.

    ``temperature <= 0`` means greedy decoding (argmax). ``top_k <= 0``, ``top_p >= 1`` and
    ``min_p <= 0`` disable those filters. ``seed``: the target's token at each output
    position is drawn with a uniform keyed by the seed and the position
    (:func:`keyed_uniform`), so a seed gives the same text with any drafter and draft
    length; None: random draws, and drafts with their distributions verified by modified
    rejection sampling.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclasses.dataclass(frozen=True)
class Distribution:
    """A sparse probability distribution over token ids.

    ``ids``: int64[m] token ids, in descending probability; ``probs``: float64[m], summing
    to 1, all > 0.
    """

    ids: npt.NDArray[np.int64]
    probs: npt.NDArray[np.float64]

    def prob(self, token: int) -> float:
        """p(token); 0.0 outside the support."""
        hit = np.flatnonzero(self.ids == token)
        return float(self.probs[hit[0]]) if hit.size else 0.0


#: Logits per block of :func:`top_k_ids`.
_BLOCK = 64


def _largest(
    cand: npt.NDArray[np.int64], vals: npt.NDArray[np.float32], k: int
) -> npt.NDArray[np.int64]:
    """Of the ids ``cand`` with logits ``vals``, the ``k`` with the largest logits, those
    equal to the k-th largest by smallest id, ascending."""
    kth = np.partition(vals, vals.size - k)[vals.size - k]
    above = cand[vals > kth]
    tied = np.sort(cand[vals == kth])[: k - above.size]
    return np.sort(np.concatenate([above, tied]))


def top_k_ids(logits: npt.NDArray[np.float32], k: int) -> npt.NDArray[np.int64]:
    """The ids of the ``k`` largest of ``logits`` (float32[n]; 0 < k < n), ascending:
    int64[k]. Of logits equal to the k-th largest, the smallest ids are taken, so that
    the same row gives the same tokens on every platform (``np.argpartition`` leaves that
    to its implementation). A row with NaN is searched as before: ``np.argpartition``
    over the whole row (NaN orders above every number there, and :func:`distribution`
    drops it).

    Where the vocabulary is large against ``k``, the row is cut into blocks of 64 logits
    and only the ``k`` blocks with the largest maxima are searched (with the tail past
    the last whole block): every one of the k largest logits lies in a block whose
    maximum is at least the k-th largest, so no more than k blocks hold a larger one
    (where more blocks reach the k-th largest, the ties are read from the whole row, by
    smallest id). A block is every (n // 64)-th id, not 64 neighbours: its maxima are
    then one vectorised maximum over 64 rows, where numpy reduces 2,374 rows of 64 one
    by one (19 against 239 us on 151,936 logits); which ids share a block changes no
    result. For 151,936 logits and top-k 40 the search
    reads about 2,600 (``scripts/bench-sampling``: :func:`distribution` about 4.5x
    faster, and 40x on a row a grammar masks 95% of to -inf, whose many equal logits slow
    ``np.argpartition`` down). Sampling runs this on every verified row.
    """
    n = logits.shape[0]
    whole = n // _BLOCK * _BLOCK
    small = k * _BLOCK * 4 > n
    nb = whole // _BLOCK
    # block b: ids b, b + nb, b + 2 nb, ... (see above)
    maxima = None if small else logits[:whole].reshape(_BLOCK, nb).max(axis=0)
    # (a NaN anywhere is NaN in its block's maximum, or in the tail)
    nan = np.isnan(logits).any() if maxima is None else (
        np.isnan(maxima).any() or np.isnan(logits[whole:]).any())  # fmt: skip
    if nan:
        return np.sort(np.argpartition(logits, n - k)[n - k :]).astype(np.int64)
    if maxima is None:
        return _largest(np.arange(n, dtype=np.int64), logits, k)
    blocks = np.argpartition(maxima, nb - k)[nb - k :]
    cand = (blocks[None, :] + np.arange(0, whole, nb)[:, None]).ravel().astype(np.int64)
    if whole < n:  # the tail, shorter than a block, is always searched
        cand = np.concatenate([cand, np.arange(whole, n, dtype=np.int64)])
    vals = logits[cand]
    kth = np.partition(vals, vals.size - k)[vals.size - k]
    if np.count_nonzero(maxima >= kth) <= k:  # every block reaching the k-th is searched
        return _largest(cand, vals, k)
    # Logits equal to the k-th lie outside the blocks searched too: those above it are
    # all inside, the ties are taken by smallest id from the whole row.
    above = cand[vals > kth]
    tied = np.flatnonzero(logits == kth)[: k - above.size]
    return np.sort(np.concatenate([above, tied.astype(np.int64)]))


def distribution(logits: npt.NDArray[np.float32], params: SamplerParams) -> Distribution:
    """The distribution llama.cpp's default chain samples from, for one row of logits.

    Args:
        logits: float32[n_vocab] raw logits (a row of the model's output).
        params: the sampler settings; must not be greedy.

    Raises:
        ValueError: ``params.temperature <= 0`` (greedy has no distribution) or no finite logit.
    """
    if params.greedy:
        raise ValueError("greedy decoding has no sampling distribution")
    n = logits.shape[0]
    k = params.top_k
    if 0 < k < n:
        ids = top_k_ids(logits, k)
        vals = logits[ids].astype(np.float64)
    else:
        ids = np.arange(n, dtype=np.int64)
        vals = logits.astype(np.float64)
    order = np.argsort(-vals, kind="stable")
    ids, vals = ids[order], vals[order]
    finite = np.isfinite(vals)
    if not finite.all():
        ids, vals = ids[finite], vals[finite]
        if ids.size == 0:
            raise ValueError("no finite logit to sample from")
    if params.top_p < 1.0 or params.min_p > 0.0:
        rel = np.exp(vals - vals[0])  # probabilities at temperature 1, up to a constant
        keep = ids.size
        if params.top_p < 1.0:
            cum = np.cumsum(rel / rel.sum())
            keep = min(keep, int(np.searchsorted(cum, params.top_p, side="left")) + 1)
        if params.min_p > 0.0:
            # min-p keeps tokens with p >= min_p * p_max; rel is sorted, so a prefix.
            keep = min(keep, max(1, int(np.count_nonzero(rel >= params.min_p))))
        ids, vals = ids[:keep], vals[:keep]
    z = (vals - vals[0]) / params.temperature
    p = np.exp(z)
    p /= p.sum()
    return Distribution(ids, p)


def sample(dist: Distribution, rng: np.random.Generator) -> int:
    """Draw one token id from ``dist``."""
    return sample_at(dist, rng.random())


def sample_at(dist: Distribution, u: float) -> int:
    """The token id at ``u`` (in [0, 1)) of ``dist``'s inverse cumulative distribution
    (ids in descending probability): the same ``u`` gives the same token for the same
    distribution."""
    cum = np.cumsum(dist.probs)
    i = int(np.searchsorted(cum, u * cum[-1], side="right"))
    return int(dist.ids[min(i, dist.ids.size - 1)])


def keyed_uniform(seed: int | None, index: int) -> float:
    """A uniform number in [0, 1) determined by ``seed`` and ``index`` alone (a counter-
    based draw: numpy's SeedSequence of the pair), so that the draw for an output position
    does not depend on how many draws came before it. ``seed`` None draws afresh."""
    if seed is None:
        return float(np.random.default_rng().random())
    return float(np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, index]).random())


def accept_or_resample(
    p: Distribution, q: Distribution, x: int, rng: np.random.Generator
) -> tuple[bool, int]:
    """One step of modified rejection sampling for a draft token ``x`` drawn from ``q``.

    Returns ``(True, x)`` when ``x`` is accepted (probability min(1, p(x)/q(x))), else
    ``(False, y)`` with ``y`` drawn from normalize(max(0, p - q)) (Leviathan et al. 2023,
    Algorithm 1). The output token is distributed exactly as ``p``.
    """
    px, qx = p.prob(x), q.prob(x)
    if qx <= 0.0:  # x was not drawn from q; treat as a point mass (still exact)
        return accept_point_mass(p, x, rng)
    if rng.random() * qx < px:
        return True, x
    q_on_p = _values_at(q, p.ids)
    residual = np.maximum(p.probs - q_on_p, 0.0)
    total = residual.sum()
    if total <= 0.0:  # p <= q everywhere (only by rounding): p itself is the residual
        return False, sample(p, rng)
    return False, sample(Distribution(p.ids, residual / total), rng)


def accept_point_mass(p: Distribution, x: int, rng: np.random.Generator) -> tuple[bool, int]:
    """Modified rejection sampling for a deterministic draft token ``x`` (q = point mass):
    accept with probability p(x), else draw from p with ``x`` removed, renormalised."""
    px = p.prob(x)
    if rng.random() < px:
        return True, x
    keep = p.ids != x
    rest = p.probs[keep]
    total = rest.sum()
    if total <= 0.0:  # p is a point mass at x: accepted above unless px rounds below 1
        return True, x
    return False, sample(Distribution(p.ids[keep], rest / total), rng)


def _values_at(q: Distribution, ids: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
    """q(t) for each t in ``ids`` (0 where t is outside q's support)."""
    order = np.argsort(ids)
    sorted_ids = ids[order]
    pos = np.searchsorted(sorted_ids, q.ids)
    pos_c = np.minimum(pos, sorted_ids.size - 1)
    hit = sorted_ids[pos_c] == q.ids
    out = np.zeros(ids.size, np.float64)
    out[order[pos_c[hit]]] = q.probs[hit]
    return out
