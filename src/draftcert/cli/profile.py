"""``draftcert profile`` and ``draftcert reproduce-paper`` (the study's GPU protocol, the CPU
protocol on a named pair with ``--pair``, and ``--compare`` of finished runs with the study).

Each command runs the profiler (``draftcert.profile``) and then, on rank 0, writes the run's
report (``draftcert.report``, with ``draftcert.replay``'s section when the run has a drafter):
both sit a layer above the profiler, which never imports them.  A report failure is a
warning: the trace is the product, and ``draftcert report DIR`` retries.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from ..certificates import DEFAULT_EPSILONS
from ..criteria import DEFAULT_CRITERIA
from ..models import PAIRS, get_pair
from ..profile.paper import (
    PAIR_BATCH_SIZE,
    PAIR_LIMIT,
    PAIR_MAX_NEW_TOKENS,
    PAPER_BATCH_SIZE,
    PAPER_LIMIT,
    PAPER_MAX_NEW_TOKENS,
    compare_runs,
    reproduce_pair,
    reproduce_paper,
)
from ..profile.run import ProfileResult, profile
from ..profile.settings import check_out_dir
from ..replay.report_section import section_for_report
from ..report import write_report
from ..textfit import terminal_width
from .checks import (PAIR_HELP, add_weights_option, apply_pair, apply_weights, check_divergences, check_drafter, check_dtype,
                     check_specs, set_threads)

PROFILE_EPILOG = """\
examples:
  # radii of the embedded model (SmolLM2-135M-Instruct) on 8 MT-Bench prompts
  draftcert profile --prompts mt-bench --limit 8 --max-new-tokens 32 \\
      --out runs/smol

  # with the embedded pair's default drafter: acceptance, certificates,
  # soundness
  draftcert profile --drafter default --prompts mt-bench --limit 8 \\
      --max-new-tokens 32 --out runs/smol-draft

  # a hub target with a layer-skipping self-drafter, reverse KL and TV radii
  # too, on a GPU
  draftcert profile --target Qwen/Qwen3-1.7B --drafter self:skip=20,21 \\
      --prompts prompts.jsonl --divergences forward,reverse,tv \\
      --device cuda --dtype bfloat16 --out runs/qwen

  # the Qwen2.5-Coder 1.5B target with its 0.5B drafter (fetched once from
  # PyPI, docs/pair.md) on held-out ShareGPT chat prompts
  draftcert profile --pair qwen2.5-coder --prompts sharegpt --limit 8 \\
      --max-new-tokens 64 --out runs/pair-chat

  # data-parallel over 4 GPUs (each rank writes its own shards)
  torchrun --nproc_per_node 4 -m draftcert profile --target Qwen/Qwen3-4B \\
      --prompts mt-bench --device cuda --out runs/q4

Ctrl-C finishes the batch in flight and keeps it, then stops (Ctrl-C again
stops at once and loses that batch). Rerunning the same command resumes an
interrupted run (finished prompts are skipped); rerunning it with a larger
--limit extends the run: the shards it has are reused and only the new
prompts are profiled (the prompts already traced must be the first ones).
Output: OUT/trace/rank*-*.parquet (one row per generated token), OUT/run.json
(settings and "status": running, complete, interrupted after Ctrl-C or
SIGTERM, or failed), and, unless --no-report, the report (OUT/summary.json,
report.md/html, figures). The table is
printed at $COLUMNS, else the terminal's width, else 80 columns (output to a
file or pipe); when it does not fit, its columns are split over two tables,
and numbers are never cut.
"""

PAPER_EPILOG = """\
Protocol: targets Qwen/Qwen3-1.7B and Qwen/Qwen3-4B (no drafter: radii are
properties of the target), prompts HuggingFaceH4/ultrachat_200k (first --limit
prompts, default 256), greedy continuations of --max-new-tokens (default 128)
tokens in bfloat16 on a CUDA GPU, the default criteria and epsilons.  Each
target goes to OUT/<model name>/.  Needs a GPU, hub access to both models and
the dataset, and the datasets package (pip install datasets; no extra installs
it); otherwise it lists exactly what is missing and exits with status 3.

--pair NAME runs the same measurement on the CPU on a named target + drafter
pair instead: chat prompts (sharegpt, held-out ShareGPT first turns) into
OUT/chat and code prompts (humaneval) into OUT/code, --limit 4 prompts of
--max-new-tokens 64 tokens each by default, resumable; it writes both reports
and prints them next to the study's published figures.

--compare RUN_DIR... prints the study's published figures (arXiv 2606.30265)
next to those of finished profile runs (their summary.json and run.json):
radius q05 of strict, entropy:0.09:0.3 and tree:8, certified length at 0.3,
the runs' accept and certified rates, and what differs from the study's setup
(models, prompts, precision, device, size).

examples:
  draftcert reproduce-paper --out runs/paper
  draftcert reproduce-paper --check            # only report what is missing
  draftcert reproduce-paper --pair qwen2.5-coder --out runs/paper-pair
  draftcert reproduce-paper --compare runs/paper-pair/chat runs/smol
"""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "profile",
        help="trace acceptance radii (and drafter acceptance/certificates) step by step",
        description=textwrap.fill(  # the raw formatter keeps the examples' layout but would not wrap this
            "Greedy-decode the target on a prompt set and record, for every generated token, the exact "
            "acceptance radius of each criterion (the smallest divergence D(p,q) that can cause a rejection). "
            "With a drafter, also record its divergence from the target, whether each criterion accepts its "
            "proposal, and whether the certificate KL(p||q) < radius certifies it (soundness: certified => accepted).",
            79,
        ),
        epilog=PROFILE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", default=None, metavar="MODEL",
                   help="hub id, local checkpoint or GGUF file (PATH.gguf, ORG/NAME:FILE.gguf) of the target (default: the embedded "
                        "SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default=None, metavar="MODEL",
                   help="'default' (the shipped feature drafter of the embedded target), a DRAFTER.safetensors from "
                        "train-drafter, eagle:NAME, self:skip=L[,L...], self:quant=BITS, or a hub id/"
                        "path/GGUF file sharing the target's tokenizer (default: none, radii only)")
    p.add_argument("--pair", default=None, metavar="NAME", help=PAIR_HELP)
    p.add_argument("--prompts", required=True, metavar="SOURCE",
                   help="mt-bench, humaneval, sharegpt (held-out ShareGPT first turns), a .jsonl/.txt file, or a "
                        "Hugging Face dataset name ORG/NAME (needs the datasets package: pip install datasets)")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="use the first N prompts (raise it on a rerun to extend the run)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="T", help="tokens per continuation (default 128)")
    p.add_argument("--criteria", default=",".join(DEFAULT_CRITERIA), metavar="SPECS",
                   help="comma-separated criterion specs (default: %(default)s)")
    p.add_argument("--epsilons", default=",".join(str(e) for e in DEFAULT_EPSILONS), metavar="EPS",
                   help="per-step divergence budgets for the report's certified fractions/lengths (default: %(default)s)")
    p.add_argument("--divergences", default="forward", metavar="DIVS",
                   help="radii to record: forward (always), reverse, tv; e.g. forward,reverse,tv")
    p.add_argument("--batch-size", type=int, default=8, metavar="B", help="prompts decoded together (default 8)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the loader's choice)")
    add_weights_option(p)
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (rerun to resume)")
    p.add_argument("--no-report", action="store_true", help="do not build the report at the end")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars (model loading included)")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="torch CPU threads")
    p.set_defaults(func=_run_profile, resumable=True)

    r = subparsers.add_parser(
        "reproduce-paper",
        help="rerun the reference study (Qwen3-1.7B and Qwen3-4B on UltraChat; needs a GPU and the hub), "
             "or a named pair on the CPU, and compare runs with its published figures",
        description=textwrap.fill(
            "Profile the reference study's targets with its protocol, or a named pair with the same measurement "
            "on the CPU (--pair), and set runs next to the study's published figures (--compare); see below.", 79),
        epilog=PAPER_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r.add_argument("--out", default="draftcert-paper", metavar="DIR", help="output directory (default %(default)s)")
    r.add_argument("--limit", type=int, default=None, metavar="N",
                   help=f"prompts per target (default {PAPER_LIMIT}; with --pair, per prompt set, default {PAIR_LIMIT})")
    r.add_argument("--max-new-tokens", type=int, default=None, metavar="T",
                   help=f"tokens per continuation (default {PAPER_MAX_NEW_TOKENS}; with --pair {PAIR_MAX_NEW_TOKENS})")
    r.add_argument("--batch-size", type=int, default=None, metavar="B",
                   help=f"prompts decoded together (default {PAPER_BATCH_SIZE}; with --pair {PAIR_BATCH_SIZE})")
    r.add_argument("--check", action="store_true", help="only check the requirements and say what is missing")
    r.add_argument("--pair", default=None, metavar="NAME",
                   help=f"the CPU protocol on a named pair ({', '.join(sorted(PAIRS))}): chat and code prompts into "
                        "OUT/chat and OUT/code, then the comparison with the study")
    add_weights_option(r)
    r.add_argument("--compare", nargs="+", default=None, metavar="RUN_DIR",
                   help="print the study's published figures next to these profile runs' and what differs; "
                        "runs nothing")
    r.set_defaults(func=_run_paper, resumable=True)


def _run_profile(args) -> int:
    apply_pair(args)  # --pair NAME -> --target/--drafter
    apply_weights(args)  # --weights: what the embedded target / the pair's models compute from (run.json's model_dtype)
    check_specs(args.criteria, "--criteria")  # before any model loads; suggests the closest spec
    _check_profiled_drafter(check_drafter(args.drafter))
    check_divergences(args.divergences)
    check_dtype(args.dtype)
    check_out_dir(args.out, "--out")
    set_threads(args.threads)
    res = profile(
        args.target, args.drafter, args.prompts, out=args.out, limit=args.limit,
        max_new_tokens=args.max_new_tokens, criteria=args.criteria, epsilons=args.epsilons,
        divergences=args.divergences, batch_size=args.batch_size, device=args.device, dtype=args.dtype,
        progress=not args.no_progress, command=_command_line(args),
    )
    report = _write_report(res.out_dir) if res.rank == 0 and not args.no_report else None
    if res.rank == 0:
        t = res.timings
        print(f"profile: {res.prompts} prompts, {res.steps} steps in {res.out_dir} "
              f"({res.new_prompts} prompts / {res.new_steps} steps new)\n"
              f"profile: model {t.get('model', 0):.1f}s, certificates {t.get('certificate', 0):.2f}s, "
              f"trace {t.get('trace', 0):.2f}s, wall {t.get('wall', 0):.1f}s")
        if res.nonfinite_steps:
            print(f"profile: {res.nonfinite_steps} step(s) had non-finite target logits (flagged `nonfinite`)",
                  file=sys.stderr)
        if report is not None:
            print(f"profile: report in {report}")
    return 1 if res.soundness_violations else 0


def _check_profiled_drafter(parsed) -> None:
    """A drafter the profiler can score: one with a distribution q at every step (a model).  The
    model-free drafters draft from the text inside the decoding loop, so they are for ``decode``."""
    if parsed is not None and (parsed.kind in ("prompt-lookup", "suffix") or parsed.suffix):
        raise ValueError(f"--drafter: {parsed.spec!r} drafts from the text (no model, no distribution q), so there is "
                         "nothing to profile; profile a model drafter (default, self:skip=L, a drafter.safetensors, "
                         f"a hub id), or decode with it: `draftcert decode --drafter {parsed.spec}`")


def _command_line(args) -> list[str]:
    """The command as parsed (canonical option names; works however main() was called)."""
    cmd = ["draftcert", "profile"]
    for opt in ("target", "drafter", "prompts", "limit", "max_new_tokens", "criteria", "epsilons", "divergences",
                "batch_size", "device", "dtype", "out"):
        v = getattr(args, opt)
        if v is not None:
            cmd += ["--" + opt.replace("_", "-"), str(v)]
    cmd += [f for f, on in (("--no-report", args.no_report), ("--no-progress", args.no_progress)) if on]
    return cmd


def _write_report(out: Path) -> Path | None:
    """The run's report, with the replay section when the run has a drafter (as ``draftcert
    report`` writes it); its summary.json path, or None after a warning when it failed."""
    try:
        write_report(out, replay=section_for_report(out))
        return out / "summary.json"
    except Exception as exc:  # the trace is the product; a report failure must not lose it
        print(f"draftcert: warning: report failed ({type(exc).__name__}: {exc}); the trace in {out / 'trace'} "
              f"is complete. Run `draftcert report {out}` to retry", file=sys.stderr)
        return None


def _report_paper_run(res: ProfileResult) -> None:
    if res.rank == 0:
        _write_report(res.out_dir)


def _run_paper(args) -> int:
    apply_weights(args)  # --weights: what the --pair models compute from
    if args.compare is not None:
        given = [o for o, on in (("--pair", args.pair is not None), ("--check", args.check)) if on]
        if given:
            raise ValueError(f"compare: reads finished runs and runs nothing; drop {' and '.join(given)}")
        print(compare_runs(args.compare, terminal_width()))
        return 0
    if args.pair is not None:
        return _run_paper_pair(args)
    return reproduce_paper(out=args.out, limit=_given(args.limit, PAPER_LIMIT),
                           max_new_tokens=_given(args.max_new_tokens, PAPER_MAX_NEW_TOKENS),
                           batch_size=_given(args.batch_size, PAPER_BATCH_SIZE), check_only=args.check,
                           on_run=_report_paper_run)


def _given(value, default):
    """An option's value, or the protocol's default when not given (0 stays 0: profile rejects it)."""
    return default if value is None else value


def _run_paper_pair(args) -> int:
    """``--pair NAME``: the CPU protocol on the pair (both runs and their reports), then the comparison."""
    if args.check:
        raise ValueError("check: checks the GPU protocol's requirements; the --pair protocol needs none "
                         "(it downloads the pair on first use): drop --check")
    try:
        get_pair(args.pair)  # an unknown name fails before anything runs, listing the known ones
    except ValueError as exc:
        raise ValueError(f"pair: {exc}") from None
    check_out_dir(args.out, "--out")
    runs = reproduce_pair(args.pair, args.out, limit=_given(args.limit, PAIR_LIMIT),
                          max_new_tokens=_given(args.max_new_tokens, PAIR_MAX_NEW_TOKENS),
                          batch_size=_given(args.batch_size, PAIR_BATCH_SIZE), on_run=_report_paper_run)
    print()
    print(compare_runs([r.out_dir for r in runs], terminal_width()))
    return 1 if any(r.soundness_violations for r in runs) else 0  # as `draftcert profile`: a violation is a bug
