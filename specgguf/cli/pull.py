"""``specgguf pull`` and ``specgguf list``: models and pairs from the Hugging Face hub, and
what the local cache holds."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from specgguf.cli.app import app, handled
from specgguf.cli.options import HfRepoDraftOpt, HfRepoOpt, RegistryOpt
from specgguf.cli.output import print_json, size, stderr_say, stdout_console


@app.command()
@handled
def pull(
    names: Annotated[
        list[str] | None,
        typer.Argument(
            help="Model aliases, a pair name (see `specgguf list`), or models on the hub as "
            "org/name[:QUANT]."
        ),
    ] = None,
    hf_repo: HfRepoOpt = None,
    hf_repo_draft: HfRepoDraftOpt = None,
    quant: Annotated[
        str | None, typer.Option("--quant", help="Quantization, e.g. Q4_K_M, Q8_0.")
    ] = None,
    revision: Annotated[
        str | None, typer.Option("--revision", help="A branch, tag or commit of the repo.")
    ] = None,
    no_mmproj: Annotated[
        bool,
        typer.Option(
            "--no-mmproj",
            help="Leave out the projector of a hub repository (pulled beside its model, as "
            "run -hf and serve -hf pull it).",
        ),
    ] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    quiet: Annotated[bool, typer.Option("-q", "--quiet", help="No progress on stderr.")] = False,
    registry: RegistryOpt = None,
) -> None:
    """Download models or a pair from the Hugging Face hub into its standard cache.

    A model named as org/name[:QUANT] comes with its repository's multimodal projector
    (mmproj), where it has one, picked as llama.cpp picks it (not for -hfd's draft).
    Two models, or a pair, are checked for vocabulary compatibility afterwards.
    Exit codes: 6 hub error or not found, 7 access refused (gated/private), 5 not enough
    disk, 8 integrity check failed, 4 the pulled pair is incompatible.
    """
    from specgguf.errors import EXIT_INCOMPATIBLE, UsageError
    from specgguf.gguf.vocab import check_compatibility
    from specgguf.hub.download import PullResult, resolve_hf
    from specgguf.hub.download import pull as hub_pull
    from specgguf.hub.hfref import looks_like_hf_ref
    from specgguf.hub.registry import load_registry

    reg = load_registry(registry)
    wanted: list[tuple[str, str]] = []  # ("alias" | "hf", name)
    for name in names or []:
        pair = reg.pair(name)
        if pair:
            wanted += [("alias", pair.target), ("alias", pair.draft)]
        elif name not in reg.names() and looks_like_hf_ref(name) and not Path(name).exists():
            wanted.append(("hf", name))
        else:
            wanted.append(("alias", reg.model(name).alias))
    wanted += [("hf", hf_repo)] if hf_repo is not None else []
    wanted += [("hf-draft", hf_repo_draft)] if hf_repo_draft is not None else []
    if not wanted:
        raise UsageError("nothing to pull: give model aliases, a pair, or -hf org/name[:QUANT]")

    say = stderr_say(quiet)
    progress = not quiet and sys.stderr.isatty()
    results: list[PullResult] = []
    for kind, name in wanted:
        if kind in ("hf", "hf-draft"):
            side = kind == "hf" and not no_mmproj
            res = resolve_hf(name, quant=quant, revision=revision, progress=progress, say=say,
                             mmproj=side)  # fmt: skip
        else:
            res = hub_pull(reg.model(name), quant=quant, revision=revision, progress=progress,
                           say=say)  # fmt: skip
        results.append(res)
    report = None
    if len(results) == 2:
        report = check_compatibility(results[0].path, results[1].path)
    if json_out:
        print_json({
            "models": [
                {"alias": r.entry.alias, "repo": r.entry.repo, "path": str(r.path),
                 "files": [str(p) for p in r.paths], "size": r.size, "source": r.source,
                 "mmproj": None if r.mmproj is None else {
                     "path": str(r.mmproj.path), "size": r.mmproj.size,
                     "source": r.mmproj.source}}
                for r in results
            ],
            "check": report.as_dict() if report else None,
        })  # fmt: skip
    else:
        for r in results:
            sys.stdout.write(f"{r.entry.alias}\t{r.path}\t{size(r.size)}\t{r.source}\n")
            if (m := r.mmproj) is not None:  # (its projector: a line of its own)
                sys.stdout.write(f"{r.entry.alias} mmproj\t{m.path}\t{size(m.size)}\t"
                                 f"{m.source}\n")  # fmt: skip
        if report is not None:
            sys.stdout.write(report.verdict() + "\n")
    if report is not None and not report.compatible:
        raise typer.Exit(EXIT_INCOMPATIBLE)


@app.command(name="list")
@handled
def list_models(
    drafts_for: Annotated[
        str | None,
        typer.Option(
            "--drafts-for",
            metavar="TARGET",
            help="Instead: the models on disk that can draft for TARGET (a .gguf file, an "
            "alias or org/name:QUANT), best first, with the reason for each one rejected.",
        ),
    ] = None,
    draft_search: Annotated[
        list[Path] | None,
        typer.Option(
            "--draft-search",
            metavar="DIR",
            help="With --drafts-for: also search under DIR (repeatable).",
        ),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    registry: RegistryOpt = None,
) -> None:
    """List the registry's models and pairs, which are downloaded, and their sizes.

    Reads only the registry and the local cache: no network.
    """
    from specgguf.hub.download import local_listing
    from specgguf.hub.registry import load_registry

    if drafts_for is not None:
        _list_drafts(drafts_for, draft_search or [], json_out=json_out, registry=registry)
        return
    if draft_search:
        from specgguf.errors import UsageError

        raise UsageError("--draft-search goes with --drafts-for TARGET")
    reg = load_registry(registry)
    models, pairs = local_listing(reg)
    if json_out:
        print_json(
            {"models": models, "pairs": pairs, "registry_files": [str(f) for f in reg.files]}
        )
        return
    from rich.table import Table

    con = stdout_console()
    t = Table(title="models", title_justify="left", box=None, header_style="bold")
    for col in ("alias", "params", "quant", "size", "present", "repository / file"):
        t.add_column(col)
    for x in models:
        names = x["alias"] + (f" ({', '.join(x['aliases'])})" if x["aliases"] else "")
        t.add_row(names, x["params"] or "-", x["quant"], size(x["size"]) if x["size"] else "?",
                  "yes" if x["present"] else "no", f"{x['repo']}/{x['file']}")  # fmt: skip
    con.print(t)
    t = Table(title="pairs", title_justify="left", box=None, header_style="bold")
    for col in ("pair", "target", "draft", "K", "size", "present", "note"):
        t.add_column(col)
    for p in pairs:
        name = p["name"] + (" (default)" if p["default"] else "")
        t.add_row(name, p["target"], p["draft"], str(p["draft_max"]),
                  size(p["size"]) if p["size"] else "?", "yes" if p["present"] else "no",
                  p["note"] or "")  # fmt: skip
    con.print(t)


def _list_drafts(target: str, dirs: list[Path], *, json_out: bool, registry: Path | None) -> None:
    """``list --drafts-for``: every model on disk as a draft for ``target``, best first;
    a pair calibrated on this machine is judged by its measured draft-token cost."""
    from rich.table import Table

    from specgguf.cli.options import model_path
    from specgguf.engine.calibration import measured_draft_cost
    from specgguf.hub.draft_search import count, find_drafts
    from specgguf.hub.registry import load_registry

    path = model_path(target, registry)
    found = find_drafts(path, search_dirs=dirs, registry=load_registry(registry), check_all=True,
                        measured=measured_draft_cost)  # fmt: skip
    if json_out:
        print_json(found.as_dict())
        return
    con = stdout_console()
    title = (
        f"drafts for {path.name} ({count(found.target_params)} parameters): "
        f"{found.n_files} GGUF model(s) on disk, searched in {found.seconds:.2f} s"
    )
    t = Table(title=title, title_justify="left", box=None, header_style="bold")
    for col in ("verdict", "draft", "params", "quant", "size", "found in", "why"):
        t.add_column(col)
    for c in found.candidates:
        t.add_row(c.verdict, c.path.name, count(c.n_params), c.quantization or "-",
                  size(c.file_size), c.source, c.reason)  # fmt: skip
    con.print(t)
    if not found.candidates:
        con.print(f"searched: {', '.join(str(p) for p in found.places)}")
