"""Two builds of the ``gguf-q8`` linear kernel in one process, in turns: this checkout's
``kernels/block_matmul.c`` against another's, on the same packed blocks.

On a VM whose memory speed moves from process to process (docs/speed.md: a one-row pass of the
pair's target took 31-37 ms in one process and 25-27 ms in another), timing two builds in separate
processes measures the processes as much as the code.  Here both libraries are loaded side by side
(each compiled by ``draftcert.native`` from its own source), the weights are packed once by each
build's ``dq8_pack`` from the same random blocks, and every repeat calls both builds on the same
inputs, which one first alternating; the outputs must be the same bits (a kernel change that moves a bit is not a
speed change).

    python benchmarks/bench_kernel_ab.py --compare ../other-checkout/src [--types q4_k,q6_k]
        [--shapes 151936x1536,65536x4096,8960x1536] [--rows 1,2,3,4] [--threads 2] [--repeats 21]
        [--copies 1]

``--copies N`` packs N distinct weights of each shape (each from its own random blocks) and times a
turn as the N calls in order, as a decoder's layers call one shape after another: a small layer's
weights (the 0.5B drafter's [896, 4864] is 2.7 MB) then come from memory, not the cache, and the
per-call costs that a large shape hides (the threads' start and join, the activations' quantisation)
count as they do in a decode.  Times are per call (a turn ÷ N).

Both builds read one packed buffer where they pack alike: on such a VM two copies of the same
bytes, allocated apart, streamed at speeds up to a tenth apart in one process (the same code on
each).  Weights: random blocks with every scale a small positive float16 (a block's other bytes are codes,
any value valid), at least the L3 cache's size for the default shapes (the first two: 190 MB and
220 MB of Q6_K), so a row's pass streams them from memory as a decode does.

Last lines, ``name=value``: ``kernel_ms[TYPE,NxK,M]=`` (this build, median), ``base_kernel_ms[...]=``
(the other), ``kernel_ratio[TYPE,NxK,M]=`` (this ÷ the other: below 1, this build is faster),
``bits_equal=`` (True when every output matched), ``kernel_ratio_geomean=``.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import statistics
import sys
import time
from pathlib import Path

import torch

# GGML type: (id, bytes per block, elements per block, offsets of its float16 scales)
TYPES = {"q4_1": (3, 20, 32, (0, 2)), "q5_0": (6, 22, 32, (0,)), "q8_0": (8, 34, 32, (0,)),
         "q4_k": (12, 144, 256, (0, 2)), "q6_k": (14, 210, 256, (208,))}


def random_blocks(qtype: str, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """[n, row bytes] uint8: random codes, every float16 scale in [2^-7, 2^-6) (finite, positive)."""
    _, size, per, scales = TYPES[qtype]
    blocks = torch.randint(0, 256, (n, k // per, size), dtype=torch.uint8, generator=g)
    for off in scales:
        half = (0x2000 | torch.randint(0, 0x400, (n, k // per), dtype=torch.int32, generator=g))  # 0x2000: 2^-7
        blocks[..., off] = (half & 0xFF).to(torch.uint8)
        blocks[..., off + 1] = (half >> 8).to(torch.uint8)
    return blocks.reshape(n, -1).contiguous()


def packed(lib, qid: int, blocks: torch.Tensor, n: int, k: int, threads: int) -> torch.Tensor:
    out = torch.empty(int(lib.dq8_packed_bytes(qid, n, k)), dtype=torch.uint8)
    if lib.dq8_pack(qid, blocks.data_ptr(), blocks.shape[1], n, k, out.data_ptr(), threads):
        raise RuntimeError(f"dq8_pack refused GGML type {qid} [{n}, {k}]")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", required=True, metavar="SRC", help="another checkout's src folder")
    ap.add_argument("--types", default="q4_k,q6_k", help=f"comma separated, of {', '.join(TYPES)}")
    ap.add_argument("--shapes", default="151936x1536,65536x4096,8960x1536", help="NxK, comma separated")
    ap.add_argument("--rows", default="1,2,3,4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--copies", type=int, default=1, help="distinct weights of each shape, called in turn (a layer stack)")
    args = ap.parse_args(argv)
    from draftcert.kernels import block_matmul
    from draftcert.native import NativeLibrary

    other_src = Path(args.compare) / "draftcert" / "kernels" / "block_matmul.c"
    if not other_src.is_file():
        ap.error(f"--compare: no draftcert/kernels/block_matmul.c under {args.compare}")
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    if unknown := [t for t in types if t not in TYPES]:
        ap.error(f"--types: unknown {unknown}; known: {', '.join(TYPES)}")
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",") if s.strip()]
    rows = sorted({int(r) for r in args.rows.split(",")})
    if args.copies < 1:
        ap.error("--copies: at least 1")
    this = block_matmul.LIBRARY.require()
    base = NativeLibrary(other_src, "dq", block_matmul.LIBRARY.signatures).require()
    if not (this.dq8_vectorised() and base.dq8_vectorised()):
        print("bench_kernel_ab.py: a build without the vectorised gguf-q8 code: nothing to compare", file=sys.stderr)
        return 2
    print(f"this: {block_matmul.LIBRARY.source}\nother: {other_src}\n{args.threads} thread(s), "
          f"medians of {args.repeats} turns" + (f", {args.copies} weights a shape" if args.copies > 1 else ""), flush=True)
    g = torch.Generator().manual_seed(0)
    ratios, same, lines = [], True, []
    for t in types:
        qid, _, per, _ = TYPES[t]
        for n, k in shapes:
            if k % per:
                continue
            pas, pbs = [], []
            for _ in range(args.copies):
                blocks = random_blocks(t, n, k, g)
                pa, pb = packed(this, qid, blocks, n, k, args.threads), packed(base, qid, blocks, n, k, args.threads)
                del blocks
                if torch.equal(pa, pb):  # one buffer for both: where memory sits changes its speed (module docstring)
                    pb = pa
                elif not pas:
                    print(f"{t} [{n}, {k}]: the builds pack differently; each reads its own copy", flush=True)
                pas.append(pa), pbs.append(pb)
            x = torch.randn(max(rows), k, generator=g)
            for m in rows:
                ya, yb = torch.empty(m, n), torch.empty(m, n)
                ta, tb = [], []
                calls = [(this, pas, ya, ta), (base, pbs, yb, tb)]
                for rep in range(args.repeats + 1):
                    for lib, ws, y, times in calls[:: 1 if rep % 2 else -1]:  # the order alternates
                        t0 = time.perf_counter()
                        for w in ws:
                            lib.dq8_linear(qid, w.data_ptr(), n, k, x.data_ptr(), m, None, y.data_ptr(), args.threads)
                        times.append((time.perf_counter() - t0) / len(ws))
                same &= torch.equal(ya.view(torch.int32), yb.view(torch.int32))
                a, b = statistics.median(ta[1:]), statistics.median(tb[1:])  # the first turn warms up
                key = f"{t},{n}x{k},M{m}"
                ratios.append(a / b)
                lines += [f"kernel_ms[{key}]={1e3 * a:.3f}", f"base_kernel_ms[{key}]={1e3 * b:.3f}",
                          f"kernel_ratio[{key}]={a / b:.3f}"]
                print(f"{key}: {1e3 * a:.3f} ms against {1e3 * b:.3f} ms ({a / b:.3f})", flush=True)
    print("\n".join(lines))
    print(f"bits_equal={same}")
    print(f"kernel_ratio_geomean={math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
