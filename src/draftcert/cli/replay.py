"""``draftcert replay DIR`` and ``draftcert explain DIR``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path

import torch

from ..fileio import write_json
from ..models import load_drafter, load_target
from ..models.loading import transformers_progress, weights_for_numerics
from ..prompts import encode_prompt, load_prompts
from ..replay.api import DEFAULT_MARGINS, calibration_shapes, choose_drafter, format_table, parse_ks, replay, write_replay
from ..replay.trace_reader import load_replay_trace
from ..replay.explain import attach_text, explain, format_explain, load_tokenizer, write_explain
from ..decode.draft_shape.costs import Costs, forward_count_costs
from ..replay.speed import RETIMES, calibrate
from .checks import check_run_dir_writable, set_threads

_REPLAY_EXAMPLES = """examples:
  draftcert profile --drafter default --prompts mt-bench --limit 8 --out runs/r8
  draftcert replay runs/r8              # every rule, chain k=1..8, tree shape
  draftcert replay runs/r8 --calibrate  # + timings: tokens/s, speedup, best
  draftcert replay runs/r8 --rules strict,tree:4 -k 1-6 --trees 2,4,8 --full

Strict rules (strict, tree:M) are replayed exactly: the accepted lengths are
the ones `draftcert decode` measures on the same prompts, round by round.
Relaxed rules are exact until they accept a non-greedy token; later rounds are
an estimate (column exact = fraction of rounds replayed exactly). Writes
DIR/replay.json and DIR/figures/replay_*.png; --calibrate also writes
DIR/calibration.json, which later replays of DIR and `draftcert report DIR`
reuse: it times the default shapes of every rule of the trace (whatever
--rules says) and the shapes asked for. A replay whose shapes the calibration
lacks still prints every acceptance figure, with a note naming the shapes left
without a predicted speed and the command that times them.
"""

_EXPLAIN_EXAMPLES = """examples:
  draftcert explain runs/r8             # chain k=4 (tree Mx4 for tree:M), top 5
  draftcert explain runs/r8 --rules strict --top 20 --epsilon 0.05

Categories (a partition of the rejections; D = KL(p||q), r = the rule's radius):
  inside radius  certified (D < r, proven) yet rejected: a soundness violation
  low margin     not certified and D <= eps: a drafter within eps of p was
                 rejected, so r < eps: p is nearly tied here (relax the rule)
  far off        not certified and D > eps: the drafter was further than eps
                 from p (fix the drafter)
  own features   a feature drafter's draft at depth >= 2, made from its own
                 predicted features: its D is not recorded, so it is left out
                 of the split above
  nonfinite      the step's target or drafter logits were not finite
Surprise = log p(greedy) - max log p(drafter's candidates), nats.
Writes DIR/explain.json.
"""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "replay", help="replay a profile trace under every rule, draft length and tree; predicted speed",
        description="Replay a profile trace (recorded with --drafter) under every rule,\nchain length and tree shape.",
        epilog=_REPLAY_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p)
    p.add_argument("--trees", default="2,4", help="widths m of the (m, depth) trees, depth = each k (default 2,4; '' for none)")
    p.add_argument("--static", default="4,2,1;3,2,2,1", help="static trees, ';'-separated width lists (default '4,2,1;3,2,2,1')")
    p.add_argument("--calibrate", action="store_true", help="time target and drafter forwards on this machine "
                   "(loads the run's models) for every rule's default shapes and those asked for, and predict "
                   "tokens/s and speedup")
    p.add_argument("--repeats", type=int, default=5, help="timing repeats per size with --calibrate (default 5)")
    p.add_argument("--drafter", default=None, metavar="SPEC",
                   help="the drafter to simulate: the trace's (e.g. default) or it with suffix-match candidates, as "
                   "`draftcert decode` drafts them (default+suffix; the prompts are read again from the run's "
                   "prompt source, in its order, one suffix index across them). Default: decode's default when "
                   "the trace allows (default+suffix for the embedded target and the shipped drafter), else the "
                   "trace's drafter")
    p.add_argument("--drafter-cost", type=float, default=None, metavar="R",
                   help="without calibration: predict speedup with a drafter forward costing R target forwards")
    p.add_argument("--fit-margin", action="store_true", help="fit decode's --draft-margin: replay every chain again "
                   "with the drafter stopping where its top-2 logit gap is below each of "
                   + ", ".join(f"{m:g}" for m in DEFAULT_MARGINS) + " nats, and say which stop is fastest against the "
                   "best fixed chain (needs predicted speed: --calibrate)")
    p.add_argument("--margins", default=None, metavar="LIST", help="the confidence stops to fit, nats, comma-separated "
                   "(implies --fit-margin)")
    p.add_argument("--full", action="store_true", help="print every configuration (default: chains, best depth per tree width, static trees)")
    p.add_argument("--no-figures", action="store_true", help="do not write figures")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (for --calibrate's timings)")
    p.add_argument("--no-progress", action="store_true", help="hide --calibrate's progress bars (model loading included)")
    p.set_defaults(func=run_replay)

    e = subparsers.add_parser(
        "explain", help="rank the replay's rejections by surprise and say why each happened",
        description="Rejection events of a replay, ranked by surprise, with the\ninside-radius / low-margin / far-off split.",
        epilog=_EXPLAIN_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("dir", help="output directory of `draftcert profile --drafter ...`")
    e.add_argument("--rules", default=None, help="comma-separated rules of the trace (default all)")
    e.add_argument("-k", type=int, default=4, help="draft length of the replayed configuration (default 4)")
    e.add_argument("--epsilon", type=float, default=0.1, help="eps of the low-margin / far-off split, nats (default 0.1)")
    e.add_argument("--top", type=int, default=5, help="events printed per rule (default 5; explain.json has all)")
    e.add_argument("--no-color", action="store_true", help="never colour the output")
    e.set_defaults(func=run_explain)


def _common(p) -> None:
    p.add_argument("dir", help="output directory of `draftcert profile --drafter ...`")
    p.add_argument("--rules", default=None, help="comma-separated rules of the trace (default all)")
    p.add_argument("-k", default="1-8", help="chain lengths / tree depths: a range 1-8 or a list 1,2,4 (default 1-8)")


def _static(text: str):
    out = []
    for part in (text or "").split(";"):
        part = part.strip().strip("[]")
        if not part:
            continue
        try:
            w = tuple(int(x) for x in part.split(","))
        except ValueError:
            raise ValueError(f"--static: expected width lists like 4,2,1;3,2,2,1, got {text!r}") from None
        if not w or min(w) < 1:
            raise ValueError(f"--static: widths must be integers >= 1, got {part!r}")
        out.append(w)
    return tuple(out)


def _widths(text: str):
    try:
        w = tuple(int(x) for x in (text or "").split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--trees: expected widths like 2,4, got {text!r}") from None
    if any(x < 2 for x in w):
        raise ValueError(f"--trees: tree widths must be >= 2 (width 1 is a chain), got {text!r}")
    return w


def _load_costs(args, trace, shapes_for_cal):
    cal = Path(args.dir) / "calibration.json"
    if args.calibrate:
        costs = _calibrate_run(trace, shapes_for_cal, args.repeats, progress=not args.no_progress)
        write_json(cal, costs.as_dict())
        return costs
    if args.drafter_cost is not None:
        return forward_count_costs(args.drafter_cost)
    if cal.exists():
        try:
            return Costs.from_dict(json.loads(cal.read_text()))
        except json.JSONDecodeError:
            raise ValueError(f"calibration: {cal} is not valid JSON; delete it or rerun with --calibrate") from None
    return None


def _calibrate_run(trace, shapes, repeats: int, progress: bool = True):
    run = trace.run
    tspec, dspec = run.get("target"), run.get("drafter")
    if not dspec or str(tspec).startswith("object:") or str(dspec).startswith("object:"):
        raise ValueError("--calibrate: the run's target or drafter was a Python object, which cannot be reloaded; "
                         "call draftcert.replay.speed.calibrate(target, drafter, shapes) and pass costs= to replay()")
    dtype = (run.get("settings") or {}).get("dtype")
    dtype = None if dtype in (None, "default") else dtype
    weights = weights_for_numerics(run.get("model_dtype"))  # what the run computed with
    with transformers_progress(progress):  # --no-progress: no "Loading weights" bar either
        target, tok = load_target(None if tspec == "embedded" else tspec, dtype=dtype, weights=weights)
        drafter = load_drafter(dspec, target, tok, dtype=dtype)
    plen = 64
    try:  # the mean prompt length of the run, when its prompts can be read again
        ps = load_prompts(run.get("prompts"), limit=run.get("limit"))
        lens = [len(encode_prompt(tok, p.text)) for p in ps]
        plen = max(1, round(sum(lens) / len(lens)))
    except Exception:
        pass
    ctx = plen + trace.max_new_tokens // 2
    print(f"calibrating on this machine ({torch.get_num_threads()} threads): context {ctx}, prompt {plen} tokens, "
          f"{repeats} repeats ...", file=sys.stderr)
    from tqdm.auto import tqdm  # optional: the progress bar

    with tqdm(unit="forward", desc="calibrate", file=sys.stderr, dynamic_ncols=True, disable=not progress) as bar:
        def on_progress(done: int, total: int) -> None:  # every timed forward (each size, each repeat)
            bar.total = total
            bar.update(done - bar.n)

        def on_retime(attempt: int, problems: list[str]) -> None:  # impossible or disagreeing timings: again
            print(f"calibrate: timings unreliable ({'; '.join(problems)}); timing again "
                  f"(attempt {attempt} of {1 + RETIMES})", file=sys.stderr)

        return calibrate(target, drafter, shapes, context=ctx, prompt_length=plen, repeats=repeats,
                         on_progress=on_progress, on_retime=on_retime)


def _wrap(text: str) -> str:
    """``text`` folded to 80 columns, a `quoted command` kept whole on one line (to copy and paste)."""
    parts = text.split("`")
    glued = "`".join(p.replace(" ", "\0") if i % 2 else p for i, p in enumerate(parts))
    return textwrap.fill(glued, 80, subsequent_indent="  ", break_long_words=False,
                         break_on_hyphens=False).replace("\0", " ")


def _ks(text) -> tuple[int, ...]:
    """``-k`` as ``replay.api.parse_ks`` reads it, a range written high-low refused by name first."""
    if isinstance(text, str):
        a, dash, b = text.partition("-")
        if dash and "," not in text and a.strip().isdigit() and b.strip().isdigit() and int(a) > int(b):
            raise ValueError(f"-k: the range {text!r} is empty (a range counts up, and {a.strip()} is above {b.strip()}); "
                             f"write it low-high, e.g. -k {b.strip()}-{a.strip()}, or list the lengths: -k 1,2,4")
        return parse_ks(text)
    return tuple(text)


def run_replay(args) -> int:
    ks = _ks(args.k)
    tw, st = _widths(args.trees), _static(args.static)
    if args.repeats < 1:
        raise ValueError(f"--repeats: expected an integer >= 1, got {args.repeats}")
    set_threads(args.threads)
    check_run_dir_writable(args.dir, "replay")
    trace = load_replay_trace(args.dir)
    drafter, prompts, dnote = choose_drafter(trace, args.drafter)  # decode's default where the trace allows
    margins = args.margins if args.margins is not None else (DEFAULT_MARGINS if args.fit_margin else ())
    try:
        res = replay(trace, rules=args.rules, ks=ks, tree_widths=tw, static=st, drafter=drafter,
                     prompts=prompts, margins=margins)  # validates before any model work
    except ValueError as exc:
        if str(exc).startswith("margins:"):
            raise ValueError(f"--margins: {str(exc).removeprefix('margins: ')}") from None
        raise
    # a calibration times every shape of every rule (the defaults) and those asked for, so that a later
    # `replay DIR` with other options and the report's Replay section find their costs in calibration.json
    shapes = calibration_shapes(trace, rules=args.rules, ks=ks, tree_widths=tw, static=st) if args.calibrate else []
    costs = _load_costs(args, trace, shapes)
    if costs is not None:
        res = replay(trace, rules=args.rules, ks=ks, tree_widths=tw, static=st, costs=costs, drafter=drafter,
                     prompts=prompts, margins=margins)
    if dnote:
        res.notes.append(dnote)
    paths = write_replay(args.dir, res, figures=not args.no_figures)
    tr = res.trace
    wrap = _wrap
    print(wrap(f"replay of {tr.steps} steps ({len(tr.prompts)} prompts x <= {tr.max_new_tokens} tokens), "
               f"drafter {res.drafter or tr.run.get('drafter')}"))
    print(format_table(res, full=args.full), end="")
    for n in res.notes:
        print(wrap(f"note: {n}"))
    print(wrap("columns (docs/metrics.md): tok/fwd = tokens per target forward, mal = mean acceptance length "
               "(1 + accepted / drafts), dar = draft acceptance rate (accepted / draft tokens), pos1/last = "
               "acceptance rate at position 1 / the deepest (accepted there / drafts), exact = rounds "
               "replayed exactly, speedup = predicted vs the target alone"))
    for p in paths:
        print(f"wrote {p}")
    return 0


def run_explain(args) -> int:
    if args.top < 0:
        raise ValueError(f"--top: expected an integer >= 0, got {args.top}")
    if args.k < 1:
        raise ValueError(f"-k: expected an integer >= 1, got {args.k}")
    check_run_dir_writable(args.dir, "explain")
    trace = load_replay_trace(args.dir)
    res = replay(trace, rules=args.rules, ks=(args.k,), tree_widths=(), static=())
    ex = explain(res, k=args.k, epsilon=args.epsilon)
    attach_text(ex, load_tokenizer(trace.run))
    path = write_explain(args.dir, ex)
    color = not args.no_color and not os.environ.get("NO_COLOR") and sys.stdout.isatty()
    print(format_explain(ex, top=args.top, color=color), end="")
    bad = sum(r["split"]["inside_radius"] for r in ex["rules"].values())
    if bad:
        print(f"draftcert: {bad} SOUNDNESS VIOLATION(S): rejected inside the radius; this is a bug in draftcert, "
              f"please report it with {path}", file=sys.stderr)
    print(f"wrote {path}")
    return 1 if bad else 0
