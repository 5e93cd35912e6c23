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
