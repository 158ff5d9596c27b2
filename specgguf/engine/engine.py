"""The engine: a target (and optionally a draft) loaded through llama.cpp, ready to start
generations from a prompt string, a conversation or token ids.

::

    config = EngineConfig(ModelConfig("target.gguf"), ModelConfig("draft.gguf"))
    with Engine(config) as engine:
        gen = engine.generate([{"role": "user", "content": "Hi"}], GenerationParams(n_predict=64))
        for piece in gen:
            print(piece, end="")
        print(gen.result.stats.tokens_per_s)

``run``, ``bench`` and a server are thin faces over this: each builds one
:class:`EngineConfig` and calls :meth:`Engine.generate`. Generations on one engine run one
at a time (they share the KV caches).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specgguf.engine.batching import BatchedSequence, Batcher
from specgguf.engine.calibration import calibrate, calibration_key, load_calibration, pair_timings
from specgguf.engine.chat import ChatMessage, PreparedPrompt, render_prompt
from specgguf.engine.config import (
    RECURRENT_ROWS_MAX,
    EngineConfig,
    ModelConfig,
    check_draft_min,
    check_drafter,
    check_p_min,
    default_draft_max,
    default_draft_tree,
    verify_draft_max,
)
from specgguf.engine.constraints import Grammars, model_grammars
from specgguf.engine.drafter_map import (
    DRAFTERS,
    Drafting,
    DraftSettings,
    Sources,
    head_of_draft,
    make_drafters,
    make_planner,
    missing,
)
from specgguf.engine.preflight import Preflight, preflight, target_mtp, target_snapshots
from specgguf.engine.prompt_cache import PromptCache, file_fingerprint, identity
from specgguf.engine.slots import SavedPrompt, Slot, best_slot
from specgguf.errors import (
    BackendError,
    ContextOverflowError,
    MediaError,
    SpecggufError,
    UsageError,
)
from specgguf.gguf.arch import DELTA_NET_ARCHS, article, describe
from specgguf.llama.backend import DraftHead, LlamaContext, LlamaModel, default_threads
from specgguf.llama.media import check_projector
from specgguf.llama.runtime import build_info, build_key
from specgguf.speculative.costmodel import Timings
from specgguf.speculative.draft import Drafter, Evaluator
from specgguf.speculative.drafters import MtpDrafter
from specgguf.speculative.grammar import Constraint, GrammarSpec
from specgguf.speculative.loop import Generation, GenerationParams, SpeculativeDecoder
from specgguf.speculative.planner import Planner
from specgguf.speculative.tuning import AUTO_TUNING

if TYPE_CHECKING:
    from specgguf.llama.media import Chunk, MediaSpan, Projector

log = logging.getLogger("specgguf")

#: The target's K cache type in deterministic mode (llama.cpp's ``-ctk q8_0``): with it a
#: lone row's attention is computed as in a batch, so none needs a throw-away second row
#: (:mod:`specgguf.llama.invariance`). The V cache stays f16. Greedy output then differs
#: from a run without the mode as a quantized K cache makes it differ, not run to run.
DETERMINISTIC_TYPE_K = "q8_0"

#: What :meth:`Engine.generate` takes: a text completed as is, a conversation rendered with
#: the target's chat template, or token ids.
Prompt = str | Sequence[ChatMessage] | Sequence[int]


#: Any valid text for timing calibration (the timing, not the text, matters).
_CALIBRATION_TEXT = "def f(x):\n    return x + 1\n"
#: ``llama_token_attr`` flags of a special token that eats the whitespace on its left
#: (LLAMA_TOKEN_ATTR_LSTRIP) or its right (LLAMA_TOKEN_ATTR_RSTRIP).
_ATTR_LSTRIP, _ATTR_RSTRIP = 1 << 7, 1 << 8


class Engine:
    """Target and draft models loaded through llama.cpp, ready to generate.

    Loading runs :func:`specgguf.engine.preflight.preflight` first (files, vocabularies,
    memory; pass one already made as ``checked``), then loads the target and, for the
    model and auto drafters, the draft; ``on_load_progress(path, share)`` is called as each
    model's weights load (share from 0.0 to 1.0; an exception in it aborts the load). Owns
    every native resource (models, contexts, batches) and frees them in :meth:`close` or at
    the end of a ``with`` block.

    Threads: an engine is used by one thread at a time, and for speed by one thread only,
    loading included. On CPU builds with OpenMP, each thread that has run llama.cpp
    computations keeps an OpenMP pool, and with more pooled threads than CPUs libgomp stops
    spin-waiting: generating from a second thread ran at 0.77x here (the server therefore
    loads, calibrates and generates on one thread, ``server.scheduler.engine_thread``).

    Raises:
        ModelNotFoundError, GGUFFormatError: a model file is missing or unreadable.
        IncompatibleVocabError: the draft's vocabulary does not match the target's.
        InsufficientMemoryError: the models clearly do not fit.
        BackendError: llama.cpp could not load a model or create a context.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        checked: Preflight | None = None,
        on_load_progress: Callable[[Path, float], None] | None = None,
    ) -> None:
        self.config = config
        self._on_load_progress = on_load_progress
        self.preflight = checked or preflight(config)
        self._timings: dict[bool, Timings] = {}  # by deterministic mode
        #: deterministic mode's most rows per decode (0: the engine was not set up for it)
        self.deterministic_rows = 0
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        self._stack = contextlib.ExitStack()
        spec = config.speculative
        t_info, d_info = self.preflight.target, self.preflight.draft
        mtp = target_mtp(config, t_info)
        #: the drafter whose head drafts (a context of its own that reads the target's
        #: hidden states: the MTP layers, an EAGLE-3 head given as -md), or None
        self.head_kind: str | None = "mtp" if mtp else None
        if not mtp and config.loads_draft and d_info is not None:
            self.head_kind = head_of_draft(d_info.architecture)
        head_spec = DRAFTERS[self.head_kind].head if self.head_kind else None
        if config.mmproj is not None:
            check_projector(config.mmproj, t_info.embedding_length)
        try:
            self.target_model = self._load(config.target, load_mtp=mtp)
            self.draft_model: LlamaModel | None = None
            if config.loads_draft:
                assert config.draft is not None
                self.draft_model = self._load(config.draft)
            # the model that holds the head's weights, and the hidden states it reads
            head_model = self.target_model if mtp else self.draft_model
            layers = head_spec.layers(head_model) if head_spec and head_model else ()
            # A verification needs K + 1 outputs; llama.cpp sizes its logits buffer by this.
            # Token trees need a sequence per branch (SpeculativeConfig.draft_tree); a
            # recurrent state holds none, and keeps a snapshot per draft token instead.
            attention = self.target_model.memory == "attention"
            n_par = config.n_parallel
            target_ctx = functools.partial(
                self._context, self.target_model, config.target, self.preflight.n_ctx,
                (verify_draft_max(spec, self.target_model.memory, t_info.architecture) + 1) * n_par,
                reserve=int(config.deterministic),
                # (nor with a head, which reads the hidden state of each position the
                # target decodes in sequence 0, nor with parallel sequences)
                tree_branches=(spec.draft_tree if attention and not self.head_kind
                               and n_par == 1 else 0),
                n_rs_seq=target_snapshots(config, t_info), hidden=self.head_kind is not None,
                layer_inputs=layers, n_parallel=n_par,
                n_checkpoints=config.cache.ctx_checkpoints, replay=True,
            )  # fmt: skip
            if config.deterministic:
                # K in q8_0: then no lone row needs a throw-away row (specgguf.llama.
                # invariance; the probe proves it or pads). llama.cpp refuses it for heads
                # smaller than q8_0's blocks of 32 values: f16 then.
                try:
                    self.target_ctx = target_ctx(type_k=DETERMINISTIC_TYPE_K)
                except BackendError:
                    log.info("deterministic mode: the K cache cannot be %s for %s; f16",
                             DETERMINISTIC_TYPE_K, self.target_model.path.name)  # fmt: skip
                    self.target_ctx = target_ctx()
                self._set_up_deterministic()
            else:
                self.target_ctx = target_ctx()
            self.draft_ctx: LlamaContext | None = None
            if self.draft_model is not None and not (self.head_kind and not mtp):
                assert config.draft is not None
                # The draft only ever needs the logits of its last position; a recurrent
                # one drafts in a copy of its sequence (ModelDrafter).
                self.draft_ctx = self._context(
                    self.draft_model, config.draft, self.preflight.n_ctx_draft, n_par,
                    draft=True, scratch=self.draft_model.memory != "attention",
                    n_parallel=n_par,
                )  # fmt: skip
            #: the target's sequences (``--parallel``; else the context alone), made once:
            #: each keeps the hidden states its head reads
            self._seqs = [self.target_ctx.sequence(i) for i in range(n_par)]
            #: the head's context for each sequence (each holds its own KV cache and reads
            #: its sequence's hidden states; the first is the engine's own sequence's)
            self.heads: list[DraftHead] = []
            if head_spec is not None and head_model is not None:
                self.heads = [self._stack.enter_context(head_spec.make(head_model, s))
                              for s in self._seqs]  # fmt: skip
                what = f"the {self.head_kind} head {head_model.path.name}"
                if mtp:
                    what = f"its {self.target_model.n_layer_nextn} multi-token-prediction layer(s)"
                log.info("%s: drafting with %s", self.target_model.path.name, what)
                most = getattr(self.heads[0], "max_draft", 0)
                asked = spec.draft_max != default_draft_max(spec.drafter)
                if most and asked and spec.draft_max > most:
                    block = getattr(self.heads[0], "block_size", 0)
                    unit = (f"blocks of {block}" + (" (the last token and the drafts)"
                                                    if block > most else "") if block
                            else f"{most} chained MTP blocks (one token each)")  # fmt: skip
                    log.warning("a draft length of %d does not fit %s's %s: its drafts have "
                                "at most %d tokens", spec.draft_max, head_model.path.name,
                                unit, most)  # fmt: skip
                first = self.heads[0]
                if (spec.p_min > 0 and getattr(first, "markov", False)
                        and not getattr(first, "confidence_head", False)):  # fmt: skip
                    log.warning("%s is a DSpark draft without a confidence head: its drafts "
                                "stop at a token whose probability is below p_min %g (llama.cpp "
                                "refuses a p_min above 0 for it)", head_model.path.name,
                                spec.p_min)  # fmt: skip
                if most and spec.draft_min > most:
                    log.warning("a shortest draft of %d: %s's drafts have at most %d tokens, "
                                "the shortest verified is %d", spec.draft_min,
                                head_model.path.name, most, most)  # fmt: skip
            if self.target_ctx.replays and spec.drafter != "none":
                log.info("the target is %s: rejected drafts are dropped by checkpoint and "
                         "replay", describe(t_info.architecture))  # fmt: skip
            if config.rpc_servers:
                from specgguf.llama.rpc import keep_alive, parse_endpoints

                keep_alive(parse_endpoints(config.rpc_servers), config.rpc_timeout)
            #: the target's multimodal projector (``--mmproj``), or None
            self.projector: Projector | None = None
            if config.mmproj is not None:
                from specgguf.llama.media import Projector

                threads = config.target.n_threads or default_threads()
                self.projector = self._stack.enter_context(Projector(
                    config.mmproj, self.target_model, n_threads=threads,
                    use_gpu=config.mmproj_offload))  # fmt: skip
            #: the draft model's own projector (``--mmproj-draft``), or None
            self.draft_projector: Projector | None = None
            self._said_draft_media = False
            if config.mmproj_draft is not None and self.draft_ctx is not None:
                from specgguf.llama.media import Projector

                assert self.draft_model is not None and config.draft is not None
                threads = config.draft.n_threads or default_threads()
                self.draft_projector = self._stack.enter_context(Projector(
                    config.mmproj_draft, self.draft_model, n_threads=threads,
                    use_gpu=config.mmproj_offload))  # fmt: skip
            elif config.mmproj_draft is not None:
                name = config.mmproj_draft.name
                raise UsageError(f"the draft model's projector {name}: the {spec.drafter} "
                                 f"drafter reads no draft model's text")  # fmt: skip
            self.decoder = SpeculativeDecoder(self.target_ctx, self.target_model)
            # Said when the batch size (or a recurrent state's snapshots) is what clamps
            # the draft length; a context smaller than the draft length limits each step
            # by the room left, as it should.
            capacity = self.decoder.draft_capacity
            if spec.draft_max > capacity and (
                spec.draft_max != default_draft_max(spec.drafter)  # asked for, not auto's
            ):
                why = (f"a {t_info.architecture} target's micro-batches of at most "
                       f"{RECURRENT_ROWS_MAX} rows" if t_info.architecture in DELTA_NET_ARCHS
                       else f"a verification batch of {config.target.n_batch} tokens"
                       + ("" if attention else " and the recurrent state's snapshots"))  # fmt: skip
                log.warning("a draft length of %d does not fit %s: drafts have at most %d "
                            "tokens", spec.draft_max, why, capacity)  # fmt: skip
            (own,) = make_drafters(self._sources(1))
            self.drafting = Drafting(own, self.timings)
            #: the engine's own sequence (``generate`` without a slot)
            self.own = Slot(0, self.decoder, self.target_ctx, self.target_ctx, self.drafting,
                            self.draft_ctx, self.heads[0] if self.heads else None)  # fmt: skip
            # (said where a tree was asked for, else only logged: auto mode's default)
            say = log.warning if spec.tree_asked else log.info
            if n_par > 1 and spec.draft_tree >= 2:
                say("%d parallel sequences: drafts are verified as chains (no token trees)",
                    n_par)  # fmt: skip
            elif self.head_kind and spec.draft_tree >= 2:
                what = ("the target's MTP layers" if mtp else
                        f"{article(self.head_kind)} {self.head_kind} head")  # fmt: skip
                say("drafting with %s: drafts are verified as chains (no token trees: they "
                    "read the target's rows of every position in turn)", what)  # fmt: skip
            #: the sequences generations run on: ``serve --parallel``'s, each through the
            #: batcher; one at a time, the engine's own
            self.slots: list[Slot] = [self.own]
            if n_par > 1:
                src = self._sources(n_par, batched=True)
                self.slots = [self._slot(i, d, src.draft[i] if src.draft else None)
                              for i, d in enumerate(make_drafters(src))]  # fmt: skip
            self.batcher: Batcher | None = None
            cache = config.cache
            #: saved prompts in host memory (and on disk), or None
            self.prompt_cache: PromptCache | None = None
            if cache.ram or cache.disk:
                self.prompt_cache = PromptCache(
                    cache.ram,
                    ident=self.cache_identity(),
                    disk=cache.disk_dir,
                    disk_limit=cache.disk,
                )
            trained = self.preflight.target.context_length
            if trained and self.n_ctx > trained:
                # llama.cpp's "n_ctx_seq > n_ctx_train -- possible training context
                # overflow"; said once the models have loaded (a refusal stays one line)
                log.warning(
                    "n_ctx %d is more than %s was trained for (%d): text past %d tokens may "
                    "degrade", self.n_ctx, self.target_model.path.name, trained, trained,
                )  # fmt: skip
        except BaseException:
            self._stack.close()
            raise

    def _set_up_deterministic(self) -> None:
        """Measure (or read from the cache) the batch shapes whose logits are identical on
        this model and build (:func:`specgguf.llama.invariance.deterministic_rows`).

        Raises:
            BackendError: no batch shape gives reproducible logits here.
        """
        from specgguf.llama.invariance import NO_LIMIT, deterministic_rows, lone_rows_max

        rows, diffs = deterministic_rows(
            self.target_model, n_threads=self.config.target.n_threads, type_k=self.target_ctx.type_k
        )
        rows = min(rows, self.target_ctx.n_batch)
        if rows < 2:
            detail = ", ".join(f"{b} rows: {d:.3g}" for b, d in sorted(diffs.items()) if b > 0)
            raise BackendError(
                f"deterministic mode is not possible with this llama.cpp build and "
                f"{self.target_model.path.name}: no batch shape gives the same logits for the "
                f"same tokens (largest differences: {detail})"
            )
        self.deterministic_rows = rows
        lone = lone_rows_max(diffs)
        self.target_ctx.set_lone_rows_max(lone)
        log.info("deterministic mode: K cache %s, verification in batches of 2 to %d rows, %s",
                 self.target_ctx.type_k, rows,
                 "lone rows never padded" if lone == NO_LIMIT
                 else f"lone rows padded past {lone} cached positions")  # fmt: skip

    def _sources(self, n: int, *, batched: bool = False) -> Sources:
        """What drafters draft from, for the engine's own sequence (``n`` 1) or the ``n``
        sequences of ``--parallel`` (``batched``: the draft model's sequences evaluate
        through :attr:`batcher`; each sequence's MTP layers read its own hidden states)."""
        spec = self.config.speculative
        draft: list[Evaluator] = []
        if self.draft_ctx is not None:
            draft = [self.draft_ctx]
            if batched:
                draft = [BatchedSequence(self.draft_ctx.sequence(i), lambda: self.batcher)
                         for i in range(n)]  # fmt: skip
        heads = {}
        if self.head_kind is not None:
            heads[self.head_kind] = [(h, self._seqs[i]) for i, h in enumerate(self.heads[:n])]
        return Sources(n, self.target_model.n_vocab, (spec.ngram_min, spec.ngram_max),
                       draft, heads)  # fmt: skip

    def _slot(self, i: int, drafters: dict[str, Drafter], draft: Evaluator | None) -> Slot:
        """Sequence ``i`` of ``--parallel``: the loop over its sequence of the target's
        context, evaluating through :attr:`batcher`, its ``drafters``
        (:func:`~specgguf.engine.drafter_map.make_drafters`; ``draft``: the draft model's
        sequence they draft in, through the batcher), and timings of its own, which the
        batcher tells which other sequences share a step (:attr:`Timings.others`)."""
        seq = self._seqs[i]
        target = BatchedSequence(seq, lambda: self.batcher)
        draft_seq = draft.ctx if isinstance(draft, BatchedSequence) else None
        slot = Slot(i, SpeculativeDecoder(target, self.target_model), target, seq,
                    Drafting(drafters, lambda det: timings(det)), draft_seq,
                    self.heads[i] if self.heads else None)  # fmt: skip

        def timings(det: bool) -> Timings:
            if det not in slot.timings:
                slot.timings[det] = dataclasses.replace(
                    self.timings(det), seq=i, n_ubatch=self.target_ctx.n_ubatch
                )
            return slot.timings[det]

        # (timings are refined only while this sequence runs alone: Timings.solo)
        return slot

    def fresh_memories(self) -> dict[str, Drafter]:
        """New drafters for the engine's own sequence of every entry it drafts with that
        remembers what earlier generations saw (:attr:`DrafterEntry.remembers`)."""
        src = self._sources(1)
        made = {name: e.make(src) for name, e in DRAFTERS.items()
                if e.remembers and name in self.drafting.drafters}  # fmt: skip
        return {name: d[0] for name, d in made.items() if d}

    @contextlib.contextmanager
    def fresh_memory(self) -> Iterator[None]:
        """Generations inside start with fresh drafters of every entry that remembers what
        earlier generations saw (:attr:`DrafterEntry.remembers`: the suffix corpus), every
        sequence's, and the engine's own are back afterwards: a benchmark's
        configurations must not copy an answer another one gave to the same question."""
        holders = [self.drafting, *(s.drafting for s in self.slots if s is not self.own)]
        old = [dict(h.drafters) for h in holders]
        n = len(holders) - 1
        groups = [self._sources(1), *([self._sources(n, batched=True)] if n else [])]
        for name, e in DRAFTERS.items():
            if not e.remembers or name not in self.drafting.drafters:
                continue
            fresh = [d for src in groups for d in e.make(src) or []]
            for holder, d in zip(holders, fresh, strict=True):
                holder.drafters[name] = d
        try:
            yield
        finally:
            for holder, drafters in zip(holders, old, strict=True):
                holder.drafters = drafters

    def start_batching(self) -> Batcher:
        """The :class:`~specgguf.engine.batching.Batcher` of ``--parallel`` generations
        (:meth:`generate` with a ``slot``), made on the calling thread, which must then run
        it. Measures the timings auto mode needs first (a generation must not calibrate
        while others hold the context).

        Raises:
            UsageError: the engine was loaded for one sequence at a time.
            BackendError: the calibration failed.
        """
        if self.n_parallel < 2:
            raise UsageError("this engine was loaded for one sequence at a time")
        self.timings(False)
        if self.deterministic_rows:
            self.timings(True)
        self.batcher = Batcher(
            self.target_ctx, self.draft_ctx, self.timings(False).batch_time,
            company=lambda slot, others, active: self.slots[slot].batch_others(others, active),
        )  # fmt: skip
        return self.batcher

    @classmethod
    def load(cls, config: EngineConfig) -> Engine:
        """``Engine(config)``: check, then load (see the class)."""
        return cls(config)

    def _load(self, m: ModelConfig, *, load_mtp: bool = False) -> LlamaModel:
        devices: list[str | int] | None = None if m.devices is None else list(m.devices)
        if m.rpc:  # the servers answered in preflight; their devices come first
            from specgguf.llama import rpc

            local = rpc.local_devices() if devices is None else devices
            devices = [*rpc.add_servers(rpc.parse_endpoints(m.rpc)), *local]
        report = self._on_load_progress
        progress = functools.partial(report, m.path) if report is not None else None
        model = LlamaModel(m.path, n_gpu_layers=m.n_gpu_layers, use_extra_bufts=m.repack,
                           devices=devices, tensor_split=m.tensor_split,
                           progress=progress, huge_pages=m.huge_pages,
                           load_mtp=load_mtp)  # fmt: skip
        return self._stack.enter_context(model)

    def _context(
        self,
        model: LlamaModel,
        m: ModelConfig,
        n_ctx: int,
        outputs: int,
        *,
        reserve: int = 0,
        draft: bool = False,
        tree_branches: int = 0,
        type_k: str = "f16",
        n_rs_seq: int = 0,
        scratch: bool = False,
        hidden: bool = False,
        n_parallel: int = 1,
        n_checkpoints: int = 0,
        replay: bool = False,
        layer_inputs: Sequence[int] = (),
    ) -> LlamaContext:
        # A gated delta-net target's micro-batches stay below the rows at which llama.cpp
        # changes algorithm (RECURRENT_ROWS_MAX): its state is then the same whatever the
        # prompt's pieces, the snapshots or the draft length.
        delta_net = self.preflight.target.architecture in DELTA_NET_ARCHS
        ub = RECURRENT_ROWS_MAX if not draft and delta_net else None
        ctx = self._stack.enter_context(
            model.new_context(
                n_ctx=n_ctx, n_batch=m.n_batch, n_threads=m.n_threads, n_outputs_max=outputs,
                reserve=reserve, tree_branches=tree_branches, type_k=type_k,
                n_rs_seq=n_rs_seq, scratch=scratch, hidden=hidden, n_parallel=n_parallel,
                n_checkpoints=n_checkpoints, n_ubatch=ub, replay=replay,
                layer_inputs=layer_inputs,
            )
        )  # fmt: skip
        if ctx.n_ctx_allocated != n_ctx and not reserve:
            # Said for a draft context (a small -cd is a choice worth knowing the cost of);
            # the target keeps to the size asked for, which is all a user sees of it.
            log.log(
                logging.WARNING if draft else logging.INFO,
                "%s: llama.cpp allocated a context of %d tokens for the %d asked for; "
                "generation keeps to %d", model.path.name, ctx.n_ctx_allocated, n_ctx, ctx.n_ctx,
            )  # fmt: skip
        return ctx

    # -- prompts ----------------------------------------------------------------------

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        """Token ids of ``text`` by the target's rules (BOS per the model when
        ``add_special``; special-token texts such as ``<|im_start|>`` parsed)."""
        return self.target_model.tokenize(text, add_special=add_special, parse_special=True)

    def prepared_ids(self, prepared: PreparedPrompt) -> list[int]:
        """The token ids of a rendered prompt (:meth:`render`), by :meth:`tokenize`; its
        literal spans (message text holding control-token texts) tokenized as plain text.

        Raises:
            ContextOverflowError: the text holds at least n_ctx special-token texts
                (``at_least``), found before the text is tokenized (llama.cpp's
                tokenizer takes time quadratic in their number: see
                :meth:`specgguf.llama.backend.LlamaModel.min_tokens`).
        """
        n_min = self.target_model.min_tokens(prepared.text, at_least=self.n_ctx)
        if n_min >= self.n_ctx:
            raise ContextOverflowError(n_min, self.n_ctx, at_least=True)
        if not prepared.literal:
            return self.tokenize(prepared.text, add_special=prepared.add_special)
        return self._tokenize_guarded(prepared)

    def _tokenize_guarded(self, prepared: PreparedPrompt) -> list[int]:
        """Token ids of a prompt with literal spans, as llama.cpp's own tokenizer splits a
        text (``tokenizer_st_partition`` in src/llama-vocab.cpp): the special-token texts
        outside the literal spans become their tokens (whitespace next to a token with the
        lstrip/rstrip attribute dropped, as there), and each stretch of text between them
        is tokenized as text, literal spans and all. Each stretch then starts as llama.cpp
        starts a fragment after a special token (a space prefix where the vocabulary
        adds one), and no cut falls inside text that llama.cpp would tokenize in one."""
        model = self.target_model
        attrs, pattern = model.special_attrs, model.special_pattern
        text, spans = prepared.text, prepared.literal
        ids = model.tokenize("", add_special=prepared.add_special, parse_special=False)
        cuts: list[tuple[int, int, str]] = []
        for m in pattern.finditer(text) if pattern is not None else ():
            if not any(m.start() < e and s < m.end() for s, e in spans):
                cuts.append((m.start(), m.end(), m.group(0)))
        at, strip_left = 0, False
        for start, end, special in [*cuts, (len(text), len(text), "")]:
            stretch = text[at:start]
            a = attrs.get(special, 0)
            if strip_left:
                stretch = stretch.lstrip()
            if a & _ATTR_LSTRIP:
                stretch = stretch.rstrip()
            if stretch:
                ids += model.tokenize(stretch, add_special=False, parse_special=False)
            if special:
                ids += model.tokenize(special, add_special=False, parse_special=True)
            strip_left, at = bool(a & _ATTR_RSTRIP), end
        return ids

    def render(
        self,
        prompt: str | Sequence[ChatMessage],
        *,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> PreparedPrompt:
        """The text a prompt becomes (see :func:`specgguf.engine.chat.render_prompt`), the
        target's control-token texts in messages kept as text; ``tools`` (OpenAI tool
        objects) given to the chat template.

        Raises:
            UsageError: a malformed conversation or tool, or contradicting options.
            ChatInputError: the template refuses the conversation, or does not render
                tools (:class:`~specgguf.errors.ToolsTemplateError`).
            ChatTemplateError: the chat template cannot be rendered.
        """
        return render_prompt(
            self.preflight.target, prompt,
            control_texts=self.target_model.control_texts,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
        )  # fmt: skip

    def prompt_ids(
        self,
        prompt: Prompt,
        *,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """The token ids a prompt becomes: a string tokenized as is (no second BOS when it
        starts with the BOS text; special-token texts parsed: the caller owns the whole
        prompt), a conversation through the chat template (:meth:`render`, whose options
        these are; ``tools`` only with a conversation), ids unchanged. The same ids go to
        the target and the draft.

        Raises:
            UsageError, ChatInputError, ChatTemplateError: as :meth:`render`.
            ContextOverflowError: as :meth:`prepared_ids`.
        """
        if isinstance(prompt, str):
            return self.prepared_ids(self.render(prompt))
        items: list[Any] = list(prompt)
        if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            return [int(t) for t in items]
        if not all(isinstance(m, Mapping) for m in items):
            raise UsageError("a prompt is a string, a list of messages, or a list of token ids")
        prepared = self.render(
            items,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
        )
        return self.prepared_ids(prepared)

    # -- generation -------------------------------------------------------------------

    def missing(self, kind: str) -> str | None:
        """Why drafter ``kind`` cannot draft on this engine's sequences (what it needs and
        was not loaded, in words), or None when it can.

        Raises:
            UsageError: no drafter has that name.
        """
        check_drafter(kind)
        return missing(self._drafter_named(kind), self.slots[0].drafting)

    def _drafter_named(self, kind: str) -> str:
        """The drafter ``kind`` means here: ``mtp`` is an MTP assistant where one was
        loaded as the draft (llama.cpp's draft-mtp drafts with either)."""
        return "assistant" if kind == "mtp" and self.head_kind == "assistant" else kind

    def planner(self, params: GenerationParams, slot: int | None = None) -> Planner:
        """The planner of one generation: the drafter, draft length, minimum draft length
        and p_min of ``params``, each defaulting to the engine's (:class:`SpeculativeConfig`).

        Raises:
            UsageError: an unknown drafter, p_min outside [0, 1], a negative draft length,
                a minimum draft length above the draft length, a drafter whose needs were
                not loaded (:meth:`missing`).
        """
        spec = self.config.speculative
        kind = params.drafter or spec.drafter
        check_drafter(kind)
        kind = self._drafter_named(kind)
        draft_max = spec.draft_max if params.draft_max is None else params.draft_max
        if params.draft_max is None and spec.drafter == "auto" and kind != "auto":
            # auto's largest draft is for its lookup copies; a fixed drafter asked for per
            # generation drafts at most what auto's draft model does
            draft_max = min(draft_max, AUTO_TUNING.draft_max_model)
        if draft_max < 0:
            raise UsageError(f"the draft length must be 0 or more, not {draft_max}")
        p_min = spec.p_min if params.p_min is None else params.p_min
        check_p_min(p_min)
        draft_min = spec.draft_min if params.draft_min is None else params.draft_min
        if kind != "none":
            check_draft_min(draft_min, draft_max)
        det = self.config.deterministic if params.deterministic is None else params.deterministic
        # Trees: the generation's, else the engine's for its own drafter, else the
        # drafter's default; at most what the target's context has sequences for.
        tree = params.draft_tree
        if tree is None:
            tree = spec.draft_tree if kind == spec.drafter else default_draft_tree(kind)
        if tree < 0:
            raise UsageError(f"a token tree has 0 or more branches, not {tree}")
        tree = min(tree, self.target_ctx.tree_branches)
        settings = DraftSettings(draft_max, p_min, bool(det), draft_min, tree)
        drafting = self.drafting if slot is None else self.slots[slot].drafting
        return make_planner(kind, drafting, settings)

    def generate(
        self,
        prompt: Prompt,
        params: GenerationParams | None = None,
        *,
        slot: int | None = None,
        media: Sequence[MediaSpan] = (),
    ) -> Generation:
        """Start a generation: iterate the result for text pieces; ``result`` holds the
        text, tokens, finish reason and statistics when it ends.

        The draft length is clamped, at every step, to what the verification batch, the
        context and ``n_predict`` leave (:mod:`specgguf.speculative.loop`); ``stats.draft_max``
        reports the largest usable.

        ``slot``: one of the ``--parallel`` sequences (0 to ``n_parallel - 1``), whose
        generation must then be iterated inside a task of :attr:`batcher`
        (:meth:`start_batching`); None: the engine's one sequence.

        ``params.grammar``: the output held to a grammar (:mod:`specgguf.speculative.grammar`;
        compiled here, cached per grammar).

        ``media``: the images of a prompt made by :meth:`media_prompt`, read at their
        positions.

        With ``params.cache_prompt`` (the default) and a prompt cache
        (``CacheConfig.ram``/``disk``), the sequence's state may be saved into the cache and
        a saved prompt loaded into it here, before the generation is iterated; the
        generation then keeps what the sequence shares with the prompt.

        Raises:
            UsageError: an empty prompt, a malformed conversation, bad speculative settings.
            GrammarError: a grammar that cannot be used (a UsageError).
            ChatTemplateError: the chat template cannot be rendered.
            ContextOverflowError: the prompt leaves no room to generate.
        """
        params = params or GenerationParams()
        det = self.config.deterministic if params.deterministic is None else params.deterministic
        if det and not self.deterministic_rows:
            raise UsageError("a deterministic generation needs an engine set up for it")
        params = dataclasses.replace(params, deterministic=det)
        planner = self.planner(params, slot)
        ids = self.prompt_ids(prompt)
        seq = self.own if slot is None else self.slots[slot]
        seq.target.set_rows_per_decode(self.deterministic_rows if det else None)
        constraint = self.constraint(params.grammar) if params.grammar is not None else None
        gen = seq.decoder.generate(ids, params, planner, constraint, media)
        if params.cache_prompt:
            self._recall(seq, ids, media)
        seq.last_used = time.monotonic()
        return gen

    def media_refusal(self) -> str | None:
        """Why this engine reads no media yet (None: it does): deterministic mode."""
        return "deterministic mode" if self.config.deterministic else None

    def drop_projector(self) -> None:
        """Free the projectors (``--mmproj``, ``--mmproj-draft``): the engine reads no
        media from here on."""
        for p in (self.projector, self.draft_projector):
            if p is not None:
                p.close()
        self.projector = self.draft_projector = None

    def check_media(self, media: Sequence[tuple[str, bytes]]) -> None:
        """Refuse ``media`` (``(name, bytes)``) before anything is decoded: no projector
        loaded, a setup that reads none (:meth:`media_refusal`), a medium that is empty,
        too large, of another format, too many pixels or too long by its header, or of a
        kind the projector does not read (:func:`specgguf.llama.media.check_medium`).

        Raises:
            MediaError: naming the medium.
            UsageError: a setup that reads no media yet.
        """
        from specgguf.llama.media import check_medium

        if not media:
            return
        first = media[0][0]
        if self.projector is None:
            raise MediaError(f"{first}: reading images or audio needs the target's projector "
                             f"file (mmproj)", part=first)  # fmt: skip
        if why := self.media_refusal():
            raise UsageError(f"media with {why} are not supported yet")
        for name, data in media:
            check_medium(data, name, vision=self.projector.vision, audio=self.projector.audio)

    def media_prompt(
        self,
        prepared: PreparedPrompt,
        media: Sequence[tuple[str, bytes]],
        *,
        marker: str | None = None,
        stop: Callable[[], bool] | None = None,
        turn: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
    ) -> tuple[list[int], list[MediaSpan]]:
        """The token ids of a rendered prompt whose text holds a media marker (``marker``,
        default :data:`specgguf.llama.media.MARKER`) where each of ``media`` goes (``(name,
        bytes)``: a file's name or a request's part, and its content), and the media's
        embeddings at their positions, for :meth:`generate`'s ``media``: each medium's
        positions hold a placeholder token (the target's BOS) in the ids. The text between
        the markers is tokenized as :meth:`prepared_ids` does, as libmtmd tokenizes the
        pieces (``mtmd_tokenize``). ``stop``: asked before each chunk of a medium is
        encoded, and ``turn`` makes the context each is encoded in
        (:meth:`specgguf.llama.media.Projector.chunks`).

        Raises:
            MediaError: no projector loaded, a medium that cannot be read (see
                :meth:`specgguf.llama.media.Projector.chunks`), or the prompt's last
                position inside a medium (text must follow it).
            UsageError: not as many markers as media; media in deterministic mode (not
                supported yet: :meth:`media_refusal`).
            ContextOverflowError: a medium that does not fit the context, found before it
                is encoded.
        """
        from specgguf.llama.media import MARKER, MediaSpan

        marker = marker or MARKER

        if not media:
            return self.prepared_ids(prepared), []
        self.check_media(media)
        assert self.projector is not None
        text = prepared.text
        cuts = [m.start() for m in re.finditer(re.escape(marker), text)]
        if len(cuts) != len(media):
            raise UsageError(f"the prompt has {len(cuts)} media marker(s) {marker} for "
                             f"{len(media)} medium/media")  # fmt: skip
        placeholder = max(0, self.target_model.bos)
        ids: list[int] = []
        spans: list[MediaSpan] = []
        at = 0
        shift = 0  # rows less positions so far (M-RoPE: an image's rows share positions)
        draft_shift = 0  # the same for the draft model's rows (--mmproj-draft)
        for i, cut in enumerate([*cuts, len(text)]):
            literal = tuple((max(a, at) - at, min(b, cut) - at) for a, b in prepared.literal
                            if a < cut and b > at)  # fmt: skip
            piece = dataclasses.replace(prepared, text=text[at:cut], literal=literal,
                                        add_special=prepared.add_special and i == 0)  # fmt: skip
            if piece.text or piece.add_special:
                ids += self.prepared_ids(piece)
            at = cut + len(marker)
            if i == len(media):
                break
            name, data = media[i]
            key = hashlib.sha256(data).digest()
            chunks = self.projector.chunks(data, name, fits=(len(ids), self.n_ctx), stop=stop,
                                           turn=turn)  # fmt: skip
            drafts = self._draft_chunks(data, name, chunks, stop, turn)
            for chunk in chunks:
                if chunk.embd is None:
                    ids += chunk.tokens or []
                    continue
                pos = chunk.positions(len(ids) - shift)
                span = MediaSpan(len(ids), chunk.embd, key, chunk.non_causal, pos, chunk.n_pos)
                if drafts is None:
                    draft = self._draft_rows(span)
                else:  # (its own rows, at its own positions)
                    own = drafts.pop(0)
                    assert own.embd is not None
                    grid = own.positions(span.start - draft_shift)
                    draft = MediaSpan(span.start, own.embd, key, own.non_causal, grid, own.n_pos)
                draft_shift += draft.shift if draft is not None else 0
                spans.append(dataclasses.replace(span, draft=draft))
                shift += span.shift
                ids += [placeholder] * len(chunk.embd)
        if spans and spans[-1].end >= len(ids):
            raise MediaError(f"{media[-1][0]} ends the prompt: a prompt must not end with a "
                             f"medium; put text after its marker", part=media[-1][0])  # fmt: skip
        return ids, spans

    def _draft_chunks(
        self,
        data: bytes,
        name: str,
        chunks: list[Chunk],
        stop: Callable[[], bool] | None,
        turn: Callable[[], contextlib.AbstractContextManager[object]] | None,
    ) -> list[Chunk] | None:
        """The draft model's embeddings of a medium through its own projector
        (``--mmproj-draft``), one for each of the target's ``chunks`` of embeddings, of as
        many rows each; None where there is no such projector, or it does not read this
        kind of medium or gives other rows (the draft then reads the placeholder tokens,
        said once in the log).

        Raises:
            MediaError, BackendError: as :meth:`specgguf.llama.media.Projector.chunks`.
        """
        from specgguf.llama.media import image_format

        dp = self.draft_projector
        if dp is None or self.draft_ctx is None:
            return None
        audio = image_format(data) == "audio"
        if not (dp.audio if audio else dp.vision):
            self._say_draft_media(f"the draft's projector {dp.path.name} reads no "
                                  f"{'audio' if audio else 'images'}")  # fmt: skip
            return None
        own = [c for c in dp.chunks(data, name, stop=stop, turn=turn) if c.embd is not None]
        theirs = [c.embd for c in chunks if c.embd is not None]
        if [len(c.embd) for c in own if c.embd is not None] != [len(e) for e in theirs]:
            self._say_draft_media(f"the draft's projector {dp.path.name} makes other rows "
                                  f"of {name} than the target's")  # fmt: skip
            return None
        return own

    def _say_draft_media(self, why: str) -> None:
        """Log once that the draft model reads a medium's placeholder tokens, and why."""
        if not self._said_draft_media:
            self._said_draft_media = True
            log.warning("%s: the draft model reads its placeholder tokens", why)

    def _draft_rows(self, span: MediaSpan) -> MediaSpan | None:
        """The draft model's rows of a medium (:attr:`MediaSpan.draft`): the target's
        embeddings where the draft model reads rows of their width, as llama.cpp's
        draft-simple gives a draft the target's (common/speculative.cpp), at the draft's
        own positions (M-RoPE's grid where both have it, one a row else); None where its
        width differs (it then reads the placeholder tokens; llama.cpp gives it zero
        rows) or no draft model reads the text."""
        import numpy as np

        from specgguf.llama.media import MediaSpan

        d = self.draft_model
        if self.draft_ctx is None or d is None or d.n_embd_inp != span.embd.shape[1]:
            return None
        rows = MediaSpan(span.start, span.embd, span.key, span.non_causal)
        if not d.mrope:
            return rows
        if span.pos is not None:  # (the same grid: the draft's positions are the target's)
            return dataclasses.replace(rows, pos=span.pos, n_pos=span.n_pos)
        at = np.arange(span.start, span.end, dtype=np.int32)  # (every section: as a clip's)
        return dataclasses.replace(rows, pos=np.tile(at, (4, 1)), n_pos=len(at))

    # -- what the sequences hold ------------------------------------------------------

    @property
    def n_parallel(self) -> int:
        """Sequences that generate at once (``serve --parallel``; 1: one at a time)."""
        return self.config.n_parallel

    def pick_slot(
        self, ids: Sequence[int], free: Sequence[int], media: Sequence[MediaSpan] = ()
    ) -> int:
        """Which of the ``free`` slots a prompt of token ``ids`` (and ``media``, from
        :meth:`media_prompt`) should go to: the one sharing the longest prefix with it,
        images compared by content, else the least recently used
        (:func:`specgguf.engine.slots.best_slot`, ``CacheConfig.slot_similarity``).

        Raises:
            ValueError: no slot is free.
        """
        return best_slot(self.slots, free, ids, self.config.cache.slot_similarity, media)

    def _recall(self, seq: Slot, ids: Sequence[int], media: Sequence[MediaSpan] = ()) -> None:
        """Before ``seq`` reads the prompt ``ids`` (with ``media``): a saved prompt that
        shares more with ``ids`` than ``seq`` does (its media compared by content) is
        taken out of the prompt cache, what ``seq`` holds goes into it when the prompt
        keeps less than half of it (llama-server's rule) and the cache has room for it,
        and the saved prompt comes back into ``seq``. A state llama.cpp cannot copy or
        take back is said in the log: the prompt is then read."""
        cache = self.prompt_cache
        if cache is None:
            return
        own, held = seq.cached_prefix(ids, media), seq.n_cached
        entry, shared = cache.best(ids, media)
        back = None
        if entry is not None and shared > own:
            try:  # (taken first: saving the sequence may evict it)
                back = cache.take(entry)
            except (SpecggufError, OSError) as e:
                log.warning("prompt cache: %s; the prompt is read instead", e)
        if held and own < held / 2 and cache.has_room(seq.state_bytes()):
            try:
                cache.put(seq.save())
            except SpecggufError as e:
                log.warning("prompt cache: %s; the sequence's prompt is not kept", e)
        if back is not None:
            try:
                seq.load(back)
            except SpecggufError as e:
                log.warning("prompt cache: %s; the prompt is read instead", e)

    def cache_identity(self) -> dict[str, Any]:
        """What a saved prompt of this engine belongs to (see
        :func:`specgguf.engine.prompt_cache.identity`): the models' files, the llama.cpp
        build, each context's size, K cache type, batch and micro-batch, sequences and
        recurrent snapshots, weight repacking, whether the MTP layers draft."""

        def context(ctx: LlamaContext | None) -> dict[str, Any] | None:
            if ctx is None:
                return None
            return {"n_ctx": ctx.n_ctx_allocated, "type_k": ctx.type_k,
                    "n_batch": ctx.n_batch, "n_ubatch": ctx.n_ubatch, "n_seq": ctx.n_parallel,
                    "n_rs_seq": ctx.n_rs_seq, "repack": ctx.model.use_extra_bufts}  # fmt: skip

        draft = self.draft_model
        return identity(
            build=build_key(build_info()),
            target=file_fingerprint(self.target_model.path),
            target_context=context(self.target_ctx),
            draft=file_fingerprint(draft.path) if draft is not None else None,
            draft_context=context(self.draft_ctx),
            head=self.head_kind,
        )

    def keep_prompts(self) -> int:
        """At shutdown, with a prompt-cache folder (``--cache-dir``): what each sequence
        holds goes into the prompt cache, then everything it holds in memory into its
        files, for a later server of the same models and settings. Returns the files
        written (0 without a folder). Call it on the engine's thread, no generation
        running."""
        cache = self.prompt_cache
        if cache is None or cache.disk is None:
            return 0
        written = cache.files_written  # (a state larger than the memory goes straight there)
        for seq in self.slots:
            if seq.ctx.holds_media:
                continue  # (a prompt with images is not kept in files yet)
            if seq.n_cached and cache.has_room(seq.state_bytes()):
                try:
                    cache.put(seq.save())
                except SpecggufError as e:
                    log.warning("prompt cache: sequence %d could not be saved: %s", seq.index, e)
        cache.flush()
        return cache.files_written - written

    def save_prompt(self, slot: int | None = None) -> SavedPrompt:
        """A copy of what a sequence holds (None: the engine's own), for
        :meth:`load_prompt` or a prompt-cache file
        (:func:`specgguf.engine.prompt_cache.write_file` with :meth:`cache_identity`).

        Raises:
            BackendError: llama.cpp could not copy a state.
        """
        return (self.own if slot is None else self.slots[slot]).save()

    def load_prompt(self, saved: SavedPrompt, slot: int | None = None) -> None:
        """Make a sequence (None: the engine's own) hold ``saved``: the next generation
        on it reuses what its prompt shares with it. The timings auto mode needs are
        measured first, where they are not yet known: measuring them evaluates on the
        target's context, which would empty the sequence again.

        Raises:
            BackendError: llama.cpp refused a state (the sequence is then empty), or the
                timings could not be measured.
        """
        if self.config.speculative.drafter == "auto":
            self.timings(self.config.deterministic)
        (self.own if slot is None else self.slots[slot]).load(saved)

    @property
    def grammars(self) -> Grammars:
        """Grammars over the target's vocabulary (:mod:`specgguf.engine.constraints`),
        built at the first use (about 1 s for 151,936 tokens), by whichever thread asks
        first (the server compiles a request's grammar before queueing it); reading the
        vocabulary is safe beside a generation."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = model_grammars(self.target_model)
            return self._grammars

    def check_grammar(self, spec: GrammarSpec) -> None:
        """Compile ``spec`` for the target's vocabulary (kept for the generations that use
        it), before any token is generated.

        Raises:
            GrammarError: a schema, grammar or regular expression that cannot be used,
                named in the message.
        """
        self.grammars.compile(spec)

    def constraint(self, spec: GrammarSpec) -> Constraint:
        """The grammar ``spec`` at its start, for one generation.

        Raises:
            GrammarError: as :meth:`check_grammar`.
        """
        return self.grammars.constraint(spec)

    # -- facts ------------------------------------------------------------------------

    @property
    def n_ctx(self) -> int:
        """The target's context size in tokens (as configured; 0 resolved)."""
        return self.target_ctx.n_ctx

    @property
    def n_ctx_draft(self) -> int | None:
        """The draft's context size in tokens; None without a draft model."""
        return self.draft_ctx.n_ctx if self.draft_ctx is not None else None

    @property
    def n_threads(self) -> int:
        """CPU threads of the target (the configured number, or the physical cores)."""
        return self.config.target.n_threads or default_threads()

    @property
    def repack(self) -> bool:
        """Whether the target's weights are repacked (llama.cpp's extra buffer types)."""
        return self.target_model.use_extra_bufts

    def timings(self, deterministic: bool = False, *, recalibrate: bool = False) -> Timings:
        """The target's verification and the draft's step timings on this machine, for
        auto mode (``deterministic``: with deterministic mode's batch shapes): from the
        calibration cache, or measured now (a few seconds) and cached
        (:mod:`specgguf.engine.calibration`).

        Raises:
            BackendError: an evaluation failed.
        """
        det = deterministic and bool(self.deterministic_rows)
        if det in self._timings and not recalibrate:
            return self._timings[det]
        saved, replays = self.target_ctx.rows_per_decode, self.target_ctx.replays
        self.target_ctx.set_rows_per_decode(self.deterministic_rows if det else None)
        # the curve is the verification's own; checkpoint and replay is measured apart
        self.target_ctx.replays = False
        try:
            self._timings[det] = pair_timings(
                self.calibration_key(det), self.target_ctx, self.draft_ctx,
                self._calibration_ids(), recalibrate=recalibrate,
            )  # fmt: skip
        finally:
            self.target_ctx.set_rows_per_decode(saved)
            self.target_ctx.replays = replays
        if det:  # past this a lone row costs two (a throw-away row)
            self._timings[det].lone_max = self.target_ctx.lone_rows_max
            self._timings[det].chunk_rows = self.deterministic_rows
        if self.heads and self.draft_ctx is None:
            self._timings[det].draft = self._head_token_seconds()
        if self.target_ctx.replays:
            self._timings[det].replay = (*self.target_ctx.replay_seconds(),
                                         self.target_ctx.replays_lazily)  # fmt: skip
        return self._timings[det]

    def calibration_needed(self, deterministic: bool = False) -> bool:
        """Whether :meth:`timings` would measure (no timings in this engine nor in the
        cache for this pair), so that a face can say so before a pause of 10-20 s on a
        CPU for a 1.5B target. (A cached calibration may still be measured again, when a
        fresh step shows it was taken on a busy machine.)"""
        det = deterministic and bool(self.deterministic_rows)
        return det not in self._timings and load_calibration(self.calibration_key(det)) is None

    def _head_token_seconds(self, repeats: int = 5) -> float:
        """Seconds per draft token of the head (the MTP layers, an EAGLE-3 head, a DFlash
        draft: :meth:`specgguf.llama.backend.DraftHead.token_seconds`), the draft time of
        auto mode's cost model, as a draft model's. Every sequence's drafter of it follows
        an emptied head afterwards."""
        best = self.heads[0].token_seconds(repeats)
        if (drafter := self.own.drafter(MtpDrafter)) is not None:
            drafter.follow([], None)  # the head's cache is empty now
        return best

    def calibration_key(self, deterministic: bool = False) -> str:
        """The key of this pair's calibration in the cache (see
        :func:`specgguf.engine.calibration.calibration_key`), for deterministic mode's
        batch shapes when ``deterministic``."""
        return calibration_key(
            build_key(build_info()), self.target_model.path,
            self.draft_model.path if self.draft_model else None, self.n_threads,
            self.target_model.use_extra_bufts,
            self.deterministic_rows if deterministic else 0,
            placement="|".join(m.placement for m in (self.target_model, self.draft_model)
                               if m is not None),
            type_k=self.target_ctx.type_k,
        )  # fmt: skip

    def _calibration_ids(self) -> list[int]:
        return self.target_model.tokenize(_CALIBRATION_TEXT, add_special=False)

    def target_alone_rate(self, *, measure: bool = True, cached: int = 0) -> float | None:
        """Tokens/s the target alone reaches on this machine (1 / its one-token decode
        time after ``cached`` positions): from the pair's timings when known (auto mode, with
        what its run learned of them; the calibration cache), else measured now when
        ``measure`` (three decode steps, a fraction of a second; the KV cache ends empty),
        else None. Python's share of a real run is not counted, so a real target-alone run
        is a few percent slower.

        Raises:
            BackendError: an evaluation failed.
        """
        t = self._timings.get(False) or load_calibration(self.calibration_key())
        if t is None:
            if not measure:
                return None
            t = calibrate(self.target_ctx, None, self._calibration_ids(), sizes=(1,), repeats=3)
        return 1.0 / t.verify_time(1, cached)

    def describe(self) -> dict[str, Any]:
        """What is loaded, JSON-able: model files, context sizes, drafter defaults."""
        spec = self.config.speculative
        draft_rpc = self.config.draft.rpc if self.config.draft and self.draft_model else ()
        return {
            "target": str(self.target_model.path),
            "draft": str(self.draft_model.path) if self.draft_model else None,
            #: the target's MTP layers that draft, for each sequence (0: none)
            "mtp_layers": self.target_model.n_layer_nextn if self.head_kind == "mtp" else 0,
            #: the drafter whose head drafts (mtp, eagle3), or None
            "head": self.head_kind,
            "rpc": list(self.config.target.rpc),
            "rpc_draft": list(draft_rpc),
            "n_ctx": self.n_ctx,
            "n_ctx_draft": self.n_ctx_draft,
            "drafter": spec.drafter,
            "draft_max": spec.draft_max,
            "draft_min": spec.draft_min,
            "draft_tree": spec.draft_tree,
            "p_min": spec.p_min,
        }

    # -- lifetime ---------------------------------------------------------------------

    def close(self) -> None:
        """Free every model, context and batch; idempotent."""
        self._stack.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
