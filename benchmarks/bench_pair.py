"""Wall-clock speed on the real pair: Qwen2.5-Coder-1.5B-Instruct drafted by -0.5B-Instruct
(``--pair qwen2.5-coder``, docs/pair.md), against the target alone, transformers' assisted
generation with the same assistant and llama.cpp on the same GGUF files, on held-out chat
(ShareGPT) and code (HumanEval) prompts.

    PYTHONPATH=src python benchmarks/bench_pair.py                  # 4 + 4 prompts x 128 tokens
    PYTHONPATH=src python benchmarks/bench_pair.py --quick          # 1 + 1 prompts x 32 tokens
    PYTHONPATH=src python benchmarks/bench_pair.py --llamacpp off   # without the llama.cpp rows
    PYTHONPATH=src python benchmarks/bench_pair.py --costs-only     # the dtype measurement

Our models compute from the GGUF blocks with ``decode``'s default contract
(``models.loading.default_weights()``: ``gguf-q8`` where the CPU runs it vectorised, else ``gguf``;
the header prints ``numerics_of`` of both); ``--weights gguf`` takes the exact weights with float32
sums, ``--weights float32`` the converted float32 checkpoints
(converted once, 9.6 GB for the pair).  The drafter follows ``$DRAFTCERT_WEIGHTS``, which the
script sets to ``--weights`` (``load_drafter`` has no ``weights`` argument).

Methods (each prompt runs every method once per repeat, in an order rotated per prompt and
repeat, so that load changes on a shared machine hit every method alike; a method's figure per
prompt is the median of its repeats, and its tokens/s is total tokens over the sum of those):

(a) ``target``: ``target.generate(do_sample=False)``, the target alone (the reference output);
    ``greedy``: the target alone through draftcert's own loop (``decode.engine.greedy_generate``,
    what ``decode --baseline`` times: ``hf.model_forward`` per token, no generate() machinery).
(b) ``hf-assisted``: ``target.generate(do_sample=False, assistant_model=<0.5B>)``, transformers'
    assisted generation with the same drafter: the peer a user would pick instead.
(c) ``dc:RULE:SHAPE``: ``speculative_generate`` with ``decode --pair``'s drafter, live certificates on, as a
    chain (``kN``) or a tree (``treeMxD``: top-M children along the greedy path, depth D): the 0.5B
    drafter recomputed as Q4_1 blocks (``qwen2.5-coder-0.5b@q4_1``, ``models.pair.PAIRS``' ``decode_drafter``;
    the stored one under ``--weights float32``), its output layer over its draft vocabulary as ``decode``
    does by default: its shipped token map (``drafting.draft_vocab.SHIPPED``: 32,768 tokens plus the
    sequence's own); ``dc:...@qwen2.5-coder-0.5b``: the drafter as stored;
    ``dc:RULE:SHAPE:vall``: over the whole vocabulary; ``dc:RULE:SHAPE:vN``: the first N token ids
    only (``decode --draft-vocab all`` and ``N``).
    ``dc:...@SPEC``: the same with the drafter ``SPEC`` (a ``--drafter`` spec, e.g.
    ``dc:strict:auto@eagle:qwen2.5-coder-1.5b``, the pair's feature drafter), loaded once.
(d) llama.cpp (``benchmarks/_llamacpp.py``), one process per run, on the same GGUF files
    (``models.pair.ensure_pair_gguf``), ``-t --threads``, greedy (``--temp 0 --top-k 1``):
    ``llamacpp:target`` (``llama-completion -no-cnv``, the target alone),
    ``llamacpp:spec:N`` (``llama-speculative-simple --spec-type draft-simple -md <0.5B>
    --spec-draft-n-max N --spec-draft-p-min 0``: its speculative decoding, drafts of N),
    ``llamacpp:lookup[:N]`` (``llama-lookup``: n-gram lookup from the prompt and the output, a fresh
    dynamic cache per run, drafts of ``--spec-draft-n-max`` N, llama.cpp's default 3 without N).
    The binaries are llama.cpp as vendored by llama-cpp-python 0.3.36, built once into
    ``<draftcert cache>/llamacpp/`` (``--llamacpp auto``, minutes; the AMX instructions off) or
    taken from ``--llamacpp DIR``; ``--llamacpp off`` drops these rows.
    The prompt: llama.cpp gets the very text ``encode_prompt`` tokenizes (the chat template
    applied by our tokenizer, ``tokenize=False``; the script checks that our tokenizer gives the
    same ids from that text) as a raw prompt: ``-p TEXT --no-escape``, chat mode off, special
    tokens parsed, no BOS (Qwen2.5's GGUF adds none); ``llama-completion --verbose-prompt``'s ids
    are compared with ours for every prompt (the line ``llama.cpp prompt ids``; the other two
    binaries tokenize with the same call and vocabulary).
    Timing: ours times the whole generate call (prefill included, model loaded); llama.cpp's is
    its own figures for the same span, the model load and its warm-up run excluded:
    ``llama-completion``'s prompt eval + eval + sampling times, the examples' ``encoded`` +
    ``decoded`` seconds (prompt processing on both models, then the decoding loop).  Its token
    count is its own: ``llama-completion`` makes exactly ``--max-new-tokens``, the two examples
    stop once they have at least that many and may overshoot by part of a draft.
    Its output is its stdout text, compared with our target's decoded greedy text (``identical``;
    the first differing position is a token index into our target's output; a difference there
    is a near-tie of two kernels, reported, not an error: the line ``...: prompt i leaves our greedy
    text at token j; our target's top-2 logit gap there`` gives how near, from one pass of our
    target over the prompt and its greedy prefix).

Strict rows should be identical to (a) (column ``identical``, with the first differing position
per prompt otherwise); every dc row reports its drift (fraction of emitted tokens that are not the
target's argmax after the decode's own prefix, from the decoder's statistics).  For llama.cpp's
speculative rows tokens/forward is generated tokens / (generated - accepted draft tokens).
Chat prompts are ShareGPT's held-out split (``load_prompts("sharegpt")``, never used for
training), code prompts HumanEval's first ones; ``--long N`` adds a third set, ``long``: the N
longest held-out ShareGPT first turns of at most ``LONG_CHARS`` characters (pasted documents to
summarise, fix or answer about, 600-800 tokens: where a separate drafter's prefill of the prompt
costs most).

``--costs-only``: the compute-dtype measurement of docs/pair.md: for each dtype, the target's
forward after a prompt cache with 1, 2, 4 and 6 rows (the verification pass sizes) and the
drafter's 1-row forward.  The pair is loaded once from its float32 checkpoints (whatever
``--weights`` says: the casts need float parameters) and cast in place from dtype to dtype, in
turns, ``--cost-rounds`` rounds of ``--cost-repeats`` repeats each; medians and minima over all.

Last lines: ``pair_speedup_strict=`` (best strict dc tokens/s / target), ``pair_certificate_share=``
(the fastest certifying strict method's certify stage / its rounds' time, ``DecodeStats.stage_seconds``),
``pair_ratio_vs_hf_assisted=`` (best strict dc / hf-assisted), ``pair_speedup_best=`` (best dc, any
rule / target), then with llama.cpp rows ``pair_target_vs_llamacpp_target=`` (our target alone /
llamacpp:target), ``pair_greedy_vs_llamacpp_target=`` (with a ``greedy`` row: draftcert's loop /
llamacpp:target), ``pair_vs_llamacpp_target=`` (best strict dc / llamacpp:target),
``pair_vs_llamacpp_best=`` (best strict dc / the fastest of llamacpp:target, its best
llamacpp:spec:N and llamacpp:lookup), and per prompt set ``pair_vs_llamacpp_target_chat=``,
``..._code=`` (``_long=`` with ``--long``), ``pair_vs_llamacpp_best_chat=``, ``..._code=`` (on that set's prompts only: the
overall best strict method's tokens/s over llamacpp:target's, and over the fastest llama.cpp
method's on that set), and with llamacpp:spec:N rows ``pair_vs_llamacpp_spec=`` (best strict dc / the
fastest llamacpp:spec:N) and ``pair_vs_llamacpp_spec_chat=``, ``..._code=`` (on that set: over the
fastest llamacpp:spec:N on that set's prompts).  Then the goal figures of ``dc:strict:auto``
(``draftcert decode``'s defaults: ``-k auto``'s adaptive draft length, strict): per prompt
``pair_default_vs_llamacpp_target[ID]=`` and ``pair_default_vs_target[ID]=`` (over ``greedy``, our
target alone as ``decode --baseline`` times it), their ``_geomean=``, per set ``_chat=`` / ``_code=``
(geometric means) and ``_min=``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import _llamacpp  # benchmarks/_llamacpp.py
import torch
from _methods import parse_dc, split_vocab  # benchmarks/_methods.py (python puts this folder first)

DEFAULT_METHODS = [
    "target", "greedy", "hf-assisted",
    "dc:strict:auto", "dc:strict:k3", "dc:strict:k5", "dc:strict:tree2x4",
    "dc:topm:2:k5", "dc:entropy:0.09:0.3:k5",
    "llamacpp:target", "llamacpp:spec:3", "llamacpp:spec:5", "llamacpp:spec:8", "llamacpp:spec:16", "llamacpp:lookup",
]  # fmt: skip
TARGET, DRAFTER = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"  # hf-assisted's assistant and llama.cpp's drafter file


def decode_drafter() -> str:
    """The drafter spec of ``draftcert decode --pair qwen2.5-coder`` under the weights ``load_pair`` set."""
    from draftcert.models.pair import PAIRS

    fast = PAIRS["qwen2.5-coder"].decode_drafter
    return fast if fast and os.environ.get("DRAFTCERT_WEIGHTS") != "float32" else DRAFTER


@dataclass(frozen=True)
class Peer:
    """What a llama.cpp run needs: its binaries, the pair's GGUF files, the threads."""

    bins: dict
    target_gguf: Path
    drafter_gguf: Path
    threads: int


def parse_llamacpp(method: str) -> tuple[str, int | None]:
    """(mode, draft length or None) of ``llamacpp:target``, ``llamacpp:spec:N``, ``llamacpp:lookup[:N]``."""
    mode, _, n = method[len("llamacpp:"):].partition(":")
    try:
        if mode == "target" and not n:
            return mode, None
        if mode == "spec" and int(n) > 0:
            return mode, int(n)
        if mode == "lookup":
            return mode, int(n) if n else None
    except ValueError:
        pass
    raise ValueError(f"method {method!r}: llama.cpp methods are llamacpp:target, llamacpp:spec:N, llamacpp:lookup[:N]")


LONG_CHARS = 3000  # --long: ShareGPT's first turns are cut at 4,000 characters (prompts.py); these fit 1k tokens


def long_prompts(n: int) -> list:
    """The ``n`` longest held-out ShareGPT prompts of at most ``LONG_CHARS`` characters, longest first."""
    from draftcert.prompts import load_prompts

    if n <= 0:
        return []
    fit = [p for p in load_prompts("sharegpt") if len(p.text) <= LONG_CHARS]
    return sorted(fit, key=lambda p: (-len(p.text), p.id))[:n]


def prompt_text(tok, text: str) -> str:
    """The text ``encode_prompt(tok, text)`` tokenizes (the chat template applied, not tokenized)."""
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return text


_AUTO: dict = {}  # rule -> (k, draft_length factory): ``-k auto``'s adaptive draft length, made once per rule


def _auto(target, tok, drafter, rule, spec=DRAFTER, vocab=None):
    """``draftcert decode``'s default ``-k auto`` for ``rule`` with the drafter ``spec`` (which names its
    shipped acceptance: ``models.pair.PAIR_DRAFTER_ACCEPTANCE``, a packaged drafter's ``train.json``)
    over the draft vocabulary ``vocab`` (the method's ``:v`` suffix): (k, tree, the draft_length factory)."""
    from draftcert.decode.engine import auto_draft

    if (rule, spec, vocab) not in _AUTO:
        k, tree, _, factory, line = auto_draft(target, drafter, tok, rule, None, spec=spec)
        print(f"dc:{rule}:auto@{spec}{'' if vocab is None else f':v{vocab}'}: {line}", file=sys.stderr, flush=True)
        _AUTO[rule, spec, vocab] = (k, tree, factory)
    return _AUTO[rule, spec, vocab]


_DRAFTERS: dict = {}  # (spec, vocab) -> a drafter made for ``dc:`` methods


def _drafter_named(spec, target, tok, vocab=None):
    """The drafter object of ``spec``, as ``draftcert decode --drafter SPEC [--draft-vocab VOCAB]`` makes
    it (a preset's shipped token map by default: ``qwen2.5-coder-0.5b@q4_1`` drafts over the 0.5B's map)."""
    from draftcert.drafting import make_drafter

    if (spec, vocab) not in _DRAFTERS:  # the float32 checkpoints (--weights float32): in the target's dtype
        dtype = target.dtype if os.environ.get("DRAFTCERT_WEIGHTS") == "float32" else None
        _DRAFTERS[spec, vocab] = make_drafter(spec, target, tok, dtype=dtype, draft_vocab=vocab)
    return _DRAFTERS[spec, vocab]


def run_method(method, target, tok, drafter, ids, n_new, peer=None, text=None):
    """(tokens, seconds, stats or None) of one greedy continuation of ``ids``; for llama.cpp
    methods (prompt ``text``, the templated text of ``ids``) tokens is its ``LlamaRun``."""
    from draftcert.decode import speculative_generate
    from draftcert.decode.bench import timed_generate
    from draftcert.decode.engine import greedy_generate

    if method.startswith("llamacpp:"):
        mode, n = parse_llamacpp(method)
        r = _llamacpp.run(peer.bins, mode, model=peer.target_gguf, drafter=peer.drafter_gguf, n_draft=n, prompt=text,
                          n_new=n_new, threads=peer.threads, ctx=max(4096, len(ids) + n_new + 64))  # fmt: skip
        return r, r.seconds, None
    x = torch.tensor([ids])
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    t0 = time.perf_counter()
    with torch.inference_mode():
        if method == "greedy":  # draftcert's own greedy loop (decode --baseline's target alone)
            toks, st = greedy_generate(target, ids, n_new), None
        elif method in ("target", "hf-assisted"):
            extra = {"assistant_model": drafter} if method == "hf-assisted" else {}
            out = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n_new,
                                  pad_token_id=pad, **extra)  # fmt: skip
            toks, st = out[0, len(ids) :].tolist(), None
        else:
            method, _, spec = method.partition("@")
            base, vocab = split_vocab(method)
            rule, kw = parse_dc(base, {"k": "auto", "tree": None})
            # decode --pair's drafter (or SPEC's) over decode's default draft vocabulary, or --draft-vocab all / N
            spec = spec or decode_drafter()
            drafter = _drafter_named(spec, target, tok, vocab)
            if kw["k"] == "auto":  # decode's defaults: the adaptive draft length, timed as decode times itself
                k, tree, factory = _auto(target, tok, drafter, rule, spec, vocab)
                res = timed_generate(target, drafter, ids, rule, k, tree, n_new, tokenizer=tok, draft_length=factory)
            else:
                res = speculative_generate(target, drafter, ids, rule, max_new_tokens=n_new, tokenizer=tok, **kw)
            toks, st = res.tokens, res.stats
    return toks, time.perf_counter() - t0, st


def load_pair(dtype, weights):
    """The pair from its GGUF blocks (``weights="gguf"`` or ``"gguf-q8"``, float32 only) or its float32 checkpoints."""
    from draftcert.models import load_drafter, load_target

    os.environ["DRAFTCERT_WEIGHTS"] = weights  # load_drafter has no weights= and follows it (as the CLI does)
    target, tok = load_target(TARGET, dtype=dtype, weights=weights)
    drafter = load_drafter(DRAFTER, target, tok, dtype=dtype)
    return target, tok, drafter


def text_match(tok, ref: list[int], run, n_new: int) -> tuple[bool, int | None]:
    """(identical, first differing token index into ``ref``) of a llama.cpp run's text against
    our target's greedy tokens ``ref``.  The text is compared, not token ids (llama.cpp prints
    pieces); a run that overshot ``n_new`` (the examples) is compared on ``ref``'s length."""
    eos = {tok.eos_token_id, tok.pad_token_id} - {None}
    body = ref[:-1] if ref and ref[-1] in eos else ref
    whole = tok.decode(body, skip_special_tokens=True)
    out = run.text
    if out.startswith(whole) and (len(out) == len(whole) or (len(ref) >= n_new and run.n_tokens > n_new)):
        return True, None
    for j in range(len(body)):
        piece = tok.decode(body[: j + 1], skip_special_tokens=True)
        if piece.endswith("\ufffd"):  # a character split across tokens: judge it at its last token
            continue
        if not out.startswith(piece):
            return False, j
    return False, len(body)  # our text is a prefix of theirs, but they went on (or stopped) otherwise


def greedy_gap(target, ids: list[int], ref: list[int], j: int) -> float:
    """Our target's top-1 minus top-2 logit where its greedy continuation ``ref`` of ``ids`` emits
    token ``j``: how near a tie the token where another system's text first differs was."""
    x = torch.tensor([ids + ref[:j]])
    with torch.inference_mode():
        top = target(x).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


COST_ROWS = (1, 2, 4, 6, 8, 16)


def forward_costs(target, drafter, ids, reps: int, rows=COST_ROWS) -> dict:
    """Seconds of target passes of n rows after the prompt's cache, and of a drafter row:
    ``{"target_n": [reps timings], "drafter_1": [...]}``."""
    from draftcert.models.tree_attention import crop_cache
    from draftcert.models.hf import model_forward, new_cache

    out = {f"target_{n}": [] for n in rows} | {"drafter_1": []}
    with torch.inference_mode():
        caches = {}
        for name, model in (("target", target), ("drafter", drafter)):
            caches[name] = new_cache(model)
            model_forward(model, caches[name], ids, 1)
        S = len(ids)
        for _ in range(reps):  # the sizes interleaved, so that load changes hit them alike
            for n in rows:
                t0 = time.perf_counter()
                model_forward(target, caches["target"], ids[-1:] * n, n)
                out[f"target_{n}"].append(time.perf_counter() - t0)
                crop_cache(caches["target"], S)
            t0 = time.perf_counter()
            model_forward(drafter, caches["drafter"], ids[-1:], 1)
            out["drafter_1"].append(time.perf_counter() - t0)
            crop_cache(caches["drafter"], S)
    return out


def costs_only(args, ids_text: str) -> int:
    """The pair is loaded once in float32 and cast in place to each dtype in turn, round after
    round (f32, bf16, f16, f32, bf16, ...), so that every dtype meets the same machine load and
    only one copy of the weights is held (9.6 GB).  Casting back up from bfloat16 changes the
    weights' values, not their cost: these are timings only."""
    from draftcert.models.hf import parse_dtype
    from draftcert.prompts import encode_prompt

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if args.weights != "float32":  # the GGUF pair: its two numeric contracts in turn, one copy of the blocks
        from draftcert.gguf.layers import CONTRACTS, set_numerics

        target, tok, drafter = load_pair("float32", args.weights)
        dtypes = list(CONTRACTS)

        def cast(model, d):
            return set_numerics(model, d)
    else:
        target, tok, drafter = load_pair("float32", "float32")

        def cast(model, d):
            return model.to(parse_dtype(d))
    ids = encode_prompt(tok, ids_text)
    print(f"forward costs after a {len(ids)}-token prompt, {torch.get_num_threads()} thread(s), {args.cost_rounds} "
          f"round(s) x {args.cost_repeats} repeats per dtype, dtypes in turn", flush=True)  # fmt: skip
    res: dict[str, dict[str, list[float]]] = {d: {} for d in dtypes}
    for r in range(args.cost_rounds):
        for d in dtypes:
            cast(target, d)
            cast(drafter, d)
            try:
                c = forward_costs(target, drafter, ids, args.cost_repeats)
            except Exception as e:  # a dtype without CPU kernels: report it and go on
                print(f"{d}: forward fails ({type(e).__name__}: {e})", flush=True)
                continue
            for k, v in c.items():
                res[d].setdefault(k, []).extend(v)
            med = {k: statistics.median(v) for k, v in c.items()}
            print(f"round {r + 1} {d}: target 1 row {med['target_1'] * 1e3:.1f} ms, "
                  + ", ".join(f"{n} rows {med[f'target_{n}'] / med['target_1']:.2f}x" for n in COST_ROWS[1:])
                  + f"; drafter {med['drafter_1'] * 1e3:.1f} ms", flush=True)  # fmt: skip
    for stat, f in (("median", statistics.median), ("min", min)):
        print(f"\n{stat} over all repeats | dtype | target ms/token | "
              + " | ".join(f"{n} rows" for n in COST_ROWS[1:]) + " | drafter ms/token | drafter / target |")  # fmt: skip
        print("|---|---|---:|" + "---:|" * (len(COST_ROWS) - 1) + "---:|---:|")
        for d, c in res.items():
            if not c:
                print(f"| {stat} | {d} | failed |" + " |" * (len(COST_ROWS) + 1))
                continue
            m = {k: f(v) for k, v in c.items()}
            t1 = m["target_1"]
            print(f"| {stat} | {d} | {t1 * 1e3:.1f} | " + " | ".join(f"{m[f'target_{n}'] / t1:.2f}" for n in COST_ROWS[1:])
                  + f" | {m['drafter_1'] * 1e3:.1f} | {m['drafter_1'] / t1:.3f} |")  # fmt: skip
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chat", type=int, default=4, help="held-out ShareGPT prompts (default 4)")
    ap.add_argument("--code", type=int, default=4, help="HumanEval prompts (default 4)")
    ap.add_argument("--long", type=int, default=0, help=f"the longest held-out ShareGPT prompts of at most {LONG_CHARS} "
                    "characters (default 0)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats per prompt and method (default 3)")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated; see the module docstring")
    ap.add_argument("--dtype", default=None, help="compute dtype (default: the pair's, models.PAIR_DTYPE; "
                    "--weights gguf computes in float32 only)")
    ap.add_argument("--weights", choices=("gguf", "gguf-q8", "float32"), default=None,
                    help="our models from the GGUF blocks with 8-bit activations as llama.cpp computes them (gguf-q8), "
                    "the same blocks with the exact weights and float32 activations (gguf), or the float32 "
                    "checkpoints (converted once, 9.6 GB); default: decode's (models.loading.default_weights)")
    ap.add_argument("--llamacpp", default="auto", metavar="auto|off|DIR",
                    help="the llama.cpp rows: auto (the cached build, built once if missing), off (none), or a "
                    "folder with llama-completion, llama-speculative-simple, llama-lookup, llama-bench")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="1 + 1 prompts x 32 tokens, 1 repeat")
    ap.add_argument("--costs-only", action="store_true", help="only the forward costs of 1, 2, 4 and 6 rows per dtype "
                    "(--weights float32) or per numeric contract, gguf-exact-f32 and gguf-q8, in turn (--weights gguf "
                    "or gguf-q8) (docs/pair.md)")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16", help="dtypes for --costs-only")
    ap.add_argument("--cost-repeats", type=int, default=3, help="repeats per dtype and round (default 3)")
    ap.add_argument("--cost-rounds", type=int, default=3, help="rounds over the dtypes, in turn (default 3)")
    args = ap.parse_args(argv)
    if args.weights is None:
        from draftcert.models.loading import default_weights

        args.weights = default_weights()
    if args.quick:
        args.chat, args.code, args.max_new_tokens, args.repeats = 1, 1, 32, 1
    torch.set_num_threads(args.threads)

    from draftcert.decode.stats import STAGES
    from draftcert.models import PAIR_DTYPE
    from draftcert.prompts import encode_prompt, load_prompts

    prompts = [p for name, n in (("sharegpt", args.chat), ("humaneval", args.code)) if n > 0 for p in load_prompts(name, n)]
    prompts += long_prompts(args.long)
    if not prompts:
        ap.error("no prompts: give --chat, --code or --long a count above 0")
    if args.costs_only:
        return costs_only(args, prompts[0].text)
    dtype = args.dtype or PAIR_DTYPE
    if args.weights in ("gguf", "gguf-q8") and str(dtype).removeprefix("torch.") not in ("float32", "auto"):
        ap.error(f"--weights {args.weights} computes in float32; for --dtype {dtype} pass --weights float32")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if "target" not in methods:
        methods.insert(0, "target")
    for m in methods:
        if m.startswith("llamacpp:"):
            try:
                parse_llamacpp(m)  # a bad name fails before anything loads
            except ValueError as e:
                ap.error(str(e))
    peer = None
    if any(m.startswith("llamacpp:") for m in methods):
        if args.llamacpp == "off":
            methods = [m for m in methods if not m.startswith("llamacpp:")]
        else:
            from draftcert.models import ensure_pair_gguf
            from draftcert.gguf.loader import GGUF_FILE

            peer = Peer(_llamacpp.binaries(args.llamacpp), ensure_pair_gguf(TARGET) / GGUF_FILE,
                        ensure_pair_gguf(DRAFTER) / GGUF_FILE, args.threads)  # fmt: skip
    target, tok, drafter = load_pair(dtype, args.weights)
    enc = [list(encode_prompt(tok, p.text)) for p in prompts]
    texts = [prompt_text(tok, p.text) for p in prompts]
    if peer is not None:
        for k, (t, ids) in enumerate(zip(texts, enc)):
            if list(tok(t, add_special_tokens=False)["input_ids"]) != ids:
                raise SystemExit(f"prompt {prompts[k].id}: our tokenizer gives other ids from the templated text "
                                 "than encode_prompt; llama.cpp cannot be fed the same prompt as text")  # fmt: skip
    sets = [("chat", range(args.chat)), ("code", range(args.chat, args.chat + args.code)),
            ("long", range(args.chat + args.code, args.chat + args.code + args.long))]
    from draftcert.gguf.layers import numerics_of

    print(f"pair qwen2.5-coder ({TARGET} drafted by {decode_drafter()}), {dtype}, weights {args.weights} "
          f"(target {numerics_of(target)}, drafter {numerics_of(drafter)}); {args.chat} chat + {args.code} code "
          f"{f'+ {args.long} long ' if args.long else ''}prompts x {args.max_new_tokens} tokens, {args.repeats} repeats, {args.threads} thread(s)", flush=True)
    if peer is not None:
        print(f"llama.cpp: {peer.bins['llama-completion'].parent} on {peer.target_gguf} and {peer.drafter_gguf}",
              flush=True)  # fmt: skip

    for m in methods:  # warm-up (first-call allocations, lazy imports, page cache) on a short run of every method
        run_method(m, target, tok, drafter, enc[0], 8, peer, texts[0])

    secs = {m: [[] for _ in enc] for m in methods}
    toks = {m: [None] * len(enc) for m in methods}
    stats = {m: [None] * len(enc) for m in methods}
    for r in range(args.repeats):
        for i, ids in enumerate(enc):
            order = methods[(i + r) % len(methods) :] + methods[: (i + r) % len(methods)]
            for m in order:
                t, sec, st = run_method(m, target, tok, drafter, ids, args.max_new_tokens, peer, texts[i])
                secs[m][i].append(sec)
                toks[m][i], stats[m][i] = t, st
        print(f"repeat {r + 1}/{args.repeats} done", file=sys.stderr, flush=True)

    def n_of(t) -> int:
        return t.n_tokens if isinstance(t, _llamacpp.LlamaRun) else len(t)

    def tok_s(m, idx) -> float:
        return sum(n_of(toks[m][i]) for i in idx) / sum(statistics.median(secs[m][i]) for i in idx)

    ref = toks["target"]
    rows = []
    for m in methods:
        row = {"method": m, "tok_s": tok_s(m, range(len(enc))),
               "set_tok_s": {name: tok_s(m, idx) for name, idx in sets if len(idx)},
               "spread": max((max(s) - min(s)) / statistics.median(s) for s in secs[m])}  # fmt: skip
        if m.startswith("llamacpp:"):
            match = [text_match(tok, g, t, args.max_new_tokens) for t, g in zip(toks[m], ref)]
            row["identical"], row["first_diff"] = all(a for a, _ in match), [f for _, f in match]
            sts = [t.stats for t in toks[m]]
            if all("n_accept" in s and "decoded_tokens" in s for s in sts):
                n, acc = sum(s["decoded_tokens"] for s in sts), sum(s["n_accept"] for s in sts)
                row["tokens_per_forward"] = n / max(n - acc, 1)
                row["accept"] = acc / max(sum(s["n_drafted"] for s in sts), 1)
                row["n_draft"] = sts[0].get("n_draft")
            rows.append(row)
            continue
        row["identical"] = all(t == g for t, g in zip(toks[m], ref))
        row["first_diff"] = [next((j for j, (a, b) in enumerate(zip(t, g)) if a != b), None) for t, g in zip(toks[m], ref)]
        sts = [s.summary() for s in stats[m] if s is not None]
        if sts:
            # drift: emitted tokens that are not the target's argmax after the decode's own prefix
            row["drift"] = sum(s["drift_tokens"] for s in sts) / max(sum(s["emitted"] for s in sts), 1)
            row["tokens_per_forward"] = sum(s["emitted"] for s in sts) / sum(s["target_forwards"] for s in sts)
            cert = [s["certified_fraction"] for s in sts if s.get("certified_fraction") is not None]
            row["certified"] = sum(cert) / len(cert) if cert else None
            stages = [s.stage_seconds for s in stats[m] if s is not None and s.stage_seconds]
            if stages:  # the certify stage's share of the rounds' time, over every decode of the method
                row["cert_share"] = sum(st[STAGES.index("certify")] for st in stages) / sum(sum(st) for st in stages)
        rows.append(row)

    base = next(r["tok_s"] for r in rows if r["method"] == "target")
    print("\n| method | tokens/s | vs target | tokens/forward | certified | certificate share | drift "
          "| identical to greedy (first difference) | repeat spread |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|")
    for r in rows:
        tpf = f"{r['tokens_per_forward']:.2f}" if "tokens_per_forward" in r else "-"
        cert = f"{r['certified']:.3f}" if r.get("certified") is not None else "-"
        drift = f"{r['drift']:.3f}" if "drift" in r else "-"
        share = f"{r['cert_share']:.1%}" if "cert_share" in r else "-"
        first = "" if r["identical"] else " (" + ", ".join("-" if f is None else str(f) for f in r["first_diff"]) + ")"
        print(f"| {r['method']} | {r['tok_s']:.2f} | {r['tok_s'] / base:.2f} | {tpf} | {cert} | {share} | {drift} | "
              f"{r['identical']}{first} | {r['spread']:.0%} |")  # fmt: skip
    bad = [r["method"] for r in rows if r["method"].startswith("dc:strict:") and not r["identical"]]
    if bad:  # strict is exact w.r.t. the target's argmax in the verification pass; a k-row pass rounds
        # differently from generate()'s 1-row pass, which can flip a near-tie (docs/pair.md)
        print(f"WARNING: strict methods not identical to target.generate(): {', '.join(bad)}")
    llama = [r for r in rows if r["method"].startswith("llamacpp:")]
    if llama:
        lt = next((toks[m] for m in methods if m == "llamacpp:target"), None)
        if lt is not None:
            same = ["-" if t.prompt_ids is None else str(t.prompt_ids == ids) for t, ids in zip(lt, enc)]
            print(f"llama.cpp prompt ids identical to ours (per prompt): {', '.join(same)}")
        for r in llama:
            if "accept" in r:
                print(f"{r['method']}: drafts of {r['n_draft']}, {r['accept']:.1%} of drafted tokens accepted")
        diff = [r["method"] for r in llama if not r["identical"]]
        if diff:  # two float32 kernels (ours, ggml's) can round a near-tie apart; reported, not an error
            print(f"note: llama.cpp outputs differing from our target's greedy text: {', '.join(diff)}")
            for r in llama:
                for i, j in enumerate(r["first_diff"]):
                    if j is not None and j < len(ref[i]):
                        gap = greedy_gap(target, enc[i], ref[i], j)
                        print(f"{r['method']}: prompt {i} leaves our greedy text at token {j}; our target's top-2 logit "
                              f"gap there: {gap:.4f}")  # fmt: skip

    strict = [r for r in rows if r["method"].startswith("dc:strict:")]
    dcs = [r for r in rows if r["method"].startswith("dc:")]
    hf = next((r for r in rows if r["method"] == "hf-assisted"), None)
    if not strict:
        return 0
    bs, bb = max(strict, key=lambda r: r["tok_s"]), max(dcs, key=lambda r: r["tok_s"])
    print(f"\nbest strict: {bs['method']}; best overall: {bb['method']} (drift {bb.get('drift', 0):.3f})"
          + (f"; hf-assisted {hf['tok_s'] / base:.2f}x the target" if hf else ""))
    lt = next((r for r in llama if r["method"] == "llamacpp:target"), None)
    spec = [r for r in llama if r["method"].startswith("llamacpp:spec:")]
    if llama:
        bspec = max(spec, key=lambda r: r["tok_s"]) if spec else None
        bl = max(llama, key=lambda r: r["tok_s"])
        print(f"llama.cpp: best {bl['method']}" + (f", best N for spec {bspec['method'].rpartition(':')[2]}" if spec else "")
              + (f"; llamacpp:target {lt['tok_s'] / base:.2f}x our target" if lt else ""))
    print(f"pair_speedup_strict={bs['tok_s'] / base:.3f}")
    # the certify stage's share (every drafter vocabulary carries certificates)
    certifying = [r for r in strict if "cert_share" in r]
    if certifying:
        print(f"pair_certificate_share={max(certifying, key=lambda r: r['tok_s'])['cert_share']:.4f}")
    if hf:
        print(f"pair_ratio_vs_hf_assisted={bs['tok_s'] / hf['tok_s']:.3f}")
    print(f"pair_speedup_best={bb['tok_s'] / base:.3f}")
    if lt:
        print(f"pair_target_vs_llamacpp_target={base / lt['tok_s']:.3f}")
        greedy = next((r for r in rows if r["method"] == "greedy"), None)
        if greedy:
            print(f"pair_greedy_vs_llamacpp_target={greedy['tok_s'] / lt['tok_s']:.3f}")
        print(f"pair_vs_llamacpp_target={bs['tok_s'] / lt['tok_s']:.3f}")
    if llama:
        print(f"pair_vs_llamacpp_best={bs['tok_s'] / max(r['tok_s'] for r in llama):.3f}")
    if spec:
        print(f"pair_vs_llamacpp_spec={bs['tok_s'] / bspec['tok_s']:.3f}")
    for name, idx in sets:
        if not len(idx):
            continue
        if lt:
            print(f"pair_vs_llamacpp_target_{name}={bs['set_tok_s'][name] / lt['set_tok_s'][name]:.3f}")
        if llama:
            print(f"pair_vs_llamacpp_best_{name}={bs['set_tok_s'][name] / max(r['set_tok_s'][name] for r in llama):.3f}")
        if spec:  # the goal: >= 1.5 on every prompt set, against llama.cpp's best N on that set
            print(f"pair_vs_llamacpp_spec_{name}={bs['set_tok_s'][name] / max(r['set_tok_s'][name] for r in spec):.3f}")
    goal_figures(methods, prompts, sets, lambda m, i: tok_s(m, [i]))
    return 0


def goal_figures(methods, prompts, sets, rate) -> None:
    """Issue 47's goal figures for ``dc:strict:auto`` (``draftcert decode``'s defaults, strict): per prompt
    its tokens/s over llama.cpp's target alone and over our own target alone (``greedy``, what ``decode
    --baseline`` times), then the geometric mean over every prompt and per set, and the smallest.
    ``rate(method, i)``: a method's tokens/s on prompt i."""
    peers = [(name, m) for name, m in (("llamacpp_target", "llamacpp:target"), ("target", "greedy")) if m in methods]
    for auto in [m for m in methods if m == "dc:strict:auto" or m.startswith("dc:strict:auto@")]:
        spec = auto.partition("@")[2]  # dc:strict:auto@eagle:NAME -> pair_feature_..., else pair_default_...
        label = "default" if not spec else "feature" if spec.startswith("eagle:") else re.sub(r"\W+", "_", spec)
        for name, m in peers:
            ratios = [rate(auto, i) / rate(m, i) for i in range(len(prompts))]
            for p, r in zip(prompts, ratios):
                print(f"pair_{label}_vs_{name}[{p.id}]={r:.3f}")
            print(f"pair_{label}_vs_{name}_geomean={statistics.geometric_mean(ratios):.3f}")
            for set_name, idx in sets:
                if len(idx):
                    print(f"pair_{label}_vs_{name}_{set_name}={statistics.geometric_mean([ratios[i] for i in idx]):.3f}")
            print(f"pair_{label}_vs_{name}_min={min(ratios):.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
