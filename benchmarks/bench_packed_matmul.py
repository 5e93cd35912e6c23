"""draftcert's few-row linear kernel (``draftcert.kernels.packed_matmul``) against one row of ``F.linear``.

The linear layers of the embedded target (SmolLM2-135M: 30 decoder layers of q/o 576x576, k/v
192x576, gate/up 1536x576, down 576x1536, then the LM head 49152x576), with random float32 weights,
in model order, are timed as ``linear_chooser`` times its candidates (``linear_chooser.measure_passes``:
one pass over all layers per (rows, kernel), the layers of a shape timed, round robin, fastest of
``--repeats`` rounds): the plain layer (``F.linear``, MKL) against the ``streamed`` kernel, 1..9
rows.  Every figure is a ratio to one row of ``F.linear`` of the same shape (``all``: of the whole
pass's linear layers) in the same run.  The last lines are ``name=value``: ``plain_worst_2_9`` /
``streamed_worst_2_9`` (the largest ``all`` ratio over rows 2..9) and ``streamed_rows9``.

    python benchmarks/bench_packed_matmul.py [--threads 1] [--repeats 7]
    DRAFTCERT_NATIVE_CFLAGS=-mno-avx512f python benchmarks/bench_packed_matmul.py   # the AVX2 build, on an AVX-512 CPU
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

from draftcert.kernels import linear_chooser, packed_matmul

LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # q k v o gate up down
LAYERS, LM_HEAD = 30, (49152, 576)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-rows", type=int, default=9)
    args = ap.parse_args(argv)
    if not packed_matmul.LIBRARY.available():
        print(f"the packed_matmul kernel is unavailable here: {packed_matmul.LIBRARY.reason()}", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with torch.no_grad():
        mods = [nn.Linear(k, n, bias=False).requires_grad_(False) for _ in range(LAYERS) for n, k in LAYER]
        mods.append(nn.Linear(LM_HEAD[1], LM_HEAD[0], bias=False).requires_grad_(False))
        res = linear_chooser.measure_passes(mods, repeats=args.repeats, strategies=("rowmajor", "streamed"),
                                        max_rows=args.max_rows)
    rows = range(1, args.max_rows + 1)
    print(f"packed_matmul build {packed_matmul.LIBRARY.build_id()} (block width {packed_matmul.block_width()}), {args.threads} thread(s), "
          f"fastest of {args.repeats} rounds; ratios to one row of F.linear")
    print("| shape | kernel | " + " | ".join(str(r) for r in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    total = {kind: [0.0] * len(rows) for kind in ("rowmajor", "streamed")}
    for (shape, _, _), r in res.items():
        one = r["seconds"]["rowmajor"][0]
        for kind in total:
            print(f"| {shape[0]}x{shape[1]} | {kind} | " + " | ".join(f"{x / one:.2f}" for x in r["seconds"][kind]) + " |")
            total[kind] = [a + b for a, b in zip(total[kind], r["seconds"][kind])]
    one = total["rowmajor"][0]
    curve = {kind: [x / one for x in v] for kind, v in total.items()}
    for kind, v in curve.items():
        print(f"| all | {kind} | " + " | ".join(f"{x:.2f}" for x in v) + " |")
    print(f"plain_worst_2_9={max(curve['rowmajor'][1:9]):.3f}")
    print(f"streamed_worst_2_9={max(curve['streamed'][1:9]):.3f}")
    print(f"streamed_rows9={curve['streamed'][min(8, len(rows) - 1)]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
