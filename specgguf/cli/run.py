"""``specgguf run``: flags in, one engine configuration, one generation, text out."""

from __future__ import annotations

import secrets
import sys
from pathlib import Path
from typing import Annotated

import typer

from specgguf.cli import options as o
from specgguf.cli.app import GroupedCommand, app, handled, setup_logging
from specgguf.cli.output import print_json, stderr_say


@app.command(cls=GroupedCommand, context_settings={"allow_interspersed_args": True})
@handled
def run(
    prompt: Annotated[
        str | None,
        typer.Argument(help="The prompt; '-' or omitted with piped input reads stdin."),
    ] = None,
    model: o.ModelOpt = None,
    hf_repo: o.HfRepoOpt = None,
    model_draft: o.ModelDraftOpt = None,
    hf_repo_draft: o.HfRepoDraftOpt = None,
    draft: o.DraftMaxOpt = None,
    draft_min: o.DraftMinOpt = 0,
    draft_tree: o.DraftTreeOpt = None,
    draft_p_min: o.DraftPMinOpt = 0.0,
    drafter: o.DrafterOpt = None,
    spec_type: o.SpecTypeOpt = None,
    ctx_size_draft: o.CtxSizeDraftOpt = None,
    n_gpu_layers_draft: o.NGpuLayersDraftOpt = -1,
    device_draft: o.DeviceDraftOpt = None,
    no_draft: o.NoDraftOpt = False,
    draft_search: o.DraftSearchOpt = None,
    n_predict: Annotated[
        int,
        typer.Option("-n", "--n-predict", min=-1, help="Tokens to generate (-1: until done)."),
    ] = -1,
    ctx_size: o.CtxSizeOpt = 4096,
    batch_size: o.BatchSizeOpt = 2048,
    threads: o.ThreadsOpt = None,
    temp: o.TempOpt = 0.8,
    top_k: o.TopKOpt = 40,
    top_p: o.TopPOpt = 0.95,
    min_p: o.MinPOpt = 0.05,
    seed: o.SeedOpt = -1,
    n_gpu_layers: o.NGpuLayersOpt = -1,
    stop: Annotated[
        list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")
    ] = None,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", help="Never generate end-of-generation tokens.")
    ] = False,
    prompt_opt: Annotated[
        str | None,
        typer.Option("-p", "--prompt", help="The prompt, as llama.cpp takes it (or the argument)."),
    ] = None,
    file: Annotated[
        Path | None, typer.Option("-f", "--file", help="Read the prompt from a file.")
    ] = None,
    system: Annotated[
        str | None, typer.Option("--system", help="System message for the chat template.")
    ] = None,
    raw: Annotated[
        bool, typer.Option("--raw", help="Send the prompt as is, without the chat template.")
    ] = False,
    no_repack: o.NoRepackOpt = False,
    no_check: o.NoCheckOpt = False,
    force: o.ForceOpt = False,
    deterministic: o.DeterministicOpt = False,
    rpc: o.RpcOpt = None,
    tensor_split: o.TensorSplitOpt = None,
    rpc_draft: o.RpcDraftOpt = None,
    rpc_timeout: o.RpcTimeoutOpt = o.DEFAULT_TIMEOUT,
    json_out: Annotated[
        bool, typer.Option("--json", help="One JSON object at the end instead of text.")
    ] = False,
    quiet: o.QuietOpt = False,
    verbose: Annotated[bool, typer.Option("-v", "--verbose", help="llama.cpp's logs.")] = False,
    registry: o.RegistryOpt = None,
) -> None:
    """Generate with speculative decoding: text on stdout, rates on stderr.

    Without -m, the registry's default pair is used (and downloaded on first use). With
    -m and no -md, a compatible draft model already on disk is chosen, and stderr says
    which and why (`specgguf list --drafts-for TARGET` lists them).

    Exit codes: 0 done, 2 usage, 3 model file, 4 incompatible draft, 5 does not fit,
    6 an RPC server does not answer, 9 llama.cpp error (an RPC server lost), 130
    interrupted, 141 stdout closed.
    """
    from specgguf.cli.display import (
        LoadProgress,
        live_allowed,
        loss_line,
        speculation_lost,
        stream,
        summary_line,
    )
    from specgguf.cli.prompt import read_prompt
    from specgguf.engine import Engine, preflight, render_prompt
    from specgguf.errors import Interrupted, UsageError
    from specgguf.speculative.loop import GenerationParams
    from specgguf.speculative.sampling import SamplerParams

    setup_logging(verbose=verbose, quiet=quiet)
    say = stderr_say(quiet)
    config = o.engine_config(
        model=model, model_draft=model_draft, drafter=drafter, draft=draft, ctx_size=ctx_size,
        ctx_size_draft=ctx_size_draft, batch_size=batch_size, threads=threads,
        n_gpu_layers=n_gpu_layers, n_gpu_layers_draft=n_gpu_layers_draft, no_repack=no_repack,
        draft_p_min=draft_p_min, draft_min=draft_min, draft_tree=draft_tree, spec_type=spec_type,
        device_draft=device_draft, no_draft=no_draft, draft_search=draft_search or (),
        no_check=no_check, force=force, registry=registry, deterministic=deterministic,
        hf_repo=hf_repo, hf_repo_draft=hf_repo_draft, rpc=rpc, rpc_draft=rpc_draft,
        tensor_split=tensor_split, rpc_timeout=rpc_timeout, say=say,
    )  # fmt: skip
    if raw and system is not None:
        raise UsageError("--system needs the chat template, and --raw sends the prompt without it")
    if prompt_opt is not None:
        if prompt is not None:
            raise UsageError("give the prompt as an argument or with -p/--prompt, not both")
        prompt = prompt_opt
    text = read_prompt(prompt, file)
    checked = preflight(config)  # before any weights load; the template too
    messages = [{"role": "system", "content": system}] if system is not None else []
    prepared = render_prompt(
        checked.target, text if raw else [*messages, {"role": "user", "content": text}]
    )
    seed_used = seed if seed >= 0 else secrets.randbits(32)
    sampler = SamplerParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                            seed=seed_used)  # fmt: skip
    params = GenerationParams(n_predict=n_predict, sampler=sampler, stop=tuple(stop or ()),
                              ignore_eos=ignore_eos)  # fmt: skip
    sizes = {m.path: m.file_size for m in (checked.target, checked.draft) if m is not None}
    with LoadProgress(sizes, quiet=quiet) as progress:
        engine = Engine(config, checked=checked, on_load_progress=progress)
    with engine:
        ids = engine.prepared_ids(prepared)
        gen = engine.generate(ids, params)
        # A forced drafter is compared with the target alone; auto mode weighs the target
        # alone at every step itself.
        forced = config.speculative.drafter not in ("auto", "none")
        alone = engine.target_alone_rate(measure=False) if forced else None
        live = not quiet and not json_out and live_allowed()
        result, interrupted = stream(gen, write=not json_out, live=live, target_alone=alone)
        if forced and alone is None and not interrupted:
            alone = engine.target_alone_rate()
        if alone and result.stats.steps:
            # The target alone pays this run's Python time per step too (on tiny models
            # it is most of the time).
            alone = 1.0 / (1.0 / alone + result.stats.python_seconds / result.stats.steps)
        if json_out:
            print_json({
                "text": result.text,
                "tokens": result.tokens,
                "finish_reason": result.finish_reason,
                "stats": {**result.stats.as_dict(), "target_alone_tokens_per_s":
                          round(alone, 3) if alone else None},
                "models": {**{k: engine.describe()[k] for k in ("target", "draft", "rpc",
                                                                 "rpc_draft")},
                           "drafter": config.speculative.drafter},
                "params": {
                    "draft_max": result.stats.draft_max,
                    "draft_min": config.speculative.draft_min, "n_predict": n_predict,
                    "n_ctx": checked.n_ctx, "temperature": temp, "top_k": top_k,
                    "top_p": top_p, "min_p": min_p, "seed": seed_used,
                    "stop": list(params.stop), "chat_template": prepared.templated,
                    "prompt_tokens": len(ids), "deterministic": deterministic,
                },
            })  # fmt: skip
        elif sys.stdout.isatty() and result.text and not result.text.endswith("\n"):
            print(file=sys.stderr)
        say(summary_line(result.stats, result.finish_reason))
        if alone is not None and speculation_lost(result.stats, alone):
            say(loss_line(result.stats, alone))
        if interrupted:
            raise Interrupted()
