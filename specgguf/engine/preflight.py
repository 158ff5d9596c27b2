"""Everything settled before any weights load: both models' metadata, the vocabulary check,
and whether the models fit in memory."""

from __future__ import annotations

import dataclasses

from specgguf.engine.config import EngineConfig
from specgguf.errors import IncompatibleVocabError, UsageError
from specgguf.gguf.info import ModelInfo, read_model_info
from specgguf.gguf.vocab import CompatReport, check_compatibility
from specgguf.llama.memory import (
    ModelMemory,
    check_device_fits,
    check_fits,
    model_memory,
    offloaded_bytes,
)


@dataclasses.dataclass(frozen=True)
class Preflight:
    """What was found before loading: model facts, the vocabulary report (None without a
    draft model or without the check), the memory estimate (bytes), and the target's
    context size (``n_ctx``, 0 resolved to the model's training context) and the draft's."""

    target: ModelInfo
    draft: ModelInfo | None
    compat: CompatReport | None
    memory: list[ModelMemory]
    memory_needed: int
    n_ctx: int
    n_ctx_draft: int


def preflight(config: EngineConfig) -> Preflight:
    """Read the models' metadata (no weights), check the vocabularies and the memory
    estimate, as ``config`` asks. The draft is looked at only when it will be loaded.

    Raises:
        ModelNotFoundError, GGUFFormatError: a model file is missing or unreadable.
        ModelLoadError: llama.cpp would refuse to load the target or the draft (what its
            loader checks in the metadata and tensor directory; always checked).
        IncompatibleVocabError: the draft cannot draft for the target (``check_vocab``).
        InsufficientMemoryError: the models clearly do not fit (``check_memory``).
        UsageError: a device name that this llama.cpp build does not have.
    """
    draft = config.draft if config.loads_draft else None
    for m in (config.target, draft):
        if m is not None and m.devices:
            check_devices(m.devices)
    t_info = read_model_info(config.target.path)
    d_info = read_model_info(draft.path) if draft is not None else None
    t_info.require_loadable()
    if d_info is not None:
        d_info.require_loadable()
    compat = None
    if draft is not None and config.check_vocab:
        compat = check_compatibility(config.target.path, draft.path)
        if not compat.compatible:
            raise IncompatibleVocabError(
                [f.message for f in compat.errors], target=config.target.path, draft=draft.path
            )
    # 0: the model's training context
    n_ctx = config.target.n_ctx or t_info.context_length or 4096
    n_ctx_draft = n_ctx
    parts = [model_memory(t_info, n_ctx=n_ctx)]
    if d_info is not None and draft is not None:
        n_ctx_draft = draft.n_ctx or n_ctx
        parts.append(model_memory(d_info, n_ctx=n_ctx_draft))
    needed = check_fits(parts) if config.check_memory else sum(p.total for p in parts)
    if config.check_memory:
        ngls = [config.target.n_gpu_layers, draft.n_gpu_layers if draft else 0]
        _check_device(parts, [t_info, d_info], ngls)
    return Preflight(t_info, d_info, compat, parts, needed, n_ctx, n_ctx_draft)


def _check_device(parts: list[ModelMemory], infos: list[ModelInfo | None], ngls: list[int]) -> None:
    """Device memory, where this build offloads to a GPU (skipped on CPU-only builds)."""
    from specgguf.llama.runtime import build_info

    info = build_info()
    gpus = [d for d in info.devices if d.kind == "gpu"]
    if not info.gpu_offload or not gpus:
        return
    offloaded = [
        (part.name, offloaded_bytes(part, ngl, mi.block_count or 0))
        for part, mi, ngl in zip(parts, infos, ngls, strict=False)
        if mi is not None
    ]
    check_device_fits(offloaded, sum(d.memory_free for d in gpus))


def check_devices(names: tuple[str, ...]) -> None:
    """Raises UsageError unless every name is a device (not the CPU) of this build, as
    llama.cpp's ``parse_device_list`` requires; before anything loads."""
    from specgguf.llama.runtime import build_info

    known = [d.name for d in build_info().devices if d.kind != "cpu"]
    for name in names:
        if name not in known:
            have = f"devices: {', '.join(known)}" if known else "it has none besides the CPU"
            raise UsageError(f"no device {name!r} to offload to in this llama.cpp build ({have})")
