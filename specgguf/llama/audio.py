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

import re
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


#: WAV encodings read (format tags): PCM, IEEE float, A-law, mu-law, whose frames have a
#: size the header's channels and bits say (compressed ones, whose length only their
#: decoder knows, are refused)
_WAV_ENCODINGS = {1: "PCM", 3: "float", 6: "A-law", 7: "mu-law"}


#: The most RIFF chunks a WAV file may have (a real one has a handful).
_WAV_CHUNKS = 64


def _wav_seconds(data: bytes) -> float:
    """The length of a RIFF WAVE file: its ``data`` chunk's frames (its bytes over a frame's,
    ``channels`` x ``bits`` rounded up to bytes, which the ``fmt `` chunk's frame size must
    be) at its sample rate. Not by the header's bytes a second, which decoders do not read:
    a header could say a clip is as short as it likes. Every chunk is walked: a second
    ``fmt `` chunk (which a decoder may read instead of the first) is refused."""
    at, frame, sample_rate, seconds, chunks = 12, 0, 0, None, 0
    while at + 8 <= len(data):
        chunks += 1
        if chunks > _WAV_CHUNKS:
            raise AudioHeaderError(f"it has more than {_WAV_CHUNKS} chunks")
        tag, size = data[at : at + 4], int.from_bytes(data[at + 4 : at + 8], "little")
        body = at + 8
        if tag == b"fmt ":
            if frame:
                raise AudioHeaderError("it has two fmt chunks")
            if size < 16 or body + 16 > len(data):
                raise AudioHeaderError("its fmt chunk is truncated")
            fields = struct.unpack("<HHIIHH", data[body : body + 16])
            code, channels, sample_rate, _, align, bits = (int(v) for v in fields)
            if code == 0xFFFE and size >= 40 and body + 26 <= len(data):  # (extensible)
                code = int.from_bytes(data[body + 24 : body + 26], "little")
            if code not in _WAV_ENCODINGS:
                raise AudioHeaderError(f"its encoding (format tag 0x{code:04x}) is not read: "
                                       f"{', '.join(_WAV_ENCODINGS.values())}")  # fmt: skip
            frame = channels * -(-bits // 8)
            if channels == 0 or sample_rate == 0 or frame == 0 or align != frame:
                raise AudioHeaderError(
                    f"its fmt chunk says {channels} channel(s) of {bits} bits at "
                    f"{sample_rate} Hz, in frames of {align} bytes"
                )
        elif tag == b"data" and seconds is None:
            if not frame:
                raise AudioHeaderError("its data chunk comes before its fmt chunk")
            if size == 0xFFFFFFFF or body + size > len(data):
                raise AudioHeaderError(f"truncated: its data chunk says {size:,} bytes and "
                                       f"{len(data) - body:,} follow")  # fmt: skip
            seconds = size // frame / sample_rate
        at = body + size + (size & 1)  # (chunks are padded to an even size)
    if seconds is None:
        raise AudioHeaderError("it has no data chunk" if frame else "it has no fmt chunk")
    return seconds


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
    not one.

    Raises:
        AudioHeaderError: a free-format frame (bit rate index 0), whose length no header
            says (a decoder finds it from the next frame's sync word).
    """
    if header >> 21 != 0x7FF:
        return None
    version, layer_bits = (header >> 19) & 3, (header >> 17) & 3
    b, r, pad = (header >> 12) & 15, (header >> 10) & 3, (header >> 9) & 1
    if version == 1 or layer_bits == 0 or b == 15 or r == 3:
        return None
    if b == 0:
        raise AudioHeaderError("a free-format MPEG audio frame is not read")
    layer, mpeg1 = 4 - layer_bits, version == 3
    kbps, rate = _BITRATES[(mpeg1, layer)][b], _RATES[version][r]
    if layer == 1:
        return (12 * kbps * 1000 // rate + pad) * 4, 384, rate
    samples = 1152 if layer == 2 or mpeg1 else 576
    return samples // 8 * kbps * 1000 // rate + pad, samples, rate


#: A frame header's first three bytes as :func:`_mp3_frame` may take them (a sync word, a
#: version and layer that exist, a bit rate index other than 15 and a sample rate index
#: other than 3): the next place to resync at, found without a step a byte.
_SYNC = re.compile(
    b"\xff["
    + re.escape(bytes(v for v in range(0xE0, 0x100) if v >> 3 & 3 != 1 and v >> 1 & 3))
    + b"]["
    + re.escape(bytes(v for v in range(256) if v >> 4 != 15 and v >> 2 & 3 != 3))
    + b"]"
)


def _mp3_header_frames(data: bytes, at: int, length: int) -> int:
    """The frames a Xing/Info or VBRI header in the frame at ``at`` says the stream has
    (decoders size their output by it), 0 where there is none."""
    frame = data[at : at + length]
    for tag, offset in ((b"Xing", 4), (b"Info", 4), (b"VBRI", 14)):
        i = frame.find(tag)
        if i < 0 or i + offset + 4 > len(frame):
            continue
        if tag != b"VBRI":  # flags first: bit 0 says the frame count follows
            if not frame[i + 7] & 1:
                continue
            return int.from_bytes(frame[i + 8 : i + 12], "big")
        return int.from_bytes(frame[i + offset : i + offset + 4], "big")
    return 0


def _mp3_seconds(data: bytes, limit: float) -> float:
    """The length of an MP3 stream, frame by frame after any ID3v2 tag (bytes between
    frames skipped to the next sync word, as decoders resync), until it passes ``limit``;
    or what its first frame's Xing/Info or VBRI header says, where that is longer."""
    at = 0
    if data[:3] == b"ID3":
        if len(data) < 10:
            raise AudioHeaderError("its ID3 tag is truncated")
        size = 0
        for byte in data[6:10]:  # (a "syncsafe" integer: 7 bits a byte)
            size = size << 7 | (byte & 0x7F)
        at = 10 + size + (10 if data[5] & 0x10 else 0)
    seconds, frames, said = 0.0, 0, 0.0
    while at + 4 <= len(data) and seconds <= limit:
        frame = _mp3_frame(int.from_bytes(data[at : at + 4], "big"))
        if frame is None:
            found = _SYNC.search(data, at + 1)
            if found is None:
                break
            at = found.start()
            continue
        length, samples, rate = frame
        if not frames:
            said = _mp3_header_frames(data, at, length) * samples / rate
        seconds += samples / rate
        frames += 1
        at += length
    if not frames:
        raise AudioHeaderError("no MPEG audio frame was found in it")
    return max(seconds, said)
