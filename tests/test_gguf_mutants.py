"""Tests of the GGUF vocabulary reader that mutation testing asked for (scripts/mutation-test):
each kills a planted or generated bug that passed the other tests. The oracle is llama.cpp's
own reading of the same file (``llama_vocab_is_eog`` through :class:`LlamaModel`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from specgguf.gguf.info import read_model_info
from specgguf.gguf.tiny import TinySpec, fixture_specs, write_tiny_model
from specgguf.hub import testmodels
from specgguf.llama.backend import LlamaModel


def llama_cpp_eog(path: Path) -> list[int]:
    with LlamaModel(path, vocab_only=True) as m:
        return sorted(m.eog_ids)


def _with_tokens(tmp_path: Path, name: str, extra: list[str], **vocab_changes: object) -> Path:
    spec: TinySpec = fixture_specs()["target"]
    vocab = spec.vocab
    vocab = dataclasses.replace(
        vocab,
        tokens=(*vocab.tokens, *extra),
        types=(*vocab.types, *[1] * len(extra)),
        **vocab_changes,  # type: ignore[arg-type]
    )
    return write_tiny_model(tmp_path / f"{name}.gguf", dataclasses.replace(spec, vocab=vocab))[0]


def test_end_of_generation_tokens_found_by_their_text(tmp_path: Path) -> None:
    # No EOT key: <|im_end|> (id 2) ends generation by its text alone, as do the texts
    # appended at the end of the vocabulary; a text that merely contains one does not.
    n = len(fixture_specs()["target"].vocab.tokens)
    extra = ["<|eot_id|>", "x</s>", "</s>", "<end_of_turn>y", "<|endoftext|>"[:-1], "[EOS]"]
    path = _with_tokens(tmp_path, "eog-text", extra, eot=None)
    eog = list(read_model_info(path).vocab.eog_ids)
    assert eog == [0, 2, n, n + 2, n + 5]
    assert eog == llama_cpp_eog(path)


def test_end_of_generation_tokens_of_the_tiny_fixtures_match_llama_cpp(
    tiny_models: dict[str, Path],
) -> None:
    for name in ("target", "draft-spm", "spm-target", "draft-pad128"):
        assert list(read_model_info(tiny_models[name]).vocab.eog_ids) == llama_cpp_eog(
            tiny_models[name]
        ), name


@pytest.mark.real_models
def test_qwen_end_of_generation_tokens(real_models: dict[str, Path]) -> None:
    # Qwen2.5: EOS is <|im_end|> (151645); <|endoftext|> (151643) ends generation by its
    # text, as does "</s>" (128247). llama.cpp also ends generation on the FIM pad,
    # repo and separator tokens (151662-151664), which the reader does not list (they
    # are found by token type and FIM keys, not by text): a subset, and the rest known.
    for name in (testmodels.TARGET, testmodels.DRAFT):
        eog = list(read_model_info(real_models[name]).vocab.eog_ids)
        assert {151643, 151645} <= set(eog)
        theirs = llama_cpp_eog(real_models[name])
        assert set(eog) <= set(theirs)
        assert set(theirs) - set(eog) <= {151662, 151663, 151664}


HTML = "an HTML page, not a GGUF file (a failed or redirected download?)"
JSON = "a JSON document, not a GGUF file (an error response from a server?)"
LEGACY = "a legacy GGML file (before GGUF); convert it with llama.cpp"


@pytest.mark.parametrize(
    ("head", "reason"),
    [
        (b"GGU", "the file is only 3 bytes, not a GGUF file"),
        (b"\n  version https://git-lfs.github.com/spec/v1",
         "a Git LFS pointer file, not the model itself (run `git lfs pull`)"),
        *[(prefix + b" ...", HTML) for prefix in
          (b"  <!DOCTYPE HTML", b"<HTML>", b"<?XML version", b"<HEAD>")],
        (b"{\"error\": 1}", JSON),
        (b"[1, 2]", JSON),
        (b"FUGG\x00\x00\x00\x03",
         "byte-swapped GGUF magic: a big-endian file, which llama.cpp cannot load here"),
        *[(magic + b"\x00" * 8, LEGACY) for magic in
          (b"ggml", b"ggmf", b"ggjt", b"lmgg", b"fmgg", b"tjgg")],
        (b"PK\x03\x04", "a zip archive, not a GGUF file"),
        (b"GGML\x00", "not a GGUF file (the first bytes are b'GGML', expected b'GGUF')"),
        (b"abcd", "not a GGUF file (the first bytes are b'abcd', expected b'GGUF')"),
    ],
)  # fmt: skip
def test_what_is_found_in_place_of_a_gguf_file_is_named(head: bytes, reason: str) -> None:
    from specgguf.gguf.metadata import _not_gguf_reason

    # The size is the file's: the head's own length (4 bytes are enough for a reason).
    assert _not_gguf_reason(head, len(head)) == reason


def test_long_or_unprintable_names_are_cut_with_their_length() -> None:
    from specgguf.gguf.metadata import shown

    assert shown("a" * 80) == "a" * 80  # the limit itself: as it is
    assert shown("a" * 81) == "a" * 60 + "... (81 characters)"
    assert shown("a" * 20, limit=10) == "a" * 0 + "... (20 characters)"
    # Quoted, 80 characters become 82: cut too, though the name is within the limit.
    assert shown("b" * 80, quote=True) == "'" + "b" * 59 + "... (80 characters)"
    assert shown("b" * 78, quote=True) == "'" + "b" * 78 + "'"


def _string_array(tmp_path: Path, count: int, elements: bytes) -> Path:
    """A GGUF file with one key "k": an array of ``count`` strings at byte 49, then
    ``elements`` (length-prefixed strings) and nothing more."""
    import struct

    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
    kv = struct.pack("<Q", 1) + b"k" + struct.pack("<I", 9) + struct.pack("<IQ", 8, count)
    path = tmp_path / "strings.gguf"
    path.write_bytes(head + kv + elements)
    return path


@pytest.mark.parametrize(
    ("count", "elements", "reason", "offset"),
    [
        # "ab" (bytes 49-58), then a length of 5 at 59 with 3 bytes left: past the end.
        (2, b"\x02" + bytes(7) + b"ab" + b"\x05" + bytes(7) + b"xyz",
         "k: element 1 of 2 claims 5 bytes, past the end of the file (truncated?)", 59),
        # "abcdefgh" ending exactly at the end of the file: the second is missing.
        (2, b"\x08" + bytes(7) + b"abcdefgh",
         "k: the file ends inside a string array, at element 1 of 2 (truncated?)", 65),
        # A length of 100 whose 8 bytes end exactly at the end of the file.
        (2, b"\x02" + bytes(7) + b"ab" + b"\x64" + bytes(7),
         "k: element 1 of 2 claims 100 bytes, past the end of the file (truncated?)", 59),
        # The largest unsigned length (not a negative one).
        (1, b"\xff" * 8, "k: element 0 of 1 claims 18,446,744,073,709,551,615 bytes, past the "
         "end of the file (truncated?)", 49),
    ],
)  # fmt: skip
def test_the_first_bad_string_of_an_array_is_named(
    tmp_path: Path, count: int, elements: bytes, reason: str, offset: int
) -> None:
    from specgguf.errors import GGUFFormatError
    from specgguf.gguf.metadata import GGUFMetadata

    with pytest.raises(GGUFFormatError) as ei:
        GGUFMetadata.open(_string_array(tmp_path, count, elements))
    assert (ei.value.reason, ei.value.offset) == (reason, offset)
