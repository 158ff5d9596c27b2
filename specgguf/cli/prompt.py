"""Where ``run``'s prompt comes from: the argument, ``-f FILE``, or standard input."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from specgguf.errors import UsageError


def read_prompt(prompt: str | None, file: Path | None, stdin: TextIO | None = None) -> str:
    """The prompt text: the argument, ``-f FILE``, or standard input (``-``, or no
    argument while stdin is not a terminal). Never waits on a terminal.

    Raises:
        UsageError: no prompt given, or two given, an empty (or blank) prompt, or the file
        cannot be read.
    """
    text = _read_prompt(prompt, file, stdin)
    if not text.strip():
        raise UsageError("the prompt is empty: give the text to continue or answer")
    return text


def _read_prompt(prompt: str | None, file: Path | None, stdin: TextIO | None) -> str:
    stdin = stdin or sys.stdin
    if prompt is not None and file is not None:
        raise UsageError("give the prompt as an argument or with -f/--file, not both")
    if file is not None:
        try:
            return file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read the prompt file {file}: {e}") from None
    if prompt == "-" or (prompt is None and not stdin.isatty()):
        return stdin.read()
    if prompt is None:
        raise UsageError("no prompt: give it as an argument, with -f FILE, or on standard input")
    return prompt
