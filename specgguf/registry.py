"""Model names on the command line: paths to GGUF files (aliases come with models.toml)."""

from __future__ import annotations

from pathlib import Path

from specgguf.errors import ModelNotFoundError


def resolve_model(name: str) -> Path:
    """The GGUF file ``name`` refers to.

    Raises:
        ModelNotFoundError: no such file.
    """
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model file not found: {name}", path=path)
    return path
