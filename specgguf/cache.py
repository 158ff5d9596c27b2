"""specgguf's own cache folder and the small JSON caches kept in it (the repack-probe
verdicts of :mod:`specgguf.llama.runtime`, the timing calibrations of
:mod:`specgguf.engine.calibration`). Model files live in the Hugging Face cache instead
(:mod:`specgguf.hub.download`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    """specgguf's cache folder: ``$XDG_CACHE_HOME/specgguf`` or ``~/.cache/specgguf``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specgguf"


def read_json_cache(path: Path) -> dict[str, Any]:
    """A JSON object cached in ``path``; empty when missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def update_json_cache(path: Path, key: str, value: Any) -> None:
    """Set ``key`` in the JSON object cached in ``path``, written atomically (a temporary
    file, then a rename); a cache that cannot be written is silently skipped."""
    data = read_json_cache(path)
    data[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
