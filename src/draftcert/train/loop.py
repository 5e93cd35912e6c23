"""Training an EAGLE-style feature drafter by self-distillation (``train_drafter``).

The data (``data.py``): prompts the target writes itself, its greedy answers and its features.
The objectives ``kl`` and ``certificate`` and the held-out metrics: ``objective.py``.  This module
runs the loop: draft vocabulary, AdamW with warmup and cosine decay, periodic evaluation.

Everything resumable: the data file, checkpoints (written atomically), the log.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

from ..criteria import parse_criterion
from ..fileio import atomic_path, write_json
from ..models import load_target
from ..models.eagle import EagleDrafter, load_eagle, save_eagle
from ..models.hf import eos_token_ids
from ..models.loading import transformers_progress
from .data import HeldOut, collate, draft_vocabulary, generate_examples, heldout_texts, radii_of, token_batches
from .objective import OBJECTIVES, batch_loss, evaluate


@dataclasses.dataclass
class TrainConfig:
    """One training run's settings (the ``draftcert train-drafter`` options); a rerun resumes only with the same."""

    target: str | None = None
    objective: str = "certificate"
    criterion: str = "strict"
    examples: int = 152
    heldout_examples: int = 8
    max_prompt_tokens: int = 48
    max_new_tokens: int = 128
    draft_vocab: int = 4096
    epochs: float = 2.0
    ttt: int = 2
    batch_tokens: int = 1024
    lr: float = 1e-3
    warmup: int = 20
    min_radius: float = 0.01
    seed: int = 0
    checkpoint_every: int = 25
    eval_every: int = 50
    data: str | None = None  # reuse this data file instead of generating


class _Log:
    """Appends timestamped lines to ``train.log`` and, unless quiet, echoes them on stderr."""

    def __init__(self, path: Path, quiet: bool):
        self.path, self.quiet = path, quiet

    def __call__(self, msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        with open(self.path, "a") as f:
            f.write(line + "\n")
        if not self.quiet:
            print(line, file=sys.stderr, flush=True)


def load_or_make_data(cfg: TrainConfig, target, tok, out: Path, log, heldout=None, progress: bool = False):
    """The run's examples: ``cfg.data`` or ``out/data.pt`` when it exists, else generated and written there."""
    path = Path(cfg.data) if cfg.data else out / "data.pt"
    if path.is_file():
        data = torch.load(path, weights_only=False)
        log(f"data: {len(data['examples'])} examples from {path}")
        return data
    if cfg.data:
        raise ValueError(f"--data {cfg.data!r}: no such file")
    held = HeldOut(heldout_texts() if heldout is None else heldout)
    n = cfg.examples + cfg.heldout_examples
    examples, info = generate_examples(target, tok, n, max_prompt_tokens=cfg.max_prompt_tokens,
                                       max_new_tokens=cfg.max_new_tokens, seed=cfg.seed, heldout=held, log=log,
                                       progress=progress)
    data = {"examples": examples, "info": info, "config": {"examples": cfg.examples, "heldout_examples": cfg.heldout_examples,
            "max_prompt_tokens": cfg.max_prompt_tokens, "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed}}
    with atomic_path(path) as tmp:
        torch.save(data, tmp)
    log(f"data: {n} examples written to {path} ({info['seconds']:.0f} s; dropped {info['dropped']})")
    return data


def train_drafter(cfg: TrainConfig, out, *, target=None, tokenizer=None, progress: bool = True, quiet: bool = False,
                  max_steps: int | None = None, heldout=None):
    """Train (or resume) a feature drafter into ``out``; returns the path of ``drafter.safetensors``.

    ``target``/``tokenizer`` may be passed as objects (tests); otherwise ``cfg.target`` is loaded.
    ``max_steps`` stops early (tests / interruption drills); rerunning resumes.  ``heldout``: the
    texts generated prompts must not overlap (default: every MT-Bench and HumanEval prompt).
    """
    from tqdm.auto import tqdm  # optional: models extra

    if cfg.objective not in OBJECTIVES:
        raise ValueError(f"--objective: expected one of {OBJECTIVES}, got {cfg.objective!r}")
    if cfg.ttt < 1 or cfg.draft_vocab < 1 or cfg.epochs <= 0 or cfg.batch_tokens < 2:
        raise ValueError("train-drafter: ttt, draft vocabulary, epochs and batch tokens must be positive")
    parse_criterion(cfg.criterion)  # ValueError for an unknown rule
    t_start = time.perf_counter()
    if target is None:  # before anything is written: an unloadable target leaves no empty run directory
        with transformers_progress(progress):  # progress=False: no "Loading weights" bar either
            target, tokenizer = load_target(cfg.target)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    log = _Log(out / "train.log", quiet)
    cfg_path = out / "config.json"
    cfg_dict = dataclasses.asdict(cfg)
    if cfg_path.is_file():
        old = json.loads(cfg_path.read_text())
        if {k: v for k, v in old.items() if k != "data"} != {k: v for k, v in cfg_dict.items() if k != "data"}:
            raise ValueError(f"{out} holds a run with other settings ({cfg_path}); use a new --out or the same settings")
    write_json(cfg_path, cfg_dict)

    data = load_or_make_data(cfg, target, tokenizer, out, log, heldout, progress=progress)
    examples = data["examples"]
    if len(examples) < 2:
        raise ValueError("train-drafter: need at least 2 examples (train + held-out)")
    n_held = min(cfg.heldout_examples, len(examples) - 1)
    train_ex, held_ex = examples[: len(examples) - n_held], examples[len(examples) - n_held :]
    radii_of(target, examples, cfg.criterion, log, progress=progress)

    V = int(target.get_output_embeddings().weight.shape[0])
    vocab_ids = draft_vocabulary(train_ex, cfg.draft_vocab, V, always=sorted(eos_token_ids(target, tokenizer)))
    torch.manual_seed(cfg.seed)
    drafter = EagleDrafter(target, vocab_ids)
    dtype = target.get_output_embeddings().weight.dtype
    drafter.to(dtype)
    drafter.train()
    head_w = drafter.head_weight().detach()
    vocab_dev = drafter.vocab_ids
    coverage = _coverage(held_ex, vocab_ids, V)
    log(f"drafter: {sum(p.numel() for p in drafter.parameters())} trainable parameters, draft vocabulary {len(vocab_ids)} "
        f"(covers {coverage:.3f} of held-out tokens), objective {cfg.objective} ({cfg.criterion})")

    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    rng = random.Random(cfg.seed)
    n_batches = len(token_batches(train_ex, cfg.batch_tokens, random.Random(0)))
    total_steps = max(1, int(math.ceil(cfg.epochs * n_batches)))

    def lr_at(step):
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        prog = (step - cfg.warmup) / max(1, total_steps - cfg.warmup)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(prog, 1.0))))

    ckpt = out / "checkpoint.pt"
    step, epoch_orders, seconds_before, tokens_seen = 0, [], 0.0, 0
    history = []
    if ckpt.is_file():
        st = torch.load(ckpt, weights_only=False)
        drafter.load_state_dict(st["model"], strict=False)
        opt.load_state_dict(st["opt"])
        step, epoch_orders, seconds_before, tokens_seen = st["step"], st["orders"], st["seconds"], st["tokens"]
        history = st.get("history", [])
        rng.setstate(st["rng"])
        torch.set_rng_state(st["torch_rng"])
        log(f"resumed from {ckpt} at step {step}/{total_steps}")

    def save_ckpt():
        state = {"model": drafter.state_dict(), "opt": opt.state_dict(), "step": step, "orders": epoch_orders,
                 "seconds": seconds_before + (time.perf_counter() - t_run), "tokens": tokens_seen, "history": history,
                 "rng": rng.getstate(), "torch_rng": torch.get_rng_state()}
        with atomic_path(ckpt) as tmp:
            torch.save(state, tmp)

    def flat_order():
        while sum(len(o) for o in epoch_orders) <= step:
            epoch_orders.append(token_batches(train_ex, cfg.batch_tokens, rng))
        return [g for o in epoch_orders for g in o]

    t_run = time.perf_counter()
    bar = tqdm(total=total_steps, initial=step, unit="step", desc=f"train[{cfg.objective}]", disable=not progress,
               dynamic_ncols=True, file=sys.stderr)
    last_eval = history[-1]["eval"] if history else {}
    loss_ema = None
    steps_this_run = 0
    try:
        while step < total_steps:
            if max_steps is not None and steps_this_run >= max_steps:
                break
            order = flat_order()
            idx = order[step]
            batch = collate(train_ex, idx, dtype, drafter.fc.weight.device)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            loss = batch_loss(drafter, batch, cfg, head_w, vocab_dev, V)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            steps_this_run += 1
            ntok = int(batch[2].sum())
            tokens_seen += ntok
            lv = float(loss.detach())
            loss_ema = lv if loss_ema is None else 0.9 * loss_ema + 0.1 * lv
            el = seconds_before + time.perf_counter() - t_run
            rec = {"step": step, "loss": lv, "lr": lr_at(step - 1), "tokens": tokens_seen, "tok_s": tokens_seen / max(el, 1e-9)}
            if step % cfg.eval_every == 0 or step == total_steps:
                last_eval = evaluate(drafter, held_ex, cfg, head_w, vocab_dev, V)
                rec["eval"] = last_eval
                history.append(rec)
                log("eval " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()}))
            elif step % 10 == 0:
                log(f"step {step}/{total_steps} loss {lv:.4f} (ema {loss_ema:.4f}) {rec['tok_s']:.0f} tok/s")
            bar.update(1)
            bar.set_postfix(loss=f"{loss_ema:.4f}", tok_s=f"{rec['tok_s']:.0f}",
                            accept=f"{last_eval.get('accept@1', float('nan')):.3f}")
            if step % cfg.checkpoint_every == 0:
                save_ckpt()
    finally:
        bar.close()
    save_ckpt()
    if step < total_steps:
        log(f"stopped at step {step}/{total_steps}; rerun the same command to resume")
        return None
    seconds = seconds_before + time.perf_counter() - t_run
    final = out / "drafter.safetensors"
    save_eagle(drafter, final, extra={"objective": cfg.objective, "criterion": cfg.criterion, "steps": step,
                                      "train_seconds": round(seconds, 1)})
    shipped = load_eagle(final, target, dtype=dtype)  # evaluate exactly what was written (fp16-rounded)
    ev = evaluate(shipped, held_ex, cfg, shipped.head_weight(), shipped.vocab_ids, V)
    result = {"objective": cfg.objective, "criterion": cfg.criterion, "steps": step, "train_seconds": round(seconds, 1),
              "tokens_seen": tokens_seen, "data": data.get("info"), "draft_vocab_coverage": coverage,
              "heldout_eval_fp16": ev, "wall_seconds_this_run": round(time.perf_counter() - t_start, 1),
              "file": str(final), "file_bytes": final.stat().st_size}
    write_json(out / "train.json", result)
    log("done " + json.dumps({k: v for k, v in result.items() if k != "data"}, default=str))
    return final


def _coverage(examples, vocab_ids, V):
    """The fraction of the examples' response tokens inside the draft vocabulary."""
    inv = torch.zeros(V, dtype=torch.bool)
    inv[vocab_ids] = True
    toks = torch.tensor([t for e in examples for t in e["ids"][e["n_prompt"]:]] or [0])
    return float(inv[toks].float().mean())
