"""The docs' promises that can drift: docs/cli.md equals `--help`, the worked RPC plan of
docs/rpc.md equals the planner's output. (Links and command lines: tests/test_docs.py.)"""

from __future__ import annotations

import subprocess
import sys

from .helpers import ROOT


def test_usage_section_matches_help() -> None:
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "update-docs-usage"), "--check"],
        capture_output=True, check=False,
    )  # fmt: skip
    assert res.returncode == 0, "docs/cli.md differs from --help: run scripts/update-docs-usage"


def test_worked_rpc_plan_matches_the_planner() -> None:
    """docs/rpc.md's 70B + 8B plan is what `specgguf plan` says on files of those models'
    real tensor tables (scripts/plan-example writes them; no weights)."""
    res = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "plan-example"), "--check"],
        capture_output=True, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr.decode()[-2000:] or "run scripts/plan-example"
