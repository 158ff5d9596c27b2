"""The lookup drafters' compiled indexes (``_lookup.c``, built by ``setup.py`` where a C
compiler is found), or None: then :class:`~specgguf.speculative.drafters.NgramDrafter` and
:class:`~specgguf.speculative.drafters.SuffixDrafter` keep their pure-Python indexes, the
tested reference, which give the same drafts more slowly (2-4 us a token each against tens
of nanoseconds). ``SPECGGUF_PURE_PYTHON=1`` asks for the pure-Python ones."""

from __future__ import annotations

import os
from types import ModuleType


def wanted_pure() -> bool:
    """Whether ``SPECGGUF_PURE_PYTHON`` asks for the pure-Python indexes."""
    return os.environ.get("SPECGGUF_PURE_PYTHON", "") not in ("", "0")


def load() -> ModuleType | None:
    """The compiled module, or None where it was not built or is not wanted."""
    if wanted_pure():
        return None
    try:
        from specgguf.speculative.drafters import _lookup
    except ImportError:
        return None
    return _lookup


#: What the drafters made from now on use (tests set it to None for the reference).
lookup: ModuleType | None = load()
