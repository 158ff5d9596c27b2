"""Verification and acceptance in one place: the target evaluates the last committed token
and a draft (a chain, or a token tree) in one batch, and the longest acceptable prefix of
the draft is kept, plus one token of the target's own.

Acceptance rules, one per mode (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023,
Algorithm 2):

- greedy: a draft token is accepted while it equals the target's argmax; along a tree,
  the child whose token is the argmax is followed (SpecInfer, Miao et al. 2023, section 4:
  :func:`specgguf.speculative.tree.accept_greedy`);
- sampled: modified rejection sampling (:func:`specgguf.speculative.sampling.
  accept_or_resample` for a draft with its distribution q, :func:`~specgguf.speculative.
  sampling.accept_point_mass` for a deterministic one): the output follows the target's
  distribution exactly;
- deterministic (seeded sampling whose output does not depend on the drafts): the target's
  token at output position i is drawn with a uniform keyed by the seed and i, and a
  point-mass draft token is accepted when it equals that token
  (:func:`specgguf.speculative.sampling.keyed_uniform`).

The first rejected token is replaced by the target's own; when every draft token is
accepted the target adds a bonus token.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import numpy.typing as npt

from specgguf.speculative.costmodel import call_sizes
from specgguf.speculative.draft import Draft, TargetEvaluator
from specgguf.speculative.sampling import (
    SamplerParams,
    accept_or_resample,
    accept_point_mass,
    distribution,
    keyed_uniform,
    sample,
    sample_at,
)
from specgguf.speculative.tree import accept_greedy, first_branch, is_chain, leaves


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What a verification keeps.

    Args:
        accepted: the accepted draft tokens, in order.
        token: the target's own token after them (the replacement of the first rejected
            draft token, or the bonus token when none was rejected).
        row: the logits row ``token`` came from.
        rejected: whether a draft token was rejected (a tree: the accepted path stops at a
            node that has children).
        path: for a tree, the accepted nodes (indices into the draft's tokens).
    """

    accepted: list[int]
    token: int
    row: int
    rejected: bool
    path: list[int] | None = None


def verifiable(draft: Draft, k: int, max_leaves: int) -> Draft:
    """The draft as it is verified: at most ``k`` tokens, and a tree as a tree only when
    the step verifies trees (``max_leaves`` of 2 or more: greedy, not deterministic, a
    target with tree sequences) and it has at most ``max_leaves`` leaves and more than one
    branch; otherwise its first branch, as a chain."""
    tokens = draft.tokens[:k]
    parents = draft.parents[:k] if draft.parents is not None else None
    if parents is None:
        return draft if len(tokens) == len(draft.tokens) else draft.head(k)
    if is_chain(parents) or max_leaves < 2 or len(leaves(parents)) > max_leaves:
        return Draft([tokens[i] for i in first_branch(parents)])
    return Draft(tokens, parents=parents)


def evaluate(
    target: TargetEvaluator,
    root: int,
    draft: Draft,
    *,
    lazy_rows: int = 0,
    banned: npt.NDArray[np.int64] | None = None,
    allowed: npt.NDArray[np.bool_] | None = None,
) -> tuple[npt.NDArray[np.float32], int, float]:
    """The target's logits after ``root`` (the last committed token) and after each draft
    token, in one batch (a tree through ``eval_tree``).

    ``lazy_rows``: greedy verification in deterministic mode's decode calls of at most this
    many rows, stopping after the first call that shows a rejection
    (:func:`_eval_until_rejected`; 0: one evaluation). ``banned``: token ids whose logits
    are set to -inf (``ignore_eos``). ``allowed``: ``bool[len(draft) + 1, n_vocab]``, a
    grammar's tokens per row (:meth:`specgguf.speculative.grammar.Constraint.masks`; a
    chain only): the others' logits are set to -inf.

    Returns:
        float32[m, n_vocab] logits of the m rows evaluated (m = len(draft) + 1 unless a
        lazy verification stopped early), m, and the seconds the evaluation took.
    """
    d = draft.tokens
    t0 = time.perf_counter()
    if draft.parents is not None:
        logits, rows = target.eval_tree(root, d, draft.parents), len(d) + 1
    elif lazy_rows and len(d) + 1 > lazy_rows:
        logits, rows = _eval_until_rejected(target, [root, *d], lazy_rows, banned, allowed)
        return logits, rows, time.perf_counter() - t0
    else:
        logits, rows = target.eval([root, *d], logits="all"), len(d) + 1
    seconds = time.perf_counter() - t0
    return _masked(logits, banned, allowed), rows, seconds


def _masked(
    logits: npt.NDArray[np.float32],
    banned: npt.NDArray[np.int64] | None,
    allowed: npt.NDArray[np.bool_] | None,
) -> npt.NDArray[np.float32]:
    """``logits`` (float32[m, n_vocab]) with ``banned`` columns and the tokens outside
    ``allowed`` (its first m rows) at -inf: a new array when anything is masked (the
    evaluator's may be its own buffer), else ``logits`` itself."""
    if banned is not None:
        logits = np.array(logits)
        logits[:, banned] = -np.inf
    if allowed is not None:
        logits = np.where(allowed[: len(logits)], logits, np.float32(-np.inf))
    return logits


def _eval_until_rejected(
    target: TargetEvaluator,
    tokens: list[int],
    rows_per_decode: int,
    banned: npt.NDArray[np.int64] | None,
    allowed: npt.NDArray[np.bool_] | None = None,
) -> tuple[npt.NDArray[np.float32], int]:
    """Greedy verification of ``tokens`` (the last committed token, then the drafts) in the
    decode calls deterministic mode makes anyway (sizes as even as possible, at most
    ``rows_per_decode`` rows: :meth:`specgguf.llama.backend.LlamaContext.eval`), stopping
    after the first call in which the target's argmax differs from a draft: the rows after
    it cannot change the step. Every row's logits are the same whichever calls it is
    decoded in (deterministic mode's batch shapes are proven invariant at start-up), so
    the output is too.

    Returns:
        float32[m, n_vocab] logits of the m rows evaluated (``banned`` tokens and those
        outside ``allowed`` at -inf), and m (``len(tokens)`` when every draft was accepted).
    """
    n = len(tokens)
    parts: list[npt.NDArray[np.float32]] = []
    done = 0
    for size in call_sizes(n, rows_per_decode):
        part = np.array(target.eval(tokens[done : done + size], logits="all"))
        rows = allowed[done : done + size] if allowed is not None else None
        part = _masked(part, banned, rows)
        parts.append(part)
        done += size
        # row j predicts tokens[j + 1]; the last row of all predicts past the drafts
        best = part.argmax(axis=1)[: min(size, n - 1 - (done - size))]
        if np.any(best != np.asarray(tokens[done - size + 1 : done + 1][: len(best)])):
            break
    return np.concatenate(parts), done


def accept(
    draft: Draft,
    logits: npt.NDArray[np.float32],
    sampler: SamplerParams,
    rng: np.random.Generator,
    *,
    keyed_at: int | None = None,
) -> Verdict:
    """The tokens a verification keeps (see the module for the rules).

    Args:
        draft: the draft as verified (:func:`verifiable`); a tree only when greedy.
        logits: float32[m, n_vocab]: row 0 after the last committed token, row i + 1 after
            draft token i (m may stop early after a rejection, greedy only).
        sampler: the generation's sampler (greedy when its temperature is 0).
        rng: draws of sampled acceptance and resampling.
        keyed_at: deterministic mode: the output position of the first token of the step,
            whose draws are keyed by the seed and the position; None: draws from ``rng``.
    """
    d = draft.tokens
    if draft.parents is not None:
        path, token = accept_greedy(d, draft.parents, logits.argmax(axis=1))
        row = path[-1] + 1 if path else 0  # the row of the last accepted node (root: 0)
        rejected = (path[-1] if path else -1) in draft.parents
        return Verdict([d[i] for i in path], token, row, rejected, path)
    if sampler.greedy:
        best = logits.argmax(axis=1)
        n = 0
        while n < len(d) and best[n] == d[n]:
            n += 1
        token = int(best[n])
    elif keyed_at is not None:
        n, token = _accept_keyed(logits, d, sampler, keyed_at)
    else:
        n, token = _accept_sampled(logits, draft, sampler, rng)
    return Verdict(d[:n], token, n, n < len(d))


def _accept_keyed(
    logits: npt.NDArray[np.float32], d: list[int], sampler: SamplerParams, index: int
) -> tuple[int, int]:
    """Deterministic sampling along a point-mass draft: the target's token at output
    position ``index + i`` is drawn with a uniform keyed by that position; the draft
    is accepted while it equals those tokens. (accepted count, next token)"""
    for i in range(len(d) + 1):
        y = sample_at(distribution(logits[i], sampler), keyed_uniform(sampler.seed, index + i))
        if i == len(d) or y != d[i]:
            return i, y
    raise AssertionError("unreachable")


def _accept_sampled(
    logits: npt.NDArray[np.float32],
    draft: Draft,
    sampler: SamplerParams,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Modified rejection sampling along the draft: (accepted count, next token)."""
    for i, tok in enumerate(draft.tokens):
        p = distribution(logits[i], sampler)
        if draft.dists is not None:
            ok, y = accept_or_resample(p, draft.dists[i], tok, rng)
        else:
            ok, y = accept_point_mass(p, tok, rng)
        if not ok:
            return i, y
    return len(draft.tokens), sample(distribution(logits[len(draft.tokens)], sampler), rng)
