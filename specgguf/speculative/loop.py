"""The speculative decoding loop: draft, verify in one target batch, accept, roll back.

Each step (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2):

1. a drafter proposes up to K tokens d1..dK after the committed sequence S;
2. the target evaluates [S[-1], d1..dK] in one batch, with logits at every position;
3. the longest acceptable prefix is kept, plus one token of the target's own
   (:mod:`specgguf.speculative.verification`: greedy, sampled and deterministic rules);
4. both KV caches are rolled back to the committed length (the target keeps S[:-1]: the
   last committed token is evaluated at the start of the next step).

A generation starts from what the target's cache holds: the prefix its prompt shares with
it is kept and only the rest is read (``GenerationParams.cache_prompt``), and it ends with
the cache holding the text, for the next generation to reuse.

Greedy output is token for token what the target alone produces (K = 0 is that baseline);
sampled output follows the target's distribution under the same sampler settings. The loop
talks only to the :class:`~specgguf.speculative.draft.TargetEvaluator` and
:class:`~specgguf.speculative.draft.Vocabulary` interfaces, so it runs on llama.cpp
(through :class:`specgguf.engine.Engine`) or on a fake backend in tests. Which drafter
proposes, and how many tokens, is the planner's choice (:mod:`specgguf.speculative.planner`);
the loop clamps the draft length K to what the target's batch, its context and
``n_predict`` leave, at every step, and nowhere else.

Under a grammar (:mod:`specgguf.speculative.grammar`), the tokens it forces are the step's
draft without a drafter, a drafter's draft is cut before the first token it forbids, and
every row's logits are masked to the tokens it allows there.

The draft length is called ``draft_max`` in code, JSON and flags (llama.cpp's
``--draft-max``, its server's ``speculative.n_max``) and K in formulas.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Generator, Iterator, Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from specgguf.errors import ContextOverflowError, UsageError
from specgguf.speculative.arms.base import StepPlan
from specgguf.speculative.draft import Draft, TargetEvaluator, Vocabulary
from specgguf.speculative.grammar import Constraint, GrammarSpec
from specgguf.speculative.planner import FixedPlanner, Planner
from specgguf.speculative.sampling import SamplerParams
from specgguf.speculative.stats import DrafterStats, GenerationStats
from specgguf.speculative.streaming import TextStream
from specgguf.speculative.verification import Verdict, _masked, accept, evaluate, verifiable

__all__ = [
    "DrafterStats", "FinishReason", "Generation", "GenerationParams", "GenerationResult",
    "GenerationStats", "SpeculativeDecoder", "Vocabulary",
]  # fmt: skip

FinishReason = Literal["stop", "length", "interrupted"]
GREEDY = SamplerParams(temperature=0.0)


@dataclasses.dataclass(frozen=True)
class GenerationParams:
    """What to generate.

    ``n_predict``: maximum new tokens (-1: until an end-of-generation token, a stop string,
    or a full context). ``stop``: strings that end the output (not included in it).
    ``ignore_eos``: never generate end-of-generation tokens (their target logits are set to
    -inf, as llama.cpp's ``--ignore-eos`` does), for fixed-length runs.

    Speculative settings for this generation, each None for the engine's own (see
    :class:`specgguf.engine.SpeculativeConfig`; the loop itself takes its drafter and draft
    length from the planner it is given): ``drafter`` ("auto", "model", "ngram", "none"),
    ``draft_max`` (the draft length K; with "auto" the largest), ``draft_min`` (the
    shortest draft that is verified, llama.cpp's ``speculative.n_min``: shorter drafts are
    dropped and the step runs without them), ``p_min`` (a draft model stops drafting at a
    token it gives less than this probability), ``deterministic``
    (output independent of the drafter, the draft length and timings: drafts are greedy
    point masses, and sampled tokens come from draws keyed by their output position, see
    :mod:`specgguf.speculative.sampling`; the engine also fixes the verification batch shapes),
    ``draft_tree`` (the most branches of a token tree, greedy only; 0: chains; at most what
    the engine was loaded with, see :class:`specgguf.engine.SpeculativeConfig`).
    ``grammar``: a constraint on the output (JSON Schema, GBNF, regex; see
    :mod:`specgguf.speculative.grammar`), compiled by the engine; None: free text.
    ``cache_prompt``: keep what the target's cache shares with the prompt from the
    generations before and read only the rest (llama-server's ``cache_prompt``); False
    reads the whole prompt.
    """

    n_predict: int = -1
    sampler: SamplerParams = dataclasses.field(default_factory=SamplerParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    drafter: str | None = None
    draft_max: int | None = None
    p_min: float | None = None
    deterministic: bool | None = None
    draft_min: int | None = None
    draft_tree: int | None = None
    grammar: GrammarSpec | None = None
    cache_prompt: bool = True


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """The output: ``text`` (decoded, without the stop string or EOG token), ``tokens``
    (generated ids, EOG excluded), ``finish_reason``, and the statistics."""

    text: str
    tokens: list[int]
    finish_reason: FinishReason
    stats: GenerationStats


class Generation:
    """A running generation: iterate for text pieces (complete UTF-8 only); ``result``
    is set when the iteration ends, or by :meth:`interrupt` (Ctrl-C). :meth:`cancel` may be
    called from another thread: the generation ends before its next step."""

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        prompt: list[int],
        params: GenerationParams,
        planner: Planner,
        draft_max: int,
        constraint: Constraint | None = None,
        media: Sequence[object] = (),
    ) -> None:
        self.params = params
        self.prompt = prompt
        #: what the target reads at some of the prompt's positions instead of its tokens
        #: (images: :class:`specgguf.llama.media.MediaSpan`), opaque here
        self.media = tuple(media)
        self.planner = planner
        self.constraint = constraint
        self.tokens: list[int] = []
        self.stats = GenerationStats(prompt_tokens=len(prompt), draft_max=draft_max)
        self.stream = TextStream(params.stop)
        self.result: GenerationResult | None = None
        self.cancelled = False
        self._it = decoder._run(self)

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return next(self._it)

    def run(self) -> GenerationResult:
        """Generate to the end; returns the result."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    def cancel(self) -> None:
        """Ask the generation to end before its next speculative step (finish reason
        "interrupted"); safe to call from another thread while it is being iterated."""
        self.cancelled = True

    def interrupt(self) -> GenerationResult:
        """Stop here (after Ctrl-C): the result holds what was committed so far."""
        with contextlib.suppress(Exception):
            self._it.close()
        if self.result is None:
            self.result = GenerationResult(
                self.stream.text, list(self.tokens), "interrupted", self.stats
            )
        return self.result


#: :func:`top_probability` sums the exponentials of the logits less than this far below
#: the row's maximum only: each left out weighs at most e^-16 of the maximum's, so the
#: probability is high by at most n_vocab e^-16 relative (1.7% at 151,936 tokens; at most
#: 0.04% on 48 rows of Qwen2.5 Coder 1.5B, where a median of 237 logits were that near).
NEAR_MAX = 16.0


@dataclasses.dataclass
class RowBuffers:
    """Arrays :func:`top_probability` reuses from one step to the next (None: not made yet;
    remade when a row of another size comes)."""

    softmax: npt.NDArray[np.float32] | None = None
    near: npt.NDArray[np.bool_] | None = None


@dataclasses.dataclass
class _Run:
    """One generation's state inside the loop.

    ``max_leaves``: the most leaves of a tree verified as one (0: trees are verified as
    their first branch: sampling, deterministic mode, a target without tree sequences);
    ``lazy_rows``: deterministic greedy verification in decode calls of at most this many
    rows, stopping at the first call that shows a rejection (0: one evaluation);
    ``keyed``: deterministic sampled acceptance (draws keyed by output position);
    ``banned``: ids whose logits are -inf (``ignore_eos``)."""

    history: list[int]
    n_prompt: int
    limit: float
    rng: np.random.Generator
    draft_sampler: SamplerParams
    banned: npt.NDArray[np.int64] | None
    max_leaves: int
    lazy_rows: int
    keyed: bool
    target_s0: float = 0.0
    draft_s0: float = 0.0
    deferred_s0: float = 0.0
    prompt_seconds: float = 0.0
    t_gen: float = 0.0
    buffers: RowBuffers = dataclasses.field(default_factory=RowBuffers)

    @property
    def remaining(self) -> float:
        """Tokens ``n_predict`` still allows."""
        return self.limit - (len(self.history) - self.n_prompt)


class SpeculativeDecoder:
    """The draft/verify/accept loop over a target context.

    Args:
        target: the target's context.
        vocab: the target's vocabulary (pieces, end-of-generation ids).
    """

    def __init__(self, target: TargetEvaluator, vocab: Vocabulary) -> None:
        self.target = target
        self.vocab = vocab

    @property
    def draft_capacity(self) -> int:
        """The largest draft length one verification batch can hold: K + 1 tokens must fit
        the target's batch and its logits outputs, and a recurrent target must be able to
        drop all K drafts again (``rollback_max``, its state's snapshots)."""
        rows = min(self.target.n_batch, self.target.n_outputs_max)
        if self.target.rollback_max is not None:
            rows = min(rows, self.target.rollback_max + 1)
        return max(0, rows - 1)

    def generate(
        self,
        prompt: Sequence[int],
        params: GenerationParams,
        planner: Planner | None = None,
        constraint: Constraint | None = None,
        media: Sequence[object] = (),
    ) -> Generation:
        """Start generating after ``prompt`` (token ids, already tokenized with the
        target's rules), with the drafter and draft length of ``planner`` (None: the target
        alone), the output held to ``constraint`` (a grammar at its start, see
        :mod:`specgguf.speculative.grammar`; None: free); ``media``: what the target reads
        at some of the prompt's positions instead of their tokens (passed to its
        ``reuse`` and ``prompt``). Nothing is evaluated until the first piece is
        requested.

        Raises:
            UsageError: the prompt is empty.
            ContextOverflowError: the prompt leaves no room in the target's context.
        """
        ids = list(prompt)
        if not ids:
            raise UsageError("the prompt is empty: nothing to continue from")
        if len(ids) >= self.target.n_ctx:
            raise ContextOverflowError(len(ids), self.target.n_ctx)
        planner = planner or FixedPlanner(None, 0)
        draft_max = min(planner.draft_max, self.draft_capacity)
        return Generation(self, ids, params, planner, draft_max, constraint, media)

    def _run(self, gen: Generation) -> Generator[str, None, None]:
        """Plan, verify, accept, commit, roll back, until a finish reason; yields text."""
        run = self._start(gen)
        finish: FinishReason | None = None
        lean = _lean(gen, run)
        if lean and type(gen.planner) is FixedPlanner and gen.planner.drafter is None:
            finish = yield from self._run_alone(gen, run, math.inf)
        while finish is None:
            if lean and (passing := gen.planner.pass_steps()):
                finish = yield from self._run_alone(gen, run, passing)
                if finish is not None:
                    break
            if gen.cancelled:
                finish = "interrupted"
                break
            room = self.target.n_ctx - len(run.history)
            if run.remaining <= 0 or room <= 0:
                finish = "length"
                break
            grammar = gen.constraint
            if grammar is not None and grammar.done:
                finish = "stop"  # only an end of generation is left (or none: ignore_eos)
                break
            # K + 1 new tokens must fit the context and the batch, and not overshoot n_predict.
            k = int(min(gen.stats.draft_max, room - 1, run.remaining - 1))
            forced = grammar.forced(k) if grammar is not None else []
            if forced:  # jump-forward: the grammar's own tokens, no drafter asked
                plan = StepPlan(None, Draft(forced), math.nan)
            else:
                t0, d0 = time.perf_counter(), _drafting_seconds(gen)
                plan = gen.planner.plan(run.history, k, run.draft_sampler, run.rng)
                _count_planning(gen, t0, d0)
            draft = verifiable(plan.draft, k, run.max_leaves)
            allowed = None
            if grammar is not None:
                n_valid = grammar.valid_prefix(draft.tokens)
                gen.stats.grammar_cut += len(draft.tokens) - n_valid
                draft = draft.head(n_valid)
                allowed = grammar.masks(draft.tokens)
                if run.banned is not None:  # ignore_eos: until the grammar allows only an end
                    allowed = _without(allowed, run.banned)
            logits, rows, seconds = evaluate(
                self.target, run.history[-1], draft, lazy_rows=run.lazy_rows,
                banned=run.banned if allowed is None else None, allowed=allowed,
            )  # fmt: skip
            keyed_at = len(run.history) - run.n_prompt if run.keyed else None
            verdict = accept(draft, logits, gen.params.sampler, run.rng, keyed_at=keyed_at)
            if not forced:
                confidence = None
                if gen.planner.wants_confidence:  # the target's top-1 probability of its token
                    confidence = top_probability(logits[verdict.row], run.buffers)
                # a draft cut by the grammar counts as rejected at the cut: its rows and
                # acceptance are the cut draft's
                t0, d0 = time.perf_counter(), _drafting_seconds(gen)
                gen.planner.observe(plan, len(verdict.accepted), seconds, confidence, rows=rows)
                _count_planning(gen, t0, d0)
            piece, finish = self._commit(gen, run, plan, draft, verdict, forced=bool(forced))
            if piece:
                yield piece
        tail = gen.stream.finish()
        for drafter in gen.planner.drafters:
            drafter.finish(run.history)
        self._clock(gen, run)
        gen.result = GenerationResult(gen.stream.text, list(gen.tokens), finish, gen.stats)
        if tail:
            yield tail

    def _run_alone(
        self, gen: Generation, run: _Run, steps: float
    ) -> Generator[str, None, FinishReason | None]:
        """Up to ``steps`` steps of the target alone, one token each: what :meth:`_run`'s
        steps do with no draft (an empty plan, a verification of one row, its commit),
        without their general case, whose Python costs a fifth of a step of a fast target
        (see docs/performance.md). Yields text; returns the finish reason (None: the
        steps were run and the generation goes on)."""
        target, stats, stream = self.target, gen.stats, gen.stream
        history, tokens, piece_of = run.history, gen.tokens, self.vocab.token_to_piece
        eog, banned, sampler = self.vocab.eog_ids, run.banned, gen.params.sampler
        n_ctx, limit, n_prompt = target.n_ctx, run.limit, run.n_prompt
        greedy = sampler.greedy
        lone = getattr(target, "eval_lone", None) or (lambda t: target.eval([t], logits="all")[0])
        by_drafter = stats.by_drafter
        if gen.planner.drafters:  # (no drafter runs in these steps: its times stay)
            self._clock(gen, run)
        # (_clock's sums over the drafters, constant here, cost more than the rest)
        t_gen = run.t_gen + sum(d.prompt_seconds for d in gen.planner.drafters) - run.deferred_s0
        done = 0
        while done < steps:
            done += 1
            if gen.cancelled:
                return "interrupted"
            n = len(history)
            if n - n_prompt >= limit or n >= n_ctx:
                return "length"
            row = lone(history[-1])
            if greedy:
                t = int(row.argmax())
                if banned is not None and t in eog:  # (as accept() on masked logits)
                    masked = np.array(row)
                    masked[banned] = -np.inf
                    t = int(masked.argmax())
            else:
                rows = _masked(row[None], banned, None)
                keyed_at = n - n_prompt if run.keyed else None
                t = accept(_NO_DRAFT, rows, sampler, run.rng, keyed_at=keyed_at).token
            if t in eog:
                stats.record_step("none", 0, 0, rejected=False, tree=False)
                self._clock(gen, run)
                return "stop"
            piece = stream.push(piece_of(t))
            history.append(t)
            tokens.append(t)
            # (record_step("none", 0, 0, ...) inlined: its call cost a few us a token)
            stats.steps += 1
            stats.last_draft = 0
            stats.last_drafter = "none"
            if (lone_stats := by_drafter.get("none")) is None:
                lone_stats = by_drafter["none"] = DrafterStats()
            lone_stats.steps += 1
            stats.generated = len(tokens)
            stats.seconds = time.perf_counter() - t_gen
            stats.target_seconds = target.eval_seconds - run.target_s0
            if piece:  # (text held back before, released by a stop string too)
                yield piece
            if stream.stopped:
                return "stop"
        return None

    def _start(self, gen: Generation) -> _Run:
        """Process the prompt (the target's KV cache holds all but its last token; a draft
        model reads it too) and set up the generation's state."""
        params, planner, target = gen.params, gen.planner, self.target
        sampler, det = params.sampler, bool(params.deterministic)
        # Seeded sampling (and deterministic mode) draws the target's token at each output
        # position with a uniform keyed by the seed and the position: the same seed gives
        # the same text whatever the drafter proposed, as llama.cpp's draws do (one per
        # output token, common_sampler_sample_and_accept_n in common/sampling.cpp).
        keyed = not sampler.greedy and (det or sampler.seed is not None)
        eog = self.vocab.eog_ids
        run = _Run(
            list(gen.prompt), len(gen.prompt),
            params.n_predict if params.n_predict >= 0 else math.inf,
            np.random.default_rng(sampler.seed),
            # keyed draws and grammars: drafts are point masses (greedy drafting), verified
            # against the target's own draws (a grammar cuts them: see speculative/grammar.py)
            GREEDY if det or keyed or gen.constraint is not None else sampler,
            np.array(sorted(eog), np.int64) if params.ignore_eos and eog else None,
            # token trees: greedy only, and not in deterministic mode, whose verification
            # batches have fixed shapes, nor under a grammar, which masks a chain
            target.tree_branches if sampler.greedy and not det and gen.constraint is None else 0,
            (target.rows_per_decode or 0) if det and sampler.greedy else 0,
            keyed,
        )  # fmt: skip
        t0 = time.perf_counter()
        gen.stats.constrained = gen.constraint is not None
        planner.reset()
        for d in planner.drafters:  # (a draft model reads the media it has rows for)
            if (see := getattr(d, "see_media", None)) is not None:
                see(gen.media)
        history = run.history
        keep: list[int] = []
        if params.cache_prompt:  # the last token is read with the first verification
            bounds = [b for d in planner.drafters if (b := d.reuse_limit(history)) is not None]
            keep = history[: min([len(history) - 1, *bounds])]
        cached = target.reuse(keep, exact=det, media=gen.media)
        target.prompt(history[cached:-1], exact=det, media=gen.media)
        planner.prefill(history)
        gen.stats.prompt_cached = cached
        gen.stats.prompt_seconds = run.prompt_seconds = time.perf_counter() - t0
        run.target_s0 = target.eval_seconds
        run.draft_s0 = sum(d.seconds for d in planner.drafters)  # the prompt's counted above
        run.deferred_s0 = sum(d.prompt_seconds for d in planner.drafters)
        run.t_gen = time.perf_counter()
        return run

    def _commit(
        self,
        gen: Generation,
        run: _Run,
        plan: StepPlan,
        draft: Draft,
        verdict: Verdict,
        *,
        forced: bool = False,
    ) -> tuple[str, FinishReason | None]:
        """Commit the step's tokens one at a time: the earlier of an end-of-generation token
        and a completed stop string ends the output at that token, and the tokens, the text
        and the statistics all end there (``n_predict`` is never passed: the step's K
        leaves room for its tokens). Both the target's KV cache and the history then hold
        the committed text (the target all but its last token). Returns the text to emit
        and the finish reason, if any."""
        eog = self.vocab.eog_ids
        committed: list[int] = []
        pieces: list[str] = []
        finish: FinishReason | None = None
        for t in [*verdict.accepted, verdict.token]:
            if t in eog:
                finish = "stop"
                break
            committed.append(t)
            pieces.append(gen.stream.push(self.vocab.token_to_piece(t)))
            if gen.stream.stopped:
                finish = "stop"
                break
        n = len(verdict.accepted)
        if gen.constraint is not None:
            gen.constraint.commit(committed)
        if forced:
            name = "grammar"
        else:
            name = plan.drafter.name if plan.drafter is not None and draft.tokens else "none"
        gen.stats.record_step(
            name, len(draft.tokens), min(n, len(committed)),  # drafts past the end: not output
            rejected=verdict.rejected and len(committed) > n,  # its correction kept
            tree=draft.parents is not None,
        )  # fmt: skip
        run.history.extend(committed)
        gen.tokens.extend(committed)
        if verdict.path is not None:  # the root and the accepted branch join the text
            self.target.keep_tree_path(verdict.path)
        # The cache keeps the committed text but its last token, which opens the next
        # verification; at the end, every committed token it evaluated (a draft accepted,
        # not the target's own last one), for the next generation to reuse.
        keep = len(run.history) - (finish is None or len(committed) > n)
        room = self.target.rollback_room
        if finish is None or room is None or self.target.n_past - keep <= room:
            self.target.rollback(keep)
        # else the output ends before the step's first token, and a recurrent state would
        # be read again to drop it: the next generation goes back to a checkpoint instead
        gen.stats.generated = len(gen.tokens)
        self._clock(gen, run)
        return "".join(pieces), finish

    def _clock(self, gen: Generation, run: _Run) -> None:
        """The generation's times so far (seconds): all, the target's, the drafters'; a
        prompt a drafter read at its first draft (:meth:`Drafter.defer`) counts as the
        prompt's time, as when it was read ahead."""
        stats, drafters = gen.stats, gen.planner.drafters
        deferred = sum(d.prompt_seconds for d in drafters) - run.deferred_s0
        stats.prompt_seconds = run.prompt_seconds + deferred
        stats.seconds = time.perf_counter() - run.t_gen - deferred
        stats.target_seconds = self.target.eval_seconds - run.target_s0
        stats.draft_seconds = sum(d.seconds for d in drafters) - run.draft_s0 - deferred


_NO_DRAFT = Draft([])


def _lean(gen: Generation, run: _Run) -> bool:
    """Whether a step of the target alone in ``gen`` is one row, committed whole (the
    lean steps of :meth:`SpeculativeDecoder._run_alone`): no grammar, no deterministic
    mode (whose lone rows are padded)."""
    return gen.constraint is None and not gen.params.deterministic and not run.lazy_rows


def _drafting_seconds(gen: Generation) -> float:
    return sum(d.seconds for d in gen.planner.drafters)


def _count_planning(gen: Generation, t0: float, d0: float) -> None:
    """Count the time since ``t0`` as the planner's own (``plan_seconds``), its drafters'
    time since they had spent ``d0`` left out (theirs is ``draft_seconds``)."""
    spent = time.perf_counter() - t0 - (_drafting_seconds(gen) - d0)
    gen.stats.plan_seconds += max(0.0, spent)


def top_probability(row: npt.NDArray[np.float32], buffers: RowBuffers) -> float:
    """softmax(row).max() for a float32[n_vocab] row of logits: 1 / sum(exp(row - max)),
    the sum over the logits within :data:`NEAR_MAX` of the maximum, or over the whole
    row where a quarter of it or more is that near (or it has no finite maximum: NaN
    then).

    Auto mode reads it as a moving average's input. A whole row's exponentials cost about
    250 us a step at 151,936 logits on a 2-core EPYC, the near ones about 50 (a
    confident model's row: ``scripts/bench-overhead``'s vocabulary table)."""
    if buffers.near is None or buffers.near.shape != row.shape:
        buffers.near = np.empty(row.shape, np.bool_)
    top = row.max()
    near = row[np.greater(row, top - np.float32(NEAR_MAX), out=buffers.near)]  # (a copy)
    if near.size and 4 * near.size < row.size:
        np.subtract(near, top, out=near)
        return 1.0 / float(np.exp(near, out=near).sum())
    buf = buffers.softmax
    if buf is None or buf.shape != row.shape:
        buf = buffers.softmax = np.empty(row.shape, np.float32)
    np.subtract(row, top, out=buf)
    np.exp(buf, out=buf)
    return 1.0 / float(buf.sum())


def _without(
    allowed: npt.NDArray[np.bool_], banned: npt.NDArray[np.int64]
) -> npt.NDArray[np.bool_]:
    """A grammar's masks (``bool[rows, n_vocab]``) with the ``banned`` tokens (the ends of
    generation ``ignore_eos`` bans) taken out of every row that allows anything else: where
    the grammar is complete, its end is the only token left, and the output ends there."""
    out = np.array(allowed)
    out[:, banned] = False
    empty = ~out.any(axis=1)
    out[empty] = allowed[empty]
    return out
