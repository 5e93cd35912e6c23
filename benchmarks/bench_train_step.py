"""A feature drafter's training step, as ``train-drafter`` runs it and as it ran before, on the same batches.

    PYTHONPATH=src python benchmarks/bench_train_step.py                        # the pair's 1.5B target
    PYTHONPATH=src python benchmarks/bench_train_step.py --target embedded --mlp-width 0

Data: ``--examples`` ShareGPT training prompts (the training split, never an evaluation set) answered
by the target, as ``train-drafter --prompts sharegpt-train`` makes them (``train.loop.load_or_make_data``,
kept in ``--data-dir``: a rerun reuses it), then their radii and teacher terms (``radii_of``).  The
drafter is a fresh ``EagleDrafter`` with the run's defaults for that target (the pair's: a 16,384-token
draft vocabulary and an MLP width of 2,048).  Each mode runs the same ``--steps`` batches of
``--batch-tokens`` (the first is a warm-up), one AdamW step each, in turns (``--rounds``):

    before   the target's head read once a batch (``GGUFLinear.weight`` decodes its blocks), the
             teacher's full [B, T, V] logits, float32 steps: the loop before this change
    full     the head read once per run (``objective.TeacherHead``), the full logits, float32
    terms    + the stored normaliser and negentropy: only the draft vocabulary's logits
    bf16     + the drafter's steps under a bfloat16 CPU autocast (``--autocast``; what ``auto``
             picks where the CPU has AMX or AVX-512 BF16)

Last lines, ``name=value``: ``<mode>_tok_s`` (training tokens a second, median over the rounds) and
``<mode>_vs_before`` (that ÷ before's).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import time
import types
from pathlib import Path

import torch

from draftcert.models import load_target
from draftcert.models.eagle import EagleDrafter
from draftcert.models.hf import vocab_size_of
from draftcert.train import TrainConfig
from draftcert.train.distill_data import collate, draft_vocabulary, radii_of, token_batches
from draftcert.train.loop import load_or_make_data
from draftcert.train.objective import TeacherHead, batch_loss

MODES = ("before", "full", "terms", "bf16")


class _Fresh:
    """``before``: the target's head read on every batch, as ``batch_loss`` did without a ``TeacherHead``."""

    def __init__(self, target, vocab_ids):
        self.target, self.vocab_ids = target, vocab_ids

    @property
    def full(self):
        return self.target.get_output_embeddings().weight.detach()

    @property
    def draft_rows(self):
        return self.full.index_select(0, self.vocab_ids)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--examples", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--draft-vocab", type=int, default=16384)
    ap.add_argument("--mlp-width", type=int, default=2048, help="0: the target's own")
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--data-dir", default="runs/bench-train-step")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, tok = load_target(args.target)
    out = Path(args.data_dir) / args.target.replace("/", "_")
    out.mkdir(parents=True, exist_ok=True)
    cfg = TrainConfig(target=args.target, examples=args.examples, heldout_examples=0, max_prompt_tokens=256,
                      max_new_tokens=args.max_new_tokens, prompts="sharegpt-train")
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    examples = load_or_make_data(cfg, target, tok, out, log)["examples"]
    t = time.perf_counter()
    radii_of(target, examples, "strict", log)
    print(f"radii_seconds_per_example={(time.perf_counter() - t) / len(examples):.3f}")
    V = vocab_size_of(target)
    vocab_ids = draft_vocabulary(examples, args.draft_vocab, V)
    for e in examples:
        e.pop("mass", None)
    batches = token_batches(examples, args.batch_tokens, random.Random(0))[: args.steps]
    ocfg = types.SimpleNamespace(ttt=2, objective="certificate", min_radius=0.01)
    teacher = TeacherHead(target, vocab_ids)
    fresh = _Fresh(target, vocab_ids)
    rates = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            torch.manual_seed(0)
            d = EagleDrafter(target, vocab_ids, intermediate_size=args.mlp_width or None).to(torch.float32).train()
            head_w = d.head_weight().detach()
            opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=1e-3)
            seconds, tokens = 0.0, 0
            for i, idx in enumerate(batches):
                b = collate(examples, idx, torch.float32, d.device)
                if mode in ("before", "full"):
                    b = b[:5]  # no stored teacher terms: the full logits
                amp = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "bf16" else contextlib.nullcontext()
                t = time.perf_counter()
                with amp:
                    loss = batch_loss(d, b, ocfg, head_w, d.vocab_ids, V, teacher=fresh if mode == "before" else teacher)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if i:  # the first batch warms up
                    seconds += time.perf_counter() - t
                    tokens += int(b[2].sum())
            rates[mode].append(tokens / seconds)
            print(f"round {r} {mode}: {tokens / seconds:.0f} tok/s", file=sys.stderr, flush=True)
    base = statistics.median(rates["before"])
    for mode in MODES:
        print(f"{mode}_tok_s={statistics.median(rates[mode]):.1f}")
    for mode in MODES[1:]:
        print(f"{mode}_vs_before={statistics.median(rates[mode]) / base:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
