"""One configuration object for everything an engine loads and how it drafts.

:class:`EngineConfig` is what the command line (``run``, ``bench``), a server's settings and
a Python user build, and the only thing :class:`specgguf.engine.Engine` needs. Values are
checked here, once, when the object is made: a bad value raises :class:`UsageError` with a
message that names the setting, not a command-line flag.

Names follow llama.cpp: ``n_ctx``, ``n_batch``, ``n_gpu_layers``, ``n_threads``, the draft
length ``draft_max`` (``--spec-draft-n-max``, formerly ``--draft-max``; K in formulas), the
shortest draft verified ``draft_min`` (``--spec-draft-n-min``), ``p_min``
(``--spec-draft-p-min``).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from specgguf.engine.drafter_map import AUTO, drafter_kinds, needs, unknown_drafter
from specgguf.errors import UsageError
from specgguf.gguf.arch import DELTA_NET_ARCHS
from specgguf.llama.rpc import DEFAULT_TIMEOUT, parse_endpoints
from specgguf.speculative.tuning import AUTO_TUNING

#: The most devices a tensor split can name (llama.cpp's ``llama_max_devices()``).
MAX_DEVICES = 16

#: A drafter's name: one of :func:`specgguf.engine.drafter_map.drafter_kinds` ("auto", a
#: drafter of the registry, "none").
DrafterKind = str

#: A fixed drafter's draft length when none is given.
FIXED_DRAFT_MAX = 4


#: The most branches of a token tree (each is a llama.cpp sequence of the target's context).
MAX_TREE_BRANCHES = 16
#: Auto mode's token trees by default: the most branches.
AUTO_TREE_BRANCHES = 4


def default_draft_tree(drafter: DrafterKind) -> int:
    """The most branches of a token tree when none is given: ``AUTO_TREE_BRANCHES`` for
    auto mode, which uses a tree only where the cost model expects it to pay; 0 (chains)
    for the fixed drafters."""
    return AUTO_TREE_BRANCHES if drafter == "auto" else 0


def default_draft_max(drafter: DrafterKind) -> int:
    """The draft length used when none is given: auto mode's largest (64 for lookup
    drafts; its draft model drafts at most 16), none for the target alone, else
    ``FIXED_DRAFT_MAX``."""
    return {"auto": AUTO_TUNING.draft_max_lookup, "none": 0}.get(drafter, FIXED_DRAFT_MAX)


#: A recurrent or hybrid target's largest draft when no draft length is given (auto mode
#: would draft lookups of up to 64): llama.cpp keeps a snapshot of the whole recurrent
#: state for each token a rollback may drop (Qwen3.5-27B's: about 150 MB each).
RECURRENT_DRAFT_MAX = 16


#: The most rows of a micro-batch on a gated delta-net target (Qwen3.5, Qwen3-Next:
#: :data:`specgguf.gguf.arch.DELTA_NET_ARCHS`): llama.cpp computes 64 or more tokens of
#: such a layer by another algorithm
#: (chunks of 64: src/models/delta-net-base.cpp), whose logits differ from those of one
#: token at a time (by up to 0.37 where they spread by 4.8 on the tiny fixture), and a
#: verification or a prompt read in other pieces then changed the greedy output. Up to 63
#: rows, they are the same bit for bit.
RECURRENT_ROWS_MAX = 63


def verify_draft_max(spec: SpeculativeConfig, memory: str, arch: str | None = None) -> int:
    """The largest draft the target's context is made for: the draft length, or for a
    recurrent or hybrid target (``memory``, :func:`specgguf.gguf.arch.memory_kind`) given
    none, at most :data:`RECURRENT_DRAFT_MAX`; on a gated delta-net (``arch``), at most
    ``RECURRENT_ROWS_MAX - 2`` (llama.cpp keeps the last n_rs_seq + 1 tokens of a batch in
    one micro-batch, and needs it larger: src/llama-batch.cpp)."""
    if memory == "attention":
        return spec.draft_max
    k = spec.draft_max
    if k == default_draft_max(spec.drafter):
        k = min(k, RECURRENT_DRAFT_MAX)
    return min(k, RECURRENT_ROWS_MAX - 2) if arch in DELTA_NET_ARCHS else k


def uses_mtp(config: EngineConfig, nextn_layers: int, *, rolls_back: bool = True) -> bool:
    """Whether the target's MTP layers draft: asked for (a drafter that needs them), or in
    auto mode when the target carries them, its memory can drop rejected drafts
    (``rolls_back``) and no draft model is loaded (as Ollama does)."""
    kind = config.speculative.drafter
    auto = kind == AUTO and nextn_layers > 0 and rolls_back and not config.loads_draft
    return needs(kind).mtp_layers or auto


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """How to load one model (the target or the draft).

    Args:
        path: the GGUF file (the first shard of a split model).
        n_ctx: context size in tokens (KV cache positions); 0: the model's training
            context. llama.cpp may allocate more (it rounds up to 256); generation keeps to
            this size.
        n_batch: the most tokens per ``llama_decode`` call (prompt processing; a
            verification of K + 1 tokens must fit too).
        n_gpu_layers: layers to offload (-1: all, where the build can; 0: none).
        n_threads: CPU threads (None: the physical core count).
        repack: llama.cpp's weight repacking (extra buffer types; None: the build's safe
            default, see :func:`specgguf.llama.runtime.repack_policy`).
        rpc: RPC servers (``host:port``, llama.cpp's ``rpc-server``; a comma-separated
            string is split) whose devices take this model's layers, in this order, ahead
            of this machine's GPUs (as llama.cpp orders them); ``n_gpu_layers`` counts the
            layers on all these devices, the rest stay on this machine's CPU. Empty: this
            machine only.
        tensor_split: the proportions of the offloaded layers per device, in that order
            (llama.cpp's ``--tensor-split``; missing entries are 0); empty or all zero:
            proportional to each device's free memory, as llama.cpp splits.
        devices: this machine's backend devices to offload to, by ggml name (``CUDA0``,
            ``Vulkan1``; llama.cpp's ``--device``); () none: the CPU only (and the ``rpc``
            servers); None: llama.cpp's default (every GPU). The ``rpc`` servers' devices
            come first in either case.
        huge_pages: advise transparent huge pages for the weights held in this process's
            memory, unless ``SPECGGUF_HUGEPAGES`` says otherwise (see
            :mod:`specgguf.llama.hugepages`: 3-4% faster steps on a CPU, slower loads in
            some VMs; ``serve`` sets it, ``run`` does not).

    Raises:
        UsageError: a negative or zero size, a malformed RPC endpoint, a negative or
            non-finite proportion or more than ``MAX_DEVICES`` of them.
    """

    path: Path
    n_ctx: int = 4096
    n_batch: int = 2048
    n_gpu_layers: int = -1
    n_threads: int | None = None
    repack: bool | None = None
    rpc: tuple[str, ...] = ()
    tensor_split: tuple[float, ...] = ()
    devices: tuple[str, ...] | None = None
    huge_pages: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        if self.devices is not None:
            object.__setattr__(self, "devices", tuple(self.devices))
        if self.rpc:
            endpoints = tuple(str(e) for e in parse_endpoints(self.rpc))
            object.__setattr__(self, "rpc", endpoints)
        split = tuple(float(x) for x in self.tensor_split)
        if any(not math.isfinite(x) or x < 0 for x in split) or len(split) > MAX_DEVICES:
            raise UsageError(
                f"a tensor split is up to {MAX_DEVICES} proportions of 0 or more, not "
                f"{','.join(f'{x:g}' for x in split)}"
            )
        object.__setattr__(self, "tensor_split", split)
        if self.n_ctx < 0:
            raise UsageError(f"n_ctx must be 0 (the model's) or more, not {self.n_ctx}")
        if self.n_batch < 1:
            raise UsageError(f"n_batch must be at least 1, not {self.n_batch}")
        if self.n_threads is not None and self.n_threads < 1:
            raise UsageError(f"n_threads must be at least 1, not {self.n_threads}")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How to draft, by default (a generation may ask for other settings within what was
    loaded: :class:`specgguf.speculative.loop.GenerationParams`).

    Args:
        drafter: "auto" (every drafter loaded, chosen per step by the cost model), a
            drafter of :data:`specgguf.engine.drafter_map.DRAFTERS` ("ngram", "suffix",
            "model", "mtp") or "none" (the target alone).
        draft_max: the draft length K (auto: the largest); -1: :func:`default_draft_max`.
            It also sizes the target's logits buffer (K + 1 rows), so it is the largest K
            any generation on the engine can use.
        p_min: a draft model stops drafting at a token it gives less than this probability
            (auto mode also stops where the draft's path probability falls below what
            drafting a token costs relative to a target row, between
            ``AutoTuning.p_stop_min`` and ``AutoTuning.p_stop``: ``ModelArm.p_stop_at``).
        ngram_min, ngram_max: the n-gram lengths the lookup drafter tries, longest first.
        draft_min: the shortest draft that is verified (llama.cpp's n_min): a step with
            room for fewer drafts, or whose drafter proposes fewer, runs without drafts;
            0: no minimum.
        draft_tree: the most branches of a token tree verified in one batch (greedy
            decoding only; with sampling and in deterministic mode, chains): auto mode
            weighs a tree of the suffix drafter's continuations against the chains, the
            suffix drafter always drafts trees; 0 (or 1): chains only, and the target's
            context has one sequence, as without trees; -1: :func:`default_draft_tree`.

    Raises:
        UsageError: an unknown drafter, a draft length below -1, p_min outside [0, 1],
            n-gram lengths not 1 <= ngram_min <= ngram_max, a minimum draft length below 0
            or above the draft length, a tree of more than ``MAX_TREE_BRANCHES`` branches.
    """

    drafter: DrafterKind = "auto"
    draft_max: int = -1
    p_min: float = 0.0
    ngram_min: int = 2
    ngram_max: int = 8
    draft_min: int = 0
    draft_tree: int = -1
    #: whether ``draft_tree`` was given (not -1): a tree that cannot be drafted is then
    #: said, not only logged
    tree_asked: bool = dataclasses.field(default=False, init=False, compare=False)

    def __post_init__(self) -> None:
        check_drafter(self.drafter)
        object.__setattr__(self, "tree_asked", self.draft_tree != -1)
        if self.draft_tree == -1:
            object.__setattr__(self, "draft_tree", default_draft_tree(self.drafter))
        elif not 0 <= self.draft_tree <= MAX_TREE_BRANCHES:
            raise UsageError(f"a token tree has 0 to {MAX_TREE_BRANCHES} branches, "
                             f"not {self.draft_tree}")  # fmt: skip
        if self.draft_max == -1:
            object.__setattr__(self, "draft_max", default_draft_max(self.drafter))
        elif self.draft_max < 0:
            raise UsageError(f"the draft length must be 0 or more, not {self.draft_max}")
        check_p_min(self.p_min)
        if self.drafter != "none":
            check_draft_min(self.draft_min, self.draft_max)
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise UsageError(
                f"n-gram lengths need 1 <= min <= max, not {self.ngram_min}, {self.ngram_max}"
            )


#: A recurrent state's checkpoints per sequence by default (llama-server's
#: ``--ctx-checkpoints``, 32 there): each is a copy of the state, tens of MB on larger
#: hybrid models.
CTX_CHECKPOINTS = 8
#: A prompt goes to the free sequence sharing the longest prefix with it when that is
#: more than this share of it (llama-server's ``--slot-prompt-similarity``).
SLOT_SIMILARITY = 0.1


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """What an engine keeps of its prompts between generations (a generation always keeps
    what its sequence shares with the one before: ``GenerationParams.cache_prompt``).

    Args:
        ram: bytes of host memory for the states of sequences another prompt was about to
            overwrite (llama-server's ``--cache-ram``; 0: none).
        disk_dir: a folder for the entries evicted from memory, which a later engine of
            the same models and settings finds again (None: none).
        disk: bytes the folder may hold (0: none).
        ctx_checkpoints: copies of a recurrent state a sequence keeps (llama-server's
            ``--ctx-checkpoints``): a prompt that shares a prefix with it but not all of
            it goes back to the deepest at or below the shared prefix; 0: none (such a
            prompt is read whole).
        slot_similarity: a prompt goes to the free sequence that shares the longest
            prefix with it when that is more than this share of it, else to the least
            recently used (llama-server's ``--slot-prompt-similarity``; 0: always the
            least recently used).

    Raises:
        UsageError: a negative size or count, a similarity outside [0, 1], a disk size
            without a folder.
    """

    ram: int = 0
    disk_dir: Path | None = None
    disk: int = 0
    ctx_checkpoints: int = CTX_CHECKPOINTS
    slot_similarity: float = SLOT_SIMILARITY

    def __post_init__(self) -> None:
        if self.ram < 0 or self.disk < 0:
            raise UsageError("a prompt cache's size must be 0 or more")
        if self.ctx_checkpoints < 0:
            raise UsageError(f"checkpoints must be 0 or more, not {self.ctx_checkpoints}")
        if not 0.0 <= self.slot_similarity <= 1.0:
            raise UsageError(
                f"the slot prompt similarity must be between 0 and 1, not {self.slot_similarity}"
            )
        if self.disk and self.disk_dir is None:
            raise UsageError("a disk prompt cache needs a folder")
        if self.disk_dir is not None:
            object.__setattr__(self, "disk_dir", Path(self.disk_dir))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything :class:`specgguf.engine.Engine` loads and checks.

    Args:
        target: the target model.
        draft: the draft model (loaded only for auto mode and a drafter that needs one).
        speculative: the drafter and its settings.
        check_vocab: check before loading that the draft's vocabulary matches the target's.
        check_memory: refuse before loading when the models clearly do not fit in memory.
        deterministic: greedy output bit-identical whatever the drafter, the draft length
            and timings, and sampled output with a seed too (see README, "Exactness"):
            measured and set up at load, the default of every generation.
        rpc_timeout: seconds an RPC server has to answer the handshake before loading,
            and, after loading, for its machine to answer at the TCP level before the
            connection is given up (see :mod:`specgguf.llama.rpc` for what llama.cpp
            does not allow).
        n_parallel: sequences generated at once (``serve --parallel``), each with a
            context of the target's (and the draft's) ``n_ctx`` in one llama.cpp context
            (:mod:`specgguf.engine.batching`); 1: one at a time.
        cache: what is kept of prompts between generations (:class:`CacheConfig`).
        mmproj: the target's multimodal projector file (``--mmproj``), which reads images or audio
            into the target's embeddings (:mod:`specgguf.llama.media`); None: text only.
        mmproj_offload: run the projector on the GPU where the build can
            (``--mmproj-offload``, llama.cpp's default).
        mmproj_draft: the draft model's own projector (``--mmproj-draft``), through which
            the draft model reads the media at their rows where it gives as many rows as
            the target's; None: a draft as wide as the target reads the target's rows,
            another the placeholder tokens.

    Raises:
        UsageError: a drafter that needs a draft model without one, a timeout of 0 or less,
            fewer than 1 parallel sequence.
    """

    target: ModelConfig
    draft: ModelConfig | None = None
    speculative: SpeculativeConfig = dataclasses.field(default_factory=SpeculativeConfig)
    check_vocab: bool = True
    check_memory: bool = True
    deterministic: bool = False
    rpc_timeout: float = DEFAULT_TIMEOUT
    n_parallel: int = 1
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    mmproj: Path | None = None
    mmproj_offload: bool = True
    mmproj_draft: Path | None = None

    def __post_init__(self) -> None:
        if self.n_parallel < 1:
            raise UsageError(f"n_parallel must be 1 or more, not {self.n_parallel}")
        kind = self.speculative.drafter
        if needs(kind).draft_model and self.draft is None:
            raise UsageError(f"the {kind} drafter needs a draft model")
        if not self.rpc_timeout > 0:
            raise UsageError(f"the RPC timeout must be more than 0 s, not {self.rpc_timeout}")
        if self.mmproj_draft is not None and (self.mmproj is None or self.draft is None):
            raise UsageError("the draft model's projector needs the target's projector and "
                             "a draft model")  # fmt: skip

    @property
    def rpc_servers(self) -> tuple[str, ...]:
        """Every RPC server a loaded model uses (``host:port``), each once, in order."""
        models = [self.target, *([self.draft] if self.loads_draft and self.draft else [])]
        return tuple(dict.fromkeys(e for m in models for e in m.rpc))

    @property
    def loads_draft(self) -> bool:
        """Whether the draft model is loaded (for auto mode, or a drafter that needs it)."""
        kind = self.speculative.drafter
        return self.draft is not None and (kind == AUTO or needs(kind).draft_model)


def check_drafter(kind: str) -> None:
    """Raises UsageError unless ``kind`` names a drafter."""
    if kind not in drafter_kinds():
        raise unknown_drafter(kind)


def check_p_min(p_min: float) -> None:
    """Raises UsageError unless 0 <= p_min <= 1."""
    if not 0.0 <= p_min <= 1.0:
        raise UsageError(f"p_min must be between 0 and 1, not {p_min}")


def check_draft_min(draft_min: int, draft_max: int) -> None:
    """Raises UsageError unless 0 <= draft_min <= draft_max (a minimum above the draft
    length would never let a draft through)."""
    if draft_min < 0:
        raise UsageError(f"the minimum draft length must be 0 or more, not {draft_min}")
    if draft_min > draft_max:
        raise UsageError(
            f"the minimum draft length ({draft_min}) is larger than the draft length "
            f"({draft_max}): no draft would ever be verified"
        )
