"""Commands that load no model start without the engine's loop, llguidance or the server
(issue 56): the entry point imports only the module of the command it runs, and
``specgguf.engine`` imports its names on first use. Each command runs in a fresh
interpreter, which then lists the heavy modules it imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

#: Modules a command that loads no model never needs: the loop and llama.cpp's context
#: wrapper, the grammar engine, the server and its web stack.
HEAVY = ["specgguf.engine.engine", "specgguf.llama.backend", "llguidance", "fastapi",
         "uvicorn", "specgguf.server"]  # fmt: skip

PROBE = """
import json, sys
from specgguf.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)), file=sys.stderr)
"""


def imported(*args: str) -> list[str]:
    """The modules of :data:`HEAVY` that ``specgguf ARGS`` imported."""
    res = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), *args],
                         capture_output=True, timeout=60, check=False)  # fmt: skip
    return json.loads(res.stderr.decode().strip().splitlines()[-1])


@pytest.mark.parametrize("command", [["--version"], ["--help"], ["list"], ["run", "--help"]])
def test_commands_without_a_model_import_nothing_heavy(command: list[str]) -> None:
    assert imported(*command) == []


def test_info_check_and_plan_import_nothing_heavy(tiny_models: dict[str, Path]) -> None:
    target, draft = str(tiny_models["target"]), str(tiny_models["dflash"])
    assert imported("info", target) == []
    assert imported("check", target, draft) == []
    assert imported("plan", "-m", target) == []


def test_the_probe_sees_a_heavy_import(tiny_models: dict[str, Path]) -> None:
    """(The probe can fail: a command that loads a model imports the loop.)"""
    got = imported("run", "-m", str(tiny_models["target"]), "-n", "1", "hi")
    assert "specgguf.engine.engine" in got and "specgguf.llama.backend" in got
