"""Python's time per step with llama.cpp's decodes taken out (specgguf/measure/overhead.py,
scripts/bench-overhead): the fake answers every decode of the engine, its logits are
the ones its table says, and the real functions come back after."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from specgguf.measure.overhead import FreeDecode, free_decodes, measure, next_token_tables
from specgguf.speculative.loop import GenerationParams
from specgguf.speculative.sampling import SamplerParams

from .helpers import load_engine

GREEDY = SamplerParams(temperature=0)


def test_next_token_tables_by_hand() -> None:
    # 5 -> 7 -> 9 -> 5 -> 11 -> (back to) 5: the later of 5's followers wins; every
    # fourth token of the text (5, 11) is followed, in the draft's table, by the token
    # after its target's next (11 -> 5, so 5 -> 5; 5 -> 7 ... 11 -> 7)
    target, draft = next_token_tables([5, 7, 9, 5, 11], 16)
    assert target.dtype == np.int64 and target.shape == (16,)
    assert (target[5], target[7], target[9], target[11]) == (11, 9, 5, 5)
    assert target[0] == target[15] == 5
    assert (draft[5], draft[11]) == (5, 7)
    assert (draft[7], draft[9]) == (9, 5)


def test_free_decodes_answer_every_decode_and_give_the_real_ones_back(
    tiny_models: dict[str, Path],
) -> None:
    params = GenerationParams(n_predict=24, sampler=GREEDY, drafter="model", draft_max=4,
                              ignore_eos=True)  # fmt: skip
    with load_engine(tiny_models["target"], tiny_models["draft-partial"], n_ctx=512) as e:
        ids = e.tokenize("hello world")
        real = e.generate(ids, params).run().tokens
        with free_decodes(e) as fakes:
            assert len(fakes) == 2  # the target's, then the draft model's
            target = fakes[0].table
            res = e.generate(ids, params).run()
            # every token is the table's next after the one before (and the first the
            # table's next after the prompt's last)
            assert [int(target[t]) for t in [ids[-1], *res.tokens[:-1]]] == res.tokens
            assert fakes[0].calls >= res.stats.steps and fakes[1].calls > 0
            # the draft model's table differs at every fourth token: some drafts fail
            assert 0 < res.stats.accepted < res.stats.drafted
            got = measure(e, fakes, ids, params)
            assert got.steps == res.stats.steps and got.tokens == 24 and got.us_step > 0
        assert e.generate(ids, params).run().tokens == real  # llama.cpp's own decodes again


def test_a_measure_that_went_around_the_fake_is_refused(tiny_models: dict[str, Path]) -> None:
    params = GenerationParams(n_predict=8, sampler=GREEDY, drafter="none", ignore_eos=True)
    with load_engine(tiny_models["target"], n_ctx=512, drafter="none") as e:
        ids = e.tokenize("hello world")
        unused = FreeDecode(None, np.zeros(e.target_ctx.n_vocab, np.int64), 4)
        with pytest.raises(RuntimeError, match="no decode went through FreeDecode"):
            measure(e, [unused], ids, params)


def test_a_measure_leaves_auto_modes_timings_as_they_were(tiny_models: dict[str, Path]) -> None:
    # a free decode's time would teach auto mode that batches cost nothing: every path
    # measured after would follow that
    params = GenerationParams(n_predict=32, sampler=GREEDY, drafter="auto", draft_max=4,
                              ignore_eos=True)  # fmt: skip
    with load_engine(tiny_models["target"], tiny_models["draft-partial"], drafter="auto",
                     n_ctx=512) as e:  # fmt: skip
        t = e.timings()
        before = (t.scale_single, t.scale_batch, t.draft, dict(t.verify))
        with free_decodes(e) as fakes:
            measure(e, fakes, e.tokenize("hello world"), params)
        assert (t.scale_single, t.scale_batch, t.draft, dict(t.verify)) == before


def test_logit_rows_are_shaped_as_a_confident_model_s() -> None:
    from specgguf.measure.overhead import N_VOCAB, logit_rows
    from specgguf.speculative.loop import NEAR_MAX

    rows = logit_rows(3)
    assert rows.shape == (3, N_VOCAB) and rows.dtype == np.float32
    near = (rows > rows.max(axis=1, keepdims=True) - NEAR_MAX).sum(axis=1)
    # about 0.13% of a row near its top: 205 expected of 151,936 (237 measured on Qwen)
    assert ((near > 100) & (near < 400)).all()
    assert (rows.max(axis=1) == 25.0).all()


def test_vocab_work_times_each_piece_of_a_step() -> None:
    from specgguf.measure.overhead import vocab_work

    work = vocab_work(k=2, n_vocab=4096, repeats=2)
    assert set(work) == {
        "greedy verification",
        "top-1 probability",
        "top-1 probability over the whole row",
        "sampled verification",
    }
    assert all(0.0 < us < 1e6 for us in work.values())


def test_vocab_work_verifies_every_row_of_its_draft() -> None:
    """Its draft is each row's top token, so a verification reads every row (not one,
    rejected at the first): greedy keeps all k drafts."""
    from specgguf.measure.overhead import kept_draft, logit_rows
    from specgguf.speculative.verification import accept

    rows = logit_rows(5, 4096)
    verdict = accept(kept_draft(rows), rows, GREEDY, np.random.default_rng(0))
    assert len(verdict.accepted) == 4 and verdict.row == 4
