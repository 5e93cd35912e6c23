"""`draftcert decode --baseline` exactly as a new user runs it, on held-out prompts: the issue's goal figure.

    PYTHONPATH=src python benchmarks/bench_default_decode.py                      # default settings
    PYTHONPATH=src python benchmarks/bench_default_decode.py --drafter default -k 1   # another setting, same prompts

Each prompt runs ``draftcert decode --baseline --max-new-tokens 128 --prompt TEXT --json`` in a fresh
process (model loading, the linear_chooser plan and the ``-k auto`` cost curve come from the user's
cache, as they would; delete ``~/.cache/draftcert/{linear_chooser,costs}`` to time a first run).  The
decode times itself and the target alone in turns (``--repeats``, default 3) and reports the median
speedup and whether strict's output equals the target's greedy output.  Extra arguments after the
options are passed to ``draftcert decode`` unchanged.  After the speed-ups, the drafter's figures
over every decode: ``acceptance_depth1=``, ``drafted_token_cost=`` (÷ one target step) and
``plain_round_share=`` (rounds that drafted nothing).

The default prompts are MT-Bench 81 and 84 and HumanEval 0 and 2: held out of every training set
(``train.data.heldout_texts``), chosen before any drafter was tuned on them.  Last lines:
``speedup_<prompt>=`` per prompt, ``lossless=`` (every output identical), ``geomean_speedup=``.

``--weights gguf,float32`` runs every prompt once per weights (``draftcert decode --weights W``), the
order flipping from prompt to prompt, and adds per weights ``<W>_geomean_speedup=`` (against its own
target alone), ``<W>_geomean_tok_s=`` and ``<W>_geomean_target_tok_s=``, then
``<first>_vs_<second>_tok_s=`` and ``..._target_tok_s=`` (geometric means of the per-prompt ratios).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

from draftcert.prompts import load_prompts

DEFAULT_PROMPTS = "mt-bench/81,mt-bench/84,humaneval/0,humaneval/2"


def prompt_text(pid: str) -> str:
    source = pid.split("/", 1)[0]
    for p in load_prompts(source):
        if p.id == pid:
            return p.text
    raise ValueError(f"--prompts: no prompt {pid!r} in {source!r} (ids look like mt-bench/81, humaneval/0)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS, help=f"comma-separated prompt ids (default {DEFAULT_PROMPTS})")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--weights", default=None, help="comma-separated --weights values to compare, e.g. gguf,float32 "
                    "(default: decode's own default, one run per prompt)")
    args, extra = ap.parse_known_args(argv)
    weights = [w.strip() for w in args.weights.split(",")] if args.weights else [None]
    ids = [p.strip() for p in args.prompts.split(",") if p.strip()]
    texts = {pid: prompt_text(pid) for pid in ids}  # a bad id fails before anything runs
    speedups, lossless = {}, True
    summaries = []  # every decode's --json summary: the drafter's figures below
    per = {w: {"speedup": {}, "tok_s": {}, "target_tok_s": {}} for w in weights}
    for n, pid in enumerate(ids):
        for w in (weights if n % 2 == 0 else weights[::-1]):
            cmd = [sys.executable, "-m", "draftcert", "decode", "--baseline", "--repeats", str(args.repeats),
                   "--max-new-tokens", str(args.max_new_tokens), "--json", "--no-progress",
                   *([] if w is None else ["--weights", w]), *extra, "--prompt", texts[pid]]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode != 0:
                sys.stderr.write(run.stderr)
                raise SystemExit(f"{pid}: draftcert decode exited with {run.returncode}")
            s = json.loads(run.stdout.strip().splitlines()[-1])["summary"]
            summaries.append(s)
            choice = next((ln.split("-k auto: ", 1)[1] for ln in run.stderr.splitlines() if "-k auto: " in ln), None)
            key = pid if w is None else f"{w}/{pid}"
            speedups[key] = s["speedup"]
            per[w]["speedup"][pid], per[w]["tok_s"][pid] = s["speedup"], s["tokens_per_second"]
            per[w]["target_tok_s"][pid] = s["baseline_tokens_per_second"]
            lossless &= bool(s["baseline_match"])
            pos = " ".join(f"{a:.2f}" for a in s["acceptance_rate_per_pos"][:4])
            print(f"{key}: {s['emitted']} tokens, {s.get('model_dtype', '?')}, {s['tokens_per_forward']:.2f} tokens/forward, "
                  f"acceptance_rate_per_pos {pos}, {s['tokens_per_second']:.2f} tokens/s, speedup {s['speedup']:.2f}x"
                  f"{'' if s['timing_reliable'] is not False else ' (UNRELIABLE)'}, identical {s['baseline_match']}"
                  + (f"; -k auto: {choice.split(';')[0]}" if choice else ""), flush=True)

    def geomean(values) -> float:
        values = list(values)
        return math.exp(sum(map(math.log, values)) / len(values))

    for key, v in speedups.items():
        print(f"speedup_{key.replace('/', '_').replace('-', '_')}={v:.3f}")
    print(f"lossless={lossless}")
    if len(weights) > 1:
        for w in weights:
            for what in ("speedup", "tok_s", "target_tok_s"):
                print(f"{w}_geomean_{what}={geomean(per[w][what].values()):.3f}")
        a, b = weights[:2]
        for what in ("tok_s", "target_tok_s"):
            print(f"{a}_vs_{b}_{what}={geomean(per[a][what][p] / per[b][what][p] for p in ids):.3f}")
    print(f"geomean_speedup={geomean(speedups.values()):.3f}")
    drafter_figures(summaries)
    return 0


def drafter_figures(summaries: list[dict]) -> None:
    """The drafter's side of issue 47's goals, over every decode: ``acceptance_depth1=`` (strict: drafts
    accepted at depth 1 / depth 1 attempted), ``drafted_token_cost=`` (the drafting stage's seconds per
    drafted token over the target alone's seconds per token, both from the same decodes) and
    ``plain_round_share=`` (rounds that drafted nothing: -k auto's plain steps and confidence stops)."""
    att = sum((s.get("num_attempted_per_pos") or [0])[0] for s in summaries)
    acc = sum((s.get("num_accepted_tokens_per_pos") or [0])[0] for s in summaries)
    if att:
        print(f"acceptance_depth1={acc / att:.3f}")
    drafted = sum(s.get("num_draft_tokens") or 0 for s in summaries)
    propose = sum((s.get("stage_seconds") or {}).get("propose", 0.0) for s in summaries)
    timed = [s for s in summaries if s.get("baseline_tokens_per_second")]
    base_s = sum(s["emitted"] / s["baseline_tokens_per_second"] for s in timed)  # the target alone, same lengths
    base_n = sum(s["emitted"] for s in timed)
    if drafted and base_s and base_n:
        print(f"drafted_token_cost={(propose / drafted) / (base_s / base_n):.3f}")
    rounds = sum(sum(s.get("rounds_by_draft_length") or []) for s in summaries)
    plain = sum((s.get("rounds_by_draft_length") or [0])[0] for s in summaries)
    if rounds:
        print(f"plain_round_share={plain / rounds:.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
