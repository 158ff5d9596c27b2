"""Are llama.cpp's kernels batch-invariant? How far batched evaluation strays from
one-token decoding, and the batch shapes that give every row the same logits.

llama.cpp's CPU kernels change algorithm with the batch: repacked GEMM from 4 rows (tiles of
4 rows, gemv below), the plain path from 8 rows, and FlashAttention's split-KV path for a
single token once more than 256 positions are cached. Logits then differ by up to about
0.6 between a verification batch and the target alone's one-token decode, enough to flip a
near-tie. Measured on Qwen2.5-Coder 1.5B Q4_K_M with this project's CPU build (AVX-512, no
AMX): with weight repacking, rows of 2- and 3-row batches equal each other and the first row
of a 2-row batch, 4 or more rows differ; without repacking, 2 to 7 rows agree; a lone row
agrees below 256 cached positions and differs above.

Deterministic mode uses that: every evaluation that returns logits is decoded in batches of
2 to R rows (:meth:`specgguf.llama.backend.LlamaContext.eval` with ``rows_per_decode``),
a lone row padded with a throw-away second row, except where a lone row agrees with the
batches as it is. With an f16 K cache that is while no more than :data:`LONE_ROW_LIMIT`
positions are cached; with a q8_0 K cache (what deterministic mode uses) at every position,
because FlashAttention's split-KV path takes f16 and f32 caches only, so no throw-away row
is needed at all (Qwen 1.5B, AVX2: a lone row at 2000 cached positions 86 ms, padded with
f16 131 ms). :func:`deterministic_rows` finds R for a model, build and K cache type, and
where lone rows agree, by measurement, and caches both.

Where a lone row goes another way, found with llama.cpp's graph callback (``cb_eval``) on
the model above, comparing every tensor of a one-token decode with the same token's row of
a 2-row batch at 300 cached positions: with FlashAttention off the first tensor that
differs is ``kq`` (the K*Q matrix product: another kernel for one row than for two), with
it on the attention itself (its split-KV path for one row); every tensor before attention
(norms, the Q/K/V projections, RoPE) is identical.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from specgguf.cache import cache_dir, read_json_cache, update_json_cache
from specgguf.llama.backend import LlamaContext, LlamaModel, default_threads
from specgguf.llama.runtime import build_info, build_key

#: Lone rows agree with batches while at most this many positions are cached (llama.cpp
#: pads the attended KV cells to multiples of 256, and takes FlashAttention's split-KV path
#: for a single row only past that): a deterministic generation decodes a lone row without
#: a throw-away second row up to here, when the probe found them equal.
LONE_ROW_LIMIT = 256

#: ``lone_rows_max`` when lone rows agree with the batches at every position.
NO_LIMIT = 1 << 40

#: The probe's text: long enough to pass 256 cached positions, where paths change.
_PROBE_TEXT = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}" for i in range(60))


def batch_invariance(
    model: LlamaModel,
    prompt: Sequence[int],
    sizes: Sequence[int],
    *,
    n_ctx: int = 512,
    n_threads: int | None = None,
) -> dict[int, float]:
    """How far batched evaluation strays from one-token-at-a-time evaluation.

    Greedy-decodes ``max(sizes)`` tokens after ``prompt`` one token per ``llama_decode``
    (how a target alone generates), then re-evaluates them in one batch of each size (how
    a verification step does) and returns, per size, the largest absolute logit
    difference over the batch. 0.0 means bit-identical kernels.

    Raises:
        BackendError: a decode failed.
    """
    n = max(sizes)
    with model.new_context(n_ctx=n_ctx, n_batch=max(n, 32), n_threads=n_threads) as ctx:
        ctx.eval(prompt[:-1], logits="none")
        seq = [prompt[-1]]
        single = []
        for _ in range(n):
            row = ctx.eval([seq[-1]], logits="last")[-1].copy()
            single.append(row)
            seq.append(int(row.argmax()))
        out: dict[int, float] = {}
        for size in sizes:
            ctx.rollback(len(prompt) - 1)
            rows = ctx.eval(seq[:size], logits="all")
            out[size] = max(float(np.abs(rows[i] - single[i]).max()) for i in range(size))
    return out


def row_differences(
    ctx: LlamaContext, prompt: Sequence[int], *, n_rows: int = 12, max_rows: int = 8
) -> dict[int, float]:
    """For each batch size b in 1..``max_rows``: the largest absolute logit difference
    between ``n_rows`` rows evaluated in batches of b rows and the same rows evaluated one
    at a time as the first of a 2-row batch (the reference). Size 1 is a plain one-token
    decode. The reference is taken twice: a key ``0`` holds how far it differs from itself
    (nonzero: the kernels are not even reproducible). The context's KV cache ends empty.

    Raises:
        BackendError: a decode failed.
    """
    saved = ctx.rows_per_decode
    ctx.set_rows_per_decode(None)
    try:
        ctx.rollback(0)
        ctx.eval(prompt[:-1], logits="none")
        base = len(prompt) - 1
        seq = [prompt[-1]]
        for _ in range(n_rows):  # the tokens: a greedy continuation
            seq.append(int(ctx.eval([seq[-1]], logits="last")[-1].argmax()))

        def padded_rows() -> list[npt.NDArray[np.float32]]:
            rows = []
            for i in range(n_rows):
                ctx.rollback(base + i)
                ctx.set_rows_per_decode(2)  # a lone row with a throw-away second row
                rows.append(ctx.eval([seq[i]], logits="last")[0].copy())
                ctx.set_rows_per_decode(None)
            return rows

        ref = padded_rows()
        out = {0: _max_diff(padded_rows(), ref)}
        for b in range(1, max_rows + 1):
            got: list[npt.NDArray[np.float32]] = []
            for start in range(0, n_rows, b):
                ctx.rollback(base + start)
                rows = ctx.eval(seq[start : min(start + b, n_rows)], logits="all")
                got.extend(r.copy() for r in rows)
            out[b] = _max_diff(got, ref)
        ctx.rollback(0)
        return out
    finally:
        ctx.set_rows_per_decode(saved)


def lone_row_difference(
    ctx: LlamaContext,
    prompt: Sequence[int],
    *,
    limit: int = LONE_ROW_LIMIT,
    n_rows: int = 8,
    past: bool = False,
) -> float:
    """The largest absolute logit difference between a lone row (a plain one-token decode)
    and the same row as the first of a 2-row batch (the reference of deterministic mode),
    over ``n_rows`` positions ending at ``limit`` cached positions and ``n_rows`` early
    ones; with ``past``, over ``n_rows`` positions from ``limit + 28`` on instead (where
    FlashAttention takes its split-KV path for a lone row with an f16 K cache). 0.0: lone
    rows may go without padding there. The KV cache ends empty.

    Raises:
        ValueError: the prompt is too short to reach the positions.
        BackendError: a decode failed.
    """
    starts = (limit + 28,) if past else (8, limit - n_rows)
    if len(prompt) < max(starts) + n_rows:
        raise ValueError(
            f"a prompt of {max(starts) + n_rows} tokens at least is needed, not {len(prompt)}"
        )
    saved, saved_lone = ctx.rows_per_decode, ctx.lone_rows_max
    try:
        worst = 0.0
        ctx.set_lone_rows_max(0)  # the reference: padded
        for start in starts:
            ctx.set_rows_per_decode(None)
            ctx.rollback(0)
            ctx.eval(prompt[:start], logits="none")
            for i in range(start, start + n_rows):
                ctx.set_rows_per_decode(None)
                lone = ctx.eval([prompt[i]], logits="last")[0].copy()
                ctx.rollback(i)
                ctx.set_rows_per_decode(2)
                ref = ctx.eval([prompt[i]], logits="last")[0]
                worst = max(worst, float(np.abs(lone - ref).max()))
        ctx.set_rows_per_decode(None)
        ctx.rollback(0)
        return worst
    finally:
        ctx.set_rows_per_decode(saved)
        ctx.set_lone_rows_max(saved_lone)


def lone_rows_max(diffs: dict[int, float]) -> int:
    """Positions up to which deterministic mode decodes a lone row without padding:
    :data:`NO_LIMIT` when the probe found lone rows equal to the reference below and past
    :data:`LONE_ROW_LIMIT` cached positions (keys -1 and -2 of :func:`deterministic_rows`'
    differences; a q8_0 K cache), the limit when only below it, else 0."""
    if diffs.get(-1) != 0.0:
        return 0
    return NO_LIMIT if diffs.get(-2) == 0.0 else LONE_ROW_LIMIT


def _max_diff(a: list[npt.NDArray[np.float32]], b: list[npt.NDArray[np.float32]]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def invariant_rows(diffs: dict[int, float]) -> int:
    """The largest R such that batches of 2..R rows all give the reference's logits
    exactly (0: not even 2 rows, or the reference is not reproducible)."""
    if diffs.get(0, 1.0) != 0.0:
        return 0
    r = 0
    for b in range(2, max(diffs) + 1):
        if diffs.get(b) != 0.0:
            break
        r = b
    return r


def _probe_key(model: LlamaModel, n_threads: int, type_k: str) -> str:
    st = Path(model.path).stat()
    parts = [build_key(build_info()), f"{Path(model.path).resolve()}:{st.st_size}:{st.st_mtime_ns}",
             str(model.use_extra_bufts), str(n_threads), f"lone{LONE_ROW_LIMIT}+",
             type_k]  # fmt: skip
    parts += [model.placement] if model.placement else []  # layers on RPC servers
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def deterministic_rows(
    model: LlamaModel,
    *,
    n_threads: int | None = None,
    max_rows: int = 8,
    cache: bool = True,
    type_k: str = "f16",
) -> tuple[int, dict[int, float]]:
    """R for deterministic mode on ``model`` with this build, repacking setting and thread
    count: the largest number of rows per decode for which every row's logits are
    bit-identical whatever the batch (2..R rows, lone rows padded), measured past 256
    cached positions (a few seconds) and cached in ``~/.cache/specgguf/invariance.json``.
    Returns (R, the measured differences by batch size, and under key -1 the lone rows'
    below :data:`LONE_ROW_LIMIT` cached positions, under -2 past it, see
    :func:`lone_rows_max`); R is 0 when no shape works. ``type_k``: the K cache's data type
    (:data:`specgguf.llama.backend.KV_CACHE_TYPES`), measured with it.

    Raises:
        BackendError: a decode failed.
    """
    threads = n_threads or default_threads()
    key = _probe_key(model, threads, type_k)
    path = cache_dir() / "invariance.json"
    hit = read_json_cache(path).get(key) if cache else None
    if isinstance(hit, dict) and "diffs" in hit:
        diffs = {int(k): float(v) for k, v in hit["diffs"].items()}
        return invariant_rows(diffs), diffs
    prompt = model.tokenize(_PROBE_TEXT, add_special=False)[:300]
    # reserve: the position of a lone row's throw-away row, as deterministic mode's own
    with model.new_context(
        n_ctx=512,
        n_batch=64,
        n_threads=n_threads,
        n_outputs_max=max_rows + 1,
        reserve=1,
        type_k=type_k,
    ) as ctx:
        diffs = row_differences(ctx, prompt, max_rows=max_rows)
        diffs[-1] = lone_row_difference(ctx, prompt)
        diffs[-2] = lone_row_difference(ctx, prompt, past=True)
    update_json_cache(path, key, {"diffs": diffs})
    return invariant_rows(diffs), diffs
