"""``specgguf bench``: every configuration side by side in one process, interleaved, on a
built-in prompt set with categories or on Spec-Bench's questions, with speedups over the
target alone measured in the same run.

Configurations: ``target`` (no speculation), ``model-K<k>``, ``ngram-K<k>`` and
``suffix-K<k>`` for each draft length asked for, and ``auto``
(:class:`specgguf.speculative.planner.AutoPlanner`); with deterministic mode, each again as
``det-<name>``. Rounds go over categories and configurations in turn, so that machine
noise hits all alike; the numbers of a (category, configuration) cell pool its rounds
(tokens over seconds), and an "overall" row per configuration pools every category, as
Spec-Bench computes it (total tokens over total time, against the target alone's). Each
``auto`` row also carries what the measured batch costs allow for the acceptance the
fixed-K drafters reached (:func:`allowed_rate`) and auto mode's share of it. The timings
are the pair's cached calibration unless asked to measure them again
(:func:`calibrate_pair`); the report says which, and progress comes one line per question
and configuration.

Spec-Bench (Xia et al. 2024; its ``question.jsonl``: ``question_id``, ``category``,
``turns``) groups its categories in six columns (:data:`SPEC_BENCH_COLUMNS`); a question with
two turns asks the second after the model's own answer to the first, and both count.
"""

from __future__ import annotations

import dataclasses
import json
import random
import resource
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from specgguf.engine.drafter_map import DRAFTERS
from specgguf.engine.engine import Engine
from specgguf.speculative.costmodel import Timings, best_k
from specgguf.speculative.loop import GenerationParams, GenerationResult, GenerationStats
from specgguf.speculative.sampling import SamplerParams
from specgguf.speculative.tuning import AUTO_TUNING, AutoTuning

#: The row that pools every category.
OVERALL = "overall"

CATEGORIES = (
    "code-generation", "code-editing", "structured", "translation", "summarization", "chat",
)  # fmt: skip

_CODE = """import csv
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    qty: int


def load_items(path):
    items = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            items.append(Item(row["name"], float(row["price"]), int(row["qty"])))
    return items


def calc(items):
    total = 0.0
    for item in items:
        total += item.price * item.qty
    return round(total, 2)


def report(items):
    lines = [f"{item.name}: {item.qty} x {item.price:.2f}" for item in items]
    lines.append(f"Total: {calc(items):.2f}")
    return "\\n".join(lines)


if __name__ == "__main__":
    cart = load_items("cart.csv")
    print(report(cart))
    print("Grand total:", calc(cart))
"""

_TEXT = (
    "The city council met on Tuesday to discuss the new bicycle lanes planned for the "
    "harbour district. Maria Lopez, 34, an engineer from Porto who moved to the city last "
    "year, presented the traffic study: car traffic on Harbour Road fell by twelve percent "
    "during the six-week trial, while bicycle trips more than doubled. Shop owners were "
    "divided. Tom Berg, 58, who runs a bakery on the corner of Harbour Road and Mill Street, "
    "said deliveries had become slower, but that he had gained new customers who arrive by "
    "bike. Aiko Tanaka, 27, a nurse from Osaka, told the council that the lanes made her "
    "night-shift commute safer. The council will vote on making the lanes permanent next "
    "month, after a second study of the effects on buses and emergency vehicles."
)

#: (category, prompt): one prompt per category.
PROMPTS: list[tuple[str, str]] = [
    ("code-generation",
     "Write a Python function that checks whether a string is a palindrome, ignoring case "
     "and punctuation, with a docstring, type hints and a few doctest examples."),
    ("code-editing",
     "Rename the function `calc` to `total_price` everywhere in this code. Reply with the "
     "complete updated code only, in one Python code block, without any explanation.\n\n"
     f"```python\n{_CODE}```"),
    ("structured",
     "Extract every person mentioned in the text below as a JSON array of objects with the "
     "keys \"name\", \"age\", \"city\" (null when not given) and \"role\". Reply with the "
     f"JSON only.\n\nText: {_TEXT}"),
    ("translation", f"Translate the following text into French:\n\n{_TEXT}"),
    ("summarization", f"Summarise the following news story in three sentences:\n\n{_TEXT}"),
    ("chat",
     "Write a short story about a lighthouse keeper who finds a message in a bottle."),
]  # fmt: skip


#: Spec-Bench's categories -> its table's columns (the MT-bench categories are one column).
SPEC_BENCH_COLUMNS: dict[str, str] = {
    **{c: "multi-turn" for c in ("writing", "roleplay", "reasoning", "math", "coding",
                                 "extraction", "stem", "humanities")},
    "translation": "translation", "summarization": "summarization", "qa": "qa",
    "math_reasoning": "math_reasoning", "rag": "rag",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class BenchPrompt:
    """One conversation of the benchmark: its column (``category``), its user turns (each
    asked after the model's own answer to the one before), and an id."""

    category: str
    turns: tuple[str, ...]
    question_id: str = ""


def builtin_prompts() -> list[BenchPrompt]:
    """The built-in prompt set: one single-turn prompt per category of :data:`CATEGORIES`."""
    return [BenchPrompt(c, (p,), c) for c, p in PROMPTS]


def load_prompts(path: Path) -> list[BenchPrompt]:
    """Prompts from a file: Spec-Bench's JSONL (one ``{question_id, category, turns}``
    object a line; categories grouped in :data:`SPEC_BENCH_COLUMNS`), or a JSON list of
    ``{"category", "prompt"}`` objects.

    Raises:
        UsageError: the file cannot be read or has the wrong shape.
    """
    from specgguf.errors import UsageError

    shape = ("expected a non-empty JSON list of {category, prompt} objects, or JSONL lines "
             "of {question_id, category, turns}")  # fmt: skip
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: {getattr(e, 'strerror', None) or e}") from None
    if text.lstrip().startswith("{"):
        return _load_jsonl(path, text, shape)
    try:
        data = json.loads(text)
    except ValueError as e:
        raise UsageError(f"{path}: not JSON ({e}); {shape}") from None
    if not isinstance(data, list) or not data:
        raise UsageError(f"{path}: {shape}")
    out = []
    for i, x in enumerate(data):
        if not (isinstance(x, dict) and isinstance(x.get("category"), str)
                and isinstance(x.get("prompt"), str) and x["prompt"].strip()):  # fmt: skip
            raise UsageError(f"{path}: entry {i}: {shape}")
        out.append(BenchPrompt(x["category"], (x["prompt"],), str(i)))
    return out


def _load_jsonl(path: Path, text: str, shape: str) -> list[BenchPrompt]:
    from specgguf.errors import UsageError

    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            x = json.loads(line)
        except ValueError as e:
            raise UsageError(f"{path}:{n}: not JSON ({e}); {shape}") from None
        turns = x.get("turns") if isinstance(x, dict) else None
        if not (isinstance(x, dict) and isinstance(x.get("category"), str)
                and isinstance(turns, list) and turns
                and all(isinstance(t, str) and t.strip() for t in turns)):  # fmt: skip
            raise UsageError(f"{path}:{n}: {shape}")
        category: str = x["category"]
        column = SPEC_BENCH_COLUMNS.get(category, category)
        out.append(BenchPrompt(column, tuple(turns), str(x.get("question_id", n))))
    if not out:
        raise UsageError(f"{path}: {shape}")
    return out


def sample_per_category(prompts: Sequence[BenchPrompt], n: int, seed: int) -> list[BenchPrompt]:
    """A reproducible sample of ``n`` prompts per category (all of a smaller category), in
    the file's order."""
    rng = random.Random(seed)
    keep: set[int] = set()
    for cat in dict.fromkeys(p.category for p in prompts):
        idx = [i for i, p in enumerate(prompts) if p.category == cat]
        keep.update(idx if len(idx) <= n else rng.sample(idx, n))
    return [p for i, p in enumerate(prompts) if i in keep]


def select_prompts(
    prompts: Sequence[BenchPrompt],
    categories: Sequence[str] | None,
    per_category: int | None,
    seed: int,
) -> list[BenchPrompt]:
    """``prompts`` sampled (:func:`sample_per_category`, where ``per_category`` is given),
    then kept in ``categories`` (None: all). Sampling comes first so that a category's
    questions are the same whichever categories are asked for: the sample draws the
    categories in the file's order from one generator.

    Raises:
        UsageError: a category ``prompts`` does not have.
    """
    from specgguf.errors import UsageError

    wanted = None if categories is None else set(categories)
    if wanted is not None:
        known = list(dict.fromkeys(p.category for p in prompts))
        unknown = wanted - set(known)
        if unknown:
            raise UsageError(f"unknown categories {sorted(unknown)}; known: {known}")
    chosen = list(prompts)
    if per_category is not None:
        chosen = sample_per_category(chosen, per_category, seed)
    if wanted is not None:
        chosen = [p for p in chosen if p.category in wanted]
    return chosen


def run_one(
    engine: Engine,
    ids: Sequence[int],
    kind: str,
    k: int,
    n: int,
    *,
    deterministic: bool = False,
    ignore_eos: bool = False,
) -> GenerationStats:
    """One greedy generation of ``n`` tokens with the drafter ``kind`` and draft length
    (or, for auto, the largest) ``k``, in deterministic mode or not, with ``ignore_eos``
    all ``n`` of them; returns its statistics."""
    return _generate(engine, ids, kind, k, n, deterministic, ignore_eos).stats


def _generate(
    engine: Engine,
    prompt: Any,
    kind: str,
    k: int,
    n: int,
    deterministic: bool,
    ignore_eos: bool = False,
) -> GenerationResult:
    params = GenerationParams(
        n_predict=n, sampler=SamplerParams(temperature=0), drafter=kind, draft_max=k,
        deterministic=deterministic, ignore_eos=ignore_eos,
    )  # fmt: skip
    return engine.generate(prompt, params).run()


def run_conversation(
    engine: Engine, prompt: BenchPrompt, kind: str, k: int, n: int, *, deterministic: bool = False
) -> GenerationStats:
    """Every turn of ``prompt``, each of at most ``n`` tokens after the model's own earlier
    answers, greedy; returns the statistics of all turns pooled."""
    return converse(engine, prompt, kind, k, n, deterministic=deterministic)[0]


def converse(
    engine: Engine, prompt: BenchPrompt, kind: str, k: int, n: int, *, deterministic: bool = False
) -> tuple[GenerationStats, list[dict[str, str]]]:
    """As :func:`run_conversation`, and the conversation with the model's answers."""
    messages: list[dict[str, str]] = []
    stats = GenerationStats()
    for turn in prompt.turns:
        messages.append({"role": "user", "content": turn})
        res = _generate(engine, messages, kind, k, n, deterministic)
        stats.add(res.stats)
        messages.append({"role": "assistant", "content": res.text})
    return stats, messages


@dataclasses.dataclass
class Cell:
    """Pooled statistics of one (category, configuration): the rounds' counters and times,
    each round's tokens/s, and how many generations (turns) they pool."""

    category: str
    config: str
    stats: GenerationStats = dataclasses.field(default_factory=GenerationStats)
    runs: list[float] = dataclasses.field(default_factory=list)
    generations: int = 0

    def add(self, s: GenerationStats, generations: int = 1) -> None:
        self.stats.add(s)
        self.runs.append(s.tokens_per_s)
        self.generations += generations

    @property
    def mean_depth(self) -> int:
        """The positions cached at a mean step: each generation's prompt and half of what
        it generated."""
        s = self.stats
        return round((s.prompt_tokens + s.generated / 2) / max(1, self.generations))

    @property
    def per_token_acceptance(self) -> float:
        """The rate a of the cost model: accepted / (accepted + first rejections)."""
        s = self.stats
        n = s.accepted + s.rejected_steps
        return s.accepted / n if n else 0.0


def allowed_rate(
    cells: dict[tuple[str, str], Cell], category: str, timings: Timings, cached: int = 0
) -> tuple[str, float, int, float] | None:
    """What the measured batch costs allow for the acceptance the drafters reach in
    ``category``: for each drafter measured at fixed K (``model-K*``, ``ngram-K*``,
    ``suffix-K*``), its per-token acceptance a pooled
    over its K, and the best draft length for it by the cost model, E(K) / (K t_draft +
    t_verify(K + 1)) with E(K) = (1 - a^(K+1)) / (1 - a) (Leviathan et al. 2023, section
    3.4), t_verify from this run's calibration at ``cached`` positions (the
    category's mean depth) and t_draft 0 for lookup drafters. Returns
    the fastest (drafter, a, K, tokens/s), where K = 0 is the target alone; None when no
    drafter was measured. An upper bound for auto mode only in so far as a is one number
    per drafter and text: auto mode can do better where acceptance varies along the text."""
    best: tuple[str, float, int, float] | None = None
    for family, e in DRAFTERS.items():
        measured = [c for (ct, nm), c in cells.items()
                    if ct == category and nm.startswith(f"{family}-K")]  # fmt: skip
        if not measured:
            continue
        accepted = sum(c.stats.accepted for c in measured)
        a = accepted / max(1, sum(c.stats.accepted + c.stats.rejected_steps for c in measured))
        t = AUTO_TUNING
        evaluated = e.evaluated  # a forward pass per draft token
        k_max = t.draft_max_model if evaluated else t.draft_max_lookup
        k, rate = best_k(a, timings, k_max, cached=cached,
                         draft_cost=None if evaluated else 0.0)  # fmt: skip
        if best is None or rate > best[3]:
            best = (family, a, k, rate)
    return best


def _share(part: float, whole: float) -> float:
    return round(part / whole, 4) if whole else 0.0


def run_bench(
    engine: Engine,
    prompts: Sequence[BenchPrompt],
    configs: Sequence[tuple[str, str, int]],
    *,
    n: int,
    rounds: int,
    progress: Callable[[str], None] = lambda msg: None,
    recalibrate: bool = False,
    tunings: Mapping[str, AutoTuning] | None = None,
) -> dict[str, Any]:
    """Run every (prompt, configuration) ``rounds`` times, interleaved; returns the report
    (``machine``, ``results`` with one entry per category and configuration and an
    "overall" entry per configuration, ``memory``, and ``calibration``: where the timings
    came from, see :func:`calibrate_pair`). A configuration named ``det-...`` runs
    in deterministic mode; its speedup is against the target alone in normal mode. The
    suffix drafter's corpus is per configuration and round: the earlier questions of that
    run, never the same question's answer from another configuration or round.

    ``progress`` gets a line before and after the calibration and one before each
    (round, question, configuration), numbered (``[3/24] model-K4, question 2/6
    (code-editing), round 1/2, 41 s``); ``recalibrate`` measures the timings again
    rather than reuse the pair's cached calibration. A configuration named in ``tunings``
    runs auto mode with that tuning (``scripts/bench-tuning``: a tuning change measured
    beside the current one); the others with the engine's.

    Raises:
        UsageError: a name in ``tunings`` that is not an auto-mode configuration (checked
            before anything runs).
    """
    from specgguf.errors import UsageError
    from specgguf.llama.memory import kv_cache_bytes
    from specgguf.llama.runtime import build_info, platform_summary

    tunings = tunings or {}
    kinds = {name: kind for name, kind, _ in configs}
    for name in tunings:
        if kinds.get(name) != "auto":
            raise UsageError(f"a tuning for {name!r}, which is not an auto-mode configuration")
    cells: dict[tuple[str, str], Cell] = {}
    t0 = time.perf_counter()
    # The timings of auto mode and of the cost-model limit: the pair's cached calibration
    # unless a fresh decode step shows it was measured on a busier machine.
    has_det = any(name.startswith("det-") for name, _, _ in configs)
    calibration = calibrate_pair(engine, deterministic=has_det, recalibrate=recalibrate,
                                 progress=progress)  # fmt: skip
    own = engine.drafting.drafters
    own_tuning = engine.drafting.tuning
    total = rounds * len(prompts) * len(configs)
    done = 0
    for r in range(rounds):
        # Suffix matching learns from earlier generations: each configuration gets its own
        # corpus per round (every drafter that remembers, its own), so that it holds the
        # earlier questions (as a server's earlier responses would) and never this
        # question's answer from another run.
        corpus = {name: engine.fresh_memories() for name, _, _ in configs}
        for q, p in enumerate(prompts, 1):
            for name, kind, k in configs:
                done += 1
                progress(f"[{done}/{total}] {name}, question {q}/{len(prompts)} "
                         f"({p.category}), round {r + 1}/{rounds}, "
                         f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
                det = name.startswith("det-")
                engine.drafting.drafters = {**own, **corpus[name]}
                engine.drafting.tuning = tunings.get(name, own_tuning)
                try:
                    s = run_conversation(engine, p, kind, k, n, deterministic=det)
                finally:
                    engine.drafting.drafters = own
                    engine.drafting.tuning = own_tuning
                cells.setdefault((p.category, name), Cell(p.category, name)).add(s, len(p.turns))
                cells.setdefault((OVERALL, name), Cell(OVERALL, name)).add(s, len(p.turns))
    wall = time.perf_counter() - t0
    timings = engine.timings()
    results = []
    order = {c: i for i, c in enumerate(dict.fromkeys([p.category for p in prompts] + [OVERALL]))}
    config_order = {name: i for i, (name, _, _) in enumerate(configs)}
    for (cat, name), c in sorted(cells.items(), key=lambda kv: (order[kv[0][0]],
                                 config_order[kv[0][1]])):  # fmt: skip
        s = c.stats
        base = cells.get((cat, "target"))
        row: dict[str, Any] = {
            "category": cat,
            "config": name,
            "tokens_per_s": round(s.tokens_per_s, 3),
            "speedup": round(s.tokens_per_s / base.stats.tokens_per_s, 3) if base else None,
            "acceptance_rate": round(s.acceptance_rate, 4),
            "per_token_acceptance": round(c.per_token_acceptance, 4),
            "mean_accepted": round(s.mean_accepted, 3),
            "tokens_per_step": round(s.generated / s.steps, 3) if s.steps else 0.0,
            "tokens": s.generated,
            "steps": s.steps,
            "target_share": _share(s.target_seconds, s.seconds),
            "draft_share": _share(s.draft_seconds, s.seconds),
            "python_share": _share(s.python_seconds, s.seconds),
            "runs_tokens_per_s": [round(x, 3) for x in c.runs],
            "by_drafter": s.as_dict()["by_drafter"],
        }  # fmt: skip
        if name == "auto" and cat != OVERALL and base is not None:
            depth = c.mean_depth  # the batch costs at the category's depth
            limit = allowed_rate(cells, cat, timings, depth)
            if limit is not None:
                drafter, a, k_best, rate = limit
                # the cost model's speedup over its own target alone (1 / t_verify(1)),
                # against auto's measured speedup over the measured target alone
                allowed = rate * timings.verify_time(1, depth)
                row["cost_model_limit"] = {
                    "drafter": drafter if k_best else "none",
                    "per_token_acceptance": round(a, 4), "k": k_best, "depth": depth,
                    "tokens_per_s": round(rate, 3), "speedup": round(allowed, 3),
                    "ratio": round(s.tokens_per_s / base.stats.tokens_per_s / allowed, 3),
                }  # fmt: skip
        results.append(row)
    pre = engine.preflight
    loaded = engine.describe()
    files = pre.target.file_size
    kv = kv_cache_bytes(pre.target, engine.n_ctx)
    if pre.draft is not None and engine.n_ctx_draft is not None:
        files += pre.draft.file_size
        kv += kv_cache_bytes(pre.draft, engine.n_ctx_draft)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin"
                                                                 else 1024)  # fmt: skip
    return {
        "machine": {
            **platform_summary(),
            "llama_cpp": build_info().summary(),
            "threads": engine.n_threads,
            "weight_repacking": engine.repack,
        },
        "models": {k: loaded[k] for k in ("target", "draft", "rpc", "rpc_draft")},
        "params": {
            "n_predict": n,
            "rounds": rounds,
            "greedy": True,
            "n_ctx": engine.n_ctx,
        },
        "timings": {
            # seconds, 4 significant digits (tiny models' steps take microseconds)
            "t_verify": {k: float(f"{v:.4g}") for k, v in sorted(timings.verify.items())},
            "scale_single": round(timings.scale_single, 3),
            "scale_batch": round(timings.scale_batch, 3),
            "t_draft": float(f"{timings.draft:.4g}"),
            # what each cached position past the curve's depth adds (seconds)
            "depth": timings.depth,
            "position_single": float(f"{timings.position_single:.4g}"),
            "position_row": float(f"{timings.position_row:.4g}"),
        },
        "memory": {
            "peak_rss": peak,
            "model_files": files,
            "kv_caches": kv,
            "ratio": round(peak / (files + kv), 3),
        },
        "calibration": calibration,
        "wall_seconds": round(wall, 1),
        "results": results,
    }


def calibrate_pair(
    engine: Engine,
    *,
    deterministic: bool = False,
    recalibrate: bool = False,
    progress: Callable[[str], None] = lambda msg: None,
) -> list[dict[str, Any]]:
    """The engine's timings (:meth:`Engine.timings`; with ``deterministic``, deterministic
    mode's too): the pair's cached calibration, checked against one fresh decode step, or
    measured now (with ``recalibrate``, always). ``progress`` gets a line before each
    (the measurement can take minutes on a busy machine) and one after it that says
    where the timings came from. Returns, per mode, where they came from: ``mode``
    ("normal" or "deterministic"), ``reused`` (True: read from ``file``; False: measured
    in this run), ``file`` (the cache file), ``key`` (its entry), ``measured_at`` (ISO
    8601, UTC), ``seconds`` (the check or the measurement, in this run), ``saved``
    (whether ``file`` holds them), ``unsaved`` (why not, when measured and not saved:
    the file cannot be written, or the machine was busy; else None), ``why`` (why they
    were measured; None when reused) and
    ``fresh_step_ratio`` (when reused: a fresh decode step's time over the cached one's;
    above 1 the machine is busier now than when they were measured).

    Raises:
        BackendError: an evaluation failed.
    """
    from datetime import UTC, datetime

    from specgguf.engine.calibration import calibration_source

    out = []
    for det in (False, True) if deterministic and engine.deterministic_rows else (False,):
        mode = "deterministic" if det else "normal"
        label = "calibration of deterministic mode" if det else "calibration"
        progress(f"{label}: checking the pair's cached timings, or measuring them (10-30 s "
                 "for a 1.5B target on 2 cores, minutes on a busy machine)")  # fmt: skip
        engine.timings(det, recalibrate=recalibrate)
        src = calibration_source(engine.calibration_key(det))
        if src is None:  # not through the calibration cache: nothing to tell
            continue
        when = datetime.fromtimestamp(src.measured_at, UTC).isoformat(timespec="seconds")
        out.append({
            "mode": mode, "reused": src.reused, "file": str(src.file), "key": src.key,
            "measured_at": when, "seconds": round(src.seconds, 2), "saved": src.saved,
            "unsaved": src.unsaved or None,
            "why": None if src.reused else src.why,
            "fresh_step_ratio": None if src.fresh_step_ratio is None
            else round(src.fresh_step_ratio, 3),
        })  # fmt: skip
        if src.reused:
            progress(f"{label} reused from {src.file} (measured {when}), checked in "
                     f"{src.seconds:.1f} s{busier_note(src.fresh_step_ratio)}")  # fmt: skip
        else:
            saved = f"saved to {src.file}" if src.saved else f"not saved: {src.unsaved}"
            progress(f"{label} measured in {src.seconds:.1f} s ({src.why}), {saved}")
    return out


#: A reused calibration's check ratio above this is worth telling: the numbers of the run
#: carry the machine's other work.
BUSIER = 1.25


def busier_note(ratio: float | None) -> str:
    """``; a fresh decode step took 3.10x the calibrated one: the machine is busier now``
    when a reused calibration's check ``ratio`` (fresh step over cached) says so (above
    :data:`BUSIER`), else ""."""
    if ratio is None or ratio <= BUSIER:
        return ""
    return f"; a fresh decode step took {ratio:.2f}x the calibrated one: the machine is busier now"


def generate_together(
    engine: Engine, prompts: Sequence[Any], params: GenerationParams
) -> tuple[list[GenerationResult], float]:
    """Every prompt through the engine's ``--parallel`` sequences as a server would take
    them (a prompt starts as soon as a sequence is free, in order); returns the results in
    the prompts' order and the wall seconds from the first prompt to the last token.

    Raises:
        UsageError: the engine was loaded for one sequence.
    """
    batcher = engine.batcher or engine.start_batching()
    out: dict[int, GenerationResult] = {}
    queue = list(enumerate(prompts))
    free = list(range(len(engine.slots)))

    def start(slot: int) -> None:
        i, prompt = queue.pop(0)

        def run() -> None:
            try:
                out[i] = engine.generate(prompt, params, slot=slot).run()
            finally:
                # (the lowest free sequence next: running sequences' ids without a gap
                # cost llama.cpp fewer micro-batches; prompts are read whole here)
                free.append(slot)
                free.sort()

        batcher.add(slot, run)

    t0 = time.perf_counter()
    while queue or batcher.active:
        while queue and free:
            start(free.pop(0))
        batcher.step()
    return [out[i] for i in range(len(prompts))], time.perf_counter() - t0


def run_parallel_bench(
    engine: Engine,
    prompts: Sequence[BenchPrompt],
    configs: Sequence[tuple[str, str, int]],
    *,
    n: int,
    rounds: int,
    progress: Callable[[str], None] = lambda msg: None,
    recalibrate: bool = False,
) -> dict[str, Any]:
    """``bench --parallel N``: for each configuration, every prompt's first turn one after
    another (one sequence at a time, each alone in the batcher) and all through the engine's N
    sequences at once (:func:`generate_together`), alternating which goes first from
    round to round; aggregate tokens/s (all tokens over all wall time) of both, their
    ratio, the draft tokens accepted and the target steps of both (``accepted_1``,
    ``steps_1``, ``accepted_parallel``, ``steps_parallel``), and what the calibrated batch
    curve allows for it: N rows in one batch against N single rows, t(1) N / t(N). The
    suffix drafter's corpus is empty at the start of each configuration, width and round,
    as in :func:`run_bench`: one at a time, a question drafts from the earlier questions'
    answers; all at once, only from those of questions that ended before it started
    (none while there are no more questions than sequences). ``calibration`` in the report,
    ``progress`` and
    ``recalibrate``: as in :func:`run_bench` (a line per question one at a time, and one
    per batch of all at once). With fewer prompts than sequences, "all at once" never
    fills them: the face refuses that (``bench --parallel``); a test may want it.

    Raises:
        UsageError: the engine was loaded for one sequence.
    """
    n_par = len(engine.slots)
    if n_par < 2:
        from specgguf.errors import UsageError

        raise UsageError("a parallel bench needs an engine of 2 sequences or more")
    t0 = time.perf_counter()
    # (deterministic mode's timings too where the engine has it: start_batching needs both)
    calibration = calibrate_pair(engine, deterministic=True, recalibrate=recalibrate,
                                 progress=progress)  # fmt: skip
    timings = engine.timings()
    engine.start_batching()
    totals: dict[tuple[str, int], list[float]] = {}
    total = rounds * len(configs) * (len(prompts) + 1)
    done = 0

    def step(what: str) -> None:
        nonlocal done
        done += 1
        progress(f"[{done}/{total}] {what}, {time.perf_counter() - t0:.0f} s")

    for r in range(rounds):
        for name, kind, k in configs:
            # every prompt read whole, in both passes: their wall times count prompts,
            # and one pass would otherwise find the other's prompts in its sequences
            params = GenerationParams(n_predict=n, sampler=SamplerParams(temperature=0),
                                      drafter=kind, draft_max=k, cache_prompt=False)  # fmt: skip
            firsts = [[{"role": "user", "content": p.turns[0]}] for p in prompts]
            for width in (1, n_par) if r % 2 == 0 else (n_par, 1):
                # A corpus of its own (as in run_bench): greedy answers repeat, and one
                # remembered from an earlier pass is copied whole (83 of 96 tokens).
                with engine.fresh_memory():
                    if width == 1:  # through the batcher too, on its first sequence
                        res, seconds = [], 0.0
                        for q, m in enumerate(firsts, 1):
                            step(f"{name}, one at a time, question {q}/{len(firsts)}, "
                                 f"round {r + 1}/{rounds}")  # fmt: skip
                            alone, s = generate_together(engine, [m], params)
                            res += alone
                            seconds += s
                    else:
                        step(f"{name}, {len(firsts)} questions, {width} at once, "
                             f"round {r + 1}/{rounds}")  # fmt: skip
                        res, seconds = generate_together(engine, firsts, params)
                acc = totals.setdefault((name, width), [0.0, 0.0, 0.0, 0.0])
                acc[0] += sum(len(x.tokens) for x in res)
                acc[1] += seconds
                acc[2] += sum(x.stats.accepted for x in res)
                acc[3] += sum(x.stats.steps for x in res)
    allowed = n_par * timings.verify_time(1) / timings.verify_time(n_par)
    results = []
    for name, _, _ in configs:
        single, many = (totals[(name, w)] for w in (1, n_par))
        rate1, rate_n = single[0] / single[1], many[0] / many[1]
        results.append({"config": name, "tokens_per_s_1": round(rate1, 3),
                        "tokens_per_s_parallel": round(rate_n, 3),
                        "ratio": round(rate_n / rate1, 3),
                        "accepted_1": int(single[2]), "accepted_parallel": int(many[2]),
                        "steps_1": int(single[3]), "steps_parallel": int(many[3])})  # fmt: skip
    return {"parallel": n_par, "n_predict": n, "rounds": rounds, "prompts": len(prompts),
            "batch_allows": round(allowed, 3), "calibration": calibration,
            "results": results}  # fmt: skip
