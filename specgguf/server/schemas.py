"""Request bodies of the OpenAI-compatible endpoints, as pydantic models, and their checks.

Field names and ranges follow OpenAI's API (``max_tokens``, ``max_completion_tokens``,
``temperature`` 0-2, ``top_p``, ``seed``, ``stop``, ``stream``, ``stream_options``) and
llama.cpp's server for its extensions (``n_predict``, ``top_k``, ``min_p``, ``ignore_eos``,
and the per-request speculative settings ``speculative.n_max``, ``speculative.n_min``,
``speculative.p_min``, plus specgguf's ``speculative.drafter``). Types are strict (a
string is not a number, 1 is not ``true``, numbers are finite); fields the server does not
know are ignored, and features it does not have (``logprobs``, ``functions``, ``n`` > 1,
penalties, ``logit_bias``, and llama.cpp's samplers of :data:`LLAMA_CPP_FIELDS`) are
refused by name (:func:`check_supported`).

Structured output: OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``;
llama-server's ``json_object`` with a ``schema`` too) and llama.cpp's ``json_schema`` and
``grammar`` (GBNF), one of them per request (:func:`constraint`); OpenAI's ``tools``,
``tool_choice`` and ``parallel_tool_calls`` (:mod:`specgguf.server.tools`), and in the
conversation assistant messages with ``tool_calls`` and ``tool`` messages.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specgguf.engine.chat import call_arguments
from specgguf.engine.drafter_map import drafter_kinds, spec_types
from specgguf.gguf.arch import article
from specgguf.server.errors import bad_request, unsupported
from specgguf.server.tools import ToolSet
from specgguf.speculative.grammar import GrammarSpec

#: The most tokens a request may ask for (larger values are refused; values beyond the
#: room left in the context are clamped to it).
MAX_TOKENS = 2**31 - 1
#: The most stop strings a request may give (OpenAI's limit: "up to 4 sequences").
MAX_STOP = 4


class _Strict(BaseModel):
    model_config = ConfigDict(
        strict=True, extra="allow", populate_by_name=True, allow_inf_nan=False
    )


class StreamOptions(_Strict):
    include_usage: bool | None = None


#: The ``format`` values an ``input_audio`` part may give: what libmtmd decodes.
AUDIO_PART_FORMATS = ("wav", "mp3", "flac")


class ContentPart(_Strict):
    """A part of a message's content: ``{"type": "text", "text": ...}``, or where the server
    has the target's projector (``--mmproj``) ``{"type": "image_url", "image_url": {"url":
    "data:image/png;base64,..."}}`` and ``{"type": "input_audio", "input_audio": {"data":
    "<base64>", "format": "wav"}}``."""

    type: str
    text: str | None = None
    #: ``{"url": ..., "detail": ...}``, or a bare string as some clients send it (``detail``
    #: is taken and not used); read by :meth:`ChatRequest.media`, which names a field
    #: that is wrong (a model here would answer a union's two errors about the content)
    image_url: Any = None
    #: ``{"data": <base64>, "format": ...}`` (:func:`audio_bytes`)
    input_audio: Any = None


#: The content parts that are media: each becomes a marker in the text
MEDIA_PARTS = ("image_url", "input_audio")


_URL_SAFE = str.maketrans("-_", "+/")


def image_bytes(url: str, param: str, remote: Sequence[str] = ()) -> bytes | str:
    """The image of an ``image_url`` part: the bytes of a ``data:`` URI in base64 (any
    media type: the bytes say the format, checked later), or an ``http(s)`` address on one
    of the ``remote`` hosts, as it is, to fetch (:func:`specgguf.server.remote.
    fetch_image`). Any other address is refused: fetching an address a request names lets
    anyone who can reach the server make it send requests into its own network
    (server-side request forgery).

    Raises:
        APIError: 400 naming ``param``: not a base64 ``data:`` URI, not base64, empty, or
            over :data:`specgguf.llama.media.MAX_BYTES` decoded.
    """
    from specgguf.llama.media import MAX_BYTES
    from specgguf.server.remote import allowed

    if remote and allowed(url, remote):
        return url
    head, comma, body = url.partition(",")
    if not head.lower().startswith("data:"):
        what = (
            "a web address" if head.lower().startswith(("http:", "https:")) else "not a data: URI"
        )
        raise bad_request(
            f"{param}: {what}: send the image itself, as data:image/png;base64,... (this "
            "server fetches no address a request names but on the hosts it was told)",
            param=param,
        )  # fmt: skip
    if not comma or not head.lower().endswith(";base64"):
        raise bad_request(f"{param}: a data: URI in base64 (data:image/png;base64,...) is "
                          "read", param=param)  # fmt: skip
    if len(body) > (MAX_BYTES // 3 + 1) * 4 * 77 // 76 + 8:  # (76-column lines allowed)
        raise bad_request(f"{param}: the image is more than {MAX_BYTES:,} bytes",
                          param=param)  # fmt: skip
    return _base64_bytes(body, param, "the image", "the data: URI")


def _base64_bytes(body: str, param: str, what: str, carrier: str) -> bytes:
    """``body`` decoded from base64 as tools write it: wrapped in lines (GNU base64),
    without its padding, or in the URL-safe alphabet.

    Raises:
        APIError: 400 naming ``param``: not base64 (``carrier`` is what holds it), empty,
            or over :data:`specgguf.llama.media.MAX_BYTES` (``what`` is the medium).
    """
    from specgguf.llama.media import MAX_BYTES

    body = "".join(body.split()).translate(_URL_SAFE)
    try:
        data = base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{param}: {carrier} is not valid base64", param=param) from None
    if not data:
        raise bad_request(f"{param}: {what} is empty", param=param)
    if len(data) > MAX_BYTES:
        raise bad_request(f"{param}: {what} is more than {MAX_BYTES:,} bytes",
                          param=param)  # fmt: skip
    return data


def audio_bytes(part: Any, param: str) -> bytes:
    """The clip of an ``input_audio`` part's object (``param`` names it): its ``data``
    decoded from base64 (as :func:`image_bytes` reads a data: URI's), with a ``format`` of
    :data:`AUDIO_PART_FORMATS` (OpenAI's are wav and mp3; the bytes say the format, as an
    image's do).

    Raises:
        APIError: 400 naming the field: not an object, a field missing or not a string,
            another format, data that is not base64, empty, or over
            :data:`specgguf.llama.media.MAX_BYTES` decoded.
    """
    from specgguf.llama.media import MAX_BYTES

    if not isinstance(part, dict):
        raise bad_request(f"{param}: an object with the clip in base64 (data) and its format",
                          param=param)  # fmt: skip
    fmt, data = part.get("format"), part.get("data")
    if not isinstance(fmt, str):
        raise bad_request(f"{param}.format: the clip's format, a string: one of "
                          f"{', '.join(AUDIO_PART_FORMATS)}", param=f"{param}.format")  # fmt: skip
    if fmt.lower() not in AUDIO_PART_FORMATS:
        raise bad_request(f"{param}.format: {fmt!r} is not read: one of "
                          f"{', '.join(AUDIO_PART_FORMATS)}", param=f"{param}.format")  # fmt: skip
    if not isinstance(data, str):
        raise bad_request(f"{param}.data: the clip in base64, a string", param=f"{param}.data")
    if len(data) > (MAX_BYTES // 3 + 1) * 4 * 77 // 76 + 8:  # (76-column lines allowed)
        raise bad_request(f"{param}.data: the audio is more than {MAX_BYTES:,} bytes",
                          param=f"{param}.data")  # fmt: skip
    return _base64_bytes(data, f"{param}.data", "the audio", "the data")


class FunctionCall(_Strict):
    """The function of an assistant's tool call: ``arguments`` a JSON object as text (as
    OpenAI gives it; an object is taken too)."""

    name: str
    arguments: str | dict[str, Any]


class ToolCallItem(_Strict):
    """One of an assistant message's ``tool_calls``."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    """A chat message; ``developer`` is OpenAI's newer name for ``system``. An assistant
    message may carry ``tool_calls`` (its content may then be null); a ``tool`` message
    answers one (``tool_call_id``)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionDef(_Strict):
    """A tool's function: ``parameters`` a JSON Schema of its arguments (an object)."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    """OpenAI's ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """``tool_choice`` naming the function to call."""

    type: Literal["function"]
    function: FunctionName


class _Generation(_Strict):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    #: llama.cpp's name for the tokens to generate (-1: until done); it comes before
    #: ``max_completion_tokens`` and ``max_tokens``, as in llama.cpp's server
    llama_n_predict: int | None = Field(None, alias="n_predict", ge=-1, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-1, le=2**64 - 1)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1)
    ignore_eos: bool | None = False
    spec_n_max: int | None = Field(None, alias="speculative.n_max", ge=0)
    spec_n_min: int | None = Field(None, alias="speculative.n_min", ge=0)
    spec_p_min: float | None = Field(None, alias="speculative.p_min", ge=0.0, le=1.0)
    #: a drafter of the registry (:func:`specgguf.engine.drafter_map.drafter_kinds`)
    spec_drafter: str | None = Field(None, alias="speculative.drafter")
    #: specgguf's extension: greedy (and seeded) output independent of the drafter and K;
    #: needs a server started with --deterministic (None: the server's setting)
    deterministic: bool | None = None
    #: llama.cpp's: reuse what the sequence's cache shares with the prompt (default true;
    #: false reads the whole prompt again)
    cache_prompt: bool | None = None
    # Refused unless absent or neutral (check_supported).
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, Any] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # Constraints on the output (see constraint()).
    response_format: dict[str, Any] | None = None
    #: llama.cpp's: a JSON Schema the output follows
    json_schema: dict[str, Any] | None = None
    #: llama.cpp's: a grammar in its GBNF the output follows ("": none)
    grammar: str | None = None

    @property
    def n_predict(self) -> int | None:
        """The tokens asked for (None: the server's default; -1: until done):
        ``n_predict``, else ``max_completion_tokens`` (OpenAI's newer name), else
        ``max_tokens``, as llama.cpp's server takes them (tools/server/server-schema.cpp).

        Raises:
            APIError: ``n_predict`` 0.
        """
        if self.llama_n_predict == 0:
            raise bad_request("n_predict: -1 (until done) or at least 1", param="n_predict")
        for value in (self.llama_n_predict, self.max_completion_tokens, self.max_tokens):
            if value is not None:
                return value
        return None

    @property
    def stops(self) -> tuple[str, ...]:
        """The stop strings.

        Raises:
            APIError: more than :data:`MAX_STOP`, or an empty one (as OpenAI refuses them).
        """
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if len(stops) > MAX_STOP:
            raise bad_request(f"stop: at most {MAX_STOP} stop strings", param="stop")
        if any(not s for s in stops):
            raise bad_request("stop: a stop string cannot be empty", param="stop")
        return tuple(stops)

    @field_validator("spec_drafter")
    @classmethod
    def _known_drafter(cls, v: str | None) -> str | None:
        if v is not None and v not in drafter_kinds():
            if v in (types := spec_types()):  # llama.cpp's name of one (draft-mtp)
                return types[v]
            raise ValueError(f"must be one of {', '.join(drafter_kinds())}")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Generation):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    #: The chat template's arguments that the server takes, as vLLM and llama-server
    #: name them (None: a final assistant message is continued, llama-server's default;
    #: otherwise the assistant's header follows the conversation).
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None

    def conversation(self, marker: str | None = None) -> list[dict[str, Any]]:
        """The messages as the chat template takes them: text content (parts joined by
        newlines, as llama.cpp's server does; an ``image_url`` or ``input_audio`` part as
        ``marker``, default :data:`specgguf.llama.media.MARKER`, its medium in
        :meth:`media`), ``developer`` as
        ``system``; an assistant's
        ``tool_calls`` as OpenAI's objects with their arguments as a JSON object (as vLLM
        gives them to templates, which write them with ``tojson``), its content None when
        it has none; a ``tool`` message with its ``tool_call_id`` and ``name``.

        Raises:
            APIError: a message without text content (an assistant's may have tool calls
                instead), with a part neither text nor a medium, a medium outside a user
                message, tool calls on another role, arguments that are not a JSON object.
        """
        from specgguf.llama.media import MARKER

        marker = marker or MARKER
        out: list[dict[str, Any]] = []
        for i, m in enumerate(self.messages):
            calls = m.tool_calls or []
            if m.tool_calls is not None and m.role != "assistant":
                raise bad_request(
                    f"messages.{i}.tool_calls: only an assistant message makes tool calls",
                    param=f"messages.{i}.tool_calls",
                )  # fmt: skip
            text: str | None
            if m.content is None:
                if not calls:
                    needs = "text content" + (" or tool calls" if m.role == "assistant" else "")
                    raise bad_request(
                        f"messages.{i}.content: the {m.role} message needs {needs}",
                        param=f"messages.{i}.content",
                    )  # fmt: skip
                text = None
            elif isinstance(m.content, str):
                text = m.content
            else:
                texts = []
                for j, part in enumerate(m.content):
                    if part.type in MEDIA_PARTS:
                        if m.role != "user":
                            what = "images" if part.type == "image_url" else "audio clips"
                            raise bad_request(
                                f"messages.{i}.content.{j}: {what} are read in user "
                                f"messages only, not in {article(m.role)} {m.role} message",
                                param=f"messages.{i}.content.{j}",
                            )  # fmt: skip
                        texts.append(marker)  # (where media() puts its medium)
                        continue
                    if part.type != "text":
                        raise unsupported(
                            f"messages.{i}.content.{j}", f"content of type {part.type!r}"
                        )
                    if part.text is None:
                        raise bad_request(
                            f"messages.{i}.content.{j}.text: a text part needs its text",
                            param=f"messages.{i}.content.{j}.text",
                        )  # fmt: skip
                    texts.append(part.text)
                text = "\n".join(texts)
            role = "system" if m.role == "developer" else m.role
            msg: dict[str, Any] = {"role": role, "content": text}
            if calls:
                msg["tool_calls"] = [_tool_call(c, f"messages.{i}.tool_calls.{j}")
                                     for j, c in enumerate(calls)]  # fmt: skip
            if role == "tool":
                msg.update({k: v for k, v in (("tool_call_id", m.tool_call_id),
                                               ("name", m.name)) if v is not None})  # fmt: skip
            out.append(msg)
        return out

    def media(self, remote: Sequence[str] = ()) -> list[tuple[str, bytes | str]]:
        """The media of the conversation's ``image_url`` and ``input_audio`` parts, in
        their order, each with the part's name (``messages.I.content.J``): bytes, or an
        image's address on one of the ``remote`` hosts to fetch (:func:`image_bytes`);
        :meth:`conversation` puts a media marker in the text where each is.

        Raises:
            APIError: a part without its ``image_url`` or ``input_audio``, an image that
                is not sent as a base64 ``data:`` URI (:func:`image_bytes`), a clip that
                is not base64 or not of a format read (:func:`audio_bytes`).
        """
        media: list[tuple[str, bytes | str]] = []
        for i, m in enumerate(self.messages):
            for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
                if part.type == "input_audio":
                    param = f"messages.{i}.content.{j}.input_audio"
                    if part.input_audio is None:
                        raise bad_request(f"{param}: an input_audio part needs its "
                                          f"input_audio", param=param)  # fmt: skip
                    media.append((f"messages.{i}.content.{j}",
                                  audio_bytes(part.input_audio, param)))  # fmt: skip
                    continue
                if part.type != "image_url":
                    continue
                param = f"messages.{i}.content.{j}.image_url"
                if part.image_url is None:
                    raise bad_request(f"{param}: an image_url part needs its image_url",
                                      param=param)  # fmt: skip
                if isinstance(part.image_url, str):
                    data = image_bytes(part.image_url, param, remote)
                else:
                    url = part.image_url.get("url") if isinstance(part.image_url, dict) else None
                    if not isinstance(url, str):
                        raise bad_request(f"{param}.url: an image_url part's url, a string (a "
                                          f"data: URI: data:image/png;base64,...)",
                                          param=f"{param}.url")  # fmt: skip
                    data = image_bytes(url, f"{param}.url", remote)
                media.append((f"messages.{i}.content.{j}", data))
        return media

    def tool_set(self) -> ToolSet | None:
        """The request's tools and how they may be called; None without tools (an empty
        list is none).

        Raises:
            APIError: two tools of one name, a ``tool_choice`` other than ``none`` or
                ``auto`` without tools, a named function that is not among them.
        """
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none", "auto"):
                raise bad_request(
                    "tool_choice: a tool to call needs tools: give them in 'tools'",
                    param="tool_choice",
                )  # fmt: skip
            return None
        tools = tuple(t.model_dump(exclude_none=True) for t in self.tools)
        names = [t.function.name for t in self.tools]
        for k, name in enumerate(names):
            if name in names[:k]:
                raise bad_request(
                    f"tools.{k}.function.name: another tool is named {name!r} already",
                    param=f"tools.{k}.function.name",
                )  # fmt: skip
        parallel = self.parallel_tool_calls is not False
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise bad_request(
                    f"tool_choice: no tool is named {choice.function.name!r} (the tools: "
                    + ", ".join(repr(n) for n in names) + ")", param="tool_choice",
                )  # fmt: skip
            return ToolSet(tools, "function", choice.function.name, parallel=parallel)
        return ToolSet(tools, choice or "auto", parallel=parallel)


def _tool_call(call: ToolCallItem, where: str) -> dict[str, Any]:
    """An assistant's tool call with its arguments as a JSON object.

    Raises:
        APIError: arguments that are not a JSON object.
    """
    args = call_arguments(call.function.arguments)
    if args is None:
        raise bad_request(
            f"{where}.function.arguments: the arguments must be a JSON object",
            param=f"{where}.function.arguments",
        )  # fmt: skip
    out: dict[str, Any] = {"type": "function",
                           "function": {"name": call.function.name, "arguments": args}}  # fmt: skip
    if call.id is not None:
        out["id"] = call.id
    return out


class CompletionRequest(_Generation):
    """``POST /v1/completions``: a prompt completed as is (no chat template): a string, a
    list of one string, or token ids."""

    prompt: str | list[str] | list[int]
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    def prompt_input(self) -> str | list[int]:
        """The prompt as the engine takes it.

        Raises:
            APIError: several prompts in one request, or none.
        """
        p = self.prompt
        if isinstance(p, str):
            return p
        if p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise unsupported("prompt", "more than one prompt per request")
            return str(p[0])
        if not p:
            raise bad_request("prompt: the prompt is empty", param="prompt")
        return [int(x) for x in p]


def _number_in(*neutral: float) -> Callable[[Any], bool]:
    def test(value: Any) -> bool:
        return value is None or (_is_number(value) and value in neutral)

    return test


def _number_where(off: Callable[[float], bool]) -> Callable[[Any], bool]:
    def test(value: Any) -> bool:
        return value is None or (_is_number(value) and off(value))

    return test


def _empty(value: Any) -> bool:
    return value is None or value in ("", [], {})


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


#: llama.cpp server's request fields that change what is generated
#: (tools/server/server-schema.cpp), each with a test for the values that leave the output
#: as it is (its "disabled" values) and what it is: a request that sets one otherwise is
#: refused by name, as OpenAI's ``presence_penalty`` is, rather than silently ignored.
#: Fields that only shape the response (``id_slot``, ``timings_per_token``, ``n_keep``,
#: ...) are accepted and ignored; ``cache_prompt`` is a field of the request.
LLAMA_CPP_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "grammar_triggers": (_empty, "grammar_triggers (constrained generation)"),
    "repeat_penalty": (_number_in(1.0), "repeat_penalty (repetition penalties)"),
    "dry_multiplier": (_number_in(0.0), "dry_multiplier (DRY repetition penalty)"),
    "mirostat": (_number_in(0), "mirostat sampling"),
    "typical_p": (_number_where(lambda v: v >= 1.0), "typical_p (locally typical sampling)"),
    "top_n_sigma": (_number_where(lambda v: v <= 0.0), "top_n_sigma sampling"),
    "xtc_probability": (_number_in(0.0), "xtc_probability (XTC sampling)"),
    "dynatemp_range": (_number_where(lambda v: v <= 0.0), "dynatemp_range (dynamic temperature)"),
    "adaptive_target": (_number_where(lambda v: v < 0.0), "adaptive_target (adaptive sampling)"),
    "min_keep": (_number_in(0, 1), "min_keep"),
    "samplers": (_empty, "samplers (a sampler order)"),
    "n_probs": (_number_in(0), "n_probs (token probabilities)"),
    "n_cmpl": (_number_in(1), "n_cmpl > 1 (several choices per request)"),
    "n_indent": (_number_in(0), "n_indent"),
    "t_max_predict_ms": (_number_where(lambda v: v <= 0), "t_max_predict_ms (a time limit)"),
    "lora": (_empty, "lora (LoRA adapters)"),
    "chat_template_kwargs": (_empty, "chat_template_kwargs (other chat template arguments)"),
    "n_cache_reuse": (
        _number_in(0),
        "n_cache_reuse (reusing cached chunks by shifting the "
        "KV cache; the prompt's shared prefix is reused without it)",
    ),
}

#: Request fields of other servers that change how the chat template renders (vLLM's
#: ``ChatCompletionRequest``): refused by name unless absent or empty.
TEMPLATE_FIELDS: dict[str, str] = {
    "chat_template": "chat_template (a chat template per request)",
    "documents": "documents (chat template documents)",
    "mm_processor_kwargs": "mm_processor_kwargs",
}

#: The per-request speculative settings, by llama.cpp's names.
SPECULATIVE_FIELDS = (
    "speculative.n_max",
    "speculative.n_min",
    "speculative.p_min",
    "speculative.drafter",
)


def check_supported(req: _Generation) -> None:
    """Refuse, by name, what the server does not do (rather than silently ignoring it).

    Raises:
        APIError: ``n`` > 1, log probabilities, legacy ``functions``, a logit bias, a
            non-zero penalty, ``echo``, ``suffix``, ``best_of`` > 1, a llama.cpp field of
            :data:`LLAMA_CPP_FIELDS` that would change the output, speculative settings
            as a nested object,
            ``stream_options`` without ``stream``.
    """
    extra = req.model_extra or {}
    for name, (neutral, what) in LLAMA_CPP_FIELDS.items():
        if name in extra and not neutral(extra[name]):
            raise unsupported(name, what)
    if "speculative" in extra:
        raise bad_request(
            "speculative: give the settings as top-level fields with llama.cpp's names: "
            + ", ".join(f"'{f}'" for f in SPECULATIVE_FIELDS), param="speculative",
        )  # fmt: skip
    if req.stream_options is not None and not req.stream:
        raise bad_request(
            "stream_options: only allowed when stream is true", param="stream_options"
        )
    if req.n not in (None, 1):
        raise unsupported("n", "n > 1 (several choices per request)")
    if req.logprobs not in (None, False, 0) or req.top_logprobs not in (None, 0):
        raise unsupported("logprobs", "logprobs (log probabilities)")
    if req.logit_bias:
        raise unsupported("logit_bias")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0):
            raise unsupported(name)
    if isinstance(req, ChatCompletionRequest):
        for name, what in TEMPLATE_FIELDS.items():
            if not _empty(extra.get(name)):
                raise unsupported(name, what)
        if req.continue_final_message and req.add_generation_prompt:
            raise bad_request(
                "continue_final_message: continuing the final message and adding a "
                "generation prompt (add_generation_prompt) contradict each other",
                param="continue_final_message",
            )
        if req.functions or req.function_call not in (None, "none", "auto"):
            param = "functions" if req.functions else "function_call"
            raise unsupported(param, "functions (the legacy function calling; use tools)")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise unsupported("echo")
        if req.suffix:
            raise unsupported("suffix")
        if req.best_of not in (None, 1):
            raise unsupported("best_of")


def _response_format(value: dict[str, Any]) -> GrammarSpec | None:
    """The constraint of OpenAI's ``response_format``: ``{"type": "text"}`` none,
    ``{"type": "json_object"}`` any JSON object (llama-server's ``{"type":
    "json_object", "schema": {...}}``: that schema), ``{"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}`` the schema (none given: any JSON
    object; ``strict`` changes nothing, the schema is always enforced).

    Raises:
        APIError: another type, or a part of the wrong type.
    """
    kind = value.get("type")
    schema: Any = None
    if kind == "text":
        return None
    if kind == "json_object":
        schema = value.get("schema")
        where = "response_format.schema"
    elif kind == "json_schema":
        wrapper = value.get("json_schema")
        if not isinstance(wrapper, dict):
            raise bad_request(
                "response_format.json_schema: an object with the schema ('schema') and its "
                "name ('name')", param="response_format",
            )  # fmt: skip
        if not isinstance(wrapper.get("name", ""), str):
            raise bad_request("response_format.json_schema.name: a string", param="response_format")
        schema = wrapper.get("schema")
        where = "response_format.json_schema.schema"
    else:
        raise bad_request(
            "response_format.type: one of 'text', 'json_object', 'json_schema' (not "
            f"{json.dumps(kind)})", param="response_format",
        )  # fmt: skip
    if schema is None:
        return GrammarSpec("json_object")
    if not isinstance(schema, dict):
        raise bad_request(f"{where}: a JSON Schema (an object)", param="response_format")
    return GrammarSpec("json_schema", json.dumps(schema, ensure_ascii=False))


def constraint(req: _Generation) -> tuple[GrammarSpec, str] | None:
    """The constraint a request puts on its output, and the field that gave it:
    ``response_format`` (:func:`_response_format`), llama.cpp's ``json_schema`` (a JSON
    Schema object) or ``grammar`` (GBNF; "" is none, as in llama.cpp); None without one.
    The tools' constraint is added later (:func:`specgguf.server.tools.call_grammar`).

    Raises:
        APIError: a malformed ``response_format``, or two constraints in one request.
    """
    found: list[tuple[GrammarSpec, str]] = []
    if req.response_format is not None:
        spec = _response_format(req.response_format)
        if spec is not None:
            found.append((spec, "response_format"))
    if req.json_schema is not None:
        schema = json.dumps(req.json_schema, ensure_ascii=False)
        found.append((GrammarSpec("json_schema", schema), "json_schema"))
    if req.grammar:
        found.append((GrammarSpec("gbnf", req.grammar), "grammar"))
    if len(found) > 1:
        names = " and ".join(f"'{param}'" for _, param in found)
        raise bad_request(
            f"{found[1][1]}: one constraint on the output per request, not {names}",
            param=found[1][1],
        )  # fmt: skip
    return found[0] if found else None
