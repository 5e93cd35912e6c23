"""``draftcert train-drafter``: train an EAGLE-style feature drafter for a target by self-distillation;
``draftcert draft-vocab``: a causal-LM drafter's token map, counted on a training run's data."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ..drafting.draft_vocab import DraftVocabulary
from ..fileio import dumps_json
from ..models import ModelUnavailable, load_drafter, load_target, parse_drafter_spec
from ..models.hf import eos_token_ids, vocab_size_of
from ..models.loading import transformers_progress
from ..profile.settings import check_out_dir
from ..train import OBJECTIVES, TrainConfig, train_drafter
from ..train.loop import AUTOCASTS
from ..train.distill_data import draft_vocabulary
from ..train.user_eval import USER_EVAL_KEY, evaluate_on_user_prompts, merge_into_train_json
from .checks import add_weights_option, apply_weights, check_specs, set_threads

_EXAMPLES = """examples:
  # the embedded target, the certificate objective
  draftcert train-drafter --out runs/drafter
  # the KL objective on the same data
  draftcert train-drafter --out runs/drafter-kl --objective kl \\
      --data runs/drafter/data.pt
  draftcert decode --drafter runs/drafter/drafter.safetensors \\
      --prompt "Explain KV caching." --baseline
  # ShareGPT human turns as prompts, in stages of at most 55 minutes
  draftcert train-drafter --out runs/sharegpt --prompts sharegpt-train \\
      --examples 2400 --stage-minutes 55     # rerun until it prints the file
  # acceptance by depth of an existing drafter on held-out user prompts
  draftcert train-drafter --evaluate-only default --out runs/eval-default

Data: prompts (--prompts self: written by the target itself, Magpie-style;
or a prompt source such as sharegpt-train or a .txt/.jsonl file), the target's
greedy answers, and its full next-token distribution at every position
(recomputed from its features during training; never written to disk).
MT-Bench, HumanEval and ShareGPT's held-out tenth are never trained on.
train.json gets user_prompt_eval_fp16: acceptance by depth on held-out user
prompts (MT-Bench, HumanEval, ShareGPT held-out), which -k auto reads.
Interrupt at any time; rerunning the same command resumes (answers are saved
in chunks, training from the last checkpoint).  Exit status 1: stopped early.
"""


def add_parser(subparsers) -> None:
    add_vocab_parser(subparsers)
    d = TrainConfig()
    p = subparsers.add_parser(
        "train-drafter",
        help="train a small EAGLE-style feature drafter for a target (self-distillation, resumable)",
        description="Train a one-layer feature drafter with a reduced draft vocabulary by\nself-distillation.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", default=None, help="target model (omitted/'embedded': SmolLM2-135M-Instruct), local path, hub id or GGUF file (PATH.gguf)")
    add_weights_option(p)
    p.add_argument("--out", required=True, help="run directory (data, checkpoints, train.log, drafter.safetensors)")
    p.add_argument("--prompts", default=d.prompts,
                   help="training prompts: 'self' (written by the target, Magpie-style; default), 'sharegpt-train' "
                        "(ShareGPT V3 first human turns, training split, ~8,200), 'sharegpt-train-turns' (every human "
                        "turn of those conversations, ~51,000) or a .txt/.jsonl file; held-out sets are filtered out")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="prompt length cap in tokens (default 48 for self-written prompts, 256 for a prompt source)")
    p.add_argument("--objective", choices=OBJECTIVES, default=d.objective,
                   help=f"kl: forward-KL distillation; certificate: optimise KL(p||q) < radius(p) (default {d.objective})")
    p.add_argument("--criterion", default=d.criterion, help=f"rule whose radius the certificate objective targets (default {d.criterion})")
    p.add_argument("--examples", type=int, default=d.examples, help=f"self-generated training examples (default {d.examples})")
    p.add_argument("--heldout-examples", type=int, default=d.heldout_examples, help=f"extra examples held out for the progress evaluation (default {d.heldout_examples}; 0: none, "
                        "and train.json records heldout_eval_fp16 and draft_vocab_coverage as null, not evaluated)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help=f"response length per example (default {d.max_new_tokens})")
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab, help=f"draft vocabulary size (default {d.draft_vocab})")
    p.add_argument("--mlp-width", type=int, default=None,
                   help="the drafter layer's MLP width (default: the target's; a narrower layer drafts cheaper)")
    p.add_argument("--epochs", type=float, default=d.epochs, help=f"passes over the data (default {d.epochs})")
    p.add_argument("--ttt", type=int, default=d.ttt, help=f"unrolled drafting steps in training (default {d.ttt})")
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens, help=f"tokens per batch (default {d.batch_tokens})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default {d.lr})")
    p.add_argument("--min-radius", type=float, default=d.min_radius, help=f"certificate objective ignores steps with a smaller radius (default {d.min_radius})")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--data", default=None, help="reuse a data.pt written by an earlier run (same examples for another objective)")
    p.add_argument("--user-eval-prompts", type=int, default=d.user_eval_prompts,
                   help=f"held-out user prompts (MT-Bench, HumanEval, ShareGPT thirds) of the final evaluation; 0 skips it "
                        f"(default {d.user_eval_prompts})")
    p.add_argument("--user-eval-depth", type=int, default=d.user_eval_depth,
                   help=f"drafting depths that evaluation measures (default {d.user_eval_depth})")
    p.add_argument("--stage-minutes", type=float, default=None,
                   help="end this run cleanly after that many minutes (exit status 1); rerun the same command to continue")
    p.add_argument("--evaluate-only", default=None, metavar="DRAFTER",
                   help="train nothing: write the user-prompt evaluation of DRAFTER (a drafter file, eagle:NAME or "
                        "'default') into OUT/train.json")
    p.add_argument("--autocast", choices=AUTOCASTS, default="auto",
                   help="the drafter's training steps in bfloat16 (matmuls; weights, optimiser and teacher float32) or "
                        "float32; auto (default): bfloat16 where the CPU has it natively (AMX or AVX-512 BF16)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--quiet", action="store_true", help="no progress bar or log lines on stderr")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (model loading included); log lines stay")
    p.set_defaults(func=run, resumable=True)


SELF_PROMPT_TOKENS = 48  # a user turn the target writes itself
SOURCE_PROMPT_TOKENS = 256  # a human turn of a prompt source (ShareGPT's are longer; the cap keeps prefill cheap)


def run(args) -> int:
    set_threads(args.threads)
    apply_weights(args)  # --weights: what the embedded target computes from
    for name in ("examples", "max_new_tokens", "draft_vocab", "ttt", "batch_tokens", "user_eval_depth"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")
    if args.mlp_width is not None and args.mlp_width < 1:
        raise ValueError(f"--mlp-width: expected an integer >= 1, got {args.mlp_width}")
    if args.batch_tokens < 2:
        raise ValueError(f"--batch-tokens: expected an integer >= 2, got {args.batch_tokens}")
    if args.heldout_examples < 0:
        raise ValueError(f"--heldout-examples: expected an integer >= 0 (0 evaluates nothing), got {args.heldout_examples}")
    if args.user_eval_prompts < 0:
        raise ValueError(f"--user-eval-prompts: expected an integer >= 0 (0 skips it), got {args.user_eval_prompts}")
    if args.max_prompt_tokens is not None and args.max_prompt_tokens < 1:
        raise ValueError(f"--max-prompt-tokens: expected an integer >= 1, got {args.max_prompt_tokens}")
    if args.stage_minutes is not None and not args.stage_minutes > 0:
        raise ValueError(f"--stage-minutes: expected a number > 0, got {args.stage_minutes}")
    if not args.epochs > 0:
        raise ValueError(f"--epochs: expected a number > 0, got {args.epochs}")
    check_specs(args.criterion, "--criterion", single=True)  # a typo costs no model load
    check_out_dir(args.out, "--out")
    if args.evaluate_only is not None:
        return evaluate_only(args)
    max_prompt = args.max_prompt_tokens or (SELF_PROMPT_TOKENS if args.prompts == "self" else SOURCE_PROMPT_TOKENS)
    cfg = TrainConfig(target=args.target, objective=args.objective, criterion=args.criterion, examples=args.examples,
                      heldout_examples=args.heldout_examples, max_prompt_tokens=max_prompt,
                      max_new_tokens=args.max_new_tokens, draft_vocab=args.draft_vocab, epochs=args.epochs, ttt=args.ttt,
                      batch_tokens=args.batch_tokens, lr=args.lr, min_radius=args.min_radius, seed=args.seed,
                      data=args.data, prompts=args.prompts, user_eval_prompts=args.user_eval_prompts,
                      user_eval_depth=args.user_eval_depth, mlp_width=args.mlp_width)
    try:
        path = train_drafter(cfg, args.out, progress=not (args.quiet or args.no_progress), quiet=args.quiet,
                             stage_minutes=args.stage_minutes, autocast=args.autocast)
    except ModelUnavailable as exc:  # raised before anything is written: one error line, no run directory
        raise ValueError(f"--target: {exc}") from exc
    if path is None:
        return 1
    print(path)
    return 0


def add_vocab_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "draft-vocab",
        help="a causal-LM drafter's draft vocabulary: the tokens counted most often in a train-drafter data file",
        description="Write a token map for --draft-vocab: the N tokens counted most often in the target's own\n"
                    "answers to training prompts (a train-drafter run's data.pt), EOS always in.  A drafter over it\n"
                    "computes those rows of its output layer, plus the tokens of the sequence it drafts for.",
        epilog="example:\n  draftcert train-drafter --target qwen2.5-coder-1.5b --out runs/pair-data --prompts sharegpt-train \\\n"
               "      --examples 1024 --epochs 0.01      # the data stage (resumable)\n"
               "  draftcert draft-vocab --target qwen2.5-coder-1.5b --data runs/pair-data/data.pt --size 32768 \\\n"
               "      --out vocab.json\n  draftcert decode --pair qwen2.5-coder --draft-vocab vocab.json --prompt \"...\"",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", default=None, help="the target the data was made with (its vocabulary size and EOS ids)")
    add_weights_option(p)
    p.add_argument("--data", required=True, help="a train-drafter run's data.pt (or its run directory)")
    p.add_argument("--size", type=int, required=True, help="tokens in the map (e.g. 32768 of the Qwen pair's 151,936)")
    p.add_argument("--out", required=True, help="the map file to write (JSON)")
    p.set_defaults(func=run_draft_vocab)


def run_draft_vocab(args) -> int:
    """``draftcert draft-vocab``: count, rank, and write the map with its provenance and a held-out coverage."""
    if args.size < 1:
        raise ValueError(f"--size: expected an integer >= 1, got {args.size}")
    path = Path(args.data)
    path = path / "data.pt" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"--data {args.data!r}: no such file (a train-drafter run's data.pt)")
    data = torch.load(path, weights_only=False)
    examples = data.get("examples") if isinstance(data, dict) else None
    if not examples or "ids" not in examples[0]:
        raise ValueError(f"--data {args.data!r}: not a train-drafter data file (no examples with token ids)")
    apply_weights(args)
    try:
        target, tok = load_target(args.target)
    except ModelUnavailable as exc:
        raise ValueError(f"--target: {exc}") from exc
    V, eos = vocab_size_of(target), sorted(eos_token_ids(target, tok))
    if max(max(e["ids"]) for e in examples) >= V:
        raise ValueError(f"--data {args.data!r}: token ids beyond the target's vocabulary of {V}: made with another target?")
    size = min(args.size, V)
    # coverage of the answers of every tenth example by a map counted on the other nine tenths
    fit, held = [e for i, e in enumerate(examples) if i % 10], [e for i, e in enumerate(examples) if not i % 10]
    member = torch.zeros(V, dtype=torch.bool)
    member[draft_vocabulary(fit, size, V, always=eos)] = True
    answers = torch.cat([torch.tensor(e["ids"][e.get("n_prompt", 0):], dtype=torch.int64) for e in held])
    coverage = float(member[answers].float().mean()) if answers.numel() else None
    # ... and with each answer's sequence so far (its prompt and earlier tokens), as a decode takes them in
    hits = 0
    for e in held:
        n, ids_e = e.get("n_prompt", 0), e["ids"]
        seen = set(ids_e[:n])
        for t in ids_e[n:]:
            hits += bool(member[t]) or t in seen
            seen.add(t)
    with_sequence = hits / answers.numel() if answers.numel() else None
    ids = draft_vocabulary(examples, size, V, always=eos)
    about = {"data": str(path), "examples": len(examples), "tokens": sum(len(e["ids"]) for e in examples),
             "target": args.target or "embedded", "coverage_heldout_tenth": coverage,
             "coverage_heldout_tenth_with_sequence": with_sequence,
             "command": f"draftcert draft-vocab{'' if args.target is None else ' --target ' + args.target} "
                        f"--data {args.data} --size {args.size} --out {args.out}"}
    DraftVocabulary(ids, V, grows=True, source=args.out).save(args.out, **about)
    print(dumps_json({"file": args.out, "size": size, **about}, indent=None))
    return 0


def evaluate_only(args) -> int:
    """``--evaluate-only DRAFTER``: its user-prompt evaluation, merged into ``OUT/train.json`` and printed."""
    if parse_drafter_spec(args.evaluate_only).kind != "feature":
        raise ValueError(f"--evaluate-only: {args.evaluate_only!r} is not a feature drafter (a drafter.safetensors "
                         "file, eagle:NAME or 'default')")
    if args.user_eval_prompts < 1:
        raise ValueError("--evaluate-only: --user-eval-prompts must be >= 1")
    progress = not (args.quiet or args.no_progress)
    try:
        with transformers_progress(progress):
            target, tok = load_target(args.target)
    except ModelUnavailable as exc:
        raise ValueError(f"--target: {exc}") from exc
    drafter = load_drafter(args.evaluate_only, target, tok)
    out = check_out_dir(args.out, "--out")
    out.mkdir(parents=True, exist_ok=True)
    log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    ev = evaluate_on_user_prompts(target, tok, drafter, n=args.user_eval_prompts, depth=args.user_eval_depth,
                                  max_new_tokens=args.max_new_tokens, cache=out / "user_eval.pt", log=log,
                                  progress=progress)
    path = merge_into_train_json(out, ev, drafter_path=args.evaluate_only)
    print(dumps_json({"file": str(path), USER_EVAL_KEY: ev}, indent=None))  # a depth no row reached: null
    return 0
