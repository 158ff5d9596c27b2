"""Listening: bind the address first (so that a taken port is reported before any weights
load), then serve the application with uvicorn until SIGINT or SIGTERM.

On a signal the server stops accepting connections, ends the running generation (before
its next speculative step) and the waiting ones (503), lets the open responses finish,
waits for the engine's worker thread, and returns normally: the process exits 0.
"""

from __future__ import annotations

import contextlib
import ipaddress
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from specgguf.errors import RpcServerLost, UsageError

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from specgguf.engine import Engine
    from specgguf.server.app import ServerSettings
    from specgguf.server.scheduler import Scheduler

#: Seconds that open responses get to finish after a signal, before they are cut.
GRACE_SECONDS = 5


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (port 0: any free one), not listening yet.

    Raises:
        UsageError: the host does not resolve, or the address cannot be bound (taken,
            not an address of this machine, a privileged port).
    """
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError) as e:
        raise UsageError(f"cannot listen on {host!r}: {getattr(e, 'strerror', e)}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def address(sock: socket.socket) -> str:
    """``http://HOST:PORT`` of a bound socket (IPv6 hosts in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def is_loopback(sock: socket.socket) -> bool:
    """Whether the socket is bound to a loopback address (reachable from this machine
    only)."""
    return ipaddress.ip_address(sock.getsockname()[0]).is_loopback


def serve(
    engine: Engine,
    settings: ServerSettings,
    sock: socket.socket,
    *,
    on_ready: Callable[[str], None] | None = None,
    executor: ThreadPoolExecutor | None = None,
) -> None:
    """Serve ``engine`` on the bound ``sock`` until SIGINT or SIGTERM, then return.

    ``on_ready`` is called with the server's address once it accepts connections.
    ``executor``: the one thread that loaded the engine, to run its generations too
    (:func:`specgguf.server.scheduler.engine_thread`).
    """
    import uvicorn

    from specgguf.engine import template_sandbox
    from specgguf.server.app import create_app

    app = create_app(engine, settings, executor=executor)
    scheduler: Scheduler = app.state.scheduler

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started and on_ready is not None:
                on_ready(address(sock))

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            # Before uvicorn waits for open responses: end the generations they wait for,
            # and the chat template renders (a render answers at once when stopped).
            scheduler.close()
            template_sandbox.shutdown()
            await super().shutdown(sockets)

    config = uvicorn.Config(
        app, http="h11", ws="none", loop="asyncio", lifespan="on", log_config=None,
        access_log=False, timeout_graceful_shutdown=GRACE_SECONDS, server_header=False,
    )  # fmt: skip
    server = Server(config)
    from specgguf.llama import rpc

    before = rpc.lost_handler()

    def on_rpc_lost(err: RpcServerLost) -> None:
        # llama.cpp aborts the process when this returns: every open request is answered
        # first (a stream gets an error event, then ends)
        n = scheduler.fail_all(err)
        err.requests_answered = n
        if before is not None:
            before(err)

    rpc.set_lost_handler(on_rpc_lost)
    try:
        with _exit_normally_after_signals():
            server.run(sockets=[sock])
    finally:
        rpc.set_lost_handler(before)
        scheduler.close()
        scheduler.join()  # the engine may be closed only once its worker is done
        sock.close()


@contextlib.contextmanager
def _exit_normally_after_signals() -> Iterator[None]:
    """uvicorn handles SIGINT and SIGTERM while it serves and, once it has shut down,
    raises the signal again for the handler that was there before. Here that handler does
    nothing, so that a stop by signal returns normally."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = [signal.SIGINT, signal.SIGTERM]

    def ignore(sig: int, frame: Any) -> None:
        pass

    before = {sig: signal.signal(sig, ignore) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
