"""Token trees: several draft continuations verified in one target batch.

A tree draft is a list of draft tokens with a parent for each: ``parents[i]`` is the index
of token i's parent in the list, or -1 when its parent is the root, the last committed
token (``history[-1]``). Parents come before their children (``parents[i] < i``), so every
prefix of a tree is a tree. A chain of K tokens is the tree ``[-1, 0, 1, ..., K - 2]``.

The target evaluates the root and every node in one batch, each node attending to the
committed text and its own ancestors only (SpecInfer, Miao et al. 2023, section 4's
tree attention; with llama.cpp sequence ids, see ``LlamaContext.eval_tree``), which
gives a row of logits after the root and after every node. Greedy acceptance
(:func:`accept_greedy`) walks from the root: at each node it takes the child whose token
is the target's argmax there, and stops where no child is; the target's argmax at that
node is the step's next token. The tokens committed are therefore exactly the target
alone's.

Only greedy decoding uses trees: sampled verification of several candidates needs a
multi-candidate rejection rule (SpecTr, SpecInfer's multi-step rule), which is not
implemented; with sampling, a tree is cut to its first branch (:func:`first_branch`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


def check_tree(parents: Sequence[int]) -> None:
    """Raises ValueError unless every parent is -1 or an earlier index."""
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"node {i} has parent {p}: a parent must be -1 or an earlier node")


def chain_parents(n: int) -> list[int]:
    """The parents of a chain of ``n`` tokens: ``[-1, 0, 1, ..., n - 2]``."""
    return list(range(-1, n - 1))


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node: 1 for a child of the root (its position is n_past + depth)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def leaves(parents: Sequence[int]) -> list[int]:
    """The nodes without children, in index order (none for an empty tree)."""
    has_child = [False] * len(parents)
    for p in parents:
        if p >= 0:
            has_child[p] = True
    return [i for i, c in enumerate(has_child) if not c]


def is_chain(parents: Sequence[int]) -> bool:
    """Whether the tree is a single branch (the empty tree included)."""
    return list(parents) == chain_parents(len(parents))


def first_branch(parents: Sequence[int]) -> list[int]:
    """The nodes of the branch that takes the first child at every node, root to leaf."""
    out: list[int] = []
    at = -1
    for i, p in enumerate(parents):
        if p == at:
            out.append(i)
            at = i
    return out


def accept_greedy(
    tokens: Sequence[int], parents: Sequence[int], best: npt.NDArray[np.integer] | Sequence[int]
) -> tuple[list[int], int]:
    """Greedy acceptance along a tree (SpecInfer, Miao et al. 2023, section 4).

    Args:
        tokens, parents: the tree draft (see the module).
        best: int[n + 1], the target's argmax after the root (row 0) and after each node
            (row i + 1 for node i).

    Returns:
        (path, next token): the accepted nodes from the root down (indices into
        ``tokens``), and the target's argmax after the last of them (after the root when
        none is accepted).
    """
    at = -1
    path: list[int] = []
    while True:
        want = int(best[at + 1])
        child = next(
            (i for i in range(at + 1, len(tokens)) if parents[i] == at and tokens[i] == want),
            None,
        )
        if child is None:
            return path, want
        path.append(child)
        at = child
