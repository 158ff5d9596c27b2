"""The command line: one module per command (:mod:`.run`, :mod:`.bench`, :mod:`.pull` for
``pull`` and ``list``, :mod:`.info` for ``info`` and ``check``, :mod:`.doctor`, :mod:`.serve`), the
options they share, declared once by concern (:mod:`.options`; :mod:`.flags` makes them
Typer parameters), the live display (:mod:`.display`), and the app with its entry point and
error mapping (:mod:`.app`). Each command checks its flags, calls the library, and prints."""

# Importing a command module registers its commands; `--help` lists them in this order.
# ruff: noqa: I001
from specgguf.cli.app import app, main
from specgguf.cli import doctor, info, run, serve, pull, bench, plan, rpcserver  # noqa: F401

__all__ = ["app", "main"]
