"""Tool calls (OpenAI's function calling) over a model's own chat template: what a request's
``tools``, ``tool_choice`` and ``parallel_tool_calls`` ask for, the grammar that forces a
call, and the model's calls parsed back from its text, whole or as it streams.

The tools are rendered by the model's chat template (its ``tools`` variable, as
transformers passes them: the OpenAI tool objects); the model answers in its own syntax.
Supported syntax: Qwen's and Hermes' (Qwen2.5, Qwen3, Hermes 2/3, and the many templates
that copied it)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one or several, each a JSON object with the tool's ``name`` and its ``arguments`` (an
object; a JSON string holding one is taken too). Text around the calls is the message's
content. An answer that is nothing but one such object, bare or in a Markdown code block
(```` ```json ````), is a call too: Qwen2.5-Coder answers so, and llama-server's Hermes
parser takes it (``common_chat_parse_hermes_2_pro``). Other syntaxes (Mistral's
``[TOOL_CALLS]``, Llama 3's ``<|python_tag|>``, ...) are not parsed: their text comes back
as content.

``tool_choice`` as llama-server takes it:

- ``auto`` (the default with tools): no constraint; calls parsed from the text. A call that
  does not parse (bad JSON, an unknown tool, a missing ``</tool_call>`` before more text)
  leaves the whole text as content: nothing is dropped.
- ``none``: the tools are still rendered (llama-server does so; OpenAI says only that the
  model will not call one), nothing is parsed: the text is the content.
- ``required`` or ``{"type": "function", "function": {"name": ...}}``: the output is
  constrained (:func:`call_grammar`) to calls of the tools (or of the named one), in the
  syntax above; one call, or several separated by a newline when ``parallel_tool_calls``
  (a named function: one call).

``parallel_tool_calls`` false under ``auto``: the generation stops at the first
``</tool_call>`` (:data:`CALL_CLOSE` is added to the stop strings), so that at most one
call is made.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import string
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from specgguf.server.errors import bad_request
from specgguf.speculative.grammar import GrammarSpec

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"

#: llguidance's JSON options for a call: the separators of ``json.dumps`` (as the chat
#: template's ``tojson`` renders earlier calls) and no other whitespace, so that the
#: punctuation and the keys are forced tokens, drafted without a drafter.
CALL_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_ID_CHARS = string.ascii_letters + string.digits


def call_id() -> str:
    """A tool call's id as OpenAI's look: ``call_`` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


@dataclasses.dataclass(frozen=True)
class ToolSet:
    """A request's tools and how they may be called.

    ``tools``: the OpenAI tool objects (``{"type": "function", "function": {"name",
    "description", "parameters"}}``), as the chat template takes them; ``choice``:
    ``auto``, ``none``, ``required`` or ``function`` (then ``name`` is the one to call);
    ``parallel``: whether several calls may be made in one answer.
    """

    tools: tuple[dict[str, Any], ...]
    choice: Literal["auto", "none", "required", "function"] = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        """The tools' names, in order."""
        return tuple(str(t["function"]["name"]) for t in self.tools)

    @property
    def parses(self) -> bool:
        """Whether the output is searched for calls (every choice but ``none``)."""
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        """Whether the output must be calls (``required`` or a named function)."""
        return self.choice in ("required", "function")

    @property
    def callable(self) -> tuple[str, ...]:
        """The names a call may use: the named one, or all."""
        return (self.name,) if self.choice == "function" and self.name else self.names

    def stops(self) -> tuple[str, ...]:
        """Stop strings the generation needs: :data:`CALL_CLOSE` for one call at most
        without a grammar (``auto``, ``parallel`` false), else none."""
        return (CALL_CLOSE,) if self.choice == "auto" and not self.parallel else ()


def parameters_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """A tool's ``parameters`` JSON Schema; a tool without one takes no arguments (OpenAI:
    "omitting parameters defines a function with an empty parameter list")."""
    params = tool["function"].get("parameters")
    if params is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return dict(params)


def call_schema(name: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON Schema of one call of the tool ``name``: ``{"name": name, "arguments":
    <parameters>}`` in that order, nothing else. The parameters' ``$defs`` and
    ``definitions`` move to the top, and every other ``$ref`` into them is rebased
    (``#`` -> ``#/properties/arguments``), so that their references still resolve."""
    params = dict(parameters)
    defs = {key: params.pop(key) for key in ("$defs", "definitions") if key in params}

    def rebase(node: Any) -> Any:
        if isinstance(node, dict):
            out = {k: rebase(v) for k, v in node.items()}
            ref = node.get("$ref")
            if (
                isinstance(ref, str)
                and ref.startswith("#")
                and not any(ref == f"#/{key}" or ref.startswith(f"#/{key}/") for key in defs)
            ):
                out["$ref"] = "#/properties/arguments" + ref[1:]
            return out
        if isinstance(node, list):
            return [rebase(v) for v in node]
        return node

    schema: dict[str, Any] = {
        "x-guidance": CALL_JSON_OPTIONS,
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": rebase(params)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    schema.update({key: rebase(value) for key, value in defs.items()})
    return schema


def call_grammar(tools: ToolSet, answer: GrammarSpec | None = None) -> GrammarSpec:
    """The grammar (llguidance's Lark, kind ``lark``) of an output that is calls of
    ``tools.callable`` in Qwen/Hermes syntax: ``<tool_call>\\n`` + :func:`call_schema` +
    ``\\n</tool_call>``, once, or several times separated by ``\\n`` when
    ``tools.parallel``. With ``answer`` (a ``json_object`` or ``json_schema`` spec), the
    output is either such calls or that JSON (``tool_choice`` auto with a response
    format).

    Raises:
        ValueError: ``answer`` of another kind (grammars are not combined).
    """
    by_name = {str(t["function"]["name"]): t for t in tools.tools}
    rules = [f"fn_{i}" for i in range(len(tools.callable))]
    # a named function is called once, as OpenAI's tool_choice names one call
    several = tools.parallel and tools.choice != "function"
    calls = 'call ("\\n" call)*' if several else "call"
    lines = [
        f"calls: {calls}",
        f'call: "{CALL_OPEN}\\n" ({" | ".join(rules)}) "\\n{CALL_CLOSE}"',
    ]
    for rule, name in zip(rules, tools.callable, strict=True):
        schema = call_schema(name, parameters_schema(by_name[name]))
        lines.append(f"{rule}: %json {json.dumps(schema, ensure_ascii=False)}")
    if answer is None:
        start = "start: calls"
    elif answer.kind == "json_object":
        start = "start: calls | answer"
        lines.append('answer: %json {"type": "object"}')
    elif answer.kind == "json_schema":
        start = "start: calls | answer"
        lines.append(f"answer: %json {answer.text}")
    else:
        raise ValueError(f"a {answer.kind} grammar cannot be combined with tool calls")
    return GrammarSpec("lark", "\n".join([start, *lines]) + "\n")


def output_constraint(
    answer: tuple[GrammarSpec, str] | None, tools: ToolSet | None
) -> tuple[GrammarSpec, str] | None:
    """The constraint of a chat request's output, and the request field it is named by
    when it cannot be used: ``answer`` (from ``response_format``, ``json_schema`` or
    ``grammar``, see :func:`specgguf.server.schemas.constraint`) alone without tools or
    with ``tool_choice`` none; the calls' grammar (``tools``) when a call is forced; under
    ``auto``, calls or the JSON of ``answer`` (a JSON response format) when there is one.

    Raises:
        APIError: a forced call together with another constraint; a GBNF, Lark or regex
            grammar together with tools under ``auto`` (grammars are not combined).
    """
    if tools is None or not tools.parses:
        return answer
    if tools.forced:
        if answer is not None:
            raise bad_request(
                f"{answer[1]}: tool_choice {tools.choice!r} makes the answer tool calls; "
                "it cannot also follow another constraint", param=answer[1],
            )  # fmt: skip
        return call_grammar(tools), "tools"
    if answer is None:
        return None
    if answer[0].kind not in ("json_object", "json_schema"):
        raise bad_request(
            f"{answer[1]}: a grammar cannot be combined with tools (tool_choice 'auto'); "
            "give tool_choice 'none' or a JSON response format", param=answer[1],
        )  # fmt: skip
    return call_grammar(tools, answer[0]), "tools"


# -- parsing the model's calls --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A call the model made: the tool's ``name``, its ``arguments`` as JSON text (an
    object), and the ``id`` OpenAI's responses give it."""

    name: str
    arguments: str
    id: str = dataclasses.field(default_factory=call_id)

    def openai(self) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` item."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ParsedMessage:
    """An answer split into ``content`` (None when only calls were made) and ``calls``."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()


_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|\Z)", re.S)
#: A whole answer in a Markdown code block (```json ... ```).
_FENCED = re.compile(r"```(?:json)?[ \t]*\n(.*)```", re.S)
#: How an answer that is one bare or fenced call begins.
_BARE_OPENERS = ("{", "```")


def _call(body: str, names: Sequence[str]) -> ToolCall | None:
    """One call from the text between the tags; None when it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or set(obj) - {"name", "arguments"}:
        return None
    name, args = obj.get("name"), obj.get("arguments", {})
    if isinstance(args, str):  # arguments as a JSON string, as OpenAI sends them
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(name, str) or name not in names or not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, names: Sequence[str]) -> ParsedMessage:
    """The calls in a finished answer (Qwen/Hermes syntax, see the module's docstring)
    and the text around them as the content: the pieces between calls, without the
    whitespace next to a call, joined by newlines; None when nothing is left. A final
    call may lack its ``</tool_call>`` (a generation stopped there).

    Without ``<tool_call>``, a text that is (but for whitespace) one call's JSON object,
    bare or in a code block, is that call.

    When any ``<tool_call>`` holds no valid call (not JSON, not ``{"name", "arguments"}``,
    a name not in ``names``, arguments not an object), or a call is not closed before
    more text, there are no calls and ``text`` is the whole content, unchanged.
    """
    blocks = list(_BLOCK.finditer(text))
    if not blocks:
        whole = text.strip()
        fenced = _FENCED.fullmatch(whole)
        body = fenced.group(1) if fenced else whole
        call = _call(body.strip(), names) if body.strip().startswith("{") else None
        return ParsedMessage(None, (call,)) if call else ParsedMessage(text)
    calls: list[ToolCall] = []
    pieces: list[str] = []
    at = 0
    for k, m in enumerate(blocks):
        closed = m.group(0).endswith(CALL_CLOSE)
        call = _call(m.group(1).strip(), names)
        if call is None or not (closed or k == len(blocks) - 1):
            return ParsedMessage(text)
        before = text[at : m.start()]
        pieces.append(before.rstrip() if k == 0 else before.strip())
        calls.append(call)
        at = m.end()
    pieces.append(text[at:].lstrip())
    content = "\n".join(p for p in pieces if p)
    return ParsedMessage(content or None, tuple(calls))


def _open_prefix(text: str) -> int:
    """The length of the longest end of ``text`` that is a beginning of :data:`CALL_OPEN`
    (0 when none)."""
    for n in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """Splits a streamed answer into content that can be sent at once and text held back
    until the end, because it may be (the start of) a call.

    :meth:`feed` each text piece; it returns the content to send now: the text up to any
    whitespace at its end and any beginning of ``<tool_call>`` there; from the first
    ``<tool_call>`` on, nothing; nothing either while the answer may be one bare or fenced
    call (it begins with ``{`` or a code fence). :meth:`finish` with the whole text parses it as
    :func:`parse_tool_calls` does and returns what is left to send: the content not sent
    yet (the held text itself when it held no valid call) and the calls. The content sent
    is always a beginning of the parsed content, so the streamed deltas, joined, equal the
    answer returned whole.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.text = ""
        self.sent = 0
        self.holding = False

    def feed(self, piece: str) -> str:
        """The content of ``piece`` (and of the text held before it) to send now."""
        self.text += piece
        if self.holding:
            return ""
        if self.sent == 0:  # the answer may be one bare or fenced call
            start = self.text.lstrip()
            if start.startswith(_BARE_OPENERS):
                self.holding = True
                return ""
            if start and any(o.startswith(start) for o in _BARE_OPENERS):
                return ""
        found = self.text.find(CALL_OPEN, self.sent)
        if found >= 0:
            self.holding = True
            end = found
        else:
            end = len(self.text) - _open_prefix(self.text[self.sent :])
        while end > self.sent and self.text[end - 1].isspace():
            end -= 1
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def finish(self, text: str) -> tuple[str, ParsedMessage]:
        """The content left to send and the parsed answer, for the finished ``text`` (the
        generation's; it starts with what was fed)."""
        parsed = parse_tool_calls(text, self.names)
        content = parsed.content or ""
        sent = self.text[: self.sent]
        rest = content[len(sent) :] if content.startswith(sent) else ""
        return rest, parsed
