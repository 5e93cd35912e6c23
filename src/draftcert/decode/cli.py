"""``draftcert decode`` (stream a speculative decode) and ``draftcert bench`` (criteria table)."""

from __future__ import annotations

import argparse
import json
import os
import sys

DEFAULT_BENCH_SPECS = ["strict", "additive:0.1", "multiplicative:0.5", "topm:2", "entropy:0.09:0.3", "mars:0.5", "tree:2", "tree:4"]

_DECODE_EXAMPLES = """examples:
  draftcert decode --prompt "Explain KV caching in two sentences."
  draftcert decode --prompt "Write a haiku about rain." --criterion additive:0.1 -k 6
  draftcert decode --prompt "List three prime numbers." --tree 4,3
  draftcert decode --prompt "Repeat: a b c a b c" --drafter prompt-lookup --json

Accepted draft tokens are shown in green, the target's own tokens (corrections
and bonus tokens) in the default colour (set NO_COLOR=1 or pipe the output to
turn colour off).  Statistics go to stderr; --json prints one JSON object per
verification round, then a summary object, on stdout.
"""

_BENCH_EXAMPLES = """examples:
  draftcert bench                                   # 3 MT-Bench prompts, every criterion
  draftcert bench --prompt "Tell me a story." --prompt "What is 2+2?" -k 6
  draftcert bench --criteria strict,additive:0.1,tree:4 --max-new-tokens 32 --json
"""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "decode",
        help="greedy speculative decoding of one prompt, streamed, with per-round certificates",
        description="Greedy speculative decoding (chain or tree) with exact acceptance certificates.",
        epilog=_DECODE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(p)
    p.add_argument("--prompt", required=True, help="prompt text (the chat template is applied when the tokenizer has one)")
    p.add_argument("--criterion", default="strict", help="acceptance rule: strict | additive:DELTA | multiplicative:ALPHA | "
                   "topm:M | entropy:EPS:DELTA | mars:THETA | tree:M (default strict: lossless)")
    p.add_argument("--tree", default=None, metavar="M,DEPTH", help="draft a tree: top-M children at each depth along the drafter's greedy path")
    p.add_argument("--json", action="store_true", help="print the per-round log as JSON lines instead of text")
    p.add_argument("--baseline", action="store_true", help="also time the target alone (speedup) and check strict identity")
    p.add_argument("--no-color", action="store_true", help="never colour the output")
    p.set_defaults(func=run_decode)

    b = subparsers.add_parser(
        "bench",
        help="compare acceptance criteria and trees on a few prompts (markdown table)",
        description="Tokens per target forward, mean accepted length, drift and tokens/s for several criteria.",
        epilog=_BENCH_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(b)
    b.add_argument("--prompt", action="append", default=None, help="prompt text (repeatable); default: MT-Bench prompts")
    b.add_argument("--prompts", default="mt-bench", help="prompt source when no --prompt is given (default mt-bench)")
    b.add_argument("--limit", type=int, default=3, help="number of prompts from --prompts (default 3)")
    b.add_argument("--criteria", default=",".join(DEFAULT_BENCH_SPECS), help="comma-separated criteria; tree:M rows use a width-M tree of depth k")
    b.add_argument("--json", action="store_true", help="print rows as JSON lines instead of a markdown table")
    b.set_defaults(func=run_bench)


def _common(p) -> None:
    p.add_argument("--target", default=None, help="target model: omitted/'embedded' = SmolLM2-135M-Instruct (embedded), or a local path / hub id")
    p.add_argument("--drafter", default=None, help="drafter: default | DRAFTER.safetensors (from train-drafter) | eagle:NAME | "
                   "self:skip=N | self:quant=4 | prompt-lookup | path / hub id (default: models.DEFAULT_DRAFTER, the shipped "
                   "feature drafter, for the embedded target)")
    p.add_argument("-k", type=int, default=4, help="draft tokens per round (tree depth for tree:M) (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def _load(args):
    import torch

    from draftcert.models import DEFAULT_DRAFTER, load_target

    if args.k < 1:
        raise ValueError(f"-k: expected an integer >= 1, got {args.k}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: expected an integer >= 1, got {args.max_new_tokens}")
    if args.threads:
        torch.set_num_threads(args.threads)
    embedded = args.target in (None, "embedded")
    drafter = args.drafter
    if drafter == "default":
        drafter = DEFAULT_DRAFTER
    if drafter is None:
        if not embedded:
            raise ValueError("--drafter: required with a non-embedded --target (e.g. self:skip=N, self:quant=4, prompt-lookup)")
        drafter = DEFAULT_DRAFTER
    target, tok = load_target(args.target)
    return target, tok, drafter


def _drafter_obj(spec, target, tok):
    from .drafters import make_drafter

    return make_drafter(spec, target, tok)


def _use_color(args, stream) -> bool:
    if args.no_color or os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    return hasattr(stream, "isatty") and stream.isatty()


def _json_safe(x):
    """Strict JSON: an infinite radius (no drafter can be rejected) is written as the string "inf"."""
    if isinstance(x, float) and x != x:
        return None
    if isinstance(x, float) and x in (float("inf"), float("-inf")):
        return "inf" if x > 0 else "-inf"
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


GREEN, RESET = "\033[32m", "\033[0m"


def run_decode(args) -> int:
    from draftcert.prompts import encode_prompt

    from .engine import speculative_generate

    if not args.prompt or not args.prompt.strip():
        raise ValueError("--prompt: the prompt is empty")
    target, tok, dspec = _load(args)
    ids = encode_prompt(tok, args.prompt)
    drafter = _drafter_obj(dspec, target, tok)
    out = sys.stdout
    color = _use_color(args, out)
    state = {"toks": [], "text": "", "round": 0}

    def on_round(log):
        state["round"] += 1
        if args.json:
            rec = {"round": state["round"], **log.as_dict(), "text": tok.decode(log.emitted)}
            out.write(json.dumps(_json_safe(rec)) + "\n")
            out.flush()
            return
        for t, from_draft in zip(log.emitted, log.from_draft):
            state["toks"].append(t)
            text = tok.decode(state["toks"], skip_special_tokens=True)
            piece, state["text"] = text[len(state["text"]) :], text  # incremental decode keeps multi-byte characters whole
            out.write(f"{GREEN}{piece}{RESET}" if (color and from_draft and piece) else piece)
        out.flush()

    res = speculative_generate(
        target, drafter, ids, args.criterion, k=args.k, tree=args.tree, max_new_tokens=args.max_new_tokens,
        baseline=args.baseline, tokenizer=tok, on_round=on_round,
    )
    s = res.stats.summary()
    if args.json:
        out.write(json.dumps(_json_safe({"summary": s, "drafter": dspec})) + "\n")
        return 0
    out.write("\n")
    cert = "n/a" if s["certified_fraction"] is None else f"{s['certified_fraction']:.2f}"
    msg = (f"[{s['criterion']}, drafter {dspec}] {s['emitted']} tokens in {s['rounds']} rounds: "
           f"{s['tokens_per_forward']:.2f} tokens/target forward, mean accepted {s['mean_accepted_length']:.2f}, "
           f"drift {s['drift']:.3f}, certified {cert}, {s['tokens_per_second']:.2f} tokens/s")
    if args.baseline:
        msg += f", speedup {s['speedup']:.2f}x vs target alone" + ("" if s["baseline_match"] is None else f" (identical: {s['baseline_match']})")
    print(msg, file=sys.stderr)
    return 0


def bench_rows(target, drafter, prompts_ids, specs, k, max_new_tokens, tokenizer=None):
    """One aggregate row per criterion spec over the given prompts (tree:M -> tree (M, k))."""
    from draftcert import TreeCoverage, parse_criterion

    from .engine import speculative_generate

    rows = []
    for spec in specs:
        crit = parse_criterion(spec)
        tree = (crit.m, k) if isinstance(crit, TreeCoverage) else None
        tot = {"tok": 0, "fwd": 0, "acc": 0, "rounds": 0, "drift": 0, "cert": 0, "chk": 0, "s": 0.0}
        for ids in prompts_ids:
            st = speculative_generate(target, drafter, ids, crit, k=k, tree=tree, max_new_tokens=max_new_tokens, tokenizer=tokenizer).stats
            tot["tok"] += st.emitted
            tot["fwd"] += st.target_forwards
            tot["s"] += st.seconds
            tot["acc"] += sum(r.accepted for r in st.rounds)
            tot["rounds"] += len(st.rounds)
            tot["drift"] += st.drift_tokens
            tot["cert"] += st.certified_positions
            tot["chk"] += st.checked_positions
        rows.append({
            "criterion": crit.spec,
            "draft": f"chain k={k}" if tree is None else f"tree m={tree[0]}, depth={k}",
            "tokens_per_forward": tot["tok"] / tot["fwd"],
            "mean_accepted": tot["acc"] / tot["rounds"],
            "drift": tot["drift"] / tot["tok"],
            "certified": tot["cert"] / tot["chk"] if tot["chk"] else None,
            "tokens_per_second": tot["tok"] / tot["s"],
        })
    return rows


def format_table(rows) -> str:
    lines = ["| criterion | draft | tokens/forward | mean accepted | drift | certified | tokens/s |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        cert = "n/a" if r["certified"] is None else f"{r['certified']:.3f}"
        lines.append(f"| {r['criterion']} | {r['draft']} | {r['tokens_per_forward']:.2f} | {r['mean_accepted']:.2f} | "
                     f"{r['drift']:.3f} | {cert} | {r['tokens_per_second']:.2f} |")
    return "\n".join(lines)


def run_bench(args) -> int:
    from draftcert.prompts import encode_prompt, load_prompts

    specs = [s.strip() for s in args.criteria.split(",") if s.strip()]
    if not specs:
        raise ValueError("--criteria: give at least one criterion")
    from draftcert import parse_criterion

    for s in specs:
        parse_criterion(s)  # fail on a typo before loading models
    target, tok, dspec = _load(args)
    if args.prompt:
        if any(not p.strip() for p in args.prompt):
            raise ValueError("--prompt: a prompt is empty")
        texts = args.prompt
    else:
        if args.limit < 1:
            raise ValueError(f"--limit: expected an integer >= 1, got {args.limit}")
        texts = [p.text for p in load_prompts(args.prompts, limit=args.limit)]
    ids = [encode_prompt(tok, t) for t in texts]
    drafter = _drafter_obj(dspec, target, tok)
    rows = bench_rows(target, drafter, ids, specs, args.k, args.max_new_tokens, tok)
    if args.json:
        for r in rows:
            print(json.dumps(_json_safe(r)))
    else:
        print(f"drafter {dspec}, {len(ids)} prompts x {args.max_new_tokens} tokens, k={args.k}\n")
        print(format_table(rows))
    return 0
