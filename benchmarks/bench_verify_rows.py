"""What a verification pass of 2..5 rows costs in one-row passes: the target's forward as the engine runs it.

One pass = the engine's ``decode.round.verify`` of the pending token and a chain of ``rows - 1`` drafts
after a ``--context``-token KV cache (``hf.model_forward`` with logits for every row), then the cache
cropped back to the context, untimed.  The row counts take turns (round robin, ``--repeats`` rounds after
a warm-up), each timed by the process's CPU time (``time.process_time``: with ``--threads 1`` the pass runs
on the calling thread, so time the process spent descheduled on a shared machine is left out) and by the
wall clock; medians.  ``verify_rows_cost[M]`` is the CPU-time median of M rows / that of 1 row (the goal
of issue 47: <= 1.25 for 2..5 rows).

``--stages`` times, in extra rounds, where the pass spends its CPU time: the ``gguf-q8`` kernel calls
by layer kind (``qkv``, ``o``, ``gate_up``, ``down``, ``head`` the output layer; ``block_matmul.linear_q8``
and ``linear`` wrapped with a CPU clock), the attention (``row_attention.attention``) and the rest
(``glue``: norms, rotary, cache updates, Python), ms per pass and each stage's M-row / 1-row ratio.
The clock calls add a few microseconds per kernel call to the totals of those rounds, not to the
figures above.

``--in-decode N`` times the passes inside real decodes instead: ``draftcert decode``'s defaults on the
embedded target (strict, ``-k auto``, its default drafter; ``--drafter`` another spec) over the first N
of ``bench_default_decode.py``'s held-out prompts, ``--max-new-tokens`` each, ``--repeats`` decodes of each
after one untimed.  Every verification pass (the engine's ``verify``, wrapped with a wall clock) is
filed by its rows, the pending tokens plus the draft's nodes; each decode's first pass, the prompt's
prefill, is left out.  Between passes the drafter runs, so the target's weights, cache and buffers are
cold as they are in a decode; the isolated passes above run back to back.  Last lines:
``in_decode_passes[M]=``, ``in_decode_wall_ms[M]=`` (median) and ``in_decode_wall_cost[M]=`` (÷ the
1-row median), for every M seen at least 5 times.

``--compare SRC`` runs this script in turns with ``PYTHONPATH=SRC`` (another checkout's ``src``, e.g. main's)
and with this one's, ``--turns`` processes each, alternating, and prints both sets of figures (the
baseline's prefixed ``base_``), each the median over its processes of their per-process figures.

    python benchmarks/bench_verify_rows.py [--target embedded|qwen2.5-coder-1.5b] [--rows 1,2,3,4,5]
        [--context 128] [--repeats 30] [--threads 1] [--stages] [--compare SRC --turns 3]
    python benchmarks/bench_verify_rows.py --in-decode 4 --threads 2 --repeats 2 [--drafter SPEC]

Last lines, ``name=value``: ``verify_rows_ms[M]`` (CPU ms of an M-row pass), ``verify_rows_wall_ms[M]``,
``verify_rows_cost[M]``, ``verify_rows_wall_cost[M]``, with ``--stages`` ``stage_ms[<stage>][M]`` and
``stage_cost[<stage>][M]``, and ``weights=`` (the contract the target runs under).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def _parse_rows(text: str) -> list[int]:
    rows = sorted({int(r) for r in text.split(",") if r.strip()})
    if not rows or rows[0] < 1 or 1 not in rows:
        raise ValueError("--rows: a comma list of row counts >= 1 that includes 1")
    return rows


def measure_in_decode(args) -> dict:
    """The passes of real decodes, filed by rows (module docstring: ``--in-decode``)."""
    import draftcert
    import draftcert.decode.engine as engine
    from draftcert.cli.decode import DEFAULT_DRAFTER_TRAINED
    from draftcert.decode import speculative_generate
    from draftcert.drafting import make_drafter
    from draftcert.gguf.layers import numerics_of
    from draftcert.models import load_target, parse_drafter_spec
    from draftcert.prompts import encode_prompt
    from bench_default_decode import DEFAULT_PROMPTS, prompt_text

    torch.set_num_threads(args.threads)
    model, tok = load_target(None)
    spec = parse_drafter_spec(args.drafter or DEFAULT_DRAFTER_TRAINED).spec
    drafter = make_drafter(spec, model, tok)
    prompts = [prompt_text(pid) for pid in DEFAULT_PROMPTS.split(",")[: args.in_decode]]
    by_rows: dict[int, list[float]] = {}
    timing = [False]
    verify = engine.verify

    def timed_verify(target, cache, n_cached, pending, draft, *a, **kw):
        t0 = time.perf_counter()
        out = verify(target, cache, n_cached, pending, draft, *a, **kw)
        if timing[0] and n_cached:  # n_cached 0: the prompt's prefill
            by_rows.setdefault(len(pending) + len(draft), []).append(time.perf_counter() - t0)
        return out

    engine.verify = timed_verify
    try:
        for rep in range(args.repeats + 1):
            timing[0] = rep > 0
            for text in prompts:
                speculative_generate(model, drafter, [encode_prompt(tok, text)], k="auto", tokenizer=tok,
                                     max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id)
    finally:
        engine.verify = verify
    if len(by_rows.get(1, [])) < 5:
        raise SystemExit("--in-decode: fewer than 5 one-row passes to divide by; more prompts or repeats")
    out = {"weights": numerics_of(model), "draftcert": str(Path(draftcert.__file__).parent.parent), "drafter": spec}
    one = statistics.median(by_rows[1])
    for rows in sorted(r for r, v in by_rows.items() if len(v) >= 5):
        ms = statistics.median(by_rows[rows])
        out[f"in_decode_passes[{rows}]"] = len(by_rows[rows])
        out[f"in_decode_wall_ms[{rows}]"] = 1e3 * ms
        out[f"in_decode_wall_cost[{rows}]"] = ms / one
    return out


def measure(args) -> dict:
    """This process's figures (the imports are of whatever ``draftcert`` PYTHONPATH names)."""
    import draftcert
    from draftcert.decode.draft_shape.costs import chain_for
    from draftcert.decode.round import verify
    from draftcert.gguf.layers import numerics_of
    from draftcert.kernels import block_matmul, row_attention
    from draftcert.models.hf import model_forward, new_cache
    from draftcert.models.tree_attention import crop_cache
    from draftcert.models.loading import load_target

    torch.set_num_threads(args.threads)
    try:
        model, tok = load_target(None if args.target == "embedded" else args.target)
    except ValueError as e:  # ModelUnavailable: an unknown or unreachable target
        print(f"bench_verify_rows.py: error: --target: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    cfg = model.config
    # a fixed token sequence: context + the largest chain (any tokens: the cost does not depend on them)
    text = ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 40)
    ids = tok(text)["input_ids"][: args.context + max(args.rows) + 1]
    if len(ids) < args.context + max(args.rows):
        raise SystemExit("the fixed text is too short for --context")
    cache = new_cache(model)
    with torch.inference_mode():
        model_forward(model, cache, ids[: args.context], 1)

    def one(rows: int) -> None:
        verify(model, cache, args.context, ids[args.context:args.context + 1], chain_for(ids, args.context, rows))
        crop_cache(cache, args.context)

    cpu: dict[int, list[float]] = {r: [] for r in args.rows}
    wall: dict[int, list[float]] = {r: [] for r in args.rows}
    with torch.inference_mode():
        for rep in range(args.repeats + 1):
            order = args.rows if rep % 2 else args.rows[::-1]
            for r in order:
                c0, w0 = time.process_time(), time.perf_counter()
                one(r)
                c1, w1 = time.process_time(), time.perf_counter()
                if rep:
                    cpu[r].append(c1 - c0)
                    wall[r].append(w1 - w0)
    out = {"weights": numerics_of(model), "draftcert": str(Path(draftcert.__file__).parent.parent)}
    for r in args.rows:
        out[f"verify_rows_ms[{r}]"] = 1e3 * statistics.median(cpu[r])
        out[f"verify_rows_wall_ms[{r}]"] = 1e3 * statistics.median(wall[r])
    for r in args.rows:
        out[f"verify_rows_cost[{r}]"] = out[f"verify_rows_ms[{r}]"] / out["verify_rows_ms[1]"]
        out[f"verify_rows_wall_cost[{r}]"] = out[f"verify_rows_wall_ms[{r}]"] / out["verify_rows_wall_ms[1]"]
    if args.stages:
        out.update(stages(args, model, cfg, one, block_matmul, row_attention))
    return out


def stages(args, model, cfg, one, block_matmul, row_attention) -> dict:
    """CPU ms per pass by stage (module docstring), medians over ``max(5, repeats // 3)`` rounds."""
    hidden, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    qkv = (heads + 2 * kv) * head_dim

    def kind(n: int, k: int) -> str:
        if n >= vocab:
            return "head"
        if k == inter:
            return "down"
        if n == 2 * inter or n == inter:
            return "gate_up"
        if n in (qkv, (heads + kv) * head_dim, kv * head_dim) or (n == heads * head_dim and k == hidden and n != hidden):
            return "qkv"
        return "o" if n == hidden else "qkv"

    acc: dict[str, float] = {}

    def wrap(fn, name_of):
        def timed(*a, **kw):
            t0 = time.process_time()
            y = fn(*a, **kw)
            key = name_of(*a, **kw)
            acc[key] = acc.get(key, 0.0) + time.process_time() - t0
            return y
        return timed

    saved = (block_matmul.linear_q8, block_matmul.linear, row_attention.attention)
    block_matmul.linear_q8 = wrap(saved[0], lambda x, w, qt, n, k, *a, **kw: kind(n, k))
    block_matmul.linear = wrap(saved[1], lambda x, w, qt, n, k, *a, **kw: kind(n, k))
    row_attention.attention = wrap(saved[2], lambda *a, **kw: "attention")
    per: dict[int, dict[str, list[float]]] = {r: {} for r in args.rows}
    try:
        with torch.inference_mode():
            for rep in range(max(5, args.repeats // 3) + 1):
                for r in (args.rows if rep % 2 else args.rows[::-1]):
                    acc.clear()
                    c0 = time.process_time()
                    one(r)
                    total = time.process_time() - c0
                    if rep:
                        acc["glue"] = total - sum(acc.values())
                        acc["total"] = total
                        for key, v in acc.items():
                            per[r].setdefault(key, []).append(v)
    finally:
        block_matmul.linear_q8, block_matmul.linear, row_attention.attention = saved
    out = {}
    names = [s for s in ("qkv", "o", "gate_up", "down", "head", "attention", "glue", "total") if s in per[1]]
    for s in names:
        base = 1e3 * statistics.median(per[1][s])
        for r in args.rows:
            ms = 1e3 * statistics.median(per[r].get(s, [0.0]))
            out[f"stage_ms[{s}][{r}]"] = ms
            out[f"stage_cost[{s}][{r}]"] = ms / base if base > 0 else float("nan")
    return out


def compare(args, argv: list[str]) -> None:
    """``--turns`` processes of each checkout, alternating; medians of their figures."""
    here = Path(__file__).resolve()
    ours = str(here.parent.parent / "src")
    child = [a for a in argv]
    i = child.index("--compare")
    del child[i:i + 2]
    child += ["--json"]
    runs: dict[str, list[dict]] = {"base_": [], "": []}
    for turn in range(args.turns):
        for prefix, src in ((("base_", args.compare), ("", ours)) if turn % 2 == 0 else (("", ours), ("base_", args.compare))):
            env = dict(os.environ, PYTHONPATH=src)
            res = subprocess.run([sys.executable, str(here), *child], env=env, capture_output=True, text=True)
            if res.returncode:
                sys.stderr.write(res.stderr)
                raise SystemExit(f"the run with PYTHONPATH={src} failed ({res.returncode})")
            got = json.loads(res.stdout.strip().splitlines()[-1])
            runs[prefix].append(got)
            print(f"turn {turn + 1} {prefix or 'this '}({got['draftcert']}): "
                  + " ".join(f"{r}:{got[f'verify_rows_cost[{r}]']:.3f}" for r in args.rows), flush=True)
    for prefix, got in runs.items():
        print(f"{prefix}weights={got[0]['weights']}")
        for key in got[0]:
            if key not in ("weights", "draftcert"):
                print(f"{prefix}{key}={statistics.median(g[key] for g in got):.3f}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="embedded", help="embedded (default) or qwen2.5-coder-1.5b (the pair's target)")
    ap.add_argument("--rows", default="1,2,3,4,5", help="row counts, comma separated, 1 among them")
    ap.add_argument("--context", type=int, default=128, help="tokens in the KV cache before the pass")
    ap.add_argument("--repeats", type=int, default=30, help="timed rounds over the row counts")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--stages", action="store_true", help="also time the stages of a pass")
    ap.add_argument("--compare", metavar="SRC", help="another checkout's src folder, timed in turns with this one")
    ap.add_argument("--turns", type=int, default=3, help="processes of each checkout with --compare")
    ap.add_argument("--in-decode", type=int, metavar="N", help="time the passes inside decodes of N held-out prompts "
                    "(decode's defaults on the embedded target) instead of isolated passes")
    ap.add_argument("--drafter", help="with --in-decode: the drafter spec (default: decode's default)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="with --in-decode: tokens per decode")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        args.rows = _parse_rows(args.rows)
    except ValueError as e:
        ap.error(str(e))
    for opt in ("context", "repeats", "threads", "turns"):
        if getattr(args, opt) < 1:
            ap.error(f"--{opt} must be at least 1")
    if args.in_decode is not None:
        from bench_default_decode import DEFAULT_PROMPTS
        n_prompts = len(DEFAULT_PROMPTS.split(","))
        if not 1 <= args.in_decode <= n_prompts or args.max_new_tokens < 1:
            ap.error(f"--in-decode: N from 1 to {n_prompts} (the held-out prompts), --max-new-tokens >= 1")
        if args.target != "embedded" or args.compare or args.stages:
            ap.error("--in-decode: the embedded target only, without --compare or --stages")
        for key, v in measure_in_decode(args).items():
            print(f"{key}={v:.3f}" if isinstance(v, float) else f"{key}={v}")
        return 0
    if args.compare:
        if not (Path(args.compare) / "draftcert").is_dir():
            ap.error(f"--compare: {args.compare} holds no draftcert package")
        compare(args, argv)
        return 0
    out = measure(args)
    if args.json:
        print(json.dumps(out))
        return 0
    for key, v in out.items():
        print(f"{key}={v:.3f}" if isinstance(v, float) else f"{key}={v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
