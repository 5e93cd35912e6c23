"""GGUF blocks computed as stored (``draftcert.kernels.block_matmul``) against the float32 kernels, per pass.

The linear layers of the embedded target (SmolLM2-135M-Instruct Q4_1: 30 decoder layers of q/o
576x576, k/v 192x576, gate/up 1536x576, down 576x1536, and the Q8_0 LM head 49152x576), the real
weights of ``load_target(weights="gguf")`` and of the float32 checkpoint, in model order: one pass
over all of them per (rows M, kernel), round robin, the fastest of ``--repeats`` rounds.  Kernels:

* ``quant``: ``GGUFLinear`` (the blocks, decoded once per pass for all M rows; ~1/5 of the bytes);
* ``q8``: the same layers under the contract ``gguf-q8`` (``--weights gguf-q8``: 8-bit activations,
  integer block sums; the blocks repacked once, vectorised as the CPU allows: AVX-512 VNNI, AVX-VNNI or AVX2);
* ``packed``: draftcert's float32 streamed kernel on block-packed float32 weights;
* ``flinear``: ``F.linear`` (MKL) on the float32 weights.

``--baseline-source FILE`` (e.g. an older ``block_matmul.c``: ``git show REV:src/draftcert/models/block_matmul.c >
/tmp/old.c``) adds kernel ``quant_base``: that source built with the same compiler and flags and
timed in the same rounds, and last lines ``quant_vs_base_M<M>`` (this kernel / that one) and
``quant_base_identical=`` (whether both gave the same output bits on every layer and row count).

Printed as ``name=value`` lines: ``<kernel>_ms_M<M>`` (one pass, ms) and ``<kernel>_ratio_M<M>``
(the pass of M rows / the pass of 1 row of the same kernel), ``quant_vs_flinear_M1`` /
``quant_vs_packed_M1`` (one row: the quantised pass / the float32 pass), ``q8_vs_quant_M<M>`` (the
8-bit pass / the exact one), and last
``quant_vs_best_float32_M<M>`` (the quantised pass / the faster float32 kernel at M rows, which is
about what a float32 target's ``linear_chooser`` plan runs; below 1: the blocks are faster).  On a machine shared with
other work the figures are noisy (the fastest round is kept, which only removes added time).

    python benchmarks/bench_quant.py [--threads 1] [--repeats 5] [--rows 1,2,4,8,16] [--baseline-source FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftcert.models import load_target
from draftcert.kernels import block_matmul, packed_matmul
from draftcert.gguf.layers import GGUFLinear


def build_baseline(source: Path) -> ctypes.CDLL:
    """``source`` (a block_matmul.c) compiled as draftcert compiles its own kernel, loaded."""
    try:
        return block_matmul.LIBRARY.load_other(source)
    except RuntimeError as e:
        raise SystemExit(f"--baseline-source: {source} did not build: {e}") from None


def base_linear(lib, m: GGUFLinear, x: torch.Tensor) -> torch.Tensor:
    """``m(x)`` computed by the baseline build (same arguments as ``block_matmul.linear``)."""
    q, n, k = m.qweight, m.out_features, m.in_features
    x2 = x.reshape(-1, k).contiguous()
    y = torch.empty(x2.shape[0], n)
    b = m.bias.detach().contiguous() if m.bias is not None else None
    rc = lib.dq_linear(m.qtype, q.data_ptr(), q.shape[1], n, k, x2.data_ptr(), x2.shape[0],
                       b.data_ptr() if b is not None else None, y.data_ptr(), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"baseline kernel refused the call ({rc})")
    return y.reshape(*x.shape[:-1], n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--baseline-source", default=None, help="another block_matmul.c to time as quant_base (same flags)")
    args = ap.parse_args(argv)
    if not block_matmul.LIBRARY.available():
        print(f"the block_matmul kernel is unavailable here: {block_matmul.LIBRARY.reason()}", file=sys.stderr)
        return 1
    rows = [int(r) for r in args.rows.split(",")]
    torch.set_num_threads(args.threads)
    qm, _ = load_target(weights="gguf", fast_linear=False)
    fm, _ = load_target(weights="float32", fast_linear=False)
    qmods = [m for m in qm.modules() if isinstance(m, GGUFLinear)]
    fmods = {n: m for n, m in fm.named_modules() if type(m) is nn.Linear}
    names = [n for n, m in qm.named_modules() if isinstance(m, GGUFLinear)]
    fl = [fmods[n] for n in names]
    q8 = [(block_matmul.pack_q8(m.qweight, m.qtype, m.out_features, m.in_features), m) for m in qmods]
    kernels = {"quant": [(lambda x, m=m: m(x)) for m in qmods],
               "q8": [(lambda x, p=p, m=m: block_matmul.linear_q8(x, p, m.qtype, m.out_features, m.in_features, m.bias))
                      for p, m in q8],
               "flinear": [(lambda x, w=m.weight: F.linear(x, w)) for m in fl]}
    base_lib = None
    if args.baseline_source:
        base_lib = build_baseline(Path(args.baseline_source))
        kernels["quant_base"] = [(lambda x, m=m: base_linear(base_lib, m, x)) for m in qmods]
    if packed_matmul.LIBRARY.available():
        packed = [(packed_matmul.pack(m.weight), m.weight.shape[0]) for m in fl]
        kernels["packed"] = [(lambda x, p=p, n=n: packed_matmul.linear(x, p, n)) for p, n in packed]
    gen = torch.Generator().manual_seed(0)
    xs = {(r, k): torch.randn(r, k, generator=gen) for r in rows for k in {m.in_features for m in qmods}}
    ks = [m.in_features for m in qmods]
    best = {(kind, r): float("inf") for kind in kernels for r in rows if kind != "packed" or r <= packed_matmul.max_rows()}
    with torch.no_grad():
        for rep in range(args.repeats + 1):  # the first round warms up
            for r in rows:
                for kind, fns in kernels.items():
                    if (kind, r) not in best:
                        continue
                    t = 0.0
                    for fn, k in zip(fns, ks):
                        x = xs[(r, k)]
                        t0 = time.perf_counter()
                        fn(x)
                        t += time.perf_counter() - t0
                    if rep:
                        best[(kind, r)] = min(best[(kind, r)], t)
    print(f"block_matmul build {block_matmul.LIBRARY.build_id()} ({block_matmul.vector_width()} lanes, gguf-q8 "
          f"{block_matmul.q8_vectorised() or 'portable'}), packed_matmul {packed_matmul.LIBRARY.build_id() or 'unavailable'}, "
          f"{args.threads} thread(s), {len(qmods)} layers, fastest of {args.repeats} rounds (a shared machine: noisy)")
    for (kind, r), t in best.items():
        print(f"{kind}_ms_M{r}={t * 1e3:.3f}")
    for (kind, r), t in best.items():
        print(f"{kind}_ratio_M{r}={t / best[(kind, rows[0])]:.3f}")
    if rows[0] == 1:
        print(f"quant_vs_flinear_M1={best[('quant', 1)] / best[('flinear', 1)]:.3f}")
        if ("packed", 1) in best:
            print(f"quant_vs_packed_M1={best[('quant', 1)] / best[('packed', 1)]:.3f}")
    for r in rows:
        print(f"q8_vs_quant_M{r}={best[('q8', r)] / best[('quant', r)]:.3f}")
    if base_lib is not None:
        with torch.no_grad():
            same = all(torch.equal(m(xs[(r, m.in_features)]), base_linear(base_lib, m, xs[(r, m.in_features)]))
                       for r in rows for m in qmods)
        for r in rows:
            print(f"quant_vs_base_M{r}={best[('quant', r)] / best[('quant_base', r)]:.3f}")
        print(f"quant_base_identical={same}")
    for r in rows:  # the baseline a float32 target runs: linear_chooser keeps the faster float32 kernel per row count
        f32 = min(t for (kind, m), t in best.items() if m == r and not kind.startswith("quant") and kind != "q8")
        print(f"quant_vs_best_float32_M{r}={best[('quant', r)] / f32:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
