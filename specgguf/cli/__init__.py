"""The command line: one module per command (:mod:`.run`, :mod:`.bench`, :mod:`.pull` for
``pull`` and ``list``, :mod:`.info` for ``info`` and ``check``, :mod:`.doctor`, :mod:`.serve`), the
options they share, declared once by concern (:mod:`.options`; :mod:`.flags` makes them
Typer parameters), the live display (:mod:`.display`), and the app with its entry point and
error mapping (:mod:`.app`). Each command checks its flags, calls the library, and prints.

Importing a command module registers its commands on the app. The entry point imports only
the module of the command it runs (all of them for ``--help``, ``--version`` or anything
else), so that a command that loads no model does not import the engine, the server or
llguidance; :func:`full_app` is the app with every command."""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import typer

#: Command name -> the module that registers it, in the order ``--help`` lists them.
COMMANDS = {
    "doctor": "doctor", "info": "info", "check": "info", "run": "run", "serve": "serve",
    "pull": "pull", "list": "pull", "bench": "bench", "plan": "plan", "rpc-server": "rpcserver",
}  # fmt: skip


def register(argv: list[str] | None = None) -> None:
    """Register the command that ``argv`` (the arguments after the program name) runs, none
    for ``--version`` alone, or every command where its first argument names none."""
    first = argv[0] if argv else None
    if argv == ["--version"]:
        return  # (the app's own option: no command is needed)
    names = [COMMANDS[first]] if first in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for name in names:
        importlib.import_module(f"specgguf.cli.{name}")


def main(argv: list[str] | None = None) -> None:
    """Console entry point (:func:`specgguf.cli.app.main`), with only the command it runs
    imported."""
    register(sys.argv[1:] if argv is None else argv)
    from specgguf.cli.app import main as run_app

    run_app(argv)


def full_app() -> typer.Typer:
    """The app with every command registered (what ``--help`` lists)."""
    register()
    from specgguf.cli.app import app

    return app


__all__ = ["COMMANDS", "full_app", "main", "register"]
