"""specgguf's JSON caches (:mod:`specgguf.cache`)."""

from __future__ import annotations

import json
from pathlib import Path

from specgguf.cache import CACHE_ENTRIES, read_json_cache, update_json_cache


def test_a_cache_keeps_its_newest_entries(tmp_path: Path) -> None:
    """Every new model file version adds a key; the cache keeps the newest written, and a
    key written again becomes the newest."""
    path = tmp_path / "c.json"
    for i in range(5):
        update_json_cache(path, f"k{i}", {"i": i}, keep=3)
    assert list(read_json_cache(path)) == ["k2", "k3", "k4"]
    update_json_cache(path, "k2", {"i": 22}, keep=3)
    update_json_cache(path, "k5", {"i": 5}, keep=3)
    assert read_json_cache(path) == {"k4": {"i": 4}, "k2": {"i": 22}, "k5": {"i": 5}}


def test_the_default_bound(tmp_path: Path) -> None:
    """Without ``keep``: at most CACHE_ENTRIES entries, the last ones written."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({f"old{i}": i for i in range(CACHE_ENTRIES + 40)}))
    update_json_cache(path, "new", 1)
    data = read_json_cache(path)
    assert len(data) == CACHE_ENTRIES
    assert list(data)[-1] == "new"
    assert "old0" not in data and f"old{CACHE_ENTRIES + 39}" in data
