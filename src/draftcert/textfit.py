"""Tables that fit a terminal width without cutting a cell.

A number that is cut is a wrong number, so nothing here ever truncates: when a
table is wider than the terminal, its columns are split over several stacked
tables that each repeat the first (key) column.  Only a single column that is
wider than the terminal on its own can still make a line longer than the width.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Sequence

__all__ = ["terminal_width", "column_groups", "markdown_tables", "compact_number"]


def terminal_width(default: int = 80, stream=None) -> int:
    """The width tables are printed at: ``$COLUMNS`` when set, else the width of the terminal
    ``stream`` (default ``sys.stdout``) is, else ``default``.

    Only ``stream`` itself counts: with stdout redirected to a file or a pipe the answer is
    ``$COLUMNS`` or 80 even while stderr or stdin is still a terminal (a log file has no width).
    """
    cols = os.environ.get("COLUMNS", "").strip()
    if cols.isdigit() and int(cols) > 0:
        return int(cols)
    stream = sys.stdout if stream is None else stream
    try:
        if stream.isatty():
            return os.get_terminal_size(stream.fileno()).columns or default
    except (AttributeError, ValueError, OSError):  # no fileno (captured), closed, or not a terminal after all
        pass
    return default


def compact_number(x, sig: int = 3) -> str:
    """A float in at most ``sig`` significant digits and few characters: 0.127, 12.3,
    4.1e-4 (exponent without padding or '+'), inf, nan.  Exactly as many digits as asked
    for; never rounded to fit a column."""
    if x is None:
        return "n/a"
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    if 1e-3 <= abs(x) < 10 ** sig:
        return f"{x:.{sig}g}"
    mant, exp = f"{x:.{sig - 1}e}".split("e")
    if "." in mant:
        mant = mant.rstrip("0").rstrip(".")
    return f"{mant}e{int(exp)}"


def column_groups(widths: Sequence[int], budget: int, key_width: int, sep: int) -> list[list[int]]:
    """Split column indices 1.. into consecutive groups so that key column + group fits ``budget``.

    ``widths[i]`` is the width column i needs, ``sep`` the characters a column adds (borders,
    padding).  A column too wide for any group gets a group of its own.
    """
    groups: list[list[int]] = []
    cur: list[int] = []
    used = key_width + sep
    for i in range(1, len(widths)):
        w = widths[i] + sep
        if cur and used + w > budget:
            groups.append(cur)
            cur, used = [], key_width + sep
        cur.append(i)
        used += w
    if cur:
        groups.append(cur)
    return groups or [[]]


def markdown_tables(head: Sequence[str], rows: Sequence[Sequence[str]], width: int | None,
                    align: Sequence[str] | None = None) -> str:
    """Markdown table(s) with padded columns; split into stacked tables (blank line between,
    first column repeated) when one table would be wider than ``width`` (None: never split)."""
    ncol = len(head)
    align = list(align or (["l"] + ["r"] * (ncol - 1)))
    cells = [list(head)] + [list(r) for r in rows]
    widths = [max(3, *(len(c[i]) for c in cells)) for i in range(ncol)]
    total = sum(widths) + 3 * ncol + 1
    if width is None or total <= width:
        groups = [list(range(1, ncol))]
    else:
        groups = column_groups(widths, width - 1, widths[0], 3)
    out = []
    for g in groups:
        cols = [0] + g
        lines = []
        for j, c in enumerate(cells):
            parts = [c[i].rjust(widths[i]) if align[i] == "r" else c[i].ljust(widths[i]) for i in cols]
            lines.append("| " + " | ".join(parts) + " |")
            if j == 0:
                lines.append("|" + "|".join(("-" * (widths[i] + 1) + ":") if align[i] == "r" else "-" * (widths[i] + 2)
                                            for i in cols) + "|")
        out.append("\n".join(lines))
    return "\n\n".join(out)
