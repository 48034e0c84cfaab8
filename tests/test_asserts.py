"""No `assert` in the program does work: `python -O` drops every assert, and with it whatever its test
calls. Only builtins that read, and methods that ask (is_*, has_*), may be called in one."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ("app", "scheduling", "gpu", "tenancy", "config", "contract", "cluster", "loadtest", "benchmarks")
READING_BUILTINS = {"isinstance", "issubclass", "callable", "hasattr", "getattr", "len", "all", "any", "sum", "min",
                    "max", "sorted", "set", "frozenset", "tuple", "list", "dict", "bool", "int", "float", "str",
                    "abs", "round", "type", "id", "repr", "range", "enumerate", "zip"}


def _called_names(test: ast.expr) -> list[str]:
    names = []
    for node in ast.walk(test):
        if isinstance(node, ast.Call):
            func = node.func
            names.append(func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute)
                         else ast.unparse(func))
    return names


def _is_a_question(name: str) -> bool:
    return name in READING_BUILTINS or name.startswith(("is_", "has_"))


def test_no_assert_calls_anything_that_could_do_work() -> None:
    found = [f"{path.relative_to(ROOT)}:{node.lineno}: {name}()"
             for package in PROGRAM for path in sorted((ROOT / package).rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(node, ast.Assert)
             for name in _called_names(node.test) if not _is_a_question(name)]
    assert found == [], "calls inside an assert (gone under python -O):\n" + "\n".join(found)


def test_the_check_finds_a_call_that_does_work() -> None:
    test = ast.parse("assert pairs is not None and self.blocks.allocate(request, 2)").body[0]
    assert isinstance(test, ast.Assert)
    assert [name for name in _called_names(test.test) if not _is_a_question(name)] == ["allocate"]
