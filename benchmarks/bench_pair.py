"""Wall-clock speed on the real pair: Qwen2.5-Coder-1.5B-Instruct drafted by -0.5B-Instruct
(``--pair qwen2.5-coder``, docs/pair.md), against the target alone and transformers' assisted
generation with the same assistant, on held-out chat (ShareGPT) and code (HumanEval) prompts.

    PYTHONPATH=src python benchmarks/bench_pair.py                  # 4 + 4 prompts x 128 tokens
    PYTHONPATH=src python benchmarks/bench_pair.py --quick          # 1 + 1 prompts x 32 tokens
    PYTHONPATH=src python benchmarks/bench_pair.py --costs-only     # the dtype measurement

Methods (each prompt runs every method once per repeat, in an order rotated per prompt and
repeat, so that load changes on a shared machine hit every method alike; a method's figure per
prompt is the median of its repeats, and its tokens/s is total tokens over the sum of those):

(a) ``target``: ``target.generate(do_sample=False)``, the target alone (the reference output).
(b) ``hf-assisted``: ``target.generate(do_sample=False, assistant_model=<0.5B>)``, transformers'
    assisted generation with the same drafter: the peer a user would pick instead.
(c) ``dc:RULE:SHAPE``: ``speculative_generate`` with the 0.5B drafter, live certificates on, as a
    chain (``kN``) or a tree (``treeMxD``: top-M children along the greedy path, depth D).

Strict rows should be identical to (a) (column ``identical``, with the first differing position
per prompt otherwise); every dc row reports its drift (fraction of emitted tokens that are not the
target's argmax after the decode's own prefix, from the decoder's statistics).
Chat prompts are ShareGPT's held-out split (``load_prompts("sharegpt")``, never used for
training), code prompts HumanEval's first ones.

``--costs-only``: the compute-dtype measurement of docs/pair.md: for each dtype, the target's
forward after a prompt cache with 1, 2, 4 and 6 rows (the verification pass sizes) and the
drafter's 1-row forward.  The pair is loaded once and cast in place from dtype to dtype, in
turns, ``--cost-rounds`` rounds of ``--cost-repeats`` repeats each; medians and minima over all.

Last lines: ``pair_speedup_strict=`` (best strict dc tokens/s / target), ``pair_ratio_vs_hf_assisted=``
(best strict dc / hf-assisted), ``pair_speedup_best=`` (best dc, any rule / target).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from _methods import parse_dc  # benchmarks/_methods.py (python puts this folder first)

DEFAULT_METHODS = [
    "target", "hf-assisted",
    "dc:strict:k3", "dc:strict:k5", "dc:strict:tree2x4",
    "dc:topm:2:k5", "dc:entropy:0.09:0.3:k5",
]  # fmt: skip
TARGET, DRAFTER = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"


def run_method(method, target, tok, drafter, ids, n_new):
    """(tokens, seconds, stats or None) of one greedy continuation of ``ids``."""
    from draftcert.decode import speculative_generate

    x = torch.tensor([ids])
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    t0 = time.perf_counter()
    with torch.inference_mode():
        if method in ("target", "hf-assisted"):
            extra = {"assistant_model": drafter} if method == "hf-assisted" else {}
            out = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n_new,
                                  pad_token_id=pad, **extra)  # fmt: skip
            toks, st = out[0, len(ids) :].tolist(), None
        else:
            rule, kw = parse_dc(method)
            res = speculative_generate(target, drafter, ids, rule, max_new_tokens=n_new, tokenizer=tok, **kw)
            toks, st = res.tokens, res.stats
    return toks, time.perf_counter() - t0, st


def load_pair(dtype):
    from draftcert.models import load_drafter, load_target

    target, tok = load_target(TARGET, dtype=dtype)
    drafter = load_drafter(DRAFTER, target, tok, dtype=dtype)
    return target, tok, drafter


def forward_costs(target, drafter, ids, reps: int, rows=(1, 2, 4, 6)) -> dict:
    """Seconds of target passes of n rows after the prompt's cache, and of a drafter row:
    ``{"target_n": [reps timings], "drafter_1": [...]}``."""
    from draftcert.decode.tree import crop_cache
    from draftcert.models.hf import model_forward, new_cache

    out = {f"target_{n}": [] for n in rows} | {"drafter_1": []}
    with torch.inference_mode():
        caches = {}
        for name, model in (("target", target), ("drafter", drafter)):
            caches[name] = new_cache(model)
            model_forward(model, caches[name], ids, 1)
        S = len(ids)
        for _ in range(reps):  # the sizes interleaved, so that load changes hit them alike
            for n in rows:
                t0 = time.perf_counter()
                model_forward(target, caches["target"], ids[-1:] * n, n)
                out[f"target_{n}"].append(time.perf_counter() - t0)
                crop_cache(caches["target"], S)
            t0 = time.perf_counter()
            model_forward(drafter, caches["drafter"], ids[-1:], 1)
            out["drafter_1"].append(time.perf_counter() - t0)
            crop_cache(caches["drafter"], S)
    return out


def costs_only(args, ids_text: str) -> int:
    """The pair is loaded once in float32 and cast in place to each dtype in turn, round after
    round (f32, bf16, f16, f32, bf16, ...), so that every dtype meets the same machine load and
    only one copy of the weights is held (9.6 GB).  Casting back up from bfloat16 changes the
    weights' values, not their cost: these are timings only."""
    from draftcert.models.hf import parse_dtype
    from draftcert.prompts import encode_prompt

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    target, tok, drafter = load_pair("float32")
    ids = encode_prompt(tok, ids_text)
    print(f"forward costs after a {len(ids)}-token prompt, {torch.get_num_threads()} thread(s), {args.cost_rounds} "
          f"round(s) x {args.cost_repeats} repeats per dtype, dtypes in turn", flush=True)  # fmt: skip
    res: dict[str, dict[str, list[float]]] = {d: {} for d in dtypes}
    for r in range(args.cost_rounds):
        for d in dtypes:
            target.to(parse_dtype(d))
            drafter.to(parse_dtype(d))
            try:
                c = forward_costs(target, drafter, ids, args.cost_repeats)
            except Exception as e:  # a dtype without CPU kernels: report it and go on
                print(f"{d}: forward fails ({type(e).__name__}: {e})", flush=True)
                continue
            for k, v in c.items():
                res[d].setdefault(k, []).extend(v)
            med = {k: statistics.median(v) for k, v in c.items()}
            print(f"round {r + 1} {d}: target 1 row {med['target_1'] * 1e3:.1f} ms, "
                  + ", ".join(f"{n} rows {med[f'target_{n}'] / med['target_1']:.2f}x" for n in (2, 4, 6))
                  + f"; drafter {med['drafter_1'] * 1e3:.1f} ms", flush=True)  # fmt: skip
    for stat, f in (("median", statistics.median), ("min", min)):
        print(f"\n{stat} over all repeats | dtype | target ms/token | 2 rows | 4 rows | 6 rows | drafter ms/token | "
              "drafter / target |")  # fmt: skip
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for d, c in res.items():
            if not c:
                print(f"| {stat} | {d} | failed | | | | | |")
                continue
            m = {k: f(v) for k, v in c.items()}
            t1 = m["target_1"]
            print(f"| {stat} | {d} | {t1 * 1e3:.1f} | {m['target_2'] / t1:.2f} | {m['target_4'] / t1:.2f} | "
                  f"{m['target_6'] / t1:.2f} | {m['drafter_1'] * 1e3:.1f} | {m['drafter_1'] / t1:.3f} |")  # fmt: skip
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chat", type=int, default=4, help="held-out ShareGPT prompts (default 4)")
    ap.add_argument("--code", type=int, default=4, help="HumanEval prompts (default 4)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats per prompt and method (default 3)")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated; see the module docstring")
    ap.add_argument("--dtype", default=None, help="compute dtype (default: the pair's, models.PAIR_DTYPE)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="1 + 1 prompts x 32 tokens, 1 repeat")
    ap.add_argument("--costs-only", action="store_true", help="only the per-dtype forward costs (docs/pair.md)")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16", help="dtypes for --costs-only")
    ap.add_argument("--cost-repeats", type=int, default=3, help="repeats per dtype and round (default 3)")
    ap.add_argument("--cost-rounds", type=int, default=3, help="rounds over the dtypes, in turn (default 3)")
    args = ap.parse_args(argv)
    if args.quick:
        args.chat, args.code, args.max_new_tokens, args.repeats = 1, 1, 32, 1
    torch.set_num_threads(args.threads)

    from draftcert.models import PAIR_DTYPE
    from draftcert.prompts import encode_prompt, load_prompts

    prompts = load_prompts("sharegpt", args.chat) + load_prompts("humaneval", args.code)
    if args.costs_only:
        return costs_only(args, prompts[0].text)
    dtype = args.dtype or PAIR_DTYPE
    target, tok, drafter = load_pair(dtype)
    enc = [list(encode_prompt(tok, p.text)) for p in prompts]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if "target" not in methods:
        methods.insert(0, "target")
    print(f"pair qwen2.5-coder ({TARGET} drafted by {DRAFTER}), {dtype}; {args.chat} chat + {args.code} code "
          f"prompts x {args.max_new_tokens} tokens, {args.repeats} repeats, {args.threads} thread(s)", flush=True)

    for m in methods:  # warm-up (first-call allocations, lazy imports) on a short run of every method
        run_method(m, target, tok, drafter, enc[0], 8)

    secs = {m: [[] for _ in enc] for m in methods}
    toks = {m: [None] * len(enc) for m in methods}
    stats = {m: [None] * len(enc) for m in methods}
    for r in range(args.repeats):
        for i, ids in enumerate(enc):
            order = methods[(i + r) % len(methods) :] + methods[: (i + r) % len(methods)]
            for m in order:
                t, sec, st = run_method(m, target, tok, drafter, ids, args.max_new_tokens)
                secs[m][i].append(sec)
                toks[m][i], stats[m][i] = t, st
        print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)

    ref = toks["target"]
    rows = []
    for m in methods:
        sec = sum(statistics.median(s) for s in secs[m])
        n = sum(len(t) for t in toks[m])
        row = {"method": m, "tok_s": n / sec, "identical": all(t == g for t, g in zip(toks[m], ref)),
               "first_diff": [next((j for j, (a, b) in enumerate(zip(t, g)) if a != b), None) for t, g in zip(toks[m], ref)],
               "spread": max((max(s) - min(s)) / statistics.median(s) for s in secs[m])}  # fmt: skip
        sts = [s.summary() for s in stats[m] if s is not None]
        if sts:
            # drift: emitted tokens that are not the target's argmax after the decode's own prefix
            row["drift"] = sum(s["drift_tokens"] for s in sts) / max(sum(s["emitted"] for s in sts), 1)
            row["tokens_per_forward"] = sum(s["emitted"] for s in sts) / sum(s["target_forwards"] for s in sts)
            cert = [s["certified_fraction"] for s in sts if s.get("certified_fraction") is not None]
            row["certified"] = sum(cert) / len(cert) if cert else None
        rows.append(row)

    base = next(r["tok_s"] for r in rows if r["method"] == "target")
    print("\n| method | tokens/s | vs target | tokens/forward | certified | drift | identical to greedy (first difference) "
          "| repeat spread |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        tpf = f"{r['tokens_per_forward']:.2f}" if "tokens_per_forward" in r else "-"
        cert = f"{r['certified']:.3f}" if r.get("certified") is not None else "-"
        drift = f"{r['drift']:.3f}" if "drift" in r else "-"
        first = "" if r["identical"] else " (" + ", ".join("-" if f is None else str(f) for f in r["first_diff"]) + ")"
        print(f"| {r['method']} | {r['tok_s']:.2f} | {r['tok_s'] / base:.2f} | {tpf} | {cert} | {drift} | "
              f"{r['identical']}{first} | {r['spread']:.0%} |")  # fmt: skip
    bad = [r["method"] for r in rows if r["method"].startswith("dc:strict:") and not r["identical"]]
    if bad:  # strict is exact w.r.t. the target's argmax in the verification pass; a k-row pass rounds
        # differently from generate()'s 1-row pass, which can flip a near-tie (docs/pair.md)
        print(f"WARNING: strict methods not identical to target.generate(): {', '.join(bad)}")

    strict = [r for r in rows if r["method"].startswith("dc:strict:")]
    dcs = [r for r in rows if r["method"].startswith("dc:")]
    hf = next((r for r in rows if r["method"] == "hf-assisted"), None)
    if not strict:
        return 0
    bs, bb = max(strict, key=lambda r: r["tok_s"]), max(dcs, key=lambda r: r["tok_s"])
    print(f"\nbest strict: {bs['method']}; best overall: {bb['method']} (drift {bb.get('drift', 0):.3f})"
          + (f"; hf-assisted {hf['tok_s'] / base:.2f}x the target" if hf else ""))
    print(f"pair_speedup_strict={bs['tok_s'] / base:.3f}")
    if hf:
        print(f"pair_ratio_vs_hf_assisted={bs['tok_s'] / hf['tok_s']:.3f}")
    print(f"pair_speedup_best={bb['tok_s'] / base:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
