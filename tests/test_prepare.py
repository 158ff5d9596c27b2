"""Before loading: prompt sources, chat templates in a sandbox, memory estimates."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from specgguf.cli.prompt import read_prompt
from specgguf.engine.chat import render_chat, render_prompt
from specgguf.errors import ChatInputError, ChatTemplateError, InsufficientMemoryError, UsageError
from specgguf.gguf.info import read_model_info
from specgguf.gguf.tiny import CHATML_TEMPLATE
from specgguf.hub import testmodels
from specgguf.llama.memory import (
    LOCAL,
    ModelMemory,
    Place,
    check_plan,
    kv_cache_bytes,
    local_plan,
    model_memory,
    place_model,
)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def system(text: str) -> dict[str, str]:
    return {"role": "system", "content": text}


class FakeStdin(io.StringIO):
    def __init__(self, text: str, tty: bool) -> None:
        super().__init__(text)
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def test_read_prompt_sources(tmp_path: Path) -> None:
    f = tmp_path / "p.txt"
    f.write_text("from a file")
    assert read_prompt("arg", None, FakeStdin("piped", tty=False)) == "arg"
    assert read_prompt(None, f, FakeStdin("", tty=True)) == "from a file"
    assert read_prompt(None, None, FakeStdin("piped", tty=False)) == "piped"
    assert read_prompt("-", None, FakeStdin("dash", tty=True)) == "dash"
    with pytest.raises(UsageError, match="no prompt"):
        read_prompt(None, None, FakeStdin("never read", tty=True))
    with pytest.raises(UsageError, match="not both"):
        read_prompt("a", f, FakeStdin("", tty=True))


def test_chatml_rendering_and_system_message() -> None:
    text = render_chat(CHATML_TEMPLATE, [system("be brief"), user("hi")])
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{% set _ = messages.append({'role': 'x'}) %}{{ messages }}",
    ],
)
def test_template_cannot_escape_the_sandbox(template: str) -> None:
    with pytest.raises(ChatTemplateError) as ei:
        render_chat(template, [user("hi")])
    assert "chat template" in str(ei.value)


def test_unsafe_attribute_renders_as_nothing() -> None:
    # The sandbox answers unsafe attribute reads with an undefined value: nothing leaks.
    assert render_chat("[{{ raise_exception.__globals__ }}]", [user("hi")]) == "[]"
    assert render_chat("[{{ messages[0].__class__ }}]", [user("hi")]) == "[]"


def test_template_raise_exception_is_reported() -> None:
    # The template's own refusal is about the conversation: a usage error quoting it.
    with pytest.raises(ChatInputError, match="roles must alternate") as ei:
        render_chat("{{ raise_exception('roles must alternate') }}", [user("hi")])
    assert ei.value.exit_code == 2


def test_bos_not_added_twice_when_the_template_writes_it(tiny_models: dict[str, Path]) -> None:
    info = read_model_info(tiny_models["target-add-bos"])  # add_bos true, BOS '<|endoftext|>'
    templated = dataclass_replace_template(info, "{{ bos_token }}{{ messages[0]['content'] }}")
    p = render_prompt(templated, [user("hello")])
    assert p.text == "<|endoftext|>hello" and p.add_special is False
    raw = render_prompt(info, "hello")
    assert raw.text == "hello" and raw.add_special is True
    with pytest.raises(UsageError, match="no chat template"):
        render_prompt(read_model_info(tiny_models["spm-target"]), [system("x"), user("hi")])


def dataclass_replace_template(info, template: str):  # type: ignore[no-untyped-def]
    import dataclasses

    return dataclasses.replace(info, template=template)


@pytest.mark.real_models
def test_kv_cache_estimate_for_qwen(real_models: dict[str, Path]) -> None:
    info = read_model_info(real_models[testmodels.TARGET])
    # 28 layers, 2 KV heads of 1536/12 = 128 dims, K and V in F16.
    assert kv_cache_bytes(info, 4096) == 2 * 28 * 4096 * 2 * 128 * 2
    m = model_memory(info, n_ctx=4096)
    assert m.weights == 1_117_320_768


def test_check_plan_refuses_with_numbers() -> None:
    parts = [ModelMemory("t.gguf", 6 << 30, 1 << 30, 1 << 28)]
    assert check_plan(local_plan(parts, available=16 << 30)) == parts[0].total
    with pytest.raises(InsufficientMemoryError) as ei:
        check_plan(local_plan(parts, available=4 << 30))
    msg = str(ei.value)
    assert "need about 7.25 GiB of memory" in msg and "4.00 GiB is available" in msg
    assert "t.gguf: weights 6.00 GiB + KV cache 1.00 GiB + compute 0.25 GiB" in msg
    assert ei.value.exit_code == 5 and not ei.value.gpu and not ei.value.remote


@pytest.mark.real_models
def test_gpu_share_and_refusal(real_models: dict[str, Path]) -> None:
    """Half the layers on a GPU: that GPU needs half the blocks (by the tensor table) and
    half the KV cache; this machine's share stays the whole estimate, as without a GPU."""
    info = read_model_info(real_models[testmodels.TARGET])
    mem = model_memory(info, n_ctx=4096)
    assert info.layout is not None and info.block_count == 28
    gpu = Place("GPU0", "gpu", 6 << 30)
    p = place_model(info, mem, [gpu], n_gpu_layers=14)
    assert p.layers == (LOCAL,) * 15 + ("GPU0",) * 14  # layers 15..27 and the output
    share = p.shares["GPU0"]
    assert share.weights == sum(info.layout.blocks[15:]) + info.layout.output
    assert share.kv_cache == mem.kv_cache // 28 * 13
    assert p.need(LOCAL) == mem.total
    small = Place("GPU0", "gpu", 100 << 20)
    from specgguf.llama.memory import MemoryPlan

    plan = MemoryPlan((Place(LOCAL, "local", 64 << 30), small), (p,))
    with pytest.raises(InsufficientMemoryError, match="on GPU GPU0") as ei:
        check_plan(plan)
    assert ei.value.gpu and not ei.value.remote
