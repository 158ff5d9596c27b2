"""The HTTP application: one FastAPI app over one engine through a
:class:`~specgguf.server.scheduler.Scheduler`, its endpoints in routers by family
(:mod:`.completions`: chat and text completions; :mod:`.status`: models, health,
metrics), what they share in :class:`~specgguf.server.service.Service`, and the
middleware: what web pages may do (:mod:`.guard`: ``Host``, ``Origin`` and content-type
checks; CORS with ``--cors-origins``), an API key (``--api-key``) and the count of
requests by endpoint and status.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specgguf.server import completions, status
from specgguf.server.errors import APIError, install_handlers, refused
from specgguf.server.guard import LOCAL_ORIGIN, Guard, normal_origins
from specgguf.server.metrics import Metrics
from specgguf.server.scheduler import Scheduler
from specgguf.server.service import ServerSettings, Service
from specgguf.version import __version__

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from specgguf.engine import Engine

__all__ = ["PUBLIC_PATHS", "ServerSettings", "create_app"]

#: Paths that need no API key.
PUBLIC_PATHS = frozenset({"/health", "/v1/health"})


# -- middleware -----------------------------------------------------------------------


class _RequireKey:
    """Every path but :data:`PUBLIC_PATHS` needs ``Authorization: Bearer KEY``, compared
    in constant time (:func:`secrets.compare_digest`); otherwise 401. Runs before the
    body is read."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app = app
        self.key = key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            header = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(token.strip(), self.key):
                err = APIError(
                    401, "invalid or missing API key (send Authorization: Bearer KEY)",
                    type="authentication_error", code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )  # fmt: skip
                await refused(scope["method"], scope["path"], err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _CountRequests:
    """Counts every answered request by endpoint and HTTP status."""

    def __init__(self, app: ASGIApp, metrics: Metrics, paths: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            # the route's path (/v1/models/{model:path}), never a client's: a label each
            # (a request refused before routing, 401: its path, when it is a route's)
            route = getattr(scope.get("route"), "path", scope["path"])
            path = route if route in self.paths else "other"
            self.metrics.requests.labels(path, str(status)).inc()


# -- the application ------------------------------------------------------------------


def create_app(
    engine: Engine, settings: ServerSettings, *, executor: ThreadPoolExecutor | None = None
) -> FastAPI:
    """The ASGI application over a loaded ``engine``. Its scheduler
    (``app.state.scheduler``, with ``settings.max_queue``) starts its worker now, on
    ``executor``'s thread when given (the thread that loaded the engine: see
    :func:`specgguf.server.scheduler.engine_thread`), and is closed when the application
    shuts down; join it before closing the engine.
    """
    sched: Scheduler
    metrics = Metrics(lambda: sched.waiting, lambda: sched.running, engine.prompt_cache)
    sched = Scheduler(engine, settings.max_queue, on_result=metrics.observe, executor=executor)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        sched.close()

    app = FastAPI(
        title="specgguf", version=__version__, docs_url=None, redoc_url=None,
        openapi_url=None, lifespan=lifespan,
    )  # fmt: skip
    app.state.service = Service(engine, settings, sched)
    app.state.scheduler = sched
    app.state.metrics = metrics
    install_handlers(app)
    app.include_router(completions.router)
    app.include_router(status.router)
    if settings.api_key:
        app.add_middleware(_RequireKey, key=settings.api_key)
    origins = normal_origins(settings.cors_origins)
    app.add_middleware(Guard, allowed_hosts=settings.allowed_hosts, origins=origins)
    if origins:  # outside the guard: its refusals carry CORS headers for an allowed page
        from starlette.middleware.cors import CORSMiddleware

        # (any request header, as llama-server answers: the openai JS client sends its own)
        app.add_middleware(
            CORSMiddleware, allow_origins=list(origins),
            allow_origin_regex=LOCAL_ORIGIN if "localhost" in origins else None,
            allow_methods=["GET", "POST"], allow_headers=["*"],
        )  # fmt: skip
    routers = (completions.router, status.router)
    paths = frozenset(r.path for router in routers for r in router.routes if hasattr(r, "path"))
    app.add_middleware(_CountRequests, metrics=metrics, paths=paths)
    return app
