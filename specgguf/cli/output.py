"""Writing data to stdout: JSON, Rich tables sized for a terminal or a pipe, and the
number formats the tables share."""

from __future__ import annotations

import json
import sys
from typing import Any


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def stdout_console() -> Any:
    """Rich console for data on stdout: a terminal's width, or wide enough not to wrap
    table cells when stdout is a pipe or file."""
    from rich.console import Console

    from specgguf.errors import OutputClosed

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # a closed reader is the command's OutputClosed (exit 141), as for every other
            # write (Rich would exit 1)
            self.quiet = True
            raise OutputClosed()

    return _Console(highlight=False, width=None if sys.stdout.isatty() else 240)


def stderr_say(quiet: bool = False) -> Any:
    """A function that prints one line on stderr (nothing when ``quiet``)."""

    def say(msg: str) -> None:
        if not quiet:
            print(msg, file=sys.stderr, flush=True)

    return say


#: A target at least this large gets a line before auto mode measures its batch costs
#: (10-20 s on 2 cores for a 1.5B target of 0.9 GiB; a tiny test model takes well under 1 s).
CALIBRATION_SAY_BYTES = 256 << 20


def say_calibration(engine: Any, say: Any, *, deterministic: bool = False) -> None:
    """Say on stderr that auto mode is about to measure what batches cost on this machine,
    when it will (nothing cached for the pair) and the target is large enough for the pause
    to be noticed: without it, stderr that is not a terminal stays silent for seconds to
    minutes."""
    path = engine.target_model.path
    if path.stat().st_size >= CALIBRATION_SAY_BYTES and engine.calibration_needed(deterministic):
        say(
            f"specgguf: measuring what verification batches of {path.name} cost on this "
            "machine, for auto mode (once per pair and machine; seconds to a minute)"
        )


def size(n: int) -> str:
    """Bytes in binary units: 163.6 KiB, 1.04 GiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def count(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit} ({n:,})"
    return f"{n:,}"


def num(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def tok(t: dict[str, Any] | None) -> str:
    return "-" if t is None else f"{t['id']} {t['text']!r}"
