"""Memory plans without loading anything: which layers of a target/draft pair go to this
machine, its GPUs and RPC servers, and what each needs, for servers that answer now or
for servers described by their free memory alone (planning before any exists), and the
fewest servers of a given size that hold a pair.

The numbers come from the models' GGUF metadata (tensor sizes per layer, KV cache shape)
and llama.cpp's own layer split (:func:`specgguf.llama.memory.assign_layers`); see
:mod:`specgguf.llama.memory` for the estimate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from specgguf.engine.config import EngineConfig, ModelConfig
from specgguf.engine.preflight import memory_plan, probe_servers
from specgguf.errors import UsageError
from specgguf.gguf.info import ModelInfo, read_model_info
from specgguf.gguf.projector import check_projector
from specgguf.llama.memory import LOCAL, MemoryPlan, Place
from specgguf.llama.rpc import RPC_PROTO_VERSION, RpcDevice, RpcServerInfo, parse_endpoints

#: Placeholder names of servers that do not exist yet (``fewest_servers``).
PLACEHOLDER = "server-{}:50052"


@dataclasses.dataclass(frozen=True)
class PlacementPlan:
    """A configuration and its memory plan. ``fits`` when no place is short;
    ``servers`` are the RPC servers' answers (or the stand-ins for them)."""

    config: EngineConfig
    plan: MemoryPlan
    target: ModelInfo
    draft: ModelInfo | None
    n_ctx: int
    n_ctx_draft: int
    servers: tuple[RpcServerInfo, ...]

    @property
    def fits(self) -> bool:
        return not self.plan.over()

    def utilisation(self) -> float:
        """The largest share of free memory any place would use (1.0: full)."""
        return max((self.plan.need(p.name) / p.free for p in self.plan.places if p.free),
                   default=0.0)  # fmt: skip


def stand_in_servers(endpoints: Sequence[str], free: Sequence[int]) -> dict[str, RpcServerInfo]:
    """Servers that are not asked: one device each with ``free`` bytes (one value for
    all, or one per endpoint).

    Raises:
        UsageError: a number of sizes that is neither 1 nor the number of servers.
    """
    eps = parse_endpoints(endpoints) if endpoints else ()
    if len(free) not in (1, len(eps)):
        raise UsageError(f"{len(free)} memory sizes for {len(eps)} RPC servers: give one "
                         "for all, or one per server")  # fmt: skip
    sizes = list(free) * len(eps) if len(free) == 1 else list(free)
    return {str(ep): RpcServerInfo(ep, RPC_PROTO_VERSION, (RpcDevice(0, n, n),))
            for ep, n in zip(eps, sizes, strict=True)}  # fmt: skip


def make_plan(
    config: EngineConfig,
    *,
    server_free: Sequence[int] = (),
    local_free: int | None = None,
    gpus: Sequence[Place] | None = None,
) -> PlacementPlan:
    """The plan of ``config``: its RPC servers asked for their free memory (a handshake,
    no loading), or, with ``server_free`` (bytes), taken to have that much; this machine's
    available memory, or ``local_free``. Loads no weights and raises nothing for a plan
    that does not fit (see :attr:`PlacementPlan.fits`).

    Raises:
        ModelNotFoundError, GGUFFormatError: a model file is missing or unreadable.
        ModelFileError: a projector (``mmproj``) that is not one, or one for another model.
        RpcServerError: a server that is asked does not answer.
        UsageError: a tensor split longer than a model's device list, sizes that do not
            match the servers.
    """
    target = read_model_info(config.target.path)
    draft = read_model_info(config.draft.path) if config.loads_draft and config.draft else None
    return _plan(config, target, draft, server_free=server_free, local_free=local_free,
                 gpus=gpus)  # fmt: skip


def _plan(
    config: EngineConfig,
    target: ModelInfo,
    draft: ModelInfo | None,
    *,
    server_free: Sequence[int],
    local_free: int | None,
    gpus: Sequence[Place] | None,
) -> PlacementPlan:
    if config.mmproj is not None:
        check_projector(config.mmproj, target.embedding_length)
    if server_free:
        servers = stand_in_servers(config.rpc_servers, server_free)
    else:
        servers = probe_servers(config.rpc_servers, config.rpc_timeout)
    n_ctx = config.target.n_ctx or target.context_length or ModelConfig.n_ctx  # as preflight
    n_ctx_draft = (config.draft.n_ctx if config.draft else 0) or n_ctx
    plan = memory_plan(config, target, draft, n_ctx, n_ctx_draft, servers=servers,
                       local_free=local_free, gpus=gpus)  # fmt: skip
    return PlacementPlan(config, plan, target, draft, n_ctx, n_ctx_draft,
                         tuple(servers.values()))  # fmt: skip


def fewest_servers(
    config: EngineConfig,
    server_free: int,
    *,
    local_free: int | None = None,
    gpus: Sequence[Place] | None = None,
    max_servers: int = 16,
) -> PlacementPlan | None:
    """The fewest RPC servers of ``server_free`` bytes each (named ``server-1:50052``, ...)
    that hold the target beside what stays on this machine (the input layer, the layers
    not offloaded, the draft), and of the target's layer counts (``n_gpu_layers``) that
    fit with them, the one that uses memory most evenly (the lowest largest share of any
    place). None when even ``max_servers`` do not do.

    Raises:
        ModelNotFoundError, GGUFFormatError: a model file is missing or unreadable.
    """
    from specgguf.engine.preflight import local_gpu_places
    from specgguf.llama.memory import available_memory

    t_info = read_model_info(config.target.path)
    d_info = read_model_info(config.draft.path) if config.loads_draft and config.draft else None
    n_layer = t_info.block_count or 0
    local_free = available_memory() if local_free is None else local_free
    gpus = local_gpu_places() if gpus is None else gpus
    for n in range(max_servers + 1):
        servers = tuple(PLACEHOLDER.format(i + 1) for i in range(n))
        best: PlacementPlan | None = None
        for ngl in range(n_layer + 2) if n or gpus else (config.target.n_gpu_layers,):
            target = dataclasses.replace(config.target, rpc=servers, tensor_split=(),
                                         n_gpu_layers=ngl)  # fmt: skip
            p = _plan(dataclasses.replace(config, target=target), t_info, d_info,
                      server_free=[server_free] if n else (), local_free=local_free,
                      gpus=gpus)  # fmt: skip
            if p.fits and (best is None or p.utilisation() < best.utilisation()):
                best = p
        if best is not None:
            return best
    return None


def layer_ranges(plan: MemoryPlan, model: int = 0) -> list[tuple[str, str]]:
    """(place, ``input, layers 0-13``) for one model of the plan: consecutive layers on
    one place grouped, the input layer on this machine, the output layer by name."""
    placement = plan.models[model]
    n_layer = len(placement.layers) - 1
    out: dict[str, list[str]] = {LOCAL: ["input"]}
    start = 0
    for il in range(1, n_layer + 1):
        if il == n_layer or placement.layers[il] != placement.layers[start]:
            lo, hi = start, il - 1
            out.setdefault(placement.layers[start], []).append(
                f"layer {lo}" if lo == hi else f"layers {lo}-{hi}"
            )
            start = il
    if n_layer >= 0 and placement.layers:
        out.setdefault(placement.layers[n_layer], []).append("output")
    return [(place, ", ".join(parts)) for place, parts in out.items()]
