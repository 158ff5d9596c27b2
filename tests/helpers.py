"""Helpers for tests: the real ``specgguf`` entry point as a subprocess, an engine over
given models, and llama.cpp's own sampler chain as an oracle."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from specgguf.engine import Engine
    from specgguf.spec.sampling import SamplerParams

ROOT = Path(__file__).resolve().parent.parent


def run_cli(
    *args: str,
    input: str | bytes | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
    stdin: int | None = None,
) -> subprocess.CompletedProcess[bytes]:
    """Run ``python -m specgguf ARGS`` with stdout and stderr captured separately (bytes)."""
    full_env = {**os.environ, **(env or {})}
    data = input.encode() if isinstance(input, str) else input
    return subprocess.run(
        [sys.executable, "-m", "specgguf", *args],
        input=data,
        stdin=stdin if data is None else None,
        capture_output=True,
        env=full_env,
        timeout=timeout,
        check=False,
        cwd=ROOT,
    )


def load_engine(
    target: Path,
    draft: Path | None = None,
    *,
    drafter: str = "model",
    n_ctx: int = 4096,
    draft_max: int = 16,
    n_batch: int = 512,
) -> Engine:
    """An engine over ``target`` (and ``draft``) with the checks on; ``draft_max`` sizes
    the largest draft length a generation may ask for."""
    from specgguf.engine import Engine, EngineConfig, ModelConfig, SpeculativeConfig

    return Engine(
        EngineConfig(
            ModelConfig(target, n_ctx=n_ctx, n_batch=n_batch),
            ModelConfig(draft, n_ctx=n_ctx, n_batch=n_batch) if draft is not None else None,
            SpeculativeConfig(drafter=drafter, draft_max=draft_max),
        )
    )


def llama_cpp_chain(logits: npt.NDArray[np.float32], params: SamplerParams) -> dict[int, float]:
    """The candidates and probabilities llama.cpp's chain top_k -> top_p -> min_p -> temp
    leaves (common/sampling.cpp's order), with a softmax over the remaining logits (what
    ``llama_sampler_init_dist`` samples from). Filters that are off are not added, as in
    common/sampling.cpp."""
    import llama_cpp as lc

    n = logits.shape[0]
    data = (lc.llama_token_data * n)()
    for i, v in enumerate(logits.tolist()):
        data[i].id, data[i].logit, data[i].p = i, v, 0.0
    cur = lc.llama_token_data_array(data=data, size=n, selected=-1, sorted=False)
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    try:
        if params.top_k > 0:
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(params.top_k))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(params.top_p, 1))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_min_p(params.min_p, 1))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(params.temperature))
        lc.llama_sampler_apply(chain, ctypes.byref(cur))
        ids = [int(cur.data[i].id) for i in range(cur.size)]
        z = np.array([cur.data[i].logit for i in range(cur.size)], np.float64)
    finally:
        lc.llama_sampler_free(chain)
    p = np.exp(z - z.max())
    p /= p.sum()
    return dict(zip(ids, p.tolist(), strict=True))
