"""Decoding speed alone and next to a busy process, by OpenMP spin count (the launcher's choice).

For each GOMP_SPINCOUNT value, a fresh interpreter (libgomp reads the variable when torch loads)
greedy-decodes the embedded target (2 threads) alone, then with a ``while True: pass`` process
on the same machine, and prints tokens/s.  The last lines are ``name=value`` figures: for the
launcher's value and torch's default, tokens/s alone and next to the busy process, and
``busy_slowdown_<spin>`` = alone / busy.

    python benchmarks/bench_spin.py [--spins 300000,10000,3000] [--tokens 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from draftcert_launcher import SPIN_COUNT

CHILD = """
import time, torch
from draftcert.decode import greedy_generate
from draftcert.models import load_target
torch.set_num_threads(2)
model, tok = load_target()
ids = tok("Explain KV caching in two sentences.")["input_ids"]
greedy_generate(model, ids, 8)  # warm-up
t = time.perf_counter()
out = greedy_generate(model, ids, {tokens})
print(len(out) / (time.perf_counter() - t))
"""


def tokens_per_second(spin: str, tokens: int, busy: bool) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["GOMP_SPINCOUNT"] = spin
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        r = subprocess.run([sys.executable, "-c", CHILD.format(tokens=tokens)], env=env, capture_output=True,
                           text=True, timeout=600, check=True)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    return float(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spins", default=f"300000,10000,{SPIN_COUNT}")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    spins = [s.strip() for s in a.spins.split(",") if s.strip()]
    res = {}
    for spin in spins:
        for busy in (False, True):
            runs = [tokens_per_second(spin, a.tokens, busy) for _ in range(a.repeats)]
            res[spin, busy] = statistics.median(runs)
            print(f"GOMP_SPINCOUNT={spin:>7} {'busy ' if busy else 'alone'}: "
                  + " ".join(f"{x:.1f}" for x in runs) + " tokens/s", flush=True)
    for spin in spins:
        print(f"alone_tps_{spin}={res[spin, False]:.2f}")
        print(f"busy_tps_{spin}={res[spin, True]:.2f}")
        print(f"busy_slowdown_{spin}={res[spin, False] / res[spin, True]:.2f}")


if __name__ == "__main__":
    main()
