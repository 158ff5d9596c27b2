"""``specgguf doctor``: the build, the machine, and a smoke test."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from specgguf.cli.app import app, handled
from specgguf.cli.output import print_json, size, stdout_console


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
    from specgguf.errors import BackendError
    from specgguf.llama.doctor import report
    from specgguf.speculative.drafters import compiled

    rep = report(smoke=not no_smoke)
    # whether the lookup drafters' indexes were compiled at install (setup.py)
    rep["lookup_indexes"] = "compiled" if compiled.lookup else "pure Python"
    why = ("asked for by SPECGGUF_PURE_PYTHON" if compiled.wanted_pure()
           else "slower; no C compiler was found at install")  # fmt: skip
    if json_out:
        print_json(rep)
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
            mem = f", {size(d['memory_free'])} free of {size(d['memory_total'])}"
            t.add_row(f"device {d['name']}", f"{d['description']} ({d['kind']}{mem})")
        t.add_row("CPU", f"{p['cpu']} ({p['cpu_count_physical']} cores, "
                  f"{p['cpu_count_logical']} threads)")  # fmt: skip
        t.add_row("CPU features", " ".join(p["cpu_flags"]) or "-")
        t.add_row("RAM", f"{size(p['ram_available'])} available of {size(p['ram_total'])}")
        t.add_row("AMX kernels built", "yes" if rep["amx_compiled"] else "no")
        r = rep["rpc"]
        server = f"rpc-server: {r['server']}" if r["server"] else "no rpc-server found"
        t.add_row("RPC backend (--rpc)", f"yes ({server})" if r["supported"]
                  else "no: reinstall with scripts/install")  # fmt: skip
        t.add_row("lookup indexes", rep["lookup_indexes"] if compiled.lookup else
                  f"pure Python ({why})")  # fmt: skip
        t.add_row("weight repacking", f"{'on' if rep['weight_repacking'] else 'off'} "
                  f"({rep['weight_repacking_reason']})")  # fmt: skip
        match = "" if rep["build_matches_machine"] else " (this build lacks it: reinstall)"
        t.add_row("this machine", f"{rep['machine_backend']}{match}")
        t.add_row("install command", rep["install_hint"])
        if "smoke_test" in rep:
            s = rep["smoke_test"]
            verdict = "ok" if s["ok"] else "FAILED"
            t.add_row("smoke test", f"{verdict}: {s['detail']} ({s['seconds']:.1f} s)")
        stdout_console().print(t)
    if rep.get("warning"):
        logging.getLogger("specgguf").warning(rep["warning"])
    if "smoke_test" in rep and not rep["smoke_test"]["ok"]:
        raise BackendError(
            f"smoke test failed: {rep['smoke_test']['detail']}",
            hint=f"reinstall with {rep['install_hint']}",
        )
