"""Everything ``run`` settles before any weights load: the prompt text, the chat template,
the vocabulary check, and whether the models fit in memory."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TextIO

from specgguf.chat import render_chat
from specgguf.errors import IncompatibleVocabError, UsageError
from specgguf.memory import (
    ModelMemory,
    check_device_fits,
    check_fits,
    model_memory,
    offloaded_bytes,
)
from specgguf.modelinfo import ModelInfo, read_model_info
from specgguf.vocab import CompatReport, check_compatibility


def read_prompt(prompt: str | None, file: Path | None, stdin: TextIO | None = None) -> str:
    """The prompt text: the argument, ``-f FILE``, or standard input (``-``, or no
    argument while stdin is not a terminal). Never waits on a terminal.

    Raises:
        UsageError: no prompt given, or two given, an empty (or blank) prompt, or the file
        cannot be read.
    """
    text = _read_prompt(prompt, file, stdin)
    if not text.strip():
        raise UsageError("the prompt is empty: give the text to continue or answer")
    return text


def _read_prompt(prompt: str | None, file: Path | None, stdin: TextIO | None) -> str:
    stdin = stdin or sys.stdin
    if prompt is not None and file is not None:
        raise UsageError("give the prompt as an argument or with -f/--file, not both")
    if file is not None:
        try:
            return file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read the prompt file {file}: {e}") from None
    if prompt == "-" or (prompt is None and not stdin.isatty()):
        return stdin.read()
    if prompt is None:
        raise UsageError("no prompt: give it as an argument, with -f FILE, or on standard input")
    return prompt


@dataclasses.dataclass(frozen=True)
class PreparedPrompt:
    """The text to tokenize, and whether tokenization adds the model's BOS itself."""

    text: str
    add_special: bool
    templated: bool


def prepare_prompt(
    info: ModelInfo, prompt: str, *, system: str | None = None, raw: bool = False
) -> PreparedPrompt:
    """Wrap ``prompt`` as a user message with the target's chat template (when it has one
    and ``raw`` is False). When the rendered text already starts with the BOS token's text,
    tokenization does not add another.

    Raises:
        ChatTemplateError: the template cannot be rendered.
        UsageError: ``--system`` without a chat template to put it in.
    """
    template = info.template
    if raw or template is None:
        if system is not None and not raw:
            raise UsageError(f"{info.path.name} has no chat template for a --system message")
        return PreparedPrompt(prompt, add_special=True, templated=False)
    v = info.vocab
    bos = v.text(v.bos) or ""
    text = render_chat(
        template, prompt, system=system, bos_token=bos, eos_token=v.text(v.eos) or ""
    )
    add_special = not (bos and v.add_bos and text.startswith(bos))
    return PreparedPrompt(text, add_special=add_special, templated=True)


@dataclasses.dataclass(frozen=True)
class Preflight:
    """What was found before loading: model facts, the vocabulary report (None without a
    draft model or with ``--no-check``), and the memory estimate (bytes)."""

    target: ModelInfo
    draft: ModelInfo | None
    compat: CompatReport | None
    memory: list[ModelMemory]
    memory_needed: int
    n_ctx: int


def preflight(
    target: Path,
    draft: Path | None,
    *,
    n_ctx: int,
    n_ctx_draft: int | None = None,
    check_vocab: bool = True,
    check_memory: bool = True,
    n_gpu_layers: int = -1,
    n_gpu_layers_draft: int = -1,
) -> Preflight:
    """Read both models' metadata, check the vocabularies and the memory estimate.

    Raises:
        ModelNotFoundError, GGUFFormatError: a model file is missing or unreadable.
        IncompatibleVocabError: the draft cannot draft for the target (``check_vocab``).
        InsufficientMemoryError: the models clearly do not fit (``check_memory``).

    ``n_ctx`` 0 means the target's training context length.
    """
    t_info = read_model_info(target)
    d_info = read_model_info(draft) if draft is not None else None
    compat = None
    if draft is not None and check_vocab:
        compat = check_compatibility(target, draft)
        if not compat.compatible:
            raise IncompatibleVocabError(
                [f.message for f in compat.errors], target=target, draft=draft
            )
    n_ctx = n_ctx or t_info.context_length or 4096  # 0: the model's training context
    parts = [model_memory(t_info, n_ctx=n_ctx)]
    if d_info is not None:
        parts.append(model_memory(d_info, n_ctx=n_ctx_draft or n_ctx))
    needed = check_fits(parts) if check_memory else sum(p.total for p in parts)
    if check_memory:
        _check_device(parts, [t_info, d_info], [n_gpu_layers, n_gpu_layers_draft])
    return Preflight(t_info, d_info, compat, parts, needed, n_ctx)


def _check_device(parts: list[ModelMemory], infos: list[ModelInfo | None], ngls: list[int]) -> None:
    """Device memory, where this build offloads to a GPU (skipped on CPU-only builds)."""
    from specgguf.runtime import build_info

    info = build_info()
    gpus = [d for d in info.devices if d.kind == "gpu"]
    if not info.gpu_offload or not gpus:
        return
    offloaded = [
        (part.name, offloaded_bytes(part, ngl, mi.block_count or 0))
        for part, mi, ngl in zip(parts, infos, ngls, strict=False)
        if mi is not None
    ]
    check_device_fits(offloaded, sum(d.memory_free for d in gpus))
