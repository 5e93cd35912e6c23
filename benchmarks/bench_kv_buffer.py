"""A one-row decode step after S cached positions: transformers' ``DynamicLayer`` (a copy of the whole
cache per pass) against ``forward.kv_buffer``'s layer that appends in place.

For each context S a prompt of S tokens is prefilled once into each kind of cache; then one-row steps
take turns between the two (``--repeats`` each, after a warm-up), every step cropped back to S + 1 so
the context stays put (a crop is a view on either layer: the copy measured is the one each step's
append makes).  Wall-clock medians.  The logits of the two caches are compared bit for bit at every
step (exit 1 on any difference).

    python benchmarks/bench_kv_buffer.py [--target embedded|qwen2.5-coder-1.5b|qwen2.5-coder-0.5b]
        [--contexts 100,500,1000,2000] [--repeats 15] [--threads 2]

Last lines, ``name=value``: ``step_ms_dynamic[S]``, ``step_ms_spare[S]`` and ``speedup[S]`` (dynamic / spare),
and ``weights=`` (the contract the target runs under).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="embedded")
    p.add_argument("--contexts", default="100,500,1000,2000")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers.cache_utils import DynamicLayer

    from draftcert.gguf.layers import numerics_of
    from draftcert.models.hf import model_forward, new_cache
    from draftcert.models.loading import load_target
    from draftcert.models.tree_attention import crop_cache

    model, _ = load_target(args.target)
    contexts = [int(s) for s in args.contexts.split(",")]
    out, same = {}, True
    with torch.inference_mode():
        for S in contexts:
            prompt = [(7 * i + 11) % 5000 + 10 for i in range(S)]
            caches = {}
            for kind in ("dynamic", "spare"):
                cache = new_cache(model)
                if kind == "dynamic":
                    cache.layers = [DynamicLayer() for _ in cache.layers]
                model_forward(model, cache, prompt, 1)
                model_forward(model, cache, [5], 1)  # S + 1 cached: the context every step returns to
                caches[kind] = cache
            times = {k: [] for k in caches}
            for i in range(args.repeats + 3):
                logits = {}
                for kind, cache in caches.items():
                    t = time.perf_counter()
                    logits[kind] = model_forward(model, cache, [9], 1)
                    dt = time.perf_counter() - t
                    crop_cache(cache, S + 1)
                    if i >= 3:
                        times[kind].append(dt)
                same &= torch.equal(logits["dynamic"], logits["spare"])
            d, s = statistics.median(times["dynamic"]), statistics.median(times["spare"])
            out[S] = (d, s)
            print(f"S={S}: DynamicLayer {d * 1e3:.2f} ms, in place {s * 1e3:.2f} ms, x{d / s:.3f}", flush=True)
    for S, (d, s) in out.items():
        print(f"step_ms_dynamic[{S}]={d * 1e3:.3f}")
        print(f"step_ms_spare[{S}]={s * 1e3:.3f}")
        print(f"speedup[{S}]={d / s:.3f}")
    print(f"weights={numerics_of(model)}")
    if not same:
        print("the two caches gave different logits", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
