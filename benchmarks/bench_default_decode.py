"""`draftcert decode --baseline` exactly as a new user runs it, on held-out prompts: the issue's goal figure.

    PYTHONPATH=src python benchmarks/bench_default_decode.py                      # default settings
    PYTHONPATH=src python benchmarks/bench_default_decode.py --drafter default -k 1   # another setting, same prompts

Each prompt runs ``draftcert decode --baseline --max-new-tokens 128 --prompt TEXT --json`` in a fresh
process (model loading, the fastlinear plan and the ``-k auto`` cost curve come from the user's
cache, as they would; delete ``~/.cache/draftcert/{fastlinear,costs}`` to time a first run).  The
decode times itself and the target alone in turns (``--repeats``, default 3) and reports the median
speedup and whether strict's output equals the target's greedy output.  Extra arguments after the
options are passed to ``draftcert decode`` unchanged.

The default prompts are MT-Bench 81 and 84 and HumanEval 0 and 2: held out of every training set
(``train.data.heldout_texts``), chosen before any drafter was tuned on them.  Last lines:
``speedup_<prompt>=`` per prompt, ``lossless=`` (every output identical), ``geomean_speedup=``.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

from draftcert.prompts import load_prompts

DEFAULT_PROMPTS = "mt-bench/81,mt-bench/84,humaneval/0,humaneval/2"


def prompt_text(pid: str) -> str:
    source = pid.split("/", 1)[0]
    for p in load_prompts(source):
        if p.id == pid:
            return p.text
    raise ValueError(f"--prompts: no prompt {pid!r} in {source!r} (ids look like mt-bench/81, humaneval/0)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS, help=f"comma-separated prompt ids (default {DEFAULT_PROMPTS})")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args, extra = ap.parse_known_args(argv)
    ids = [p.strip() for p in args.prompts.split(",") if p.strip()]
    texts = {pid: prompt_text(pid) for pid in ids}  # a bad id fails before anything runs
    speedups, lossless = {}, True
    for pid in ids:
        cmd = [sys.executable, "-m", "draftcert", "decode", "--baseline", "--repeats", str(args.repeats),
               "--max-new-tokens", str(args.max_new_tokens), "--json", "--no-progress", *extra, "--prompt", texts[pid]]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            sys.stderr.write(run.stderr)
            raise SystemExit(f"{pid}: draftcert decode exited with {run.returncode}")
        s = json.loads(run.stdout.strip().splitlines()[-1])["summary"]
        choice = next((ln.split("-k auto: ", 1)[1] for ln in run.stderr.splitlines() if "-k auto: " in ln), None)
        speedups[pid] = s["speedup"]
        lossless &= bool(s["baseline_match"])
        pos = " ".join(f"{a:.2f}" for a in s["acceptance_rate_per_pos"][:4])
        print(f"{pid}: {s['emitted']} tokens, {s['tokens_per_forward']:.2f} tokens/forward, acceptance_rate_per_pos "
              f"{pos}, {s['tokens_per_second']:.2f} tokens/s, speedup {s['speedup']:.2f}x"
              f"{'' if s['timing_reliable'] is not False else ' (UNRELIABLE)'}, identical {s['baseline_match']}"
              + (f"; -k auto: {choice.split(';')[0]}" if choice else ""), flush=True)
    for pid, v in speedups.items():
        print(f"speedup_{pid.replace('/', '_').replace('-', '_')}={v:.3f}")
    print(f"lossless={lossless}")
    print(f"geomean_speedup={math.exp(sum(map(math.log, speedups.values())) / len(speedups)):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
