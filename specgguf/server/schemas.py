"""Request bodies of the OpenAI-compatible endpoints, as pydantic models, and their checks.

Field names and ranges follow OpenAI's API (``max_tokens``, ``max_completion_tokens``,
``temperature`` 0-2, ``top_p``, ``seed``, ``stop``, ``stream``, ``stream_options``) and
llama.cpp's server for its extensions (``n_predict``, ``top_k``, ``min_p``, ``ignore_eos``,
and the per-request speculative settings ``speculative.n_max``, ``speculative.n_min``,
``speculative.p_min``, plus specgguf's ``speculative.drafter``). Types are strict (a
string is not a number, 1 is not ``true``, numbers are finite); fields the server does not
know are ignored, and features it does not have (``logprobs``, ``tools``,
``response_format``, ``n`` > 1, penalties, ``logit_bias``, and llama.cpp's grammars and
samplers of :data:`LLAMA_CPP_FIELDS`) are refused by name (:func:`check_supported`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specgguf.server.errors import bad_request, unsupported

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


class ContentPart(_Strict):
    """A part of a message's content (only ``{"type": "text", "text": ...}`` is served)."""

    type: str
    text: str | None = None


class Message(_Strict):
    """A chat message; ``developer`` is OpenAI's newer name for ``system``."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None


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
    spec_drafter: Literal["auto", "model", "mtp", "ngram", "suffix", "none"] | None = Field(
        None, alias="speculative.drafter"
    )
    #: specgguf's extension: greedy (and seeded) output independent of the drafter and K;
    #: needs a server started with --deterministic (None: the server's setting)
    deterministic: bool | None = None
    # Refused unless absent or neutral (check_supported).
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    logit_bias: dict[str, Any] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)

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

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Generation):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    #: The chat template's arguments that the server takes, as vLLM and llama-server
    #: name them (None: a final assistant message is continued, llama-server's default;
    #: otherwise the assistant's header follows the conversation).
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None

    def conversation(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them: text content (parts joined by
        newlines, as llama.cpp's server does), ``developer`` as ``system``.

        Raises:
            APIError: a message without text content, or with a non-text part.
        """
        out = []
        for i, m in enumerate(self.messages):
            if m.content is None:
                calls = " (tool calls are not supported by this server)" if (
                    m.role == "assistant" and m.model_extra and "tool_calls" in m.model_extra
                ) else ""  # fmt: skip
                raise bad_request(
                    f"messages.{i}.content: the {m.role} message needs text content{calls}",
                    param=f"messages.{i}.content",
                )  # fmt: skip
            if isinstance(m.content, str):
                text = m.content
            else:
                texts = []
                for j, part in enumerate(m.content):
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
            out.append({"role": role, "content": text})
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
#: Fields that only shape the response or the server's caching (``cache_prompt``,
#: ``id_slot``, ``timings_per_token``, ``n_keep``, ...) are accepted and ignored.
LLAMA_CPP_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "grammar": (_empty, "grammar (constrained generation)"),
    "json_schema": (lambda v: v is None, "json_schema (constrained generation)"),
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
        APIError: ``n`` > 1, log probabilities, tools or functions, a response format
            other than text, a logit bias, a non-zero penalty, ``echo``, ``suffix``,
            ``best_of`` > 1, a llama.cpp field of :data:`LLAMA_CPP_FIELDS` that would
            change the output, speculative settings as a nested object,
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
        if req.tools or req.functions:
            raise unsupported("tools" if req.tools else "functions", "tools (function calling)")
        if req.tool_choice not in (None, "none", "auto") or req.function_call not in (
            None, "none", "auto",
        ):  # fmt: skip
            param = "tool_choice" if req.function_call is None else "function_call"
            raise unsupported(param, "tools (function calling)")
        if req.response_format not in (None, {"type": "text"}):
            raise unsupported("response_format", "response_format other than text")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise unsupported("echo")
        if req.suffix:
            raise unsupported("suffix")
        if req.best_of not in (None, 1):
            raise unsupported("best_of")
