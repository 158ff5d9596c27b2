"""Gemma 4's MTP assistant (``--drafter assistant``; llama.cpp's ``--spec-type draft-mtp``
with the assistant as ``-md``) on the tiny generated ``gemma4`` target (a sliding-window
and a full-attention layer) and its ``gemma4-assistant`` (two blocks half as wide reading
those layers' cache). Weights are random: nearly every draft is rejected, which makes each
step's draft depend only on the assistant's reading of the target's cache and hidden
state, compared step by step with llama.cpp's (``llama-speculative-simple -v``, when
``scripts/bench-llama-cpp --build-only`` built it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from specgguf.engine import Engine, EngineConfig, ModelConfig, SpeculativeConfig
from specgguf.measure.bench import generate_together
from specgguf.speculative.drafters.assistant import AssistantDrafter
from specgguf.speculative.loop import GenerationParams
from specgguf.speculative.sampling import SamplerParams

from .helpers import check_head_choice, record_drafts, run_cli
from .test_mtp_oracle import run_llama

PROMPTS = ["def is_palindrome(text):", "The quick brown fox", "for i in range(10):\n"]
GREEDY = SamplerParams(temperature=0.0)


def engine(tiny: dict[str, Path], drafter: str, k: int = 4, *, assistant: bool = True,
           **kw: Any) -> Engine:  # fmt: skip
    threads = kw.pop("n_threads", None)
    return Engine(EngineConfig(
        ModelConfig(tiny["gemma4"], n_ctx=512, n_threads=threads),
        ModelConfig(tiny["gemma4-assistant"], n_ctx=512, n_threads=threads) if assistant
        else None,
        SpeculativeConfig(drafter=drafter, draft_max=k), **kw,
    ))  # fmt: skip


@pytest.fixture(scope="module")
def alone(tiny_models: dict[str, Path]) -> list[list[int]]:
    params = GenerationParams(n_predict=80, sampler=GREEDY, ignore_eos=True)
    with engine(tiny_models, "none", assistant=False) as e:
        return [e.generate(p, params).run().tokens for p in PROMPTS]


@pytest.mark.parametrize("drafter", ["assistant", "auto"])
def test_greedy_output_is_the_targets_own(
    tiny_models: dict[str, Path], alone: list[list[int]], drafter: str
) -> None:
    with engine(tiny_models, drafter, 16) as e:
        assert e.head_kind == "assistant" and e.draft_ctx is None  # a head, not a draft model
        drafted = 0
        for k in (1, 4, 16):
            for p, want in zip(PROMPTS, alone, strict=True):
                params = GenerationParams(n_predict=80, draft_max=k, sampler=GREEDY,
                                          ignore_eos=True)  # fmt: skip
                res = e.generate(p, params).run()
                assert res.tokens == want, (k, p)
                if (st := res.stats.by_drafter.get("assistant")) is not None:
                    drafted += st.drafted
    if drafter == "assistant":
        assert drafted > 0


@pytest.mark.parametrize("k", [1, 4, 16])
def test_the_assistant_drafts_as_llama_cpp(
    k: int, tools: Path, tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same tokens as llama.cpp's ``draft-mtp`` with the assistant, and the same draft
    at every step (the comparable steps of tests/test_mtp_oracle.py)."""
    n = 48
    prompt = "Speculative decoding makes"
    llama = run_llama(tools, tiny_models["gemma4"], k, n, spec_type="draft-mtp",
                      draft=tiny_models["gemma4-assistant"], prompt=prompt)  # fmt: skip
    drafts = record_drafts(monkeypatch, AssistantDrafter)
    with engine(tiny_models, "assistant", k, n_threads=1) as e:
        ids = e.target_model.tokenize(prompt, add_special=True, parse_special=True)
        assert len(ids) == llama.n_prompt
        params = GenerationParams(n_predict=n, draft_max=k, sampler=GREEDY, ignore_eos=True)
        result = e.generate(ids, params).run()
    assert result.tokens == llama.tokens[:n]
    comparable = [s for s in llama.steps if s.produced < n - 1]
    assert sum(len(s.draft) for s in comparable) > n // 2  # it drafted: not a vacuous check
    for i, (ours, theirs) in enumerate(zip(drafts, comparable, strict=True)):
        assert ours == theirs.draft, f"step {i} (after {theirs.produced} tokens)"
    assert result.stats.drafted == sum(len(s.draft) for s in comparable)
    assert result.stats.accepted == sum(s.accepted for s in comparable)


def test_each_parallel_sequence_drafts_from_its_own_cache(
    tiny_models: dict[str, Path], alone: list[list[int]]
) -> None:
    """Each sequence's assistant reads its own sequence of the target's cache."""
    params = GenerationParams(n_predict=80, sampler=GREEDY, ignore_eos=True)
    with engine(tiny_models, "assistant") as one:
        each = [one.generate(p, params).run() for p in PROMPTS]
    with engine(tiny_models, "assistant", n_parallel=3) as three:
        assert len(three.heads) == 3
        together = generate_together(three, PROMPTS, params)[0]
    assert [r.tokens for r in together] == [r.tokens for r in each] == alone
    assert [r.stats.drafted for r in together] == [r.stats.drafted for r in each]
    assert [r.stats.accepted for r in together] == [r.stats.accepted for r in each]


def test_an_assistant_is_taken_for_what_it_is(tiny_models: dict[str, Path]) -> None:
    """``-md`` an assistant: ``--draft K`` drafts with it, and llama.cpp's ``--spec-type
    draft-mtp`` names it; ``--drafter model`` or ``eagle3`` with it, ``--drafter
    assistant`` without one, and an assistant beside a target of another architecture
    are refused in one line (exit 2); ``info`` says what it needs."""
    t, a = str(tiny_models["gemma4"]), str(tiny_models["gemma4-assistant"])
    base = ["run", "-m", t, "-n", "12", "--temp", "0", "--ignore-eos", "--json", "hi"]
    check_head_choice(
        base, "assistant",
        [["-md", a, "--draft", "4"], ["-md", a, "--spec-type", "draft-mtp"]],
        [(["-md", a, "--drafter", "model"], "is a gemma4-assistant head, not a draft model"),
         (["-md", a, "--drafter", "eagle3"], "it drafts as the assistant drafter"),
         (["--drafter", "assistant"], "needs an MTP assistant as its draft model: give it"),
         (["-md", str(tiny_models["eagle3"]), "--drafter", "assistant"], "is an eagle3 head")],
    )  # fmt: skip
    res = run_cli("run", "-m", str(tiny_models["target"]), "-md", a, "-n", "4", "hi")
    err = res.stderr.decode()
    assert res.returncode == 2 and "drafts for a gemma4 target, and this one is llama" in err
    res = run_cli("info", a)
    assert (
        "a gemma4-assistant head for a target 64 wide, reading its KV cache" in res.stdout.decode()
    )


def test_check_says_which_target_an_assistant_drafts_for(tiny_models: dict[str, Path]) -> None:
    """``check`` finds what ``run`` refuses: an assistant beside a llama target."""
    res = run_cli("check", str(tiny_models["target"]), str(tiny_models["gemma4-assistant"]))
    out = res.stdout.decode()
    assert res.returncode == 4 and "[head-fit]" in out, out
    assert "the MTP assistant drafts for a gemma4 target, and this one is llama" in out
    res = run_cli("check", str(tiny_models["gemma4"]), str(tiny_models["gemma4-assistant"]))
    assert res.returncode == 0, res.stdout


def test_mtp_means_the_assistant_where_one_was_loaded(
    tiny_models: dict[str, Path], alone: list[list[int]]
) -> None:
    """llama.cpp's draft-mtp drafts with an MTP assistant given as -md: a request's
    ``speculative.drafter`` ``mtp`` (or ``draft-mtp``) does here too, as ``--drafter mtp``."""
    params = GenerationParams(n_predict=80, sampler=GREEDY, ignore_eos=True, drafter="mtp")
    with engine(tiny_models, "auto") as e:
        assert e.missing("mtp") is None
        res = e.generate(PROMPTS[0], params).run()
    assert res.tokens == alone[0]
    assert set(res.stats.by_drafter) <= {"assistant", "none"} and res.stats.drafted > 0
