"""Nothing of ours may shadow a standard-library or third-party module.

A folder that ends up on ``sys.path`` makes each of its direct children an importable
top-level name.  When such a child is called like a standard-library module (``profile``,
``types``, ``test``...) or like an installed distribution's package, every later
``import`` of that name gets ours instead: this is how ``tests/profile`` once broke
``cProfile`` -> ``torch._dynamo`` -> every lazy transformers import on a fresh machine.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# folders that are, or can be, on sys.path: the repo root (pytest's rootdir insertion for the
# ``tests`` package), src/ (pyproject's pythonpath), tests/ (rootdir-less import modes) and
# benchmarks/ (``python benchmarks/x.py`` puts its own folder first).
CANDIDATES = [ROOT, ROOT / "src", ROOT / "tests", ROOT / "benchmarks"]
OURS = {"draftcert", "draftcert_launcher", "tests", "benchmarks", "src", "docs"}


def _top_level_names(folder: Path) -> set[str]:
    names = set()
    for child in folder.iterdir():
        if child.name.startswith((".", "_")) and child.name != "__init__.py":
            continue
        if child.is_file() and child.suffix == ".py":
            names.add(child.stem)
        elif child.is_dir() and child.name.isidentifier():
            names.add(child.name)
    return names


def _folders_on_path() -> list[Path]:
    """Every candidate plus whatever this very test run put on sys.path inside the repo, except
    the interpreter's own library folders: a virtualenv inside the checkout (``.venv/``,
    ignored by git) puts its site-packages on sys.path, and those *are* the installed packages."""
    seen = {p.resolve() for p in CANDIDATES if p.is_dir()}
    paths = sysconfig.get_paths()
    libs = {Path(paths[k]).resolve() for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    for entry in sys.path:
        try:
            p = Path(entry or os.getcwd()).resolve()
        except OSError:
            continue
        if any(p == lib or lib in p.parents for lib in libs):
            continue
        if p.is_dir() and (p == ROOT or ROOT in p.parents):
            seen.add(p)
    return sorted(seen)


def test_no_folder_on_sys_path_shadows_the_standard_library():
    clashes = [f"{folder.relative_to(ROOT) or '.'}/{name}" for folder in _folders_on_path()
               for name in sorted(_top_level_names(folder)) if name in sys.stdlib_module_names]
    assert not clashes, f"these names shadow standard-library modules; rename them: {clashes}"


def test_no_folder_on_sys_path_shadows_an_installed_package():
    installed = set(importlib.metadata.packages_distributions())
    clashes = [f"{folder.relative_to(ROOT) or '.'}/{name}" for folder in _folders_on_path()
               for name in sorted(_top_level_names(folder) - OURS) if name in installed]
    assert not clashes, f"these names shadow installed packages; rename them: {clashes}"


def test_the_checker_sees_a_planted_clash(tmp_path):
    """The check above can fail: a folder holding ``profile/`` and ``numpy.py`` is caught."""
    (tmp_path / "profile").mkdir()
    (tmp_path / "numpy.py").write_text("")
    (tmp_path / "fine_name.py").write_text("")
    names = _top_level_names(tmp_path)
    assert names & set(sys.stdlib_module_names) == {"profile"}
    assert "numpy" in names & set(importlib.metadata.packages_distributions())


def test_tests_dir_is_not_on_sys_path():
    """tests/ is the package ``tests``; putting the folder itself on sys.path is what exposed
    its children as top-level modules."""
    here = (ROOT / "tests").resolve()
    assert all(Path(e or os.getcwd()).resolve() != here for e in sys.path)


# ---------------------------------------------------------------------------- one room per concern


def _package_modules(src: Path) -> list[Path]:
    """Every module (``.py``) and C source (``.c``) of the package, relative to ``src/draftcert``."""
    pkg = src / "draftcert"
    return sorted(p.relative_to(pkg) for p in pkg.rglob("*") if p.suffix in (".py", ".c") and "__pycache__" not in p.parts)


def _unnamed_in_layout(src: Path, layout_text: str) -> list[str]:
    """Modules that docs/layout.md does not name: a module counts as named when its file name stands
    in the page's module tree (``name.py``, or ``name.py, .c`` for a binding and its source)."""
    tree = layout_text[layout_text.index("## Modules"):]
    missing = []
    for rel in _package_modules(src):
        if rel.name == "__init__.py":
            continue  # each package's docstring says what it owns; the page names the package
        stem_py = rel.with_suffix(".py").name
        named = re.search(rf"(?<![\w/.]){re.escape(rel.name)}(?![\w])", tree) is not None \
            or (rel.suffix == ".c" and re.search(rf"(?<![\w/.]){re.escape(stem_py)}, \.c", tree) is not None) \
            or any("/".join(rel.parts[i:]) in tree for i in range(1, len(rel.parts) - 1))  # a path's tail
        if not named:
            missing.append(str(rel))
    return missing


def test_layout_page_names_every_module():
    missing = _unnamed_in_layout(ROOT / "src", (ROOT / "docs" / "layout.md").read_text())
    assert not missing, f"docs/layout.md does not name these modules: {missing}"


def test_the_layout_check_sees_an_unnamed_module(tmp_path):
    pkg = tmp_path / "draftcert" / "sub"
    pkg.mkdir(parents=True)
    for name in ("__init__.py", "named.py", "named.c", "forgotten.py", "data.py"):
        (pkg / name).write_text("")
    page = "## Modules\n  sub/\n    named.py, .c   something\n    distill_data.py  not data.py's name\n"
    assert _unnamed_in_layout(tmp_path, page) == ["sub/forgotten.py"]
    assert _unnamed_in_layout(tmp_path, page.replace("not data.py's name", "")) == ["sub/data.py", "sub/forgotten.py"]


def test_no_two_modules_share_a_file_name():
    """One name, one module: ``draftcert/x/data.py`` beside ``draftcert/y/data.py`` hides which one a
    traceback or a grep means (``__init__``/``__main__`` aside, and the hub's generate.py, whose
    name transformers fixes)."""
    seen: dict[str, list[str]] = {}
    for rel in _package_modules(ROOT / "src"):
        if rel.name in ("__init__.py", "__main__.py") or rel.parts[:2] == ("generation", "hub"):
            continue
        seen.setdefault(rel.name, []).append(str(rel))
    twins = {name: where for name, where in seen.items() if len(where) > 1}
    assert not twins, f"modules sharing a file name: {twins}"


def test_no_package_holds_more_than_3000_lines():
    """No room grows back into a quarter of the code: each subpackage's .py and .c lines (its own
    files, not its subfolders') stay at most 3,000 (docs/layout.md; issue 48)."""
    pkg = ROOT / "src" / "draftcert"
    sizes = {}
    for d in [p for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists()]:
        sizes[d.name] = sum(len(f.read_text().splitlines()) for f in d.iterdir() if f.suffix in (".py", ".c"))
    big = {name: n for name, n in sizes.items() if n > 3000}
    assert not big, f"packages over 3,000 lines: {big}"
