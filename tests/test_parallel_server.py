"""``serve --parallel`` on the tiny models: several requests in one target batch give each
what it gives alone, through the engine and over HTTP, and llama-server ``-np 4`` gives
the same greedy texts (when its tools are built: ``scripts/bench-llama-cpp
--build-only``)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from specgguf.engine import Engine, EngineConfig, ModelConfig, SpeculativeConfig
from specgguf.measure.bench import generate_together
from specgguf.speculative.loop import GenerationParams, GenerationResult
from specgguf.speculative.sampling import SamplerParams

from .helpers import ServerProcess
from .test_mtp_oracle import llama_tools_dir
from .test_server import _loopback_only, env  # noqa: F401 (fixtures)

PROMPTS = ["def is_palindrome(text):", "The quick brown fox", "for i in range(10):\n",
           "Once upon a time", "import numpy as np\n"]  # fmt: skip
GREEDY = GenerationParams(n_predict=40, sampler=SamplerParams(temperature=0.0), ignore_eos=True)


def engine(tiny: dict[str, Path], n_parallel: int, drafter: str, **kw: Any) -> Engine:
    return Engine(
        EngineConfig(
            ModelConfig(tiny["target"], n_ctx=512), ModelConfig(tiny["draft-partial"], n_ctx=512),
            SpeculativeConfig(drafter=drafter, draft_max=4), n_parallel=n_parallel, **kw,
        )
    )  # fmt: skip


def batched(e: Engine, prompts: list[str], params: GenerationParams) -> list[GenerationResult]:
    """Every prompt at once, each on a sequence of its own."""
    return generate_together(e, prompts, params)[0]


@pytest.mark.parametrize("drafter", ["none", "ngram", "model", "auto"])
def test_sequences_generated_together_equal_each_alone(
    tiny_models: dict[str, Path], drafter: str
) -> None:
    with engine(tiny_models, 1, drafter) as one:
        alone = [one.generate(p, GREEDY).run() for p in PROMPTS[:4]]
    with engine(tiny_models, 4, drafter) as four:
        together = batched(four, PROMPTS[:4], GREEDY)
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    assert all(len(r.tokens) == 40 for r in together)
    if drafter == "model":  # each request's own draft counts
        assert [r.stats.drafted for r in together] == [r.stats.drafted for r in alone]


def test_verifications_padded_to_even_rows_leave_every_output_as_alone(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a cost where rows are nearly free (a GPU's), the batcher pads the target's
    batches of verifications with throw-away rows, which llama.cpp writes and the batcher
    then drops: each request's text is still what it is alone."""
    from specgguf.llama.backend import LlamaContext

    with engine(tiny_models, 1, "model") as one:
        alone = [one.generate(p, GREEDY).run() for p in PROMPTS[:3]]
    shapes: list[list[int]] = []
    decode_many = LlamaContext.decode_many

    def spy(self: LlamaContext, parts: Any) -> Any:
        if all(w == "all" for _, _, w in parts):
            shapes.append([len(t) for _, t, _ in parts])
        return decode_many(self, parts)

    monkeypatch.setattr(LlamaContext, "decode_many", spy)
    several: dict[str, list[list[int]]] = {}
    for name, cost in (("rows cost little", lambda n, cached: 1.0 + 0.001 * n),
                       ("rows cost much", lambda n, cached: 0.1 + 1.0 * n)):  # fmt: skip
        shapes.clear()
        with engine(tiny_models, 3, "model") as three:
            three.start_batching().cost = cost
            together = batched(three, PROMPTS[:3], GREEDY)
        assert [r.tokens for r in together] == [r.tokens for r in alone], name
        assert [r.stats.drafted for r in together] == [r.stats.drafted for r in alone], name
        several[name] = [sh for sh in shapes if len(sh) > 1]
    # Batches of several verifications: uneven where rows cost much, and every one even
    # (padded) where they cost little.
    assert any(len(set(sh)) > 1 for sh in several["rows cost much"])
    assert several["rows cost little"]
    assert all(len(set(sh)) == 1 for sh in several["rows cost little"])


def test_llama_cpp_splits_a_batch_of_sequences_as_the_cost_model_says(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp as the oracle of :func:`micro_batches`: its graph-evaluation callback
    (``cb_eval``) is asked once per node of every micro-batch's graph, so a decode's
    calls divided by those of a one-row decode count its micro-batches."""
    import llama_cpp

    from specgguf.llama.backend import LlamaContext, LlamaModel
    from specgguf.speculative.costmodel import micro_batches

    from .test_costmodel import MICRO_BATCH_CASES

    asked = [0]

    @llama_cpp.ggml_backend_sched_eval_callback  # type: ignore[misc]
    def count(tensor: Any, ask: bool, user_data: Any) -> bool:
        asked[0] += int(ask)
        return False  # (nothing observed: the graph runs as without a callback)

    model = LlamaModel(tiny_models["target"])
    try:
        lc = model._lc
        default = lc.llama_context_default_params

        def with_callback() -> Any:
            params = default()
            params.cb_eval = count
            return params

        monkeypatch.setattr(lc, "llama_context_default_params", with_callback)
        ctx = LlamaContext(model, n_ctx=256, n_batch=256, n_ubatch=128, n_outputs_max=256,
                           n_parallel=4)  # fmt: skip
        monkeypatch.setattr(lc, "llama_context_default_params", default)
        seqs = [ctx.sequence(i) for i in range(4)]
        for s in seqs:
            s.eval([5 + s._home, 6, 7], logits="none")

        def graphs_asked(rows: list[tuple[int, int]]) -> int:
            asked[0] = 0
            ctx.decode_many([(seqs[i], [9 + j for j in range(n)], "all") for i, n in rows if n])
            for i, _ in rows:
                seqs[i].rollback(3)
            return asked[0]

        per_graph = graphs_asked([(0, 1)])
        assert per_graph > 0
        for rows, expected in MICRO_BATCH_CASES:
            if not rows:
                continue
            got = graphs_asked(rows)
            assert got % per_graph == 0, (rows, got, per_graph)
            assert got // per_graph == len(micro_batches(rows, 128)) == len(expected), rows
    finally:
        model.close()


def test_auto_mode_plans_each_step_with_the_rows_of_the_others(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from specgguf.speculative.costmodel import Timings

    seen: set[tuple[int, tuple[int, ...], int]] = set()
    verify_time = Timings.verify_time

    def spy(self: Timings, n: int, cached: int = 0) -> float:
        seen.add((self.seq, tuple(self.others), self.n_ubatch))
        return verify_time(self, n, cached)

    monkeypatch.setattr(Timings, "verify_time", spy)
    with engine(tiny_models, 3, "auto") as three:
        batched(three, PROMPTS[:3], GREEDY)
        n_ubatch = three.target_ctx.n_ubatch
    # every sequence planned beside the two others (by their sequence ids) at some step,
    # with the context's micro-batch size
    for seq, others in ((0, (1, 2)), (1, (0, 2)), (2, (0, 1))):
        assert (seq, others, n_ubatch) in seen, seen


def test_deterministic_sequences_together_equal_each_alone(tiny_models: dict[str, Path]) -> None:
    sampled = dataclasses.replace(
        GREEDY, sampler=SamplerParams(temperature=0.8, seed=7), deterministic=True
    )
    with engine(tiny_models, 1, "model", deterministic=True) as one:
        alone = [one.generate(p, sampled).run() for p in PROMPTS[:3]]
    with engine(tiny_models, 3, "model", deterministic=True) as three:
        together = batched(three, PROMPTS[:3], sampled)
    assert [r.tokens for r in together] == [r.tokens for r in alone]


def test_parallel_is_refused_where_a_sequence_cannot_be_shared(
    tiny_models: dict[str, Path],
) -> None:
    from specgguf.errors import UsageError

    with pytest.raises(UsageError, match="drafts for one sequence at a time"):
        Engine(EngineConfig(ModelConfig(tiny_models["hybrid"]),
                            ModelConfig(tiny_models["hybrid-draft"]), n_parallel=2))  # fmt: skip


@pytest.mark.parametrize("drafter", ["mtp", "auto"])
def test_each_sequence_drafts_with_mtp_layers_of_its_own(
    tiny_models: dict[str, Path], drafter: str
) -> None:
    """The target's MTP layers draft for every sequence of ``--parallel``, each from its
    own hidden states: four at once give each request's text and its drafted and accepted
    counts as alone (llama-server's users report MTP acceptance collapsing with several
    slots: unsloth #7717)."""

    def mtp_engine(n: int) -> Engine:
        return Engine(EngineConfig(ModelConfig(tiny_models["mtp"], n_ctx=512), None,
                                   SpeculativeConfig(drafter=drafter, draft_max=4),
                                   n_parallel=n))  # fmt: skip

    with mtp_engine(1) as one:
        alone = [one.generate(p, GREEDY).run() for p in PROMPTS[:4]]
    with mtp_engine(4) as four:
        heads = [s.drafting.get("mtp") for s in four.slots]  # auto mode weighs them too
        assert len({id(getattr(h, "head", None)) for h in heads if h is not None}) == 4
        together = batched(four, PROMPTS[:4], GREEDY)
    assert [r.tokens for r in together] == [r.tokens for r in alone]
    if drafter == "mtp":
        assert [r.stats.accepted for r in together] == [r.stats.accepted for r in alone]
        assert [r.stats.drafted for r in together] == [r.stats.drafted for r in alone]
        assert all(r.stats.drafted > 0 for r in together)
        assert sum(r.stats.accepted for r in together) > 0


# -- over HTTP -------------------------------------------------------------------------------


def complete(url: str, prompt: str, n: int = 40, **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, **extra}
    r = httpx.post(f"{url}/v1/completions", timeout=120, json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def args(tiny: dict[str, Path], *extra: str) -> list[str]:
    return ["-m", str(tiny["target"]), "-md", str(tiny["draft-partial"]), "-c", "1024", *extra]


@pytest.fixture(scope="module")
def server(tiny_models: dict[str, Path], env: dict[str, str]) -> Iterator[ServerProcess]:  # noqa: F811
    # A fixed drafter: each request's draft counts are then its own alone too.
    with ServerProcess(*args(tiny_models, "-np", "4", "--drafter", "model", "--draft", "4"),
                       env=env) as s:  # fmt: skip
        yield s


@pytest.fixture(scope="module")
def det_server(tiny_models: dict[str, Path], env: dict[str, str]) -> Iterator[ServerProcess]:  # noqa: F811
    """Deterministic mode: a request's output is what it is alone whatever runs beside it
    and whenever it arrives (without it, which requests share a batch depends on timing,
    and a long greedy text of the tiny models can meet a near-tie)."""
    with ServerProcess(*args(tiny_models, "-np", "4", "--drafter", "model", "--draft", "4",
                             "--deterministic"), env=env) as s:  # fmt: skip
        yield s


def test_four_clients_at_once_get_what_each_gets_alone(server: ServerProcess) -> None:
    assert "parallel 4, n_ctx 1024 each" in server.stderr
    alone = [complete(server.url, p) for p in PROMPTS[:4]]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: complete(server.url, p), PROMPTS[:4]))
    assert [r["choices"][0]["text"] for r in together] == [r["choices"][0]["text"] for r in alone]
    for r, a in zip(together, alone, strict=True):  # each request's own counts
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")
        assert [r["usage"][k] for k in counts] == [a["usage"][k] for k in counts]
        assert r["timings"]["draft_n"] == a["timings"]["draft_n"]
        # each went to the sequence that held its prompt: all of it reused but its last
        # token (which opens the first step)
        cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == r["usage"]["prompt_tokens"] - 1 == r["timings"]["cache_n"]


def stream_chunks(url: str, prompt: str, n: int, stop_after: int | None = None) -> str:
    """A streamed completion's text; with ``stop_after``, the connection is dropped after
    that many text chunks."""
    text, got = [], 0
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = json.loads(line[6:])["choices"][0]["text"]
            if piece:
                text.append(piece)
                got += 1
                if stop_after is not None and got >= stop_after:
                    break
    return "".join(text)


def test_a_client_leaving_mid_stream_leaves_the_three_others_whole(
    det_server: ServerProcess,
) -> None:
    server, n = det_server, 400
    alone = [complete(server.url, p, n)["choices"][0]["text"] for p in PROMPTS[1:4]]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        left = pool.submit(stream_chunks, server.url, PROMPTS[0], 2000, 2)
        others = [pool.submit(stream_chunks, server.url, p, n) for p in PROMPTS[1:4]]
        # (the waits only end a hang: 69 s here with both cores busy elsewhere)
        assert left.result(600)
        assert [f.result(600) for f in others] == alone
    # The server took the dropped request's sequence back: all four answer again.
    deadline = time.monotonic() + 30
    while "specgguf_requests_running 0.0" not in httpx.get(f"{server.url}/metrics").text:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def stream_until(url: str, prompt: str, n: int, enough: Callable[[str], bool]) -> tuple[str, bool]:
    """A streamed completion's text, read until ``enough(text)`` holds (the connection is
    then dropped) or the stream ends; and whether it ended (all ``n`` tokens sent)."""
    text = ""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                return text, True
            if line.startswith("data: "):
                text += json.loads(line[6:])["choices"][0]["text"]
                if enough(text):
                    return text, False
    return text, True


def test_a_request_arriving_mid_generation_is_answered_beside_them(
    det_server: ServerProcess,
) -> None:
    # Counted work, not a race: the three ask for 900 tokens (most of their 1024
    # positions) and are read until the late request (40 tokens) has been answered and
    # each has the text it gives alone for 300; then dropped. One still generating then
    # shows the late one was answered beside them (a server serving it after them would
    # have sent all 900 tokens of each first).
    server, n, late_done = det_server, 300, threading.Event()
    alone = complete(server.url, PROMPTS[4], 40)["choices"][0]["text"]
    running_alone = [complete(server.url, p, n)["choices"][0]["text"] for p in PROMPTS[:3]]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = [
            pool.submit(stream_until, server.url, p, 900,
                        lambda text, want=want: late_done.is_set() and len(text) >= len(want))
            for p, want in zip(PROMPTS[:3], running_alone, strict=True)
        ]  # fmt: skip
        deadline = time.monotonic() + 120  # (only ends a hang)
        while "specgguf_requests_running 3.0" not in httpx.get(f"{server.url}/metrics").text:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        late = complete(server.url, PROMPTS[4], 40)
        late_done.set()
        got = [f.result(600) for f in running]
    assert late["choices"][0]["text"] == alone
    for (text, _), want in zip(got, running_alone, strict=True):
        assert text.startswith(want)  # what each gives alone, the late request beside it
    assert not all(ended for _, ended in got)  # still generating once it was answered


def test_parallel_sequences_and_then_the_queue_then_503(
    tiny_models: dict[str, Path],
    env: dict[str, str],  # noqa: F811
) -> None:
    with ServerProcess(*args(tiny_models, "-np", "2", "--max-queue", "1", "-c", "8192"),
                       env=env) as s:  # fmt: skip
        long = {"prompt": PROMPTS[0], "max_tokens": 8000, "temperature": 0, "ignore_eos": True}
        stop = threading.Event()
        results: list[int] = []

        def hold() -> None:
            with httpx.stream("POST", f"{s.url}/v1/completions", json={**long, "stream": True},
                              timeout=120) as r:  # fmt: skip
                for _ in r.iter_lines():
                    if stop.is_set():
                        break
            results.append(r.status_code)

        holders = [threading.Thread(target=hold) for _ in range(2)]
        for t in holders:
            t.start()
        waiting: dict[str, int] = {}
        queued = threading.Thread(target=lambda: waiting.update(
            code=httpx.post(f"{s.url}/v1/completions", json={**long, "max_tokens": 4},
                            timeout=120).status_code))  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            m = httpx.get(f"{s.url}/metrics").text
            if "specgguf_requests_running 2.0" in m:
                break
            assert time.monotonic() < deadline, m
            time.sleep(0.02)
        queued.start()
        while "specgguf_queue_length 1.0" not in httpx.get(f"{s.url}/metrics").text:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = httpx.post(f"{s.url}/v1/completions", json={**long, "max_tokens": 4}, timeout=60)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
        stop.set()
        for t in holders:
            t.join(60)
        queued.join(60)
        assert waiting["code"] == 200 and results == [200, 200]


# -- llama-server as the oracle ----------------------------------------------------------------


def test_llama_server_np4_gives_the_same_greedy_texts(
    tiny_models: dict[str, Path],
    env: dict[str, str],  # noqa: F811
) -> None:
    bindir = llama_tools_dir()
    tool = bindir / "llama-server" if bindir is not None else None
    if tool is None or not tool.is_file():
        why = "llama-server is not built (scripts/bench-llama-cpp --build-only)"
        if os.environ.get("SPECGGUF_REQUIRE_LLAMA_TOOLS") == "1":
            pytest.fail(f"SPECGGUF_REQUIRE_LLAMA_TOOLS=1 but {why}")
        pytest.skip(why)
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # -c is shared by llama-server's slots: 4 x 1024 as specgguf's -c 1024 -np 4.
    proc = subprocess.Popen(
        [str(tool), "-m", str(tiny_models["target"]), "-c", "4096", "-np", "4", "--port",
         str(port), "--host", "127.0.0.1", "-t", "2", "--no-webui"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "llama-server did not start"
            time.sleep(0.2)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            theirs = list(pool.map(lambda p: complete(url, p), PROMPTS[:4]))
    finally:
        proc.terminate()
        proc.wait(30)
    ours_args = ["-m", str(tiny_models["target"]), "-c", "1024", "-np", "4", "--drafter", "none"]
    with ServerProcess(*ours_args, env=env) as s, concurrent.futures.ThreadPoolExecutor(4) as pool:
        ours = list(pool.map(lambda p: complete(s.url, p), PROMPTS[:4]))
    assert [r["choices"][0]["text"] for r in ours] == [r["choices"][0]["text"] for r in theirs]
    assert all(r["usage"]["completion_tokens"] == 40 for r in ours)


def test_hybrid_target_sequences_together_equal_each_alone(tiny_models: dict[str, Path]) -> None:
    """A recurrent state's evaluations are decoded one sequence at a time, each one's
    logits its own (the next decode reuses llama.cpp's buffer)."""

    def load(n: int) -> Engine:
        return Engine(EngineConfig(ModelConfig(tiny_models["hybrid"], n_ctx=512), None,
                                   SpeculativeConfig(drafter="ngram", draft_max=4),
                                   n_parallel=n))  # fmt: skip

    prompts = ["def f(x):", "hello there", "abc abc abc abc"]
    with load(1) as one:
        alone = [one.generate(p, GREEDY).run().tokens for p in prompts]
    with load(3) as three:
        together, _ = generate_together(three, prompts, GREEDY)
    assert [r.tokens for r in together] == alone


def test_a_parallel_that_does_not_fit_is_refused_before_loading(
    tiny_models: dict[str, Path],
) -> None:
    from .helpers import run_cli

    res = run_cli("serve", "-m", str(tiny_models["target"]), "-c", "200000", "-np", "4000",
                  "--port", "0")  # fmt: skip
    err = res.stderr.decode()
    assert res.returncode == 5, err
    assert "KV cache" in err and "Traceback" not in err
    # the hint names -np as a second way out, not as another name for -c
    assert "a smaller -np/--parallel too: the KV cache holds -np x -c positions" in err


def test_decode_many_reads_tokens_given_as_lists_or_arrays(tiny_models: dict[str, Path]) -> None:
    """Each sequence's tokens go into the batch as they are, a list or an array, one
    token or several; the cache holds them, and each gets the logits it would alone."""
    import numpy as np

    from specgguf.llama.backend import LlamaContext, LlamaModel

    model = LlamaModel(tiny_models["target"])
    try:
        ctx = LlamaContext(model, n_ctx=256, n_batch=64, n_ubatch=64, n_outputs_max=64,
                           n_parallel=3)  # fmt: skip
        a, b, c = (ctx.sequence(i) for i in range(3))
        out = ctx.decode_many([(a, [5], "last"), (b, np.array([7, 8, 9]), "all"),
                               (c, (11,), "none")])  # fmt: skip
        together = [np.array(o) for o in out]
        assert [a.n_past, b.n_past, c.n_past] == [1, 3, 1]
        assert [len(o) for o in together] == [1, 3, 0]
        assert a.cached_prefix([5, 0]) == 1 and b.cached_prefix([7, 8, 9]) == 3
        assert c.cached_prefix([11]) == 1
        for s in (a, b, c):
            s.rollback(0)
        alone_a = np.array(a.eval([5], logits="last"))
        alone_b = np.array(b.eval([7, 8, 9], logits="all"))
        np.testing.assert_allclose(together[0], alone_a, rtol=0, atol=1e-3)
        np.testing.assert_allclose(together[1], alone_b, rtol=0, atol=1e-3)
    finally:
        model.close()
