"""The speculative decoding loop: draft, verify in one target batch, accept, roll back.

Each step (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2):

1. a drafter proposes up to K tokens d1..dK after the committed sequence S;
2. the target evaluates [S[-1], d1..dK] in one batch, with logits at every position;
3. greedy: d_i is accepted while it equals the target's argmax; sampled: by modified
   rejection sampling (:mod:`specgguf.sampling`); the first rejection is replaced by the
   target's token, and when all K are accepted the target adds a bonus token;
4. both KV caches are rolled back to the committed length (the target keeps S[:-1]: the
   last committed token is evaluated at the start of the next step).

Greedy output is token for token what the target alone produces (K = 0 is that baseline);
sampled output follows the target's distribution under the same sampler settings. The loop
talks only to the :class:`~specgguf.drafters.Evaluator` and :class:`Vocabulary` interfaces,
so it runs on llama.cpp (:class:`SpeculativeEngine`) or on a fake backend in tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from specgguf.costmodel import (
    AutoPlanner,
    FixedPlanner,
    Plan,
    Timings,
    calibrate,
    calibration_key,
    load_calibration,
    save_calibration,
)
from specgguf.drafters import Draft, Drafter, Evaluator, ModelDrafter, NgramDrafter
from specgguf.errors import ContextOverflowError, UsageError
from specgguf.sampling import (
    SamplerParams,
    accept_or_resample,
    accept_point_mass,
    distribution,
    sample,
)
from specgguf.streaming import TextStream

FinishReason = Literal["stop", "length", "interrupted"]


class Vocabulary(Protocol):
    """The target's vocabulary as the loop needs it (see ``backend.LlamaModel``)."""

    n_vocab: int
    eog_ids: frozenset[int]

    def token_to_piece(self, token: int) -> bytes: ...


@dataclasses.dataclass(frozen=True)
class GenerationParams:
    """What to generate.

    ``n_predict``: maximum new tokens (-1: until an end-of-generation token, a stop string,
    or a full context). ``draft_max``: the draft length K (tokens proposed per step).
    ``stop``: strings that end the output (not included in it). ``ignore_eos``: never
    generate end-of-generation tokens (their target logits are set to -inf, as llama.cpp's
    ``--ignore-eos`` does), for fixed-length runs.
    """

    n_predict: int = -1
    draft_max: int = 8
    sampler: SamplerParams = dataclasses.field(default_factory=SamplerParams)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclasses.dataclass
class GenerationStats:
    """Counters and timings of one generation (seconds of wall time).

    ``drafted``: draft tokens sent to verification; ``accepted``: those the target kept;
    ``steps``: target verification passes (one per generated token without a drafter).
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
    #: drafter name -> [steps, drafted, accepted]
    by_drafter: dict[str, list[int]] = dataclasses.field(default_factory=dict)

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

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
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
    is set when the iteration ends, or by :meth:`interrupt` (Ctrl-C)."""

    def __init__(self, decoder: SpeculativeDecoder, prompt: list[int], params: GenerationParams):
        self.params = params
        self.prompt = prompt
        self.tokens: list[int] = []
        self.stats = GenerationStats(prompt_tokens=len(prompt), draft_max=params.draft_max)
        self.stream = TextStream(params.stop)
        self.result: GenerationResult | None = None
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

    def interrupt(self) -> GenerationResult:
        """Stop here (after Ctrl-C): the result holds what was committed so far."""
        with contextlib.suppress(Exception):
            self._it.close()
        if self.result is None:
            self.result = GenerationResult(
                self.stream.text, list(self.tokens), "interrupted", self.stats
            )
        return self.result


class Planner(Protocol):
    """Chooses the drafter and draft for each step (see :mod:`specgguf.costmodel`)."""

    drafters: list[Drafter]

    def reset(self) -> None: ...

    def plan(
        self, history: Sequence[int], k_max: int, sampler: SamplerParams, rng: np.random.Generator
    ) -> Plan: ...

    wants_confidence: bool

    def observe(
        self, plan: Plan, accepted: int, verify_seconds: float, confidence: float | None = None
    ) -> None: ...


class SpeculativeDecoder:
    """The draft/verify/accept loop over a target context and an optional drafter.

    Args:
        target: the target's context (``Evaluator``).
        vocab: the target's vocabulary (pieces, end-of-generation ids).
        drafter: proposes tokens with a fixed draft length (``GenerationParams.draft_max``);
            None decodes with the target alone (the baseline).
        planner: instead of ``drafter``, chooses drafter and K at each step
            (:class:`specgguf.costmodel.AutoPlanner`).
    """

    def __init__(
        self,
        target: Evaluator,
        vocab: Vocabulary,
        drafter: Drafter | None = None,
        planner: Planner | None = None,
    ) -> None:
        self.target = target
        self.vocab = vocab
        self.drafter = drafter
        self.planner = planner

    def generate(self, prompt: Sequence[int], params: GenerationParams) -> Generation:
        """Start generating after ``prompt`` (token ids, already tokenized with the
        target's rules). Nothing is evaluated until the first piece is requested.

        Raises (on first iteration):
            UsageError: the prompt is empty.
            ContextOverflowError: the prompt leaves no room in the target's context.
        """
        return Generation(self, list(prompt), params)

    def _run(self, gen: Generation) -> Generator[str, None, None]:
        params, stats, target = gen.params, gen.stats, self.target
        sampler = params.sampler
        history = list(gen.prompt)
        n_prompt = len(history)
        if n_prompt == 0:
            raise UsageError("the prompt is empty: nothing to continue from")
        if n_prompt >= target.n_ctx:
            raise ContextOverflowError(n_prompt, target.n_ctx)
        eog = self.vocab.eog_ids
        banned = np.array(sorted(eog), np.int64) if params.ignore_eos and eog else None
        rng = np.random.default_rng(sampler.seed)
        planner = self.planner or FixedPlanner(self.drafter, params.draft_max)
        outputs = getattr(target, "n_outputs_max", target.n_batch)
        k_max = max(0, min(params.draft_max, target.n_batch - 1, outputs - 1))
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
            remaining = limit - (len(history) - n_prompt)
            room = target.n_ctx - len(history)
            if remaining <= 0 or room <= 0:
                finish = "length"
                break
            # K + 1 new tokens must fit the context and the batch, and not overshoot n_predict.
            k = int(min(k_max, room - 1, remaining - 1))
            plan = planner.plan(history, k, sampler, rng)
            draft = plan.draft
            d = draft.tokens[:k]
            t_verify = time.perf_counter()
            logits = target.eval([history[-1], *d], logits="all")
            t_verify = time.perf_counter() - t_verify
            if banned is not None:
                logits = logits.copy()
                logits[:, banned] = -np.inf
            if sampler.greedy:
                best = logits.argmax(axis=1)
                n = 0
                while n < len(d) and best[n] == d[n]:
                    n += 1
                x = int(best[n])
            else:
                n, x = self._accept_sampled(logits, draft, d, sampler, rng)
            new = [*d[:n], x]
            conf = None
            if planner.wants_confidence:
                row = logits[n]  # the target's top-1 probability for the token it chose
                conf = 1.0 / float(np.exp(row - row.max()).sum())
            planner.observe(plan, n, t_verify, conf)
            for i, t in enumerate(new):
                if t in eog:
                    new = new[:i]
                    finish = "stop"
                    break
            if len(new) > remaining:
                new = new[: int(remaining)]
                finish = "length"
            kept = min(n, len(new))  # accepted drafts past an end-of-generation token are dropped
            stats.steps += 1
            stats.drafted += len(d)
            stats.accepted += kept
            stats.rejected_steps += n < len(d)
            stats.last_draft = len(d)
            name = plan.drafter.name if plan.drafter is not None and d else "none"
            stats.last_drafter = name
            row = stats.by_drafter.setdefault(name, [0, 0, 0])
            row[0] += 1
            row[1] += len(d)
            row[2] += kept
            history.extend(new)
            gen.tokens.extend(new)
            target.rollback(len(history) - 1)
            piece = gen.stream.push(b"".join(self.vocab.token_to_piece(t) for t in new))
            if gen.stream.stopped:
                finish = "stop"
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


DrafterKind = Literal["auto", "model", "ngram", "none"]


#: The largest draft length of auto mode. n-gram drafts pay up to about 16 here and lose
#: beyond (code editing: 29-33 tokens/s at 16, 25-29 at 48), and a verification of K + 1
#: tokens sizes llama.cpp's logits buffer (0.6 MB per row for a 151,936-token vocabulary).
AUTO_K_MAX = 16


class SpeculativeEngine:
    """Target and draft models loaded through llama.cpp, ready to generate.

    Owns every native resource (models, contexts, batches) and frees them in ``close()``
    or at the end of a ``with`` block.

    Args:
        target: the target GGUF file (first shard of a split model).
        draft: the draft GGUF file; needed for ``drafter="model"``.
        drafter: "auto" (n-gram lookup and, with a draft file, the draft model, chosen at
            every step by the cost model of :mod:`specgguf.costmodel`), "model", "ngram" or
            "none" (the target alone).
        n_ctx: the target's context size (tokens); ``n_ctx_draft`` the draft's (default:
            the same).
        n_batch: the batch size for prompt processing (verification uses K + 1 <= n_batch).
        n_threads: CPU threads (default: physical cores).
        n_gpu_layers, n_gpu_layers_draft: layers to offload (-1: all, where the build can).
        use_extra_bufts: weight repacking (None: :func:`specgguf.runtime.repack_policy`).
        ngram: (n_min, n_max) of the n-gram drafter.
        p_min: greedy drafting stops when the draft's top probability is below this.
        k_max: the largest draft length in auto mode (16 at most for the draft model).

    Raises:
        UsageError: ``drafter="model"`` without a draft file.
        ModelNotFoundError, BackendError: a model or context could not be created.
    """

    def __init__(
        self,
        target: Path | str,
        draft: Path | str | None = None,
        *,
        drafter: DrafterKind = "model",
        n_ctx: int = 4096,
        n_ctx_draft: int | None = None,
        n_batch: int = 512,
        n_threads: int | None = None,
        n_gpu_layers: int = -1,
        n_gpu_layers_draft: int = -1,
        use_extra_bufts: bool | None = None,
        ngram: tuple[int, int] = (2, 8),
        p_min: float = 0.0,
        k_max: int = AUTO_K_MAX,
    ) -> None:
        from specgguf.backend import LlamaContext, LlamaModel

        if drafter == "model" and draft is None:
            raise UsageError("the model drafter needs a draft model (-md/--model-draft)")
        self._stack = contextlib.ExitStack()
        try:
            self.target_model = self._stack.enter_context(
                LlamaModel(target, n_gpu_layers=n_gpu_layers, use_extra_bufts=use_extra_bufts)
            )
            # A verification needs K + 1 outputs; llama.cpp sizes its output buffer by this.
            self.target_ctx: LlamaContext = self._stack.enter_context(
                self.target_model.new_context(
                    n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads,
                    n_outputs_max=min(k_max, n_batch - 1) + 1,
                )
            )  # fmt: skip
            self.draft_model: LlamaModel | None = None
            self.draft_ctx: LlamaContext | None = None
            self.model_drafter: ModelDrafter | None = None
            self._timings: Timings | None = None
            self.n_threads = n_threads
            self.ngram = ngram
            self.k_max = k_max
            if draft is not None and drafter in ("model", "auto"):
                self.draft_model = self._stack.enter_context(
                    LlamaModel(
                        draft, n_gpu_layers=n_gpu_layers_draft, use_extra_bufts=use_extra_bufts
                    )
                )
                # The draft only ever needs the logits of its last position.
                self.draft_ctx = self._stack.enter_context(
                    self.draft_model.new_context(
                        n_ctx=n_ctx_draft or n_ctx, n_batch=n_batch, n_threads=n_threads,
                        n_outputs_max=1,
                    )
                )  # fmt: skip
                self.model_drafter = ModelDrafter(
                    self.draft_ctx, self.target_model.n_vocab, p_min=p_min
                )
            self.decoder = self.decoder_for(drafter)
        except BaseException:
            self._stack.close()
            raise

    @property
    def drafter(self) -> Drafter | None:
        """The drafter of the main decoder (None in auto mode or for the target alone)."""
        return self.decoder.drafter

    @property
    def planner(self) -> Planner | None:
        return self.decoder.planner

    def decoder_for(self, kind: DrafterKind) -> SpeculativeDecoder:
        """A decoder over the loaded models with another drafter (for side-by-side
        measurements in one process): "none", "ngram", "model" (needs the draft model) or
        "auto". The contexts are shared; each generation starts afresh.

        Raises:
            UsageError: "model" without a draft model.
        """
        model = self.model_drafter
        if kind == "none":
            return SpeculativeDecoder(self.target_ctx, self.target_model, None)
        if kind == "ngram":
            return SpeculativeDecoder(self.target_ctx, self.target_model, NgramDrafter(*self.ngram))
        if kind == "model":
            if model is None:
                raise UsageError("the model drafter needs a draft model (-md/--model-draft)")
            return SpeculativeDecoder(self.target_ctx, self.target_model, model)
        planner = AutoPlanner(
            self.timings(), model=model, ngram=NgramDrafter(*self.ngram), k_max=self.k_max,
            k_max_model=min(16, self.k_max),
        )  # fmt: skip
        return SpeculativeDecoder(self.target_ctx, self.target_model, planner=planner)

    def timings(self, *, recalibrate: bool = False) -> Timings:
        """The target's verification and the draft's step timings on this machine: from
        the calibration cache, or measured now (a few seconds) and cached.

        Raises:
            BackendError: an evaluation failed.
        """
        from specgguf.backend import default_threads
        from specgguf.runtime import _build_key, build_info

        if self._timings is not None and not recalibrate:
            return self._timings
        threads = self.n_threads or default_threads()
        key = calibration_key(
            _build_key(build_info()), self.target_model.path,
            self.draft_model.path if self.draft_model else None, threads,
            self.target_model.use_extra_bufts,
        )  # fmt: skip
        sample_ids = self.target_model.tokenize("def f(x):\n    return x + 1\n", add_special=False)
        cached = None if recalibrate else load_calibration(key)
        if cached is not None:
            # A calibration taken while the machine was busy would mislead every run after
            # it: check one decode step against it, and measure again when far off.
            now = calibrate(self.target_ctx, None, sample_ids, sizes=(1,), repeats=3)
            if 0.5 <= now.verify[1] / cached.verify[1] <= 2.0:
                self._timings = cached
                return cached
        t = calibrate(self.target_ctx, self.draft_ctx, sample_ids)
        save_calibration(key, t)
        self._timings = t
        return t

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        """Token ids of ``text`` by the target's rules (BOS per the model when
        ``add_special``; special-token texts such as ``<|im_start|>`` parsed)."""
        return self.target_model.tokenize(text, add_special=add_special, parse_special=True)

    def generate(self, prompt: str | Sequence[int], params: GenerationParams) -> Generation:
        """Start a generation (see :meth:`SpeculativeDecoder.generate`); a string prompt is
        tokenized once with the target's rules and the same ids go to both models."""
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        return self.decoder.generate(ids, params)

    def close(self) -> None:
        """Free every model, context and batch; idempotent."""
        self._stack.close()

    def __enter__(self) -> SpeculativeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
