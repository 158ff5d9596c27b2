"""The automatic choice of a draft model among the models on disk (hub/draft_search.py), and
``run``/``list --drafts-for`` over it."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

from specgguf import errors
from specgguf.gguf.tiny import TinySpec, fixture_specs, spm_vocab, write_tiny_model
from specgguf.hub import draft_search as drafts
from specgguf.hub.draft_search import CHOSEN, COMPATIBLE, REJECTED, UNCHECKED, find_drafts
from specgguf.hub.registry import load_registry

from .helpers import run_cli

COMMIT = "c0ffee" + "0" * 34


def cache_file(hub: Path, repo: str, name: str, spec: TinySpec | bytes) -> Path:
    """Write a file into a Hugging Face cache laid out as huggingface_hub lays it out:
    the blob, a snapshot link to it, and refs/main. Returns the snapshot path."""
    folder = hub / ("models--" + repo.replace("/", "--"))
    snap = folder / "snapshots" / COMMIT / name
    blob = folder / "blobs" / f"{name}.blob"
    blob.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(spec, bytes):
        blob.write_bytes(spec)
    else:
        write_tiny_model(blob.with_suffix(".gguf"), spec)
        blob.with_suffix(".gguf").rename(blob)
    snap.parent.mkdir(parents=True, exist_ok=True)
    snap.symlink_to(os.path.relpath(blob, snap.parent))
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(COMMIT)
    return snap


TARGET = dataclasses.replace(fixture_specs()["target"], name="tiny target")  # 140K parameters


def small(name: str, n_embd: int, *, quant: Q = Q.F32, vocab: object = None) -> TinySpec:
    """A draft much smaller than ``TARGET`` (F32 allows rows shorter than a Q8_0 block)."""
    return dataclasses.replace(
        TARGET, name=name, n_embd=n_embd, n_ff=2 * n_embd, n_layer=1, quant=quant,
        vocab=vocab or TARGET.vocab,
    )  # fmt: skip


SPM = spm_vocab()
BIG = dataclasses.replace(TARGET, name="big", perturb=0.3)


@pytest.fixture
def disk(isolated_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A Hugging Face cache and an extra folder holding every kind of candidate."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))  # the memo, kept here
    hub = isolated_env / "hf" / "hub"
    files = {
        "target": cache_file(hub, "test/target-GGUF", "target-Q8_0.gguf", TARGET),
        # 19K parameters: compatible, at most a quarter of the target's
        "small": cache_file(hub, "test/small-GGUF", "small-F32.gguf", small("small", 16)),
        # 9K: compatible and smaller still: the one to choose
        "smaller": cache_file(hub, "test/smaller-GGUF", "smaller-F32.gguf", small("s", 8)),
        # 9K but another vocabulary: smallest, yet it must never be chosen
        "spm": cache_file(hub, "test/spm-GGUF", "spm-F32.gguf", small("spm", 8, vocab=SPM)),
        # the target's own size: compatible, but too large to pay as a draft
        "big": cache_file(hub, "test/big-GGUF", "big-Q8_0.gguf", BIG),
        "html": cache_file(hub, "test/html-GGUF", "html-Q8_0.gguf", b"<!DOCTYPE html><html>"),
        "mmproj": cache_file(hub, "test/small-GGUF", "mmproj-small-f16.gguf", b"sidecar"),
    }
    # An unfinished download: the snapshot link exists, its blob does not yet.
    dangling = hub / "models--test--partial-GGUF" / "snapshots" / COMMIT / "partial-Q8_0.gguf"
    dangling.parent.mkdir(parents=True)
    dangling.symlink_to("../../blobs/missing")
    extra = tmp_path / "extra"
    files["extra"] = write_tiny_model(extra / "deep" / "extra-F32.gguf", small("extra", 16))[0]
    return files


def by_name(found: drafts.DraftSearch) -> dict[str, drafts.DraftCandidate]:
    return {c.path.name: c for c in found.candidates}


def test_the_smallest_compatible_draft_is_chosen_and_the_rest_explained(
    disk: dict[str, Path],
) -> None:
    found = find_drafts(disk["target"], check_all=True)
    rows = by_name(found)
    assert found.chosen is not None and found.chosen.path == disk["smaller"]
    assert "smallest" in found.chosen.reason
    assert rows["small-F32.gguf"].verdict == COMPATIBLE
    assert rows["spm-F32.gguf"].verdict == REJECTED
    assert "vocabulary types differ" in rows["spm-F32.gguf"].reason
    big, html = rows["big-Q8_0.gguf"], rows["html-Q8_0.gguf"]
    assert big.verdict == REJECTED and "100% of the target's" in big.reason
    assert html.verdict == REJECTED and "HTML" in html.reason
    # The target itself, sidecars and unfinished downloads are not candidates.
    assert set(rows) == {"small-F32.gguf", "smaller-F32.gguf", "spm-F32.gguf", "big-Q8_0.gguf",
                         "html-Q8_0.gguf"}  # fmt: skip
    assert rows["smaller-F32.gguf"].source == "Hugging Face cache (test/smaller-GGUF)"
    assert rows["smaller-F32.gguf"].n_params == params_of(small("s", 8))
    assert found.candidates[0] == found.chosen  # listed first
    assert found.target_params == TARGET_PARAMS


def params_of(spec: TinySpec) -> int:
    """Parameters of a tiny llama model, from its shape (tiny.py's tensors)."""
    d, ff, v = spec.n_embd, spec.n_ff, len(spec.vocab.tokens)
    kv = d // spec.n_head * spec.n_head_kv
    layer = 2 * d + 2 * d * d + 2 * kv * d + 3 * d * ff
    return 2 * v * d + spec.n_layer * layer + d


TARGET_PARAMS = params_of(TARGET)


def test_extra_folders_are_searched_and_without_check_all_the_search_stops_early(
    disk: dict[str, Path],
) -> None:
    found = find_drafts(disk["target"], search_dirs=[disk["extra"].parent.parent])
    rows = by_name(found)
    assert rows["extra-F32.gguf"].source == str(disk["extra"].parent.parent)
    assert found.chosen is not None and found.chosen.path == disk["smaller"]
    # The larger compatible ones were not needed: not checked.
    assert rows["small-F32.gguf"].verdict == UNCHECKED
    assert rows["extra-F32.gguf"].verdict == UNCHECKED
    with pytest.raises(errors.UsageError, match="not found"):
        find_drafts(disk["target"], search_dirs=[disk["extra"].parent / "nope"])


def test_no_compatible_file_means_no_choice(disk: dict[str, Path]) -> None:
    for name in ("small", "smaller"):
        disk[name].unlink()
    found = find_drafts(disk["target"], check_all=True)
    assert found.chosen is None and found.n_files == 3
    assert all(c.verdict == REJECTED for c in found.candidates)


def test_ties_in_parameters_go_to_the_smaller_file(isolated_env: Path, tmp_path: Path) -> None:
    # A larger target, so that a draft wide enough for Q8_0 blocks stays under a quarter.
    target = dataclasses.replace(TARGET, n_embd=128, n_ff=256)
    folder = tmp_path / "models"
    t = write_tiny_model(folder / "target.gguf", target)[0]
    same = dataclasses.replace(TARGET, name="d", n_embd=32, n_ff=64, n_layer=1)
    f32 = write_tiny_model(folder / "d-F32.gguf", dataclasses.replace(same, quant=Q.F32))[0]
    q8 = write_tiny_model(folder / "d-Q8_0.gguf", same)[0]
    found = find_drafts(t, search_dirs=[folder], check_all=True)
    rows = by_name(found)
    assert rows["d-F32.gguf"].n_params == rows["d-Q8_0.gguf"].n_params
    assert q8.stat().st_size < f32.stat().st_size
    assert found.chosen is not None and found.chosen.path == q8


def test_a_draft_the_registry_pairs_with_the_target_comes_first(
    disk: dict[str, Path], isolated_env: Path
) -> None:
    # "big" is too large for the quarter rule, but the registry pairs it with the target.
    reg = isolated_env / ".config" / "specgguf" / "models.toml"
    reg.parent.mkdir(parents=True, exist_ok=True)
    reg.write_text(
        '[models.t]\nrepo = "test/target-GGUF"\nfile = "target-{quant}.gguf"\nquant = "Q8_0"\n'
        '[models.b]\nrepo = "test/big-GGUF"\nfile = "big-{quant}.gguf"\nquant = "Q8_0"\n'
        '[pairs.t-b]\ntarget = "t"\ndraft = "b"\n'
    )
    found = find_drafts(disk["target"], registry=load_registry())
    assert found.chosen is not None and found.chosen.path == disk["big"]
    assert found.chosen.source == "registry pair t-b" and "registry pairs" in found.chosen.reason
    # Without the registry the quarter rule applies again.
    chosen = find_drafts(disk["target"]).chosen
    assert chosen is not None and chosen.path == disk["smaller"]


def test_a_second_search_reads_only_files_it_has_not_seen(
    disk: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    first = find_drafts(disk["target"], check_all=True)
    opened: list[Path] = []
    real_info, real_open = drafts.read_model_info, drafts.GGUFMetadata.open

    def counting_info(path: Path | str) -> object:
        opened.append(Path(path))
        return real_info(path)

    def counting_open(path: Path | str) -> object:
        opened.append(Path(path))
        return real_open(path)

    monkeypatch.setattr(drafts, "read_model_info", counting_info)
    monkeypatch.setattr(drafts.GGUFMetadata, "open", counting_open)
    again = find_drafts(disk["target"], check_all=True)
    assert [c.verdict for c in again.candidates] == [c.verdict for c in first.candidates]
    assert set(opened) == {disk["target"]}  # the target's own facts only
    # A file that changes is read again.
    opened.clear()
    blob = disk["small"].resolve()
    write_tiny_model(blob.with_name("new.gguf"), small("small", 16, vocab=SPM))
    os.replace(blob.with_name("new.gguf"), blob)
    changed = by_name(find_drafts(disk["target"], check_all=True))["small-F32.gguf"]
    assert changed.verdict == REJECTED and "vocabulary" in changed.reason
    assert disk["small"] in opened and disk["smaller"] not in opened


def test_the_search_never_reaches_the_hub(
    disk: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    from specgguf.hub import download

    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("the draft search must not download or list anything")

    for name in ("hf_hub_download", "snapshot_download", "HfApi"):
        monkeypatch.setattr(huggingface_hub, name, refuse)
    monkeypatch.setattr(download, "pull", refuse)
    monkeypatch.setattr(download, "_hub_listing", refuse)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert find_drafts(disk["target"], registry=load_registry()).chosen is not None


# --- the command line ----------------------------------------------------------------


def run_json(*args: str) -> tuple[dict[str, object], str]:
    res = run_cli("run", "--temp", "0", "-n", "4", "--json", *args, "hello")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout), res.stderr.decode()


def test_run_chooses_a_draft_says_why_and_explicit_choices_win(
    disk: dict[str, Path], tiny_models: dict[str, Path]
) -> None:
    target = str(disk["target"])
    out, err = run_json("-m", target)
    assert out["models"]["draft"] == str(disk["smaller"])  # type: ignore[index]
    line = next(x for x in err.splitlines() if "draft model" in x)
    assert "smaller-F32.gguf" in line and "9K parameters" in line and "smallest" in line
    # An explicit draft wins, and the search does not run.
    out, err = run_json("-m", target, "-md", str(disk["small"]))
    assert out["models"]["draft"] == str(disk["small"]) and "chosen" not in err  # type: ignore[index]
    # --no-draft and the drafters that use no draft model turn it off.
    for flags in (["--no-draft"], ["--drafter", "ngram"], ["--spec-type", "ngram-mod"],
                  ["--drafter", "none"]):  # fmt: skip
        out, err = run_json("-m", target, *flags)
        assert out["models"]["draft"] is None and "draft model" not in err, flags  # type: ignore[index]
    # A fixed K without -md drafts with the draft model that was found.
    out, _ = run_json("-m", target, "--draft", "3")
    assert out["models"]["drafter"] == "model" and out["models"]["draft"] == str(disk["smaller"])  # type: ignore[index]


def test_an_incompatible_explicit_draft_is_refused_as_before(
    disk: dict[str, Path],
) -> None:
    res = run_cli("run", "-m", str(disk["target"]), "-md", str(disk["spm"]), "-n", "2", "hi")
    assert res.returncode == errors.EXIT_INCOMPATIBLE and res.stdout == b""
    assert b"vocabulary types differ" in res.stderr


def test_nothing_compatible_falls_back_to_ngram_and_model_drafter_is_refused(
    disk: dict[str, Path],
) -> None:
    for name in ("small", "smaller"):
        disk[name].unlink()
    out, err = run_json("-m", str(disk["target"]))
    assert out["models"]["draft"] is None and out["models"]["drafter"] == "auto"  # type: ignore[index]
    assert "none of the 3 GGUF model(s) on disk can draft" in err
    res = run_cli("run", "-m", str(disk["target"]), "--drafter", "model", "hi")
    assert res.returncode == errors.EXIT_USAGE and b"--drafts-for" in res.stderr


def test_list_drafts_for_prints_candidates_and_reasons(disk: dict[str, Path]) -> None:
    res = run_cli("list", "--drafts-for", str(disk["target"]))
    assert res.returncode == 0, res.stderr
    text = res.stdout.decode()
    lines = [x.split() for x in text.splitlines()]
    rows = [x for x in lines if x and x[0] in (CHOSEN, "compatible", "not", REJECTED)]
    assert rows[0][:2] == [CHOSEN, "smaller-F32.gguf"] and len(rows) == 5
    assert "vocabulary types differ" in text and "at most 25%" in text and "HTML" in text
    res = run_cli("list", "--drafts-for", str(disk["target"]), "--json")
    data = json.loads(res.stdout)
    assert data["chosen"] == str(disk["smaller"])
    verdicts = {Path(c["path"]).name: c["verdict"] for c in data["candidates"]}
    assert verdicts["small-F32.gguf"] == COMPATIBLE and verdicts["spm-F32.gguf"] == REJECTED
    res = run_cli("list", "--draft-search", str(disk["target"].parent))
    assert res.returncode == errors.EXIT_USAGE
