"""Everything settled before any weights load: both models' metadata, the vocabulary check,
the RPC servers (each one answers, and its free memory), and the memory plan: which layers
go where, and whether every place holds its share."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from specgguf.engine.config import EngineConfig, ModelConfig, uses_mtp, verify_draft_max
from specgguf.engine.drafter_map import check_rules, head_of_draft
from specgguf.errors import BackendError, IncompatibleVocabError, UsageError
from specgguf.gguf.arch import DRAFT_HEAD_ARCHS, article, describe, rolls_back
from specgguf.gguf.info import ModelInfo, read_model_info
from specgguf.gguf.projector import check_projector
from specgguf.gguf.vocab import CompatReport, check_compatibility
from specgguf.llama.memory import (
    DRAFT_PROJECTOR,
    LOCAL,
    PROJECTOR,
    MemoryPlan,
    ModelMemory,
    ModelPlacement,
    Place,
    Share,
    available_memory,
    check_plan,
    model_memory,
    place_model,
    projector_memory,
)
from specgguf.llama.rpc import RpcServerInfo, parse_endpoints, probe


@dataclasses.dataclass(frozen=True)
class Preflight:
    """What was found before loading: model facts, the vocabulary report (None without a
    draft model or without the check), the memory estimate (bytes) and plan, the RPC
    servers' answers, and the target's context size (``n_ctx``, 0 resolved to the model's
    training context) and the draft's."""

    target: ModelInfo
    draft: ModelInfo | None
    compat: CompatReport | None
    memory: list[ModelMemory]
    memory_needed: int
    n_ctx: int
    n_ctx_draft: int
    plan: MemoryPlan | None = None
    servers: tuple[RpcServerInfo, ...] = ()


def probe_servers(endpoints: Sequence[str], timeout: float) -> dict[str, RpcServerInfo]:
    """Each RPC server's answer (:func:`specgguf.llama.rpc.probe`), by ``host:port``.

    Raises:
        RpcServerError: a server that does not answer, named.
    """
    return {str(ep): probe(ep, timeout=timeout) for ep in parse_endpoints(endpoints)} if \
        endpoints else {}  # fmt: skip


def server_places(info: RpcServerInfo) -> list[Place]:
    """An RPC server's devices as places: ``host:port``, with ``#i`` when it has several."""
    several = len(info.devices) > 1
    return [
        Place(f"{info.endpoint}#{d.index}" if several else str(info.endpoint), "rpc",
              d.memory_free, d.memory_total)
        for d in info.devices
    ]  # fmt: skip


def local_gpu_places() -> list[Place]:
    """This machine's GPUs as llama.cpp uses them by default (integrated GPUs only when
    there is no discrete one), with their free memory; none on CPU-only builds.

    Raises:
        BackendError: llama-cpp-python cannot be imported.
    """
    from specgguf.llama.runtime import build_info

    info = build_info()
    if not info.gpu_offload:
        return []
    gpus = [d for d in info.devices if d.kind == "gpu" and not d.name.startswith("RPC")]
    chosen = gpus or [d for d in info.devices if d.kind == "igpu"]
    return [Place(d.name, "gpu", d.memory_free, d.memory_total) for d in chosen]


def named_places(names: Sequence[str]) -> list[Place]:
    """This machine's devices of those ggml names (``ModelConfig.devices``, checked by
    :func:`check_devices`), in that order, with their free memory.

    Raises:
        BackendError: llama-cpp-python cannot be imported.
    """
    from specgguf.llama.runtime import build_info

    by_name = {d.name: d for d in build_info().devices if d.kind != "cpu"}
    return [
        Place(n, "gpu", by_name[n].memory_free, by_name[n].memory_total)
        for n in names
        if n in by_name
    ]


def model_devices(
    m: ModelConfig, servers: Mapping[str, RpcServerInfo], gpus: Sequence[Place]
) -> list[Place]:
    """The devices a model's layers may go to, in llama.cpp's order: its RPC servers'
    devices, then this machine's GPUs (``gpus``, or the ones ``m.devices`` names).

    Raises:
        UsageError: a tensor split with more proportions than the model has devices.
    """
    local = list(gpus) if m.devices is None else named_places(m.devices)
    devices = [p for ep in m.rpc for p in server_places(servers[ep])] + local
    if len(m.tensor_split) > len(devices):
        names = ", ".join(d.name for d in devices) or "none: no GPU and no RPC server"
        raise UsageError(
            f"{m.path.name}: a tensor split of {len(m.tensor_split)} proportions, but its "
            f"layers have {len(devices)} devices to go to ({names})"
        )
    return devices


def memory_plan(
    config: EngineConfig,
    target: ModelInfo,
    draft: ModelInfo | None,
    n_ctx: int,
    n_ctx_draft: int,
    *,
    servers: Mapping[str, RpcServerInfo],
    local_free: int | None = None,
    gpus: Sequence[Place] | None = None,
) -> MemoryPlan:
    """Where each model's layers go and what every place needs (bytes), from metadata and
    the servers' answers; ``local_free`` (bytes, default: psutil's available memory) and
    ``gpus`` (default: this build's GPUs) stand in for this machine, to plan for another.

    Raises:
        UsageError: a tensor split longer than a model's device list.
    """
    gpus = local_gpu_places() if gpus is None else gpus
    local = Place(LOCAL, "local", available_memory() if local_free is None else local_free)
    places: dict[str, Place] = {LOCAL: local}
    models = []
    pairs = [(config.target, target, n_ctx)]
    if draft is not None and config.draft is not None:
        pairs.append((config.draft, draft, n_ctx_draft))
    for m, info, ctx in pairs:
        devices = model_devices(m, servers, gpus)
        places.update({d.name: d for d in devices})
        if info is target:
            mem = model_memory(info, n_ctx=ctx, snapshots=target_snapshots(config, info),
                               mtp=target_mtp(config, info), n_seq=config.n_parallel,
                               hidden_layers=len(head_layers(config, draft)))  # fmt: skip
        else:
            mem = model_memory(info, n_ctx=ctx, snapshots=draft_snapshots(info),
                               n_seq=config.n_parallel)  # fmt: skip
        models.append(
            place_model(info, mem, devices, n_gpu_layers=m.n_gpu_layers,
                        tensor_split=m.tensor_split)
        )  # fmt: skip
    cache = prompt_cache_bytes(config, target)
    if cache:
        models.append(ModelPlacement(PROMPT_CACHE, (), {LOCAL: Share(kv_cache=cache)}))
    for name, path in ((PROJECTOR, config.mmproj), (DRAFT_PROJECTOR, config.mmproj_draft)):
        if path is None or (name == DRAFT_PROJECTOR and not config.loads_draft):
            continue
        share = projector_memory(path)  # (libmtmd reads it through this machine's memory)
        shares = {LOCAL: share}
        if config.mmproj_offload and gpus:  # (clip.cpp's weights on the first GPU)
            places.setdefault(gpus[0].name, gpus[0])
            shares[gpus[0].name] = share
        models.append(ModelPlacement(name, (), shares))
    return MemoryPlan(tuple(places.values()), tuple(models))


def memory_left(checked: Preflight) -> int:
    """Bytes of this machine's available memory the checked plan leaves (0 when it is
    unknown or full)."""
    plan = checked.plan
    if plan is None:
        return 0
    local = next((p for p in plan.places if p.name == LOCAL), None)
    if local is None or local.free is None:
        return 0
    return max(0, local.free - plan.need(LOCAL))


#: The name of the prompt cache's share in a memory plan.
PROMPT_CACHE = "prompt cache"


def prompt_cache_bytes(config: EngineConfig, target: ModelInfo) -> int:
    """Host memory for prompts kept between requests (bytes): the prompt cache's budget
    (``CacheConfig.ram``) and, for a recurrent or hybrid target, each sequence's
    checkpoints of its state (``ctx_checkpoints`` copies of it at most)."""
    checkpoints = 0
    if target.memory != "attention":
        checkpoints = target.recurrent_state_bytes * config.cache.ctx_checkpoints
    return config.cache.ram + checkpoints * config.n_parallel


def target_snapshots(config: EngineConfig, info: ModelInfo) -> int:
    """Recurrent-state snapshots the target's context keeps (``n_rs_seq``): one per draft
    token a verification may reject, for an architecture llama.cpp snapshots; else 0."""
    if info.memory == "attention" or not rolls_back(info.architecture):
        return 0
    return verify_draft_max(config.speculative, info.memory, info.architecture)


def target_mtp(config: EngineConfig, info: ModelInfo) -> bool:
    """Whether the target's MTP layers are loaded to draft (:func:`uses_mtp`)."""
    return uses_mtp(config, info.nextn_layers, rolls_back=rolls_back(info.architecture))


def head_layers(config: EngineConfig, draft: ModelInfo | None) -> tuple[int, ...]:
    """The target's layers whose inputs a draft head reads at every position (an EAGLE-3
    head loaded as the draft: its ``target_layers``), else none."""
    if draft is None or not config.loads_draft or head_of_draft(draft.architecture) is None:
        return ()
    return draft.target_layers


def draft_snapshots(info: ModelInfo) -> int:
    """A recurrent draft model's second state: the copy of its sequence it drafts in."""
    return 0 if info.memory == "attention" else 1


def check_speculation(
    config: EngineConfig, target: ModelInfo, draft: ModelInfo | None = None
) -> None:
    """Refuse, before anything loads, what the target's architecture cannot do: token
    trees and deterministic mode on a recurrent state, and the drafter's own rules (its registry
    entry: :func:`specgguf.engine.drafter_map.check_rules`).

    Raises:
        UsageError: one line naming the architecture and what to use instead.
    """
    spec, arch = config.speculative, describe(target.architecture)
    check_rules(config, target, draft)
    if target.memory == "attention":
        return
    if config.deterministic:
        raise UsageError(f"deterministic mode is not supported on a recurrent state; the "
                         f"target is {arch}")  # fmt: skip
    if spec.draft_tree >= 2 and spec.drafter != "auto":  # (one branch is a chain)
        raise UsageError(f"token trees: a recurrent state cannot hold one; the target is "
                         f"{arch}: draft chains (no tree branches)")  # fmt: skip


def preflight(config: EngineConfig) -> Preflight:
    """Read the models' metadata (no weights), check the vocabularies, ask every RPC server
    for its version and free memory, and check the memory plan, as ``config`` asks. The
    draft is looked at only when it will be loaded.

    Raises:
        ModelNotFoundError, GGUFFormatError: a model file is missing or unreadable.
        ModelLoadError: llama.cpp would refuse to load the target or the draft (what its
            loader checks in the metadata and tensor directory; always checked).
        IncompatibleVocabError: the draft cannot draft for the target (``check_vocab``).
        BackendError: RPC servers are given but this llama.cpp build has no RPC backend.
        RpcServerError: an RPC server does not answer (named), before anything loads.
        UsageError: a device name that this llama.cpp build does not have; a tensor split
            longer than a model's device list.
        InsufficientMemoryError: some place clearly cannot hold its share
            (``check_memory``).
    """
    draft = config.draft if config.loads_draft else None
    for m in (config.target, draft):
        if m is not None and m.devices:
            check_devices(m.devices)
    t_info = read_model_info(config.target.path)
    d_info = read_model_info(draft.path) if draft is not None else None
    t_info.require_loadable()
    if config.mmproj is not None:
        check_projector(config.mmproj, t_info.embedding_length)
    if config.mmproj_draft is not None and d_info is not None:
        check_projector(config.mmproj_draft, d_info.embedding_length, model="draft model")
    if t_info.architecture in DRAFT_HEAD_ARCHS:
        arch = t_info.architecture
        raise UsageError(f"{t_info.path.name} is {article(arch)} {arch} draft head, not a "
                         "model: it drafts for a target, as its draft model")  # fmt: skip
    check_speculation(config, t_info, d_info)
    if d_info is not None:
        d_info.require_loadable()
        if config.n_parallel > 1 and d_info.memory != "attention":
            raise UsageError(
                f"the draft {d_info.path.name} is {describe(d_info.architecture)}: it drafts "
                "for one sequence at a time; serve one request at a time with it, or use a draft "
                "with a KV cache only"
            )
    compat = None
    if draft is not None and config.check_vocab:
        compat = check_compatibility(config.target.path, draft.path)
        if not compat.compatible:
            raise IncompatibleVocabError(
                [f.message for f in compat.errors], target=config.target.path, draft=draft.path
            )
    if config.rpc_servers:
        from specgguf.llama.rpc import supported

        if not supported():
            raise BackendError(
                "this llama.cpp build has no RPC backend (it was built without GGML_RPC=ON)",
                hint="reinstall with scripts/install, which builds it in",
            )
    servers = probe_servers(config.rpc_servers, config.rpc_timeout)
    # 0: the model's training context; a model that gives none: the default size
    n_ctx = config.target.n_ctx or t_info.context_length or ModelConfig.n_ctx
    n_ctx_draft = n_ctx
    n_seq = config.n_parallel
    parts = [model_memory(t_info, n_ctx=n_ctx, snapshots=target_snapshots(config, t_info),
                          mtp=target_mtp(config, t_info), n_seq=n_seq,
                          hidden_layers=len(head_layers(config, d_info)))]  # fmt: skip
    if d_info is not None and draft is not None:
        n_ctx_draft = draft.n_ctx or n_ctx
        parts.append(model_memory(d_info, n_ctx=n_ctx_draft, snapshots=draft_snapshots(d_info),
                                  n_seq=n_seq))  # fmt: skip
    plan = memory_plan(config, t_info, d_info, n_ctx, n_ctx_draft, servers=servers)
    needed = check_plan(plan) if config.check_memory else plan.need(LOCAL)
    return Preflight(t_info, d_info, compat, parts, needed, n_ctx, n_ctx_draft, plan,
                     tuple(servers.values()))  # fmt: skip


def check_devices(names: tuple[str, ...]) -> None:
    """Raises UsageError unless every name is a device (not the CPU) of this build, as
    llama.cpp's ``parse_device_list`` requires; before anything loads."""
    from specgguf.llama.runtime import build_info

    known = [d.name for d in build_info().devices if d.kind != "cpu"]
    for name in names:
        if name not in known:
            have = f"devices: {', '.join(known)}" if known else "it has none besides the CPU"
            raise UsageError(f"no device {name!r} to offload to in this llama.cpp build ({have})")
