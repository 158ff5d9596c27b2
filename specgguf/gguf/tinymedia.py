"""Tiny generated media fixtures: multimodal projector ("mmproj") GGUFs that llama.cpp's
libmtmd loads beside a tiny text model (:mod:`specgguf.gguf.tiny`), for images and for
audio (:func:`write_audio_mmproj`), and tiny images and audio clips.

The projector is LLaVA's (``clip.projector_type = "mlp"``, libmtmd's
tools/mtmd/models/llava.cpp): a vision transformer over ``image_size``² RGB images cut into
``patch_size``² patches (a convolution, learned positions, a layer norm), then two linear
layers with a GELU between them into the text model's embedding size. It is the simplest
projector libmtmd knows: a square input of fixed size (any image is resized to it), no
image-marker tokens, ordinary positions (no M-RoPE), one embedding a patch. Its weights are
seeded random numbers: what it "sees" is meaningless, but it is deterministic, and a
different image gives different embeddings, so that llama.cpp's own ``llama-mtmd-cli`` is
an oracle of what a model generates after it.

What llama.cpp requires of such a file, beyond what gguf-py's writer names (tools/mtmd/
clip.cpp): ``clip.vision.image_mean`` and ``image_std`` of 3 values each (read as optional,
but fewer than 3 throw); ``mm.2.weight`` (its size is the projector's output size);
``v.position_embd.weight``; a feed-forward size other than the embedding size (else a
fix-up for old files swaps the feed-forward weights); and the llava graph runs all blocks
but the last (LLaVA reads the second-to-last layer).
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

#: CLIP's normalisation, as LLaVA's projectors carry it.
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


def write_mmproj(
    path: Path,
    n_embd_text: int,
    *,
    image_size: int = 32,
    patch_size: int = 8,
    n_embd: int = 32,
    n_head: int = 2,
    n_ff: int = 64,
    n_layer: int = 2,
    seed: int = 4321,
    dtype: type[np.floating] = np.float32,
    projector: str = "mlp",
    deepstack: tuple[int, ...] = (),
) -> int:
    """Write a tiny LLaVA projector to ``path`` whose output embeddings have
    ``n_embd_text`` values (the text model's ``embedding_length``); returns the embeddings
    (image tokens) an image becomes: (image_size / patch_size)². ``dtype``: the weight
    matrices' type (float32, or float16 as ``mmproj-*-f16.gguf`` files have them; biases
    and norms stay float32): float16 halves a large projector's file.

    ``projector="qwen2vl_merger"``: Qwen2-VL's instead (libmtmd's models/qwen2vl.cpp): two
    patch convolutions summed (a video's two frames), no bias and no learned positions
    (the tower's attention has 2-D rotary positions), and each 2 x 2 patches merged into
    one embedding by two linear layers: (image_size / patch_size / 2)² embeddings, which
    a target with M-RoPE places on a grid of positions. ``"qwen3vl_merger"``: Qwen3-VL's
    (models/qwen3vl.cpp): a patch bias and learned positions besides, the attention's
    Q, K and V in one matrix, and ``deepstack``: the blocks whose output, merged and
    projected, is put beside each embedding (Qwen3-VL's text model adds it to its first
    layers): each row is then ``n_embd_text`` times one more than there are of them.

    Raises:
        ValueError: sizes that do not divide (image by patch, embedding by heads; Qwen2-VL:
            patches by 2, head size by 4), or a feed-forward size equal to the embedding
            size (see the module).
    """
    qwen3 = projector == "qwen3vl_merger"
    qwen = qwen3 or projector == "qwen2vl_merger"
    if (image_size % patch_size or n_embd % n_head or n_ff == n_embd
            or (qwen and (image_size // patch_size % 2 or n_embd // n_head % 4))):  # fmt: skip
        raise ValueError(
            f"need image_size % patch_size == 0, n_embd % n_head == 0 and n_ff != n_embd, "
            f"got {image_size}, {patch_size}, {n_embd}, {n_head}, {n_ff}"
        )
    rng = np.random.default_rng(seed)

    def normal(shape: tuple[int, ...], scale: float) -> npt.NDArray[Any]:
        return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)

    def ones(n: int) -> npt.NDArray[np.float32]:
        return np.ones(n, np.float32)

    def zeros(n: int) -> npt.NDArray[np.float32]:
        return np.zeros(n, np.float32)

    n_patches = (image_size // patch_size) ** 2
    d, ps = n_embd, patch_size
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_name("tiny mmproj")
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32 if dtype == np.float32
                        else gguf.LlamaFileType.MOSTLY_F16))  # fmt: skip
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(projector)  # (gguf-py has no constant for LLaVA's)
    w.add_vision_image_size(image_size)
    w.add_vision_patch_size(patch_size)
    w.add_vision_embedding_length(d)
    w.add_vision_feed_forward_length(n_ff)
    w.add_vision_block_count(n_layer)
    w.add_vision_head_count(n_head)
    w.add_vision_attention_layernorm_eps(1e-5)
    w.add_vision_projection_dim(n_embd_text)
    w.add_vision_image_mean(list(IMAGE_MEAN))
    w.add_vision_image_std(list(IMAGE_STD))
    w.add_vision_use_gelu(True)
    tensors: list[tuple[str, npt.NDArray[Any]]] = [
        # numpy shapes are (out, in): a convolution's (out, in, kh, kw)
        ("v.patch_embd.weight", normal((d, 3, ps, ps), (3 * ps * ps) ** -0.5)),
    ]
    if qwen:
        tensors += [("v.patch_embd.weight.1", normal((d, 3, ps, ps), (3 * ps * ps) ** -0.5))]
    if qwen3:
        positions = normal((n_patches, d), 0.1).astype(np.float32)
        tensors += [("v.patch_embd.bias", zeros(d)), ("v.position_embd.weight", positions)]
    elif not qwen:
        tensors += [
            ("v.patch_embd.bias", zeros(d)),
            ("v.position_embd.weight", normal((n_patches, d), 0.1).astype(np.float32)),
            ("v.pre_ln.weight", ones(d)),
            ("v.pre_ln.bias", zeros(d)),
        ]
    for i in range(n_layer):
        p = f"v.blk.{i}"
        for t in ("attn_out",) if qwen3 else ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensors += [(f"{p}.{t}.weight", normal((d, d), d**-0.5)), (f"{p}.{t}.bias", zeros(d))]
        if qwen3:
            tensors += [(f"{p}.attn_qkv.weight", normal((3 * d, d), d**-0.5)),
                        (f"{p}.attn_qkv.bias", zeros(3 * d))]  # fmt: skip
        if i in deepstack:  # (2 x 2 merged patches: 4 d wide)
            q = f"v.deepstack.{i}"
            tensors += [(f"{q}.norm.weight", ones(4 * d)), (f"{q}.norm.bias", zeros(4 * d)),
                        (f"{q}.fc1.weight", normal((4 * d, 4 * d), (4 * d) ** -0.5)),
                        (f"{q}.fc1.bias", zeros(4 * d)),
                        (f"{q}.fc2.weight", normal((n_embd_text, 4 * d), (4 * d) ** -0.5)),
                        (f"{q}.fc2.bias", zeros(n_embd_text))]  # fmt: skip
        tensors += [
            (f"{p}.ln1.weight", ones(d)),
            (f"{p}.ln1.bias", zeros(d)),
            (f"{p}.ln2.weight", ones(d)),
            (f"{p}.ln2.bias", zeros(d)),
            (f"{p}.ffn_up.weight", normal((n_ff, d), d**-0.5)),
            (f"{p}.ffn_up.bias", zeros(n_ff)),
            (f"{p}.ffn_down.weight", normal((d, n_ff), n_ff**-0.5)),
            (f"{p}.ffn_down.bias", zeros(d)),
        ]
    d_in = 4 * d if qwen else d  # (Qwen2-VL's merger reads 2 x 2 patches side by side)
    tensors += [
        ("mm.0.weight", normal((n_embd_text, d_in), d_in**-0.5)),
        ("mm.0.bias", zeros(n_embd_text)),
        ("mm.2.weight", normal((n_embd_text, n_embd_text), n_embd_text**-0.5)),
        ("mm.2.bias", zeros(n_embd_text)),
    ]
    for name, arr in tensors:
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return n_patches // 4 if qwen else n_patches


def write_audio_mmproj(
    path: Path,
    n_embd_text: int,
    *,
    n_mel: int = 16,
    n_embd: int = 32,
    n_head: int = 2,
    n_ff: int = 64,
    n_layer: int = 1,
    stack: int = 20,
    hidden: int = 64,
    seed: int = 8765,
    dtype: type[np.floating] = np.float32,
) -> int:
    """Write a tiny Ultravox audio projector to ``path`` (``clip.projector_type =
    "ultravox"``, libmtmd's tools/mtmd/models/whisper-enc.cpp) whose output embeddings have
    ``n_embd_text`` values; returns the embeddings a 30-second chunk of audio becomes.

    The encoder is Whisper's: two 1-D convolutions over ``n_mel`` mel bands (the second
    of stride 2: 3,000 frames of a 30 s chunk become 1,500 positions), learned positions,
    ``n_layer`` transformer blocks; then Ultravox's projector stacks ``stack`` positions
    into one row (an RMS norm, a SwiGLU of ``hidden`` values, an RMS norm, a linear layer
    into the text model's size). What llama.cpp requires of it (tools/mtmd/clip.cpp): the
    convolutions' biases shaped (n, 1), no bias on the attention's keys, and a ``stack``
    that divides 1,500 (libmtmd counts a chunk's rows as 3,000 / stack / 2, rounded down,
    and the graph makes 1,500 / stack, rounded up). Seeded random weights, as
    :func:`write_mmproj`'s: another clip gives other embeddings. ``dtype`` as there.

    Raises:
        ValueError: ``stack`` not dividing 1,500, or an embedding size the heads do not
            divide.
    """
    n_pos = 1500
    if n_pos % stack or n_embd % n_head:
        raise ValueError(f"need stack dividing {n_pos} and n_embd % n_head == 0, got "
                         f"{stack}, {n_embd}, {n_head}")  # fmt: skip
    rng = np.random.default_rng(seed)

    def normal(shape: tuple[int, ...], scale: float) -> npt.NDArray[Any]:
        return (rng.standard_normal(shape) * scale).astype(np.float32).astype(dtype)

    def ones(n: int) -> npt.NDArray[np.float32]:
        return np.ones(n, np.float32)

    def zeros(*shape: int) -> npt.NDArray[np.float32]:
        return np.zeros(shape, np.float32)

    d, ds = n_embd, n_embd * stack
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_name("tiny audio mmproj")
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32 if dtype == np.float32
                        else gguf.LlamaFileType.MOSTLY_F16))  # fmt: skip
    w.add_bool("clip.has_audio_encoder", True)
    w.add_clip_projector_type("ultravox")
    w.add_uint32("clip.audio.embedding_length", d)
    w.add_uint32("clip.audio.feed_forward_length", n_ff)
    w.add_uint32("clip.audio.block_count", n_layer)
    w.add_uint32("clip.audio.attention.head_count", n_head)
    w.add_float32("clip.audio.attention.layer_norm_epsilon", 1e-5)
    w.add_uint32("clip.audio.projection_dim", n_embd_text)
    w.add_uint32("clip.audio.num_mel_bins", n_mel)
    w.add_uint32("clip.audio.projector.stack_factor", stack)
    tensors: list[tuple[str, npt.NDArray[Any]]] = [
        # numpy shapes are (out, in): a 1-D convolution's (out, in, kernel)
        ("a.conv1d.1.weight", normal((d, n_mel, 3), (3 * n_mel) ** -0.5)),
        ("a.conv1d.1.bias", zeros(d, 1)),
        ("a.conv1d.2.weight", normal((d, d, 3), (3 * d) ** -0.5)),
        ("a.conv1d.2.bias", zeros(d, 1)),
        ("a.position_embd.weight", normal((n_pos, d), 0.1).astype(np.float32)),
        ("a.post_ln.weight", ones(d)),
        ("a.post_ln.bias", zeros(d)),
    ]
    for i in range(n_layer):
        p = f"a.blk.{i}"
        tensors += [(f"{p}.{t}.weight", normal((d, d), d**-0.5))
                    for t in ("attn_q", "attn_k", "attn_v", "attn_out")]  # fmt: skip
        tensors += [(f"{p}.{t}.bias", zeros(d)) for t in ("attn_q", "attn_v", "attn_out")]
        tensors += [
            (f"{p}.ln1.weight", ones(d)),
            (f"{p}.ln1.bias", zeros(d)),
            (f"{p}.ln2.weight", ones(d)),
            (f"{p}.ln2.bias", zeros(d)),
            (f"{p}.ffn_up.weight", normal((n_ff, d), d**-0.5)),
            (f"{p}.ffn_up.bias", zeros(n_ff)),
            (f"{p}.ffn_down.weight", normal((d, n_ff), n_ff**-0.5)),
            (f"{p}.ffn_down.bias", zeros(d)),
        ]
    tensors += [
        ("mm.a.norm_pre.weight", ones(ds)),
        ("mm.a.mlp.1.weight", normal((2 * hidden, ds), ds**-0.5)),
        ("mm.a.norm_mid.weight", ones(hidden)),
        ("mm.a.mlp.2.weight", normal((n_embd_text, hidden), hidden**-0.5)),
    ]
    for name, arr in tensors:
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return n_pos // stack


def tone(freq: float, seconds: float = 1.0, *, rate: int = 16000) -> npt.NDArray[np.int16]:
    """A sine tone, int16[seconds * rate] samples at a quarter of full scale and more."""
    t = np.arange(int(seconds * rate)) / rate
    return (12000 * np.sin(2 * np.pi * freq * t)).astype(np.int16)


def wav_bytes(samples: npt.NDArray[np.int16], *, rate: int = 16000, channels: int = 1) -> bytes:
    """A PCM WAV file (16-bit) of ``samples`` (int16[n * channels], interleaved)."""
    data = samples.astype("<i2").tobytes()
    fmt = struct.pack("<HHIIHH", 1, channels, rate, rate * 2 * channels, 2 * channels, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def silent_mp3(frames: int) -> bytes:
    """An MP3 stream of ``frames`` silent MPEG-1 Layer III frames at 128 kbit/s and 44.1
    kHz (1,152 samples each: 26 ms): headers and all-zero side information, which decoders
    read as silence. What an encoder would make here, without one."""
    header = bytes((0xFF, 0xFB, 0x90, 0xC4))  # (mono: channel mode 3 in the last byte)
    length = 144 * 128000 // 44100  # 417 bytes, no padding
    return (header + bytes(length - 4)) * frames


def picture(size: int = 32, *, flip: bool = False) -> npt.NDArray[np.uint8]:
    """A deterministic RGB picture, uint8[size, size, 3]: gradients and a white square
    (``flip``: mirrored left to right, another picture)."""
    y, x = np.mgrid[0:size, 0:size]
    top = max(1, size - 1)
    img = np.stack([x * 255 // top, y * 255 // top, (x + y) * 127 // top], -1)
    img[size // 4 : size // 2, size // 4 : size // 2] = 255
    img = img.astype(np.uint8)
    return img[:, ::-1].copy() if flip else img


def png_bytes(rgb: npt.NDArray[np.uint8]) -> bytes:
    """An 8-bit RGB PNG of ``rgb`` (uint8[h, w, 3]), with zlib only."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[r].tobytes() for r in range(h))  # filter 0 on each row

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
            + chunk(b"IEND", b""))  # fmt: skip


def write_png(path: Path, rgb: npt.NDArray[np.uint8]) -> Path:
    """:func:`png_bytes` of ``rgb`` written to ``path``; returns ``path``."""
    path.write_bytes(png_bytes(rgb))
    return path
