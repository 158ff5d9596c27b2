"""Will the models fit? An estimate of the memory a target/draft pair needs, from GGUF
metadata alone, against what the machine has (psutil), and a placement plan: which layers
llama.cpp puts on which device (local GPUs, devices of RPC servers), and whether each
device's share fits its free memory.

Estimate per model (bytes): the weights (the file sizes: llama.cpp maps them), the KV cache
(2 x n_layer x n_ctx x n_head_kv x head_dim x 2 bytes for F16 K and V in the attention
layers; llama.cpp's ``llama_kv_cache`` with its default cache types; a recurrent state and
its snapshots in the other layers), and the compute buffer, dominated by the
logits of the outputs reserved per micro-batch (n_vocab x n_outputs_max x 4) plus a margin
for activations (n_ubatch x n_embd x 4 x 16).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np

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
    #: the activations' share of ``compute``: what each device that computes layers needs
    activations: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute


def kv_cache_bytes(info: ModelInfo, n_ctx: int, *, snapshots: int = 0) -> int:
    """F16 K and V for ``n_ctx`` positions in every attention layer (0 when the shape is
    unknown), plus, for a recurrent or hybrid model, its F32 state for one sequence and
    ``snapshots`` copies of it (``n_rs_seq``: llama.cpp allocates ``1 + n_rs_seq`` states
    per sequence, src/llama-memory-recurrent.cpp).
    """
    return _attention_bytes(info, n_ctx) + info.recurrent_state_bytes * (1 + snapshots)


def _attention_bytes(info: ModelInfo, n_ctx: int) -> int:
    n_layer = info.attention_layers
    n_head = info.head_count or 0
    n_head_kv = info.head_count_kv or n_head
    n_embd = info.embedding_length or 0
    if not (n_layer and n_head and n_embd):
        return 0
    head_dim = n_embd // n_head
    return 2 * n_layer * n_ctx * n_head_kv * head_dim * KV_BYTES_PER_VALUE


def model_memory(
    info: ModelInfo,
    *,
    n_ctx: int,
    n_ubatch: int = 512,
    n_outputs_max: int = 64,
    snapshots: int = 0,
    mtp: bool = False,
    n_seq: int = 1,
    hidden_layers: int = 0,
) -> ModelMemory:
    """The estimate for one model loaded with a context of ``n_ctx`` positions (and
    ``snapshots`` of a recurrent state, see :func:`kv_cache_bytes`) for each of ``n_seq``
    sequences (``serve --parallel``: their logits too); with ``mtp``, its MTP layers
    drafting: their own KV cache and the target's hidden state of every position (F32),
    which they read, for each sequence; with ``hidden_layers``, the inputs of that many
    of its layers at every position (F32, host memory), which an EAGLE-3 head reads."""
    activations = n_ubatch * (info.embedding_length or 0) * 4 * 16
    kv = kv_cache_bytes(info, n_ctx, snapshots=snapshots) * n_seq
    n_outputs_max *= n_seq
    if mtp and info.attention_layers:
        per_layer = _attention_bytes(info, n_ctx) // info.attention_layers
        kv += (info.nextn_layers * per_layer + n_ctx * (info.embedding_length or 0) * 4) * n_seq
    kv += hidden_layers * n_ctx * (info.embedding_length or 0) * 4 * n_seq
    return ModelMemory(
        name=info.path.name,
        weights=info.file_size,
        kv_cache=kv,
        compute=info.vocab.n_tokens * n_outputs_max * 4 + activations,
        activations=activations,
    )


def assign_layers(n_layer: int, n_gpu_layers: int, splits: Sequence[float]) -> list[int | None]:
    """Where llama.cpp puts each layer: the index into the model's device list of layers
    ``0 .. n_layer - 1`` and of the output layer (the last entry, index ``n_layer``), None
    for this machine's CPU. The input layer always stays on the CPU.

    Mirrors ``llama_model::load_tensors`` (llama-model.cpp): ``n_gpu_layers`` (-1: all,
    n_layer + 1 with the output) of the last layers go to the devices, split at the
    cumulative proportions of ``splits`` (one per device, in float32 as llama.cpp computes
    them; all zero: equal shares, where llama.cpp would use free memory: pass that).
    """
    n_dev = len(splits)
    ngl = n_layer + 1 if n_gpu_layers < 0 else n_gpu_layers
    i_start = max(n_layer + 1 - ngl, 0)
    act = 0 if n_dev == 0 else min(ngl, n_layer + 1)
    weights = np.asarray(splits, dtype=np.float32)
    if n_dev and not float(weights.sum()) > 0:
        weights = np.ones(n_dev, dtype=np.float32)
    cum = np.cumsum(weights, dtype=np.float32)
    points = [float(x) for x in (cum / cum[-1]).astype(np.float32)] if n_dev else []
    out: list[int | None] = []
    for il in range(n_layer + 1):
        if il < i_start or il - i_start >= act:
            out.append(None)
        else:
            x = float(np.float32(il - i_start) / np.float32(act))
            out.append(min(bisect.bisect_right(points, x), n_dev - 1))
    return out


@dataclasses.dataclass(frozen=True)
class Place:
    """Somewhere memory is needed: this machine (``kind`` "local": its RAM), a local GPU
    ("gpu") or a device of an RPC server ("rpc"). ``name`` says which (``this machine``,
    ``CUDA0``, ``10.0.0.2:50052``); ``free`` is the bytes it has free (None: unknown)."""

    name: str
    kind: str
    free: int | None
    total: int | None = None


@dataclasses.dataclass(frozen=True)
class Share:
    """A model's bytes at one place."""

    weights: int = 0
    kv_cache: int = 0
    compute: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute

    def describe(self) -> str:
        """``weights 6.00 GiB + KV cache 1.00 GiB + compute 0.25 GiB``"""
        return (f"weights {gib(self.weights)} + KV cache {gib(self.kv_cache)}"
                f" + compute {gib(self.compute)}")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ModelPlacement:
    """One model's layers and bytes by place.

    ``layers`` names the place of each layer ``0 .. n_layer - 1`` and, last, of the output
    layer; ``shares`` holds the bytes by place name: the weights of the layers there, their
    KV cache, and a compute buffer where layers are computed. This machine's share counts
    every part not on an RPC server (a local GPU's layers too: llama.cpp reads the weights
    through this machine's memory, and without RPC this is the whole estimate, as before).
    """

    name: str
    layers: tuple[str, ...]
    shares: dict[str, Share]

    def need(self, place: str) -> int:
        """Bytes this model needs at ``place``."""
        share = self.shares.get(place)
        return share.total if share else 0


LOCAL = "this machine"


def place_model(
    info: ModelInfo,
    mem: ModelMemory,
    devices: Sequence[Place],
    *,
    n_gpu_layers: int = -1,
    tensor_split: Sequence[float] = (),
) -> ModelPlacement:
    """Where one model's layers go and what each place needs (bytes), from its metadata:
    the layers assigned as llama.cpp assigns them (:func:`assign_layers`, ``devices`` in
    llama.cpp's order; without a tensor split, in proportion to each device's free
    memory, as llama.cpp splits), each layer's weights from the tensor table
    (:attr:`specgguf.gguf.info.ModelInfo.layout`; an even share of the file when it is
    unknown), and the KV cache in even shares per layer. A block count past llama.cpp's
    limit (a corrupt file, which preflight reports) is planned as that limit: the file's
    own number never sizes a table here."""
    from specgguf.gguf.loadcheck import LLAMA_MAX_LAYERS

    n_layer = min(info.block_count or 0, LLAMA_MAX_LAYERS)
    layout = info.layout
    if layout is not None and len(layout.blocks) == n_layer:
        blocks, output = list(layout.blocks), layout.output
    else:
        blocks, output = [mem.weights // max(n_layer, 1)] * n_layer, 0
    kv_layer = mem.kv_cache // n_layer if n_layer else 0
    split = list(tensor_split)[: len(devices)]
    if not any(x > 0 for x in split):
        split = [float(d.free or 0) for d in devices]
    where = assign_layers(n_layer, n_gpu_layers, split)
    names = tuple(LOCAL if i is None else devices[i].name for i in where)
    dev_shares: dict[str, Share] = {}
    remote = Share()
    for il, i in enumerate(where):
        if i is None:
            continue
        dev = devices[i]
        w, kv = (blocks[il], kv_layer) if il < n_layer else (output, 0)
        old = dev_shares.get(dev.name)
        dev_shares[dev.name] = Share(
            (old.weights if old else 0) + w,
            (old.kv_cache if old else 0) + kv,
            old.compute if old else mem.activations,
        )
        if dev.kind == "rpc":
            remote = Share(remote.weights + w, remote.kv_cache + kv)
    local = Share(max(mem.weights - remote.weights, 0), mem.kv_cache - remote.kv_cache,
                  mem.compute)  # fmt: skip
    return ModelPlacement(mem.name, names, {LOCAL: local, **dev_shares})


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Every place and each model's placement: what :func:`check_plan` checks and
    ``specgguf plan`` shows."""

    places: tuple[Place, ...]
    models: tuple[ModelPlacement, ...]

    def need(self, place: str) -> int:
        """Bytes all models need at ``place``."""
        return sum(m.need(place) for m in self.models)

    def over(self) -> list[tuple[Place, int]]:
        """The places whose need exceeds their free memory, with that need (bytes)."""
        return [(p, n) for p in self.places
                if p.free is not None and (n := self.need(p.name)) > p.free]  # fmt: skip


def local_plan(parts: Sequence[ModelMemory], available: int | None = None) -> MemoryPlan:
    """The plan of models wholly on this machine (``available``: bytes, default psutil's
    available memory, free plus reclaimable page cache, which includes model files
    already cached)."""
    place = Place(LOCAL, "local", available if available is not None else available_memory())
    models = tuple(ModelPlacement(p.name, (), {LOCAL: Share(p.weights, p.kv_cache, p.compute)})
                   for p in parts)  # fmt: skip
    return MemoryPlan((place,), models)


def available_memory() -> int:
    """psutil's available memory on this machine (bytes)."""
    import psutil

    return int(psutil.virtual_memory().available)


def check_plan(plan: MemoryPlan) -> int:
    """Raise when some place clearly cannot hold its share; returns the bytes needed on
    this machine.

    Raises:
        InsufficientMemoryError: naming every place that is short, with its need, its free
            memory and each model's share (``gpu`` when a local GPU is short, ``remote``
            when an RPC server is).
    """
    over = plan.over()
    if over:
        parts = []
        for place, n in over:
            where = {"local": "of memory", "gpu": f"on GPU {place.name}",
                     "rpc": f"on RPC server {place.name}"}[place.kind]  # fmt: skip
            has = "is available" if place.kind == "local" else "is free"
            detail = ", ".join(f"{m.name}: {m.shares[place.name].describe()}"
                               for m in plan.models if m.need(place.name))  # fmt: skip
            parts.append(f"need about {gib(n)} {where} but {gib(place.free or 0)} {has} "
                         f"({detail})")  # fmt: skip
        kinds = {p.kind for p, _ in over}
        raise InsufficientMemoryError(
            "the models " + "; and they ".join(parts),
            needed=sum(n for _, n in over),
            available=sum(p.free or 0 for p, _ in over),
            gpu="gpu" in kinds,
            remote="rpc" in kinds,
        )
    return plan.need(LOCAL)


#: The name of a multimodal projector's share in a memory plan (the target's; the draft
#: model's).
PROJECTOR = "projector"
DRAFT_PROJECTOR = "draft projector"


def projector_memory(path: Path) -> Share:
    """What a multimodal projector (``--mmproj``) takes in this machine's memory (bytes):
    its file, which libmtmd reads whole, and a compute buffer for one image or one 30 s
    chunk of audio, whichever is larger: its positions' rows (n_tok (4 n_embd + n_ff)
    float32) and one layer's attention scores (n_head n_tok² float32), from the vision
    tower's or the audio encoder's metadata; a chunk of audio is 1,500 positions
    (Whisper's encoder), after a convolution over its 3,000 frames of mel bands. A
    LLaVA-1.5-shaped projector (ViT-L/14 at 336 x 336, 581 MiB in float16) estimated at 39
    MiB of compute took 582 MiB once loaded and 18 MiB more after an encode (2-core EPYC,
    2026-12-07).

    Raises:
        GGUFFormatError: the file is not a GGUF file.
    """
    from specgguf.gguf.metadata import GGUFMetadata

    def buffer(n_tok: int, n_embd: int, n_ff: int, n_head: int) -> int:
        return 4 * n_tok * (4 * n_embd + n_ff) + 4 * n_head * n_tok * n_tok

    with GGUFMetadata.open(path) as meta:

        def key(name: str) -> int:
            value = meta.get(f"clip.{name}")
            return int(value) if isinstance(value, int) and value > 0 else 0

        side, patch = key("vision.image_size"), key("vision.patch_size")
        n_tok = (side // patch) ** 2 + 1 if side and patch else 0
        v = "vision."
        compute = buffer(n_tok, key(v + "embedding_length"), key(v + "feed_forward_length"),
                         key(v + "attention.head_count"))  # fmt: skip
        if meta.get("clip.has_audio_encoder"):
            a = "audio."
            n_embd, n_mel = key(a + "embedding_length"), key(a + "num_mel_bins")
            conv = 4 * 3000 * (n_mel + n_embd)
            heard = conv + buffer(1500, n_embd, key(a + "feed_forward_length"),
                                  key(a + "attention.head_count"))  # fmt: skip
            compute = max(compute, heard)
    return Share(weights=path.stat().st_size, compute=compute)
