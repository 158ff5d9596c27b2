"""``specgguf rpc-server``: llama.cpp's ``rpc-server`` on this machine, for another
machine's ``--rpc``."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from specgguf.cli.app import app, handled


@app.command("rpc-server")
@handled
def rpc_server(
    host: Annotated[
        str,
        typer.Option(
            "-H",
            "--host",
            help="Address to listen on (anything but 127.0.0.1 prints llama.cpp's warning).",
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("-p", "--port", min=1, max=65535, help="Port to listen on.")
    ] = 50052,
    threads: Annotated[
        int | None,
        typer.Option("-t", "--threads", min=1, help="CPU threads (default: half the cores)."),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(
            "-d",
            "--device",
            metavar="DEV[,DEV...]",
            help="Devices to serve, as llama.cpp names them (default: the GPUs, else the CPU).",
        ),
    ] = None,
    cache: Annotated[
        bool,
        typer.Option(
            "-c",
            "--cache",
            help="Keep received weights in llama.cpp's cache "
            "folder, so that a second load skips the transfer.",
        ),
    ] = False,
) -> None:
    """Serve this machine's memory and compute to another machine's --rpc (llama.cpp's
    rpc-server, built by scripts/install from the same llama.cpp).

    It has no authentication and runs whatever a client sends: it listens on 127.0.0.1
    unless --host says otherwise; never expose it to an untrusted network (use a private
    network or an SSH tunnel: see the README). It serves one client at a time; stop it
    with Ctrl-C.

    Exit codes: 9 no rpc-server for this installation.
    """
    from specgguf.errors import BackendError
    from specgguf.llama.rpc import server_binary

    exe = server_binary()
    if exe is None:
        raise BackendError(
            "llama.cpp's rpc-server is not built for this installation",
            hint="scripts/install builds it beside the llama-cpp-python wheel; or set "
            "SPECGGUF_RPC_SERVER to an rpc-server of the same llama.cpp release",
        )
    argv = [str(exe), "--host", host, "--port", str(port)]
    argv += ["--threads", str(threads)] if threads else []
    argv += ["--device", device] if device else []
    argv += ["--cache"] if cache else []
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(exe, argv)  # llama.cpp's own program from here on (and its warning)
    except OSError as e:
        raise BackendError(f"cannot start {exe}: {e.strerror or e}") from None
