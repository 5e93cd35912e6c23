"""Command-line entry point: ``draftcert <command>``.

Subcommands live next to the code they drive; each module exposes
``add_parser(subparsers)`` and is imported lazily, so ``draftcert --help``
stays fast and a missing optional dependency only affects its own command.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (module, description) for each subcommand group; module.add_parser registers them.
_COMMAND_MODULES = [
    "draftcert.demo",
    "draftcert.profile.cli",
    "draftcert.report.cli",
    "draftcert.decode.cli",
    "draftcert.replay.cli",
    "draftcert.train.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftcert",
        description=(
            "Exact acceptance certificates for speculative decoding: when is a draft accepted, "
            "and how far can the drafter drift from the target before it can be rejected?"
        ),
        epilog="Criterion specs: strict | additive:DELTA | multiplicative:ALPHA | topm:M | "
        "entropy[:EPSILON[:DELTA]] | typical[:EPSILON[:DELTA]] | mars:THETA | tree:M.  Run `draftcert COMMAND --help` for details.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("draftcert"):
                continue  # command group not present in this build
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    except ValueError as exc:
        print(f"draftcert: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`draftcert demo | head`): stop quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
