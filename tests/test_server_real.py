"""`specgguf serve` on the real Qwen2.5-Coder pair: the main cases of test_server.py
(skipped when the files are absent)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from specgguf.hub import testmodels

from .helpers import ROOT, ServerProcess, run_cli

pytestmark = pytest.mark.real_models

PROMPT = "Write a Python function that checks whether a string is a palindrome."
N = 24
#: A fixed drafter and draft length: the verification batches, and so llama.cpp's
#: kernels, are the same in the server and in `run` (auto mode's batch sizes follow
#: timings; see the README on batch invariance).
SPEC = ["--drafter", "model", "--draft", "4", "-c", "2048"]


def pair(real: dict[str, Path]) -> list[str]:
    return ["-m", str(real[testmodels.TARGET]), "-md", str(real[testmodels.DRAFT]), *SPEC]


@pytest.fixture(scope="module")
def server(
    real_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    home = tmp_path_factory.mktemp("home")
    env = {"HOME": str(home), "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    with ServerProcess(*pair(real_models), env=env) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(
        model="qwen", messages=[{"role": "user", "content": PROMPT}], temperature=0, **kw
    )


def test_chat_equals_run_streamed_or_not(
    client: openai.OpenAI, real_models: dict[str, Path]
) -> None:
    r = chat(client, max_tokens=N)
    whole = r.choices[0].message.content
    chunks = list(chat(client, max_tokens=N, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    res = run_cli("run", *pair(real_models), "--temp", "0", "-n", str(N), "--json", PROMPT)
    assert res.returncode == 0, res.stderr
    assert whole == streamed == json.loads(res.stdout)["text"]
    assert "def" in whole  # the model writes code
    assert r.usage is not None and r.usage.completion_tokens == N
    t = r.model_extra["timings"]
    assert t["predicted_n"] == N and 0 < t["draft_n_accepted"] <= t["draft_n"]
    last = chunks[-1]
    assert last.usage is not None and last.usage.completion_tokens == N
    assert last.model_extra["timings"]["predicted_n"] == N


def test_stop_string_and_completion(client: openai.OpenAI) -> None:
    full = chat(client, max_tokens=N).choices[0].message.content
    assert "def " in full
    cut = chat(client, max_tokens=N, stop=["def "])
    assert cut.choices[0].message.content == full[: full.index("def ")]
    assert cut.choices[0].finish_reason == "stop"
    # A raw completion continues the text as is.
    r = client.completions.create(model="qwen", prompt="def add(a, b):\n    return", max_tokens=4,
                                  temperature=0)  # fmt: skip
    assert "a + b" in r.choices[0].text or "a+b" in r.choices[0].text


def test_sigterm_before_listening_ends_it_as_ctrl_c_does(
    real_models: dict[str, Path], tmp_path: Path
) -> None:
    # While the pair loads and auto mode calibrates (seconds here), SIGTERM is Ctrl-C:
    # exit 130 without a traceback (it was a kill by the signal, exit -15).
    env = {**os.environ, "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    args = ["serve", "--port", "0", "-v", "-m", str(real_models[testmodels.TARGET]),
            "-md", str(real_models[testmodels.DRAFT]), "-c", "2048"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "specgguf", *args], cwd=ROOT, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:  # llama.cpp's own log (-v): the target has begun to load
        seen.append(line)
        if "llama_model_loader" in line:
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.stderr.read()
    assert proc.wait(60) == 130, "".join(seen[-5:]) + rest[-2000:]
    assert "Traceback" not in rest and "listening on" not in rest


def test_the_server_holds_its_weights_on_huge_pages(
    server: ServerProcess, real_models: dict[str, Path]
) -> None:
    from specgguf.llama.hugepages import anon_huge_bytes, thp_mode
    from specgguf.llama.runtime import local_gpu_offload, repack_policy

    if thp_mode() != "madvise" or os.environ.get("SPECGGUF_HUGEPAGES") is not None:
        pytest.skip("THP mode not madvise, or SPECGGUF_HUGEPAGES decides: not serve's default")
    if local_gpu_offload() or not repack_policy().use_extra_bufts:
        pytest.skip("the weights are not copied into the server's memory here")
    huge = anon_huge_bytes(server.proc.pid)
    weights = sum(real_models[n].stat().st_size for n in (testmodels.TARGET, testmodels.DRAFT))
    assert huge > 0.7 * weights, (huge, weights)
