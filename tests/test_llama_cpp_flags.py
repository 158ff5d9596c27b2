"""llama.cpp's speculative flag names (2026: --spec-*) next to specgguf's, --spec-type, the
minimum draft length through the engine, and load progress."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest

from specgguf import errors
from specgguf.cli import options as o
from specgguf.engine.config import SpeculativeConfig

from .helpers import load_engine, run_cli


def help_records(command: str) -> dict[str, list[str]]:
    """``specgguf COMMAND --help``: section title -> the lines that start an option (its
    names, then its metavar, then, when they fit, its help text)."""
    out = run_cli(command, "--help").stdout.decode()
    sections: dict[str, list[str]] = {}
    title = ""
    for line in out.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
            sections[title] = []
        elif title and line.startswith("  -"):
            sections[title].append(line.strip())
    return sections


SPEC_TITLE = "Speculative decoding (llama.cpp's --spec-* names and the former ones)"


@pytest.mark.parametrize(
    "names",
    [
        ("-md", "--model-draft", "--spec-draft-model"),
        ("-hfd", "--hf-repo-draft", "--spec-draft-hf"),
        ("--draft", "--draft-max", "--spec-draft-n-max"),
        ("--draft-min", "--spec-draft-n-min"),
        ("--draft-p-min", "--spec-draft-p-min"),
        ("-cd", "--ctx-size-draft", "--spec-draft-ctx-size"),
        ("-ngld", "--n-gpu-layers-draft", "--gpu-layers-draft", "--spec-draft-ngl"),
        ("-devd", "--device-draft", "--spec-draft-device"),
        ("--spec-type",),
        ("--no-draft",),
    ],
)
def test_run_help_shows_old_and_new_names_as_one_option(names: tuple[str, ...]) -> None:
    sections = help_records("run")
    records = [r for r in sections[SPEC_TITLE] if r.split(",")[0].split()[0] == names[0]]
    assert len(records) == 1, sections[SPEC_TITLE]
    head = records[0].split("  ")[0]  # the names (and the metavar), before the help text
    assert all(re.search(rf"(^|, ){re.escape(n)}(,| |$)", head) for n in names), head
    # Nothing speculative is left among the general options.
    assert not any("draft" in r.split("  ")[0] for r in sections["Options"])


def test_bench_help_groups_its_draft_options_too() -> None:
    records = help_records("bench")[SPEC_TITLE]
    assert any(r.startswith("--draft, --spec-draft-n-max") for r in records)
    assert any(r.startswith("-md, -d, --model-draft, --spec-draft-model") for r in records)


def run_json(*args: str) -> dict[str, object]:
    res = run_cli("run", "--temp", "0", "--ignore-eos", "--json", *args, "def is_palindrome(s):")
    assert res.returncode == 0, res.stderr
    out: dict[str, object] = json.loads(res.stdout)
    return out


def test_old_and_new_names_give_the_same_run(tiny_models: dict[str, Path]) -> None:
    target, draft = str(tiny_models["target"]), str(tiny_models["draft-partial"])
    old = run_json("-m", target, "-md", draft, "--draft", "3", "--draft-p-min", "0.2",
                   "-cd", "512", "-ngld", "0", "-n", "24")  # fmt: skip
    new = run_json("-m", target, "--spec-draft-model", draft, "--spec-draft-n-max", "3",
                   "--spec-draft-p-min", "0.2", "--spec-draft-ctx-size", "512",
                   "--spec-draft-ngl", "0", "--spec-type", "draft-simple", "-n", "24")  # fmt: skip
    assert new["tokens"] == old["tokens"] and new["models"] == old["models"]
    assert new["models"]["drafter"] == "model"  # type: ignore[index]
    for key in ("draft_max", "draft_min"):
        assert new["params"][key] == old["params"][key]  # type: ignore[index]
    assert old["params"]["draft_max"] == 3  # type: ignore[index]
    assert old["stats"]["drafted"] > 0  # type: ignore[index]


def test_draft_min_keeps_short_drafts_from_verification(tiny_models: dict[str, Path]) -> None:
    # With p_min 0.6 the tiny draft often stops after one or two tokens.
    args = ["-m", str(tiny_models["target"]), "-md", str(tiny_models["draft-identical"]),
            "--spec-draft-n-max", "4", "--spec-draft-p-min", "0.6", "-n", "40"]  # fmt: skip
    free = run_json(*args)
    kept = run_json(*args, "--spec-draft-n-min", "3")
    steps, drafted, _ = kept["stats"]["by_drafter"]["model"]  # type: ignore[index]
    assert steps > 0 and drafted >= 3 * steps  # every verified draft has 3 or 4 tokens
    assert kept["params"]["draft_min"] == 3  # type: ignore[index]
    # Control: without a minimum, shorter drafts were verified.
    steps, drafted, _ = free["stats"]["by_drafter"]["model"]  # type: ignore[index]
    assert drafted < 3 * steps


@pytest.mark.parametrize(
    ("value", "drafter", "note"),
    [
        ("draft-simple", "model", None),
        ("ngram-simple", "ngram", "n-gram lookup"),
        ("ngram-mod", "ngram", "hash pool"),
        ("ngram-map-k,ngram-map-k4v", "ngram", "n-gram counts"),
        ("ngram-cache", "ngram", "cache files"),
        ("draft-simple,ngram-mod", "auto", "auto mode"),
        ("draft-mtp", "mtp", None),
        ("draft-eagle3", "eagle3", None),
        ("draft-dflash", "dflash", None),
        ("draft-dspark", "dflash", None),
        ("draft-mtp,ngram-mod", "auto", "mtp with ngram is auto mode"),
        ("none", "none", None),
        ("none,draft-simple", "model", None),
        ("DRAFT-SIMPLE", "model", None),
    ],
)
def test_spec_type_maps_to_a_drafter(value: str, drafter: str, note: str | None) -> None:
    got, said = o.spec_type_drafter(value)
    assert got == drafter
    assert (said is None) == (note is None)
    if note:
        assert note in str(said) and len(str(said).splitlines()) == 1


@pytest.mark.parametrize(
    ("value", "needle"),
    [("draft-foo", "not with draft-foo"), ("draft-dflash2", "DSpark"),
     ("ngram-magic", "unknown type"), ("", "needs a type")],
)  # fmt: skip
def test_spec_type_refuses_what_specgguf_cannot_run(value: str, needle: str) -> None:
    with pytest.raises(errors.UsageError, match=needle):
        o.spec_type_drafter(value)


def test_spec_type_on_the_command_line(tiny_models: dict[str, Path]) -> None:
    target = str(tiny_models["target"])
    res = run_cli("run", "-m", target, "--spec-type", "ngram-mod", "--json", "-n", "3", "hi")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["models"]["drafter"] == "ngram"
    assert b"note: --spec-type ngram-mod" in res.stderr
    for flags, code, needle in [
        (["--spec-type", "draft-mtp"], errors.EXIT_USAGE, b"multi-token-prediction"),
        (["--spec-type", "ngram-mod", "--drafter", "model"], errors.EXIT_USAGE, b"give one"),
        (["--no-draft", "-md", target], errors.EXIT_USAGE, b"exclude each other"),
        (["--spec-draft-n-max", "2", "--spec-draft-n-min", "3"], errors.EXIT_USAGE,
         b"minimum draft length (3) is larger"),
        (["-ngld", "lots"], errors.EXIT_USAGE, b"not a number of layers"),
    ]:  # fmt: skip
        res = run_cli("run", "-m", target, *flags, "hi")
        assert res.returncode == code and needle in res.stderr, (flags, res.stderr)


def test_gpu_layers_take_llama_cpp_words_and_devd_none_keeps_the_draft_on_the_cpu(
    tiny_models: dict[str, Path],
) -> None:
    assert [o.gpu_layers(v) for v in ("all", "AUTO", "12", "-1", 7)] == [-1, -1, 12, -1, 7]
    pair = o.ModelOptions(model=str(tiny_models["target"]),
                          model_draft=str(tiny_models["draft-partial"]), ctx_size=512)  # fmt: skip
    config = o.engine_config(replace(pair, n_gpu_layers_draft=-1, device_draft="none"))
    assert config.draft is not None
    assert config.draft.devices == () and config.draft.n_gpu_layers == 0
    named = o.engine_config(replace(pair, device_draft="CUDA0,CUDA1"))
    assert named.draft is not None and named.draft.devices == ("CUDA0", "CUDA1")
    with pytest.raises(errors.UsageError, match="-devd takes none or device names"):
        o.engine_config(replace(pair, model_draft=None, device_draft="none,CUDA0"),
                        o.DraftOptions(drafter="ngram"))  # fmt: skip


def test_an_unknown_device_is_refused_before_anything_loads(
    tiny_models: dict[str, Path],
) -> None:
    res = run_cli("run", "-m", str(tiny_models["target"]), "-md",
                  str(tiny_models["draft-partial"]), "-devd", "NoSuchGPU0", "-v", "hi")  # fmt: skip
    assert res.returncode == errors.EXIT_USAGE
    assert b"no device 'NoSuchGPU0'" in res.stderr
    assert b"llama_model_load" not in res.stderr  # nothing was loaded (-v shows llama.cpp)


def test_draft_min_is_checked_and_reaches_each_generation(tiny_models: dict[str, Path]) -> None:
    from specgguf.speculative.loop import GenerationParams
    from specgguf.speculative.planner import FixedPlanner

    with pytest.raises(errors.UsageError, match="larger than the draft length"):
        SpeculativeConfig(drafter="model", draft_max=4, draft_min=5)
    with pytest.raises(errors.UsageError, match="0 or more"):
        SpeculativeConfig(draft_min=-1)
    assert SpeculativeConfig(drafter="auto", draft_min=16).draft_min == 16  # auto's K is 16
    with load_engine(tiny_models["target"], tiny_models["draft-partial"], drafter="model",
                     draft_max=8, n_ctx=512) as engine:  # fmt: skip
        planner = engine.planner(GenerationParams(draft_min=3))
        assert isinstance(planner, FixedPlanner) and planner.draft_min == 3
        assert engine.planner(GenerationParams()).draft_min == 0  # type: ignore[attr-defined]
        auto = engine.planner(GenerationParams(drafter="auto", draft_min=5))
        assert auto.draft_min == 5  # type: ignore[attr-defined]
        with pytest.raises(errors.UsageError, match="larger than the draft length"):
            engine.planner(GenerationParams(draft_max=2, draft_min=3))
        assert engine.describe()["draft_min"] == 0


def test_a_fixed_drafter_asked_for_under_auto_drafts_at_most_16(
    tiny_models: dict[str, Path],
) -> None:
    # Auto mode's own largest draft (64) is for its lookup copies; a generation that asks
    # for another drafter without a draft length gets 16, as auto's draft model does, and
    # what it asks for when it asks.
    from specgguf.speculative.loop import GenerationParams
    from specgguf.speculative.planner import AutoPlanner
    from specgguf.speculative.tuning import AUTO_TUNING

    assert SpeculativeConfig(drafter="auto").draft_max == AUTO_TUNING.draft_max_lookup == 64
    with load_engine(tiny_models["target"], tiny_models["draft-partial"], drafter="auto",
                     draft_max=-1, n_ctx=512) as engine:  # fmt: skip
        auto = engine.planner(GenerationParams())
        assert isinstance(auto, AutoPlanner)
        model_arm = auto.arm("model")
        assert (auto.draft_max, model_arm.draft_max) == (64, AUTO_TUNING.draft_max_model)  # type: ignore[attr-defined]
        assert AUTO_TUNING.draft_max_model == 16
        assert [arm.name for arm in auto.arms] == ["ngram", "suffix", "model"]
        for kind in ("model", "ngram", "suffix"):
            assert engine.planner(GenerationParams(drafter=kind)).draft_max == 16, kind
        assert engine.planner(GenerationParams(drafter="ngram", draft_max=40)).draft_max == 40


# --- load progress -------------------------------------------------------------------


def test_load_progress_reaches_every_model_and_ends_at_one(tiny_models: dict[str, Path]) -> None:
    from specgguf.engine import Engine, EngineConfig, ModelConfig, SpeculativeConfig

    seen: dict[Path, list[float]] = {}
    config = EngineConfig(
        ModelConfig(tiny_models["target"], n_ctx=256),
        ModelConfig(tiny_models["draft-partial"], n_ctx=256), SpeculativeConfig("model", 4),
    )  # fmt: skip
    with Engine(config, on_load_progress=lambda p, x: seen.setdefault(p, []).append(x)):
        pass
    assert list(seen) == [tiny_models["target"], tiny_models["draft-partial"]]
    for shares in seen.values():
        assert shares[0] == 0.0 and shares[-1] == 1.0 and shares == sorted(shares)
        assert len(shares) > 2


@pytest.mark.parametrize("huge_pages", [False, True])
def test_an_exception_in_the_progress_callback_aborts_the_load(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, huge_pages: bool
) -> None:
    from specgguf.llama import hugepages
    from specgguf.llama.backend import LlamaModel

    # With huge pages the caller's callback runs behind the advice's hook: the same holds.
    monkeypatch.setattr(hugepages, "enabled", lambda default: default)
    calls: list[float] = []

    def interrupt(share: float) -> None:
        calls.append(share)
        if share > 0.0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        LlamaModel(tiny_models["target"], progress=interrupt, huge_pages=huge_pages)
    assert len(calls) == 2  # llama.cpp stopped at the first refusal
    # Control: the same load without the interruption succeeds.
    with LlamaModel(tiny_models["target"], progress=calls.append, huge_pages=huge_pages) as model:
        assert model.n_vocab > 0 and calls[-1] == 1.0


def test_load_progress_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from specgguf.cli import display

    big, small = tmp_path / "big.gguf", tmp_path / "small.gguf"
    sizes = {big: 3 * 2**30, small: 2**20}  # only models of a GiB or more report
    with display.LoadProgress(dict(sizes), live=False) as progress:
        for share in (0.0, 0.5, 1.0):
            progress(big, share)
            progress(small, share)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and re.fullmatch(r"specgguf: loaded big\.gguf \(3\.00 GiB\) in \S+ s",
                                          err[0]), err  # fmt: skip
    with display.LoadProgress(dict(sizes), quiet=True, live=False) as progress:
        progress(big, 1.0)
    assert capsys.readouterr().err == ""
    # On a terminal: a Rich bar (drawn to stderr, here captured).
    monkeypatch.setenv("COLUMNS", "100")
    with display.LoadProgress(dict(sizes), live=True) as progress:
        for share in (0.0, 0.5, 1.0):
            progress(big, share)
    out = capsys.readouterr()
    assert "loading big.gguf" in out.err and "3.0/3.0 GiB" in out.err and out.out == ""


@pytest.mark.real_models
def test_a_real_target_reports_its_load_on_stderr(real_models: dict[str, Path]) -> None:
    from specgguf.hub.testmodels import TARGET

    res = run_cli("run", "-m", str(real_models[TARGET]), "--drafter", "none", "-n", "1",
                  "--temp", "0", "hi", env={"NO_COLOR": "1"})  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert re.search(rb"specgguf: loaded qwen2.5-coder-1.5b\S* \(1\.04 GiB\) in \S+ s",
                     res.stderr), res.stderr  # fmt: skip
    assert os.path.getsize(real_models[TARGET]) >= 2**30


def test_prompt_with_p_as_llama_cpp_takes_it(tiny_models: dict[str, Path]) -> None:
    base = ["run", "-m", str(tiny_models["target"]), "--temp", "0", "-n", "6", "--json"]
    by_flag = run_cli(*base, "-p", "hello")
    by_arg = run_cli(*base, "hello")
    assert by_flag.returncode == by_arg.returncode == 0, by_flag.stderr
    assert json.loads(by_flag.stdout)["tokens"] == json.loads(by_arg.stdout)["tokens"]
    both = run_cli(*base, "-p", "hello", "there")
    assert both.returncode == errors.EXIT_USAGE and b"-p/--prompt, not both" in both.stderr
