"""Two trained feature drafters (e.g. ``--objective kl`` vs ``--objective certificate``) side by side
on held-out MT-Bench and HumanEval prompts, decoding with the engine (strict, chain of k).

    PYTHONPATH=src python benchmarks/bench_drafter_objectives.py \\
        --drafter kl=runs/drafter-kl/drafter.safetensors --drafter certificate=runs/drafter-cert/drafter.safetensors

Per drafter, in docs/metrics.md's vocabulary: draft_acceptance_rate (num_accepted_tokens /
num_draft_tokens), acceptance_rate_per_pos (accepted at position i / num_drafts), certified rate (positions whose acceptance the certificate KL(p||q) < radius(p)
guaranteed, over positions checked), mean_acceptance_length (1 + num_accepted_tokens / num_drafts),
tokens per target forward, tokens/s (drafters interleaved per prompt, fastest of ``--repeats``).
The last line names the winner by mean acceptance length:
``winner=NAME mean_acceptance_length_ratio=X``.
"""

from __future__ import annotations

import argparse
import time

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", action="append", required=True, metavar="NAME=PATH")
    ap.add_argument("--mt-bench", type=int, default=6)
    ap.add_argument("--humaneval", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("--criterion", default="strict")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from draftcert.decode import speculative_generate
    from draftcert.models import load_drafter, load_target
    from draftcert.prompts import encode_prompt, load_prompts

    target, tok = load_target(None)
    drafters = {}
    for item in args.drafter:
        name, _, path = item.partition("=")
        drafters[name] = load_drafter(path, target, tok)
    prompts = [p for src, n in (("mt-bench", args.mt_bench), ("humaneval", args.humaneval)) if n
               for p in load_prompts(src, n)]
    enc = [list(encode_prompt(tok, p.text)) for p in prompts]
    names = list(drafters)
    agg = {n: {"draft": 0, "acc": 0, "cert": 0, "chk": 0, "drafts": 0, "pos": [], "emitted": 0, "fwd": 0, "sec": [float("inf")] * len(enc)} for n in names}
    speculative_generate(target, drafters[names[0]], enc[0], args.criterion, k=args.k, max_new_tokens=4)
    for r in range(args.repeats):
        for i, ids in enumerate(enc):
            order = names[(i + r) % len(names):] + names[: (i + r) % len(names)]
            for n in order:
                t0 = time.perf_counter()
                res = speculative_generate(target, drafters[n], ids, args.criterion, k=args.k, max_new_tokens=args.max_new_tokens)
                sec = time.perf_counter() - t0
                a = agg[n]
                a["sec"][i] = min(a["sec"][i], sec)
                if r == 0:
                    st = res.stats
                    a["draft"] += st.num_draft_tokens
                    a["acc"] += st.num_accepted_tokens
                    a["cert"] += st.certified_positions
                    a["chk"] += st.checked_positions
                    a["drafts"] += st.num_drafts
                    per_pos = st.num_accepted_tokens_per_pos
                    n = max(len(a["pos"]), len(per_pos))  # add position by position, the shorter list padded
                    a["pos"] = [x + y for x, y in zip(a["pos"] + [0] * (n - len(a["pos"])), per_pos + [0] * (n - len(per_pos)))]
                    a["emitted"] += st.emitted
                    a["fwd"] += st.target_forwards
    print(f"{len(enc)} held-out prompts ({args.mt_bench} MT-Bench + {args.humaneval} HumanEval) x {args.max_new_tokens} tokens, "
          f"{args.criterion} chain k={args.k}")
    print("| drafter | draft_acceptance_rate | acceptance_rate_per_pos | certified rate | mean_acceptance_length "
          "| tokens / forward | tokens/s |")
    print("|---|---:|---|---:|---:|---:|---:|")
    out = {}
    for n in names:
        a = agg[n]
        row = {"accept": a["acc"] / max(a["draft"], 1), "cert": a["cert"] / max(a["chk"], 1),
               "len": 1 + a["acc"] / max(a["drafts"], 1), "tpf": a["emitted"] / max(a["fwd"], 1),
               "tps": a["emitted"] / sum(a["sec"]), "pos": [x / max(a["drafts"], 1) for x in a["pos"]]}
        out[n] = row
        pos = ", ".join(f"{x:.3f}" for x in row["pos"])
        print(f"| {n} | {row['accept']:.3f} | {pos} | {row['cert']:.3f} | {row['len']:.3f} | {row['tpf']:.3f} | {row['tps']:.2f} |")
    best = max(names, key=lambda n: out[n]["len"])
    other = [n for n in names if n != best]
    if other:
        print(f"winner={best} mean_acceptance_length_ratio={out[best]['len'] / out[other[0]]['len']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
