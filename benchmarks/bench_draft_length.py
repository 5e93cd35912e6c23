"""How long a round's chain should be: ``-k auto``'s rule against fixed lengths, on the same drafts, without timing noise.

For each prompt the target's greedy text is decoded once; then at every position of it the drafter
drafts its greedy chain of ``--depth`` tokens from the target's prefix, recording the drafter's
probability of each drafted token (``pi_d = softmax(q_d)[drafted]``) and how many of them the target's
greedy text matches (what strict accepts).  Each policy is then played on those drafts, round after
round as the engine plays it (a round emits its accepted tokens and the target's next one), and priced
with this machine's cost curve (``decode.draft_shape.costs.engine_costs``, the one ``-k auto`` uses; measured on
first use and cached):

- ``plain``: the target alone (``k = 0`` every round), the reference;
- ``kN``: a fixed chain of N;
- ``auto-k``: ``decode.draft_shape.adaptive.AdaptiveDraftLength``'s k each round, the chain exactly k long
  (the controller without the drafter's confidence);
- ``auto``: what ``draftcert decode`` does: the controller decides whether to draft, and the chain
  grows while ``AdaptiveDraftLength.keep_drafting`` says one more depth pays;
- ``oracle``: the fastest sequence of chain lengths knowing every match in advance (an upper bound
  no controller reaches).

The figures are predictions from the cost curve (a timed comparison is ``bench_pair.py``'s); the
drafts and the decisions are the shipped code's.  The drafter's calibration on these prompts comes
with them: of the drafted tokens reached (every earlier one matched), the share the target accepts,
by decile of ``pi``.

    python benchmarks/bench_draft_length.py [--pair qwen2.5-coder | --target T --drafter D]
        [--chat 6] [--code 6] [--max-new-tokens 64] [--depth 6] [--threads 2]

The chat prompts are ShareGPT's held-out split, the code prompts HumanEval's first ones.  Last lines,
``name=value``: ``predicted_speedup[POLICY]=`` (geometric mean over prompts, ÷ ``plain``),
``predicted_speedup_min[POLICY]=``, ``accepted_given_pi[LO-HI]=`` (with ``reached_given_pi[LO-HI]=``,
the count), ``drafter=``, ``costs=``.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch


def drafts_along(target, drafter, prompt: list[int], out: list[int], depth: int):
    """At each position i of ``out``: (the drafter's chain tokens, their probabilities, how many match out[i:])."""
    from draftcert.models.hf import forward_with_hidden, new_cache
    from draftcert.drafting.tree_growth import top_probability

    hidden = None
    if drafter.needs_target_hidden:  # a feature drafter reads the target's features of the prefix
        _, hidden = forward_with_hidden(target, new_cache(target), prompt + out, 1)
    drafter.start(prompt)
    rows, n_obs = [], 0
    for i in range(len(out)):
        seq = prompt + out[:i]
        if hidden is not None:
            drafter.observe(hidden[n_obs: len(seq) - 1])
            n_obs = len(seq) - 1
        drafter.depth_limit, drafter.min_margin, drafter.keep_drafting = depth, None, None
        tree = drafter.propose(seq, [1] * depth, False)
        pis = [top_probability(tree.q[d: d + 1]) for d in range(len(tree))]
        n = 0
        while n < len(tree) and i + n < len(out) and tree.tokens[n] == out[i + n]:
            n += 1
        rows.append((pis, n))
        drafter.accept([])  # the engine's next round starts from the target's text, not the draft
    return rows


def play(rows, seconds, choose) -> float:
    """Seconds to emit the whole text when ``choose(i, pis) -> k`` sets each round's chain (k <= len(pis))."""
    i, t = 0, 0.0
    while i < len(rows):
        pis, match = rows[i]
        k = choose(i, pis)
        t += seconds[k]
        i += min(k, match) + 1
    return t


def oracle(rows, seconds) -> float:
    best = [0.0] * (len(rows) + 1)
    for i in range(len(rows) - 1, -1, -1):
        pis, match = rows[i]
        best[i] = min(seconds[k] + best[min(len(rows), i + min(k, match) + 1)] for k in range(len(pis) + 1))
    return best[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default=None, help="a preset pair (qwen2.5-coder); the default without --target")
    ap.add_argument("--target", default=None)
    ap.add_argument("--drafter", default=None, help="a drafter spec with a distribution (a model or feature drafter)")
    ap.add_argument("--chat", type=int, default=6)
    ap.add_argument("--code", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from draftcert.decode.draft_shape.adaptive import MAX_K
    from draftcert.decode.engine import greedy_generate
    from draftcert.decode.draft_shape.shape import adaptive_draft_length
    from draftcert.drafting.make import make_drafter
    from draftcert.models import get_pair, load_target
    from draftcert.models.drafter_loading import parse_drafter_spec
    from draftcert.prompts import encode_prompt, load_prompts

    if args.target is None:
        pair = get_pair(args.pair or "qwen2.5-coder")
        args.target, args.drafter = pair.target, args.drafter or pair.drafter
    if args.drafter is None:
        sys.exit("--drafter: name the drafter of --target (a model or feature drafter)")
    spec = parse_drafter_spec(args.drafter)
    if spec.kind in ("prompt-lookup", "suffix"):
        sys.exit(f"--drafter {args.drafter}: a drafter without a distribution has no confidence to follow")
    if not 1 <= args.depth <= MAX_K:
        sys.exit(f"--depth: 1..{MAX_K}")
    target, tok = load_target(args.target)
    drafter = make_drafter(spec.model_spec, target, tok)  # 'X+suffix' -> X: the suffix chain has no confidence
    factory, line = adaptive_draft_length(target, drafter, spec.model_spec)
    seconds = factory().round_seconds()  # k = 0..MAX_K, predicted: untimed, as a relaxed rule plays it
    prompts = load_prompts("sharegpt", limit=args.chat) + load_prompts("humaneval", limit=args.code)

    policies = ["plain"] + [f"k{k}" for k in range(1, args.depth + 1)] + ["auto-k", "auto", "oracle"]
    ratios = {p: [] for p in policies}
    reached, accepted = [0] * 10, [0] * 10
    with torch.inference_mode():
        for p in prompts:
            prompt = encode_prompt(tok, p.text)
            out = greedy_generate(target, prompt, args.max_new_tokens)
            rows = drafts_along(target, drafter, prompt, out, args.depth)
            for pis, match in rows:
                for d, pi in enumerate(pis[: match + 1]):  # reached: every earlier token matched
                    b = min(int(pi * 10), 9)
                    reached[b] += 1
                    accepted[b] += int(d < match)
            times = {"plain": play(rows, seconds, lambda i, pis: 0)}
            for k in range(1, args.depth + 1):
                times[f"k{k}"] = play(rows, seconds, lambda i, pis, k=k: min(k, len(pis)))
            for name in ("auto-k", "auto"):
                ctl = factory()

                def choose(i, pis, ctl=ctl, name=name):
                    k = min(ctl.next_k(), len(pis))
                    if k and name == "auto":
                        k = 1
                        while k < len(pis) and ctl.keep_drafting(pis[:k]):
                            k += 1
                    match = rows[i][1]
                    ctl.observe([True] * min(k, match) + ([False] if match < k else []))
                    return k

                times[name] = play(rows, seconds, choose)
            times["oracle"] = oracle(rows, seconds)
            per = {name: times["plain"] / t for name, t in times.items()}
            for name in policies:
                ratios[name].append(per[name])
            print(f"{p.id}: {len(out)} tokens, " + ", ".join(f"{n} {per[n]:.3f}" for n in policies), flush=True)

    print(f"drafter={args.drafter} on {args.target}; {line}")
    for name in policies:
        v = ratios[name]
        print(f"predicted_speedup[{name}]={math.exp(sum(map(math.log, v)) / len(v)):.3f}")
        print(f"predicted_speedup_min[{name}]={min(v):.3f}")
    for b in range(10):
        if reached[b]:
            print(f"accepted_given_pi[{b / 10:.1f}-{(b + 1) / 10:.1f}]={accepted[b] / reached[b]:.3f}")
            print(f"reached_given_pi[{b / 10:.1f}-{(b + 1) / 10:.1f}]={reached[b]}")
    print("costs=" + ",".join(f"{s * 1e3:.1f}" for s in seconds) + " (ms per round, k = 0..6)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
