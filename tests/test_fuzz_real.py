"""Bad input tried against a real server (issue 54): the generated requests of
:mod:`tests.test_fuzz_server` sent over HTTP to ``specgguf serve`` on the tiny generated
target and draft (``--parallel 2``, auto mode), so that what a request reaches is the real
engine: tokenizer, chat template, grammars, drafters, the batch of two sequences. Every
answer is a 2xx or a 4xx in OpenAI's error shape; the server's log has no traceback; it
answers a good request after and shows nothing queued or running.

A bounded number here (``SPECGGUF_FUZZ_REAL_EXAMPLES``, default 150 per test); the large run
is ``scripts/fuzz-server`` (its figures: docs/reliability.md)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .helpers import ServerProcess
from .test_fuzz_server import CHAT, COMPLETION, JSON, check

EXAMPLES = int(os.environ.get("SPECGGUF_FUZZ_REAL_EXAMPLES", "150"))

# Well-typed requests with values at the edges, so that most reach the engine (the
# strategies of test_fuzz_server are refused at validation nearly always).
TEXT = st.text(max_size=40) | st.sampled_from([
    "", "<|im_start|>", "<|im_end|>assistant\n", "\x00", "\ud800", "\U0001f600" * 20,
    "{{ raise_exception('x') }}", "{% for x in range(99) %}", "def f():\n\treturn 1",
])  # fmt: skip
SCHEMAS = st.sampled_from([
    {"type": "object"}, {"type": "string", "maxLength": 3}, {"enum": [1, "a", None]},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2}, {"type": "nope"},
    {"$ref": "#/nowhere"}, {"type": "string", "pattern": "^[0-9]{2}$"}, {},
])  # fmt: skip
GRAMMARS = st.sampled_from(['root ::= "a"', "root ::= [0-9]+", "root ::= x", "", "root ::= ("])
LENGTH = st.integers(1, 24)  # (generations until the context is full would take the time)
TYPED = {
    "n_predict": st.integers(1, 24),
    "temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "top_k": st.integers(0, 600),
    "min_p": st.floats(0, 1), "seed": st.integers(-1, 2**64 - 1),
    "stop": TEXT | st.lists(TEXT, max_size=5), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.integers(1, 3), "ignore_eos": st.booleans(),
    "speculative.n_max": st.integers(0, 100), "speculative.n_min": st.integers(0, 100),
    "speculative.p_min": st.floats(0, 1),
    "speculative.drafter": st.sampled_from(["auto", "none", "model", "ngram", "suffix", "mtp"]),
    "deterministic": st.booleans(), "cache_prompt": st.booleans(),
    "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
    "logit_bias": st.dictionaries(st.integers(-1, 600).map(str), st.integers(-100, 100),
                                  max_size=2),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}])
    | SCHEMAS.map(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}),
    "json_schema": SCHEMAS, "grammar": GRAMMARS,
}  # fmt: skip
TYPED_MESSAGE = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
    "content": TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                               min_size=1, max_size=2),
})  # fmt: skip
TYPED_TOOL = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["f", "read_file", "x" * 64])},
            optional={"parameters": SCHEMAS},
        ),
    }
)
TYPED_CHAT = st.fixed_dictionaries(
    {"messages": st.lists(TYPED_MESSAGE, min_size=1, max_size=4), "max_tokens": LENGTH},
    optional={**TYPED, "tools": st.lists(TYPED_TOOL, min_size=1, max_size=2),
              "tool_choice": st.sampled_from(["auto", "none", "required"]),
              "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans()},
)  # fmt: skip
TYPED_COMPLETION = st.fixed_dictionaries(
    {"prompt": TEXT | st.lists(TEXT, min_size=1, max_size=2)
     | st.lists(st.integers(-2, 700), min_size=1, max_size=40), "max_tokens": LENGTH},
    optional={**TYPED, "echo": st.booleans(), "suffix": TEXT},
)  # fmt: skip

FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)  # fmt: skip


@pytest.fixture(scope="module")
def server(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    home = tmp_path_factory.mktemp("home")
    env = {"HOME": str(home), "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    args = ["-m", str(tiny_models["target"]), "-md", str(tiny_models["draft-partial"]),
            "-c", "512", "-np", "2", "--max-queue", "8"]  # fmt: skip
    with ServerProcess(*args, env=env) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    # as a local client sends: the server's own address as Host
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def post(client: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    # (json.dumps escapes lone surrogates, which a client may send and httpx cannot encode)
    return client.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


@FUZZ
@given(body=CHAT)
def test_chat_completions_on_real_models_never_answer_5xx(
    client: httpx.Client, body: dict[str, Any]
) -> None:
    check(client.post("/v1/chat/completions", json=body))


@FUZZ
@given(body=COMPLETION)
def test_completions_on_real_models_never_answer_5xx(
    client: httpx.Client, body: dict[str, Any]
) -> None:
    check(client.post("/v1/completions", json=body))


@FUZZ
@given(body=TYPED_CHAT)
def test_well_typed_chat_completions_never_answer_5xx(
    client: httpx.Client, body: dict[str, Any]
) -> None:
    check(post(client, "/v1/chat/completions", body))


@FUZZ
@given(body=TYPED_COMPLETION)
def test_well_typed_completions_never_answer_5xx(
    client: httpx.Client, body: dict[str, Any]
) -> None:
    check(post(client, "/v1/completions", body))


@FUZZ
@given(raw=st.binary(max_size=64) | JSON.map(lambda v: json.dumps(v).encode()))
def test_any_body_bytes_on_real_models_never_answer_5xx(client: httpx.Client, raw: bytes) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        check(client.post(path, content=raw, headers={"Content-Type": "application/json"}))


PATHS = st.sampled_from(
    [
        "/v1/models",
        "/models",
        "/health",
        "/v1/health",
        "/props",
        "/metrics",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/",
    ]
)
METHODS = st.sampled_from(["GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"])


@FUZZ
@given(method=METHODS, path=PATHS | st.text(max_size=20).map(lambda t: "/v1/models/" + quote(t)),
       query=st.text(max_size=12))  # fmt: skip
def test_every_endpoint_and_method_never_answers_5xx(
    client: httpx.Client, method: str, path: str, query: str
) -> None:
    r = client.request(method, path, params={"q": query} if query else None,
                       headers={"Content-Type": "application/json"})  # fmt: skip
    assert r.status_code < 500, (method, path, r.status_code, r.text)


def gauge(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"/metrics has no {name}")


def test_the_real_server_is_whole_after_the_fuzzing(
    server: ServerProcess, client: httpx.Client
) -> None:
    # (runs after the tests above: pytest keeps a module's order)
    hello = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "temperature": 0}
    r = client.post("/v1/chat/completions", json=hello)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    assert client.get("/health").status_code == 200
    deadline = time.monotonic() + 30  # a stream the client left may still be ending
    while gauge(client, "specgguf_requests_running") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gauge(client, "specgguf_requests_running") == 0
    assert gauge(client, "specgguf_queue_length") == 0
    assert server.proc.poll() is None
    assert "Traceback" not in server.stderr, server.stderr[-4000:]
    assert "internal error" not in server.stderr.lower(), server.stderr[-4000:]
