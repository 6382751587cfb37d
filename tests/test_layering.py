"""The package order: layerstore < fusefs < vmm < api. A package never imports
a higher one, neither with an import statement (at any depth, in any
function) nor by name through importlib or __import__ (plugin loading)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ORDER = ("layerstore", "fusefs", "vmm", "api")


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every absolute import and every importlib/__import__ call with a literal name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func) and node.args:
            if isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in ("__import__", "import_module")
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def violations() -> list[str]:
    bad = []
    for rank, package in enumerate(ORDER):
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, module in imported_modules(ast.parse(path.read_text(), str(path))):
                top = module.split(".")[0]
                if top in ORDER and ORDER.index(top) > rank:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return bad


def test_no_package_imports_a_higher_one() -> None:
    assert violations() == []


def test_the_check_sees_every_kind_of_import() -> None:
    source = ("import api.cli\nfrom vmm import sandbox\ndef f():\n    from fusefs.client import x\n"
              "import importlib\nimportlib.import_module('api.server')\n__import__('vmm.cli')\n")
    assert sorted(m for _, m in imported_modules(ast.parse(source))) == [
        "api.cli", "api.server", "fusefs.client", "importlib", "vmm", "vmm.cli"]


def test_the_entry_point_is_the_top_package() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert 'strata = "api.cli:main"' in text
