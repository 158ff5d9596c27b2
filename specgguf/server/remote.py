"""Images the server fetches from the addresses a request names, only on the hosts the
operator allowed (``serve --allow-remote-media HOST``): a server that fetches any address
lets whoever reaches it send requests from it into its own network (server-side request
forgery), so every other address, and a redirect off the allowed hosts, is refused."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from specgguf.errors import MediaError

#: Seconds an allowed host has to answer (to connect, and between two reads).
TIMEOUT = 10.0


def allowed(url: str, hosts: Sequence[str]) -> bool:
    """Whether ``url`` is an http(s) address on one of ``hosts`` (``host``: any port;
    ``host:port``: that one; names compared without case)."""
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    except ValueError:  # (a port that is not a number)
        return False
    host = (parts.hostname or "").lower()
    if parts.scheme.lower() not in ("http", "https") or not host:
        return False
    names = {h.lower() for h in hosts}
    return host in names or f"{host}:{port}" in names


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed host."""

    def __init__(self, hosts: Sequence[str]) -> None:
        self.hosts = hosts

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> Any:  # fmt: skip
        if not allowed(newurl, self.hosts):
            raise urllib.error.HTTPError(newurl, code, f"redirected to {newurl}, a host not "
                                         "allowed", headers, fp)  # fmt: skip
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def fetch_image(url: str, part: str, hosts: Sequence[str], limit: int) -> bytes:
    """The bytes at ``url`` (an address on one of ``hosts``), at most ``limit``; no proxy
    from the environment, redirects only to ``hosts``.

    Raises:
        MediaError: naming ``part``: the host is not allowed, the address does not
            answer (or not 200), a redirect leaves the allowed hosts, more than ``limit``
            bytes.
    """
    if not allowed(url, hosts):
        raise MediaError(f"{part}: {url} is not on a host the server fetches images "
                         "from: send the image as a data: URI", part=part)  # fmt: skip
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _Redirects(hosts))
    try:
        with opener.open(urllib.request.Request(url, method="GET"), timeout=TIMEOUT) as r:
            data: bytes = r.read(limit + 1)
    except urllib.error.HTTPError as e:
        raise MediaError(f"{part}: {url}: HTTP {e.code} {e.reason}", part=part) from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        why = getattr(e, "reason", None) or e
        raise MediaError(f"{part}: could not fetch {url}: {why}", part=part) from None
    if len(data) > limit:
        raise MediaError(f"{part}: {url} holds more than {limit:,} bytes", part=part)
    return data
