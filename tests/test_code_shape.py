"""Shape rules from the architecture issue that a reader would otherwise
have to police by hand: no function in the packages over 120 lines, and no
HTTP route function over 40 (a route parses, authorizes and calls one node
action; anything longer is logic that belongs in the node)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("layerstore", "fusefs", "vmm", "api")
MAX_FUNCTION = 120
MAX_ROUTE = 40


def functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text(), str(path))
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def length(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined]


def too_long(paths: list[Path], limit: int) -> list[str]:
    return [f"{p}:{f.lineno} {f.name} is {length(f)} lines"
            for p in paths for f in functions(p) if length(f) > limit]


def test_no_function_over_120_lines() -> None:
    paths = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert too_long(paths, MAX_FUNCTION) == []


def test_no_route_over_40_lines() -> None:
    assert too_long(sorted((ROOT / "api" / "routes").glob("*.py")), MAX_ROUTE) == []


def test_the_rule_can_fail(tmp_path: Path) -> None:
    long = tmp_path / "long.py"
    long.write_text("def f():\n" + "    x = 1\n" * 130)
    assert too_long([long], MAX_FUNCTION) and not too_long([long], 200)
