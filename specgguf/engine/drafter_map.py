"""The registry of drafters: each drafter declares itself once, in :data:`DRAFTERS`.

An entry (:class:`DrafterEntry`) says what a drafter is called (its name and llama.cpp's
``--spec-type`` names for it), what it needs (:class:`Needs`: a draft model, the target's
MTP layers), how the engine makes one for each
sequence from what it loaded (:class:`Sources`), its arm in auto mode
(:mod:`specgguf.speculative.arms`), how it is costed (``evaluated``: a forward pass per
draft token), whether it drafts for every sequence of ``--parallel``, and its help line.
Everything that names drafters reads it: ``--drafter`` and ``--spec-type`` (their choices
and help), a request's ``speculative.drafter``, preflight's refusals, ``bench``'s
configurations and the planner simulator's fixed drafters. A new kind of drafter is one
class (:class:`specgguf.speculative.draft.Drafter`) and one entry here.

Auto mode is an :class:`~specgguf.speculative.planner.AutoPlanner` over the arms of every
entry a sequence has a drafter of, in the registry's order (on a tie, the earlier wins:
free drafters first); a fixed drafter (``--drafter NAME``) is a
:class:`~specgguf.speculative.planner.FixedPlanner` over that drafter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from specgguf.errors import UsageError
from specgguf.gguf.arch import article
from specgguf.speculative.arms import Arm, LookupArm, ModelArm, SuffixArm
from specgguf.speculative.costmodel import Timings
from specgguf.speculative.draft import Drafter, Evaluator
from specgguf.speculative.drafters import ModelDrafter, MtpDrafter, NgramDrafter, SuffixDrafter
from specgguf.speculative.drafters.assistant import AssistantDrafter
from specgguf.speculative.drafters.dflash import DFlashDrafter
from specgguf.speculative.drafters.eagle3 import Eagle3Drafter
from specgguf.speculative.drafters.mtp import Head, HiddenStates
from specgguf.speculative.planner import AutoPlanner, FixedPlanner, Planner
from specgguf.speculative.tuning import AUTO_TUNING, AutoTuning

if TYPE_CHECKING:
    from specgguf.engine.config import EngineConfig
    from specgguf.gguf.info import ModelInfo
    from specgguf.llama.backend import DraftHead, LlamaContext, LlamaModel

#: Drafter names that are not drafters: auto mode, and the target alone.
AUTO, NONE = "auto", "none"


@dataclasses.dataclass(frozen=True)
class Needs:
    """What a drafter needs to run: a draft model (``-md``), the target's multi-token-
    prediction layers (``nextn_predict_layers``). (Every target drops rejected drafts:
    a recurrent state by its snapshots or by checkpoint and replay.)"""

    draft_model: bool = False
    mtp_layers: bool = False
    #: what it needs, in its own words ("": from the fields)
    what: str = ""

    def describe(self) -> str:
        """What it needs that a target alone does not have, in words ("" for nothing)."""
        if self.what:
            return self.what
        parts = ["a draft model"] * self.draft_model
        parts += ["the target's multi-token-prediction layers"] * self.mtp_layers
        return " and ".join(parts)


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """A drafter that drafts with a context of its own reading the target's hidden states
    (the target's MTP layers, an EAGLE-3 head): its context for one of the target's
    sequences (``make``: from the model that holds its weights, and the sequence), which
    hidden states it reads (``layers``: the target's layers whose inputs, read from that
    model; empty: the output's), and where its weights are: a draft model file (``-md``)
    whose ``general.architecture`` is one of ``architectures`` is this drafter's (auto
    mode and ``--drafter`` take it as that, not as a draft model); none: the target's own
    layers."""

    make: Callable[[LlamaModel, LlamaContext], DraftHead]
    layers: Callable[[LlamaModel], tuple[int, ...]] = lambda model: ()
    architectures: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class Sources:
    """What the engine loaded that drafters draft from, for ``n`` sequences (the slots of
    ``--parallel``, or the engine's own one): the target's vocabulary size, the n-gram
    lengths to look up, the draft model's sequence for each (empty: no draft model is
    loaded), and by drafter name, for each sequence its head's context with the sequence
    whose hidden states it reads (:class:`HeadSpec`; a name absent: none loaded)."""

    n: int
    n_vocab: int
    ngram: tuple[int, int] = (2, 8)
    draft: Sequence[Evaluator] = ()
    heads: Mapping[str, Sequence[tuple[Head, HiddenStates]]] = dataclasses.field(
        default_factory=dict
    )


@dataclasses.dataclass(frozen=True)
class DraftSettings:
    """One generation's drafting: the draft length, p_min, deterministic mode, the
    shortest draft worth verifying (``draft_min``; 0: any), the most branches of a
    token tree (``tree_branches``; 0: chains only), and whether the drafter runs under
    auto mode (``auto``: an evaluated drafter then drafts at most ``draft_max_model``)."""

    draft_max: int
    p_min: float = 0.0
    deterministic: bool = False
    draft_min: int = 0
    tree_branches: int = 0
    auto: bool = False

    @property
    def trees(self) -> int:
        """The most branches of a tree this generation verifies (none in deterministic
        mode, whose verification batches have fixed shapes)."""
        return 0 if self.deterministic else self.tree_branches


@dataclasses.dataclass(frozen=True)
class DrafterEntry:
    """One drafter, as everything outside :mod:`specgguf.speculative` knows it.

    Args:
        name: ``--drafter NAME`` and a request's ``speculative.drafter``.
        help: what it drafts with, for ``--drafter``'s help (a few words).
        make: its drafter for each of the ``Sources.n`` sequences, in order, or None where
            what it needs was not loaded.
        arm: its arm in auto mode, for one generation's settings and auto mode's tuning.
        spec_types: llama.cpp's ``--spec-type`` names that mean this drafter.
        spec_note: where it drafts otherwise than llama.cpp's drafter of those names, in
            words (said when ``--spec-type`` names it); "" where it does not.
        needs: what it needs (preflight and the engine refuse it without).
        evaluated: a forward pass per draft token: costed by its measured seconds per
            token (``Timings.draft``), at most ``AutoTuning.draft_max_model`` tokens a
            draft in auto mode; else its drafts cost nothing to make.
        parallel: it drafts for every sequence of ``--parallel``; else for one sequence
            at a time, and a server with several is refused it.
        remembers: it keeps what earlier generations saw (a benchmark gives each
            configuration a fresh one, :meth:`specgguf.engine.Engine.fresh_memory`).
        trees: its arm drafts token trees (``DraftSettings.tree_branches``); else chains,
            and a tree asked of it is refused.
        check: further preflight rules: raises UsageError for a configuration, target
            or draft model file (None: none is loaded) it cannot run on, before anything
            loads.
        head: for a drafter with a context of its own that reads the target's hidden
            states, what the engine loads for it (:class:`HeadSpec`).
    """

    name: str
    help: str
    make: Callable[[Sources], list[Drafter] | None]
    arm: Callable[[Drafter, DraftSettings, AutoTuning], Arm]
    spec_types: tuple[str, ...] = ()
    spec_note: str = ""
    needs: Needs = Needs()
    evaluated: bool = False
    parallel: bool = True
    remembers: bool = False
    trees: bool = False
    check: Callable[[EngineConfig, ModelInfo, ModelInfo | None], None] | None = None
    head: HeadSpec | None = None


def _evaluated_arm(drafter: Drafter, s: DraftSettings, tuning: AutoTuning) -> Arm:
    draft_max = min(tuning.draft_max_model, s.draft_max) if s.auto else s.draft_max
    # (a head's drafts may be shorter whatever K: a block, chained MTP blocks)
    if most := getattr(drafter, "most", None):
        draft_max = min(draft_max, most)
    return ModelArm(drafter, draft_max=draft_max, p_min=s.p_min)  # type: ignore[arg-type]


def _make_model(src: Sources) -> list[Drafter] | None:
    if not src.draft:
        return None
    return [ModelDrafter(ctx, src.n_vocab) for ctx in src.draft]


def _check_model(config: EngineConfig, target: ModelInfo, draft: ModelInfo | None) -> None:
    if draft is not None and (kind := head_of_draft(draft.architecture)) is not None:
        arch = draft.architecture
        raise UsageError(f"the draft {draft.path.name} is {article(arch)} {arch} head, not a "
                         f"draft model: it drafts as the {kind} drafter")  # fmt: skip


def _heads(cls: type[MtpDrafter], name: str) -> Callable[[Sources], list[Drafter] | None]:
    """``make`` of a drafter of class ``cls`` over the heads of entry ``name``."""

    def make(src: Sources) -> list[Drafter] | None:
        heads = src.heads.get(name)
        return [cls(h, target, src.n_vocab) for h, target in heads] if heads else None

    return make


def _mtp_head(model: LlamaModel, seq: LlamaContext) -> DraftHead:
    from specgguf.llama.backend import MtpHead

    return MtpHead(seq)


def _check_mtp(config: EngineConfig, target: ModelInfo, draft: ModelInfo | None) -> None:
    if not target.nextn_layers:
        raise UsageError(
            f"the mtp drafter: {target.path.name} carries no multi-token-prediction layers "
            f"({target.architecture}.nextn_predict_layers)"
        )


def _eagle3_head(model: LlamaModel, seq: LlamaContext) -> DraftHead:
    from specgguf.llama.backend import Eagle3Head

    return Eagle3Head(model, seq)


def _target_layers(model: LlamaModel) -> tuple[int, ...]:
    from specgguf.llama.backend import head_target_layers

    return head_target_layers(model)


def _check_layer_head(
    arch: str, what: str
) -> Callable[[EngineConfig, ModelInfo, ModelInfo | None], None]:
    """``check`` of a drafter whose head is a draft file of architecture ``arch``
    (``what``: it in words) reading the inputs of the target's layers."""

    def check(config: EngineConfig, target: ModelInfo, draft: ModelInfo | None) -> None:
        from specgguf.gguf.arch import head_fit

        if draft is None or draft.architecture != arch:
            got = ("none was given" if draft is None
                   else f"{draft.path.name} is {draft.architecture}")  # fmt: skip
            raise UsageError(f"the {arch} drafter needs {what} as its draft model (a GGUF "
                             f"of architecture {arch}); {got}")  # fmt: skip
        if draft.markov_head and not draft.draft_block:
            raise UsageError(f"the {arch} drafter cannot draft with {draft.path.name}: a "
                             "DSpark draft without dflash.block_size, which llama.cpp's graph "
                             "needs")  # fmt: skip
        n_layer = (target.block_count or 0) - target.nextn_layers
        why = head_fit(target.architecture, target.embedding_length, n_layer or None, arch,
                       draft.target_layers, draft.target_width)  # fmt: skip
        if why:
            raise UsageError(f"the {arch} drafter cannot draft with {draft.path.name} for "
                             f"{target.path.name}: {why[0]}")  # fmt: skip

    return check


def _assistant_head(model: LlamaModel, seq: LlamaContext) -> DraftHead:
    from specgguf.llama.backend import AssistantHead

    return AssistantHead(model, seq)


#: MTP assistants' architectures (each drafts for its target's architecture: ``head_fit``)
ASSISTANT_ARCHS = frozenset({"gemma4-assistant"})


def _check_assistant(config: EngineConfig, target: ModelInfo, draft: ModelInfo | None) -> None:
    from specgguf.gguf.arch import head_fit

    if draft is None or draft.architecture not in ASSISTANT_ARCHS:
        got = ("none was given" if draft is None
               else f"{draft.path.name} is {draft.architecture}")  # fmt: skip
        raise UsageError("the assistant drafter needs an MTP assistant as its draft model (a "
                         f"GGUF of architecture gemma4-assistant); {got}")  # fmt: skip
    why = head_fit(target.architecture, target.embedding_length, None, draft.architecture, (),
                   draft.target_width)  # fmt: skip
    if why:
        raise UsageError(f"the assistant drafter cannot draft with {draft.path.name} for "
                         f"{target.path.name}: {why[0]}")  # fmt: skip


def _dflash_head(model: LlamaModel, seq: LlamaContext) -> DraftHead:
    from specgguf.llama.backend import DFlashHead

    return DFlashHead(model, seq)


#: Drafter name -> its entry, in the order auto mode weighs them (free drafters first).
DRAFTERS: dict[str, DrafterEntry] = {
    e.name: e
    for e in (
        DrafterEntry(
            "ngram", "n-gram lookup",
            make=lambda src: [NgramDrafter(*src.ngram) for _ in range(src.n)],
            arm=lambda d, s, t: LookupArm(d),  # type: ignore[arg-type]
            spec_types=("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod",
                        "ngram-cache"),
            spec_note="specgguf's n-gram lookup drafts what followed the latest earlier "
            "occurrence of the last 8 to 2 tokens of the prompt and output, without "
            "llama.cpp's n-gram counts, hash pool or cache files",
        ),
        DrafterEntry(
            "suffix", "suffix matching over all text seen",
            # one corpus of everything the sequences saw, a copy each
            make=lambda src: list(SuffixDrafter.group(src.n)),
            arm=lambda d, s, t: SuffixArm(d, tree_branches=s.trees),  # type: ignore[arg-type]
            remembers=True, trees=True,
        ),
        DrafterEntry(
            "model", "the draft model", make=_make_model, arm=_evaluated_arm,
            spec_types=("draft-simple",), needs=Needs(draft_model=True), evaluated=True,
            check=_check_model,
        ),
        DrafterEntry(
            "mtp", "the target's multi-token-prediction layers",
            make=_heads(MtpDrafter, "mtp"), arm=_evaluated_arm, spec_types=("draft-mtp",),
            needs=Needs(mtp_layers=True), evaluated=True, check=_check_mtp,
            head=HeadSpec(_mtp_head),
        ),
        DrafterEntry(
            "eagle3", "an EAGLE-3 head given as -md", make=_heads(Eagle3Drafter, "eagle3"),
            arm=_evaluated_arm, spec_types=("draft-eagle3",),
            needs=Needs(draft_model=True, what="an EAGLE-3 head as its draft model"),
            evaluated=True, check=_check_layer_head("eagle3", "an EAGLE-3 head"),
            head=HeadSpec(_eagle3_head, _target_layers, frozenset({"eagle3"})),
        ),
        DrafterEntry(
            "assistant", "an MTP assistant model given as -md (Gemma 4's)",
            make=_heads(AssistantDrafter, "assistant"), arm=_evaluated_arm,
            needs=Needs(draft_model=True, what="an MTP assistant as its draft model"),
            evaluated=True, check=_check_assistant,
            head=HeadSpec(_assistant_head, architectures=ASSISTANT_ARCHS),
        ),
        DrafterEntry(
            "dflash", "a DFlash, DSpark or DFlash2 block-diffusion draft given as -md",
            make=_heads(DFlashDrafter, "dflash"), arm=_evaluated_arm,
            spec_types=("draft-dflash", "draft-dspark"),
            needs=Needs(draft_model=True, what="a DFlash draft as its draft model"),
            evaluated=True, check=_check_layer_head("dflash", "a DFlash draft"),
            head=HeadSpec(_dflash_head, _target_layers, frozenset({"dflash"})),
        ),
    )
}  # fmt: skip


def entry(name: str) -> DrafterEntry:
    """The entry of drafter ``name``.

    Raises:
        UsageError: no drafter has that name.
    """
    if name not in DRAFTERS:
        raise unknown_drafter(name)
    return DRAFTERS[name]


def unknown_drafter(name: str) -> UsageError:
    """The error for a drafter name that names nothing (one line: the names there are)."""
    return UsageError(f"the drafter must be {', '.join(drafter_kinds())}, not {name!r}")


def head_of_draft(architecture: str | None) -> str | None:
    """The drafter whose head a draft model file of ``architecture`` is
    (:attr:`HeadSpec.architectures`), or None: a draft model."""
    return next((name for name, e in DRAFTERS.items()
                 if e.head is not None and architecture in e.head.architectures), None)  # fmt: skip


def drafter_kinds() -> tuple[str, ...]:
    """What ``--drafter`` takes: auto mode, a drafter of :data:`DRAFTERS`, or none."""
    return (AUTO, *sorted(DRAFTERS), NONE)


def needs(kind: str) -> Needs:
    """What drafter ``kind`` needs (auto mode and none: nothing; auto loads what it can)."""
    return DRAFTERS[kind].needs if kind in DRAFTERS else Needs()


def spec_types() -> dict[str, str]:
    """llama.cpp's ``--spec-type`` names -> the drafter each means (``none``: none)."""
    types = {NONE: NONE}
    for e in DRAFTERS.values():
        types.update(dict.fromkeys(e.spec_types, e.name))
    return types


def drafter_help() -> str:
    """``--drafter``'s choices in words, from the registry."""
    each = ", ".join(f"{e.name} ({e.help})" for e in DRAFTERS.values())
    return f"{AUTO} (per step, the fastest drafter loaded), {each} or {NONE} (the target alone)"


def check_rules(config: EngineConfig, target: ModelInfo, draft: ModelInfo | None = None) -> None:
    """Preflight's rules of the configured drafter, from its entry: what it needs of the
    target, of the draft model file (``draft``: None where none is loaded) and of the
    server, and the entry's own rules; a draft file that is another drafter's head.

    Raises:
        UsageError: one line naming the drafter and what it lacks.
    """
    kind = config.speculative.drafter
    head = head_of_draft(draft.architecture) if draft is not None else None
    # ("model" says it in its own words)
    if draft is not None and head not in (None, kind) and kind not in (AUTO, "model"):
        arch = draft.architecture
        raise UsageError(f"the draft {draft.path.name} is {article(arch)} {arch} head: it "
                         f"drafts as the {head} drafter (or in auto mode)")  # fmt: skip
    if kind == AUTO and head is not None and (check := DRAFTERS[head].check) is not None:
        check(config, target, draft)  # (auto mode drafts with it)
    if kind not in DRAFTERS:
        return
    e = DRAFTERS[kind]
    if config.n_parallel > 1 and not e.parallel:
        raise UsageError(
            f"the {kind} drafter drafts for one sequence at a time: serve one request at a "
            "time with it"
        )
    branches = config.speculative.draft_tree
    if branches >= 2 and not e.trees:
        treed = " and ".join(n for n, d in DRAFTERS.items() if d.trees)
        raise UsageError(f"token trees of {branches} branches: the {kind} drafter drafts "
                         f"chains; {treed} and auto mode (without a head or MTP layers) "
                         "draft trees")  # fmt: skip
    if e.check is not None:
        e.check(config, target, draft)


@dataclasses.dataclass
class Drafting:
    """What a sequence drafts with: its drafter of each entry that could be made (by name:
    the draft model's follows its KV cache across generations, the lookups keep their
    indexes), and the pair's timings for auto mode (measured on first use, for normal
    (False) or deterministic (True) verification batches)."""

    drafters: dict[str, Drafter]
    timings: Callable[[bool], Timings]
    #: auto mode's tuning
    tuning: AutoTuning = AUTO_TUNING

    def get(self, name: str) -> Drafter | None:
        """The drafter of entry ``name``, or None where none could be made."""
        return self.drafters.get(name)


def make_drafters(src: Sources) -> Iterator[dict[str, Drafter]]:
    """Each sequence's drafters, by name, for ``src.n`` sequences: every entry's
    :attr:`DrafterEntry.make` that could be made from ``src``."""
    made = {name: d for name, e in DRAFTERS.items() if (d := e.make(src)) is not None}
    for i in range(src.n):
        yield {name: d[i] for name, d in made.items()}


def missing(kind: str, d: Drafting) -> str | None:
    """Why drafter ``kind`` cannot draft for ``d``: what it needs and was not loaded, in
    words; None when it can (auto mode and none always can)."""
    if kind in (AUTO, NONE) or d.get(kind) is not None:
        return None
    what = needs(kind).describe() or "what it drafts from"
    loaded = [name for name in DRAFTERS if d.get(name) is not None]
    return (f"the {kind} drafter needs {what}, and none was loaded (drafters here: "
            f"{', '.join([*loaded, AUTO, NONE])})")  # fmt: skip


def make_planner(kind: str, d: Drafting, s: DraftSettings) -> Planner:
    """The planner of one generation for drafter ``kind`` (see :func:`drafter_kinds`).

    Raises:
        UsageError: an unknown kind, or a drafter that cannot run here (what it needs was
            not loaded: :func:`missing`).
    """
    if kind == NONE:
        return FixedPlanner(None, 0)
    if kind == AUTO:
        s = dataclasses.replace(s, auto=True)
        arms = [e.arm(d.drafters[name], s, d.tuning)
                for name, e in DRAFTERS.items() if name in d.drafters]  # fmt: skip
        return AutoPlanner(d.timings(s.deterministic), arms, draft_max=s.draft_max,
                           draft_min=s.draft_min, tuning=d.tuning)  # fmt: skip
    e = entry(kind)
    if (why := missing(kind, d)) is not None:
        raise UsageError(why)
    arm = e.arm(d.drafters[kind], s, d.tuning)
    # (a head whose drafts are shorter whatever K: the shortest worth verifying is at most
    # that, as llama.cpp lowers n_min to a DFlash block)
    most = getattr(arm.drafter, "most", None)
    draft_min = min(s.draft_min, most) if most else s.draft_min
    return FixedPlanner(arm.drafter, s.draft_max, p_min=s.p_min, draft_min=draft_min,
                        tree_branches=s.trees)  # fmt: skip
