"""Chat prompts: a conversation (a list of ``{"role", "content"}`` messages) rendered with the
model's own ``tokenizer.chat_template``, with the tools the model may call.

Tools are OpenAI's tool objects (``{"type": "function", "function": {"name",
"description", "parameters"}}``), given to the template as its ``tools`` variable, as
transformers' ``apply_chat_template(tools=...)`` does; an assistant message may hold
``tool_calls`` (OpenAI's, their ``arguments`` a JSON object: text is parsed, as vLLM does,
since templates write them with ``tojson``) and a ``tool`` message a call's result. A
template that does not render tools, calls or results (found by rendering a probe once per
template, as minja's capability probes do) refuses them: :class:`ToolsTemplateError`.

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
import json
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
    ToolsTemplateError,
    UsageError,
)
from specgguf.gguf.info import ModelInfo

log = logging.getLogger("specgguf")

#: A chat message: ``{"role": "system" | "user" | "assistant" | "tool", "content": str}``,
#: an assistant's with ``tool_calls`` (its content may be None), a tool's with
#: ``tool_call_id`` and ``name``.
ChatMessage = Mapping[str, Any]
#: A tool as OpenAI gives it: ``{"type": "function", "function": {"name", ...}}``.
Tool = Mapping[str, Any]
ROLES = ("system", "user", "assistant", "tool")


def check_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as plain dicts, checked: at least one, each with a known role and a
    string content; an assistant's ``tool_calls`` (then its content may be None) with
    their arguments as JSON objects; a tool message's ``tool_call_id`` and ``name``.

    Raises:
        UsageError: an empty list, a message that is not a mapping, an unknown role, a
            content that is not a string, malformed tool calls.
    """
    if not messages:
        raise UsageError("the conversation has no messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise UsageError(f"message {i} is not an object with a role and a content")
        role, content, calls = m.get("role"), m.get("content"), m.get("tool_calls")
        if role not in ROLES:
            raise UsageError(f"message {i}: unknown role {role!r} (expected one of {ROLES})")
        if calls is not None and role != "assistant":
            raise UsageError(f"message {i}: only an assistant message makes tool calls")
        if not isinstance(content, str) and not (calls and content is None):
            raise UsageError(f"message {i}: the content must be a string")
        msg: dict[str, Any] = {"role": role, "content": content}
        if calls:
            msg["tool_calls"] = _check_calls(calls, i)
        for key in ("tool_call_id", "name") if role == "tool" else ():
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return out


def _check_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant's tool calls as OpenAI's objects, arguments as JSON objects.

    Raises:
        UsageError: not a list of ``{"function": {"name": str, "arguments": ...}}``, or
            arguments that are not a JSON object (as an object or as text).
    """
    if not isinstance(calls, Sequence) or isinstance(calls, str):
        raise UsageError(f"message {i}: tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise UsageError(f"message {i}: tool call {j} needs a function with a name")
        args = call_arguments(fn.get("arguments", {}))
        if args is None:
            raise UsageError(f"message {i}: tool call {j}: the arguments must be a JSON object")
        function = {"name": fn["name"], "arguments": args}
        item: dict[str, Any] = {"type": "function", "function": function}
        if isinstance(call.get("id"), str):
            item["id"] = call["id"]
        out.append(item)
    return out


def call_arguments(args: Any) -> dict[str, Any] | None:
    """A tool call's arguments as the template takes them: a JSON object, given as one or as
    its text (OpenAI's); None when they are not one."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return dict(args) if isinstance(args, Mapping) else None


def check_tools(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """The tools as plain JSON values, checked: each ``{"type": "function", "function":
    {"name": str, ...}}`` with ``parameters`` an object when given.

    Raises:
        UsageError: a tool of another shape.
    """
    out = []
    for k, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if (
            not isinstance(tool, Mapping)
            or tool.get("type") != "function"
            or not isinstance(fn, Mapping)
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("parameters", {}), Mapping)
        ):
            raise UsageError(
                f'tool {k}: expected {{"type": "function", "function": {{"name": ..., '
                '"parameters": {...}}}}'
            )
        try:
            out.append(json.loads(json.dumps(tool)))
        except (TypeError, ValueError):
            raise UsageError(f"tool {k} is not made of JSON values") from None
    return out


def render_chat(
    template: str,
    messages: Sequence[ChatMessage],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    tools: Sequence[Tool] | None = None,
) -> str:
    """The prompt text for a conversation, ending with the assistant's header when
    ``add_generation_prompt``; the messages as given (see :func:`render_prompt` for the
    system-message fallback), ``tools`` as the template's ``tools`` (left undefined when
    None). The template runs in a worker process within a budget of time, output and
    memory (:mod:`specgguf.engine.template_sandbox`).

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
    if tools is not None:
        variables["tools"] = [dict(t) for t in tools]
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


#: The probe's tool: a name no template writes by itself.
_PROBE_TOOL = "specgguf_probe_tool"


@dataclasses.dataclass(frozen=True)
class ToolSupport:
    """What a chat template renders of tool use: the ``tools`` given to it, an assistant's
    ``tool_calls``, and ``tool`` messages (the calls' results)."""

    tools: bool
    calls: bool
    results: bool


@functools.lru_cache(maxsize=16)
def tool_support(template: str, *, bos_token: str = "", eos_token: str = "") -> ToolSupport:
    """Which parts of tool use the template renders, found as minja's capability probes
    do: a conversation with a tool, a call of it and its result, each holding a marker,
    rendered once per template; a template that refuses the probe renders none of them.
    """
    tool = {"type": "function", "function": {
        "name": _PROBE_TOOL, "description": "A probe.",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}  # fmt: skip
    call = {"id": "call_1", "type": "function",
            "function": {"name": "specgguf_probe_call", "arguments": {"x": "y"}}}  # fmt: skip
    probe: list[dict[str, Any]] = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "specgguf probe result", "tool_call_id": "call_1"},
    ]
    try:
        tools = _PROBE_TOOL in render_chat(template, probe[:1], bos_token=bos_token,
                                           eos_token=eos_token, tools=[tool])  # fmt: skip
    except ChatTemplateBudgetError:
        raise
    except (ChatInputError, ChatTemplateError):
        tools = False
    texts = []
    # the whole probe; then a result after plain text, for a template that fails on calls
    plain: dict[str, Any] = {"role": "assistant", "content": "Hello."}
    for conv in (probe, [probe[0], plain, probe[2]]):
        try:
            texts.append(render_chat(template, conv, bos_token=bos_token, eos_token=eos_token,
                                     tools=[tool]))  # fmt: skip
        except ChatTemplateBudgetError:
            raise
        except (ChatInputError, ChatTemplateError):
            texts.append("")
    return ToolSupport(
        tools, "specgguf_probe_call" in texts[0], any("specgguf probe result" in t for t in texts)
    )


def merge_system(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation without system messages: their text goes in front of the next
    user message, joined by a newline (or becomes a user message of its own before an
    assistant message or at the end), as llama.cpp's minja does."""
    out: list[dict[str, Any]] = []
    pending = ""
    for m in messages:
        role, content = str(m["role"]), m["content"]
        if role == "system":
            pending = f"{pending}\n{content}" if pending else str(content)
            continue
        if pending:
            if role == "user":
                content = pending + (f"\n{content}" if content else "")
            else:
                out.append({"role": "user", "content": pending})
            pending = ""
        out.append({**m, "role": role, "content": content})
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
    messages: list[dict[str, Any]],
    guarded: list[int],
    pattern: re.Pattern[str],
    *,
    bos_token: str,
    eos_token: str,
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
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
                           add_generation_prompt=add_generation_prompt, tools=tools)  # fmt: skip

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
    tools: Sequence[Tool] | None = None,
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
    A tool message's content is guarded as any other; tools and tool calls that hold a
    control token's text are refused (they are rendered as JSON, where no mark can be
    kept apart).

    ``tools``: OpenAI tool objects for the template's ``tools`` variable (None or empty:
    no tools). A conversation may hold assistant messages with ``tool_calls`` and
    ``tool`` messages (see :func:`check_messages`); a final assistant message with tool
    calls is a closed turn, never continued.

    Raises:
        UsageError: a malformed conversation or tool, one a model without a chat template
            cannot take (a system message, several turns, tools), two assistant messages
            at the end of a conversation to continue, flags that contradict each other.
        ToolsTemplateError: tools, tool calls or tool results for a template that does
            not render them (see :func:`tool_support`).
        ChatInputError: the template refuses the conversation (its own message quoted),
            or changes a guarded control-token text; a control token's text in a tool or
            a tool call.
        ChatTemplateError: the template cannot be rendered, or ran out of its budget.
    """
    v = info.vocab
    bos, eos = v.text(v.bos) or "", v.text(v.eos) or ""
    if isinstance(prompt, str):
        # A text that already starts with the BOS token's text gets no second BOS.
        return PreparedPrompt(prompt, not (bos and v.add_bos and prompt.startswith(bos)), False)
    messages = check_messages(prompt)
    tool_list = check_tools(tools) if tools else None
    prefill = _prefill(messages, add_generation_prompt, continue_final_message)
    template = info.template
    if template is None:
        if tool_list:
            raise UsageError(f"{info.path.name} has no chat template to give tools to")
        if len(messages) == 1 and messages[0]["role"] == "user":
            return PreparedPrompt(messages[0]["content"], add_special=True, templated=False)
        what = "a system message" if messages[0]["role"] == "system" else "a conversation"
        raise UsageError(f"{info.path.name} has no chat template for {what}")
    pattern = _control_pattern(tuple(control_texts))
    try:
        _check_tool_use(info, template, messages, tool_list, pattern, bos=bos, eos=eos)
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
        guarded = [
            i for i, m in enumerate(messages)
            if pattern and isinstance(m["content"], str) and pattern.search(m["content"])
        ]  # fmt: skip
        if guarded and pattern is not None:
            text, spans = _render_guarded(template, messages, guarded, pattern, bos_token=bos,
                                          eos_token=eos, add_generation_prompt=header,
                                          tools=tool_list)  # fmt: skip
        else:
            text = render_chat(template, messages, bos_token=bos, eos_token=eos,
                               add_generation_prompt=header, tools=tool_list)  # fmt: skip
            spans = []
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


def _check_tool_use(
    info: ModelInfo,
    template: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    pattern: re.Pattern[str] | None,
    *,
    bos: str,
    eos: str,
) -> None:
    """Refuse tool use the template does not render, and control-token texts in tools
    and tool calls (see :func:`render_prompt`).

    Raises:
        ToolsTemplateError, ChatInputError: as :func:`render_prompt` says.
    """
    calls = [m["tool_calls"] for m in messages if m.get("tool_calls")]
    results = any(m["role"] == "tool" for m in messages)
    if not (tools or calls or results):
        return
    can = tool_support(template, bos_token=bos, eos_token=eos)
    for wanted, able, what in ((bool(tools), can.tools, "tools"),
                               (bool(calls), can.calls, "tool calls"),
                               (results, can.results, "tool results")):  # fmt: skip
        if wanted and not able:
            raise ToolsTemplateError(
                f"{info.path.name}: the model's chat template does not render {what}, so "
                "the model cannot be given them", part=what,
            )  # fmt: skip
    if pattern is not None:
        for what, value in (("a tool", tools), ("a tool call", calls)):
            found = pattern.search(json.dumps(value, ensure_ascii=False)) if value else None
            if found:
                raise ChatInputError(
                    f"{what} holds the text of a control token ({found.group(0)!r}), which "
                    "cannot be kept apart from the chat template's own: take it out"
                )


def _prefill(
    messages: list[dict[str, Any]],
    add_generation_prompt: bool | None,
    continue_final_message: bool | None,
) -> bool:
    """Whether the conversation's final assistant message is continued (see
    :func:`render_prompt`).

    Raises:
        UsageError: flags that contradict each other or the conversation.
    """
    # a final assistant message with tool calls is a closed turn, never continued
    last_is_assistant = messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
    if continue_final_message and add_generation_prompt:
        raise UsageError(
            "continuing the final message and adding a generation prompt contradict each "
            "other: ask for one of them"
        )
    if continue_final_message and not last_is_assistant:
        raise UsageError(
            "continuing the final message needs a conversation that ends with an assistant "
            "message (without tool calls)"
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
