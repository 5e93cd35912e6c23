"""Resident memory while ``train-drafter`` computes radii: glibc's heap with and without ``radii_of``
handing its free pages back (``train.distill_data.RELEASE_EVERY``).

Each example's radius needs the target's ``[T, V]`` logits and a few temporaries of that size; once
glibc's mmap threshold has risen, they come from the heap, and the holes they leave stayed resident.
Each mode runs in a fresh process: ``--examples`` synthetic examples (random features of 60..384
positions, the embedded target's output layer), in chunks of 64, printing the resident set after
each chunk.

    python benchmarks/bench_radii_memory.py [--examples 256] [--threads 1]

Last lines, ``name=value``: ``rss_growth_mb_kept`` (no release) and ``rss_growth_mb_released`` (the
library's), from before the first example to after the last; ``mb_per_example_kept`` and
``mb_per_example_released``, the growth per example after the first chunk (what a long run adds).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys


def child(mode: str, n: int, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    from draftcert.models import load_target
    from draftcert.train import distill_data

    if mode == "kept":
        distill_data.RELEASE_EVERY = 10 ** 9  # never
    target, _ = load_target(None)
    H, rng = target.config.hidden_size, random.Random(0)

    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2 ** 20

    start, first, kept = rss_mb(), None, []
    for i in range(0, n, 64):
        examples = [{"features": torch.randn(rng.randint(60, 384), H) * 0.5, "ids": [0]} for _ in range(min(64, n - i))]
        distill_data.radii_of(target, examples, "strict", lambda *a: None)
        kept += [(e["radius"], e["teacher_lse"], e["teacher_negent"]) for e in examples]  # what a run keeps
        first = rss_mb() if first is None else first
        print(f"{mode}: {i + len(examples)} examples, {rss_mb():.0f} MB resident", file=sys.stderr, flush=True)
    print(json.dumps({"start": start, "first": first, "end": rss_mb(), "n": n}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child, args.examples, args.threads)
        return 0
    out = {}
    for mode in ("kept", "released"):
        run = subprocess.run([sys.executable, __file__, "--child", mode, "--examples", str(args.examples),
                              "--threads", str(args.threads)], stdout=subprocess.PIPE, text=True)
        if run.returncode:
            raise SystemExit(f"{mode}: exited with {run.returncode}")
        out[mode] = json.loads(run.stdout.strip().splitlines()[-1])
    for mode, r in out.items():
        print(f"rss_growth_mb_{mode}={r['end'] - r['start']:.0f}")
    for mode, r in out.items():  # after the first chunk (the allocator's and torch's start-up aside)
        print(f"mb_per_example_{mode}={(r['end'] - r['first']) / max(1, r['n'] - 64):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
