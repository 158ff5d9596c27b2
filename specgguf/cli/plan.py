"""``specgguf plan``: which layers go where and whether they fit, before any weights load."""

from __future__ import annotations

import dataclasses
import sys
from typing import Annotated, Any

import typer

from specgguf.cli import options as o
from specgguf.cli.app import app, handled
from specgguf.cli.flags import Options, takes
from specgguf.cli.info import load_refusal, loadable_text
from specgguf.cli.output import print_json, size, stdout_console


def _gib_list(flag: str, text: str | None) -> list[int]:
    from specgguf.errors import UsageError

    if not text:
        return []
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or any(not v > 0 for v in values):
        raise UsageError(f"{flag} takes sizes in GiB like 22 or 22,46, not {text!r}")
    return [int(v * 2**30) for v in values]


#: plan's model options: those that place layers and size memory.
_LOAD = (
    Options(o.ModelOptions)
    .only("model", "model_draft", "ctx_size", "ctx_size_draft", "n_gpu_layers",
          "n_gpu_layers_draft", "rpc", "tensor_split", "rpc_draft", "rpc_timeout", "registry",
          "mmproj", "mmproj_draft")
    .changed("model", required=True, help="Target model: a .gguf file or a cached alias.")
)  # fmt: skip


@app.command()
@handled
@takes(load=_LOAD, cache=Options(o.CacheOptions).only("cache_ram", "ctx_checkpoints"))
def plan(
    *,
    load: o.ModelOptions,
    cache: o.CacheOptions,
    rpc_mem: Annotated[
        str | None,
        typer.Option(
            "--rpc-mem",
            metavar="GIB[,GIB...]",
            help="Free memory of each RPC server, instead of asking them; without --rpc: "
            "find the fewest servers of this size that hold the target.",
        ),
    ] = None,
    local_mem: Annotated[
        str | None,
        typer.Option(
            "--local-mem",
            metavar="GIB",
            help="Plan for a client with this much free memory and no GPU (default: this "
            "machine, its available memory and GPUs).",
        ),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="The plan as JSON.")] = False,
) -> None:
    """Show where llama.cpp would put each layer of the target and the draft (this machine,
    its GPUs, RPC servers) and what each place needs against its free memory, from the
    models' metadata alone: no weights load.

    Exit codes: 0 it fits, 5 it does not (the plan is still shown), 6 an RPC server does
    not answer. A model llama.cpp would refuse to load (a split model with a shard missing,
    say) is planned all the same, with a warning on stderr (in JSON, "load_refusal") that
    check, run, serve and bench exit 3 for it.
    """
    from specgguf.engine.planning import fewest_servers, make_plan
    from specgguf.errors import InsufficientMemoryError, UsageError
    from specgguf.llama.memory import Place, check_plan

    server_free = _gib_list("--rpc-mem", rpc_mem)
    local = _gib_list("--local-mem", local_mem)
    if len(local) > 1:
        raise UsageError("--local-mem takes one size")
    config = dataclasses.replace(o.engine_config(load), cache=o.cache_config(cache))
    local_free = local[0] if local else None
    gpus: list[Place] | None = [] if local else None  # another machine's: no GPU assumed
    search = bool(server_free) and not load.rpc
    if search:
        if len(server_free) > 1:
            raise UsageError("without --rpc, --rpc-mem takes one size: that of each server")
        found = fewest_servers(config, server_free[0], local_free=local_free, gpus=gpus)
        if found is None:
            raise InsufficientMemoryError(
                f"16 RPC servers of {size(server_free[0])} do not hold "
                f"{config.target.path.name}", needed=0, available=server_free[0], remote=True,
            )  # fmt: skip
        result = found
    else:
        result = make_plan(config, server_free=server_free, local_free=local_free, gpus=gpus)
    report = _report(result, search)
    for m in report["models"]:
        if m["load_refusal"]:
            why = loadable_text(m["load_refusal"]).removeprefix("no: ")
            print(f"specgguf: warning: llama.cpp cannot load {m['file']}: {why}",
                  file=sys.stderr)  # fmt: skip
    if json_out:
        print_json(report)
    else:
        _print(report)
    check_plan(result.plan)


def _report(result: Any, search: bool) -> dict[str, Any]:
    from specgguf.engine.planning import layer_ranges
    from specgguf.engine.preflight import PROMPT_CACHE
    from specgguf.llama.memory import DRAFT_PROJECTOR, PROJECTOR

    plan = result.plan
    models = []
    for i, (role, info) in enumerate((("target", result.target), ("draft", result.draft))):
        if info is None:
            continue
        m = plan.models[i]
        models.append({
            "role": role, "file": info.path.name, "n_layer": info.block_count,
            "layers": [{"place": p, "layers": r} for p, r in layer_ranges(plan, i)],
            "need": {place: share.total for place, share in m.shares.items()},
            "load_refusal": load_refusal(info),
        })  # fmt: skip
    for m in plan.models:
        # --cache-ram and a recurrent target's checkpoints; --mmproj
        if m.name in (PROMPT_CACHE, PROJECTOR, DRAFT_PROJECTOR):
            path = {PROJECTOR: result.config.mmproj,
                    DRAFT_PROJECTOR: result.config.mmproj_draft}.get(m.name)  # fmt: skip
            file = path.name if path is not None else None
            models.append({"role": m.name, "file": file, "n_layer": 0, "layers": [],
                           "need": {p: s.total for p, s in m.shares.items()},
                           "load_refusal": None})  # fmt: skip
    t = result.config.target
    out: dict[str, Any] = {
        "fits": result.fits,
        "n_ctx": result.n_ctx,
        "places": [
            {"name": p.name, "kind": p.kind, "free": p.free, "need": plan.need(p.name)}
            for p in plan.places
        ],
        "models": models,
        "rpc": list(t.rpc),
        "n_gpu_layers": t.n_gpu_layers,
    }
    if search:
        out["servers_needed"] = len(t.rpc)
    return out


def _print(report: dict[str, Any]) -> None:
    from rich.table import Table

    con = stdout_console()
    if "servers_needed" in report:
        n = report["servers_needed"]
        con.print(f"fits with {n} RPC server{'s' if n != 1 else ''} and -ngl "
                  f"{report['n_gpu_layers']} (the target's layers on the servers; the rest "
                  "and the draft stay on this machine)", highlight=False)  # fmt: skip
    for m in report["models"]:
        if not m["layers"]:  # the prompt cache, a projector: no layers
            continue
        con.print(f"{m['role']} {m['file']}: {m['n_layer']} layers + output",
                  highlight=False)  # fmt: skip
        for entry in m["layers"]:
            con.print(f"  {entry['place']:<22} {entry['layers']}", highlight=False)
    t = Table(box=None, header_style="bold", pad_edge=False)
    for col in ("place", "free", "needed", *(m["role"] for m in report["models"]), ""):
        t.add_column(col, justify="left" if col in ("place", "") else "right")
    for p in report["places"]:
        over = p["free"] is not None and p["need"] > p["free"]
        t.add_row(p["name"], size(p["free"]) if p["free"] is not None else "?",
                  size(p["need"]),
                  *(size(m["need"].get(p["name"], 0)) for m in report["models"]),
                  "DOES NOT FIT" if over else "ok")  # fmt: skip
    con.print(t)
