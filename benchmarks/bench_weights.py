"""The embedded target from its GGUF blocks (``--weights gguf``) against its float32 checkpoint
(``--weights float32``), side by side in one process: target alone and strict speculative decoding.

Both targets (SmolLM2-135M-Instruct Q4_1: ``load_target(weights="gguf")`` and
``load_target(weights="float32")``) are loaded together with their drafters, and every timed run
(target alone = ``decode.greedy_generate``; strict = ``decode.speculative_generate`` at each
``--shapes`` entry) of each weights on each prompt takes turns with the others (``decode.timing.interleave``:
the order flips every repeat), so a busy neighbour slows both alike.  Per (weights, run): tokens/s
= all prompts' tokens / the sum of their seconds, median over the repeats; the gguf/float32 ratios
are medians of the per-repeat ratios.  Each strict run's tokens are checked against the same
target's greedy tokens (``lossless``).

Memory (``--memory``, on by default): a fresh process per weights loads the target and the drafter,
decodes the first prompt once, and reports its peak RSS (``VmHWM``) and the model's own bytes
(parameters and buffers, each storage counted once: GGUF blocks, embeddings, norms).

    python benchmarks/bench_weights.py [--threads 2] [--repeats 3] [--max-new-tokens 64]
        [--prompts mt-bench/81,mt-bench/84] [--drafter default+suffix] [--shapes 1,2,3,4x2]

Last lines, ``name=value``: ``<weights>_target_tok_s``, ``<weights>_strict_<shape>_tok_s``,
``<weights>_best_strict_tok_s`` (and its shape), ``<weights>_rss_mb``, ``<weights>_model_mb``, then
``gguf_vs_float32_target`` and ``gguf_vs_float32_best_strict`` (above 1: the blocks are faster)
and ``lossless`` (every strict output equals its target's greedy output).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

from draftcert.decode import speculative_generate
from draftcert.drafting.make import DEFAULT_DRAFTER_TRAINED, make_drafter
from draftcert.decode.engine import greedy_generate
from draftcert.decode.draft_shape.shape import auto_engine_args
from draftcert.drafting.suffix import SuffixIndex, SuffixStore
from draftcert.decode.timing import interleave
from draftcert.models import load_target, numerics_of
from draftcert.prompts import encode_prompt, load_prompts

WEIGHTS = ("gguf", "float32")
DEFAULT_PROMPTS = "mt-bench/81,mt-bench/84"


def prompt_texts(ids: list[str]) -> list[str]:
    out = []
    for pid in ids:
        source = pid.split("/", 1)[0]
        match = [p.text for p in load_prompts(source) if p.id == pid]
        if not match:
            raise SystemExit(f"--prompts: no prompt {pid!r} (ids look like mt-bench/81)")
        out.append(match[0])
    return out


def parse_shape(text: str):
    """``3`` -> chain k=3; ``4x2`` -> tree of width 4, depth 2 (``--tree 4,2``)."""
    if "x" in text:
        m, d = text.split("x")
        return {"k": int(d), "tree": (int(m), int(d))}
    return {"k": int(text), "tree": None}


def model_bytes(model) -> int:
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def no_memory_across_prompts(drafter):
    """The drafter's suffix index (of DRAFTER+suffix, suffix) with an empty store: each decode drafts
    from its own prompt and output only, as a fresh ``draftcert decode`` process does (the shared store
    would otherwise hold the other prompts' outputs of this run)."""
    for obj in (drafter, getattr(drafter, "suffix", None), getattr(drafter, "index", None)):
        if isinstance(obj, SuffixIndex):
            obj.store = SuffixStore(0)
    return drafter


def peak_rss_mb() -> float:
    """This process's peak RSS: VmHWM (ru_maxrss would carry the parent's peak over fork + exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_child(weights: str, drafter: str, text: str, threads: int) -> int:
    torch.set_num_threads(threads)
    target, tok = load_target(weights=weights)
    d = make_drafter(drafter, target, tok)
    ids = encode_prompt(tok, text)
    speculative_generate(target, d, ids, "strict", k=2, max_new_tokens=16, tokenizer=tok)
    print(json.dumps({"rss_mb": peak_rss_mb(),
                      "model_mb": model_bytes(target) / 2**20, "numerics": numerics_of(target)}))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS)
    ap.add_argument("--drafter", default=DEFAULT_DRAFTER_TRAINED, help=f"(default {DEFAULT_DRAFTER_TRAINED}, decode's)")
    ap.add_argument("--shapes", default="auto,1,2,3,4x2", help="strict shapes: k for a chain, MxD for a tree, auto for "
                    "decode's default -k auto (chosen per weights from its cost curve; default auto,1,2,3,4x2)")
    ap.add_argument("--no-memory", action="store_true", help="skip the per-weights memory processes")
    ap.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    texts = prompt_texts([p.strip() for p in args.prompts.split(",") if p.strip()])
    if args.memory_child:
        return memory_child(args.memory_child, args.drafter, texts[0], args.threads)
    torch.set_num_threads(args.threads)
    names_ = [s.strip() for s in args.shapes.split(",") if s.strip()]

    loaded = {}
    for w in WEIGHTS:
        t0 = time.perf_counter()
        target, tok = load_target(weights=w)
        loaded[w] = (target, tok, no_memory_across_prompts(make_drafter(args.drafter, target, tok)))
        print(f"{w}: {numerics_of(target)}, loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    shapes = {w: {s: parse_shape(s) for s in names_ if s != "auto"} for w in WEIGHTS}
    if "auto" in names_:
        for w in WEIGHTS:  # decode's -k auto: this machine's cost curve for this target (cached after the first run)
            got, choice, source = auto_engine_args(loaded[w][0], loaded[w][2], args.drafter, "strict")
            shapes[w] = {"auto": got, **shapes[w]}
            print(f"{w}: -k auto: {choice.why()}; {source}", file=sys.stderr)

    prompts = {w: [encode_prompt(loaded[w][1], t) for t in texts] for w in WEIGHTS}
    greedy = {w: [greedy_generate(loaded[w][0], ids, args.max_new_tokens) for ids in prompts[w]] for w in WEIGHTS}  # warm-up too
    runs, names, lossless = [], [], True

    def target_run(w, i):
        def run():
            t0 = time.perf_counter()
            greedy_generate(loaded[w][0], prompts[w][i], args.max_new_tokens)
            return time.perf_counter() - t0
        return run

    def strict_run(w, i, shape):
        def run():
            nonlocal lossless
            target, tok, d = loaded[w]
            res = speculative_generate(target, d, prompts[w][i], "strict", k=shape["k"], tree=shape["tree"],
                                       max_new_tokens=args.max_new_tokens, tokenizer=tok)
            lossless &= list(res.tokens) == greedy[w][i]
            return res.stats.seconds
        return run

    for i in range(len(texts)):
        for w in WEIGHTS:
            runs.append(target_run(w, i))
            names.append((w, "target", i))
            for s, shape in shapes[w].items():
                runs.append(strict_run(w, i, shape))
                names.append((w, f"strict_{s}", i))
    for r in runs:  # warm-up: every shape once (the drafters' first calls, the linear_chooser plan)
        r()
    times = interleave(runs, args.repeats)
    tokens = {w: sum(len(g) for g in greedy[w]) for w in WEIGHTS}
    per_rep: dict[tuple[str, str], list[float]] = {}
    for (w, what, _), ts in zip(names, times):
        acc = per_rep.setdefault((w, what), [0.0] * args.repeats)
        for r, t in enumerate(ts):
            acc[r] += t
    tok_s = {key: [tokens[key[0]] / t for t in ts] for key, ts in per_rep.items()}
    med = {key: statistics.median(v) for key, v in tok_s.items()}
    best = {w: max((k for k in med if k[0] == w and k[1] != "target"), key=med.get) for w in WEIGHTS}

    mem = {}
    if not args.no_memory:
        for w in WEIGHTS:
            run = subprocess.run([sys.executable, __file__, "--memory-child", w, "--drafter", args.drafter,
                                  "--prompts", args.prompts, "--threads", str(args.threads)], capture_output=True, text=True)
            if run.returncode:
                sys.stderr.write(run.stderr)
                raise SystemExit(f"memory process for {w} exited with {run.returncode}")
            mem[w] = json.loads(run.stdout.strip().splitlines()[-1])

    print(f"{len(texts)} prompts ({args.prompts}) x {args.max_new_tokens} tokens, drafter {args.drafter}, "
          f"{args.threads} thread(s), median of {args.repeats} interleaved repeats; greedy tokens "
          f"{'identical' if greedy['gguf'] == greedy['float32'] else 'differ'} between the two weights")
    for (w, what), v in sorted(med.items()):
        spread = (max(tok_s[(w, what)]) - min(tok_s[(w, what)])) / v
        print(f"  {w:8s} {what:12s} {v:7.2f} tok/s (spread {spread:.0%})")
    for w in WEIGHTS:
        print(f"{w}_target_tok_s={med[(w, 'target')]:.2f}")
        if "auto" in shapes[w]:
            a = shapes[w]["auto"]
            print(f"{w}_auto_shape=k{a['k']}" + ("" if a["tree"] is None else " tree " + str(a["tree"]).replace(" ", "")))
        for s in shapes[w]:
            print(f"{w}_strict_{s}_tok_s={med[(w, f'strict_{s}')]:.2f}")
        print(f"{w}_best_strict_shape={best[w][1].removeprefix('strict_')}")
        print(f"{w}_best_strict_tok_s={med[best[w]]:.2f}")
        print(f"{w}_best_strict_speedup={med[best[w]] / med[(w, 'target')]:.3f}")
        if w in mem:
            print(f"{w}_rss_mb={mem[w]['rss_mb']:.0f}")
            print(f"{w}_model_mb={mem[w]['model_mb']:.0f}")

    def ratio(a, b):
        return statistics.median(x / y for x, y in zip(tok_s[a], tok_s[b]))

    print(f"gguf_vs_float32_target={ratio(('gguf', 'target'), ('float32', 'target')):.3f}")
    print(f"gguf_vs_float32_best_strict={ratio(best['gguf'], best['float32']):.3f}")
    print(f"lossless={lossless}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
