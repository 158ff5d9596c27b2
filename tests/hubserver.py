"""A local HTTP server that answers the requests huggingface_hub makes, the way the
Hugging Face hub does, for tests without the internet.

Served: ``HEAD``/``GET /{repo}/resolve/{revision}/{file}`` (ETag/X-Linked-Etag = SHA-256,
X-Linked-Size, X-Repo-Commit, Range requests answered with 206), ``GET
/api/models/{repo}/tree/{revision}`` (file listing), and the hub's error responses
(``X-Error-Code`` RepoNotFound / EntryNotFound / GatedRepo with 401/403/404). Faults can be
injected: a connection dropped after N bytes of a file, or a file served with other bytes
than its advertised SHA-256.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclasses.dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    gated: bool = False
    private: bool = False


@dataclasses.dataclass
class HubState:
    repos: dict[str, Repo] = dataclasses.field(default_factory=dict)
    #: file name -> drop the connection after this many bytes (once)
    drop_after: dict[str, int] = dataclasses.field(default_factory=dict)
    #: file name -> bytes served instead of the real ones (the advertised hash stays)
    corrupt: dict[str, bytes] = dataclasses.field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = dataclasses.field(default_factory=list)
    #: sizes advertised instead of the real ones (for disk-space tests)
    fake_size: dict[str, int] = dataclasses.field(default_factory=dict)


class _Handler(BaseHTTPRequestHandler):
    state: HubState
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _error(self, status: int, code: str | None, message: str) -> None:
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        data = json.dumps({"error": message}).encode()
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _repo(self, repo_id: str) -> Repo | None:
        repo = self.state.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository Not Found for url: {self.path}")
            return None
        if repo.private and not self.headers.get("Authorization"):
            self._error(401, "RepoNotFound", "Invalid username or password.")
            return None
        if repo.gated:
            self._error(403, "GatedRepo", f"Access to model {repo_id} is restricted.")
            return None
        return repo

    def _serve(self, *, body: bool) -> None:
        st = self.state
        st.requests.append((self.command, self.path, self.headers.get("Range")))
        path = self.path.split("?", 1)[0]
        m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?$", path)
        if m:
            repo = self._repo(m[1])
            if repo is None:
                return
            listing = [
                {"type": "file", "path": name, "size": len(data),
                 "oid": hashlib.sha1(data).hexdigest(),
                 "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data)}}
                for name, data in sorted(repo.files.items())
            ]  # fmt: skip
            data = json.dumps(listing).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)
            return
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if not m:
            self._error(404, None, "not found")
            return
        repo = self._repo(m[1])
        if repo is None:
            return
        name = m[3]
        if name not in repo.files:
            self._error(404, "EntryNotFound", f"{name} does not exist on {m[2]}")
            return
        real = repo.files[name]
        data = st.corrupt.get(name, real)
        sha = hashlib.sha256(real).hexdigest()
        size = st.fake_size.get(name, len(data))
        start = 0
        rng = self.headers.get("Range")
        if rng and (rm := re.match(r"bytes=(\d+)-", rng)):
            start = int(rm[1])
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", repo.commit)
        self.send_header("ETag", f'"{sha}"')
        self.send_header("X-Linked-Etag", f'"{sha}"')
        self.send_header("X-Linked-Size", str(size))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if not body:
            return
        cut = st.drop_after.pop(name, None) if not start else None
        if cut is not None:
            self.wfile.write(data[:cut])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)  # drop mid-body, as a failing network would
            return
        self.wfile.write(data[start:])


class LocalHub:
    """Runs the server in a thread; ``url`` is its endpoint (set HF_ENDPOINT to it)."""

    def __init__(self) -> None:
        self.state = HubState()
        handler = type("Handler", (_Handler,), {"state": self.state})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add_repo(self, repo_id: str, files: dict[str, Path | bytes], **kw: object) -> Repo:
        repo = Repo(
            {n: (p.read_bytes() if isinstance(p, Path) else p) for n, p in files.items()},
            **kw,  # type: ignore[arg-type]
        )
        self.state.repos[repo_id] = repo
        return repo

    def gets(self, name: str) -> list[str | None]:
        """The Range header of each GET of ``name`` (None: a whole-file request)."""
        return [r for m, p, r in self.state.requests if m == "GET" and p.endswith("/" + name)]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
