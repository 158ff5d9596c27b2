"""The planner simulator: a recorded trace (:mod:`specgguf.measure.traces`) replayed against a
machine's cost curve, with the real planner (the :class:`AutoPlanner` and arms ``run``
builds, through :func:`specgguf.engine.drafter_map.make_planner`), the real n-gram and
suffix drafters over the text, and a draft model answered from the trace's chains.

Each step is the loop's (:mod:`specgguf.speculative.loop`) for greedy decoding: the
planner plans, the draft is clipped as the loop clips it (``verifiable``), the target
agrees with the longest prefix (or tree path) that its recorded output continues, and the
step costs the machine's ``t_verify(rows)`` plus the draft model's evaluations (its
catch-up as a batch on the same curve's shape, then one row per further draft token).
The planner observes the step as it would a real one, so its learned corrections and
acceptance estimates move as they would. Prompt processing is not counted (as in
``bench``'s tokens/s); neither is Python's own time per step (``overhead`` adds a fixed
cost per step where wanted).

Reported per configuration: seconds and tokens per category, for auto mode, the target
alone, every fixed drafter and draft length, and a per-step oracle that picks, knowing
the output, the option with the most tokens per second at that step (a myopic oracle: an
upper reference, not a bound).

Curves: ``../shared/machines/curves.json``'s machines (batch cost per row count relative to
one row, one row's milliseconds, a draft-model token relative to one target row, and
optionally what each cached position adds to a row: :func:`machine_timings`), a
calibration specgguf cached (``scripts/simulate-planner --calibration``: with what depth
costs), and :data:`GPU_LIKE`.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from specgguf.engine.config import default_draft_max, default_draft_tree
from specgguf.engine.drafter_map import (
    DRAFTERS,
    Drafting,
    DraftSettings,
    Needs,
    Sources,
    make_drafters,
    make_planner,
)
from specgguf.errors import UsageError
from specgguf.measure.traces import Trace, TracedGeneration
from specgguf.speculative.costmodel import Timings, cheapest_micro_batches, micro_batches
from specgguf.speculative.draft import Draft, Drafter
from specgguf.speculative.drafters import ModelDrafter, NgramDrafter, SuffixDrafter
from specgguf.speculative.planner import AutoPlanner, Planner
from specgguf.speculative.sampling import SamplerParams
from specgguf.speculative.tuning import AUTO_TUNING, AutoTuning
from specgguf.speculative.verification import verifiable

GREEDY = SamplerParams(temperature=0.0)

#: A GPU-like machine: a memory-bound 7-8B target, a batch of 17 rows 1.1x one row, 65 rows
#: 1.6x, a small draft's token 0.08 of a target row (the issue's figures).
GPU_LIKE: dict[str, Any] = {
    "one_row_ms": 15.0,
    "rows": {"1": 1.0, "2": 1.01, "5": 1.03, "9": 1.05, "17": 1.1, "33": 1.3, "65": 1.6},
    "draft_token": 0.08,
    "source": "synthetic (issue 34): 17 rows 1.1x, 65 rows 1.6x, a draft token 0.08 of a row",
}

#: The fixed draft lengths the table compares.
FIXED_KS = (1, 2, 3, 4, 6, 8, 12, 16)

#: Fixed drafters the table compares: every drafter of the registry that needs nothing
#: loaded, and the trace's draft model (only where the trace has chains).
FIXED_DRAFTERS = (*(name for name, e in DRAFTERS.items() if e.needs == Needs()), "model")


def _drafters(n: int, models: Sequence[TraceDraftModel | None]) -> list[dict[str, Drafter]]:
    """The drafters of ``n`` sequences: every entry of the registry that drafts from no
    model (no model is loaded), and ``models``, the trace's draft model of each, as the
    model drafter."""
    each = list(make_drafters(Sources(n, n_vocab=0)))
    for drafters, model in zip(each, models, strict=True):
        if model is not None:
            drafters["model"] = model
    return each


def machine_timings(
    curve: dict[str, Any], position_us: tuple[float, float] | None = None
) -> Timings:
    """:class:`Timings` of a machine of ``curves.json`` (``one_row_ms``, ``rows``: row
    count -> cost relative to one row, ``draft_token``: a draft token relative to one row),
    measured at ``depth`` cached positions (an integer, default 0), and what each cached
    position past it adds: ``position_row_us`` microseconds to each row of a batch, and
    ``position_single_us`` to a lone row (default: the batch row's; at most it, as
    :meth:`Timings.verify_time` reads it). A curve without them takes ``position_us`` (row,
    lone row), or costs the same at every depth. The draft model's token costs the same
    at every depth.

    Raises:
        UsageError: a malformed curve.
    """
    try:
        one = float(curve["one_row_ms"]) / 1000.0
        verify = {int(n): one * float(r) for n, r in curve["rows"].items()}
        draft = one * float(curve.get("draft_token", 0.0))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise UsageError(f"a machine curve needs one_row_ms, rows and draft_token ({e})") from None
    if 1 not in verify or any(v <= 0 for v in verify.values()):
        raise UsageError("a machine curve needs a positive cost for 1 row and every size")
    depth = curve.get("depth", 0)
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
        raise UsageError(f"a machine curve's depth is a number of positions, not {depth!r}")
    if "position_single_us" in curve and "position_row_us" not in curve:
        raise UsageError("a machine curve with position_single_us needs position_row_us")
    if "position_row_us" in curve:
        given = (
            curve["position_row_us"],
            curve.get("position_single_us", curve["position_row_us"]),
        )
    else:
        given = position_us or (0.0, 0.0)
    try:
        row, single = (float(v) for v in given)
    except (TypeError, ValueError):
        row = single = math.nan
    if not all(math.isfinite(v) and v >= 0 for v in (row, single)) or single > row:
        raise UsageError(
            "a machine curve's position_row_us and position_single_us are microseconds, "
            "at least 0, the lone row's at most the batch row's"
        )
    return Timings(verify, draft, depth=depth, position_row=row * 1e-6,
                   position_single=single * 1e-6)  # fmt: skip


def load_curves(
    path: Path | None, position_us: tuple[float, float] | None = None
) -> dict[str, Timings]:
    """The machines of ``curves.json`` at ``path`` (None: none), those without their own
    position costs given ``position_us`` (:func:`machine_timings`), and :data:`GPU_LIKE`
    (none: on a GPU attention reads the cache about once per batch, whatever its rows),
    by name.

    Raises:
        UsageError: the file cannot be read or holds a malformed curve.
    """
    out: dict[str, Timings] = {}
    if path is not None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise UsageError(f"{path}: {getattr(e, 'strerror', None) or e}") from None
        if not isinstance(data, dict):
            raise UsageError(f"{path}: expected an object of machines")
        for name, curve in data.items():
            out[name] = machine_timings(curve, position_us)
    out["gpu-like"] = machine_timings(GPU_LIKE)
    return out


def changed_tuning(items: Sequence[str], base: AutoTuning = AUTO_TUNING) -> AutoTuning:
    """``base`` with the fields of ``items`` ("FIELD=VALUE", VALUE a Python literal of the
    field's type; an int where a float is wanted) changed: what ``scripts/simulate-planner``
    and ``scripts/bench-tuning`` are given to try.

    Raises:
        UsageError: not FIELD=VALUE, no such field of :class:`AutoTuning`, not a literal,
            or a value of another type.
    """
    changes: dict[str, Any] = {}
    fields = {f.name for f in dataclasses.fields(AutoTuning)}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in fields:
            raise UsageError(f"{item!r}: expected FIELD=VALUE with a field of AutoTuning")
        try:
            v = ast.literal_eval(value)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            raise UsageError(f"{item!r}: not a Python literal") from None
        old = getattr(base, name)
        if isinstance(old, float) and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if type(v) is not type(old):
            raise UsageError(f"{item!r}: {name} is a {type(old).__name__} (now {old!r})")
        changes[name] = v
    return dataclasses.replace(base, **changes)


def _copy(t: Timings) -> Timings:
    return dataclasses.replace(t, verify=dict(t.verify))


class TraceDraftModel(ModelDrafter):
    """A draft model answered from a trace's chains, at the machine's cost: a catch-up of
    b tokens costs ``draft * curve(b) / curve(1)``, each further draft token ``draft``.
    The history must be the trace's (prompt + its output so far), as greedy decoding
    keeps it."""

    def __init__(self, truth: Timings) -> None:  # (no context: nothing is evaluated)
        self.truth = truth
        self.gen: TracedGeneration | None = None
        self._held_sim: list[int] = []
        self.seconds = 0.0
        #: each draft's evaluations: its catch-up rows, then how many one-row evaluations
        self.evaluations: list[tuple[int, int]] = []
        self.n_vocab = 1 << 30

    def start(self, gen: TracedGeneration) -> None:
        self.gen = gen

    def reset(self) -> None:
        pass

    def prefill(self, history: Sequence[int]) -> None:
        self._held_sim = list(history[:-1])  # the prompt is not timed

    def cached_tokens(self, history: Sequence[int]) -> int:
        n = 0
        for a, b in zip(self._held_sim, history, strict=False):
            if a != b:
                break
            n += 1
        return n

    def propose(
        self,
        history: Sequence[int],
        k: int,
        sampler: SamplerParams,
        rng: np.random.Generator,
        *,
        p_min: float = 0.0,
        p_path_min: float = 0.0,
    ) -> Draft:
        gen = self.gen
        assert gen is not None
        i = len(history) - len(gen.prompt)
        t = self.truth
        per = t.draft
        if k <= 0 or not gen.chains or i >= len(gen.chains):
            return Draft([], token_seconds=per)
        tokens: list[int] = []
        stopped = False
        path = 1.0
        for tok, p in zip(gen.chains[i][:k], gen.chain_probs[i][:k], strict=True):
            path *= p
            if p < p_min or path < p_path_min:
                stopped = True
                break
            tokens.append(tok)
        behind = max(1, len(history) - self.cached_tokens(history))
        # (as ModelDrafter: every drafted token but the last is evaluated, and the last too
        # when drafting went on to a token it then stopped at)
        evaluated = tokens if stopped else tokens[:-1]
        self.seconds += per * t.curve(behind) / t.curve(1) + per * len(evaluated)
        self.evaluations.append((behind, len(evaluated)))
        self._held_sim = [*history, *evaluated]
        return Draft(tokens, stopped=stopped, token_seconds=per)


@dataclasses.dataclass
class SimResult:
    """Simulated seconds and tokens per category, and steps."""

    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    tokens: dict[str, int] = dataclasses.field(default_factory=dict)
    steps: int = 0
    by_drafter: dict[str, int] = dataclasses.field(default_factory=dict)

    def add(self, category: str, seconds: float, tokens: int) -> None:
        self.seconds[category] = self.seconds.get(category, 0.0) + seconds
        self.tokens[category] = self.tokens.get(category, 0) + tokens

    def rate(self, category: str | Sequence[str] | None = None) -> float:
        """Tokens/s in ``category`` (several: pooled; None: all)."""
        if category is None:
            cats: Sequence[str] = list(self.tokens)
        elif isinstance(category, str):
            cats = [category]
        else:
            cats = category
        tokens = sum(self.tokens[c] for c in cats)
        return tokens / max(1e-12, sum(self.seconds[c] for c in cats))


def _agreement(draft: Draft, output: Sequence[int], pos: int) -> int:
    """How many draft tokens greedy verification accepts at output position ``pos``: the
    longest chain prefix, or tree path, that the output continues."""
    if draft.parents is None:
        n = 0
        for tok in draft.tokens:
            if pos + n >= len(output) or tok != output[pos + n]:
                break
            n += 1
        return n
    node, n = -1, 0
    while pos + n < len(output):
        nxt = next((j for j, (tok, par) in enumerate(zip(draft.tokens, draft.parents,
                                                          strict=True))
                    if par == node and tok == output[pos + n]), None)  # fmt: skip
        if nxt is None:
            break
        node, n = nxt, n + 1
    return n


def _start(
    gen: TracedGeneration,
    model: TraceDraftModel | None,
    drafting: Drafting,
    kind: str,
    settings: DraftSettings,
) -> tuple[Planner, list[int]]:
    """A generation's planner, reset, with its drafters having read the prompt; and its
    history (the prompt)."""
    if model is not None:
        model.start(gen)
    planner = make_planner(kind, drafting, settings)
    planner.reset()
    history = list(gen.prompt)
    for d in planner.drafters:
        d.prefill(history)
    return planner, history


def simulate(
    trace: Trace,
    truth: Timings,
    kind: str,
    draft_max: int | None = None,
    *,
    tuning: AutoTuning = AUTO_TUNING,
    tree_branches: int | None = None,
    overhead: float = 0.0,
    n_batch: int = 512,
    overhead_alone: float | None = None,
) -> SimResult:
    """Replay ``trace`` on a machine whose costs are ``truth`` with drafter ``kind``
    ("auto", "none", "ngram", "suffix", "model") and draft length ``draft_max`` (None:
    the default of ``run``), the planner given ``truth`` as its calibration (a copy it
    refines); ``tree_branches`` (None: the drafter's default) as ``--draft-tree``;
    ``overhead`` seconds added per step, ``overhead_alone`` (None: the same) per step
    auto mode's planner let pass without asking its arms, the difference being the cost
    of asking it weighs (``AutoPlanner.plan_cost``). The suffix drafter's memory runs
    across the trace's generations, in order, as in one ``bench``.

    Raises:
        UsageError: the model drafter without chains in the trace.
    """
    model = TraceDraftModel(truth) if any(g.chains for g in trace.generations) else None
    n_predict = trace.meta.get("n_predict")
    n_predict = n_predict if isinstance(n_predict, int) else None
    calibrated = _copy(truth)
    (drafters,) = _drafters(1, [model])
    drafting = Drafting(drafters, lambda det: calibrated, tuning)
    if draft_max is not None:
        k = draft_max
    else:
        k = tuning.draft_max_lookup if kind == "auto" else default_draft_max(kind)  # type: ignore[arg-type]
    trees = default_draft_tree(kind) if tree_branches is None else tree_branches  # type: ignore[arg-type]
    settings = DraftSettings(k, 0.0, False, 0, trees)
    res = SimResult()
    rng = np.random.default_rng(0)
    for gen in trace.generations:
        planner, history = _start(gen, model, drafting, kind, settings)
        own = overhead if overhead_alone is None else overhead_alone
        out, pos, seconds = gen.output, 0, 0.0
        if isinstance(planner, AutoPlanner):  # (never this machine's own time)
            planner.plan_cost = max(0.0, overhead - own)
            planner.clock = lambda: seconds  # noqa: B023  (the replay's clock, read as it runs)
        k_cap = min(planner.draft_max, n_batch - 1)
        # An output that ended at an end-of-generation token had n_predict left to draft
        # into, as the real loop does; one cut at n_predict had only its own length.
        limit = max(n_predict or 0, len(out))
        while pos < len(out):
            # steps auto mode lets pass: the loop's lean steps, neither planned nor observed
            for _ in range(min(planner.pass_steps(), len(out) - pos)):
                seconds += truth.verify_time(1, len(history) - 1) + own
                res.by_drafter["none"] = res.by_drafter.get("none", 0) + 1
                res.steps += 1
                history.append(out[pos])
                pos += 1
            if pos >= len(out):
                break
            k_step = min(k_cap, limit - pos - 1)
            before = model.seconds if model is not None else 0.0
            plan = planner.plan(history, k_step, GREEDY, rng)
            draft = verifiable(plan.draft, k_step, trees if trees >= 2 else 0)
            acc = _agreement(draft, out, pos)
            rows = len(draft.tokens) + 1
            verify = truth.verify_time(rows, len(history) - 1)
            drafted = (model.seconds - before) if model is not None else 0.0
            # (past the output: the row of its end of generation, whose confidence the
            # trace does not hold)
            conf = gen.confidence[pos + acc] if pos + acc < len(out) else None
            planner.observe(plan, acc, verify, conf, rows=rows)
            seconds += verify + drafted + (own if getattr(planner, "skipped", False) else overhead)
            name = plan.drafter.name if plan.drafter is not None and draft.tokens else "none"
            res.by_drafter[name] = res.by_drafter.get(name, 0) + 1
            res.steps += 1
            history.extend(out[pos : pos + acc + 1])
            pos += acc + 1
        for d in planner.drafters:  # as the loop ends a generation
            d.finish(history)
        res.add(gen.category, seconds, len(out))
    return res


def oracle(trace: Trace, truth: Timings, *, overhead: float = 0.0, k_max: int = 64) -> SimResult:
    """The per-step oracle: at each step, knowing the output, the option with the most
    tokens per second among the target alone, and each drafter (n-gram, suffix, the
    trace's draft model) at the draft length it would have accepted whole."""
    res = SimResult()
    ngram, suffix = NgramDrafter(2, 8), SuffixDrafter()
    for gen in trace.generations:
        ngram.reset()
        suffix.reset()
        history = list(gen.prompt)
        out, pos, seconds = gen.output, 0, 0.0
        rng = np.random.default_rng(0)
        behind = 1
        while pos < len(out):
            alone = truth.verify_time(1, len(history) - 1)
            best_rate, best_n, best_cost = 1.0 / alone, 1, alone
            room = len(out) - pos - 1
            cands: list[tuple[int, float]] = []
            for d in (ngram, suffix):
                prop = d.propose(history, min(k_max, room), GREEDY, rng)
                a = _agreement(prop, out, pos)
                if a:
                    cands.append((a, 0.0))
            model_used = False
            if gen.chains and room > 0:
                chain = gen.chains[pos]
                a = _agreement(Draft(chain[: min(16, room)]), out, pos)
                if a:
                    cost = truth.draft * (truth.curve(behind) / truth.curve(1) + a - 1)
                    cands.append((a, cost))
            for a, draft_cost in cands:
                cost = truth.verify_time(a + 1, len(history) - 1) + draft_cost
                if (a + 1) / cost > best_rate:
                    best_rate, best_n, best_cost = (a + 1) / cost, a + 1, cost
                    model_used = draft_cost > 0
            # (after a model step the draft has not read its last token nor the target's)
            behind = 2 if model_used else behind + best_n
            seconds += best_cost + overhead
            res.steps += 1
            history.extend(out[pos : pos + best_n])
            pos += best_n
        suffix.finish(history)
        res.add(gen.category, seconds, len(out))
    return res


@dataclasses.dataclass(eq=False)
class _Running:
    """One generation on a sequence of :func:`simulate_parallel`."""

    gen: TracedGeneration
    planner: Planner
    history: list[int]
    limit: int
    pos: int = 0


def simulate_parallel(
    trace: Trace,
    truth: Timings,
    kind: str,
    n_parallel: int,
    draft_max: int | None = None,
    *,
    tuning: AutoTuning = AUTO_TUNING,
    n_ubatch: int = 128,
    overhead: float = 0.0,
    n_batch: int = 512,
) -> SimResult:
    """Replay ``trace``'s generations ``n_parallel`` at a time, as ``serve --parallel`` runs
    them (:mod:`specgguf.engine.batching`) with every request already waiting: each
    sequence has its own planner (drafter ``kind``, draft length ``draft_max``; None:
    ``run``'s) and timings
    told which other sequences share the step (:attr:`Timings.others`); the
    suffix corpus is shared; a finished generation's sequence takes the next one, lowest
    free sequence first. A step is one target batch of every running sequence's rows,
    costing the sum of ``truth``'s curve over llama.cpp's micro-batches of it, padded
    where that costs less, as the batcher pads a batch of verifications
    (:func:`~specgguf.speculative.costmodel.cheapest_micro_batches`, at the deepest
    sequence's depth; the batcher does not pad a batch that also reads a new prompt, which
    this replay, counting no prompts, never has), after the draft model's batches (the
    catch-ups, then one row per sequence still drafting, per draft position, each split
    into micro-batches and never padded, at ``truth.draft`` a row on the curve's shape),
    plus ``overhead``. Greedy, chains only (no token trees with several sequences),
    prompts not counted.

    Returns:
        a result whose category ``"all"`` holds every generation's tokens and the wall
        seconds of the whole replay.

    Raises:
        UsageError: the model drafter without chains in the trace.
    """
    chains = any(g.chains for g in trace.generations)
    seqs: list[tuple[TraceDraftModel | None, Timings, Drafting]] = []

    def fixed(t: Timings) -> Callable[[bool], Timings]:
        return lambda det: t

    models = [TraceDraftModel(truth) if chains else None for _ in range(n_parallel)]
    for i, (model, drafters) in enumerate(zip(models, _drafters(n_parallel, models), strict=True)):
        own = dataclasses.replace(_copy(truth), seq=i, n_ubatch=n_ubatch)
        seqs.append((model, own, Drafting(drafters, fixed(own), tuning)))
    if draft_max is not None:
        k = draft_max
    else:
        k = tuning.draft_max_lookup if kind == "auto" else default_draft_max(kind)  # type: ignore[arg-type]
    settings = DraftSettings(k, 0.0, False, 0, 0)
    n_predict = trace.meta.get("n_predict")
    n_predict = n_predict if isinstance(n_predict, int) else None
    queue = list(trace.generations)
    running: dict[int, _Running] = {}
    res = SimResult()
    rng = np.random.default_rng(0)
    clock, tokens = 0.0, 0

    def cost(rows: list[tuple[int, int]], per_row: float, cached: int) -> float:
        return sum(truth._at_depth(m, cached) for m in micro_batches(rows, n_ubatch)) * per_row

    def verify_cost(rows: list[tuple[int, int]], cached: int) -> float:
        def at(m: int) -> float:
            return truth._at_depth(m, cached)

        return sum(at(m) for m in cheapest_micro_batches(rows, n_ubatch, at)[0])

    while queue or running:
        for i in range(n_parallel):
            if i not in running and queue:
                gen = queue.pop(0)
                model, _, drafting = seqs[i]
                planner, history = _start(gen, model, drafting, kind, settings)
                if isinstance(planner, AutoPlanner):
                    # (``overhead`` is the batch's step's, not a sequence's asking: no step
                    # is let pass for it, nor for this machine's own time)
                    planner.plan_cost = 0.0
                running[i] = _Running(gen, planner, history, max(n_predict or 0, len(gen.output)))
        steps = []
        for i, run in sorted(running.items()):
            model, own, _ = seqs[i]
            own.others = tuple(j for j in sorted(running) if j != i)
            own.solo = len(running) == 1
            if model is not None:
                model.evaluations.clear()
            k_step = min(run.planner.draft_max, n_batch - 1, run.limit - run.pos - 1)
            plan = run.planner.plan(run.history, k_step, GREEDY, rng)
            draft = verifiable(plan.draft, k_step, 0)
            acc = _agreement(draft, run.gen.output, run.pos)
            evals = list(model.evaluations) if model is not None else []
            steps.append((i, run, plan, draft, acc, evals))
        cached = max(len(run.history) - 1 for run in running.values())
        seconds = overhead
        drafted = [(i, ev[-1]) for i, _, _, _, _, ev in steps if ev]
        if drafted:  # catch-ups, then one row each per further draft position
            seconds += cost([(i, b) for i, (b, _) in drafted], truth.draft / truth.curve(1), 0)
            for j in range(1, max(n for _, (_, n) in drafted) + 1):
                rows = [(i, 1) for i, (_, n) in drafted if n >= j]
                seconds += cost(rows, truth.draft / truth.curve(1), 0)
        verify = verify_cost([(i, len(d.tokens) + 1) for i, _, _, d, _, _ in steps], cached)
        seconds += verify
        clock += seconds
        for i, run, plan, draft, acc, _ in steps:
            out = run.gen.output
            conf = run.gen.confidence[run.pos + acc] if run.pos + acc < len(out) else None
            run.planner.observe(plan, acc, verify, conf, rows=len(draft.tokens) + 1)
            name = plan.drafter.name if plan.drafter is not None and draft.tokens else "none"
            res.by_drafter[name] = res.by_drafter.get(name, 0) + 1
            res.steps += 1
            run.history.extend(out[run.pos : run.pos + acc + 1])
            run.pos += acc + 1
            if run.pos >= len(out):
                for d in run.planner.drafters:
                    d.finish(run.history)
                tokens += len(out)
                del running[i]
    res.add("all", clock, tokens)
    return res


@dataclasses.dataclass
class Row:
    """One category of the table on one machine: rates relative to the target alone."""

    machine: str
    category: str
    auto: float
    best_fixed: float
    best_fixed_name: str
    oracle: float
    #: auto mode with another tuning (``table``'s ``variant``), when given
    variant: float | None = None

    @property
    def goal(self) -> float:
        """The issue's bar: the better of the best fixed choice and 0.85 of the oracle."""
        return max(self.best_fixed, 0.85 * self.oracle)

    @property
    def ok(self) -> bool:
        """Auto at least the target alone and within 5% of :attr:`goal`."""
        return self.auto >= 1.0 and self.auto >= 0.95 * self.goal


def table(
    trace: Trace,
    machines: dict[str, Timings],
    *,
    tuning: AutoTuning = AUTO_TUNING,
    overhead: float = 0.0,
    fixed_ks: Iterable[int] = FIXED_KS,
    drafters: Sequence[str] = FIXED_DRAFTERS,
    variant: AutoTuning | None = None,
    overhead_alone: float | None = None,
) -> list[Row]:
    """Per machine, per category, Spec-Bench's columns pooled ("spec-bench", where bench's
    categories ("bench/...") are there too) and overall ("all"): auto, the best fixed drafter and
    length, and the oracle, each relative to the target alone (and auto with the
    ``variant`` tuning, when given). Every step costs ``overhead`` seconds more (Python's
    time), the target alone's ``overhead_alone`` (default: the same)."""
    rows: list[Row] = []
    has_model = any(g.chains for g in trace.generations)
    kinds = [d for d in drafters if d != "model" or has_model]
    for name, truth in machines.items():
        own = overhead if overhead_alone is None else overhead_alone
        alone = simulate(trace, truth, "none", 0, overhead=own)
        auto = simulate(trace, truth, "auto", tuning=tuning, overhead=overhead, overhead_alone=own)
        orc = oracle(trace, truth, overhead=overhead)
        var = (
            None
            if variant is None
            else simulate(
                trace, truth, "auto", tuning=variant, overhead=overhead, overhead_alone=own
            )
        )
        fixed = {f"{d} K={k}": simulate(trace, truth, d, k, overhead=overhead)
                 for d in kinds for k in fixed_ks}  # fmt: skip
        groups: list[tuple[str, str | list[str] | None]] = [(c, c) for c in trace.categories]
        spec = [c for c in trace.categories if not c.startswith("bench/")]
        if spec and len(spec) < len(trace.categories):
            groups.append(("spec-bench", spec))
        groups.append(("all", None))
        for label, cat in groups:
            base = alone.rate(cat)
            best = max(fixed, key=lambda f: fixed[f].rate(cat))
            rows.append(Row(name, label, auto.rate(cat) / base,
                            fixed[best].rate(cat) / base, best, orc.rate(cat) / base,
                            None if var is None else var.rate(cat) / base))  # fmt: skip
    return rows


@dataclasses.dataclass
class ParallelRow:
    """One machine's ``--parallel`` replay (:func:`simulate_parallel`): tokens/s of the
    target alone with N sequences, auto mode with 1 and with N, each relative to the
    target alone with 1; and what the curve allows N sequences over one,
    N t(1) / t(N)."""

    machine: str
    n_parallel: int
    target: float
    auto_one: float
    auto: float
    allows: float


def parallel_table(
    trace: Trace,
    machines: dict[str, Timings],
    n_parallel: int,
    *,
    tuning: AutoTuning = AUTO_TUNING,
    overhead: float = 0.0,
    overhead_alone: float | None = None,
) -> list[ParallelRow]:
    """Per machine, :class:`ParallelRow` (micro-batches of 512 rows on the GPU-like
    curve, as on builds that offload; else 128, as on CPU builds); Python's time per step
    as :func:`table` takes it."""
    rows = []
    own = overhead if overhead_alone is None else overhead_alone
    for name, truth in machines.items():
        ub = 512 if name == "gpu-like" else 128

        def rate(kind: str, n: int, ub: int = ub, truth: Timings = truth) -> float:
            res = simulate_parallel(trace, truth, kind, n, tuning=tuning, n_ubatch=ub,
                                    overhead=own if kind == "none" else overhead)  # fmt: skip
            return res.rate()

        base = rate("none", 1)
        rows.append(ParallelRow(name, n_parallel, rate("none", n_parallel) / base,
                                rate("auto", 1) / base, rate("auto", n_parallel) / base,
                                n_parallel * truth.curve(1) / truth.curve(n_parallel)))  # fmt: skip
    return rows


def format_parallel_table(rows: Sequence[ParallelRow]) -> str:
    """A markdown table of :class:`ParallelRow`."""
    if not rows:
        return ""
    n = rows[0].n_parallel
    out = [f"| machine | target -np {n} | auto -np 1 | auto -np {n} | auto / target at -np {n} "
           f"| the curve allows |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        out.append(f"| {r.machine} | {r.target:.2f}x | {r.auto_one:.2f}x | {r.auto:.2f}x "
                   f"| {r.auto / r.target:.3f}x | {r.allows:.2f}x |")  # fmt: skip
    return "\n".join(out)


def format_table(rows: Sequence[Row]) -> str:
    """The table as Markdown: one line per machine and category."""
    var = any(r.variant is not None for r in rows)
    lines = ["| machine | category | auto |" + (" variant |" if var else "")
             + " best fixed | (which) | oracle | goal | ok |",
             "|---|---|---|" + ("---|" if var else "") + "---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        v = f" {r.variant:.2f}x |" if r.variant is not None else (" - |" if var else "")
        lines.append(f"| {r.machine} | {r.category} | {r.auto:.2f}x |{v} {r.best_fixed:.2f}x "
                     f"| {r.best_fixed_name} | {r.oracle:.2f}x | {r.goal:.2f}x | "
                     f"{'yes' if r.ok else 'NO'} |")  # fmt: skip
    return "\n".join(lines)
