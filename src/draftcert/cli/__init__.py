"""Command-line entry point: ``draftcert <command>``, the top layer.

One module per subcommand group (``demo``, ``profile``, ``report``, ``decode``, ``replay``,
``train``, ``evaluate``); each exposes ``add_parser(subparsers)`` and drives the layers below it.  Optional
heavy dependencies (transformers, pyarrow, matplotlib) load only when a command needs them.
A subcommand module that fails to import is an error (a broken install), never a silently
shorter ``--help``.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys

from .. import __version__
from ..criteria import SPEC_HELP
from . import decode, demo, evaluate, profile, replay, report, train

_COMMANDS = (demo, profile, report, decode, replay, train, evaluate)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftcert",
        description=(
            "Exact acceptance certificates for speculative decoding: when is a draft accepted, "
            "and how far can the drafter drift from the target before it can be rejected?"
        ),
        epilog=f"Criterion specs: {SPEC_HELP}.  Run `draftcert COMMAND --help` for details.",
    )
    parser.add_argument("--version", action="version", version=f"draftcert {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _COMMANDS:
        mod.add_parser(sub)
    return parser


_POSITIONALS = ("command", "func", "dir", "resumable")  # parsed values that are no option


def name_option(message: str, args: argparse.Namespace) -> str:
    """An error message as the command line says it: the library names a Python argument
    (``limit: expected an integer >= 1``), the command line names the option the user typed
    (``--limit: ...``, ``-k: ...``; ``out_dir``, the run folder, is the positional ``DIR`` of
    ``report``, ``replay`` and ``explain``).  Only a prefix that is one of this command's options changes."""
    name, sep, rest = message.partition(": ")
    if sep and name == "out_dir" and "dir" in vars(args):  # the run folder the library reads: the user's DIR
        return f"DIR: {rest}"
    if not sep or name in _POSITIONALS or name not in vars(args):
        return message
    return f"{'-' if len(name) == 1 else '--'}{name.replace('_', '-')}: {rest}"


# Write failures the machine, not draftcert, decided (read-only, no permission, no space): one line, no traceback.
_UNWRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        # only the commands that keep their work (profile, reproduce-paper, train-drafter) can resume
        print("interrupted; rerun the same command to resume" if getattr(args, "resumable", False) else "interrupted",
              file=sys.stderr)
        return 130
    except ValueError as exc:
        print(f"draftcert: error: {name_option(str(exc), args)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`draftcert demo | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    except OSError as exc:  # after BrokenPipeError (an OSError too): a folder that became unwritable mid-run
        if exc.errno not in _UNWRITABLE or not exc.filename:
            raise
        print(f"draftcert: error: cannot write {str(exc.filename)!r} ({exc.strerror}); "
              "rerun with an output folder you can write to", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
