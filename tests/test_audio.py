"""Audio read by the target through an audio projector (``--mmproj``, libmtmd): a tiny
generated Ultravox projector (Whisper's encoder, specgguf/gguf/tinymedia.py) beside the tiny
target, llama.cpp's own ``llama-mtmd-cli --audio`` as the oracle of what the target
generates after a clip, every drafter giving the target's own greedy output, a clip's
length read from its header before anything decodes it, and the server's ``input_audio``
parts through the official `openai` package."""

from __future__ import annotations

import base64
import contextlib
import json
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from specgguf.errors import BackendError, MediaError
from specgguf.gguf.tinymedia import (
    picture,
    silent_mp3,
    tone,
    wav_bytes,
    write_audio_mmproj,
    write_mmproj,
    write_png,
)
from specgguf.llama.audio import MAX_SECONDS, AudioHeaderError, audio_format, audio_seconds
from specgguf.llama.media import MARKER, check_medium

from .helpers import ServerProcess, mtmd_cli, run_cli
from .test_server import _loopback_only  # noqa: F401 (clients talk to 127.0.0.1 directly)

N_EMBD = 64  # the tiny target's (specgguf/gguf/tiny.py)
PROMPT = "Describe"
#: Drafting on, with a drafter that drafts on the tiny pair (as tests/test_server_media.py)
SPEC = ["--drafter", "ngram", "--draft", "4", "-t", "1", "-c", "1024"]


@pytest.fixture(scope="module")
def media(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The tiny target, an audio projector and an image one, clips and a picture."""
    folder = tmp_path_factory.mktemp("audio")
    write_audio_mmproj(folder / "mmproj-audio.gguf", N_EMBD)
    write_mmproj(folder / "mmproj-image.gguf", N_EMBD)
    clips = {"a440": wav_bytes(tone(440)), "a880": wav_bytes(tone(880)),
             "long": wav_bytes(tone(300, 35.0))}  # fmt: skip
    for name, data in clips.items():
        (folder / f"{name}.wav").write_bytes(data)
    (folder / "quiet.mp3").write_bytes(silent_mp3(40))
    return {
        "target": tiny_models["target"],
        "draft": tiny_models["draft-partial"],
        "mmproj": folder / "mmproj-audio.gguf",
        "mmproj-image": folder / "mmproj-image.gguf",
        **{name: folder / f"{name}.wav" for name in clips},
        "mp3": folder / "quiet.mp3",
        "png": write_png(folder / "a.png", picture()),
    }


# -- a clip's length from its header: read before anything decodes it -------------------


def _wav_fmt(code: int, channels: int, rate: int, align: int, *, bits: int = 16,
             byte_rate: int = 32000, data: bytes = bytes(64)) -> bytes:  # fmt: skip
    """A WAV file with the fmt chunk's fields as given, then ``data``."""
    fmt = struct.pack("<HHIIHH", code, channels, rate, byte_rate, align, bits)
    body = b"WAVEfmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", len(data))
    return b"RIFF" + struct.pack("<I", len(body + data)) + body + data


#: The header of an 8 x 8 PNG (what a check reads of it)
PNG_8 = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + struct.pack(">II", 8, 8) + bytes(5)


def _flac(sample_rate: int, total: int) -> bytes:
    """A FLAC file's magic and STREAMINFO block (what its length is read from)."""
    info = struct.pack(">HH", 4096, 4096) + bytes(6)  # block sizes, frame sizes
    bits = sample_rate << 44 | 0 << 41 | 15 << 36 | total  # mono, 16 bits a sample
    info += bits.to_bytes(8, "big") + bytes(16)  # (the MD5 of the samples)
    return b"fLaC" + bytes((0x80,)) + len(info).to_bytes(3, "big") + info


def test_a_clips_length_is_read_from_its_header() -> None:
    assert audio_seconds(wav_bytes(tone(440, 2.5))) == 2.5
    stereo = np.zeros(2 * 22050, np.int16)  # half a second of 44.1 kHz, two channels
    assert audio_seconds(wav_bytes(stereo, rate=44100, channels=2)) == 0.5
    # a chunk before fmt, of odd size (padded to even): skipped
    wav = wav_bytes(tone(440, 1.0))
    odd = wav[:12] + b"LIST" + struct.pack("<I", 3) + b"abc\x00" + wav[12:]
    assert audio_seconds(odd) == 1.0
    frames = 40 * 1152 / 44100  # (40 frames of MPEG-1 Layer III at 44.1 kHz)
    assert audio_seconds(silent_mp3(40)) == pytest.approx(frames)
    tag = b"ID3\x04\x00\x00" + bytes((0, 0, 1, 0)) + bytes(128)  # a 128-byte ID3v2 tag
    assert audio_seconds(tag + silent_mp3(40)) == pytest.approx(frames)
    junk = silent_mp3(20) + b"\xff\x00junk" + silent_mp3(20)  # (a decoder resyncs)
    assert audio_seconds(junk) == pytest.approx(frames)
    assert audio_seconds(_flac(16000, 48000)) == 3.0
    assert [audio_format(d) for d in (wav, silent_mp3(1), _flac(8000, 1), b"OggS" + bytes(8),
                                      b"\x89PNG\r\n\x1a\n")] == ["WAV", "MP3", "FLAC", "Ogg",
                                                                 None]  # fmt: skip


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (wav_bytes(tone(440))[:-100], "truncated"),
        (b"RIFF" + struct.pack("<I", 4) + b"WAVE", "no fmt chunk"),
        (b"RIFF\x00\x00\x00\x00WAVEdata" + struct.pack("<I", 0), "before its fmt chunk"),
        (b"RIFF\x00\x00\x00\x00WAVEfmt " + struct.pack("<I", 16) + bytes(16), "format tag 0x0000"),
        (_wav_fmt(1, 0, 16000, 0), "0 channel(s)"),
        (_flac(16000, 0), "does not say"),
        (b"fLaC" + bytes(10), "STREAMINFO"),
        (b"ID3\x04\x00\x00\x00\x00\x00\x00" + bytes(300), "no MPEG audio frame"),
        (b"\x89PNG\r\n\x1a\n", "not audio"),
        # (reviewed: each of these passed a first version, and libmtmd then decoded
        # hours of samples or aborted the process)
        (_wav_fmt(2, 1, 16000, 4), "encoding (format tag 0x0002) is not read"),  # ADPCM
        (_wav_fmt(1, 2, 16000, 2), "2 channel(s) of 16-bit PCM at 16000 Hz, in frames of 2"),
        # dr_wav refuses these, and miniaudio then tries dr_flac and dr_mp3 on the same
        # bytes (a re-review's finds: MP3 frames in the data decoded for hours)
        (_wav_fmt(1, 1, 400_000, 2), "at 400000 Hz"),
        (_wav_fmt(1, 300, 16000, 600), "300 channel(s)"),
        (_wav_fmt(6, 1, 8000, 2), "16-bit A-law"),
        (_wav_fmt(1, 1, 16000, 2) + b"fmt " + struct.pack("<I", 16) + bytes(16), "two fmt chunks"),
        # free-format frames (their length in no header) do not start a count
        ((bytes((0xFF, 0xE3, 0x08, 0xC0)) + bytes(20)) * 10, "no MPEG audio frame"),
        # FLAC behind an ID3 tag (dr_flac skips it), whose block is not STREAMINFO's 34 bytes
        (b"ID3\x03" + bytes(6) + b"fLaC" + bytes(50) + silent_mp3(1), "STREAMINFO block of 34"),
        (
            _flac(16000, 16000)[:5] + b"\x00\x00\x23" + _flac(16000, 16000)[8:] + b"\0",
            "STREAMINFO block of 34",
        ),
    ],
)
def test_a_header_that_does_not_say_a_length_or_lies_is_refused(data: bytes, words: str) -> None:
    with pytest.raises(AudioHeaderError, match=re.escape(words)):
        audio_seconds(data)


def test_clips_are_refused_before_anything_decodes_them() -> None:
    at_most = np.zeros(int(MAX_SECONDS) * 8000, np.int16)  # (8 kHz: 9.6 MB for ten minutes)
    check_medium(wav_bytes(at_most, rate=8000), "ten.wav", audio=True)  # at the limit: read
    longer = np.zeros(int(MAX_SECONDS) * 8000 + 8000, np.int16)
    with pytest.raises(MediaError, match="at most 600 s of audio"):
        check_medium(wav_bytes(longer, rate=8000), "long.wav", audio=True)
    # a header that says more than the file holds: refused, not allocated
    lying = bytearray(wav_bytes(tone(440)))
    lying[40:44] = struct.pack("<I", 2_000_000_000)
    with pytest.raises(MediaError, match=r"lie\.wav could not be read as WAV audio: truncated"):
        check_medium(bytes(lying), "lie.wav", audio=True)
    # The length is the data's frames at the sample rate, whatever the header says of its
    # bytes a second (libmtmd reads the frames: a first version read the byte rate, and 1 MB
    # said to be 2 us at 1 Hz made libmtmd allocate 64 GB and abort the server).
    lies = _wav_fmt(1, 1, 8000, 1, bits=8, byte_rate=0xFFFFFFFF, data=bytes(1_000_000))
    assert audio_seconds(lies) == 125.0
    with pytest.raises(MediaError, match=r"at 1 Hz, in frames of 1 bytes: not read here"):
        check_medium(_wav_fmt(1, 1, 1, 1, bits=8, byte_rate=2**32 - 1, data=bytes(1000)),
                     "lies.wav", audio=True)  # fmt: skip
    # An MP3 is bounded by every frame header in its bytes, at the first frame's rate, as
    # minimp3 finds frames anywhere and dr_mp3 gives them all at its first frame's rate
    # (a re-review's finds, each decoded for hours by a first version's count):
    l3 = b"\xff\xf3\x14\xc0" + bytes(20)  # MPEG-2 layer III, 24 kHz: 576 samples
    hidden = (b"\xff\xe7\xe8\xc0" + l3 * 63 + bytes(20)) * 400  # (inside layer I "frames")
    assert audio_seconds(hidden) > MAX_SECONDS
    eight_first = (b"\xff\xe3\x18\xc0" + bytes(68)) * 11 + (b"\xff\xfb\x14\xc0" + bytes(92)) * 2000
    assert audio_seconds(eight_first) == (11 * 576 + 2000 * 1152) / 8000
    # a Xing tag where dr_mp3 reads one: after the side information of the stream's start
    before = b"\xff\xf1\x00\xc0" + bytes(9) + b"Xing\0\0\0\x01" + (100_000).to_bytes(4, "big")
    with pytest.raises(MediaError, match="is more than 600 s long"):
        check_medium(before + bytes(11) + l3 * 20, "xing.mp3", audio=True)
    # ... or in the frame after one that gives no samples (its main data said to begin in
    # a reservoir it has not got): dr_mp3 reads the tag where its first samples came from
    # (a third review's find: 528 bytes decoded to 1,830 s)
    kind = b"\xff\xf3\x24\xc0"  # MPEG-2 layer III, 16 kbit/s, 24 kHz, mono: 48 bytes
    empty = kind + b"\xff" + bytes(43)
    tagged = kind + bytes(9) + b"Xing\0\0\0\x01" + (75_000).to_bytes(4, "big") + bytes(23)
    assert audio_seconds(empty + tagged + (kind + bytes(44)) * 9) == 75_000 * 1152 / 24000
    # (text in trailing ID3v1 tags is no tag of dr_mp3's)
    id3v1 = b"TAG" + b"Info\x01\x01\x01\x01\x7f\x7f\x7f\x7f" + bytes(113)
    assert audio_seconds(silent_mp3(40) + id3v1) == audio_seconds(silent_mp3(40))
    # an MP3 whose Xing header says 500,000 frames: decoders size their output by it
    first = bytearray(silent_mp3(1))
    first[21:33] = b"Xing" + (1).to_bytes(4, "big") + (500_000).to_bytes(4, "big")
    with pytest.raises(MediaError, match="is more than 600 s long"):
        check_medium(bytes(first) + silent_mp3(40), "xing.mp3", audio=True)
    with pytest.raises(MediaError, match="holds no audio"):
        check_medium(_wav_fmt(1, 1, 16000, 2, data=b""), "none.wav", audio=True)
    with pytest.raises(MediaError, match="is Ogg audio: not read here"):
        check_medium(b"OggS" + bytes(64), "a.ogg", audio=True)
    with pytest.raises(MediaError, match="reads images only"):
        check_medium(wav_bytes(tone(440)), "a.wav")
    with pytest.raises(MediaError, match="is an image, and the projector reads audio only"):
        check_medium(PNG_8, "a.png", vision=False, audio=True)
    with pytest.raises(MediaError, match=r"not an image or audio of a format read here \(PNG"):
        check_medium(b"hello there", "a.txt", audio=True)


# -- the projector ----------------------------------------------------------------------


def test_the_audio_projector_turns_a_clip_into_embeddings(media: dict[str, Path]) -> None:
    from specgguf.llama.backend import LlamaModel
    from specgguf.llama.media import Projector

    with LlamaModel(media["target"]) as model, Projector(media["mmproj"], model, n_threads=1) as p:
        assert p.audio and not p.vision
        (chunk,) = p.chunks(media["a440"].read_bytes(), "a440.wav")
        assert chunk.embd is not None and chunk.embd.shape == (75, N_EMBD)  # a 30 s chunk
        (again,) = p.chunks(media["a440"].read_bytes(), "a440.wav")
        (other,) = p.chunks(media["a880"].read_bytes(), "a880.wav")
        assert again.embd is not None and other.embd is not None
        assert np.array_equal(chunk.embd, again.embd)  # deterministic
        assert not np.allclose(chunk.embd, other.embd)  # and the clip matters
        # 35 s: two chunks of 30 s; an MP3 is read too
        assert [c.embd.shape for c in p.chunks(media["long"].read_bytes(), "long.wav")
                if c.embd is not None] == [(75, N_EMBD)] * 2  # fmt: skip
        (mp3,) = p.chunks(media["mp3"].read_bytes(), "quiet.mp3")
        assert mp3.embd is not None and mp3.embd.shape == (75, N_EMBD)
        # an encoding other than those whose length the header says (the WAV format tag
        # 0x1234), refused before libmtmd reads it
        strange = bytearray(media["a440"].read_bytes())
        strange[20:22] = struct.pack("<H", 0x1234)
        with pytest.raises(MediaError, match=r"strange\.wav could not be read as WAV audio"):
            p.chunks(bytes(strange), "strange.wav")
        # a server that stops ends a long clip's encoding at its next chunk of 30 s
        asked: list[int] = []

        def stop() -> bool:
            asked.append(1)
            return len(asked) > 1

        with pytest.raises(BackendError, match=r"the encoding of long\.wav was stopped"):
            p.chunks(media["long"].read_bytes(), "long.wav", stop=stop)
        assert len(asked) == 2  # (asked before each chunk: the second is not encoded)
        # each chunk in a turn of its own (the server's, between two steps of the others):
        # the stop asked inside it, the chunk encoded before it ends
        log: list[str] = []

        @contextlib.contextmanager
        def turn() -> Iterator[None]:
            log.append("in")
            yield
            log.append("out")

        def stop_logged() -> bool:
            log.append("stop?")
            return False

        long = p.chunks(media["long"].read_bytes(), "long.wav", stop=stop_logged, turn=turn)
        assert sum(c.embd is not None for c in long) == 2
        assert log == ["in", "stop?", "out"] * len(long)
        with pytest.raises(
            MediaError, match=r"a\.png is an image, and the projector reads audio only"
        ):
            p.chunks(media["png"].read_bytes(), "a.png")


# -- run --audio against llama-mtmd-cli -------------------------------------------------


def _run(media: dict[str, Path], *args: str, clip: str = "a440", n: int = 16) -> dict:
    res = run_cli("run", "-m", str(media["target"]), "--mmproj", str(media["mmproj"]),
                  "--audio", str(media[clip]), "--temp", "0", "-n", str(n), "--ignore-eos",
                  "-t", "1", "--json", *args, PROMPT)  # fmt: skip
    assert res.returncode == 0, res.stderr.decode()
    return json.loads(res.stdout)


def test_run_with_audio_generates_what_llama_mtmd_cli_does(
    media: dict[str, Path], tools: Path
) -> None:
    from specgguf.llama.backend import LlamaModel

    for clip in ("a440", "mp3"):
        oracle = mtmd_cli(tools, "-m", str(media["target"]), "--mmproj", str(media["mmproj"]),
                          "--audio", str(media[clip]), "-p", PROMPT, "--temp", "0", "-n", "16",
                          "-t", "1", "-c", "512", "--ignore-eos")  # fmt: skip
        ours = _run(media, "--drafter", "none", clip=clip)
        assert ours["audio"] == [str(media[clip])] and ours["images"] == []
        with LlamaModel(media["target"], vocab_only=True) as vocab:
            text = vocab.detokenize(ours["tokens"])
        assert len(ours["tokens"]) == 16
        # (llama-mtmd-cli prints a newline before the generated text and after it)
        assert oracle == text.strip(b"\n"), (clip, oracle, text)
    # the clip is heard: another tone gives another output
    assert _run(media, "--drafter", "none", clip="a880")["tokens"] != _run(media)["tokens"]


@pytest.mark.parametrize("drafter", ["ngram", "suffix", "model", "auto"])
def test_every_drafter_gives_the_targets_own_output_after_a_clip(
    media: dict[str, Path], drafter: str
) -> None:
    alone = _run(media, "--drafter", "none", n=48)
    draft = ["-md", str(media["draft"])] if drafter in ("model", "auto") else ["--no-draft"]
    got = _run(media, "--drafter", drafter, "--draft", "4", *draft, n=48)
    assert got["tokens"] == alone["tokens"], drafter
    assert drafter == "auto" or got["stats"]["drafted"] > 0, drafter


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--mmproj", "{mmproj}", "--audio", "{missing}"], "No such file"),
        (["--mmproj", "{mmproj}", "--audio", "{cut}"], "truncated"),
        (["--mmproj", "{mmproj}", "--audio", "{ogg}"], "is Ogg audio: not read here"),
        (["--mmproj", "{mmproj}", "--image", "{png}"], "reads audio only"),
        (["--mmproj", "{mmproj-image}", "--audio", "{a440}"], "reads images only"),
        (["--audio", "{a440}"], "--audio {a440}: reading audio needs the target's projector"),
        (["--mmproj", "{mmproj}", "--audio", "{a440}", "--audio", "{a880}", "one <__media__>"],
         "1 <__media__> marker(s) for 2 --image/--audio"),
    ],
)  # fmt: skip
def test_bad_audio_exits_2_with_one_line(
    media: dict[str, Path], tmp_path: Path, args: list[str], words: str
) -> None:
    (tmp_path / "cut.wav").write_bytes(media["a440"].read_bytes()[:1000])
    (tmp_path / "a.ogg").write_bytes(b"OggS" + bytes(100))
    paths = {**{k: str(v) for k, v in media.items()}, "missing": str(tmp_path / "no.wav"),
             "cut": str(tmp_path / "cut.wav"), "ogg": str(tmp_path / "a.ogg")}  # fmt: skip
    filled = [a.format(**paths) for a in args]
    prompt = [] if filled[-1].startswith("one") else [PROMPT]
    res = run_cli("run", "-m", str(media["target"]), "-n", "4", "--drafter", "none", *filled,
                  *prompt)  # fmt: skip
    err = res.stderr.decode()
    assert res.returncode == 2, err
    assert words.format(**paths) in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_info_describes_an_audio_projector(media: dict[str, Path]) -> None:
    res = run_cli("info", str(media["mmproj"]))
    out = res.stdout.decode()
    assert res.returncode == 0, res.stderr.decode()
    assert "ultravox" in out and "audio encoder" in out and "16 mel bands, 1 blocks" in out
    assert "vision tower" not in out
    said = json.loads(run_cli("info", "--json", str(media["mmproj"])).stdout)["projector"]
    assert said["audio"] is True and said["vision"] is False and said["projection_dim"] == N_EMBD


# -- the server's input_audio parts -------------------------------------------------------


@pytest.fixture(scope="module")
def server(media: dict[str, Path]) -> Iterator[ServerProcess]:
    with ServerProcess("-m", str(media["target"]), "--mmproj", str(media["mmproj"]),
                       *SPEC) as s:  # fmt: skip
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def clip(path: Path, fmt: str = "wav") -> dict[str, Any]:
    data = base64.b64encode(path.read_bytes()).decode()
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def run_text(media: dict[str, Path], prompt: str, *clips: str, n: int = 48) -> str:
    """What `specgguf run` generates with the same files, settings and clips."""
    args = [a for name in clips for a in ("--audio", str(media[name]))]
    res = run_cli("run", "-m", str(media["target"]), "--mmproj", str(media["mmproj"]),
                  *SPEC, *args, "--temp", "0", "-n", str(n), "--ignore-eos", "--json",
                  prompt)  # fmt: skip
    assert res.returncode == 0, res.stderr.decode()
    return str(json.loads(res.stdout)["text"])


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], *, stream: bool = False) -> Any:
    """The answer's text and its timings (streamed: the text put together)."""
    greedy: dict[str, Any] = {"temperature": 0, "max_tokens": 48,
                              "extra_body": {"ignore_eos": True}}  # fmt: skip
    if not stream:
        r = client.chat.completions.create(model="tiny", messages=messages,
                                           **greedy)  # type: ignore[arg-type]  # fmt: skip
        return r.choices[0].message.content, r.model_extra["timings"]  # type: ignore[index]
    chunks = client.chat.completions.create(model="tiny", messages=messages, stream=True,
                                            **greedy)  # type: ignore[arg-type]  # fmt: skip
    pieces, timings = [], None
    for c in chunks:
        if c.choices and c.choices[0].delta.content:
            pieces.append(c.choices[0].delta.content)
        timings = (c.model_extra or {}).get("timings") or timings
    return "".join(pieces), timings


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_input_audio_part_generates_what_run_does_with_the_clip(
    client: openai.OpenAI, media: dict[str, Path], stream: bool
) -> None:
    got, timings = chat(client, [{"role": "user", "content": [clip(media["a440"]),
                                                              text("Describe")]}],
                        stream=stream)  # fmt: skip
    assert got == run_text(media, f"{MARKER}\nDescribe", "a440")
    assert timings["predicted_n"] == 48 and timings["draft_n"] > 0  # drafting was on
    # two clips, in their order; an MP3 sent as mp3
    parts = [text("Compare"), clip(media["a880"]), clip(media["mp3"], "mp3")]
    got, _ = chat(client, [{"role": "user", "content": parts}], stream=stream)
    assert got == run_text(media, f"Compare\n{MARKER}\n{MARKER}", "a880", "mp3")


def test_a_clip_in_an_earlier_turn_is_kept_and_its_prompt_reused(
    client: openai.OpenAI,
    media: dict[str, Path],
) -> None:
    first = [{"role": "user", "content": [clip(media["a440"]), text("What is it?")]}]
    answer, t1 = chat(client, first)
    later = [*first, {"role": "assistant", "content": answer},
             {"role": "user", "content": "And louder?"}]  # fmt: skip
    _, t2 = chat(client, later)
    # The first turn, its 75 rows of audio included, is read again from the cache.
    assert t2["cache_n"] >= t1["prompt_n"] + t1["cache_n"] - 1 > 75, (t1, t2)


def test_a_client_can_see_that_the_server_reads_audio(server: ServerProcess) -> None:
    root = server.base_url.removesuffix("/v1")
    said = httpx.get(f"{root}/props", timeout=10).json()["modalities"]
    assert said == {"vision": False, "audio": True}
    card = httpx.get(f"{server.base_url}/models", timeout=10).json()["data"][0]
    assert "multimodal" in card["capabilities"]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


BAD: list[tuple[str, Any, str, str]] = [
    # (what, the part, the param named, words of the message)
    ("no input_audio", {"type": "input_audio"}, "messages.0.content.0.input_audio", "needs its"),
    # (reviewed: each of these was "messages.0.content: Input should be a valid string (and
    # 1 more)", pydantic's two errors of the content's union)
    ("input_audio a string", {"type": "input_audio", "input_audio": "AAAA"},
     "messages.0.content.0.input_audio", "an object with the clip"),
    ("no format", {"type": "input_audio", "input_audio": {"data": "AAAA"}},
     "messages.0.content.0.input_audio.format", "a string: one of wav, mp3, flac"),
    ("a format not a string", {"type": "input_audio", "input_audio": {"data": "AAAA",
                                                                      "format": 123}},
     "messages.0.content.0.input_audio.format", "a string"),
    ("no data", {"type": "input_audio", "input_audio": {"format": "wav"}},
     "messages.0.content.0.input_audio.data", "the clip in base64, a string"),
    ("image_url {}", {"type": "image_url", "image_url": {}},
     "messages.0.content.0.image_url.url", "an image_url part's url, a string"),
    ("another format", {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "ogg"}},
     "messages.0.content.0.input_audio.format", "'ogg' is not read: one of wav, mp3, flac"),
    ("not base64", {"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}},
     "messages.0.content.0.input_audio.data", "not valid base64"),
    ("empty", {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
     "messages.0.content.0.input_audio.data", "the audio is empty"),
    ("truncated", {"type": "input_audio", "input_audio": {
        "data": _b64(wav_bytes(tone(440))[:500]), "format": "wav"}},
     "messages.0.content.0", "truncated"),
    ("Ogg", {"type": "input_audio", "input_audio": {"data": _b64(b"OggS" + bytes(64)),
                                                    "format": "wav"}},
     "messages.0.content.0", "Ogg audio: not read here"),
    ("an image", {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                            + _b64(PNG_8)}},
     "messages.0.content.0", "reads audio only"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "part", "param", "words"), BAD, ids=[b[0] for b in BAD])
def test_bad_audio_gets_400_naming_the_part(
    server: ServerProcess, what: str, part: Any, param: str, words: str
) -> None:
    body = {"messages": [{"role": "user", "content": [part, text("Describe")]}]}
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_audio_outside_user_messages_gets_400(
    server: ServerProcess, media: dict[str, Path]
) -> None:
    body = {"messages": [{"role": "system", "content": [clip(media["a440"])]},
                         {"role": "user", "content": "hi"}]}  # fmt: skip
    r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (
        err["param"] == "messages.0.content.0" and "audio clips are read in user" in err["message"]
    ), err
