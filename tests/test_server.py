"""`specgguf serve` as a subprocess on a free loopback port with the tiny models, driven by
the official `openai` package and by `httpx` for raw and malformed requests."""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from specgguf import errors
from specgguf.gguf.tiny import fixture_specs, write_tiny_model

from .helpers import ServerProcess, run_cli

PROMPTS = ["def is_palindrome(text):", "The quick brown fox", "for i in range(10):\n"]
#: The tiny models ignore their prompt's meaning: fixed-length greedy output is the test.
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}
SPEC = ["--drafter", "model", "--draft", "4"]


@pytest.fixture(scope="module", autouse=True)
def _loopback_only() -> Iterator[None]:
    """Clients talk to 127.0.0.1 directly, never through a proxy from the environment."""
    with pytest.MonkeyPatch.context() as mp:
        for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                    "all_proxy"):  # fmt: skip
            mp.delenv(var, raising=False)
        mp.setenv("NO_PROXY", "127.0.0.1,localhost")
        yield


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The subprocesses' environment: no network, a home of their own."""
    home = tmp_path_factory.mktemp("home")
    return {"HOME": str(home), "HF_HOME": str(home / "hf"), "HF_HUB_OFFLINE": "1",
            "NO_COLOR": "1", "XDG_CONFIG_HOME": str(home / ".config")}  # fmt: skip


def models(tiny: dict[str, Path], *extra: str, ctx: int = 1024) -> list[str]:
    return ["-m", str(tiny["target"]), "-md", str(tiny["draft-partial"]), "-c", str(ctx),
            *SPEC, *extra]  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path], env: dict[str, str]) -> Iterator[ServerProcess]:
    with ServerProcess(*models(tiny_models), env=env) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, prompt: str, **kw: Any) -> Any:
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], **kw
    )


def cli_text(tiny: dict[str, Path], prompt: str, n: int, *extra: str) -> str:
    """What `specgguf run` generates for the same models and settings."""
    args = ["run", *models(tiny), "--temp", "0", "-n", str(n), "--ignore-eos", "--json"]
    res = run_cli(*args, *extra, prompt)
    assert res.returncode == 0, res.stderr
    return str(json.loads(res.stdout)["text"])


# -- the main cases, through the openai package -------------------------------------------


def test_chat_completion_usage_timings(client: openai.OpenAI) -> None:
    r = chat(client, PROMPTS[0], max_tokens=24, **GREEDY)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.usage is not None and r.usage.completion_tokens == 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24 and r.usage.prompt_tokens > 5
    t = r.model_extra["timings"]
    assert t["predicted_n"] == 24 and t["prompt_n"] == r.usage.prompt_tokens
    # The draft model drafts for every step here (K=4), and the perturbed draft is right
    # only part of the time.
    assert 0 < t["draft_n_accepted"] < t["draft_n"]
    assert t["predicted_ms"] > 0 and t["predicted_per_second"] == pytest.approx(
        24 / (t["predicted_ms"] / 1e3), rel=1e-6
    )


def test_text_completion_is_raw(client: openai.OpenAI, server: ServerProcess) -> None:
    r = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=16, **GREEDY)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 16
    # A raw prompt is not wrapped in the chat template: far fewer prompt tokens.
    c = chat(client, PROMPTS[1], max_tokens=1, **GREEDY)
    assert c.usage is not None and r.usage.prompt_tokens < c.usage.prompt_tokens


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_greedy_output_equals_run_streamed_or_not(
    kind: str, client: openai.OpenAI, tiny_models: dict[str, Path]
) -> None:
    texts = []
    for prompt in PROMPTS[:2]:
        if kind == "chat":
            whole = chat(client, prompt, max_tokens=32, **GREEDY).choices[0].message.content
            stream = chat(client, prompt, max_tokens=32, stream=True, **GREEDY)
            streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            ran = cli_text(tiny_models, prompt, 32)
        else:
            kw = dict(model="tiny", prompt=prompt, max_tokens=32, **GREEDY)
            whole = client.completions.create(**kw).choices[0].text  # type: ignore[call-overload]
            stream = client.completions.create(stream=True, **kw)  # type: ignore[call-overload]
            streamed = "".join(c.choices[0].text for c in stream if c.choices)
            ran = cli_text(tiny_models, prompt, 32, "--raw")
        assert whole == streamed == ran
        texts.append(whole)
    assert texts[0] != texts[1]  # control: the prompt matters


def test_stream_chunks_usage_and_done(client: openai.OpenAI, server: ServerProcess) -> None:
    chunks = list(chat(client, PROMPTS[2], max_tokens=12, stream=True,
                       stream_options={"include_usage": True}, **GREEDY))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 12
    assert last.model_extra["timings"]["predicted_n"] == 12  # llama.cpp: on the last chunk
    # The wire format: SSE events, the last one data: [DONE].
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"  # no proxy keeps or buffers it
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert "timings" in json.loads(events[-2][6:]) and "usage" not in json.loads(events[-2][6:])


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_text_before_it(client: openai.OpenAI, stream: bool) -> None:
    full = chat(client, PROMPTS[0], max_tokens=40, **GREEDY).choices[0].message.content
    assert full and len(full) > 12
    stop = full[8:11]
    if stop in full[:8]:
        pytest.skip("the stop string occurs earlier")
    kw = dict(max_tokens=40, stop=[stop, "never-seen-stop"], **GREEDY)
    if stream:
        chunks = list(chat(client, PROMPTS[0], stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        r = chat(client, PROMPTS[0], **kw)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert text == full[:8] and finish == "stop"
    # A single string works too.
    r = chat(client, PROMPTS[0], max_tokens=40, stop=stop, **GREEDY)
    assert r.choices[0].message.content == full[:8]


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(max_tokens=24, temperature=1.0, top_p=1.0, extra_body={
        "top_k": 0, "min_p": 0, "ignore_eos": True})  # fmt: skip
    a = chat(client, PROMPTS[1], seed=7, **kw).choices[0].message.content
    b = chat(client, PROMPTS[1], seed=7, **kw).choices[0].message.content
    c = chat(client, PROMPTS[1], seed=8, **kw).choices[0].message.content
    assert a == b and a != c


def test_multi_turn_conversation_is_templated(client: openai.OpenAI) -> None:
    def complete(messages: list[dict[str, Any]]) -> Any:
        return client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=4, **GREEDY
        )

    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "More"},
    ]
    r, one = complete(msgs), complete(msgs[-1:])
    assert r.usage is not None and one.usage is not None
    assert r.usage.prompt_tokens > one.usage.prompt_tokens + 10
    # Content as a list of text parts, and the developer role, as OpenAI's clients send.
    parts: list[dict[str, Any]] = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    p, same = complete(parts), complete(msgs[:2])
    assert p.usage is not None and same.usage is not None
    assert p.usage.prompt_tokens == same.usage.prompt_tokens
    assert p.choices[0].message.content == same.choices[0].message.content


def test_max_tokens_beyond_the_context_is_clamped(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="a b c", max_tokens=100_000, **GREEDY)
    assert r.usage is not None and r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == 1024  # the whole context, and no more


def test_per_request_speculative_settings(client: openai.OpenAI) -> None:
    def timings(**spec: Any) -> dict[str, Any]:
        extra = {"ignore_eos": True, **{f"speculative.{k}": v for k, v in spec.items()}}
        r = chat(client, PROMPTS[0], max_tokens=30, temperature=0, extra_body=extra)
        return dict(r.model_extra["timings"], text=r.choices[0].message.content)

    base = timings()
    none = timings(drafter="none")
    assert none["draft_n"] == 0 and none["text"] == base["text"]
    k1 = timings(n_max=1)
    assert 0 < k1["draft_n"] <= 30 and k1["text"] == base["text"]
    assert base["draft_n"] > k1["draft_n"]
    # n_min 4 with n_max 4: drafts that stop short (p_min 0.9 stops them) are not verified,
    # so every verified draft has 4 tokens (the loop's rule is tested on the fake backend).
    skipped = timings(p_min=0.9, n_min=4)
    assert skipped["draft_n"] % 4 == 0 and skipped["text"] == base["text"]


def test_models_health_and_metrics(server: ServerProcess, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-target.gguf"]
    meta = models[0].model_extra["meta"]
    assert meta["draft"] == "tiny-draft-partial.gguf" and meta["n_ctx"] == 1024
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}

    def metric(name: str) -> float:
        text = httpx.get(f"{server.url}/metrics").text
        lines = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
        return float(lines[0].split()[1])

    before = {n: metric(n) for n in ("specgguf_tokens_generated_total",
                                     "specgguf_draft_tokens_total",
                                     "specgguf_draft_tokens_accepted_total")}  # fmt: skip
    r = chat(client, PROMPTS[1], max_tokens=20, **GREEDY)
    t = r.model_extra["timings"]
    assert metric("specgguf_tokens_generated_total") - before[
        "specgguf_tokens_generated_total"] == 20  # fmt: skip
    assert metric("specgguf_draft_tokens_total") - before["specgguf_draft_tokens_total"] == t[
        "draft_n"]  # fmt: skip
    assert 0 < metric("specgguf_acceptance_rate") < 1
    assert metric("specgguf_queue_length") == 0
    text = httpx.get(f"{server.url}/metrics").text
    assert 'specgguf_requests_total{endpoint="/v1/chat/completions",status="200"}' in text


def test_a_conversation_reads_only_what_its_next_turn_adds(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    """The next turn reuses the earlier ones (its sequence's cache): OpenAI's
    ``cached_tokens`` and llama.cpp's ``cache_n`` say how many, ``prompt_n`` how many were
    read; ``cache_prompt: false`` reads them all; /metrics counts both."""

    def metric(name: str) -> float:
        text = httpx.get(f"{server.url}/metrics").text
        return float(next(ln for ln in text.splitlines() if ln.startswith(name + " ")).split()[1])

    before = {n: metric(n) for n in ("specgguf_prompt_tokens_cached_total",
                                     "specgguf_prompt_tokens_read_total",
                                     "specgguf_prompt_cache_hits_total",
                                     "specgguf_prompt_cache_misses_total")}  # fmt: skip
    talk = [{"role": "user", "content": "Tell me about caches " * 8}]
    first = client.chat.completions.create(model="tiny", messages=talk, max_tokens=8,
                                           **GREEDY)  # fmt: skip
    talk += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And then?"}]  # fmt: skip
    second = client.chat.completions.create(model="tiny", messages=talk, max_tokens=8,
                                            **GREEDY)  # fmt: skip
    u, t = second.usage, second.model_extra["timings"]
    assert u is not None and u.prompt_tokens_details is not None
    cached = u.prompt_tokens_details.cached_tokens
    assert cached == t["cache_n"] and cached > first.usage.prompt_tokens - 2
    assert t["prompt_n"] == u.prompt_tokens - cached
    whole = client.chat.completions.create(
        model="tiny", messages=talk, max_tokens=8,
        extra_body={**GREEDY["extra_body"], "cache_prompt": False}, temperature=0,
    )  # fmt: skip
    t = whole.model_extra["timings"]
    assert t["cache_n"] == 0 and t["prompt_n"] == whole.usage.prompt_tokens
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    assert metric("specgguf_prompt_tokens_cached_total") - before[
        "specgguf_prompt_tokens_cached_total"] >= cached  # fmt: skip
    read = metric("specgguf_prompt_tokens_read_total") - before["specgguf_prompt_tokens_read_total"]
    assert read >= t["prompt_n"] + second.model_extra["timings"]["prompt_n"]
    assert metric("specgguf_prompt_cache_hits_total") > before["specgguf_prompt_cache_hits_total"]
    assert metric("specgguf_prompt_cache_misses_total") > before[
        "specgguf_prompt_cache_misses_total"]  # fmt: skip
    assert metric("specgguf_prompt_cache_bytes") >= 0  # the cache is on by default


def test_retrieve_model_and_head_requests(server: ServerProcess, client: openai.OpenAI) -> None:
    # OpenAI's "retrieve model": the target under each of its names, 404 for any other.
    for name in ("tiny-target.gguf", "tiny-target"):
        m = client.models.retrieve(name)
        assert m.id == "tiny-target.gguf" and m.model_extra["meta"]["n_ctx"] == 1024
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.code == "model_not_found"
    # Uptime checkers send HEAD.
    for path in ("/health", "/metrics"):
        r = httpx.head(f"{server.url}{path}")
        assert r.status_code == 200 and r.content == b""
    r = httpx.head(f"{server.base_url}/models")
    assert r.status_code == 200


def test_model_field_is_never_resolved(client: openai.OpenAI) -> None:
    # Matched against the loaded model's names and otherwise ignored: the loaded model
    # answers, whatever the name (a path, another registry alias, another vendor's model).
    for name in ("../../../etc/passwd", "qwen2.5-coder-1.5b", "/tmp/x.gguf", "gpt-4o"):
        r = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **GREEDY
        )
        assert r.model == "tiny-target.gguf" and r.usage is not None
        assert r.usage.completion_tokens == 2


def test_logs_carry_no_text_without_verbose(
    server: ServerProcess, client: openai.OpenAI, tiny_models: dict[str, Path],
    env: dict[str, str],
) -> None:  # fmt: skip
    marker = "zebra-marker-4711"
    r = chat(client, f"{marker} hi", max_tokens=8, **GREEDY)
    out = r.choices[0].message.content
    assert out and "POST /v1/chat/completions" in server.stderr
    assert marker not in server.stderr and out not in server.stderr
    with ServerProcess(*models(tiny_models), "-v", env=env) as loud:
        c = openai.OpenAI(base_url=loud.base_url, api_key="x", max_retries=0)
        out = chat(c, f"{marker} hi", max_tokens=8, **GREEDY).choices[0].message.content
        deadline = time.monotonic() + 60  # a hang guard: the log line is written after
        while repr(out) not in loud.stderr and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker in loud.stderr and repr(out) in loud.stderr


# -- bad input: always a 4xx with OpenAI's error shape --------------------------------------


def post(server: ServerProcess, path: str, body: Any, **kw: Any) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.base_url}{path}", content=data,
                      headers={"Content-Type": "application/json"}, timeout=60, **kw)  # fmt: skip


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"], err
    return dict(err)


USER = [{"role": "user", "content": "hi"}]
BAD_CHAT: list[tuple[str, Any, str | None]] = [
    ("malformed JSON", b'{"messages": [', None),
    ("not an object", b"[1, 2]", None),
    ("empty body", b"", None),
    ("lone surrogate", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', None),
    ("deeply nested", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    ("not UTF-8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', None),
    (
        "infinite temperature",
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e999}',
        "temperature",
    ),
    ("no messages", {"max_tokens": 3}, "messages"),
    ("empty messages", {"messages": []}, "messages"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("content not text", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("content null", {"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    (
        "image part",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}],
                }
            ]
        },
        "messages.0.content.0.image_url.url",
    ),
    ("temperature a string", {"messages": USER, "temperature": "hot"}, "temperature"),
    ("max_tokens a string", {"messages": USER, "max_tokens": "5"}, "max_tokens"),
    ("stream not a bool", {"messages": USER, "stream": 1}, "stream"),
    ("stop not a string", {"messages": USER, "stop": 5}, "stop"),
    ("too many stops", {"messages": USER, "stop": ["a"] * 5}, "stop"),
    ("an empty stop", {"messages": USER, "stop": [""]}, "stop"),
    ("an empty stop string", {"messages": USER, "stop": ""}, "stop"),
    ("n > 1", {"messages": USER, "n": 2}, "n"),
    ("negative max_tokens", {"messages": USER, "max_tokens": -1}, "max_tokens"),
    ("zero max_tokens", {"messages": USER, "max_tokens": 0}, "max_tokens"),
    ("huge max_tokens", {"messages": USER, "max_tokens": 2**40}, "max_tokens"),
    (
        "huge max_completion_tokens",
        {"messages": USER, "max_completion_tokens": 10**30},
        "max_completion_tokens",
    ),
    ("temperature too high", {"messages": USER, "temperature": 2.5}, "temperature"),
    ("temperature negative", {"messages": USER, "temperature": -0.1}, "temperature"),
    ("top_p above 1", {"messages": USER, "top_p": 1.5}, "top_p"),
    ("negative top_k", {"messages": USER, "top_k": -3}, "top_k"),
    ("seed below -1", {"messages": USER, "seed": -5}, "seed"),
    ("logprobs", {"messages": USER, "logprobs": True}, "logprobs"),
    ("top_logprobs", {"messages": USER, "top_logprobs": 3}, "logprobs"),
    # tools for a chat template that does not render them (more in test_server_structured)
    (
        "tools",
        {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]},
        "tools",
    ),
    ("tool_choice", {"messages": USER, "tool_choice": "required"}, "tool_choice"),
    (
        "response_format",
        {"messages": USER, "response_format": {"type": "xml"}},
        "response_format",
    ),
    ("presence_penalty", {"messages": USER, "presence_penalty": 0.5}, "presence_penalty"),
    ("logit_bias", {"messages": USER, "logit_bias": {"5": 10}}, "logit_bias"),
    ("model not a string", {"messages": USER, "model": 12}, "model"),
    (
        "unknown drafter",
        {"messages": USER, "speculative.drafter": "eagle"},
        "speculative.drafter",
    ),
    ("n_max above the loaded", {"messages": USER, "speculative.n_max": 5}, "speculative.n_max"),
    (
        "n_min above n_max",
        {"messages": USER, "speculative.n_max": 2, "speculative.n_min": 3},
        "speculative.n_min",
    ),
    ("p_min above 1", {"messages": USER, "speculative.p_min": 1.5}, "speculative.p_min"),
    (
        "NaN temperature",
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        "temperature",
    ),
    (
        "text part without its text",
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "messages.0.content.0.text",
    ),
    (
        "assistant without content",
        {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": []}, *USER]},
        "messages.1.content",
    ),
    (
        "llama.cpp's grammar_triggers",
        {"messages": USER, "grammar_triggers": [{}]},
        "grammar_triggers",
    ),
    ("llama.cpp's repeat_penalty", {"messages": USER, "repeat_penalty": 1.1}, "repeat_penalty"),
    ("llama.cpp's mirostat", {"messages": USER, "mirostat": 2}, "mirostat"),
    ("llama.cpp's samplers", {"messages": USER, "samplers": ["top_k"]}, "samplers"),
    ("llama.cpp's n_probs", {"messages": USER, "n_probs": 5}, "n_probs"),
    ("llama.cpp's n_cache_reuse", {"messages": USER, "n_cache_reuse": 256}, "n_cache_reuse"),
    ("cache_prompt not a bool", {"messages": USER, "cache_prompt": "yes"}, "cache_prompt"),
    ("n_predict 0", {"messages": USER, "n_predict": 0}, "n_predict"),
    ("n_predict below -1", {"messages": USER, "n_predict": -2}, "n_predict"),
    ("nested speculative", {"messages": USER, "speculative": {"n_max": 2}}, "speculative"),
    (
        "template kwargs",
        {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}},
        "chat_template_kwargs",
    ),
    ("a template per request", {"messages": USER, "chat_template": "{{ x }}"}, "chat_template"),
    ("continue without assistant", {"messages": USER, "continue_final_message": True}, "messages"),
    (
        "continue and generation prompt",
        {
            "messages": [*USER, {"role": "assistant", "content": "Hi"}],
            "continue_final_message": True,
            "add_generation_prompt": True,
        },
        "continue_final_message",
    ),
    (
        "two assistant messages to continue",
        {"messages": [*USER, *[{"role": "assistant", "content": "Hi"}] * 2]},
        "messages",
    ),
    (
        "add_generation_prompt not a bool",
        {"messages": USER, "add_generation_prompt": 1},
        "add_generation_prompt",
    ),
    (
        "stream_options without stream",
        {"messages": USER, "stream_options": {"include_usage": True}},
        "stream_options",
    ),
]

#: What some of the bad requests above are told: the words a client can act on.
BAD_CHAT_MESSAGES = {
    "image part": "not a data: URI",
    "lone surrogate": "lone UTF-16 surrogate",
    "NaN temperature": "finite number",
    "text part without its text": "a text part needs its text",
    "assistant without content": "the assistant message needs text content or tool calls",
    "llama.cpp's grammar_triggers": "grammar_triggers (constrained generation) is not supported",
    "llama.cpp's repeat_penalty": "repeat_penalty (repetition penalties) is not supported",
    "llama.cpp's n_cache_reuse": "n_cache_reuse (reusing cached chunks by shifting the KV cache",
    "nested speculative": "'speculative.n_max'",
    "template kwargs": "chat_template_kwargs (other chat template arguments) is not supported",
    "continue without assistant": "ends with an assistant message",
    "continue and generation prompt": "contradict each other",
    "two assistant messages to continue": "two assistant messages in a row",
    "an empty stop": "cannot be empty",
}


@pytest.mark.parametrize(("what", "body", "param"), BAD_CHAT, ids=[c[0] for c in BAD_CHAT])
def test_bad_chat_requests_get_400(
    server: ServerProcess, what: str, body: Any, param: str | None
) -> None:
    err = error_of(post(server, "/chat/completions", body), 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    if what in BAD_CHAT_MESSAGES:
        assert BAD_CHAT_MESSAGES[what] in err["message"], err
    if what.startswith("llama.cpp's"):
        assert err["code"] == "unsupported_parameter", err


def test_llama_cpp_fields_at_their_disabled_values_are_accepted(server: ServerProcess) -> None:
    # The values llama.cpp's server takes as "off" change nothing, so they are served.
    neutral = {"repeat_penalty": 1.0, "grammar": "", "dry_multiplier": 0, "mirostat": 0,
               "typical_p": 1.5, "top_n_sigma": 0, "dynatemp_range": -1.0, "xtc_probability": 0.0,
               "n_probs": 0, "samplers": [], "cache_prompt": True, "id_slot": -1,
               "n_cache_reuse": 0}  # fmt: skip
    body = {"messages": USER, "max_tokens": 3, "temperature": 0, "ignore_eos": True, **neutral}
    r = post(server, "/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("path", ["/completions", "/chat/completions"])
@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        ({"max_completion_tokens": 3}, 3),
        ({"max_tokens": 5}, 5),
        ({"n_predict": 4}, 4),
        # llama.cpp's server reads n_predict first, then max_completion_tokens, max_tokens
        ({"n_predict": 2, "max_completion_tokens": 6, "max_tokens": 7}, 2),
        ({"max_completion_tokens": 3, "max_tokens": 6}, 3),
    ],
)
def test_every_name_of_the_token_limit_is_honoured(
    server: ServerProcess, path: str, limits: dict[str, int], expected: int
) -> None:
    body: dict[str, Any] = {"temperature": 0, "ignore_eos": True, **limits}
    body.update({"prompt": "a"} if path == "/completions" else {"messages": USER})
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == expected


@pytest.mark.parametrize(
    ("what", "body", "param"),
    [
        ("no prompt", {"max_tokens": 2}, "prompt"),
        ("prompt a number", {"prompt": 5}, "prompt"),
        ("two prompts", {"prompt": ["a", "b"]}, "prompt"),
        ("token id out of range", {"prompt": [1, 2, 99999]}, "prompt"),
        ("negative token id", {"prompt": [1, -2]}, "prompt"),
        ("echo", {"prompt": "a", "echo": True}, "echo"),
        ("best_of", {"prompt": "a", "best_of": 3}, "best_of"),
        ("logprobs", {"prompt": "a", "logprobs": 2}, "logprobs"),
        # OpenAI takes up to 4 stop strings, none empty (the reported inputs)
        ("five stop strings", {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("an empty stop string", {"prompt": "a", "stop": [""]}, "stop"),
    ],
)
def test_bad_completion_requests_get_400(
    server: ServerProcess, what: str, body: Any, param: str
) -> None:
    err = error_of(post(server, "/completions", body), 400)
    assert err["param"] == param, err


def test_prompt_longer_than_the_context(server: ServerProcess) -> None:
    r = post(server, "/completions", {"prompt": "hello world " * 2000, "max_tokens": 4})
    err = error_of(r, 400)
    assert err["code"] == "context_length_exceeded" and err["n_ctx"] == 1024
    assert err["n_prompt_tokens"] > 1024 and str(err["n_prompt_tokens"]) in err["message"]
    # The same through the openai package: a BadRequestError with the code.
    c = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        chat(c, "hello world " * 2000, max_tokens=4)
    assert e.value.code == "context_length_exceeded"


def test_prompt_of_special_tokens_is_refused_before_it_is_tokenized(
    server: ServerProcess,
) -> None:
    # llama.cpp's tokenizer takes time quadratic in the number of special-token texts
    # (120,000 took 25 s); a prompt with more of them than the context holds is refused by
    # counting them ("at least"), for both endpoints.
    special = "<|im_end|>" * 50_000 + "hi"
    bodies: dict[str, dict[str, Any]] = {
        "/completions": {"prompt": special},
        "/chat/completions": {"messages": [{"role": "user", "content": special}]},
    }
    for path, body in bodies.items():
        err = error_of(post(server, path, {**body, "max_tokens": 2}), 400)
        assert err["code"] == "context_length_exceeded", err
        assert err["n_prompt_tokens"] >= 50_000 and err["n_ctx"] == 1024
        assert f"at least {err['n_prompt_tokens']} tokens" in err["message"]
    # Fewer than the context holds: tokenized and served as before.
    r = post(server, "/completions", {"prompt": "<|im_end|>" * 100, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 100


def test_body_over_the_size_limit_gets_413(server: ServerProcess) -> None:
    big = json.dumps({"prompt": "x" * (5 * 2**20)}).encode()
    err = error_of(post(server, "/completions", big), 413)
    assert err["code"] == "request_too_large"


def test_token_ids_as_prompt(server: ServerProcess, client: openai.OpenAI) -> None:
    r = client.completions.create(model="t", prompt=[300, 301, 302], max_tokens=4, **GREEDY)
    assert r.usage is not None and r.usage.prompt_tokens == 3


def test_unknown_path_and_method(server: ServerProcess) -> None:
    assert error_of(httpx.get(f"{server.base_url}/nothing"), 404)["type"] == "not_found_error"
    error_of(httpx.get(f"{server.base_url}/chat/completions"), 405)


def test_a_body_not_declared_json_is_refused(server: ServerProcess) -> None:
    # curl -d sends application/x-www-form-urlencoded, a page text/plain: both are bodies a
    # browser sends cross-origin without asking, so JSON must be declared (415 otherwise)
    body = json.dumps({"prompt": "a", "max_tokens": 2, "ignore_eos": True})
    for ctype in ("application/x-www-form-urlencoded", "text/plain"):
        r = httpx.post(f"{server.base_url}/completions", content=body,
                       headers={"Content-Type": ctype})  # fmt: skip
        assert error_of(r, 415)["code"] == "unsupported_media_type"
    r = httpx.get(f"{server.base_url}/models", headers={"Host": f"rebound.example:{server.port}"})
    assert error_of(r, 403)["code"] == "host_not_allowed"


def test_chat_template_that_raises_gives_400_with_its_message(
    tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]
) -> None:
    # A template that refuses a system message is given it merged into the first user
    # message (as llama.cpp's minja polyfill does); one that refuses the conversation itself
    # answers 400 with the template's own words.
    template = (
        "{% if messages[0]['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for m in messages %}"
        "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    )
    spec = dataclasses.replace(fixture_specs()["target"], chat_template=template)
    path = write_tiny_model(tmp_path_factory.mktemp("tmpl") / "no-system.gguf", spec)[0]
    with ServerProcess("-m", str(path), "-c", "512", "--drafter", "none", env=env) as s:
        twice = [*USER, *USER]
        err = error_of(post(s, "/chat/completions", {"messages": twice, "max_tokens": 2}), 400)
        assert "Conversation roles must alternate" in err["message"]
        assert err["code"] == "chat_template_error"
        ok = post(s, "/chat/completions", {"messages": USER, "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        sys_msg = [{"role": "system", "content": "be brief"}, *USER]
        merged = post(s, "/chat/completions", {"messages": sys_msg, "max_tokens": 2})
        assert merged.status_code == 200, merged.text
        alone = ok.json()["usage"]["prompt_tokens"]
        assert merged.json()["usage"]["prompt_tokens"] > alone  # the system text was sent


# -- security ---------------------------------------------------------------------------------


def test_api_key(tiny_models: dict[str, Path], env: dict[str, str]) -> None:
    key = "s3cret-key"
    with ServerProcess(*models(tiny_models), env={**env, "SPECGGUF_API_KEY": key}) as s:
        assert httpx.get(f"{s.url}/health").status_code == 200  # public
        for path in ("/v1/models", "/metrics"):
            assert error_of(httpx.get(f"{s.url}{path}"), 401)["type"] == "authentication_error"
            bad = {"Authorization": "Bearer wrong"}
            error_of(httpx.get(f"{s.url}{path}", headers=bad), 401)
            good = {"Authorization": f"Bearer {key}"}
            assert httpx.get(f"{s.url}{path}", headers=good).status_code == 200
        # A malformed body without the key is refused for the key, not parsed.
        error_of(post(s, "/chat/completions", b"{oops"), 401)
        with pytest.raises(openai.AuthenticationError):
            chat(openai.OpenAI(base_url=s.base_url, api_key="nope", max_retries=0), "hi")
        ok = openai.OpenAI(base_url=s.base_url, api_key=key, max_retries=0)
        assert chat(ok, "hi", max_tokens=3, **GREEDY).usage.completion_tokens == 3
    assert "warning" not in s.stderr  # loopback: no warning


def test_is_loopback() -> None:
    from specgguf.server.listen import bind, is_loopback

    sock = bind("127.0.0.1", 0)
    try:
        assert is_loopback(sock)
    finally:
        sock.close()

    class Public:
        def getsockname(self) -> tuple[str, int]:
            return ("192.0.2.7", 8080)

    assert not is_loopback(Public())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("draft", "code"),
    [("missing", errors.EXIT_MODEL_FILE), ("draft-spm", errors.EXIT_INCOMPATIBLE)],
)
def test_bad_models_exit_before_listening(
    tiny_models: dict[str, Path], tmp_path: Path, draft: str, code: int
) -> None:
    path = tiny_models.get(draft, tmp_path / "missing.gguf")
    res = run_cli("serve", "-m", str(tiny_models["target"]), "-md", str(path), "--port", "0",
                  timeout=120)  # fmt: skip
    assert res.returncode == code, res.stderr
    assert b"listening" not in res.stderr and b"Traceback" not in res.stderr


def test_warns_when_listening_beyond_loopback_without_a_key(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # In-process, with the bind kept on loopback (tests never listen on other addresses)
    # and the address reported as public; serving returns at once.
    from typer.testing import CliRunner

    import specgguf.server
    import specgguf.server.listen
    from specgguf.cli import full_app

    app = full_app()
    served: list[Any] = []
    monkeypatch.setattr(specgguf.server.listen, "is_loopback", lambda sock: False)
    monkeypatch.setattr(specgguf.server, "serve", lambda *a, **kw: served.append(a[1]))
    args = ["serve", *models(tiny_models), "--host", "127.0.0.1", "--port", "0"]
    warned = CliRunner().invoke(app, args)
    assert warned.exit_code == 0, warned.output
    assert "warning: listening on 127.0.0.1 without --api-key" in warned.stderr
    quiet = CliRunner().invoke(app, [*args, "--api-key", "k"])
    assert quiet.exit_code == 0 and "warning" not in quiet.stderr
    assert [s.api_key for s in served] == [None, "k"]


def test_taken_port_is_refused_before_loading(
    server: ServerProcess, tiny_models: dict[str, Path]
) -> None:
    res = run_cli("serve", *models(tiny_models), "--port", str(server.port), timeout=60)
    assert res.returncode == 2
    assert b"cannot listen on 127.0.0.1:" in res.stderr and b"llama" not in res.stderr


# -- one engine, many clients: queue, cancellation, shutdown ----------------------------------


@pytest.fixture(scope="module")
def long_server(tiny_models: dict[str, Path], env: dict[str, str]) -> Iterator[ServerProcess]:
    """A long context (8192) for generations that take seconds, one at a time, and a queue
    of 1 (tests/test_parallel.py: the queue of parallel sequences)."""
    with ServerProcess(*models(tiny_models, ctx=8192), "--max-queue", "1", "-np", "1",
                       env=env) as s:  # fmt: skip
        yield s


LONG = {"messages": USER, "max_tokens": 8000, "temperature": 0, "ignore_eos": True}


def rss(pid: int) -> int:
    import psutil

    return int(psutil.Process(pid).memory_info().rss)


def test_full_queue_gets_503_with_retry_after(long_server: ServerProcess) -> None:
    url = f"{long_server.base_url}/chat/completions"
    with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=60) as running:
        lines = running.iter_lines()  # (kept: dropping it would close the connection)
        next(lines)  # the first chunk: the generation has been queued
        queued: dict[str, Any] = {}

        def wait_in_queue() -> None:
            queued["r"] = httpx.post(url, json={**LONG, "max_tokens": 4}, timeout=120)

        t = threading.Thread(target=wait_in_queue)
        t.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            m = httpx.get(f"{long_server.url}/metrics").text
            if "specgguf_queue_length 1.0" in m:
                break
            time.sleep(0.05)
        assert "specgguf_queue_length 1.0" in m
        r = httpx.post(url, json={**LONG, "max_tokens": 4}, timeout=60)
        err = error_of(r, 503)
        assert err["code"] == "queue_full" and r.headers["retry-after"] == "1"
    # Closing the running stream lets the queued request through.
    t.join(60)
    assert queued["r"].status_code == 200 and queued["r"].json()["usage"]["completion_tokens"] == 4


def test_dropped_streams_cancel_and_memory_stays_flat(long_server: ServerProcess) -> None:
    url = f"{long_server.base_url}/chat/completions"

    def metric(name: str) -> float:
        text = httpx.get(f"{long_server.url}/metrics").text
        return float(next(ln for ln in text.splitlines() if ln.startswith(name + " ")).split()[1])

    def drop() -> None:
        with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=60) as r:
            lines = r.iter_lines()
            for _ in range(4):
                next(lines)  # role chunk, then text

    def short() -> None:
        r = httpx.post(url, json={**LONG, "max_tokens": 4}, timeout=600)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4

    for _ in range(3):  # warm up allocations
        drop()
        short()
    generated = metric("specgguf_tokens_generated_total")
    before = rss(long_server.proc.pid)
    for _ in range(20):
        drop()
        short()  # (the tokens counted below say the dropped one stopped at once)
    growth = rss(long_server.proc.pid) - before
    assert growth < 32 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 20 drops"
    # 20 cancelled generations of up to 8000 tokens and 20 of 4: far fewer than 160000.
    assert metric("specgguf_tokens_generated_total") - generated < 20 * 2000


def test_dropped_non_streaming_request_is_cancelled(long_server: ServerProcess) -> None:
    url = f"{long_server.base_url}/chat/completions"

    def metric(name: str) -> float:
        text = httpx.get(f"{long_server.url}/metrics").text
        return float(next(ln for ln in text.splitlines() if ln.startswith(name + " ")).split()[1])

    logged = long_server.stderr.count("the client went away")
    generated = metric("specgguf_tokens_generated_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=LONG, timeout=1.0)
    r = httpx.post(url, json={**LONG, "max_tokens": 4}, timeout=600)
    assert r.status_code == 200
    # Counted, not timed: once nothing runs, the dropped request's tokens are counted, and
    # they are far fewer than the 8000 it asked for.
    deadline = time.monotonic() + 600  # a hang guard
    while metric("specgguf_requests_running") > 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert metric("specgguf_tokens_generated_total") - generated < 8000
    # The log has a line for the cancelled request too.
    deadline = time.monotonic() + 60
    while long_server.stderr.count("the client went away") == logged:
        assert time.monotonic() < deadline, long_server.stderr[-2000:]
        time.sleep(0.05)


def test_every_request_has_a_log_line(server: ServerProcess) -> None:
    # Refused requests too, with the reason and no prompt text.
    error_of(post(server, "/chat/completions", {"messages": USER, "n": 3}), 400)
    error_of(httpx.get(f"{server.base_url}/nothing-here"), 404)
    deadline = time.monotonic() + 60
    while "GET /v1/nothing-here: 404" not in server.stderr:
        assert time.monotonic() < deadline, server.stderr[-2000:]
        time.sleep(0.05)
    assert "POST /v1/chat/completions: 400 n > 1 (several choices per request)" in server.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_ends_generation_and_exits_0(
    tiny_models: dict[str, Path], env: dict[str, str], sig: int
) -> None:
    s = ServerProcess(*models(tiny_models, ctx=8192), env=env)
    url = f"{s.base_url}/chat/completions"
    events: list[str] = []

    def stream() -> None:
        with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=60) as r:
            events.extend(line for line in r.iter_lines() if line)

    t = threading.Thread(target=stream)
    t.start()
    while len(events) < 3 and t.is_alive():
        time.sleep(0.02)
    code = s.stop(sig)  # (fails past its own 30 s: a hang guard)
    assert code == 0, s.stderr
    t.join(60)
    assert not t.is_alive()
    # The stream ended early, with an error event that says why (not 8000 tokens).
    assert len(events) < 4000
    assert json.loads(events[-1][6:])["error"]["code"] == "server_shutting_down"
    assert "Traceback" not in s.stderr
    # the log says what happened to the stream, not a 503 after the 200 that started it
    assert re.search(r"POST /v1/chat/completions: stream ended by shutdown after [1-9]\d* "
                     r"(tokens|text pieces)", s.stderr), s.stderr[-2000:]  # fmt: skip
    assert ": 503 " not in s.stderr


# -- the scheduler on a fake engine ------------------------------------------------------------


def test_scheduler_runs_jobs_in_arrival_order_and_bounds_the_queue() -> None:
    import asyncio

    from specgguf.server.scheduler import Job, QueueFull, Scheduler
    from specgguf.speculative.loop import GenerationParams, SpeculativeDecoder

    from .fakes import FakeContext, FakeVocab, one_hot_rule

    gate = threading.Event()
    order: list[int] = []

    class Engine:
        n_parallel = 1
        decoder = SpeculativeDecoder(
            FakeContext(one_hot_rule(lambda p: p[-1] % 30 + 1, 32), 32),
            FakeVocab(32),  # type: ignore[arg-type]
        )

        def generate(self, ids: list[int], params: GenerationParams) -> Any:
            gate.wait(10)
            order.append(ids[0])
            return self.decoder.generate(ids, params)

    async def main() -> None:
        sched = Scheduler(Engine(), max_queue=2)  # type: ignore[arg-type]
        jobs = [Job([i + 1], GenerationParams(n_predict=3)) for i in range(3)]
        for j in jobs:
            sched.submit(j)  # one runs (held at the gate), two wait
        with pytest.raises(QueueFull):
            sched.submit(Job([9], GenerationParams(n_predict=3)))
        jobs[2].cancel()  # a waiting job that is cancelled never runs
        gate.set()
        results = []
        for j in jobs[:2]:
            results.append([e async for e in j.events()][-1])
        assert [r.result.tokens for r in results] == [[2, 3, 4], [3, 4, 5]]
        sched.close()
        assert sched.join(10)

    asyncio.run(main())
    assert order == [1, 2]


def test_a_request_reading_images_holds_a_place_and_takes_its_turn_before_the_next_job() -> None:
    """A request whose images wait for their turn at llama.cpp (``Scheduler.turn``) holds
    a place in the queue (``reserve``): counted as waiting, refused like a job when the
    queue is full; its turn comes when the running job ends, before the next job."""
    import asyncio

    from specgguf.server.scheduler import Job, QueueFull, Scheduler, ShuttingDown
    from specgguf.speculative.loop import GenerationParams, SpeculativeDecoder

    from .fakes import FakeContext, FakeVocab, one_hot_rule

    gate = threading.Event()
    order: list[str] = []

    class Engine:
        n_parallel = 1
        decoder = SpeculativeDecoder(
            FakeContext(one_hot_rule(lambda p: p[-1] % 30 + 1, 32), 32),
            FakeVocab(32),  # type: ignore[arg-type]
        )

        def generate(self, ids: list[int], params: GenerationParams) -> Any:
            gate.wait(10)
            order.append(f"job {ids[0]}")
            return self.decoder.generate(ids, params)

    async def main() -> None:
        sched = Scheduler(Engine(), max_queue=1)  # type: ignore[arg-type]
        first = Job([1], GenerationParams(n_predict=3))
        sched.submit(first)  # runs, held at the gate
        while not sched.running:
            await asyncio.sleep(0.01)
        with sched.reserve():
            assert sched.waiting == 1 and sched.full()
            with pytest.raises(QueueFull):
                sched.submit(Job([8], GenerationParams(n_predict=3)))
            with pytest.raises(QueueFull), sched.reserve():
                pass
        assert sched.waiting == 0 and not sched.full()
        took = threading.Event()

        def encode() -> None:
            with sched.turn():
                order.append("turn")
                took.set()

        t = threading.Thread(target=encode)
        t.start()
        await asyncio.sleep(0.2)
        assert not took.is_set()  # (the running job holds llama.cpp)
        second = Job([2], GenerationParams(n_predict=3))
        sched.submit(second)
        gate.set()
        for j in (first, second):
            assert [e async for e in j.events()][-1].kind == "done"
        t.join(10)
        sched.close()
        assert sched.join(10)
        with pytest.raises(ShuttingDown), sched.turn():  # (its work would be for nothing)
            order.append("turn after close")

    asyncio.run(main())
    assert order == ["job 1", "turn", "job 2"]


def test_a_job_without_pieces_reports_only_its_end() -> None:
    """A non-streaming request's job sends the event loop no per-step text (nobody reads
    it); its result still has all the text, as a streamed job's pieces do."""
    import asyncio

    from specgguf.server.scheduler import Job, Scheduler
    from specgguf.speculative.loop import GenerationParams, SpeculativeDecoder

    from .fakes import FakeContext, FakeVocab, one_hot_rule

    class Engine:
        n_parallel = 1
        decoder = SpeculativeDecoder(
            FakeContext(one_hot_rule(lambda p: p[-1] % 30 + 1, 32), 32),
            FakeVocab(32),  # type: ignore[arg-type]
        )

        def generate(self, ids: list[int], params: GenerationParams) -> Any:
            return self.decoder.generate(ids, params)

    async def main() -> tuple[list[Any], list[Any]]:
        sched = Scheduler(Engine(), max_queue=2, stream_interval=0)  # type: ignore[arg-type]
        streamed = Job([1], GenerationParams(n_predict=5))
        quiet = Job([1], GenerationParams(n_predict=5), pieces=False)
        sched.submit(streamed)
        sched.submit(quiet)
        out = ([e async for e in streamed.events()], [e async for e in quiet.events()])
        sched.close()
        assert sched.join(10)
        return out

    streamed, quiet = asyncio.run(main())
    assert [e.kind for e in quiet] == ["done"]
    assert [e.kind for e in streamed] == ["piece"] * (len(streamed) - 1) + ["done"]
    assert len(streamed) > 2
    text = "".join(e.text for e in streamed[:-1])
    assert quiet[0].result.text == streamed[-1].result.text == text
    assert quiet[0].result.tokens == [2, 3, 4, 5, 6]


def test_a_streamed_job_sends_text_at_most_every_stream_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Steps that end within the interval of the last event have their text held and sent
    with a later one (the first step's at once, the rest at the end): fewer wake-ups of the
    event loop, the same text."""
    import asyncio

    from specgguf.server import scheduler
    from specgguf.server.scheduler import Job, Scheduler
    from specgguf.speculative.loop import GenerationParams

    clock = [100.0]
    monkeypatch.setattr(scheduler, "monotonic", lambda: clock[0])
    # (text, seconds the step took); an exception: the step fails
    steps: list[tuple[str | Exception, float]] = [(f"<{i}>", 0.02) for i in range(11)]

    class Generation:
        result = "the result"

        def __iter__(self) -> Any:
            for text, seconds in steps:
                clock[0] += seconds
                if isinstance(text, Exception):
                    raise text
                yield text

        def cancel(self) -> None:
            pass

    class Engine:
        n_parallel = 1

        def generate(self, ids: list[int], params: GenerationParams) -> Any:
            return Generation()

    async def main() -> list[Any]:
        sched = Scheduler(Engine(), max_queue=1, stream_interval=0.05)  # type: ignore[arg-type]
        job = Job([1], GenerationParams(n_predict=11))
        sched.submit(job)
        events = [e async for e in job.events()]
        sched.close()
        assert sched.join(10)
        return events

    events = asyncio.run(main())
    pieces = [e.text for e in events if e.kind == "piece"]
    assert "".join(pieces) == "".join(str(t) for t, _ in steps)
    # sent when a step ends at 0.02, then 0.08 (0.06 after the last), 0.14, 0.20: the
    # steps in between are held; the last step's text (at 0.22) is sent at the end
    assert pieces == ["<0>", "<1><2><3>", "<4><5><6>", "<7><8><9>", "<10>"]
    assert events[-1].kind == "done" and events[-1].result == "the result"
    # A generation that fails: the text held before the failure is sent, then the error.
    steps[3:] = [(RuntimeError("llama.cpp failed"), 0.0)]
    events = asyncio.run(main())
    assert [(e.kind, e.text) for e in events[:2]] == [("piece", "<0>"), ("piece", "<1><2>")]
    assert events[2].kind == "error" and str(events[2].error) == "llama.cpp failed"


def test_scheduler_on_an_engine_thread_generates_on_the_thread_that_loaded() -> None:
    # serve loads and calibrates on engine_thread() and hands it to the scheduler: every
    # llama.cpp call on one OS thread (a second computing thread slows OpenMP's pools).
    import asyncio

    from specgguf.server.scheduler import Job, Scheduler, engine_thread
    from specgguf.speculative.loop import GenerationParams, SpeculativeDecoder

    from .fakes import FakeContext, FakeVocab, one_hot_rule

    threads: list[int] = []

    class Engine:
        n_parallel = 1

        def __init__(self) -> None:
            threads.append(threading.get_ident())  # "loading"
            self.decoder = SpeculativeDecoder(
                FakeContext(one_hot_rule(lambda p: p[-1] % 30 + 1, 32), 32),
                FakeVocab(32),  # type: ignore[arg-type]
            )

        def generate(self, ids: list[int], params: GenerationParams) -> Any:
            threads.append(threading.get_ident())
            return self.decoder.generate(ids, params)

    pool = engine_thread()
    engine = pool.submit(Engine).result()

    async def main(sched: Scheduler) -> None:
        for i in range(2):
            job = Job([i + 1], GenerationParams(n_predict=2))
            sched.submit(job)
            assert [e async for e in job.events()][-1].result.tokens == [i + 2, i + 3]

    for executor in (pool, None):
        sched = Scheduler(engine, max_queue=2, executor=executor)  # type: ignore[arg-type]
        asyncio.run(main(sched))
        sched.close()
        assert sched.join(10)
    pool.shutdown()
    assert threading.get_ident() not in threads
    # With the executor: the loading thread ran both generations; without (control): the
    # scheduler's own thread, another one.
    assert threads[1] == threads[2] == threads[0] and threads[3] == threads[4] != threads[0]


def test_deterministic_requests(
    tiny_models: dict[str, Path], env: dict[str, str], client: openai.OpenAI
) -> None:
    # A server started with --deterministic: the same text for every drafter and K,
    # seeded sampling included; a server without it refuses a deterministic request.
    with ServerProcess(*models(tiny_models, "--drafter", "auto", "--deterministic"),
                       env=env) as s:  # fmt: skip
        det = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
            texts = set()
            for spec in ({"drafter": "none"}, {"drafter": "model", "n_max": 1},
                         {"drafter": "model", "n_max": 4}, {"drafter": "ngram", "n_max": 3},
                         {"drafter": "auto"}):  # fmt: skip
                extra = {"ignore_eos": True, "deterministic": True,
                         **{f"speculative.{k}": v for k, v in spec.items()}}  # fmt: skip
                r = chat(det, PROMPTS[0], max_tokens=24, extra_body=extra, **sampling)
                texts.add(r.choices[0].message.content)
            assert len(texts) == 1, (sampling, texts)
    with pytest.raises(openai.BadRequestError, match="deterministic"):
        chat(client, PROMPTS[0], max_tokens=4, extra_body={"deterministic": True})
