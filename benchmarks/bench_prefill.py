"""Prefill and batched answering, this checkout's native kernels against another checkout's, in turns.

    python benchmarks/bench_prefill.py --compare ../other-checkout/src [--target qwen2.5-coder-1.5b]
        [--tokens 700] [--batch 32] [--batch-prompt-tokens 120] [--new-tokens 32] [--turns 2] [--threads 2]

Two jobs, each timed in a fresh process per checkout (a checkout's native libraries are compiled from
its own sources and loaded once per process), the checkouts alternating for ``--turns`` turns:

- ``prefill``: one prompt of ``--tokens`` tokens on ``--target`` (a fixed English text), a pass with
  the logits of its last token, median of 3 after one warm-up: what a long prompt costs before the
  first token (``decode``'s prefill).
- ``answers``: ``--batch`` ShareGPT training prompts (``sharegpt-train``, cut to
  ``--batch-prompt-tokens``) answered greedily for ``--new-tokens`` tokens by the embedded target in
  one left-padded batch, with their features, as ``train-drafter`` writes its data
  (``train.distill_data.answer_prompts``).

Both checkouts must compute the same bits: the last-token logits and the answers are compared
(``bits_equal=``).  Last lines, ``name=value``: ``prefill_ms[TARGET,N]=`` (this checkout, the median over
turns), ``base_prefill_ms[...]=`` (the other), ``prefill_ratio[...]=`` (this ÷ the other: below 1,
this checkout is faster), the same for ``answers_s[embedded,BxP+T]``, and ``bits_equal=``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TEXT = ("Write a long essay about the history of computing, from the abacus and the first mechanical "
        "calculators to the transistor, the microprocessor and the graphics processors of today. ")


def child(args) -> dict:
    """The timings of one process (run under the checkout's PYTHONPATH)."""
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("DRAFTCERT_WEIGHTS", "gguf-q8")
    from draftcert.models import load_target
    from draftcert.models.hf import model_forward, new_cache
    from draftcert.prompts import encode_prompt, load_prompts
    from draftcert.train.distill_data import answer_prompts

    out = {}
    target, tok = load_target(None if args.target == "embedded" else args.target)
    ids = encode_prompt(tok, TEXT * (args.tokens // 20 + 2))[: args.tokens]
    if len(ids) < args.tokens:
        raise SystemExit(f"bench_prefill.py: the text gives {len(ids)} tokens, fewer than --tokens {args.tokens}")
    with torch.inference_mode():
        model_forward(target, new_cache(target), ids[:64], 1)
        times, logits = [], None
        for _ in range(3):
            t0 = time.perf_counter()
            logits = model_forward(target, new_cache(target), ids, 1)
            times.append(time.perf_counter() - t0)
    out["prefill_s"] = statistics.median(times)
    out["prefill_hash"] = hashlib.sha256(logits.float().numpy().tobytes()).hexdigest()
    if args.batch:
        if args.target != "embedded":
            del target
            target, tok = load_target(None)
        prompts = [p.text for p in load_prompts("sharegpt-train")[: args.batch]]
        prompts = [tok.decode(tok(p, add_special_tokens=False)["input_ids"][: args.batch_prompt_tokens]) for p in prompts]
        with torch.inference_mode():
            answer_prompts(target, tok, prompts[:2], max_new_tokens=2, batch=2, log=lambda *_: None)  # warm-up
            t0 = time.perf_counter()
            ex = answer_prompts(target, tok, prompts, max_new_tokens=args.new_tokens, batch=args.batch, log=lambda *_: None)
            out["answers_s"] = time.perf_counter() - t0
        out["answers_hash"] = hashlib.sha256(json.dumps([e["ids"] for e in ex]).encode()).hexdigest()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", metavar="SRC", help="another checkout's src folder (required, except with --child)")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b", help="the prefill's target (embedded or a preset)")
    ap.add_argument("--tokens", type=int, default=700)
    ap.add_argument("--batch", type=int, default=32, help="prompts answered in one batch (0: no answers job)")
    ap.add_argument("--batch-prompt-tokens", type=int, default=120)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    if not args.compare or not (Path(args.compare) / "draftcert" / "forward" / "layer_kernel.c").is_file():
        ap.error("--compare: a checkout's src folder (with draftcert/forward/layer_kernel.c)")
    if args.turns < 1 or args.tokens < 64 or args.batch < 0:
        ap.error("--turns >= 1, --tokens >= 64 and --batch >= 0")
    here = str(Path(__file__).resolve().parents[1] / "src")
    srcs = {"this": here, "base": str(Path(args.compare).resolve())}
    flags = [f"--target={args.target}", f"--tokens={args.tokens}", f"--batch={args.batch}", f"--new-tokens={args.new_tokens}",
             f"--batch-prompt-tokens={args.batch_prompt_tokens}", f"--threads={args.threads}", "--child"]
    print(f"this: {srcs['this']}\nother: {srcs['base']}\n{args.threads} thread(s), {args.turns} turn(s), a fresh "
          "process per checkout and turn", flush=True)
    runs = {"this": [], "base": []}
    for turn in range(args.turns):
        for name in (("this", "base") if turn % 2 == 0 else ("base", "this")):
            env = {**os.environ, "PYTHONPATH": srcs[name]}
            res = subprocess.run([sys.executable, __file__, *flags], env=env, capture_output=True, text=True)
            line = next((s for s in res.stdout.splitlines() if s.startswith("RESULT ")), None)
            if res.returncode or line is None:
                print(res.stdout[-2000:], res.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"bench_prefill.py: the {name} checkout's run failed (exit {res.returncode})")
            r = json.loads(line[len("RESULT "):])
            runs[name].append(r)
            print(f"turn {turn + 1} {name}: prefill {1e3 * r['prefill_s']:.0f} ms"
                  + (f", answers {r['answers_s']:.2f} s" if "answers_s" in r else ""), flush=True)
    same = all(r[h] == runs["this"][0][h] for h in ("prefill_hash", "answers_hash") if h in runs["this"][0]
               for r in runs["this"] + runs["base"])
    lines = []
    jobs = [("prefill_ms", f"{args.target},{args.tokens}", "prefill_s", 1e3)]
    if args.batch:
        jobs.append(("answers_s", f"embedded,{args.batch}x{args.batch_prompt_tokens}+{args.new_tokens}", "answers_s", 1.0))
    for name, key, field, scale in jobs:
        a = statistics.median(r[field] for r in runs["this"]) * scale
        b = statistics.median(r[field] for r in runs["base"]) * scale
        lines += [f"{name}[{key}]={a:.3f}", f"base_{name}[{key}]={b:.3f}", f"{name.split('_')[0]}_ratio[{key}]={a / b:.3f}"]
    print("\n".join(lines))
    print(f"bits_equal={same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
