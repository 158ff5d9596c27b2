"""``specgguf doctor``: what this installation runs on, and a smoke test that generates.

The report names the llama-cpp-python and llama.cpp versions, the backends compiled in,
whether layers can be offloaded to a GPU, the CPU features, RAM and device memory, and the
weight-repacking decision (see :mod:`specgguf.runtime`). The smoke test writes a tiny GGUF
model, loads it with the settings ``run`` would use, and generates a few tokens, in a child
process so that a crashing build is reported instead of taking the caller down.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from specgguf.runtime import build_info, platform_summary, repack_policy

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
    """Generate ``n_tokens`` greedy tokens from a tiny model in a child process.

    Never raises for a failing build: a crash or error is reported in the result.
    """
    t0 = time.perf_counter()
    try:
        res = subprocess.run(
            [sys.executable, "-m", "specgguf.doctor", "--smoke-child", str(n_tokens)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return SmokeResult(False, 0, timeout, f"timed out after {timeout:.0f} s")
    dt = time.perf_counter() - t0
    if res.returncode == 0:
        try:
            data = json.loads(res.stdout.strip().splitlines()[-1])
            return SmokeResult(True, int(data["tokens"]), dt, data["detail"])
        except (ValueError, KeyError, IndexError):
            return SmokeResult(False, 0, dt, f"unexpected output: {res.stdout[-200:]!r}")
    if res.returncode < 0:
        import signal

        try:
            sig = signal.Signals(-res.returncode).name
        except ValueError:
            sig = f"signal {-res.returncode}"
        return SmokeResult(False, 0, dt, f"the child process crashed with {sig}")
    last = (res.stderr.strip().splitlines() or ["no output"])[-1]
    return SmokeResult(False, 0, dt, f"exit code {res.returncode}: {last}")


def _smoke_child(n_tokens: int) -> int:
    from specgguf.backend import LlamaModel
    from specgguf.tinymodels import TinySpec, gpt2_vocab, write_tiny_model

    with tempfile.TemporaryDirectory(prefix="specgguf-smoke-") as tmp:
        path = Path(tmp) / "smoke.gguf"
        write_tiny_model(path, TinySpec(vocab=gpt2_vocab(), name="smoke"))
        with LlamaModel(path) as model, model.new_context(n_ctx=128, n_batch=32) as ctx:
            logits = ctx.eval(model.tokenize("def add(a, b):"), logits="last")
            out = []
            for _ in range(n_tokens):
                tok = int(logits[-1].argmax())
                out.append(tok)
                logits = ctx.eval([tok], logits="last")
            repack = "on" if model.use_extra_bufts else "off"
    detail = f"generated {len(out)} tokens, weight repacking {repack}"
    print(json.dumps({"tokens": len(out), "detail": detail}))
    return 0


def report(smoke: bool = True) -> dict[str, Any]:
    """Everything ``doctor`` shows, as a JSON-able dict.

    Raises:
        BackendError: llama-cpp-python cannot be imported.
    """
    import specgguf
    from specgguf.buildconfig import detect_backend

    info = build_info()
    policy = repack_policy()
    machine_backend = detect_backend()
    compiled = {b.lower() for b in info.backends}
    names = {"cuda": "CUDA", "metal": "Metal", "rocm": "ROCm", "vulkan": "Vulkan", "cpu": "CPU"}
    out: dict[str, Any] = {
        "specgguf": specgguf.__version__,
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
        "build_matches_machine": machine_backend == "cpu"
        or bool(compiled & {machine_backend, "hip" if machine_backend == "rocm" else ""}),
        "env": {k: os.environ[k] for k in ("CMAKE_ARGS", "SPECGGUF_REPACK") if k in os.environ},
    }  # fmt: skip
    if policy.warning:
        out["warning"] = policy.warning
    if smoke:
        out["smoke_test"] = dataclasses.asdict(smoke_test())
    return out


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--smoke-child":
        sys.exit(_smoke_child(int(sys.argv[2])))
    print("usage: python -m specgguf.doctor --smoke-child N", file=sys.stderr)
    sys.exit(2)
