"""The ``specgguf`` command line: flags in, library calls, results out.

stdout carries data only (generated text, tables a user asked for, or JSON with ``--json``);
everything else goes to stderr. :func:`main` maps each :class:`SpecggufError` to a one-line
message and its exit code (see :mod:`specgguf.errors`); set ``SPECGGUF_DEBUG=1`` for a
traceback.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Annotated, Any, ParamSpec, TypeVar

import typer

from specgguf import __version__
from specgguf.errors import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERNAL,
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
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


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
        t.add_row("suggested install", rep["install_hint"])
        if "smoke_test" in rep:
            s = rep["smoke_test"]
            verdict = "ok" if s["ok"] else "FAILED"
            t.add_row("smoke test", f"{verdict}: {s['detail']} ({s['seconds']:.1f} s)")
        _stdout_console().print(t)
    if rep.get("warning"):
        print(f"specgguf: warning: {rep['warning']}", file=sys.stderr)
    if "smoke_test" in rep and not rep["smoke_test"]["ok"]:
        raise BackendError(f"smoke test failed: {rep['smoke_test']['detail']}")


def _report(err: SpecggufError) -> int:
    print(f"specgguf: error: {err}", file=sys.stderr)
    if err.hint:
        print(f"specgguf: hint: {err.hint}", file=sys.stderr)
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
