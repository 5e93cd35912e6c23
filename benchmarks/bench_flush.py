"""The profiler's certificate work per step, on rows shaped like the Qwen pair's, in one run.

Two parts of the profile overhead on the pair (``profile/batches.py``):

* **the target summary** of each step (``StepCertifier.summarize_step``: normaliser, entropy,
  top-k), with the native moments pass (``logit_pass.c``'s ``lp_logit_moments``) against torch's
  two-pass moments (``DRAFTCERT_FUSED_SUMMARY=0``'s path, read on every call);
* **the flush** of a group of pending steps (``StepCertifier.rows`` with the drafter's logits:
  the radii of every default rule, the divergence pass, the drafter's top-k, ranks, acceptance
  and certificates), per row, for the group sizes that ``GROUP_ELEMENTS`` = 2^21 (the old
  setting) and 2^23 (today's) give at this vocabulary.

Rounds alternate which variant goes first; each figure is the fastest round.  Synthetic logits:
a broad body (``randn * 2.5``) and 64 dominant tokens (``+ 8 + 4 randn``), the drafter's a
perturbation of the target's (``+ 0.5 randn``).

    python benchmarks/bench_flush.py [--step-rows 8] [--vocab 151936] [--threads 2] [--repeats 5]

Prints ``summary_fused_ms_per_row=``, ``summary_torch_ms_per_row=``, ``flush_rows_old=``,
``flush_ms_per_row_old=``, ``flush_rows_new=``, ``flush_ms_per_row_new=`` and
``flush_speedup=`` (old ÷ new per row) last.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch


def _logits(rows: int, vocab: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(rows, vocab, generator=g) * 2.5  # a broad body ...
    # ... and 64 dominant tokens: median top-1 probability ~0.6, top-16 mass ~0.98, as a language
    # model's (flatter rows would send most radii to the exact pass beyond the top-k)
    x[:, :64] += 8 + 4 * torch.randn(rows, 64, generator=g)
    return x, x + 0.5 * torch.randn(rows, vocab, generator=g)


def _best(runs: dict, repeats: int) -> dict[str, float]:
    best = {k: float("inf") for k in runs}
    for f in runs.values():
        f()  # warm: build, allocator
    for r in range(repeats):
        for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
            t0 = time.perf_counter()
            runs[name]()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-rows", type=int, default=8, help="rows a decode step adds (the profile's batch size)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from draftcert import logit_pass
    from draftcert.criteria import DEFAULT_CRITERIA
    from draftcert.profile.settings import parse_criteria
    from draftcert.profile.batches import GROUP_ELEMENTS
    from draftcert.profile.trace import StepCertifier

    why = logit_pass.reason("summary")
    if why:
        print(f"fused summary unavailable: {why}")
        return 1
    V, A = args.vocab, args.step_rows
    certifier = StepCertifier(parse_criteria(DEFAULT_CRITERIA))
    # a group closes once it holds >= GROUP_ELEMENTS logits (batches._groups): whole steps
    steps_of = {"old": math.ceil((1 << 21) / (A * V)), "new": math.ceil(GROUP_ELEMENTS / (A * V))}
    n_steps = max(steps_of.values())
    g = torch.Generator().manual_seed(0)
    steps = [_logits(A, V, g) for _ in range(n_steps)]

    def summarize_all(fused: bool):
        def run():
            os.environ["DRAFTCERT_FUSED_SUMMARY"] = "1" if fused else "0"
            return [certifier.summarize_step(x) for x, _ in steps]
        return run

    try:
        best = _best({"fused": summarize_all(True), "torch": summarize_all(False)}, args.repeats)
    finally:
        os.environ.pop("DRAFTCERT_FUSED_SUMMARY", None)
    summaries = [certifier.summarize_step(x) for x, _ in steps]  # today's path, as the profiler runs

    def flush(kind: str):
        k = steps_of[kind]
        summ, bads = [s for s, _ in summaries[:k]], [b for _, b in summaries[:k]]
        draft = torch.cat([y for _, y in steps[:k]])  # [k * A, V]: the group's one gather

        def run():
            return certifier.rows(summ, bads, draft)
        return run

    fbest = _best({"old": flush("old"), "new": flush("new")}, args.repeats)
    rows = {k: steps_of[k] * A for k in steps_of}
    n = n_steps * A
    print(f"vocab={V} step_rows={A} threads={args.threads} repeats={args.repeats} "
          f"criteria={len(certifier.criteria)} group_elements_new={GROUP_ELEMENTS}")
    s_f, s_t = best["fused"] * 1e3 / n, best["torch"] * 1e3 / n
    f_o, f_n = fbest["old"] * 1e3 / rows["old"], fbest["new"] * 1e3 / rows["new"]
    print(f"summary_fused_ms_per_row={s_f:.4f}")
    print(f"summary_torch_ms_per_row={s_t:.4f}")
    print(f"summary_speedup={s_t / s_f:.3f}")
    print(f"flush_rows_old={rows['old']}")
    print(f"flush_ms_per_row_old={f_o:.4f}")
    print(f"flush_rows_new={rows['new']}")
    print(f"flush_ms_per_row_new={f_n:.4f}")
    print(f"flush_speedup={f_o / f_n:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
