"""Bad input tried (issue 54): generated requests, well-formed and not, sent to every
endpoint of the application over a scripted engine (no model: the chat template, the
request models, grammars and tool schemas are the real ones). Every answer is a 2xx or a
4xx in OpenAI's error shape, never a 5xx; the application answers a good request after.
A bounded number here (``SPECGGUF_FUZZ_EXAMPLES``, default 300 per endpoint)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .test_server_structured import ScriptedEngine

EXAMPLES = int(os.environ.get("SPECGGUF_FUZZ_EXAMPLES", "300"))

# any JSON value, small
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=3),
    max_leaves=8,
)  # fmt: skip
ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "x"])
PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio", "?"])},
                             optional={"text": JSON, "image_url": JSON})  # fmt: skip
MESSAGE = st.fixed_dictionaries(
    {"role": ROLES},
    optional={"content": st.none() | st.text(max_size=30) | st.lists(PART, max_size=2) | JSON,
              "name": JSON, "tool_calls": JSON, "tool_call_id": JSON},
)  # fmt: skip
SCHEMA = st.sampled_from([{"type": "object"}, {"type": "string", "maxLength": 3}, {"enum": [1]},
                          {"type": "nope"}, {"$ref": "#/x"}, {}])  # fmt: skip
TOOL = st.fixed_dictionaries({"type": st.sampled_from(["function", "x"])}, optional={
    "function": st.fixed_dictionaries({"name": st.text(max_size=8)},
                                      optional={"parameters": SCHEMA | JSON})})  # fmt: skip
COMMON = {
    "model": JSON, "max_tokens": st.integers(-3, 10) | JSON, "n_predict": JSON,
    "temperature": st.floats(-1, 3) | JSON, "top_p": JSON, "top_k": JSON, "min_p": JSON,
    "seed": JSON, "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=5) | JSON,
    "stream": st.booleans() | JSON, "stream_options": JSON, "n": JSON, "ignore_eos": JSON,
    "speculative.n_max": JSON, "speculative.n_min": JSON, "speculative.p_min": JSON,
    "speculative.drafter": st.sampled_from(["auto", "model", "mtp", "ngram", "x"]) | JSON,
    "deterministic": JSON, "cache_prompt": JSON, "n_cache_reuse": JSON,
    "response_format": st.fixed_dictionaries({"type": st.sampled_from(
        ["text", "json_object", "json_schema", "x"])}, optional={"json_schema": JSON}) | JSON,
    "json_schema": SCHEMA | JSON, "grammar": st.sampled_from(['root ::= "a"', "x", ""]) | JSON,
    "logprobs": JSON, "logit_bias": JSON, "presence_penalty": JSON, "unknown_field": JSON,
}  # fmt: skip
CHAT = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, max_size=3) | JSON},
    optional={**COMMON, "tools": st.lists(TOOL, max_size=2) | JSON,
              "tool_choice": st.sampled_from(["auto", "none", "required"]) | JSON,
              "parallel_tool_calls": JSON, "add_generation_prompt": JSON,
              "continue_final_message": JSON},
)  # fmt: skip
COMPLETION = st.fixed_dictionaries(
    {"prompt": st.text(max_size=30) | st.lists(st.text(max_size=5), max_size=2) | JSON},
    optional=COMMON,
)


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    from starlette.testclient import TestClient

    from specgguf.server.app import ServerSettings, create_app

    app = create_app(ScriptedEngine(), ServerSettings(model_id="fake"))  # type: ignore[arg-type]
    with TestClient(app, base_url="http://localhost", raise_server_exceptions=False) as c:
        yield c
    app.state.scheduler.join(5)


def check(r: Any) -> None:
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and err["type"], err
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" or "error" in json.loads(events[-1][6:]), events


FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)  # fmt: skip


@FUZZ
@given(body=CHAT)
def test_chat_completions_never_answer_5xx(client: Any, body: dict[str, Any]) -> None:
    check(client.post("/v1/chat/completions", json=body))


@FUZZ
@given(body=COMPLETION)
def test_completions_never_answer_5xx(client: Any, body: dict[str, Any]) -> None:
    check(client.post("/v1/completions", json=body))


@FUZZ
@given(raw=st.binary(max_size=64) | JSON.map(lambda v: json.dumps(v).encode()))
def test_any_body_bytes_never_answer_5xx(client: Any, raw: bytes) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        check(client.post(path, content=raw, headers={"Content-Type": "application/json"}))


def test_a_good_request_is_answered_after_the_fuzzing(client: Any) -> None:
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello."
    assert client.get("/health").status_code == 200
