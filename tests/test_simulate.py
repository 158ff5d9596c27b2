"""The planner simulator and its traces (issue 34): costs computed by hand on small curves,
the recorder against the tiny pair evaluated independently, the files, and auto mode on
traces built to be hard for it."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specgguf.errors import UsageError
from specgguf.llama.backend import LlamaModel
from specgguf.measure.simulate import (
    GPU_LIKE,
    GREEDY,
    TraceDraftModel,
    _agreement,
    changed_tuning,
    load_curves,
    machine_timings,
    oracle,
    parallel_table,
    simulate,
    simulate_parallel,
    table,
)
from specgguf.measure.traces import (
    Trace,
    TracedGeneration,
    load_trace,
    record_trace,
    save_trace,
)
from specgguf.speculative.draft import Draft
from specgguf.speculative.tuning import AUTO_TUNING

ROOT = Path(__file__).resolve().parent.parent

#: The measured machines of ../shared/machines/curves.json (llama-bench, the 1.5B Qwen
#: target, 2 threads), copied here so that the tests run wherever the repository is.
MACHINES = {
    "xeon-2026-12-02": {"one_row_ms": 67.0, "draft_token": 0.41, "rows": {
        "1": 1.0, "2": 1.34, "3": 1.71, "5": 1.82, "9": 3.01, "17": 4.23, "33": 6.87,
        "65": 12.16}},
    "xeon-2026-11-30": {"one_row_ms": 70.2, "draft_token": 0.54, "rows": {
        "1": 1.0, "2": 1.39, "3": 1.7, "5": 1.72, "9": 2.56, "17": 3.59}},
    "epyc-2026-12-02": {"one_row_ms": 40.0, "draft_token": 0.6, "rows": {
        "1": 1.0, "2": 1.51, "3": 2.05, "5": 2.81, "9": 6.6, "17": 7.7, "33": 12.3,
        "49": 15.6, "65": 20.8}},
}  # fmt: skip

#: one row 10 ms, three rows 12 ms (two interpolated: 11), a draft token 1 ms
SMALL = {"one_row_ms": 10.0, "rows": {"1": 1.0, "3": 1.2, "9": 3.0}, "draft_token": 0.1}


def gen(prompt: list[int], output: list[int], *, right: bool = True, cat: str = "c",
        p: float = 0.9) -> TracedGeneration:  # fmt: skip
    """A generation whose draft chains continue the output (``right``) or never do."""
    chains = [[t if right else 7 for t in (output[i:] + [0] * 16)[:16]]
              for i in range(len(output))]  # fmt: skip
    return TracedGeneration(cat, "q", prompt, output, [0.8] * len(output), chains,
                            [[p] * 16 for _ in output])  # fmt: skip


def test_the_target_alone_costs_one_row_a_token() -> None:
    t = machine_timings(SMALL)
    res = simulate(Trace({}, [gen([1, 2, 3], list(range(10, 20)))]), t, "none", 0)
    assert res.tokens == {"c": 10} and res.steps == 10
    assert res.seconds["c"] == pytest.approx(10 * 0.010)


def test_a_draft_model_step_costs_its_catch_up_drafts_and_the_batch() -> None:
    # K = 2, every draft right, 7 tokens:
    #   pos 0: catch-up of 1 token (1 ms) + 1 more draft token (1 ms) + t(3) 12 ms = 14
    #   pos 3: catch-up of 2 tokens (1 ms * t(2)/t(1) = 1.1) + 1 ms + 12 ms = 14.1
    #   pos 6: one token left, no room for drafts: t(1) = 10
    t = machine_timings(SMALL)
    res = simulate(Trace({}, [gen([1, 2, 3], list(range(10, 17)))]), t, "model", 2)
    assert res.steps == 3
    assert res.seconds["c"] == pytest.approx(0.0381)


def test_what_depth_adds_is_charged_at_each_steps_cached_positions() -> None:
    # 50 us a cached position for a lone row, 100 us for each row of a batch, from 0.
    deep = {**SMALL, "position_row_us": 100.0, "position_single_us": 50.0}
    t = machine_timings(deep)
    # The target alone after a 40-token prompt: the step at output position i has 39 + i
    # positions cached: 10 ms + (39 + i) * 0.05 ms, for i = 0, 1, 2: 30 + 6 = 36 ms.
    tr = Trace({}, [gen(list(range(40)), [50, 51, 52])])
    assert simulate(tr, t, "none", 0).seconds["c"] == pytest.approx(0.036)
    # The draft model at K = 2, both right: catch-up 1 ms, one more draft token 1 ms, and
    # t(3) at 39 cached positions, 12 ms + 3 rows * 39 * 0.1 ms = 23.7 ms: 25.7 ms.
    res = simulate(tr, t, "model", 2)
    assert res.steps == 1 and res.seconds["c"] == pytest.approx(0.0257)
    # Measured deeper than 0: only the positions past the curve's depth add.
    t30 = machine_timings({**deep, "depth": 30})
    assert t30.verify_time(3, 39) == pytest.approx(0.012 + 3 * 9 * 0.0001)
    # Without them, as before: the same at every depth.
    assert machine_timings(SMALL).verify_time(3, 1000) == pytest.approx(0.012)
    # The oracle's lone steps pay the same depth (nothing here is worth drafting).
    wrong = Trace({}, [gen(list(range(40)), [50, 51, 52], right=False)])
    assert oracle(wrong, t).seconds["c"] == pytest.approx(0.036)


def test_position_costs_go_to_the_curves_that_lack_their_own(tmp_path: Path) -> None:
    path = tmp_path / "curves.json"
    path.write_text(json.dumps({"plain": SMALL,
                                "own": {**SMALL, "position_row_us": 7.0}}))  # fmt: skip
    out = load_curves(path, (20.0, 5.0))
    assert (out["plain"].position_row, out["plain"].position_single) == pytest.approx((2e-5, 5e-6))
    assert (out["own"].position_row, out["own"].position_single) == pytest.approx((7e-6, 7e-6))
    assert out["gpu-like"].position_row == out["gpu-like"].position_single == 0.0
    for bad in ({"position_row_us": -1}, {"position_row_us": "fast"},
                {"position_row_us": float("nan")},
                {"position_row_us": 5, "position_single_us": 20}):  # fmt: skip
        with pytest.raises(UsageError, match="microseconds, at least 0"):
            machine_timings({**SMALL, **bad})
    with pytest.raises(UsageError, match="needs position_row_us"):
        machine_timings({**SMALL, "position_single_us": 5})
    for depth in (-1, 1.5, 1e400, True, "64"):
        with pytest.raises(UsageError, match="depth is a number of positions"):
            machine_timings({**SMALL, "depth": depth})


def test_a_rejected_draft_costs_its_batch_and_gives_one_token() -> None:
    t = machine_timings(SMALL)
    res = simulate(Trace({}, [gen([1, 2, 3], list(range(10, 14)), right=False)]), t, "model", 2)
    # pos 0, 1: 2 wrong drafts (a catch-up of 1 token, the draft's wrong first token being
    # dropped, 1 ms + 1 ms; t(3) 12 ms) and one token each; pos 2: room for 1 draft
    # (1 ms + t(2) 11 ms); pos 3: t(1)
    assert res.steps == 4
    assert res.seconds["c"] == pytest.approx(0.014 + 0.014 + 0.012 + 0.010)


def test_a_draft_that_stops_at_an_unsure_token_has_evaluated_it() -> None:
    # Chain [10, 11, 7 (p 0.2), ...] after the prompt, p_min 0.5: the draft stops before
    # the 7, having evaluated 10 and 11 to find it (as ModelDrafter), which its cache then
    # holds: a catch-up of the prompt's last token (1 ms) + 2 ms. A draft cut at K = 2
    # evaluates only 10.
    g = gen([1, 2, 3], [10, 11, 12, 13])
    g.chains = [[10, 11, 7, 7], *g.chains[1:]]
    g.chain_probs = [[0.9, 0.9, 0.2, 0.9], *g.chain_probs[1:]]
    rng = np.random.default_rng(0)
    for k, p_min, tokens, cost, cached in (
        (4, 0.5, [10, 11], 0.003, 5),
        (2, 0.0, [10, 11], 0.002, 4),
    ):
        model = TraceDraftModel(machine_timings(SMALL))
        model.start(g)
        model.prefill([1, 2, 3])
        d = model.propose([1, 2, 3], k, GREEDY, rng, p_min=p_min)
        assert d.tokens == tokens and d.stopped == (p_min > 0)
        assert model.seconds == pytest.approx(cost)
        assert model.cached_tokens([1, 2, 3, 10, 11, 12]) == cached
    # the path 0.9, 0.81, 0.162: 0.5 stops at the third token, as p_min 0.5 does; 0.85 at
    # the second, where p_min 0.85 lets it through; a stopped draft evaluated every token
    # it kept (1 ms each, after the 1 ms catch-up)
    for kw, tokens, cost in (({"p_path_min": 0.5}, [10, 11], 0.003),
                             ({"p_path_min": 0.85}, [10], 0.002),
                             ({"p_min": 0.85}, [10, 11], 0.003)):  # fmt: skip
        model = TraceDraftModel(machine_timings(SMALL))
        model.start(g)
        model.prefill([1, 2, 3])
        d = model.propose([1, 2, 3], 4, GREEDY, rng, **kw)
        assert (d.tokens, d.stopped) == (tokens, True), kw
        assert model.seconds == pytest.approx(cost), kw


def test_sequences_at_once_share_each_step_and_a_finished_ones_sequence_takes_the_next() -> None:
    # The target alone, 2 sequences, on SMALL (t(1) 10 ms, t(2) 11 ms): A (3 tokens) and B
    # (1) together, 11 ms; C takes B's sequence, 11 ms; A alone, 10 ms.
    t = machine_timings(SMALL)
    tr = Trace({}, [gen([1, 2], [10, 11, 12]), gen([3], [20]), gen([4], [30])])
    res = simulate_parallel(tr, t, "none", 2)
    assert res.tokens == {"all": 5} and res.steps == 5
    assert res.seconds["all"] == pytest.approx(0.032)
    # one at a time: a row per token
    assert simulate_parallel(tr, t, "none", 1).seconds["all"] == pytest.approx(0.050)


def test_sequences_drafting_as_many_tokens_are_one_micro_batch_and_uneven_ones_cost_more() -> None:
    t = machine_timings(SMALL)
    # Both draft 2 tokens with the model (every one right; 3 tokens each): the catch-ups
    # (1 row each) in one draft batch, 1 ms * t(2) / t(1) = 1.1 ms, and the second draft
    # token's evaluation, 1.1 ms; the target's 6 rows in one micro-batch, t(6) = 21 ms.
    even = Trace({}, [gen([1, 2], [10, 11, 12]), gen([3], [20, 21, 22])])
    res = simulate_parallel(even, t, "model", 2, 2)
    assert res.steps == 2 and res.seconds["all"] == pytest.approx(0.0232)
    # B has room for no draft (1 token): rows (3, 1), which llama.cpp splits into a row of
    # each, then A's other 2: t(2) + t(2) = 22 ms, not t(4) = 15 ms; padded to 3 rows
    # each, t(6) = 21 ms, the cheaper; and A's drafts, 1 + 1 ms.
    uneven = Trace({}, [gen([1, 2], [10, 11, 12]), gen([3], [20])])
    res = simulate_parallel(uneven, t, "model", 2, 2)
    assert res.steps == 2 and res.seconds["all"] == pytest.approx(0.023)
    # Where 6 rows cost 36 ms, split: 22 + 2 ms.
    steep = machine_timings({**SMALL, "rows": {"1": 1.0, "3": 1.2, "9": 6.0}})
    res = simulate_parallel(uneven, steep, "model", 2, 2)
    assert res.seconds["all"] == pytest.approx(0.024)


def test_auto_mode_with_sequences_at_once_is_not_slower_than_the_target_alone() -> None:
    """On every measured curve and the GPU-like one, 4 sequences at once: auto mode plans
    with the micro-batches (counted from each step's last token, fed the others' rows);
    before, a sequence between two others' ids saw its drafts as free (0.84x the target
    alone on the GPU-like curve with the recorded trace D)."""
    rng = random.Random(5)
    gens = []
    for i in range(12):
        out = [rng.randrange(100, 400) for _ in range(40)]
        right = i % 3 != 0
        gens.append(gen([i + 1, i + 2], out, right=right, cat="c", p=0.9 if right else 0.6))
    tr = Trace({}, gens)
    machines = {**{k: machine_timings(v) for k, v in MACHINES.items()},
                "gpu-like": machine_timings(GPU_LIKE)}  # fmt: skip
    for row in parallel_table(tr, machines, 4):
        assert row.auto >= 0.99 * row.target, row
        assert row.target > 1.0, row


def test_agreement_of_chains_and_trees() -> None:
    out = [6, 7, 9, 4]
    assert _agreement(Draft([6, 7, 8]), out, 0) == 2
    assert _agreement(Draft([5]), out, 0) == 0
    assert _agreement(Draft([9, 4, 1]), out, 2) == 2  # the output ends there
    # root -> 5, root -> 6 -> 7 -> 8: the second branch, two deep
    tree = Draft([5, 6, 7, 8], parents=[-1, -1, 1, 2])
    assert _agreement(tree, out, 0) == 2
    assert _agreement(Draft([6, 9, 7, 4], parents=[-1, 0, 0, 2]), out, 0) == 2  # 6 -> 7


def test_the_oracle_takes_the_best_option_at_each_step() -> None:
    # Output = a copy of the prompt: the lookups draft it all. On SMALL, 3 rows cost 1.2x
    # one and 9 rows 3x: accepting 2 (3 tokens for 12 ms) beats 8 (9 for 30 ms).
    t = machine_timings(SMALL)
    prompt = list(range(100, 140))
    tr = Trace({}, [gen([*prompt, 1], prompt[:20], right=False)])
    res = oracle(tr, t)
    alone = simulate(tr, t, "none", 0)
    assert res.rate() > 2.0 * alone.rate()
    assert res.seconds["c"] <= simulate(tr, t, "suffix", 2).seconds["c"] + 1e-12


def _copying(seed: int, n_gen: int = 4) -> Trace:
    """Generations that copy spans of their prompt half the time, with drafts right 70%
    of the time, in two categories."""
    r = random.Random(seed)
    gens = []
    for q in range(n_gen):
        prompt = [r.randrange(100, 1000) for _ in range(60)]
        out: list[int] = []
        while len(out) < 96:
            if r.random() < 0.5:
                s = r.randrange(0, 50)
                out += prompt[s : s + r.randrange(3, 12)]
            else:
                out += [r.randrange(100, 1000) for _ in range(r.randrange(1, 6))]
        out = out[:96]
        g = gen(prompt, out, cat=f"c{q % 2}")
        g.chains = [[t if r.random() < 0.7 else 5 for t in c] for c in g.chains]
        gens.append(g)
    return Trace({}, gens)


def _hopeless(seed: int, p: float = 0.35) -> Trace:
    """Nothing repeats, and every draft is wrong, the draft giving its tokens ``p``."""
    r = random.Random(seed)
    gens = [gen([r.randrange(100, 10**6) for _ in range(40)],
                [r.randrange(100, 10**6) for _ in range(96)], right=False, p=p)
            for _ in range(3)]  # fmt: skip
    return Trace({}, gens)


@pytest.fixture(scope="module")
def machines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    path = tmp_path_factory.mktemp("curves") / "curves.json"
    path.write_text(json.dumps(MACHINES))
    out = load_curves(path)
    assert list(out) == [*MACHINES, "gpu-like"]
    return out  # type: ignore[return-value]


def test_auto_mode_on_a_hopeless_trace_stays_near_the_target_alone(machines: dict) -> None:
    # What auto mode pays to find out that nothing pays: a few probes per generation of 96
    # tokens; issue 34's bar for a real column is 0.97x. (With a prior of fixed weight
    # the GPU-like curve drafted at every step, at 0.91x: AutoTuning.prior_floor.)
    tr = _hopeless(1)
    for name, t in machines.items():
        auto = simulate(tr, t, "auto").rate()
        alone = simulate(tr, t, "none", 0).rate()
        assert auto >= 0.97 * alone, name


def test_auto_mode_gains_where_copies_pay(machines: dict) -> None:
    rows = {(r.machine, r.category): r for r in table(_copying(2), machines,
                                                       fixed_ks=(2, 4, 8))}  # fmt: skip
    for name in machines:
        r = rows[(name, "all")]
        assert r.auto > 1.0, name
        assert r.oracle >= r.best_fixed, name
    assert rows[("gpu-like", "all")].auto > 1.5


def test_the_target_alone_may_pay_a_python_time_of_its_own(machines: dict) -> None:
    # (scripts/simulate-planner --alone-overhead-ms: auto mode's Python per step is about
    # ten times the target alone's, scripts/bench-overhead.) The same for both: the target
    # alone's own figure; a smaller one for it: auto's rate over it falls, by exactly what
    # the target alone's steps no longer pay.
    tr = _copying(2, n_gen=2)
    t = machines["gpu-like"]
    same = table(tr, {"g": t}, overhead=2e-3, fixed_ks=(4,))
    given = table(tr, {"g": t}, overhead=2e-3, overhead_alone=2e-3, fixed_ks=(4,))
    less = table(tr, {"g": t}, overhead=2e-3, overhead_alone=0.0, fixed_ks=(4,))
    assert [r.auto for r in same] == [r.auto for r in given]
    alone_with = simulate(tr, t, "none", 0, overhead=2e-3).rate()
    alone_without = simulate(tr, t, "none", 0).rate()
    assert alone_without > alone_with
    for a, b in zip(same, less, strict=True):
        if a.category == "all":
            assert b.auto == pytest.approx(a.auto * alone_with / alone_without)


def test_a_gpu_like_curve_is_what_the_issue_says() -> None:
    t = machine_timings(GPU_LIKE)
    assert t.verify_time(17) / t.verify_time(1) == pytest.approx(1.1)
    assert t.verify_time(65) / t.verify_time(1) == pytest.approx(1.6)
    assert t.draft / t.verify_time(1) == pytest.approx(0.08)


def test_bad_curves_are_refused(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="one_row_ms"):
        machine_timings({"rows": {"1": 1.0}})
    with pytest.raises(UsageError, match="1 row"):
        machine_timings({"one_row_ms": 5, "rows": {"2": 1.0}, "draft_token": 0.1})
    bad = tmp_path / "c.json"
    bad.write_text("[1]")
    with pytest.raises(UsageError, match="object of machines"):
        load_curves(bad)


def test_traces_round_trip_and_bad_files_are_refused(tmp_path: Path) -> None:
    tr = _copying(3, n_gen=2)
    tr.meta = {"version": 1, "command": "x"}
    path = tmp_path / "traces" / "t.json.gz"
    save_trace(tr, path)
    back = load_trace(path)
    assert back.generations == tr.generations and back.meta["command"] == "x"
    assert [p.name for p in path.parent.iterdir()] == ["t.json.gz"]  # no temporary left
    (tmp_path / "junk").write_bytes(b"not gzip")
    with pytest.raises(UsageError, match="not a trace"):
        load_trace(tmp_path / "junk")
    with gzip.open(tmp_path / "old", "wt") as f:
        f.write('{"meta": {"version": 0}, "generations": []}')
    with pytest.raises(UsageError, match="version 1"):
        load_trace(tmp_path / "old")
    with gzip.open(tmp_path / "short", "wt") as f:
        f.write(
            '{"meta": {"version": 1}, "generations": [{"category": "c", "question_id": '
            '"1", "prompt": [1], "output": [2, 3], "confidence": [0.5], "chains": [], '
            '"chain_probs": []}]}'
        )
    with pytest.raises(UsageError, match="lengths disagree"):
        load_trace(tmp_path / "short")


def test_the_simulator_script_says_what_is_wrong(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "simulate-planner"),
                        str(tmp_path / "none.json.gz")], capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    trace = tmp_path / "t.json.gz"
    tr = _copying(4, n_gen=1)
    tr.meta = {"version": 1}
    save_trace(tr, trace)
    for args, says in ((["--set", 'p_stop_cost="x"'], "p_stop_cost is a float"),
                       (["--set", "nope=1"], "a field of AutoTuning"),
                       (["--curves", str(tmp_path / "none.json")], "no such file"),
                       (["--machine", "abacus"], "no machine abacus"),
                       (["--position-us", "-1"], "--position-us '-1'"),
                       (["--position-us", "1,2,3"], "ROW or ROW,LONE"),
                       (["--position-us", "inf"], "microseconds of at least 0"),
                       (["--position-us", "5,20"], "LONE at most ROW"),
                       (["--position-us", "fast"], "ROW or ROW,LONE"),
                       (["--parallel", "1"], "--parallel 1: expected 2 to 64")):  # fmt: skip
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "simulate-planner"),
                            str(trace), *args], capture_output=True, text=True,
                           timeout=120)  # fmt: skip
        assert r.returncode == 2 and says in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, args


def test_the_simulator_script_replays_sequences_at_once(tmp_path: Path) -> None:
    trace = tmp_path / "t.json.gz"
    tr = _copying(4, n_gen=3)
    tr.meta = {"version": 1}
    save_trace(tr, trace)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "simulate-planner"), str(trace),
                        "--machine", "gpu-like", "--parallel", "2"], capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode in (0, 1), r.stderr
    assert "2 sequences at once (serve --parallel 2)" in r.stdout
    row = next(line for line in r.stdout.splitlines() if line.startswith("| gpu-like | ") and
               line.count("|") == 7)  # fmt: skip
    # the target alone, 2 sequences at once: 3 generations of 96 tokens, 96 steps of 2
    # rows (15 ms x 1.01) then 96 of one (15 ms), against 288 steps of one: 1.49x; the
    # curve allows 2 t(1) / t(2) = 2 / 1.01 = 1.98x
    assert row.startswith(f"| gpu-like | {288 / (96 * 1.01 + 96):.2f}x |"), row
    assert row.endswith("| 1.98x |"), row


def test_the_simulator_scripts_position_costs_reach_the_curves(tmp_path: Path) -> None:
    # A trace whose drafts are all accepted, 40-token prompts: with 200 us a cached
    # position for each row (and 50 for a lone row) a draft of several rows costs more
    # against a lone row than without, so auto mode's and the oracle's rates fall.
    trace, curves = tmp_path / "t.json.gz", tmp_path / "curves.json"
    save_trace(Trace({"version": 1}, [gen(list(range(40)), list(range(100, 160)))]), trace)
    curves.write_text(json.dumps({"m": SMALL}))
    out = {}
    for extra in ([], ["--position-us", "200,50"]):
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "simulate-planner"), str(trace),
                            "--curves", str(curves), "--machine", "m", "--json",
                            str(tmp_path / "rows.json"), *extra],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        assert r.returncode in (0, 1), r.stderr
        rows = json.loads((tmp_path / "rows.json").read_text())
        out[bool(extra)] = {row["category"]: row for row in rows}["all"]
    assert out[True]["oracle"] < out[False]["oracle"]
    assert out[True]["auto"] < out[False]["auto"]


# -- the recorder, on the tiny pair ----------------------------------------------------


def _greedy(path: Path, ids: list[int], n: int, eog: frozenset[int]) -> list[int]:
    """Greedy decoding one token at a time in a fresh context (the recorder's oracle)."""
    out: list[int] = []
    with LlamaModel(path) as model, model.new_context(n_ctx=512) as ctx:
        logits = ctx.eval(ids, logits="last")
        for _ in range(n):
            tok = int(logits[-1].argmax())
            if tok in eog:
                break
            out.append(tok)
            logits = ctx.eval([tok], logits="last")
    return out


def test_the_recorder_records_the_targets_output_and_the_drafts_chains(
    tiny_models: dict[str, Path],
) -> None:
    target, draft = tiny_models["target"], tiny_models["draft-partial"]
    with LlamaModel(target) as tm, LlamaModel(draft) as dm, \
            tm.new_context(n_ctx=512) as tc, dm.new_context(n_ctx=512) as dc:  # fmt: skip
        prompts = [("a", "1", tm.tokenize("def is_palindrome(text):")),
                   ("b", "2", tm.tokenize("The quick brown fox"))]  # fmt: skip
        tr = record_trace(tc, dc, prompts, 40, tm.eog_ids, {"command": "test"}, depth=6)
        eog = tm.eog_ids
    assert tr.meta["version"] == 1 and tr.categories == ["a", "b"]
    for g, (_, _, ids) in zip(tr.generations, prompts, strict=True):
        assert g.output == _greedy(target, list(ids), 40, eog)
        assert len(g.chains) == len(g.output) and all(len(c) == 6 for c in g.chains)
        assert all(0.0 < p <= 1.0 for p in g.confidence)
        # each chain is the draft's greedy continuation, decoded afresh
        for i in (0, 7, len(g.output) - 1):
            assert g.chains[i] == _greedy(draft, [*ids, *g.output[:i]], 6, frozenset()), i
    # the partial draft agrees with the target sometimes, not always
    firsts = [g.chains[i][0] == g.output[i] for g in tr.generations
              for i in range(len(g.output))]  # fmt: skip
    assert 0 < sum(firsts) < len(firsts)
    assert np.isfinite([p for g in tr.generations for c in g.chain_probs for p in c]).all()


def test_a_changed_tuning_keeps_the_fields_types_and_the_rest() -> None:
    t = changed_tuning(["margin=1", "lookup_z=0.25", "shadow_len=8"])
    assert (t.margin, type(t.margin), t.lookup_z, t.shadow_len) == (1.0, float, 0.25, 8)
    assert t.p_stop == AUTO_TUNING.p_stop and t.lookup_priors == AUTO_TUNING.lookup_priors
    for bad in ("margin", "margin=", "shadow_len=2.5", "lookup_z=[1]", "nope=1"):
        with pytest.raises(UsageError):
            changed_tuning([bad])


def test_the_tuning_benchmark_runs_both_tunings_and_says_what_is_wrong(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    script = [sys.executable, str(ROOT / "scripts" / "bench-tuning")]
    pair = ["-m", str(tiny_models["target"]), "-d", str(tiny_models["draft-identical"])]
    cases = (([], "--set FIELD=VALUE is needed"),
             (["--set", "nope=1"], "a field of AutoTuning"),
             (["--set", "margin=1000", "--rounds", "0"], "--rounds must be 1"),
             (["--set", "margin=1000", "--categories", "nope"], "unknown categor"))  # fmt: skip
    for args, says in cases:
        r = subprocess.run([*script, *pair, *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    out, prompts = tmp_path / "t.json", tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"category": "chat", "prompt": "Repeat this line five times: "
                                    "the sea and the sky."}]))  # fmt: skip
    r = subprocess.run([*script, *pair, "--set", "draft_max_lookup=0", "--prompts",
                        str(prompts), "-n", "48", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = {(x["category"], x["config"]): x for x in json.loads(out.read_text())["results"]}
    assert {c for _, c in rows} == {"target", "auto", "auto-set"}
    # no room for drafts: auto-set drafts nothing where auto drafts (a margin of 1000 did
    # not stop every draft on a loaded machine)
    drafted = {c: sum(v[1] for v in rows[("chat", c)]["by_drafter"].values())
               for c in ("auto", "auto-set")}  # fmt: skip
    assert drafted["auto"] > 0 and drafted["auto-set"] == 0, drafted
    assert "| chat |" in r.stdout and "| overall |" in r.stdout and "auto-set / auto" in r.stdout


def test_steps_let_pass_cost_the_target_alones_python_where_nothing_pays(machines: dict) -> None:
    # Asking costs 2 ms of Python a step, the target alone's steps none, on the GPU-like
    # curve's 15 ms rows (13% of a row, against plan_budget's 3%). Where nothing pays,
    # auto mode lets most steps pass: nearer the target alone than when it asks at every
    # step (plan_budget 0).
    import dataclasses

    tr, t = _hopeless(3), machines["gpu-like"]
    alone = simulate(tr, t, "none", 0, overhead=0.0).rate()
    # (and without the clock's check of drafted steps, which lets steps pass too)
    asking = simulate(tr, t, "auto", overhead=2e-3, overhead_alone=0.0,
                      tuning=dataclasses.replace(AUTO_TUNING, plan_budget=0.0,
                                                 check_steps=False))  # fmt: skip
    passing = simulate(tr, t, "auto", overhead=2e-3, overhead_alone=0.0)
    assert asking.rate() < passing.rate() <= alone
    assert passing.rate() > 0.93 * alone > asking.rate()
    # the same trace and costs with nothing to pay for asking: every step asks, as before
    free = simulate(tr, t, "auto", overhead=2e-3, overhead_alone=2e-3)
    same = simulate(tr, t, "auto", overhead=2e-3, overhead_alone=2e-3,
                    tuning=dataclasses.replace(AUTO_TUNING, plan_budget=0.0))  # fmt: skip
    assert free.rate() == same.rate() and free.steps == same.steps


@pytest.mark.parametrize("overhead,own", [(0.0, 0.0), (2.7e-4, 2.2e-5)])
def test_the_clock_check_of_drafted_steps_keeps_what_copies_gain(
    machines: dict, overhead: float, own: float
) -> None:
    # The check judges a drafted step by the tokens the cost model expected of it. Judged
    # by the tokens kept, a few rejected long drafts made the average negative and auto
    # mode stopped asking: on this trace the Xeon curves fell from 1.28x to 1.04x the
    # target alone. With no Python beyond the replay's (or the issue's measured 0.27 ms a
    # step, the target alone 0.022 ms), the check changes nothing here.
    import dataclasses

    on = dataclasses.replace(AUTO_TUNING, check_steps=True)
    off = dataclasses.replace(AUTO_TUNING, check_steps=False)
    for tr in (_copying(2, 8), _hopeless(1)):
        for name, t in machines.items():
            rates = [simulate(tr, t, "auto", tuning=tu, overhead=overhead,
                              overhead_alone=own).rate() for tu in (on, off)]  # fmt: skip
            assert rates[0] == pytest.approx(rates[1], rel=0.01), name
