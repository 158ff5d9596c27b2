"""Images read by the target through a projector (``--mmproj``, libmtmd): a tiny generated
LLaVA projector beside the tiny target (specgguf/gguf/tinymedia.py), llama.cpp's own
``llama-mtmd-cli`` as the oracle of what the target generates after an image, every
drafter giving the target's own greedy output, and bad media refused before anything is
decoded."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specgguf.errors import MediaError, UsageError
from specgguf.gguf.tinymedia import picture, png_bytes, write_mmproj, write_png
from specgguf.llama.media import MAX_PIXELS, check_medium, image_size

from .helpers import run_cli

N_EMBD = 64  # the tiny target's (specgguf/gguf/tiny.py)
PROMPT = "Describe"


@pytest.fixture(scope="module")
def media(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The tiny target, its projector, two pictures and a corrupt one."""
    folder = tmp_path_factory.mktemp("media")
    write_mmproj(folder / "mmproj.gguf", N_EMBD)
    (folder / "broken.png").write_bytes(png_bytes(picture())[:60])
    return {
        "target": tiny_models["target"],
        "draft": tiny_models["draft-partial"],
        "mmproj": folder / "mmproj.gguf",
        "image": write_png(folder / "a.png", picture()),
        "other": write_png(folder / "b.png", picture(flip=True)),
        "broken": folder / "broken.png",
    }


def _run(media: dict[str, Path], *args: str, image: str = "image", n: int = 16) -> dict:
    res = run_cli("run", "-m", str(media["target"]), "--mmproj", str(media["mmproj"]),
                  "--image", str(media[image]), "--temp", "0", "-n", str(n), "--ignore-eos",
                  "-t", "1", "--json", *args, PROMPT)  # fmt: skip
    assert res.returncode == 0, res.stderr.decode()
    return json.loads(res.stdout)


# -- headers and limits: refused before anything decodes --------------------------------


def _png_header(w: int, h: int) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + struct.pack(">II", w, h)


def test_image_sizes_are_read_from_their_headers() -> None:
    assert image_size(png_bytes(picture(24))) == (24, 24)
    assert image_size(b"GIF89a" + struct.pack("<HH", 300, 200)) == (300, 200)
    assert image_size(b"BM" + bytes(16) + struct.pack("<ii", 640, -480)) == (640, 480)
    assert image_size(b"P6\n33 17\n255\n" + bytes(33 * 17 * 3)) == (33, 17)
    # a JPEG: SOI, an APP0 segment, then SOF0 with height 20 and width 40
    jpeg = (b"\xff\xd8" + b"\xff\xe0" + struct.pack(">H", 4) + b"JF"
            + b"\xff\xc0" + struct.pack(">HBHH", 11, 8, 20, 40) + bytes(8))  # fmt: skip
    assert image_size(jpeg) == (40, 20)
    assert image_size(b"not an image at all") is None
    # a PNM header with a comment, a JPEG with a fill byte, an OS/2 BMP (16-bit sizes)
    assert image_size(b"P6\n# made here\n6000 6000\n255\n") == (6000, 6000)
    app0 = b"\xff\xe0" + struct.pack(">H", 4) + b"JF"
    sof = b"\xff\xc0" + struct.pack(">HBHH", 11, 8, 20, 40) + bytes(8)
    assert image_size(b"\xff\xd8" + app0 + b"\xff" + sof) == (40, 20)  # a fill byte
    assert image_size(b"BM" + bytes(12) + struct.pack("<IHH", 12, 4, 4) + bytes(8)) == (4, 4)


def test_bad_media_are_refused_by_name_before_decoding() -> None:
    with pytest.raises(MediaError, match=r"x\.png is empty"):
        check_medium(b"", "x.png")
    huge = _png_header(20_000, 20_000)
    with pytest.raises(MediaError, match=r"20,000 x 20,000 pixels"):
        check_medium(huge, "huge.png")
    with pytest.raises(MediaError, match="0 x 5 pixels"):
        check_medium(_png_header(0, 5), "flat.png")
    check_medium(_png_header(8192, MAX_PIXELS // 8192), "ok.png")  # at the limit: read
    with pytest.raises(MediaError, match="6,000 x 6,000"):  # (a comment does not hide it)
        check_medium(b"P6\n# c\n6000 6000\n255\n", "big.ppm")
    with pytest.raises(MediaError, match="is audio"):
        check_medium(b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(40), "voice.wav")
    with pytest.raises(MediaError, match="not an image of a format read here"):
        check_medium(b"RIFF\x24\x00\x00\x00WEBPVP8 " + bytes(40), "photo.webp")
    with pytest.raises(MediaError, match="header is truncated"):
        check_medium(b"\x89PNG\r\n\x1a\n\x00", "cut.png")
    assert issubclass(MediaError, UsageError)  # exit 2, HTTP 400


# -- the projector --------------------------------------------------------------------


def test_the_projector_turns_an_image_into_embeddings(media: dict[str, Path]) -> None:
    from specgguf.llama.backend import LlamaModel
    from specgguf.llama.media import Projector

    with LlamaModel(media["target"]) as model, Projector(media["mmproj"], model, n_threads=1) as p:
        assert p.vision and not p.audio
        (chunk,) = p.chunks(media["image"].read_bytes(), "a.png")
        assert chunk.tokens is None and chunk.embd is not None
        assert chunk.embd.shape == (16, N_EMBD) and chunk.embd.dtype == np.float32
        (again,) = p.chunks(media["image"].read_bytes(), "a.png")
        (other,) = p.chunks(media["other"].read_bytes(), "b.png")
        assert again.embd is not None and other.embd is not None
        assert np.array_equal(chunk.embd, again.embd)  # deterministic
        assert not np.allclose(chunk.embd, other.embd)  # and the picture matters
        for data, name in ((media["broken"].read_bytes(), "broken.png"),
                           (b"\x00\x01garbage" * 10, "garbage.bin")):  # fmt: skip
            with pytest.raises(MediaError, match=name):
                p.chunks(data, name)


# -- run --image against llama-mtmd-cli -------------------------------------------------


def test_run_with_an_image_generates_what_llama_mtmd_cli_does(
    media: dict[str, Path], tools: Path
) -> None:
    cli = tools / "llama-mtmd-cli"
    if not cli.is_file():
        why = "llama-mtmd-cli is not built (scripts/bench-llama-cpp --build-only)"
        if os.environ.get("SPECGGUF_REQUIRE_LLAMA_TOOLS") == "1":
            pytest.fail(why)
        pytest.skip(why)
    from specgguf.llama.backend import LlamaModel

    oracle = subprocess.run(
        [str(cli), "-m", str(media["target"]), "--mmproj", str(media["mmproj"]),
         "--image", str(media["image"]), "-p", PROMPT, "--temp", "0", "-n", "16", "-t", "1",
         "-c", "512", "--ignore-eos"],
        capture_output=True, timeout=300, check=True,
    )  # fmt: skip
    ours = _run(media, "--drafter", "none")
    assert ours["images"] == [str(media["image"])]
    assert ours["models"]["mmproj"] == str(media["mmproj"])
    with LlamaModel(media["target"], vocab_only=True) as vocab:
        text = vocab.detokenize(ours["tokens"])
    assert len(ours["tokens"]) == 16
    # (llama-mtmd-cli prints a newline before the generated text and after it)
    assert oracle.stdout.strip(b"\n") == text.strip(b"\n"), (oracle.stdout, text)
    # the image is read: another picture gives another output
    assert _run(media, "--drafter", "none", image="other")["tokens"] != ours["tokens"]


@pytest.mark.parametrize("drafter", ["ngram", "suffix", "model", "auto"])
def test_every_drafter_gives_the_targets_own_output_after_an_image(
    media: dict[str, Path], drafter: str
) -> None:
    alone = _run(media, "--drafter", "none", n=48)
    draft = ["-md", str(media["draft"])] if drafter in ("model", "auto") else ["--no-draft"]
    for k in ("1", "4"):
        got = _run(media, "--drafter", drafter, "--draft", k, *draft, n=48)
        assert got["tokens"] == alone["tokens"], (drafter, k)
        # (a fixed drafter drafts here: after the image's placeholders, and from the text)
        assert drafter == "auto" or got["stats"]["drafted"] > 0, (drafter, k)


# -- bad input from the command line: exit 2, one line, nothing decoded -----------------


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--image", "{broken}"], "could not be read as an image"),
        (["--image", "{missing}"], "No such file"),
        (["--image", "{empty}"], "is empty"),
        (["--image", "{huge}"], "20,000 x 20,000 pixels"),
        (["--image", "{image}", "--image", "{image}", "one <__media__> marker"],
         "1 <__media__> marker(s) for 2 --image"),
        (["--image", "{image}", "--raw", "text first <__media__>"], "must not end with a medium"),
        (["--image", "/dev/zero"], "more than 67,108,864 bytes"),
        (["--image", "{folder}"], "Is a directory"),
        (["--image", "{wav}"], "is audio"),
    ],
)  # fmt: skip
def test_bad_images_exit_2_with_one_line(
    media: dict[str, Path], tmp_path: Path, args: list[str], words: str
) -> None:
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "voice.wav").write_bytes(b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(40))
    (tmp_path / "huge.png").write_bytes(_png_header(20_000, 20_000) + bytes(64))
    paths = {**{k: str(v) for k, v in media.items()}, "missing": str(tmp_path / "no.png"),
             "empty": str(tmp_path / "empty.png"), "huge": str(tmp_path / "huge.png"),
             "folder": str(tmp_path), "wav": str(tmp_path / "voice.wav")}  # fmt: skip
    filled = [a.format(**paths) for a in args]
    prompt = [] if filled[-1].startswith(("one", "text")) else [PROMPT]
    res = run_cli("run", "-m", str(media["target"]), "--mmproj", str(media["mmproj"]), "-n", "4",
                  "--drafter", "none", *filled, *prompt)  # fmt: skip
    err = res.stderr.decode()
    assert res.returncode == 2, err
    assert words in err and "Traceback" not in err
    assert res.stdout == b""


def test_an_image_without_a_projector_is_refused(media: dict[str, Path]) -> None:
    res = run_cli("run", "-m", str(media["target"]), "--image", str(media["image"]), "-n", "4",
                  PROMPT)  # fmt: skip
    assert res.returncode == 2
    assert "--mmproj" in res.stderr.decode() and res.stdout == b""
    missing = run_cli("run", "-m", str(media["target"]), "--mmproj", "/nonexistent.gguf",
                      "--image", str(media["image"]), "-n", "4", PROMPT)  # fmt: skip
    assert missing.returncode == 3, missing.stderr.decode()
    assert "projector file not found" in missing.stderr.decode()
    # the text model as a projector, or a projector for another model: refused before
    # the weights load
    other = media["mmproj"].with_name("mmproj-32.gguf")
    write_mmproj(other, 32)
    for path, words in ((media["target"], "not a multimodal projector"),
                        (other, "it is for another model"),
                        (media["mmproj"].parent, "not a folder")):  # fmt: skip
        res = run_cli("run", "-m", str(media["target"]), "--mmproj", str(path), "--image",
                      str(media["image"]), "-n", "4", PROMPT)  # fmt: skip
        assert res.returncode == 3, res.stderr.decode()
        assert words in res.stderr.decode() and "Traceback" not in res.stderr.decode()


def test_a_prompt_with_the_marker_and_no_image_is_text(media: dict[str, Path]) -> None:
    res = run_cli("run", "-m", str(media["target"]), "-n", "4", "--drafter", "none",
                  "What does <__media__> mean?")  # fmt: skip
    assert res.returncode == 0, res.stderr.decode()


def _in_process(media: dict[str, Path]) -> tuple[Any, Any, dict[str, tuple[str, bytes]]]:
    """An engine configuration of the tiny target and its projector (the target alone),
    greedy parameters of 12 tokens, and the two pictures by name."""
    from specgguf.engine import EngineConfig, ModelConfig, SpeculativeConfig
    from specgguf.speculative.loop import GenerationParams
    from specgguf.speculative.sampling import SamplerParams

    config = EngineConfig(ModelConfig(media["target"], n_ctx=512, n_threads=1),
                          speculative=SpeculativeConfig(drafter="none"),
                          mmproj=media["mmproj"])  # fmt: skip
    params = GenerationParams(n_predict=12, sampler=SamplerParams(temperature=0), drafter="none",
                              ignore_eos=True)  # fmt: skip
    return config, params, {k: ("picture", media[k].read_bytes()) for k in ("image", "other")}


def test_a_cached_prompt_is_reused_only_up_to_a_different_image(media: dict[str, Path]) -> None:
    """The placeholders are the same tokens for every image: the cache must be cut where
    the image's content differs, and kept where it is the same (keyed by its hash)."""
    from specgguf.engine import Engine
    from specgguf.llama.media import MARKER

    config, params, pictures = _in_process(media)

    def generate(eng: Engine, which: str) -> tuple[list[int], int, int]:
        ids, spans = eng.media_prompt(eng.render(MARKER + PROMPT), [pictures[which]])
        res = eng.generate(ids, params, media=spans).run()
        return res.tokens, res.stats.prompt_cached, spans[0].start

    fresh: dict[str, list[int]] = {}
    for which in ("image", "other"):
        with Engine(config) as eng:
            fresh[which] = generate(eng, which)[0]
    assert fresh["image"] != fresh["other"]
    with Engine(config) as eng:
        assert generate(eng, "image")[0] == fresh["image"]
        tokens, cached, start = generate(eng, "other")
        assert tokens == fresh["other"] and cached <= start  # cut before the new image
        tokens, cached, start = generate(eng, "other")
        assert tokens == fresh["other"] and cached > start + 16  # the same image: kept
        # a text prompt after them reads its own tokens, not the image's rows
        ids = eng.prepared_ids(eng.render(PROMPT))
        with Engine(dataclasses.replace(config, mmproj=None)) as text_only:
            expected = text_only.generate(ids, params).run().tokens
        assert eng.generate(ids, params).run().tokens == expected


def test_media_travel_with_their_generation_and_saved_prompts(media: dict[str, Path]) -> None:
    """A generation made before another is run reads its own media; a saved prompt brought
    back holds its own images (reviewed: both once read another image's rows)."""
    from specgguf.engine import Engine
    from specgguf.llama.media import MARKER

    config, params, pictures = _in_process(media)

    def prompt(eng: Engine, which: str) -> tuple[list[int], list]:
        return eng.media_prompt(eng.render(MARKER + PROMPT), [pictures[which]])

    with Engine(config) as eng:
        expected = {}
        for w in ("image", "other"):
            ids, spans = prompt(eng, w)
            expected[w] = eng.generate(ids, params, media=spans).run().tokens
    assert expected["image"] != expected["other"]
    with Engine(config) as eng:
        ids, spans = prompt(eng, "other")
        first = eng.generate(ids, params, media=spans)
        eng.generate(eng.prepared_ids(eng.render(PROMPT)), params)  # made, never run
        assert first.run().tokens == expected["other"]
        ids, spans = prompt(eng, "image")
        assert eng.generate(ids, params, media=spans).run().tokens == expected["image"]
        saved = eng.save_prompt()
        ids, spans = prompt(eng, "other")
        assert eng.generate(ids, params, media=spans).run().tokens == expected["other"]
        eng.load_prompt(saved)  # image's rows come back, known as the image's
        assert eng.generate(ids, params, media=spans).run().tokens == expected["other"]
        ids, spans = prompt(eng, "image")
        eng.load_prompt(saved)
        res = eng.generate(ids, params, media=spans).run()
        assert res.tokens == expected["image"] and res.stats.prompt_cached > spans[0].end


# -- the projector's memory: plan counts it ------------------------------------------------


def test_plan_counts_the_projector_and_refuses_one_for_another_model(
    media: dict[str, Path], tmp_path: Path
) -> None:
    from specgguf.errors import EXIT_MODEL_FILE

    # A projector of about 25 MB: its file and its compute buffer for one image are counted.
    mid = tmp_path / "mmproj-mid.gguf"
    write_mmproj(mid, N_EMBD, image_size=64, patch_size=8, n_embd=256, n_head=4, n_ff=1024,
                 n_layer=8)  # fmt: skip
    base = ["plan", "-m", str(media["target"]), "--json"]
    alone = json.loads(run_cli(*base).stdout)
    res = run_cli(*base, "--mmproj", str(mid))
    assert res.returncode == 0, res.stderr.decode()
    got = json.loads(res.stdout)
    (proj,) = [m for m in got["models"] if m["role"] == "projector"]
    need = proj["need"]["this machine"]
    # (64 / 8)^2 + 1 = 65 rows: 4 * 65 * (4 * 256 + 1024) + 4 * 4 * 65^2 bytes of compute
    assert need == mid.stat().st_size + 532_480 + 67_600
    assert got["places"][0]["need"] == alone["places"][0]["need"] + need
    # 20 MiB free: the target alone fits, with the projector it does not (exit 5)
    small = ["--local-mem", str(20 / 1024)]
    assert run_cli(*base, *small).returncode == 0
    assert run_cli(*base, *small, "--mmproj", str(mid)).returncode == 5
    # a text model given as the projector: one line, exit 3, before anything is planned
    bad = run_cli("plan", "-m", str(media["target"]), "--mmproj", str(media["target"]))
    err = bad.stderr.decode()
    assert bad.returncode == EXIT_MODEL_FILE and "not a multimodal projector" in err, err
    assert len(err.strip().splitlines()) == 1


def test_images_that_do_not_fit_are_refused_before_they_are_encoded(
    media: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request of a thousand small images must not cost a thousand encodes (seconds of
    arithmetic and their embeddings' memory) before the context's limit refuses it."""
    from specgguf.engine import Engine
    from specgguf.errors import ContextOverflowError
    from specgguf.llama.media import MARKER, Projector

    config, _, pictures = _in_process(media)  # (n_ctx 512: 16 positions an image)
    encoded = []
    chunk = Projector._chunk

    def counted(self: Projector, c: Any, name: str) -> Any:
        encoded.append(name)
        return chunk(self, c, name)

    monkeypatch.setattr(Projector, "_chunk", counted)
    with Engine(config) as eng, pytest.raises(ContextOverflowError):
        eng.media_prompt(eng.render(MARKER * 1000 + PROMPT), [pictures["image"]] * 1000)
    assert 20 <= len(encoded) < 32  # the images that fit, and none past them


def test_info_says_what_a_projector_reads_and_for_which_target(media: dict[str, Path]) -> None:
    res = run_cli("info", str(media["mmproj"]))
    assert res.returncode == 0 and res.stderr == b"", res.stderr.decode()
    out = res.stdout.decode()
    assert re.search(r"^projector type +mlp", out, re.M), out
    assert re.search(r"^rows of +64 values", out, re.M), out  # the tiny target's n_embd
    assert re.search(r"^image / patch size +32 / 8 pixels", out, re.M), out
    assert "tokenizer" not in out and "loadable" not in out  # (no language model's rows)
    data = json.loads(run_cli("info", "--json", str(media["mmproj"])).stdout)
    assert data["projector"]["projection_dim"] == 64 and data["projector"]["vision"] is True


def test_images_in_deterministic_mode_are_refused_before_the_weights_load(
    media: dict[str, Path],
) -> None:
    res = run_cli("run", "-m", str(media["target"]), "--mmproj", str(media["mmproj"]),
                  "--image", str(media["image"]), "--deterministic", "-v", PROMPT)  # fmt: skip
    err = res.stderr.decode()
    assert res.returncode == 2 and "media with deterministic mode" in err, err
    assert "llama_model_load" not in err and "load_tensors" not in err  # (nothing loaded)


@pytest.mark.parametrize("offload", [True, False])
def test_a_projector_offloaded_counts_on_the_gpu_too(media: dict[str, Path], offload: bool) -> None:
    from specgguf.engine import EngineConfig, ModelConfig
    from specgguf.engine.preflight import memory_plan
    from specgguf.gguf.info import read_model_info
    from specgguf.llama.memory import LOCAL, PROJECTOR, Place, projector_memory

    config = EngineConfig(ModelConfig(media["target"], n_ctx=512), mmproj=media["mmproj"],
                          mmproj_offload=offload)  # fmt: skip
    gpu = Place("CUDA0", "gpu", 8 << 30)
    plan = memory_plan(config, read_model_info(media["target"]), None, 512, 512, servers={},
                       local_free=16 << 30, gpus=[gpu])  # fmt: skip
    (proj,) = [m for m in plan.models if m.name == PROJECTOR]
    share = projector_memory(media["mmproj"])
    assert proj.shares[LOCAL] == share  # (read through this machine's memory either way)
    assert proj.shares.get("CUDA0") == (share if offload else None)


def test_a_medium_whose_read_fails_midway_leaves_none_of_its_rows(media: dict[str, Path]) -> None:
    # The image's 16 rows in batches of 8: the second decode fails. The first 8 rows must
    # leave the cache with it, or a later prompt with the same placeholder tokens there
    # would keep them as if they were those tokens' rows.
    from specgguf.engine import Engine
    from specgguf.errors import BackendError
    from specgguf.llama.media import MARKER

    config, params, pictures = _in_process(media)
    config = dataclasses.replace(config, target=dataclasses.replace(config.target, n_batch=8))
    with Engine(config) as eng:
        ids, spans = eng.media_prompt(eng.render(MARKER + PROMPT), [pictures["image"]])
        start = spans[0].start
        probe = [*ids[: start + 8], *eng.prepared_ids(eng.render(PROMPT))]
        fresh = eng.generate(probe, params).run()
        eng.target_ctx.reuse([])
        lc = eng.target_ctx._lc
        decode, media_decodes = lc.llama_decode, [0]

        def fail_the_second(ctx: Any, batch: Any) -> int:
            if batch.embd:
                media_decodes[0] += 1
                if media_decodes[0] == 2:
                    return 1
            return int(decode(ctx, batch))

        lc.llama_decode = fail_the_second
        try:
            with pytest.raises(BackendError, match="reading a medium"):
                eng.generate(ids, params, media=spans).run()
        finally:
            lc.llama_decode = decode
        assert media_decodes[0] == 2 and eng.target_ctx.n_past == start
        again = eng.generate(probe, params).run()
        assert again.stats.prompt_cached <= start and again.tokens == fresh.tokens
