"""The automatic choice of a draft model among the models on disk (hub/draft_search.py), and
``run``/``list --drafts-for`` over it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

from specgguf import errors
from specgguf.gguf.tiny import TinySpec, fixture_specs, spm_vocab, write_tiny_model
from specgguf.hub import draft_search as drafts
from specgguf.hub import testmodels
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
        # 19K parameters, F32: compatible, a draft token costs about half a target row
        "small": cache_file(hub, "test/small-GGUF", "small-F32.gguf", small("small", 16)),
        # 9K: compatible and cheaper still: the one to choose
        "smaller": cache_file(hub, "test/smaller-GGUF", "smaller-F32.gguf", small("s", 8)),
        # 9K but another vocabulary: smallest, yet it must never be chosen
        "spm": cache_file(hub, "test/spm-GGUF", "spm-F32.gguf", small("spm", 8, vocab=SPM)),
        # the target's own shapes: compatible, but a draft token would cost a target row
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


def test_the_cheapest_compatible_draft_is_chosen_and_the_rest_explained(
    disk: dict[str, Path],
) -> None:
    found = find_drafts(disk["target"], check_all=True)
    rows = by_name(found)
    assert found.chosen is not None and found.chosen.path == disk["smaller"]
    assert "the cheapest" in found.chosen.reason and found.chosen.cost_basis == "estimated"
    assert found.chosen.cost == pytest.approx(estimated_cost(small("s", 8), TARGET))
    assert rows["small-F32.gguf"].verdict == COMPATIBLE
    assert rows["spm-F32.gguf"].verdict == REJECTED
    assert "vocabulary types differ" in rows["spm-F32.gguf"].reason
    big, html = rows["big-Q8_0.gguf"], rows["html-Q8_0.gguf"]
    # The target's own shapes read the target's bytes: a token costs a target row or more.
    assert big.verdict == REJECTED and "pays only below 1" in big.reason
    assert big.cost == pytest.approx(drafts.ESTIMATE_SLACK)
    assert big.cost is not None and big.cost >= drafts.MAX_DRAFT_COST
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


def token_bytes_of(spec: TinySpec) -> float:
    """Bytes of weights a tiny llama model reads per token, from its shape: every tensor
    but token_embd; a matrix whose rows hold whole Q8_0 blocks (32 values in 34 bytes) is
    quantized, the rest is F32 (tiny.py's rule)."""
    d, ff, v = spec.n_embd, spec.n_ff, len(spec.vocab.tokens)
    kv = d // spec.n_head * spec.n_head_kv

    def matrix(rows: int, cols: int) -> float:
        q8 = spec.quant == Q.Q8_0 and cols % 32 == 0
        return rows * cols * (34 / 32 if q8 else 4)

    layer = 4 * 2 * d + 2 * matrix(d, d) + 2 * matrix(kv, d) + 2 * matrix(ff, d) + matrix(d, ff)
    return spec.n_layer * layer + 4 * d + matrix(v, d)


def estimated_cost(draft: TinySpec, target: TinySpec) -> float:
    """c estimated as the module says: the ratio of bytes read per token, with its slack."""
    return drafts.ESTIMATE_SLACK * token_bytes_of(draft) / token_bytes_of(target)


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
    # A larger target, so that a draft wide enough for Q8_0 blocks stays cheap.
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
    # "big" costs too much to be chosen on its own, but the registry pairs it with the target.
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
    # Without the registry the cost rule applies again.
    chosen = find_drafts(disk["target"]).chosen
    assert chosen is not None and chosen.path == disk["smaller"]


def test_a_draft_with_over_a_quarter_of_the_parameters_is_judged_by_its_token_cost(
    isolated_env: Path, tmp_path: Path
) -> None:
    # The shape of the reported input: a draft with more than a quarter of the target's
    # parameters (the 0.5B Qwen has 35% of the 1.5B's), beside the target in a plain folder.
    folder = tmp_path / "models"
    t = write_tiny_model(folder / "target-Q8_0.gguf", TARGET)[0]
    wide = dataclasses.replace(TARGET, name="wide", n_embd=32, n_ff=64)
    d = write_tiny_model(folder / "wide-Q8_0.gguf", wide)[0]
    # Fewer parameters, but F32 weights: it reads more bytes per token than "wide".
    f32 = dataclasses.replace(wide, name="f32", n_layer=1, quant=Q.F32)
    write_tiny_model(folder / "f32-F32.gguf", f32)
    found = find_drafts(t, search_dirs=[folder], check_all=True)
    rows = by_name(found)
    assert 0.35 < params_of(wide) / TARGET_PARAMS < 0.4
    assert params_of(f32) < params_of(wide)
    assert found.chosen is not None and found.chosen.path == d
    assert found.chosen.cost == pytest.approx(estimated_cost(wide, TARGET))
    assert found.chosen.cost is not None and found.chosen.cost < 1
    costly = rows["f32-F32.gguf"]
    assert costly.verdict == REJECTED and "pays only below 1" in costly.reason
    assert costly.cost == pytest.approx(estimated_cost(f32, TARGET))
    assert costly.cost is not None and costly.cost >= 1


def registry_file(home: Path, text: str) -> None:
    reg = home / ".config" / "specgguf" / "models.toml"
    reg.parent.mkdir(parents=True, exist_ok=True)
    reg.write_text(text)


def pinned(alias: str, path: Path, *, repo: str = "test/elsewhere-GGUF") -> str:
    """A registry entry pinning ``path``'s name, size and SHA-256 (its repository is not in
    the Hugging Face cache)."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return (f'[models.{alias}]\nrepo = "{repo}"\nfile = "{path.name}"\n'
            f'size = {path.stat().st_size}\nsha256 = "{digest}"\n')  # fmt: skip


def test_registry_pairs_are_recognized_by_identity_wherever_the_files_lie(
    isolated_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    folder = tmp_path / "models"
    t = write_tiny_model(folder / "target-Q8_0.gguf", TARGET)[0]
    big = write_tiny_model(folder / "big-Q8_0.gguf", BIG)[0]  # too costly unless paired
    cheap = write_tiny_model(folder / "s-F32.gguf", small("s", 8))[0]
    registry_file(isolated_env, pinned("t", t) + pinned("b", big)
                  + '[pairs.t-b]\ntarget = "t"\ndraft = "b"\n')  # fmt: skip
    found = find_drafts(t, search_dirs=[folder], registry=load_registry())
    c = found.chosen
    assert c is not None and c.path == big and c.paired and c.source == str(folder)
    assert c.pair is not None and c.pair.startswith("t-b;") and "registry pairs" in c.reason
    assert "target recognized by name and size" in c.reason
    assert "draft by name and size" in c.reason
    # Renamed copies are the same files: known by their pinned SHA-256.
    other = tmp_path / "renamed"
    other.mkdir()
    t2 = other / "my-target.gguf"
    t2.write_bytes(t.read_bytes())
    (other / "my-draft.gguf").write_bytes(big.read_bytes())
    c = find_drafts(t2, search_dirs=[other], registry=load_registry()).chosen
    assert c is not None and c.path == other / "my-draft.gguf"
    assert c.pair is not None and "target recognized by SHA-256" in c.pair
    assert "draft by SHA-256" in c.pair
    # The pinned name with other bytes is another file: the cost rule decides.
    (other / "my-draft.gguf").unlink()
    fake = other / "big-Q8_0.gguf"
    write_tiny_model(fake, dataclasses.replace(BIG, perturb=0.5))
    assert fake.stat().st_size == big.stat().st_size
    registry_file(isolated_env, pinned("t", t) + pinned("b", big).replace(
        f"size = {big.stat().st_size}", f"size = {big.stat().st_size + 1}")
        + '[pairs.t-b]\ntarget = "t"\ndraft = "b"\n')  # fmt: skip
    c = find_drafts(t, search_dirs=[folder], registry=load_registry()).chosen
    assert c is not None and c.path == cheap and not c.paired


def test_a_measured_cost_replaces_the_estimate(disk: dict[str, Path], isolated_env: Path) -> None:
    costs = {disk["smaller"]: 1.2, disk["small"]: 0.05}
    calls: list[tuple[Path, Path]] = []

    def measured(target: Path, draft: Path) -> float | None:
        calls.append((target, draft))
        return costs.get(draft)

    found = find_drafts(disk["target"], check_all=True, measured=measured)
    rows = by_name(found)
    assert (disk["target"], disk["smaller"]) in calls
    slow = rows["smaller-F32.gguf"]
    assert slow.verdict == REJECTED and slow.cost == 1.2 and "measured" in slow.reason
    assert found.chosen is not None and found.chosen.path == disk["small"]
    assert found.chosen.cost == 0.05 and "(measured)" in found.chosen.reason
    # A pair measured too slow on this machine is rejected too; an estimate does not.
    registry_file(isolated_env,
        '[models.t]\nrepo = "test/target-GGUF"\nfile = "target-{quant}.gguf"\nquant = "Q8_0"\n'
        '[models.b]\nrepo = "test/big-GGUF"\nfile = "big-{quant}.gguf"\nquant = "Q8_0"\n'
        '[pairs.t-b]\ntarget = "t"\ndraft = "b"\n')  # fmt: skip
    costs[disk["big"]] = 1.0
    found = find_drafts(disk["target"], registry=load_registry(), measured=measured)
    big = by_name(found)["big-Q8_0.gguf"]
    assert big.paired and big.verdict == REJECTED and "measured on this machine" in big.reason
    assert found.chosen is not None and found.chosen.path == disk["small"]


#: One draft token of the 0.5B Qwen over one row of the 1.5B, measured on the project's
#: machines (../shared/machines/curves.json: two Xeons, an EPYC; rounded to 0.01).
MEASURED_QWEN_DRAFT_TOKEN = (0.41, 0.54, 0.60)


@pytest.mark.real_models
def test_the_default_pair_in_a_plain_folder_is_found_as_the_registry_pair(
    real_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The reported input: the 1.5B target with the 0.5B beside it, not in the HF cache.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    target, draft = real_models[testmodels.TARGET], real_models[testmodels.DRAFT]
    folder = target.parent
    found = find_drafts(target, search_dirs=[folder], registry=load_registry(), check_all=True)
    rows = by_name(found)
    c = found.chosen
    assert c is not None and c.path == draft and c.paired
    assert c.pair == ("qwen2.5-coder-1.5b+0.5b; the target recognized by name and size, the "
                      "draft by name and size")  # fmt: skip
    assert rows[testmodels.FOREIGN].verdict == REJECTED
    assert rows[testmodels.FOREIGN_GEMMA].verdict == REJECTED
    # Judged on its own, it is chosen too: it has 35% of the target's parameters, and its
    # estimated token cost is at least what the machines measured, and below one row.
    alone = find_drafts(target, search_dirs=[folder], check_all=True).chosen
    assert alone is not None and alone.path == draft and not alone.paired
    assert alone.n_params is not None and found.target_params is not None
    assert 0.3 < alone.n_params / found.target_params < 0.4
    assert alone.cost is not None and alone.cost_basis == "estimated"
    assert max(MEASURED_QWEN_DRAFT_TOKEN) - 0.01 <= alone.cost < drafts.MAX_DRAFT_COST
    # A renamed copy of the draft is still the registry's 0.5B: known by its SHA-256.
    other = tmp_path / "renamed"
    other.mkdir()
    (other / "draft.gguf").symlink_to(draft)
    c = find_drafts(target, search_dirs=[other], registry=load_registry()).chosen
    assert c is not None and c.path == other / "draft.gguf"
    assert c.pair is not None and c.pair.endswith("the draft by SHA-256")


@pytest.mark.real_models
def test_the_command_line_search_finds_the_registry_pair_in_a_plain_folder(
    real_models: dict[str, Path],
) -> None:
    # The search `run -m TARGET --draft-search DIR` makes, through `list --drafts-for`
    # (the same search with the same registry, without loading the models).
    target = real_models[testmodels.TARGET]
    res = run_cli("list", "--drafts-for", str(target), "--draft-search", str(target.parent),
                  "--json")  # fmt: skip
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["chosen"] == str(real_models[testmodels.DRAFT])
    chosen = next(c for c in data["candidates"] if c["verdict"] == CHOSEN)
    assert chosen["pair"].startswith("qwen2.5-coder-1.5b+0.5b;") and chosen["paired"]


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
    assert "smaller-F32.gguf" in line and "9K parameters" in line and "the cheapest" in line
    # An explicit draft wins, and the search does not run.
    out, err = run_json("-m", target, "-md", str(disk["small"]))
    assert out["models"]["draft"] == str(disk["small"]) and "chosen" not in err  # type: ignore[index]
    # --no-draft and the drafters that use no draft model turn it off.
    for flags in (["--no-draft"], ["--drafter", "ngram"], ["--spec-type", "ngram-mod"],
                  ["--drafter", "none"]):  # fmt: skip
        out, err = run_json("-m", target, *flags)
        assert out["models"]["draft"] is None and "draft model" not in err, flags  # type: ignore[index]
    # A fixed K without -md drafts with the draft model that the search finds now. The
    # auto-mode runs above left calibrations, whose measured costs replace the estimates:
    # on these tiny models either compatible draft can measure cheaper (CI once chose
    # "small"), so the choice is read from the search itself, not assumed.
    res = run_cli("list", "--drafts-for", target, "--json")
    assert res.returncode == 0, res.stderr
    found = json.loads(res.stdout)["chosen"]
    assert found in (str(disk["small"]), str(disk["smaller"]))
    out, _ = run_json("-m", target, "--draft", "3")
    assert out["models"]["drafter"] == "model" and out["models"]["draft"] == found  # type: ignore[index]


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
    assert "vocabulary types differ" in text and "pays only below 1" in text and "HTML" in text
    res = run_cli("list", "--drafts-for", str(disk["target"]), "--json")
    data = json.loads(res.stdout)
    assert data["chosen"] == str(disk["smaller"])
    verdicts = {Path(c["path"]).name: c["verdict"] for c in data["candidates"]}
    assert verdicts["small-F32.gguf"] == COMPATIBLE and verdicts["spm-F32.gguf"] == REJECTED
    res = run_cli("list", "--draft-search", str(disk["target"].parent))
    assert res.returncode == errors.EXIT_USAGE


def test_list_and_run_judge_a_calibrated_pair_by_its_measured_cost(
    disk: dict[str, Path], tmp_path: Path
) -> None:
    from specgguf.engine.calibration import calibration_key, save_calibration
    from specgguf.speculative.costmodel import Timings

    # Calibrations planted in the disk fixture's cache folder, as `run` in auto mode leaves
    # them: the estimate's choice measured too slow here, the next one very cheap.
    target = disk["target"]
    for name, verify_1, t_draft in (("smaller", 0.010, 0.012), ("small", 0.050, 0.002)):
        key = calibration_key("build", target, disk[name], 2, True)
        assert save_calibration(key, Timings({1: verify_1, 2: 0.06}, t_draft, depth=64))
    res = run_cli("list", "--drafts-for", str(target), "--draft-search", str(tmp_path / "extra"),
                  "--json")  # fmt: skip
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    rows = {Path(c["path"]).name: c for c in data["candidates"]}
    assert data["chosen"] == str(disk["small"])
    chosen = rows["small-F32.gguf"]
    assert chosen["verdict"] == CHOSEN and chosen["cost_basis"] == "measured"
    assert chosen["cost"] == pytest.approx(0.002 / 0.050)
    slow = rows["smaller-F32.gguf"]
    assert slow["verdict"] == REJECTED and slow["cost"] == pytest.approx(1.2)
    assert "measured on this machine" in slow["reason"]
    # The same files without a calibration keep the estimate.
    extra = rows["extra-F32.gguf"]
    assert extra["cost_basis"] == "estimated" and extra["verdict"] == COMPATIBLE
    assert extra["cost"] == pytest.approx(estimated_cost(small("extra", 16), TARGET), rel=1e-3)
    # `run` chooses the same way, and says the cost was measured.
    out, err = run_json("-m", str(target), "--draft-search", str(tmp_path / "extra"))
    assert out["models"]["draft"] == str(disk["small"])  # type: ignore[index]
    line = next(x for x in err.splitlines() if "draft model" in x)
    assert "small-F32.gguf" in line and "0.04 of a target row (measured)" in line


def test_draft_heads_are_rejected_as_heads_whatever_their_size(
    isolated_env: Path, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """A DFlash, DSpark, DFlash2 or EAGLE-3 file beside the target is a head, given with
    -md: the search says so (before, its size judged it as a draft model first)."""
    import shutil

    folder = tmp_path / "heads"
    folder.mkdir()
    for name in ("dflash", "dspark", "dflash2", "eagle3"):
        shutil.copy(tiny_models[name], folder / tiny_models[name].name)
    found = find_drafts(tiny_models["target"], search_dirs=[folder], check_all=True)
    heads = {c.path.name: c for c in found.candidates if c.path.parent == folder}
    assert len(heads) == 4
    for c in heads.values():
        arch = "eagle3" if "eagle3" in c.path.name else "dflash"
        article = "an" if arch == "eagle3" else "a"
        assert c.verdict == REJECTED
        assert c.reason == f"{article} {arch} draft head, not a draft model (given with -md)"
