"""EAGLE-3 heads (``--drafter eagle3``, llama.cpp's ``--spec-type draft-eagle3``) on the
tiny generated heads of :mod:`specgguf.gguf.tiny` for the tiny llama target: ``eagle3``
(its own token embeddings and LM head) and ``eagle3-d2t`` (the target's embeddings, a
reduced vocabulary of 256 ids mapped by ``d2t``). Their weights are random: nearly every
draft is rejected, which makes each step's draft depend only on the head's own decoding
of the committed text, compared step by step with llama.cpp's (``llama-speculative-simple
-v``, when ``scripts/bench-llama-cpp --build-only`` built it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specgguf.engine import Engine, EngineConfig, ModelConfig, SpeculativeConfig
from specgguf.measure.bench import generate_together
from specgguf.speculative.drafters.eagle3 import Eagle3Drafter
from specgguf.speculative.loop import GenerationParams
from specgguf.speculative.sampling import SamplerParams

from .helpers import check_head_choice, record_drafts, run_cli
from .test_mtp_oracle import run_llama

HEADS = ["eagle3", "eagle3-d2t"]
PROMPTS = ["def is_palindrome(text):", "The quick brown fox", "for i in range(10):\n"]
GREEDY = SamplerParams(temperature=0.0)


def engine(tiny: dict[str, Path], head: str | None, drafter: str, k: int = 4, **kw: Any) -> Engine:
    threads = kw.pop("n_threads", None)
    return Engine(EngineConfig(
        ModelConfig(tiny["target"], n_ctx=512, n_threads=threads),
        ModelConfig(tiny[head], n_ctx=512, n_threads=threads) if head else None,
        SpeculativeConfig(drafter=drafter, draft_max=k), **kw,
    ))  # fmt: skip


@pytest.fixture(scope="module")
def alone(tiny_models: dict[str, Path]) -> list[list[int]]:
    params = GenerationParams(n_predict=80, sampler=GREEDY, ignore_eos=True)
    with engine(tiny_models, None, "none") as e:
        return [e.generate(p, params).run().tokens for p in PROMPTS]


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("drafter", ["eagle3", "auto"])
def test_greedy_output_is_the_targets_own(
    tiny_models: dict[str, Path], alone: list[list[int]], head: str, drafter: str
) -> None:
    with engine(tiny_models, head, drafter, 16) as e:
        assert e.head_kind == "eagle3" and e.draft_ctx is None  # a head, not a draft model
        assert e.target_ctx.layer_inputs == (0, 1, 1)
        drafted = 0
        for k in (1, 4, 16):
            for p, want in zip(PROMPTS, alone, strict=True):
                params = GenerationParams(n_predict=80, draft_max=k, sampler=GREEDY,
                                          ignore_eos=True)  # fmt: skip
                res = e.generate(p, params).run()
                assert res.tokens == want, (k, p)
                if (st := res.stats.by_drafter.get("eagle3")) is not None:
                    drafted += st.drafted
    if drafter == "eagle3":
        assert drafted > 0


def test_a_reduced_vocabulary_drafts_only_its_ids(tiny_models: dict[str, Path]) -> None:
    """The head with ``d2t`` proposes only the 256 target ids it maps to (every other
    one: the tiny fixture maps draft id i to target id 2i); the one without proposes
    others too."""
    seen: dict[str, set[int]] = {}
    for head in HEADS:
        params = GenerationParams(n_predict=60, draft_max=4, sampler=GREEDY, ignore_eos=True)
        with engine(tiny_models, head, "eagle3") as e:
            d = e.own.drafter(Eagle3Drafter)
            assert d is not None
            tokens: set[int] = set()

            def spy(*a: Any, _propose: Any = d.propose, _seen: set[int] = tokens, **kw: Any) -> Any:
                draft = _propose(*a, **kw)
                _seen.update(draft.tokens)
                return draft

            d.propose = spy  # type: ignore[method-assign]
            for p in PROMPTS:
                e.generate(p, params).run()
        seen[head] = tokens
    assert seen["eagle3-d2t"] and all(t % 2 == 0 and t < 512 for t in seen["eagle3-d2t"])
    assert any(t % 2 for t in seen["eagle3"])


def test_each_parallel_sequence_drafts_from_its_own_hidden_states(
    tiny_models: dict[str, Path], alone: list[list[int]]
) -> None:
    params = GenerationParams(n_predict=80, sampler=GREEDY, ignore_eos=True)
    with engine(tiny_models, "eagle3", "eagle3") as one:
        each = [one.generate(p, params).run() for p in PROMPTS]
    with engine(tiny_models, "eagle3", "eagle3", n_parallel=3) as three:
        assert len(three.heads) == 3
        together = generate_together(three, PROMPTS, params)[0]
    assert [r.tokens for r in together] == [r.tokens for r in each] == alone
    assert [r.stats.drafted for r in together] == [r.stats.drafted for r in each]


def test_a_head_is_taken_for_what_it_is(tiny_models: dict[str, Path]) -> None:
    """``-md`` an EAGLE-3 head: ``--draft K`` drafts with it (as llama.cpp chooses the
    drafter from the file), ``--spec-type draft-eagle3`` names it; ``--drafter model``
    with it, and ``--drafter eagle3`` with a draft model or none, are refused in one line."""
    t, head = str(tiny_models["target"]), str(tiny_models["eagle3"])
    base = ["run", "-m", t, "-n", "12", "--temp", "0", "--ignore-eos", "--json", "hi"]
    check_head_choice(
        base, "eagle3",
        [["-md", head, "--draft", "4"], ["-md", head, "--spec-type", "draft-eagle3"]],
        [(["-md", head, "--drafter", "model"], "is an eagle3 head, not a draft model"),
         (["-md", str(tiny_models["draft-partial"]), "--drafter", "eagle3"], "needs an EAGLE-3"),
         (["--drafter", "eagle3"], "needs an EAGLE-3 head as its draft model: give it with -md")],
    )  # fmt: skip


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("k", [1, 4, 16])
def test_eagle3_drafts_as_llama_cpp(
    k: int, head: str, tools: Path, tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same tokens as llama.cpp's ``draft-eagle3``, and the same draft at every step
    (the comparable steps of tests/test_mtp_oracle.py)."""
    n = 48
    prompt = "Speculative decoding makes"
    llama = run_llama(tools, tiny_models["target"], k, n, spec_type="draft-eagle3",
                      draft=tiny_models[head], prompt=prompt)  # fmt: skip
    drafts = record_drafts(monkeypatch, Eagle3Drafter)
    with engine(tiny_models, head, "eagle3", k, n_threads=1) as e:
        vocab = e.target_model
        ids = vocab.tokenize(prompt, add_special=True, parse_special=True)
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


def test_the_heads_rows_are_llama_cpps_encoder_and_decoder(tiny_models: dict[str, Path]) -> None:
    """The head's encoder output differs per position, and the decoder's logits over a
    reduced vocabulary are -inf exactly off the ids ``d2t`` maps to."""
    from specgguf.llama.backend import Eagle3Head, LlamaModel, head_target_layers

    with LlamaModel(tiny_models["target"]) as t, LlamaModel(tiny_models["eagle3-d2t"]) as d:
        layers = head_target_layers(d)
        assert layers == (0, 1, 1)
        with t.new_context(n_ctx=256, n_batch=64, layer_inputs=layers) as ctx:
            ids = t.tokenize("The quick brown fox")
            ctx.eval(ids, logits="none")
            h = ctx.hidden_rows(0, len(ids))
            assert h.shape == (len(ids), 3 * 64) and np.array_equal(h[:, 64:128], h[:, 128:])
            with Eagle3Head(d, ctx) as head:
                g = head.encode(h)
                assert g.shape == (len(ids), 64) and not np.allclose(g[0], g[1])
                out = head.eval([*ids[1:], ids[0]], g, last=True)
                assert out is not None and head.n_past == len(ids)
                logits = np.array(out[0])  # (a view of llama.cpp's buffer until then)
    finite = np.flatnonzero(np.isfinite(logits))
    assert np.array_equal(finite, np.arange(0, 512, 2))


def test_a_target_whose_graph_keeps_no_layer_inputs_is_refused(
    tiny_models: dict[str, Path],
) -> None:
    """llama.cpp records layer inputs only in some architectures' graphs and aborts the
    process for the others at the first decode: mamba2 (as qwen2) is refused before, in
    one line, and the backend raises rather than let llama.cpp abort."""
    from specgguf.errors import BackendError
    from specgguf.llama.backend import LlamaModel

    for drafter in ("eagle3", "auto"):
        target, head = str(tiny_models["recurrent"]), str(tiny_models["eagle3"])
        res = run_cli("run", "-m", target, "-md", head, "--drafter", drafter, "-n", "4", "hi")
        err = res.stderr.decode()
        assert res.returncode == 2 and "keeps no layer inputs of a mamba2 target" in err, err
    with (
        LlamaModel(tiny_models["recurrent"]) as m,
        pytest.raises(BackendError, match="keeps no layer inputs of a mamba2"),
    ):
        m.new_context(n_ctx=256, layer_inputs=(0, 1, 1))


def _head_like(src: Path, dst: Path, **keys: object) -> Path:
    """A copy of the EAGLE-3 head ``src`` with metadata ``keys`` replaced (a head made
    for another target)."""
    import dataclasses

    from specgguf.gguf.tiny import fixture_specs, write_tiny_model

    spec = dataclasses.replace(fixture_specs()["eagle3"], **keys)  # type: ignore[arg-type]
    return write_tiny_model(dst, spec)[0]


@pytest.mark.parametrize(
    ("keys", "needle"),
    [({"target_hidden": 128}, "made for a target 128 wide, and this one is 64 wide"),
     ({"target_layers": (0, 1, 7)}, "reads layers [0, 1, 7], and the target has 2")],
)  # fmt: skip
def test_a_head_made_for_another_target_is_refused(
    tiny_models: dict[str, Path], tmp_path: Path, keys: dict[str, object], needle: str
) -> None:
    """llama.cpp checks neither the width a head was made for nor its layers: a head for
    another model would read rows of another width, or layers the target lacks. ``check``
    says so (exit 4), and ``run`` refuses in one line, in auto mode too."""
    head = str(_head_like(tiny_models["eagle3"], tmp_path / "other.gguf", **keys))
    target = str(tiny_models["target"])
    res = run_cli("check", target, head)
    assert res.returncode == 4 and needle in res.stdout.decode(), res.stdout
    for drafter in ("auto", "eagle3"):
        res = run_cli("run", "-m", target, "-md", head, "--drafter", drafter, "-n", "4", "hi")
        err = res.stderr.decode()
        assert res.returncode == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_a_head_is_not_a_target(tiny_models: dict[str, Path]) -> None:
    head, target = str(tiny_models["eagle3"]), str(tiny_models["target"])
    res = run_cli("run", "-m", head, "-n", "4", "hi")
    err = res.stderr.decode()
    assert res.returncode == 2 and "is an eagle3 draft head, not a model" in err, err
    res = run_cli("check", head, target)
    assert res.returncode == 4 and b"head-as-target" in res.stdout
    res = run_cli("info", str(tiny_models["eagle3-d2t"]))
    out = res.stdout.decode()
    assert "an eagle3 head for a target 64 wide, reading the inputs of its layers 0, 1, 1" in out
    assert "256 ids of its own mapped onto the target's (d2t)" in out


def test_the_memory_plan_counts_the_layer_inputs_a_head_reads(
    tiny_models: dict[str, Path],
) -> None:
    """The target keeps the inputs of the head's three layers at every position (F32),
    for each sequence: 3 x n_ctx x 64 x 4 bytes more on the tiny target, per sequence."""
    from specgguf.engine import preflight

    def kv(head: str | None, drafter: str, n_parallel: int = 1) -> int:
        config = EngineConfig(
            ModelConfig(tiny_models["target"], n_ctx=512),
            ModelConfig(tiny_models[head], n_ctx=512) if head else None,
            SpeculativeConfig(drafter=drafter), n_parallel=n_parallel,
        )  # fmt: skip
        return preflight(config).memory[0].kv_cache

    assert kv("eagle3", "eagle3") - kv(None, "none") == 3 * 512 * 64 * 4
    assert kv("eagle3", "auto", 2) - kv(None, "none", 2) == 2 * 3 * 512 * 64 * 4
    assert kv("draft-partial", "model") == kv(None, "none")  # a draft model: nothing kept
