"""Batched strict speculative decoding against transformers' batched greedy ``generate``.

    PYTHONPATH=src python benchmarks/bench_batch.py            # 8 MT-Bench prompts x 64 new tokens
    PYTHONPATH=src python benchmarks/bench_batch.py --quick    # 8 prompts x 32 new tokens

The embedded target (SmolLM2-135M-Instruct, float32) decodes the same N MT-Bench prompts at batch
size B = 1, 4 and 8 (N / B left-padded batches each), three ways:

* ``greedy``: ``target.generate(ids, attention_mask=..., do_sample=False)`` on the left-padded batch;
* ``default``: ``batch_speculative_generate`` under ``strict`` with the shipped feature drafter,
  k=1 (``draftcert decode``'s choice for a feature drafter);
* ``pld``: the same with prompt lookup, k=4.

Throughput = new tokens (each row up to and including its EOS) / wall seconds over all batches,
the three runs timed in turns (``decode/timing.py``) and the median of ``--repeats`` kept.  Strict
is lossless, so the speculative rows must equal the row's own greedy decoding; rows where they
differ from transformers' batched greedy are counted (a batched matmul rounds differently from a
single row's, so a near-tie may flip either way; none is expected).

The last lines are ``name=value``: ``batch{B}_ratio_vs_greedy`` (default drafter's tokens/s over
greedy's at batch B), ``pld_batch{B}_ratio_vs_greedy``, ``batch{B}_greedy_tokens_per_s``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from draftcert.decode import batch_speculative_generate, make_drafter
from draftcert.decode import batch as batch_mod
from draftcert.decode.timing import interleave, median_or_none
from draftcert.models import load_target
from draftcert.models.hf import eos_token_ids, left_pad, pad_token_id
from draftcert.prompts import encode_prompt, load_prompts


def greedy_batch(target, rows, max_new_tokens, pad_id, eos):
    """transformers' batched greedy generate on the left-padded rows; each row cut after its first EOS."""
    ids, mask, _ = left_pad(rows, pad_id, target.device)
    with torch.inference_mode():
        out = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                              pad_token_id=pad_id)
    toks = []
    for row in out[:, ids.shape[1] :].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        toks.append(row[:end])
    return toks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8,
                    help="MT-Bench prompts, a multiple of every batch size (default 8)")
    ap.add_argument("--batch-sizes", default="1,4,8", help="comma-separated batch sizes (default 1,4,8)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k-default", type=int, default=1, help="draft tokens per round, default drafter (default 1)")
    ap.add_argument("--k-pld", type=int, default=4, help="draft tokens per round, prompt lookup (default 4)")
    ap.add_argument("--repeats", type=int, default=1, help="timed repeats per run, interleaved; medians (default 1)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine may be shared)")
    ap.add_argument("--compact-holes", type=float, default=None,
                    help=f"override decode.batch.COMPACT_HOLES (default {batch_mod.COMPACT_HOLES})")
    ap.add_argument("--quick", action="store_true", help="32 new tokens instead of 64")
    a = ap.parse_args(argv)
    if a.quick:
        a.max_new_tokens = 32
    sizes = [int(s) for s in a.batch_sizes.split(",")]
    if any(s < 1 or a.prompts % s for s in sizes):
        ap.error(f"--prompts {a.prompts} must be a multiple of every batch size {sizes}")
    torch.set_num_threads(a.threads)
    if a.compact_holes is not None:
        batch_mod.COMPACT_HOLES = a.compact_holes

    target, tok = load_target(None)
    prompts = [encode_prompt(tok, p.text) for p in load_prompts("mt-bench", limit=a.prompts)]
    pad_id, eos = pad_token_id(tok, target), eos_token_ids(target, tok)
    drafters = {"default": make_drafter("default", target, tok), "pld": make_drafter("prompt-lookup")}
    ks = {"default": a.k_default, "pld": a.k_pld}
    print(f"# target: embedded SmolLM2-135M-Instruct (float32), {a.prompts} MT-Bench prompts "
          f"(lengths {min(map(len, prompts))}..{max(map(len, prompts))}) x {a.max_new_tokens} new tokens, "
          f"strict, k={ks}, torch threads={torch.get_num_threads()}, repeats={a.repeats}, "
          f"COMPACT_HOLES={batch_mod.COMPACT_HOLES}", flush=True)

    # warm up every path (allocator, first calls)
    greedy_batch(target, [p[:16] for p in prompts[:2]], 4, pad_id, eos)
    for d in drafters.values():
        batch_speculative_generate(target, d, [p[:16] for p in prompts[:2]], k=2, max_new_tokens=4, tokenizer=tok)

    lines, table = [], []
    for B in sizes:
        batches = [prompts[i : i + B] for i in range(0, a.prompts, B)]
        got: dict[str, list] = {}
        stats = {}

        def greedy_run() -> float:
            t0 = time.perf_counter()
            got["greedy"] = [t for rows in batches for t in greedy_batch(target, rows, a.max_new_tokens, pad_id, eos)]
            return time.perf_counter() - t0

        def spec_run(name):
            def run() -> float:
                t0 = time.perf_counter()
                res = [batch_speculative_generate(target, drafters[name], rows, "strict", k=ks[name],
                                                  max_new_tokens=a.max_new_tokens, tokenizer=tok) for rows in batches]
                sec = time.perf_counter() - t0
                got[name] = [t for r in res for t in r.tokens]
                stats[name] = res
                return sec
            return run

        names = ["greedy", "default", "pld"]
        times = dict(zip(names, interleave([greedy_run, spec_run("default"), spec_run("pld")], a.repeats)))
        tps = {n: sum(map(len, got[n])) / median_or_none(times[n]) for n in names}
        for n in ("default", "pld"):
            same = sum(x == y for x, y in zip(got[n], got["greedy"]))
            merged = [r.stats for r in stats[n]]
            acc = sum(s.num_accepted_tokens for s in merged) / max(1, sum(s.num_drafts for s in merged))
            fwd = sum(max(len(s.rounds) for s in r.row_stats) for r in stats[n])  # batched target passes
            table.append((B, n, tps[n], tps["greedy"], tps[n] / tps["greedy"], 1 + acc, fwd, f"{same}/{a.prompts}"))
        lines.append(f"batch{B}_ratio_vs_greedy={tps['default'] / tps['greedy']:.4f}")
        lines.append(f"pld_batch{B}_ratio_vs_greedy={tps['pld'] / tps['greedy']:.4f}")
        lines.append(f"batch{B}_greedy_tokens_per_s={tps['greedy']:.2f}")
        print(f"batch {B}: greedy {tps['greedy']:.1f} tok/s, default {tps['default']:.1f}, pld {tps['pld']:.1f}",
              flush=True)

    print("\n| batch | drafter | tokens/s | greedy tokens/s | ratio | mean acceptance length | target passes "
          "| rows = batched greedy |")
    print("|---|---|---|---|---|---|---|---|")
    for B, n, t, g, r, mal, fwd, same in table:
        print(f"| {B} | {n} | {t:.1f} | {g:.1f} | {r:.2f} | {mal:.2f} | {fwd} | {same} |")
    print()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
