"""Python's time per speculative step, with llama.cpp's decode taken out
(``scripts/bench-overhead``): what a GPU's 2-10 ms steps pay on top of their own decodes.

The engine runs as it runs any pair, calibration included, but every ``llama_decode`` of
the target and the draft model goes to :class:`FreeDecode`, which reads the batch and
writes one-hot logits (the next token of a fixed text after each row's token) into a
buffer of its own. Its own time is subtracted: what is left per step is the loop, the
planner, the drafters, the samplers, the grammar and the backend's Python, with
llama.cpp's KV-cache calls (which stay real).
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from specgguf.engine.engine import Engine
from specgguf.llama.backend import LlamaContext
from specgguf.measure.bench import generate_together
from specgguf.speculative.draft import Draft
from specgguf.speculative.loop import (
    GenerationParams,
    GenerationResult,
    RowBuffers,
    top_probability,
)
from specgguf.speculative.sampling import SamplerParams
from specgguf.speculative.verification import accept

#: The text FreeDecode's logits follow (the draft model's differs at every fourth token).
TEXT = (
    "def is_palindrome(s: str) -> bool:\n    s = s.lower()\n    return s == s[::-1]\n\n"
    "The quick brown fox jumps over the lazy dog, and the dog sleeps on.\n"
)

#: The logit of a row's next token (the others are 0): at temperature 0.8 the rest of a
#: vocabulary of thousands of tokens is drawn about once in 10^8 draws.
PEAK = 20.0


class FreeDecode:
    """``llama_cpp``'s functions, but ``llama_decode`` decodes nothing: the logits of each
    output row are :data:`PEAK` at ``table[token]`` (the row's next token) and 0 elsewhere,
    in a buffer of ``rows`` rows that ``llama_get_logits`` returns; every other function is
    the real one. ``seconds``: the time spent in its ``llama_decode``; ``calls``: how many.

    Args:
        real: the ``llama_cpp`` module (or what stands for it).
        table: int64[n_vocab]: the token after each token.
        rows: the most output rows of a decode.
    """

    def __init__(self, real: Any, table: npt.NDArray[np.int64], rows: int) -> None:
        self._real = real
        self.table = table
        self.buf = np.zeros((rows, len(table)), np.float32)
        self._ptr = self.buf.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        self.seconds = 0.0
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def llama_decode(self, ctx: Any, batch: Any) -> int:
        t0 = time.perf_counter()
        n = batch.n_tokens
        tokens = np.ctypeslib.as_array(batch.token, shape=(n,))
        wanted = np.ctypeslib.as_array(batch.logits, shape=(n,)) != 0
        nxt = self.table[tokens[wanted]]
        self.buf[: len(nxt)] = 0.0
        self.buf[np.arange(len(nxt)), nxt] = PEAK
        self.calls += 1
        self.seconds += time.perf_counter() - t0
        return 0

    def llama_get_logits(self, ctx: Any) -> Any:
        return self._ptr


def next_token_tables(
    ids: Sequence[int], n_vocab: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """The target's table (int64[n_vocab]: each token of ``ids`` followed by the next,
    cyclically, where a token occurs twice the later; every other token by ``ids[0]``) and
    the draft model's (every fourth token of ``ids`` followed by the token after its
    target's next instead)."""
    target = np.full(n_vocab, ids[0], np.int64)
    for a, b in zip(ids, [*ids[1:], ids[0]], strict=True):
        target[a] = b
    draft = target.copy()
    for a in ids[::4]:
        draft[a] = ids[(list(ids).index(int(target[a])) + 1) % len(ids)]
    return target, draft


def _contexts(engine: Engine) -> list[LlamaContext]:
    """The engine's target and draft-model contexts, its parallel sequences' views too."""
    found: dict[int, LlamaContext] = {}
    for ctx in (engine.target_ctx, engine.draft_ctx,
                *(c for s in engine.slots for c in (s.ctx, s.draft_ctx))):  # fmt: skip
        if ctx is not None:
            found[id(ctx)] = ctx
    return list(found.values())


@contextlib.contextmanager
def free_decodes(engine: Engine) -> Iterator[list[FreeDecode]]:
    """Every context of ``engine`` on a :class:`FreeDecode` (one per model, the target's
    first) following :data:`TEXT`; the real functions back after.

    Raises:
        ValueError: the engine drafts with a head (MTP, EAGLE-3, DFlash, an assistant),
            whose contexts this does not reach.
    """
    if engine.head_kind:
        raise ValueError(f"a {engine.head_kind} head's decodes cannot be taken out")
    ids = engine.tokenize(TEXT, add_special=False)
    target_table, draft_table = next_token_tables(ids, engine.target_ctx.n_vocab)
    target_model = engine.target_ctx.model
    fakes: dict[int, FreeDecode] = {}
    swapped: list[tuple[LlamaContext, Any]] = []
    for ctx in _contexts(engine):
        table = target_table if ctx.model is target_model else draft_table
        fake = fakes.setdefault(id(ctx.model), FreeDecode(ctx._lc, table, ctx._logits_rows))
        swapped.append((ctx, ctx._lc))
        ctx._lc = fake  # type: ignore[assignment]  # (it stands for the module)
    try:
        yield sorted(fakes.values(), key=lambda f: f.table is not target_table)
    finally:
        for ctx, real in swapped:
            ctx._lc = real


@dataclasses.dataclass(frozen=True)
class Overhead:
    """Python's time of a run with free decodes: ``us_step`` microseconds a step (with
    several sequences: a sequence's step), ``us_token`` a generated token, ``steps``,
    ``tokens``, ``acceptance`` (accepted over drafted; 0 without drafts)."""

    us_step: float
    us_token: float
    steps: int
    tokens: int
    acceptance: float


def _overhead(seconds: float, results: Sequence[GenerationResult]) -> Overhead:
    steps = sum(r.stats.steps for r in results)
    tokens = sum(r.stats.generated for r in results)
    drafted = sum(r.stats.drafted for r in results)
    accepted = sum(r.stats.accepted for r in results)
    return Overhead(1e6 * seconds / max(1, steps), 1e6 * seconds / max(1, tokens), steps,
                    tokens, accepted / drafted if drafted else 0.0)  # fmt: skip


def _check(fakes: Sequence[FreeDecode], calls: int, results: Sequence[GenerationResult],
           followed: bool) -> None:  # fmt: skip
    if sum(f.calls for f in fakes) == calls:
        raise RuntimeError("no decode went through FreeDecode: the engine calls llama.cpp "
                           "some other way, and its decodes would be timed")  # fmt: skip
    table = fakes[0].table
    for r in results:
        pairs = zip(r.tokens, r.tokens[1:], strict=False)
        if followed and any(table[a] != b for a, b in pairs):
            raise RuntimeError("the output does not follow FreeDecode's text: something "
                               "other than it gave the logits")  # fmt: skip


@contextlib.contextmanager
def _as_before(engine: Engine) -> Iterator[None]:
    """A generation from the engine's timings and drafters' memories as they are now, which
    it leaves as they were: a free decode's time would teach auto mode that every batch is
    free (its next choices would follow), and a suffix corpus grown by the paths measured
    before would copy their answers."""
    timings = [*engine._timings.values(), *(t for s in engine.slots for t in s.timings.values())]
    saved = [copy.deepcopy(t) for t in timings]
    try:
        with engine.fresh_memory():
            yield
    finally:
        for t, before in zip(timings, saved, strict=True):
            for f in dataclasses.fields(t):
                setattr(t, f.name, getattr(before, f.name))


def measure(
    engine: Engine, fakes: Sequence[FreeDecode], ids: Sequence[int], params: GenerationParams
) -> Overhead:
    """One generation of ``params`` after the prompt ``ids`` on an engine under
    :func:`free_decodes` (``fakes``): Python's time per step, FreeDecode's subtracted. Each
    starts from the same timings and an empty suffix corpus (:func:`_as_before`).

    Raises:
        RuntimeError: no decode went through ``fakes``, or (without a grammar) the output
            does not follow their text: the figure would not be Python's alone.
    """
    spent, calls = sum(f.seconds for f in fakes), sum(f.calls for f in fakes)
    with _as_before(engine):
        t0 = time.perf_counter()
        res = engine.generate(list(ids), params).run()
        seconds = time.perf_counter() - t0
    seconds -= sum(f.seconds for f in fakes) - spent
    _check(fakes, calls, [res], params.grammar is None)
    return _overhead(seconds, [res])


def measure_together(
    engine: Engine, fakes: Sequence[FreeDecode], ids: Sequence[int], params: GenerationParams
) -> Overhead:
    """As :func:`measure`, the same prompt in every one of the engine's ``--parallel``
    sequences at once (:func:`specgguf.measure.bench.generate_together`): per sequence
    and step.

    Raises:
        RuntimeError: as :func:`measure`.
        UsageError: the engine was loaded for one sequence.
    """
    spent, calls = sum(f.seconds for f in fakes), sum(f.calls for f in fakes)
    with _as_before(engine):
        results, seconds = generate_together(engine, [list(ids)] * engine.n_parallel, params)
    seconds -= sum(f.seconds for f in fakes) - spent
    _check(fakes, calls, results, params.grammar is None)
    return _overhead(seconds, results)


#: A vocabulary of today's models (Qwen2.5's 151,936 tokens).
N_VOCAB = 151_936


def logit_rows(n_rows: int, n_vocab: int = N_VOCAB, seed: int = 0) -> npt.NDArray[np.float32]:
    """float32[n_rows, n_vocab] logits shaped as a confident model's: N(0, 3) with one
    token at 25, so that about 0.13% of a row (205 of 151,936) is within 16 of its top, as
    a median of 237 were on 48 rows of Qwen2.5 Coder 1.5B (the rest, in that model too,
    20 or more below it)."""
    rng = np.random.default_rng(seed)
    rows = (rng.standard_normal((n_rows, n_vocab)) * 3.0).astype(np.float32)
    rows[np.arange(n_rows), rng.integers(0, n_vocab, n_rows)] = 25.0
    return rows


def _whole_row_top_probability(row: npt.NDArray[np.float32], buf: npt.NDArray[np.float32]) -> float:
    """softmax(row).max() over every logit, in ``buf`` (as the loop read it before
    2026-12-07, its buffer reused from step to step)."""
    np.subtract(row, row.max(), out=buf)
    np.exp(buf, out=buf)
    return 1.0 / float(buf.sum())


def kept_draft(rows: npt.NDArray[np.float32]) -> Draft:
    """The draft whose verification by ``rows`` (float32[k + 1, n_vocab]) keeps every
    token, greedy: draft token i is row i's top token (row i is read after it)."""
    return Draft([int(t) for t in rows[:-1].argmax(axis=1)])


def vocab_work(k: int = 4, n_vocab: int = N_VOCAB, repeats: int = 50) -> dict[str, float]:
    """Microseconds a step of the loop's work that grows with the vocabulary, on
    :func:`logit_rows` (``k + 1`` rows: a verification of ``k`` drafts), the least of
    ``repeats``: ``greedy verification`` (each row's argmax), ``top-1 probability`` (what
    auto mode reads of the target's last row:
    :func:`~specgguf.speculative.loop.top_probability`), the same ``over the whole row``,
    and ``sampled verification`` (llama.cpp's default chain at temperature 0.8, the draft
    a point mass at each row's top token, :func:`kept_draft`: every row is read). With
    free decodes (:func:`measure`) a tiny model's vocabulary hides these costs."""
    rows = logit_rows(k + 1, n_vocab)
    draft = kept_draft(rows)
    whole = np.empty(n_vocab, np.float32)
    rng = np.random.default_rng(0)
    greedy, sampled = SamplerParams(temperature=0.0), SamplerParams(temperature=0.8)
    buffers = RowBuffers()
    work: dict[str, Callable[[], object]] = {
        "greedy verification": lambda: accept(draft, rows, greedy, rng),
        "top-1 probability": lambda: top_probability(rows[-1], buffers),
        "top-1 probability over the whole row": lambda: _whole_row_top_probability(rows[-1], whole),
        "sampled verification": lambda: accept(draft, rows, sampled, rng),
    }
    out: dict[str, float] = {}
    for name, fn in work.items():
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        out[name] = 1e6 * best
    return out
