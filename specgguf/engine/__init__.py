"""The engine: one configuration (:mod:`.config`), checks before loading
(:mod:`.preflight`), chat prompts (:mod:`.chat`), drafters by name (:mod:`.drafter_map`),
loading and starting generations (:mod:`.engine`), timing calibration
(:mod:`.calibration`) and the benchmark (:mod:`.bench`). The command line and a server are
faces over this package."""

from specgguf.engine.chat import ChatMessage, PreparedPrompt, render_prompt
from specgguf.engine.config import EngineConfig, ModelConfig, SpeculativeConfig
from specgguf.engine.drafter_map import DRAFTERS, drafter_kinds
from specgguf.engine.engine import Engine, Prompt
from specgguf.engine.preflight import Preflight, preflight

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
