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
