"""``draftcert report DIR``: summary.json, figures and report.md/html from a profile run."""

from __future__ import annotations

import argparse

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
            "Safe to rerun at any time; every file is replaced atomically."
        ),
        epilog="Example: draftcert profile --out runs/smol && draftcert report runs/smol",
    )
    p.add_argument("dir", metavar="DIR", help="output directory of `draftcert profile` (holds trace/ and run.json)")
    p.add_argument("-q", "--quiet", action="store_true", help="do not print the summary table and the paths written")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    check_run_dir_writable(args.dir, "report")  # a read-only run folder: one line, before any reading
    write_report(args.dir, replay=section_for_report(args.dir), verbose=not args.quiet)
    return 0
