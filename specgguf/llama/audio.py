"""Audio clips read before anything decodes them: their format and length from their
headers, for the formats llama.cpp's libmtmd decodes (WAV, MP3 and FLAC, with miniaudio:
``tools/mtmd/mtmd-helper.cpp``).

libmtmd decodes a clip whole into 16 kHz float32 samples (64 kB a second) and computes its
mel spectrogram before its first chunk is encoded, and it sizes the samples by what the
file says of its length. So a clip's length is checked here first, against
:data:`MAX_SECONDS`: a 64 MB file of 8 kbit/s MP3 would otherwise decode to 4 GB, and a WAV
header may say any length.
"""

from __future__ import annotations

import struct

__all__ = ["AUDIO_FORMATS", "MAX_SECONDS", "AudioHeaderError", "audio_format", "audio_seconds"]

#: The longest clip read (seconds): ten minutes decode to 38 MB of samples.
MAX_SECONDS = 600.0

#: The audio formats read (libmtmd's helper decodes these; Ogg and others it does not).
AUDIO_FORMATS = ("WAV", "MP3", "FLAC")


class AudioHeaderError(ValueError):
    """A clip whose header does not say its length, or says one it cannot have."""


def audio_format(data: bytes) -> str | None:
    """The audio format of ``data`` by its first bytes: one of :data:`AUDIO_FORMATS`,
    ``Ogg``, or None for anything else (libmtmd's own test: an ID3 tag or an MPEG sync
    word is MP3)."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "WAV"
    if data[:4] == b"fLaC":
        return "FLAC"
    if data[:4] == b"OggS":
        return "Ogg"
    if data[:3] == b"ID3" or (len(data) >= 2 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "MP3"
    return None


def audio_seconds(data: bytes, limit: float = MAX_SECONDS) -> float:
    """A clip's length in seconds by its header (WAV, FLAC) or its frames' headers (MP3,
    counted until they pass ``limit``: the length returned is then above ``limit``).

    Raises:
        AudioHeaderError: not one of :data:`AUDIO_FORMATS`, or a header that is truncated,
            damaged or does not say the clip's length.
    """
    kind = audio_format(data)
    if kind == "WAV":
        return _wav_seconds(data)
    if kind == "FLAC":
        return _flac_seconds(data)
    if kind == "MP3":
        return _mp3_seconds(data, limit)
    raise AudioHeaderError(f"not audio of a format read here ({', '.join(AUDIO_FORMATS)})")


def _wav_seconds(data: bytes) -> float:
    """The length of a RIFF WAVE file: its ``data`` chunk's bytes over the ``fmt ``
    chunk's bytes a second (so for compressed encodings too)."""
    at, rate = 12, 0
    while at + 8 <= len(data):
        tag, size = data[at : at + 4], int.from_bytes(data[at + 4 : at + 8], "little")
        body = at + 8
        if tag == b"fmt ":
            if size < 16 or body + 16 > len(data):
                raise AudioHeaderError("its fmt chunk is truncated")
            channels, sample_rate, rate = (
                int(v) for v in struct.unpack("<HII", data[body + 2 : body + 12])
            )
            if channels == 0 or sample_rate == 0 or rate == 0:
                raise AudioHeaderError(f"its fmt chunk says {channels} channel(s) at "
                                       f"{sample_rate} Hz, {rate} bytes a second")  # fmt: skip
        elif tag == b"data":
            if not rate:
                raise AudioHeaderError("its data chunk comes before its fmt chunk")
            if size == 0xFFFFFFFF or body + size > len(data):
                raise AudioHeaderError(f"truncated: its data chunk says {size:,} bytes and "
                                       f"{len(data) - body:,} follow")  # fmt: skip
            return size / rate
        at = body + size + (size & 1)  # (chunks are padded to an even size)
    raise AudioHeaderError("it has no data chunk" if rate else "it has no fmt chunk")


def _flac_seconds(data: bytes) -> float:
    """The length a FLAC file's STREAMINFO block says (its first metadata block)."""
    if len(data) < 8 + 34 or data[4] & 0x7F != 0:
        raise AudioHeaderError("its STREAMINFO block is missing or truncated")
    bits = int.from_bytes(data[8 + 10 : 8 + 18], "big")
    sample_rate = bits >> 44
    total = bits & ((1 << 36) - 1)
    if sample_rate == 0 or total == 0:
        raise AudioHeaderError("its STREAMINFO block does not say the clip's length")
    return total / sample_rate


# MPEG audio frame headers (ISO/IEC 11172-3 and 13818-3): kbit/s by (MPEG-1?, layer) and
# index; sample rates by version; samples a frame by (MPEG-1?, layer).
_BITRATES = {
    (True, 1): (0, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),
    (True, 2): (0, 32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),
    (True, 3): (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    (False, 1): (0, 32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
    (False, 2): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
    (False, 3): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}


def _mp3_frame(header: int) -> tuple[int, int, int] | None:
    """(frame bytes, samples, sample rate) of an MPEG audio frame header; None where it is
    not one (a free-format frame, whose length no header says, included)."""
    if header >> 21 != 0x7FF:
        return None
    version, layer_bits = (header >> 19) & 3, (header >> 17) & 3
    b, r, pad = (header >> 12) & 15, (header >> 10) & 3, (header >> 9) & 1
    if version == 1 or layer_bits == 0 or b in (0, 15) or r == 3:
        return None
    layer, mpeg1 = 4 - layer_bits, version == 3
    kbps, rate = _BITRATES[(mpeg1, layer)][b], _RATES[version][r]
    if layer == 1:
        return (12 * kbps * 1000 // rate + pad) * 4, 384, rate
    samples = 1152 if layer == 2 or mpeg1 else 576
    return samples // 8 * kbps * 1000 // rate + pad, samples, rate


def _mp3_seconds(data: bytes, limit: float) -> float:
    """The length of an MP3 stream, frame by frame after any ID3v2 tag (bytes between
    frames skipped to the next sync word, as decoders resync), until it passes ``limit``."""
    at = 0
    if data[:3] == b"ID3":
        if len(data) < 10:
            raise AudioHeaderError("its ID3 tag is truncated")
        size = 0
        for byte in data[6:10]:  # (a "syncsafe" integer: 7 bits a byte)
            size = size << 7 | (byte & 0x7F)
        at = 10 + size + (10 if data[5] & 0x10 else 0)
    seconds, frames = 0.0, 0
    while at + 4 <= len(data) and seconds <= limit:
        frame = _mp3_frame(int.from_bytes(data[at : at + 4], "big"))
        if frame is None:
            at = data.find(b"\xff", at + 1)
            if at < 0:
                break
            continue
        length, samples, rate = frame
        seconds += samples / rate
        frames += 1
        at += length
    if not frames:
        raise AudioHeaderError("no MPEG audio frame was found in it")
    return seconds
