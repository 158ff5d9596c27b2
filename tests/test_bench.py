"""`specgguf bench` through the real entry point, on the tiny fixtures."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest

from specgguf import errors

from .helpers import run_cli


def test_bench_json_has_every_configuration_and_same_run_speedups(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    res = run_cli(
        "bench", "-m", str(tiny_models["target"]), "-md", str(tiny_models["draft-partial"]),
        "--draft", "1,2", "-n", "12", "--rounds", "2", "--categories", "code-editing,chat",
        "-c", "2048", "--json",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert set(data) >= {"machine", "results", "memory", "timings"}
    got = {(r["category"], r["config"]) for r in data["results"]}
    configs = {"target", "model-K1", "model-K2", "ngram-K1", "ngram-K2", "suffix-K1",
               "suffix-K2", "auto"}  # fmt: skip
    assert got == {(c, k) for c in ("code-editing", "chat", "overall") for k in configs}
    for r in data["results"]:
        # both rounds pooled (and in "overall", both categories)
        assert len(r["runs_tokens_per_s"]) == (4 if r["category"] == "overall" else 2)
        if r["config"] == "target":
            assert r["speedup"] == 1.0 and r["acceptance_rate"] == 0.0
        assert {"tokens_per_s", "speedup", "acceptance_rate", "mean_accepted"} <= set(r)
    # Speedup is tokens/s over the target alone's in the same category (each rounded to
    # 3 decimals in the report: the ratio of the rounded rates carries their rounding, and
    # the speedup its own, up to 5e-4).
    alone = {r["category"]: r["tokens_per_s"] for r in data["results"] if r["config"] == "target"}
    for r in data["results"]:
        tps, base = r["tokens_per_s"], alone[r["category"]]
        slack = 5e-4 / tps + 5e-4 / base + 5e-4 / max(r["speedup"], 1e-3)
        assert r["speedup"] == pytest.approx(tps / base, rel=slack, abs=5e-4), (r, base)
    # Per-token acceptance (the cost model's a) counts each step's first rejection: it
    # lies between accepted / drafted and 1, and is below 1 where a draft was rejected.
    for r in data["results"]:
        if r["config"].startswith("model"):
            drafted = sum(row[1] for row in r["by_drafter"].values())
            accepted = sum(row[2] for row in r["by_drafter"].values())
            assert 0 < accepted < drafted  # the partial draft: some kept, some rejected
            assert accepted / drafted - 1e-4 <= r["per_token_acceptance"] < 1.0
            assert r["acceptance_rate"] == pytest.approx(accepted / drafted, abs=1e-4)
    auto = [r for r in data["results"] if r["config"] == "auto"]
    # What the batch costs allow, recomputed from the report's own numbers by the cost
    # model: E(K) / (K t_draft + t_verify(K + 1)) at the drafter's pooled acceptance, the
    # calibrated curve interpolated, plus each position cached past the calibration's depth
    # at the category's mean depth, and scaled by the learned corrections.
    t = data["timings"]
    verify = {int(k): v for k, v in t["t_verify"].items()}
    xs = sorted(verify)
    depth = 0

    def t_verify(n: int) -> float:
        if n in verify:
            raw = verify[n]
        else:
            lo = max((x for x in xs if x < n), default=xs[0])
            hi = min((x for x in xs if x > n), default=None)
            if hi is None:
                lo, hi = xs[-2], xs[-1]
            raw = verify[lo] + (n - lo) / (hi - lo) * (verify[hi] - verify[lo])
        per = t["position_single"] if n == 1 else n * t["position_row"]
        raw += max(0, depth - t["depth"]) * per
        return raw * (t["scale_single"] if n == 1 else t["scale_batch"])

    assert [r["category"] for r in auto if "cost_model_limit" not in r] == ["overall"]
    for r in auto:
        if r["category"] == "overall":
            continue
        lim = r["cost_model_limit"]
        assert (
            lim["drafter"] in ("model", "ngram", "none") and 0 <= lim["per_token_acceptance"] <= 1
        )
        assert (lim["drafter"] == "none") == (lim["k"] == 0)
        a, k = lim["per_token_acceptance"], lim["k"]
        # the category's prompt tokens plus half of what it generated, per generation
        depth = lim["depth"]
        assert depth > 0
        td = t["t_draft"] if lim["drafter"] == "model" else 0.0
        want = sum(a**i for i in range(k + 1)) / (k * td + t_verify(k + 1))
        assert lim["tokens_per_s"] == pytest.approx(want, rel=0.02)
        assert lim["speedup"] == pytest.approx(want * t_verify(1), rel=0.02)
        assert lim["speedup"] >= 1.0 - 1e-3  # K = 0 (the target alone) is always allowed
        assert lim["ratio"] == pytest.approx(r["speedup"] / lim["speedup"], rel=1e-2)
    assert data["memory"]["peak_rss"] > data["memory"]["model_files"]
    # The table goes to stderr when stdout carries the JSON.
    assert b"tokens/s" in res.stderr and b"speedup" in res.stderr


def test_bench_plot_needs_matplotlib_or_draws(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    png = tmp_path / "speedup.png"
    res = run_cli(
        "bench", "-m", str(tiny_models["target"]), "--draft", "1,2", "-n", "4", "--rounds", "1",
        "--categories", "chat", "-c", "1024", "--plot", str(png),
    )  # fmt: skip
    if importlib.util.find_spec("matplotlib") is None:
        assert res.returncode == errors.EXIT_USAGE
        assert b"needs matplotlib" in res.stderr
    else:
        assert res.returncode == 0, res.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_bad_arguments(tiny_models: dict[str, Path]) -> None:
    res = run_cli("bench", "-m", str(tiny_models["target"]), "--draft", "x,2")
    assert res.returncode == errors.EXIT_USAGE and b"comma-separated integers" in res.stderr
    res = run_cli("bench", "-m", str(tiny_models["target"]), "--categories", "poetry")
    assert res.returncode == errors.EXIT_USAGE and b"unknown categories" in res.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--draft", "0"], b"1 or more"),
        (["--draft=-3,2"], b"1 or more"),
        (["--draft", ","], b"1 or more"),
        (["--prompts", "{empty}"], b"non-empty JSON list"),
        (["--prompts", "{nokey}"], b"entry 0"),
        (
            ["--plot", "{missing}/x.png"],
            b"cannot write" if importlib.util.find_spec("matplotlib") else b"needs matplotlib",
        ),
    ],
)
def test_bench_refuses_bad_input_before_loading_models(
    tmp_path: Path, args: list[str], message: bytes
) -> None:
    # The target does not exist: refusing with a usage error (not "model not found")
    # shows the check comes first, before a run that could take many minutes.
    (tmp_path / "empty.json").write_text("[]")
    (tmp_path / "nokey.json").write_text('[{"category": "chat"}]')
    paths = {"empty": tmp_path / "empty.json", "nokey": tmp_path / "nokey.json",
             "missing": tmp_path / "no-such-dir"}  # fmt: skip
    args = [a.format(**paths) for a in args]
    res = run_cli("bench", "-m", str(tmp_path / "absent.gguf"), "-md", str(tmp_path / "a.gguf"),
                  *args)  # fmt: skip
    assert res.returncode == errors.EXIT_USAGE, res.stderr
    assert message in res.stderr and b"Traceback" not in res.stderr and res.stdout == b""


def test_bench_reads_spec_bench_and_pools_an_overall_row(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    # Spec-Bench's format: two MT-bench categories (one column, two turns each), qa.
    lines = [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
        {"question_id": 82, "category": "coding", "turns": ["def add(a, b):", "Now sub."]},
        {"question_id": 91, "category": "qa", "turns": ["Who wrote Hamlet?"]},
        {"question_id": 92, "category": "qa", "turns": ["What is the capital of France?"]},
    ]
    jsonl = tmp_path / "question.jsonl"
    jsonl.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    res = run_cli(
        "bench", "-m", str(tiny_models["target"]), "--draft", "2", "-n", "6", "--rounds", "1",
        "--prompts", str(jsonl), "--per-category", "1", "--seed", "3", "-c", "1024", "--json",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr.decode()
    rows = {(r["category"], r["config"]): r for r in json.loads(res.stdout)["results"]}
    assert {c for c, _ in rows} == {"multi-turn", "qa", "overall"}
    for cfg in ("target", "ngram-K2", "suffix-K2", "auto"):
        # One question per column; the multi-turn one counts both turns (up to 12 tokens).
        assert rows[("multi-turn", cfg)]["tokens"] > 6 >= rows[("qa", cfg)]["tokens"]
        parts = rows[("multi-turn", cfg)]["tokens"] + rows[("qa", cfg)]["tokens"]
        assert rows[("overall", cfg)]["tokens"] == parts
        # speedup = this configuration's tokens/s over the target alone's, same column
        for col in ("multi-turn", "qa", "overall"):
            r, t = rows[(col, cfg)], rows[(col, "target")]
            # (both rounded to 3 decimals in the JSON: a relative tolerance)
            want = r["tokens_per_s"] / t["tokens_per_s"]
            assert r["speedup"] == pytest.approx(want, rel=1e-2, abs=2e-3)


def test_suffix_configurations_never_see_the_same_question_answered_before(
    tiny_models: dict[str, Path],
) -> None:
    # Suffix matching remembers earlier generations. In a bench, each configuration and
    # round must start without this question's answer from another run: two suffix
    # configurations over two rounds then draft and accept exactly alike.
    from specgguf.measure.bench import BenchPrompt, run_bench, run_conversation

    from .helpers import load_engine

    prompt = BenchPrompt("chat", ("Tell me about the sea and the sky.",), "q1")
    with load_engine(tiny_models["target"], drafter="none", n_ctx=1024) as engine:
        configs = [("target", "none", 0), ("suffix-a", "suffix", 4), ("suffix-b", "suffix", 4)]
        report = run_bench(engine, [prompt], configs, n=48, rounds=2)
        rows = {r["config"]: r for r in report["results"] if r["category"] == "chat"}
        a, b = rows["suffix-a"]["by_drafter"], rows["suffix-b"]["by_drafter"]
        assert a == b and a["suffix"][1] > 0  # [steps, drafted, accepted]: equal, drafted
        # Control: the engine's own corpus, kept across generations, accepts more on the
        # second run of the same question (it has seen the answer).
        first = run_conversation(engine, prompt, "suffix", 4, 48)
        second = run_conversation(engine, prompt, "suffix", 4, 48)
        assert second.accepted > first.accepted
        assert second.accepted > a["suffix"][2] / 2  # two rounds pooled in a


def test_parallel_bench_gives_each_pass_a_suffix_corpus_of_its_own(
    tiny_models: dict[str, Path],
) -> None:
    # bench --parallel kept the sequences' corpora across its passes: the pass of all
    # prompts at once copied the answers the one-at-a-time pass had just given (83 of 96
    # tokens accepted on a question that accepts none afresh). With a corpus per
    # configuration, width and round, one question drafts and accepts alike in all.
    from specgguf.engine import Engine, EngineConfig, ModelConfig, SpeculativeConfig
    from specgguf.measure.bench import BenchPrompt, generate_together, run_parallel_bench
    from specgguf.speculative.loop import GenerationParams
    from specgguf.speculative.sampling import SamplerParams

    question = "Count from one to ten."  # 48 tokens from the tiny target, none repeated
    config = EngineConfig(
        ModelConfig(tiny_models["target"], n_ctx=1024),
        None,
        SpeculativeConfig(drafter="none", draft_max=16),
        n_parallel=2,
    )
    with Engine(config) as engine:
        configs = [("suffix-a", "suffix", 4), ("suffix-b", "suffix", 4)]
        report = run_parallel_bench(engine, [BenchPrompt("chat", (question,), "q1")],
                                    configs, n=48, rounds=2)  # fmt: skip
        counts = {(r["accepted_1"], r["steps_1"], r["accepted_parallel"], r["steps_parallel"])
                  for r in report["results"]}  # fmt: skip
        assert len(counts) == 1, counts
        ((accepted, steps, _, _),) = counts
        # Control: a corpus kept across generations copies the second answer.
        params = GenerationParams(n_predict=48, sampler=SamplerParams(temperature=0),
                                  drafter="suffix", draft_max=4)  # fmt: skip
        msgs = [{"role": "user", "content": question}]
        with engine.fresh_memory():
            (first,), _ = generate_together(engine, [msgs], params)
            (second,), _ = generate_together(engine, [msgs], params)
        assert len(first.tokens) == len(second.tokens) == 48
        assert (2 * first.stats.accepted, 2 * first.stats.steps) == (accepted, steps)
        assert second.stats.accepted > first.stats.accepted + 24


def test_parallel_sequences_draft_from_what_the_others_generated(
    tiny_models: dict[str, Path],
) -> None:
    # Each sequence of --parallel had a suffix corpus of its own: a question answered on
    # one sequence taught nothing to the next request on another, where one at a time the
    # answer is copied. The corpus is one: the second asking, on the other sequence,
    # copies the first's answer.
    from specgguf.engine import Engine, EngineConfig, ModelConfig, SpeculativeConfig
    from specgguf.measure.bench import generate_together
    from specgguf.speculative.loop import GenerationParams
    from specgguf.speculative.sampling import SamplerParams

    config = EngineConfig(
        ModelConfig(tiny_models["target"], n_ctx=1024),
        None,
        SpeculativeConfig(drafter="none", draft_max=16),
        n_parallel=2,
    )
    params = GenerationParams(n_predict=48, sampler=SamplerParams(temperature=0),
                              drafter="suffix", draft_max=4)  # fmt: skip
    count = [{"role": "user", "content": "Count from one to ten."}]
    other = [{"role": "user", "content": "hello world"}]  # a one-token answer
    with Engine(config) as engine, engine.fresh_memory():
        # sequences 0 and 1 at once, then the other way round
        (first, _), _ = generate_together(engine, [count, other], params)
        (_, again), _ = generate_together(engine, [other, count], params)
    assert again.tokens == first.tokens and len(first.tokens) == 48
    assert again.stats.accepted >= 36 > first.stats.accepted + 24


def test_a_cells_mean_depth_is_its_generations_prompts_and_half_their_output() -> None:
    from specgguf.measure.bench import Cell
    from specgguf.speculative.loop import GenerationStats

    cell = Cell("multi-turn", "auto")
    # A two-turn conversation: prompts of 100 and 300 tokens (the second holds the first
    # answer), 128 tokens generated in each; then a one-turn question of 60 tokens, 20 out.
    cell.add(GenerationStats(prompt_tokens=400, generated=256), generations=2)
    cell.add(GenerationStats(prompt_tokens=60, generated=20))
    assert cell.generations == 3
    assert cell.mean_depth == round((460 + 276 / 2) / 3)  # 199


# --- progress and the cached calibration --------------------------------------------------

_STEP = re.compile(rb"bench: \[(\d+)/(\d+)\] (\S+), question (\d+)/(\d+) \((\S+)\), "
                   rb"round (\d+)/(\d+), \d+ s")  # fmt: skip


def test_bench_reports_each_configuration_and_question_when_stderr_is_not_a_terminal(
    tiny_models: dict[str, Path],
) -> None:
    # A run in a pipeline or CI (stderr a pipe here) printed nothing for 590 s: one line per
    # round, question and configuration, numbered, in the order they run, on stderr only.
    res = run_cli(
        "bench", "-m", str(tiny_models["target"]), "-md", str(tiny_models["draft-partial"]),
        "--draft", "1,2", "-n", "4", "--rounds", "2", "--categories", "code-editing,chat",
        "-c", "1024", "--json",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr.decode()
    lines = res.stderr.splitlines()
    steps = [m.groups() for m in map(_STEP.fullmatch, lines) if m]
    # the registry's order: the lookups, then the draft model
    configs = ["target", "ngram-K1", "ngram-K2", "suffix-K1", "suffix-K2", "model-K1",
               "model-K2", "auto"]  # fmt: skip
    want = [(r, q, cat, name) for r in (1, 2) for q, cat in ((1, "code-editing"), (2, "chat"))
            for name in configs]  # fmt: skip
    assert len(steps) == len(want) == 32, res.stderr.decode()
    for i, (got, (r, q, cat, name)) in enumerate(zip(steps, want, strict=True), 1):
        assert got == (str(i).encode(), b"32", name.encode(), str(q).encode(), b"2",
                       cat.encode(), str(r).encode(), b"2")  # fmt: skip
    # The calibration says itself before the first step and after it, and the table comes
    # after the last step.
    first = lines.index(next(x for x in lines if _STEP.fullmatch(x)))
    assert lines[0].startswith(b"bench: calibration: checking the pair's cached timings")
    assert re.fullmatch(rb"bench: calibration (reused from|measured in) .*", lines[1]), lines[1]
    assert first == 2
    table = next(i for i, x in enumerate(lines) if b"tokens/s" in x and b"speedup" in x)
    assert table > first + 31
    # stdout is the JSON alone.
    assert {"results", "calibration"} <= set(json.loads(res.stdout))


def test_bench_parallel_reports_each_question_and_batch(tiny_models: dict[str, Path]) -> None:
    res = run_cli(
        "bench", "-m", str(tiny_models["target"]), "--draft", "2", "-n", "4", "--rounds", "1",
        "--categories", "code-editing,chat", "-c", "1024", "-np", "2",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr.decode()
    steps = [x for x in res.stderr.splitlines() if x.startswith(b"bench: [")]
    # per configuration: each question one at a time, then both at once
    configs = ["target", "ngram-K2", "suffix-K2", "auto"]
    want = [part for name in configs for part in (
        f"{name}, one at a time, question 1/2", f"{name}, one at a time, question 2/2",
        f"{name}, 2 questions, 2 at once")]  # fmt: skip
    assert [re.sub(rb"^bench: \[\d+/12\] (.*), round 1/1, \d+ s$", rb"\1", x).decode()
            for x in steps] == want  # fmt: skip
    assert b"calibration: " in res.stdout and b"bench:" not in res.stdout


def test_bench_parallel_refuses_fewer_prompts_than_sequences_before_loading(
    tiny_models: dict[str, Path],
) -> None:
    # One built-in chat prompt and -np 2: "2 at once" would run one sequence and still
    # print a ratio. Refused with the count, before the model loads.
    res = run_cli("bench", "-m", str(tiny_models["target"]), "--categories", "chat",
                  "-np", "2", "-n", "4")  # fmt: skip
    err = res.stderr.decode()
    assert res.returncode == 2, err
    assert "--parallel 2 needs at least 2 prompts; the selection has 1" in err
    assert "Traceback" not in err and "llama" not in err.lower()


def _cached(file: Path, key: str) -> dict[str, Any]:
    entry: dict[str, Any] = json.loads(file.read_text())[key]
    return entry


def test_a_second_bench_reuses_the_pairs_calibration_unless_asked_to_measure_again(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    # Each bench recalibrated (4.5 minutes on a busy machine). Now the pair's cached
    # calibration is reused, and the report says so and from which file.
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    file = tmp_path / "cache" / "specgguf" / "calibration.json"

    def bench(*extra: str) -> tuple[dict[str, Any], bytes, bytes]:
        res = run_cli(
            "bench", "-m", str(tiny_models["target"]), "--draft", "1", "-n", "2",
            "--rounds", "1", "--categories", "chat", "-c", "1024", *extra, env=env,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr.decode()
        data = json.loads(res.stdout) if "--json" in extra else {}
        return data, res.stdout, res.stderr

    data, _, err = bench("--json")
    (first,) = data["calibration"]
    assert first["reused"] is False and first["why"] == "none cached for this pair"
    assert first["file"] == str(file) and first["saved"] is True and first["mode"] == "normal"
    assert b"bench: calibration measured in " in err
    assert f"none cached for this pair), saved to {file}".encode() in err
    key = first["key"]
    # Plant timings no step of this machine can beat (1 ns), measured on 2026-01-01: the
    # fresh decode step that checks them is slower, so the cached ones are kept (the
    # machine is busier now than then), and the report carries exactly them.
    planted = {**_cached(file, key), "time": 1767225600.0}
    planted["verify"] = {n: 1e-9 * int(n) for n in planted["verify"]}
    file.write_text(json.dumps({key: planted}))
    data, _, err = bench("--json")
    (second,) = data["calibration"]
    assert second["reused"] is True and second["key"] == key and second["why"] is None
    assert second["measured_at"] == "2026-01-01T00:00:00+00:00"
    assert second["fresh_step_ratio"] > 1
    assert data["timings"]["t_verify"] == {n: float(f"{v:.4g}")
                                           for n, v in planted["verify"].items()}  # fmt: skip
    assert _cached(file, key) == planted  # not measured, not written
    assert f"calibration reused from {file} (measured 2026-01-01T00:00:00+00:00)".encode() in err
    # the table's note (on stderr with --json)
    assert re.search(rb"calibration: reused from \S+ \(measured 2026-01-01T00:00:00\+00:00\); "
                     rb"a fresh decode step took \S+x the calibrated one: the machine is busier "
                     rb"now; --recalibrate measures it again", err), err  # fmt: skip
    # --recalibrate measures it again, and caches it for the next run.
    _, out, err = bench("--recalibrate")
    want = f"calibration: measured in this run (recalibration asked for), saved to {file}"
    assert want.encode() in out and b"bench:" not in out
    again = _cached(file, key)
    assert again["time"] > planted["time"] and again["verify"] != planted["verify"]
    # A cached calibration far slower than a fresh step (measured while the machine was
    # busy: 100 s a step) is measured again without being asked.
    slow = {**again, "verify": {n: 100.0 for n in again["verify"]}}
    file.write_text(json.dumps({key: slow}))
    data, _, _ = bench("--json")
    (third,) = data["calibration"]
    assert third["reused"] is False and "measured while the machine was busy" in third["why"]
    assert _cached(file, key)["verify"] != slow["verify"]


def test_a_large_target_loading_without_a_terminal_reports_every_ten_seconds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # bench and run load through LoadProgress: a 40 GB target was silent until loaded.
    from specgguf.cli import display

    now = [0.0]
    big = tmp_path / "big.gguf"
    with display.LoadProgress({big: 40 * 2**30}, live=False, clock=lambda: now[0]) as progress:
        for t, share in ((0, 0.0), (5, 0.1), (12, 0.3), (15, 0.35), (21, 0.5), (23, 0.6),
                         (26, 1.0)):  # fmt: skip
            now[0] = t
            progress(big, share)
    assert capsys.readouterr().err.splitlines() == [
        "specgguf: loading big.gguf (40.00 GiB): 30%, 12 s",
        "specgguf: loading big.gguf (40.00 GiB): 60%, 23 s",
        "specgguf: loaded big.gguf (40.00 GiB) in 26.00 s",
    ]


def test_a_categorys_sample_is_the_same_whichever_categories_are_asked_for() -> None:
    # `bench --categories summarization --per-category 10 --seed 2` measured other
    # questions than the summarization column of `--per-category 10 --seed 2`: it sampled
    # after filtering, and the sample draws every category from one generator in turn.
    from specgguf.measure.bench import BenchPrompt, sample_per_category, select_prompts

    cats3 = ("writing", "translation", "summarization")
    prompts = [BenchPrompt(c, (f"{c} {i}",), f"{c}-{i}") for c in cats3 for i in range(8)]
    for seed in range(20):
        whole = sample_per_category(prompts, 3, seed)
        assert [p.category for p in whole].count("summarization") == 3
        for cats in (["summarization"], ["translation", "summarization"]):
            alone = select_prompts(prompts, cats, 3, seed)
            assert alone == [p for p in whole if p.category in cats], (seed, cats)
    assert select_prompts(prompts, None, None, 0) == prompts
    assert select_prompts(prompts, ["writing"], None, 0) == prompts[:8]
    with pytest.raises(errors.UsageError, match=r"unknown categories \['poetry'\]"):
        select_prompts(prompts, ["poetry", "writing"], 3, 0)


def test_a_configuration_given_a_tuning_runs_auto_mode_with_it(
    tiny_models: dict[str, Path],
) -> None:
    # scripts/bench-tuning measures a tuning change beside the current tuning: the
    # configuration named in `tunings` must plan with that tuning, the others with the
    # engine's, which is the engine's again afterwards. A margin no draft can meet turns
    # auto mode's drafting off: the control drafts on the same question.
    import dataclasses

    from specgguf.measure.bench import BenchPrompt, run_bench
    from specgguf.speculative.tuning import AUTO_TUNING

    from .helpers import load_engine

    prompt = BenchPrompt("chat", ("Repeat this line five times: the sea and the sky.",), "q1")
    never = dataclasses.replace(AUTO_TUNING, margin=1000.0)
    with load_engine(tiny_models["target"], drafter="none", n_ctx=1024) as engine:
        own = engine.drafting.tuning
        configs = [("auto", "auto", 8), ("auto-never", "auto", 8)]
        report = run_bench(engine, [prompt], configs, n=48, rounds=1,
                           tunings={"auto-never": never})  # fmt: skip
        assert engine.drafting.tuning is own
        # a tuning for no configuration, or for one that is not auto mode, is refused
        for name in ("auto-nevr", "target"):
            with pytest.raises(errors.UsageError, match="not an auto-mode configuration"):
                run_bench(engine, [prompt], [*configs, ("target", "none", 0)], n=48,
                          rounds=1, tunings={name: never})  # fmt: skip
    rows = {r["config"]: r for r in report["results"] if r["category"] == "chat"}
    drafted = {name: sum(v[1] for v in row["by_drafter"].values()) for name, row in rows.items()}
    assert drafted["auto"] > 0 and drafted["auto-never"] == 0, drafted
