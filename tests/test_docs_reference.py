"""docs/*.md are reference, not a lab notebook (issue 48): no page carries a dated run (2026-12-04)
or a time-of-day word (evening, night, morning, afternoon, tonight, yesterday, today). Dated runs
belong in benchmarks/results/, named after the benchmark that produced them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = re.compile(r"20[0-9]{2}-[0-9]{2}-[0-9]{2}|\b(evening|night|morning|afternoon|tonight|yesterday|today)\b", re.I)


def notebook_lines(pages: list[Path]) -> list[str]:
    return [f"{p.name}:{i}: {line.strip()}" for p in pages
            for i, line in enumerate(p.read_text().splitlines(), 1) if NOTEBOOK.search(line)]


def test_no_docs_page_reads_like_a_lab_notebook():
    found = notebook_lines(sorted((ROOT / "docs").glob("*.md")))
    assert not found, "dated or time-of-day lines in docs/ (move the run to benchmarks/results/):\n" + "\n".join(found)


def test_the_check_sees_a_dated_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Speed\n\nMeasured 2026-12-04 on the quiet machine.\nThat Evening's runs.\n"
                    "The nightly build and a knight are not times of day.\n")
    assert [line.split(":")[1] for line in notebook_lines([page])] == ["3", "4"]
