"""Prompt reuse across generations: the loop keeps what the target's cache shares with the
next prompt, the drafters extend what they built, slots are chosen by shared prefix, and
saved prompts come back from host memory, disk and files. Here on a fake backend with
exact integer logits and on saved states made by hand; on llama.cpp in
tests/test_prompt_reuse_models.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from specgguf.engine.prompt_cache import (
    PromptCache,
    PromptCacheFileError,
    identity,
    read_file,
    write_file,
)
from specgguf.engine.slots import SavedPrompt, best_slot, common_prefix
from specgguf.llama.backend import Checkpoint, SequenceState
from specgguf.speculative.costmodel import Timings
from specgguf.speculative.drafters import ModelDrafter, NgramDrafter, SuffixDrafter
from specgguf.speculative.loop import GenerationParams, SpeculativeDecoder
from specgguf.speculative.planner import FixedPlanner
from specgguf.speculative.sampling import SamplerParams

from .fakes import FakeContext, FakeVocab, auto_planner

V = 32
EOS = 31
GREEDY = SamplerParams(temperature=0.0)


def walk(prefix: Sequence[int]) -> int:
    """The fake target's next token: a function of the last three tokens and the length,
    so that a cache holding other tokens than the text gives other logits."""
    return (prefix[-1] * 7 + sum(prefix[-3:]) + len(prefix)) % 29 + 1


def rule(prefix: Sequence[int]) -> np.ndarray:
    row = np.zeros(V, np.float32)
    row[walk(prefix)] = 10
    return row


def decoder(n_ctx: int = 512) -> tuple[SpeculativeDecoder, FakeContext]:
    ctx = FakeContext(rule, V, n_ctx=n_ctx, n_batch=64)
    return SpeculativeDecoder(ctx, FakeVocab(V, eog_ids=[EOS])), ctx  # type: ignore[arg-type]


def truth(prompt: Sequence[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(walk(seq))
    return seq[len(prompt) :]


def generate(dec: SpeculativeDecoder, prompt: list[int], n: int = 12, **kw: object):  # type: ignore[no-untyped-def]
    params = GenerationParams(n_predict=n, sampler=GREEDY, **kw)  # type: ignore[arg-type]
    return dec.generate(prompt, params, FixedPlanner(None, 0)).run()


def evaluated(ctx: FakeContext) -> list[int]:
    """Every token the fake target evaluated since its log was cleared, in order."""
    return [t for entry in ctx.log if entry[0] == "eval" for t in entry[2]]  # type: ignore[union-attr]


PROMPT = [3, 5, 7, 9, 11, 13, 2, 4, 6, 8]


def test_a_next_turn_reads_only_what_its_prompt_adds() -> None:
    dec, ctx = decoder()
    first = generate(dec, PROMPT, n=12)
    assert first.tokens == truth(PROMPT, 12)
    assert first.stats.prompt_cached == 0 and first.stats.prompt_read == len(PROMPT)
    # a conversation's next request: everything before, the answer, and a new message
    turn = [*PROMPT, *first.tokens, 20, 21, 22]
    ctx.log.clear()
    second = generate(dec, turn, n=12)
    assert second.tokens == truth(turn, 12)
    # The answer's last token came from the last step's own logits (n_predict), never
    # evaluated: it is read with the new message, whose last token opens the first step.
    held = len(PROMPT) + len(first.tokens) - 1
    assert second.stats.prompt_cached == held
    assert second.stats.prompt_read == len(turn) - held
    assert evaluated(ctx)[: len(turn) - held] == turn[held:]


def test_the_cache_keeps_every_token_a_finished_output_evaluated() -> None:
    """An output that ends with an end-of-generation token has all its tokens evaluated
    (the end was the target's pick after the last): the next prompt reuses them all."""
    dec, ctx = decoder()
    prompt = [1, 2, 3]
    out = truth(prompt, 40)
    eos_at = 6
    ctx.rule = lambda p: rule(p) if len(p) != len(prompt) + eos_at else _eos_row()  # type: ignore[method-assign]
    first = generate(dec, prompt, n=40)
    assert first.finish_reason == "stop" and first.tokens == out[:eos_at]
    ctx.rule = rule  # type: ignore[method-assign]
    turn = [*prompt, *first.tokens, EOS, 9, 9]
    second = generate(dec, turn, n=4)
    assert second.stats.prompt_cached == len(prompt) + eos_at
    assert second.tokens == truth(turn, 4)


def _eos_row() -> np.ndarray:
    row = np.zeros(V, np.float32)
    row[EOS] = 10
    return row


@pytest.mark.parametrize("at", [0, 1, 5, 9, 10, 30])
def test_a_prompt_that_differs_at_p_reuses_exactly_p_tokens(at: int) -> None:
    """The cache holds PROMPT and its output; a prompt equal to that text up to ``at``
    reuses ``at`` tokens (never its own last one, which opens the first step), and its
    output is the target alone's."""
    dec, _ctx = decoder()
    first = generate(dec, PROMPT, n=30)
    text = [*PROMPT, *first.tokens]
    prompt = [*text[:at], (text[at] % 29) + 2, 17, 18] if at < len(text) else [*text, 17]
    assert prompt[:at] == text[:at] and (at >= len(text) or prompt[at] != text[at])
    second = generate(dec, prompt, n=8)
    held = len(text) - 1  # the output's last token was never evaluated
    assert second.stats.prompt_cached == min(at, held, len(prompt) - 1)
    assert second.tokens == truth(prompt, 8)


def test_the_prompt_itself_again_reuses_all_but_its_last_token() -> None:
    dec, _ctx = decoder()
    generate(dec, PROMPT, n=5)
    again = generate(dec, PROMPT, n=5)
    assert again.stats.prompt_cached == len(PROMPT) - 1 and again.stats.prompt_read == 1
    assert again.tokens == truth(PROMPT, 5)


def test_cache_prompt_false_reads_the_whole_prompt() -> None:
    dec, ctx = decoder()
    first = generate(dec, PROMPT, n=6)
    turn = [*PROMPT, *first.tokens, 20]
    ctx.log.clear()
    second = generate(dec, turn, n=6, cache_prompt=False)
    assert second.stats.prompt_cached == 0
    assert evaluated(ctx)[: len(turn) - 1] == turn[:-1]
    assert second.tokens == truth(turn, 6)


def test_a_drafter_bound_limits_what_the_target_keeps() -> None:
    """A drafter whose next row reads the target's state before its own (the MTP layers)
    bounds the prefix kept (``Drafter.reuse_limit``)."""

    class Bounded(NgramDrafter):
        def reuse_limit(self, history: Sequence[int]) -> int | None:
            return 4

    dec, _ctx = decoder()
    first = generate(dec, PROMPT, n=6)
    turn = [*PROMPT, *first.tokens, 20]
    params = GenerationParams(n_predict=6, sampler=GREEDY)
    second = dec.generate(turn, params, FixedPlanner(Bounded(), 3)).run()
    assert second.stats.prompt_cached == 4
    assert second.tokens == truth(turn, 6)


# -- the drafters extend what they built ------------------------------------------------


def test_ngram_index_is_extended_by_a_text_that_extends_it_and_rebuilt_otherwise() -> None:
    a = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 6]
    b = [*a, 1, 2, 3, 1, 9, 1, 2]
    kept = NgramDrafter(1, 3)
    kept.propose(a, 4, GREEDY, np.random.default_rng(0))
    index = kept._index
    kept.reset()
    got = kept.propose(b, 4, GREEDY, np.random.default_rng(0))
    fresh = NgramDrafter(1, 3)
    want = fresh.propose(b, 4, GREEDY, np.random.default_rng(0))
    assert kept._index is index  # extended, not rebuilt
    assert (got.tokens, got.probs, got.match) == (want.tokens, want.probs, want.match)
    assert kept.index_tables() == fresh.index_tables()
    # another text: rebuilt, as a fresh drafter's
    c = [7, 8, 7, 8, 7]
    kept.reset()
    got = kept.propose(c, 4, GREEDY, np.random.default_rng(0))
    fresh = NgramDrafter(1, 3)
    want = fresh.propose(c, 4, GREEDY, np.random.default_rng(0))
    assert kept._index is not index
    assert (got.tokens, got.probs) == (want.tokens, want.probs)
    assert kept.index_tables() == fresh.index_tables()


def test_suffix_corpus_goes_on_with_a_generation_that_extends_the_last() -> None:
    rng = np.random.default_rng(0)
    d = SuffixDrafter()
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    d.propose(a, 4, GREEDY, rng)
    d.finish([*a, 9, 10])
    d.reset()  # the next generation's planner resets it again
    b = [*a, 9, 10, 11, 1, 2, 3]
    draft = d.propose(b, 3, GREEDY, rng)
    assert draft.tokens == [4, 5, 6]  # the earlier occurrence in the same text
    assert d._corpus == b  # the conversation once, not twice
    d.finish([*b, 4])
    d.reset()
    other = [50, 51, 52]
    d.propose(other, 3, GREEDY, rng)  # another text: appended after a separator
    assert d._corpus == [*b, 4, SuffixDrafter.SEPARATOR, *other]


def test_suffix_corpus_starts_a_new_text_where_a_peer_added_one_between() -> None:
    rng = np.random.default_rng(0)
    d, peer = SuffixDrafter.group(2)
    a = [1, 2, 3, 4, 5]
    d.finish(a)
    peer.finish([40, 41, 42])
    d.reset()  # takes the peer's text in after its own: the text is not at the end
    b = [*a, 6, 7]
    d.propose(b, 2, GREEDY, rng)
    sep = SuffixDrafter.SEPARATOR
    assert d._corpus == [*a, sep, 40, 41, 42, sep, *b]


def test_suffix_group_is_sent_only_what_a_going_on_generation_added() -> None:
    rng = np.random.default_rng(0)
    d, peer = SuffixDrafter.group(2)
    a = [1, 2, 3, 4, 5]
    d.finish(a)
    d.reset()
    b = [*a, 6, 7]
    d.propose(b, 2, GREEDY, rng)
    assert d._corpus == b  # went on
    d.finish([*b, 8])
    peer.reset()
    sep = SuffixDrafter.SEPARATOR
    assert peer._corpus == [*a, sep, 6, 7, 8, sep]


def test_a_draft_model_under_auto_mode_reads_the_prompt_only_when_it_drafts() -> None:
    """Deferred: a generation in which auto mode never drafts with the model never reads
    the prompt with it; its offers weigh the prompt as read (the same as before)."""
    draft_ctx = FakeContext(rule, V, n_ctx=512, n_batch=64)
    model = ModelDrafter(draft_ctx, V)  # type: ignore[arg-type]
    # a draft token costs as much as a target step: the model cannot pay, never drafts
    slow = Timings({1: 0.01, 2: 0.02, 4: 0.04, 8: 0.08, 16: 0.16}, 0.01)
    dec, _ctx = decoder()
    planner = auto_planner(slow, model=model)
    dec.generate(PROMPT, GenerationParams(n_predict=8, sampler=GREEDY), planner).run()
    assert not [e for e in draft_ctx.log if e[0] == "eval"]
    # where it pays, it reads the prompt at its first draft
    fast = Timings({1: 0.01, 2: 0.0101, 4: 0.0102, 8: 0.0104, 16: 0.011}, 0.0001)
    planner = auto_planner(fast, model=model)
    planner.reset()
    planner.prefill(PROMPT)
    assert model.cached_tokens(PROMPT) == len(PROMPT) - 1  # weighed as read
    assert not [e for e in draft_ctx.log if e[0] == "eval"]
    model.propose(PROMPT, 2, GREEDY, np.random.default_rng(0))
    read = [t for e in draft_ctx.log if e[0] == "eval" for t in e[2]]  # type: ignore[union-attr]
    assert read[: len(PROMPT)] == PROMPT


# -- slots ------------------------------------------------------------------------------


@dataclasses.dataclass
class _Slot:
    held: list[int]
    last_used: float
    #: positions from which it holds an image (its tokens are placeholders: 0)
    image_at: int | None = None

    @property
    def holds_media(self) -> bool:
        return self.image_at is not None

    @property
    def media_end(self) -> int:
        return 0 if self.image_at is None else self.image_at + 4  # (4 rows)

    def cached_prefix(self, tokens: Sequence[int], media: Sequence[object] = ()) -> int:
        n = common_prefix(np.asarray(self.held, np.int32), tokens)
        if self.image_at is not None and media != ["same image"]:
            n = min(n, self.image_at)  # (another image, or none, at its position)
        return n


def test_a_slot_holding_an_image_is_not_given_to_a_prompt_that_drops_it() -> None:
    # Two conversations, each with an image after a shared template prefix (1, 2): the
    # second goes to a slot of its own, not over the first's image (which the prompt cache
    # does not keep), even by a prefix above the similarity; its own image's next turn
    # goes back to it.
    image_a = _Slot([1, 2, 0, 0, 0, 0, 5], 3.0, image_at=2)
    slots = [image_a, _Slot([], 0.0), _Slot([9], 1.0)]
    other = [1, 2, 0, 0, 0, 0, 6]
    assert best_slot(slots, [0, 1, 2], other, 0.1, ["other image"]) == 1  # type: ignore[arg-type]
    assert best_slot(slots, [0, 2], other, 0.1, ["other image"]) == 2  # type: ignore[arg-type]
    # by age, a slot holding images comes last
    older = [_Slot([1, 2, 0, 0], 0.5, image_at=2), _Slot([9], 1.0)]
    assert best_slot(older, [0, 1], [7], 0.1) == 1  # type: ignore[arg-type]
    assert best_slot(slots, [0], other, 0.1, ["other image"]) == 0  # type: ignore[arg-type]
    again = [1, 2, 0, 0, 0, 0, 5, 8]
    assert best_slot(slots, [0, 1, 2], again, 0.1, ["same image"]) == 0  # type: ignore[arg-type]
    # a later turn of its conversation takes it, however little of the rest it keeps
    image_a.held += [10, 11, 12, 13, 14, 15, 16, 17]
    later = [*again[:7], 99]
    assert best_slot(slots, [0, 1, 2], later, 0.1, ["same image"]) == 0  # type: ignore[arg-type]


def test_a_prompt_goes_to_the_slot_sharing_most_of_it_else_the_least_recently_used() -> None:
    slots = [_Slot([1, 2, 3], 5.0), _Slot([1, 2, 3, 4, 5], 1.0), _Slot([], 0.0), _Slot([9], 2.0)]
    prompt = [1, 2, 3, 4, 5, 6]
    assert best_slot(slots, [0, 1, 2, 3], prompt, 0.1) == 1  # type: ignore[arg-type]
    assert best_slot(slots, [0, 2, 3], prompt, 0.1) == 0  # type: ignore[arg-type]
    # ties on the prefix: the least recently used
    slots[0].held = [1, 2, 3, 4, 5]
    assert best_slot(slots, [0, 1], prompt, 0.1) == 1  # type: ignore[arg-type]
    # a prefix of no more than the similarity: the least recently used, then the lowest
    assert best_slot(slots, [0, 1, 2, 3], [7, 7, 7], 0.1) == 2  # type: ignore[arg-type]
    assert best_slot(slots, [0, 1, 3], [1, 7, 7, 7, 7, 7, 7, 7, 7, 7], 0.1) == 1  # type: ignore[arg-type]
    assert best_slot(slots, [0, 1, 2], prompt, 0.0) == 2  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        best_slot(slots, [], prompt, 0.1)  # type: ignore[arg-type]


# -- saved prompts ----------------------------------------------------------------------


def saved(tokens: Sequence[int], size: int = 100, checkpoints: int = 0) -> SavedPrompt:
    t = np.asarray(tokens, np.int32)
    cps = tuple(Checkpoint(i + 1, bytes([i]) * 7) for i in range(checkpoints))
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    return SavedPrompt(SequenceState(t, data, cps, exact=len(t) // 2))


def test_the_cache_finds_the_longest_shared_prefix_and_gives_the_entry_back_once() -> None:
    cache = PromptCache(10_000)
    a, b = saved([1, 2, 3, 4, 5, 6, 7, 8]), saved([1, 2, 9, 9, 9, 9, 9, 9])
    assert cache.put(a) and cache.put(b) and len(cache) == 2
    entry, n = cache.best([1, 2, 3, 4, 5, 0])
    assert entry is a and n == 5
    # at least a quarter of the entry's tokens must be shared (KEEP_MIN)
    assert cache.best([1, 0]) == (None, 0)
    assert cache.take(entry) is a and len(cache) == 1 and cache.restores == 1
    assert cache.best([1, 2, 3, 4, 5, 0])[0] is b


def test_entries_held_whole_by_others_are_dropped_and_never_kept() -> None:
    cache = PromptCache(10_000)
    short, long = saved([1, 2, 3, 4]), saved([1, 2, 3, 4, 5, 6])
    assert cache.put(short)
    assert cache.put(long) and len(cache) == 1  # the shorter one is held whole
    assert not cache.put(saved([1, 2, 3]))  # held whole by the longer one
    assert cache.best([1, 2, 3, 4, 5, 6, 7]) == (long, 6)


def test_the_least_recently_used_go_first_within_the_limit() -> None:
    cache = PromptCache(1000)
    entries = [saved([i, i, i, i], size=300) for i in range(1, 5)]
    for e in entries:
        cache.put(e)
    assert len(cache) == 3 and cache.nbytes <= 1000
    assert cache.best([1, 1, 1, 1])[0] is None  # the oldest went
    assert cache.best([4, 4, 4, 4])[0] is entries[3]
    assert not cache.put(saved([9, 9], size=5000))  # larger than the whole cache


def test_evicted_entries_go_to_disk_and_are_found_after_a_restart(tmp_path: Path) -> None:
    ident = identity(target={"name": "t.gguf", "size": 1, "hash": "x"})
    cache = PromptCache(1000, ident=ident, disk=tmp_path, disk_limit=10_000)
    first = saved([1, 2, 3, 4], size=600, checkpoints=2)
    cache.put(first)
    cache.put(saved([5, 6, 7, 8], size=600))  # the first goes to disk
    assert cache.files_written == 1 and len(list(tmp_path.glob("*.sgpc"))) == 1
    again = PromptCache(1000, ident=ident, disk=tmp_path, disk_limit=10_000)
    entry, n = again.best([1, 2, 3, 4, 9])
    assert n == 4
    back = again.take(entry)  # type: ignore[arg-type]
    assert back.target.data == first.target.data and back.target.exact == first.target.exact
    assert back.target.checkpoints == first.target.checkpoints
    assert list(back.tokens) == [1, 2, 3, 4]
    # another setup's files are left alone, never found
    other = PromptCache(1000, ident=identity(target={"name": "u"}), disk=tmp_path,
                        disk_limit=10_000)  # fmt: skip
    assert other.best([1, 2, 3, 4, 9]) == (None, 0)
    assert len(list(tmp_path.glob("*.sgpc"))) == 1


def test_a_file_of_other_settings_names_what_differs_only() -> None:
    from specgguf.engine.prompt_cache import _difference

    ours = {"target_context": {"n_ctx": 512, "type_k": "f16", "n_batch": 512}}
    theirs = {"target_context": {"n_ctx": 1024, "type_k": "f16", "n_batch": 512}}
    assert _difference(theirs, ours) == "another target context (n_ctx 1024, here 512)"


def test_a_flush_writes_what_memory_holds_the_newest_kept_where_the_disk_is_full(
    tmp_path: Path,
) -> None:
    cache = PromptCache(10_000, ident=identity(), disk=tmp_path, disk_limit=3000)
    for i in (1, 2, 3):
        cache.put(saved([i] * 4, size=1000))
    assert cache.files_written == 0 and cache.flush() == 3
    again = PromptCache(0, ident=identity(), disk=tmp_path, disk_limit=3000)
    assert [again.best([i] * 4)[1] for i in (1, 2, 3)] == [0, 4, 4]
    assert PromptCache(10_000).flush() == 0  # no folder: nothing


def test_the_disk_keeps_within_its_limit(tmp_path: Path) -> None:
    cache = PromptCache(0, ident=identity(), disk=tmp_path, disk_limit=3000)
    for i in range(1, 6):
        cache.put(saved([i] * 4, size=1000))
    sizes = sum(p.stat().st_size for p in tmp_path.glob("*.sgpc"))
    assert sizes <= 3000 and cache.disk_bytes == sizes
    assert cache.best([5] * 4)[1] == 4 and cache.best([1] * 4) == (None, 0)


def test_a_prompt_file_round_trips_and_refuses_what_is_not_its_own(tmp_path: Path) -> None:
    ident = identity(target={"name": "t.gguf", "size": 10, "hash": "ab"}, n_ctx=512)
    draft = SequenceState(np.asarray([1, 2], np.int32), b"draft-state", (), 0)
    s = dataclasses.replace(saved([1, 2, 3], size=50, checkpoints=1), draft=draft,
                            draft_offset=3)  # fmt: skip
    path = tmp_path / "p.cache"
    write_file(path, s, ident)
    back = read_file(path, ident)
    assert list(back.tokens) == [1, 2, 3] and back.target.data == s.target.data
    assert back.draft is not None and back.draft.data == b"draft-state"
    assert back.draft_offset == 3 and list(back.draft.tokens) == [1, 2]
    # another model
    with pytest.raises(PromptCacheFileError, match=r"another target model \(the file's: t.gguf\)"):
        read_file(path, identity(target={"name": "u.gguf", "size": 10, "hash": "cd"}, n_ctx=512))
    with pytest.raises(PromptCacheFileError, match="another n ctx"):
        read_file(path, {**ident, "n_ctx": 1024})
    # cut short, damaged, not ours
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(PromptCacheFileError, match="cut short"):
        read_file(path, ident)
    path.write_bytes(data[:-10] + b"0123456789")
    with pytest.raises(PromptCacheFileError, match="checksum"):
        read_file(path, ident)
    path.write_bytes(b"GGUF" + data[4:])
    with pytest.raises(PromptCacheFileError, match="not a specgguf prompt-cache file"):
        read_file(path, ident)
    path.write_bytes(data[:30])
    with pytest.raises(PromptCacheFileError, match="damaged or cut short"):
        read_file(path, ident)


def test_entries_are_told_apart_by_identity_not_by_their_arrays() -> None:
    """Two entries of different lengths: taking one never compares their token arrays
    element-wise (which numpy refuses for arrays of other shapes)."""
    cache = PromptCache(10_000)
    a, b = saved([1, 2, 3, 4, 5, 6]), saved([7, 8, 9])
    cache.put(a)
    cache.put(b)
    assert cache.take(b) is b and cache.take(a) is a and len(cache) == 0


def test_a_prompt_read_at_the_first_draft_counts_as_prompt_time() -> None:
    """Deferred or not, reading the prompt is prompt processing: tokens/s leaves it out."""
    import time

    class Slow(FakeContext):
        def eval(self, tokens, *, logits="last"):  # type: ignore[no-untyped-def]
            if logits == "none":
                time.sleep(0.004 * len(tokens))
            return super().eval(tokens, logits=logits)

    draft_ctx = Slow(rule, V, n_ctx=512, n_batch=64)
    model = ModelDrafter(draft_ctx, V)  # type: ignore[arg-type]
    fast = Timings({1: 0.01, 2: 0.0101, 4: 0.0102, 8: 0.0104, 16: 0.011}, 0.0001)
    dec, _ = decoder()
    prompt = [(i * 7) % 29 + 1 for i in range(60)]
    planner = auto_planner(fast, model=model, learn_timings=False)
    res = dec.generate(prompt, GenerationParams(n_predict=8, sampler=GREEDY), planner).run()
    assert res.stats.by_drafter["model"].steps > 0  # it drafted, and read the prompt then
    assert res.stats.prompt_seconds >= 0.004 * (len(prompt) - 2)
    assert res.stats.draft_seconds < 0.004 * (len(prompt) - 2)


def test_a_file_whose_header_was_changed_is_refused(tmp_path: Path) -> None:
    """The checksum covers the header's fields too: a checkpoint's position changed in
    place (the file's length kept) is refused, never restored at a wrong position."""
    ident = identity(target={"name": "t.gguf"})
    path = tmp_path / "p.cache"
    write_file(path, saved([1, 2, 3, 4, 5], size=40, checkpoints=2), ident)
    data = path.read_bytes()
    assert b'"checkpoints": [1, 2]' in data
    path.write_bytes(data.replace(b'"checkpoints": [1, 2]', b'"checkpoints": [1, 4]'))
    with pytest.raises(PromptCacheFileError, match="checksum"):
        read_file(path, ident)


def test_a_damaged_file_is_deleted_when_it_is_found_out(tmp_path: Path) -> None:
    ident = identity(target={"name": "t.gguf"})
    cache = PromptCache(0, ident=ident, disk=tmp_path, disk_limit=10_000)
    cache.put(saved([1, 2, 3, 4], size=100))
    (path,) = tmp_path.glob("*.sgpc")
    path.write_bytes(path.read_bytes()[:-5] + b"XXXXX")
    entry, n = cache.best([1, 2, 3, 4, 5])
    assert n == 4
    with pytest.raises(PromptCacheFileError):
        cache.take(entry)  # type: ignore[arg-type]
    assert not path.exists() and len(cache) == 0


def test_an_entry_larger_than_memory_and_disk_is_not_counted_as_kept(tmp_path: Path) -> None:
    cache = PromptCache(100, ident=identity(), disk=tmp_path, disk_limit=2000)
    assert not cache.has_room(3000) and cache.has_room(400) and cache.has_room(50)
    assert not cache.put(saved([1, 2], size=3000)) and cache.saves == 0
    assert cache.put(saved([3, 4], size=300)) and cache.saves == 1  # to disk
    assert cache.files_written == 1 and len(cache) == 1


def test_the_prompt_caches_entries_are_matched_by_their_media_too() -> None:
    """An image's rows hold placeholder tokens, the same whatever the image: an entry is
    shared up to the first medium it and the prompt do not share, and a prompt with
    another image at the same rows does not hold an entry whole."""
    from specgguf.llama.backend import MediaSpan

    tokens = np.array([1, 2, 3, 0, 0, 0, 0, 5, 6, 7, 8], np.int32)
    cat = MediaSpan(3, np.zeros((4, 8), np.float32), b"cat")
    dog = dataclasses.replace(cat, key=b"dog")
    cache = PromptCache(1 << 20)
    assert cache.put(SavedPrompt(SequenceState(tokens, b"x" * 10, media=(cat,))))
    longer = [*tokens.tolist(), 9]
    assert cache.best(longer, [cat])[1] == 11
    assert cache.best(longer, [dog])[1] == 3  # (up to the other image)
    assert cache.best(longer, [])[1] == 3  # (text where it holds an image)
    # another image at the same rows: a prompt of its own, kept beside the first
    assert cache.put(SavedPrompt(SequenceState(tokens, b"y" * 10, media=(dog,))))
    assert len(cache) == 2
    # the image's rows are counted in its size
    assert cache.nbytes == 2 * (10 + tokens.nbytes + cat.embd.nbytes)
