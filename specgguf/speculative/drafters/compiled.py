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


#: What the drafters call of the compiled module: a build older than this code (an
#: editable install not built again) lacks some, and is not used.
NAMES = ("NgramTable", "SuffixTable", "MAX_LENGTH", "match_length", "suffix_chain", "suffix_tree")


def usable(module: ModuleType) -> bool:
    """Whether ``module`` has everything the drafters call (:data:`NAMES`)."""
    return all(hasattr(module, name) for name in NAMES)


def load() -> ModuleType | None:
    """The compiled module, or None where it was not built, is older than this code, or is
    not wanted."""
    if wanted_pure():
        return None
    try:
        from specgguf.speculative.drafters import _lookup
    except ImportError:
        return None
    return _lookup if usable(_lookup) else None


#: What the drafters made from now on use (tests set it to None for the reference).
lookup: ModuleType | None = load()
