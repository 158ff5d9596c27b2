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

from collections.abc import Callable
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


def article(word: str | None) -> str:
    """``a`` or ``an`` before ``word`` as written (an eagle3 head, a dflash head)."""
    return "an" if (word or "")[:1].lower() in ("a", "e", "i", "o", "u") else "a"


#: Architectures that are draft heads, not models: they draft for a target and generate
#: nothing alone (llama.cpp's ``draft-eagle3``, ``draft-dflash``, Gemma 4's MTP assistant).
DRAFT_HEAD_ARCHS = frozenset({"eagle3", "dflash", "gemma4-assistant"})

#: Architectures whose llama.cpp graph keeps the inputs of its layers, which
#: ``llama_set_embeddings_layer_inp`` asks for and an EAGLE-3 head reads (the models of
#: src/models/*.cpp that set ``res->t_layer_inp``; for any other, llama.cpp asserts and
#: aborts at the first decode).
LAYER_INPUT_ARCHS = frozenset({
    "bailingmoe3", "deepseek4", "gemma4", "hunyuan_vl", "lfm2", "llama", "mimo2",
    "minimax-01", "minimax-m2", "muse-glimmer", "nanbeige", "nemotron_h", "gpt-oss", "qwen3",
    "qwen35", "qwen35moe", "qwen3moe", "qwen3next", "qwen4exp",
})  # fmt: skip


def head_width(head_arch: str | None, key: Callable[[str], int | None]) -> int:
    """The width of the target a draft head of ``head_arch`` was made for, from its
    ``{arch}.*`` integers (``key("embedding_length")``): an EAGLE-3 head's
    ``target_hidden_size``, an MTP assistant's ``embedding_length_out``, a DFlash draft's
    own width (it reads a target as wide as itself); 0 for a model."""
    name = {"eagle3": "target_hidden_size", "gemma4-assistant": "embedding_length_out",
            "dflash": "embedding_length"}.get(head_arch or "")  # fmt: skip
    return (key(name) or 0) if name else 0


def head_fit(
    target_arch: str | None,
    target_width: int | None,
    target_layers: int | None,
    head_arch: str | None,
    head_layers: tuple[int, ...],
    head_width: int | None,
) -> list[str]:
    """Why a draft head (``head_arch``: "eagle3" or "dflash", reading the inputs of
    ``head_layers`` of a target ``head_width`` wide: an EAGLE-3 head's
    ``target_hidden_size``, a DFlash draft's own width; "gemma4-assistant", reading a gemma4
    target's cache, ``head_width`` its ``embedding_length_out``) cannot draft for a
    target of ``target_arch``, ``target_width`` and ``target_layers`` layers, in words;
    empty where it can, or where the draft is no such head. (llama.cpp checks none of it: a
    head made for another model reads rows of another width, or layers the target does not
    have.)"""
    if head_arch == "gemma4-assistant":
        out = []
        if target_arch != "gemma4":
            out.append(f"the MTP assistant drafts for a gemma4 target, and this one is "
                       f"{target_arch}")  # fmt: skip
        if head_width and target_width and head_width != target_width:
            out.append(f"the MTP assistant was made for a target {head_width} wide, and this "
                       f"one is {target_width} wide")  # fmt: skip
        return out
    name = {"eagle3": "EAGLE-3 head", "dflash": "DFlash draft"}.get(head_arch or "")
    if name is None:
        return []
    out = []
    if target_arch not in LAYER_INPUT_ARCHS:
        out.append(f"llama.cpp keeps no layer inputs of a {target_arch} target, which "
                   f"{'an' if head_arch == 'eagle3' else 'a'} {name} reads")  # fmt: skip
    if head_arch == "eagle3" and len(head_layers) != 3:
        out.append(f"the EAGLE-3 head names {len(head_layers)} target layers, not 3")
    if not head_layers:
        out.append(f"the {name} names no target layers")
    if head_width and target_width and head_width != target_width:
        out.append(f"the {name} was made for a target {head_width} wide, and this one is "
                   f"{target_width} wide")  # fmt: skip
    if target_layers and any(not 0 <= lid < target_layers for lid in head_layers):
        out.append(f"the {name} reads layers {list(head_layers)}, and the target has "
                   f"{target_layers} layers")  # fmt: skip
    return out
