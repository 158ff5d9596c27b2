"""`specgguf run` through the real entry point, as a subprocess, in shell pipelines."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specgguf import errors
from specgguf.hub import testmodels

from .helpers import ROOT, run_cli

ANSI = re.compile(rb"\x1b\[")
SPECGGUF = [sys.executable, "-m", "specgguf"]


def tiny_args(tiny: dict[str, Path], *extra: str, draft: str = "draft-partial") -> list[str]:
    return ["run", "-m", str(tiny["target"]), "-md", str(tiny[draft]), "-c", "1024", *extra]


def shell(cmd: str, timeout: float = 300) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["bash", "-c", "set -o pipefail; " + cmd], capture_output=True, timeout=timeout,
        cwd=ROOT, check=False,
    )  # fmt: skip


def q(args: list[str]) -> str:
    import shlex

    return shlex.join([*SPECGGUF, *args])


def test_stdin_prompt_through_a_pipe_has_clean_stdout(tiny_models: dict[str, Path]) -> None:
    args = tiny_args(tiny_models, "--temp", "0", "-n", "40", "-v")
    res = shell(f"echo 'def add(a, b):' | {q(args)} | cat")
    assert res.returncode == 0, res.stderr
    assert res.stdout and not ANSI.search(res.stdout)
    # llama.cpp's own log lines (-v) and the summary go to stderr, never stdout.
    assert b"llama" not in res.stdout and b"tokens/s" not in res.stdout
    assert b"llama_" in res.stderr and b"tokens/s" in res.stderr
    assert not ANSI.search(res.stderr)  # stderr is not a terminal either


def test_quiet_by_default_and_summary_only(tiny_models: dict[str, Path]) -> None:
    res = run_cli(*tiny_args(tiny_models, "--temp", "0", "--draft", "4", "-n", "10", "hello"))
    assert res.returncode == 0
    lines = res.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "tokens/s" in lines[0] and "acceptance" in lines[0]
    assert run_cli(*tiny_args(tiny_models, "-q", "-n", "5", "hello")).stderr == b""


def test_prompt_argument_with_stdin_from_dev_null(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out.txt"
    args = tiny_args(tiny_models, "--temp", "0", "-n", "20", "The quick brown fox")
    res = shell(f"{q(args)} < /dev/null > {out}")
    assert res.returncode == 0, res.stderr
    assert out.read_bytes() and not ANSI.search(out.read_bytes())


def test_closed_pipe_exits_quietly(tiny_models: dict[str, Path]) -> None:
    args = tiny_args(tiny_models, "--temp", "0", "-n", "900", "--ignore-eos", "--drafter", "none",
                     "hello")  # fmt: skip
    res = shell(f'{q(args)} | head -c 5; echo " rc=${{PIPESTATUS[0]}}"')
    assert res.stdout.decode().endswith(f" rc={errors.EXIT_BROKEN_PIPE}\n"), res
    assert len(res.stdout.decode().split(" rc=")[0].encode()) == 5
    assert b"Traceback" not in res.stderr and b"Error" not in res.stderr


@pytest.mark.parametrize(
    "command",
    [["--version"], ["--help"], ["run", "--help"], ["info", "TARGET"],
     ["check", "TARGET", "TARGET"], ["plan", "-m", "TARGET"], ["list"], ["run", "TEXT"],
     ["run", "TEXT", "--json"]],
    ids=lambda c: " ".join(c),
)  # fmt: skip
def test_every_command_with_a_closed_stream(
    tiny_models: dict[str, Path], command: list[str]
) -> None:
    # 0<&-, >&-, 2>&- (issue 54: "run -m M 0<&-" was an internal error): stdin reads as
    # empty, stdout closed is a closed pipe's exit, stderr closed is silence; never a
    # traceback or an internal error, and no file opened later takes a closed number
    target = str(tiny_models["target"])
    args = [a for c in command for a in (
        [target] if c == "TARGET" else
        ["-m", target, "--drafter", "none", "-n", "8", "--temp", "0", "hello"] if c == "TEXT"
        else [c])]  # fmt: skip
    base = q(args)
    for redirect, want in (("0<&-", 0), (">&-", errors.EXIT_BROKEN_PIPE), ("2>&-", 0)):
        res = shell(f"{base} {redirect}")
        assert res.returncode == want, (redirect, res)
        assert b"Traceback" not in res.stderr and b"internal error" not in res.stderr, res
        if redirect != ">&-":
            assert res.stdout, (redirect, res)


def test_run_reads_an_empty_prompt_from_a_closed_stdin(tiny_models: dict[str, Path]) -> None:
    res = shell(f"{q(tiny_args(tiny_models, '-n', '4'))} 0<&-")
    assert res.returncode == 2 and b"the prompt is empty" in res.stderr, res


def test_json_text_equals_streamed_text_of_same_seeded_run(tiny_models: dict[str, Path]) -> None:
    common = ["--temp", "1.3", "--seed", "1234", "-n", "30", "--draft", "3", "--ignore-eos",
              "The fox"]  # fmt: skip
    streamed = run_cli(*tiny_args(tiny_models, *common))
    as_json = run_cli(*tiny_args(tiny_models, "--json", *common))
    assert streamed.returncode == as_json.returncode == 0
    data = json.loads(as_json.stdout)
    assert data["text"] == streamed.stdout.decode()
    assert set(data) >= {"text", "tokens", "finish_reason", "stats", "models", "params"}
    assert data["finish_reason"] == "length" and len(data["tokens"]) == 30
    assert {"acceptance_rate", "tokens_per_s", "drafted", "accepted", "steps"} <= set(data["stats"])
    assert data["params"]["seed"] == 1234
    assert data["models"]["drafter"] == "model"


def test_drafter_none_and_model_agree_at_temp_0(tiny_models: dict[str, Path]) -> None:
    outs = {}
    for drafter in ("none", "model", "ngram"):
        res = run_cli(*tiny_args(tiny_models, "--temp", "0", "-n", "60", "--drafter", drafter,
                                 "--ignore-eos", "--json", "def is_palindrome(text):"))  # fmt: skip
        assert res.returncode == 0, res.stderr
        outs[drafter] = json.loads(res.stdout)
    assert outs["none"]["text"] == outs["model"]["text"] == outs["ngram"]["text"]
    assert outs["none"]["stats"]["drafted"] == 0 < outs["model"]["stats"]["drafted"]


def test_incompatible_draft_is_exit_4_with_one_line(tiny_models: dict[str, Path]) -> None:
    res = run_cli(*tiny_args(tiny_models, "hello", draft="draft-spm"))
    assert res.returncode == errors.EXIT_INCOMPATIBLE
    err = res.stderr.decode().strip().splitlines()
    assert len(err) == 1 and "vocabulary types differ" in err[0]
    assert res.stdout == b""
    forced = run_cli(
        *tiny_args(tiny_models, "--no-check", "-n", "3", "hello", draft="draft-pad129")
    )
    assert forced.returncode == 0
    assert b"warning: --no-check" in forced.stderr


@pytest.mark.parametrize(
    ("case", "code", "needle"),
    [
        ("missing", errors.EXIT_MODEL_FILE, "model file not found"),
        ("not-gguf", errors.EXIT_MODEL_FILE, "an HTML page"),
        ("long-prompt", errors.EXIT_RESOURCES, "which does not fit the target's context of"),
        ("special-prompt", errors.EXIT_RESOURCES, "the prompt is at least 200 tokens, which"),
        ("no-prompt", errors.EXIT_USAGE, "no prompt"),
        ("bad-drafter", errors.EXIT_USAGE, "--drafter must be"),
    ],
)
def test_errors_are_one_line_with_documented_codes(
    tiny_models: dict[str, Path], tmp_path: Path, case: str, code: int, needle: str
) -> None:
    html = tmp_path / "model.gguf"
    html.write_text("<!DOCTYPE html><html>404</html>")
    target = str(tiny_models["target"])
    args = {
        "missing": ["run", "-m", str(tmp_path / "nope.gguf"), "hi"],
        "not-gguf": ["run", "-m", str(html), "hi"],
        "long-prompt": ["run", "-m", target, "-c", "64", "--raw", "word " * 200],
        # counted before it is tokenized (see LlamaModel.min_tokens)
        "special-prompt": ["run", "-m", target, "-c", "64", "--raw", "<|im_end|>" * 200],
        "no-prompt": ["run", "-m", target],
        "bad-drafter": ["run", "-m", target, "--drafter", "magic", "hi"],
    }[case]
    # No prompt on a terminal must not wait: stdin is a pty here.
    master, slave = pty.openpty()
    try:
        res = run_cli(*args, stdin=slave, timeout=60)
    finally:
        os.close(master)
        os.close(slave)
    assert res.returncode == code, res.stderr
    lines = res.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines
    assert res.stdout == b""


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_keeps_text_prints_stats_exits_130(tiny_models: dict[str, Path]) -> None:
    args = tiny_args(tiny_models, "--temp", "0", "-n", "-1", "-c", "8192", "--drafter", "none",
                     "--ignore-eos", "--raw", "hello")  # fmt: skip
    # A shell starts background jobs with SIGINT ignored, and Python keeps an ignored
    # SIGINT ignored: under `.ci/run &` the run ignored Ctrl-C and ended with exit 0. The
    # child gets the default disposition, as from a terminal.
    proc = subprocess.Popen([*SPECGGUF, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=ROOT, preexec_fn=_default_sigint)  # fmt: skip
    assert proc.stdout is not None
    first = proc.stdout.read(20)  # generation is under way
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == errors.EXIT_INTERRUPTED, err
    assert len(first + out) >= 20
    text = err.decode()
    assert "finish: interrupted" in text and "tokens/s" in text
    assert "Traceback" not in text


def test_live_display_under_a_pseudo_terminal(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    """stderr on a terminal (a pty), stdout to a file: the live panel shows the rates."""
    out = tmp_path / "out.txt"
    master, slave = pty.openpty()
    args = tiny_args(tiny_models, "--temp", "0", "-n", "-1", "-c", "4096", "--drafter", "model",
                     "--ignore-eos", "--raw", "hello")  # fmt: skip
    env = {**os.environ, "COLUMNS": "160", "TERM": "xterm"}
    env.pop("NO_COLOR", None)
    # SIGINT at its default, as from a terminal (see the Ctrl-C test): under a shell's
    # background job it was ignored, and the run went on past its draft model's context
    # at a few tokens/s, with the loop below reading its panel for many minutes.
    with out.open("wb") as fout:
        proc = subprocess.Popen([*SPECGGUF, *args], stdout=fout, stderr=slave, stdin=slave,
                                cwd=ROOT, env=env, preexec_fn=_default_sigint)  # fmt: skip
    os.close(slave)
    seen = b""
    # (the deadlines only end a hang; the verdict is on what was drawn)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and b"tokens/s (now)" not in seen:
        r, _, _ = select.select([master], [], [], 0.5)
        if r:
            try:
                seen += os.read(master, 65536)
            except OSError:
                break
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 60
    try:  # what it draws until it exits (EOF: OSError on Linux) or stops drawing
        while time.monotonic() < deadline:
            r, _, _ = select.select([master], [], [], 1)
            if not r:
                break
            seen += os.read(master, 65536)
    except OSError:
        pass
    try:
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    os.close(master)
    assert proc.returncode == errors.EXIT_INTERRUPTED, seen[-2000:]
    assert b"tokens/s (now)" in seen and b"acceptance" in seen and b"K=" in seen
    assert ANSI.search(seen)  # drawn with terminal control codes
    assert not ANSI.search(out.read_bytes())  # the text file got none of that


@pytest.mark.real_models
def test_main_job_on_the_real_pair(real_models: dict[str, Path]) -> None:
    target, draft = real_models[testmodels.TARGET], real_models[testmodels.DRAFT]
    prompt = "Write a Python function that checks whether a string is a palindrome"
    base = ["run", "-m", str(target), "--temp", "0", "-n", "64", "--json", prompt]
    spec = run_cli(*base, "-md", str(draft), "--draft", "4")
    alone = run_cli(*base, "--drafter", "none")
    assert spec.returncode == alone.returncode == 0, spec.stderr
    s, a = json.loads(spec.stdout), json.loads(alone.stdout)
    assert "def " in s["text"] and "palindrome" in s["text"]
    assert s["stats"]["acceptance_rate"] > 0.5
    assert s["params"]["chat_template"] is True
    # Same text unless llama.cpp's batched kernels flipped a near-tie (see
    # test_speculative_real); this prompt and K stay within the bit-identical batch sizes.
    assert s["text"] == a["text"]


def test_context_size_is_the_one_asked_for(tiny_models: dict[str, Path]) -> None:
    # llama.cpp rounds a context up to 256 positions; specgguf keeps to -c.
    base = ["run", "-m", str(tiny_models["target"]), "--temp", "0", "--ignore-eos"]
    res = run_cli(*base, "-c", "40", "--json", "hello")
    assert res.returncode == 0, res.stderr
    stats = json.loads(res.stdout)["stats"]
    assert stats["prompt_tokens"] + stats["generated"] == 40
    long_prompt = "hello there, how are you doing today my friend " * 3
    res = run_cli(*base, "-c", "10", long_prompt)
    assert res.returncode == errors.EXIT_RESOURCES and res.stdout == b""
    assert b"context of 10 tokens" in res.stderr and len(res.stderr.splitlines()) == 1


@pytest.mark.parametrize("prompt", ["", "  \n"])
def test_empty_prompt_is_a_usage_error(tiny_models: dict[str, Path], prompt: str) -> None:
    res = run_cli("run", "-m", str(tiny_models["target"]), prompt)
    assert res.returncode == errors.EXIT_USAGE and res.stdout == b""
    assert res.stderr.decode().strip() == (
        "specgguf: error: the prompt is empty: give the text to continue or answer"
    )


@pytest.mark.parametrize(
    "flag",
    [("--top-p", "5"), ("--top-k", "-3"), ("--min-p", "1.5"), ("--draft-p-min", "1.5"),
     ("--draft-p-min", "-1"), ("-n", "-5")],
)  # fmt: skip
def test_sampling_values_out_of_range(tiny_models: dict[str, Path], flag: tuple[str, str]) -> None:
    res = run_cli("run", "-m", str(tiny_models["target"]), *flag, "hi")
    assert res.returncode == errors.EXIT_USAGE and res.stdout == b""
    assert flag[0].encode() in res.stderr


def test_a_context_beyond_the_models_training_is_warned_of(tiny_models: dict[str, Path]) -> None:
    # The tiny target was trained for 1024 tokens (its GGUF's context_length).
    target = str(tiny_models["target"])
    for ctx, warned in (("1024", False), ("2048", True)):
        res = run_cli("run", "-m", target, "-c", ctx, "-n", "2", "--raw", "hi")
        assert res.returncode == 0, res.stderr
        line = f"n_ctx {ctx} is more than tiny-target.gguf was trained for (1024)"
        assert (line in res.stderr.decode()) == warned, res.stderr
