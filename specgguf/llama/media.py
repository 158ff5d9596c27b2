"""Images and audio for a multimodal target: a projector file (``--mmproj``) read by
llama.cpp's libmtmd through llama-cpp-python's binding (``llama_cpp.mtmd_cpp``), which
turns an image or an audio clip into the embeddings the target reads in its place
(tools/mtmd/mtmd.h).

A prompt with media is text with a marker (:data:`MARKER`, libmtmd's default) where each
medium goes. :meth:`Projector.chunks` turns one medium into what the target reads there:
its embeddings (float32 rows of the target's input width, ``n_embd_inp``: its ``n_embd``,
more with Qwen3-VL's deepstack rows beside them; a clip's in chunks of 30 s, as
Whisper's encoder reads them), and any text the projector puts around them (begin/end
tokens on some models; none on LLaVA's). The embeddings take positions in the target's KV
cache as tokens do (:meth:`specgguf.llama.backend.LlamaContext.prompt` with
:class:`MediaSpan`\\ s); the text of the generation holds a placeholder token at each of
those positions, which the drafters read as text.

A target with M-RoPE (Qwen2-VL and later, Qwen3.5) places an image's rows on positions
of their own, fewer than its rows (:class:`Chunk`'s ``pos``, as libmtmd's helpers place
them); the text after it goes on from the image's last position.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from specgguf.errors import BackendError, ContextOverflowError, MediaError
from specgguf.gguf.projector import check_projector
from specgguf.llama.audio import (
    AUDIO_FORMATS,
    MAX_SECONDS,
    AudioHeaderError,
    audio_format,
    audio_seconds,
)
from specgguf.llama.backend import LlamaModel, MediaSpan, _Native

__all__ = [
    "FORMATS",
    "MARKER",
    "MAX_BYTES",
    "MAX_PIXELS",
    "Chunk",
    "MediaSpan",
    "Projector",
    "check_medium",
    "check_projector",
    "image_size",
]

#: libmtmd's default media marker (``mtmd_default_marker()``): where a medium goes in a
#: prompt's text.
MARKER = "<__media__>"

#: The most pixels an image may have (width times height): libmtmd decodes it whole (3
#: bytes a pixel) before resizing it to the projector's input, so a 20,000 x 20,000
#: image would take 1.2 GB. 33.5 M pixels: 8,192 x 4,096, about 100 MB decoded.
MAX_PIXELS = 1 << 25

#: The most bytes of one medium (a file or a request's data).
MAX_BYTES = 64 << 20

#: A folder with no ffmpeg in it (see :meth:`Projector.chunks`).
_NO_FFMPEG = b"/nonexistent/specgguf-no-ffmpeg"


@dataclasses.dataclass(frozen=True)
class Chunk:
    """What a medium becomes: text token ids (``tokens``), or embeddings (``embd``
    float32[n, n_embd], ``non_causal``). For a target with M-RoPE, ``n_pos`` is the
    positions the embeddings take and ``pos`` each row's four position components where
    the medium starts at position p (int32[4, n], section by section): ``pos[0] + p *
    pos[1]`` (libmtmd's ``mtmd_image_tokens_get_decoder_pos``: some components do not
    move with p)."""

    tokens: list[int] | None = None
    embd: npt.NDArray[np.float32] | None = None
    non_causal: bool = False
    n_pos: int = 0
    pos: tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]] | None = None

    def positions(self, p: int) -> npt.NDArray[np.int32] | None:
        """The rows' positions where the medium starts at position ``p`` (int32[4, n]),
        or None: one a row from ``p``."""
        if self.pos is None:
            return None
        at, moves = self.pos
        return (at + p * moves).astype(np.int32)


def image_format(data: bytes) -> str | None:
    """The image format of ``data`` by its first bytes: one of :data:`FORMATS`, ``audio``
    (:func:`~specgguf.llama.audio.audio_format`'s), or None for anything else."""
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "PNG"
    if data[:3] == b"\xff\xd8\xff":
        return "JPEG"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:2] == b"BM":
        return "BMP"
    if data[:2] in (b"P5", b"P6") and data[2:3].isspace():
        return "PNM"
    if audio_format(data) is not None:
        return "audio"
    return None


#: The image formats read: those whose size their header says, so that it is checked
#: before anything decodes them (libmtmd's stb_image reads more: TGA, PSD, HDR, PIC, whose
#: run-length data can decode to any size, and WebP and video only through ffmpeg).
FORMATS = ("PNG", "JPEG", "GIF", "BMP", "PNM")


def _pnm_fields(data: bytes, n: int) -> list[int] | None:
    """The first ``n`` numbers of a PNM header after its magic (comments skipped)."""
    fields: list[int] = []
    i = 2
    while len(fields) < n and i < min(len(data), 4096):
        c = data[i : i + 1]
        if c == b"#":
            end = data.find(b"\n", i)
            i = len(data) if end < 0 else end + 1
        elif c.isspace():
            i += 1
        elif c.isdigit():
            j = i
            while j < len(data) and data[j : j + 1].isdigit():
                j += 1
            fields.append(int(data[i:j]))
            i = j
        else:
            return None
    return fields if len(fields) == n else None


def image_size(data: bytes) -> tuple[int, int] | None:
    """An image's (width, height) from its header, for the :data:`FORMATS`; None for
    another format or a header that does not say."""
    kind = image_format(data)
    if kind == "PNG" and len(data) >= 24:
        w, h = struct.unpack(">II", data[16:24])
        return w, h
    if kind == "GIF" and len(data) >= 10:
        w, h = struct.unpack("<HH", data[6:10])
        return w, h
    if kind == "BMP" and len(data) >= 26:
        if struct.unpack("<I", data[14:18])[0] == 12:  # an OS/2 header: 16-bit sizes
            w, h = struct.unpack("<HH", data[18:22])
            return w, h
        w, h = struct.unpack("<ii", data[18:26])
        return abs(w), abs(h)
    if kind == "PNM":
        fields = _pnm_fields(data, 2)
        return (fields[0], fields[1]) if fields else None
    if kind == "JPEG":  # the first start-of-frame marker
        i = 2
        while i + 9 < len(data):
            if data[i] != 0xFF:
                return None
            if data[i + 1] == 0xFF:  # a fill byte
                i += 1
                continue
            marker, length = data[i + 1], struct.unpack(">H", data[i + 2 : i + 4])[0]
            if marker in (0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD,
                          0xCE, 0xCF):  # fmt: skip
                h, w = struct.unpack(">HH", data[i + 5 : i + 9])
                return w, h
            i += 2 + length
    return None


def check_medium(data: bytes, name: str, *, vision: bool = True, audio: bool = False) -> None:
    """Refuse a medium before anything decodes it: empty, over :data:`MAX_BYTES`, neither
    an image of the :data:`FORMATS` nor audio of the
    :data:`~specgguf.llama.audio.AUDIO_FORMATS`, an image whose header does not say its
    size or that has more than :data:`MAX_PIXELS`, a clip whose header does not say its
    length or that is longer than :data:`~specgguf.llama.audio.MAX_SECONDS`; an image
    where the projector reads none (``vision``), a clip where it reads no audio
    (``audio``).

    Raises:
        MediaError: naming ``name`` and what is wrong.
    """
    if not data:
        raise MediaError(f"{name} is empty", part=name)
    if len(data) > MAX_BYTES:
        raise MediaError(f"{name} is more than {MAX_BYTES:,} bytes: at most that is read",
                         part=name)  # fmt: skip
    kind = image_format(data)
    if kind == "audio":
        _check_clip(data, name, audio=audio)
        return
    if kind is None:
        read = [*FORMATS, *AUDIO_FORMATS] if audio else list(FORMATS)
        what = "an image or audio" if audio else "an image"
        raise MediaError(f"{name} is not {what} of a format read here ({', '.join(read)})",
                         part=name)  # fmt: skip
    if not vision:
        raise MediaError(f"{name} is an image, and the projector reads audio only", part=name)
    size = image_size(data)
    if size is None:
        raise MediaError(f"{name} could not be read as an image: its {kind} header is "
                         f"truncated or damaged", part=name)  # fmt: skip
    w, h = size
    if w <= 0 or h <= 0:
        raise MediaError(f"{name} says it is {w} x {h} pixels: not an image", part=name)
    if w * h > MAX_PIXELS:
        raise MediaError(f"{name} is {w:,} x {h:,} pixels: at most {MAX_PIXELS:,} "
                         f"pixels are read", part=name)  # fmt: skip


def _check_clip(data: bytes, name: str, *, audio: bool) -> None:
    """:func:`check_medium` for an audio clip."""
    kind = audio_format(data)
    if not audio:
        raise MediaError(f"{name} is audio ({kind}), and the projector reads images only",
                         part=name)  # fmt: skip
    if kind not in AUDIO_FORMATS:
        raise MediaError(f"{name} is {kind} audio: not read here ({', '.join(AUDIO_FORMATS)})",
                         part=name)  # fmt: skip
    try:
        seconds = audio_seconds(data)
    except AudioHeaderError as e:
        raise MediaError(f"{name} could not be read as {kind} audio: {e}", part=name) from None
    if seconds <= 0:
        raise MediaError(f"{name} holds no audio: its header says 0 samples", part=name)
    if seconds > MAX_SECONDS:
        # (an MP3's frames are counted until they pass the limit)
        long = f"more than {MAX_SECONDS:,.0f}" if kind == "MP3" else f"{seconds:,.1f}"
        raise MediaError(f"{name} is {long} s long: at most {MAX_SECONDS:,.0f} s of audio "
                         f"are read", part=name)  # fmt: skip


def _mtmd() -> Any:
    """llama-cpp-python's libmtmd binding.

    Raises:
        BackendError: this build of llama-cpp-python has no libmtmd.
    """
    from specgguf.llama import runtime

    runtime.llama()  # (the log callback exists from here on)
    try:
        from llama_cpp import mtmd_cpp
    except (OSError, FileNotFoundError, RuntimeError) as e:  # (no libmtmd.so in the wheel)
        raise BackendError(
            f"this llama-cpp-python build has no multimodal library (libmtmd): {e}",
            hint="reinstall with scripts/install, which builds it",
        ) from None
    # libmtmd's own log (its encoder's lines) to the same logger as llama.cpp's (-v)
    mtmd_cpp.mtmd_log_set(runtime._log_callback, None)
    mtmd_cpp.mtmd_helper_log_set(runtime._log_callback, None)
    return mtmd_cpp


class Projector(_Native):
    """A multimodal projector file loaded beside its text model (``mtmd_init_from_file``).

    Args:
        path: the projector GGUF (``mmproj-*.gguf``, architecture ``clip``).
        model: the loaded text model it feeds (its input width ``n_embd_inp`` must be the
            projector's output size: libmtmd refuses another).
        n_threads: CPU threads of the image encoder.
        use_gpu: offload the encoder where the build can (``--mmproj-offload``).

    Raises:
        BackendError: no libmtmd in this build, or libmtmd could not load the file (not a
            projector, or one for another model).
    """

    def __init__(self, path: Path, model: LlamaModel, *, n_threads: int = 4,
                 use_gpu: bool = True) -> None:  # fmt: skip
        self.path = Path(path)
        self._ctx: Any = None
        # held while an image is encoded, and by close(): the server encodes a request's
        # images on another thread than the one that closes the engine at shutdown
        self._lock = threading.Lock()
        self._m = m = _mtmd()
        params = m.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = max(1, n_threads)
        params.print_timings = False
        params.warmup = False
        self._ctx = m.mtmd_init_from_file(str(self.path).encode(), model.handle, params)
        if not self._ctx:
            raise BackendError(
                f"llama.cpp could not load the projector {self.path.name} for "
                f"{model.path.name} (not a projector file, or one made for another model)"
            )
        self.vision = bool(m.mtmd_support_vision(self._ctx))
        self.audio = bool(m.mtmd_support_audio(self._ctx))
        #: the width of the rows it makes (the model's input rows: libmtmd's
        #: mtmd_get_output_embd gives ``llama_model_n_embd_inp`` values a row)
        self.n_embd = model.n_embd_inp
        #: seconds spent encoding media so far
        self.encode_seconds = 0.0

    def chunks(
        self,
        data: bytes,
        name: str,
        *,
        fits: tuple[int, int] | None = None,
        stop: Callable[[], bool] | None = None,
        turn: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
    ) -> list[Chunk]:
        """What one medium (its file's bytes: an image or an audio clip) becomes, in order:
        its embeddings (a clip's in chunks of 30 s), and any text the projector puts around
        them. ``fits``: (rows before it, n_ctx): the medium is refused before it is
        encoded where its rows would fill the context. ``stop``: asked before each
        chunk is encoded; True ends the encoding (a server shutting down). ``turn``: each
        chunk is encoded inside a context it makes (the server's turn between two steps of
        the sequences that generate: they go on between a long clip's chunks).

        Raises:
            MediaError: an empty, oversized, unreadable or unsupported medium (``name``
                names it), or an audio clip for a projector without audio.
            ContextOverflowError: with ``fits``, the image does not fit (at least that
                many positions: ``at_least``).
            BackendError: libmtmd failed to encode it, the projector was closed, or
                ``stop`` said to stop.
        """
        check_medium(data, name, vision=self.vision, audio=self.audio)
        with self._lock:
            if self._ctx is None:
                raise BackendError(f"the projector {self.path.name} is closed")
            return self._chunks(data, name, fits, stop, turn or contextlib.nullcontext)

    def _chunks(
        self,
        data: bytes,
        name: str,
        fits: tuple[int, int] | None,
        stop: Callable[[], bool] | None,
        turn: Callable[[], contextlib.AbstractContextManager[object]],
    ) -> list[Chunk]:
        m, ctx = self._m, self._ctx
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        opt = m.mtmd_helper_init_opt_default()
        # (what stb_image cannot decode, libmtmd would hand to ffmpeg from PATH as a video:
        # a folder with no ffmpeg in it keeps it from running any program)
        opt.video_params.ffmpeg_bin_dir = _NO_FFMPEG
        wrapped = m.mtmd_helper_bitmap_init_from_buf_wrapper(ctx, buf, len(data), False, opt)
        bitmap = wrapped.bitmap
        if wrapped.video_ctx:
            m.mtmd_helper_video_free(wrapped.video_ctx)
            if bitmap:
                m.mtmd_bitmap_free(bitmap)
            raise MediaError(f"{name} is a video: not supported", part=name)
        if not bitmap:
            what = "audio" if image_format(data) == "audio" else "an image"
            raise MediaError(f"{name} could not be read as {what} (a corrupt, truncated "
                             f"or unknown format)", part=name)  # fmt: skip
        chunks = m.mtmd_input_chunks_init()
        try:
            # (both refused by check_medium already, by the file's first bytes)
            if m.mtmd_bitmap_is_audio(bitmap) and not self.audio:
                raise MediaError(f"{name} is audio, and {self.path.name} reads no audio",
                                 part=name)  # fmt: skip
            if not m.mtmd_bitmap_is_audio(bitmap) and not self.vision:
                raise MediaError(f"{name} is an image, and {self.path.name} reads no images",
                                 part=name)  # fmt: skip
            text = m.mtmd_input_text(MARKER.encode(), len(MARKER.encode()), False, True)
            bitmaps = (m.mtmd_bitmap_p_ctypes * 1)(bitmap)
            rc = m.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1)
            if rc != 0:
                raise MediaError(f"{name} could not be prepared for the projector "
                                 f"(libmtmd error {rc})", part=name)  # fmt: skip
            items = [m.mtmd_input_chunks_get(chunks, i)
                     for i in range(m.mtmd_input_chunks_size(chunks))]  # fmt: skip
            if fits is not None:  # (counted before any arithmetic is spent on it: KV rows)
                need = fits[0] + sum(int(m.mtmd_input_chunk_get_n_tokens(c)) for c in items)
                if need >= fits[1]:
                    raise ContextOverflowError(need, fits[1], at_least=True)
            out = []
            for c in items:  # (a long clip is many chunks of 30 s: seconds each, real size)
                with turn():
                    if stop is not None and stop():
                        raise BackendError(f"the encoding of {name} was stopped")
                    out.append(self._chunk(c, name))
            return out
        finally:
            m.mtmd_input_chunks_free(chunks)
            m.mtmd_bitmap_free(bitmap)

    def _chunk(self, chunk: Any, name: str) -> Chunk:
        m, ctx = self._m, self._ctx
        kind = m.mtmd_input_chunk_get_type(chunk)
        if kind == m.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ctypes.c_size_t(0)
            ptr = m.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
            return Chunk(tokens=[int(ptr[i]) for i in range(n.value)])
        n_tokens = int(m.mtmd_input_chunk_get_n_tokens(chunk))
        n_pos = int(m.mtmd_input_chunk_get_n_pos(chunk))
        pos = None
        if m.mtmd_decode_use_mrope(ctx):
            pos = self._positions(chunk, kind, n_tokens)
        elif n_pos != n_tokens:
            raise MediaError(f"{self.path.name} places a medium's {n_tokens} rows on "
                             f"{n_pos} positions without M-RoPE: not supported",
                             part=name)  # fmt: skip
        t0 = time.perf_counter()
        if m.mtmd_encode_chunk(ctx, chunk) != 0:
            raise BackendError(f"llama.cpp could not encode {name} with {self.path.name}")
        out = m.mtmd_get_output_embd(ctx)
        embd = np.ctypeslib.as_array(out, shape=(n_tokens, self.n_embd)).copy()
        self.encode_seconds += time.perf_counter() - t0
        return Chunk(embd=embd, non_causal=bool(m.mtmd_decode_use_non_causal(ctx, chunk)),
                     n_pos=n_pos if pos is not None else 0, pos=pos)  # fmt: skip

    def _positions(
        self, chunk: Any, kind: int, n: int
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """An M-RoPE medium's positions (see :class:`Chunk`): an image's from libmtmd's
        ``mtmd_image_tokens_get_decoder_pos``, read where it starts at 0 and at 1 (which
        components move with the start); a clip's one a row in every component, as
        ``mtmd_helper_decode_image_chunk`` places them."""
        m = self._m
        if kind != m.MTMD_INPUT_CHUNK_TYPE_IMAGE:
            rows = np.arange(n, dtype=np.int32)
            return np.tile(rows, (4, 1)), np.ones((4, n), np.int32)
        image = m.mtmd_input_chunk_get_tokens_image(chunk)

        def at(p: int) -> npt.NDArray[np.int32]:
            out = np.empty((4, n), np.int32)
            for i in range(n):
                d = m.mtmd_image_tokens_get_decoder_pos(image, p, i)
                out[:, i] = (d.t, d.y, d.x, d.z)  # (section order: set_position_mrope_2d)
            return out

        zero = at(0)
        return zero, at(1) - zero

    def _is_open(self) -> bool:
        return self._ctx is not None

    def _free(self) -> None:
        with self._lock:  # (after an encode that runs: see __init__)
            if self._ctx is not None:
                self._m.mtmd_free(self._ctx)
                self._ctx = None
