"""``draftcert evaluate``: a task's problems decoded under several rules, scored, compared with strict."""

from __future__ import annotations

import argparse
import sys

from .. import models
from ..drafting.draft_vocab import vocabulary_of
from ..drafting.make import DEFAULT_DRAFTER_TRAINED, FEATURE_K, MODEL_K, make_drafter
from ..evaluate.executor import NOT_A_SANDBOX, Limits, blocks_forks, landlock_abi
from ..evaluate.scoreboard import format_rows, write_scoreboard
from ..evaluate.session import CONTROL, run_evaluation
from ..evaluate.tasks import TASK_HELP, load_task
from ..fileio import check_writable_dir
from ..forward import native_layer
from ..gguf.layers import numerics_of
from ..models.loading import fetch_pair_downloads, transformers_progress
from .checks import PAIR_HELP, add_weights_option, apply_pair, apply_weights, check_drafter, check_dtype, check_specs, set_threads

DEFAULT_CRITERIA = "strict,relaxed:2:0.1,topm:2,additive:0.1,typical:0.09:0.3"
EXECUTE_FLAG = "--execute-untrusted-code"

_EXAMPLES = f"""examples:
  draftcert evaluate --out runs/he --limit 20 {EXECUTE_FLAG}
  draftcert evaluate --pair qwen2.5-coder --out runs/he-pair {EXECUTE_FLAG} --baseline
  draftcert evaluate --task gsm8k.jsonl --criteria strict,relaxed:2:0.1 --out runs/gsm8k

Strict is the control (added first when --criteria leaves it out): its completions are the target's
greedy ones (--baseline also runs the target alone and checks them bit for bit).  Every (problem,
rule) result is written atomically under --out as it is scored; rerunning the same command skips
what is done (resume; more rules or a larger --limit add to the folder).  Every decode (the target
alone's too) stops right after the fence line closing the code block that is scored, which leaves
every verdict as it is (--no-stop: it runs to EOS or the limit).  At the end the folder
gets evaluation.json, evaluation.parquet, completions.parquet, evaluation.md and the figure
(`draftcert report DIR` writes them again).

WARNING: scoring HumanEval or a {{prompt, test}} task RUNS THE MODEL'S CODE on this machine, as
your user.  Nothing runs without {EXECUTE_FLAG}.  Each program runs in its own subprocess
in a fresh temporary folder with a wall-clock timeout, CPU, memory, file-size and open-file limits,
no new processes (seccomp, x86-64 Linux), writes confined to its folder (Landlock, where the kernel
has it), no inherited file descriptors and a minimal environment.  This is NOT a security sandbox:
it contains accidents, not a program written to escape (docs/evaluate.md).
"""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "evaluate",
        help="task accuracy per rule: pass@1 against strict (McNemar), speed, drift, certificates, flips",
        description="Decode a task's problems under several rules, score every completion, and compare each "
                    "rule with strict: what a relaxed rule costs in answers.",
        epilog=_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--task", default="humaneval", help=f"the problems: {TASK_HELP} (default humaneval)")
    p.add_argument("--criteria", default=DEFAULT_CRITERIA, help="comma-separated rules (strict is added first when "
                   f"missing); tree:M drafts a width-M tree of depth k (default {DEFAULT_CRITERIA})")
    p.add_argument("--out", required=True, metavar="DIR", help="run folder: results are written here as they are "
                   "scored, and a rerun resumes")
    p.add_argument("--limit", type=int, default=None, help="the first N problems (default: all)")
    p.add_argument(EXECUTE_FLAG, dest="execute_untrusted_code", action="store_true",
                   help=f"allow running the model's code to score it (HumanEval, {{prompt, test}} tasks): {NOT_A_SANDBOX}")
    p.add_argument("--timeout", type=float, default=10, help="wall-clock seconds per program (default 10; the CPU "
                   "limit is the same number of seconds)")
    p.add_argument("--memory-mb", type=int, default=2048, help="address-space limit per program in MiB (default 2048)")
    p.add_argument("--rescore", action="store_true", help="score the completions already in --out again (after a "
                   "change to the scoring); nothing is decoded again")
    p.add_argument("--baseline", action="store_true", help="also run the target alone on every problem: strict's "
                   "completions are checked against it bit for bit (exit status 1 when one differs), and its tokens/s give each "
                   "rule's speedup")
    p.add_argument("--target", default=None, help="target model: omitted/'embedded' = SmolLM2-135M-Instruct, or a "
                   "local path / hub id")
    p.add_argument("--drafter", default=None, help="drafter spec as for `draftcert decode` (default for the embedded "
                   "target: default+suffix)")
    p.add_argument("--pair", default=None, metavar="NAME", help=PAIR_HELP)
    p.add_argument("-k", type=int, default=None, help=f"draft tokens per round (tree depth for tree:M; default "
                   f"{FEATURE_K} with a feature drafter, else {MODEL_K})")
    p.add_argument("--max-new-tokens", type=int, default=384, help="tokens per completion (default 384)")
    p.add_argument("--no-stop", action="store_true", help="run every completion to EOS or --max-new-tokens (default: "
                   "stop right after the fence line closing the code block that is scored, which leaves every "
                   "verdict as it is; {prompt, answer} tasks never stop early)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--dtype", default=None, help="compute dtype of the target and of a drafter model (float32 default)")
    add_weights_option(p)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.set_defaults(func=run, resumable=True)


def _criteria(value: str) -> list[str]:
    specs = [c.spec for c in check_specs(value, "--criteria")]
    specs = list(dict.fromkeys(specs))
    return [CONTROL] + [s for s in specs if s != CONTROL]


def arithmetic_of(target) -> str:
    """The target's numbers as its completions depend on them: its dtype or GGUF contract, and under
    ``gguf-q8`` whether its decoder layers run natively (``forward/native_layer.py``: another arithmetic,
    whose greedy completions can differ; a folder decoded one way is not resumed the other)."""
    numerics = numerics_of(target)
    layers = getattr(target.get_decoder(), "layers", None) if hasattr(target, "get_decoder") else None
    if numerics == "gguf-q8" and layers and all(native_layer.plan_of(layer) is not None for layer in layers):
        return f"{numerics}+native-layers"
    return numerics


def run(args) -> int:
    specs = _criteria(args.criteria)
    for name, v in (("--limit", args.limit), ("--max-new-tokens", args.max_new_tokens), ("--memory-mb", args.memory_mb)):
        if v is not None and v < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {v}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout: expected a number of seconds > 0, got {args.timeout}")
    if args.k is not None and args.k < 1:
        raise ValueError(f"-k: expected an integer >= 1, got {args.k}")
    problems = load_task(args.task, args.limit)
    if any(p.runs_code for p in problems) and not args.execute_untrusted_code:
        raise ValueError(f"{EXECUTE_FLAG}: {args.task} is scored by running the model's code; pass {EXECUTE_FLAG} "
                         f"to allow it ({NOT_A_SANDBOX})")
    check_writable_dir(args.out)
    check_drafter(args.drafter)
    apply_pair(args)
    apply_weights(args)
    set_threads(args.threads)
    args.dtype = check_dtype(args.dtype)
    embedded = args.target in (None, "embedded")
    dspec = args.drafter
    if dspec is None:
        if not embedded:
            raise ValueError("--drafter: required with a non-embedded --target (e.g. self:skip=N, prompt-lookup)")
        dspec = DEFAULT_DRAFTER_TRAINED
    try:
        dspec = models.parse_drafter_spec(dspec).spec
    except ValueError as exc:
        raise ValueError(f"--drafter: {exc}") from None
    try:
        fetch_pair_downloads([args.target, dspec], dtype=args.dtype, progress=not args.no_progress)
        with transformers_progress(not args.no_progress):
            target, tok = models.load_target(args.target, dtype=args.dtype)
            drafter = make_drafter(dspec, target, tok, dtype=args.dtype)
            if vocabulary_of(drafter) is not None:
                # the drafter's whole vocabulary, not decode's shipped map: the relaxed rules' answers are the
                # causal LM's own drafts (and a run made before the maps resumes with the same settings)
                drafter = make_drafter(drafter, target, tok, draft_vocab="all")
    except models.ModelUnavailable as exc:
        raise ValueError(f"{'--pair' if args.pair else '--target'}: {exc}") from exc
    except (OSError, RuntimeError) as exc:
        raise ValueError(f"--drafter: {exc}") from exc
    k = args.k if args.k is not None else (FEATURE_K if drafter.needs_target_hidden else MODEL_K)
    limits = Limits(timeout=args.timeout, cpu_seconds=max(1, int(-(-args.timeout // 1))),
                    memory_bytes=args.memory_mb << 20)
    settings = {"task": args.task, "target": args.target or "embedded", "drafter": dspec, "k": k,
                "max_new_tokens": args.max_new_tokens, "model_dtype": arithmetic_of(target),
                "draft_vocab": getattr(vocabulary_of(drafter), "key", None),
                "timeout": args.timeout, "memory_bytes": limits.memory_bytes}
    if any(p.runs_code for p in problems):
        abi = landlock_abi()
        print(f"evaluate: running model-written code (not a security sandbox): writes outside each program's folder "
              f"{f'refused (Landlock ABI {abi})' if abi else 'NOT refused (no Landlock in this kernel)'}, new processes "
              f"{'refused' if blocks_forks() else 'NOT refused (root, no seccomp filter on this platform)'}",
              file=sys.stderr)
    from tqdm.auto import tqdm  # optional: the progress bar

    total = len(problems) * (len(specs) + bool(args.baseline))
    bar = tqdm(total=total, unit="decode", desc="evaluate", file=sys.stderr, dynamic_ncols=True,
               disable=args.no_progress)

    def on_result(pid, spec, skipped):
        bar.set_postfix_str(f"{pid} {spec}{' (done before)' if skipped else ''}")
        bar.update(1)

    try:
        run_evaluation(target, tok, drafter, problems, specs, args.out, k=k, max_new_tokens=args.max_new_tokens,
                       limits=limits, settings=settings, baseline=args.baseline, on_result=on_result,
                       rescore=args.rescore, stop=not args.no_stop)
    finally:
        bar.close()
    doc = write_scoreboard(args.out)
    print(f"{args.task}: {len(problems)} problems, drafter {dspec}, k={k}, up to {args.max_new_tokens} new tokens")
    print(format_rows(doc["rows"]))
    if "baseline_match" in doc:
        print(f"strict = the target's greedy completions, bit for bit: {doc['baseline_match']} "
              f"({doc['baseline_compared']} problems)")
    print(f"{len(doc['flips'])} flips; written: {args.out}/evaluation.md, evaluation.json, evaluation.parquet, "
          "completions.parquet, figures/")
    return 0 if doc.get("baseline_match", True) else 1
