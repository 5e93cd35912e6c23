"""report.md, a self-contained report.html (figures embedded as base64) and the terminal table."""

from __future__ import annotations

import base64
import html
import json
import math
import re
from pathlib import Path

from ..textfit import column_groups, terminal_width
from .figures import PAGE_WIDTH_PX
from .run_summary import eps_key, stat_value

HOW_TO_READ = (
    "Each verification rule (criterion) accepts a drafted token exactly when the token is not in a "
    "lower level set of the target distribution p. The *radius* of a step is the smallest forward "
    "KL(p||q) (nats) a drafter q needs to cause a rejection there: any drafter closer than the radius "
    "is guaranteed to be accepted. A larger radius means a more forgiving rule at that step; +inf "
    "means no drafter can be rejected. *Certified fraction at eps* is the share of steps whose radius "
    "is >= eps, i.e. steps where every drafter within eps nats is accepted; *certified length* is the "
    "mean number of consecutive such steps starting at a step (the guaranteed accepted run of a "
    "speculative block). With a drafter, *accept rate* is how often its greedy proposal (top-m for "
    "trees) was actually accepted, *certified rate* how often its actual KL was below the radius; "
    "a certified step must be accepted, so *soundness violations* must be 0."
)


def table_epsilon(summary: dict) -> str:
    """The epsilon shown in tables: 0.3 when the run has it, else the middle one."""
    eps = [eps_key(e) for e in summary["epsilons"]]
    return "0.3" if "0.3" in eps else eps[len(eps) // 2]


def fmt(x, digits: int = 4) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, str):
        return x
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return str(x)
    x = float(x)
    if math.isnan(x):
        return "n/a"
    if math.isinf(x):
        return "+inf" if x > 0 else "-inf"
    if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e4):
        mant, exp = f"{x:.{digits - 1}e}".split("e")
        return f"{mant}e{int(exp)}"  # compact: 4.48e-4, not 4.48e-04
    return f"{x:.{digits}g}"


def table_rows(summary: dict, digits: int = 4) -> tuple[list[str], list[list[str]]]:
    eps = table_epsilon(summary)
    drafter = any("accept_rate" in summary[s] for s in summary["criteria"])
    head = ["criterion", "radius q05", "radius median", f"certified frac @{eps}", f"certified length @{eps}"]
    if drafter:
        head += ["accept rate", "certified rate", "soundness violations"]
    rows = []
    finite = summary["finite_steps"]
    for s in summary["criteria"]:
        d = summary[s]
        vals = [stat_value(d["radius_q05"], finite), stat_value(d["radius_median"], finite),
                d["certified_fraction"][eps], d["certified_length"][eps]]
        if drafter:
            vals += [d.get("accept_rate"), d.get("certified_rate"), d.get("soundness_violations")]
        row = [s] + [fmt(v, digits) for v in vals]
        rows.append(row)
    return head, rows


def metadata_rows(summary: dict, run: dict, notes: list[str]) -> list[tuple[str, str]]:
    m = summary.get("models") or {}
    rows = [
        ("command", summary.get("command") if isinstance(summary.get("command"), str) else " ".join(map(str, summary.get("command") or [])) or "unknown"),
        ("target", str(m.get("target") or "unknown")),
        ("drafter", str(m.get("drafter") or "none")),
        ("steps", f"{summary['steps']} ({summary['nonfinite_steps']} nonfinite, excluded from statistics)"
         + (f"; drafter rates over {summary['drafter_steps']} steps ({summary['draft_nonfinite_steps']} with non-finite drafter logits excluded)" if "drafter_steps" in summary else "")),
        ("prompts", str(summary["prompts"])),
        ("epsilons (nats)", ", ".join(eps_key(e) for e in summary["epsilons"])),
    ]
    for key in ("prompts_source", "prompts", "limit", "max_new_tokens", "divergences", "world_size", "device", "model_dtype", "updated"):
        if key in run and not (key == "prompts" and isinstance(run[key], (int, float))):
            rows.append((f"run: {key}", json.dumps(run[key]) if not isinstance(run[key], str) else run[key]))
    v = summary.get("versions") or {}
    if v:
        rows.append(("versions", ", ".join(f"{k} {val}" for k, val in v.items())))
    if "drafter_kl_forward" in summary:
        k = {key: stat_value(v, summary["drafter_steps"]) for key, v in summary["drafter_kl_forward"].items()}
        rows.append(("drafter KL(p||q) (nats)", f"q05 {fmt(k['q05'])}, median {fmt(k['median'])}, mean {fmt(k['mean'])}"))
    for n in notes:
        rows.append(("note", n))
    return rows


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|")


def render_markdown(summary: dict, run: dict, notes: list[str], figures: list[Path], out_dir: Path) -> str:
    head, rows = table_rows(summary)
    lines = ["# draftcert report", "", "## Summary per criterion", ""]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join("---" for _ in head) + "|")
    lines += ["| " + " | ".join(_md_escape(c) for c in r) + " |" for r in rows]
    lines += ["", "Radii and epsilons are forward KL(p||q) in nats.", "", "## How to read this", "", HOW_TO_READ, "", "## Run", ""]
    lines += ["| field | value |", "|---|---|"]
    lines += [f"| {_md_escape(k)} | {_md_escape(v)} |" for k, v in metadata_rows(summary, run, notes)]
    lines += ["", "## Figures", ""]
    for f in figures:
        rel = f.relative_to(out_dir).as_posix()
        lines += [f"### {FIGURE_TITLES.get(f.name, f.stem)}", "", f"![{f.stem}]({rel})", ""]
    lines += ["Full numbers: `summary.json`.", ""]
    return "\n".join(lines)


FIGURE_TITLES = {
    "radius_cdf.png": "Radius distribution per criterion",
    "certified_by_margin.png": "Certified fraction by target margin",
    "certified_length.png": "Certified acceptance length against epsilon",
    "kl_vs_radius.png": "Drafter KL against radius",
    "rates_by_margin.png": "Acceptance and certified rates by target margin",
}


def markdown_to_html(text: str) -> str:
    """CommonMark -> HTML (markdown-it-py, which rich already depends on): *emphasis* becomes
    <em>, and any HTML in the text is escaped, not passed through."""
    from markdown_it import MarkdownIt  # optional: models extra

    return MarkdownIt("commonmark", {"html": False}).render(text).strip()


def inline_html(text: str) -> str:
    """Plain text with markdown's inline code (as notes write a command: `draftcert profile`)
    as HTML: escaped, each `code` span as <code>; nothing else is read as markdown (a path or a
    command may hold * or _)."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


# The page: at most PAGE_WIDTH_PX wide (figures wider are shrunk to it: report.figures keeps
# theirs within it); a table cell never wraps (a number or a row of rates reads on one line),
# a table wider than the page scrolls; header cells and the run's metadata wrap.
STYLE = (
    f"body{{font-family:system-ui,sans-serif;max-width:{PAGE_WIDTH_PX}px;margin:2em auto;padding:0 1em;color:#222}}"
    "table{border-collapse:collapse;margin:1em 0;font-size:14px;display:block;max-width:100%;overflow-x:auto}"
    "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}td{white-space:nowrap}"
    "td:first-child,th:first-child{text-align:left}th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee}"
    ".meta td{text-align:left;white-space:normal}code{font-size:90%;background:#f3f3f3;padding:0 2px}"
)


def skipped_section(title: str, note: str, fix: str) -> tuple[str, str]:
    """(markdown, HTML) of a section that could not be built: its heading, why, and the command
    that fills it (a report never drops a section without saying so)."""
    md = f"## {title}\n\n**Not built:** {note}\n\n{fix}\n"
    page = f"<h2>{html.escape(title)}</h2><p><b>Not built:</b> {inline_html(note)}</p><p>{inline_html(fix)}</p>"
    return md, page


def render_html(summary: dict, run: dict, notes: list[str], figures: list[Path]) -> str:
    e = html.escape
    head, rows = table_rows(summary)
    out = [
        "<!doctype html><html><head><meta charset='utf-8'><title>draftcert report</title>",
        f"<style>{STYLE}</style></head><body>",
        "<h1>draftcert report</h1><h2>Summary per criterion</h2><table><tr>",
        "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>",
    ]
    out += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows]
    out += ["</table><p>Radii and epsilons are forward KL(p||q) in nats.</p>", f"<h2>How to read this</h2>{markdown_to_html(HOW_TO_READ)}"]
    out += ["<h2>Run</h2><table class='meta'>"]
    out += [f"<tr><th>{e(k)}</th><td>{inline_html(v)}</td></tr>" for k, v in metadata_rows(summary, run, notes)]
    out += ["</table><h2>Figures</h2>"]
    for f in figures:
        data = base64.b64encode(f.read_bytes()).decode()
        out.append(f"<h3>{e(FIGURE_TITLES.get(f.name, f.stem))}</h3><img alt='{e(f.stem)}' src='data:image/png;base64,{data}'>")
    out += ["<p>Full numbers: <code>summary.json</code>.</p></body></html>"]
    return "\n".join(out)


def _fit_widths(head: list[str], rows: list[list[str]], cols: list[int], budget: int) -> list[int]:
    """Content widths of ``cols`` in a rich table of ``budget`` characters: every cell whole
    (a number is never cut); headers wrap at spaces only where the room runs out."""
    lo = [max([len(r[i]) for r in rows] + [len(w) for w in head[i].split()]) for i in cols]
    hi = [max([len(r[i]) for r in rows] + [len(head[i])]) for i in cols]
    widths = list(lo)
    room = budget - (sum(lo) + 3 * len(cols) + 1)  # padding 1+1 and one border per column, plus one
    for j in sorted(range(len(cols)), key=lambda j: hi[j] - lo[j]):
        give = max(0, min(room, hi[j] - lo[j]))
        widths[j] += give
        room -= give
    return widths


def terminal_tables(summary: dict, width: int) -> list:
    """The summary as rich Tables that fit ``width`` columns without cutting any cell: the
    columns are split over stacked tables (each repeating the criterion) when one is too wide."""
    from rich.table import Table  # optional: models extra

    head, rows = table_rows(summary, digits=3)
    short = {"radius q05": "radius q05", "radius median": "radius median", "accept rate": "accept",
             "certified rate": "certified", "soundness violations": "violations"}
    head = [short.get(h, h.replace("certified frac ", "cert frac ").replace("certified length ", "cert len ")) for h in head]
    need = [max([len(r[i]) for r in rows] + [len(w) for w in head[i].split()]) for i in range(len(head))]
    groups = column_groups(need, width - 1, need[0], 3)
    natural = [list(range(1, 5)), list(range(5, len(head)))]  # the target's radii | the drafter's rates
    if len(groups) > 1 and len(head) > 5 and all(need[0] + sum(need[i] for i in g) + 3 * (len(g) + 1) + 1 <= width
                                                 for g in natural):
        groups = natural
    tables = []
    for k, g in enumerate(groups):
        cols = [0] + g
        title = (f"draftcert report: {summary['steps']} steps, {summary['prompts']} prompts, "
                 f"{summary['nonfinite_steps']} nonfinite (radii in nats)") if k == 0 else None
        t = Table(title=title)
        for i, w in zip(cols, _fit_widths(head, rows, cols, width)):
            t.add_column(head[i], justify="left" if i == 0 else "right", no_wrap=i == 0, width=w)
        for r in rows:
            style = "bold red" if len(r) > 7 and r[7] not in ("0", "n/a") else None
            t.add_row(*(r[i] for i in cols), style=style)
        tables.append(t)
    return tables


def print_terminal(summary: dict, paths: list[Path], notes: list[str], console=None) -> None:
    """The summary table(s) at ``textfit.terminal_width()``: ``$COLUMNS``, else the terminal's
    width, else 80 (piped or logged; rich alone would take the width of a terminal on stderr)."""
    from rich.console import Console  # optional: models extra

    if console is None:
        console = Console(width=terminal_width())
    for t in terminal_tables(summary, console.width):
        console.print(t)
    for n in notes:
        console.print(f"[yellow]note:[/] {n}", soft_wrap=True)  # notes name paths: never folded inside one
    for p in paths:
        console.print(f"wrote {p}", soft_wrap=True, highlight=False)  # a path is never folded
