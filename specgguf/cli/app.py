"""The ``specgguf`` command line: flags in, library calls, results out.

stdout carries data only (generated text, tables a user asked for, or JSON with ``--json``);
everything else goes to stderr. :func:`main` maps each :class:`SpecggufError` to a one-line
message and its exit code (see :mod:`specgguf.errors`); set ``SPECGGUF_DEBUG=1`` for a
traceback.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ParamSpec, TypeVar

import typer

from specgguf import __version__
from specgguf.errors import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERNAL,
    ContextOverflowError,
    Interrupted,
    OutputClosed,
    SpecggufError,
)

P = ParamSpec("P")
R = TypeVar("R")

app = typer.Typer(
    name="specgguf",
    help="Speculative decoding for llama.cpp GGUF models: a draft proposes, the target "
    "verifies, the output stays exactly the target's.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def handled(fn: Callable[P, R]) -> Callable[P, R]:
    """Wrap a command so that Ctrl-C and a closed stdout become :class:`Interrupted` and
    :class:`OutputClosed` (Click would turn them into exit 1)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            raise Interrupted() from None
        except BrokenPipeError:
            raise OutputClosed() from None

    return wrapper


def _version_callback(value: bool) -> None:
    if not value:
        return
    line = f"specgguf {__version__}"
    try:
        from specgguf.runtime import build_info

        line += f"\n{build_info().summary()}"
    except SpecggufError as e:
        line += f"\nllama.cpp: not available ({e})"
    sys.stdout.write(line + "\n")
    raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_version_callback,
            is_eager=True,
            help="Print the specgguf version and the llama.cpp build it runs on.",
        ),
    ] = False,
) -> None:
    """Speculative decoding for llama.cpp GGUF models."""


def _print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def _stdout_console() -> Any:
    """Rich console for data on stdout: a terminal's width, or wide enough not to wrap
    table cells when stdout is a pipe or file."""
    from rich.console import Console

    return Console(highlight=False, width=None if sys.stdout.isatty() else 240)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _size(n: int) -> str:
    """Bytes in binary units: 163.6 KiB, 1.04 GiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@app.command()
@handled
def doctor(
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    no_smoke: Annotated[
        bool, typer.Option("--no-smoke", help="Skip the smoke test (a tiny model generating).")
    ] = False,
) -> None:
    """Show the llama.cpp build, backends, CPU, memory, and run a smoke test.

    Exits 9 when the smoke test fails.
    """
    from specgguf.doctor import report
    from specgguf.errors import BackendError

    rep = report(smoke=not no_smoke)
    if json_out:
        _print_json(rep)
    else:
        from rich.table import Table

        t = Table(show_header=False, box=None, pad_edge=False)
        t.add_column(style="bold")
        t.add_column()
        p = rep["platform"]
        t.add_row("specgguf", rep["specgguf"])
        t.add_row("llama-cpp-python", rep["llama_cpp_python"])
        t.add_row("llama.cpp (ggml)", f"{rep['ggml_version']} {rep['ggml_commit']}")
        t.add_row("backends", ", ".join(rep["backends"]))
        t.add_row("GPU offload", "yes" if rep["gpu_offload"] else "no")
        for d in rep["devices"]:
            mem = f", {_gib(d['memory_free'])} free of {_gib(d['memory_total'])}"
            t.add_row(f"device {d['name']}", f"{d['description']} ({d['kind']}{mem})")
        t.add_row("CPU", f"{p['cpu']} ({p['cpu_count_physical']} cores, "
                  f"{p['cpu_count_logical']} threads)")  # fmt: skip
        t.add_row("CPU features", " ".join(p["cpu_flags"]) or "-")
        t.add_row("RAM", f"{_gib(p['ram_available'])} available of {_gib(p['ram_total'])}")
        t.add_row("AMX kernels built", "yes" if rep["amx_compiled"] else "no")
        t.add_row("weight repacking", f"{'on' if rep['weight_repacking'] else 'off'} "
                  f"({rep['weight_repacking_reason']})")  # fmt: skip
        match = "" if rep["build_matches_machine"] else " (this build lacks it: reinstall)"
        t.add_row("this machine", f"{rep['machine_backend']}{match}")
        t.add_row("install command", rep["install_hint"])
        if "smoke_test" in rep:
            s = rep["smoke_test"]
            verdict = "ok" if s["ok"] else "FAILED"
            t.add_row("smoke test", f"{verdict}: {s['detail']} ({s['seconds']:.1f} s)")
        _stdout_console().print(t)
    if rep.get("warning"):
        print(f"specgguf: warning: {rep['warning']}", file=sys.stderr)
    if "smoke_test" in rep and not rep["smoke_test"]["ok"]:
        raise BackendError(f"smoke test failed: {rep['smoke_test']['detail']}")


RegistryOpt = Annotated[
    Path | None,
    typer.Option("--registry", help="An extra models.toml (adds to or overrides the registry)."),
]


def _model_path(name: str, registry: Path | None = None) -> Path:
    """A model argument as a path: a .gguf file, or an alias of the registry found in the
    local cache (see :func:`specgguf.registry.resolve_model`)."""
    from specgguf.registry import load_registry, resolve_model

    path = Path(name).expanduser()
    if path.exists() or name.endswith(".gguf"):
        return resolve_model(name)
    return resolve_model(name, registry=load_registry(registry))


def _count(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit} ({n:,})"
    return f"{n:,}"


def _num(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _tok(t: dict[str, Any] | None) -> str:
    return "-" if t is None else f"{t['id']} {t['text']!r}"


@app.command()
@handled
def info(
    model: Annotated[
        str, typer.Argument(help="A .gguf file (first shard of a split model) or an alias.")
    ],
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    registry: RegistryOpt = None,
) -> None:
    """Show what a GGUF model holds, from its metadata alone (no weights load).

    Exits 3 when the file is missing or not a readable GGUF file.
    """
    from specgguf.modelinfo import read_model_info

    mi = read_model_info(_model_path(model, registry)).as_dict()
    if json_out:
        _print_json(mi)
        return
    from rich.table import Table

    v = mi["vocab"]
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    shards = f"{mi['split_count']}"
    if mi["missing_shards"]:
        shards += f" ({len(mi['missing_shards'])} missing: {', '.join(mi['missing_shards'])})"
    rows = [
        ("file", mi["path"]),
        ("name", mi["name"] or "-"),
        ("architecture", mi["architecture"] or "-"),
        ("size label", mi["size_label"] or "-"),
        ("quantization", mi["quantization"] or "-"),
        ("parameters", _count(mi["n_params"])),
        ("context length", _num(mi["context_length"])),
        ("blocks", _num(mi["block_count"])),
        ("embedding length", _num(mi["embedding_length"])),
        ("heads / KV heads", f"{mi['head_count'] or '-'} / {mi['head_count_kv'] or '-'}"),
        ("tokenizer", f"{v['tokenizer_model']} ({v['vocab_type'].upper()}), "
                      f"pre-tokenizer {v['pre_tokenizer'] or '-'}"),
        ("tokens", f"{v['n_tokens']:,}" + (f", {v['n_merges']:,} merges" if v["n_merges"] else "")),
        ("BOS", _tok(v["bos"]) + f" (add_bos {str(v['add_bos']).lower()})"),
        ("EOS", _tok(v["eos"]) + f" (add_eos {str(v['add_eos']).lower()})"),
        ("EOT", _tok(v["eot"])),
        ("padding", _tok(v["padding"])),
        ("end of generation", ", ".join(_tok(x) for x in v["eog"]) or "-"),
        ("chat template", "yes" if mi["has_chat_template"] else "no"),
        ("tensors", f"{mi['n_tensors']:,}"),
        ("file size", f"{mi['file_size']:,} bytes ({_size(mi['file_size'])})"),
        ("splits", shards),
        ("GGUF version", str(mi["gguf_version"])),
    ]  # fmt: skip
    for k, val in rows:
        t.add_row(k, val)
    _stdout_console().print(t)


@app.command()
@handled
def check(
    target: Annotated[str, typer.Argument(help="The target model (.gguf or alias).")],
    draft: Annotated[str, typer.Argument(help="The draft model (.gguf or alias).")],
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    registry: RegistryOpt = None,
) -> None:
    """Tell whether DRAFT can draft for TARGET, from their vocabularies (no weights load).

    Exit codes: 0 compatible, 4 incompatible, 3 a file is missing or unreadable.
    """
    from specgguf.errors import EXIT_INCOMPATIBLE
    from specgguf.vocab import check_compatibility

    report = check_compatibility(_model_path(target, registry), _model_path(draft, registry))
    if json_out:
        _print_json(report.as_dict())
    else:
        _print_check(report)
    if not report.compatible:
        raise typer.Exit(EXIT_INCOMPATIBLE)


def _print_check(report: Any) -> None:
    from rich.table import Table

    con = _stdout_console()
    t = Table(box=None, pad_edge=False, header_style="bold")
    t.add_column("")
    t.add_column("target", overflow="fold")
    t.add_column("draft", overflow="fold")
    tv, dv = report.target.as_dict(), report.draft.as_dict()
    t.add_row("file", str(report.target.path), str(report.draft.path))
    t.add_row("architecture", report.target.architecture or "-", report.draft.architecture or "-")
    for label, key in (("tokenizer", "tokenizer_model"), ("pre-tokenizer", "pre_tokenizer")):
        t.add_row(label, str(tv[key]), str(dv[key]))
    t.add_row("tokens", f"{tv['n_tokens']:,}", f"{dv['n_tokens']:,}")
    t.add_row("merges", f"{tv['n_merges']:,}", f"{dv['n_merges']:,}")
    for label, key in (("BOS", "bos"), ("EOS", "eos"), ("EOT", "eot")):
        t.add_row(label, _tok(tv[key]), _tok(dv[key]))
    t.add_row("add_bos / add_eos", f"{tv['add_bos']} / {tv['add_eos']}".lower(),
              f"{dv['add_bos']} / {dv['add_eos']}".lower())  # fmt: skip
    con.print(t)
    d = report.token_diff
    if d.n_compared:
        con.print(f"token texts: {d.n_different:,} of {d.n_compared:,} ids differ (ids 5.."
                  f"{5 + d.n_compared - 1})", highlight=False, markup=False)  # fmt: skip
    for f in report.findings:
        con.print(f"{f.severity}: [{f.code}] {f.message}", highlight=False, markup=False)
    con.print(report.verdict(), highlight=False, markup=False)


@app.command(context_settings={"allow_interspersed_args": True})
@handled
def run(
    prompt: Annotated[
        str | None,
        typer.Argument(help="The prompt; '-' or omitted with piped input reads stdin."),
    ] = None,
    model: Annotated[
        str | None, typer.Option("-m", "--model", help="Target model: a .gguf file or an alias.")
    ] = None,
    model_draft: Annotated[
        str | None,
        typer.Option("-md", "-d", "--model-draft", help="Draft model: a .gguf file or alias."),
    ] = None,
    draft: Annotated[
        int | None,
        typer.Option(
            "--draft",
            "--draft-max",
            min=0,
            help="Fixed draft length K per step (with --drafter auto: the largest K).",
        ),
    ] = None,
    drafter: Annotated[
        str | None,
        typer.Option(
            "--drafter",
            help="auto, model, ngram or none (the target alone). Default: auto, or with "
            "--draft K the draft model (with -md) else n-gram lookup, at that fixed K.",
        ),
    ] = None,
    n_predict: Annotated[
        int,
        typer.Option("-n", "--n-predict", min=-1, help="Tokens to generate (-1: until done)."),
    ] = -1,
    ctx_size: Annotated[
        int, typer.Option("-c", "--ctx-size", min=0, help="Context size (0: the model's).")
    ] = 4096,
    ctx_size_draft: Annotated[
        int | None,
        typer.Option("-cd", "--ctx-size-draft", min=0, help="Draft context size (default: -c)."),
    ] = None,
    batch_size: Annotated[
        int, typer.Option("-b", "--batch-size", min=1, help="Prompt batch size.")
    ] = 2048,
    threads: Annotated[
        int | None, typer.Option("-t", "--threads", min=1, help="CPU threads.")
    ] = None,
    temp: Annotated[float, typer.Option("--temp", min=0.0, help="Temperature (0: greedy).")] = 0.8,
    top_k: Annotated[int, typer.Option("--top-k", min=0, help="Top-k (0: off).")] = 40,
    top_p: Annotated[
        float, typer.Option("--top-p", min=0.0, max=1.0, help="Top-p (1: off).")
    ] = 0.95,
    min_p: Annotated[
        float, typer.Option("--min-p", min=0.0, max=1.0, help="Min-p (0: off).")
    ] = 0.05,
    seed: Annotated[int, typer.Option("--seed", help="RNG seed (-1: random).")] = -1,
    n_gpu_layers: Annotated[
        int, typer.Option("-ngl", "--n-gpu-layers", help="Target layers on the GPU (-1: all).")
    ] = -1,
    n_gpu_layers_draft: Annotated[
        int,
        typer.Option("-ngld", "--n-gpu-layers-draft", help="Draft layers on the GPU (-1: all)."),
    ] = -1,
    stop: Annotated[
        list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")
    ] = None,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", help="Never generate end-of-generation tokens.")
    ] = False,
    file: Annotated[
        Path | None, typer.Option("-f", "--file", help="Read the prompt from a file.")
    ] = None,
    system: Annotated[
        str | None, typer.Option("--system", help="System message for the chat template.")
    ] = None,
    raw: Annotated[
        bool, typer.Option("--raw", help="Send the prompt as is, without the chat template.")
    ] = False,
    draft_p_min: Annotated[
        float,
        typer.Option(
            "--draft-p-min",
            min=0.0,
            max=1.0,
            help="Stop drafting below this probability (auto mode: at least 0.5).",
        ),
    ] = 0.0,
    no_repack: Annotated[
        bool, typer.Option("-nr", "--no-repack", help="Disable weight repacking.")
    ] = False,
    no_check: Annotated[
        bool, typer.Option("--no-check", help="Skip the vocabulary check (with a warning).")
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Load even when the models seem not to fit.")
    ] = False,
    json_out: Annotated[
        bool, typer.Option("--json", help="One JSON object at the end instead of text.")
    ] = False,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="Nothing on stderr.")] = False,
    verbose: Annotated[bool, typer.Option("-v", "--verbose", help="llama.cpp's logs.")] = False,
    registry: RegistryOpt = None,
) -> None:
    """Generate with speculative decoding: text on stdout, rates on stderr.

    Without -m, the registry's default pair is used (and downloaded on first use).

    Exit codes: 0 done, 2 usage, 3 model file, 4 incompatible draft, 5 does not fit,
    9 llama.cpp error, 130 interrupted, 141 stdout closed.
    """
    import secrets

    from specgguf.display import LiveStats, live_allowed, summary_line
    from specgguf.errors import UsageError
    from specgguf.prepare import preflight, prepare_prompt, read_prompt
    from specgguf.runtime import set_verbose
    from specgguf.sampling import SamplerParams
    from specgguf.speculative import AUTO_K_MAX, GenerationParams, SpeculativeEngine

    set_verbose(verbose)

    def say(msg: str) -> None:
        if not quiet:
            print(msg, file=sys.stderr, flush=True)

    if model is None:
        model, model_draft, _ = _default_pair(registry, model_draft, drafter, say)
    if drafter is None:
        drafter = "auto" if draft is None else ("model" if model_draft else "ngram")
    kind = drafter
    if kind not in ("auto", "model", "ngram", "none"):
        raise UsageError(f"--drafter must be auto, model, ngram or none, not {kind!r}")
    draft = (AUTO_K_MAX if kind == "auto" else 4) if draft is None else draft
    if kind == "model" and model_draft is None:
        raise UsageError("--drafter model needs a draft model (-md/--model-draft)")
    target_path = _model_path(model, registry)
    draft_path = (
        _model_path(model_draft, registry) if model_draft and kind in ("model", "auto") else None
    )
    text = read_prompt(prompt, file)
    if no_check and draft_path is not None:
        say("specgguf: warning: --no-check: the draft's vocabulary was not checked")
    pre = preflight(
        target_path,
        draft_path,
        n_ctx=ctx_size,
        n_ctx_draft=ctx_size_draft,
        check_vocab=not no_check,
        check_memory=not force,
        n_gpu_layers=n_gpu_layers,
        n_gpu_layers_draft=n_gpu_layers_draft,
    )
    n_ctx = pre.n_ctx
    prepared = prepare_prompt(pre.target, text, system=system, raw=raw)
    seed_used = seed if seed >= 0 else secrets.randbits(32)
    sampler = SamplerParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                            seed=seed_used)  # fmt: skip
    gen_params = GenerationParams(
        n_predict=n_predict, draft_max=draft if kind != "none" else 0, sampler=sampler,
        stop=tuple(stop or ()), ignore_eos=ignore_eos,
    )  # fmt: skip
    with SpeculativeEngine(
        target_path,
        draft_path,
        drafter=kind,  # type: ignore[arg-type]
        n_ctx=n_ctx,
        n_ctx_draft=ctx_size_draft,
        n_batch=batch_size,
        n_threads=threads,
        n_gpu_layers=n_gpu_layers,
        n_gpu_layers_draft=n_gpu_layers_draft,
        use_extra_bufts=False if no_repack else None,
        p_min=draft_p_min,
        k_max=draft,
    ) as engine:
        ids = engine.tokenize(prepared.text, add_special=prepared.add_special)
        # llama.cpp rounds a context up (to 256 positions at least); keep to the one asked.
        room = n_ctx - len(ids)
        if room < 1:
            raise ContextOverflowError(len(ids), n_ctx)
        if gen_params.n_predict < 0 or gen_params.n_predict > room:
            gen_params = dataclasses.replace(gen_params, n_predict=room)
        gen = engine.generate(ids, gen_params)
        live = LiveStats(gen.stats, enabled=not quiet and not json_out and live_allowed())
        interrupted = False
        try:
            with live:
                for piece in gen:
                    if not json_out:
                        sys.stdout.write(piece)
                        sys.stdout.flush()
                    live.update()
        except KeyboardInterrupt:
            interrupted = True
            gen.interrupt()
        result = gen.result
        assert result is not None
        if json_out:
            _print_json({
                "text": result.text,
                "tokens": result.tokens,
                "finish_reason": result.finish_reason,
                "stats": result.stats.as_dict(),
                "models": {
                    "target": str(target_path),
                    "draft": str(draft_path) if draft_path else None,
                    "drafter": kind,
                },
                "params": {
                    "draft_max": gen_params.draft_max, "n_predict": n_predict, "n_ctx": n_ctx,
                    "temperature": temp, "top_k": top_k, "top_p": top_p, "min_p": min_p,
                    "seed": seed_used, "stop": list(gen_params.stop),
                    "chat_template": prepared.templated, "prompt_tokens": len(ids),
                },
            })  # fmt: skip
        elif sys.stdout.isatty() and result.text and not result.text.endswith("\n"):
            print(file=sys.stderr)
        say(summary_line(result.stats, result.finish_reason))
        if interrupted:
            raise Interrupted()


def _default_pair(
    registry: Path | None, model_draft: str | None, drafter: str | None, say: Any
) -> tuple[str, str | None, int]:
    """The registry's default pair, pulled into the cache on first use (progress on
    stderr). Returns (target alias, draft alias or the given draft, suggested K)."""
    from specgguf.errors import UsageError
    from specgguf.hub import pull
    from specgguf.registry import load_registry

    reg = load_registry(registry)
    if reg.default_pair is None:
        raise UsageError("no target model: give one with -m/--model")
    pair = reg.pairs[reg.default_pair]
    wanted = [pair.target]
    if model_draft is None and drafter in (None, "model"):
        model_draft = pair.draft
        wanted.append(pair.draft)
    for alias in wanted:
        res = pull(reg.model(alias), progress=sys.stderr.isatty(), say=say)
        if res.source != "cache":
            say(f"specgguf: {alias}: {res.path} ({_size(res.size)}, from {res.source})")
    return pair.target, model_draft, pair.draft_max


@app.command()
@handled
def pull(
    names: Annotated[
        list[str], typer.Argument(help="Model aliases or a pair name (see `specgguf list`).")
    ],
    quant: Annotated[
        str | None, typer.Option("--quant", help="Quantization, e.g. Q4_K_M, Q8_0.")
    ] = None,
    revision: Annotated[
        str | None, typer.Option("--revision", help="A branch, tag or commit of the repo.")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="No progress on stderr.")] = False,
    registry: RegistryOpt = None,
) -> None:
    """Download models or a pair from the Hugging Face hub into its standard cache.

    Two models, or a pair, are checked for vocabulary compatibility afterwards.
    Exit codes: 6 hub error or not found, 7 access refused (gated/private), 5 not enough
    disk, 8 integrity check failed, 4 the pulled pair is incompatible.
    """
    from specgguf.errors import EXIT_INCOMPATIBLE
    from specgguf.hub import pull as hub_pull
    from specgguf.registry import load_registry
    from specgguf.vocab import check_compatibility

    reg = load_registry(registry)
    aliases: list[str] = []
    for name in names:
        pair = reg.pair(name)
        aliases += [pair.target, pair.draft] if pair else [reg.model(name).alias]

    def say(msg: str) -> None:
        if not quiet:
            print(msg, file=sys.stderr, flush=True)

    results = [
        hub_pull(reg.model(a), quant=quant, revision=revision,
                 progress=not quiet and sys.stderr.isatty(), say=say)
        for a in aliases
    ]  # fmt: skip
    report = None
    if len(results) == 2:
        report = check_compatibility(results[0].path, results[1].path)
    if json_out:
        _print_json({
            "models": [
                {"alias": r.entry.alias, "repo": r.entry.repo, "path": str(r.path),
                 "files": [str(p) for p in r.paths], "size": r.size, "source": r.source}
                for r in results
            ],
            "check": report.as_dict() if report else None,
        })  # fmt: skip
    else:
        for r in results:
            sys.stdout.write(f"{r.entry.alias}\t{r.path}\t{_size(r.size)}\t{r.source}\n")
        if report is not None:
            sys.stdout.write(report.verdict() + "\n")
    if report is not None and not report.compatible:
        raise typer.Exit(EXIT_INCOMPATIBLE)


@app.command(name="list")
@handled
def list_models(
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    registry: RegistryOpt = None,
) -> None:
    """List the registry's models and pairs, which are downloaded, and their sizes.

    Reads only the registry and the local cache: no network.
    """
    from specgguf.hub import local_listing
    from specgguf.registry import load_registry

    reg = load_registry(registry)
    models, pairs = local_listing(reg)
    if json_out:
        _print_json(
            {"models": models, "pairs": pairs, "registry_files": [str(f) for f in reg.files]}
        )
        return
    from rich.table import Table

    con = _stdout_console()
    t = Table(title="models", title_justify="left", box=None, header_style="bold")
    for col in ("alias", "params", "quant", "size", "present", "repository / file"):
        t.add_column(col)
    for x in models:
        names = x["alias"] + (f" ({', '.join(x['aliases'])})" if x["aliases"] else "")
        t.add_row(names, x["params"] or "-", x["quant"], _size(x["size"]) if x["size"] else "?",
                  "yes" if x["present"] else "no", f"{x['repo']}/{x['file']}")  # fmt: skip
    con.print(t)
    t = Table(title="pairs", title_justify="left", box=None, header_style="bold")
    for col in ("pair", "target", "draft", "K", "size", "present", "note"):
        t.add_column(col)
    for p in pairs:
        name = p["name"] + (" (default)" if p["default"] else "")
        t.add_row(name, p["target"], p["draft"], str(p["draft_max"]),
                  _size(p["size"]) if p["size"] else "?", "yes" if p["present"] else "no",
                  p["note"] or "")  # fmt: skip
    con.print(t)


@app.command()
@handled
def bench(
    model: Annotated[
        str | None, typer.Option("-m", "--model", help="Target model (default: the default pair).")
    ] = None,
    model_draft: Annotated[
        str | None, typer.Option("-md", "-d", "--model-draft", help="Draft model.")
    ] = None,
    draft: Annotated[
        str, typer.Option("--draft", help="Draft lengths to try, comma-separated.")
    ] = "1,2,4,8",
    prompts: Annotated[
        Path | None,
        typer.Option("--prompts", help="JSON list of {category, prompt} (default: built-in)."),
    ] = None,
    categories: Annotated[
        str | None, typer.Option("--categories", help="Only these categories, comma-separated.")
    ] = None,
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", min=1)] = 128,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Interleaved rounds.")] = 2,
    ctx_size: Annotated[int, typer.Option("-c", "--ctx-size", min=256)] = 4096,
    threads: Annotated[int | None, typer.Option("-t", "--threads", min=1)] = None,
    no_repack: Annotated[bool, typer.Option("-nr", "--no-repack")] = False,
    json_out: Annotated[
        bool, typer.Option("--json", help="All numbers as JSON on stdout.")
    ] = False,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Draw speedup against K (needs matplotlib).")
    ] = None,
    registry: RegistryOpt = None,
) -> None:
    """Measure the target alone, each drafter at each draft length, and auto mode, on a
    prompt set with categories, interleaved in one process; speedups are relative to the
    target alone in the same run."""
    from specgguf.bench import CATEGORIES, PROMPTS, load_prompts, run_bench
    from specgguf.errors import UsageError
    from specgguf.speculative import AUTO_K_MAX, SpeculativeEngine

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if model is None:
        model, model_draft, _ = _default_pair(registry, model_draft, None, say)
    try:
        ks = sorted({int(x) for x in draft.split(",") if x.strip()})
    except ValueError:
        raise UsageError(f"--draft takes comma-separated integers, not {draft!r}") from None
    if not ks or ks[0] < 1:
        raise UsageError(f"--draft takes draft lengths of 1 or more, not {draft!r}")
    if plot is not None:
        _check_plot_path(plot)  # before the run, not after it
    chosen = load_prompts(prompts) if prompts else PROMPTS
    if categories:
        wanted = set(categories.split(","))
        unknown = wanted - {c for c, _ in chosen}
        if unknown:
            raise UsageError(f"unknown categories {sorted(unknown)}; known: {list(CATEGORIES)}")
        chosen = [(c, p) for c, p in chosen if c in wanted]
    target_path = _model_path(model, registry)
    draft_path = _model_path(model_draft, registry) if model_draft else None
    configs = [("target", "none", 0)]
    if draft_path is not None:
        configs += [(f"model-K{k}", "model", k) for k in ks]
    configs += [(f"ngram-K{k}", "ngram", k) for k in ks]
    configs.append(("auto", "auto", max(AUTO_K_MAX, *ks)))
    with SpeculativeEngine(
        target_path, draft_path, drafter="auto", n_ctx=ctx_size, n_threads=threads,
        use_extra_bufts=False if no_repack else None, k_max=max(AUTO_K_MAX, *ks),
    ) as engine:  # fmt: skip
        report = run_bench(engine, chosen, configs, n=n_predict, rounds=rounds,
                           progress=say if sys.stderr.isatty() else (lambda m: None))  # fmt: skip
    if json_out:
        _print_json(report)
    _print_bench(report, stderr=json_out)
    if plot is not None:
        _plot_bench(report, plot)


def _print_bench(report: dict[str, Any], *, stderr: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(stderr=True, highlight=False) if stderr else _stdout_console()
    m = report["machine"]
    t = Table(
        title=f"{Path(report['models']['target']).name} + "
        f"{Path(report['models']['draft']).name if report['models']['draft'] else 'no draft'}"
        f", {m['cpu']}, {m['threads']} threads, n={report['params']['n_predict']}, greedy",
        title_justify="left", box=None, header_style="bold",
    )  # fmt: skip
    for col in ("category", "config", "tokens/s", "speedup", "accept", "mean acc",
                "target/draft/other"):  # fmt: skip
        t.add_column(col, justify="left" if col in ("category", "config") else "right")
    for r in report["results"]:
        t.add_row(
            r["category"], r["config"], f"{r['tokens_per_s']:.2f}",
            f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-",
            f"{r['acceptance_rate']:.0%}" if r["config"] != "target" else "-",
            f"{r['mean_accepted']:.2f}",
            f"{r['target_share']:.0%}/{r['draft_share']:.0%}/{r['python_share']:.0%}",
        )  # fmt: skip
    con.print(t)
    mem = report["memory"]
    con.print(f"peak RSS {_size(mem['peak_rss'])} = {mem['ratio']:.2f} x (model files "
              f"{_size(mem['model_files'])} + KV caches {_size(mem['kv_caches'])}); "
              f"{report['wall_seconds']:.0f} s", highlight=False)  # fmt: skip


def _check_plot_path(path: Path) -> None:
    """Raises UsageError when --plot cannot work: no matplotlib, or a folder that does not
    exist or cannot be written."""
    import importlib.util

    from specgguf.errors import UsageError

    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib: pip install 'specgguf[plot]'")
    folder = path.parent  # Path("x.png").parent is Path(".")
    if path.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
        raise UsageError(f"--plot: cannot write {path}")


def _plot_bench(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    from specgguf.errors import UsageError

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = list(dict.fromkeys(r["category"] for r in report["results"]))
    fig, axes = plt.subplots(1, len(cats), figsize=(4 * len(cats), 3.5), squeeze=False)
    for ax, cat in zip(axes[0], cats, strict=True):
        rows = [r for r in report["results"] if r["category"] == cat]
        for kind in ("model", "ngram"):
            pts = sorted((int(r["config"].split("-K")[1]), r["speedup"]) for r in rows
                         if r["config"].startswith(kind + "-K"))  # fmt: skip
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=kind)
        auto = next((r["speedup"] for r in rows if r["config"] == "auto"), None)
        if auto is not None:
            ax.axhline(auto, color="green", linestyle="--", label="auto")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_title(cat)
        ax.set_xlabel("draft length K")
        ax.set_ylabel("speedup over the target alone")
        ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise UsageError(f"--plot: cannot write {path}: {e.strerror or e}") from None


def _report(err: SpecggufError) -> int:
    if isinstance(err, Interrupted):
        return err.exit_code  # the summary of what was done is already on stderr
    hint = f" (hint: {err.hint})" if err.hint else ""
    print(f"specgguf: error: {err}{hint}", file=sys.stderr)
    return err.exit_code


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the command, map errors to messages and exit codes.

    Typer reports its own usage errors (exit 2); commands raise :class:`SpecggufError`
    subclasses, which arrive here, since they are not Click exceptions.
    """
    debug = os.environ.get("SPECGGUF_DEBUG", "") not in ("", "0")
    try:
        app(args=argv, prog_name="specgguf")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except OutputClosed:
        code = EXIT_BROKEN_PIPE
    except SpecggufError as e:
        if debug:
            raise
        code = _report(e)
    except Exception as e:
        if debug:
            raise
        print(
            f"specgguf: internal error: {type(e).__name__}: {e} "
            "(set SPECGGUF_DEBUG=1 for a traceback)",
            file=sys.stderr,
        )
        code = EXIT_INTERNAL
    _exit(code)


def _exit(code: int) -> None:
    """Flush stdout and exit; a reader that went away (``| head``) is not an error to
    report: exit 141 quietly, with stdout pointed at /dev/null so that the interpreter's
    final flush cannot raise again."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        code = EXIT_BROKEN_PIPE
    if code == EXIT_BROKEN_PIPE:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    sys.exit(code)
