"""A multimodal projector file (``mmproj-*.gguf``, llama.cpp's libmtmd) checked from its
metadata alone, before any weights load: what every command that takes ``--mmproj`` reads
first (the projector itself: :mod:`specgguf.llama.media`)."""

from __future__ import annotations

from pathlib import Path

from specgguf.errors import ModelFileError, ModelNotFoundError


def check_projector(path: Path, n_embd: int | None, *, model: str = "target") -> None:
    """Refuse a projector file before any weights load: missing, not a file, not a GGUF
    projector (architecture ``clip``), or one whose output size is not the text model's
    ``n_embd`` (``clip.vision.projection_dim``, or ``clip.audio.projection_dim`` for an
    audio projector; None: not checked), ``model`` the text model's role in the message.

    Raises:
        ModelNotFoundError: no such file (exit 3).
        ModelFileError: a folder, not a projector, or one for another model (exit 3).
    """
    from specgguf.gguf.metadata import GGUFMetadata

    if not path.exists():
        raise ModelNotFoundError(f"projector file not found: {path}", path=path)
    if not path.is_file():
        raise ModelFileError(f"{path}: a projector is a .gguf file, not a folder", path=path)
    with GGUFMetadata.open(path) as meta:
        arch = meta.get("general.architecture")
        dim = meta.get("clip.vision.projection_dim") or meta.get("clip.audio.projection_dim")
    if arch != "clip":
        raise ModelFileError(f"{path}: not a multimodal projector (its architecture is "
                             f"{arch!r}, a projector's is 'clip')", path=path)  # fmt: skip
    if n_embd is not None and dim is not None and int(dim) != n_embd:
        raise ModelFileError(f"{path}: the projector's rows have {dim} values and the "
                             f"{model}'s {n_embd}: it is for another model", path=path)  # fmt: skip


def projector_info(path: Path) -> dict[str, object]:
    """What a projector file says of itself (``specgguf info``): its projector type
    (``mlp``: LLaVA's; ``ultravox``: an audio one), whether it reads images and audio,
    the vision tower's image and patch sizes, width, blocks and heads, the audio encoder's
    mel bands, width, blocks and heads (``audio_*``), and ``projection_dim``, the size of
    the rows it gives (the target's ``n_embd`` it is made for); None where the file does
    not say.

    Raises:
        GGUFFormatError: not a GGUF file.
    """
    from specgguf.gguf.metadata import GGUFMetadata

    keys = {
        "projector_type": "clip.projector_type",
        "vision": "clip.has_vision_encoder",
        "audio": "clip.has_audio_encoder",
        "image_size": "clip.vision.image_size",
        "patch_size": "clip.vision.patch_size",
        "embedding_length": "clip.vision.embedding_length",
        "block_count": "clip.vision.block_count",
        "head_count": "clip.vision.attention.head_count",
        "audio_mel_bins": "clip.audio.num_mel_bins",
        "audio_embedding_length": "clip.audio.embedding_length",
        "audio_block_count": "clip.audio.block_count",
        "audio_head_count": "clip.audio.attention.head_count",
    }
    with GGUFMetadata.open(path) as meta:
        out = {name: meta.get(key) for name, key in keys.items()}
        out["projection_dim"] = meta.get("clip.vision.projection_dim") or meta.get(
            "clip.audio.projection_dim"
        )
        out["name"] = meta.get("general.name")
    out["vision"], out["audio"] = bool(out["vision"]), bool(out["audio"])
    return out


def projector_reads(path: Path) -> tuple[bool, bool]:
    """Whether a projector file reads images and whether it reads audio, by its metadata
    (``clip.has_vision_encoder``, ``clip.has_audio_encoder``).

    Raises:
        GGUFFormatError: not a GGUF file.
    """
    p = projector_info(path)
    return bool(p["vision"]), bool(p["audio"])
