"""DFlash drafts (``--drafter dflash``, llama.cpp's ``--spec-type draft-dflash``) on the
tiny generated drafts of :mod:`specgguf.gguf.tiny` for the tiny llama target: ``dflash``
(its own token embeddings and LM head, reading the inputs of the target's layers 0 and 1)
and ``dflash-shared`` (the target's, through llama.cpp's ``ctx_other``; layer 1 only),
both trained, as it were, on blocks of 8. Their weights are random: nearly every draft is
rejected, which makes each step's draft depend only on the draft's own reading of the
committed text, compared step by step with llama.cpp's (``llama-speculative-simple -v``,
when ``scripts/bench-llama-cpp --build-only`` built it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specgguf.engine import Engine, EngineConfig, ModelConfig, SpeculativeConfig
from specgguf.gguf.arch import head_fit
from specgguf.measure.bench import generate_together
from specgguf.speculative.drafters.dflash import DFlashDrafter
from specgguf.speculative.loop import GenerationParams
from specgguf.speculative.sampling import SamplerParams

from .helpers import check_head_choice, record_drafts, run_cli
from .test_mtp_oracle import run_llama

#: each tiny draft: the target layers it reads, and the most tokens a draft of it has
DRAFTS = {"dflash": ((0, 1), 7), "dflash-shared": ((1,), 7), "dspark": ((0, 1), 8),
          "dspark-bonus": ((1,), 7), "dflash2": ((0, 1), 7)}  # fmt: skip
PROMPTS = ["def is_palindrome(text):", "The quick brown fox", "for i in range(10):\n"]
GREEDY = SamplerParams(temperature=0.0)


def engine(tiny: dict[str, Path], draft: str | None, drafter: str, k: int = 4, **kw: Any) -> Engine:
    threads = kw.pop("n_threads", None)
    p_min = kw.pop("p_min", 0.0)
    return Engine(EngineConfig(
        ModelConfig(tiny["target"], n_ctx=512, n_threads=threads),
        ModelConfig(tiny[draft], n_ctx=512, n_threads=threads) if draft else None,
        SpeculativeConfig(drafter=drafter, draft_max=k, p_min=p_min), **kw,
    ))  # fmt: skip


@pytest.fixture(scope="module")
def alone(tiny_models: dict[str, Path]) -> list[list[int]]:
    params = GenerationParams(n_predict=80, sampler=GREEDY, ignore_eos=True)
    with engine(tiny_models, None, "none") as e:
        return [e.generate(p, params).run().tokens for p in PROMPTS]


@pytest.mark.parametrize("draft", DRAFTS)
@pytest.mark.parametrize("drafter", ["dflash", "auto"])
def test_greedy_output_is_the_targets_own(
    tiny_models: dict[str, Path], alone: list[list[int]], draft: str, drafter: str
) -> None:
    layers, most = DRAFTS[draft]
    with engine(tiny_models, draft, drafter, 16) as e:
        assert e.head_kind == "dflash" and e.draft_ctx is None  # a head, not a draft model
        assert e.target_ctx.layer_inputs == layers
        drafted, long_steps = 0, 0
        for k in (1, 4, 16):
            for p, want in zip(PROMPTS, alone, strict=True):
                params = GenerationParams(n_predict=80, draft_max=k, sampler=GREEDY,
                                          ignore_eos=True)  # fmt: skip
                res = e.generate(p, params).run()
                assert res.tokens == want, (k, p)
                if (st := res.stats.by_drafter.get("dflash")) is not None:
                    drafted += st.drafted
                    assert st.drafted <= most * st.steps  # (a block of 8)
                    long_steps += k == 16 and st.drafted > (most - 1) * st.steps
    if drafter == "dflash":
        assert drafted > 0 and long_steps == len(PROMPTS)


@pytest.mark.parametrize(
    ("target", "draft", "k", "p_min"),
    [
        *[(t, d, k, 0.0) for k in (1, 4, 7)
          for t, d in (("target", "dflash"), ("target", "dflash-shared"),
                       ("hybrid", "dflash-mrope"))],
        *[("target", "dspark", k, p) for k in (1, 4, 8) for p in (0.0, 0.5)],
        *[("target", "dspark-bonus", k, 0.0) for k in (1, 4, 7)],
    ],
)  # fmt: skip
def test_dflash_drafts_as_llama_cpp(
    k: int,
    p_min: float,
    target: str,
    draft: str,
    tools: Path,
    tiny_models: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same tokens as llama.cpp's ``draft-dflash`` (``draft-dspark`` for the DSpark
    drafts), and the same draft at every step (the comparable steps of
    tests/test_mtp_oracle.py) that drafts the configured K: near the end, where a step
    keeps fewer, llama.cpp still decodes the configured K's block and specgguf one of the
    draft's length, whose rows attend to each other. ``dflash-mrope`` runs with M-RoPE (4
    positions per row of target rows) on the hybrid target. ``dspark``'s row 0 predicts
    (a draft of 8 from its block of 8) and its confidence head cuts drafts at ``p_min``;
    ``dspark-bonus`` maps a reduced vocabulary by d2t. (``dspark-bonus`` has no confidence
    head: there llama.cpp reads its hidden state as the confidence, so p_min is 0.)"""
    n = 48
    prompt = "Speculative decoding makes"
    spec_type = "draft-dspark" if draft.startswith("dspark") else "draft-dflash"
    llama = run_llama(tools, tiny_models[target], k, n, spec_type=spec_type,
                      draft=tiny_models[draft], prompt=prompt, p_min=p_min)  # fmt: skip
    drafts = record_drafts(monkeypatch, DFlashDrafter)
    config = EngineConfig(
        ModelConfig(tiny_models[target], n_ctx=512, n_threads=1),
        ModelConfig(tiny_models[draft], n_ctx=512, n_threads=1),
        SpeculativeConfig(drafter="dflash", draft_max=k, p_min=p_min),
    )
    with Engine(config) as e:
        ids = e.target_model.tokenize(prompt, add_special=True, parse_special=True)
        assert len(ids) == llama.n_prompt
        params = GenerationParams(n_predict=n, draft_max=k, sampler=GREEDY, ignore_eos=True)
        result = e.generate(ids, params).run()
    assert result.tokens == llama.tokens[:n]
    comparable = [s for s in llama.steps if s.produced < n - 1]
    drafted = sum(len(s.draft) for s in comparable)
    assert drafted > n // 2 if not p_min else n // 8 < drafted < k * len(comparable) - k
    assert len(drafts) == len(comparable)
    full = 0
    for i, (ours, theirs) in enumerate(zip(drafts, comparable, strict=True)):
        # (a confidence read from a shorter block differs too)
        near_end = theirs.produced + k >= n
        assert len(ours) == len(theirs.draft) or (p_min and near_end), f"step {i}"
        if theirs.produced + k < n:  # (room for the configured K)
            assert ours == theirs.draft, f"step {i} (after {theirs.produced} tokens)"
            full += 1
    assert full >= len(comparable) - k  # (only the last steps lack the room)
    if not p_min:  # (else the last steps' may differ, above)
        assert result.stats.drafted == drafted


@pytest.mark.parametrize("draft", ["dflash", "dspark"])
def test_each_parallel_sequence_drafts_from_its_own_rows(
    tiny_models: dict[str, Path], alone: list[list[int]], draft: str
) -> None:
    params = GenerationParams(n_predict=80, sampler=GREEDY, ignore_eos=True)
    with engine(tiny_models, draft, "dflash", p_min=0.5) as one:
        each = [one.generate(p, params).run() for p in PROMPTS]
    with engine(tiny_models, draft, "dflash", n_parallel=3, p_min=0.5) as three:
        assert len(three.heads) == 3
        together = generate_together(three, PROMPTS, params)[0]
    assert [r.tokens for r in together] == [r.tokens for r in each] == alone
    assert [r.stats.drafted for r in together] == [r.stats.drafted for r in each]
    assert [r.stats.accepted for r in together] == [r.stats.accepted for r in each]


def test_a_block_leaves_the_cache_as_it_was(tiny_models: dict[str, Path]) -> None:
    """The block's rows attend to each other (a draft of 2 from a block of 3 differs from
    the first 2 of a block of 8), and leave nothing behind: the same block again gives
    the same logits, and rows written after it equal rows written without it."""
    from specgguf.llama.backend import DFlashHead, LlamaModel, head_target_layers

    with (
        LlamaModel(tiny_models["target"]) as t,
        LlamaModel(tiny_models["dflash"]) as d,
        t.new_context(n_ctx=256, n_batch=64, layer_inputs=head_target_layers(d)) as ctx,
    ):
        ids = t.tokenize("The quick brown fox jumps")
        ctx.eval(ids, logits="none")
        h = ctx.hidden_rows(0, len(ids))
        assert h.shape == (len(ids), 2 * 64)
        with DFlashHead(d, ctx) as head:
            assert (head.block_size, head.mask_token) == (8, 1)
            head.eval(ids[:3], h[:3], last=False)
            short = np.array(head.block(ids[3], 2))
            full = np.array(head.block(ids[3], 7))
            again = np.array(head.block(ids[3], 7))
            assert head.n_past == 3
            head.eval(ids[3:], h[3:], last=False)
            after = np.array(head.block(ids[-1], 7))
            head.rollback(0)
            head.eval(ids, h, last=False)
            fresh = np.array(head.block(ids[-1], 7))
            with pytest.raises(ValueError, match="drafts 1 to 7 tokens, not 8"):
                head.block(ids[-1], 8)
    assert short.shape == (2, 512) and full.shape == (7, 512)
    assert not np.allclose(short, full[:2]) and np.array_equal(full, again)
    assert np.array_equal(after, fresh)


def test_a_draft_is_taken_for_what_it_is(tiny_models: dict[str, Path]) -> None:
    """``-md`` a DFlash draft: ``--draft K`` drafts with it (as llama.cpp chooses the
    drafter from the file), ``--spec-type draft-dflash`` names it; ``--drafter model`` or
    ``eagle3`` with it, and ``--drafter dflash`` with an EAGLE-3 head or none, are refused
    in one line."""
    t, draft = str(tiny_models["target"]), str(tiny_models["dflash"])
    base = ["run", "-m", t, "-n", "12", "--temp", "0", "--ignore-eos", "--json", "hi"]
    check_head_choice(
        base, "dflash",
        [["-md", draft, "--draft", "4"], ["-md", draft, "--spec-type", "draft-dflash"]],
        [(["-md", draft, "--drafter", "model"], "is a dflash head, not a draft model"),
         (["-md", draft, "--drafter", "eagle3"], "is a dflash head: it drafts as the dflash"),
         (["-md", str(tiny_models["eagle3"]), "--drafter", "dflash"], "is an eagle3 head: it"),
         (["--drafter", "dflash"], "needs a DFlash draft as its draft model: give it with -md"),
         (["-md", draft, "--drafter", "mtp"], "is a dflash head: it drafts as the dflash")],
    )  # fmt: skip
    # a lookup or none leaves the head unloaded, as a draft model, with a note
    res = run_cli(*base, "-md", draft, "--drafter", "ngram")
    assert res.returncode == 0 and b"drafts without the draft model" in res.stderr, res.stderr
    # a draft length past the block is said, and drafts what the block holds
    res = run_cli(*base, "-md", draft, "--draft", "16")
    assert res.returncode == 0, res.stderr
    assert b"a draft length of 16 does not fit tiny-dflash.gguf's blocks of 8" in res.stderr


def test_a_draft_made_for_another_target_is_refused(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """A DFlash draft reads the inputs of the target's layers at its own width: one as
    wide as another target, or reading layers this one lacks, is refused by ``check``
    (exit 4) and ``run`` (exit 2, one line)."""
    import dataclasses

    from specgguf.gguf.tiny import fixture_specs, write_tiny_model

    spec = fixture_specs()["dflash"]
    for name, changes, needle in (
        ("wide", {"n_embd": 128, "n_ff": 256}, "made for a target 128 wide, and this one is 64"),
        ("deep", {"target_layers": (0, 5)}, "reads layers [0, 5], and the target has 2"),
    ):
        other = write_tiny_model(tmp_path / f"{name}.gguf", dataclasses.replace(spec, **changes))
        res = run_cli("check", str(tiny_models["target"]), str(other[0]))
        assert res.returncode == 4 and needle in res.stdout.decode(), res.stdout
        res = run_cli("run", "-m", str(tiny_models["target"]), "-md", str(other[0]), "-n", "4",
                      "hi")  # fmt: skip
        err = res.stderr.decode()
        assert res.returncode == 2 and needle in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("p_min", [0.0, 0.7])
@pytest.mark.parametrize("k", [1, 4, 7])
def test_dflash2_drafts_as_llama_cpp(
    k: int, p_min: float, tools: Path, tiny_models: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A DFlash2 draft (a selector) with llama.cpp's ``draft-dflash`` as the oracle. llama.cpp
    logs no DFlash2 draft's tokens, and with random weights it accepts none: the same
    tokens, every comparable step's draft as long as llama.cpp's (``p_min`` 0.7 cuts
    them at the same rows; :func:`walk_lattice`'s own test checks the walk's tokens), the
    same drafted count."""
    n = 48
    prompt = "Speculative decoding makes"
    llama = run_llama(tools, tiny_models["target"], k, n, spec_type="draft-dflash",
                      draft=tiny_models["dflash2"], prompt=prompt, p_min=p_min,
                      logged=False)  # fmt: skip
    assert not any(s.accepted for s in llama.steps)  # (so its token list is whole)
    drafts = record_drafts(monkeypatch, DFlashDrafter)
    with engine(tiny_models, "dflash2", "dflash", k, n_threads=1, p_min=p_min) as e:
        assert e.heads[0].selector_top_k == 4  # type: ignore[attr-defined]
        ids = e.target_model.tokenize(prompt, add_special=True, parse_special=True)
        params = GenerationParams(n_predict=n, draft_max=k, sampler=GREEDY, ignore_eos=True)
        result = e.generate(ids, params).run()
    assert result.tokens == llama.tokens[:n]
    comparable = [s for s in llama.steps if s.produced + k < n]
    lengths = [s.n_draft for s in comparable]
    assert [len(d) for d in drafts[: len(comparable)]] == lengths
    assert sum(lengths) > n // 2 if not p_min else 0 < sum(lengths) < k * len(lengths) - k


def test_walk_lattice() -> None:
    """A lattice of top 2: row = [id0, id1, scores after candidate 0 (2), after 1 (2)]."""
    from specgguf.speculative.drafters.dflash import walk_lattice

    rows = np.array([[10, 11, 0.0, 3.0, 0.0, 3.0],  # (row 0: the same after either)
                     [20, 21, 5.0, 1.0, 0.0, 2.0],  # after 11 (candidate 1): 21
                     [30, 31, 0.0, 9.0, 4.0, 0.0]],  # after 21 (candidate 1): 30
                    np.float32)  # fmt: skip
    assert walk_lattice(rows, 2, 100) == ([11, 21, 30], False)
    # softmax at the best: 0.953, 0.881, 0.982 (the path's: 0.953, 0.839, 0.824)
    assert walk_lattice(rows, 2, 100, p_min=0.9) == ([11], True)
    assert walk_lattice(rows, 2, 100, p_path_min=0.8) == ([11, 21, 30], False)
    assert walk_lattice(rows, 2, 100, p_path_min=0.85) == ([11], True)  # (0.953 * 0.881)
    assert walk_lattice(rows, 2, 25) == ([11, 21], True)  # (30 is past the vocabulary)
    assert walk_lattice(rows[:0], 2, 100) == ([], False)


def test_dflash2_greedy_and_sampled_output(
    tiny_models: dict[str, Path], alone: list[list[int]]
) -> None:
    """Greedy output is the target's own for K in {1, 4, 16} (a block of 8 drafts 7 at
    most); sampled, a DFlash2 draft is deterministic (no distributions)."""
    with engine(tiny_models, "dflash2", "dflash", 16) as e:
        for k in (1, 4, 16):
            for p, want in zip(PROMPTS, alone, strict=True):
                params = GenerationParams(n_predict=80, draft_max=k, sampler=GREEDY,
                                          ignore_eos=True)  # fmt: skip
                res = e.generate(p, params).run()
                assert res.tokens == want, (k, p)
                st = res.stats.by_drafter["dflash"]
                assert 0 < st.drafted <= min(k, 7) * st.steps
        sampled = GenerationParams(n_predict=40, sampler=SamplerParams(temperature=0.8, seed=5),
                                   ignore_eos=True)  # fmt: skip
        drafts = []
        propose = DFlashDrafter.propose
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(DFlashDrafter, "propose",
                       lambda *a, **kw: drafts.append(d := propose(*a, **kw)) or d)  # fmt: skip
            assert len(e.generate(PROMPTS[0], sampled).run().tokens) == 40
        assert drafts and all(d.dists is None for d in drafts)
        assert any(d.tokens for d in drafts)


def test_head_fit_words() -> None:
    assert head_fit("llama", 64, 2, "dflash", (0, 1), 64) == []
    assert head_fit("mamba2", 64, 2, "dflash", (0, 1), 64) == [
        "llama.cpp keeps no layer inputs of a mamba2 target, which a DFlash draft reads"
    ]
    assert head_fit("llama", 64, 2, "dflash", (), 64) == ["the DFlash draft names no target layers"]
    assert head_fit("llama", 64, 2, "dflash", (0, 1, 1, 1, 1), 64) == []  # (any number)
    assert head_fit("llama", 64, 2, "qwen3", (0,), 32) == []  # (no head)


def test_info_says_what_the_draft_needs(tiny_models: dict[str, Path]) -> None:
    res = run_cli("info", str(tiny_models["dflash-shared"]))
    out = res.stdout.decode()
    assert res.returncode == 0, res.stderr
    assert "a dflash head for a target 64 wide, reading the inputs of its layer 1;" in out
    assert "blocks of 8 (drafts of at most 7 tokens)" in out


def test_info_says_what_a_dspark_draft_is(tiny_models: dict[str, Path]) -> None:
    out = run_cli("info", str(tiny_models["dspark"])).stdout.decode()
    assert ("blocks of 8 (drafts of at most 8 tokens); DSpark: a Markov head and a "
            "confidence head, which --draft-p-min reads") in out  # fmt: skip
    out = run_cli("info", str(tiny_models["dspark-bonus"])).stdout.decode()
    assert "blocks of 8 (drafts of at most 7 tokens); DSpark: a Markov head;" in out
    assert "256 ids of its own mapped onto the target's (d2t)" in out
    out = run_cli("info", str(tiny_models["dflash2"])).stdout.decode()
    assert "drafts of at most 7 tokens); DFlash2: a selector over each row's best 4;" in out


def test_a_dspark_confidence_cuts_drafts_sampled_too(tiny_models: dict[str, Path]) -> None:
    """With a confidence head, ``p_min`` cuts a sampled draft as a greedy one (llama.cpp
    reads it whatever the sampler): a draft never reaches past a token whose confidence is
    below it; the text is the same length either way."""
    from specgguf.speculative.drafters.dflash import DFlashDrafter

    sampled = GenerationParams(n_predict=40, sampler=SamplerParams(temperature=0.8, seed=3),
                               ignore_eos=True)  # fmt: skip
    seen: list[tuple[int, np.ndarray]] = []
    propose = DFlashDrafter.propose

    def spy(self: DFlashDrafter, *a: Any, **kw: Any) -> Any:
        draft = propose(self, *a, **kw)
        if getattr(self.block_head, "_rows", 0):  # (a block was decoded)
            seen.append((len(draft.tokens), self.block_head.confidence()))
        return draft

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DFlashDrafter, "propose", spy)
        with engine(tiny_models, "dspark", "dflash", 8, p_min=0.5) as e:
            res = e.generate(PROMPTS[0], sampled).run()
    assert len(res.tokens) == 40 and seen
    for n, conf in seen:
        assert np.all((conf >= 0) & (conf <= 1))
        assert np.all(conf[:n] >= 0.5) and (n == len(conf) or conf[n] < 0.5)
    assert any(n < len(conf) for n, conf in seen)  # it cut some


@pytest.mark.parametrize("n_batch", [512, 513, 8])
def test_a_prompt_longer_than_a_micro_batch(tiny_models: dict[str, Path], n_batch: int) -> None:
    """A DFlash draft attends without a causal mask, which llama.cpp takes only in one
    micro-batch (it aborted the process before): a prompt of 600 tokens, read by the
    draft in pieces, with the default batch, one above the draft's micro-batch of 512, and
    one that fits a block (8 rows). Greedy output is the same with each draft, and with
    the default batch the target alone's (with other batches the target reads the prompt
    in other micro-batches, whose kernels round otherwise than alone on this tiny file)."""
    ids = [(7 * i) % 400 + 50 for i in range(600)]
    params = GenerationParams(n_predict=12, sampler=GREEDY, ignore_eos=True)
    with Engine(EngineConfig(ModelConfig(tiny_models["target"], n_ctx=1024), None,
                             SpeculativeConfig(drafter="none"))) as e:  # fmt: skip
        alone = e.generate(ids, params).run().tokens
    outs = []
    for draft in ("dflash", "dspark", "dflash2"):
        config = EngineConfig(
            ModelConfig(tiny_models["target"], n_ctx=1024, n_batch=n_batch),
            ModelConfig(tiny_models[draft], n_ctx=1024),
            SpeculativeConfig(drafter="dflash", draft_max=4),
        )
        with Engine(config) as e:
            res = e.generate(ids, params).run()
        outs.append(res.tokens)
        assert res.stats.by_drafter["dflash"].drafted > 0
    assert outs[0] == outs[1] == outs[2]
    if n_batch == 512:
        assert outs[0] == alone


def test_a_shortest_draft_past_the_block_is_lowered(tiny_models: dict[str, Path]) -> None:
    """``draft_min`` above what a block drafts is lowered to it (llama.cpp lowers n_min to
    the block too), and said: before, nothing was ever drafted."""
    base = ["run", "-m", str(tiny_models["target"]), "-md", str(tiny_models["dflash"]),
            "--drafter", "dflash", "--draft", "16", "--draft-min", "10", "-n", "24", "--temp",
            "0", "--ignore-eos", "--json", "hi"]  # fmt: skip
    res = run_cli(*base)
    assert res.returncode == 0, res.stderr
    assert (b"a shortest draft of 10: tiny-dflash.gguf's drafts have at most 7 tokens, the "
            b"shortest verified is 7") in res.stderr  # fmt: skip
    steps, drafted, _ = json.loads(res.stdout)["stats"]["by_drafter"]["dflash"]
    assert drafted == 7 * steps > 0


def test_dspark_files_as_converters_write_them(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """Without a confidence head (``dflash.has_confidence_head`` false, a bool), ``p_min``
    stops drafts at a token's probability, said once (llama.cpp refuses it); without
    ``dflash.block_size``, which llama.cpp's DSpark graph asserts, the file is refused in
    one line before anything loads."""
    import dataclasses

    from gguf import GGUFValueType

    from specgguf.gguf.tiny import fixture_specs, write_tiny_model

    spec = fixture_specs()["dspark"]
    no_conf = dataclasses.replace(spec, set_keys=(
        ("dflash.has_confidence_head", False, GGUFValueType.BOOL, None),))  # fmt: skip
    path = str(write_tiny_model(tmp_path / "noconf.gguf", no_conf)[0])
    base = ["run", "-m", str(tiny_models["target"]), "-md", path, "-n", "8", "--temp", "0",
            "--ignore-eos", "hi"]  # fmt: skip
    res = run_cli(*base, "--draft-p-min", "0.5")
    assert res.returncode == 0, res.stderr
    assert res.stderr.count(b"is a DSpark draft without a confidence head") == 1
    assert b"confidence head" not in run_cli(*base).stderr  # (p_min 0: nothing to say)
    assert "a Markov head;" in run_cli("info", path).stdout.decode()  # (no confidence head)
    no_block = dataclasses.replace(spec, drop_keys=frozenset({"dflash.block_size"}))
    path = str(write_tiny_model(tmp_path / "noblock.gguf", no_block)[0])
    res = run_cli("run", "-m", str(tiny_models["target"]), "-md", path, "-n", "8", "hi")
    err = res.stderr.decode()
    assert res.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert "a DSpark draft without dflash.block_size" in err
