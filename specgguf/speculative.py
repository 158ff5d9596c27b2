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


class SpeculativeDecoder:
    """The draft/verify/accept loop over a target context and an optional drafter.

    Args:
        target: the target's context (``Evaluator``).
        vocab: the target's vocabulary (pieces, end-of-generation ids).
        drafter: proposes tokens; None decodes with the target alone (the baseline).
    """

    def __init__(self, target: Evaluator, vocab: Vocabulary, drafter: Drafter | None) -> None:
        self.target = target
        self.vocab = vocab
        self.drafter = drafter

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
        drafter = self.drafter
        k_max = max(0, min(params.draft_max, target.n_batch - 1))
        limit = params.n_predict if params.n_predict >= 0 else math.inf

        t0 = time.perf_counter()
        if drafter:
            drafter.reset()
        target.rollback(0)
        if n_prompt > 1:
            target.eval(history[:-1], logits="none")
        stats.prompt_seconds = time.perf_counter() - t0
        target_s0 = target.eval_seconds
        draft_s0 = drafter.seconds if drafter else 0.0
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
            draft = drafter.propose(history, k, sampler, rng) if drafter and k > 0 else Draft([])
            d = draft.tokens[:k]
            logits = target.eval([history[-1], *d], logits="all")
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
            stats.steps += 1
            stats.drafted += len(d)
            stats.accepted += n
            stats.last_draft = len(d)
            for i, t in enumerate(new):
                if t in eog:
                    new = new[:i]
                    finish = "stop"
                    break
            if len(new) > remaining:
                new = new[: int(remaining)]
                finish = "length"
            history.extend(new)
            gen.tokens.extend(new)
            target.rollback(len(history) - 1)
            piece = gen.stream.push(b"".join(self.vocab.token_to_piece(t) for t in new))
            if gen.stream.stopped:
                finish = "stop"
            stats.generated = len(gen.tokens)
            stats.seconds = time.perf_counter() - t_gen
            stats.target_seconds = target.eval_seconds - target_s0
            stats.draft_seconds = (drafter.seconds - draft_s0) if drafter else 0.0
            if piece:
                yield piece
        tail = gen.stream.finish()
        stats.seconds = time.perf_counter() - t_gen
        stats.target_seconds = target.eval_seconds - target_s0
        stats.draft_seconds = (drafter.seconds - draft_s0) if drafter else 0.0
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


DrafterKind = Literal["model", "ngram", "none"]


class SpeculativeEngine:
    """Target and draft models loaded through llama.cpp, ready to generate.

    Owns every native resource (models, contexts, batches) and frees them in ``close()``
    or at the end of a ``with`` block.

    Args:
        target: the target GGUF file (first shard of a split model).
        draft: the draft GGUF file; needed for ``drafter="model"``.
        drafter: "model", "ngram" or "none" (the target alone).
        n_ctx: the target's context size (tokens); ``n_ctx_draft`` the draft's (default:
            the same).
        n_batch: the batch size for prompt processing (verification uses K + 1 <= n_batch).
        n_threads: CPU threads (default: physical cores).
        n_gpu_layers, n_gpu_layers_draft: layers to offload (-1: all, where the build can).
        use_extra_bufts: weight repacking (None: :func:`specgguf.runtime.repack_policy`).
        ngram: (n_min, n_max) of the n-gram drafter.
        p_min: greedy drafting stops when the draft's top probability is below this.

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
    ) -> None:
        from specgguf.backend import LlamaContext, LlamaModel

        if drafter == "model" and draft is None:
            raise UsageError("the model drafter needs a draft model (-md/--model-draft)")
        self._stack = contextlib.ExitStack()
        try:
            self.target_model = self._stack.enter_context(
                LlamaModel(target, n_gpu_layers=n_gpu_layers, use_extra_bufts=use_extra_bufts)
            )
            self.target_ctx: LlamaContext = self._stack.enter_context(
                self.target_model.new_context(n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads)
            )
            self.draft_model: LlamaModel | None = None
            self.draft_ctx: LlamaContext | None = None
            self.drafter: Drafter | None = None
            if drafter == "model":
                assert draft is not None
                self.draft_model = self._stack.enter_context(
                    LlamaModel(
                        draft, n_gpu_layers=n_gpu_layers_draft, use_extra_bufts=use_extra_bufts
                    )
                )
                self.draft_ctx = self._stack.enter_context(
                    self.draft_model.new_context(
                        n_ctx=n_ctx_draft or n_ctx, n_batch=n_batch, n_threads=n_threads
                    )
                )
                self.drafter = ModelDrafter(self.draft_ctx, self.target_model.n_vocab, p_min=p_min)
            elif drafter == "ngram":
                self.drafter = NgramDrafter(*ngram)
        except BaseException:
            self._stack.close()
            raise
        self.decoder = SpeculativeDecoder(self.target_ctx, self.target_model, self.drafter)

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
