"""The child side of :mod:`specgguf.llama.child`: ``python -m specgguf.llama.checks
smoke N`` or ``probe-repack``. Each writes a tiny GGUF model, loads it, generates a few
greedy tokens, and prints one line of JSON.

- ``smoke N``: the settings ``run`` would use (weight repacking as the policy decides).
- ``probe-repack``: weight repacking forced on, with Q8_0 weights of AMX-compatible shapes
  (multiples of 32): the path that crashed on some machines.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path


def generate_tiny(n_tokens: int, *, use_extra_bufts: bool | None) -> dict[str, object]:
    """Greedy-decode ``n_tokens`` from a tiny model; returns what was done."""
    from specgguf.gguf.tiny import TinySpec, gpt2_vocab, write_tiny_model
    from specgguf.llama.backend import LlamaModel

    with tempfile.TemporaryDirectory(prefix="specgguf-check-") as tmp:
        path = Path(tmp) / "tiny.gguf"
        write_tiny_model(path, TinySpec(vocab=gpt2_vocab(), name="specgguf check"))
        with (
            LlamaModel(path, use_extra_bufts=use_extra_bufts) as model,
            model.new_context(n_ctx=128, n_batch=32) as ctx,
        ):
            logits = ctx.eval(model.tokenize("def add(a, b):"), logits="last")
            out = []
            for _ in range(n_tokens):
                tok = int(logits[-1].argmax())
                if not 0 <= tok < model.n_vocab:
                    raise RuntimeError(f"token {tok} outside the vocabulary")
                out.append(tok)
                logits = ctx.eval([tok], logits="last")
            repack = "on" if model.use_extra_bufts else "off"
    return {"tokens": len(out), "detail": f"generated {len(out)} tokens, weight repacking {repack}"}


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "smoke" and argv[1].isdigit():
        result = generate_tiny(int(argv[1]), use_extra_bufts=None)
    elif argv == ["probe-repack"]:
        result = generate_tiny(4, use_extra_bufts=True)
    else:
        sys.stderr.write("usage: python -m specgguf.llama.checks smoke N | probe-repack\n")
        return 2
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
