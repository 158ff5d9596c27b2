"""llama.cpp's RPC backend: layers of a model on other machines' ``rpc-server`` processes.

An ``rpc-server`` (llama.cpp's ``tools/rpc``, built by ``scripts/install`` beside the
llama-cpp-python wheel, started by ``specgguf rpc-server``) exposes its machine's CPU or
GPU memory and compute. A client adds each server with ``ggml_backend_rpc_add_server``
(as llama.cpp's ``--rpc`` does in ``common/arg.cpp``, ``add_rpc_devices``), and a model
loaded with those devices in ``llama_model_params.devices`` has its layers placed there by
llama.cpp's own splitting (``n_gpu_layers``, ``tensor_split``).

What llama.cpp does not allow, and what this module does about it:

- ggml-rpc ends the process (``GGML_ABORT``) when it cannot connect to a server or when a
  server stops answering in the middle of a call ("Remote RPC server crashed or returned
  malformed response"); there is no error return. So :func:`probe` checks every server
  itself, in Python, before anything is handed to llama.cpp: a TCP connection and the RPC
  handshake (``RPC_CMD_HELLO``: protocol version), the device count and each device's
  free memory, all with a timeout, raising :class:`RpcServerError` naming the server.
- A server lost after loading cannot be recovered from in-process: :func:`add_servers`
  installs a ggml abort callback (``ggml_set_abort_callback``, which ggml calls before
  ``abort()``) that works out which server is gone and hands a :class:`RpcServerLost` to
  the handler set with :func:`set_lost_handler`; the command line prints it on one line
  and exits 9 there, before ``abort()`` would. Without a handler the error is logged and
  the process aborts as llama.cpp intends.
- ggml-rpc's sockets have no timeout (no ``SO_RCVTIMEO``, no keepalive: a call waits for
  its answer forever). A server process that is killed is noticed at once (the peer's
  kernel closes the connection). A server machine that disappears (power, network) would
  leave the client waiting forever: :func:`keep_alive` turns on TCP keepalive and
  ``TCP_USER_TIMEOUT`` on llama.cpp's own sockets after loading, so that the kernel
  drops such a connection within the timeout and the abort path above reports it. A
  server process that hangs while its machine stays up still answers TCP keepalive and
  is not detected: a receive timeout would be needed, and it would also cut off a long
  but healthy computation, so none is set.
- An ``rpc-server`` serves one client connection at a time (its accept loop is serial):
  a second client waits until the first disconnects. :func:`probe` says so when a server
  accepts a connection but does not answer the handshake within the timeout.

Security: ``rpc-server`` has no authentication and runs whatever graph a client sends; it
must never face an untrusted network (see the README, "Targets bigger than one machine").
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import json
import logging
import os
import shutil
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from specgguf.errors import BackendError, RpcServerError, RpcServerLost, UsageError
from specgguf.llama.runtime import native_fn as _fn

log = logging.getLogger("specgguf")

#: The RPC protocol of the llama.cpp this release of specgguf builds (ggml-rpc.h,
#: ``RPC_PROTO_*_VERSION``): a server must have this major version and no newer minor.
RPC_PROTO_VERSION = (7, 0, 0)
#: ``RPC_CONN_CAPS_SIZE`` (transport.h): the capability bytes of the handshake (all zero:
#: plain TCP, no RDMA upgrade).
_CAPS_SIZE = 24
_CMD_GET_DEVICE_MEMORY = 11
_CMD_HELLO = 14
_CMD_DEVICE_COUNT = 15

#: llama.cpp's default port of ``rpc-server``.
DEFAULT_PORT = 50052
#: Seconds for the handshake in :func:`probe`, and for :func:`keep_alive` to give up on a
#: server machine that no longer answers at the TCP level.
DEFAULT_TIMEOUT = 15.0


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """An RPC server's address as llama.cpp writes it: ``host:port`` (IPv4 or a name)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoints(text: str | Sequence[str]) -> tuple[Endpoint, ...]:
    """Endpoints from llama.cpp's ``--rpc`` format, ``HOST:PORT[,HOST:PORT...]`` (or a
    list of such strings); duplicates removed, order kept.

    Raises:
        UsageError: an empty list, an entry without a port, a port outside 1..65535, an
            IPv6 address (llama.cpp's RPC client connects over IPv4 only).
    """
    items = [text] if isinstance(text, str) else list(text)
    out: list[Endpoint] = []
    for item in items:
        for raw in item.split(","):
            entry = raw.strip()
            host, sep, port = entry.rpartition(":")
            if not sep or not host or not port:
                raise UsageError(f"an RPC server is HOST:PORT, not {entry!r}")
            if ":" in host or host.startswith("["):
                raise UsageError(
                    f"{entry!r}: llama.cpp's RPC client connects over IPv4 only; give an "
                    "IPv4 address or a host name"
                )
            if not port.isdigit() or not 1 <= int(port) <= 65535:
                raise UsageError(f"{entry!r}: the port must be a number from 1 to 65535")
            ep = Endpoint(host, int(port))
            if ep not in out:
                out.append(ep)
    if not out:
        raise UsageError("no RPC server given")
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class RpcDevice:
    """One device of an RPC server: its index there and its memory in bytes."""

    index: int
    memory_free: int
    memory_total: int


@dataclasses.dataclass(frozen=True)
class RpcServerInfo:
    """What an RPC server said in :func:`probe`: its protocol version and devices."""

    endpoint: Endpoint
    version: tuple[int, int, int]
    devices: tuple[RpcDevice, ...]

    @property
    def memory_free(self) -> int:
        """Free memory over all its devices (bytes)."""
        return sum(d.memory_free for d in self.devices)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError("the server closed the connection")
        buf += chunk
    return bytes(buf)


def _call(sock: socket.socket, cmd: int, payload: bytes, reply_size: int) -> bytes:
    """One request and its reply, framed as ggml-rpc frames them (``send_rpc_cmd``):
    ``cmd: u8 | size: u64 | payload`` out, ``size: u64 | data`` back."""
    sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    (size,) = struct.unpack("<Q", _recv_exact(sock, 8))
    if size != reply_size:
        raise ValueError(f"a reply of {size} bytes where {reply_size} were expected")
    return _recv_exact(sock, size)


def probe(endpoint: Endpoint, *, timeout: float = DEFAULT_TIMEOUT) -> RpcServerInfo:
    """Check that an RPC server answers, and read its version and devices' memory, the way
    ggml-rpc's client would (HELLO, DEVICE_COUNT, GET_DEVICE_MEMORY per device), but with a
    ``timeout`` (seconds) on every step and an error instead of ``abort()``.

    Raises:
        RpcServerError: the name does not resolve, nothing listens at the port, the
            connection or the handshake times out, the server speaks another protocol
            version, or it reports no device.
    """
    name = str(endpoint)
    try:
        sock = socket.create_connection((endpoint.host, endpoint.port), timeout=timeout)
    except socket.gaierror as e:
        raise RpcServerError(
            name, f"cannot resolve host {endpoint.host!r} ({e.strerror})"
        ) from None
    except ConnectionRefusedError:
        raise RpcServerError(
            name, "connection refused (nothing listens at that port: is rpc-server running?)"
        ) from None
    except TimeoutError:
        raise RpcServerError(name, f"no connection within {timeout:g} s") from None
    except OSError as e:
        raise RpcServerError(name, f"cannot connect ({e.strerror or e})") from None
    with sock:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = _call(sock, _CMD_HELLO, bytes(_CAPS_SIZE), 4 + _CAPS_SIZE)
            version = (hello[0], hello[1], hello[2])
            if version[0] != RPC_PROTO_VERSION[0] or version[1] > RPC_PROTO_VERSION[1]:
                want = ".".join(map(str, RPC_PROTO_VERSION))
                raise RpcServerError(
                    name,
                    f"speaks RPC protocol {'.'.join(map(str, version))}, this llama.cpp "
                    f"build speaks {want}: run the rpc-server of the same llama.cpp release",
                )
            (n_dev,) = struct.unpack("<I", _call(sock, _CMD_DEVICE_COUNT, b"", 4))
            devices = []
            for i in range(n_dev):
                raw = _call(sock, _CMD_GET_DEVICE_MEMORY, struct.pack("<I", i), 16)
                free, total = struct.unpack("<QQ", raw)
                devices.append(RpcDevice(i, free, total))
        except TimeoutError:
            raise RpcServerError(
                name,
                f"accepted the connection but did not answer the handshake within "
                f"{timeout:g} s (an rpc-server serves one client at a time: is another "
                "program connected to it?)",
            ) from None
        except (ValueError, struct.error, ConnectionError) as e:
            raise RpcServerError(
                name,
                f"did not answer as an rpc-server of RPC protocol "
                f"{'.'.join(map(str, RPC_PROTO_VERSION))} ({e}): another program, or "
                "another llama.cpp release?",
            ) from None
        except OSError as e:
            raise RpcServerError(name, f"connection failed ({e.strerror or e})") from None
    if not devices:
        raise RpcServerError(name, "reports no device")
    return RpcServerInfo(endpoint, version, tuple(devices))


# --- the native side -------------------------------------------------------------------


@functools.cache
def _rpc_reg() -> int | None:
    """The RPC backend registry (``ggml_backend_reg_by_name("RPC")``), None without one."""
    reg = _fn("ggml_backend_reg_by_name", ctypes.c_void_p, ctypes.c_char_p)(b"RPC")
    return int(reg) if reg else None


def supported() -> bool:
    """Whether the loaded llama.cpp build has the RPC backend (built with GGML_RPC=ON).

    Raises:
        BackendError: llama-cpp-python cannot be imported.
    """
    return _rpc_reg() is not None


_lock = threading.Lock()
_added: dict[Endpoint, tuple[int, ...]] = {}


def add_servers(endpoints: Sequence[Endpoint]) -> list[int]:
    """Add RPC servers to llama.cpp (``ggml_backend_rpc_add_server``, through the RPC
    registry's proc address as ``common/arg.cpp`` does) and return their devices
    (``ggml_backend_dev_t`` addresses) in order, for ``llama_model_params.devices``.

    The servers are not registered globally (no ``ggml_backend_register``), so a model
    loaded without an explicit device list (the draft, by default) stays local. Adding a
    server twice returns the same devices. Call :func:`probe` on each first: llama.cpp
    aborts the process when a server cannot be reached. Installs the abort callback that
    reports a server lost later (:func:`set_lost_handler`).

    Raises:
        BackendError: this llama.cpp build has no RPC backend, or a server reports no
            device.
    """
    reg = _rpc_reg()
    if reg is None:
        raise BackendError(
            "this llama.cpp build has no RPC backend (it was built without GGML_RPC=ON)",
            hint="reinstall with scripts/install, which builds it in",
        )
    addr = _fn("ggml_backend_reg_get_proc_address", ctypes.c_void_p, ctypes.c_void_p,
               ctypes.c_char_p)(reg, b"ggml_backend_rpc_add_server")  # fmt: skip
    if not addr:
        raise BackendError("this llama.cpp build's RPC backend has no add_server entry point")
    add = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(addr)
    dev_count = _fn("ggml_backend_reg_dev_count", ctypes.c_size_t, ctypes.c_void_p)
    dev_get = _fn("ggml_backend_reg_dev_get", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    _install_abort_hook()
    out: list[int] = []
    with _lock:
        for ep in endpoints:
            if ep not in _added:
                _in_use.add(ep)
                server = add(str(ep).encode())
                if not server:
                    raise BackendError(f"RPC server {ep} reports no device")
                _added[ep] = tuple(int(dev_get(server, i)) for i in range(dev_count(server)))
            out += _added[ep]
    return out


class _DevCaps(ctypes.Structure):
    _fields_ = [
        (f, ctypes.c_bool)
        for f in ("async_", "host_buffer", "buffer_from_host_ptr", "events", "mmap_support")
    ]


class _DevProps(ctypes.Structure):
    """``struct ggml_backend_dev_props`` (ggml-backend.h), with room to spare at the end
    for fields a newer ggml adds."""

    _fields_ = [
        ("name", ctypes.c_char_p),
        ("description", ctypes.c_char_p),
        ("memory_free", ctypes.c_size_t),
        ("memory_total", ctypes.c_size_t),
        ("type", ctypes.c_int),
        ("device_id", ctypes.c_char_p),
        ("caps", _DevCaps),
        ("_spare", ctypes.c_char * 64),
    ]


_GPU, _IGPU = 1, 2


def local_devices() -> list[int]:
    """This machine's devices as llama.cpp picks them by default (``llama.cpp``,
    ``llama_prepare_model_devices``) without the RPC servers: the GPUs (one per physical
    device id), or the integrated GPUs of one backend when there is no GPU; empty on
    CPU-only builds. They follow the RPC devices in a model's device list, as llama.cpp
    puts them.

    Raises:
        BackendError: llama-cpp-python cannot be imported.
    """
    count = _fn("ggml_backend_dev_count", ctypes.c_size_t)
    get = _fn("ggml_backend_dev_get", ctypes.c_void_p, ctypes.c_size_t)
    dev_type = _fn("ggml_backend_dev_type", ctypes.c_int, ctypes.c_void_p)
    dev_reg = _fn("ggml_backend_dev_backend_reg", ctypes.c_void_p, ctypes.c_void_p)
    reg_name = _fn("ggml_backend_reg_name", ctypes.c_char_p, ctypes.c_void_p)
    props_of = _fn("ggml_backend_dev_get_props", None, ctypes.c_void_p,
                   ctypes.POINTER(_DevProps))  # fmt: skip
    gpus: list[int] = []
    ids: set[bytes] = set()
    igpus: list[int] = []
    for i in range(count()):
        dev = get(i)
        kind = dev_type(dev)
        if kind == _GPU and reg_name(dev_reg(dev)) != b"RPC":
            props = _DevProps()
            props_of(dev, ctypes.byref(props))
            if props.device_id and props.device_id in ids:
                continue
            if props.device_id:
                ids.add(props.device_id)
            gpus.append(int(dev))
        elif kind == _IGPU and (not igpus or dev_reg(dev) == dev_reg(igpus[-1])):
            igpus.append(int(dev))
    return gpus or igpus


def device_name(dev: int) -> str:
    """A device's name as llama.cpp logs it (``RPC0``, ``CUDA0``)."""
    name = _fn("ggml_backend_dev_name", ctypes.c_char_p, ctypes.c_void_p)(dev)
    return (name or b"").decode()


# --- a server lost after loading -------------------------------------------------------

_in_use: set[Endpoint] = set()
_lost_handler: Callable[[RpcServerLost], None] | None = None
_abort_callback: Any = None  # keeps the ctypes callback alive


def set_lost_handler(handler: Callable[[RpcServerLost], None] | None) -> None:
    """What to do when an RPC server is lost after loading, just before llama.cpp ends the
    process: ``handler`` gets the error (it may end the process itself, e.g. with
    ``os._exit``; when it returns, the process aborts). None: log the error and abort."""
    global _lost_handler
    _lost_handler = handler


def lost_handler() -> Callable[[RpcServerLost], None] | None:
    """The handler set with :func:`set_lost_handler` (None: none)."""
    return _lost_handler


def _reachable(ep: Endpoint, timeout: float = 1.0) -> str | None:
    """None when a TCP connection to ``ep`` opens now, else why not."""
    try:
        with socket.create_connection((ep.host, ep.port), timeout=timeout):
            return None
    except ConnectionRefusedError:
        return "connection refused"
    except TimeoutError:
        return f"no answer within {timeout:g} s"
    except OSError as e:
        return e.strerror or str(e)


#: Seconds to wait for a lost server to stop accepting connections: a killed process
#: closes its connection to us before its listening socket, and a connection opened in
#: between is accepted by the kernel (CI: a killed server was not singled out).
LOST_SETTLE = 2.0


def lost_error(
    message: str, endpoints: Sequence[Endpoint], *, settle: float = LOST_SETTLE
) -> RpcServerLost:
    """The error for ggml-rpc's abort ``message``: the servers among ``endpoints`` that no
    longer accept a connection, asked again every 0.1 s for up to ``settle`` seconds until
    one does not (all of them when none can be singled out)."""
    detail = message.split(": ", 1)[-1].strip()  # drop ggml's "file:line: "
    named = [ep for ep in endpoints if str(ep) in message]
    if named:
        return RpcServerLost([str(ep) for ep in named], detail)
    deadline = time.monotonic() + settle
    while True:
        gone = [(ep, why) for ep in endpoints if (why := _reachable(ep)) is not None]
        if gone or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if gone:
        return RpcServerLost([str(ep) for ep, _ in gone], f"{gone[0][1]} now; llama.cpp: {detail}")
    return RpcServerLost([str(ep) for ep in endpoints], f"llama.cpp: {detail}")


def _on_abort(message: bytes | None) -> None:
    text = (message or b"").decode("utf-8", errors="replace")
    if "ggml-rpc" in text and _in_use:
        err = lost_error(text, sorted(_in_use, key=str))
        if _lost_handler is not None:
            _lost_handler(err)
        else:
            log.critical("%s", err)
        return
    # Any other abort: what ggml prints without a callback, through the log (the
    # library never prints; with no handler, logging's last resort writes it to stderr).
    log.critical("%s", text.rstrip("\n"))
    with contextlib.suppress(AttributeError, OSError):
        _fn("ggml_print_backtrace", None)()


def _install_abort_hook() -> None:
    global _abort_callback
    if _abort_callback is not None:
        return
    cb_type = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
    _abort_callback = cb_type(_on_abort)
    _fn("ggml_set_abort_callback", ctypes.c_void_p, cb_type)(_abort_callback)


def keep_alive(endpoints: Sequence[Endpoint], timeout: float = DEFAULT_TIMEOUT) -> int:
    """Give llama.cpp's open connections to ``endpoints`` a dead-peer timeout (seconds):
    TCP keepalive (first probe after a third of it idle, then probes until it has passed)
    and, on Linux, ``TCP_USER_TIMEOUT`` (sent data unacknowledged for that long). The
    kernel then closes a connection to a machine that stopped answering, and llama.cpp's
    next read fails and is reported (:func:`set_lost_handler`) instead of waiting forever.
    Returns the number of connections changed (0 where the platform does not tell which
    sockets the process holds).
    """
    import psutil

    wanted: set[tuple[str, int]] = set()
    for ep in endpoints:
        try:
            wanted.add((socket.gethostbyname(ep.host), ep.port))
        except OSError:
            continue
    try:
        conns = psutil.Process().net_connections(kind="tcp4")
    except (psutil.Error, OSError):
        return 0
    idle = max(1, int(timeout / 3))
    interval = max(1, int(timeout / 6))
    count = max(1, int((timeout - idle) / interval))
    changed = 0
    for c in conns:
        if c.fd < 0 or not c.raddr or (c.raddr.ip, c.raddr.port) not in wanted:
            continue
        s = socket.socket(fileno=c.fd)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for opt, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPALIVE", idle),
                               ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count),
                               ("TCP_USER_TIMEOUT", int(timeout * 1000))):  # fmt: skip
                if hasattr(socket, opt):
                    s.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
            changed += 1
        except OSError as e:
            log.debug("keepalive on fd %d: %s", c.fd, e)
        finally:
            s.detach()  # the socket stays llama.cpp's
    return changed


# --- the rpc-server program ----------------------------------------------------------

#: Names llama.cpp's RPC server program has had (``tools/rpc``): the current one first.
SERVER_NAMES = ("ggml-rpc-server", "rpc-server")


def _wheel_dir() -> Path | None:
    """The folder of the wheel the installed llama-cpp-python came from, when it was
    installed from a local file (``scripts/install``'s cache: ``direct_url.json``)."""
    from importlib import metadata
    from urllib.parse import unquote, urlparse

    try:
        raw = metadata.distribution("llama_cpp_python").read_text("direct_url.json")
        url = json.loads(raw or "{}").get("url", "")
    except (metadata.PackageNotFoundError, ValueError, OSError):
        return None
    parsed = urlparse(url)
    if parsed.scheme != "file":
        return None
    return Path(unquote(parsed.path)).parent


def server_binary() -> Path | None:
    """llama.cpp's ``rpc-server`` for the llama.cpp specgguf runs on, or None: the file
    named by ``SPECGGUF_RPC_SERVER``; else the one ``scripts/install`` built from the same
    source and flags, beside the installed wheel in its cache folder; else one on PATH
    (``ggml-rpc-server``, ``rpc-server``), which must speak the same protocol version."""
    env = os.environ.get("SPECGGUF_RPC_SERVER")
    if env:
        return Path(env)
    folder = _wheel_dir()
    if folder is not None and (folder / "rpc-server").is_file():
        return folder / "rpc-server"
    for name in SERVER_NAMES:
        found = shutil.which(name)
        if found:
            return Path(found)
    return None
