"""No number is ever cut at 80 columns: `draftcert demo` and the report's terminal table.

Every number shown must appear whole, and parse back to the value it stands for (to the
digits it claims), with no line wider than the terminal."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest

import draftcert as dc
from draftcert.textfit import compact_number, markdown_tables
from draftcert.cli.demo import DEFAULT_CRITERIA, example_distributions, run_demo

_CELL_SPLIT = re.compile(r"[\s│┃|]+")


def tokens(text: str) -> set[str]:
    return {t for t in _CELL_SPLIT.split(text) if t}


def as_float(cell: str) -> float:
    return {"inf": np.inf, "+inf": np.inf}.get(cell, None) or float(cell)


@pytest.mark.parametrize("width", [80, 100])
def test_demo_fits_and_every_number_is_whole(width):
    crits = DEFAULT_CRITERIA.split(",")
    text = run_demo(crits, ["forward", "reverse", "tv"], width=width)
    lines = text.splitlines()
    assert max(map(len, lines)) <= width  # the tables need 75 columns, the prose wraps at the width
    P = np.stack(list(example_distributions().values()))
    for div in ("forward", "reverse", "tv"):
        r = dc.radii(crits, P, div)
        start = next(i for i, l in enumerate(lines) if l.startswith("radius,") and
                     {"forward": "forward KL", "reverse": "reverse KL", "tv": "total variation"}[div] in l)
        body = lines[start + 3 : start + 3 + 2 * len(crits)]
        for j, spec in enumerate(crits):
            row, bound = body[2 * j].split(), body[2 * j + 1].split()
            assert row[0] == spec and bound[:2] == ["margin", "bound"]
            want_r, want_b = r[spec], dc.margin_bound(spec, P, div)
            for cell, want in zip(row[1:], want_r):  # 4 significant digits: relative error <= 5e-4
                assert as_float(cell) == pytest.approx(want, rel=5.01e-4, abs=0), (div, spec, cell, want)
            for cell, want in zip(bound[2:], want_b):
                assert as_float(cell) == pytest.approx(want, rel=5.01e-4, abs=0), (div, spec, cell, want)
            assert len(row) == 6 and len(bound) == 7


def test_demo_cli_at_80_columns(capsys, monkeypatch):
    from draftcert.cli import main

    monkeypatch.setenv("COLUMNS", "80")
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 80
    assert "confident (0.90, 0.05, 0.02)" in out  # the legend is whole, not cut mid-number


@pytest.mark.parametrize("x,s", [(4.1e-4, "4.1e-4"), (0.000448, "4.48e-4"), (0.127, "0.127"), (12.34, "12.3"),
                                 (0.0, "0"), (np.inf, "inf"), (1234.5, "1.23e3"), (-2.5e-7, "-2.5e-7")])
def test_compact_number(x, s):
    assert compact_number(x) == s


def test_markdown_tables_split_instead_of_cutting():
    head = ["criterion"] + [f"column number {i}" for i in range(8)]
    rows = [[f"spec{j}"] + [f"{(j + 1) * 1.2345678e-5 * 10 ** i:.6g}" for i in range(8)] for j in range(3)]
    text = markdown_tables(head, rows, 80)
    assert max(map(len, text.splitlines())) <= 80
    assert text.count("| criterion") >= 2  # stacked tables, each with the key column
    toks = tokens(text)
    assert all(c in toks for r in rows for c in r)


# --------------------------------------------------------------------------- report table


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    from draftcert.report import write_report

    from .report import tracegen

    out = tmp_path_factory.mktemp("run80")
    tracegen.write_run(out, tracegen.make_steps(seed=0))
    return write_report(out, verbose=False)


def _render(summary, width):
    from rich.console import Console

    from draftcert.report.render import print_terminal

    buf = io.StringIO()
    print_terminal(summary, [], ["a note"], console=Console(width=width, file=buf, color_system=None))
    return buf.getvalue()


@pytest.mark.parametrize("width", [60, 80, 100, 160])
def test_report_table_fits_and_every_number_is_whole(summary, width):
    from draftcert.report.render import table_epsilon

    text = _render(summary, width)
    lines = text.splitlines()
    assert max(map(len, lines)) <= width
    assert "…" not in text  # rich's ellipsis: a cut cell
    eps = table_epsilon(summary)
    for spec in summary["criteria"]:
        # the spec's cells across the stacked tables, in column order
        cells = [c for l in lines if l.startswith("│") for c in [_CELL_SPLIT.split(l.strip("│ "))] if c[0] == spec]
        shown = [t for c in cells for t in c[1:]]
        d = summary[spec]
        want = [d["radius_q05"], d["radius_median"], d["certified_fraction"][eps], d["certified_length"][eps],
                d["accept_rate"], d["certified_rate"]]
        assert len(shown) == len(want) + 1, (spec, cells)
        for cell, v in zip(shown, want):  # 3 significant digits: relative error <= 5e-3
            # summary.json writes +inf as null (the JSON rule); the table shows it as +inf
            assert as_float(cell) == pytest.approx(np.inf if v is None else float(v), rel=5.01e-3, abs=0), (spec, cell, v)
        assert shown[-1] == str(d["soundness_violations"])
    if width <= 80 or width >= 120:  # split only when one table does not fit, even with wrapped headers
        assert (text.count("criterion") > 1) == (width <= 80)


def test_report_cells_use_compact_exponents(summary):
    from draftcert.report.render import fmt

    assert fmt(4.1e-4, 3) == "4.10e-4" and fmt(1.5e5) == "1.500e5" and fmt(0.127, 3) == "0.127"
    text = _render(summary, 80)
    assert "e-0" not in text


def test_a_note_naming_a_long_path_is_not_folded_inside_it(summary):
    """A note names a path (``<run>/run.json not found: ...``); folded at the console's width the
    path, and the words after it, would be split across lines (and no longer copy-pasteable)."""
    from rich.console import Console

    from draftcert.report.render import print_terminal

    note = "/tmp/" + "deep/" * 20 + "run.json not found: using defaults"
    buf = io.StringIO()
    print_terminal(summary, [], [note], console=Console(width=60, file=buf, color_system=None))
    assert f"note: {note}" in buf.getvalue().splitlines()


# --------------------------------------------------------------------------- output to a file


def test_a_logged_report_table_is_80_columns(summary, capsys, monkeypatch):
    """No terminal (stdout captured, as in a log) and no $COLUMNS: 80 columns, not one wide table
    (it was 140, 118 characters in a log); $COLUMNS still sets the width."""
    from draftcert.report.render import print_terminal

    monkeypatch.delenv("COLUMNS", raising=False)
    print_terminal(summary, [], [])
    lines = capsys.readouterr().out.splitlines()
    assert lines and max(map(len, lines)) <= 80
    monkeypatch.setenv("COLUMNS", "120")
    print_terminal(summary, [], [])
    assert 80 < max(map(len, capsys.readouterr().out.splitlines())) <= 120


_WIDTH_PROBE = """
import fcntl, os, pty, struct, subprocess, sys, termios
master, slave = pty.openpty()
fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 118, 0, 0))  # a 118-column terminal
probe = [sys.executable, "-c", sys.argv[2], sys.argv[3]]
with open(sys.argv[1], "w") as log:  # stdout to a file; stdin and stderr stay on the terminal
    subprocess.run(probe, stdin=slave, stdout=log, stderr=slave, check=True)
subprocess.run(probe, stdin=slave, stdout=slave, stderr=slave, check=True)  # stdout on the terminal itself
print(os.read(master, 100).decode().split()[0])
"""
# textfit.py alone (it imports only the standard library): no torch import in each subprocess
_TEXTFIT = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("textfit", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
print(mod.terminal_width())
"""


def test_terminal_width_with_stdout_redirected(tmp_path):
    """stdout to a file: $COLUMNS or 80, even while stdin and stderr are a 118-column terminal;
    stdout on that terminal: 118."""
    import os
    import subprocess
    import sys

    pytest.importorskip("pty")
    from draftcert import textfit

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    log = tmp_path / "log.txt"
    argv = [sys.executable, "-c", _WIDTH_PROBE, str(log), _TEXTFIT, textfit.__file__]
    on_tty = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    assert log.read_text().strip() == "80" and on_tty == "118"
    subprocess.run(argv, env={**env, "COLUMNS": "100"}, check=True, capture_output=True, timeout=60)
    assert log.read_text().strip() == "100"


class _FakeTTY(io.StringIO):
    def isatty(self):
        return True

    def fileno(self):
        raise OSError("no real terminal behind it")


def test_terminal_width_never_fails(monkeypatch):
    from draftcert.textfit import terminal_width

    monkeypatch.delenv("COLUMNS", raising=False)
    assert terminal_width() == 80 and terminal_width(72) == 72  # captured stdout: no terminal
    assert terminal_width(stream=_FakeTTY()) == 80  # claims a terminal, has no descriptor
    for bad in ("", "0", "-3", "wide"):
        monkeypatch.setenv("COLUMNS", bad)
        assert terminal_width() == 80
    monkeypatch.setenv("COLUMNS", " 132 ")
    assert terminal_width() == 132
