"""The llama.cpp build specgguf runs on: versions, backends, CPU features, log routing, and
the guard against builds whose weight-repacking kernels crash.

The guard: llama.cpp's CPU backend "repacks" quantized weights into extra buffer types
(AMX tiles, AVX-512/AVX2 interleaved layouts) for speed. On some machines a build with the
AMX kernels compiled in (the default ``GGML_NATIVE=ON`` build on a CPU that reports AMX)
crashes with a segmentation fault at the first decode, inside ``ggml_backend_amx_mul_mat``,
for example in virtual machines. A crash cannot be caught in-process, so when the build has
AMX compiled in, :func:`repack_policy` runs a tiny model in a child process once, caches the
verdict for that exact build, and loads models with ``use_extra_bufts = False`` (llama.cpp's
``--no-repack``) when the child crashed, saying so on stderr. ``scripts/install`` builds
without AMX on such CPUs, which keeps the other repacked kernels and their speed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
from pathlib import Path
from types import ModuleType
from typing import Any

from specgguf.cache import cache_dir, read_json_cache, update_json_cache
from specgguf.errors import BackendError
from specgguf.llama.buildconfig import cpu_model, read_cpu_flags

#: llama.cpp's own log lines, one record per line, at DEBUG level (the command line shows
#: them with -v); nothing is formatted unless a handler wants DEBUG.
LLAMA_CPP_LOG = logging.getLogger("specgguf.llama_cpp")
# Keeps the ctypes callback alive for as long as llama.cpp may call it.
_log_callback: Any = None
_log_partial: list[str] = []


@functools.cache
def llama() -> ModuleType:
    """The ``llama_cpp.llama_cpp`` ctypes bindings, imported on first use, with llama.cpp's
    log routed to the ``specgguf.llama_cpp`` logger and the backends initialised.

    Raises:
        BackendError: llama-cpp-python is not installed or its library does not load.
    """
    try:
        import llama_cpp.llama_cpp as lc
    except (ImportError, OSError, RuntimeError) as e:
        raise BackendError(
            f"llama-cpp-python cannot be imported: {e}",
            hint="install it with scripts/install (it builds llama.cpp for this machine)",
        ) from e

    global _log_callback

    @lc.llama_log_callback  # type: ignore[untyped-decorator]
    def _log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        # llama.cpp sends lines in pieces (progress dots, continuations): one record per
        # complete line.
        if not text or not LLAMA_CPP_LOG.isEnabledFor(logging.DEBUG):
            return
        _log_partial.append(text.decode("utf-8", errors="replace"))
        if _log_partial[-1].endswith("\n"):
            for line in "".join(_log_partial).splitlines():
                LLAMA_CPP_LOG.debug(line)
            _log_partial.clear()

    _log_callback = _log
    lc.llama_log_set(_log_callback, ctypes.c_void_p(0))
    lc.llama_backend_init()
    return lc


def native_fn(name: str, restype: Any, *argtypes: Any) -> Any:
    """A ctypes function for the C function ``name`` in the loaded llama.cpp libraries
    (libllama and the ggml libraries it links), with its own types: not the shared
    attribute of the library object, whose types other code may set.

    Raises:
        BackendError: llama-cpp-python cannot be imported.
        AttributeError: no such function in this build.
    """
    proto = ctypes.CFUNCTYPE(restype, *argtypes)
    return proto((name, llama()._lib))


@functools.cache
def local_gpu_offload() -> bool:
    """Whether this build has a GPU on this machine to offload layers to.

    ``llama_supports_gpu_offload()`` also answers yes for a CPU-only build with the RPC
    backend (every build ``scripts/install`` makes), where nothing local is offloaded;
    this asks for a GPU or integrated GPU device, as that function does otherwise.

    Raises:
        BackendError: llama-cpp-python cannot be imported.
    """
    by_type = native_fn("ggml_backend_dev_by_type", ctypes.c_void_p, ctypes.c_int)
    return bool(by_type(1) or by_type(2))  # GGML_BACKEND_DEVICE_TYPE_GPU, _IGPU


@dataclasses.dataclass(frozen=True)
class Device:
    """A ggml backend device: ``kind`` is cpu, gpu, igpu or accel; memory in bytes."""

    name: str
    description: str
    kind: str
    memory_free: int
    memory_total: int


@dataclasses.dataclass(frozen=True)
class BuildInfo:
    """What llama-cpp-python and llama.cpp build is loaded, and what it can do."""

    llama_cpp_python: str
    ggml_version: str
    ggml_commit: str
    system_info: str  # llama_print_system_info(): "CPU : SSE3 = 1 | ... |"
    devices: tuple[Device, ...]
    gpu_offload: bool  # a local GPU to offload to (RPC servers not counted)
    library: Path

    @property
    def backends(self) -> list[str]:
        """Names of the backend registries compiled in (CPU, CUDA, Metal, ROCm/HIP, ...)."""
        names = []
        for part in self.system_info.split("|"):
            if " : " in part:
                names.append(part.split(" : ")[0].strip())
        for d in self.devices:
            reg = d.name.rstrip("0123456789")
            if reg and reg not in names:
                names.append(reg)
        return names

    @property
    def features(self) -> dict[str, str]:
        """Feature flags of the backends, e.g. ``{"AVX2": "1", "AMX_INT8": "1"}``."""
        out: dict[str, str] = {}
        for part in self.system_info.replace(" : ", "|").split("|"):
            if "=" in part:
                k, v = part.split("=", 1)
                out[k.strip()] = v.strip()
        return out

    @property
    def has_amx(self) -> bool:
        """True when the CPU backend was compiled with the AMX kernels."""
        return any(k.startswith("AMX") and v == "1" for k, v in self.features.items())

    def summary(self) -> str:
        """One line: versions and backends, for ``--version``."""
        commit = f" ({self.ggml_commit})" if self.ggml_commit else ""
        return (
            f"llama-cpp-python {self.llama_cpp_python}, ggml {self.ggml_version}{commit}, "
            f"backends: {', '.join(self.backends) or 'none'}"
            f"{', GPU offload' if self.gpu_offload else ''}"
        )


_DEV_KINDS = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


@functools.cache
def build_info() -> BuildInfo:
    """Introspect the loaded llama.cpp build (imports it on first call).

    Raises:
        BackendError: llama-cpp-python cannot be imported.
    """
    lc = llama()
    import llama_cpp

    lib = lc._lib
    devices: list[Device] = []
    ggml_version = ggml_commit = ""
    try:
        lib.ggml_version.restype = ctypes.c_char_p
        lib.ggml_commit.restype = ctypes.c_char_p
        ggml_version = (lib.ggml_version() or b"").decode()
        ggml_commit = (lib.ggml_commit() or b"").decode()
        lib.ggml_backend_dev_count.restype = ctypes.c_size_t
        lib.ggml_backend_dev_get.restype = ctypes.c_void_p
        lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
        for fn in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
            getattr(lib, fn).restype = ctypes.c_char_p
            getattr(lib, fn).argtypes = [ctypes.c_void_p]
        lib.ggml_backend_dev_type.restype = ctypes.c_int
        lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p] + [
            ctypes.POINTER(ctypes.c_size_t)
        ] * 2
        for i in range(lib.ggml_backend_dev_count()):
            dev = lib.ggml_backend_dev_get(i)
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
            devices.append(
                Device(
                    name=(lib.ggml_backend_dev_name(dev) or b"").decode(),
                    description=(lib.ggml_backend_dev_description(dev) or b"").decode(),
                    kind=_DEV_KINDS.get(lib.ggml_backend_dev_type(dev), "other"),
                    memory_free=free.value,
                    memory_total=total.value,
                )
            )
    except AttributeError:  # an older ggml without these entry points
        pass
    return BuildInfo(
        llama_cpp_python=getattr(llama_cpp, "__version__", "unknown"),
        ggml_version=ggml_version,
        ggml_commit=ggml_commit,
        system_info=lc.llama_print_system_info().decode("utf-8", errors="replace"),
        devices=tuple(devices),
        gpu_offload=local_gpu_offload(),
        library=Path(lib._name),
    )


# --- the repack guard -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RepackPolicy:
    """Whether models load with llama.cpp's extra (repacking) buffer types, and why."""

    use_extra_bufts: bool
    reason: str
    warning: str | None = None


def build_key(info: BuildInfo) -> str:
    """Identifies the exact build: the library files' names, sizes and modification times."""
    h = hashlib.sha256(info.llama_cpp_python.encode())
    for f in (
        sorted(info.library.parent.glob("*.so*"))
        + sorted(info.library.parent.glob("*.dylib"))
        + sorted(info.library.parent.glob("*.dll"))
    ):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


@functools.cache
def repack_policy() -> RepackPolicy:
    """Decide ``use_extra_bufts`` for this build on this machine.

    ``SPECGGUF_REPACK=0`` or ``1`` forces the answer. Otherwise a build without the AMX
    kernels repacks (llama.cpp's default); a build with them is probed once in a child
    process (cached in ``~/.cache/specgguf/repack-probe.json`` per build) and repacks only
    when the probe survived.

    Raises:
        BackendError: llama-cpp-python cannot be imported.
    """
    env = os.environ.get("SPECGGUF_REPACK")
    if env in ("0", "1"):
        return RepackPolicy(env == "1", f"SPECGGUF_REPACK={env}")
    info = build_info()
    if not info.has_amx:
        return RepackPolicy(True, "build without AMX kernels")
    key = build_key(info)
    cache = cache_dir() / "repack-probe.json"
    verdict = read_json_cache(cache).get(key)
    if verdict is None:
        from specgguf.llama.child import run_child

        res = run_child("probe-repack", env={"SPECGGUF_REPACK": "1"})
        verdict = "ok" if res.ok else res.failure
        update_json_cache(cache, key, verdict)
    if verdict == "ok":
        return RepackPolicy(True, "AMX build, probe passed")
    return RepackPolicy(
        False,
        f"AMX build, probe {verdict}",
        warning=(
            "this llama.cpp build's AMX kernels crash on this machine "
            f"({verdict}); loading with weight repacking off, which is slower. "
            "Reinstall with scripts/install for a build that keeps repacking."
        ),
    )


def platform_summary() -> dict[str, Any]:
    """OS, CPU and memory facts for reports (doctor, bench)."""
    import psutil

    vm = psutil.virtual_memory()
    flags = read_cpu_flags()
    interesting = [
        f
        for f in ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16",
                  "amx_tile", "amx_int8", "amx_bf16", "neon", "asimd", "sve")
        if f in flags
    ]  # fmt: skip
    return {
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cpu_count_logical": psutil.cpu_count(logical=True),
        "cpu_count_physical": psutil.cpu_count(logical=False),
        "cpu_flags": interesting,
        "ram_total": vm.total,
        "ram_available": vm.available,
        "python": platform.python_version(),
    }
