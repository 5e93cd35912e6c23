"""Docs that had gone stale (issue 31): every command's --help has examples, as the README says;
docs/profiling.md's median KL sits under the drafter it belongs to; the `models` extra and the
docs name the transformers version `draftcert.generate` needs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from draftcert.cli import build_parser
from draftcert.generation.custom import MIN_TRANSFORMERS

ROOT = Path(__file__).resolve().parents[1]


def test_every_command_help_has_examples():
    parser = build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    section = re.compile(r"^\s*examples?:", re.I | re.M)  # an examples section, not the word in a description
    missing = [name for name, sub in subs.items() if not section.search(sub.format_help())]
    assert not missing, f"--help without examples: {missing}"


def test_profiling_doc_puts_each_median_kl_under_its_drafter():
    text = (ROOT / "docs" / "profiling.md").read_text()
    skip5_table = text.index("| `tree:8` | 0.0697 |")  # the self:skip=5 table's last row
    default_intro = text.index("With the shipped feature drafter")
    default_table = text.index("| `tree:8` | 0.854 |")
    kl_skip5 = text.index("0.070 nats")
    kl_default = text.index("3.00 nats")
    assert skip5_table < kl_skip5 < default_intro < default_table < kl_default
    assert "self:skip=5" in text[skip5_table:kl_skip5 + 20]


def test_the_models_extra_and_the_docs_name_the_transformers_generate_needs():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["models"]
    (req,) = [r for r in extra if r.startswith("transformers")]
    assert req == f"transformers>={MIN_TRANSFORMERS}"
    older = re.compile(r"transformers\s*(>=|≥)\s*(\d+\.\d+)")
    files = [ROOT / "README.md", ROOT / "pyproject.toml", *(ROOT / "docs").glob("*.md"),
             *(f for f in (ROOT / "src").rglob("*") if f.suffix in (".py", ".txt", ".md") and ".egg-info" not in str(f))]
    stale = [f"{f.relative_to(ROOT)}: {m.group(0)}" for f in files for m in older.finditer(f.read_text(errors="replace"))
             if tuple(map(int, m.group(2).split("."))) < tuple(map(int, MIN_TRANSFORMERS.split(".")))]
    assert not stale, stale


def test_no_help_text_shows_an_unfilled_placeholder():
    """A help string written as a plain string where an f-string was meant prints '{NAME}' verbatim
    (reproduce-paper's --weights said 'default: ${WEIGHTS_ENV}')."""
    parser = build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    placeholder = re.compile(r"\{[A-Za-z_][A-Za-z0-9_]*\}")
    found = {name: placeholder.findall(sub.format_help()) for name, sub in subs.items()}
    assert not {k: v for k, v in found.items() if v}, found
