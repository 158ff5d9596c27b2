"""The vocabulary rules of :mod:`specgguf.gguf.vocab`, one branch at a time, on small
vocabulary-only GGUF files written with gguf-py's ``GGUFWriter``: which differences between
a target and a draft are allowed, which refuse, and the exact wording of why; what
:func:`read_vocab` takes from a file and the defaults it takes from llama.cpp when a key is
absent; what :func:`vocab_findings` refuses in one file. Asked for by mutation testing
(scripts/mutation-test): the fixture-pair tests of tests/test_vocab.py check codes and
substrings, which let changed wording, boundaries and branches through.

The expected texts are written out from the rules in the module docstring and
llama.cpp's ``common_speculative_are_compatible`` (common/speculative.cpp), not taken from
the code under test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFValueType, GGUFWriter

from specgguf.errors import ModelLoadError
from specgguf.gguf.metadata import Finding, GGUFMetadata
from specgguf.gguf.vocab import (
    CompatReport,
    TokenDiff,
    VocabInfo,
    check_compatibility,
    compare_vocabs,
    read_vocab,
    vocab_findings,
)

T = GGUFValueType
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "c", "d", "e", "f", "g"]
BASE: dict[str, Any] = {
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.pre": "gpt-2",
    "tokenizer.ggml.tokens": TOKENS,
    "tokenizer.ggml.merges": ["a b", "c d"],
    "tokenizer.ggml.bos_token_id": 0,
    "tokenizer.ggml.eos_token_id": 0,
    "tokenizer.ggml.add_bos_token": False,
}


def _typed(value: Any) -> tuple[Any, GGUFValueType, GGUFValueType | None]:
    """A value with the GGUF type llama.cpp reads for it (or as given: (value, type))."""
    if isinstance(value, tuple):
        return value[0], value[1], value[2] if len(value) > 2 else None
    if isinstance(value, bool):
        return value, T.BOOL, None
    if isinstance(value, int):
        return value, T.UINT32, None
    if isinstance(value, str):
        return value, T.STRING, None
    if isinstance(value, list):
        if not value or isinstance(value[0], str):
            return value, T.ARRAY, T.STRING
        if isinstance(value[0], float):
            return value, T.ARRAY, T.FLOAT32
        return value, T.ARRAY, T.INT32
    raise TypeError(value)


def write_vocab(path: Path, arch: str = "llama", **changes: Any) -> Path:
    """A GGUF file with only ``general.architecture`` and the tokenizer keys of BASE,
    changed by ``changes`` (keys without the ``tokenizer.ggml.`` prefix; None drops)."""
    keys = dict(BASE)
    for k, v in changes.items():
        full = k.startswith(("tokenizer.", "general.", f"{arch}."))
        keys[k if full else f"tokenizer.ggml.{k}"] = v
    w = GGUFWriter(path, arch=arch)
    for key, v in keys.items():
        if v is None:
            continue
        value, vtype, sub = _typed(v)
        w.add_key_value(key, value, vtype, sub_type=sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def vocab(tmp_path: Path) -> Iterator[Callable[..., VocabInfo]]:
    """vocab(name, **changes): the VocabInfo of a file written by write_vocab, kept open
    until the test ends."""
    with contextlib.ExitStack() as stack:

        def make(name: str = "t", arch: str = "llama", **changes: Any) -> VocabInfo:
            path = write_vocab(tmp_path / f"{name}.gguf", arch, **changes)
            return read_vocab(stack.enter_context(GGUFMetadata.open(path)))

        yield make


def messages(r: CompatReport) -> list[tuple[str, str, str]]:
    return [(f.severity, f.code, f.message) for f in r.findings]


# -- identical vocabularies and the report ---------------------------------------------------


def test_identical_vocabularies(
    vocab: Callable[..., VocabInfo], monkeypatch: pytest.MonkeyPatch
) -> None:
    import types

    import specgguf.gguf.vocab as vocab_module

    t, d = vocab("t"), vocab("d")
    # A fake clock that stands still: the seconds below are exact whatever the load.
    monkeypatch.setattr(vocab_module, "time", types.SimpleNamespace(perf_counter=lambda: 1000.0))
    r = compare_vocabs(t, d, started=900.0)
    assert r.findings == () and r.compatible and r.llama_cpp_compatible is True
    assert r.token_diff == TokenDiff(5, 0, None, None, None)
    assert r.errors == [] and r.warnings == []
    assert r.verdict() == "compatible: d.gguf can draft for t.gguf"
    assert r.seconds == 100.0  # measured from the given start
    later = compare_vocabs(t, d)
    assert later.seconds == 0.0  # from the start of the comparison itself


def test_report_as_dict(vocab: Callable[..., VocabInfo]) -> None:
    t, d = vocab("t"), vocab("d", add_bos_token=True)
    r = dataclass_replace_seconds(compare_vocabs(t, d), 1.234567)
    data = r.as_dict()
    assert list(data) == [
        "compatible", "llama_cpp_compatible", "verdict", "target", "draft", "findings",
        "token_diff", "seconds",
    ]  # fmt: skip
    assert data["compatible"] is False and data["llama_cpp_compatible"] is False
    assert data["verdict"] == r.verdict()
    assert data["seconds"] == 1.2346
    assert data["findings"] == [
        {"severity": "error", "code": "bos", "message": r.errors[0].message}
    ]
    assert data["token_diff"] == {
        "n_compared": 5, "n_different": 0, "first_id": None, "first_target": None,
        "first_draft": None,
    }  # fmt: skip
    assert data["target"]["path"] == str(t.path) and data["draft"]["path"] == str(d.path)
    assert data["target"] == {"path": str(t.path), "architecture": t.architecture,
                              "memory": "attention", "rolls_back": True, **t.as_dict()}  # fmt: skip
    assert data["draft"]["add_bos"] is True


def dataclass_replace_seconds(r: CompatReport, seconds: float) -> CompatReport:
    import dataclasses

    return dataclasses.replace(r, seconds=seconds)


def test_vocab_info_as_dict_and_text(vocab: Callable[..., VocabInfo]) -> None:
    v = vocab("t", eot_token_id=2, padding_token_id=1, eom_token_id=9)
    assert v.as_dict() == {
        "tokenizer_model": "gpt2",
        "vocab_type": "bpe",
        "pre_tokenizer": "gpt-2",
        "n_tokens": 10,
        "n_merges": 2,
        "bos": {"id": 0, "text": "<|endoftext|>"},
        "eos": {"id": 0, "text": "<|endoftext|>"},
        "eot": {"id": 2, "text": "<|im_end|>"},
        "eom": {"id": 9, "text": "g"},
        "padding": {"id": 1, "text": "<|im_start|>"},
        "add_bos": False,
        "add_eos": False,
        "eog": [
            {"id": 0, "text": "<|endoftext|>"},
            {"id": 2, "text": "<|im_end|>"},
            {"id": 9, "text": "g"},
        ],
    }
    assert v.special_texts == {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>", 9: "g"}
    assert [v.text(i) for i in (None, -1, 10, 3, 8)] == [None, None, None, "a", "f"]
    none = vocab("n", model="none", tokens=None, merges=None)
    assert none.as_dict()["bos"] is None and none.text(0) is None and none.tokens is None


# -- llama.cpp's rules -------------------------------------------------------------------------


def test_vocabulary_types_differ(vocab: Callable[..., VocabInfo]) -> None:
    t = vocab("t")
    d = vocab("d", model="llama", pre="default", merges=None, bos_token_id=1, eos_token_id=2)
    r = compare_vocabs(t, d)
    assert r.errors[0] == Finding(
        "error", "vocab-type", "vocabulary types differ: target BPE (gpt2), draft SPM (llama)"
    )
    assert r.llama_cpp_compatible is False


@pytest.mark.parametrize("name", ["bos", "eos"])
def test_add_flag_differs(vocab: Callable[..., VocabInfo], name: str) -> None:
    r = compare_vocabs(vocab("t"), vocab("d", **{f"add_{name}_token": True}))
    assert messages(r) == [
        ("error", name, f"add_{name} differs: target false, draft true (one would start prompts "
         f"with {name.upper()}, the other not)"),
    ]  # fmt: skip
    assert r.llama_cpp_compatible is False and not r.compatible
    assert r.verdict() == f"INCOMPATIBLE: d.gguf cannot draft for t.gguf: {r.errors[0].message}"
    r = compare_vocabs(vocab("t2", **{f"add_{name}_token": True}), vocab("d2"))
    assert r.errors[0].message.startswith(f"add_{name} differs: target true, draft false")


@pytest.mark.parametrize("name", ["bos", "eos"])
def test_special_ids_differ_only_matter_with_the_flag(
    vocab: Callable[..., VocabInfo], name: str
) -> None:
    flag = f"add_{name}_token"
    t = vocab("t", **{flag: True})
    d = vocab("d", **{flag: True, f"{name}_token_id": 1})
    r = compare_vocabs(t, d)
    assert messages(r) == [
        ("error", name, f"{name.upper()} ids differ with add_{name} set: target 0 "
         "'<|endoftext|>', draft 1 '<|im_start|>'"),
    ]  # fmt: skip
    assert r.llama_cpp_compatible is False
    # the same ids with the flag set, or different ids without it: allowed
    assert compare_vocabs(t, vocab("d2", **{flag: True})).findings == ()
    r = compare_vocabs(vocab("t3"), vocab("d3", **{f"{name}_token_id": 1}))
    assert r.llama_cpp_compatible is True and r.errors == []


def test_an_absent_special_token_is_shown_as_none(vocab: Callable[..., VocabInfo]) -> None:
    # An EOS id past the token list, with gpt2's default (11) past it too: no EOS.
    t = vocab("t", add_eos_token=True, eos_token_id=3)
    d = vocab("d", add_eos_token=True, eos_token_id=50)
    assert d.eos is None
    r = compare_vocabs(t, d)
    assert r.errors[0].message == "EOS ids differ with add_eos set: target 3 'a', draft None (none)"


def _tokens(n: int) -> list[str]:
    return TOKENS + [f"t{i}" for i in range(len(TOKENS), n)]


@pytest.mark.parametrize(("n_target", "n_draft"), [(1000, 1128), (1128, 1000), (1000, 1000)])
def test_token_counts_within_128_are_allowed(
    vocab: Callable[..., VocabInfo], n_target: int, n_draft: int
) -> None:
    r = compare_vocabs(vocab("t", tokens=_tokens(n_target)), vocab("d", tokens=_tokens(n_draft)))
    assert r.llama_cpp_compatible is True and r.compatible
    assert r.token_diff == TokenDiff(min(n_target, n_draft) - 5, 0, None, None, None)


def test_token_counts_129_apart_are_refused(vocab: Callable[..., VocabInfo]) -> None:
    r = compare_vocabs(vocab("t", tokens=_tokens(1000)), vocab("d", tokens=_tokens(1129)))
    assert r.llama_cpp_compatible is False
    assert messages(r) == [
        ("error", "vocab-size", "token counts differ by 129 (target 1,000, draft 1,129); "
         "llama.cpp allows at most 128"),
        ("warning", "draft-extra-ids", "the draft has 129 token ids (1000..1128) the target "
         "does not have; specgguf never proposes them (their draft probability is set to "
         "zero)"),
    ]  # fmt: skip
    r = compare_vocabs(vocab("t2", tokens=_tokens(1129)), vocab("d2", tokens=_tokens(1000)))
    assert messages(r) == [
        ("error", "vocab-size", "token counts differ by 129 (target 1,129, draft 1,000); "
         "llama.cpp allows at most 128"),
        ("info", "target-extra-ids", "the target has 129 token ids (1000..1128) the draft "
         "cannot propose"),
    ]  # fmt: skip


def test_extra_ids_are_named_with_their_range(vocab: Callable[..., VocabInfo]) -> None:
    r = compare_vocabs(vocab("t"), vocab("d", tokens=_tokens(12)))
    assert messages(r) == [
        ("warning", "draft-extra-ids", "the draft has 2 token ids (10..11) the target does not "
         "have; specgguf never proposes them (their draft probability is set to zero)"),
    ]  # fmt: skip
    assert r.verdict() == "compatible: d.gguf can draft for t.gguf (1 warning(s))"
    r = compare_vocabs(vocab("t2", tokens=_tokens(11)), vocab("d2"))
    assert messages(r) == [
        ("info", "target-extra-ids", "the target has 1 token ids (10..10) the draft cannot "
         "propose"),
    ]  # fmt: skip
    assert r.verdict() == "compatible: d2.gguf can draft for t2.gguf"


def _changed(changes: dict[int, str], n: int = 10) -> list[str]:
    toks = _tokens(n)
    for i, text in changes.items():
        toks[i] = text
    return toks


@pytest.mark.parametrize(
    ("changes", "n_different", "first", "texts"),
    [
        ({5: "C"}, 1, 5, ("'c'", "'C'")),  # the first id compared
        ({9: "G", 6: "D"}, 2, 6, ("'d'", "'D'")),  # the last id compared; the first named
        ({7: "\u00e9"}, 1, 7, ("'e'", "'\u00e9'")),
    ],
)
def test_token_texts_compared_from_id_5(
    vocab: Callable[..., VocabInfo],
    changes: dict[int, str],
    n_different: int,
    first: int,
    texts: tuple[str, str],
) -> None:
    r = compare_vocabs(vocab("t"), vocab("d", tokens=_changed(changes)))
    assert r.token_diff == TokenDiff(5, n_different, first, texts[0][1:-1], texts[1][1:-1])
    assert r.errors == [
        Finding("error", "token-text", f"{n_different} of 5 token ids compared have different "
                f"texts; the first is id {first}: target {texts[0]}, draft {texts[1]}"),
    ]  # fmt: skip
    assert r.llama_cpp_compatible is False


def test_token_texts_past_the_smaller_count_and_below_5_are_not_compared(
    vocab: Callable[..., VocabInfo],
) -> None:
    # ids 3 and 4 differ (below 5: reported as information only); the draft's extra ids
    # are not compared
    t = vocab("t")
    d = vocab("d", tokens=_changed({3: "A", 4: "B"}, 12))
    r = compare_vocabs(t, d)
    assert r.llama_cpp_compatible is True and r.compatible
    assert r.token_diff == TokenDiff(5, 0, None, None, None)
    assert ("info", "head-token-text", "ids below 5 (not compared by llama.cpp) differ: 3, 4") in (
        messages(r)
    )
    # id 0 too: an end-of-generation token, so an error of its own
    r = compare_vocabs(t, vocab("d0", tokens=_changed({0: "<s>", 1: "x"})))
    assert ("info", "head-token-text", "ids below 5 (not compared by llama.cpp) differ: 0, 1") in (
        messages(r)
    )


def test_ids_below_5_compared_up_to_the_shorter_list(vocab: Callable[..., VocabInfo]) -> None:
    short, full = vocab("s", tokens=TOKENS[:4]), vocab("f")
    for r in (compare_vocabs(short, full), compare_vocabs(full, short)):
        assert not [f for f in r.findings if f.code == "head-token-text"]
        assert r.token_diff == TokenDiff(0, 0, None, None, None)


@pytest.mark.parametrize(("n", "compared"), [(5, 0), (6, 1), (4, 0)])
def test_short_vocabularies_compare_what_is_there(
    vocab: Callable[..., VocabInfo], n: int, compared: int
) -> None:
    toks = TOKENS[:n]
    other = [*toks[:-1], "Z"]
    r = compare_vocabs(vocab("t", tokens=toks), vocab("d", tokens=other))
    assert r.token_diff.n_compared == compared
    if compared:
        assert r.token_diff == TokenDiff(1, 1, 5, "c", "Z")
    else:
        assert r.token_diff == TokenDiff(0, 0, None, None, None)
        head = [f for f in r.findings if f.code == "head-token-text"]
        assert head == [
            Finding("info", "head-token-text",
                    f"ids below 5 (not compared by llama.cpp) differ: {n - 1}"),
        ]  # fmt: skip


def test_texts_that_are_not_utf8_are_shown_with_replacement_characters(
    vocab: Callable[..., VocabInfo], tmp_path: Path
) -> None:
    t = vocab("t", tokens=[*TOKENS[:8], b"h\xff", "i"])
    d = vocab("d", tokens=[*TOKENS[:8], b"h\xfe", "i"])
    assert (t.text(8), d.text(8)) == ("h\ufffd", "h\ufffd")
    special = vocab("s", tokens=[*TOKENS[:8], b"h\xff", "i"], eot_token_id=8)
    assert special.special_texts[8] == "h\ufffd" == special.text(8)
    r = compare_vocabs(t, d)
    assert r.token_diff == TokenDiff(5, 1, 8, "h\ufffd", "h\ufffd")
    assert r.errors[0].message == (
        "1 of 5 token ids compared have different texts; the first is id 8: target "
        "'h\ufffd', draft 'h\ufffd'"
    )
    assert findings_of(tmp_path, tokens=[*TOKENS[:6], b"\xff", b"\xff"]) == [
        (E, "duplicate-token", "tokens 6 and 7 have the same text '\ufffd': llama.cpp aborts "
         "on such a vocabulary"),
    ]  # fmt: skip


# -- beyond llama.cpp ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "rolls_back"),
    [("mamba", False), ("rwkv7", False), ("jamba", False), ("qwen3next", False),
     ("qwen35", True), ("nemotron_h", True), ("llama", True)],
)  # fmt: skip
def test_recurrent_and_hybrid_architectures(
    vocab: Callable[..., VocabInfo], arch: str, rolls_back: bool
) -> None:
    # Refused until issue 31: any architecture drafts (a recurrent draft drafts in a copy
    # of its sequence); a target whose state llama.cpp cannot snapshot is said to roll
    # back by checkpoint and replay (issue 53).
    r = compare_vocabs(vocab("t"), vocab("d", arch=arch))
    assert messages(r) == [] and r.compatible
    r = compare_vocabs(vocab("t2", arch=arch), vocab("d2"))
    why = (f"the target's architecture {arch!r} keeps no snapshots of its recurrent state in "
           "this llama.cpp: rejected drafts are dropped by checkpoint and replay (the state "
           "is copied before each verification; after a rejection the copy comes back and "
           "the accepted drafts are decoded again)")  # fmt: skip
    assert messages(r) == ([] if rolls_back else [("info", "replay", why)])
    assert r.compatible


def test_no_token_list(vocab: Callable[..., VocabInfo]) -> None:
    none = vocab("n", model="none", tokens=None, merges=None)
    assert (none.tokens, none.n_tokens, none.vocab_type) == (None, 0, "none")
    r = compare_vocabs(none, vocab("n2", model="none", tokens=None, merges=None))
    assert messages(r) == [
        ("error", "no-vocabulary", "the target has no tokenizer.ggml.tokens list"),
        ("error", "no-vocabulary", "the draft has no tokenizer.ggml.tokens list"),
    ]
    assert r.llama_cpp_compatible is True  # same type, same flags, nothing to compare
    assert r.token_diff == TokenDiff(0, 0, None, None, None)


def test_one_side_without_a_token_list(vocab: Callable[..., VocabInfo]) -> None:
    # No token list but a vocab_size of 10: nothing to compare, no text to look up.
    none = vocab("n", model="none", tokens=None, merges=None, **{"llama.vocab_size": 10})
    assert none.n_tokens == 10
    for r, role in ((compare_vocabs(none, vocab("d")), "target"),
                    (compare_vocabs(vocab("t"), none), "draft")):  # fmt: skip
        assert r.token_diff == TokenDiff(0, 0, None, None, None)
        assert [f.code for f in r.findings] == ["no-vocabulary", "vocab-type"]
        assert r.findings[0].message == f"the {role} has no tokenizer.ggml.tokens list"


def test_end_of_generation_token_missing_in_the_draft(vocab: Callable[..., VocabInfo]) -> None:
    t = vocab("t", tokens=_tokens(12), eot_token_id=11)
    r = compare_vocabs(t, vocab("d"))
    assert ("error", "eog-missing", "the target's end-of-generation token 11 't11' does not "
            "exist in the draft (10 tokens)") in messages(r)  # fmt: skip
    # the first id past the draft's list
    r = compare_vocabs(vocab("t1", tokens=_tokens(11), eot_token_id=10), vocab("d1"))
    assert [m for m in messages(r) if m[1].startswith("eog")] == [
        ("error", "eog-missing", "the target's end-of-generation token 10 't10' does not "
         "exist in the draft (10 tokens)")
    ]  # fmt: skip
    assert not [f for f in r.findings if f.code == "eog-ids"]  # the error says it
    assert r.llama_cpp_compatible is True and not r.compatible


def test_end_of_generation_token_with_another_text(vocab: Callable[..., VocabInfo]) -> None:
    r = compare_vocabs(vocab("t"), vocab("d", tokens=_changed({2: "<|im_sep|>"})))
    assert messages(r) == [
        ("error", "eog-text", "the target's end-of-generation token 2 '<|im_end|>' is "
         "'<|im_sep|>' in the draft"),
        ("info", "head-token-text", "ids below 5 (not compared by llama.cpp) differ: 2"),
    ]  # fmt: skip


def test_draft_not_ending_on_the_targets_tokens_is_a_warning(
    vocab: Callable[..., VocabInfo],
) -> None:
    # The target ends generation on ids 0, 2 (by text), 7 (EOT) and 9 (EOM); the draft
    # only on 0 and 2.
    t = vocab("t", eot_token_id=7, eom_token_id=9)
    r = compare_vocabs(t, vocab("d"))
    assert t.eog_ids == (0, 2, 7, 9)
    assert messages(r) == [
        ("warning", "eog-ids", "the draft does not end generation on the target's token(s) "
         "7 'e', 9 'g': it may draft past the end of an answer (the target still stops)"),
    ]  # fmt: skip
    assert r.compatible
    # the other way round: nothing to say (the draft stopping early is harmless)
    assert compare_vocabs(vocab("d2"), t).findings == ()


def test_pre_tokenizer_difference_is_a_warning_only_when_ids_match(
    vocab: Callable[..., VocabInfo],
) -> None:
    r = compare_vocabs(vocab("t"), vocab("d", pre="qwen2"))
    assert messages(r) == [
        ("warning", "pre-tokenizer", "pre-tokenizers differ: target 'gpt-2', draft 'qwen2'; ids "
         "still match, but the draft may split text differently"),
    ]  # fmt: skip
    r = compare_vocabs(vocab("t1", pre=None), vocab("d1"))
    assert messages(r)[0][2].startswith("pre-tokenizers differ: target (none), draft 'gpt-2';")
    r = compare_vocabs(vocab("t2"), vocab("d2", pre="qwen2", add_bos_token=True))
    assert [f.code for f in r.findings] == ["bos"]
    r = compare_vocabs(vocab("t3"), vocab("d3", pre="qwen2", tokens=_changed({2: "x"})))
    assert [f.code for f in r.findings] == ["eog-text", "head-token-text"]


@pytest.mark.parametrize(
    ("t_merges", "d_merges", "message"),
    [
        (["a b", "c d"], ["a b", "c e"], "BPE merges differ (target 2, draft 2; first "
         "difference at merge 1): ids match, but the draft may split text differently"),
        (["a b", "c d"], ["x y", "c d", "e f"], "BPE merges differ (target 2, draft 3; first "
         "difference at merge 0): ids match, but the draft may split text differently"),
        (["a b", "c d"], ["a b", "c d", "e f"], "BPE merges differ (target 2, draft 3; one "
         "list extends the other (2 vs 3)): ids match, but the draft may split text "
         "differently"),
        (["m"] * 1001, ["m"] * 1000, "BPE merges differ (target 1,001, draft 1,000; one list "
         "extends the other (1,001 vs 1,000)): ids match, but the draft may split text "
         "differently"),
        (["a b", "c d"], ["a b", "c d"], None),
    ],
)  # fmt: skip
def test_merges(
    vocab: Callable[..., VocabInfo],
    t_merges: list[str],
    d_merges: list[str],
    message: str | None,
) -> None:
    r = compare_vocabs(vocab("t", merges=t_merges), vocab("d", merges=d_merges))
    assert messages(r) == ([("warning", "merges", message)] if message else [])


def test_merges_only_compared_between_bpe_vocabularies_with_same_ids(
    vocab: Callable[..., VocabInfo],
) -> None:
    # kimi-k2 goes without merges (llama.cpp allows it): one model with, one without
    t = vocab("t")
    d = vocab("d", pre="kimi-k2", merges=None)
    assert [m[2] for m in messages(compare_vocabs(t, d)) if m[1] == "merges"] == [
        "only one model has BPE merges"
    ]
    assert [m[2] for m in messages(compare_vocabs(d, t)) if m[1] == "merges"] == [
        "only one model has BPE merges"
    ]
    both = compare_vocabs(d, vocab("d2", pre="kimi-k2", merges=None))
    assert both.findings == ()
    # different ids: merges not compared
    r = compare_vocabs(t, vocab("d3", merges=["z z"], tokens=_changed({5: "C"})))
    assert [f.code for f in r.findings] == ["token-text"]
    # SPM on both sides: no merges to compare, even if one file holds some
    spm = {"model": "llama", "pre": "default", "bos_token_id": 1, "eos_token_id": 2}
    a = vocab("s1", **spm, merges=["a b"])
    b = vocab("s2", **spm, merges=["c d"])
    assert compare_vocabs(a, b).findings == ()


def test_findings_sorted_errors_then_warnings_then_information(
    vocab: Callable[..., VocabInfo],
) -> None:
    # a target without snapshots (information, found first), extra draft ids (warning),
    # a head difference (information), a changed token (error, found later)
    d = vocab("d", tokens=_changed({3: "A", 6: "D"}, 11))
    r = compare_vocabs(vocab("t", arch="mamba"), d)
    assert [(f.severity, f.code) for f in r.findings] == [
        ("error", "token-text"),
        ("warning", "draft-extra-ids"),
        ("info", "replay"),
        ("info", "head-token-text"),
    ]
    assert r.verdict().endswith(r.findings[0].message)
    # information found before a warning still comes after it
    r = compare_vocabs(vocab("t2"), vocab("d2", pre="qwen2", tokens=_changed({3: "A"})))
    assert [(f.severity, f.code) for f in r.findings] == [
        ("warning", "pre-tokenizer"),
        ("info", "head-token-text"),
    ]


# -- read_vocab: values and llama.cpp's defaults ----------------------------------------------


def test_read_vocab_values(vocab: Callable[..., VocabInfo]) -> None:
    v = vocab("t", eot_token_id=2, padding_token_id=1, add_eos_token=True)
    assert (v.architecture, v.tokenizer_model, v.vocab_type, v.pre) == (
        "llama", "gpt2", "bpe", "gpt-2"
    )  # fmt: skip
    assert (v.n_tokens, v.bos, v.eos, v.eot, v.eom, v.pad) == (10, 0, 0, 2, None, 1)
    assert (v.add_bos, v.add_eos, v.eog_ids, v.n_merges) == (False, True, (0, 2), 2)
    assert v.findings == ()
    assert v.path.name == "t.gguf"


@pytest.mark.parametrize(
    ("changes", "bos", "eos", "add_bos", "add_eos"),
    [
        # gpt2 defaults BOS and EOS to 11: past 10 tokens, so none; with 12 tokens, 11
        ({"bos_token_id": None, "eos_token_id": None}, None, None, False, False),
        ({"bos_token_id": None, "eos_token_id": None, "tokens": _tokens(12)}, 11, 11, False,
         False),
        ({"bos_token_id": None, "eos_token_id": None, "tokens": _tokens(11)}, None, None,
         False, False),
        # a stored id past the list keeps the default; an id equal to the count too
        ({"bos_token_id": 10, "eos_token_id": 99, "tokens": _tokens(12)}, 10, 11, False,
         False),
        ({"bos_token_id": 12, "tokens": _tokens(12)}, 11, 0, False, False),
        # add_bos defaults: true for BPE with a llama3-style pre-tokenizer, false for others
        ({"add_bos_token": None, "pre": "llama-bpe"}, 0, 0, True, False),
        ({"add_bos_token": None, "pre": "qwen2"}, 0, 0, False, False),
        ({"add_bos_token": None, "pre": None}, 0, 0, False, False),
        ({"add_bos_token": False, "pre": "llama3"}, 0, 0, False, False),
        # chatglm-bpe: no default BOS
        ({"bos_token_id": None, "pre": "chatglm-bpe", "tokens": _tokens(12)}, None, 0, False,
         False),
        ({"add_bos_token": None, "pre": "gemma4"}, 0, 0, True, False),
        # the pre-tokenizer rules are BPE's: an SPM vocabulary keeps its BOS, a UGM one its
        # add_bos default, whatever its pre-tokenizer says
        ({"model": "llama", "pre": "chatglm-bpe", "bos_token_id": None, "merges": None}, 1, 0,
         False, False),
        ({"model": "t5", "pre": "llama3", "add_bos_token": None, "merges": None}, 0, 0, False,
         True),
        ({"add_bos_token": False, "pre": "gemma4"}, 0, 0, True, False),  # forced
        # SPM: BOS 1, EOS 2, add_bos true by default; UGM (t5): add_eos true, EOS 1
        ({"model": "llama", "bos_token_id": None, "eos_token_id": None, "add_bos_token": None,
          "merges": None}, 1, 2, True, False),
        ({"model": "t5", "bos_token_id": None, "eos_token_id": None, "merges": None}, None, 1,
         False, True),
        ({"model": "bert", "bos_token_id": None, "add_bos_token": None, "merges": None,
          "tokens": _tokens(102)}, 101, 0, True, False),
        ({"model": "rwkv", "bos_token_id": None, "eos_token_id": None, "merges": None}, None,
         None, False, False),
        ({"model": "plamo2", "bos_token_id": None, "eos_token_id": None, "merges": None}, 1,
         2, False, False),
        # a flag stored with another type is not read (llama.cpp refuses the file anyway)
        ({"add_bos_token": (1, T.UINT8)}, 0, 0, False, False),
        ({"add_eos_token": (1, T.UINT8), "model": "t5", "merges": None}, 0, 0, False, True),
        # an id stored as a bool or a negative int is not an id
        ({"bos_token_id": (True, T.BOOL)}, None, 0, False, False),
        ({"bos_token_id": (-3, T.INT32), "tokens": _tokens(12)}, 11, 0, False, False),
        ({"bos_token_id": (0, T.INT32), "tokens": _tokens(12)}, 0, 0, False, False),
    ],
)  # fmt: skip
def test_special_tokens_and_flags(
    vocab: Callable[..., VocabInfo],
    changes: dict[str, Any],
    bos: int | None,
    eos: int | None,
    add_bos: bool,
    add_eos: bool,
) -> None:
    v = vocab("v", **changes)
    assert (v.bos, v.eos, v.add_bos, v.add_eos) == (bos, eos, add_bos, add_eos)


@pytest.mark.parametrize(
    ("model", "vtype"),
    [("no_vocab", "none"), ("none", "none"), ("llama", "spm"), ("gpt2", "bpe"),
     ("hybriddna", "bpe"), ("whitespace", "bpe"), ("gemma4", "bpe"), ("bert", "wpm"),
     ("t5", "ugm"), ("rwkv", "rwkv"), ("plamo2", "plamo2"), ("foo", "unknown (foo)")],
)  # fmt: skip
def test_vocabulary_types(vocab: Callable[..., VocabInfo], model: str, vtype: str) -> None:
    assert vocab("v", model=model).vocab_type == vtype


def test_no_tokenizer_section(vocab: Callable[..., VocabInfo]) -> None:
    v = vocab("v", model=None, pre=None, tokens=None, merges=None, bos_token_id=None,
              eos_token_id=None, add_bos_token=None, **{"llama.vocab_size": 300})  # fmt: skip
    assert (v.tokenizer_model, v.vocab_type, v.pre, v.n_tokens) == ("none", "none", None, 300)
    assert (v.bos, v.eos, v.eog_ids, v.n_merges, v.tokens) == (None, None, (), 0, None)
    assert v.special_texts == {}
    # a vocab_size that is not a count: 0
    w = vocab("w", model=None, tokens=None, **{"llama.vocab_size": (True, T.BOOL)})
    assert w.n_tokens == 0
    # a token list that is not strings: not a token list
    x = vocab("x", tokens=[1, 2, 3], **{"llama.vocab_size": 7})
    assert (x.tokens, x.n_tokens) == (None, 7)


def test_end_of_generation_ids_found_by_text(vocab: Callable[..., VocabInfo]) -> None:
    toks = _changed({3: "</s>", 4: "x</s>", 5: "</s>x", 6: "[EOS]", 7: "<eos>"}, 12)
    v = vocab("v", tokens=toks)
    assert v.eog_ids == (0, 2, 3, 6, 7)
    assert v.special_texts[6] == "[EOS]"
    # a token whose bytes hold another's encoding (length prefix and text): not an element
    # start, so not that token; the search goes on to the real one, the last token
    toks = _changed({8: "\x05" + "\x00" * 7 + "<eos>", 11: "<eos>"}, 12)
    assert vocab("w", tokens=toks).eog_ids == (0, 2, 11)
    toks = _changed({11: "\x05" + "\x00" * 7 + "<eos>"}, 12)
    assert vocab("x", tokens=toks).eog_ids == (0, 2)
    # every occurrence is looked at, in order: the real one between two that are not
    # element starts, and the real one before one that is not
    hidden = "\x05" + "\x00" * 7 + "<eos>"
    toks = _changed({3: "a" + hidden, 5: "<eos>", 8: "b" + hidden}, 12)
    assert vocab("y", tokens=toks).eog_ids == (0, 2, 5)
    toks = _changed({3: "<eos>", 8: hidden}, 12)
    assert vocab("z", tokens=toks).eog_ids == (0, 2, 3)


# -- vocab_findings: what llama.cpp's vocabulary loader refuses --------------------------------


def findings_of(tmp_path: Path, **changes: Any) -> list[tuple[str, str, str]]:
    path = write_vocab(tmp_path / "f.gguf", **changes)
    with GGUFMetadata.open(path) as m:
        v = read_vocab(m)
        return [(f.severity, f.code, f.message) for f in v.findings]


E, W = "error", "warning"


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"model": None}, [(E, "tokenizer", "no tokenizer.ggml.model: llama.cpp needs a "
                            "tokenizer")]),
        ({"model": (["gpt2"], T.ARRAY, T.STRING)}, [(E, "key-type", "tokenizer.ggml.model is "
         "array[string]; llama.cpp reads it as string and refuses the file")]),
        ({"pre": (3, T.UINT32)}, [(E, "key-type", "tokenizer.ggml.pre is uint32; llama.cpp "
         "reads it as string and refuses the file")]),
        ({"token_type_count": (3, T.UINT64)}, [(E, "key-type", "tokenizer.ggml.token_type_count "
         "is uint64; llama.cpp reads it as uint32 and refuses the file")]),
        ({"token_type_count": 3}, []),
        ({"model": "none", "llama.vocab_size": (5, T.INT32)}, [(E, "key-type",
         "llama.vocab_size is int32; llama.cpp reads it as uint32 and refuses the file")]),
        ({"model": "no_vocab", "tokens": None}, []),
        ({"model": "bpe\n"}, [(E, "tokenizer", "unknown tokenizer model 'bpe\\n'")]),
        ({"model": "bpe"}, [(E, "tokenizer", "unknown tokenizer model 'bpe'")]),
        ({"model": "test", "merges": None}, []),
        ({"merges": None}, [(E, "merges", "a BPE vocabulary (gpt2) without "
         "tokenizer.ggml.merges: llama.cpp refuses it")]),
        ({"merges": None, "pre": "kimi-k2"}, []),
        ({"merges": None, "model": "gemma4", "pre": "kimi-k2"}, [(E, "merges", "a BPE "
         "vocabulary (gemma4) without tokenizer.ggml.merges: llama.cpp refuses it")]),
        ({"merges": [1, 2]}, [(E, "merges", "tokenizer.ggml.merges is array[int32], not "
         "array[string]")]),
        ({"pre": None}, [(W, "pre-tokenizer", "no tokenizer.ggml.pre: llama.cpp uses 'default' "
         "and warns that generation quality will be degraded")]),
        ({"pre": ""}, [(W, "pre-tokenizer", "no tokenizer.ggml.pre: llama.cpp uses 'default' "
         "and warns that generation quality will be degraded")]),
        ({"pre": "gpt-5"}, [(E, "pre-tokenizer", "unknown pre-tokenizer 'gpt-5': this llama.cpp "
         "build refuses it")]),
        ({"model": "gemma4", "pre": "gpt-5"}, []),  # gemma4 sets its own
        ({"model": "llama", "pre": "gpt-5", "merges": None, "bos_token_id": 1}, []),
        ({"add_space_prefix": (1, T.UINT8)}, [(E, "key-type", "tokenizer.ggml.add_space_prefix "
         "is uint8; llama.cpp reads it as bool and refuses the file")]),
        ({"remove_extra_whitespaces": "yes"}, [(E, "key-type",
         "tokenizer.ggml.remove_extra_whitespaces is string; llama.cpp reads it as bool and "
         "refuses the file")]),
        ({"add_space_prefix": True, "remove_extra_whitespaces": False}, []),
        ({"tokens": None}, [(E, "tokens", "no tokenizer.ggml.tokens: llama.cpp needs the token "
         "list")]),
        ({"tokens": [1, 2]}, [(E, "tokens", "tokenizer.ggml.tokens is array[int32], not "
         "array[string]")]),
        ({"scores": [0.5] * 10}, []),
        ({"scores": [1] * 10}, []),
        ({"scores": [0.5] * 9}, [(E, "key-type", "tokenizer.ggml.scores has 9 values for 10 "
         "tokens")]),
        ({"scores": ["x"] * 10}, [(E, "key-type", "tokenizer.ggml.scores is array[string], not "
         "array[int32] or array[float32]")]),
        ({"token_type": [1] * 10}, []),
        ({"token_type": [1] * 11, "scores": [0.5] * 12}, []),
        ({"token_type": [1] * 9}, [(E, "key-type", "tokenizer.ggml.token_type has 9 values "
         "for 10 tokens")]),
        ({"token_type": [1.0] * 10}, [(E, "key-type", "tokenizer.ggml.token_type is "
         "array[float32], not array[int32]")]),
        ({"scores": [0.5] * 9, "token_type": [1.0] * 10}, [(E, "key-type",
         "tokenizer.ggml.scores has 9 values for 10 tokens")]),
        ({"tokens": _changed({7: "c"})}, [(E, "duplicate-token", "tokens 5 and 7 have the same "
         "text 'c': llama.cpp aborts on such a vocabulary")]),
        ({"tokens": _changed({4: "", 8: "[EMPTY_4]"})}, [(E, "duplicate-token", "tokens 4 and 8 "
         "have the same text '[EMPTY_4]': llama.cpp aborts on such a vocabulary")]),
        ({"tokens": _changed({4: ""})}, []),  # one empty text is "[EMPTY_4]"
        ({"tokens": _changed({4: "", 6: ""})}, []),  # two empty texts differ by their ids
        ({"eot_token_id": 10}, [(W, "special-token", "tokenizer.ggml.eot_token_id is 10, past "
         "the 10 tokens: llama.cpp ignores it")]),
        ({"eot_token_id": 9}, []),
        ({"tokens": _tokens(1000), "padding_token_id": 5000, "fim_pre_token_id": 1000},
         [(W, "special-token", "tokenizer.ggml.padding_token_id is 5000, past the 1,000 "
           "tokens: llama.cpp ignores it"),
          (W, "special-token", "tokenizer.ggml.fim_pre_token_id is 1000, past the 1,000 "
           "tokens: llama.cpp ignores it")]),
        ({"middle_token_id": (3, T.INT32)}, [(E, "key-type", "tokenizer.ggml.middle_token_id is "
         "int32; llama.cpp reads it as uint32 and refuses the file")]),
        ({"seperator_token_id": 99, "mask_token_id": (3, T.UINT64)}, [(W, "special-token",
         "tokenizer.ggml.seperator_token_id is 99, past the 10 tokens: llama.cpp ignores it"),
         (E, "key-type", "tokenizer.ggml.mask_token_id is uint64; llama.cpp reads it as uint32 "
          "and refuses the file")]),
        ({"add_bos_token": (1, T.UINT8)}, [(E, "key-type", "tokenizer.ggml.add_bos_token is "
         "uint8; llama.cpp reads it as bool and refuses the file")]),
        ({"add_eos_token": (1, T.INT8)}, [(E, "key-type", "tokenizer.ggml.add_eos_token is "
         "int8; llama.cpp reads it as bool and refuses the file")]),
        ({"normalizer.lowercase": 0}, [(E, "key-type", "tokenizer.ggml.normalizer.lowercase "
         "is uint32; llama.cpp reads it as bool and refuses the file")]),
        ({"bos_token_id": (0, T.INT32)}, [(E, "key-type", "tokenizer.ggml.bos_token_id is "
         "int32; llama.cpp reads it as uint32 and refuses the file")]),
        ({"add_sep_token": 1}, [(E, "key-type", "tokenizer.ggml.add_sep_token is uint32; "
         "llama.cpp reads it as bool and refuses the file")]),
        ({"normalizer.strip_accents": "no"}, [(E, "key-type",
         "tokenizer.ggml.normalizer.strip_accents is string; llama.cpp reads it as bool and "
         "refuses the file")]),
        ({"normalizer.lowercase": True, "add_eos_token": False}, []),
        ({"suppress_tokens": [1, 2]}, []),
        ({"suppress_tokens": (["1"], T.ARRAY, T.STRING)}, [(E, "key-type",
         "tokenizer.ggml.suppress_tokens is array[string], not array[int32]")]),
        ({"add_bos_token": True, "bos_token_id": 50}, [(W, "special-token",
         "tokenizer.ggml.bos_token_id is 50, past the 10 tokens: llama.cpp ignores it"),
         (E, "special-token", "add_bos is set but the vocabulary has no BOS token: llama.cpp "
          "aborts when it tokenizes a prompt")]),
        ({"add_eos_token": True, "eos_token_id": 50, "add_bos_token": True, "bos_token_id": 50},
         [(W, "special-token", "tokenizer.ggml.bos_token_id is 50, past the 10 tokens: "
           "llama.cpp ignores it"),
          (W, "special-token", "tokenizer.ggml.eos_token_id is 50, past the 10 tokens: "
           "llama.cpp ignores it"),
          (E, "special-token", "add_bos is set but the vocabulary has no BOS token: llama.cpp "
           "aborts when it tokenizes a prompt"),
          (E, "special-token", "add_eos is set but the vocabulary has no EOS token: llama.cpp "
           "aborts when it tokenizes a prompt")]),
    ],
)  # fmt: skip
def test_vocab_findings(
    tmp_path: Path, changes: dict[str, Any], expected: list[tuple[str, str, str]]
) -> None:
    assert findings_of(tmp_path, **changes) == expected


def test_vocab_findings_defaults(tmp_path: Path) -> None:
    # Called alone: no BOS or EOS to add unless told.
    path = write_vocab(tmp_path / "f.gguf", bos_token_id=50, eos_token_id=50)
    with GGUFMetadata.open(path) as m:
        assert [f.code for f in vocab_findings(m)] == ["special-token", "special-token"]
        assert [f.severity for f in vocab_findings(m, add_bos=True)][-1] == "error"
        assert vocab_findings(m, add_bos=True, bos=0)[-1].severity == "warning"


T5 = {"model": "t5", "pre": None, "merges": None}
KEY = "tokenizer.ggml.precompiled_charsmap"


@pytest.mark.parametrize(
    ("charsmap", "sub", "problem"),
    [
        (None, None, None),
        (b"\x04\x00\x00\x00abcdX", T.UINT8, None),  # 4 + 4 < 9 bytes
        (b"\x04\x00\x00\x00abcd", T.UINT8, ": its header claims 4 bytes, past its end (8 bytes)"),
        (b"\x00\x00\x00\x00", T.UINT8, ": its header claims 0 bytes, past its end (4 bytes)"),
        (b"\x00\x00\x00\x00X", T.INT8, None),
        (b"\xe8\x03\x00\x00" + bytes(1001), T.UINT8, None),
        (b"\xe8\x03\x00\x00" + bytes(1000), T.UINT8,
         ": its header claims 1,000 bytes, past its end (1,004 bytes)"),
        (b"\x01\x00\x00", T.UINT8, " holds 3 bytes, too few for its header"),
        (b"\x00\x00\x00\x80abcd", T.UINT8,  # unsigned: not a negative size
         ": its header claims 2,147,483,648 bytes, past its end (8 bytes)"),
        (b"\x01", T.INT8, " holds 1 bytes, too few for its header"),
        (b"\x01\x02\x03\x04\x05", T.INT32, " is array[int32], not an array of bytes"),
        (b"abc", T.STRING, " is string, not an array of bytes"),
    ],
)  # fmt: skip
def test_t5_charsmap(
    tmp_path: Path, charsmap: bytes | None, sub: GGUFValueType | None, problem: str | None
) -> None:
    value: Any = None
    if sub == T.STRING:
        value = (charsmap, T.STRING)
    elif charsmap is not None:
        elems = [b - 256 if sub == T.INT8 and b > 127 else b for b in charsmap]
        value = (elems, T.ARRAY, sub)
    expected = [] if problem is None else [(E, "charsmap", f"{KEY}{problem}")]
    assert findings_of(tmp_path, **T5, precompiled_charsmap=value) == expected
    # the charsmap is only a T5 matter
    assert findings_of(tmp_path, precompiled_charsmap=value) == []


# -- check_compatibility: files llama.cpp refuses -----------------------------------------------


def test_check_compatibility_times_the_reading_too(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fake clock that reading each vocabulary advances by 10 s: the check's seconds
    # count from before the files are read.
    import types

    import specgguf.gguf.vocab as vocab_module

    now = [1000.0]
    real = vocab_module.read_vocab

    def slow_read(meta: GGUFMetadata) -> VocabInfo:
        now[0] += 10
        return real(meta)

    monkeypatch.setattr(vocab_module, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(vocab_module, "read_vocab", slow_read)
    r = check_compatibility(tiny_models["target"], tiny_models["draft-identical"])
    assert r.seconds == 20.0


def test_check_compatibility_refuses_a_file_llama_cpp_refuses(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    bad = write_vocab(tmp_path / "bad.gguf", model="bpe\n")
    with pytest.raises(ModelLoadError) as ei:
        check_compatibility(tiny_models["target"], bad)
    assert ei.value.path == bad
    assert ei.value.reasons[0] != "" and "unknown tokenizer model 'bpe\\n'" in ei.value.reasons
    assert all(isinstance(r, str) for r in ei.value.reasons)
    with pytest.raises(ModelLoadError) as e2:
        check_compatibility(bad, tiny_models["target"])
    assert e2.value.path == bad and e2.value.reasons == ei.value.reasons
    # only errors: a file with warnings alone is loadable
    ok = check_compatibility(tiny_models["target"], tiny_models["draft-pad128"])
    assert ok.compatible and ok.target.path == tiny_models["target"]
    assert ok.draft.path == tiny_models["draft-pad128"]
    assert ok.llama_cpp_compatible and 0 < ok.seconds < 10
