"""The README's promises that can drift: the usage section equals `--help`."""

from __future__ import annotations

import subprocess
import sys

from .helpers import ROOT


def test_usage_section_matches_help() -> None:
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "update-readme-usage"), "--check"],
        capture_output=True, check=False,
    )  # fmt: skip
    assert res.returncode == 0, "README usage differs from --help: run scripts/update-readme-usage"
