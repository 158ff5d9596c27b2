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
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from specgguf.errors import MediaError, UsageError
from specgguf.gguf.tinymedia import picture, png_bytes, write_mmproj, write_png
from specgguf.llama.media import MAX_PIXELS, check_medium, image_size

from .helpers import mtmd_cli, run_cli

N_EMBD = 64  # the tiny target's (specgguf/gguf/tiny.py)
PROMPT = "Describe"


@pytest.fixture(scope="module")
def media(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The tiny target, its projector, two pictures and a corrupt one; a Qwen2-VL
    projector (for a target with M-RoPE)."""
    folder = tmp_path_factory.mktemp("media")
    write_mmproj(folder / "mmproj.gguf", N_EMBD)
    write_mmproj(folder / "mmproj-qwen2vl.gguf", N_EMBD, patch_size=4,
                 projector="qwen2vl_merger")  # fmt: skip
    write_mmproj(folder / "mmproj-qwen3vl.gguf", N_EMBD, patch_size=4,
                 projector="qwen3vl_merger", deepstack=(0,))  # fmt: skip
    (folder / "broken.png").write_bytes(png_bytes(picture())[:60])
    return {
        "target": tiny_models["target"],
        "draft": tiny_models["draft-partial"],
        "mmproj": folder / "mmproj.gguf",
        "mmproj-qwen2vl": folder / "mmproj-qwen2vl.gguf",
        "mmproj-qwen3vl": folder / "mmproj-qwen3vl.gguf",
        "image": write_png(folder / "a.png", picture()),
        "other": write_png(folder / "b.png", picture(flip=True)),
        "broken": folder / "broken.png",
    }


def _run(
    media: dict[str, Path], *args: str, image: str = "image", n: int = 16, prompt: str = PROMPT
) -> dict:
    res = run_cli("run", "-m", str(media["target"]), "--mmproj", str(media["mmproj"]),
                  "--image", str(media[image]), "--temp", "0", "-n", str(n), "--ignore-eos",
                  "-t", "1", "--json", *args, prompt)  # fmt: skip
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
    from specgguf.llama.backend import LlamaModel

    oracle = mtmd_cli(tools, "-m", str(media["target"]), "--mmproj", str(media["mmproj"]),
                      "--image", str(media["image"]), "-p", PROMPT, "--temp", "0", "-n", "16",
                      "-t", "1", "-c", "512", "--ignore-eos")  # fmt: skip
    ours = _run(media, "--drafter", "none")
    assert ours["images"] == [str(media["image"])]
    assert ours["models"]["mmproj"] == str(media["mmproj"])
    with LlamaModel(media["target"], vocab_only=True) as vocab:
        text = vocab.detokenize(ours["tokens"])
    assert len(ours["tokens"]) == 16
    # (llama-mtmd-cli prints a newline before the generated text and after it)
    assert oracle == text.strip(b"\n"), (oracle, text)
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


def _in_process(
    media: dict[str, Path], target: Path | None = None, mmproj: str = "mmproj"
) -> tuple[Any, Any, dict[str, tuple[str, bytes]]]:
    """An engine configuration of the tiny target (or ``target``) and its projector (or
    ``media[mmproj]``) (the target alone), greedy parameters of 12 tokens, and the two
    pictures by name."""
    from specgguf.engine import EngineConfig, ModelConfig, SpeculativeConfig
    from specgguf.speculative.loop import GenerationParams
    from specgguf.speculative.sampling import SamplerParams

    config = EngineConfig(ModelConfig(target or media["target"], n_ctx=512, n_threads=1),
                          speculative=SpeculativeConfig(drafter="none"),
                          mmproj=media[mmproj])  # fmt: skip
    params = GenerationParams(n_predict=12, sampler=SamplerParams(temperature=0), drafter="none",
                              ignore_eos=True)  # fmt: skip
    return config, params, {k: ("picture", media[k].read_bytes()) for k in ("image", "other")}


#: generations one after another on one engine: other text right after the same image (a
#: cache kept one position less than it holds would end inside the image), another image,
#: the first again, text alone
TURNS = [("image", "Describe"), ("image", "Name it"), ("other", "Describe"),
         ("image", "Describe"), (None, "Describe")]  # fmt: skip


def _look(eng: Any, pictures: dict[str, tuple[str, bytes]], which: str | None,
          text: str) -> tuple[list[int], list]:  # fmt: skip
    """The ids and media of "Look at this: <picture ``which``>``text``" (None: ``text``
    alone)."""
    from specgguf.llama.media import MARKER

    if which is None:
        return eng.prepared_ids(eng.render(text)), []
    return eng.media_prompt(eng.render(f"Look at this: {MARKER}{text}"), [pictures[which]])


def _fresh(config: Any, params: Any, pictures: dict[str, tuple[str, bytes]],
           turns: list[tuple[str | None, str]]) -> list[list[int]]:  # fmt: skip
    """Each turn's tokens (:func:`_look`) from an engine of its own, with ``params``."""
    from specgguf.engine import Engine

    out = []
    for which, text in turns:
        with Engine(config) as eng:
            ids, spans = _look(eng, pictures, which, text)
            out.append(eng.generate(ids, params, media=spans).run().tokens)
    return out


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


# -- drafters that read the target's hidden states ------------------------------------

#: (fixture of the target, fixture of the head's file or None: the target's own MTP
#: blocks, the drafter)
HEADS = {
    "mtp": ("mtp-heads", None, "mtp"),  # Hunyuan V3's two chained MTP blocks
    "eagle3": ("target", "eagle3", "eagle3"),
    "dflash": ("target", "dflash", "dflash"),
    "assistant": ("gemma4", "gemma4-assistant", "assistant"),  # Gemma 4's MTP assistant
    # Qwen3.5's shape: a hybrid target with M-RoPE, its MTP block, a DFlash draft for it
    "mtp-hybrid": ("mtp", None, "mtp"),
    "dflash-mrope": ("hybrid", "dflash-mrope", "dflash"),
}


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_a_head_drafts_after_media_from_the_hidden_states_that_saw_them(
    media: dict[str, Path], tiny_models: dict[str, Path], kind: str
) -> None:
    """MTP blocks, EAGLE-3, DFlash and Gemma 4's assistant read the target's hidden states
    at a medium's positions (placeholder tokens, states that saw the image), and the head's
    cache is kept across generations only up to a medium that changed (the placeholders
    are the same tokens whatever the image). Each generation gives the target alone's
    tokens, fresh: the same image with other text after it, another image, the first
    again, text alone."""
    from specgguf.engine import Engine, ModelConfig, SpeculativeConfig

    target, head, drafter = HEADS[kind]
    mmproj = "mmproj-qwen2vl" if target in ("mtp", "hybrid") else "mmproj"  # (M-RoPE)
    config, params, pictures = _in_process(media, tiny_models[target], mmproj)
    params = dataclasses.replace(params, n_predict=24)
    spec = SpeculativeConfig(drafter=drafter, draft_max=4, draft_min=0)
    drafting = dataclasses.replace(
        config, speculative=spec,
        draft=ModelConfig(tiny_models[head], n_ctx=512, n_threads=1) if head else None,
    )  # fmt: skip
    # (another image: the head's first row there reads the hidden state of the position
    # before it, which the target computes again)
    turns = TURNS
    expected = _fresh(config, params, pictures, turns)
    # (the tiny Gemma 4 gives the same tokens whatever the image)
    assert expected[0] != expected[2] or kind == "assistant"
    with Engine(drafting) as eng:
        ids, spans = _look(eng, pictures, "image", "Describe")
        ctx = eng.target_ctx
        ctx.prompt(ids, media=spans)
        rows = ctx.hidden_rows(spans[0].start, spans[0].end)  # (none there before)
        assert rows.shape[0] == len(spans[0].embd) and np.isfinite(rows).all()
        ctx.reuse([])
        drafted, cached = 0, []
        for (which, text), want in zip(turns, expected, strict=True):
            ids, spans = _look(eng, pictures, which, text)
            res = eng.generate(ids, dataclasses.replace(params, drafter=drafter),
                               media=spans).run()  # fmt: skip
            assert res.tokens == want, (kind, which, text)
            drafted += res.stats.drafted
            cached.append(res.stats.prompt_cached)
        assert drafted > 0
        # the text before the image is kept (but its last position, for the head's row)
        image_at = _look(eng, pictures, "image", "Describe")[1][0].start
        assert 0 < cached[2] < image_at and cached[3] == cached[2]


# -- recurrent and hybrid targets, M-RoPE ---------------------------------------------

#: a Mamba-2 target with LLaVA's projector; a hybrid of Gated DeltaNet and attention
#: layers with M-RoPE (Qwen3.5's) and Qwen2-VL's text model (attention, M-RoPE), both
#: with Qwen2-VL's projector; Qwen3-VL's, whose image rows are twice its width (one
#: deepstack block's rows beside the merger's); the draft model for each
RECURRENT = {"recurrent": ("draft-partial", "mmproj"),
             "hybrid": ("hybrid-draft", "mmproj-qwen2vl"),
             "qwen2vl": ("draft-partial", "mmproj-qwen2vl"),
             "qwen3vl": ("draft-partial", "mmproj-qwen3vl")}  # fmt: skip


@pytest.mark.parametrize("target", sorted(RECURRENT))
def test_a_recurrent_or_m_rope_target_reads_an_image_as_llama_mtmd_cli_does(
    media: dict[str, Path], tiny_models: dict[str, Path], tools: Path, target: str
) -> None:
    """A Mamba-2 target reads the image's rows into its recurrent state; an M-RoPE target
    (the hybrid, Qwen2-VL's, Qwen3-VL's) places them on positions of their own (a 4 x 4
    grid of rows on 4 positions), and the text after goes on from there; Qwen3-VL's rows
    are twice its width (its deepstack rows beside them): `run --image` gives
    llama-mtmd-cli's bytes with text before the image and after it, and each drafter the
    target alone's tokens."""
    from specgguf.llama.backend import LlamaModel

    draft, mmproj = RECURRENT[target]
    at = {**media, "target": tiny_models[target], "draft": tiny_models[draft],
          "mmproj": media[mmproj]}  # fmt: skip
    prompt = f"Look at this: <__media__> {PROMPT}"
    ours = _run(at, "--drafter", "none", prompt=prompt)
    assert _run(at, "--drafter", "none", prompt=prompt, image="other")["tokens"] != ours["tokens"]
    if (tools / "llama-mtmd-cli").is_file() or os.environ.get("SPECGGUF_REQUIRE_LLAMA_TOOLS"):
        oracle = mtmd_cli(tools, "-m", str(at["target"]), "--mmproj", str(at["mmproj"]),
                          "--image", str(media["image"]), "-p", prompt, "--temp", "0", "-n",
                          "16", "-t", "1", "-c", "512", "--ignore-eos")  # fmt: skip
        with LlamaModel(at["target"], vocab_only=True) as vocab:
            text = vocab.detokenize(ours["tokens"])
        assert oracle == text.strip(b"\n"), (oracle, text)
    alone = _run(at, "--drafter", "none", prompt=prompt, n=32)
    for drafter in ("ngram", "suffix", "model"):
        draft = ["-md", str(at["draft"])] if drafter == "model" else ["--no-draft"]
        got = _run(at, "--drafter", drafter, "--draft", "4", *draft, prompt=prompt, n=32)
        assert got["tokens"] == alone["tokens"], drafter
        assert drafter != "model" or got["stats"]["drafted"] > 0
    # (the suffix drafter's token trees, on an attention target: its branches at the
    # positions after the image's)
    if target == "qwen2vl":
        again = prompt + ": the quick brown fox jumps over the lazy dog" * 3
        got = _run(at, "--drafter", "suffix", "--draft", "4", "--draft-tree", "4", "--no-draft",
                   prompt=again, n=128)  # fmt: skip
        assert got["tokens"] == _run(at, "--drafter", "none", prompt=again, n=128)["tokens"]
        assert got["stats"]["tree_steps"] > 0 and got["stats"]["accepted"] > 0


def test_an_m_rope_images_rows_take_the_positions_libmtmd_gives_them(
    media: dict[str, Path], tiny_models: dict[str, Path]
) -> None:
    """The tiny Qwen2-VL projector's image is 16 rows in a 4 x 4 grid: with M-RoPE they
    take 4 positions, all at the image's first in time, row and column in the other two
    sections (libmtmd's mtmd_image_tokens_get_decoder_pos); a second image starts where
    the first's positions end, not its rows. (LLaVA's projector beside an M-RoPE target
    gives one position a row, in libmtmd too.)"""
    from specgguf.engine import Engine
    from specgguf.llama.media import MARKER

    config, _, pictures = _in_process(media, tiny_models["hybrid"], "mmproj-qwen2vl")
    with Engine(config) as eng:
        _, spans = eng.media_prompt(eng.render(f"a{MARKER}b{MARKER}c"),
                                      [pictures["image"], pictures["other"]])  # fmt: skip
    first, second = spans
    assert (len(first.embd), first.n_pos, first.shift) == (16, 4, 12)
    p = first.start
    assert first.pos is not None and second.pos is not None
    assert (first.pos[0] == p).all() and first.pos[3].tolist() == [0] * 16
    assert first.pos[1].tolist() == [p + i // 4 for i in range(16)]  # rows
    assert first.pos[2].tolist() == [p + i % 4 for i in range(16)]  # columns
    # the text between takes one position a token, from the first image's last + 1
    assert (second.pos[0] == second.start - 12).all()


@pytest.mark.parametrize("target", ["hybrid", "recurrent"])
def test_a_recurrent_state_keeps_a_checkpoint_after_an_image_and_reads_it_again(
    media: dict[str, Path], tiny_models: dict[str, Path], target: str
) -> None:
    """A recurrent state cannot be cut anywhere: a prompt that shares the image goes on
    from the checkpoint after it; another image from before it; and a rollback past the
    snapshots decodes the kept positions again, the image's as rows, not placeholders
    (on the M-RoPE hybrid, at the image's positions)."""
    from specgguf.engine import Engine

    config, params, pictures = _in_process(media, tiny_models[target], RECURRENT[target][1])

    turns: list[tuple[str | None, str]] = TURNS[:3]
    expected = _fresh(config, params, pictures, turns)
    assert expected[0] != expected[2]
    with Engine(config) as eng:
        cached = []
        for (which, text), want in zip(turns, expected, strict=True):
            ids, spans = _look(eng, pictures, which, text)
            res = eng.generate(ids, params, media=spans).run()
            assert res.tokens == want, (which, text)
            cached.append(res.stats.prompt_cached)
        start, end = spans[0].start, spans[0].end
        assert cached[1] >= end and cached[2] <= start, (cached, start, end)
        # past the snapshots: cleared and decoded again, the image as its rows
        ctx = eng.target_ctx
        ids, spans = _look(eng, pictures, "image", "Describe")
        ctx.reuse([])
        ctx.prompt(ids[:-1], media=spans)
        ctx.rollback(end + 1)
        assert ctx.n_past == end + 1 and ctx.holds_media
        again = ctx.eval(ids[end + 1 : end + 2]).copy()
        ctx.reuse([])
        ctx.prompt(ids[: end + 1], media=spans)
        fresh = ctx.eval(ids[end + 1 : end + 2]).copy()
        np.testing.assert_array_equal(again, fresh)
        ctx.reuse([])  # (what reading the placeholders as text gives: not that)
        ctx.eval(ids[: end + 1], logits="none")
        assert not np.array_equal(ctx.eval(ids[end + 1 : end + 2]), fresh)


def test_an_image_right_after_rows_a_rollback_kept_undecoded_follows_them(
    media: dict[str, Path], tiny_models: dict[str, Path]
) -> None:
    """A Mamba-2 target rolls back by checkpoint and replay: the rows a verification kept
    are decoded with the next evaluation. An image read first after such a cut goes after
    them (reviewed: it was decoded at positions past the cache's end, and failed)."""
    from specgguf.engine import Engine, SpeculativeConfig
    from specgguf.llama.backend import MediaSpan

    config, _, pictures = _in_process(media, tiny_models["recurrent"])
    config = dataclasses.replace(config, speculative=SpeculativeConfig(drafter="ngram",
                                                                       draft_max=4))  # fmt: skip
    with Engine(config) as eng:
        ctx = eng.target_ctx
        (span,) = eng.media_prompt(eng.render("<__media__> hi"), [pictures["image"]])[1]
        text = eng.tokenize(" the quick brown fox jumps over the lazy dog", add_special=False)
        pre, verified, after = text[:8], text[8:12], text[12:16]
        image = MediaSpan(len(pre) + 2, span.embd, span.key, span.non_causal)
        ids = [*pre, *verified[:2], *[0] * len(span.embd), *after]
        ctx.reuse([])
        ctx.eval(pre, logits="none")
        ctx.eval(verified, logits="all")  # a verification, two of its rows kept
        ctx.rollback(len(pre) + 2)
        assert ctx.replays and ctx.rollback_room is not None
        kept = ctx.reuse(ids, media=[image])
        ctx.prompt(ids[kept:-1], media=[image])
        got = ctx.eval(ids[-1:]).copy()
        ctx.reuse([])
        ctx.prompt(ids[:-1], media=[image])
        np.testing.assert_array_equal(got, ctx.eval(ids[-1:]))


# -- a draft model reads the image's rows --------------------------------------------

#: targets with a draft model that is the target itself (the same weights): its drafts
#: are all accepted only where it reads what the target reads
SAME = {"target": ("draft-identical", "mmproj"), "hybrid": ("hybrid", "mmproj-qwen2vl")}


@pytest.mark.parametrize("target", sorted(SAME))
def test_a_draft_model_of_the_targets_width_reads_the_images_rows(
    media: dict[str, Path], tiny_models: dict[str, Path], target: str
) -> None:
    """A draft model whose input rows are as wide as the target's reads the target's
    embeddings of an image at its rows (llama.cpp's draft-simple), on the hybrid M-RoPE
    target at the image's grid of positions: a draft with the target's own weights then
    has its drafts accepted after an image, where with the placeholder tokens most were
    rejected. Across generations its cache is kept only up to an image it read
    otherwise: the same image, another, the first again, text alone, each the target
    alone's tokens, the drafts after an image accepted."""
    from specgguf.engine import Engine, ModelConfig, SpeculativeConfig

    draft, mmproj = SAME[target]
    config, params, pictures = _in_process(media, tiny_models[target], mmproj)
    params = dataclasses.replace(params, n_predict=24)
    drafting = dataclasses.replace(
        config, speculative=SpeculativeConfig(drafter="model", draft_max=4),
        draft=ModelConfig(tiny_models[draft], n_ctx=512, n_threads=1),
    )  # fmt: skip
    turns = TURNS
    expected = _fresh(config, params, pictures, turns)
    assert expected[0] != expected[2]
    model = dataclasses.replace(params, drafter="model")
    with Engine(drafting) as eng:
        for (which, text), want in zip(turns, expected, strict=True):
            ids, spans = _look(eng, pictures, which, text)
            assert all(s.draft is not None for s in spans)
            res = eng.generate(ids, model, media=spans).run()
            assert res.tokens == want, (which, text)
            # (a draft and a target of the same weights may still differ in a last bit
            # between a batch of one row and one of K + 1: text alone is not asserted)
            rate = res.stats.accepted / max(1, res.stats.drafted)
            assert which is None or rate >= 0.75, (which, text, res.stats)
        # the placeholders instead of the rows: most drafts after the image rejected
        ids, spans = _look(eng, pictures, "other", "Describe")
        res = eng.generate(ids, model, media=[dataclasses.replace(s, draft=None)
                                              for s in spans]).run()  # fmt: skip
        assert res.tokens == expected[2]
        assert res.stats.accepted / max(1, res.stats.drafted) < 0.5, res.stats


@pytest.fixture(scope="module")
def narrow(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A draft model half the target's width (the target's vocabulary), its own LLaVA
    projector (16 rows an image, as the target's), and one that makes 64 rows."""
    from specgguf.gguf.tiny import fixture_specs, write_tiny_model

    folder = tmp_path_factory.mktemp("narrow")
    spec = dataclasses.replace(fixture_specs()["target"], name="tiny narrow draft", n_embd=32,
                               seed=91)  # fmt: skip
    write_tiny_model(folder / "narrow.gguf", spec)
    write_mmproj(folder / "mmproj-narrow.gguf", 32, seed=92)
    write_mmproj(folder / "mmproj-narrow-64.gguf", 32, patch_size=4, seed=93)
    return {"draft": folder / "narrow.gguf", "mmproj": folder / "mmproj-narrow.gguf",
            "mmproj-64": folder / "mmproj-narrow-64.gguf"}  # fmt: skip


def test_a_draft_model_reads_the_media_through_its_own_projector(
    media: dict[str, Path], narrow: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """--mmproj-draft: a draft model of another width reads each image through its own
    projector, at the same rows as the target's (its rows differ from image to image);
    one whose projector makes other rows than the target's reads the placeholders, said
    in the log. Every output is the target alone's."""
    from specgguf.engine import Engine, ModelConfig, SpeculativeConfig
    from specgguf.llama.media import MARKER

    config, params, pictures = _in_process(media)
    params = dataclasses.replace(params, n_predict=24, drafter="model")
    drafting = dataclasses.replace(
        config, speculative=SpeculativeConfig(drafter="model", draft_max=4),
        draft=ModelConfig(narrow["draft"], n_ctx=512, n_threads=1), mmproj_draft=narrow["mmproj"],
    )  # fmt: skip
    with Engine(config) as eng:
        alone = {}
        for w in ("image", "other"):
            ids, spans = eng.media_prompt(eng.render(MARKER + PROMPT), [pictures[w]])
            alone[w] = eng.generate(ids, dataclasses.replace(params, drafter="none"),
                                    media=spans).run().tokens  # fmt: skip
    with Engine(drafting) as eng:
        rows = {}
        for w in ("image", "other", "image"):
            ids, spans = eng.media_prompt(eng.render(MARKER + PROMPT), [pictures[w]])
            (span,) = spans
            assert span.draft is not None and span.draft.embd.shape == (16, 32)
            rows[w] = span.draft.embd
            res = eng.generate(ids, params, media=spans).run()
            assert res.tokens == alone[w] and res.stats.drafted > 0
            assert eng.draft_ctx is not None and eng.draft_ctx.media_keys() == {
                span.start: span.key
            }
        assert not np.array_equal(rows["image"], rows["other"])
    other = dataclasses.replace(drafting, mmproj_draft=narrow["mmproj-64"])
    with Engine(other) as eng:
        ids, spans = eng.media_prompt(eng.render(MARKER + PROMPT), [pictures["image"]])
        assert spans[0].draft is None  # (64 rows against 16)
        assert eng.generate(ids, params, media=spans).run().tokens == alone["image"]
    assert "makes other rows of picture than the target's" in caplog.text


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["--mmproj-draft", "{mmproj}"], 2, "needs the target's (--mmproj) and a draft model"),
        (["--mmproj", "{target_mmproj}", "-md", "{draft}", "--mmproj-draft", "{target_mmproj}"],
         3, "have 64 values and the draft model's 32: it is for another model"),
    ],
)  # fmt: skip
def test_a_draft_projector_without_its_model_or_for_another_is_refused(
    media: dict[str, Path], narrow: dict[str, Path], args: list[str], code: int, words: str
) -> None:
    """Exit 2 (usage) or 3 (a model file that cannot be used), one line, before loading."""
    names = {"mmproj": narrow["mmproj"], "draft": narrow["draft"],
             "target_mmproj": media["mmproj"]}  # fmt: skip
    res = run_cli("run", "-m", str(media["target"]),
                  *[a.format(**{k: str(v) for k, v in names.items()}) for a in args],
                  "-n", "4", PROMPT)  # fmt: skip
    err = res.stderr.decode()
    assert res.returncode == code and words in err and len(err.strip().splitlines()) == 1, err


def test_the_ram_prompt_cache_keeps_prompts_with_images_by_their_content(
    media: dict[str, Path],
) -> None:
    """--cache-ram keeps a sequence's prompt with its images when another prompt takes
    its place; a later prompt with the same image gets it back past the image, one with
    another image only up to it (the placeholders are the same tokens)."""
    from specgguf.engine import Engine
    from specgguf.engine.config import CacheConfig

    config, params, pictures = _in_process(media)
    cached = dataclasses.replace(config, cache=CacheConfig(ram=64 << 20))

    turns = [("image", "Describe"), (None, "Tell me about the quick fox, " * 8),
             ("image", "Describe"), ("other", "Describe")]  # fmt: skip
    fresh = _fresh(config, params, pictures, turns)
    with Engine(cached) as eng:
        got = []
        for which, text in turns:
            ids, spans = _look(eng, pictures, which, text)
            res = eng.generate(ids, params, media=spans).run()
            got.append((res.tokens, res.stats.prompt_cached, spans))
        assert eng.prompt_cache is not None and eng.prompt_cache.restores >= 1
    assert [t for t, _, _ in got] == fresh
    (image,) = got[2][2]
    assert got[2][1] >= image.end  # (back from the cache, the image's rows with it)
    assert got[3][1] <= image.start  # (another image: up to it)


def test_a_draft_window_slid_by_a_long_generation_goes_back_for_the_next_images(
    media: dict[str, Path], tiny_models: dict[str, Path]
) -> None:
    """A draft model's context of 80 positions: a generation past it slides the draft's
    window; the next prompt, which fits, reads its images as rows again from the start
    (reviewed: the window stayed slid, and the draft read placeholders from then on)."""
    from specgguf.engine import Engine, ModelConfig, SpeculativeConfig
    from specgguf.llama.media import MARKER

    config, params, pictures = _in_process(media)
    drafting = dataclasses.replace(
        config, speculative=SpeculativeConfig(drafter="model", draft_max=4),
        draft=ModelConfig(tiny_models["draft-identical"], n_ctx=80, n_threads=1),
    )  # fmt: skip
    params = dataclasses.replace(params, n_predict=36, drafter="model")
    with Engine(drafting) as eng:
        for turn, images in enumerate((["image", "other"], ["image", "image"],
                                       ["image", "other"])):  # fmt: skip
            ids, spans = eng.media_prompt(eng.render(f"Look at these: {MARKER}{MARKER}Compare"),
                                          [pictures[w] for w in images])  # fmt: skip
            assert len(ids) + params.n_predict > 80 > len(ids)
            res = eng.generate(ids, params, media=spans).run()
            # (each slides its window near its end: its drafts after that read none)
            assert turn == 0 or res.stats.accepted >= 0.5 * res.stats.drafted > 0, (
                images, res.stats)  # fmt: skip
