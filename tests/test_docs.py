"""README and the pages under docs/ say nothing that is not there: every relative link resolves, and
every command they show in code (`make T`, `fairlane C [S]`, `python -m loadtest X`) exists."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from benchmarks.cli import add_bench_command
from cluster.cli import extend_serve_command
from loadtest.commands import LONG_RUNS
from loadtest.scenarios import SCENARIOS

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.DOTALL)
# A command opens a line of code (after any VAR=value), so program output that mentions it is not one.
COMMAND_START = r"^\s*(?:[A-Z_]+=\S+\s+)*(?:\S*/)?"
MAKE = re.compile(COMMAND_START + r"make ([a-z][\w-]*)", re.MULTILINE)
FAIRLANE = re.compile(COMMAND_START + r"fairlane ([a-z][a-z-]*)(?=\s|$)(?: ([a-z][a-z-]*)(?=\s|$))?", re.MULTILINE)
LOADTEST = re.compile(COMMAND_START + r"python -m loadtest ([a-z][\w-]*)", re.MULTILINE)


def code_of(page: Path) -> str:
    """The page's code, one line per line of a block and one per inline span, without the fences."""
    return "\n".join(span.strip("`") for span in CODE.findall(page.read_text(encoding="utf-8")))


def fairlane_commands() -> dict[str, set[str]]:
    """Each `fairlane` command with its subcommands (empty: none), as the installed command has them."""
    from app.process.cli import build_parser

    parser = build_parser((extend_serve_command, add_bench_command))
    commands: dict[str, set[str]] = {}
    for action in parser._subparsers._group_actions:  # type: ignore[union-attr]
        assert isinstance(action, argparse._SubParsersAction)
        for name, sub in action.choices.items():
            nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
            commands[name] = set(nested[0].choices) if nested else set()
    return commands


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    targets = [t.split("#")[0] for t in LINK.findall(page.read_text(encoding="utf-8"))
               if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    missing = [t for t in targets if t and not (page.parent / t).exists()]
    assert missing == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_shown_exists(page: Path) -> None:
    code = code_of(page)
    commands, targets = fairlane_commands(), make_targets()
    unknown = [f"make {t}" for t in MAKE.findall(code) if t not in targets]
    for command, sub in FAIRLANE.findall(code):
        if command not in commands or (sub and commands[command] and sub not in commands[command]):
            unknown.append(f"fairlane {command} {sub}".strip())
    unknown += [f"python -m loadtest {s}" for s in LOADTEST.findall(code) if s not in (*SCENARIOS, *LONG_RUNS)]
    assert unknown == []


def test_the_checks_see_the_commands() -> None:
    """The test above reads something: README shows both of its commands, and the parser knows bench's."""
    readme = code_of(ROOT / "README.md")
    assert {"serve", "test"} <= set(MAKE.findall(readme))
    assert {"engine", "serve", "quality"} <= fairlane_commands()["bench"]
