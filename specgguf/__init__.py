"""specgguf: speculative decoding for llama.cpp GGUF models.

A small draft model (or n-gram lookup in the text so far) proposes tokens; the large target
model verifies them in one batched forward pass; the longest agreeing prefix is kept, plus
one token from the target. Greedy output is exactly the target's; sampled output keeps the
target's distribution by modified rejection sampling (Leviathan et al. 2023; Chen et al. 2023).

Use from Python::

    from specgguf import Engine, EngineConfig, GenerationParams, ModelConfig, SamplerParams

    config = EngineConfig(ModelConfig("target.gguf"), ModelConfig("draft.gguf"))
    with Engine(config) as engine:
        gen = engine.generate([{"role": "user", "content": "Hi"}],
                              GenerationParams(n_predict=64, sampler=SamplerParams(temperature=0)))
        for piece in gen:
            print(piece, end="", flush=True)
        print(gen.result.stats.tokens_per_s)

The names below are imported on first use, so that ``import specgguf`` stays cheap (the
installer imports :mod:`specgguf.llama.buildconfig` before numpy or llama.cpp exist).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from specgguf.version import __version__

#: Public name -> the module that defines it.
_EXPORTS = {
    "Engine": "specgguf.engine.engine",
    "EngineConfig": "specgguf.engine.config",
    "ModelConfig": "specgguf.engine.config",
    "SpeculativeConfig": "specgguf.engine.config",
    "Generation": "specgguf.speculative.loop",
    "GenerationParams": "specgguf.speculative.loop",
    "GenerationResult": "specgguf.speculative.loop",
    "GenerationStats": "specgguf.speculative.loop",
    "GrammarSpec": "specgguf.speculative.grammar",
    "SamplerParams": "specgguf.speculative.sampling",
    "SpecggufError": "specgguf.errors",
}

__all__ = [
    "Engine",
    "EngineConfig",
    "Generation",
    "GenerationParams",
    "GenerationResult",
    "GenerationStats",
    "GrammarSpec",
    "ModelConfig",
    "SamplerParams",
    "SpecggufError",
    "SpeculativeConfig",
    "__version__",
]

if TYPE_CHECKING:
    from specgguf.engine.config import EngineConfig, ModelConfig, SpeculativeConfig
    from specgguf.engine.engine import Engine
    from specgguf.errors import SpecggufError
    from specgguf.speculative.grammar import GrammarSpec
    from specgguf.speculative.loop import (
        Generation,
        GenerationParams,
        GenerationResult,
        GenerationStats,
    )
    from specgguf.speculative.sampling import SamplerParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specgguf' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
