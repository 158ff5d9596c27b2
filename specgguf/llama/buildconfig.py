"""Which llama.cpp build suits this machine: backend detection and ``CMAKE_ARGS``.

Standard library only: ``scripts/install`` imports this module before anything else is
installed. ``doctor`` uses it to tell a user which install command fits their machine.

The rules:

- backend: ``metal`` on Apple silicon; ``cuda`` when ``nvidia-smi -L`` lists a GPU (a CUDA
  compiler alone, without a GPU, is not enough); ``rocm`` when ``rocminfo`` lists a gfx
  agent; ``vulkan`` only when asked; otherwise ``cpu``.
- RPC: every build has ggml's RPC backend (``-DGGML_RPC=ON``, also added to a
  ``CMAKE_ARGS`` given by a user unless it sets ``GGML_RPC``): it costs nothing unused,
  and it is what ``--rpc`` and ``specgguf rpc-server`` need.
- CPU flags: on x86-64 CPUs that report AMX (``amx_int8`` in /proc/cpuinfo), a native build
  compiles llama.cpp's AMX kernels, which crash at the first decode on some such machines
  (seen in VMs: a segmentation fault in ``ggml_backend_amx_mul_mat``). There the build
  turns ``GGML_NATIVE`` off and names every instruction-set extension the CPU reports
  except AMX, so the AVX-512/AVX2 repacked kernels stay. Elsewhere ``GGML_NATIVE`` (the
  default) stays on. The same CPU flags apply with a GPU backend, since layers that are
  not offloaded run on the CPU.
"""

from __future__ import annotations

import hashlib
import platform
import shutil
import subprocess
import sys

BACKENDS = ("cpu", "cuda", "metal", "rocm", "vulkan")

#: ggml's RPC backend, in every build (llama.cpp's ``--rpc``; ``specgguf rpc-server``).
RPC_CMAKE_ARG = "-DGGML_RPC=ON"

#: (cpuinfo flag, ggml CMake option), in ggml's order.
_X86_FEATURES = (
    ("sse4_2", "GGML_SSE42"),
    ("avx", "GGML_AVX"),
    ("avx_vnni", "GGML_AVX_VNNI"),
    ("avx2", "GGML_AVX2"),
    ("bmi2", "GGML_BMI2"),
    ("fma", "GGML_FMA"),
    ("f16c", "GGML_F16C"),
    ("avx512f", "GGML_AVX512"),
    ("avx512vbmi", "GGML_AVX512_VBMI"),
    ("avx512_vnni", "GGML_AVX512_VNNI"),
    ("avx512_bf16", "GGML_AVX512_BF16"),
)


def cpuinfo() -> dict[str, str]:
    """The fields of the first processor in ``/proc/cpuinfo`` (``flags`` or, on Arm,
    ``Features``; ``model name``); empty on systems without it."""
    out: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    if out:
                        break  # the first processor is enough
                    continue
                key, _, value = line.partition(":")
                out.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return out


def read_cpu_flags() -> frozenset[str]:
    """The CPU feature flags the kernel reports, empty where unknown."""
    info = cpuinfo()
    return frozenset((info.get("flags") or info.get("Features") or "").split())


def cpu_model() -> str:
    """The CPU's model name, e.g. ``AMD EPYC``."""
    return cpuinfo().get("model name") or platform.processor() or platform.machine()


def _lists_device(cmd: list[str], needle: str) -> bool:
    exe = shutil.which(cmd[0])
    if exe is None:
        return False
    try:
        res = subprocess.run(
            [exe, *cmd[1:]], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return res.returncode == 0 and needle in res.stdout


def detect_backend() -> str:
    """The GPU backend this machine can use, or ``cpu``."""
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return "metal"
    if _lists_device(["nvidia-smi", "-L"], "GPU "):
        return "cuda"
    if _lists_device(["rocminfo"], "gfx"):
        return "rocm"
    return "cpu"


def cpu_cmake_args(flags: frozenset[str], machine: str | None = None) -> list[str]:
    """CPU options for this machine: ``[]`` (native build) unless the CPU reports AMX on
    x86-64, where AMX is left out and every other extension is named."""
    machine = machine or platform.machine()
    if machine.lower() not in ("x86_64", "amd64") or "amx_int8" not in flags:
        return []
    args = ["-DGGML_NATIVE=OFF"]
    args += [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in _X86_FEATURES]
    args += ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return args


def cmake_args(backend: str, flags: frozenset[str], machine: str | None = None) -> list[str]:
    """The whole ``CMAKE_ARGS`` for ``backend`` on a CPU with ``flags``.

    Raises:
        ValueError: an unknown backend.
    """
    gpu = {
        "cpu": [],
        "cuda": ["-DGGML_CUDA=on"],
        "metal": ["-DGGML_METAL=on"],
        "rocm": ["-DGGML_HIP=on"],
        "vulkan": ["-DGGML_VULKAN=on"],
    }
    if backend not in gpu:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    # The RPC backend (ggml-rpc) lets a target's layers live on other machines' rpc-server
    # processes; it costs nothing when unused, so every build has it. llama-cpp-python's
    # default LLAVA_BUILD=ON builds libmtmd, the multimodal library (--mmproj).
    return [*gpu[backend], *cpu_cmake_args(flags, machine), RPC_CMAKE_ARG]


def with_rpc(args: str) -> str:
    """``CMAKE_ARGS`` given by a user, with the RPC backend added unless they set
    ``GGML_RPC`` themselves (on or off)."""
    if "GGML_RPC" in args:
        return args
    return f"{args} {RPC_CMAKE_ARG}".strip()


def build_key(version: str, args: str) -> str:
    """A name for one build: the llama-cpp-python version, the CMAKE_ARGS, the Python and
    the platform (wheels are only reused where all four match)."""
    tag = f"{version}|{args}|{sys.implementation.cache_tag}|{platform.machine()}|{sys.platform}"
    return f"{version}-{hashlib.sha256(tag.encode()).hexdigest()[:12]}"
