"""The README's promises that can drift: the usage section equals `--help`, the worked
RPC plan equals the planner's output."""

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


def test_worked_rpc_plan_matches_the_planner() -> None:
    """The README's 70B + 8B plan is what `specgguf plan` says on files of those models'
    real tensor tables (scripts/plan-example writes them; no weights)."""
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "plan-example"), "--check"],
        capture_output=True, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr.decode()[-2000:] or "run scripts/plan-example"
