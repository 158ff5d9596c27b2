"""``specgguf doctor``: what this installation runs on, and a smoke test that generates.

The report names the llama-cpp-python and llama.cpp versions, the backends compiled in,
whether layers can be offloaded to a GPU, the CPU features, RAM and device memory, and the
weight-repacking decision (see :mod:`specgguf.llama.runtime`), and whether the build
has llama.cpp's RPC backend and an ``rpc-server`` to go with it
(:mod:`specgguf.llama.rpc`). The smoke test writes a tiny GGUF
model, loads it with the settings ``run`` would use, and generates a few tokens, in a child
process (:mod:`specgguf.llama.child`) so that a crashing build is reported instead of
taking the caller down.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from specgguf.llama.child import run_child
from specgguf.llama.runtime import build_info, platform_summary, repack_policy

#: How to install llama-cpp-python for each backend (also in the README).
INSTALL_HINTS = {
    "CPU": "scripts/install (detects the CPU; AMX is left out where it crashes)",
    "CUDA": 'scripts/install --backend cuda  (CMAKE_ARGS="-DGGML_CUDA=on")',
    "Metal": 'scripts/install --backend metal  (CMAKE_ARGS="-DGGML_METAL=on", default on macOS)',
    "ROCm": 'scripts/install --backend rocm  (CMAKE_ARGS="-DGGML_HIP=on")',
    "Vulkan": 'scripts/install --backend vulkan  (CMAKE_ARGS="-DGGML_VULKAN=on")',
}


@dataclasses.dataclass(frozen=True)
class SmokeResult:
    """Outcome of the smoke test: ``ok``, tokens generated, wall seconds, detail."""

    ok: bool
    tokens: int
    seconds: float
    detail: str


def smoke_test(n_tokens: int = 8, timeout: float = 300.0) -> SmokeResult:
    """Generate ``n_tokens`` greedy tokens from a tiny model in a child process
    (:func:`specgguf.llama.child.run_child`).

    Never raises for a failing build: a crash or error is reported in the result.
    """
    res = run_child("smoke", str(n_tokens), timeout=timeout)
    if not res.ok:
        return SmokeResult(False, 0, res.seconds, res.failure)
    return SmokeResult(
        True, int(res.data.get("tokens", 0)), res.seconds, str(res.data.get("detail"))
    )


def report(smoke: bool = True) -> dict[str, Any]:
    """Everything ``doctor`` shows, as a JSON-able dict.

    Raises:
        BackendError: llama-cpp-python cannot be imported.
    """
    from specgguf.llama import rpc
    from specgguf.llama.buildconfig import detect_backend
    from specgguf.version import __version__

    info = build_info()
    policy = repack_policy()
    machine_backend = detect_backend()
    compiled = {b.lower() for b in info.backends}
    names = {"cuda": "CUDA", "metal": "Metal", "rocm": "ROCm", "vulkan": "Vulkan", "cpu": "CPU"}
    out: dict[str, Any] = {
        "specgguf": __version__,
        "llama_cpp_python": info.llama_cpp_python,
        "ggml_version": info.ggml_version,
        "ggml_commit": info.ggml_commit,
        "library": str(info.library),
        "backends": info.backends,
        "gpu_offload": info.gpu_offload,
        "devices": [dataclasses.asdict(d) for d in info.devices],
        "build_features": info.features,
        "amx_compiled": info.has_amx,
        "weight_repacking": policy.use_extra_bufts,
        "weight_repacking_reason": policy.reason,
        "platform": platform_summary(),
        "machine_backend": machine_backend,
        "install_hint": INSTALL_HINTS[names[machine_backend]],
        "rpc": {"supported": rpc.supported(),
                "server": str(server) if (server := rpc.server_binary()) else None},
        "build_matches_machine": machine_backend == "cpu"
        or bool(compiled & {machine_backend, "hip" if machine_backend == "rocm" else ""}),
        "env": {k: os.environ[k] for k in ("CMAKE_ARGS", "SPECGGUF_REPACK") if k in os.environ},
    }  # fmt: skip
    if policy.warning:
        out["warning"] = policy.warning
    if smoke:
        out["smoke_test"] = dataclasses.asdict(smoke_test())
    return out
