"""Report of a ``draftcert profile`` run: summary.json, figures, report.md/html.

``write_report(out_dir)`` reads every trace shard ``out_dir/trace/*.parquet``
(all ranks) and ``out_dir/run.json`` and writes, each atomically:

* ``summary.json``  -- per-criterion statistics (see ``report/summary.py``)
* ``figures/*.png`` -- radius CDF, certified fraction by margin, certified
  length against eps, and with a drafter KL-vs-radius and rates by margin
* ``report.md`` (figures linked relatively) and ``report.html`` (self-contained)
"""

from __future__ import annotations

from pathlib import Path

from .summary import (
    DEFAULT_EPSILONS,
    atomic_write,
    list_shards,
    load_run,
    read_trace,
    run_epsilons,
    summarize_trace,
    to_json_value,
)

__all__ = ["write_report", "DEFAULT_EPSILONS"]


def write_report(out_dir, *, verbose: bool = True) -> dict:
    """Summarise a profile run directory and write the report files into it.

    Returns the summary dict exactly as written to ``summary.json`` (+inf as
    the string "inf", NaN as null).  ``verbose`` prints a table and the paths.
    Raises ValueError for a missing/empty trace directory or an unreadable shard.
    """
    import json

    from .figures import write_figures
    from .render import print_terminal, render_html, render_markdown

    out_dir = Path(out_dir)
    shards = list_shards(out_dir)
    run, notes = load_run(out_dir)
    epsilons = run_epsilons(run)
    trace = read_trace(shards)
    summary, plot = summarize_trace(trace, run, epsilons)
    summary["shards"] = len(shards)
    if notes:
        summary["notes"] = list(notes)
    summary = to_json_value(summary)

    figures = write_figures(summary, plot, out_dir / "figures", trace.has_drafter)
    replay = _replay_section(out_dir, notes) if trace.has_drafter else None
    if replay is not None:
        summary["replay"] = replay["summary"]
    paths = [out_dir / "summary.json"]
    atomic_write(paths[0], json.dumps(summary, indent=2, allow_nan=False) + "\n")
    md, page = render_markdown(summary, run, notes, figures, out_dir), render_html(summary, run, notes, figures)
    if replay is not None:  # the replay section (draftcert.replay) goes last
        md = md.rstrip("\n") + "\n\n" + replay["md"] + "\n"
        page = page.replace("</body></html>", replay["html"] + "</body></html>")
        figures = figures + replay["figures"]
    atomic_write(out_dir / "report.md", md)
    atomic_write(out_dir / "report.html", page)
    paths += [out_dir / "report.md", out_dir / "report.html"] + figures
    if verbose:
        print_terminal(summary, paths, notes)
    return summary


def _replay_section(out_dir: Path, notes: list[str]) -> dict | None:
    """The "Replay" section (draftcert.replay); a failure there leaves the rest of the report intact."""
    try:
        from ..replay.report import replay_section

        return replay_section(out_dir)
    except Exception as exc:  # noqa: BLE001 - the report is written anyway, with a note
        notes.append(f"replay section skipped: {type(exc).__name__}: {exc}")
        return None
