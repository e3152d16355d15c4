"""README.md and docs/*.md: every relative link resolves and every quoted command exists.

Links: `[text](path)`, `[text](path#anchor)`, `[text](#anchor)` and `[name]: path` outside
code; the path must exist relative to the page, and an anchor into a Markdown page must name
one of its headings (GitHub's slugs). Commands, inside code spans and code blocks:
`make <target>` (a Makefile target), `slimserve <subcommand>` and `python -m app.cli
<subcommand>` (registered in app/cli.py's parser); anywhere, `python bench/<script>.py`,
`python scripts/...` and `bash scripts/...` (the file exists). Failures name file and line.
"""

from __future__ import annotations

import argparse
import functools
import glob
import os
import re
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(?!`)((?:(?!\n[ \t]*\n).)+?)(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...

# `make` and `slimserve` count where a shell command starts (a line, or after ; & | ( or a
# `$ ` prompt, past VAR=value words and a path); a command ends at a separator or comment.
START = r"(?:^|[;&|(]|\$ )[ \t]*(?:\w+=\S*[ \t]+)*(?:\S*/)?"
MAKE = re.compile(START + r"make((?:[ \t]+[^\s;&|#`]+)+)", re.M)
CLI = re.compile(START + r"(?:slimserve|python3? -m app\.cli)[ \t]+([a-z][\w-]*)", re.M)
SCRIPT = re.compile(r"(?<![\w-])(?:python3?|bash|sh)[ \t]+((?:bench|scripts)/[\w./-]+)")


@dataclass(frozen=True)
class Span:
    """Text of a page at an offset (so a finding can name its line)."""

    page: str
    offset: int
    text: str


@functools.cache
def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def where(page: str, offset: int) -> tuple[str, int]:
    return os.path.relpath(page, ROOT), read(page).count("\n", 0, offset) + 1


def report(title: str, problems: list[tuple[tuple[str, int], str]]) -> None:
    if problems:
        lines = [f"{path}:{line}: {problem}" for (path, line), problem in sorted(problems)]
        pytest.fail(f"{title}:\n" + "\n".join(lines), pytrace=False)


def split_code(page: str) -> tuple[str, list[Span]]:
    """(the page with code blanked out, the code spans and blocks)."""
    text = read(page)
    code: list[Span] = []
    prose = list(text)

    def blank(start: int, end: int) -> None:
        for i in range(start, end):
            if prose[i] != "\n":
                prose[i] = " "

    for m in FENCE.finditer(text):
        code.append(Span(page, m.start(), m.group(0)))
        blank(m.start(), m.end())
    for m in INLINE_CODE.finditer("".join(prose)):  # a span never crosses a blank line
        code.append(Span(page, m.start(2), m.group(2)))
        blank(m.start(), m.end())
    return "".join(prose), code


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower case, punctuation dropped."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def anchors(path: str) -> frozenset[str]:
    seen: dict[str, int] = {}
    found = set()
    for m in HEADING.finditer(FENCE.sub("", read(path))):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")  # GitHub numbers repeated headings
    return frozenset(found)


def link_problem(page: str, target: str) -> str | None:
    if EXTERNAL.match(target):
        return None
    path, _, anchor = target.partition("#")
    resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
    if not os.path.exists(resolved):
        return f"link to {target!r}: {os.path.relpath(resolved, ROOT)} does not exist"
    if anchor and resolved.endswith(".md") and anchor.lower() not in anchors(resolved):
        return f"link to {target!r}: no heading with anchor #{anchor} in {path or 'this page'}"
    return None


def make_targets() -> set[str]:
    targets = set()
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as f:
        for line in f:
            m = re.match(r"^([A-Za-z0-9_.%-][^:=\s]*(?:[ \t]+[^:=\s]+)*)[ \t]*::?(?!=)", line)
            if m:
                targets.update(m.group(1).split())
    return targets


def cli_subcommands() -> set[str]:
    from app.cli import build_parser

    parser, _ = build_parser([])
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name for action in subparsers for name in action.choices}


def command_problems(span: Span, in_code: bool, targets: set[str], subcommands: set[str]):
    for m in SCRIPT.finditer(span.text):
        path = m.group(1).rstrip(".,;:")
        if not os.path.exists(os.path.join(ROOT, path)):
            yield span.offset + m.start(), f"{m.group(0)!r}: {path} does not exist"
    if not in_code:
        return
    for m in MAKE.finditer(span.text):
        for word in m.group(1).split():
            if not word.startswith("-") and "=" not in word and word not in targets:
                yield span.offset + m.start(), f"'make {word}': no such target in the Makefile"
    for m in CLI.finditer(span.text):
        if m.group(1) not in subcommands:
            yield span.offset + m.start(), f"{m.group(0)!r}: no such subcommand in app/cli.py"


def test_the_pages_are_there():
    names = {os.path.relpath(p, ROOT) for p in PAGES}
    assert {"README.md", "docs/performance.md", "docs/architecture.md"} <= names


def test_relative_links_resolve():
    problems = []
    for page in PAGES:
        prose, _ = split_code(page)
        found = [(m.start(), m.group(1)) for m in LINK.finditer(prose)]
        found += [(m.start(), m.group(1)) for m in REFERENCE.finditer(prose)]
        for offset, target in found:
            problem = link_problem(page, target)
            if problem:
                problems.append((where(page, offset), problem))
    report("broken links", problems)


def test_quoted_commands_exist():
    targets, subcommands = make_targets(), cli_subcommands()
    assert {"serve", "test"} <= targets and "serve" in subcommands
    problems = []
    for page in PAGES:
        prose, code = split_code(page)
        spans = [(s, True) for s in code] + [(Span(page, 0, prose), False)]
        for span, in_code in spans:
            for offset, problem in command_problems(span, in_code, targets, subcommands):
                problems.append((where(page, offset), problem))
    report("commands that do not exist", problems)


@pytest.mark.parametrize(
    "heading, anchor",
    [
        ("On a GPU (one H200, 2026-12-04)", "on-a-gpu-one-h200-2026-12-04"),
        ("Served vs vLLM", "served-vs-vllm"),
        ("CPU MoE (`python bench/moe_cpu.py`)", "cpu-moe-python-benchmoe_cpupy"),
        ("The prefill -> decode hand-off", "the-prefill---decode-hand-off"),
    ],
)
def test_slug_follows_github(heading, anchor):
    assert slug(heading) == anchor
