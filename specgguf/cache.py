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


#: The most entries a JSON cache keeps: the newest written. Keys name files by path, size
#: and modification time, so every new version of a model file (or of a test's fixture)
#: adds one; without a bound a cache, read and written whole, grows with every run.
CACHE_ENTRIES = 256


def update_json_cache(path: Path, key: str, value: Any, *, keep: int = CACHE_ENTRIES) -> None:
    """Set ``key`` in the JSON object cached in ``path``, written atomically (a temporary
    file, then a rename); a cache that cannot be written is silently skipped. The object
    keeps its newest ``keep`` entries: ``key`` becomes the newest, and the oldest written
    go."""
    data = read_json_cache(path)
    data.pop(key, None)
    data[key] = value
    if len(data) > keep:
        data = dict(list(data.items())[-keep:])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
