"""Vocabulary compatibility: each tiny fixture refused for the right reason, llama.cpp's own
verdict reproduced, the rules beyond llama.cpp, and the real models."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from specgguf.errors import EXIT_INCOMPATIBLE
from specgguf.gguf.tiny import CHANGED_TOKEN_ID, TinySpec, fixture_specs, write_tiny_model
from specgguf.gguf.vocab import check_compatibility
from specgguf.hub import testmodels
from specgguf.llama.backend import LlamaModel

from .helpers import run_cli


def llama_cpp_are_compatible(target: Path, draft: Path) -> bool:
    """common_speculative_are_compatible (common/speculative.cpp) transcribed over the
    vocabularies as llama.cpp itself loads them: the oracle for ``llama_cpp_compatible``."""
    with (
        LlamaModel(target, vocab_only=True) as t,
        LlamaModel(draft, vocab_only=True) as d,
    ):
        lc = t._lc
        vt, vd = t._vocab, d._vocab
        if lc.llama_vocab_type(vt) != lc.llama_vocab_type(vd):
            return False
        if lc.llama_vocab_get_add_bos(vt) != lc.llama_vocab_get_add_bos(vd) or (
            lc.llama_vocab_get_add_bos(vt) and lc.llama_vocab_bos(vt) != lc.llama_vocab_bos(vd)
        ):
            return False
        if lc.llama_vocab_get_add_eos(vt) != lc.llama_vocab_get_add_eos(vd) or (
            lc.llama_vocab_get_add_eos(vt) and lc.llama_vocab_eos(vt) != lc.llama_vocab_eos(vd)
        ):
            return False
        if abs(t.n_vocab - d.n_vocab) > 128:
            return False
        return all(
            lc.llama_vocab_get_text(vt, i) == lc.llama_vocab_get_text(vd, i)
            for i in range(5, min(t.n_vocab, d.n_vocab))
        )


# (target fixture, draft fixture) -> (compatible, code of the first error or None)
CASES = {
    ("target", "draft-identical"): (True, None),
    ("target", "draft-partial"): (True, None),
    ("target", "split"): (True, None),
    ("target", "draft-pad128"): (True, None),
    ("target", "draft-pad129"): (False, "vocab-size"),
    ("target", "draft-spm"): (False, "vocab-type"),
    ("target", "draft-token-changed"): (False, "token-text"),
    ("target", "draft-add-bos"): (False, "bos"),
    ("target-add-bos", "draft-bos-id"): (False, "bos"),
    ("spm-target", "draft-spm"): (True, None),
}


@pytest.mark.parametrize(("target", "draft"), sorted(CASES))
def test_fixture_pairs(tiny_models: dict[str, Path], target: str, draft: str) -> None:
    compatible, first_error = CASES[target, draft]
    report = check_compatibility(tiny_models[target], tiny_models[draft])
    assert report.compatible is compatible, report.findings
    if first_error:
        assert report.errors[0].code == first_error
    else:
        assert report.errors == []
    # The llama.cpp part of the verdict agrees with llama.cpp's own loader and rules.
    assert report.llama_cpp_compatible == llama_cpp_are_compatible(
        tiny_models[target], tiny_models[draft]
    )


def test_token_changed_report_names_id_and_both_texts(tiny_models: dict[str, Path]) -> None:
    r = check_compatibility(tiny_models["target"], tiny_models["draft-token-changed"])
    d = r.token_diff
    assert (d.n_different, d.first_id) == (1, CHANGED_TOKEN_ID)
    assert d.first_draft == "\u0120CHANGED"
    assert d.first_target == fixture_specs()["target"].vocab.tokens[CHANGED_TOKEN_ID]
    assert f"id {CHANGED_TOKEN_ID}" in r.errors[0].message
    assert r.verdict().startswith("INCOMPATIBLE: ")


def test_bos_messages(tiny_models: dict[str, Path]) -> None:
    r = check_compatibility(tiny_models["target"], tiny_models["draft-add-bos"])
    assert "add_bos differs: target false, draft true" in r.errors[0].message
    r = check_compatibility(tiny_models["target-add-bos"], tiny_models["draft-bos-id"])
    assert r.errors[0].message.startswith("BOS ids differ with add_bos set: target 0")


def test_padding_drafts_128_accepted_129_refused(tiny_models: dict[str, Path]) -> None:
    ok = check_compatibility(tiny_models["target"], tiny_models["draft-pad128"])
    assert ok.compatible and [w.code for w in ok.warnings] == ["draft-extra-ids"]
    assert "512..639" in ok.warnings[0].message
    bad = check_compatibility(tiny_models["target"], tiny_models["draft-pad129"])
    assert "differ by 129" in bad.errors[0].message


def _variant(tmp_path: Path, name: str, **changes: object) -> Path:
    spec = dataclasses.replace(fixture_specs()["target"], **changes)  # type: ignore[arg-type]
    return write_tiny_model(tmp_path / f"{name}.gguf", spec)[0]


def test_a_recurrent_architecture_is_a_fact_not_an_error(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    # Refused before issue 31 ("recurrent-architecture"); a recurrent draft drafts in a
    # copy of its sequence, and the kind is reported.
    mamba = _variant(tmp_path, "mamba", architecture="mamba")
    r = check_compatibility(tiny_models["target"], mamba)
    assert r.compatible and not r.errors
    d = r.as_dict()["draft"]
    assert (d["architecture"], d["memory"], d["rolls_back"]) == ("mamba", "recurrent", False)
    assert r.as_dict()["target"]["memory"] == "attention"


def test_eog_token_below_id_5_differs(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    # llama.cpp does not compare ids 0..4; the target's EOT is id 2.
    vocab = fixture_specs()["target"].vocab
    tokens = list(vocab.tokens)
    tokens[2] = "<|im_sep|>"
    draft = _variant(tmp_path, "eot", vocab=dataclasses.replace(vocab, tokens=tuple(tokens)))
    r = check_compatibility(tiny_models["target"], draft)
    assert r.llama_cpp_compatible
    assert not r.compatible
    assert r.errors[0].code == "eog-text"
    assert "2 '<|im_end|>' is '<|im_sep|>' in the draft" in r.errors[0].message


def test_pre_tokenizer_and_merges_are_warnings(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    vocab = fixture_specs()["target"].vocab
    other = dataclasses.replace(vocab, pre="default", merges=vocab.merges[:-1])
    r = check_compatibility(tiny_models["target"], _variant(tmp_path, "pre", vocab=other))
    assert r.compatible
    assert [w.code for w in r.warnings] == ["pre-tokenizer", "merges"]
    assert "one list extends the other (253 vs 252)" in r.warnings[1].message


def test_cli_check_exit_codes_and_json(tiny_models: dict[str, Path]) -> None:
    ok = run_cli("check", str(tiny_models["target"]), str(tiny_models["draft-partial"]))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.decode().strip().splitlines()[-1].startswith("compatible: ")
    bad = run_cli("check", "--json", str(tiny_models["target"]), str(tiny_models["draft-spm"]))
    assert bad.returncode == EXIT_INCOMPATIBLE
    data = json.loads(bad.stdout)
    assert data["compatible"] is False
    assert data["findings"][0]["code"] == "vocab-type"
    assert data["verdict"].startswith("INCOMPATIBLE")
    assert bad.stderr == b""


def test_cli_info_json(tiny_models: dict[str, Path]) -> None:
    res = run_cli("info", "--json", str(tiny_models["split"]))
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["split_count"] == 3 and data["missing_shards"] == []
    assert data["quantization"] == "Q8_0"
    assert data["vocab"]["eot"] == {"id": 2, "text": "<|im_end|>"}
    # Parameters summed over all three shards equal the unsplit model's.
    whole = json.loads(run_cli("info", "--json", str(tiny_models["target"])).stdout)
    assert data["n_params"] == whole["n_params"] > 100_000
    assert data["n_tensors"] == whole["n_tensors"] == 21


def test_info_reports_missing_shard(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    spec = TinySpec(vocab=fixture_specs()["target"].vocab, split_max_tensors=8)
    files = write_tiny_model(tmp_path / "s.gguf", spec)
    files[2].unlink()
    data = json.loads(run_cli("info", "--json", str(files[0])).stdout)
    assert data["missing_shards"] == [str(files[2])]
    assert data["n_params"] is None


def test_info_on_a_missing_shard_names_the_exit_of_the_commands_that_load(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    # The reported case: info exits 0 on a split model with a shard missing (documented),
    # while check, run, serve and bench exit 3; info's output says so, in text and JSON.
    spec = TinySpec(vocab=fixture_specs()["target"].vocab, split_max_tensors=8)
    files = write_tiny_model(tmp_path / "s.gguf", spec)
    assert len(files) == 3
    whole = json.loads(run_cli("info", "--json", str(files[0])).stdout)
    assert whole["load_refusal"] is None
    files[1].unlink()
    res = run_cli("info", "--json", str(files[0]))
    assert res.returncode == 0, res.stderr
    refusal = json.loads(res.stdout)["load_refusal"]
    assert refusal["reason"] == f"shard 2 of 3 is missing: {files[1]}"
    assert refusal["exit_code"] == 3
    assert refusal["commands"] == ["check", "run", "serve", "bench"]
    text = run_cli("info", str(files[0]))
    assert text.returncode == 0, text.stderr
    row = [ln for ln in text.stdout.decode().splitlines() if ln.startswith("loadable")]
    assert len(row) == 1, text.stdout
    assert f"no: shard 2 of 3 is missing: {files[1]}" in row[0]
    assert "check, run, serve and bench exit 3 for it" in row[0]
    # What info says is what each of those commands does with the file.
    m, ok = str(files[0]), str(tiny_models["target"])
    for args in (["check", m, ok], ["check", ok, m], ["run", "-m", m, "-n", "1", "hi"],
                 ["serve", "-m", m, "--host", "127.0.0.1", "--port", "0"],
                 ["bench", "-m", m, "-n", "1", "--rounds", "1"]):  # fmt: skip
        got = run_cli(*args, timeout=120)
        assert got.returncode == 3, (args, got.stderr)
        assert b"shard 2 of 3 is missing" in got.stderr, (args, got.stderr)
    # plan reads the metadata alone, as info does: it plans, and warns of the same
    planned = run_cli("plan", "-m", m, "--json", timeout=120)
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["models"][0]["load_refusal"]["exit_code"] == 3
    warned = planned.stderr.decode()
    assert "shard 2 of 3 is missing" in warned and "run, serve and bench exit 3" in warned


@pytest.mark.real_models
def test_real_qwen_pair_compatible_and_foreign_refused(real_models: dict[str, Path]) -> None:
    target = real_models[testmodels.TARGET]
    ok = check_compatibility(target, real_models[testmodels.DRAFT])
    assert ok.compatible and ok.llama_cpp_compatible and ok.findings == ()
    assert ok.token_diff.n_compared == 151_936 - 5
    smol = check_compatibility(target, real_models[testmodels.FOREIGN])
    assert not smol.compatible
    codes = [f.code for f in smol.errors]
    assert codes[:2] == ["vocab-size", "token-text"]
    assert smol.token_diff.first_id == 5
    gemma = check_compatibility(target, real_models[testmodels.FOREIGN_GEMMA])
    assert [f.code for f in gemma.errors][:2] == ["vocab-type", "bos"]
    res = run_cli("check", str(target), str(real_models[testmodels.FOREIGN]))
    assert res.returncode == EXIT_INCOMPATIBLE
    out = res.stdout.decode()
    assert "vocab-size" in out and "first is id 5" in out
