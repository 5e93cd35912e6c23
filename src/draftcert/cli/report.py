"""``draftcert report DIR``: summary.json, figures and report.md/html from a profile run; the evaluation
files of a ``draftcert evaluate`` folder (``evaluate.scoreboard``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..evaluate.scoreboard import FIGURE, format_rows, is_evaluation_dir, write_scoreboard
from ..replay.report_section import section_for_report
from ..report import write_report
from .checks import check_run_dir_writable


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "report",
        help="summarise a `draftcert profile` run: summary.json, figures, report.md/html",
        description=(
            "Read every trace shard DIR/trace/rank*.parquet (all ranks) and DIR/run.json of a "
            "`draftcert profile` run and write into DIR: summary.json (per criterion: radius "
            "quantiles, certified fraction and mean certified run length per epsilon, and with a "
            "drafter accept/certified rates and soundness violations), figures/*.png, report.md and "
            "a self-contained report.html (with a drafter, a Replay section: `draftcert replay`'s "
            "tokens per forward and the rejections split).  Radii and epsilons are forward KL(p||q) in nats; "
            "summary.json writes non-finite numbers as null (a null radius is +inf).  "
            "Safe to rerun at any time; every file is replaced atomically.  A `draftcert evaluate` "
            "folder (DIR/evaluate.json) gets its evaluation.json/.parquet/.md and "
            f"{FIGURE} (next to a profile run's figures when DIR holds both)."
        ),
        epilog="Example: draftcert profile --out runs/smol && draftcert report runs/smol",
    )
    p.add_argument("dir", metavar="DIR", help="output directory of `draftcert profile` (holds trace/ and run.json)")
    p.add_argument("-q", "--quiet", action="store_true", help="do not print the summary table and the paths written")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    if is_evaluation_dir(args.dir):
        doc = write_scoreboard(args.dir)
        if not args.quiet:
            print(format_rows(doc["rows"]))
            print(f"wrote {Path(args.dir) / 'evaluation.md'}")
        if not (Path(args.dir) / "run.json").exists():  # an evaluation folder only
            return 0
    check_run_dir_writable(args.dir, "report")  # a read-only run folder: one line, before any reading
    write_report(args.dir, replay=section_for_report(args.dir), verbose=not args.quiet)
    return 0
