"""Model references as llama.cpp writes them (``org/name[:QUANT]``): parsing, and which
files of a repository a quant tag picks, against the cases of llama.cpp's
``find_best_model`` and ``get_split_files`` (common/download.cpp)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specgguf.errors import HubError, QuantNotFoundError, UsageError
from specgguf.hub.hfref import (
    HfRef,
    best_sibling,
    looks_like_hf_ref,
    match_quant,
    parse_hf_ref,
    quants_of,
    split_info,
)

SPLIT = [f"Q4_K_M/m-Q4_K_M-0000{i}-of-00003.gguf" for i in (3, 1, 2)]  # listing order


@pytest.mark.parametrize(
    ("files", "tag", "want"),
    [
        (["m-Q8_0.gguf", "m-Q4_K_M.gguf"], None, ["m-Q4_K_M.gguf"]),  # Q4_K_M first
        (["m-F16.gguf", "m-Q8_0.gguf"], None, ["m-Q8_0.gguf"]),  # then Q8_0
        (["README.md", "m-F16.gguf"], None, ["m-F16.gguf"]),  # then the only model
        (["m-Q8_0.gguf", "m-Q4_K_M.gguf"], "q8_0", ["m-Q8_0.gguf"]),  # case-insensitive
        (["tinyllama.Q5_K_S.gguf"], "Q5_K_S", ["tinyllama.Q5_K_S.gguf"]),  # '.' separators
        (["m-UD-Q4_K_XL.gguf", "m-Q8_0.gguf"], "ud-q4_k_xl", ["m-UD-Q4_K_XL.gguf"]),
        (["mmproj-m-F16.gguf", "m-F16.gguf"], "F16", ["m-F16.gguf"]),  # a sidecar is no model
        (["m-imatrix-Q8_0.gguf", "m-Q8_0.gguf"], "Q8_0", ["m-Q8_0.gguf"]),
        (["m-BF16.gguf", "m-F16.gguf"], "f16", ["m-F16.gguf"]),  # the exact suffix wins
        (["m-BF16.gguf"], "F16", ["m-BF16.gguf"]),  # found inside the name, as in llama.cpp
        (["m-IQ4_XS.gguf", "m-Q4_XS.gguf"], "Q4_XS", ["m-Q4_XS.gguf"]),
        ([*SPLIT, "m-Q8_0.gguf"], "q4_k_m", sorted(SPLIT)),  # every shard, in order
        ([*SPLIT, "m-Q8_0.gguf"], None, sorted(SPLIT)),
        (["sub/m-Q4_K_M.gguf", "m-Q4_K_M.gguf"], "sub/m-Q4_K_M.gguf", ["sub/m-Q4_K_M.gguf"]),
    ],
)
def test_the_quant_tag_picks_what_llama_cpp_picks(
    files: list[str], tag: str | None, want: list[str]
) -> None:
    assert match_quant(files, tag, repo="o/m") == want


@pytest.mark.parametrize(
    ("files", "tag", "error", "message"),
    [
        (["m-Q8_0.gguf", "m-F16.gguf"], "Q5_K_M", QuantNotFoundError,
         "o/m has no GGUF model of quant Q5_K_M; available: F16, Q8_0"),
        (["m-F16.gguf", "m-BF16.gguf"], None, QuantNotFoundError,
         "o/m has no GGUF model of quant Q4_K_M or Q8_0; available: BF16, F16"),
        (["README.md", "mmproj-Q8_0.gguf"], "Q8_0", QuantNotFoundError,
         "o/m has no GGUF model file"),
        (["m-Q8_0.gguf"], "other.gguf", QuantNotFoundError,
         "o/m has no GGUF model file other.gguf; available: Q8_0"),
        (["m-Q4_K_M.gguf", "m-instruct-Q4_K_M.gguf"], None, HubError,
         "o/m: quant Q4_K_M matches several models: m-Q4_K_M.gguf, m-instruct-Q4_K_M.gguf"),
        (SPLIT[1:], "Q4_K_M", HubError,
         "Q4_K_M/m-Q4_K_M-00001-of-00003.gguf is split in 3 shards, but shard(s) 3 are missing"),
    ],
)  # fmt: skip
def test_a_tag_that_matches_none_or_several_is_an_error(
    files: list[str], tag: str | None, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as ei:
        match_quant(files, tag, repo="o/m")
    assert str(ei.value).startswith(message)
    assert type(ei.value) is error  # not found and ambiguous are told apart


def test_an_ambiguous_tag_hints_at_naming_the_file() -> None:
    with pytest.raises(HubError) as ei:
        match_quant(["b-Q8_0.gguf", "a-Q8_0.gguf"], "Q8_0", repo="o/m", cached=True)
    assert str(ei.value).startswith("o/m (in the local cache): quant Q8_0 matches several")
    assert ei.value.hint == "name one by its file, e.g. o/m:a-Q8_0.gguf"


QUANTS = ["Q4_K_M", "Q8_0", "F16", "IQ2_XXS", "Q5_K_S", "BF16", "Q6_K"]


@given(
    picked=st.lists(st.sampled_from(QUANTS), min_size=1, unique=True),
    tag=st.sampled_from(QUANTS),
    flips=st.lists(st.booleans(), min_size=8, max_size=8),
    shards=st.integers(min_value=1, max_value=4),
)
def test_matching_ignores_case_and_returns_whole_splits(
    picked: list[str], tag: str, flips: list[bool], shards: int
) -> None:
    files = ["README.md"]
    for q in picked:
        if shards == 1:
            files.append(f"model-{q}.gguf")
        else:
            files += [f"model-{q}-{i:05d}-of-{shards:05d}.gguf" for i in range(shards, 0, -1)]
    cased = "".join(c.lower() if f else c for c, f in zip(tag, flips * 2, strict=False))
    # As in llama.cpp, the tag is found inside names: F16 finds BF16 when there is no F16.
    matching = [q for q in picked if q == tag] or [q for q in picked if q.endswith(tag)]
    if matching:
        got = match_quant(files, cased, repo="o/m")
        infos = [split_info(f) for f in got]
        assert [i.tag for i in infos if i] == [matching[0]] * shards
        assert [i.index for i in infos if i] == list(range(1, shards + 1))
    else:
        with pytest.raises(QuantNotFoundError) as ei:
            match_quant(files, cased, repo="o/m")
        assert ei.value.available == sorted(picked) == quants_of(files)


@pytest.mark.parametrize(
    ("name", "ref"),
    [
        ("org/name", True),
        ("org/name-GGUF:Q4_K_M", True),
        ("org/name:file.gguf", True),
        ("ggml-org/Qwen2.5-Coder-1.5B-Q8_0-GGUF", True),
        ("dir/model.gguf", False),  # a path to a file
        ("./org/name", False),
        ("/abs/name", False),
        ("a/b/c", False),
        ("name", False),
        ("org/name:", False),
        ("org/name:a:b", False),
    ],
)
def test_what_looks_like_a_reference(name: str, ref: bool) -> None:
    assert looks_like_hf_ref(name) is ref


def test_parse_a_reference() -> None:
    assert parse_hf_ref("org/m-GGUF:q8_0") == HfRef("org/m-GGUF", "q8_0")
    assert parse_hf_ref("org/m-GGUF", quant="F16") == HfRef("org/m-GGUF", "F16")
    assert parse_hf_ref("org/m-GGUF:q8_0", quant="Q8_0") == HfRef("org/m-GGUF", "q8_0")
    assert str(HfRef("org/m", "Q8_0")) == "org/m:Q8_0" and str(HfRef("org/m")) == "org/m"
    for bad in ("noslash", "a/b/c", "a//b", "org/..:Q8_0", "org/a--b", ":Q8_0", "a/b:x:y"):
        with pytest.raises(UsageError, match="org/name"):
            parse_hf_ref(bad)
    with pytest.raises(UsageError, match="names quant Q8_0 and another quant, F16"):
        parse_hf_ref("org/m:Q8_0", quant="F16")


@pytest.mark.parametrize(
    ("files", "model", "chosen"),
    [
        # the quant nearest the model's in bits: 8 against 4 before 16 against 4
        (["m-Q4_K_M.gguf", "mmproj-m-F16.gguf", "mmproj-m-Q8_0.gguf"], "m-Q4_K_M.gguf",
         "mmproj-m-Q8_0.gguf"),
        (["m-F16.gguf", "mmproj-m-Q8_0.gguf", "mmproj-m-F16.gguf"], "m-F16.gguf",
         "mmproj-m-F16.gguf"),
        # the model's own folder before one above it; never another folder
        (["mmproj-top-Q4_K_M.gguf", "Q4/mmproj-F16.gguf", "Q4/m-Q4_K_M.gguf"],
         "Q4/m-Q4_K_M.gguf", "Q4/mmproj-F16.gguf"),
        (["Q8/mmproj-Q8_0.gguf", "Q4/m-Q4_K_M.gguf"], "Q4/m-Q4_K_M.gguf", None),
        (["mmproj-top.gguf", "Q4/m-Q4_K_M.gguf"], "Q4/m-Q4_K_M.gguf", "mmproj-top.gguf"),
        # only .gguf files; none at all; ties to the first listed
        (["mmproj-notes.txt", "m-Q4_K_M.gguf"], "m-Q4_K_M.gguf", None),
        (["m-Q4_K_M.gguf"], "m-Q4_K_M.gguf", None),
        (["mmproj-a-Q8_0.gguf", "mmproj-b-Q8_0.gguf"], "m-Q8_0.gguf", "mmproj-a-Q8_0.gguf"),
    ],
)  # fmt: skip
def test_the_projector_of_a_repository_is_picked_as_llama_cpp_picks_it(
    files: list[str], model: str, chosen: str | None
) -> None:
    assert best_sibling(files, model, "mmproj") == chosen
