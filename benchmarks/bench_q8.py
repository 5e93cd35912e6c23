"""The contract ``gguf-q8``'s kernel (``block_matmul.linear_q8``) on every linear layer of a GGUF file, as
stored: one pass per row count, the cost curve of a verification pass without the rest of the model.

The layers are a GGUF file's 2-D block tensors in file order (``blk.*.weight`` and ``output.weight``,
or ``token_embd.weight`` where the output layer is tied to it; the input embedding is a lookup, not a
pass), each packed once with ``block_matmul.pack_q8``, each fed a
fixed random ``[M, K]`` float32 input.  Per ``--rows`` M, one pass = every layer once; the passes of
all row counts and kernels take turns (round robin, the kernels in alternating order), and the fastest of ``--repeats`` rounds is kept
(on a shared machine that only removes time others added).  The models default to the Qwen pair's
two files (``models.pair.ensure_pair_gguf``: the 1.5B target, Q4_K and Q6_K; the 0.5B drafter, Q5_0,
Q8_0, Q6_K and Q4_K; downloaded on first use, 1.6 GB) and the embedded SmolLM2 file (Q4_1, Q8_0).

``--baseline-source FILE`` (an older ``block_matmul.c``: ``git show REV:src/draftcert/models/block_matmul.c >
/tmp/old.c``) builds that source with the same compiler and flags and times its own ``dq8_pack`` and
``dq8_linear`` on the same layers in the same rounds (kernel ``base``); both must give the same output
bits on every layer and row count (the contract does not depend on the layout), printed as
``<model>_base_identical=``.

``--variants avxvnni,avx2,portable`` also builds the kernel for other x86 code paths on this machine,
by compiler flags after ``-march=native`` (``avxvnni``: ``-mno-avx512f``, the 256-bit AVX-VNNI code;
``avx2``: also ``-mno-avxvnni``, the AVX2 code; ``portable``: no AVX-512, AVX2, FMA, F16C or AVX-VNNI,
the portable code), and times each one's ``dq8_linear`` on the same packed layers in the same rounds as
kind ``<variant>`` (``q8`` is this machine's own build, ``<model>_q8_path`` names its code).  Every
variant must give the same output bits on every layer and row count: ``<model>_<variant>_identical=``.

``--forward`` adds, per model, the whole transformers model under ``gguf-q8`` (``load_target``):
one-row forwards (``hf.model_forward``, as the engine calls them) after a fixed 34-token prompt, timed in turns with the kernels and with
``block_matmul.linear_q8`` replaced by a function that only allocates its output (what the model costs
around the kernels: norms, rotary, attention, Python), and with the decoder layers given back to
transformers' own modules (``lean.decoder_layers``: what writing the layers out saves), ``--repeats`` x 10
of each, medians.

    python benchmarks/bench_q8.py [--models target,drafter,embedded] [--rows 1,2,3,4,8,16]
        [--threads 2] [--repeats 5] [--clock wall|cpu] [--baseline-source FILE]
        [--variants avxvnni,avx2,portable] [--forward]

``--clock cpu`` (with ``--threads 1``: the kernel then runs on the calling thread) times each kernel
call by the thread's CPU time (``time.thread_time``) instead of the wall clock: time the process
spent descheduled on a busy machine is left out (what other processes do to the caches is not).

Last lines, ``name=value`` per model: ``<model>_packed_mb`` (the bytes one pass reads),
``<model>_q8_ms_M<M>`` (one pass, ms), ``<model>_q8_ratio_M<M>`` (M rows / 1 row),
``<model>_q8_gb_s_M1`` (packed bytes / the one-row pass: the rate it streams the weights),
``<model>_<kind>_layers_ms_M<M>`` (the sum over layers of each layer's fastest call: on a busy machine
it removes others' time layer by layer, where the fastest whole pass still holds some), per
GGUF type ``<model>_q8_<type>_ms_M<M>`` (the layers of that type only, same rounds), and with a
baseline ``<model>_base_ms_M<M>``, ``<model>_q8_vs_base_M<M>`` (below 1: this kernel is faster) and
``<model>_base_identical``; with ``--variants`` ``<model>_<variant>_ms_M<M>``,
``<model>_<variant>_vs_q8_M<M>`` (the variant's pass / this build's: above 1, slower),
``<model>_<variant>_layers_vs_q8_M<M>`` (the same from the layer sums),
``<model>_<kind>_speedup_vs_portable_M<M>`` (with ``portable`` among them, from the layer sums: the
portable code's / the kind's, ``q8`` included) and ``<model>_<variant>_identical``; with ``--forward`` ``<model>_forward_ms_M1``,
``<model>_forward_outside_kernels_ms_M1``, ``<model>_forward_kernel_share`` (1 - the second / the
first), ``<model>_forward_modules_ms_M1`` (transformers' layer modules), ``<model>_forward_lean_vs_modules``
(below 1: the written-out layers are faster) and ``<model>_forward_lean_identical`` (the same logits).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

from draftcert.kernels import block_matmul
from draftcert.gguf.blocks import KERNEL_TYPES, block_type
from draftcert.gguf.reader import read_gguf

MODELS = {"target": "qwen2.5-coder-1.5b", "drafter": "qwen2.5-coder-0.5b", "embedded": None}
# --variants: (the flags after -march=native, the code dq8_vectorised() must report: 3 AVX-VNNI, 4 AVX2, 0 portable)
VARIANTS = {"avxvnni": (("-mno-avx512f",), 3), "avx2": (("-mno-avx512f", "-mno-avxvnni"), 4),
            "portable": (("-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-avxvnni"), 0)}


def gguf_path(model: str) -> Path:
    if MODELS[model] is None:
        from draftcert.models.loading import ensure_embedded_gguf  # the embedded target's file

        return ensure_embedded_gguf() / "model.gguf"
    from draftcert.models.pair import ensure_pair_gguf

    return ensure_pair_gguf(MODELS[model]) / "model.gguf"


def layers_of(path: Path) -> list[tuple[str, int, int, int, torch.Tensor]]:
    """``(name, qtype, n, k, blocks)`` of the file's 2-D block tensors that are passes (not the embedding)."""
    _, tensors = read_gguf(path)
    tied = "output.weight" not in tensors  # the output layer is the embedding's blocks
    out = []
    for t in tensors.values():
        if len(t.shape) != 2 or t.qtype not in KERNEL_TYPES or (t.name == "token_embd.weight" and not tied):
            continue
        n = t.shape[0]
        qk, qb = block_matmul.block_shape(t.qtype)  # elements, bytes a block
        k = t.data.shape[1] // qb * qk
        out.append((t.name, t.qtype, n, k, torch.from_numpy(t.data)))
    return out


def build_baseline(source: Path) -> ctypes.CDLL:
    """``source`` (a block_matmul.c) compiled as draftcert compiles its own kernel, loaded."""
    try:
        return block_matmul.LIBRARY.load_other(source)
    except RuntimeError as e:
        raise SystemExit(f"--baseline-source: {source} did not build: {e}") from None


def build_variant(name: str) -> ctypes.CDLL:
    """This source built for the code path ``name`` of :data:`VARIANTS` (flags after ``-march=native``)."""
    from draftcert.native import NativeLibrary

    flags, code = VARIANTS[name]
    lib = NativeLibrary(block_matmul.LIBRARY.source, "dq", block_matmul.LIBRARY.signatures,
                        (*block_matmul.LIBRARY.source_flags, *flags)).lib
    if lib is None:
        raise SystemExit(f"--variants {name}: the kernel did not build with {' '.join(flags)}")
    if lib.dq8_vectorised() != code:
        raise SystemExit(f"--variants {name}: the build with {' '.join(flags)} runs code {lib.dq8_vectorised()}, "
                         f"not {code} (this CPU or compiler lacks it)")
    return lib


def base_pack(lib, qtype: int, n: int, k: int, blocks: torch.Tensor) -> torch.Tensor:
    out = torch.empty(lib.dq8_packed_bytes(qtype, n, k), dtype=torch.uint8)
    if lib.dq8_pack(qtype, blocks.data_ptr(), blocks.shape[1], n, k, out.data_ptr(), torch.get_num_threads()):
        raise RuntimeError("the baseline's dq8_pack refused a layer")
    return out


def direct_linear(lib, x: torch.Tensor, packed: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    y = torch.empty(x.shape[0], n)
    if lib.dq8_linear(qtype, packed.data_ptr(), n, k, x.data_ptr(), x.shape[0], None, y.data_ptr(),
                      torch.get_num_threads()):
        raise RuntimeError("dq8_linear refused a layer")
    return y


def forward_costs(model: str, repeats: int) -> list[str]:
    """One-row forwards of ``model`` under gguf-q8: with its kernels, with them stubbed out, and with
    its decoder layers given back to transformers' modules (``decoder_layers.restore_layers``)."""
    from draftcert.forward import decoder_layers
    from draftcert.models import load_target
    from draftcert.models.hf import model_forward, new_cache
    from draftcert.prompts import encode_prompt

    target, tok = load_target(MODELS[model], weights="gguf-q8")  # None: the embedded target
    ids = encode_prompt(tok, "Write a Python function that checks whether a number is prime.")
    real = block_matmul.linear_q8
    n_lean = decoder_layers.lean_layers(target)

    def outputs_only(x, packed, qtype, n, k, bias=None):  # only the output a kernel call would fill
        return torch.zeros(*x.shape[:-1], n)

    modes = ("kernels", "outside", "modules")
    times = {m: [] for m in modes}
    logits = {}
    with torch.inference_mode():
        cache = new_cache(target)
        model_forward(target, cache, ids, 1)  # the prompt, as the engine feeds it
        try:
            for rep in range(repeats):
                for mode in modes if rep % 2 == 0 else modes[::-1]:
                    block_matmul.linear_q8 = outputs_only if mode == "outside" else real
                    if mode == "modules":
                        decoder_layers.restore_layers(target)
                    for step in range(10):
                        t0 = time.perf_counter()
                        out = model_forward(target, cache, [100 + step], 1)  # one row, the engine's call
                        times[mode].append(time.perf_counter() - t0)
                        cache.crop(-1)
                        if step == 0 and mode != "outside":
                            logits.setdefault(mode, out)
                    decoder_layers.use_lean_layers(target)
        finally:
            block_matmul.linear_q8 = real
            decoder_layers.use_lean_layers(target)
    full, outside, modules = (statistics.median(times[m]) for m in modes)
    return [f"{model}_forward_ms_M1={full * 1e3:.2f}", f"{model}_forward_outside_kernels_ms_M1={outside * 1e3:.2f}",
            f"{model}_forward_kernel_share={1 - outside / full:.3f}",
            f"{model}_forward_lean_layers={n_lean}",
            f"{model}_forward_modules_ms_M1={modules * 1e3:.2f}",
            f"{model}_forward_lean_vs_modules={full / modules:.3f}",
            f"{model}_forward_lean_identical={torch.equal(logits['kernels'], logits['modules'])}"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="target,drafter,embedded", help="comma-separated: " + ", ".join(MODELS))
    ap.add_argument("--rows", default="1,2,3,4,8,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the calling thread's CPU time per kernel call (needs --threads 1)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline-source", default=None, help="another block_matmul.c to time as kernel base (same flags)")
    ap.add_argument("--variants", default="", help="comma-separated x86 code paths to build and time beside this "
                    "machine's own: " + ", ".join(VARIANTS))
    ap.add_argument("--forward", action="store_true", help="also time each model's one-row forward with and "
                    "without its kernels (what the rest of the model costs)")
    args = ap.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad:
        ap.error(f"--models: unknown {', '.join(bad)} (choose from {', '.join(MODELS)})")
    if not block_matmul.LIBRARY.available():
        print(f"the block_matmul kernel is unavailable here: {block_matmul.LIBRARY.reason()}", file=sys.stderr)
        return 1
    rows = sorted({int(r) for r in args.rows.split(",")})
    if rows[0] != 1:
        rows = [1, *rows]
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu times the calling thread only: use it with --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    base = build_baseline(Path(args.baseline_source)) if args.baseline_source else None
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)} (choose from {', '.join(VARIANTS)})")
    lib = block_matmul.LIBRARY.lib
    libs = {"q8": lib, **{v: build_variant(v) for v in variants}, **({"base": base} if base is not None else {})}
    gen = torch.Generator().manual_seed(0)
    print(f"block_matmul build {block_matmul.LIBRARY.build_id()} (gguf-q8 {block_matmul.q8_vectorised() or 'portable'}), "
          f"{args.threads} thread(s), fastest of {args.repeats} rounds, {args.clock} clock", flush=True)
    results = []
    for model in models:
        layers = layers_of(gguf_path(model))
        packs = {"q8": [block_matmul.pack_q8(b, qt, n, k) for _, qt, n, k, b in layers]}
        for v in variants:  # the packing does not depend on the code path: the same bytes
            packs[v] = packs["q8"]
        if base is not None:
            packs["base"] = [base_pack(base, qt, n, k, b) for _, qt, n, k, b in layers]
        xs = {(r, k): torch.randn(r, k, generator=gen) for r in rows for k in {k for _, _, _, k, _ in layers}}
        names = {qt: block_type(qt).name for _, qt, _, _, _ in layers}

        def run(kind, i, x):  # both kernels through the same direct call: the kernels' time, no wrapper
            _, qt, n, k, _ = layers[i]
            return direct_linear(libs[kind], x, packs[kind][i], qt, n, k)

        best = {(kind, r): float("inf") for kind in packs for r in rows}
        best_type = {(kind, qt, r): float("inf") for kind in packs for qt in names for r in rows}
        best_layer = {(kind, r): [float("inf")] * len(layers) for kind in packs for r in rows}
        with torch.inference_mode():
            for rep in range(args.repeats + 1):  # the first round warms up
                for r in rows:
                    # the kernels take turns in alternating order, so neither is always timed first
                    for kind in (list(packs) if rep % 2 else list(packs)[::-1]):
                        t, per = 0.0, dict.fromkeys(names, 0.0)
                        for i, (_, qt, _, k, _) in enumerate(layers):
                            x = xs[(r, k)]
                            t0 = clock()
                            run(kind, i, x)
                            dt = clock() - t0
                            t += dt
                            per[qt] += dt
                            if rep:
                                best_layer[(kind, r)][i] = min(best_layer[(kind, r)][i], dt)
                        if rep:
                            best[(kind, r)] = min(best[(kind, r)], t)
                            for qt, v in per.items():
                                best_type[(kind, qt, r)] = min(best_type[(kind, qt, r)], v)
            same = None
            if base is not None:
                same = all(torch.equal(run("q8", i, xs[(r, layers[i][3])]), run("base", i, xs[(r, layers[i][3])]))
                           for r in rows for i in range(len(layers)))
            same_variant = {v: all(torch.equal(run("q8", i, xs[(r, layers[i][3])]).view(torch.int32),
                                               run(v, i, xs[(r, layers[i][3])]).view(torch.int32))
                                   for r in rows for i in range(len(layers))) for v in variants}
        mb = sum(p.numel() for p in packs["q8"]) / 1e6
        results.append(f"{model}_layers={len(layers)}")
        results.append(f"{model}_q8_path={block_matmul.q8_vectorised() or 'portable'}")
        results.append(f"{model}_packed_mb={mb:.1f}")
        if base is not None:
            results.append(f"{model}_base_packed_mb={sum(p.numel() for p in packs['base']) / 1e6:.1f}")
        for kind in packs:
            for r in rows:
                results.append(f"{model}_{kind}_ms_M{r}={best[(kind, r)] * 1e3:.3f}")
        for kind in packs:
            for r in rows:
                results.append(f"{model}_{kind}_layers_ms_M{r}={sum(best_layer[(kind, r)]) * 1e3:.3f}")
        for kind in packs:
            for r in rows[1:]:
                results.append(f"{model}_{kind}_ratio_M{r}={best[(kind, r)] / best[(kind, 1)]:.3f}")
        results.append(f"{model}_q8_gb_s_M1={mb / 1e3 / best[('q8', 1)]:.2f}")
        for kind in packs:
            for qt, name in names.items():
                for r in rows:
                    results.append(f"{model}_{kind}_{name}_ms_M{r}={best_type[(kind, qt, r)] * 1e3:.3f}")
        if base is not None:
            for r in rows:
                results.append(f"{model}_q8_vs_base_M{r}={best[('q8', r)] / best[('base', r)]:.3f}")
            results.append(f"{model}_base_identical={same}")
        for v in variants:
            for r in rows:
                results.append(f"{model}_{v}_vs_q8_M{r}={best[(v, r)] / best[('q8', r)]:.3f}")
            for r in rows:
                results.append(f"{model}_{v}_layers_vs_q8_M{r}="
                               f"{sum(best_layer[(v, r)]) / sum(best_layer[('q8', r)]):.3f}")
        if "portable" in variants:
            for kind in ["q8", *variants]:
                if kind != "portable":
                    for r in rows:
                        results.append(f"{model}_{kind}_speedup_vs_portable_M{r}="
                                       f"{sum(best_layer[('portable', r)]) / sum(best_layer[(kind, r)]):.1f}")
        for v in variants:
            results.append(f"{model}_{v}_identical={same_variant[v]}")
        del packs, xs
        if args.forward:
            results += forward_costs(model, args.repeats)
    print("\n".join(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
