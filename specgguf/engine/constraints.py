"""Grammars over the target's vocabulary, with llguidance: compiling a
:class:`~specgguf.speculative.grammar.GrammarSpec` and following it during a generation
(:class:`~specgguf.speculative.grammar.Constraint`).

llguidance (the grammar library llama.cpp itself builds with ``LLAMA_LLGUIDANCE``) was
chosen over xgrammar for three reasons, measured and read in ``scripts/bench-grammar``
and noted in docs: it computes a token mask over Qwen's 151,936 tokens in tens of
microseconds; it rolls back any number of tokens and validates a whole draft in one call
(``validate_tokens``), and gives the tokens the grammar forces (``compute_ff_tokens``),
which is what speculative decoding needs; and it is one wheel without dependencies, where
xgrammar requires torch, transformers and triton.

The tokenizer llguidance sees is the target's own: each token's bytes as llama.cpp renders
it, control tokens marked with a 0xff prefix so that no grammar text can produce them
(llguidance's convention, as in its ``llamacpp.py``). Unlike that helper, user-defined
tokens such as Qwen's ``<tool_call>`` stay text: a grammar that asks for ``<tool_call>``
lets the model write it with the one token it was trained to write it with.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from typing import Any

import llguidance
import numpy as np
import numpy.typing as npt

from specgguf.errors import GrammarError
from specgguf.llama.backend import LlamaModel
from specgguf.speculative.grammar import GRAMMAR_KINDS, GrammarSpec

#: Compiled grammars kept per vocabulary (a server sees the same schema again and again).
CACHE_SIZE = 64

#: Bounds on a grammar's work per token (llguidance's defaults, named here to be stated:
#: a grammar that needs more is refused when compiled, or ends the generation).
LIMITS = llguidance.LLParserLimits()

#: JSON on one line with Python's separators, as chat models write it inline (and their
#: tool calls): fixed separators are forced tokens the loop drafts for free, where
#: llguidance's default of any whitespace would leave each to the model.
_JSON_OPTIONS: Any = {
    "item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False,
    "coerce_one_of": True,
}  # fmt: skip


class _Tokenizer:
    """What llguidance's ``TokenizerWrapper`` asks of a tokenizer."""

    def __init__(
        self,
        pieces: Sequence[bytes],
        eos: int,
        bos: int | None,
        special: Collection[int],
        tokenize: Callable[[bytes], list[int]],
    ) -> None:
        self.tokens = list(pieces)
        self.eos_token_id = eos
        self.bos_token_id = bos
        self.special_token_ids = sorted(special)
        self._tokenize = tokenize

    def __call__(self, text: bytes) -> list[int]:
        return self._tokenize(text)


class Grammars:
    """Compiles grammars for one vocabulary and starts constraints from them.

    Args:
        pieces: each token's bytes as generated text shows it, by id (``n_vocab`` items).
        eog: the end-of-generation ids (allowed where the grammar is complete).
        control: ids of control tokens, which no grammar text produces.
        tokenize: text (bytes) -> token ids, no BOS, special-token texts not parsed.
        bos: the BOS id, if any.

    Building the tokenizer reads every piece (about 1 s for 151,936 tokens); it happens
    once, at the first grammar. Thread-safe.
    """

    def __init__(
        self,
        pieces: Sequence[bytes],
        eog: Collection[int],
        control: Collection[int],
        tokenize: Callable[[bytes], list[int]],
        bos: int | None = None,
    ) -> None:
        self.n_vocab = len(pieces)
        eos = sorted(eog)
        tokens = [b"\xff" + p if i in control else p for i, p in enumerate(pieces)]
        wrapper = llguidance.TokenizerWrapper(
            _Tokenizer(tokens, eos[0] if eos else 0, bos, control, tokenize)
        )
        self.tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=self.n_vocab, eos_token=eos)
        self.eog = frozenset(eog)
        self._compiled: OrderedDict[GrammarSpec, str] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> str:
        """llguidance's grammar for ``spec``, checked against this vocabulary (cached).

        Raises:
            GrammarError: an unknown kind, a schema that is not JSON or uses a feature
                llguidance does not support, a grammar or regular expression that does
                not parse; the message names what is wrong.
        """
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        grammar = _grammar(spec)
        bad, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer, limits=LIMITS
        )
        if bad:
            raise GrammarError(f"{_what(spec)} cannot be used: {_one_line(messages[0])}")
        # A grammar can be valid and yet allow no output at all (a schema that refers only
        # to itself): its first mask says so.
        probe = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=LIMITS)
        probe.compute_bitmask()
        if probe.is_error():
            raise GrammarError(f"{_what(spec)} allows no output: {_one_line(probe.get_error())}")
        with self._lock:
            self._compiled[spec] = grammar
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return grammar

    def constraint(self, spec: GrammarSpec) -> GrammarConstraint:
        """A :class:`GrammarConstraint` at the start of ``spec``'s grammar.

        Raises:
            GrammarError: as :meth:`compile`.
        """
        matcher = llguidance.LLMatcher(self.tokenizer, self.compile(spec), log_level=0,
                                       limits=LIMITS)  # fmt: skip
        if matcher.is_error():
            raise GrammarError(f"{_what(spec)} cannot be used: {_one_line(matcher.get_error())}")
        return GrammarConstraint(matcher, self.n_vocab, self.eog)


class GrammarConstraint:
    """A :class:`~specgguf.speculative.grammar.Constraint` over an llguidance matcher.

    Masks are computed row by row along the draft (consume, mask, then roll back):
    ``n_vocab / 32`` int32 words each, unpacked to ``bool[n_vocab]``.
    """

    def __init__(self, matcher: llguidance.LLMatcher, n_vocab: int, eog: Collection[int]) -> None:
        self.m = matcher
        self.n_vocab = n_vocab
        self.eog = frozenset(eog)
        self._words = (n_vocab + 31) // 32

    @property
    def done(self) -> bool:
        """Whether only an end of generation is left.

        Raises:
            GrammarError: the grammar failed (past llguidance's limits of work per token):
                the output so far stands, but nothing more can be generated under it.
        """
        if self.m.is_error():
            raise GrammarError(f"the grammar failed: {_one_line(self.m.get_error())}")
        return bool(self.m.is_stopped())

    def forced(self, limit: int) -> list[int]:
        if limit <= 0 or self.m.is_stopped():
            return []
        return [int(t) for t in self.m.compute_ff_tokens()[:limit]]

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        n = int(self.m.validate_tokens(list(tokens))) if tokens else 0
        # an end of generation ends the output: drafting past it, or it, gains nothing
        for i, t in enumerate(tokens[:n]):
            if t in self.eog:
                return i
        return n

    def masks(self, draft: Sequence[int]) -> npt.NDArray[np.bool_]:
        words = np.empty((len(draft) + 1, self._words), np.int32)
        consumed = 0
        try:
            for i in range(len(draft) + 1):
                self.m.unsafe_compute_mask_ptr(words[i].ctypes.data, self._words * 4)
                if i < len(draft):
                    if not self.m.consume_token(int(draft[i])):
                        raise AssertionError("a draft token outside the grammar was masked")
                    consumed += 1
        finally:
            if consumed:
                self.m.rollback(consumed)
        bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
        return bits[:, : self.n_vocab].view(np.bool_)  # 0 and 1 bytes: valid booleans

    def commit(self, tokens: Sequence[int]) -> None:
        if tokens and not self.m.consume_tokens([int(t) for t in tokens]):
            raise AssertionError(f"a committed token outside the grammar: {self.m.get_error()}")


def model_grammars(model: LlamaModel) -> Grammars:
    """:class:`Grammars` over a loaded model's vocabulary (its pieces, end-of-generation
    and control tokens, and :func:`_plain_tokenizer`); about 1 s for 151,936 tokens."""
    return Grammars(
        [model.token_to_piece(i) for i in range(model.n_vocab)], model.eog_ids,
        model.control_ids, _plain_tokenizer(model), bos=model.bos if model.bos >= 0 else None,
    )  # fmt: skip


def _plain_tokenizer(model: LlamaModel) -> Callable[[bytes], list[int]]:
    """Text -> token ids as a grammar's forced bytes are written in the output: no BOS, no
    special-token texts, and no space before the first word. SentencePiece vocabularies
    that add one (``add_space_prefix``: Llama 2, Mistral) tokenize after a newline, which
    takes none, and the tokens of that newline are dropped; where a token spans it, the
    text is tokenized as is."""

    def plain(text: bytes) -> list[int]:
        return model.tokenize(text, add_special=False, parse_special=False)

    if not model.detokenize(plain(b"a")).startswith(b" "):
        return plain

    def unspaced(text: bytes) -> list[int]:
        ids = plain(b"\n" + text)
        seen = b""
        for i, t in enumerate(ids):
            if seen in (b"\n", b" \n"):
                return ids[i:]
            seen += model.token_to_piece(t)
        return [] if seen in (b"\n", b" \n") else plain(text)  # empty, or a token spans it

    return unspaced


def check_grammar(spec: GrammarSpec) -> None:
    """Check ``spec`` without a vocabulary (before any model loads): the checks of
    :meth:`Grammars.compile` that do not depend on the tokens.

    Raises:
        GrammarError: as :meth:`Grammars.compile`.
    """
    bad, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        _grammar(spec), None, limits=LIMITS
    )
    if bad:
        raise GrammarError(f"{_what(spec)} cannot be used: {_one_line(messages[0])}")


def _grammar(spec: GrammarSpec) -> str:
    """llguidance's grammar text for a spec (not yet checked)."""
    kind, text = spec.kind, spec.text
    if kind not in GRAMMAR_KINDS:
        raise GrammarError(f"unknown kind of grammar {kind!r}: one of {', '.join(GRAMMAR_KINDS)}")
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=_JSON_OPTIONS
        )
    if kind == "json_schema":
        try:
            schema: Any = json.loads(text)
        except json.JSONDecodeError as e:
            raise GrammarError(f"the JSON Schema is not valid JSON: {e}") from None
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise GrammarError("a JSON Schema is an object (or true)")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(f"the JSON Schema cannot be used: {e}") from None
    if kind == "gbnf":
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # the converter raises what its parser meets
            raise GrammarError(f"the GBNF grammar does not parse: {_one_line(str(e))}") from None
        return llguidance.LLMatcher.grammar_from_lark(text)
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(text)
    return llguidance.LLMatcher.grammar_from_regex(text)


def _what(spec: GrammarSpec) -> str:
    return {
        "json_object": "the JSON object grammar",
        "json_schema": "the JSON Schema",
        "gbnf": "the GBNF grammar",
        "lark": "the Lark grammar",
        "regex": "the regular expression",
    }.get(spec.kind, "the grammar")


def _one_line(message: str) -> str:
    """llguidance's message (several lines: where, then what) on one line, at most 300
    characters."""
    text = " ".join(line.strip() for line in message.splitlines() if line.strip())
    return text[:300] or "unknown error"
