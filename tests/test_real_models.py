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
