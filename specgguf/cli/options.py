"""The options of the commands that load models (``run``, ``serve``, ``bench``, ``plan``),
declared once, by concern, and :func:`engine_config`, which turns them into one
:class:`~specgguf.engine.EngineConfig`.

One frozen dataclass per concern: :class:`ModelOptions` (which models load, and how),
:class:`DraftOptions` (how to draft), :class:`SamplingOptions` and :class:`ServerOptions`.
Each field is one option, declared once with :func:`~specgguf.cli.flags.option`: its
default, its flag's names, help and bounds, and the configuration arguments it sets
(``to="target.n_ctx"``). A command takes a concern with :func:`~specgguf.cli.flags.takes`
(all its flags, or :class:`~specgguf.cli.flags.Options` narrowed or changed for that
command) and receives one instance of it.

These dataclasses live here, in the command line, not in the engine: a flag's names, help
and help section, and the parsing of its text (``-ngl all``, ``-ts 3/1``, ``--rpc`` lists,
``--spec-type``) with errors that name the flag, are the face's, and the library's errors
name no flag. The defaults are the engine's: an option that sets a configuration argument
takes that argument's default from the engine's own dataclass (``ModelConfig.n_ctx``,
``SamplerParams.temperature``), as vLLM's ``EngineArgs`` takes its defaults from its config
classes; so each default is written once, where a Python user of the engine sees it too,
and the defaults that only the command line has (``--seed -1``, ``--port``) are written
here.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from specgguf.cli.flags import Options, config_args, option
from specgguf.engine.config import (
    MAX_DEVICES,
    MAX_TREE_BRANCHES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SpeculativeConfig,
)
from specgguf.engine.drafter_map import (
    AUTO,
    DRAFTERS,
    NONE,
    drafter_help,
    drafter_kinds,
    head_of_draft,
    needs,
    spec_types,
)
from specgguf.errors import UsageError
from specgguf.gguf.arch import DRAFT_HEAD_ARCHS, article
from specgguf.speculative.sampling import SamplerParams

#: llama.cpp's --spec-type values (common/speculative.cpp, 2026) -> specgguf's drafter, from
#: the registry (:func:`specgguf.engine.drafter_map.spec_types`).
SPEC_TYPES = spec_types()

#: The help section of the speculative options. Each option lists all its names on one
#: line: specgguf's, llama.cpp's current ``--spec-*`` names (since 2026) and the former ones.
SPEC = "Speculative decoding (llama.cpp's --spec-* names and the former ones)"


def gpu_layers(value: str | int) -> int:
    """A number of layers to offload, or llama.cpp's words: all and auto (both -1 here:
    every layer the build can offload; specgguf checks the memory before loading).

    Raises:
        typer.BadParameter: anything else (a usage error, exit 2).
    """
    if isinstance(value, int):
        return value
    text = value.strip().lower()
    if text in ("all", "auto"):
        return -1
    try:
        return int(text)
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not a number of layers, all or auto") from None


def parse_tensor_split(text: str | None) -> tuple[float, ...]:
    """llama.cpp's ``-ts`` value: proportions separated by ``,`` or ``/``.

    Raises:
        UsageError: something that is not a number of 0 or more, or more than 16 of them.
    """
    if not text:
        return ()
    try:
        split = tuple(float(x) for x in text.replace("/", ",").split(","))
    except ValueError:
        split = ()
    if not split or any(not x >= 0 or x == float("inf") for x in split):
        raise UsageError(f"--tensor-split takes proportions of 0 or more like 3,1, not {text!r}")
    if len(split) > MAX_DEVICES:
        raise UsageError(f"--tensor-split takes at most {MAX_DEVICES} proportions")
    return split


def _servers(flag: str, text: str | None) -> tuple[str, ...]:
    """RPC servers of ``flag`` as ``host:port`` strings.

    Raises:
        UsageError: a malformed list, named by its flag.
    """
    from specgguf.llama.rpc import parse_endpoints

    if text is None:
        return ()
    try:
        return tuple(str(ep) for ep in parse_endpoints(text))
    except UsageError as e:
        raise UsageError(f"{flag}: {e}") from None


def _devices(device_draft: str | None) -> tuple[str, ...] | None:
    """``-devd`` as llama.cpp reads it: None (not given), () for "none" (the CPU), or the
    device names.

    Raises:
        UsageError: an empty list, or "none" among names.
    """
    if device_draft is None:
        return None
    names = tuple(n.strip() for n in device_draft.split(",") if n.strip())
    if names == ("none",):
        return ()
    if not names or "none" in names:
        raise UsageError(f"-devd takes none or device names (see `specgguf doctor`), not "
                         f"{device_draft!r}")  # fmt: skip
    return names


@dataclass(frozen=True)
class ModelOptions:
    """Which models load, and how: the target's and the draft's options, where their
    layers go, and the checks before loading. Each field with ``to`` reaches the
    :class:`~specgguf.engine.ModelConfig` of the target, the draft or both, or the
    :class:`~specgguf.engine.EngineConfig` (:func:`engine_config`).

    A new loader option is one field here, its ``to`` naming the ``ModelConfig``
    argument(s) (``"target.X"``, ``"draft.X"``): ``run``, ``serve`` and ``bench`` show it,
    and every command's configuration gets it (``plan`` shows the fields it lists).
    """

    model: str | None = option(
        None, "-m", "--model",
        help="Target model: a .gguf file, an alias, or org/name:QUANT when cached.",
    )  # fmt: skip
    model_draft: str | None = option(
        None, "-md", "-d", "--model-draft", "--spec-draft-model", panel=SPEC,
        help="Draft model, or a draft head (an EAGLE-3 head, a DFlash draft, an MTP "
        "assistant: its drafter then drafts): a .gguf file, an alias, or org/name:QUANT when "
        "cached. Default: the best compatible draft model already on disk (see --no-draft).",
    )  # fmt: skip
    hf_repo: str | None = option(
        None, "-hf", "-hfr", "--hf-repo", metavar="REPO[:QUANT]",
        help="Target model on the Hugging Face hub, as llama.cpp names it: org/name-GGUF"
        "[:QUANT] (quant case-insensitive, default Q4_K_M), downloaded on first use.",
    )  # fmt: skip
    hf_repo_draft: str | None = option(
        None, "-hfd", "-hfrd", "--hf-repo-draft", "--spec-draft-hf", metavar="REPO[:QUANT]",
        help="Draft model on the Hugging Face hub, as -hf.", panel=SPEC,
    )  # fmt: skip
    no_draft: bool = option(
        False, "--no-draft", panel=SPEC,
        help="No draft model: none is looked for on disk (auto mode still drafts with "
        "n-gram lookup and suffix matching).",
    )  # fmt: skip
    draft_search: list[Path] | None = option(
        None, "--draft-search", metavar="DIR", panel=SPEC,
        help="Also look for a draft model under DIR (repeatable); the Hugging Face cache is "
        "always searched.",
    )  # fmt: skip
    ctx_size: int = option(
        ModelConfig.n_ctx, "-c", "--ctx-size", min=0, help="Context size (0: the model's).",
        to="target.n_ctx",
    )  # fmt: skip
    ctx_size_draft: int | None = option(
        None, "-cd", "--ctx-size-draft", "--spec-draft-ctx-size", min=0, panel=SPEC,
        help="Draft context size (default: -c).",
        to="draft.n_ctx", convert=lambda n: n or 0,  # 0: the target's n_ctx
    )  # fmt: skip
    batch_size: int = option(
        ModelConfig.n_batch, "-b", "--batch-size", min=1, help="Prompt batch size.",
        to=("target.n_batch", "draft.n_batch"),
    )  # fmt: skip
    threads: int | None = option(
        None, "-t", "--threads", min=1, help="CPU threads.",
        to=("target.n_threads", "draft.n_threads"),
    )  # fmt: skip
    n_gpu_layers: int = option(
        ModelConfig.n_gpu_layers, "-ngl", "--n-gpu-layers", "--gpu-layers", parser=gpu_layers,
        metavar="N|all|auto", help="Target layers on the GPU or RPC servers (-1, all, auto: all).",
        to="target.n_gpu_layers",
    )  # fmt: skip
    n_gpu_layers_draft: int = option(
        ModelConfig.n_gpu_layers, "-ngld", "--n-gpu-layers-draft", "--gpu-layers-draft",
        "--spec-draft-ngl", parser=gpu_layers, metavar="N|all|auto", panel=SPEC,
        help="Draft layers on the GPU or RPC servers (-1, all, auto: all).",
        to="draft.n_gpu_layers",
    )  # fmt: skip
    device_draft: str | None = option(
        None, "-devd", "--device-draft", "--spec-draft-device", metavar="none|DEV[,DEV]",
        panel=SPEC,
        help="Devices for the draft model, by ggml name (see `specgguf doctor`); none: the "
        "CPU.",
        to="draft.devices", convert=_devices,
    )  # fmt: skip
    no_repack: bool = option(
        False, "-nr", "--no-repack", help="Disable weight repacking.",
        to=("target.repack", "draft.repack"), convert=lambda no: False if no else None,
    )  # fmt: skip
    no_check: bool = option(
        False, "--no-check", help="Skip the vocabulary check (with a warning).",
        to="engine.check_vocab", convert=operator.not_,
    )  # fmt: skip
    force: bool = option(
        False, "--force", help="Load even when the models seem not to fit.",
        to="engine.check_memory", convert=operator.not_,
    )  # fmt: skip
    deterministic: bool = option(
        EngineConfig.deterministic, "--deterministic",
        help="Output independent of the drafter, K and timings (greedy; sampling with "
        "--seed): fixed verification batch shapes and a q8_0 K cache, measured at start.",
        to="engine.deterministic",
    )  # fmt: skip
    rpc: str | None = option(
        None, "--rpc", metavar="HOST:PORT[,...]",
        help="RPC servers (specgguf rpc-server) that take the target's layers, as "
        "llama.cpp's --rpc; -ngl counts the layers on them (and on local GPUs), the rest "
        "stay on this machine.",
        to="target.rpc", convert=functools.partial(_servers, "--rpc"),
    )  # fmt: skip
    tensor_split: str | None = option(
        None, "-ts", "--tensor-split", metavar="N0,N1,...",
        help="Proportions of the target's offloaded layers per device: the --rpc servers "
        "in order, then local GPUs (default: by free memory), as llama.cpp's -ts.",
        to="target.tensor_split", convert=parse_tensor_split,
    )  # fmt: skip
    rpc_draft: str | None = option(
        None, "--rpc-draft", metavar="HOST:PORT[,...]", panel=SPEC,
        help="RPC servers for the draft's layers (default: none, the draft stays local).",
        to="draft.rpc", convert=functools.partial(_servers, "--rpc-draft"),
    )  # fmt: skip
    rpc_timeout: float = option(
        EngineConfig.rpc_timeout, "--rpc-timeout", min=0.1, metavar="SECONDS",
        help="Seconds an RPC server has to answer before loading, and its machine at the "
        "network level while generating.",
        to="engine.rpc_timeout",
    )  # fmt: skip
    mmproj: Path | None = option(
        None, "-mm", "--mmproj", metavar="FILE",
        help="The target's multimodal projector (an mmproj-*.gguf file, as llama.cpp's "
        "--mmproj), which reads images or audio: `run --image/--audio`, the server's image_url "
        "and input_audio parts.",
        to="engine.mmproj",
    )  # fmt: skip
    no_mmproj: bool = option(
        False, "--no-mmproj",
        help="Leave out the projector of an -hf repository (which run and serve pull "
        "beside the model, as llama.cpp does).",
    )  # fmt: skip
    mmproj_draft: Path | None = option(
        None, "--mmproj-draft", metavar="FILE", panel=SPEC,
        help="The draft model's own projector, through which it reads the media the target "
        "reads (default: a draft as wide as the target reads the target's embeddings, "
        "another the media's placeholder tokens).",
        to="engine.mmproj_draft",
    )  # fmt: skip
    no_mmproj_offload: bool = option(
        False, "--no-mmproj-offload",
        help="Run the projector on the CPU (default: on the GPU where the build has one).",
        to="engine.mmproj_offload", convert=operator.not_,
    )  # fmt: skip
    registry: Path | None = option(
        None, "--registry", help="An extra models.toml (adds to or overrides the registry)."
    )


@dataclass(frozen=True)
class DraftOptions:
    """How to draft: the :class:`~specgguf.engine.SpeculativeConfig` (the drafter itself,
    from ``drafter`` and ``spec_type``, is :func:`engine_config`'s)."""

    draft: int | None = option(
        None, "--draft", "--draft-max", "--spec-draft-n-max", min=0, panel=SPEC,
        help="Fixed draft length K per step (with --drafter auto: the largest K).",
        to="speculative.draft_max",
    )  # fmt: skip
    draft_min: int = option(
        SpeculativeConfig.draft_min, "--draft-min", "--spec-draft-n-min", min=0, panel=SPEC,
        help="Shortest draft verified: a step with room for fewer tokens, or whose drafter "
        "proposes fewer, runs without drafts.",
        to="speculative.draft_min",
    )  # fmt: skip
    draft_tree: int | None = option(
        None, "--draft-tree", min=0, max=MAX_TREE_BRANCHES, metavar="N", panel=SPEC,
        help="Verify up to N draft branches in one batch (token trees; greedy decoding "
        "only: with sampling, chains). auto: a tree of the suffix drafter's continuations "
        "where the measured batch costs say it pays (default 4); suffix: always trees "
        "(default 0: chains); the other drafters draft chains (refused). 0: chains only.",
        to="speculative.draft_tree",
    )  # fmt: skip
    draft_p_min: float = option(
        SpeculativeConfig.p_min, "--draft-p-min", "--spec-draft-p-min", min=0.0, max=1.0,
        panel=SPEC, help="Stop drafting at a token below this probability (per token; a "
        "DSpark draft's confidence, a DFlash2 selector's score).",
        to="speculative.p_min",
    )  # fmt: skip
    drafter: str | None = option(
        None, "--drafter", panel=SPEC,
        help=f"{drafter_help()}. Default: auto, or with --draft K the draft model (given or "
        "found), else the target's MTP layers, else n-gram lookup, at that fixed K.",
    )  # fmt: skip
    spec_type: str | None = option(
        None, "--spec-type", metavar="TYPE[,TYPE]", panel=SPEC,
        help="llama.cpp's name for --drafter: "
        + "; ".join(f"{', '.join(t for t, k in SPEC_TYPES.items() if k == kind)} = {kind}"
                    for kind in dict.fromkeys(SPEC_TYPES.values()) if kind != NONE)
        + " (assistant with an MTP assistant as -md); several kinds = auto; none.",
    )  # fmt: skip


@dataclass(frozen=True)
class SamplingOptions:
    """The sampler (``serve``: the defaults of requests that do not set them), with
    :class:`~specgguf.speculative.sampling.SamplerParams`'s defaults."""

    temp: float = option(
        SamplerParams.temperature, "--temp", min=0.0, help="Temperature (0: greedy).",
        to="sampler.temperature",
    )  # fmt: skip
    top_k: int = option(SamplerParams.top_k, "--top-k", min=0, help="Top-k (0: off).",
                        to="sampler.top_k")  # fmt: skip
    top_p: float = option(SamplerParams.top_p, "--top-p", min=0.0, max=1.0,
                          help="Top-p (1: off).", to="sampler.top_p")  # fmt: skip
    min_p: float = option(SamplerParams.min_p, "--min-p", min=0.0, max=1.0,
                          help="Min-p (0: off).", to="sampler.min_p")  # fmt: skip
    seed: int = option(-1, "-s", "--seed", help="RNG seed (-1: random).", to="sampler.seed",
                       convert=lambda s: s if s >= 0 else None)  # fmt: skip

    def sampler(self) -> SamplerParams:
        """The sampler settings (a negative seed: None, random)."""
        return SamplerParams(**config_args(self, "sampler"))


def _names(value: str | None) -> tuple[str, ...]:
    return tuple(n.strip() for n in (value or "").split(",") if n.strip())


@dataclass(frozen=True)
class ServerOptions:
    """Where ``serve`` listens, and what it lets in: ``server.*`` are the
    :class:`~specgguf.server.ServerSettings` arguments."""

    host: str = option("127.0.0.1", "--host", help="Address to listen on (loopback unless told).")
    port: int = option(8080, "--port", min=0, max=65535,
                       help="Port to listen on (0: any free one).")  # fmt: skip
    api_key: str | None = option(
        None, "--api-key", envvar="SPECGGUF_API_KEY",
        help="Require 'Authorization: Bearer KEY' on every endpoint but /health.",
        to="server.api_key", convert=lambda key: key or None,
    )  # fmt: skip
    allowed_hosts: str | None = option(
        None, "--allowed-hosts", metavar="NAME[,NAME]",
        help="Names the Host header may give besides IP addresses, localhost and this "
        "machine's name (.NAME: every name under it); others get 403 (DNS rebinding).",
        to="server.allowed_hosts", convert=_names,
    )  # fmt: skip
    cors_origins: str | None = option(
        None, "--cors-origins", metavar="ORIGIN[,ORIGIN]",
        help="Web pages of these origins (scheme://host:port; localhost: any page on this "
        "machine; * any, with --api-key only) may use the server (CORS); others get 403.",
        to="server.cors_origins", convert=_names,
    )  # fmt: skip
    allow_remote_media: str | None = option(
        None, "--allow-remote-media", metavar="HOST[,HOST]",
        help="Image addresses (http, https) on these hosts (host or host:port) are fetched "
        "by the server; any other address is refused (a request could make the server "
        "reach into its own network).",
        to="server.remote_media", convert=_names,
    )  # fmt: skip
    # ServerSettings.max_queue's (a test keeps them equal): the server is not imported
    # here, as its import (FastAPI) would slow every command by half a second.
    max_queue: int = option(
        16, "--max-queue", min=0,
        help="Requests that may wait while --parallel generate; more get 503.",
        to="server.max_queue",
    )  # fmt: skip
    parallel: int | None = option(
        None, "-np", "--parallel", min=1,
        help="Requests generated at once, every one's draft verified in one target batch; "
        "each has a context of -c tokens (default: 4 where the memory plan allows, else 1).",
    )  # fmt: skip


#: The help section of the prompt cache's options.
CACHE = "Prompt cache (llama-server's names)"
#: ``--cache-ram`` at most, when not given (llama-server's default), and ``--cache-disk``
#: when only ``--cache-dir`` is.
CACHE_MIB = 8192


def _mib(n: int | None) -> int | None:
    return None if n is None else n << 20


@dataclass(frozen=True)
class CacheOptions:
    """What is kept of prompts between requests: the engine's
    :class:`~specgguf.engine.config.CacheConfig` (``cache_ram`` and ``cache_disk`` in MiB;
    None: the command's default, see :func:`cache_config`)."""

    cache_ram: int | None = option(
        None, "-cram", "--cache-ram", min=0, metavar="MiB", panel=CACHE,
        help="Host memory for the prompts of sequences another request takes over, given "
        "back to a later request that shares more with them (default: half of what the "
        f"memory plan leaves, at most {CACHE_MIB}; 0: none, or with --cache-dir straight "
        "to its files).",
        to="cache.ram", convert=_mib,
    )  # fmt: skip
    cache_dir: Path | None = option(
        None, "--cache-dir", metavar="DIR", panel=CACHE,
        help="Keep the prompts evicted from --cache-ram in files here, and at shutdown "
        "what the sequences and --cache-ram hold, found again by a later server of the "
        "same models and settings (the folder is made if missing).",
        to="cache.disk_dir",
    )  # fmt: skip
    cache_disk: int | None = option(
        None, "--cache-disk", min=0, metavar="MiB", panel=CACHE,
        help=f"The most --cache-dir may hold (default {CACHE_MIB} with --cache-dir).",
        to="cache.disk", convert=_mib,
    )  # fmt: skip
    ctx_checkpoints: int = option(
        CacheConfig.ctx_checkpoints, "-ctxcp", "--ctx-checkpoints", min=0, panel=CACHE,
        help="Copies of a recurrent or hybrid target's state kept per sequence, at the end "
        "of each prompt and along long ones: a prompt that shares only a prefix goes back "
        "to one (0: read whole).",
        to="cache.ctx_checkpoints",
    )  # fmt: skip
    slot_prompt_similarity: float = option(
        CacheConfig.slot_similarity, "-sps", "--slot-prompt-similarity", min=0.0, max=1.0,
        panel=CACHE,
        help="A request goes to the free sequence sharing the longest prefix with it when "
        "that is more than this share of it, else to the least recently used (0 or 1: "
        "always the least recently used).",
        to="cache.slot_similarity",
    )  # fmt: skip


def cache_config(options: CacheOptions, ram: int = 0) -> CacheConfig:
    """The engine's cache configuration the options ask for; ``ram`` (bytes) when
    ``--cache-ram`` is not given.

    Raises:
        UsageError: --cache-disk without --cache-dir; a --cache-dir that is not a folder
            this process can make and write to.
    """
    args = config_args(options, "cache")
    if options.cache_disk is not None and options.cache_dir is None:
        raise UsageError("--cache-disk sizes the folder --cache-dir names: give one")
    if options.cache_dir is not None:
        _check_folder(options.cache_dir, "--cache-dir")
    args.setdefault("ram", ram)
    if options.cache_dir is not None:
        args.setdefault("disk", CACHE_MIB << 20)
    return CacheConfig(**args)


def _check_folder(path: Path, flag: str) -> None:
    """Make folder ``path`` if missing and check it can be written to.

    Raises:
        UsageError: it is not a folder, or cannot be made or written to.
    """
    import os

    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path} is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot make the folder ({e.strerror or e})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: this process cannot write there")


QuietOpt = Annotated[bool, typer.Option("-q", "--quiet", help="Nothing on stderr.")]

# The model options that `pull`, `list`, `info` and `check` take alone, as declared above
# (for mypy, the values' types).
if TYPE_CHECKING:
    from specgguf.hub.download import PullResult
    from specgguf.speculative.grammar import GrammarSpec

    HfRepoOpt = str | None
    HfRepoDraftOpt = str | None
    RegistryOpt = Path | None
else:
    HfRepoOpt = Options(ModelOptions).annotation("hf_repo")
    HfRepoDraftOpt = Options(ModelOptions).annotation("hf_repo_draft")
    RegistryOpt = Options(ModelOptions).annotation("registry")


def model_path(name: str, registry: Path | None = None) -> Path:
    """A model argument as a path: a .gguf file, an alias of the registry or a hub
    reference ``org/name[:QUANT]`` found in the local cache (see
    :func:`specgguf.hub.download.resolve_model`)."""
    from specgguf.hub.download import resolve_model
    from specgguf.hub.registry import load_registry

    if is_model_file(name):
        return resolve_model(name)
    return resolve_model(name, registry=load_registry(registry))


def _pull_hf(ref: str, say: Callable[[str], None], *, mmproj: bool = False) -> PullResult:
    """The model ``ref`` names on the hub (``mmproj``: and its projector, where the
    repository has one), pulled when not cached."""
    import sys

    from specgguf.hub.download import resolve_hf

    res = resolve_hf(ref, progress=sys.stderr.isatty(), say=say, mmproj=mmproj)
    for r, what in ((res, ref), (res.mmproj, f"{ref}'s projector")):
        if r is not None and r.source != "cache":
            say(f"specgguf: {what}: {r.path} ({r.size / 2**30:.2f} GiB, from {r.source})")
    return res


def is_model_file(name: str) -> bool:
    """Whether a model argument names a file (it exists or ends in .gguf), not an alias."""
    return name.endswith(".gguf") or Path(name).expanduser().exists()


def spec_type_drafter(value: str) -> tuple[str, str | None]:
    """specgguf's drafter for llama.cpp's ``--spec-type`` (a comma-separated list), and a
    one-line note where specgguf does something else than llama.cpp would.

    Raises:
        UsageError: a type llama.cpp does not have, or one specgguf cannot run.
    """
    known = spec_types()
    types = [t.strip().lower() for t in value.split(",") if t.strip()]
    if not types:
        raise UsageError("--spec-type needs a type, e.g. draft-simple or ngram-mod")
    for t in types:
        if t not in known and t.startswith("draft-"):
            runs = "; ".join(f"{e.help} ({', '.join(e.spec_types)})"
                             for e in DRAFTERS.values() if e.spec_types)  # fmt: skip
            raise UsageError(f"--spec-type {t}: specgguf drafts with {runs}, not with {t}")
        if t not in known:
            raise UsageError(f"--spec-type: unknown type {t!r}; llama.cpp's are {', '.join(known)}")
    kinds = {known[t] for t in types} - {NONE}
    notes = []
    for kind in dict.fromkeys(known[t] for t in types):
        if kind != NONE and (differs := DRAFTERS[kind].spec_note):
            named = ",".join(t for t in types if known[t] == kind)
            notes.append(f"--spec-type {named}: {differs}")
    note = f"specgguf: note: {'; '.join(notes)}" if notes else None
    if len(kinds) > 1:
        note = (note + "; " if note else "specgguf: note: ") + (
            f"{' with '.join(sorted(kinds))} is auto mode here: it picks one of them at "
            "every step by expected speed (llama.cpp prefers an n-gram match)"
        )
        return AUTO, note
    return (kinds.pop() if kinds else NONE), note


def _mtp_layers(path: Path) -> int:
    """The MTP layers a target's metadata declares that can draft for it (0 when it has
    none, its state cannot be rolled back, or it is unreadable: loading then says why)."""
    from specgguf.errors import SpecggufError
    from specgguf.gguf.arch import rolls_back
    from specgguf.gguf.info import read_model_info

    try:
        info = read_model_info(path)
    except (SpecggufError, OSError):
        return 0
    return info.nextn_layers if rolls_back(info.architecture) else 0


def _architecture(path: Path | None) -> str | None:
    """A model file's ``general.architecture`` (None: none, or unreadable: loading says
    why)."""
    from specgguf.errors import SpecggufError
    from specgguf.gguf.metadata import GGUFMetadata

    if path is None:
        return None
    try:
        with GGUFMetadata.open(path) as meta:
            return meta.architecture
    except (SpecggufError, OSError):
        return None


def _draft_kind(path: Path | None) -> str:
    """The drafter a draft file drafts with by default: the one whose head it is (an
    EAGLE-3 head: ``eagle3``), else a draft model's."""
    return head_of_draft(_architecture(path)) or "model"


def engine_config(
    load: ModelOptions,
    drafting: DraftOptions | None = None,
    *,
    say: Callable[[str], None] = lambda msg: None,
    media: bool = False,
) -> EngineConfig:
    """The engine configuration the options ask for (``drafting`` None: the defaults).
    ``hf_repo``/``hf_repo_draft`` name models on the hub as llama.cpp does
    (``org/name:QUANT``), pulled on first use; for a command that reads ``media``, with
    the target repository's projector, unless ``--mmproj`` or ``--no-mmproj`` is given
    (llama.cpp pulls it for llama-server and llama-mtmd-cli). Without a target model, the registry's
    default pair (downloaded on first use). ``spec_type`` is llama.cpp's name for the
    drafter (:func:`spec_type_drafter`). The drafter defaults to auto, or, with a fixed
    ``--draft K``, to the draft model when there is one, else the target's MTP layers
    where it has them, else n-gram lookup. Without a
    draft model (and unless ``no_draft``), one is chosen among the models on disk when the
    drafter can use it (:func:`specgguf.hub.draft_search.find_drafts`; ``draft_search``:
    more folders), and ``say`` tells which and why. ``rpc`` (``HOST:PORT,...``) spreads the
    target over RPC servers with ``tensor_split``; the draft stays local unless
    ``rpc_draft`` names servers for it. Every other option reaches the configuration its
    field's ``to`` names (:func:`~specgguf.cli.flags.config_args`).

    Raises:
        UsageError: flags that do not combine (``--drafter model`` without a draft model,
            --mmproj with --no-mmproj,
            a model given both as a file or alias and as -hf, -md with --no-draft, a
            --spec-type that names another drafter than --drafter, --rpc-draft without a
            draft model, a malformed --rpc or --tensor-split).
        ModelNotFoundError, UnknownModelError: a model name that names nothing usable.
        HubError and the other download errors: pulling a model failed.
    """
    import sys

    drafting = drafting or DraftOptions()
    drafter, model, model_draft = drafting.drafter, load.model, load.model_draft
    if drafter is not None and drafter not in drafter_kinds():
        raise UsageError(f"--drafter must be one of {', '.join(drafter_kinds())}, not {drafter!r}")
    if drafting.spec_type is not None:
        kind_of_type, note = spec_type_drafter(drafting.spec_type)
        if drafter is not None and drafter != kind_of_type:
            raise UsageError(f"--spec-type {drafting.spec_type} is --drafter {kind_of_type}, "
                             f"not --drafter {drafter}: give one")  # fmt: skip
        drafter = kind_of_type
        if note:
            say(note)
    _devices(load.device_draft)  # checked before anything is downloaded
    if load.no_draft and (model_draft is not None or load.hf_repo_draft is not None):
        raise UsageError("--no-draft and a draft model (-md/-hfd) exclude each other")
    if load.no_draft and drafter is not None and needs(drafter).draft_model:
        raise UsageError(f"--drafter {drafter} needs a draft model, and --no-draft refuses one")
    if load.no_mmproj and load.mmproj is not None:
        raise UsageError("--no-mmproj and --mmproj exclude each other: give one")
    mmproj = None  # the -hf repository's projector
    if load.hf_repo is not None:
        if model is not None:
            raise UsageError("-m/--model and -hf/--hf-repo both name the target: give one")
        wants = media and load.mmproj is None and not load.no_mmproj
        pulled = _pull_hf(load.hf_repo, say, mmproj=wants)
        model, mmproj = str(pulled.path), pulled.mmproj and pulled.mmproj.path
    if load.hf_repo_draft is not None:
        if model_draft is not None:
            raise UsageError("-md/--model-draft and -hfd/--hf-repo-draft both name the draft: "
                             "give one")  # fmt: skip
        model_draft = str(_pull_hf(load.hf_repo_draft, say).path)
    wants_model = (drafter in (None, AUTO) or needs(drafter).draft_model) and not load.no_draft
    if model is None:
        from specgguf.hub.download import default_pair
        from specgguf.hub.registry import load_registry

        reg = load_registry(load.registry)
        if reg.default_pair is None:
            raise UsageError("no target model: give one with -m/--model")
        want_draft = model_draft is None and wants_model
        pair = default_pair(reg, want_draft=want_draft, progress=sys.stderr.isatty(), say=say)
        model = str(pair.target)
        if pair.draft is not None:
            model_draft = str(pair.draft)
    target_path = model_path(model, load.registry)
    draft_path = model_path(model_draft, load.registry) if model_draft is not None else None
    head_kind = _draft_kind(draft_path) if draft_path is not None else "model"
    if drafter == "mtp" and head_kind == "assistant":
        drafter = "assistant"  # (llama.cpp's draft-mtp, with an MTP assistant as -md)
    # (a drafter with a head of its own, given another drafter's head: lookups and none
    # leave any draft unloaded, and the draft model's entry says it in its own words)
    own_head = drafter in DRAFTERS and DRAFTERS[drafter].head is not None
    if draft_path is not None and own_head and head_kind not in ("model", drafter):
        arch = _architecture(draft_path)
        raise UsageError(f"the draft {draft_path.name} is {article(arch)} {arch} head: it "
                         f"drafts as the {head_kind} drafter (or in auto mode)")  # fmt: skip
    if (arch := _architecture(target_path)) in DRAFT_HEAD_ARCHS:
        raise UsageError(f"{target_path.name} is {article(arch)} {arch} draft head, not "
                         "a model: give it with -md beside its target")  # fmt: skip
    head = DRAFTERS[drafter].head if drafter is not None and drafter in DRAFTERS else None
    if drafter is not None and draft_path is None and head is not None and head.architectures:
        # (the draft search looks for draft models, not heads)
        raise UsageError(f"--drafter {drafter} needs {needs(drafter).describe()}: give it with "
                         "-md FILE")  # fmt: skip
    searched = None
    own_layers = False  # the target's MTP layers draft, where nothing else is asked for
    if draft_path is None and wants_model and (drafter or AUTO) == AUTO:
        n_mtp = _mtp_layers(target_path)
        if n_mtp:  # the target's own layers draft, as Ollama and llama.cpp use them
            how = "auto mode drafts" if drafting.draft is None else "--draft K drafts"
            say(f"specgguf: note: {target_path.name} carries {n_mtp} multi-token-prediction "
                f"layer(s): {how} with them (no draft model is looked for; -md adds one "
                "instead)")  # fmt: skip
            wants_model, own_layers = False, True
    if draft_path is None and wants_model:
        searched = _find_draft(target_path, model, load.draft_search or (), load.registry, say)
        draft_path = searched
    fixed = _draft_kind(draft_path) if draft_path else ("mtp" if own_layers else "ngram")
    kind = drafter or (AUTO if drafting.draft is None else fixed)
    uses_model = kind == AUTO or needs(kind).draft_model
    if needs(kind).draft_model and draft_path is None:
        raise UsageError(
            f"--drafter {kind} needs a draft model (-md/--model-draft), and none on disk is "
            "compatible with the target (`specgguf list --drafts-for TARGET` says why)"
        )
    if not uses_model and model_draft is not None:
        say(f"specgguf: note: the {kind} drafter drafts without the draft model "
            f"{Path(model_draft).name}: it is not loaded")  # fmt: skip
    target = ModelConfig(target_path, **config_args(load, "target"))
    draft_args = config_args(load, "draft")
    draft_model = None
    if draft_path is not None and uses_model:
        if draft_args.get("devices") == () and not draft_args.get("rpc"):
            draft_args["n_gpu_layers"] = 0  # -devd none: the CPU alone
        draft_model = ModelConfig(draft_path, **draft_args)
    elif draft_args.get("rpc"):
        raise UsageError("--rpc-draft places the draft model's layers, and no draft model is "
                         "loaded")  # fmt: skip
    spec = SpeculativeConfig(drafter=kind, **config_args(drafting, "speculative"))
    if load.no_check and draft_model is not None and searched is None:
        say("specgguf: warning: --no-check: the draft's vocabulary was not checked")
    engine = config_args(load, "engine")
    if mmproj is not None:
        engine["mmproj"] = mmproj
    if engine.get("mmproj_draft") is not None and draft_model is None and draft_path is not None:
        say(f"specgguf: note: the {kind} drafter reads no draft model's text: "
            f"--mmproj-draft {Path(engine['mmproj_draft']).name} is not loaded")  # fmt: skip
        engine["mmproj_draft"] = None
    if engine.get("mmproj_draft") is not None and (engine.get("mmproj") is None
                                                   or draft_model is None):  # fmt: skip
        raise UsageError(
            "--mmproj-draft is the draft model's projector: it needs the "
            "target's (--mmproj) and a draft model (-md)"
        )
    return EngineConfig(target, draft_model, spec, **engine)


def _find_draft(
    target: Path,
    label: str,
    dirs: Sequence[Path],
    registry: Path | None,
    say: Callable[[str], None],
) -> Path | None:
    """The draft model chosen on disk for ``target`` (called ``label`` on the command
    line; None: none fits), said on stderr; a pair calibrated on this machine is judged by
    its measured draft-token cost (:func:`~specgguf.engine.calibration.measured_draft_cost`)."""
    import shlex

    from specgguf.cli.output import size
    from specgguf.engine.calibration import measured_draft_cost
    from specgguf.hub.draft_search import count, find_drafts
    from specgguf.hub.registry import load_registry

    found = find_drafts(target, search_dirs=dirs, registry=load_registry(registry),
                        measured=measured_draft_cost)  # fmt: skip
    c = found.chosen
    if c is None:
        if found.n_files:
            say(f"specgguf: no draft model: none of the {found.n_files} GGUF model(s) on disk "
                f"can draft for {target.name} (`specgguf list --drafts-for "
                f"{shlex.quote(label)}` says why)")  # fmt: skip
        return None
    say(f"specgguf: draft model {c.path.name} ({count(c.n_params)} parameters, "
        f"{c.quantization or '?'}, {size(c.file_size)}; {c.source}), chosen among "
        f"{found.n_files} on disk in {found.seconds:.2f} s: {c.reason} "
        "(--no-draft: none)")  # fmt: skip
    return c.path


def grammar_spec(
    json_schema: str | None,
    json_schema_file: Path | None,
    grammar: str | None,
    grammar_file: Path | None,
) -> GrammarSpec | None:
    """The one constraint on the output that ``run``'s flags give (llama.cpp's
    ``--json-schema``, ``-jf``, ``--grammar``, ``--grammar-file``), checked before any
    model loads (:func:`specgguf.engine.constraints.check_grammar`).

    Raises:
        UsageError: two of them, or a file that cannot be read.
        GrammarError: a schema or grammar that cannot be used.
    """
    from specgguf.engine.constraints import check_grammar
    from specgguf.speculative.grammar import GrammarSpec

    given = [(flag, v) for flag, v in (("--json-schema", json_schema),
             ("--json-schema-file", json_schema_file), ("--grammar", grammar),
             ("--grammar-file", grammar_file)) if v is not None]  # fmt: skip
    if not given:
        return None
    if len(given) > 1:
        raise UsageError(f"give one of {given[0][0]} and {given[1][0]}, not both")
    flag, value = given[0]
    if isinstance(value, Path):
        try:
            value = value.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"{flag}: cannot read {value}: {getattr(e, 'strerror', e)}") from None
    spec = GrammarSpec("json_schema" if "json" in flag else "gbnf", value)
    check_grammar(spec)
    return spec
