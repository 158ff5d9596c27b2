"""Faults of grammars with speculation found in review (issue 33), each reproduced with
its right value: ignore_eos with a grammar that ends inside a step, SentencePiece
vocabularies that add a space before the first word, llguidance's messages on one line, a
schema that allows no output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specgguf.engine.constraints import Grammars, check_grammar
from specgguf.errors import GrammarError
from specgguf.speculative.grammar import GrammarSpec
from specgguf.speculative.loop import GenerationParams, SpeculativeDecoder
from specgguf.speculative.planner import FixedPlanner
from specgguf.speculative.sampling import SamplerParams

from .fakes import FakeContext, FakeVocab, ScriptedDrafter, one_hot_rule
from .helpers import run_cli
from .test_grammar import (
    BYTE_EOS,
    BYTES_V,
    EOS,
    GREEDY,
    PIECES,
    Allowed,
    V,
    byte_target,
    greedy_tokenize,
    walk,
)


def _walk_drafter() -> ScriptedDrafter:
    return ScriptedDrafter(lambda h, k: [(h[-1] + i) % 30 + 1 for i in range(k)])


# --- Defect 1: ignore_eos + a grammar that completes inside a step ---------------------------
# loop.py `_run`: `grammar.done` is only checked before a step. When the grammar completes
# inside a step (forced tokens or a draft reaching the end), the row after the last draft
# token allows only EOG (grammar mask) and `banned` (ignore_eos) removes those too: every
# logit is -inf. Greedy then takes argmax = token 0 and `Constraint.commit` raises
# AssertionError ("a committed token outside the grammar"); sampling raises ValueError
# ("no finite logit to sample from"). Real pair: `specgguf run -m qwen1.5b -md qwen0.5b
# --ignore-eos --grammar 'root ::= "yes"' "Say yes"` -> "internal error", exit 1; server:
# 500. Expected: the output ends at the grammar's end (finish "stop"), as it does with the
# target alone.


def test_ignore_eos_with_a_grammar_finished_inside_a_draft_greedy() -> None:
    ctx = FakeContext(one_hot_rule(walk, V), V)
    dec = SpeculativeDecoder(ctx, FakeVocab(V, eog_ids=[EOS]))
    params = GenerationParams(n_predict=10, sampler=GREEDY, ignore_eos=True)
    c = Allowed({}, done_at=3)
    r = dec.generate([3], params, FixedPlanner(_walk_drafter(), 4), c).run()  # type: ignore[arg-type]
    assert r.tokens == [4, 5, 6] and r.finish_reason == "stop"


@pytest.mark.parametrize(
    "sampler",
    [GREEDY, SamplerParams(temperature=1.0, seed=7), SamplerParams(temperature=1.0, seed=None)],
    ids=["greedy", "seeded", "unseeded"],
)
def test_ignore_eos_with_llguidance_grammar_finished_by_forced_tokens(
    sampler: SamplerParams,
) -> None:
    grammars = Grammars([*PIECES, b"</s>"], [BYTE_EOS], [BYTE_EOS], greedy_tokenize)
    ctx = FakeContext(byte_target, BYTES_V)
    dec = SpeculativeDecoder(ctx, FakeVocab(BYTES_V, [BYTE_EOS], dict(enumerate(PIECES))))
    params = GenerationParams(n_predict=20, sampler=sampler, ignore_eos=True)
    constraint = grammars.constraint(GrammarSpec("regex", "abc"))  # all forced
    r = dec.generate([1, 2], params, FixedPlanner(_walk_drafter(), 4), constraint).run()
    assert b"".join(PIECES[t] for t in r.tokens) == b"abc" and r.finish_reason == "stop"


# --- Defect 2: SPM vocabularies (add_space_prefix) crash under any grammar -------------------
# engine.py `_new_grammars` gives llguidance `model.tokenize(text, add_special=False)`, which
# for an SPM vocabulary with add_space_prefix (Llama 2, Mistral, CodeLlama, ...) prepends
# " " / "▁". llguidance tokenizes forced bytes with it, so where the grammar forces bytes
# the mask allows only the space token, which the matcher then refuses to consume:
# `run -m tiny-spm-target.gguf -j SCHEMA hello` -> "internal error: AssertionError: a
# committed token outside the grammar ... forced bytes: got '{'; applying ' '" (even with
# --drafter none). Jump-forward tokens start with the space too (valid_prefix 0).


def _vocab_grammars(path: Path) -> Grammars:
    from specgguf.engine.constraints import model_grammars
    from specgguf.llama.backend import LlamaModel

    return model_grammars(LlamaModel(path, vocab_only=True))


@pytest.mark.parametrize(
    "spec",
    [GrammarSpec("gbnf", 'root ::= "yes"'),
     GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {
         "keyname": {"type": "string"}}, "required": ["keyname"]}))],
    ids=["gbnf", "json_schema"],
)  # fmt: skip
def test_spm_target_every_masked_token_can_be_committed(
    tiny_models: dict[str, Path], spec: GrammarSpec
) -> None:
    g = _vocab_grammars(tiny_models["spm-target"])
    c = g.constraint(spec)
    allowed = [int(t) for t in c.masks([])[0].nonzero()[0]]
    assert allowed
    assert all(c.valid_prefix([t]) == 1 for t in allowed), "mask allows unconsumable tokens"
    forced = c.forced(8)
    assert c.valid_prefix(forced) == len(forced) > 0  # jump-forward tokens are usable


def test_spm_target_run_json_schema(tiny_models: dict[str, Path]) -> None:
    schema = {"type": "object", "properties": {"b": {"enum": ["xyz", "yes"]}},
              "required": ["b"], "additionalProperties": False}  # fmt: skip
    res = run_cli("run", "-m", str(tiny_models["spm-target"]), "-c", "512", "--temp", "0",
                  "-n", "40", "--drafter", "none", "-j", json.dumps(schema), "hello")  # fmt: skip
    assert res.returncode == 0, res.stderr.decode()[:300]
    assert json.loads(res.stdout)["b"] in ("xyz", "yes")


# --- Defect 3 (low): error messages cut to a first line that names nothing -------------------
# constraints.py `_first_line` keeps only "regex parse error:" of llguidance's
# "regex parse error:\n    [a-\n    ^\nerror: unclosed character class":
# `run -m M -j '{"type":"string","pattern":"[a-"}' x` -> "the JSON Schema cannot be used:
# regex parse error:" (and the server's 400 says the same). Expected: one line that says
# what is wrong (the "error: ..." line, and ideally the pattern).


@pytest.mark.parametrize(
    "spec",
    [GrammarSpec("json_schema", json.dumps({"type": "string", "pattern": "[a-"})),
     GrammarSpec("regex", "(a")],
    ids=["schema-pattern", "regex"],
)  # fmt: skip
def test_a_bad_regular_expression_is_named_in_one_line(spec: GrammarSpec) -> None:
    with pytest.raises(GrammarError) as e:
        check_grammar(spec)
    message = str(e.value)
    assert "\n" not in message
    assert "unclosed" in message, message


# --- Defect 4 (low): a grammar the matcher cannot start is a silent empty "stop" -------------
# A schema that compiles but cannot produce any text (here: a $ref cycle without a base case)
# passes `Grammars.compile` (so the server queues it, `run` loads the model); the matcher
# errors at its first mask ("NoExtensionBias"), `Constraint.done` reads `is_stopped()`, and
# the loop ends with no tokens and finish "stop": a 200 with empty content. Expected: a
# GrammarError (400 / exit 2) before generating, or at least not a normal "stop".


def test_a_schema_that_can_produce_nothing_is_refused() -> None:
    grammars = Grammars([*PIECES, b"</s>"], [BYTE_EOS], [BYTE_EOS], greedy_tokenize)
    spec = GrammarSpec("json_schema", json.dumps(
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}))  # fmt: skip
    with pytest.raises(GrammarError):
        grammars.compile(spec)
        ctx = FakeContext(byte_target, BYTES_V)
        dec = SpeculativeDecoder(ctx, FakeVocab(BYTES_V, [BYTE_EOS], dict(enumerate(PIECES))))
        r = dec.generate([1, 2], GenerationParams(n_predict=20, sampler=GREEDY), None,
                         grammars.constraint(spec)).run()  # fmt: skip
        assert r.finish_reason == "stop" and r.tokens == []  # what happens today
