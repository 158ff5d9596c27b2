"""Several MTP blocks chained (llama.cpp's ``draft-mtp`` with ``llama_set_nextn_layer_offset``)
on the tiny ``mtp-heads`` fixture of :mod:`specgguf.gguf.tiny`: a Hunyuan V3 target with
two MTP blocks, block j drafting a draft's (j + 1)-th token. tests/test_mtp_oracle.py
compares its drafts with llama.cpp's step by step; here: output, the bound on a draft,
``--parallel`` and the head's own checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specgguf.engine import Engine, EngineConfig, ModelConfig, SpeculativeConfig
from specgguf.measure.bench import generate_together
from specgguf.speculative.loop import GenerationParams
from specgguf.speculative.sampling import SamplerParams

from .helpers import run_cli

PROMPTS = ["def is_palindrome(text):", "The quick brown fox", "for i in range(10):\n"]
GREEDY = SamplerParams(temperature=0.0)


def engine(tiny: dict[str, Path], drafter: str, k: int = 4, n_parallel: int = 1) -> Engine:
    return Engine(EngineConfig(
        ModelConfig(tiny["mtp-heads"], n_ctx=512), None,
        SpeculativeConfig(drafter=drafter, draft_max=k), n_parallel=n_parallel,
    ))  # fmt: skip


@pytest.fixture(scope="module")
def alone(tiny_models: dict[str, Path]) -> list[list[int]]:
    params = GenerationParams(n_predict=60, sampler=GREEDY, ignore_eos=True)
    with engine(tiny_models, "none") as e:
        return [e.generate(p, params).run().tokens for p in PROMPTS]


@pytest.mark.parametrize("drafter", ["mtp", "auto"])
def test_greedy_output_is_the_targets_own(
    tiny_models: dict[str, Path], alone: list[list[int]], drafter: str
) -> None:
    """K in {1, 4, 16}: the target's own tokens; a draft has at most two tokens (one per
    block), and with K > 1 the second block drafts."""
    with engine(tiny_models, drafter, 16) as e:
        assert e.heads[0].n_heads == 2
        drafted = accepted = second = 0
        for k in (1, 4, 16):
            for p, want in zip(PROMPTS, alone, strict=True):
                params = GenerationParams(n_predict=60, draft_max=k, sampler=GREEDY,
                                          ignore_eos=True)  # fmt: skip
                res = e.generate(p, params).run()
                assert res.tokens == want, (k, p)
                if (st := res.stats.by_drafter.get("mtp")) is not None:
                    assert st.drafted <= min(k, 2) * st.steps
                    drafted += st.drafted
                    accepted += st.accepted
                    second += k > 1 and st.drafted > st.steps
    if drafter == "mtp":
        assert accepted > 0 and second == 2 * len(PROMPTS)


def test_each_parallel_sequence_drafts_from_its_own_rows(
    tiny_models: dict[str, Path], alone: list[list[int]]
) -> None:
    params = GenerationParams(n_predict=60, sampler=GREEDY, ignore_eos=True)
    with engine(tiny_models, "mtp") as one:
        each = [one.generate(p, params).run() for p in PROMPTS]
    with engine(tiny_models, "mtp", n_parallel=3) as three:
        assert len(three.heads) == 3
        together = generate_together(three, PROMPTS, params)[0]
    assert [r.tokens for r in together] == [r.tokens for r in each] == alone
    assert [r.stats.drafted for r in together] == [r.stats.drafted for r in each]
    assert [r.stats.accepted for r in together] == [r.stats.accepted for r in each]
    assert sum(r.stats.accepted for r in each) > 0


def test_a_block_reads_the_draft_so_far(tiny_models: dict[str, Path]) -> None:
    """``chain`` takes block j with the j + 1 rows of the draft so far, and nothing else;
    the same rows give the same logits again (the cells block 0 left are taken again)."""
    with engine(tiny_models, "mtp") as e:
        head = e.heads[0]
        n = 5
        toks = e.target_model.tokenize("The quick brown fox", add_special=True)[:n]
        rows = np.random.default_rng(0).standard_normal((n, head.n_embd)).astype(np.float32)
        head.rollback(0)
        head.eval(toks[:-1], rows[:-1], last=False)
        first = head.eval(toks[-1:], rows[-1:], last=True)
        assert first is not None and head.n_past == n
        draft = [int(first[0].argmax())]
        chained = np.stack([rows[-1], first[1]])
        a = head.chain(1, [toks[-1], *draft], chained)
        a_logits, a_h = a[0].copy(), a[1]
        assert head.n_past == n + 1
        head.rollback(n)
        b = head.chain(1, [toks[-1], *draft], chained)
        assert np.array_equal(a_logits, b[0]) and np.array_equal(a_h, b[1])
        for block, tokens in ((2, [1, 2, 3]), (0, [1]), (1, [1, 2, 3])):
            with pytest.raises(ValueError, match="reads"):
                head.chain(block, tokens, np.zeros((len(tokens), head.n_embd), np.float32))
        head.rollback(0)


def test_the_calibration_times_a_whole_chained_draft(tiny_models: dict[str, Path]) -> None:
    """Auto mode's cost per token of chained blocks is a whole draft's (block 1 reads two
    rows) over its tokens, and leaves the head as it found it: empty, block 0 drafting
    (the next draft's first token equals a fresh head's)."""
    with engine(tiny_models, "mtp") as e:
        head = e.heads[0]
        rows = np.random.default_rng(1).standard_normal((3, head.n_embd)).astype(np.float32)
        head.rollback(0)
        fresh = head.eval([5, 6, 7], rows, last=True)
        assert fresh is not None
        want = fresh[0].copy()
        head.rollback(0)
        seconds = head.token_seconds(repeats=3)
        assert seconds > 0 and head.n_past == 0
        again = head.eval([5, 6, 7], rows, last=True)
        assert again is not None and np.array_equal(again[0], want)
        head.rollback(0)


def test_a_longer_draft_is_said(tiny_models: dict[str, Path]) -> None:
    res = run_cli("run", "-m", str(tiny_models["mtp-heads"]), "--drafter", "mtp", "--draft",
                  "8", "-n", "8", "--temp", "0", "--ignore-eos", "hi")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert (b"a draft length of 8 does not fit tiny-mtp-heads.gguf's 2 chained MTP blocks "
            b"(one token each): its drafts have at most 2 tokens") in res.stderr  # fmt: skip


def test_draft_k_alone_drafts_with_the_targets_layers(tiny_models: dict[str, Path]) -> None:
    """``--draft K`` without a drafter or a draft model on a target that carries MTP layers
    drafts with them at K (as llama.cpp picks draft-mtp from the file), and says so."""
    import json

    res = run_cli("run", "-m", str(tiny_models["mtp-heads"]), "--draft", "2", "-n", "8",
                  "--temp", "0", "--ignore-eos", "--json", "hi")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert b"carries 2 multi-token-prediction layer(s): --draft K drafts with them" in res.stderr
    out = json.loads(res.stdout)
    assert set(out["stats"]["by_drafter"]) <= {"mtp", "none"}
    assert out["stats"]["by_drafter"]["mtp"][1] > 0
