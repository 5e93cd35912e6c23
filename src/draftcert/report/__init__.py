"""Report of a ``draftcert profile`` run: summary.json, figures, report.md/html.

``write_report(out_dir)`` reads every trace shard ``out_dir/trace/rank*.parquet``
(all ranks; ``draftcert.tracefile``) and ``out_dir/run.json`` and writes, each atomically:

* ``summary.json``  -- per-criterion statistics (see ``report/run_summary.py``)
* ``figures/*.png`` -- radius CDF, certified fraction by margin, certified
  length against eps, and with a drafter KL-vs-radius and rates by margin
* ``report.md`` (figures linked relatively) and ``report.html`` (self-contained)

The report does not replay: a caller that wants the "Replay" section computes it
(``draftcert.replay.report_section.section_for_report``) and passes it as ``replay=``.
"""

from __future__ import annotations

from pathlib import Path

from ..fileio import atomic_write, json_value, write_json
from ..tracefile import load_run, run_epsilons, run_shards
from .figures import write_figures
from .render import print_terminal, render_html, render_markdown, skipped_section
from .run_summary import read_trace, run_notes, summarize_trace

__all__ = ["write_report"]


def write_report(out_dir, *, replay: dict | None = None, verbose: bool = True) -> dict:
    """Summarise a profile run directory and write the report files into it.

    ``replay``: the "Replay" section, appended last, or None for none.  It is the dict of
    ``draftcert.replay.report_section.section_for_report(out_dir)`` (None there too when the trace has
    no drafter): ``{"md": str, "html": str, "figures": [Path], "summary": dict}`` (the summary
    goes to ``summary.json["replay"]``; an optional ``"notes": [str]`` joins the report's notes), or
    ``{"note": str, "fix": str}`` when the section could not be built: the note is listed with the
    report's notes and the Replay section says it, with ``fix`` (the command that fills it), in
    report.md and report.html (``summary.json["replay"] = {"skipped": note}``).

    Returns the summary dict exactly as written to ``summary.json`` (the JSON rule:
    non-finite numbers as null; ``report.run_summary.stat_value`` reads a null radius back as
    +inf).  ``verbose`` prints a table and the paths.  Raises ValueError for a missing or
    empty trace folder or an unreadable shard.
    """
    out_dir = Path(out_dir)
    shards = run_shards(out_dir)
    run = load_run(out_dir)
    notes = run_notes(out_dir, run)
    if replay is not None and "note" in replay:  # the section failed: it says so, in place
        notes.append(replay["note"])
        md_part, html_part = skipped_section("Replay", replay["note"], replay.get("fix", ""))
        replay = {"md": md_part, "html": html_part, "figures": [], "summary": {"skipped": replay["note"]}}
    elif replay is not None:
        notes += replay.get("notes", [])
    epsilons = run_epsilons(run)
    trace = read_trace(shards)
    summary, plot = summarize_trace(trace, run, epsilons)
    summary["shards"] = len(shards)
    if notes:
        summary["notes"] = list(notes)
    if replay is not None:
        summary["replay"] = replay["summary"]
    summary = json_value(summary)

    figures = write_figures(summary, plot, out_dir / "figures", trace.has_drafter)
    paths = [write_json(out_dir / "summary.json", summary)]
    md, page = render_markdown(summary, run, notes, figures, out_dir), render_html(summary, run, notes, figures)
    if replay is not None:  # the replay section goes last
        md = md.rstrip("\n") + "\n\n" + replay["md"] + "\n"
        page = page.replace("</body></html>", replay["html"] + "</body></html>")
        figures = figures + list(replay["figures"])
    atomic_write(out_dir / "report.md", md)
    atomic_write(out_dir / "report.html", page)
    paths += [out_dir / "report.md", out_dir / "report.html"] + figures
    if verbose:
        print_terminal(summary, paths, notes)
    return summary
