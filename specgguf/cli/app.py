"""The ``specgguf`` command line: the Typer app, the entry point, and the mapping of errors
to one-line messages and exit codes.

stdout carries data only (generated text, tables a user asked for, or JSON with ``--json``);
everything else goes to stderr. :func:`main` maps each :class:`SpecggufError` to a one-line
message, adds the command-line hint that fits it (the library's messages name no flags),
and returns its exit code (see :mod:`specgguf.errors`); set ``SPECGGUF_DEBUG=1`` for a
traceback. The library's warnings arrive through :mod:`logging` and are printed here.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Annotated, Any, ParamSpec, TypeVar

import typer
import typer.core

from specgguf import __version__
from specgguf.errors import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERNAL,
    BackendError,
    ChatTemplateError,
    ContextOverflowError,
    IncompatibleVocabError,
    InsufficientMemoryError,
    Interrupted,
    ModelLoadError,
    ModelNotDownloadedError,
    OutputClosed,
    RpcServerError,
    RpcServerLost,
    SpecggufError,
    UnknownModelError,
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


class GroupedCommand(typer.core.TyperCommand):
    """A command whose ``--help`` lists its options in sections, by the ``rich_help_panel``
    each option names (in plain text, as Click prints help): the options without one
    under "Options", then one section per panel in the order they first appear. Used for
    the speculative options, whose llama.cpp names (current and former) share one line."""

    # Typer passes its own (vendored) Click's context and formatter.
    def format_options(self, ctx: Any, formatter: Any) -> None:
        args: list[tuple[str, str]] = []
        sections: dict[str, list[tuple[str, str]]] = {"Options": []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                args.append(record)
            else:
                panel = getattr(param, "rich_help_panel", None) or "Options"
                sections.setdefault(panel, []).append(record)
        if args:
            with formatter.section("Arguments"):
                formatter.write_dl(args)
        for title, rows in sections.items():
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


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


class _StderrHandler(logging.Handler):
    """Library warnings as ``specgguf: warning: ...``; llama.cpp's log lines as they are."""

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if record.name != "specgguf.llama_cpp":
            msg = f"specgguf: {record.levelname.lower()}: {msg}"
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()


_handler = _StderrHandler()


def setup_logging(*, verbose: bool = False, quiet: bool = False) -> None:
    """Print the library's warnings on stderr (none with ``quiet``), and llama.cpp's own
    log lines with ``verbose``."""
    root = logging.getLogger("specgguf")
    if _handler not in root.handlers:
        root.addHandler(_handler)
    root.propagate = False
    root.setLevel(logging.ERROR if quiet else logging.WARNING)
    logging.getLogger("specgguf.llama_cpp").setLevel(
        logging.DEBUG if verbose and not quiet else logging.WARNING
    )


def _version_callback(value: bool) -> None:
    if not value:
        return
    line = f"specgguf {__version__}"
    try:
        from specgguf.llama.runtime import build_info

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


def hint(err: SpecggufError) -> str | None:
    """What to do about ``err`` on the command line: the library's own hint, or one that
    names this command line's flags."""
    if err.hint:
        return err.hint
    if isinstance(err, ContextOverflowError):
        if err.draft:
            return "raise -cd/--ctx-size-draft"
        return "raise -c/--ctx-size or shorten the prompt"
    if isinstance(err, InsufficientMemoryError):
        if err.remote:
            return ("more RPC servers (--rpc), fewer layers on the full one (-ts/--tensor-split"
                    ", -ngl), a smaller -c; `specgguf plan` shows the split; --force loads "
                    "anyway")  # fmt: skip
        if err.gpu:
            return "lower -ngl/-ngld; --force loads anyway"
        return (
            "--force loads anyway; a smaller -c/--ctx-size helps (serving, a smaller "
            "-np/--parallel too: the KV cache holds -np x -c positions)"
        )
    if isinstance(err, RpcServerError):
        return ("start it on that machine with `specgguf rpc-server` (see the README, "
                "\"Targets bigger than one machine\"), or leave it out of --rpc")  # fmt: skip
    if isinstance(err, RpcServerLost):
        if err.requests_answered is not None:
            return (f"{err.requests_answered} open request(s) answered with this error; "
                    "restart the rpc-server, then this server")  # fmt: skip
        return "the text so far is on stdout; restart the server and run again"
    if isinstance(err, IncompatibleVocabError):
        return "`specgguf check TARGET DRAFT` gives the whole report; --no-check overrides"
    if isinstance(err, UnknownModelError):
        return "`specgguf list` shows the known aliases and pairs"
    if isinstance(err, ModelLoadError) and err.path is not None:
        return f"`specgguf info {err.path}` lists every problem"
    if isinstance(err, ModelNotDownloadedError):
        return f"`specgguf pull {err.alias}` downloads it"
    if isinstance(err, ChatTemplateError):
        return "--raw sends the prompt without the template"
    if isinstance(err, BackendError):
        return "-v shows llama.cpp's own log"
    return None


def _report(err: SpecggufError) -> int:
    if isinstance(err, Interrupted):
        return err.exit_code  # the summary of what was done is already on stderr
    h = hint(err)
    print(f"specgguf: error: {err}{f' (hint: {h})' if h else ''}", file=sys.stderr)
    return err.exit_code


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the command, map errors to messages and exit codes.

    Typer reports its own usage errors (exit 2); commands raise :class:`SpecggufError`
    subclasses, which arrive here, since they are not Click exceptions.
    """
    debug = os.environ.get("SPECGGUF_DEBUG", "") not in ("", "0")
    _closed_streams()
    setup_logging()
    from specgguf.llama.rpc import set_lost_handler

    set_lost_handler(_rpc_lost)
    try:
        app(args=argv, prog_name="specgguf")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if type(sys.stdout).__name__ == "PacifyFlushWrapper":
            code = EXIT_BROKEN_PIPE  # Click's own output (--help) met a closed stdout
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


def _rpc_lost(err: RpcServerLost) -> None:
    """An RPC server stopped answering after loading, and llama.cpp is about to abort the
    process (from one of its threads): say so on one line and exit 9 first, the text
    generated so far already on stdout (written and flushed piece by piece)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        _report(err)
        sys.stderr.flush()
    os._exit(err.exit_code)


def _closed_streams() -> None:
    """Standard streams the process was started without (``0<&-``, ``>&-``, ``2>&-``):
    each closed descriptor 0-2 is reopened first, so that no file or socket opened later
    takes its number (llama.cpp's C code writes to 1 and 2). stdin reads as empty, stderr
    is discarded, and stdout is a pipe without a reader: a command's output fails as
    under ``| head`` when its reader has gone (exit 141: nothing written, and nothing said
    to be), and a command without output (``serve``) runs."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            if fd == 1:
                read, new = os.pipe()
                os.close(read)
            else:
                new = os.open(os.devnull, os.O_RDWR)
            if new != fd:
                os.dup2(new, fd)
                os.close(new)
    if sys.stdin is None:
        sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    if sys.stdout is None:
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    if sys.stderr is None:
        sys.stderr = open(2, "w", encoding="utf-8", closefd=False)  # noqa: SIM115


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
