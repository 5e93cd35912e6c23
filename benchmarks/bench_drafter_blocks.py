"""A model drafter as stored against the same drafter recomputed as other blocks (``NAME@q4_1``,
``gguf.requantize``): its one-row step, its acceptance, and ``-k auto``'s speed against the target alone.

    python benchmarks/bench_drafter_blocks.py                        # the pair's 0.5B drafter, as stored vs @q4_1
    python benchmarks/bench_drafter_blocks.py --blocks q5_0 --prompts humaneval/3,mt-bench/90

Per prompt (``--max-new-tokens``, default 96), the target alone (``greedy_generate``) and a strict
``-k auto`` decode with each drafter take turns (``--repeats`` rounds, the order flipping each round;
medians), each drafter with its own cost curve, as ``draftcert decode`` would run it.  Then a chain of
``--k`` drafts with each drafter (the same tokens: strict), whose depth-1 acceptance is the drafter's
(not steered by timing).  The default prompts are held out of every training set (MT-Bench, HumanEval,
ShareGPT's held-out tenth).

Last lines, ``name=value``: ``step_ms[stored|requant]`` (one-row drafter pass, map head, context 128),
``target_step_ms``, ``step_vs_target[...]``, ``acceptance_depth1[...]`` (the fixed chains' accepted /
attempted depth-1 drafts over every prompt), ``speedup[<drafter>][<prompt>]``,
``geomean_speedup[stored|requant]`` and ``requant_vs_stored`` (the ratio of the two geometric means).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

DEFAULT_PROMPTS = "mt-bench/85,mt-bench/90,humaneval/3,humaneval/7,sharegpt/VY7cMKG_0,sharegpt/eL3wWKe_0"


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    p.add_argument("--blocks", default="q4_1", help="the block type to recompute the drafter as (q4_1, q5_0, q8_0)")
    p.add_argument("--prompts", default=DEFAULT_PROMPTS)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4, help="the fixed chain whose acceptance is compared (default 4)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from draftcert.decode.engine import auto_draft, decode_loop, greedy_generate, prepare_decode
    from draftcert.drafting import make_drafter
    from draftcert.models import load_target
    from draftcert.models.hf import model_forward, new_cache
    from draftcert.models.tree_attention import crop_cache
    from draftcert.prompts import encode_prompt, load_prompts

    target, tok = load_target(args.target)
    specs = {"stored": args.drafter, "requant": f"{args.drafter}@{args.blocks}"}
    drafters = {name: make_drafter(spec, target, tok) for name, spec in specs.items()}
    autos = {}
    for name, spec in specs.items():  # -k auto as decode chooses it: each drafter's own cost curve
        k, _, obj, factory, line = auto_draft(target, spec, tok, "strict", None, spec=spec)
        autos[name] = (k, obj, factory)
        print(f"{name} ({spec}): {line}", flush=True)

    # one-row steps: the drafters' passes over their map heads, and the target's, in turns
    context = list(range(1000, 1128))
    runs = {}
    for name, d in drafters.items():
        md = d.model_drafter
        md.start(context)  # its map head over the shipped token map and the context's tokens, as a decode's
        runs[name] = (md.model, md.vocab_head)
    runs["target"] = (target, None)
    step = {k: [] for k in runs}
    with torch.inference_mode():
        caches = {k: new_cache(m) for k, (m, _) in runs.items()}
        for k, (m, _) in runs.items():
            model_forward(m, caches[k], context, 1)
        for r in range(13):
            for k, (m, head) in runs.items():
                t = time.perf_counter()
                model_forward(m, caches[k], [5], 1, **({"head": head} if head is not None else {}))
                if r:
                    step[k].append(time.perf_counter() - t)
                crop_cache(caches[k], len(context))
    ms = {k: 1e3 * statistics.median(v) for k, v in step.items()}

    prompts = {}
    for pid in [x.strip() for x in args.prompts.split(",") if x.strip()]:
        source = pid.split("/", 1)[0]
        match = [q for q in load_prompts(source, limit=None) if q.id == pid]
        if not match:
            raise SystemExit(f"--prompts: no prompt {pid!r}")
        prompts[pid] = encode_prompt(tok, match[0].text)

    speed: dict[str, dict[str, float]] = {name: {} for name in specs}
    accepted = {name: [0, 0] for name in specs}
    for pid, ids in prompts.items():
        def timed(name):
            k, obj, factory = autos[name]
            prompt, dsrc, cfg = prepare_decode(target, obj, ids, "strict", k, max_new_tokens=args.max_new_tokens,
                                               tokenizer=tok, draft_length=factory)
            t = time.perf_counter()
            out, _ = decode_loop(target, dsrc, prompt, cfg)
            return time.perf_counter() - t, out

        def alone():
            t = time.perf_counter()
            out = greedy_generate(target, ids, args.max_new_tokens)
            return time.perf_counter() - t, out

        jobs = {"target": alone, **{name: (lambda n=name: timed(n)) for name in specs}}
        for job in jobs.values():  # warm-up: caches, native plans, the cost curves
            job()
        seconds = {name: [] for name in jobs}
        outs = {}
        for r in range(args.repeats):
            for name in (list(jobs) if r % 2 == 0 else list(jobs)[::-1]):
                s, outs[name] = jobs[name]()
                seconds[name].append(s)
        base = statistics.median(seconds["target"])
        for name in specs:
            if outs[name] != outs["target"]:
                raise SystemExit(f"{pid}: strict with the {name} drafter differs from the target's greedy decoding")
            speed[name][pid] = base / statistics.median(seconds[name])
            prompt, dsrc, cfg = prepare_decode(target, drafters[name], ids, "strict", args.k,
                                               max_new_tokens=args.max_new_tokens, tokenizer=tok)
            _, st = decode_loop(target, dsrc, prompt, cfg)
            accepted[name][0] += st.num_accepted_tokens_per_pos[0] if st.num_accepted_tokens_per_pos else 0
            accepted[name][1] += st.num_attempted_per_pos[0] if st.num_attempted_per_pos else 0
        print(f"{pid}: " + ", ".join(f"{name} {speed[name][pid]:.3f}" for name in specs), flush=True)

    for name in specs:
        print(f"step_ms[{name}]={ms[name]:.2f}")
    print(f"target_step_ms={ms['target']:.2f}")
    for name in specs:
        print(f"step_vs_target[{name}]={ms[name] / ms['target']:.3f}")
    for name in specs:
        a, n = accepted[name]
        print(f"acceptance_depth1[{name}]={a / max(n, 1):.3f}")
    for name in specs:
        for pid, v in speed[name].items():
            print(f"speedup[{name}][{pid}]={v:.3f}")
    g = {name: geomean(speed[name].values()) for name in specs}
    for name in specs:
        print(f"geomean_speedup[{name}]={g[name]:.3f}")
    print(f"requant_vs_stored={g['requant'] / g['stored']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
