"""A local HTTP server that answers the requests huggingface_hub makes, the way the
Hugging Face hub does, for tests without the internet.

Served: ``HEAD``/``GET /{repo}/resolve/{revision}/{file}`` (ETag/X-Linked-Etag = SHA-256,
X-Linked-Size, X-Repo-Commit, Range requests answered with 206), ``GET
/api/models/{repo}[/revision/{revision}]`` (the repository's commit and files), ``GET
/api/models/{repo}/tree/{revision}`` (file listing, with LFS sizes and SHA-256), and the
hub's error responses (``X-Error-Code`` RepoNotFound / RevisionNotFound / EntryNotFound /
GatedRepo with 401/403/404). A revision is ``main``, the repository's commit, or one of its
``branches``. As on the hub, a gated repository shows its files but refuses to serve them.
Faults can be injected: a connection dropped after N bytes of a file, a file served with
other bytes than its advertised SHA-256, a size advertised other than the bytes sent, an
HTTP status (5xx) answered instead, and files served without the hub's headers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote


@dataclasses.dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    gated: bool = False
    private: bool = False
    #: other branch or tag names that point at ``commit``
    branches: tuple[str, ...] = ()


@dataclasses.dataclass
class HubState:
    repos: dict[str, Repo] = dataclasses.field(default_factory=dict)
    #: file name -> drop the connection after this many bytes (once)
    drop_after: dict[str, int] = dataclasses.field(default_factory=dict)
    #: file name -> bytes served instead of the real ones (the advertised hash stays)
    corrupt: dict[str, bytes] = dataclasses.field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = dataclasses.field(default_factory=list)
    #: sizes advertised instead of the real ones (for disk-space and integrity tests)
    fake_size: dict[str, int] = dataclasses.field(default_factory=dict)
    #: file name or repository id -> HTTP status answered to every request for it
    fail: dict[str, int] = dataclasses.field(default_factory=dict)
    #: file name -> HTTP status answered to its GETs only (the HEAD succeeds)
    fail_get: dict[str, int] = dataclasses.field(default_factory=dict)
    #: serve files without the hub's headers (commit, ETag), as a plain web server would
    bare: bool = False


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

    def _repo(self, repo_id: str, revision: str | None, *, files: bool) -> Repo | None:
        """The repository, or None after answering the error the hub would give; ``files``:
        the request is for a file's bytes (which a gated repository refuses)."""
        if repo_id in self.state.fail:
            self._error(self.state.fail[repo_id], None, "Internal Error")
            return None
        repo = self.state.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository Not Found for url: {self.path}")
            return None
        if repo.private and not self.headers.get("Authorization"):
            self._error(401, "RepoNotFound", "Invalid username or password.")
            return None
        if repo.gated and files:
            self._error(403, "GatedRepo", f"Access to model {repo_id} is restricted.")
            return None
        if revision is not None and revision not in ("main", repo.commit, *repo.branches):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return repo

    def _json(self, obj: object, *, body: bool) -> None:
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _serve(self, *, body: bool) -> None:
        st = self.state
        st.requests.append((self.command, self.path, self.headers.get("Range")))
        path = unquote(self.path.split("?", 1)[0])
        m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)(/.*)?$", path)
        if m:
            repo = self._repo(m[1], m[2], files=False)
            if repo is not None:
                self._json([
                    {"type": "file", "path": name, "size": len(data),
                     "oid": hashlib.sha1(data).hexdigest(),
                     "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                             "pointerSize": 134}}
                    for name, data in sorted(repo.files.items())
                ], body=body)  # fmt: skip
            return
        m = re.match(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$", path)
        if m:
            repo = self._repo(m[1], m[2], files=False)
            if repo is not None:
                self._json({"id": m[1], "sha": repo.commit, "private": repo.private,
                            "gated": "manual" if repo.gated else False,
                            "siblings": [{"rfilename": n} for n in sorted(repo.files)]},
                           body=body)  # fmt: skip
            return
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
        if not m:
            self._error(404, None, "not found")
            return
        repo = self._repo(m[1], m[2], files=True)
        if repo is None:
            return
        name = m[3]
        if name not in repo.files:
            self._error(404, "EntryNotFound", f"{name} does not exist on {m[2]}")
            return
        status = st.fail.get(name) or (st.fail_get.get(name) if self.command == "GET" else None)
        if status:
            self._error(status, None, "Internal Error")
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
        if not st.bare:
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
