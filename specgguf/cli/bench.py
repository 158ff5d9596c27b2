"""``specgguf bench``: every drafter and draft length side by side in one process."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from specgguf.cli import options as o
from specgguf.cli.app import GroupedCommand, app, handled
from specgguf.cli.flags import Options, takes
from specgguf.cli.output import print_json, size, stderr_say, stdout_console

#: bench's model options: those that matter to speed, some with bench's own help.
_LOAD = (
    Options(o.ModelOptions)
    .without("ctx_size_draft", "batch_size", "device_draft", "no_check", "force")
    .changed("model", help="Target model (default: the default pair).")
    .changed("ctx_size", min=256, help=None)
    .changed("threads", help=None)
    .changed("no_repack", help=None)
    .changed("deterministic", help="Also measure deterministic mode (det-target, "
             "det-model-K, det-ngram-K, det-suffix-K, det-auto) side by side.")
)  # fmt: skip


@app.command(cls=GroupedCommand)
@handled
@takes(load=_LOAD, drafting=Options(o.DraftOptions).only("draft_tree"))
def bench(
    *,
    load: o.ModelOptions,
    draft: Annotated[
        str,
        typer.Option(
            "--draft",
            "--spec-draft-n-max",
            help="Draft lengths to try, comma-separated.",
            rich_help_panel=o.SPEC,
        ),
    ] = "1,2,4,8",
    drafting: o.DraftOptions,
    prompts: Annotated[
        Path | None,
        typer.Option(
            "--prompts",
            help="JSON list of {category, prompt}, or Spec-Bench's question.jsonl "
            "(default: built-in).",
        ),
    ] = None,
    per_category: Annotated[
        int | None,
        typer.Option("--per-category", min=1, help="A sample of N prompts per category."),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the --per-category sample.")] = 0,
    categories: Annotated[
        str | None, typer.Option("--categories", help="Only these categories, comma-separated.")
    ] = None,
    n_predict: Annotated[int, typer.Option("-n", "--n-predict", min=1)] = 128,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Interleaved rounds.")] = 2,
    json_out: Annotated[
        bool, typer.Option("--json", help="All numbers as JSON on stdout.")
    ] = False,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Draw speedup against K (needs matplotlib).")
    ] = None,
    parallel: Annotated[
        int,
        typer.Option(
            "-np",
            "--parallel",
            min=1,
            help="N prompts at once through the engine's N sequences, against one at a "
            "time (aggregate tokens/s, draft tokens accepted per step).",
        ),
    ] = 1,
    recalibrate: Annotated[
        bool,
        typer.Option(
            "--recalibrate",
            help="Measure the pair's timings again rather than reuse its cached calibration.",
        ),
    ] = False,
) -> None:
    """Measure the target alone, each drafter at each draft length, and auto mode, on a
    prompt set with categories, interleaved in one process; speedups are relative to the
    target alone in the same run."""
    from specgguf.cli.display import LoadProgress
    from specgguf.engine import DRAFTERS, Engine
    from specgguf.errors import UsageError
    from specgguf.measure.bench import (
        builtin_prompts,
        load_prompts,
        run_bench,
        run_parallel_bench,
        select_prompts,
    )
    from specgguf.speculative.tuning import AUTO_TUNING

    say = stderr_say()
    try:
        ks = sorted({int(x) for x in draft.split(",") if x.strip()})
    except ValueError:
        raise UsageError(f"--draft takes comma-separated integers, not {draft!r}") from None
    if not ks or ks[0] < 1:
        raise UsageError(f"--draft takes draft lengths of 1 or more, not {draft!r}")
    if plot is not None:
        _check_plot_path(plot)  # before the run, not after it
    chosen = select_prompts(
        load_prompts(prompts) if prompts else builtin_prompts(),
        categories.split(",") if categories else None, per_category, seed,
    )  # fmt: skip
    if parallel > len(chosen):  # before loading: fewer would never run N at once
        raise UsageError(f"--parallel {parallel} needs at least {parallel} prompts; the "
                         f"selection has {len(chosen)} (more --categories, a larger "
                         "--per-category, or --prompts FILE)")  # fmt: skip
    draft_max = max(AUTO_TUNING.draft_max_lookup, *ks)
    drafting = dataclasses.replace(drafting, drafter="auto", draft=draft_max)
    config = dataclasses.replace(
        o.engine_config(load, drafting, say=say), n_parallel=parallel, mmproj=None
    )  # (bench reads text prompts: no projector)
    with LoadProgress({}) as load_progress:
        engine = Engine(config, on_load_progress=load_progress)
    # each drafter the engine could make (the registry's, in its order), at each K
    configs = [("target", "none", 0)]
    configs += [(f"{name}-K{k}", name, k) for name in DRAFTERS
                if engine.drafting.get(name) is not None for k in ks]  # fmt: skip
    configs.append(("auto", "auto", draft_max))
    if load.deterministic:
        configs += [("det-" + name, kind, k) for name, kind, k in configs]

    # One line per step on stderr, terminal or not: a run in a pipeline or CI that prints
    # nothing for many minutes looks hung (as pip and huggingface_hub, one line at a time).
    def progress(msg: str) -> None:
        say(f"bench: {msg}")

    if parallel > 1:
        with engine:
            report = run_parallel_bench(engine, chosen, configs, n=n_predict, rounds=rounds,
                                        progress=progress, recalibrate=recalibrate)  # fmt: skip
        if json_out:
            print_json(report)
        _print_parallel(report, stderr=json_out)
        return
    with engine:
        report = run_bench(engine, chosen, configs, n=n_predict, rounds=rounds,
                           progress=progress, recalibrate=recalibrate)  # fmt: skip
    if json_out:
        print_json(report)
    _print_bench(report, stderr=json_out)
    if plot is not None:
        _plot_bench(report, plot)


def _print_bench(report: dict[str, Any], *, stderr: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(stderr=True, highlight=False) if stderr else stdout_console()
    m = report["machine"]
    t = Table(
        title=f"{Path(report['models']['target']).name} + "
        f"{Path(report['models']['draft']).name if report['models']['draft'] else 'no draft'}"
        f"{_rpc_note(report['models'])}"
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
    for r in report["results"]:
        lim = r.get("cost_model_limit")
        if lim and r["speedup"] is not None:
            con.print(
                f"{r['category']}: auto {r['speedup']:.2f}x, the batch costs allow "
                f"{lim['speedup']:.2f}x for the best acceptance reached ({lim['drafter']}, "
                f"a = {lim['per_token_acceptance']:.2f}, K = {lim['k']}): {lim['ratio']:.2f} "
                "of it",
                highlight=False,
            )  # fmt: skip
    mem = report["memory"]
    con.print(f"peak RSS {size(mem['peak_rss'])} = {mem['ratio']:.2f} x (model files "
              f"{size(mem['model_files'])} + KV caches {size(mem['kv_caches'])}); "
              f"{report['wall_seconds']:.0f} s", highlight=False)  # fmt: skip
    _print_calibration(con, report["calibration"])


def _print_calibration(con: Any, entries: list[dict[str, Any]]) -> None:
    """One line per calibration: reused from which file, or measured in this run."""
    from specgguf.measure.bench import busier_note

    for c in entries:
        label = "calibration" + (" of deterministic mode" if c["mode"] == "deterministic" else "")
        if c["reused"]:
            line = (f"{label}: reused from {c['file']} (measured {c['measured_at']})"
                    f"{busier_note(c['fresh_step_ratio'])}; --recalibrate measures it "
                    "again")  # fmt: skip
        else:
            saved = f"saved to {c['file']}" if c["saved"] else f"not saved: {c['unsaved']}"
            line = f"{label}: measured in this run ({c['why']}), {saved}"
        con.print(line, highlight=False, soft_wrap=True)


def _print_parallel(report: dict[str, Any], *, stderr: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(stderr=True, highlight=False) if stderr else stdout_console()
    n = report["parallel"]
    title = (f"{report['prompts']} prompts, n={report['n_predict']}, greedy: one at a time "
             f"against {n} at once")  # fmt: skip
    t = Table(title=title, title_justify="left", box=None, header_style="bold")
    cols = ("config", "tokens/s (1)", f"tokens/s ({n})", "ratio", "accepted/step (1)",
            f"accepted/step ({n})")  # fmt: skip
    for col in cols:
        t.add_column(col, justify="left" if col == "config" else "right")
    for r in report["results"]:
        t.add_row(r["config"], f"{r['tokens_per_s_1']:.2f}", f"{r['tokens_per_s_parallel']:.2f}",
                  f"{r['ratio']:.2f}x", f"{r['accepted_1'] / max(1, r['steps_1']):.2f}",
                  f"{r['accepted_parallel'] / max(1, r['steps_parallel']):.2f}")  # fmt: skip
    con.print(t)
    con.print(f"ratio: tokens/s ({n}) over tokens/s (1); for the target alone the batch "
              f"curve allows {report['batch_allows']:.2f}x with {n} sequences ({n} x t(1) / "
              f"t({n})), drafts and copies between answers aside", highlight=False)  # fmt: skip
    _print_calibration(con, report["calibration"])


def _rpc_note(models: dict[str, Any]) -> str:
    """`` (target over RPC: 10.0.0.2:50052, ...)`` when layers are on RPC servers."""
    roles = (("target", "rpc"), ("draft", "rpc_draft"))
    parts = [f"{role} over RPC: {', '.join(models[key])}" for role, key in roles if models.get(key)]
    return f" ({'; '.join(parts)})" if parts else ""


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

    from specgguf.engine import DRAFTERS

    cats = list(dict.fromkeys(r["category"] for r in report["results"]))
    fig, axes = plt.subplots(1, len(cats), figsize=(4 * len(cats), 3.5), squeeze=False)
    for ax, cat in zip(axes[0], cats, strict=True):
        rows = [r for r in report["results"] if r["category"] == cat]
        for kind in DRAFTERS:
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
