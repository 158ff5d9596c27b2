"""The speculative decoding loop: draft, verify in one target batch, accept, roll back.

Each step (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2):

1. a drafter proposes up to K tokens d1..dK after the committed sequence S;
2. the target evaluates [S[-1], d1..dK] in one batch, with logits at every position;
3. greedy: d_i is accepted while it equals the target's argmax; sampled: by modified
   rejection sampling (:mod:`specgguf.speculative.sampling`); the first rejection is replaced by
   the target's token, and when all K are accepted the target adds a bonus token;
4. both KV caches are rolled back to the committed length (the target keeps S[:-1]: the
   last committed token is evaluated at the start of the next step).

Greedy output is token for token what the target alone produces (K = 0 is that baseline);
sampled output follows the target's distribution under the same sampler settings. The loop
talks only to the :class:`~specgguf.speculative.drafters.Evaluator` and :class:`Vocabulary`
interfaces, so it runs on llama.cpp (through :class:`specgguf.engine.Engine`) or on a fake
backend in tests. Which drafter proposes, and how many tokens, is the planner's choice
(:mod:`specgguf.speculative.planner`); the loop clamps the draft length K to what the target's
batch, its context and ``n_predict`` leave, at every step, and nowhere else.

The draft length is called ``draft_max`` in code, JSON and flags (llama.cpp's
``--draft-max``, its server's ``speculative.n_max``) and K in formulas.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Generator, Iterator, Sequence
from typing import Any, Literal, Protocol

import numpy as np

from specgguf.errors import ContextOverflowError, UsageError
from specgguf.speculative.drafters import Draft, Evaluator
from specgguf.speculative.planner import FixedPlanner, Planner, call_sizes
from specgguf.speculative.sampling import (
    SamplerParams,
    accept_or_resample,
    accept_point_mass,
    distribution,
    keyed_uniform,
    sample,
    sample_at,
)
from specgguf.speculative.streaming import TextStream
from specgguf.speculative.tree import accept_greedy, first_branch, is_chain, leaves

FinishReason = Literal["stop", "length", "interrupted"]
GREEDY = SamplerParams(temperature=0.0)


class Vocabulary(Protocol):
    """The target's vocabulary as the loop needs it (see ``backend.LlamaModel``)."""

    n_vocab: int
    eog_ids: frozenset[int]

    def token_to_piece(self, token: int) -> bytes: ...


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


@dataclasses.dataclass
class DrafterStats:
    """What one drafter did in a generation: verification ``steps`` it drafted for (for
    "none": steps without drafts), tokens ``drafted`` and ``accepted``."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    def add(self, other: DrafterStats) -> None:
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted


@dataclasses.dataclass
class GenerationStats:
    """Counters and timings of one generation (seconds of wall time).

    ``drafted``: draft tokens sent to verification; ``accepted``: those the target kept;
    ``steps``: target verification passes (one per generated token without a drafter);
    ``rejected_steps``: steps where a draft token was rejected (for a token tree: at the
    last node accepted); ``tree_steps``: steps that verified a token tree of several
    branches (their ``drafted`` counts every node); ``draft_max``: the largest
    draft length this generation could use; ``last_draft``, ``last_drafter``: the latest
    step's. Several generations' statistics pool with :meth:`add`.
    """

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    generated: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    seconds: float = 0.0
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    draft_max: int = 0
    last_draft: int = 0
    last_drafter: str = "none"
    rejected_steps: int = 0
    tree_steps: int = 0
    by_drafter: dict[str, DrafterStats] = dataclasses.field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean draft tokens accepted per verification step."""
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of generation (prompt processing excluded)."""
        return self.generated / self.seconds if self.seconds > 0 else 0.0

    @property
    def python_seconds(self) -> float:
        """Generation time spent outside target and draft evaluation."""
        return max(0.0, self.seconds - self.target_seconds - self.draft_seconds)

    def add(self, other: GenerationStats) -> None:
        """Pool ``other`` into these counters and times (``draft_max`` becomes the larger;
        ``last_*`` are left as they are)."""
        for f in ("prompt_tokens", "prompt_seconds", "generated", "steps", "drafted",
                  "accepted", "seconds", "target_seconds", "draft_seconds",
                  "rejected_steps", "tree_steps"):  # fmt: skip
            setattr(self, f, getattr(self, f) + getattr(other, f))
        self.draft_max = max(self.draft_max, other.draft_max)
        for name, row in other.by_drafter.items():
            self.by_drafter.setdefault(name, DrafterStats()).add(row)

    def as_dict(self) -> dict[str, Any]:
        """JSON-able: every field and rate; ``by_drafter`` maps a drafter's name to
        ``[steps, drafted, accepted]``."""
        d = dataclasses.asdict(self)
        d["by_drafter"] = {
            name: [r.steps, r.drafted, r.accepted] for name, r in self.by_drafter.items()
        }
        d.update(
            acceptance_rate=round(self.acceptance_rate, 4),
            mean_accepted=round(self.mean_accepted, 4),
            tokens_per_s=round(self.tokens_per_s, 3),
            python_seconds=round(self.python_seconds, 4),
        )
        for k in ("prompt_seconds", "seconds", "target_seconds", "draft_seconds"):
            d[k] = round(d[k], 4)
        return d


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
    ) -> None:
        self.params = params
        self.prompt = prompt
        self.planner = planner
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


def _eval_until_rejected(
    target: Evaluator, tokens: list[int], rows_per_decode: int, banned: np.ndarray | None
) -> tuple[np.ndarray, int]:
    """Greedy verification of ``tokens`` (the last committed token, then the drafts) in the
    decode calls deterministic mode makes anyway (sizes as even as possible, at most
    ``rows_per_decode`` rows: :meth:`specgguf.llama.backend.LlamaContext.eval`), stopping
    after the first call in which the target's argmax differs from a draft: the rows after
    it cannot change the step. Every row's logits are the same whichever calls it is
    decoded in (deterministic mode's batch shapes are proven invariant at start-up), so
    the output is too.

    Returns:
        float32[m, n_vocab] logits of the m rows evaluated (``banned`` tokens at -inf), and
        m (``len(tokens)`` when every draft was accepted).
    """
    n = len(tokens)
    parts: list[np.ndarray] = []
    done = 0
    for size in call_sizes(n, rows_per_decode):
        part = np.array(target.eval(tokens[done : done + size], logits="all"))
        if banned is not None:
            part[:, banned] = -np.inf
        parts.append(part)
        done += size
        # row j predicts tokens[j + 1]; the last row of all predicts past the drafts
        best = part.argmax(axis=1)[: min(size, n - 1 - (done - size))]
        if np.any(best != np.asarray(tokens[done - size + 1 : done + 1][: len(best)])):
            break
    return np.concatenate(parts), done


class SpeculativeDecoder:
    """The draft/verify/accept loop over a target context.

    Args:
        target: the target's context (``Evaluator``).
        vocab: the target's vocabulary (pieces, end-of-generation ids).
    """

    def __init__(self, target: Evaluator, vocab: Vocabulary) -> None:
        self.target = target
        self.vocab = vocab

    @property
    def draft_capacity(self) -> int:
        """The largest draft length one verification batch can hold: K + 1 tokens must fit
        the target's batch and its logits outputs."""
        outputs = getattr(self.target, "n_outputs_max", self.target.n_batch)
        return max(0, min(self.target.n_batch, outputs) - 1)

    def generate(
        self, prompt: Sequence[int], params: GenerationParams, planner: Planner | None = None
    ) -> Generation:
        """Start generating after ``prompt`` (token ids, already tokenized with the
        target's rules), with the drafter and draft length of ``planner`` (None: the target
        alone). Nothing is evaluated until the first piece is requested.

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
        return Generation(self, ids, params, planner, draft_max)

    def _run(self, gen: Generation) -> Generator[str, None, None]:
        params, stats, target, planner = gen.params, gen.stats, self.target, gen.planner
        sampler = params.sampler
        history = list(gen.prompt)
        n_prompt = len(history)
        eog = self.vocab.eog_ids
        banned = np.array(sorted(eog), np.int64) if params.ignore_eos and eog else None
        rng = np.random.default_rng(sampler.seed)
        deterministic = bool(params.deterministic)
        # Deterministic sampling: drafts are point masses (greedy drafting), verified against
        # the target's own draws keyed by output position.
        draft_sampler = GREEDY if deterministic else sampler
        k_max = stats.draft_max
        # Token trees: greedy only (see specgguf.speculative.tree), and not in deterministic mode,
        # whose verification batches have fixed shapes.
        tree_branches = int(getattr(target, "tree_branches", 0))
        trees = sampler.greedy and not deterministic and tree_branches >= 2
        # Deterministic greedy verification in decode calls of at most this many rows
        # stops at the first call that shows a rejection (0: one evaluation).
        lazy = (
            int(getattr(target, "rows_per_decode", None) or 0)
            if (deterministic and sampler.greedy)
            else 0
        )
        limit = params.n_predict if params.n_predict >= 0 else math.inf

        def draft_seconds() -> float:
            return sum(d.seconds for d in planner.drafters)

        t0 = time.perf_counter()
        planner.reset()
        target.rollback(0)
        if n_prompt > 1:
            target.eval(history[:-1], logits="none")
        for drafter in planner.drafters:  # a draft model reads the prompt now, like the target
            prefill = getattr(drafter, "prefill", None)
            if prefill is not None:
                prefill(history)
        stats.prompt_seconds = time.perf_counter() - t0
        target_s0 = target.eval_seconds
        draft_s0 = draft_seconds()  # after the draft's prompt: that counts as prompt time
        t_gen = time.perf_counter()
        finish: FinishReason | None = None
        while finish is None:
            if gen.cancelled:
                finish = "interrupted"
                break
            remaining = limit - (len(history) - n_prompt)
            room = target.n_ctx - len(history)
            if remaining <= 0 or room <= 0:
                finish = "length"
                break
            # K + 1 new tokens must fit the context and the batch, and not overshoot n_predict.
            k = int(min(k_max, room - 1, remaining - 1))
            plan = planner.plan(history, k, draft_sampler, rng)
            draft = plan.draft
            d = draft.tokens[:k]
            parents = draft.parents[:k] if draft.parents is not None else None
            if parents is not None and (
                is_chain(parents) or not trees or len(leaves(parents)) > tree_branches
            ):
                # A chain, or a tree where trees are not verified (sampling, deterministic
                # mode, a target without them): its first branch, as a chain.
                d = [d[i] for i in first_branch(parents)]
                draft = Draft(d)
                parents = None
            t_verify = time.perf_counter()
            rows = len(d) + 1  # target rows evaluated
            masked = False  # banned tokens already at -inf
            if parents is not None:
                logits = target.eval_tree(history[-1], d, parents)  # type: ignore[attr-defined]
            elif lazy and len(d) + 1 > lazy:
                logits, rows = _eval_until_rejected(target, [history[-1], *d], lazy, banned)
                masked = True
            else:
                logits = target.eval([history[-1], *d], logits="all")
            t_verify = time.perf_counter() - t_verify
            if banned is not None and not masked:
                logits = logits.copy()
                logits[:, banned] = -np.inf
            path: list[int] = []
            if parents is not None:
                path, x = accept_greedy(d, parents, logits.argmax(axis=1))
                n = len(path)
                accepted = [d[i] for i in path]
                # the row of the last accepted node (the root's when none was)
                last_row = path[-1] + 1 if path else 0
                rejected = (path[-1] if path else -1) in parents
            else:
                if sampler.greedy:
                    best = logits.argmax(axis=1)
                    n = 0
                    while n < len(d) and best[n] == d[n]:
                        n += 1
                    x = int(best[n])
                elif deterministic:
                    n, x = self._accept_keyed(logits, d, sampler, len(history) - n_prompt)
                else:
                    n, x = self._accept_sampled(logits, draft, d, sampler, rng)
                accepted, last_row, rejected = d[:n], n, n < len(d)
            new = [*accepted, x]
            conf = None
            if planner.wants_confidence:
                row = logits[last_row]  # the target's top-1 probability for its token
                conf = 1.0 / float(np.exp(row - row.max()).sum())
            planner.observe(plan, n, t_verify, conf, rows=rows)
            # Commit the step's tokens one at a time: the earliest of an end-of-generation
            # token, n_predict and a completed stop string ends the output at that token, and
            # the tokens, the text and the statistics all end there.
            committed: list[int] = []
            pieces: list[str] = []
            for t in new:
                if t in eog:
                    finish = "stop"
                    break
                if len(committed) >= remaining:
                    finish = "length"
                    break
                committed.append(t)
                pieces.append(gen.stream.push(self.vocab.token_to_piece(t)))
                if gen.stream.stopped:
                    finish = "stop"
                    break
            kept = min(n, len(committed))  # drafts past the end are not accepted output
            stats.steps += 1
            stats.drafted += len(d)
            stats.accepted += kept
            stats.rejected_steps += rejected and len(committed) > n  # its correction kept
            stats.tree_steps += parents is not None
            stats.last_draft = len(d)
            name = plan.drafter.name if plan.drafter is not None and d else "none"
            stats.last_drafter = name
            row = stats.by_drafter.setdefault(name, DrafterStats())
            row.steps += 1
            row.drafted += len(d)
            row.accepted += kept
            history.extend(committed)
            gen.tokens.extend(committed)
            if parents is not None:  # the root and the accepted branch join the text
                target.keep_tree_path(path)  # type: ignore[attr-defined]
            target.rollback(len(history) - 1)
            piece = "".join(pieces)
            stats.generated = len(gen.tokens)
            stats.seconds = time.perf_counter() - t_gen
            stats.target_seconds = target.eval_seconds - target_s0
            stats.draft_seconds = draft_seconds() - draft_s0
            if piece:
                yield piece
        tail = gen.stream.finish()
        stats.seconds = time.perf_counter() - t_gen
        stats.target_seconds = target.eval_seconds - target_s0
        stats.draft_seconds = draft_seconds() - draft_s0
        gen.result = GenerationResult(gen.stream.text, list(gen.tokens), finish, stats)
        if tail:
            yield tail

    @staticmethod
    def _accept_keyed(
        logits: np.ndarray, d: list[int], sampler: SamplerParams, index: int
    ) -> tuple[int, int]:
        """Deterministic sampling along a point-mass draft: the target's token at output
        position ``index + i`` is drawn with a uniform keyed by that position; the draft
        is accepted while it equals those tokens. (accepted count, next token)"""
        for i in range(len(d) + 1):
            y = sample_at(distribution(logits[i], sampler), keyed_uniform(sampler.seed, index + i))
            if i == len(d) or y != d[i]:
                return i, y
        raise AssertionError("unreachable")

    @staticmethod
    def _accept_sampled(
        logits: np.ndarray,
        draft: Draft,
        d: list[int],
        sampler: SamplerParams,
        rng: np.random.Generator,
    ) -> tuple[int, int]:
        """Modified rejection sampling along the draft: (accepted count, next token)."""
        for i, tok in enumerate(d):
            p = distribution(logits[i], sampler)
            if draft.dists is not None:
                ok, y = accept_or_resample(p, draft.dists[i], tok, rng)
            else:
                ok, y = accept_point_mass(p, tok, rng)
            if not ok:
                return i, y
        return len(d), sample(distribution(logits[len(d)], sampler), rng)
