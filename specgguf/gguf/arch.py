"""What an architecture's memory holds, and whether this llama.cpp can roll it back, by
``general.architecture`` (src/llama-arch.cpp of the llama.cpp that llama-cpp-python 0.3.36
vendors: ``llm_arch_is_recurrent``, ``llm_arch_is_hybrid``, ``llm_arch_supports_rs_rollback``).

A recurrent state is one value per sequence, not one per position, so a speculative step
cannot drop its rejected drafts by cutting the cache. llama.cpp keeps per-token snapshots
of the state (``llama_context_params.n_rs_seq``) for the architectures of
:data:`ROLLBACK_ARCHS`; as targets, the others drop rejected drafts by checkpoint and
replay (``backend.LlamaContext``'s ``replay``, as llama-server does), and as drafts they
draft in a copy of their sequence (``backend.LlamaContext.scratch``).
"""

from __future__ import annotations

from typing import Literal

MemoryKind = Literal["attention", "recurrent", "hybrid"]

RECURRENT_ARCHS = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
HYBRID_ARCHS = frozenset({
    "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h",
    "nemotron_h_moe", "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next",
    "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "minimax-01",
})  # fmt: skip
#: Recurrent or hybrid architectures whose state llama.cpp snapshots per token.
ROLLBACK_ARCHS = frozenset({
    "kimi-k3", "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "glm5-next", "nemotron_h",
    "nemotron_h_moe", "lfm2", "lfm2moe", "bailingmoe3",
})  # fmt: skip

#: Architectures built on llama.cpp's gated delta-net (src/models/delta-net-base.cpp),
#: which computes 64 or more tokens of a micro-batch by another algorithm than fewer.
DELTA_NET_ARCHS = frozenset({
    "qwen3next", "qwen35", "qwen35moe", "qwen4exp", "kimi-linear", "kimi-k3", "glm5-next",
    "bailingmoe3",
})  # fmt: skip


def memory_kind(arch: str | None) -> MemoryKind:
    """ "recurrent", "hybrid" (attention and recurrent layers) or "attention"."""
    if arch in RECURRENT_ARCHS:
        return "recurrent"
    if arch in HYBRID_ARCHS:
        return "hybrid"
    return "attention"


def rolls_back(arch: str | None) -> bool:
    """Whether rejected drafts can be dropped from this architecture's memory by cutting
    it: always for attention alone, through snapshots for :data:`ROLLBACK_ARCHS` (else
    by checkpoint and replay, which costs a copy of the state per verification)."""
    return memory_kind(arch) == "attention" or arch in ROLLBACK_ARCHS


def describe(arch: str | None) -> str:
    """``qwen35 (hybrid: attention + recurrent state, rolled back by snapshots)``"""
    kind = memory_kind(arch)
    if kind == "attention":
        return f"{arch or 'unknown'} (attention)"
    what = "recurrent state" if kind == "recurrent" else "hybrid: attention + recurrent state"
    how = "rolled back by snapshots" if rolls_back(arch) else "rolled back by checkpoint and replay"
    return f"{arch} ({what}, {how})"
