"""Traces of what the drafters would propose, for the planner simulator
(:mod:`specgguf.measure.simulate`).

A trace holds, per generation (a prompt of a benchmark column), the target's greedy output,
the target's confidence at each output position (the top-1 probability, which auto mode
reads from a verification row), and the draft model's greedy chain after each output
position with the draft's probability of each chain token. Lookups (n-gram, suffix) are not
stored: they are functions of the text, and the simulator runs the real drafters over it.
Whether the target agrees with a proposal follows from the output (greedy decoding), so no
logits are stored: a generation of 128 tokens with chains of 16 is about 26 KB of JSON,
about 5 KB gzipped.

Recording runs the real pair once, token by token: the target's output one row at a time,
and each chain in the draft model's KV cache, reusing the previous position's chain when the
target agreed with its first token (the draft's greedy chain after ``h + [c0]`` is the rest
of its chain after ``h``), so a position costs one draft evaluation where the draft was
right and ``depth`` where it was not.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from specgguf.errors import UsageError
from specgguf.speculative.draft import Evaluator

#: The format of the files :func:`save_trace` writes.
TRACE_VERSION = 1


@dataclasses.dataclass
class TracedGeneration:
    """One generation of a trace.

    Args:
        category: its benchmark column (Spec-Bench's, or a bench category).
        question_id: which question (and turn: ``id/turn``).
        prompt: the prompt's token ids, as the target reads them.
        output: the target's greedy output ids, up to its end of generation (excluded) or
            the length asked for.
        confidence: float per output position: the target's top-1 probability there.
        chains: per output position i, the draft model's greedy chain after
            ``prompt + output[:i]`` (ids; empty without a draft model).
        chain_probs: the draft's probability of each chain token.
    """

    category: str
    question_id: str
    prompt: list[int]
    output: list[int]
    confidence: list[float]
    chains: list[list[int]]
    chain_probs: list[list[float]]


@dataclasses.dataclass
class Trace:
    """Recorded generations and how they were recorded (``meta``: the models, the command,
    the date)."""

    meta: dict[str, Any]
    generations: list[TracedGeneration]

    @property
    def categories(self) -> list[str]:
        """The categories in the order they first appear."""
        return list(dict.fromkeys(g.category for g in self.generations))


def _softmax_top(row: npt.NDArray[np.float32]) -> tuple[int, float]:
    """The argmax of a logits row and its probability."""
    tok = int(row.argmax())
    return tok, 1.0 / float(np.exp(row - row[tok]).sum())


class _Cache:
    """A context's KV cache as a token list: :meth:`logits_after` evaluates only what the
    cache does not already hold."""

    def __init__(self, ctx: Evaluator) -> None:
        self.ctx = ctx
        self.held: list[int] = []
        ctx.rollback(0)

    def logits_after(self, tokens: Sequence[int]) -> npt.NDArray[np.float32]:
        """The logits row (float32[n_vocab], a copy) after ``tokens``."""
        common = 0
        for a, b in zip(self.held, tokens, strict=False):
            if a != b:
                break
            common += 1
        keep = min(common, len(tokens) - 1)
        self.ctx.rollback(keep)
        del self.held[keep:]
        row: npt.NDArray[np.float32] = self.ctx.eval(list(tokens[keep:]), logits="last")[-1].copy()
        self.held.extend(tokens[keep:])
        return row


def record_generation(
    target: Evaluator,
    draft: Evaluator | None,
    prompt: Sequence[int],
    n_predict: int,
    eog_ids: frozenset[int],
    *,
    depth: int = 16,
    n_vocab: int | None = None,
) -> tuple[list[int], list[float], list[list[int]], list[list[float]]]:
    """The target's greedy output after ``prompt`` (at most ``n_predict`` tokens, ending
    before an end-of-generation token), its confidence per position, and the draft's greedy
    chains of ``depth`` tokens after each position with their probabilities (ids at or past
    ``n_vocab`` never drafted). Both KV caches end empty.

    Raises:
        BackendError: an evaluation failed.
        ContextOverflowError: the prompt and output do not fit a context.
    """
    t = _Cache(target)
    output: list[int] = []
    confidence: list[float] = []
    text = list(prompt)
    for _ in range(n_predict):
        tok, p = _softmax_top(t.logits_after(text))
        if tok in eog_ids:
            break
        output.append(tok)
        confidence.append(round(p, 4))
        text.append(tok)
    target.rollback(0)
    chains: list[list[int]] = []
    probs: list[list[float]] = []
    if draft is not None:
        d = _Cache(draft)
        limit = n_vocab or draft.n_vocab
        chain: list[int] = []
        chain_p: list[float] = []
        for i in range(len(output)):
            if i and chain and chain[0] == output[i - 1]:
                chain, chain_p = chain[1:], chain_p[1:]
            elif i:
                chain, chain_p = [], []
            base = [*prompt, *output[:i]]
            while len(chain) < depth:
                tok, p = _softmax_top(d.logits_after(base + chain)[:limit])
                chain.append(tok)
                chain_p.append(round(p, 4))
            chains.append(list(chain))
            probs.append(list(chain_p))
        draft.rollback(0)
    return output, confidence, chains, probs


def record_trace(
    target: Evaluator,
    draft: Evaluator | None,
    prompts: Sequence[tuple[str, str, Sequence[int]]],
    n_predict: int,
    eog_ids: frozenset[int],
    meta: dict[str, Any],
    *,
    depth: int = 16,
    n_vocab: int | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> Trace:
    """A :class:`Trace` of ``prompts`` (category, question id, prompt ids), in order, each
    through :func:`record_generation`; ``progress(i, n, category)`` before each.

    Raises:
        BackendError: an evaluation failed.
        ContextOverflowError: a prompt and its output do not fit a context.
    """
    gens = []
    for i, (category, qid, ids) in enumerate(prompts):
        if progress is not None:
            progress(i, len(prompts), category)
        out, conf, chains, probs = record_generation(
            target, draft, ids, n_predict, eog_ids, depth=depth, n_vocab=n_vocab
        )
        gens.append(TracedGeneration(category, qid, list(ids), out, conf, chains, probs))
    return Trace(dict(meta, version=TRACE_VERSION, depth=depth, n_predict=n_predict), gens)


def save_trace(trace: Trace, path: Path) -> None:
    """Write ``trace`` as gzipped JSON, atomically (a temporary file renamed).

    Raises:
        OSError: the file cannot be written.
    """
    data = {"meta": trace.meta, "generations": [dataclasses.asdict(g) for g in trace.generations]}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb") as f:
            f.write(json.dumps(data, separators=(",", ":")).encode())
        os.chmod(tmp, 0o644)  # (mkstemp's 0600: a cache file, not a secret)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_trace(path: Path) -> Trace:
    """Read a trace :func:`save_trace` wrote.

    Raises:
        UsageError: the file is missing, not a trace, or of another version.
    """
    try:
        with gzip.open(path, "rb") as f:
            data = json.loads(f.read())
    except (OSError, EOFError, ValueError) as e:
        raise UsageError(f"{path}: not a trace ({getattr(e, 'strerror', None) or e})") from None
    meta = data.get("meta") if isinstance(data, dict) else None
    if not isinstance(meta, dict) or meta.get("version") != TRACE_VERSION:
        raise UsageError(f"{path}: not a trace of version {TRACE_VERSION}")
    try:
        gens = [TracedGeneration(**g) for g in data["generations"]]
        for g in gens:
            _check(g)
    except (TypeError, KeyError, ValueError) as e:
        raise UsageError(f"{path}: a malformed trace ({e})") from None
    return Trace(meta, gens)


def _check(g: TracedGeneration) -> None:
    """Raise ValueError (or TypeError) where ``g``'s fields do not fit together."""
    n = len(g.output)
    if len(g.confidence) != n or (g.chains and len(g.chains) != n):
        raise ValueError(f"generation {g.question_id}: lengths disagree")
    if len(g.chain_probs) != len(g.chains) or any(
        len(c) != len(p) for c, p in zip(g.chains, g.chain_probs, strict=True)
    ):
        raise ValueError(f"generation {g.question_id}: chains and their probabilities disagree")
    numbers = [*g.confidence, *(p for ps in g.chain_probs for p in ps)]
    if any(not isinstance(p, int | float) or math.isnan(p) or not 0.0 <= p <= 1.0
           for p in numbers):  # fmt: skip
        raise ValueError(f"generation {g.question_id}: a probability outside [0, 1]")
    ids = [*g.prompt, *g.output, *(t for c in g.chains for t in c)]
    if any(not isinstance(t, int) for t in ids):
        raise ValueError(f"generation {g.question_id}: a token id that is not an integer")
