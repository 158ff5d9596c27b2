"""Prompt reuse through llama.cpp on the tiny generated models: a conversation's later
turns read only what they add, on attention, hybrid, recurrent and MTP targets, with one
sequence and with ``--parallel``; saved prompts come back from host memory and files.

Greedy output with a reused prefix is compared with the same prompt read from nothing: in
deterministic mode bit for bit; otherwise llama.cpp's batch shapes may flip a near-tie,
which is allowed only where the two runs' own logits show one (:func:`assert_same_or_near_tie`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specgguf.engine import Engine
from specgguf.speculative.loop import GenerationParams, GenerationResult
from specgguf.speculative.sampling import SamplerParams

from .helpers import load_engine, run_cli

GREEDY = SamplerParams(temperature=0.0)
DOC = "def add(a, b):\n    return a + b\n" * 30


def params(n: int = 16, **kw: Any) -> GenerationParams:
    return GenerationParams(n_predict=n, sampler=GREEDY, ignore_eos=True, **kw)


Rows = list[tuple[int, np.ndarray]]


def conversation(
    engine: Engine, turns: int, *, n: int = 16, **kw: Any
) -> list[tuple[list[int], GenerationResult, Rows]]:
    """A chat about DOC: each turn the whole conversation so far, the answer and a new
    question; each turn's prompt ids, result and verification rows (:class:`Recorder`)."""
    rec = Recorder(engine)
    messages: list[dict[str, str]] = [{"role": "user", "content": DOC + "\nexplain"}]
    out = []
    for i in range(turns):
        ids = engine.prompt_ids(messages)
        res = engine.generate(ids, params(n, **kw)).run()
        out.append((ids, res, rec.take()))
        messages += [{"role": "assistant", "content": res.text},
                     {"role": "user", "content": f"and {i}?"}]  # fmt: skip
    return out


class Recorder:
    """Records the logits of every row the target evaluates (its verifications), by
    position: ``row(p)`` is the latest row after position ``p``."""

    def __init__(self, engine: Engine) -> None:
        self.ctx = ctx = engine.target_ctx
        self.calls: list[tuple[int, np.ndarray]] = []
        real = ctx.eval

        def eval(tokens: Sequence[int], *, logits: Any = "last") -> np.ndarray:
            n_past = ctx.n_past
            out = real(tokens, logits=logits)
            if logits == "all":
                self.calls.append((n_past, np.array(out)))
            return out

        ctx.eval = eval  # type: ignore[method-assign]

    def take(self) -> list[tuple[int, np.ndarray]]:
        """The rows recorded since the last take (by the first position they follow)."""
        calls, self.calls = self.calls, []
        return calls


def row_at(calls: list[tuple[int, np.ndarray]], position: int) -> np.ndarray:
    """The latest recorded row after ``position``."""
    for n_past, rows in reversed(calls):
        if n_past <= position < n_past + len(rows):
            return np.asarray(rows[position - n_past])
    raise AssertionError(f"no verification row after position {position}")


def fresh_logits(engine: Engine, ids: Sequence[int]) -> np.ndarray:
    """The target's logits after ``ids``, read from nothing in one piece."""
    ctx = engine.target_ctx
    ctx.rollback(0)
    row = np.array(ctx.eval(ids, logits="last")[-1])
    ctx.rollback(0)
    return row


#: How far a reused prefix's logits may stray from a fresh read's (the tiny models' batch
#: shapes move them by up to about 0.2); a wrong state moves them by several units.
NOISE = 0.5


def assert_same_or_near_tie(
    engine: Engine,
    rows: list[tuple[int, np.ndarray]],
    ids: list[int],
    reused: GenerationResult,
    fresh: list[int],
) -> None:
    """``reused``'s tokens equal ``fresh`` (the same prompt read from nothing), or they
    part at a near-tie: at the first difference the reused run's logits (``rows``,
    recorded as it ran: :class:`Recorder`) chose its token and the fresh read's its own,
    and the two rows differ by no more than batch shapes move them (:data:`NOISE`); any
    other difference fails."""
    got = reused.tokens
    if got == fresh:
        return
    i = next((j for j, (a, b) in enumerate(zip(got, fresh, strict=False)) if a != b), None)
    assert i is not None, f"one output is a prefix of the other: {got} / {fresh}"
    a, b = fresh[i], got[i]
    one = fresh_logits(engine, [*ids, *fresh[:i]])
    mine = row_at(rows, len(ids) + i - 1)
    assert int(one.argmax()) == a and int(mine.argmax()) == b
    stray = float(np.abs(mine - one).max())
    assert stray <= NOISE, f"token {i}: fresh {a}, reused {b}; the rows differ by {stray:.3g}"


@pytest.mark.parametrize(
    ("name", "drafter"),
    [
        ("target", "none"),
        ("target", "model"),
        ("hybrid", "none"),
        ("recurrent", "none"),
        ("recurrent", "model"),  # checkpoint and replay
        ("mtp", "mtp"),
    ],
)
def test_later_turns_read_only_what_they_add(
    tiny_models: dict[str, Path], name: str, drafter: str
) -> None:
    draft = tiny_models["draft-partial"] if drafter == "model" else None
    with load_engine(tiny_models[name], draft, drafter=drafter, n_ctx=2048) as e:
        turns = conversation(e, 3)
        for k, (ids, res, rows) in enumerate(turns):
            s = res.stats
            assert s.prompt_tokens == len(ids) and s.prompt_read == len(ids) - s.prompt_cached
            if k == 0:
                assert s.prompt_cached == 0
                continue
            before, prev, _ = turns[k - 1]
            held = [*before, *prev.tokens]
            shared = next((j for j, (x, y) in enumerate(zip(held, ids, strict=False))
                           if x != y), len(held))  # fmt: skip
            # All it shares with what the sequence held; a recurrent state, where that
            # ends inside the last answer, from the checkpoint after the last prompt.
            want = shared if e.target_model.memory == "attention" else (
                shared if shared >= len(held) - 1 else len(before) - 1)  # fmt: skip
            assert s.prompt_cached == min(want, len(ids) - 1), (k, shared, len(before))
            assert s.prompt_read < len(ids) // 4
            fresh = e.generate(ids, params(cache_prompt=False)).run()
            assert fresh.stats.prompt_cached == 0
            assert_same_or_near_tie(e, rows, ids, res, fresh.tokens)


def test_deterministic_mode_reuses_only_what_reads_bit_identically(
    tiny_models: dict[str, Path],
) -> None:
    """Deterministic mode keeps the prefix read in whole micro-batches from position 0,
    cut on a micro-batch boundary: the output is the fresh read's, bit for bit."""
    with load_engine(tiny_models["target"], drafter="none", n_ctx=2048,
                     deterministic=True) as e:  # fmt: skip
        unit = e.target_ctx.n_ubatch
        turns = conversation(e, 3)
        for ids, res, _ in turns[1:]:
            cached = res.stats.prompt_cached
            assert cached > 0 and cached % unit == 0
            fresh = e.generate(ids, params(cache_prompt=False)).run()
            assert res.tokens == fresh.tokens


def test_a_recurrent_state_goes_back_to_its_deepest_checkpoint(
    tiny_models: dict[str, Path],
) -> None:
    """A prompt that shares only part of a long one goes back to the checkpoint at or
    below the shared prefix (one every CHECKPOINT_STEP positions and after the prompt):
    only the rest is read; the mamba2 fixture's reads are batch-invariant, so the output
    is the fresh read's exactly."""
    from specgguf.llama.backend import CHECKPOINT_STEP, CHECKPOINT_TAIL

    with load_engine(tiny_models["recurrent"], drafter="none", n_ctx=4096) as e:
        long = e.tokenize("x = 1\n" * 700, add_special=False)[: 2 * CHECKPOINT_STEP + 100]
        first = e.generate(long, params(4)).run()
        end = len(long) - 1
        assert [c.n for c in e.target_ctx.checkpoints] == [
            CHECKPOINT_STEP, 2 * CHECKPOINT_STEP, end - CHECKPOINT_TAIL, end]  # fmt: skip
        other = [*long[: CHECKPOINT_STEP + 50], *e.tokenize(" y = 2", add_special=False)]
        res = e.generate(other, params(8)).run()
        assert res.stats.prompt_cached == CHECKPOINT_STEP
        fresh = e.generate(other, params(8, cache_prompt=False)).run()
        assert res.tokens == fresh.tokens and first.tokens
        # nothing usable below a prefix shorter than the first checkpoint: read whole
        short = [*long[:10], 5, 6]
        assert e.generate(short, params(2)).run().stats.prompt_cached == 0


def test_checkpoints_spread_over_a_long_prompt_within_their_number(
    tiny_models: dict[str, Path],
) -> None:
    from specgguf.engine import EngineConfig, ModelConfig, SpeculativeConfig
    from specgguf.engine.config import CacheConfig
    from specgguf.llama.backend import CHECKPOINT_STEP

    config = EngineConfig(ModelConfig(tiny_models["hybrid"], n_ctx=8192, n_batch=512),
                          speculative=SpeculativeConfig(drafter="none"),
                          cache=CacheConfig(ctx_checkpoints=3))  # fmt: skip
    with Engine(config) as e:
        ids = e.tokenize("z = 3\n" * 3000, add_special=False)[: 6 * CHECKPOINT_STEP + 10]
        e.generate(ids, params(2)).run()
        at = [c.n for c in e.target_ctx.checkpoints]
        assert len(at) == 3 and at[-1] == len(ids) - 1
        assert at[0] < 3 * CHECKPOINT_STEP  # not only the last ones kept


def test_slots_take_the_prompts_that_share_most_with_them(tiny_models: dict[str, Path]) -> None:
    """With --parallel, a conversation's next turn goes to the sequence that holds it."""
    from specgguf.engine import EngineConfig, ModelConfig, SpeculativeConfig

    config = EngineConfig(ModelConfig(tiny_models["target"], n_ctx=2048),
                          speculative=SpeculativeConfig(drafter="none"), n_parallel=3)  # fmt: skip
    with Engine(config) as e:
        from specgguf.measure.bench import generate_together

        a = e.tokenize("alpha " * 60, add_special=False)
        b = e.tokenize("beta " * 60, add_special=False)
        generate_together(e, [a, b], params(6))
        held = {i: s.n_cached for i, s in enumerate(e.slots)}
        assert sorted(held.values())[-2:] == [len(a) + 5, len(b) + 5]
        slot_a = next(i for i, s in enumerate(e.slots) if s.cached_prefix(a) == len(a))
        assert e.pick_slot([*a, 7, 8], [0, 1, 2]) == slot_a
        assert e.pick_slot([9, 9, 9], [0, 1, 2]) not in (slot_a,)  # the unused one


def test_a_saved_prompt_comes_back_from_host_memory(tiny_models: dict[str, Path]) -> None:
    """One sequence, two conversations in turn: each other turn's prompt was evicted by
    the other conversation, saved in host memory, and comes back instead of being read."""
    from specgguf.engine import EngineConfig, ModelConfig, SpeculativeConfig
    from specgguf.engine.config import CacheConfig

    config = EngineConfig(ModelConfig(tiny_models["target"], n_ctx=2048),
                          speculative=SpeculativeConfig(drafter="none"),
                          cache=CacheConfig(ram=64 << 20))  # fmt: skip
    with Engine(config) as e:
        cache = e.prompt_cache
        assert cache is not None
        a = e.tokenize("alpha " * 120, add_special=False)
        b = e.tokenize("beta " * 120, add_special=False)
        ra = e.generate(a, params(6)).run()
        e.generate(b, params(6)).run()  # a's state saved before b is read
        assert cache.saves == 1 and len(cache) == 1
        again = [*a, *ra.tokens, 11, 12]
        rec = Recorder(e)
        res = e.generate(again, params(6)).run()  # a's back; b's saved
        rows = rec.take()
        assert cache.restores == 1 and cache.saves == 2
        assert res.stats.prompt_cached == len(a) + len(ra.tokens) - 1
        fresh = e.generate(again, params(6, cache_prompt=False)).run()
        assert_same_or_near_tie(e, rows, again, res, fresh.tokens)


def test_a_small_host_cache_evicts(tiny_models: dict[str, Path]) -> None:
    from specgguf.engine import EngineConfig, ModelConfig, SpeculativeConfig
    from specgguf.engine.config import CacheConfig

    texts = [f"{w} " * 100 for w in ("alpha", "beta", "gamma", "delta")]
    config = EngineConfig(ModelConfig(tiny_models["target"], n_ctx=1024),
                          speculative=SpeculativeConfig(drafter="none"),
                          cache=CacheConfig(ram=1))  # fmt: skip
    with Engine(config) as e:
        one = e.tokenize(texts[0], add_special=False)
        e.generate(one, params(2)).run()
        size = e.save_prompt().nbytes
    config = EngineConfig(ModelConfig(tiny_models["target"], n_ctx=1024),
                          speculative=SpeculativeConfig(drafter="none"),
                          cache=CacheConfig(ram=int(size * 2.5)))  # fmt: skip
    with Engine(config) as e:
        cache = e.prompt_cache
        assert cache is not None
        for t in texts:
            e.generate(e.tokenize(t, add_special=False), params(2)).run()
        assert cache.saves == 3 and len(cache) == 2 and cache.nbytes <= cache.limit
        # the oldest went: word0's prompt is read again
        res = e.generate(e.tokenize(texts[0], add_special=False), params(2)).run()
        assert res.stats.prompt_cached == 0


def test_no_host_cache_without_ram(tiny_models: dict[str, Path]) -> None:
    with load_engine(tiny_models["target"], drafter="none") as e:
        assert e.prompt_cache is None
        e.generate(e.tokenize("a " * 50, add_special=False), params(2)).run()
        res = e.generate(e.tokenize("b " * 50, add_special=False), params(2)).run()
        assert res.stats.prompt_cached == 0


# -- run --prompt-cache -----------------------------------------------------------------


def run_json(tiny: dict[str, Path], cache: Path, question: str, *extra: str,
             env: dict[str, str] | None = None) -> Any:  # fmt: skip
    drafter = [] if "--drafter" in extra else ["--drafter", "none"]
    res = run_cli("run", "-m", str(tiny["target"]), *drafter, "-c", "2048",
                  "--temp", "0", "-n", "8", "--ignore-eos", "--json", "--prompt-cache",
                  str(cache), *extra, DOC + question, env=env)  # fmt: skip
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout), res.stderr.decode()


def test_run_prompt_cache_reads_a_shared_document_once(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    cache = tmp_path / "doc.cache"
    first, err = run_json(tiny_models, cache, "What does it do?")
    assert first["stats"]["prompt_cached"] == 0 and cache.is_file()
    assert "0 of" in err and "prompt tokens reused" in err
    second, err = run_json(tiny_models, cache, "Is it correct?")
    n = second["stats"]["prompt_cached"]
    assert n > first["stats"]["prompt_tokens"] * 0.8
    assert f"{n} of {second['stats']['prompt_tokens']} prompt tokens reused" in err
    # the same run again without the file gives the same text (up to a near-tie, which
    # the tiny target meets rarely; the engine tests check the rule itself)
    alone = run_cli("run", "-m", str(tiny_models["target"]), "--drafter", "none", "-c",
                    "2048", "--temp", "0", "-n", "8", "--ignore-eos", "--json",
                    DOC + "Is it correct?")  # fmt: skip
    assert json.loads(alone.stdout)["stats"]["prompt_cached"] == 0


def test_run_prompt_cache_of_another_model_or_damaged_is_ignored_and_rewritten(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    cache = tmp_path / "doc.cache"
    run_json(tiny_models, cache, "Q1")
    other = dict(tiny_models, target=tiny_models["draft-partial"])
    out, err = run_json(other, cache, "Q1")
    assert out["stats"]["prompt_cached"] == 0
    assert "is ignored (made for another target model (the file's: tiny-target.gguf))" in err
    assert "written again" in err
    out, err = run_json(other, cache, "Q2")  # rewritten for the other model
    assert out["stats"]["prompt_cached"] > 0
    cache.write_bytes(cache.read_bytes()[:-100])
    out, err = run_json(other, cache, "Q2")
    assert out["stats"]["prompt_cached"] == 0 and "cut short" in err
    cache.write_text("hello")
    out, err = run_json(other, cache, "Q2")
    assert "not a specgguf prompt-cache file" in err and out["stats"]["prompt_cached"] == 0


def test_run_prompt_cache_ro_leaves_the_file_as_it_was(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    cache = tmp_path / "doc.cache"
    run_json(tiny_models, cache, "Q1")
    before = cache.read_bytes()
    out, _ = run_json(tiny_models, cache, "Q2", "--prompt-cache-ro")
    assert out["stats"]["prompt_cached"] > 0 and cache.read_bytes() == before
    missing = tmp_path / "none.cache"
    run_json(tiny_models, missing, "Q2", "--prompt-cache-ro")
    assert not missing.exists()
    bad = run_cli("run", "-m", str(tiny_models["target"]), "--prompt-cache-ro", "hi")
    assert bad.returncode == 2 and b"--prompt-cache-ro" in bad.stderr


def test_the_mtp_layers_follow_a_target_that_kept_its_prefix(tiny_models: dict[str, Path]) -> None:
    """The MTP layers read the target's hidden state of the position before theirs: a
    target that kept a prefix without computing it again leaves them what they need (the
    state after their last position, kept), or computes again the position they need."""
    from specgguf.llama.backend import CHECKPOINT_TAIL

    with load_engine(tiny_models["mtp"], drafter="mtp", n_ctx=2048) as e:
        ids = e.tokenize(DOC, add_special=False)
        rec = Recorder(e)
        first = e.generate(ids, params(12)).run()
        # the same prompt again: the head holds more than it; the target computes again
        # the position before the head's cut, from its checkpoint a few tokens before
        # the prompt's end
        rec.take()
        again = e.generate(ids, params(12)).run()
        rows = rec.take()
        assert again.stats.prompt_cached == len(ids) - 1 - CHECKPOINT_TAIL
        assert_same_or_near_tie(e, rows, ids, again, first.tokens)
        # a generation without the head moves the target on alone
        e.generate([*ids, 7, 8], params(6, drafter="none")).run()
        turn = [*ids, *first.tokens, 9, 10, 11]
        rec.take()
        res = e.generate(turn, params(12)).run()
        rows = rec.take()
        assert 0 < res.stats.prompt_cached < len(turn)
        fresh = e.generate(turn, params(12, cache_prompt=False)).run()
        assert_same_or_near_tie(e, rows, turn, res, fresh.tokens)
        # a calibration that empties the head under the drafter's feet
        e.timings(recalibrate=True)
        rec.take()
        again = e.generate(turn, params(12)).run()
        assert_same_or_near_tie(e, rec.take(), turn, again, fresh.tokens)


def test_plan_counts_the_prompt_cache_and_the_checkpoints(tiny_models: dict[str, Path]) -> None:
    from specgguf.gguf.info import read_model_info

    def cache_need(*args: str) -> int:
        res = run_cli("plan", *args, "--json")
        assert res.returncode == 0, res.stderr
        models = json.loads(res.stdout)["models"]
        return sum(m["need"]["this machine"] for m in models if m["role"] == "prompt cache")

    target, hybrid = str(tiny_models["target"]), str(tiny_models["hybrid"])
    assert cache_need("-m", target) == 0
    assert cache_need("-m", target, "--cache-ram", "100") == 100 << 20
    state = read_model_info(tiny_models["hybrid"]).recurrent_state_bytes
    assert cache_need("-m", hybrid) == 8 * state  # --ctx-checkpoints 8, one sequence
    assert cache_need("-m", hybrid, "-ctxcp", "2", "--cache-ram", "1") == (1 << 20) + 2 * state


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_a_saved_prompt_of_an_mtp_target_comes_back_and_drafts(
    tiny_models: dict[str, Path], tmp_path: Path, where: str
) -> None:
    """A conversation displaced by another and given back (from memory, or from a file:
    the MTP layers' cache and the hidden state they kept, as the target's) goes on
    drafting with the MTP layers from there."""
    from specgguf.engine import EngineConfig, ModelConfig, SpeculativeConfig
    from specgguf.engine.config import CacheConfig

    disk = CacheConfig(ram=1, disk_dir=tmp_path, disk=64 << 20)
    cache = CacheConfig(ram=64 << 20) if where == "memory" else disk
    config = EngineConfig(ModelConfig(tiny_models["mtp"], n_ctx=2048),
                          speculative=SpeculativeConfig(drafter="mtp", draft_max=4),
                          cache=cache)  # fmt: skip
    with Engine(config) as e:
        rec = Recorder(e)
        a = e.tokenize(DOC, add_special=False)
        first = e.generate(a, params(12)).run()
        e.generate(e.tokenize("beta " * 200, add_special=False), params(6)).run()
        turn = [*a, *first.tokens, 5, 6, 7]
        rec.take()
        res = e.generate(turn, params(12)).run()
        rows = rec.take()
        assert e.prompt_cache is not None and e.prompt_cache.restores == 1
        # the head's cut falls in the answer, which the hybrid state cannot be cut in:
        # it goes back to its checkpoint after the prompt, and reads the answer again
        assert res.stats.prompt_cached == len(a) - 1 and res.stats.by_drafter["mtp"].steps
        fresh = e.generate(turn, params(12, cache_prompt=False)).run()
        assert_same_or_near_tie(e, rows, turn, res, fresh.tokens)


def test_a_saved_prompt_is_taken_before_the_sequence_is_saved_over_it(
    tiny_models: dict[str, Path],
) -> None:
    """A cache that holds one sequence's state: taking it back must come before saving
    the state it replaces, which would evict it."""
    from specgguf.engine import EngineConfig, ModelConfig, SpeculativeConfig
    from specgguf.engine.config import CacheConfig

    def config(ram: int) -> EngineConfig:
        return EngineConfig(ModelConfig(tiny_models["target"], n_ctx=1024),
                            speculative=SpeculativeConfig(drafter="none"),
                            cache=CacheConfig(ram=ram))  # fmt: skip

    with Engine(config(1)) as e:
        e.generate(e.tokenize("alpha " * 100, add_special=False), params(2)).run()
        size = e.save_prompt().nbytes
    with Engine(config(int(size * 1.5))) as e:
        a = e.tokenize("alpha " * 100, add_special=False)
        first = e.generate(a, params(2)).run()
        e.generate(e.tokenize("beta " * 100, add_special=False), params(2)).run()
        res = e.generate([*a, *first.tokens, 9], params(2)).run()
        assert e.prompt_cache is not None and e.prompt_cache.restores == 1
        assert res.stats.prompt_cached == len(a) + 1 and len(e.prompt_cache) == 1


def test_a_token_tree_step_leaves_the_cache_knowing_its_tokens(
    tiny_models: dict[str, Path],
) -> None:
    """The root and the branch a tree verification keeps are what the sequence holds:
    the next prompt reuses them, and no other text's."""
    from specgguf.llama.backend import LlamaModel

    with LlamaModel(tiny_models["target"]) as m, m.new_context(n_ctx=256, tree_branches=2) as ctx:
        ctx.eval([1, 2, 3], logits="none")
        ctx.eval_tree(4, [5, 6, 7], [-1, 0, -1])  # 4 -> 5 -> 6, and 4 -> 7
        ctx.keep_tree_path([0, 1])
        assert ctx.n_past == 6 and ctx.cached_prefix([1, 2, 3, 4, 5, 6, 9]) == 6
        assert ctx.cached_prefix([1, 2, 3, 4, 7]) == 4


@pytest.mark.parametrize("drafter", [["--drafter", "auto"], ["--drafter", "model", "--draft", "4"]])
def test_run_prompt_cache_with_a_draft_model(
    tiny_models: dict[str, Path], tmp_path: Path, drafter: list[str]
) -> None:
    """What measures timings on the target (auto mode's calibration check before the first
    step, a forced drafter's target-alone rate after the text) never empties the state
    the file gives or the run saves."""
    cache = tmp_path / "doc.cache"
    args = ["-md", str(tiny_models["draft-partial"]), *drafter]
    # no calibration cached: each run measures what it needs
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    first, _ = run_json(tiny_models, cache, "Q1", *args, env=env)
    shutil.rmtree(tmp_path / "xdg", ignore_errors=True)
    second, err = run_json(tiny_models, cache, "Q2", *args, env=env)
    assert second["stats"]["prompt_cached"] > first["stats"]["prompt_tokens"] * 0.8, err
    shutil.rmtree(tmp_path / "xdg", ignore_errors=True)
    third, err = run_json(tiny_models, cache, "Q3", *args, env=env)
    assert third["stats"]["prompt_cached"] > first["stats"]["prompt_tokens"] * 0.8, err


def test_run_prompt_cache_refuses_what_is_not_a_file_and_writes_through_a_link(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    # A save replaces the file: a folder or a device must never be replaced (as root,
    # --prompt-cache /dev/null would have become a regular file).
    for path, what in ((tmp_path, b"is a folder"), (Path("/dev/null"), b"not a regular file")):
        res = run_cli("run", "-m", str(tiny_models["target"]), "--prompt-cache", str(path), "hi")
        assert res.returncode == 2 and what in res.stderr, res.stderr
    assert Path("/dev/null").is_char_device()
    real = tmp_path / "real.cache"
    link = tmp_path / "link.cache"
    link.symlink_to(real)
    run_json(tiny_models, link, "Q1")
    assert link.is_symlink() and real.is_file()
    out, _ = run_json(tiny_models, link, "Q2")
    assert out["stats"]["prompt_cached"] > 0
    # read only, a missing file is said (a mistyped name would otherwise go unnoticed)
    _, err = run_json(tiny_models, tmp_path / "typo.cache", "Q2", "--prompt-cache-ro")
    assert "typo.cache does not exist: the prompt is read whole" in err


def test_serve_cache_dir_must_be_a_folder_it_can_write(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    for where, what in ((afile, b"is not a folder"), (afile / "sub", b"cannot make the folder")):
        res = run_cli("serve", "-m", str(tiny_models["target"]), "--cache-dir", str(where))
        assert res.returncode == 2 and what in res.stderr, res.stderr
    assert afile.read_text() == "x"


def test_serve_keeps_its_prompts_in_cache_dir_for_the_next_server(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    # With the default --cache-ram, nothing is evicted in a short session: what the
    # sequences and the memory hold is written at shutdown, and a restarted server reads
    # only what the next turn adds.
    import urllib.request

    from .helpers import ServerProcess

    def ask(s: ServerProcess, text: str) -> dict[str, Any]:
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 4,
                "temperature": 0}  # fmt: skip
        req = urllib.request.Request(f"{s.base_url}/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    args = ("-m", str(tiny_models["target"]), "-c", "2048", "--drafter", "none", "-np", "1",
            "--cache-dir", str(tmp_path / "kept"))  # fmt: skip
    with ServerProcess(*args) as s:
        first = ask(s, DOC + "Q1")
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert s.stop() == 0
    assert "1 prompt(s) saved in" in s.stderr
    assert len(list((tmp_path / "kept").glob("*.sgpc"))) == 1
    # straight to the files (--cache-ram 0): counted too
    with ServerProcess(*args, "--cache-ram", "0", "--cache-dir", str(tmp_path / "disk")) as d:
        ask(d, DOC + "Q3")
        assert d.stop() == 0
    assert "1 prompt(s) saved in" in d.stderr, d.stderr
    with ServerProcess(*args) as again:
        later = ask(again, DOC + "Q2")
    with load_engine(tiny_models["target"], drafter="none", n_ctx=2048) as e:
        ids = [e.prepared_ids(e.render([{"role": "user", "content": DOC + q}]))
               for q in ("Q1", "Q2")]  # fmt: skip
    shared = int(np.flatnonzero(np.asarray(ids[0][: len(ids[1])]) != ids[1][: len(ids[0])])[0])
    assert later["usage"]["prompt_tokens"] == len(ids[1]) > shared > 500
    assert later["usage"]["prompt_tokens_details"]["cached_tokens"] == shared
