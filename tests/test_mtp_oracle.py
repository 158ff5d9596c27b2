"""llama.cpp's own MTP speculative decoding as the oracle of specgguf's ``--drafter mtp``.

``llama-speculative-simple --spec-type draft-mtp`` (built by ``scripts/bench-llama-cpp
--build-only``) and specgguf generate greedily from the tiny ``mtp`` fixture, the same
prompt and draft length K; llama.cpp's debug log (``-v``) gives every step's drafted tokens
(``draft candidate 0``), how many the target accepted and the token it added. Asserted:
the same output tokens (and text), the same draft at every comparable step, and so the same
drafted / accepted counts.

What is comparable, and why the totals llama.cpp prints differ:

- Length: llama.cpp stops once it has produced *more* than ``-n`` tokens, so it generates
  at least n + 1; specgguf generates exactly ``n_predict``. Tokens: specgguf's n are
  llama.cpp's first n.
- The last steps: both clamp a step's draft to what ``n_predict`` leaves (llama.cpp:
  ``n_predict - produced - 1``, as specgguf's loop does). But where that clamp is 0
  (produced n - 1 or n), llama.cpp does not clamp at all (``common_speculative_draft``
  truncates only for ``n_max > 0``): it drafts K tokens past the end and counts them in
  ``n_drafted`` / ``n_accept``; specgguf runs that step without a draft. So the counts are
  compared over llama.cpp's steps that started with fewer than n - 1 tokens produced.
- The prompt: llama-speculative-simple tokenizes ``-p`` with ``add_special`` and
  ``parse_special`` (BOS per the model's ``add_bos``; no chat template; ``-p`` escapes are
  processed, and the prompt here has none), as ``LlamaModel.tokenize`` does by default;
  its "encoded N tokens" line is checked against specgguf's count.
- This hybrid target supports partial removal from its sequence, so llama.cpp verifies
  each draft once (no checkpoint replays, whose re-verified tokens it would count as
  drafted and accepted).

One thread on both sides (llama.cpp's ``-t 1``, the engine's ``n_threads=1``; otherwise
as ``helpers.load_engine``): on a busy two-core machine, ggml's spinning thread pool
stalled some two-thread runs of either for 30-60 s; the output is the same. llama.cpp's
logger is asynchronous and now and then loses its last lines at exit: a run without its
final counts is repeated.
Skipped when the tools are not built, unless ``SPECGGUF_REQUIRE_LLAMA_TOOLS=1``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from specgguf.engine import Engine, EngineConfig, ModelConfig, SpeculativeConfig
from specgguf.speculative.drafters.mtp import MtpDrafter
from specgguf.speculative.loop import GenerationParams
from specgguf.speculative.sampling import SamplerParams

PROMPT = "Speculative decoding makes"
N_PREDICT = 64
TOOL = "llama-speculative-simple"


def llama_tools_dir() -> Path | None:
    """The bin folder where ``scripts/bench-llama-cpp`` builds llama.cpp's tools (its
    ``build()``: one per llama-cpp-python version and CMAKE_ARGS), if the tool is there."""
    from specgguf.llama.buildconfig import cmake_args, detect_backend, read_cpu_flags
    from specgguf.llama.runtime import build_info

    version = build_info().llama_cpp_python
    args = os.environ.get("CMAKE_ARGS") or " ".join(cmake_args(detect_backend(), read_cpu_flags()))
    key = hashlib.sha256(f"{version}|{args}".encode()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    bindir = cache / "specgguf" / "llama.cpp" / f"build-{version}-{key}" / "bin"
    return bindir if (bindir / TOOL).is_file() else None


@dataclasses.dataclass
class LlamaStep:
    produced: int  # tokens generated before the step
    draft: list[int]  # as verified (clamped to what -n leaves, where that is above 0)
    accepted: int
    token: int  # the target's own token after the accepted ones
    n_draft: int = 0  # its length (where llama.cpp does not log the draft's tokens)


@dataclasses.dataclass
class LlamaRun:
    n_prompt: int
    steps: list[LlamaStep]
    totals: dict[str, int]
    stdout: bytes

    @property
    def tokens(self) -> list[int]:
        return [t for s in self.steps for t in (*s.draft[: s.accepted], s.token)]


_STEP = re.compile(
    rb"draft candidate +0, pos +(\d+): +(\d+)"
    rb"|accepted (\d+)/(\d+) draft tokens, the last target token is: \((\d+)\)"
)


def parse_llama_log(stderr: bytes, stdout: bytes, *, logged: bool = True) -> LlamaRun:
    """The steps of a ``-v`` run: each draft's candidate-0 lines, then its "accepted" line.
    A draft's positions count from 0, or from 1 where llama.cpp logs its block's rows
    (DSpark whose block row 0 does not predict). Not ``logged``: llama.cpp logs no
    candidates (DFlash2), and the steps have only their drafts' lengths."""
    steps: list[LlamaStep] = []
    drafted: list[int] = []
    produced = 0
    first = 0
    for m in _STEP.finditer(stderr):
        if m[1] is not None:
            if not drafted:
                first = int(m[1])
                assert first in (0, 1), f"a draft starts at position {first}"
            assert int(m[1]) - first == len(drafted), "a draft position is missing from the log"
            drafted.append(int(m[2]))
            continue
        accepted, n_draft = int(m[3]), int(m[4])
        steps.append(LlamaStep(produced, drafted[:n_draft], accepted, int(m[5]), n_draft))
        produced += accepted + 1
        drafted = []
    totals = {k.decode(): int(v) for k, v in re.findall(rb"(n_\w+) *= (\d+)", stderr)}
    encoded = re.search(rb"encoded +(\d+) tokens", stderr)
    assert encoded is not None
    run = LlamaRun(int(encoded[1]), steps, totals, stdout)
    # The log is complete: the steps add up to llama.cpp's own totals.
    assert sum(len(s.draft) if logged else s.n_draft for s in steps) == totals["n_drafted"]
    assert sum(s.accepted for s in steps) == totals["n_accept"]
    assert len(run.tokens) == totals["n_predict"]
    return run


def run_llama(
    tools: Path, model: Path, k: int, n: int, *, spec_type: str = "draft-mtp",
    draft: Path | None = None, prompt: str = PROMPT, p_min: float = 0.0, logged: bool = True,
) -> LlamaRun:  # fmt: skip
    """``llama-speculative-simple`` greedily, ``--spec-type spec_type`` (``-md draft``)."""
    cmd = [
        str(tools / TOOL), "-m", str(model), "--spec-type", spec_type,
        *(["-md", str(draft)] if draft is not None else []),
        "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0", "--spec-draft-p-min", str(p_min),
        "-p", prompt, "-n", str(n), "--temp", "0", "-t", "1", "-c", "512", "--ignore-eos",
        "-v", "--log-colors", "off",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    for _ in range(3):
        res = subprocess.run(cmd, capture_output=True, timeout=60, env=env, check=False)
        assert res.returncode == 0, res.stderr.decode(errors="replace")[-3000:]
        if b"n_accept" in res.stderr:
            return parse_llama_log(res.stderr, res.stdout, logged=logged)
    raise AssertionError(f"{TOOL} lost its final log lines three times")


def one_thread_engine(model: Path, k: int) -> Engine:
    """``helpers.load_engine(model, drafter="mtp", n_ctx=512, draft_max=k)`` on one thread."""
    return Engine(
        EngineConfig(
            ModelConfig(model, n_ctx=512, n_batch=512, n_threads=1),
            None,
            SpeculativeConfig(drafter="mtp", draft_max=k),
        )
    )


@pytest.mark.parametrize("k", [1, 4, 16])
@pytest.mark.parametrize("fixture", ["mtp", "mtp-heads"])
def test_mtp_drafts_as_llama_cpp(
    k: int,
    fixture: str,
    tools: Path,
    tiny_models: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``mtp``: one MTP block (qwen35); ``mtp-heads``: two (hy_v3), which llama.cpp chains,
    so that a draft has at most two tokens (block 1 drafts the second)."""
    model = tiny_models[fixture]
    llama = run_llama(tools, model, k, N_PREDICT)
    if fixture == "mtp-heads":
        assert max(len(s.draft) for s in llama.steps) == min(k, 2)

    drafts: list[list[int]] = []  # specgguf's, one per step that asked for a draft
    propose = MtpDrafter.propose

    def recording(self: MtpDrafter, history: Sequence[int], kk: int, *a: Any, **kw: Any) -> Any:
        draft = propose(self, history, kk, *a, **kw)
        if kk > 0:
            drafts.append(list(draft.tokens))
        return draft

    monkeypatch.setattr(MtpDrafter, "propose", recording)
    with one_thread_engine(model, k) as engine:
        vocab = engine.target_model
        prompt = vocab.tokenize(PROMPT, add_special=True, parse_special=True)
        assert len(prompt) == llama.n_prompt
        params = GenerationParams(
            n_predict=N_PREDICT, draft_max=k, sampler=SamplerParams(temperature=0.0),
            ignore_eos=True,
        )  # fmt: skip
        result = engine.generate(prompt, params).run()
        text = vocab.detokenize(prompt) + vocab.detokenize(result.tokens)

    # The oracle is worth something: drafts partly accepted, a text that is no loop of one.
    assert 0.05 < llama.totals["n_accept"] / llama.totals["n_drafted"] < 0.9
    assert len(set(llama.tokens)) > 20

    assert result.tokens == llama.tokens[:N_PREDICT]
    assert llama.stdout.lstrip(b"\n").startswith(text)
    comparable = [s for s in llama.steps if s.produced < N_PREDICT - 1]
    for i, (ours, theirs) in enumerate(zip(drafts, comparable, strict=True)):
        assert ours == theirs.draft, f"step {i} (after {theirs.produced} tokens)"
    assert result.stats.drafted == sum(len(s.draft) for s in comparable)
    assert result.stats.accepted == sum(s.accepted for s in comparable)
