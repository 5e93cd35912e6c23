"""Suffix-match candidates (``draftcert.drafting.suffix``) on the embedded target: ``default`` vs
``default+suffix`` vs ``suffix``, strict, against the target alone, on held-out prompts.

    PYTHONPATH=src python benchmarks/bench_suffix.py                   # 4 MT-Bench + 4 HumanEval, 128 tokens, 3 repeats
    PYTHONPATH=src python benchmarks/bench_suffix.py --quick           # 1 + 1 prompts x 32 tokens, 1 repeat

Per prompt, every method (the target's own greedy decoding included) runs once per repeat, in
turns (``decode.timing.interleave``: the order alternates per repeat), so that load changes on a
shared machine hit every method alike; a method's time on a prompt is the median of its repeats.
Figures: tokens per target forward (exact counts), tokens/s (total tokens / sum of median times),
and the geometric mean over prompts of the speed-up (target time / method time).  Every strict
output is checked against the target's greedy output.

The suffix index has no memory across sequences here (``SuffixStore(0)``): the candidates come from
the prompt and the text generated so far, so repeats cannot draft from their own earlier run.  One
extra pass decodes the prompts in order with a shared store (earlier prompts' outputs as
candidates, as a process serving many requests would) and reports its tokens per forward only.

Then the index's own cost: ``draft`` (index the new tokens + match + trie) per round on a sequence
of a few thousand tokens, and indexing a prompt of that length at ``start``.

Last lines: ``name=value``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def index_costs(tokens: list[int], rounds: int = 400) -> dict:
    """Seconds per ``SuffixIndex.draft`` round (a few new tokens each) after a prompt of len(tokens) - rounds * 3."""
    from draftcert.drafting.suffix import SuffixIndex, SuffixStore

    ix = SuffixIndex(store=SuffixStore(0))
    n0 = len(tokens) - rounds * 3
    t0 = time.perf_counter()
    ix.start(tokens[:n0])
    start_s = time.perf_counter() - t0
    per = []
    for r in range(rounds):
        seq = tokens[: n0 + 3 * (r + 1)]
        t0 = time.perf_counter()
        ix.draft(seq, [1], False, 16)
        per.append(time.perf_counter() - t0)
    return {"prompt_tokens": n0, "start_s": start_s, "draft_median_s": statistics.median(per), "draft_max_s": max(per),
            "draft_p99_s": sorted(per)[int(0.99 * (len(per) - 1))]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mt-bench", type=int, default=4)
    ap.add_argument("--humaneval", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.mt_bench, args.humaneval, args.max_new_tokens, args.repeats = 1, 1, 32, 1
    torch.set_num_threads(args.threads)

    from draftcert.decode import greedy_generate, make_drafter, speculative_generate
    from draftcert.drafting.feature_drafter import FeatureDrafter
    from draftcert.drafting.suffix import HybridDrafter, SuffixDrafter, SuffixIndex, SuffixStore
    from draftcert.decode.timing import interleave
    from draftcert.models import load_target
    from draftcert.prompts import encode_prompt, load_prompts

    target, tok = load_target(None)
    feature = make_drafter("default", target, tok)  # the shipped feature drafter (FeatureDrafter)
    no_store = SuffixStore(0)
    methods = {  # name -> (drafter, k): k as draftcert decode's default for the drafter
        "default": (feature, 1),
        "default+suffix": (HybridDrafter(FeatureDrafter(feature.model), SuffixIndex(store=no_store)), 1),
        "suffix": (SuffixDrafter(SuffixIndex(store=no_store)), 4),
    }
    prompts = load_prompts("mt-bench", args.mt_bench) + load_prompts("humaneval", args.humaneval)
    enc = [list(encode_prompt(tok, p.text)) for p in prompts]
    n = args.max_new_tokens
    print(f"{len(enc)} prompts x {n} tokens, strict, {args.repeats} repeat(s), {args.threads} thread(s); "
          "the machine may be shared: tokens/s are noisy, tokens/forward are exact")

    for drafter, k in methods.values():  # untimed warm-up
        speculative_generate(target, drafter, enc[0], "strict", k=k, max_new_tokens=8)
    greedy_generate(target, enc[0], 8)

    rows = {name: {"tokens": 0, "forwards": 0, "seconds": 0.0, "speedups": [], "suffix_acc": 0, "suffix_drafted": 0}
            for name in methods}
    base_seconds = 0.0
    for i, (p, ids) in enumerate(zip(prompts, enc)):
        ref = greedy_generate(target, ids, n)
        results = {}

        def run_target():
            t0 = time.perf_counter()
            greedy_generate(target, ids, n)
            return time.perf_counter() - t0

        def make_run(name):
            drafter, k = methods[name]

            def run():
                a0, d0 = getattr(drafter, "suffix_accepted", 0), getattr(drafter, "suffix_drafted", 0)
                t0 = time.perf_counter()
                res = speculative_generate(target, drafter, ids, "strict", k=k, max_new_tokens=n)
                dt = time.perf_counter() - t0
                if res.tokens != ref:
                    raise AssertionError(f"{name} on {p.id}: strict output differs from greedy")
                acc, dr = getattr(drafter, "suffix_accepted", 0) - a0, getattr(drafter, "suffix_drafted", 0) - d0
                results[name] = (res.stats, acc, dr)
                return dt

            return run

        names = list(methods)
        times = interleave([run_target] + [make_run(m) for m in names], args.repeats)
        t_base = statistics.median(times[0])
        base_seconds += t_base
        line = [f"{p.id}: target {len(ref) / t_base:.2f} tok/s"]
        for name, ts in zip(names, times[1:]):
            st, acc, dr = results[name]
            t = statistics.median(ts)
            r = rows[name]
            r["tokens"] += len(ref)
            r["forwards"] += st.target_forwards
            r["seconds"] += t
            r["speedups"].append(t_base / t)
            r["suffix_acc"] += acc
            r["suffix_drafted"] += dr
            line.append(f"{name} {len(ref) / t:.2f} tok/s {len(ref) / st.target_forwards:.2f} tok/fwd")
        print(", ".join(line), flush=True)

    # a shared store across the prompts, in order: tokens per forward only
    shared = SuffixStore()
    hyb = HybridDrafter(FeatureDrafter(feature.model), SuffixIndex(store=shared))
    sfx = SuffixDrafter(SuffixIndex(store=shared))
    store_fwd = {"default+suffix": [0, 0], "suffix": [0, 0]}
    for name, drafter, k in (("default+suffix", hyb, 1), ("suffix", sfx, 4)):
        shared.clear()
        for ids in enc:
            res = speculative_generate(target, drafter, ids, "strict", k=k, max_new_tokens=n)
            store_fwd[name][0] += len(res.tokens)
            store_fwd[name][1] += res.stats.target_forwards

    total = rows["default"]["tokens"]
    print("\n| method | tokens/forward | tokens/s | speed-up vs target (geo. mean) | suffix nodes accepted / drafted |")
    print("|---|---:|---:|---:|---:|")
    print(f"| target alone | 1.00 | {total / base_seconds:.2f} | 1.00 | - |")
    for name, r in rows.items():
        sfx_cell = f"{r['suffix_acc']} / {r['suffix_drafted']}" if name == "default+suffix" else "-"
        print(f"| {name} | {r['tokens'] / r['forwards']:.3f} | {r['tokens'] / r['seconds']:.2f} | "
              f"{geomean(r['speedups']):.3f} | {sfx_cell} |")
    for name, (t, f) in store_fwd.items():
        print(f"with a store across the prompts: {name} {t / f:.3f} tokens/forward")

    text = sum(enc, [])  # a few thousand tokens of real prompt text, repeated up to 4000
    while len(text) < 4000:
        text = text + text
    costs = index_costs(text[:4000])
    print(f"\nindex cost on a {costs['prompt_tokens']}-token prompt (+3 tokens a round): start (index the prompt) "
          f"{costs['start_s'] * 1e3:.2f} ms; draft per round median {costs['draft_median_s'] * 1e6:.0f} us, "
          f"p99 {costs['draft_p99_s'] * 1e6:.0f} us, max {costs['draft_max_s'] * 1e6:.0f} us")
    print()
    for name, r in rows.items():
        key = name.replace("+", "_plus_")
        print(f"tokens_per_forward_{key}={r['tokens'] / r['forwards']:.4f}")
        print(f"speedup_geomean_{key}={geomean(r['speedups']):.4f}")
    print(f"index_draft_median_us={costs['draft_median_s'] * 1e6:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
