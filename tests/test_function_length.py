"""No function in src/ is longer than 80 lines: a longer one does several jobs, and each job
deserves a name (docs/STYLE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "kvwise"
MOST_LINES = 80


def long_functions(source: str, name: str) -> list[str]:
    return [
        f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > MOST_LINES
    ]


def test_no_function_is_longer_than_80_lines():
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in long_functions(path.read_text(), path.name)]
    assert found == []


def test_the_check_sees_a_long_function():
    source = "def long():\n" + "    x = 1\n" * MOST_LINES
    assert long_functions(source, "x.py") == ["x.py:1 long (81 lines)"]
