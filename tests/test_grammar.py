"""Constrained decoding in the speculative loop (speculative/grammar.py, engine/constraints.py)
on the fake backend: a hand-made constraint for the loop's mechanics, llguidance over a
small byte vocabulary for exactness with every drafter."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import pytest

from specgguf.engine.constraints import Grammars, check_grammar
from specgguf.errors import GrammarError, UsageError
from specgguf.speculative.draft import Draft, Drafter
from specgguf.speculative.drafters import NgramDrafter
from specgguf.speculative.grammar import GrammarSpec
from specgguf.speculative.loop import GenerationParams, GenerationResult, SpeculativeDecoder
from specgguf.speculative.planner import FixedPlanner
from specgguf.speculative.sampling import SamplerParams
from specgguf.speculative.verification import evaluate

from .fakes import FakeContext, FakeVocab, ScriptedDrafter, one_hot_rule

GREEDY = SamplerParams(temperature=0.0)


# --- the loop's mechanics, with a constraint made by hand ----------------------------------

V = 32
EOS = 31


class Allowed:
    """A constraint whose allowed tokens are a function of the output position:
    ``allowed(i)`` is the set at output position i; ``force`` maps a position to the tokens
    it forces from there; ``done_at``: the position after which only EOS remains."""

    def __init__(
        self,
        allowed: dict[int, set[int]],
        force: dict[int, list[int]] | None = None,
        done_at: int | None = None,
    ) -> None:
        self.allowed = allowed
        self.force = force or {}
        self.done_at = done_at
        self.pos = 0
        self.committed: list[int] = []
        self.mask_calls: list[list[int]] = []

    def _set(self, i: int) -> set[int]:
        if self.done_at is not None and i >= self.done_at:
            return {EOS}
        return self.allowed.get(i, set(range(V)))

    @property
    def done(self) -> bool:
        return self.done_at is not None and self.pos >= self.done_at

    def forced(self, limit: int) -> list[int]:
        return self.force.get(self.pos, [])[:limit]

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        for i, t in enumerate(tokens):
            if t not in self._set(self.pos + i) or t == EOS:
                return i
        return len(tokens)

    def masks(self, draft: Sequence[int]) -> npt.NDArray[np.bool_]:
        self.mask_calls.append(list(draft))
        out = np.zeros((len(draft) + 1, V), bool)
        for i in range(len(draft) + 1):
            out[i, sorted(self._set(self.pos + i))] = True
        return out

    def commit(self, tokens: Sequence[int]) -> None:
        for i, t in enumerate(tokens):
            assert t in self._set(self.pos + i), (self.pos + i, t)
        self.pos += len(tokens)
        self.committed += tokens


def walk(prefix: Sequence[int]) -> int:
    """The fake target's favourite: 1, 2, ..., 30, 1, ... after the last token (logits 10;
    the token after it 5; the rest 0)."""
    return prefix[-1] % 30 + 1


def generate(
    constraint: object | None,
    drafter: Drafter | None = None,
    k: int = 0,
    *,
    n: int = 12,
    prompt: Sequence[int] = (3,),
    sampler: SamplerParams = GREEDY,
) -> GenerationResult:
    ctx = FakeContext(one_hot_rule(walk, V), V)
    dec = SpeculativeDecoder(ctx, FakeVocab(V, eog_ids=[EOS]))
    params = GenerationParams(n_predict=n, sampler=sampler)
    planner = FixedPlanner(drafter, k)
    return dec.generate(list(prompt), params, planner, constraint).run()  # type: ignore[arg-type]


def test_the_target_chooses_among_the_allowed_tokens_only() -> None:
    # position 0: the walk wants 4 (logit 10), 5 is next best (5); 4 forbidden -> 5.
    # position 1: after 5 the walk wants 6; only {2, 9} allowed, both logit 0 -> argmax's
    # first, 2. Then free again: 3, 4, ...
    c = Allowed({0: {5, 6}, 1: {2, 9}})
    r = generate(c, n=5)
    assert r.tokens == [5, 2, 3, 4, 5] and c.committed == r.tokens


def test_a_draft_is_cut_before_the_first_forbidden_token_and_counted() -> None:
    # the drafter proposes the walk [4, 5, 6, 7]; the grammar forbids 6 at position 2
    c = Allowed({2: {1, 2, 3, 20}})
    seen: list[list[int]] = []

    def script(history: Sequence[int], k: int) -> list[int]:
        out = [(history[-1] + i) % 30 + 1 for i in range(k)]
        seen.append(out)
        return out

    r = generate(c, ScriptedDrafter(script), 4, n=4)
    # n_predict 4 leaves K = 3: the drafter proposes [4, 5, 6], the step verifies [4, 5];
    # at position 2 the walk wants 6 (logit 10) and 7 (5), both forbidden: among
    # {1, 2, 3, 20} every logit is 0 and the first, 1, is the argmax. Then the walk: 2.
    assert seen[0] == [4, 5, 6] and c.mask_calls[0] == [4, 5]
    assert r.tokens == [4, 5, 1, 2]
    assert r.stats.grammar_cut == 1 and r.stats.by_drafter["scripted"].drafted == 2


def test_forced_tokens_are_drafted_without_the_drafter() -> None:
    calls: list[int] = []

    def script(history: Sequence[int], k: int) -> list[int]:
        calls.append(len(history))
        return [walk(history)]

    # position 0 forces [9, 10, 11]: one verification of all three, the drafter not asked
    c = Allowed({0: {9}, 1: {10}, 2: {11}}, force={0: [9, 10, 11]})
    r = generate(c, ScriptedDrafter(script), 4, n=6)
    assert r.tokens[:4] == [9, 10, 11, 12]  # the bonus token after the forced ones: the walk
    assert r.stats.by_drafter["grammar"].steps == 1
    assert r.stats.by_drafter["grammar"].drafted == 3 == r.stats.by_drafter["grammar"].accepted
    assert 1 not in calls  # the drafter was first asked after the forced step (history 5)
    assert min(calls) == 5


def test_forced_tokens_are_at_most_the_step_s_draft_length() -> None:
    c = Allowed({}, force={0: [9, 10, 11, 12, 13]})
    r = generate(c, None, 0, n=3)
    # the target alone (K = 0) drafts nothing, forced tokens included; the draft length
    # clamp holds: n_predict 3 leaves K <= 2
    assert r.stats.drafted == 0 and r.tokens == [4, 5, 6]
    c = Allowed({0: {9}, 1: {10}, 2: {11}, 3: {12}}, force={0: [9, 10, 11, 12, 13]})
    r = generate(c, ScriptedDrafter(lambda h, k: []), 8, n=3)
    assert r.stats.by_drafter["grammar"].drafted == 2 and r.tokens == [9, 10, 11]


def test_a_finished_grammar_ends_the_output() -> None:
    c = Allowed({}, done_at=3)
    r = generate(c, n=10)
    # after three tokens only EOS is allowed: the target takes it (a stop)
    assert r.tokens == [4, 5, 6] and r.finish_reason == "stop"
    # with ignore_eos the loop stops at the finished grammar rather than decode garbage
    ctx = FakeContext(one_hot_rule(walk, V), V)
    dec = SpeculativeDecoder(ctx, FakeVocab(V, eog_ids=[EOS]))
    params = GenerationParams(n_predict=10, sampler=GREEDY, ignore_eos=True)
    r = dec.generate([3], params, None, Allowed({}, done_at=3)).run()  # type: ignore[arg-type]
    assert r.tokens == [4, 5, 6] and r.finish_reason == "stop"


@pytest.mark.parametrize("lazy", [0, 2])
def test_evaluate_masks_every_row_and_lazy_verification_judges_masked_rows(lazy: int) -> None:
    ctx = FakeContext(one_hot_rule(walk, V), V)
    ctx.eval([3], logits="none")
    allowed = np.ones((4, V), bool)
    allowed[1, 6] = False  # row 1 (after draft token 5) may not give 6
    logits, rows, _ = evaluate(ctx, 4, Draft([5, 7, 8]), lazy_rows=lazy, allowed=allowed)
    assert logits[1, 6] == -np.inf and logits[1].argmax() == 7
    # the masked argmax accepts 7 at row 1: a lazy verification goes on past it
    assert rows == 4 and logits[2].argmax() == 8


# --- llguidance over a byte vocabulary: exactness with every drafter -----------------------

#: single bytes for the printable ASCII range, a few merges, and an end of generation
PIECES = [bytes([c]) for c in range(32, 127)] + [b'{"', b'":', b'", "', b"true", b"123"]
BYTE_EOS = len(PIECES)
BYTES_V = BYTE_EOS + 1


def greedy_tokenize(text: bytes) -> list[int]:
    out, i = [], 0
    while i < len(text):
        best = max((j for j, p in enumerate(PIECES) if text.startswith(p, i)),
                   key=lambda j: len(PIECES[j]))  # fmt: skip
        out.append(best)
        i += len(PIECES[best])
    return out


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars([*PIECES, b"</s>"], [BYTE_EOS], [BYTE_EOS], greedy_tokenize)


def byte_target(prefix: Sequence[int]) -> npt.NDArray[np.float32]:
    """A target that likes a few letters, digits and quotes in a cycle driven by the
    prefix, with distinct integer logits for every token (no ties)."""
    row = ((np.arange(BYTES_V) * 7 + sum(prefix) * 13) % BYTES_V / 10).astype(np.float32)
    row[BYTE_EOS] = 20.0 if len(prefix) > 40 else -50.0
    return row


def byte_generate(
    grammars: Grammars,
    spec: GrammarSpec,
    drafter: Drafter | None,
    k: int,
    *,
    sampler: SamplerParams = GREEDY,
    n: int = 60,
) -> GenerationResult:
    ctx = FakeContext(byte_target, BYTES_V)
    dec = SpeculativeDecoder(ctx, FakeVocab(BYTES_V, [BYTE_EOS], dict(enumerate(PIECES))))
    params = GenerationParams(n_predict=n, sampler=sampler)
    return dec.generate([1, 2], params, FixedPlanner(drafter, k), grammars.constraint(spec)).run()


SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green"]},
    },
    "required": ["id", "ok", "tag"],
    "additionalProperties": False,
}
SPECS = [
    GrammarSpec("json_schema", json.dumps(SCHEMA)),
    GrammarSpec("regex", r"[a-e]{3}-[0-9]{2,4}!"),
    GrammarSpec("gbnf", 'root ::= "x" [a-c]+ ("." [0-9])? "y"'),
]


def wrong_then_right(history: Sequence[int], k: int) -> list[int]:
    """A drafter that proposes printable bytes whatever the grammar says."""
    return [(sum(history) + i * 5) % 95 for i in range(k)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_greedy_output_under_a_grammar_is_the_constrained_target_s_with_every_drafter(
    grammars: Grammars, spec: GrammarSpec
) -> None:
    alone = byte_generate(grammars, spec, None, 0)
    text = b"".join(PIECES[t] for t in alone.tokens).decode()
    if spec.kind == "json_schema":
        doc = json.loads(text)
        assert set(doc) == {"id", "ok", "tag"} and doc["tag"] in ("red", "green")
    elif spec.kind == "regex":
        assert re.fullmatch(r"[a-e]{3}-[0-9]{2,4}!", text), text
    else:
        assert re.fullmatch(r"x[a-c]+(\.[0-9])?y", text), text
    assert alone.finish_reason == "stop"
    # an oracle drafter (the constrained target's own tokens), a drafter of noise, n-grams
    oracle = ScriptedDrafter(lambda h, k: alone.tokens[len(h) - 2 :][:k])
    for drafter in (oracle, ScriptedDrafter(wrong_then_right), NgramDrafter()):
        for k in (1, 3, 8):
            r = byte_generate(grammars, spec, drafter, k)
            assert r.tokens == alone.tokens, (drafter, k)
    # the forced tokens were drafted, the noise cut
    r = byte_generate(grammars, spec, ScriptedDrafter(wrong_then_right), 8)
    forced = r.stats.by_drafter["grammar"]
    assert forced.accepted == forced.drafted > 0
    if spec.kind == "json_schema":
        # keys, separators, the enum once begun, false after "f": 28 of 32 tokens forced
        assert forced.accepted >= len(alone.tokens) // 2 and r.stats.steps < 8
    else:
        assert r.stats.grammar_cut > 0


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_seeded_sampling_under_a_grammar_repeats_whatever_the_drafter(
    grammars: Grammars, spec: GrammarSpec
) -> None:
    sampler = SamplerParams(temperature=1.0, seed=11)
    alone = byte_generate(grammars, spec, None, 0, sampler=sampler)
    for drafter in (ScriptedDrafter(wrong_then_right), NgramDrafter()):
        r = byte_generate(grammars, spec, drafter, 4, sampler=sampler)
        assert r.tokens == alone.tokens
    other = byte_generate(grammars, spec, None, 0, sampler=SamplerParams(temperature=1.0, seed=12))
    texts = {bytes(alone.tokens), bytes(other.tokens)}
    assert len(texts) == 2 or spec.kind == "gbnf"  # the seed matters (where there is choice)


def test_unseeded_sampling_under_a_grammar_follows_the_constrained_distribution(
    grammars: Grammars,
) -> None:
    # regex "[ab]": the target's logits for a and b decide; with drafts (point masses,
    # cut or not) the frequencies stay the constrained target's
    spec = GrammarSpec("regex", "[ab]")
    a, b = PIECES.index(b"a"), PIECES.index(b"b")
    row = byte_target([1, 2])
    p_a = 1.0 / (1.0 + np.exp(row[b] - row[a]))
    rng_counts = {True: 0, False: 0}
    n = 2000
    for i in range(n):
        sampler = SamplerParams(temperature=1.0, seed=None)
        drafter = ScriptedDrafter(lambda h, k: [a] * k) if i % 2 else None
        r = byte_generate(grammars, spec, drafter, 2, sampler=sampler, n=2)
        rng_counts[r.tokens[0] == a] += 1
    freq = rng_counts[True] / n
    assert abs(freq - p_a) < 4 * np.sqrt(p_a * (1 - p_a) / n), (freq, p_a)


# --- compiling: errors named before any token ----------------------------------------------


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (GrammarSpec("json_schema", "{not json"), "not valid JSON"),
        (GrammarSpec("json_schema", "[1, 2]"), "is an object"),
        (GrammarSpec("json_schema", json.dumps({"$ref": "#/nowhere"})), "nowhere"),
        (GrammarSpec("json_schema", json.dumps({"type": "string", "format": "nope"})), "nope"),
        (GrammarSpec("regex", "[0-9"), "regular expression"),
        (GrammarSpec("gbnf", "root ::= missing"), "GBNF"),
        (GrammarSpec("gbnf", 'root ::= "a" |||| ('), "GBNF"),
        (GrammarSpec("lark", "start: nothing_here"), "Lark"),
        (GrammarSpec("xml", "<a/>"), "unknown kind"),  # type: ignore[arg-type]
    ],
)
def test_a_constraint_that_cannot_be_used_is_a_usage_error_naming_it(
    grammars: Grammars, spec: GrammarSpec, words: str
) -> None:
    with pytest.raises(GrammarError) as e:
        check_grammar(spec)
    assert words in str(e.value) and isinstance(e.value, UsageError)
    assert "\n" not in str(e.value)
    with pytest.raises(GrammarError):
        grammars.compile(spec)


def test_compiled_grammars_are_cached_and_bounded(grammars: Grammars) -> None:
    from specgguf.engine import constraints

    spec = GrammarSpec("regex", "[a-c]+")
    assert grammars.compile(spec) is grammars.compile(spec)
    for i in range(constraints.CACHE_SIZE + 3):
        grammars.compile(GrammarSpec("regex", f"x{{{i + 1}}}"))
    assert len(grammars._compiled) == constraints.CACHE_SIZE and spec not in grammars._compiled
