"""What keeps a web page from driving the local server, before any request is read.

A page the user visits can send requests to ``http://127.0.0.1:PORT`` from the browser:
"simple" cross-origin requests (a POST with ``Content-Type: text/plain``) without asking
first, and through DNS rebinding (a name of the attacker's re-pointed to 127.0.0.1) as
the same origin, reading every answer. Ollama fixed the same class (CVE-2024-28224) by
checking ``Host`` and ``Origin``. :class:`Guard` refuses, in this order:

- on a connection to a loopback address (where a rebound name leads), a ``Host`` header
  that names neither an IP address, ``localhost`` (or a name under it), this machine's
  host name, nor a name given with ``--allowed-hosts``: 403 (a rebound name is none of
  these; an IP address cannot be rebound). With ``--allowed-hosts``, on every connection
  (``*``: any name). As Ollama, a connection that came over the network (a container, a
  proxy, another machine) is not held to it otherwise;
- an ``Origin`` header (browsers send it with cross-origin requests and same-origin
  POSTs) other than the server's own origin or one given with ``--cors-origins``: 403;
- a POST whose body is not declared ``application/json``: 415 (a browser cannot send
  that cross-origin without a CORS preflight, which only ``--cors-origins`` answers).

CORS itself is Starlette's middleware, on only with ``--cors-origins``.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from specgguf.server.errors import APIError, refused

#: Names every server answers to, besides IP addresses and ``--allowed-hosts``.
LOCAL_NAMES = ("localhost",)
#: The origins ``--cors-origins localhost`` lets in (llama-server's special value): pages
#: on this machine, any port.
LOCAL_ORIGIN = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"


def _hostname(host: str) -> str:
    """The name part of a ``Host`` header value (``[::1]:8080`` -> ``::1``), lowercased."""
    host = host.strip().lower()
    if host.startswith("["):  # an IPv6 literal
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_allowed(host: str, allowed: Sequence[str]) -> bool:
    """Whether a ``Host`` header value names this server: an IP address, ``localhost``
    or a name under it, this machine's host name, or a name of ``allowed`` (a name
    starting with a dot allows every name under it: ``.example.lan``; a port is ignored;
    ``*``: any)."""
    name = _hostname(host).rstrip(".")
    if not name or _is_ip(name) or "*" in allowed:
        return True
    if any(name == n or name.endswith("." + n) for n in LOCAL_NAMES):
        return True
    if name == socket.gethostname().lower():
        return True
    for a in allowed:
        a = _hostname(a).rstrip(".")
        if name == a.lstrip(".") or (a.startswith(".") and name.endswith(a)):
            return True
    return False


def normal_origins(origins: Sequence[str]) -> tuple[str, ...]:
    """``--cors-origins`` as browsers write an ``Origin``: lowercase, no trailing slash."""
    return tuple(o.strip().rstrip("/").lower() for o in origins if o.strip())


def _loopback(scope: Scope) -> bool:
    """Whether the connection came to a loopback address of this machine."""
    server = scope.get("server")
    if not server:
        return True  # (not told: held to the check)
    try:
        return ipaddress.ip_address(str(server[0]).split("%")[0]).is_loopback
    except ValueError:
        return True


def _media_type(value: bytes) -> str:
    return value.split(b";", 1)[0].strip().lower().decode("latin-1")


class Guard:
    """The checks of this module's docstring, on every HTTP request, before its body is
    read. ``allowed_hosts``: ``--allowed-hosts``; ``origins``: ``--cors-origins``
    (``*``: every origin; ``localhost``: pages on this machine, :data:`LOCAL_ORIGIN`)."""

    def __init__(
        self, app: ASGIApp, allowed_hosts: Sequence[str] = (), origins: Sequence[str] = ()
    ) -> None:
        self.app = app
        self.allowed_hosts = tuple(allowed_hosts)
        self.origins = frozenset(normal_origins(origins))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (err := self.refusal(scope)) is not None:
            await refused(scope["method"], scope["path"], err)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> APIError | None:
        """Why the request is refused, or None."""
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        held = self.allowed_hosts or _loopback(scope)
        if host and held and not host_allowed(host, self.allowed_hosts):
            return APIError(
                403, f"Host {_hostname(host)!r} is not this server's: use its address, "
                "localhost, or start it with --allowed-hosts NAME",
                type="permission_error", code="host_not_allowed",
            )  # fmt: skip
        origin = headers.get(b"origin")
        if origin is not None and not self.origin_allowed(origin.decode("latin-1"), host):
            return APIError(
                403, "requests from web pages of another origin are refused: start the "
                "server with --cors-origins ORIGIN to let a page use it",
                type="permission_error", code="origin_not_allowed",
            )  # fmt: skip
        if scope["method"] == "POST":
            ctype = _media_type(headers.get(b"content-type", b""))
            if ctype != "application/json":
                return APIError(
                    415, f"the body must be JSON sent as Content-Type: application/json, not "
                    f"{ctype or 'none'} (curl: -H 'Content-Type: application/json')",
                    code="unsupported_media_type",
                )  # fmt: skip
        return None

    def origin_allowed(self, origin: str, host: str) -> bool:
        """Whether a page of ``origin`` may use the server: its own origin (``host``,
        the request's ``Host``), or one of ``--cors-origins``."""
        origin = origin.rstrip("/").lower()
        if "*" in self.origins or origin in self.origins:
            return True
        if "localhost" in self.origins and re.fullmatch(LOCAL_ORIGIN, origin):
            return True
        parts = urlsplit(origin)
        return bool(host) and parts.scheme in ("http", "https") and parts.netloc == host.lower()
