"""The one-row kernels' non-temporal weight stream (``kernels/block_matmul.c``, ``Q8NTA``) against
the same kernels without it (``-DQ8NTA=0``), end to end on the embedded target, in one process.

    PYTHONPATH=src python benchmarks/bench_weight_stream.py [--prompts mt-bench/81,...] [--max-new-tokens 128]
        [--repeats 3] [--drafter default+suffix]

A one-row pass under ``gguf-q8`` streams every weight once.  With ordinary prefetches the stream
fills the L2 and L3 caches with bytes nobody reads again before the next pass, evicting what the code
around the pass reads next (the caller's Python and torch objects, the KV cache, a drafter's weights);
with non-temporal prefetches of the 32-weight block types (Q4_1, Q5_0, Q8_0) it does not.  Both builds
of the native libraries (``forward/layer_kernel.c``, ``kernels/block_matmul.c``) are loaded side by
side (``NativeLibrary.built_with``) and every prompt decodes with each, in turns, which one first
alternating: the target alone (``k=0``, the target's own greedy step) and ``decode``'s draft shape
(``k="auto"``) with ``--drafter``.  The prompts are the goal prompts of ``bench_default_decode.py``.

Last lines, ``name=value``: ``target_alone_time_ratio=`` and ``speculative_time_ratio=`` (this build's
total time ÷ the other's: below 1, this build is faster), ``identical=`` (True when both builds gave the
same tokens, as they must: a prefetch moves no bit).
"""

from __future__ import annotations

import argparse
import time

import torch

from bench_default_decode import DEFAULT_PROMPTS, prompt_text
from draftcert.decode.engine import speculative_generate
from draftcert.drafting.make import make_drafter
from draftcert.forward import layer_kernel
from draftcert.kernels import block_matmul
from draftcert.models.loading import load_target

OTHER = ("-DQ8NTA=0",)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--drafter", default="default+suffix")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tok = load_target(None)
    drafter = make_drafter(args.drafter, target, tok)
    prompts = []
    for pid in [p.strip() for p in args.prompts.split(",") if p.strip()]:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt_text(pid)}], add_generation_prompt=True,
                                      return_dict=False)
        prompts.append((pid, list(ids)))

    def decode(build, ids, k, n):
        if build == "this":
            return speculative_generate(target, drafter, ids, "strict", k=k, max_new_tokens=n, tokenizer=tok)
        with layer_kernel.LIBRARY.built_with(*OTHER), block_matmul.LIBRARY.built_with(*OTHER):
            return speculative_generate(target, drafter, ids, "strict", k=k, max_new_tokens=n, tokenizer=tok)

    for build in ("this", "other"):  # compile both builds and warm up before anything is timed
        decode(build, prompts[0][1], "auto", 16)
    seconds = {(b, k): 0.0 for b in ("this", "other") for k in (0, "auto")}
    tokens, identical = {}, True
    for rep in range(args.repeats):
        for i, (pid, ids) in enumerate(prompts):
            for k in (0, "auto"):
                for build in (("this", "other") if (rep + i) % 2 == 0 else ("other", "this")):
                    t0 = time.perf_counter()
                    out = decode(build, ids, k, args.max_new_tokens)
                    seconds[(build, k)] += time.perf_counter() - t0
                    identical &= tokens.setdefault(pid, out.tokens) == out.tokens
    for k, name in ((0, "target alone"), ("auto", "speculative")):
        print(f"{name}: this build {seconds[('this', k)]:.3f} s, {' '.join(OTHER)} {seconds[('other', k)]:.3f} s")
    print(f"target_alone_time_ratio={seconds[('this', 0)] / seconds[('other', 0)]:.3f}")
    print(f"speculative_time_ratio={seconds[('this', 'auto')] / seconds[('other', 'auto')]:.3f}")
    print(f"identical={identical}")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
