"""Streaming text: only complete UTF-8 code points, across verify steps and rejections."""

from __future__ import annotations

import io
from collections.abc import Sequence

from specgguf.speculative.loop import GenerationParams, SpeculativeDecoder
from specgguf.speculative.planner import FixedPlanner
from specgguf.speculative.sampling import SamplerParams
from specgguf.speculative.streaming import TextStream

from .fakes import FakeContext, FakeVocab, ScriptedDrafter, one_hot_rule

ROCKET = "\U0001f680".encode()  # 4 bytes: F0 9F 9A 80
V = 16
# Token 1 and 2 carry the two halves of the emoji; 3 is "A", 4 is "B", 5 is "é" (2 bytes).
PIECES = {1: ROCKET[:2], 2: ROCKET[2:], 3: b"A", 4: b"B", 5: "é".encode(), 6: b"\xc3", 7: b"\xa9"}
SEQUENCE = [3, 1, 2, 4, 1, 2, 6, 7, 3, 1, 2]  # what the target generates after the prompt
EXPECTED = "A\U0001f680B\U0001f680éA\U0001f680".encode()


def target_next(prefix: Sequence[int]) -> int:
    i = len(prefix) - 1  # prompt is one token
    return SEQUENCE[i] if i < len(SEQUENCE) else 15


def test_text_stream_holds_partial_characters() -> None:
    ts = TextStream()
    assert ts.push(ROCKET[:2]) == ""
    assert ts.push(ROCKET[2:3]) == ""
    assert ts.push(ROCKET[3:] + b"x") == "\U0001f680x"
    assert ts.push(b"\xc3") == ""
    assert ts.finish() == "\ufffd"  # a character cut off at the very end
    assert ts.text == "\U0001f680x\ufffd"


def test_stop_string_prefix_is_held_back() -> None:
    ts = TextStream(["END"])
    assert ts.push(b"abcE") == "abc"
    assert ts.push(b"N") == ""
    assert ts.push(b"Dxyz") == ""
    assert ts.stopped and ts.stop_string == "END" and ts.text == "abc"
    ts2 = TextStream(["END"])
    assert ts2.push(b"abcE") == "abc"
    assert ts2.push(b"x") == "Ex"  # not a stop after all: released


def generate(drafter_script, k: int):  # type: ignore[no-untyped-def]
    """Run the loop; returns (pieces, stdout bytes, stats)."""
    ctx = FakeContext(one_hot_rule(target_next, V), V)
    vocab = FakeVocab(V, eog_ids=[15], pieces=PIECES)
    drafter = ScriptedDrafter(drafter_script) if drafter_script else None
    dec = SpeculativeDecoder(ctx, vocab)  # type: ignore[arg-type]
    params = GenerationParams(sampler=SamplerParams(temperature=0))
    gen = dec.generate([0], params, FixedPlanner(drafter, k))
    out = io.BytesIO()
    pieces = []
    for piece in gen:  # what the CLI does: write each piece's bytes and flush
        pieces.append(piece)
        out.write(piece.encode())
    assert gen.result is not None
    return pieces, out.getvalue(), gen.result.stats


def test_emoji_split_across_a_verify_boundary() -> None:
    # The draft is always right, so a step commits K + 1 tokens, and the emoji's halves
    # (tokens 1 and 2) fall into different steps for K = 1 and K = 3.
    def oracle(h: Sequence[int], k: int) -> list[int]:
        return [target_next([*h, *([0] * i)]) for i in range(k)]

    for k in (1, 2, 3, 4):
        pieces, data, _ = generate(oracle, k)
        assert data == EXPECTED
        assert all("\ufffd" not in p for p in pieces)
    pieces, _, _ = generate(oracle, 1)
    # With K = 1 a step commits 2 tokens: [3, 1] then [2, 4]: the first half of the emoji
    # is held back until the step that commits its second half.
    assert pieces[0] == "A"
    assert pieces[1] == "\U0001f680B"


def test_emoji_at_a_rejection() -> None:
    # The draft proposes the emoji's first half, then a wrong second half: the target
    # rejects it and supplies the right one. The wrong bytes never reach the output.
    def wrong_second_half(h: Sequence[int], k: int) -> list[int]:
        out = [target_next([*h, *([0] * i)]) for i in range(k)]
        return [5 if t == 2 else t for t in out]

    for k in (2, 3, 5):
        pieces, data, stats = generate(wrong_second_half, k)
        assert data == EXPECTED
        assert "\ufffd" not in "".join(pieces)
        assert stats.accepted < stats.drafted  # the wrong halves were really rejected
    _, baseline, _ = generate(None, 0)
    assert baseline == EXPECTED


def test_finish_releases_a_held_stop_string_prefix() -> None:
    # "E" could start "END", so push holds it back; at the end of generation it is text.
    ts = TextStream(["END"])
    assert ts.push(b"abcE") == "abc"
    assert ts.finish() == "E"
    assert ts.text == "abcE" and not ts.stopped
    # finish() is also where a stop string completed by the last bytes is cut.
    ts = TextStream(["END"])
    assert ts.push(b"xEN") == "x"
    assert ts.push(b"D") == "" and ts.stop_string == "END"
    assert ts.finish() == "" and ts.text == "x"


def test_the_earliest_of_several_stop_strings_wins() -> None:
    # "b" starts before "xyz" does: the output ends before "b", whatever the list order.
    for stops in (["xyz", "b"], ["b", "xyz"]):
        ts = TextStream(stops)
        assert ts.push(b"abxyz") == "a"
        assert ts.stop_string == "b" and ts.text == "a"
    # The one that starts first wins, though listed last and longer.
    ts = TextStream(["cd", "abcdef"])
    assert ts.push(b"zabcdef") == "z" and ts.stop_string == "abcdef"


def test_held_suffix_is_the_longest_that_could_start_any_stop_string() -> None:
    ts = TextStream(["abcd", "cx"])
    # "abc" could become "abcd"; "c" alone could become "cx": the longer hold wins.
    assert ts.push(b"zzabc") == "zz"
    assert ts.push(b"y") == "abcy"
    ts = TextStream(["xy", "xxxy"])
    assert ts.push(b"qxxx") == "q"  # "xxx" could still become "xxxy"
    assert ts.push(b"x") == "x"  # "xxxx": "xxx" is still a prefix of "xxxy"
    # "xxxy" starts before "xy": the earliest stop string cuts.
    assert ts.push(b"y") == "" and ts.stop_string == "xxxy" and ts.text == "qx"


def test_nothing_after_a_stop_and_empty_stop_strings_ignored() -> None:
    ts = TextStream(["", "S"])
    assert ts.push(b"aSb") == "a"
    assert ts.push(b"more") == "" and ts.finish() == ""
    assert ts.text == "a"
    plain = TextStream([""])
    assert plain.push(b"abc") == "abc" and not plain.stopped


def test_a_stop_string_that_occurs_twice_cuts_at_its_first_occurrence() -> None:
    ts = TextStream(["b"])
    assert ts.push(b"abab") == "a" and ts.text == "a"
