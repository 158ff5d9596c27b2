"""The package's shape: the library prints nothing and names no command-line flag in its
errors (the command line adds its hints), and the Python example of the README runs."""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specgguf.speculative.tuning import AutoTuning

from .helpers import ROOT

PKG = ROOT / "specgguf"
#: Modules of the faces: they print, and name their flags.
FACES = ("cli",)
#: Child processes that answer their parent on stdout (a line of JSON).
CHILD_PROTOCOL = {"llama/checks.py"}
FLAG = re.compile(r"(?:^|[\s(/'\"`])(--[a-z][a-z-]+|-(?:m|md|d|c|cd|n|b|t|f|ngl|ngld|nr|q|v)\b)")


def library_modules() -> list[Path]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel.split("/")[0] in FACES or rel in ("__main__.py",):
            continue
        out.append(path)
    return out


def _strings(node: ast.AST) -> list[str]:
    return [
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def prints_in(source: str) -> list[int]:
    """Lines of ``source`` that call print() or write to sys.stdout/sys.stderr."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "print":
            lines.append(node.lineno)
        if isinstance(f, ast.Attribute) and f.attr in ("write", "flush"):
            s = f.value
            if (isinstance(s, ast.Attribute) and s.attr in ("stderr", "stdout")
                    and isinstance(s.value, ast.Name) and s.value.id == "sys"):  # fmt: skip
                lines.append(node.lineno)
    return lines


def test_the_library_never_prints() -> None:
    assert prints_in("import sys\nprint(1)\nsys.stderr.write('x')\nlog.warning('y')") == [2, 3]
    offenders = [
        f"{path.relative_to(PKG)}:{line}"
        for path in library_modules()
        if path.relative_to(PKG).as_posix() not in CHILD_PROTOCOL
        for line in prints_in(path.read_text())
    ]
    assert offenders == []


def test_library_errors_name_no_command_line_flag() -> None:
    offenders = []
    for path in library_modules():
        rel = path.relative_to(PKG).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                for text in _strings(node.exc):
                    if FLAG.search(text):
                        offenders.append(f"{rel}:{node.lineno}: {text!r}")
    assert offenders == []


def test_the_flag_pattern_finds_flags() -> None:
    # The check above can fail: these messages would be caught.
    for text in ("raise -c/--ctx-size", "give one with -md", "use --force", "(-ngl)"):
        assert FLAG.search(text), text
    for text in ("top-k", "n-gram", "1.5 tokens", "-1: all", "Qwen2.5-Coder"):
        assert not FLAG.search(text), text


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- python-example -->")[1].split("<!-- /python-example -->")[0]
    return block.split("```python\n")[1].split("```")[0]


def test_readme_python_example_runs(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    code = readme_example()
    # The example names the default pair's files; run it on the tiny pair.
    code, n = re.subn(r'^TARGET = ".*"$', f'TARGET = "{tiny_models["target"]}"', code, flags=re.M)
    code, m = re.subn(
        r'^DRAFT = ".*"$', f'DRAFT = "{tiny_models["draft-partial"]}"', code, flags=re.M
    )
    assert n == m == 1, "the README example should set TARGET and DRAFT on lines of their own"
    script = tmp_path / "example.py"
    script.write_text(code)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, check=False)  # fmt: skip
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    # The last line is the statistics the example prints: tokens and acceptance.
    stats = re.fullmatch(r"(\d+) tokens, ([\d.]+) tokens/s, acceptance ([\d.]+)%", lines[-1])
    assert stats is not None, res.stdout
    assert 1 <= int(stats[1]) <= 32 and "".join(lines[:-1]).strip()


@pytest.mark.parametrize("name", ["Engine", "EngineConfig", "GenerationParams", "SamplerParams"])
def test_public_names_are_exported(name: str) -> None:
    import specgguf

    assert name in specgguf.__all__
    assert getattr(specgguf, name).__name__ == name


# --- auto mode's tuning: one documented place --------------------------------------


def test_every_tuning_number_is_a_documented_field() -> None:
    """Each field of AutoTuning has a comment above it that says where its value came
    from (a measurement, or "no measurement recorded") and what values it has had ("was",
    "only value", or the values compared)."""
    source = (ROOT / "specgguf" / "speculative" / "tuning.py").read_text()
    lines = source.splitlines()
    names = [f.name for f in dataclasses.fields(AutoTuning)]
    assert len(names) >= 30
    for name in names:
        at = next(i for i, ln in enumerate(lines) if re.match(rf"    {name}: ", ln))
        doc = []
        i = at - 1
        while lines[i].startswith("    #:"):  # its own comment, right above it
            doc.insert(0, lines[i])
            i -= 1
        text = " ".join(doc).lower()
        assert text, f"{name} has no comment"
        # (where it came from: a measurement, a reason, none, or the planner simulator's
        # replay of recorded traces, scripts/simulate-planner)
        assert re.search(r"measur|reason|not measured|\(epyc|xeon|\bqwen|simulat", text), name
        assert re.search(r"\bwas\b|only value|tried|never changed|against|unchanged", text), name


#: The numbers the arms and the planner may write as literals: structure, not tuning (a
#: count of 0 or 1, a tree of 2 branches, a lone row and its throw-away row).
STRUCTURAL = {0, 1, 2, -1}


def test_no_tuning_number_is_written_into_the_planner_or_the_arms() -> None:
    code = [ROOT / "specgguf" / "speculative" / "planner.py",
            *sorted((ROOT / "specgguf" / "speculative" / "arms").glob("*.py"))]  # fmt: skip
    found = []
    for path in code:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, int | float)
                and not isinstance(node.value, bool)
                and node.value not in STRUCTURAL
            ):
                found.append((path.name, node.lineno, node.value))
    assert found == []
