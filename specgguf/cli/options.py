"""Options shared by the commands that load models (``run``, ``bench``, ``serve``): one
definition each, and :func:`engine_config`, which turns them into one
:class:`~specgguf.engine.EngineConfig`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated

import typer

from specgguf.engine.config import EngineConfig, ModelConfig, SpeculativeConfig
from specgguf.errors import UsageError
from specgguf.llama.rpc import DEFAULT_TIMEOUT as DEFAULT_TIMEOUT

ModelOpt = Annotated[
    str | None,
    typer.Option(
        "-m",
        "--model",
        help="Target model: a .gguf file, an alias, or org/name:QUANT when cached.",
    ),
]

#: The help section of the speculative options. Each option lists all its names on one
#: line: specgguf's, llama.cpp's current ``--spec-*`` names (since 2026) and the former ones.
SPEC = "Speculative decoding (llama.cpp's --spec-* names and the former ones)"

RegistryOpt = Annotated[
    Path | None,
    typer.Option("--registry", help="An extra models.toml (adds to or overrides the registry)."),
]
HfRepoOpt = Annotated[
    str | None,
    typer.Option(
        "-hf", "-hfr", "--hf-repo", metavar="REPO[:QUANT]",
        help="Target model on the Hugging Face hub, as llama.cpp names it: org/name-GGUF"
        "[:QUANT] (quant case-insensitive, default Q4_K_M), downloaded on first use.",
    ),
]  # fmt: skip
HfRepoDraftOpt = Annotated[
    str | None,
    typer.Option(
        "-hfd", "-hfrd", "--hf-repo-draft", "--spec-draft-hf", metavar="REPO[:QUANT]",
        help="Draft model on the Hugging Face hub, as -hf.", rich_help_panel=SPEC,
    ),
]  # fmt: skip
ModelDraftOpt = Annotated[
    str | None,
    typer.Option(
        "-md", "-d", "--model-draft", "--spec-draft-model",
        help="Draft model: a .gguf file, an alias, or org/name:QUANT when cached. Default: "
        "the best compatible one already on disk (see --no-draft).",
        rich_help_panel=SPEC,
    ),
]  # fmt: skip
DraftMaxOpt = Annotated[
    int | None,
    typer.Option(
        "--draft", "--draft-max", "--spec-draft-n-max", min=0,
        help="Fixed draft length K per step (with --drafter auto: the largest K).",
        rich_help_panel=SPEC,
    ),
]  # fmt: skip
DraftMinOpt = Annotated[
    int,
    typer.Option(
        "--draft-min", "--spec-draft-n-min", min=0,
        help="Shortest draft verified: a step with room for fewer tokens, or whose drafter "
        "proposes fewer, runs without drafts.",
        rich_help_panel=SPEC,
    ),
]  # fmt: skip
DraftTreeOpt = Annotated[
    int | None,
    typer.Option(
        "--draft-tree", min=0, max=16, metavar="N",
        help="Verify up to N draft branches in one batch (token trees; greedy decoding "
        "only: with sampling, chains). auto: a tree of the suffix drafter's continuations "
        "where the measured batch costs say it pays (default 4); suffix: always trees "
        "(default 0: chains). 0: chains only.",
        rich_help_panel=SPEC,
    ),
]  # fmt: skip
DraftPMinOpt = Annotated[
    float,
    typer.Option(
        "--draft-p-min", "--spec-draft-p-min", min=0.0, max=1.0,
        help="Stop drafting below this probability (auto mode: at least 0.5).",
        rich_help_panel=SPEC,
    ),
]  # fmt: skip
DraftOpt = DraftMaxOpt
DrafterOpt = Annotated[
    str | None,
    typer.Option(
        "--drafter",
        help="auto (per step, the fastest of the draft model, n-gram lookup and suffix "
        "matching), model, ngram, suffix (matching over all text seen) or none (the target "
        "alone). Default: auto, or with --draft K the draft model (given or found) else "
        "n-gram lookup, at that fixed K.",
        rich_help_panel=SPEC,
    ),
]
SpecTypeOpt = Annotated[
    str | None,
    typer.Option(
        "--spec-type", metavar="TYPE[,TYPE]",
        help="llama.cpp's name for --drafter: draft-simple = model; ngram-simple, "
        "ngram-map-k, ngram-map-k4v, ngram-mod, ngram-cache = ngram (specgguf's own "
        "n-gram lookup); both kinds = auto; none.",
        rich_help_panel=SPEC,
    ),
]  # fmt: skip
CtxSizeOpt = Annotated[
    int, typer.Option("-c", "--ctx-size", min=0, help="Context size (0: the model's).")
]
CtxSizeDraftOpt = Annotated[
    int | None,
    typer.Option(
        "-cd", "--ctx-size-draft", "--spec-draft-ctx-size", min=0,
        help="Draft context size (default: -c).", rich_help_panel=SPEC,
    ),
]  # fmt: skip
BatchSizeOpt = Annotated[int, typer.Option("-b", "--batch-size", min=1, help="Prompt batch size.")]
ThreadsOpt = Annotated[int | None, typer.Option("-t", "--threads", min=1, help="CPU threads.")]


def gpu_layers(value: str | int) -> int:
    """A number of layers to offload, or llama.cpp's words: all and auto (both -1 here:
    every layer the build can offload; specgguf checks the memory before loading)."""
    if isinstance(value, int):
        return value
    text = value.strip().lower()
    if text in ("all", "auto"):
        return -1
    try:
        return int(text)
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not a number of layers, all or auto") from None


NGpuLayersOpt = Annotated[
    int,
    typer.Option(
        "-ngl", "--n-gpu-layers", "--gpu-layers", parser=gpu_layers, metavar="N|all|auto",
        help="Target layers on the GPU or RPC servers (-1, all, auto: all).",
    ),
]  # fmt: skip
NGpuLayersDraftOpt = Annotated[
    int,
    typer.Option(
        "-ngld", "--n-gpu-layers-draft", "--gpu-layers-draft", "--spec-draft-ngl",
        parser=gpu_layers, metavar="N|all|auto",
        help="Draft layers on the GPU or RPC servers (-1, all, auto: all).",
        rich_help_panel=SPEC,
    ),
]  # fmt: skip
DeviceDraftOpt = Annotated[
    str | None,
    typer.Option(
        "-devd", "--device-draft", "--spec-draft-device", metavar="none|DEV[,DEV]",
        help="Devices for the draft model, by ggml name (see `specgguf doctor`); none: the "
        "CPU.",
        rich_help_panel=SPEC,
    ),
]  # fmt: skip
NoDraftOpt = Annotated[
    bool,
    typer.Option(
        "--no-draft",
        help="No draft model: none is looked for on disk (auto mode still drafts with "
        "n-gram lookup and suffix matching).",
        rich_help_panel=SPEC,
    ),
]
NoRepackOpt = Annotated[bool, typer.Option("-nr", "--no-repack", help="Disable weight repacking.")]
DraftSearchOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--draft-search", metavar="DIR",
        help="Also look for a draft model under DIR (repeatable); the Hugging Face cache is "
        "always searched.",
        rich_help_panel=SPEC,
    ),
]  # fmt: skip
NoCheckOpt = Annotated[
    bool, typer.Option("--no-check", help="Skip the vocabulary check (with a warning).")
]
DeterministicOpt = Annotated[
    bool,
    typer.Option(
        "--deterministic",
        help="Output independent of the drafter, K and timings (greedy; sampling with "
        "--seed): fixed verification batch shapes and a q8_0 K cache, measured at start.",
    ),
]
ForceOpt = Annotated[
    bool, typer.Option("--force", help="Load even when the models seem not to fit.")
]
RpcOpt = Annotated[
    str | None,
    typer.Option(
        "--rpc", metavar="HOST:PORT[,...]",
        help="RPC servers (specgguf rpc-server) that take the target's layers, as "
        "llama.cpp's --rpc; -ngl counts the layers on them (and on local GPUs), the rest "
        "stay on this machine.",
    ),
]  # fmt: skip
RpcDraftOpt = Annotated[
    str | None,
    typer.Option(
        "--rpc-draft", metavar="HOST:PORT[,...]",
        help="RPC servers for the draft's layers (default: none, the draft stays local).",
        rich_help_panel=SPEC,
    ),
]  # fmt: skip
TensorSplitOpt = Annotated[
    str | None,
    typer.Option(
        "-ts", "--tensor-split", metavar="N0,N1,...",
        help="Proportions of the target's offloaded layers per device: the --rpc servers "
        "in order, then local GPUs (default: by free memory), as llama.cpp's -ts.",
    ),
]  # fmt: skip
RpcTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--rpc-timeout", min=0.1, metavar="SECONDS",
        help="Seconds an RPC server has to answer before loading, and its machine at the "
        "network level while generating.",
    ),
]  # fmt: skip

QuietOpt = Annotated[bool, typer.Option("-q", "--quiet", help="Nothing on stderr.")]

# Sampling settings (``serve``: the defaults of requests that do not set them).
TempOpt = Annotated[float, typer.Option("--temp", min=0.0, help="Temperature (0: greedy).")]
TopKOpt = Annotated[int, typer.Option("--top-k", min=0, help="Top-k (0: off).")]
TopPOpt = Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Top-p (1: off).")]
MinPOpt = Annotated[float, typer.Option("--min-p", min=0.0, max=1.0, help="Min-p (0: off).")]
SeedOpt = Annotated[int, typer.Option("--seed", help="RNG seed (-1: random).")]


def parse_tensor_split(text: str | None) -> tuple[float, ...]:
    """llama.cpp's ``-ts`` value: proportions separated by ``,`` or ``/``.

    Raises:
        UsageError: something that is not a number of 0 or more, or more than 16 of them.
    """
    from specgguf.engine.config import MAX_DEVICES

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


def model_path(name: str, registry: Path | None = None) -> Path:
    """A model argument as a path: a .gguf file, an alias of the registry or a hub
    reference ``org/name[:QUANT]`` found in the local cache (see
    :func:`specgguf.hub.download.resolve_model`)."""
    from specgguf.hub.download import resolve_model
    from specgguf.hub.registry import load_registry

    if is_model_file(name):
        return resolve_model(name)
    return resolve_model(name, registry=load_registry(registry))


def _pull_hf(ref: str, say: Callable[[str], None]) -> Path:
    """The first file of the model ``ref`` names on the hub, pulled when not cached."""
    import sys

    from specgguf.hub.download import resolve_hf

    res = resolve_hf(ref, progress=sys.stderr.isatty(), say=say)
    if res.source != "cache":
        say(f"specgguf: {ref}: {res.path} ({res.size / 2**30:.2f} GiB, from {res.source})")
    return res.path


def is_model_file(name: str) -> bool:
    """Whether a model argument names a file (it exists or ends in .gguf), not an alias."""
    return name.endswith(".gguf") or Path(name).expanduser().exists()


#: llama.cpp's --spec-type values (common/speculative.cpp, 2026) -> specgguf's drafter.
SPEC_TYPES = {
    "none": "none", "draft-simple": "model", "ngram-simple": "ngram", "ngram-map-k": "ngram",
    "ngram-map-k4v": "ngram", "ngram-mod": "ngram", "ngram-cache": "ngram",
}  # fmt: skip
#: llama.cpp's drafters that need a model specgguf cannot drive (a head inside or beside
#: the target), and what they are.
_HEADS = {
    "draft-mtp": "the target's multi-token-prediction head",
    "draft-eagle3": "an EAGLE-3 head",
    "draft-dflash": "a DFlash drafter",
}


def spec_type_drafter(value: str) -> tuple[str, str | None]:
    """specgguf's drafter for llama.cpp's ``--spec-type`` (a comma-separated list), and a
    one-line note where specgguf does something else than llama.cpp would.

    Raises:
        UsageError: a type llama.cpp does not have, or one specgguf cannot run.
    """
    types = [t.strip().lower() for t in value.split(",") if t.strip()]
    if not types:
        raise UsageError("--spec-type needs a type, e.g. draft-simple or ngram-mod")
    for t in types:
        if t in _HEADS or (t.startswith("draft-") and t not in SPEC_TYPES):
            what = _HEADS.get(t, "a drafting head")
            raise UsageError(
                f"--spec-type {t}: specgguf drafts with a separate draft model (draft-simple, "
                f"-md) or n-gram lookup (ngram-*), not with {what}"
            )
        if t not in SPEC_TYPES:
            raise UsageError(
                f"--spec-type: unknown type {t!r}; llama.cpp's are {', '.join(SPEC_TYPES)}"
            )
    kinds = {SPEC_TYPES[t] for t in types} - {"none"}
    ngrams = [t for t in types if SPEC_TYPES[t] == "ngram"]
    note = None
    if ngrams:
        note = (
            f"specgguf: note: --spec-type {','.join(ngrams)}: specgguf's n-gram lookup drafts "
            "what followed the latest earlier occurrence of the last 8 to 2 tokens of the "
            "prompt and output, without llama.cpp's n-gram counts, hash pool or cache files"
        )
    if kinds == {"model", "ngram"}:
        note = (note + "; " if note else "specgguf: note: ") + (
            "a draft model with n-gram lookup is auto mode here: it picks one of them at "
            "every step by expected speed (llama.cpp prefers an n-gram match)"
        )
        return "auto", note
    return (kinds.pop() if kinds else "none"), note


def engine_config(
    *,
    model: str | None,
    model_draft: str | None,
    drafter: str | None,
    draft: int | None,
    ctx_size: int,
    ctx_size_draft: int | None = None,
    batch_size: int = 2048,
    threads: int | None = None,
    n_gpu_layers: int = -1,
    n_gpu_layers_draft: int = -1,
    no_repack: bool = False,
    draft_p_min: float = 0.0,
    draft_min: int = 0,
    draft_tree: int | None = None,
    spec_type: str | None = None,
    device_draft: str | None = None,
    no_draft: bool = False,
    draft_search: Sequence[Path] = (),
    no_check: bool = False,
    force: bool = False,
    registry: Path | None = None,
    deterministic: bool = False,
    hf_repo: str | None = None,
    hf_repo_draft: str | None = None,
    rpc: str | None = None,
    rpc_draft: str | None = None,
    tensor_split: str | None = None,
    rpc_timeout: float | None = None,
    say: Callable[[str], None] = lambda msg: None,
) -> EngineConfig:
    """The engine configuration the flags ask for. ``hf_repo``/``hf_repo_draft`` name
    models on the hub as llama.cpp does (``org/name:QUANT``), pulled on first use. Without
    a target model, the registry's default pair (downloaded on first use). ``spec_type``
    is llama.cpp's name for the drafter (:func:`spec_type_drafter`). The drafter defaults
    to auto, or, with a fixed ``--draft K``, to the draft model when there is one, else
    n-gram lookup. Without a draft model (and unless ``no_draft``), one is chosen among the
    models on disk when the drafter can use it (:func:`specgguf.hub.draft_search.find_drafts`;
    ``draft_search``: more folders), and ``say`` tells which and why. ``rpc``
    (``HOST:PORT,...``) spreads the target over RPC servers with ``tensor_split``; the
    draft stays local unless ``rpc_draft`` names servers for it.

    Raises:
        UsageError: flags that do not combine (``--drafter model`` without a draft model,
            a model given both as a file or alias and as -hf, -md with --no-draft, a
            --spec-type that names another drafter than --drafter, --rpc-draft without a
            draft model, a malformed --rpc or --tensor-split).
        ModelNotFoundError, UnknownModelError: a model name that names nothing usable.
        HubError and the other download errors: pulling a model failed.
    """
    import sys

    from specgguf.engine.config import check_drafter

    if drafter is not None:
        try:
            check_drafter(drafter)
        except UsageError:
            from specgguf.engine.drafter_map import drafter_kinds

            raise UsageError(
                f"--drafter must be one of {', '.join(drafter_kinds())}, not {drafter!r}"
            ) from None
    if spec_type is not None:
        kind_of_type, note = spec_type_drafter(spec_type)
        if drafter is not None and drafter != kind_of_type:
            raise UsageError(f"--spec-type {spec_type} is --drafter {kind_of_type}, not "
                             f"--drafter {drafter}: give one")  # fmt: skip
        drafter = kind_of_type
        if note:
            say(note)
    devices = _devices(device_draft)
    if no_draft and (model_draft is not None or hf_repo_draft is not None):
        raise UsageError("--no-draft and a draft model (-md/-hfd) exclude each other")
    if no_draft and drafter == "model":
        raise UsageError("--drafter model needs a draft model, and --no-draft refuses one")
    if hf_repo is not None:
        if model is not None:
            raise UsageError("-m/--model and -hf/--hf-repo both name the target: give one")
        model = str(_pull_hf(hf_repo, say))
    if hf_repo_draft is not None:
        if model_draft is not None:
            raise UsageError("-md/--model-draft and -hfd/--hf-repo-draft both name the draft: "
                             "give one")  # fmt: skip
        model_draft = str(_pull_hf(hf_repo_draft, say))
    wants_model = drafter in (None, "model", "auto") and not no_draft
    if model is None:
        from specgguf.hub.download import default_pair
        from specgguf.hub.registry import load_registry

        reg = load_registry(registry)
        if reg.default_pair is None:
            raise UsageError("no target model: give one with -m/--model")
        want_draft = model_draft is None and wants_model
        pair = default_pair(reg, want_draft=want_draft, progress=sys.stderr.isatty(), say=say)
        model = str(pair.target)
        if pair.draft is not None:
            model_draft = str(pair.draft)
    target_path = model_path(model, registry)
    draft_path = model_path(model_draft, registry) if model_draft is not None else None
    searched = None
    if draft_path is None and wants_model:
        searched = _find_draft(target_path, model, draft_search, registry, say)
        draft_path = searched
    kind = drafter or ("auto" if draft is None else ("model" if draft_path else "ngram"))
    if kind == "model" and draft_path is None:
        raise UsageError(
            "--drafter model needs a draft model (-md/--model-draft), and none on disk is "
            "compatible with the target (`specgguf list --drafts-for TARGET` says why)"
        )
    repack = False if no_repack else None
    split = parse_tensor_split(tensor_split)
    servers = _servers("--rpc", rpc)
    servers_draft = _servers("--rpc-draft", rpc_draft)
    target = ModelConfig(target_path, n_ctx=ctx_size, n_batch=batch_size,
                         n_gpu_layers=n_gpu_layers, n_threads=threads, repack=repack,
                         rpc=servers, tensor_split=split)  # fmt: skip
    draft_model = None
    if draft_path is not None and kind in ("model", "auto"):
        draft_model = ModelConfig(
            draft_path, n_ctx=ctx_size_draft or 0, n_batch=batch_size,
            n_gpu_layers=0 if devices == () and not servers_draft else n_gpu_layers_draft,
            n_threads=threads, repack=repack, devices=devices, rpc=servers_draft,
        )  # fmt: skip
    elif servers_draft:
        raise UsageError("--rpc-draft places the draft model's layers, and no draft model is "
                         "loaded")  # fmt: skip
    spec = SpeculativeConfig(drafter=kind, draft_max=-1 if draft is None else draft,
                             p_min=draft_p_min, draft_min=draft_min,
                             draft_tree=-1 if draft_tree is None else draft_tree)  # fmt: skip
    if no_check and draft_model is not None and searched is None:
        say("specgguf: warning: --no-check: the draft's vocabulary was not checked")
    return EngineConfig(target, draft_model, spec, check_vocab=not no_check,
                        check_memory=not force, deterministic=deterministic,
                        rpc_timeout=rpc_timeout or DEFAULT_TIMEOUT)  # fmt: skip


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


def _find_draft(
    target: Path,
    label: str,
    dirs: Sequence[Path],
    registry: Path | None,
    say: Callable[[str], None],
) -> Path | None:
    """The draft model chosen on disk for ``target`` (called ``label`` on the command
    line; None: none fits), said on stderr."""
    import shlex

    from specgguf.cli.output import size
    from specgguf.hub.draft_search import count, find_drafts
    from specgguf.hub.registry import load_registry

    found = find_drafts(target, search_dirs=dirs, registry=load_registry(registry))
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
