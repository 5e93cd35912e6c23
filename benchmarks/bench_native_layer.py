"""A ``gguf-q8`` target's pass with its decoder layers computed natively (``forward/native_layer.py``, two C
calls a layer) against the written-out torch layer (``DRAFTCERT_NATIVE_LAYERS=0``), on the same model.

For each context S a prompt of S tokens is prefilled once; then passes of each row count R (1: the
decode step; 2..: chain verifications) take turns between the two layers (``--repeats`` each; after
each switch one untimed pass), every pass cropped back to S so the context stays put.  Wall-clock
medians.  The two arithmetics differ (the native norms and activation are not torch's), so the logits
are compared for the greedy token only.

    python benchmarks/bench_native_layer.py [--target embedded|qwen2.5-coder-1.5b|qwen2.5-coder-0.5b]
        [--contexts 100,1000] [--rows 1,2,3,4,5] [--repeats 15] [--threads 2]

Last lines, ``name=value``: ``pass_ms_torch[S,R]``, ``pass_ms_native[S,R]``, ``speedup[S,R]`` (torch /
native), ``rows_cost_native[S,R]`` (an R-row pass over a one-row pass, native), ``same_greedy=`` (the
fraction of passes whose greedy tokens agree), ``weights=``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="embedded")
    p.add_argument("--contexts", default="100,1000")
    p.add_argument("--rows", default="1,2,3,4,5")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from draftcert.forward import native_layer
    from draftcert.gguf.layers import numerics_of
    from draftcert.models.hf import model_forward, new_cache
    from draftcert.models.loading import load_target
    from draftcert.models.tree_attention import crop_cache

    model, _ = load_target(args.target)
    if numerics_of(model) != "gguf-q8":
        print(f"{args.target} runs {numerics_of(model)}, not gguf-q8: nothing to compare", file=sys.stderr)
        return 2

    def use(kind: str) -> None:
        os.environ["DRAFTCERT_NATIVE_LAYERS"] = "1" if kind == "native" else "0"
        native_layer.forget(model)

    contexts = [int(s) for s in args.contexts.split(",")]
    rows = [int(s) for s in args.rows.split(",")]
    out, agree, compared = {}, 0, 0
    with torch.inference_mode():
        for S in contexts:
            prompt = [(7 * i + 11) % 5000 + 10 for i in range(S)]
            cache = new_cache(model)
            model_forward(model, cache, prompt, 1)
            for R in rows:
                ids = [(13 * j + 5) % 5000 + 10 for j in range(R)]
                times = {"torch": [], "native": []}
                for i in range(args.repeats + 1):
                    greedy = {}
                    for kind in times:
                        use(kind)
                        model_forward(model, cache, ids, R)  # untimed: the plans are made again
                        crop_cache(cache, S)
                        t = time.perf_counter()
                        logits = model_forward(model, cache, ids, R)
                        dt = time.perf_counter() - t
                        crop_cache(cache, S)
                        greedy[kind] = logits.argmax(-1)
                        if i:
                            times[kind].append(dt)
                    agree += int(torch.equal(greedy["torch"], greedy["native"]))
                    compared += 1
                t_, n_ = statistics.median(times["torch"]), statistics.median(times["native"])
                out[S, R] = (t_, n_)
                print(f"S={S} R={R}: torch layer {t_ * 1e3:.2f} ms, native {n_ * 1e3:.2f} ms, x{t_ / n_:.3f}", flush=True)
    os.environ.pop("DRAFTCERT_NATIVE_LAYERS", None)
    for (S, R), (t_, n_) in out.items():
        print(f"pass_ms_torch[{S},{R}]={t_ * 1e3:.3f}")
        print(f"pass_ms_native[{S},{R}]={n_ * 1e3:.3f}")
        print(f"speedup[{S},{R}]={t_ / n_:.3f}")
        if (S, 1) in out:
            print(f"rows_cost_native[{S},{R}]={n_ / out[S, 1][1]:.3f}")
    print(f"same_greedy={agree / max(compared, 1):.3f}")
    print(f"weights={numerics_of(model)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
