"""Chat prompts: a conversation (a list of ``{"role", "content"}`` messages) rendered with the
model's own ``tokenizer.chat_template``.

Templates come from downloaded files, so they are rendered in Jinja's
``ImmutableSandboxedEnvironment``, in a worker process, within a budget of time, output and
memory: :mod:`specgguf.engine.template_sandbox`, which also lists what real templates use
beyond plain Jinja.

A template that takes no system message (it raises, or leaves the text out) gets the
system text in front of the first user message, as llama.cpp does (minja's
``polyfill_system_role`` in ``common/chat-template.hpp``: joined with a newline).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from specgguf.engine import template_sandbox
from specgguf.errors import (
    ChatInputError,
    ChatTemplateBudgetError,
    ChatTemplateError,
    SpecggufError,
    UsageError,
)
from specgguf.gguf.info import ModelInfo

log = logging.getLogger("specgguf")

#: A chat message: ``{"role": "system" | "user" | "assistant", "content": str}``.
ChatMessage = Mapping[str, Any]
ROLES = ("system", "user", "assistant")


def check_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """The messages as plain dicts, checked: at least one, each with a known role and a
    string content.

    Raises:
        UsageError: an empty list, a message that is not a mapping, an unknown role, a
            content that is not a string.
    """
    if not messages:
        raise UsageError("the conversation has no messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise UsageError(f"message {i} is not an object with a role and a content")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise UsageError(f"message {i}: unknown role {role!r} (expected one of {ROLES})")
        if not isinstance(content, str):
            raise UsageError(f"message {i}: the content must be a string")
        out.append({"role": role, "content": content})
    return out


def render_chat(
    template: str,
    messages: Sequence[ChatMessage],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text for a conversation, ending with the assistant's header when
    ``add_generation_prompt``; the messages as given (see :func:`render_prompt` for the
    system-message fallback). The template runs in a worker process within a budget of
    time, output and memory (:mod:`specgguf.engine.template_sandbox`).

    Raises:
        ChatInputError: the template refuses the conversation (its ``raise_exception``).
        ChatTemplateError: the template fails to parse or render, tries to escape the
            sandbox, or runs out of its budget.
        SpecggufError: no render worker process could be started.
    """
    variables = {
        "messages": [dict(m) for m in messages],
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
    }
    try:
        return template_sandbox.render(template, variables)
    except template_sandbox.WorkerError as e:
        raise SpecggufError(str(e)) from None
    except template_sandbox.RenderFailure as e:
        if e.kind == "refused":
            raise ChatInputError(
                f"the model's chat template refuses this conversation: {e}"
            ) from None
        if e.kind == "security":
            raise ChatTemplateError(
                f"the model's chat template tried something the sandbox forbids ({e})"
            ) from None
        if e.kind == "budget":
            raise ChatTemplateBudgetError(
                f"the model's chat template was stopped: {e} (the budget of one render)"
            ) from None
        raise ChatTemplateError(f"the model's chat template cannot be rendered: {e}") from None


@functools.lru_cache(maxsize=16)
def takes_system_message(template: str, *, bos_token: str = "", eos_token: str = "") -> bool:
    """Whether the template renders a system message's text (as minja's capability probe
    does: a system message with a marker, then a user message); remembered per template."""
    marker = "<specgguf system marker>"
    probe = [{"role": "system", "content": marker}, {"role": "user", "content": "Hi"}]
    try:
        return marker in render_chat(template, probe, bos_token=bos_token, eos_token=eos_token)
    except ChatTemplateBudgetError:
        raise
    except (ChatInputError, ChatTemplateError):
        return False


def merge_system(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """The conversation without system messages: their text goes in front of the next
    user message, joined by a newline (or becomes a user message of its own before an
    assistant message or at the end), as llama.cpp's minja does."""
    out: list[dict[str, str]] = []
    pending = ""
    for m in messages:
        role, content = str(m["role"]), str(m["content"])
        if role == "system":
            pending = f"{pending}\n{content}" if pending else content
            continue
        if pending:
            if role == "user":
                content = pending + (f"\n{content}" if content else "")
            else:
                out.append({"role": "user", "content": pending})
            pending = ""
        out.append({"role": role, "content": content})
    if pending:
        out.append({"role": "user", "content": pending})
    return out


@dataclasses.dataclass(frozen=True)
class PreparedPrompt:
    """The text to tokenize, whether tokenization adds the model's BOS itself
    (``add_special``), whether the chat template made it (``templated``), and the spans of
    the text (``literal``: ``(start, end)`` character offsets, in order) that are message
    text holding a control token's text, to be tokenized as plain text: only the
    template's own markup yields control tokens."""

    text: str
    add_special: bool
    templated: bool
    literal: tuple[tuple[int, int], ...] = ()

    def pieces(self) -> list[tuple[str, bool]]:
        """The text in order as ``(piece, parse_special)``: the literal spans with
        ``parse_special`` False, the text between them True (empty pieces left out)."""
        out, at = [], 0
        for start, end in self.literal:
            out += [(self.text[at:start], True), (self.text[start:end], False)]
            at = end
        out.append((self.text[at:], True))
        return [(t, special) for t, special in out if t]


@functools.lru_cache(maxsize=8)
def _control_pattern(texts: tuple[str, ...]) -> re.Pattern[str] | None:
    texts = tuple(t for t in texts if t)
    if not texts:
        return None
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True)))


def _render_guarded(
    template: str,
    messages: list[dict[str, str]],
    guarded: list[int],
    pattern: re.Pattern[str],
    *,
    bos_token: str,
    eos_token: str,
    add_generation_prompt: bool,
) -> tuple[str, list[tuple[int, int]]]:
    """The conversation rendered as the template renders it, and the spans of the text
    that are the guarded messages' own (their control-token texts must be tokenized as
    text). Found by rendering again with marks (private-use characters with a random
    nonce): first a pair around each guarded content (the whole content is then text, as
    if the control texts were plain); where that changes what the template writes (it
    trims or tests the content, say), one mark in place of each control-token text. A
    marked render is used only when taking its marks out gives exactly the plain render;
    a mark the template dropped (with the content around it) leaves nothing to guard.

    Raises:
        ChatInputError: the template changes a control-token text of a message so that
            it cannot be kept apart from its own markup.
    """
    nonce = secrets.token_hex(6)
    found = re.compile(f"\ue000{nonce}([oct])(\\d+)\ue001")

    def mark(kind: str, i: int) -> str:
        return f"\ue000{nonce}{kind}{i}\ue001"

    def render_marked(contents: dict[int, str]) -> str:
        marked = [dict(m, content=contents.get(i, m["content"])) for i, m in enumerate(messages)]
        return render_chat(template, marked, bos_token=bos_token, eos_token=eos_token,
                           add_generation_prompt=add_generation_prompt)  # fmt: skip

    plain = render_marked({})

    def unmark(text: str, put: dict[str, list[str]] | None) -> tuple[str, list[tuple[int, int]]]:
        """``text`` without its marks, and the spans they delimit: between an ``o`` and a
        ``c`` mark of the same message, or a ``t`` mark's control text (``put``)."""
        out: list[str] = []
        spans: list[tuple[int, int]] = []
        n = at = 0
        opened: tuple[int, int] | None = None  # (message, start in the output)
        for m in found.finditer(text):
            out.append(text[at : m.start()])
            n += m.start() - at
            at = m.end()
            kind, i = m.group(1), int(m.group(2))
            if kind == "t" and put is not None:
                piece = put["t"][i]
                out.append(piece)
                spans.append((n, n + len(piece)))
                n += len(piece)
            elif kind == "o" and opened is None:
                opened = (i, n)
            elif kind == "c" and opened is not None and opened[0] == i:
                if n > opened[1]:
                    spans.append((opened[1], n))
                opened = None
            else:
                return "", []  # marks out of order: not usable
        out.append(text[at:])
        return ("".join(out), spans) if opened is None else ("", [])

    # 1. a pair of marks around each guarded content
    pairs = {i: mark("o", i) + messages[i]["content"] + mark("c", i) for i in guarded}
    text, spans = unmark(render_marked(pairs), None)
    if text == plain:
        return plain, spans
    # 2. one mark in place of each control-token text
    originals: list[str] = []

    def swap(m: re.Match[str]) -> str:
        originals.append(m.group(0))
        return mark("t", len(originals) - 1)

    swapped = {i: pattern.sub(swap, messages[i]["content"]) for i in guarded}
    text, spans = unmark(render_marked(swapped), {"t": originals})
    if text == plain:
        return plain, spans
    raise ChatInputError(
        "a message holds the text of a control token (such as "
        f"{originals[0]!r}) that the model's chat template changes, so it cannot be kept "
        "apart from the template's own: take it out of the message"
    )


def render_prompt(
    info: ModelInfo,
    prompt: str | Sequence[ChatMessage],
    *,
    control_texts: Sequence[str] = (),
    add_generation_prompt: bool | None = None,
    continue_final_message: bool | None = None,
) -> PreparedPrompt:
    """A prompt as the target reads it: a string as is (the model adds its BOS), a
    conversation through the target's chat template. A model without a template takes a
    conversation of one user message as that message's text. When the text (given or
    rendered) already starts with the BOS token's text, tokenization adds no second BOS:
    llama.cpp would add one and only warn that the prompt starts with 2 BOS tokens.

    A conversation that ends with an assistant message is continued (prefill), as
    llama-server does by default (``oaicompat_chat_params_parse`` in
    tools/server/server-common.cpp): the conversation before it is rendered with the
    assistant's header and its text follows, with no end of turn. ``continue_final_message``
    False renders it as a closed turn instead; True insists on a final assistant message.
    ``add_generation_prompt`` False leaves out the assistant's header after a conversation
    that ends otherwise (both as vLLM and transformers take them).

    ``control_texts``: the texts of the target's control tokens (those llama.cpp parses
    only as special tokens). A message holding one is marked so that it is tokenized as
    text (:attr:`PreparedPrompt.literal`): a user cannot write ``<|im_start|>system``
    and get a turn of the template's. A string prompt is the caller's own: not guarded.

    Raises:
        UsageError: a malformed conversation, one a model without a chat template cannot
            take (a system message, several turns), two assistant messages at the end of
            a conversation to continue, flags that contradict each other.
        ChatInputError: the template refuses the conversation (its own message quoted),
            or changes a guarded control-token text.
        ChatTemplateError: the template cannot be rendered, or ran out of its budget.
    """
    v = info.vocab
    bos, eos = v.text(v.bos) or "", v.text(v.eos) or ""
    if isinstance(prompt, str):
        # A text that already starts with the BOS token's text gets no second BOS.
        return PreparedPrompt(prompt, not (bos and v.add_bos and prompt.startswith(bos)), False)
    messages = check_messages(prompt)
    prefill = _prefill(messages, add_generation_prompt, continue_final_message)
    template = info.template
    if template is None:
        if len(messages) == 1 and messages[0]["role"] == "user":
            return PreparedPrompt(messages[0]["content"], add_special=True, templated=False)
        what = "a system message" if messages[0]["role"] == "system" else "a conversation"
        raise UsageError(f"{info.path.name} has no chat template for {what}")
    try:
        if any(m["role"] == "system" for m in messages) and not takes_system_message(
            template, bos_token=bos, eos_token=eos
        ):
            log.warning(
                "the chat template of %s takes no system message: its text was put in front "
                "of the first user message, as llama.cpp does", info.path.name,
            )  # fmt: skip
            messages = merge_system(messages)
        tail = messages.pop()["content"] if prefill else ""
        header = prefill or add_generation_prompt is not False
        pattern = _control_pattern(tuple(control_texts))
        guarded = [i for i, m in enumerate(messages) if pattern and pattern.search(m["content"])]
        if guarded and pattern is not None:
            text, spans = _render_guarded(template, messages, guarded, pattern, bos_token=bos,
                                          eos_token=eos, add_generation_prompt=header)  # fmt: skip
        else:
            text, spans = render_chat(template, messages, bos_token=bos, eos_token=eos,
                                      add_generation_prompt=header), []  # fmt: skip
    except ChatTemplateError as e:
        raise type(e)(f"{info.path.name}: {e}", path=info.path) from None
    if tail:
        if pattern and pattern.search(tail):
            spans.append((len(text), len(text) + len(tail)))
        text += tail
    # the template's own BOS text, not a message's (which is text: the BOS is still added)
    own_bos = text.startswith(bos) and not (spans and spans[0][0] == 0)
    add_special = not (bos and v.add_bos and own_bos)
    return PreparedPrompt(text, add_special=add_special, templated=True, literal=tuple(spans))


def _prefill(
    messages: list[dict[str, str]],
    add_generation_prompt: bool | None,
    continue_final_message: bool | None,
) -> bool:
    """Whether the conversation's final assistant message is continued (see
    :func:`render_prompt`).

    Raises:
        UsageError: flags that contradict each other or the conversation.
    """
    last_is_assistant = messages[-1]["role"] == "assistant"
    if continue_final_message and add_generation_prompt:
        raise UsageError(
            "continuing the final message and adding a generation prompt contradict each "
            "other: ask for one of them"
        )
    if continue_final_message and not last_is_assistant:
        raise UsageError(
            "continuing the final message needs a conversation that ends with an assistant message"
        )
    # an explicit add_generation_prompt closes that turn and starts a new one, as in vLLM
    prefill = (
        last_is_assistant and continue_final_message is not False and not add_generation_prompt
    )
    if prefill and len(messages) > 1 and messages[-2]["role"] == "assistant":
        raise UsageError(
            "a conversation to continue cannot end with two assistant messages in a row"
        )
    return prefill
