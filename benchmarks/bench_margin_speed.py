"""Speed of margin bounds against the radius they bound, on the same tensor.

For each rule, times ``draftcert.margin_bound`` and ``draftcert.radius`` (forward KL unless
``--divergence`` says otherwise) on
(256, 151936) float32 LM-like logits, interleaved, and prints the ratio of medians per rule.
``margin_bound`` reads the rule's statistic and, under the floating-point contract, caps
the bound by the radius, so it costs one summary plus a little: a ratio near 1 means the
sharp bounds (closed forms for trees, rejection-gap lookups for the rest) add almost
nothing.  Before the sharp bounds, margin_bound cost the same as radius (ratio ~1.0).

Last line: ``margin_vs_radius=X``, the worst rule's ratio (target: <= 2).

    python benchmarks/bench_margin_speed.py [--rows 256] [--vocab 151936] [--repeats 5] [--rules R1,R2]
        [--divergence forward|reverse|tv]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import draftcert
from bench_certificates import lm_like_logits

RULES = ["strict", "additive:0.1", "multiplicative:0.5", "topm:2", "entropy:0.09:0.3",
         "typical:0.09:0.3", "mars:0.5", "tree:2", "tree:8"]


def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rules", default=",".join(RULES), help="comma-separated rules to time")
    ap.add_argument("--divergence", default="forward", choices=("forward", "reverse", "tv"))
    args = ap.parse_args(argv)
    x = lm_like_logits(args.rows, args.vocab)
    worst = 0.0
    for rule in args.rules.split(","):
        kind = args.divergence
        draftcert.margin_bound(rule, logits=x, divergence=kind)  # warm-up: compiles the fused kernels once
        draftcert.radius(rule, logits=x, divergence=kind)
        mb, rd = [], []
        for _ in range(args.repeats):
            mb.append(_time(lambda: draftcert.margin_bound(rule, logits=x, divergence=kind)))
            rd.append(_time(lambda: draftcert.radius(rule, logits=x, divergence=kind)))
        ratio = statistics.median(mb) / statistics.median(rd)
        worst = max(worst, ratio)
        print(f"{rule:20s} margin_bound {1e3 * statistics.median(mb):8.1f} ms   radius "
              f"{1e3 * statistics.median(rd):8.1f} ms   ratio {ratio:.3f}", flush=True)
    print(f"margin_vs_radius={worst:.3f}")


if __name__ == "__main__":
    main()
