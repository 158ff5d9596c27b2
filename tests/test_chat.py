"""Chat templates as models ship them: what they use beyond plain Jinja, templates that take
no system message, refusals, and the same through `specgguf run`."""

from __future__ import annotations

import dataclasses
import datetime
import json
from pathlib import Path

import pytest

from specgguf.engine.chat import merge_system, render_chat, render_prompt, takes_system_message
from specgguf.errors import ChatInputError, ChatTemplateError
from specgguf.gguf.info import read_model_info
from specgguf.gguf.tiny import CHATML_TEMPLATE, TinySpec, gpt2_vocab, write_tiny_model

from .helpers import run_cli


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def system(text: str) -> dict[str, str]:
    return {"role": "system", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


#: ChatML with the assistant turns in Hugging Face's generation tags (SmolLM3 and others).
CHATML_GENERATION = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

#: A Gemma 2 style template: refuses a system role, alternates user/model turns.
NO_SYSTEM = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{{ '<start_of_turn>' + message['role'] + '\\n' + message['content'] | trim "
    "+ '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def test_generation_tags_render_their_body() -> None:
    conv = [system("s"), user("hi"), assistant("hello"), user("again")]
    assert render_chat(CHATML_GENERATION, conv) == render_chat(CHATML_TEMPLATE, conv)
    assert "generation" not in render_chat(CHATML_GENERATION, conv)


def test_features_real_templates_use() -> None:
    # raise_exception: a refusal of the conversation, quoted
    with pytest.raises(ChatInputError, match="no tools here"):
        render_chat("{{ raise_exception('no tools here') }}", [user("x")])
    # strftime_now
    before = str(datetime.date.today().year)
    rendered = render_chat("{{ strftime_now('%Y') }}", [user("x")])
    assert rendered in (before, str(datetime.date.today().year))  # (at New Year either)
    # tojson as json.dumps: indent, no HTML escaping, keys in their order
    out = render_chat("{{ messages[0] | tojson(indent=2) }}", [{"role": "user", "content": "a<b"}])
    assert out == json.dumps({"role": "user", "content": "a<b"}, indent=2)
    assert (
        render_chat("{{ messages[0] | tojson }}", [user("é")]) == '{"role": "user", "content": "é"}'
    )
    # loop controls
    loop = "{% for m in messages %}{% if COND %}{% STMT %}{% endif %}{{ m.content }}{% endfor %}"
    t = loop.replace("COND", "loop.index0 == 1").replace("STMT", "break")
    assert render_chat(t, [user("a"), assistant("b"), user("c")]) == "a"
    t = loop.replace("COND", "m.role == 'user'").replace("STMT", "continue")
    assert render_chat(t, [user("a"), assistant("b"), user("c")]) == "b"
    # namespace
    t = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
         "{% endfor %}{{ ns.n }}")  # fmt: skip
    assert render_chat(t, [user("a"), assistant("b"), user("c")]) == "3"
    # a template that is broken is the model file's problem, not the user's
    with pytest.raises(ChatTemplateError):
        render_chat("{% for m in messages %}", [user("x")])


def test_system_message_goes_in_front_of_the_first_user_message() -> None:
    assert not takes_system_message(NO_SYSTEM) and takes_system_message(CHATML_TEMPLATE)
    conv = [system("Be brief."), user("hi")]
    assert merge_system(conv) == [user("Be brief.\nhi")]
    assert merge_system([system("a"), system("b"), assistant("x"), user("y")]) == [
        user("a\nb"), assistant("x"), user("y"),
    ]  # fmt: skip
    assert merge_system([user("a"), system("s")]) == [user("a"), user("s")]


def test_render_prompt_falls_back_for_a_template_without_system(
    tiny_models: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    info = dataclasses.replace(read_model_info(tiny_models["target"]), template=NO_SYSTEM)
    p = render_prompt(info, [system("Be brief."), user("hi")])
    assert p.text == render_prompt(info, [user("Be brief.\nhi")]).text
    assert "<start_of_turn>user\nBe brief.\nhi<end_of_turn>" in p.text
    assert "takes no system message" in caplog.text
    with pytest.raises(ChatInputError, match="roles must alternate") as ei:
        render_prompt(info, [user("a"), user("b")])
    assert ei.value.exit_code == 2


@pytest.fixture(scope="module")
def template_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("templates")
    out = {}
    for name, template in (("chatml", CHATML_TEMPLATE), ("generation", CHATML_GENERATION),
                           ("no-system", NO_SYSTEM)):  # fmt: skip
        spec = TinySpec(vocab=gpt2_vocab(), name=f"tiny {name}", chat_template=template)
        out[name] = write_tiny_model(folder / f"{name}.gguf", spec)[0]
    return out


def _prompt_tokens(model: Path, *args: str) -> tuple[int, str]:
    res = run_cli("run", "-m", str(model), "--temp", "0", "-n", "1", "--json", *args, "hi")
    assert res.returncode == 0, res.stderr.decode()
    return json.loads(res.stdout)["params"]["prompt_tokens"], res.stderr.decode()


def test_run_with_generation_tags_and_without_system_role(template_models: dict[str, Path]) -> None:
    # The reported failures: exit 3 "unknown tag 'generation'", and exit 3 for a template
    # that refuses --system. Right: the same prompt as plain ChatML (19 tokens here), and
    # the system text in front of the user's with a note on stderr.
    n_chatml, _ = _prompt_tokens(template_models["chatml"])
    n_gen, _ = _prompt_tokens(template_models["generation"])
    assert n_gen == n_chatml == 19
    n_sys, err = _prompt_tokens(template_models["no-system"], "--system", "Be brief.")
    n_merged, _ = _prompt_tokens(template_models["no-system"])  # "hi" alone
    assert n_sys > n_merged and "takes no system message" in err


def test_raw_with_system_is_a_usage_error(template_models: dict[str, Path]) -> None:
    res = run_cli("run", "-m", str(template_models["chatml"]), "--raw", "--system", "x", "hi")
    assert res.returncode == 2
    assert b"--system" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_a_template_is_compiled_once_and_its_errors_are_not_cached() -> None:
    from specgguf.engine import chat, template_sandbox

    # (the render worker's own functions, run here in-process)
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}#"
    template_sandbox._compiled.cache_clear()
    msgs = [{"role": "user", "content": "hi"}]
    assert template_sandbox._render_here(template, {"messages": msgs}, 100) == "<user>hi#"
    yo = {"messages": [{"role": "user", "content": "yo"}]}
    assert template_sandbox._render_here(template, yo, 100) == "<user>yo#"
    info = template_sandbox._compiled.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    assert chat.render_chat(template, msgs) == "<user>hi#"
    # A template that does not parse fails every time, with the same error.
    for _ in range(2):
        with pytest.raises(chat.ChatTemplateError, match="cannot be rendered"):
            chat.render_chat("{% for %}", msgs)
