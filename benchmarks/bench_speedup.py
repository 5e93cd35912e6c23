"""Wall-clock speed of draftcert with the shipped feature drafter vs the target alone and vs
transformers' assisted generation, on held-out MT-Bench and HumanEval prompts (batch 1, greedy).

    PYTHONPATH=src python benchmarks/bench_speedup.py                 # 4 + 4 prompts x 128 tokens
    PYTHONPATH=src python benchmarks/bench_speedup.py --quick         # 1 + 1 prompts x 32 tokens

Methods (each prompt runs every method once per repeat, in an order rotated per prompt and
repeat, so that load changes on a shared machine hit every method alike; a method's tokens/s is
its total tokens over the sum, over prompts, of its fastest repeat):

(a) ``target``: ``target.generate(do_sample=False)``, the target alone.
(b) ``hf-pld:N``: transformers' assisted generation with prompt lookup (``prompt_lookup_num_tokens=N``),
    the assisted configuration available on this pair (there is no smaller model with the target's
    tokenizer; a ``self:skip`` assistant costs 29/30 of the target).  The best N is (b).
(c) ``dc:RULE:SHAPE``: ``speculative_generate`` with the shipped drafter (``--drafter``), live
    certificates on, as a chain (``k=K``), a tree (``treeMxD``: top-M children along the greedy path,
    depth D) or ``auto`` (what ``draftcert decode``'s default ``-k auto`` picks on this machine:
    ``draftcert.decode.draft_shape.shape.choose`` on the cached cost curve, printed with its reason).

Then the machine's cost curve, at 1 and 2 threads (``draftcert.decode.draft_shape.costs.measure``, the engine's
own timing: a verification of n = 1..9 rows after a 128-token cache (``--cost-context``), with the kernels
``draftcert.kernels.linear_chooser`` measured for this machine and with the plain layers, alternated;
one drafter round of k=1; the certificate work per round), relative to one row, and the kernel
chosen per weight shape (``--costs-only`` prints just that).

Last lines: ``speedup_strict=`` (best strict dc tokens/s / target), ``speedup_best=`` (best dc /
target), ``ratio_vs_hf_best=`` (best strict dc / best hf-pld).
"""

from __future__ import annotations

import argparse
import time

import torch
from _methods import parse_dc  # benchmarks/_methods.py (python puts this folder first)

DEFAULT_METHODS = [
    "target", "hf-pld:3", "hf-pld:10",
    "dc:strict:auto", "dc:strict:k1", "dc:strict:k2", "dc:strict:k3", "dc:strict:k4", "dc:strict:tree2x3",
    "dc:topm:2:k3", "dc:entropy:0.09:0.3:k3",
]


def run_method(method, target, tok, drafter, ids, n_new, eos, auto=None):
    from draftcert.decode import speculative_generate

    x = torch.tensor([ids])
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    t0 = time.perf_counter()
    with torch.inference_mode():
        if method == "target":
            out = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n_new, pad_token_id=pad)
            toks, st = out[0, len(ids):].tolist(), None
        elif method.startswith("hf-pld:"):
            out = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n_new, pad_token_id=pad,
                                  prompt_lookup_num_tokens=int(method.split(":")[1]))
            toks, st = out[0, len(ids):].tolist(), None
        else:
            rule, kw = parse_dc(method, auto)
            res = speculative_generate(target, drafter, ids, rule, max_new_tokens=n_new, **kw)
            toks, st = res.tokens, res.stats
    return toks, time.perf_counter() - t0, st


def cost_curve(target, drafter, threads: int, reps: int = 5, context: int = 128) -> dict:
    """The engine's cost curve at ``threads`` threads: median seconds of a verification of n = 1..9 rows
    with the measured kernels (``t``) and the plain layers (``plain``), alternated ``reps`` times; one
    drafter round of k=1 (``drafter``); the certificate work of a round verifying n rows (``cert``)."""
    from draftcert.decode.draft_shape.costs import measure
    from draftcert.drafting.make import make_drafter
    from draftcert.kernels import linear_chooser

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        linear_chooser.disable(target)
        linear_chooser.enable(target)  # this thread count's kernel choice (measured once, then cached)
        plan = linear_chooser.plan_of(target)
        src = make_drafter(drafter, target)
        runs = {"t": [], "plain": []}
        for _ in range(reps):
            runs["t"].append(measure(target, src.fork(), [((1,), False)], max_rows=9, repeats=1, context=context))
            with linear_chooser.plain_kernels(target):
                runs["plain"].append(measure(target, src.fork(), [((1,), False)], max_rows=9, repeats=1,
                                             context=context))
    finally:
        torch.set_num_threads(saved)
        linear_chooser.disable(target)
        linear_chooser.enable(target)  # back to the decoding thread count's choice
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {
        "threads": threads, "plan": plan,
        "t": {n: med([c.target[n] for c in runs["t"]]) for n in range(1, 10)},
        "plain": {n: med([c.target[n] for c in runs["plain"]]) for n in range(1, 10)},
        "drafter": med([c.drafter_round["1"] for c in runs["t"]]),
        "cert": {n: med([c.overhead[n] for c in runs["t"]]) for n in range(1, 10)},
    }


def _print_curve(c: dict) -> None:
    t1 = c["t"][1]
    print(f"cost curve, {c['threads']} thread(s) (median of alternated runs; one row = {t1 * 1e3:.1f} ms):")
    print("| rows | " + " | ".join(str(n) for n in range(1, 10)) + " |")
    print("|---" * 10 + "|")
    print("| measured kernels, vs 1 row | " + " | ".join(f"{c['t'][n] / t1:.2f}" for n in range(1, 10)) + " |")
    print("| plain layers, vs 1 row | " + " | ".join(f"{c['plain'][n] / c['plain'][1]:.2f}" for n in range(1, 10)) + " |")
    print("| certificate work, vs 1 row | " + " | ".join(f"{c['cert'][n] / t1:.3f}" for n in range(1, 10)) + " |")
    print(f"drafter round (k=1): {c['drafter'] * 1e3:.1f} ms = {c['drafter'] / t1:.3f} of one row; plain 1 row "
          f"{c['plain'][1] * 1e3:.1f} ms")
    print("kernels chosen (rows 1..9): " + "; ".join(f"{shape} " + ",".join(k[:3] for k in ks) for shape, ks in c["plan"].items()))


def _print_costs(target, drafter, reps: int, context: int) -> None:
    for threads in (1, 2):
        _print_curve(cost_curve(target, drafter, threads, reps, context))
        print()


def _auto_shape(target, drafter, dspec: str) -> dict:
    """What `draftcert decode -k auto` picks on this machine (printed with its reason)."""
    from draftcert.drafting.make import make_drafter
    from draftcert.decode.draft_shape.shape import auto_shape

    choice, source = auto_shape(target, make_drafter(drafter, target), dspec, on_note=lambda m: print(m, flush=True))
    print(f"dc:*:auto = {choice.why()}; {source}", flush=True)
    return choice.best.engine_args()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="default", help="feature drafter (default: the shipped one)")
    ap.add_argument("--mt-bench", type=int, default=4, help="MT-Bench prompts (default 4)")
    ap.add_argument("--humaneval", type=int, default=4, help="HumanEval prompts (default 4)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated; see the module docstring")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="1 + 1 prompts x 32 tokens, 1 repeat")
    ap.add_argument("--costs-only", action="store_true", help="only the cost breakdown (forward cost by token count, "
                    "at 1 and 2 threads, measured and plain kernels alternated; drafter step; certificates)")
    ap.add_argument("--cost-repeats", type=int, default=5, help="alternated runs per cost curve (median; default 5)")
    ap.add_argument("--cost-context", type=int, default=128, help="tokens in the target's cache while the cost curve "
                    "is timed (default 128)")
    args = ap.parse_args(argv)
    if args.quick:
        args.mt_bench, args.humaneval, args.max_new_tokens, args.repeats = 1, 1, 32, 1
    torch.set_num_threads(args.threads)

    from draftcert.drafting.make import make_drafter
    from draftcert.models import DEFAULT_DRAFTER, load_target
    from draftcert.prompts import encode_prompt, load_prompts

    target, tok = load_target(None)
    dspec = DEFAULT_DRAFTER if args.drafter == "default" else args.drafter
    drafter = make_drafter(dspec, target, tok)  # a drafter object (start() resets it per decode)
    prompts = load_prompts("mt-bench", args.mt_bench) + load_prompts("humaneval", args.humaneval)
    enc = [list(encode_prompt(tok, p.text)) for p in prompts]
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else [0]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.costs_only:
        _print_costs(target, drafter, args.cost_repeats, args.cost_context)
        return 0
    auto = _auto_shape(target, drafter, dspec) if any(m.endswith(":auto") for m in methods) else None
    print(f"target: embedded SmolLM2-135M-Instruct; drafter: {dspec}; {len(prompts)} prompts x {args.max_new_tokens} tokens, "
          f"{args.repeats} repeats, {args.threads} thread(s)")

    # warm-up (first-call allocations, lazy imports) on a short run of every method
    for m in methods:
        run_method(m, target, tok, drafter, enc[0], 8, eos, auto)

    best = {m: [float("inf")] * len(enc) for m in methods}
    ntok = {m: [0] * len(enc) for m in methods}
    stats = {m: [None] * len(enc) for m in methods}
    ref = [None] * len(enc)
    for r in range(args.repeats):
        for i, ids in enumerate(enc):
            order = methods[(i + r) % len(methods):] + methods[: (i + r) % len(methods)]
            for m in order:
                toks, sec, st = run_method(m, target, tok, drafter, ids, args.max_new_tokens, eos, auto)
                if m == "target":
                    ref[i] = toks
                if sec < best[m][i]:
                    best[m][i], ntok[m][i], stats[m][i] = sec, len(toks), st
                if st is not None:
                    stats[m][i] = stats[m][i] or st
                stats.setdefault("_toks", {})[(m, i)] = toks
        print(f"repeat {r + 1}/{args.repeats} done", flush=True)

    # drift against the target's own greedy decoding (strict must be identical)
    rows = []
    for m in methods:
        tps = sum(ntok[m]) / sum(best[m])
        row = {"method": m, "tok_s": tps}
        same = all(stats["_toks"][(m, i)] == ref[i] for i in range(len(enc))) if "target" in methods else None
        row["identical"] = same
        sts = [s for s in stats[m] if s is not None]
        if sts:
            # the names and definitions of docs/metrics.md (vLLM's where vLLM has the quantity)
            emitted = sum(s.emitted for s in sts)
            drafts = sum(s.num_drafts for s in sts)
            accepted = sum(s.num_accepted_tokens for s in sts)
            row["tokens_per_forward"] = emitted / sum(s.target_forwards for s in sts)
            row["mean_acceptance_length"] = 1 + accepted / drafts if drafts else None
            row["draft_acceptance_rate"] = accepted / max(sum(s.num_draft_tokens for s in sts), 1)
            row["certified_fraction"] = sum(s.certified_positions for s in sts) / max(sum(s.checked_positions for s in sts), 1)
            row["drift"] = sum(s.drift_tokens for s in sts) / max(emitted, 1)
        rows.append(row)

    base = next(r["tok_s"] for r in rows if r["method"] == "target")
    print()
    print("| method | tokens/s | vs target | tokens_per_forward | mean_acceptance_length | draft_acceptance_rate "
          "| certified_fraction | drift | identical to greedy |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        f = lambda k, fmt="{:.3f}": fmt.format(r[k]) if r.get(k) is not None else "-"
        print(f"| {r['method']} | {r['tok_s']:.2f} | {r['tok_s'] / base:.2f} | {f('tokens_per_forward', '{:.2f}')} | "
              f"{f('mean_acceptance_length', '{:.2f}')} | {f('draft_acceptance_rate')} | {f('certified_fraction')} | "
              f"{f('drift')} | {r['identical']} |")

    print()
    _print_costs(target, drafter, args.cost_repeats, args.cost_context)

    strict = [r for r in rows if r["method"].startswith("dc:strict:")]
    dcs = [r for r in rows if r["method"].startswith("dc:")]
    hf = [r for r in rows if r["method"].startswith("hf-")]
    bs = max(strict, key=lambda r: r["tok_s"]) if strict else None
    bb = max(dcs, key=lambda r: r["tok_s"]) if dcs else None
    bh = max(hf, key=lambda r: r["tok_s"]) if hf else None
    if bs:
        print(f"best strict: {bs['method']}; best overall: {bb['method']} (drift {bb.get('drift', 0):.3f})"
              + (f"; best transformers assisted: {bh['method']}" if bh else ""))
        print(f"speedup_strict={bs['tok_s'] / base:.3f}")
        print(f"speedup_best={bb['tok_s'] / base:.3f}")
        if bh:
            print(f"ratio_vs_hf_best={bs['tok_s'] / bh['tok_s']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
