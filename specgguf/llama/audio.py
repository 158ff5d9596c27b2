"""Audio clips read before anything decodes them: their format and length from their
headers, as the decoders llama.cpp's libmtmd calls will read them (miniaudio's dr_wav,
dr_flac and dr_mp3: ``tools/mtmd/mtmd-helper.cpp``, ``vendor/miniaudio/miniaudio.h``).

libmtmd decodes a clip whole into 16 kHz float32 samples (64 kB a second) and computes its
mel spectrogram before its first chunk is encoded, and the decoder sizes the samples by
what the file says of its length. So a clip's length is checked here first, against
:data:`MAX_SECONDS`: a 64 MB file of 8 kbit/s MP3 would otherwise decode to 4 GB, and a
header may say any length.

miniaudio does not follow a file's first bytes: it tries dr_wav, then dr_flac (which skips
any ID3v2 tags first), then dr_mp3 (which finds frames anywhere in the bytes) on every
clip. So a clip is read here in that order too, and each of the first two is taken only
where its header is one that decoder certainly accepts (else another decoder would read
the same bytes): a WAV of a plain encoding and sizes, a FLAC whose metadata blocks all fit
the file. An MP3's length is bounded by every frame header its bytes hold, and by what any
Xing/Info tag in it says.
"""

from __future__ import annotations

import re
import struct

__all__ = ["AUDIO_FORMATS", "MAX_SECONDS", "AudioHeaderError", "audio_format", "audio_seconds"]

#: The longest clip read (seconds): ten minutes decode to 38 MB of samples.
MAX_SECONDS = 600.0

#: The audio formats read (libmtmd's helper decodes these; Ogg and others it does not).
AUDIO_FORMATS = ("WAV", "MP3", "FLAC")


class AudioHeaderError(ValueError):
    """A clip whose header does not say its length, says one it cannot have, or is not one
    the decoders certainly read as it says."""


def _after_id3(data: bytes) -> int:
    """Where the bytes after any ID3v2 tags at the start of ``data`` begin (dr_flac and
    dr_mp3 skip them, as many as there are)."""
    at = 0
    while data[at : at + 3] == b"ID3" and at + 10 <= len(data):
        size = 0
        for byte in data[at + 6 : at + 10]:  # (a "syncsafe" integer: 7 bits a byte)
            size = size << 7 | (byte & 0x7F)
        at += 10 + size + (10 if data[at + 5] & 0x10 else 0)
    return at


def audio_format(data: bytes) -> str | None:
    """The audio format of ``data`` by its first bytes (after any ID3v2 tags): one of
    :data:`AUDIO_FORMATS`, ``Ogg``, or None for anything else (libmtmd's own test: an ID3
    tag or an MPEG sync word is audio)."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "WAV"
    start = _after_id3(data)
    if data[start : start + 4] == b"fLaC":
        return "FLAC"
    if data[start : start + 4] == b"OggS":
        return "Ogg"
    if data[:3] == b"ID3" or (len(data) >= 2 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "MP3"
    return None


def audio_seconds(data: bytes, limit: float = MAX_SECONDS) -> float:
    """A clip's length in seconds as its decoder will read it (see the module; an MP3's
    bound is counted until it passes ``limit``: the length returned is then above it).

    Raises:
        AudioHeaderError: not one of :data:`AUDIO_FORMATS`, or a header that is truncated,
            damaged, does not say the clip's length, or is not one its decoder certainly
            accepts.
    """
    kind = audio_format(data)
    if kind == "WAV":
        return _wav_seconds(data)
    if kind == "FLAC":
        return _flac_seconds(data, _after_id3(data))
    if kind == "MP3":
        return _mp3_seconds(data, limit)
    raise AudioHeaderError(f"not audio of a format read here ({', '.join(AUDIO_FORMATS)})")


#: WAV encodings read (format tags) and their sample sizes (bits): PCM, IEEE float,
#: A-law, mu-law, whose frames have the size the header's channels and bits say.
#: Compressed ones (their length is what their decoder finds) are refused.
_WAV_ENCODINGS = {1: ("PCM", (8, 16, 24, 32)), 3: ("float", (32, 64)),
                  6: ("A-law", (8,)), 7: ("mu-law", (8,))}  # fmt: skip

#: The most RIFF chunks a WAV file may have (a real one has a handful).
_WAV_CHUNKS = 64


def _wav_fmt(data: bytes, body: int, size: int) -> tuple[int, int]:
    """A ``fmt `` chunk's (bytes a frame, sample rate), where it is one dr_wav certainly
    reads as it says: a plain encoding (:data:`_WAV_ENCODINGS`, or the extensible form of
    one with its 22 bytes of extension), 1 to 8 channels, 1,000 to 384,000 Hz, and a frame
    size of its channels times its bits.

    Raises:
        AudioHeaderError: anything else.
    """
    if size not in (16, 18, 40) or body + size > len(data):
        raise AudioHeaderError(f"its fmt chunk of {size} bytes is not one read here (16, 18 "
                               f"or 40 bytes, within the file)")  # fmt: skip
    code, channels, rate, _, align, bits = struct.unpack("<HHIIHH", data[body : body + 16])
    extra = int.from_bytes(data[body + 16 : body + 18], "little") if size > 16 else 0
    if code == 0xFFFE:  # (extensible: the encoding in its subformat)
        valid = int.from_bytes(data[body + 18 : body + 20], "little") if size == 40 else 0
        if size != 40 or extra != 22 or not 0 < valid <= bits:
            raise AudioHeaderError("its extensible fmt chunk is not one read here")
        code = int.from_bytes(data[body + 24 : body + 26], "little")
    elif extra:
        raise AudioHeaderError(f"its fmt chunk says {extra} more bytes: not read here")
    if code not in _WAV_ENCODINGS:
        raise AudioHeaderError(f"its encoding (format tag 0x{code:04x}) is not read: "
                               f"{', '.join(n for n, _ in _WAV_ENCODINGS.values())}")  # fmt: skip
    name, sizes = _WAV_ENCODINGS[code]
    if not (1 <= channels <= 8 and 1000 <= rate <= 384_000 and bits in sizes
            and align == channels * bits // 8):  # fmt: skip
        raise AudioHeaderError(f"its fmt chunk says {channels} channel(s) of {bits}-bit "
                               f"{name} at {rate} Hz, in frames of {align} bytes: not read "
                               f"here")  # fmt: skip
    return align, rate


def _wav_seconds(data: bytes) -> float:
    """The length of a RIFF WAVE file: its ``data`` chunk's frames at its sample rate (not
    by the header's bytes a second, which decoders do not read: a header could say a clip
    is as short as it likes). Every chunk is walked: a second ``fmt `` chunk (which a
    decoder may read instead of the first) is refused."""
    at, frame, rate, seconds, chunks = 12, 0, 0, None, 0
    while at + 8 <= len(data):
        chunks += 1
        if chunks > _WAV_CHUNKS:
            raise AudioHeaderError(f"it has more than {_WAV_CHUNKS} chunks")
        tag, size = data[at : at + 4], int.from_bytes(data[at + 4 : at + 8], "little")
        body = at + 8
        if tag == b"fmt ":
            if frame:
                raise AudioHeaderError("it has two fmt chunks")
            frame, rate = _wav_fmt(data, body, size)
        elif tag == b"data" and seconds is None:
            if not frame:
                raise AudioHeaderError("its data chunk comes before its fmt chunk")
            if size == 0xFFFFFFFF or body + size > len(data):
                raise AudioHeaderError(f"truncated: its data chunk says {size:,} bytes and "
                                       f"{len(data) - body:,} follow")  # fmt: skip
            seconds = size // frame / rate
        at = body + size + (size & 1)  # (chunks are padded to an even size)
    if seconds is None:
        raise AudioHeaderError("it has no data chunk" if frame else "it has no fmt chunk")
    return seconds


def _flac_seconds(data: bytes, start: int) -> float:
    """The length a FLAC stream's STREAMINFO block says (what dr_flac sizes its samples
    by), where every metadata block fits the file (so that dr_flac reads it)."""
    at = start + 4
    if len(data) < at + 4 + 34 or data[at] & 0x7F != 0 or data[at + 1 : at + 4] != b"\0\0\x22":
        raise AudioHeaderError("its first metadata block is not a STREAMINFO block of 34 bytes")
    bits = int.from_bytes(data[at + 4 + 10 : at + 4 + 18], "big")
    rate, total = bits >> 44, bits & ((1 << 36) - 1)
    if rate == 0 or total == 0:
        raise AudioHeaderError("its STREAMINFO block does not say the clip's length")
    while True:
        last, size = data[at] & 0x80, int.from_bytes(data[at + 1 : at + 4], "big")
        at += 4 + size
        if at > len(data) or (not last and at + 4 > len(data)):
            raise AudioHeaderError("a metadata block runs past the end of the file")
        if last:
            return total / rate


# MPEG audio frame headers as minimp3 (dr_mp3) reads them: ma_dr_mp3_hdr_valid and the
# functions after it in miniaudio.h.
_KBPS = {  # by (MPEG-1, layer): kbit/s by bit rate index
    (False, 3): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
    (False, 2): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
    (False, 1): (0, 32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
    (True, 3): (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    (True, 2): (0, 32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),
    (True, 1): (0, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),
}

#: A header minimp3 takes for one: a sync byte, an MPEG-1/2 version of any layer or MPEG-2.5
#: layer III, a bit rate index other than 15, a sample rate index other than 3.
_HEADER = re.compile(
    b"\\xff["
    + re.escape(
        bytes(v for v in range(256) if (v & 0xF0 == 0xF0 or v & 0xFE == 0xE2) and v >> 1 & 3)
    )
    + b"]["
    + re.escape(bytes(v for v in range(256) if v >> 4 != 15 and v >> 2 & 3 != 3))
    + b"]",
    re.DOTALL,
)


def _mp3_header(h: bytes) -> tuple[int, int, int]:
    """(frame bytes without padding, 0 for free format; samples; sample rate) of a header
    :data:`_HEADER` matched, as minimp3 computes them."""
    mpeg1, not25 = bool(h[1] & 0x08), bool(h[1] & 0x10)
    layer = 4 - (h[1] >> 1 & 3)
    rate = (44100, 48000, 32000)[h[2] >> 2 & 3] >> (not mpeg1) >> (not not25)
    samples = 384 if layer == 1 else 1152 >> (not mpeg1 and layer == 3)
    size = samples * _KBPS[(mpeg1, layer)][h[2] >> 4] * 125 // rate
    return (size & ~3 if layer == 1 else size), samples, rate


def _mp3_same(h1: bytes, h2: bytes) -> bool:
    """minimp3's ``hdr_compare``: ``h2`` a header of the same version, layer and rate."""
    return (_HEADER.match(h2) is not None and not (h1[1] ^ h2[1]) & 0xFE
            and not (h1[2] ^ h2[2]) & 0x0C and (h1[2] >> 4 == 0) == (h2[2] >> 4 == 0))  # fmt: skip


def _mp3_first(data: bytes, at: int) -> bool:
    """Whether minimp3 would start decoding at the header at ``at`` (``find_frame``: its
    frame fits, and up to 10 frames after it have headers of the same kind). A free-format
    frame, whose length minimp3 finds otherwise, is not taken to start it: the rates of the
    headers before the one taken are all counted, so later is the safe side."""
    h = data[at : at + 4]
    size = _mp3_header(h)[0]
    if not size:
        return False
    i = 0
    for n in range(10):
        i += size + (h[2] >> 1 & 1) * (4 if h[1] >> 1 & 3 == 3 else 1)
        if at + i + 4 > len(data):
            return n > 0 or at + i == len(data)
        if not _mp3_same(h, data[at + i : at + i + 4]):
            return False
        h = data[at + i : at + i + 4]
        size = _mp3_header(h)[0]
    return True


def _mp3_seconds(data: bytes, limit: float) -> float:
    """An upper bound of what dr_mp3 decodes of ``data``: every header in its bytes as a
    frame of its samples (minimp3 looks for frames anywhere, and may find them inside what
    another reader took for a frame), at the lowest sample rate of the headers up to the
    one it starts at (dr_mp3 gives every frame's samples at the first frame's rate); or
    what a Xing/Info tag anywhere in the stream says, if more. Counted until it passes
    ``limit``.

    The rate is the first frame's that minimp3 starts at: where that frame and the ones of
    its kind after it give no samples, dr_mp3 may take its rate from a later frame, at
    most 6 times lower (48 kHz against 8): what is decoded is then at most 6 times the
    bound."""
    start = _after_id3(data)
    samples, rate, first = 0, 0, None
    for found in _HEADER.finditer(data, start):
        at = found.start()
        _, n, r = _mp3_header(data[at : at + 4])
        samples += n
        if first is None:
            rate = min(rate, r) if rate else r
            if _mp3_first(data, at):
                first = at
        if samples / rate > limit:  # (the count stops here: a few thousand headers at most)
            return samples / rate
    if first is None:
        raise AudioHeaderError("no MPEG audio frame was found in it")
    # dr_mp3 reads a Xing/Info tag after the side information of the bytes of its first
    # decode that gave samples: the stream's start, a frame's, or what follows frames that
    # gave none (a reviewer's find). Any tag in the stream counts, its trailing ID3v1 and
    # APE tags (text) left out.
    end = len(data)
    if data[end - 128 : end - 125] == b"TAG":
        end -= 128
    if data[end - 32 : end - 24] == b"APETAGEX":
        end -= int.from_bytes(data[end - 20 : end - 16], "little") + 32
    said = 0
    for tag in (b"Xing", b"Info"):
        at = data.find(tag, start, end)
        while at >= 0:
            if at + 12 <= len(data) and data[at + 7] & 1:
                said = max(said, int.from_bytes(data[at + 8 : at + 12], "big"))
            at = data.find(tag, at + 4, end)
    return max(samples, said * 1152) / rate
