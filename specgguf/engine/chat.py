"""Chat prompts: a user message (and optional system message) rendered with the model's own
``tokenizer.chat_template``.

Templates come from downloaded files, so they are rendered in Jinja's
``ImmutableSandboxedEnvironment``: a template cannot reach Python internals (attribute
access such as ``__class__``/``__globals__`` raises ``SecurityError``) nor modify the data
it is given. Server-side template injection through GGUF chat templates has had CVEs in
llama-cpp-python (CVE-2024-34359), which used a plain ``jinja2.Environment``. The options
follow Hugging Face transformers' ``apply_chat_template``: ``trim_blocks``, ``lstrip_blocks``,
the loop-controls extension, ``raise_exception`` and ``strftime_now``.
"""

from __future__ import annotations

import datetime
from typing import Any, NoReturn

from specgguf.errors import ModelFileError


class ChatTemplateError(ModelFileError):
    """A chat template that cannot be rendered (syntax error, sandbox violation, or a
    ``raise_exception`` in the template itself)."""


def render_chat(
    template: str,
    user: str,
    *,
    system: str | None = None,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text for one user turn (plus an optional system turn), ending with the
    assistant's header when ``add_generation_prompt``.

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
    messages: list[dict[str, Any]] = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": user})
    try:
        return env.from_string(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
        )
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(
            f"the model's chat template tried something the sandbox forbids ({e})",
            hint="--raw sends the prompt without the template",
        ) from None
    except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError) as e:
        raise ChatTemplateError(
            f"the model's chat template cannot be rendered: {type(e).__name__}: {e}",
            hint="--raw sends the prompt without the template",
        ) from None
