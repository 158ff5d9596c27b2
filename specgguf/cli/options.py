"""Options shared by the commands that load models (``run``, ``bench``, ``serve``): one
definition each, and :func:`engine_config`, which turns them into one
:class:`~specgguf.engine.EngineConfig`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from specgguf.engine.config import EngineConfig, ModelConfig, SpeculativeConfig
from specgguf.errors import UsageError

ModelOpt = Annotated[
    str | None,
    typer.Option(
        "-m",
        "--model",
        help="Target model: a .gguf file, an alias, or org/name:QUANT when cached.",
    ),
]
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
        "-hfd", "-hfrd", "--hf-repo-draft", metavar="REPO[:QUANT]",
        help="Draft model on the Hugging Face hub, as -hf.",
    ),
]  # fmt: skip
ModelDraftOpt = Annotated[
    str | None,
    typer.Option(
        "-md",
        "-d",
        "--model-draft",
        help="Draft model: a .gguf file, an alias, or org/name:QUANT when cached.",
    ),
]
DraftOpt = Annotated[
    int | None,
    typer.Option(
        "--draft",
        "--draft-max",
        min=0,
        help="Fixed draft length K per step (with --drafter auto: the largest K).",
    ),
]
DrafterOpt = Annotated[
    str | None,
    typer.Option(
        "--drafter",
        help="auto, model, ngram, suffix (matching over all text seen) or none (the target "
        "alone). Default: auto, or with --draft K the draft model (with -md) else n-gram "
        "lookup, at that fixed K.",
    ),
]
CtxSizeOpt = Annotated[
    int, typer.Option("-c", "--ctx-size", min=0, help="Context size (0: the model's).")
]
CtxSizeDraftOpt = Annotated[
    int | None,
    typer.Option("-cd", "--ctx-size-draft", min=0, help="Draft context size (default: -c)."),
]
BatchSizeOpt = Annotated[int, typer.Option("-b", "--batch-size", min=1, help="Prompt batch size.")]
ThreadsOpt = Annotated[int | None, typer.Option("-t", "--threads", min=1, help="CPU threads.")]
NGpuLayersOpt = Annotated[
    int, typer.Option("-ngl", "--n-gpu-layers", help="Target layers on the GPU (-1: all).")
]
NGpuLayersDraftOpt = Annotated[
    int,
    typer.Option("-ngld", "--n-gpu-layers-draft", help="Draft layers on the GPU (-1: all)."),
]
DraftPMinOpt = Annotated[
    float,
    typer.Option(
        "--draft-p-min",
        min=0.0,
        max=1.0,
        help="Stop drafting below this probability (auto mode: at least 0.5).",
    ),
]
NoRepackOpt = Annotated[bool, typer.Option("-nr", "--no-repack", help="Disable weight repacking.")]
NoCheckOpt = Annotated[
    bool, typer.Option("--no-check", help="Skip the vocabulary check (with a warning).")
]
DeterministicOpt = Annotated[
    bool,
    typer.Option(
        "--deterministic",
        help="Output independent of the drafter, K and timings (greedy; sampling with "
        "--seed): fixed verification batch shapes, measured at start.",
    ),
]
ForceOpt = Annotated[
    bool, typer.Option("--force", help="Load even when the models seem not to fit.")
]

QuietOpt = Annotated[bool, typer.Option("-q", "--quiet", help="Nothing on stderr.")]

# Sampling settings (``serve``: the defaults of requests that do not set them).
TempOpt = Annotated[float, typer.Option("--temp", min=0.0, help="Temperature (0: greedy).")]
TopKOpt = Annotated[int, typer.Option("--top-k", min=0, help="Top-k (0: off).")]
TopPOpt = Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Top-p (1: off).")]
MinPOpt = Annotated[float, typer.Option("--min-p", min=0.0, max=1.0, help="Min-p (0: off).")]
SeedOpt = Annotated[int, typer.Option("--seed", help="RNG seed (-1: random).")]


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
    no_check: bool = False,
    force: bool = False,
    registry: Path | None = None,
    deterministic: bool = False,
    hf_repo: str | None = None,
    hf_repo_draft: str | None = None,
    say: Callable[[str], None] = lambda msg: None,
) -> EngineConfig:
    """The engine configuration the flags ask for. ``hf_repo``/``hf_repo_draft`` name
    models on the hub as llama.cpp does (``org/name:QUANT``), pulled on first use. Without
    a target model, the registry's default pair (downloaded on first use). The drafter
    defaults to auto, or, with a fixed ``--draft K``, to the draft model when there is
    one, else n-gram lookup.

    Raises:
        UsageError: flags that do not combine (``--drafter model`` without a draft model,
            a model given both as a file or alias and as -hf).
        ModelNotFoundError, UnknownModelError: a model name that names nothing usable.
        HubError and the other download errors: pulling a model failed.
    """
    import sys

    from specgguf.engine.config import check_drafter

    if drafter is not None:
        try:
            check_drafter(drafter)
        except UsageError:
            from specgguf.engine.drafting import DRAFTERS

            raise UsageError(
                f"--drafter must be one of {', '.join(DRAFTERS)}, not {drafter!r}"
            ) from None
    if hf_repo is not None:
        if model is not None:
            raise UsageError("-m/--model and -hf/--hf-repo both name the target: give one")
        model = str(_pull_hf(hf_repo, say))
    if hf_repo_draft is not None:
        if model_draft is not None:
            raise UsageError("-md/--model-draft and -hfd/--hf-repo-draft both name the draft: "
                             "give one")  # fmt: skip
        model_draft = str(_pull_hf(hf_repo_draft, say))
    if model is None:
        from specgguf.hub.download import default_pair
        from specgguf.hub.registry import load_registry

        reg = load_registry(registry)
        if reg.default_pair is None:
            raise UsageError("no target model: give one with -m/--model")
        want_draft = model_draft is None and drafter in (None, "model", "auto")
        pair = default_pair(reg, want_draft=want_draft, progress=sys.stderr.isatty(), say=say)
        model = str(pair.target)
        if pair.draft is not None:
            model_draft = str(pair.draft)
    kind = drafter or ("auto" if draft is None else ("model" if model_draft else "ngram"))
    if kind == "model" and model_draft is None:
        raise UsageError("--drafter model needs a draft model (-md/--model-draft)")
    repack = False if no_repack else None
    target = ModelConfig(model_path(model, registry), n_ctx=ctx_size, n_batch=batch_size,
                         n_gpu_layers=n_gpu_layers, n_threads=threads, repack=repack)  # fmt: skip
    draft_model = None
    if model_draft is not None and kind in ("model", "auto"):
        draft_model = ModelConfig(
            model_path(model_draft, registry), n_ctx=ctx_size_draft or 0, n_batch=batch_size,
            n_gpu_layers=n_gpu_layers_draft, n_threads=threads, repack=repack,
        )  # fmt: skip
    spec = SpeculativeConfig(
        drafter=kind, draft_max=-1 if draft is None else draft, p_min=draft_p_min
    )
    if no_check and draft_model is not None:
        say("specgguf: warning: --no-check: the draft's vocabulary was not checked")
    return EngineConfig(target, draft_model, spec, check_vocab=not no_check,
                        check_memory=not force, deterministic=deterministic)  # fmt: skip
