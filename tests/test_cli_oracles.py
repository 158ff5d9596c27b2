"""The command line against values computed independently of the code under test: stop
strings against the full output cut by hand, ``--system`` against the ChatML text written
out and tokenized by llama.cpp, ``-f`` against the same prompt given as an argument,
``-c 0`` against the training context read with gguf-py, the memory refusal against the
KV cache size computed from the file's shape, ``--draft-p-min`` against a draft that can
never pass it, and the exit codes 1, 5 and 9 (``doctor``'s failed smoke test included)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from specgguf import errors
from specgguf.gguf.tiny import TinySpec, gpt2_vocab, write_tiny_model
from specgguf.llama.backend import LlamaModel

from .helpers import run_cli


def run_json(*args: str) -> dict[str, Any]:
    res = run_cli("run", "--json", *args)
    assert res.returncode == 0, res.stderr.decode()
    data: dict[str, Any] = json.loads(res.stdout)
    return data


def greedy(tiny: dict[str, Path], *args: str) -> list[str]:
    return ["-m", str(tiny["target"]), "-c", "512", "--temp", "0", "--ignore-eos", *args]


def test_several_stop_strings_cut_at_the_earliest(tiny_models: dict[str, Path]) -> None:
    prompt = "def is_palindrome(text):"
    full = run_json(*greedy(tiny_models, "-n", "40", "--drafter", "none", "--raw", prompt))
    text = full["text"]
    assert len(text) > 30
    # Two stop strings from the output: the one that occurs first ends it, whichever is
    # listed first; the text is the full output cut by hand.
    early, late = text[10:13], text[25:28]
    assert early.strip() and late.strip()
    cut = min(text.index(early), text.index(late))
    for stops in ((early, late), (late, early)):
        flags = [a for s in stops for a in ("--stop", s)]
        for drafter in (["--drafter", "none"],
                        ["-md", str(tiny_models["draft-partial"]), "--draft", "4"]):  # fmt: skip
            out = run_json(*greedy(tiny_models, "-n", "40", *drafter, *flags, "--raw", prompt))
            assert out["text"] == text[:cut], (stops, drafter)
            assert out["finish_reason"] == "stop"
            assert out["params"]["stop"] == list(stops)
            # The tokens are the full run's, up to the one that completed the stop string.
            assert out["tokens"] == full["tokens"][: len(out["tokens"])]


def test_system_message_is_rendered_as_the_template_says(tiny_models: dict[str, Path]) -> None:
    # The tiny target carries a ChatML template: the prompt is this text, written out here,
    # tokenized by llama.cpp itself with special tokens parsed.
    expected = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                "<|im_start|>assistant\n")  # fmt: skip
    with LlamaModel(tiny_models["target"], vocab_only=True) as m:
        n_expected = len(m.tokenize(expected, add_special=True, parse_special=True))
        n_plain = len(m.tokenize(expected.split("<|im_start|>user")[0], parse_special=True))
    args = greedy(tiny_models, "-n", "4", "--drafter", "none")
    out = run_json(*args, "--system", "Be brief.", "hi")
    assert out["params"]["chat_template"] is True
    assert out["params"]["prompt_tokens"] == n_expected
    without = run_json(*args, "hi")
    assert without["params"]["prompt_tokens"] == n_expected - n_plain


def test_prompt_file_equals_the_same_prompt_as_an_argument(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    prompt = "def add(a, b):\n    return a + b\n\n# caf\u00e9 \U0001f680\n"
    path = tmp_path / "prompt.txt"
    path.write_text(prompt, encoding="utf-8")
    args = greedy(tiny_models, "-n", "16", "--drafter", "none", "--raw")
    from_file = run_json(*args, "-f", str(path))
    from_arg = run_json(*args, prompt)
    assert from_file["tokens"] == from_arg["tokens"] and from_file["text"] == from_arg["text"]
    assert from_file["params"]["prompt_tokens"] == from_arg["params"]["prompt_tokens"]
    # Both at once is a usage error; a file that is not UTF-8 too.
    res = run_cli("run", *args, "-f", str(path), "hi")
    assert res.returncode == errors.EXIT_USAGE and b"not both" in res.stderr
    path.write_bytes(b"\xff\xfe bad")
    res = run_cli("run", *args, "-f", str(path))
    assert res.returncode == errors.EXIT_USAGE and b"cannot read the prompt file" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_ctx_size_0_is_the_training_context(tiny_models: dict[str, Path]) -> None:
    from gguf import GGUFReader

    field = GGUFReader(tiny_models["target"]).fields["llama.context_length"]
    trained = int(field.parts[field.data[0]][0])
    assert trained == 1024  # what the fixture writes; not the 4096 default of -c
    out = run_json("-m", str(tiny_models["target"]), "-c", "0", "--temp", "0", "-n", "-1",
                   "--ignore-eos", "--drafter", "none", "--raw", "hi")  # fmt: skip
    assert out["params"]["n_ctx"] == trained
    # Generating until the context is full stops exactly there.
    assert out["stats"]["prompt_tokens"] + out["stats"]["generated"] == trained
    assert out["finish_reason"] == "length"


def test_memory_refusal_is_exit_5_with_the_kv_cache_computed_by_hand(
    tiny_models: dict[str, Path],
) -> None:
    # The tiny target: 2 layers, 2 KV heads of 64 / 4 = 16 values; F16 K and V. A context
    # of 2e9 positions needs 2 * 2 * 2e9 * 2 * 16 * 2 bytes = 476.84 GiB of KV cache.
    n_ctx = 2_000_000_000
    kv_gib = 2 * 2 * n_ctx * 2 * 16 * 2 / 2**30
    assert f"{kv_gib:.2f}" == "476.84"
    res = run_cli("run", "-m", str(tiny_models["target"]), "-c", str(n_ctx), "--raw", "hi")
    assert res.returncode == errors.EXIT_RESOURCES, res.stderr
    lines = res.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and res.stdout == b""
    assert "KV cache 476.84 GiB" in lines[0] and "--force" in lines[0]


def test_draft_p_min_reaches_the_draft_model(tiny_models: dict[str, Path]) -> None:
    # No token has probability 1 under the draft, so with --draft-p-min 1 the draft model
    # stops before its first token at every step; with 0 it drafts.
    args = ["-m", str(tiny_models["target"]), "-md", str(tiny_models["draft-identical"]),
            "-c", "512", "--temp", "0", "-n", "24", "--ignore-eos", "--drafter", "model",
            "--draft", "4", "--raw", "def is_palindrome(text):"]  # fmt: skip
    free = run_json(*args)
    assert free["stats"]["drafted"] > 10 and free["stats"]["accepted"] == free["stats"]["drafted"]
    never = run_json(*args, "--draft-p-min", "1")
    assert never["stats"]["drafted"] == 0 and never["tokens"] == free["tokens"]


def test_backend_failure_is_exit_9(tmp_path: Path) -> None:
    # A well-formed GGUF file of an architecture llama.cpp knows (starcoder2) but with a
    # llama's tensors: preflight does not mirror starcoder2's required tensors (see
    # gguf/loadcheck.py), so the metadata checks pass and llama.cpp refuses to load it.
    spec = TinySpec(vocab=gpt2_vocab(), name="odd", architecture="starcoder2")
    path = write_tiny_model(tmp_path / "odd.gguf", spec)[0]
    res = run_cli("run", "-m", str(path), "-c", "1024", "--raw", "-n", "2", "hi")
    assert res.returncode == errors.EXIT_BACKEND, res.stderr
    lines = res.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specgguf: error: ") and res.stdout == b""
    assert "-v" in lines[0]  # the hint: llama.cpp's own log says why


def test_internal_error_is_exit_1_with_one_line(
    tiny_models: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A bug (an exception that is not a SpecggufError) is one line and exit 1, with the
    # way to get the traceback; with SPECGGUF_DEBUG set, the traceback itself.
    from specgguf import engine
    from specgguf.cli import main

    def broken(config: object) -> None:
        raise KeyError("planted")

    monkeypatch.setattr(engine, "preflight", broken)
    with pytest.raises(SystemExit) as ei:
        main(["run", "-m", str(tiny_models["target"]), "--raw", "hi"])
    assert ei.value.code == errors.EXIT_INTERNAL
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip().splitlines() == [
        "specgguf: internal error: KeyError: 'planted' (set SPECGGUF_DEBUG=1 for a traceback)"
    ]
    monkeypatch.setenv("SPECGGUF_DEBUG", "1")
    with pytest.raises(KeyError, match="planted"):
        main(["run", "-m", str(tiny_models["target"]), "--raw", "hi"])


def test_doctor_failed_smoke_test_is_exit_9(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from specgguf.cli import main
    from specgguf.llama import doctor
    from specgguf.llama.child import ChildResult

    failed = ChildResult(False, {}, 0.5, "crashed with SIGILL")
    monkeypatch.setattr(doctor, "run_child", lambda *a, **kw: failed)
    with pytest.raises(SystemExit) as ei:
        main(["doctor", "--json"])
    assert ei.value.code == errors.EXIT_BACKEND
    out, err = capsys.readouterr()
    rep = json.loads(out)  # the report is still printed, with the failure in it
    assert rep["smoke_test"] == {"ok": False, "tokens": 0, "seconds": 0.5,
                                 "detail": "crashed with SIGILL"}  # fmt: skip
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "smoke test failed: crashed with SIGILL" in lines[0]
    assert "reinstall with" in lines[0]
    # The table form fails the same way.
    with pytest.raises(SystemExit) as ei:
        main(["doctor"])
    assert ei.value.code == errors.EXIT_BACKEND
    out, _ = capsys.readouterr()
    assert "FAILED: crashed with SIGILL" in out
