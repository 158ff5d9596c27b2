"""Chat prompts: a conversation (a list of ``{"role", "content"}`` messages) rendered with the
model's own ``tokenizer.chat_template``.

Templates come from downloaded files, so they are rendered in Jinja's
``ImmutableSandboxedEnvironment``: a template cannot reach Python internals (attribute
access such as ``__class__``/``__globals__`` raises ``SecurityError``) nor modify the data
it is given. Server-side template injection through GGUF chat templates has had CVEs in
llama-cpp-python (CVE-2024-34359), which used a plain ``jinja2.Environment``. The options
follow Hugging Face transformers' ``apply_chat_template``: ``trim_blocks``, ``lstrip_blocks``,
the loop-controls extension, ``raise_exception`` and ``strftime_now``.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from specgguf.errors import ModelFileError, UsageError
from specgguf.gguf.info import ModelInfo

#: A chat message: ``{"role": "system" | "user" | "assistant", "content": str}``.
ChatMessage = Mapping[str, Any]
ROLES = ("system", "user", "assistant")


class ChatTemplateError(ModelFileError):
    """A chat template that cannot be rendered (syntax error, sandbox violation, or a
    ``raise_exception`` in the template itself)."""


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
    ``add_generation_prompt``.

    Raises:
        ChatTemplateError: the template fails to parse or render, or tries to escape the
            sandbox.
    """
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> NoReturn:
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template).render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(
            f"the model's chat template tried something the sandbox forbids ({e})"
        ) from None
    except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError) as e:
        raise ChatTemplateError(
            f"the model's chat template cannot be rendered: {type(e).__name__}: {e}"
        ) from None


@dataclasses.dataclass(frozen=True)
class PreparedPrompt:
    """The text to tokenize, whether tokenization adds the model's BOS itself
    (``add_special``), and whether the chat template made it (``templated``)."""

    text: str
    add_special: bool
    templated: bool


def render_prompt(info: ModelInfo, prompt: str | Sequence[ChatMessage]) -> PreparedPrompt:
    """A prompt as the target reads it: a string as is (the model adds its BOS), a
    conversation through the target's chat template. A model without a template takes a
    conversation of one user message as that message's text. When the rendered text
    already starts with the BOS token's text, tokenization does not add another.

    Raises:
        UsageError: a malformed conversation, or one a model without a chat template
            cannot take (a system message, several turns).
        ChatTemplateError: the template cannot be rendered.
    """
    if isinstance(prompt, str):
        return PreparedPrompt(prompt, add_special=True, templated=False)
    messages = check_messages(prompt)
    template = info.template
    if template is None:
        if len(messages) == 1 and messages[0]["role"] == "user":
            return PreparedPrompt(messages[0]["content"], add_special=True, templated=False)
        what = "a system message" if messages[0]["role"] == "system" else "a conversation"
        raise UsageError(f"{info.path.name} has no chat template for {what}")
    v = info.vocab
    bos = v.text(v.bos) or ""
    text = render_chat(template, messages, bos_token=bos, eos_token=v.text(v.eos) or "")
    add_special = not (bos and v.add_bos and text.startswith(bos))
    return PreparedPrompt(text, add_special=add_special, templated=True)
