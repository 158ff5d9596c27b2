"""The engine: one configuration (:mod:`.config`), checks before loading
(:mod:`.preflight`), chat prompts (:mod:`.chat`), drafters by name (:mod:`.drafter_map`),
loading and starting generations (:mod:`.engine`) and timing calibration
(:mod:`.calibration`). The command line, a server and the measuring instruments
(:mod:`specgguf.measure`: the benchmark, the simulator) are over this package.

The loop's names are imported on first use (``from specgguf.engine import Engine``): a
command that reads only the configuration or plans does not import llama.cpp's context
wrapper, the loop or llguidance."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# (the configuration and the checks before loading now: ``preflight`` is also a module's
# name, which a later import of that module would otherwise bind here)
from specgguf.engine.config import EngineConfig, ModelConfig, SpeculativeConfig
from specgguf.engine.drafter_map import DRAFTERS, drafter_kinds
from specgguf.engine.preflight import Preflight, preflight

if TYPE_CHECKING:
    from specgguf.engine.chat import ChatMessage, PreparedPrompt, render_prompt
    from specgguf.engine.engine import Engine, Prompt

#: Each name imported on first use -> the module that defines it.
_WHERE = {
    "ChatMessage": "chat", "PreparedPrompt": "chat", "render_prompt": "chat",
    "Engine": "engine", "Prompt": "engine",
}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DRAFTERS",
    "ChatMessage",
    "Engine",
    "EngineConfig",
    "ModelConfig",
    "Preflight",
    "PreparedPrompt",
    "Prompt",
    "SpeculativeConfig",
    "drafter_kinds",
    "preflight",
    "render_prompt",
]
