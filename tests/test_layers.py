"""The package's layering, enforced: imports only go down (import-linter's layers contract in
pyproject.toml, no ignore list), no module imports another module's private name, and every
import inside a function says in a comment why it is deferred (an optional or heavy dependency).
"""

from __future__ import annotations

import ast
import os
import tokenize
from pathlib import Path

from importlinter import cli as importlinter_cli

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "draftcert"


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _is_ours(node: ast.ImportFrom) -> bool:
    return node.level > 0 or (node.module or "").split(".")[0] == "draftcert"


def test_import_linter_layers_contract_is_kept():
    cwd = os.getcwd()
    os.chdir(ROOT)  # the contract lives in pyproject.toml at the repository root
    try:
        code = importlinter_cli.lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True)
    finally:
        os.chdir(cwd)
    assert code == 0, "import-linter: a layers contract is broken (run `lint-imports` for the report)"


def test_no_module_imports_a_private_name_of_another():
    bad = []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and _is_ours(node):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name}")
    assert not bad, "private names imported across modules (make them public):\n" + "\n".join(bad)


def _comments_by_line(path: Path) -> dict[int, str]:
    with open(path, "rb") as f:
        return {tok.start[0]: tok.string for tok in tokenize.tokenize(f.readline) if tok.type == tokenize.COMMENT}


def test_imports_inside_functions_say_why():
    """An import inside a function is allowed only to defer an optional or heavy dependency,
    and then its line (or one of the three above it, for a group of such imports) carries a
    comment saying so."""
    bad = []
    for path, tree in _modules():
        comments = None
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    comments = comments if comments is not None else _comments_by_line(path)
                    if not any(line in comments for line in range(node.lineno - 3, node.lineno + 1)):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "imports inside functions without a comment saying why they are deferred:\n" + "\n".join(sorted(set(bad)))
