"""The README and docs/ stay true to the code: every relative link resolves (to a file, and
to a heading as GitHub slugs it), and every `specgguf ...` command line in a fenced block
names a real command and only options that command has. The lines are parsed by the real
Click command of the Typer app, without running anything. (The README's Python example runs
in tests/test_layout.py; docs/cli.md equals `--help` in tests/test_readme.py.)"""

from __future__ import annotations

import re
import shlex
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
import typer.core

from specgguf.cli import full_app

from .helpers import ROOT

app = full_app()

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: Command lines that are not meant to parse (shell placeholders and the like), word for
#: word. Each must still occur in the docs (see test_skipped_lines_still_exist).
SKIP: tuple[str, ...] = ()

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`[^`]*`")
SHELL_OPERATORS = set("|&;<>()")


def split_fences(text: str) -> tuple[str, list[str]]:
    """The text outside fenced blocks (fenced lines blanked, so line numbers hold) and the
    lines inside them."""
    prose, fenced, inside = [], [], False
    for line in text.splitlines():
        if FENCE.match(line):
            inside = not inside
            prose.append("")
        elif inside:
            fenced.append(line)
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), fenced


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text as rendered (link and code markup
    dropped), lower case, punctuation other than '-' and '_' removed, spaces as '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a Markdown text's headings (a repeated one gets -1, -2, ...)."""
    prose, _ = split_fences(text)
    seen: Counter[str] = Counter()
    out = set()
    for line in prose.splitlines():
        m = HEADING.match(line)
        if m:
            s = slug(m[2])
            out.add(s if seen[s] == 0 else f"{s}-{seen[s]}")
            seen[s] += 1
    return out


def link_problems(path: Path, text: str | None = None) -> list[str]:
    """Each relative link of a Markdown file that does not resolve, with the reason."""
    text = path.read_text() if text is None else text
    prose, _ = split_fences(text)
    prose = CODE_SPAN.sub("", prose)
    problems = []
    for target in LINK.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        if not file:
            if anchor not in anchors(text):
                problems.append(f"{target}: no heading #{anchor} here")
            continue
        dest = (path.parent / file).resolve()
        rel = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
        if not dest.exists():
            problems.append(f"{target}: no file {rel}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            problems.append(f"{target}: no heading #{anchor} in {rel}")
    return problems


def command_lines(text: str) -> Iterator[str]:
    """The lines of fenced blocks that run specgguf, after an optional `$ ` prompt, with
    lines that end in a backslash joined to the next."""
    _, fenced = split_fences(text)
    joined, buf = [], ""
    for line in fenced:
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        joined.append(buf + line)
        buf = ""
    for line in joined:
        line = line.removeprefix("$ ")
        if line.startswith("specgguf "):
            yield line


def words(line: str) -> list[str]:
    """The words of one shell command line, up to its first pipe, redirection or list
    operator, without its comment."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    out = []
    for word in lex:
        if set(word) <= SHELL_OPERATORS:
            break
        out.append(word)
    return out


def command_problem(line: str) -> str | None:
    """Why the real command line parser would refuse `line`, or None. Nothing runs: the
    line is parsed by the Click command's own option parser (no callbacks, no types)."""
    args = words(line)[1:]
    group = typer.main.get_command(app)
    assert isinstance(group, typer.core.TyperGroup)
    ctx = group.context_class(group, info_name="specgguf")
    try:
        _, rest, _ = group.make_parser(ctx).parse_args(list(args))
    except Exception as err:
        return str(err)
    if not rest:
        return None if args else "no command"
    name, *sub_args = rest
    cmd = group.get_command(ctx, name)
    if cmd is None:
        return f"no command {name!r}"
    sub_ctx = cmd.context_class(cmd, info_name=name, parent=ctx)
    try:
        _, extra, _ = cmd.make_parser(sub_ctx).parse_args(list(sub_args))
    except Exception as err:
        return f"{name}: {err}"
    if extra and not sub_ctx.allow_extra_args:
        return f"{name}: unexpected extra arguments {extra}"
    return None


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path: Path) -> None:
    assert link_problems(path) == []


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_command_lines_parse(path: Path) -> None:
    problems = [
        f"{line}\n    {why}"
        for line in command_lines(path.read_text())
        if line not in SKIP and (why := command_problem(line))
    ]
    assert problems == [], "\n".join(problems)


def test_the_docs_have_command_lines_to_check() -> None:
    # The extraction finds what is there: the README shows every command but one at least.
    readme = {words(line)[1] for line in command_lines((ROOT / "README.md").read_text())}
    assert {"run", "serve", "bench", "pull", "list", "info", "check", "plan"} <= readme
    assert sum(len(list(command_lines(p.read_text()))) for p in DOCS) >= 30


def test_skipped_lines_still_exist() -> None:
    every = {line for p in DOCS for line in command_lines(p.read_text())}
    assert set(SKIP) <= every


def test_the_command_checker_can_fail() -> None:
    good = [
        'specgguf run -m t.gguf -md d.gguf --spec-draft-n-max 8 -ngl all "Hello"',
        "specgguf run -hf org/repo-GGUF:Q8_0 --draft=4 -p 'def f(n):' > out.txt  # a comment",
        "specgguf pull a b c",
        "specgguf --version",
    ]
    for line in good:
        assert command_problem(line) is None, line
    bad = {
        "specgguf run --no-such-flag x": "--no-such-flag",
        "specgguf frobnicate --json": "frobnicate",
        "specgguf info -md d.gguf t.gguf": "No such option",  # another command's option
        "specgguf run -m": "-m",  # an option without its value
        "specgguf check t.gguf d.gguf third.gguf": "extra",
        "specgguf": "no command",
    }
    for line, word in bad.items():
        why = command_problem(line)
        assert why is not None and word in why, (line, why)


def test_continued_lines_are_joined_and_checked() -> None:
    text = '```\n$ specgguf run -m t.gguf \\\n    --no-such-flag 8 "Hello"\nspecgguf: done\n```\n'
    lines = list(command_lines(text))
    assert lines == ['specgguf run -m t.gguf      --no-such-flag 8 "Hello"']
    assert command_problem(lines[0]) is not None


def test_the_link_checker_can_fail() -> None:
    assert slug("Targets bigger than one machine (RPC)") == "targets-bigger-than-one-machine-rpc"
    assert slug("Generate: `specgguf run`") == "generate-specgguf-run"
    assert slug("Exactness and llama.cpp's kernels") == "exactness-and-llamacpps-kernels"
    doc = ROOT / "docs" / "made-up.md"  # not written: links resolve from its folder
    text = (
        "# A heading\n\n[ok](../README.md#exit-codes) [self](#a-heading) [web](https://x.org)\n"
        "[missing](no-such-file.md) [bad anchor](cli.md#no-such-heading) [bad](#nowhere) "
        "`[in code](nowhere.md)`\n```\n[in a fence](nowhere.md)\n```\n"
    )
    problems = link_problems(doc, text)
    assert len(problems) == 3, problems
    assert "no-such-file.md" in problems[0] and "no-such-heading" in problems[1]
    assert "#nowhere" in problems[2]
