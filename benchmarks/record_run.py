"""Run a benchmark and append what it printed to its log in ``benchmarks/results/``.

    PYTHONPATH=src python benchmarks/record_run.py bench_pair.py --quick
    PYTHONPATH=src python benchmarks/record_run.py bench_default_decode.py --weights gguf,gguf-q8

The benchmark runs as ``python benchmarks/<script> ARGS`` with its output shown as it comes; when it
exits 0, ``benchmarks/results/<script stem>_runs.md`` gets a section headed by the date, the CPU
(``/proc/cpuinfo``'s model name, the cores and torch's thread count), the exact command and the git
commit, then the output verbatim.  The docs pages quote the current table and link to these logs for
the history (docs are reference; a run's log belongs here).  A failed run appends nothing and
returns the benchmark's exit status.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def cpu_line() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE, capture_output=True,
                               text=True, timeout=30).stdout.strip()
        return out.stdout.strip() + (" (uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or not (HERE / argv[0]).is_file():
        print("usage: python benchmarks/record_run.py SCRIPT.py [ARGS...] (a script in benchmarks/)", file=sys.stderr)
        return 2
    script, args = argv[0], argv[1:]
    cmd = [sys.executable, str(HERE / script), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:  # shown as it comes, kept for the log
        sys.stdout.write(line)
        sys.stdout.flush()
        lines.append(line)
    code = proc.wait()
    if code != 0:
        print(f"record_run: {script} exited with {code}; nothing recorded", file=sys.stderr)
        return code
    log = HERE / "results" / f"{Path(script).stem}_runs.md"
    head = (f"\n## {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}, {cpu_line()}\n\n"
            f"`python benchmarks/{shlex.join([script, *args])}` at commit {commit()}\n\n```\n")
    with open(log, "a") as f:
        if f.tell() == 0:
            f.write(f"# {script}: recorded runs\n\nAppended by `benchmarks/record_run.py`, newest last.\n")
        f.write(head + "".join(lines).rstrip("\n") + "\n```\n")
    print(f"record_run: appended to {log.relative_to(HERE.parent)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
