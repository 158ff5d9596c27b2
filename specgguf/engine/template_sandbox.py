"""Chat templates rendered in a child process, within a budget of time, output and memory.

A GGUF's ``tokenizer.chat_template`` is a program that came with a downloaded file. Jinja's
``ImmutableSandboxedEnvironment`` keeps it away from Python internals (attribute access such
as ``__class__``/``__globals__`` raises ``SecurityError``; llama-cpp-python's plain
``jinja2.Environment`` had CVE-2024-34359), but nothing in Jinja bounds how long a template
runs or how much it builds: ``{% for i in range(10**5) %}{% for j in range(10**5) %}``
spins for hours, a string doubled in a loop takes the machine's memory, and a thread that
runs such a loop cannot be stopped. So every render happens in a worker process (this file,
run as a script: the standard library and jinja2 only), which:

- stops itself after :data:`RENDER_SECONDS` (``SIGALRM``), and is killed by the caller a
  second later if a single operation outlasts that;
- stops when its output passes its character budget (:func:`output_budget`);
- runs under an address-space limit of :data:`RENDER_MEMORY` bytes (``RLIMIT_AS``, where
  the platform enforces it), so an allocation past it is a ``MemoryError``.

A worker that hit a budget exits; idle workers are kept for the next render (a render costs
one pipe round trip, about 0.1 ms, after the worker's start, about 0.1 s once).

What real templates use beyond plain Jinja follows Hugging Face transformers'
``apply_chat_template`` (``transformers/utils/chat_template_utils.py``): ``trim_blocks``,
``lstrip_blocks``, loop controls (``break``/``continue``), ``raise_exception``,
``strftime_now``, ``tojson`` as ``json.dumps`` (with ``indent``, no HTML escaping, keys in
their order), ``namespace``, and the ``{% generation %}...{% endgeneration %}`` tags, whose
body is rendered as is.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import functools
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, NoReturn

#: Wall-clock seconds one render may take (real templates take well under 0.01 s).
RENDER_SECONDS = 5.0
#: Bytes of address space a render worker may hold (the interpreter and jinja2 take ~60 MB).
RENDER_MEMORY = 1 << 30
#: Seconds a worker may take to start (import jinja2), outside the render's budget.
START_SECONDS = 60.0
#: Idle workers kept for later renders.
_KEEP_IDLE = 4
#: The most workers at once (renders past it wait for one): each may take RENDER_MEMORY.
MAX_WORKERS = 4


def output_budget(variables: Mapping[str, Any]) -> int:
    """The most characters a render of ``variables`` may produce: 1 MiB plus 8 times the
    characters of the variables as JSON (a template repeats its inputs a few times at most:
    a system prompt, tool definitions)."""
    return (1 << 20) + 8 * len(json.dumps(variables, ensure_ascii=False, default=str))


@dataclasses.dataclass(frozen=True)
class RenderFailure(Exception):
    """A render that did not give a text.

    ``kind``: ``refused`` (the template's own ``raise_exception``; ``message`` is its
    text), ``security`` (the sandbox stopped it), ``budget`` (time, output or memory ran
    out), ``template`` (anything else the template did wrong: a syntax error, an unknown
    name, an ``OverflowError`` from a range past Jinja's limit)."""

    kind: str
    message: str

    def __str__(self) -> str:
        return self.message


# -- the worker's side ----------------------------------------------------------------


class _Refused(Exception):
    """The template's own ``raise_exception``: it refuses the conversation."""


class _OverBudget(Exception):
    pass


@functools.cache
def _environment() -> Any:
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTags(Extension):
        """``{% generation %}...{% endgeneration %}`` (marks the assistant's text for
        training masks): the body is rendered as is."""

        tags = {"generation"}  # noqa: RUF012  (Jinja's own class attribute)

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str) -> NoReturn:
        raise _Refused(message)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)  # fmt: skip

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", GenerationTags],
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.filters["tojson"] = tojson
    return env


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> Any:
    """The template compiled once (about 5 ms for Qwen2.5's, 0.01 ms to render after)."""
    return _environment().from_string(template)


def _render_here(template: str, variables: dict[str, Any], max_chars: int) -> str:
    """Render in this process, stopping once the output passes ``max_chars``."""
    parts, n = [], 0
    for part in _compiled(template).generate(**variables):
        n += len(part)
        if n > max_chars:
            raise _OverBudget(f"its output passed {max_chars:,} characters")
        parts.append(part)
    return "".join(parts)


def _answer(request: dict[str, Any]) -> dict[str, str]:
    """One request of the worker: ``{"text": ...}`` or ``{"kind": ..., "message": ...}``."""
    import jinja2

    def over_time(*_: object) -> NoReturn:
        raise _OverBudget(f"it ran for more than {request['seconds']:g} s")

    import signal

    signal.signal(signal.SIGALRM, over_time)
    signal.setitimer(signal.ITIMER_REAL, request["seconds"])
    try:
        return {"text": _render_here(request["template"], request["vars"], request["max_chars"])}
    except _Refused as e:
        return {"kind": "refused", "message": str(e)}
    except _OverBudget as e:
        return {"kind": "budget", "message": str(e)}
    except MemoryError:
        return {"kind": "budget", "message": f"it took more than {RENDER_MEMORY >> 20} MiB"}
    except RecursionError:
        return {"kind": "budget", "message": "it recursed too deeply"}
    except jinja2.exceptions.SecurityError as e:
        return {"kind": "security", "message": str(e)}
    except Exception as e:
        return {"kind": "template", "message": f"{type(e).__name__}: {e}"}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _worker_main() -> None:
    """Answer one JSON request per line of stdin with one JSON line on stdout; exit after a
    budget ran out (the process may be left in a poor state) or at the end of stdin."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (RENDER_MEMORY, RENDER_MEMORY))
    except (ImportError, ValueError, OSError):
        pass  # not enforced on this platform: time and output still are
    import jinja2  # noqa: F401  (imported before the first request: its time is not the render's)

    out = sys.stdout.buffer  # UTF-8 both ways, whatever the locale
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        reply = _answer(json.loads(line.decode("utf-8")))
        # (a template can write a lone surrogate: carried as is, not a crash)
        text = json.dumps(reply, ensure_ascii=False)
        out.write(text.encode("utf-8", "surrogatepass") + b"\n")
        out.flush()
        if reply.get("kind") == "budget":
            return


# -- the caller's side ----------------------------------------------------------------


class _Worker:
    def __init__(self) -> None:
        # -P: the script's folder (specgguf/engine) stays off sys.path.
        self.proc = subprocess.Popen(
            [sys.executable, "-P", os.path.abspath(__file__)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self._chunks: list[bytes] = []

    def start(self) -> None:
        """Wait for the worker to be ready (its imports are not a render's time).

        Raises:
            WorkerError: it did not start.
        """
        if self._line(time.monotonic() + START_SECONDS, START_SECONDS) != b"ready":
            self.kill()
            raise WorkerError("the chat template worker process did not start")

    def _line(self, first_by: float, then: float) -> bytes | None:
        """The next line from the worker: its first bytes by the time ``first_by`` (the
        render's budget), the rest within ``then`` more seconds (a long reply is being
        written: its render is over); None past a deadline, ``b""`` at the worker's end (it
        was stopped or died: a reply is never empty)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = first_by
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b""
            if not self._chunks:
                deadline = time.monotonic() + then
            end = chunk.find(b"\n")
            if end < 0:
                self._chunks.append(chunk)
                continue
            line = b"".join([*self._chunks, chunk[:end]])
            self._chunks = [chunk[end + 1 :]] if end + 1 < len(chunk) else []
            return line

    def render(self, request: dict[str, Any]) -> dict[str, str]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            return {"kind": "budget", "message": "the template worker process was stopped"}
        line = self._line(time.monotonic() + request["seconds"] + 1.0, START_SECONDS)
        if not line:
            self.kill()
            if line == b"":
                return {"kind": "budget", "message": "the template worker process was stopped"}
            return {"kind": "budget", "message": f"it ran for more than {request['seconds']:g} s"}
        reply: dict[str, str] = json.loads(line.decode("utf-8", "surrogatepass"))
        return reply

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


class WorkerError(Exception):
    """A render worker process that could not be started (the installation's fault, not
    the template's)."""


class _Pool:
    """Workers shared by every thread: one render per worker at a time, a new worker when
    all are busy, at most :data:`MAX_WORKERS` at once (a caller past it waits its turn)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_WORKERS)
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()

    def render(self, request: dict[str, Any]) -> dict[str, str]:
        with self._slots:
            with self._lock:
                worker = self._idle.pop() if self._idle else None
            if worker is None or not worker.alive:
                if worker is not None:
                    self._forget(worker)
                worker = _Worker()
                with self._lock:
                    self._all.add(worker)
                try:
                    worker.start()
                except WorkerError:
                    self._forget(worker)
                    raise
            reply: dict[str, str] = {}
            try:
                reply = worker.render(request)
                return reply
            finally:
                # a worker that ran out of a budget exits by itself: never reused
                keep = bool(reply) and reply.get("kind") != "budget" and worker.alive
                with self._lock:
                    keep = keep and len(self._idle) < _KEEP_IDLE and worker in self._all
                    if keep:
                        self._idle.append(worker)
                if not keep:
                    self._forget(worker)

    def _forget(self, worker: _Worker) -> None:
        with self._lock:
            self._all.discard(worker)
        worker.kill()

    def close(self) -> None:
        """Kill every worker, busy and starting ones too (their callers get a failure at
        once), and reap them."""
        with self._lock:
            workers = list(self._all)
            self._all.clear()
            self._idle.clear()
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
        for w in workers:
            w.proc.wait()


_POOL = _Pool()
atexit.register(_POOL.close)


def render(template: str, variables: dict[str, Any], *, seconds: float | None = None) -> str:
    """``template`` rendered with ``variables`` (JSON values) in a worker process, within
    :data:`RENDER_SECONDS` (or ``seconds``), :func:`output_budget` characters and
    :data:`RENDER_MEMORY` bytes.

    Raises:
        RenderFailure: the template refused, broke the sandbox, ran out of a budget, or
            failed otherwise (``kind`` says which).
        WorkerError: no worker process could be started.
    """
    request = {
        "template": template, "vars": variables, "max_chars": output_budget(variables),
        "seconds": RENDER_SECONDS if seconds is None else seconds,
    }  # fmt: skip
    reply = _POOL.render(request)
    if "text" in reply:
        return reply["text"]
    raise RenderFailure(reply["kind"], reply["message"])


def shutdown() -> None:
    """Kill every worker, busy ones too: a server shutting down must not wait for a render
    (its caller gets a failure at once). A later render starts a new worker."""
    _POOL.close()


if __name__ == "__main__":
    _worker_main()
