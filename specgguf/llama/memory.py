"""Will the models fit? An estimate of the memory a target/draft pair needs, from GGUF
metadata alone, against what the machine has (psutil, and device memory where layers are
offloaded).

Estimate per model (bytes): the weights (the file sizes: llama.cpp maps them), the KV cache
(2 x n_layer x n_ctx x n_head_kv x head_dim x 2 bytes for F16 K and V; llama.cpp's
``llama_kv_cache`` with its default cache types), and the compute buffer, dominated by the
logits of the outputs reserved per micro-batch (n_vocab x n_outputs_max x 4) plus a margin
for activations (n_ubatch x n_embd x 4 x 16).
"""

from __future__ import annotations

import dataclasses

from specgguf.errors import InsufficientMemoryError, gib
from specgguf.gguf.info import ModelInfo

KV_BYTES_PER_VALUE = 2  # F16 K and V (llama.cpp's default cache type)


@dataclasses.dataclass(frozen=True)
class ModelMemory:
    """One model's share (bytes)."""

    name: str
    weights: int
    kv_cache: int
    compute: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute


def kv_cache_bytes(info: ModelInfo, n_ctx: int) -> int:
    """F16 K and V for ``n_ctx`` positions in every layer (0 when the shape is unknown)."""
    n_layer = info.block_count or 0
    n_head = info.head_count or 0
    n_head_kv = info.head_count_kv or n_head
    n_embd = info.embedding_length or 0
    if not (n_layer and n_head and n_embd):
        return 0
    head_dim = n_embd // n_head
    return 2 * n_layer * n_ctx * n_head_kv * head_dim * KV_BYTES_PER_VALUE


def model_memory(
    info: ModelInfo, *, n_ctx: int, n_ubatch: int = 512, n_outputs_max: int = 64
) -> ModelMemory:
    """The estimate for one model loaded with a context of ``n_ctx`` positions."""
    compute = info.vocab.n_tokens * n_outputs_max * 4
    compute += n_ubatch * (info.embedding_length or 0) * 4 * 16
    return ModelMemory(
        name=info.path.name,
        weights=info.file_size,
        kv_cache=kv_cache_bytes(info, n_ctx),
        compute=compute,
    )


def check_fits(parts: list[ModelMemory], *, available: int | None = None) -> int:
    """Raise when the models clearly do not fit in RAM; returns the bytes needed.

    ``available`` defaults to psutil's available memory (free plus reclaimable page
    cache, which includes model files already cached).

    Raises:
        InsufficientMemoryError: the estimate exceeds what is available.
    """
    needed = sum(p.total for p in parts)
    if available is None:
        import psutil

        available = int(psutil.virtual_memory().available)
    if needed > available:
        detail = ", ".join(
            f"{p.name}: weights {gib(p.weights)} + KV cache {gib(p.kv_cache)}"
            f" + compute {gib(p.compute)}"
            for p in parts
        )
        raise InsufficientMemoryError(
            f"the models need about {gib(needed)} of memory but {gib(available)} is "
            f"available ({detail})",
            needed=needed,
            available=available,
        )
    return needed


def offloaded_bytes(part: ModelMemory, n_gpu_layers: int, n_layer: int) -> int:
    """The share of a model that goes to the GPU with ``n_gpu_layers`` of ``n_layer``
    offloaded (-1: all), weights and KV cache in proportion to the layers."""
    if n_gpu_layers == 0 or n_layer <= 0:
        return 0
    layers = n_layer if n_gpu_layers < 0 else min(n_gpu_layers, n_layer)
    return (part.weights + part.kv_cache) * layers // n_layer + part.compute


def check_device_fits(offloaded: list[tuple[str, int]], device_free: int) -> int:
    """Raise when what is offloaded clearly exceeds the GPUs' free memory (bytes).

    Raises:
        InsufficientMemoryError: the offloaded share is larger than ``device_free``.
    """
    needed = sum(n for _, n in offloaded)
    if needed > device_free:
        detail = ", ".join(f"{name}: {gib(n)}" for name, n in offloaded)
        raise InsufficientMemoryError(
            f"the offloaded layers need about {gib(needed)} of GPU memory but "
            f"{gib(device_free)} is free ({detail})",
            needed=needed,
            available=device_free,
            gpu=True,
        )
    return needed
