"""The real Qwen2.5-Coder pair runs through llama.cpp (skipped when the files are absent)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specgguf.hub import testmodels
from specgguf.llama.backend import LlamaModel

pytestmark = pytest.mark.real_models


@pytest.mark.parametrize("name", [testmodels.TARGET, testmodels.DRAFT])
def test_real_qwen_model_generates_greedy_tokens(real_models: dict[str, Path], name: str) -> None:
    with LlamaModel(real_models[name]) as model, model.new_context(n_ctx=256) as ctx:
        assert model.n_vocab == 151_936
        assert model.eos == 151_645  # <|im_end|>
        logits = ctx.eval(model.tokenize("The capital of France is"), logits="last")
        assert logits.shape == (1, 151_936)
        out = []
        for _ in range(6):
            tok = int(logits[-1].argmax())
            out.append(tok)
            logits = ctx.eval([tok], logits="last")
        text = model.detokenize(out).decode("utf-8")
    assert "Paris" in text, text


def test_min_tokens_is_a_lower_bound_on_qwens_vocabulary(real_models: dict[str, Path]) -> None:
    # Qwen2.5's control and added tokens (the chat, fill-in-the-middle and tool texts):
    # each is one token wherever it stands, so a text of them alone is counted exactly,
    # and a text mixed with prose at most to its token count.
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|fim_prefix|>",
                "<|fim_middle|>", "<|fim_suffix|>", "<|file_sep|>", "<tool_call>"]  # fmt: skip
    with LlamaModel(real_models[testmodels.TARGET], vocab_only=True) as m:
        pure = "".join(specials) * 25
        assert m.min_tokens(pure) == len(specials) * 25 == len(m.tokenize(pure, add_special=False))
        mixed = "".join(f"{s}word {s[:4]} |>" for s in specials * 10)
        n = len(m.tokenize(mixed, add_special=False))
        assert m.min_tokens(mixed) == 2 * len(specials) * 10 <= n  # a piece after each
