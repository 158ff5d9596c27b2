"""Request bodies of the OpenAI-compatible endpoints, as pydantic models, and their checks.

Field names and ranges follow OpenAI's API (``max_tokens``, ``max_completion_tokens``,
``temperature`` 0-2, ``top_p``, ``seed``, ``stop``, ``stream``, ``stream_options``) and
llama.cpp's server for its extensions (``top_k``, ``min_p``, ``ignore_eos``, and the
per-request speculative settings ``speculative.n_max``, ``speculative.n_min``,
``speculative.p_min``, plus specgguf's ``speculative.drafter``). Types are strict (a
string is not a number, 1 is not ``true``); fields the server does not know are ignored,
and features it does not have (``logprobs``, ``tools``, ``response_format``, ``n`` > 1,
penalties, ``logit_bias``) are refused by name (:func:`check_supported`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specgguf.server.errors import bad_request, unsupported

#: The most tokens a request may ask for (larger values are refused; values beyond the
#: room left in the context are clamped to it).
MAX_TOKENS = 2**31 - 1
#: The most stop strings a request may give.
MAX_STOP = 16


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)


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
    spec_drafter: Literal["auto", "model", "ngram", "suffix", "none"] | None = Field(
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
        """The tokens asked for (None: the server's default)."""
        return self.max_tokens

    @property
    def stops(self) -> tuple[str, ...]:
        """The stop strings (empty ones dropped).

        Raises:
            APIError: more than :data:`MAX_STOP`.
        """
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if len(stops) > MAX_STOP:
            raise bad_request(f"stop: at most {MAX_STOP} stop strings", param="stop")
        return tuple(s for s in stops if s)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Generation):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    @property
    def n_predict(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's newer name) or ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens

    def conversation(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them: text content (parts joined by
        newlines, as llama.cpp's server does), ``developer`` as ``system``.

        Raises:
            APIError: a message without text content, or with a non-text part.
        """
        out = []
        for i, m in enumerate(self.messages):
            if m.content is None:
                raise bad_request(
                    f"messages.{i}.content: a {m.role} message needs text content",
                    param=f"messages.{i}.content",
                )
            if isinstance(m.content, str):
                text = m.content
            else:
                texts = []
                for j, part in enumerate(m.content):
                    if part.type != "text" or part.text is None:
                        raise unsupported(
                            f"messages.{i}.content.{j}", f"content of type {part.type!r}"
                        )
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


def check_supported(req: _Generation) -> None:
    """Refuse, by name, what the server does not do (rather than silently ignoring it).

    Raises:
        APIError: ``n`` > 1, log probabilities, tools or functions, a response format
            other than text, a logit bias, a non-zero penalty, ``echo``, ``suffix``,
            ``best_of`` > 1.
    """
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
