"""``draftcert train-drafter``: train an EAGLE-style feature drafter for a target by self-distillation."""

from __future__ import annotations

import argparse

from ..models import ModelUnavailable
from ..profile.settings import check_out_dir
from ..train import OBJECTIVES, TrainConfig, train_drafter
from .checks import check_specs, set_threads

_EXAMPLES = """examples:
  # the embedded target, the certificate objective
  draftcert train-drafter --out runs/drafter
  # the KL objective on the same data
  draftcert train-drafter --out runs/drafter-kl --objective kl \\
      --data runs/drafter/data.pt
  draftcert decode --drafter runs/drafter/drafter.safetensors \\
      --prompt "Explain KV caching." --baseline

Data: prompts written by the target itself (Magpie-style: the chat template's
user prefix only), its greedy answers, and its full next-token distribution at
every position (recomputed from its features during training; never written to
disk).  MT-Bench and HumanEval prompts are held out.  Interrupt at any time;
rerunning the same command resumes from the last checkpoint.
"""


def add_parser(subparsers) -> None:
    d = TrainConfig()
    p = subparsers.add_parser(
        "train-drafter",
        help="train a small EAGLE-style feature drafter for a target (self-distillation, resumable)",
        description="Train a one-layer feature drafter with a reduced draft vocabulary by\nself-distillation.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", default=None, help="target model (omitted/'embedded': SmolLM2-135M-Instruct), local path or hub id")
    p.add_argument("--out", required=True, help="run directory (data, checkpoints, train.log, drafter.safetensors)")
    p.add_argument("--objective", choices=OBJECTIVES, default=d.objective,
                   help=f"kl: forward-KL distillation; certificate: optimise KL(p||q) < radius(p) (default {d.objective})")
    p.add_argument("--criterion", default=d.criterion, help=f"rule whose radius the certificate objective targets (default {d.criterion})")
    p.add_argument("--examples", type=int, default=d.examples, help=f"self-generated training examples (default {d.examples})")
    p.add_argument("--heldout-examples", type=int, default=d.heldout_examples, help="extra self-generated examples for progress evaluation")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help=f"response length per example (default {d.max_new_tokens})")
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab, help=f"draft vocabulary size (default {d.draft_vocab})")
    p.add_argument("--epochs", type=float, default=d.epochs, help=f"passes over the data (default {d.epochs})")
    p.add_argument("--ttt", type=int, default=d.ttt, help=f"unrolled drafting steps in training (default {d.ttt})")
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens, help=f"tokens per batch (default {d.batch_tokens})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default {d.lr})")
    p.add_argument("--min-radius", type=float, default=d.min_radius, help=f"certificate objective ignores steps with a smaller radius (default {d.min_radius})")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--data", default=None, help="reuse a data.pt written by an earlier run (same examples for another objective)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--quiet", action="store_true", help="no progress bar or log lines on stderr")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (model loading included); log lines stay")
    p.set_defaults(func=run)


def run(args) -> int:
    set_threads(args.threads)
    for name in ("examples", "max_new_tokens", "draft_vocab", "ttt", "batch_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")
    if args.batch_tokens < 2:
        raise ValueError(f"--batch-tokens: expected an integer >= 2, got {args.batch_tokens}")
    if not args.epochs > 0:
        raise ValueError(f"--epochs: expected a number > 0, got {args.epochs}")
    check_specs(args.criterion, "--criterion", single=True)  # a typo costs no model load
    check_out_dir(args.out, "--out")
    cfg = TrainConfig(target=args.target, objective=args.objective, criterion=args.criterion, examples=args.examples,
                      heldout_examples=args.heldout_examples, max_new_tokens=args.max_new_tokens,
                      draft_vocab=args.draft_vocab, epochs=args.epochs, ttt=args.ttt, batch_tokens=args.batch_tokens,
                      lr=args.lr, min_radius=args.min_radius, seed=args.seed, data=args.data)
    try:
        path = train_drafter(cfg, args.out, progress=not (args.quiet or args.no_progress), quiet=args.quiet)
    except ModelUnavailable as exc:  # raised before anything is written: one error line, no run directory
        raise ValueError(f"--target: {exc}") from exc
    if path is None:
        return 1
    print(path)
    return 0
