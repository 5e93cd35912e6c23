"""The profiler's float64 divergence pass, fused (logit_pass.c) against torch's, in one run.

Times ``divergences.divergences_from_logits`` (KL both ways, TV, log Z_q and the certificate's
enclosure of KL(p||q)) on rows of float32 logits shaped like the Qwen pair's, with the fused
native pass and with torch's chunked pass (``DRAFTCERT_FUSED_DIVERGENCE=0``'s path), alternating
which goes first each round, and checks that the two enclosures meet on every row.

    python benchmarks/bench_logit_pass.py [--rows 64] [--vocab 151936] [--threads 2] [--repeats 7]

Prints ``fused_ms_per_row=``, ``torch_ms_per_row=`` and ``fused_speedup=`` (torch ÷ fused, fastest
round of each) last.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from draftcert import divergences as D

    why = D.fused_pass_reason()
    if why:
        print(f"fused pass unavailable: {why}")
        return 1
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, args.vocab, generator=g) * 2.5  # logits: a broad body ...
    x[:, :64] += 6 * torch.randn(args.rows, 64, generator=g)  # ... and a few dominant tokens
    y = x + 0.5 * torch.randn(args.rows, args.vocab, generator=g)

    def torch_pass():
        return D._pair_bounds(args.vocab, *D._torch_reductions(x, y, True), True)

    runs = {"fused": lambda: D.divergences_from_logits(x, y), "torch": torch_pass}
    best = {k: float("inf") for k in runs}
    for f in runs.values():
        f()  # warm: build, allocator
    for r in range(args.repeats):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            t0 = time.perf_counter()
            runs[name]()
            best[name] = min(best[name], time.perf_counter() - t0)
    a, b = runs["fused"](), torch_pass()
    meet = bool(((a["lo"] <= b["hi"]) & (b["lo"] <= a["hi"])).all())
    print(f"rows={args.rows} vocab={args.vocab} threads={args.threads} repeats={args.repeats} enclosures_meet={meet}")
    print(f"max |kl fused - kl torch| = {float((a['kl'] - b['kl']).abs().max()):.3g}, "
          f"enclosure width up to {float((a['hi'] - a['lo']).max()):.3g}")
    fused, base = best["fused"] * 1e3 / args.rows, best["torch"] * 1e3 / args.rows
    print(f"fused_ms_per_row={fused:.4f}")
    print(f"torch_ms_per_row={base:.4f}")
    print(f"fused_speedup={base / fused:.3f}")
    return 0 if meet else 1


if __name__ == "__main__":
    sys.exit(main())
