"""Training an EAGLE-style feature drafter by self-distillation (``train_drafter``).

The data (``data.py``): prompts (written by the target itself, or from a prompt source such as
ShareGPT), the target's greedy answers and its features.  The objectives ``kl`` and
``certificate`` and the held-out metrics: ``objective.py``; the acceptance on user prompts written
into ``train.json``: ``user_eval.py``.  This module runs the loop: draft vocabulary, AdamW with
warmup and cosine decay, periodic evaluation.

Everything resumable, in stages: the prompts and each chunk of answers are saved as they complete
(``DIR/data.parts/``, assembled into ``DIR/data.pt`` at the end), checkpoints are written
atomically, the log appends.  ``stage_minutes`` ends a run cleanly (between chunks or steps);
rerunning the same command continues where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch

from ..criteria import parse_criterion
from ..fileio import atomic_path, dumps_json, settings_changes, write_json
from ..models import load_target
from ..gguf.layers import CONTRACTS, numerics_of
from ..models.eagle import EagleDrafter, load_eagle, save_eagle
from ..models.hf import eos_token_ids, vocab_size_of
from ..models.loading import transformers_progress
from ..prompts import load_prompts
from .distill_data import (HeldOut, answer_prompts, collate, draft_vocabulary, heldout_texts, radii_of, select_prompts,
                   template_prefix_tokens, token_batches, vocabulary_score, write_prompts)
from .objective import OBJECTIVES, TeacherHead, batch_loss, evaluate
from .user_eval import USER_EVAL_KEY, evaluate_on_user_prompts, user_eval_prompts


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
    mlp_width: int | None = None  # the drafter layer's MLP width (None: the target's intermediate size)
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
    prompts: str = "self"  # "self" (Magpie-style) or a load_prompts source, e.g. "sharegpt-train" or a file
    user_eval_prompts: int = 24  # held-out user prompts of the final evaluation (0: none)
    user_eval_depth: int = 6  # drafting depths it measures
    gen_batch: int = 32  # prompts generated / answered per batch; a saved chunk of answers is one batch


SELF_PROMPTS = "self"
EVALUATION_SETS = ("mt-bench", "mtbench", "humaneval", "human-eval", "sharegpt")  # load_prompts' names for them


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


def load_or_make_data(cfg: TrainConfig, target, tok, out: Path, log, heldout=None, progress: bool = False,
                      deadline: float | None = None):
    """The run's examples: ``cfg.data`` or ``out/data.pt`` when it exists, else generated and written there.

    Generation is resumable: the prompts go to ``out/data.parts/selected.json`` and the answers to
    ``out/data.parts/answers-NNNNN.pt`` chunk by chunk (``data.answer_prompts``); a rerun reuses
    them.  Returns None when ``deadline`` (``time.monotonic()``) ends the stage first.
    """
    path = Path(cfg.data) if cfg.data else out / "data.pt"
    if path.is_file():
        data = torch.load(path, weights_only=False)
        log(f"data: {len(data['examples'])} examples from {path}")
        return data
    if cfg.data:
        raise ValueError(f"--data {cfg.data!r}: no such file")
    parts = out / "data.parts"
    parts.mkdir(exist_ok=True)
    n = cfg.examples + cfg.heldout_examples
    selected = parts / "selected.json"
    t0 = time.perf_counter()
    if selected.is_file():
        sel = json.loads(selected.read_text())
        log(f"prompts: {len(sel['prompts'])} from {selected}")
    else:
        held = HeldOut(heldout_texts() if heldout is None else heldout)
        if cfg.prompts == SELF_PROMPTS:
            prompts, dropped = write_prompts(target, tok, n, max_prompt_tokens=cfg.max_prompt_tokens, seed=cfg.seed,
                                             batch=cfg.gen_batch, heldout=held, log=log, progress=progress)
        else:
            prompts, dropped = select_prompts(load_prompts(cfg.prompts), n, tok, max_prompt_tokens=cfg.max_prompt_tokens,
                                              seed=cfg.seed, heldout=held, source=cfg.prompts)
            log(f"prompts: {n} from {cfg.prompts} (dropped {dropped})")
        sel = {"prompts": prompts, "dropped": dropped, "seconds": time.perf_counter() - t0}
        write_json(selected, sel)
    examples = answer_prompts(target, tok, sel["prompts"], max_new_tokens=cfg.max_new_tokens, batch=cfg.gen_batch,
                              n_skip=template_prefix_tokens(tok), log=log, progress=progress, parts=parts,
                              deadline=deadline)
    if examples is None:
        return None
    info = {"dropped": sel["dropped"], "seconds": sel["seconds"] + time.perf_counter() - t0, "prompts": cfg.prompts}
    data = {"examples": examples, "info": info, "config": {"examples": cfg.examples, "heldout_examples": cfg.heldout_examples,
            "max_prompt_tokens": cfg.max_prompt_tokens, "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed,
            "prompts": cfg.prompts}}
    with atomic_path(path) as tmp:
        torch.save(data, tmp)
    shutil.rmtree(parts)  # everything is in data.pt now
    log(f"data: {n} examples written to {path} ({time.perf_counter() - t0:.0f} s this stage; dropped {sel['dropped']})")
    return data


def bf16_matmuls() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX or AVX-512 BF16, from Linux's CPU flags): a
    bfloat16 autocast then speeds training up, where elsewhere it would emulate bfloat16 and slow it down."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


AUTOCASTS = ("auto", "bfloat16", "float32")


def train_drafter(cfg: TrainConfig, out, *, target=None, tokenizer=None, progress: bool = True, quiet: bool = False,
                  max_steps: int | None = None, heldout=None, stage_minutes: float | None = None, user_prompts=None,
                  autocast: str = "auto"):
    """Train (or resume) a feature drafter into ``out``; returns the path of ``drafter.safetensors``,
    or None when it stopped early (``max_steps``, ``stage_minutes``): rerunning resumes.

    ``target``/``tokenizer`` may be passed as objects (tests); otherwise ``cfg.target`` is loaded.
    ``max_steps`` stops early (tests / interruption drills).  ``stage_minutes``: end this stage
    cleanly once that many minutes have passed (between answer chunks or training steps).
    ``heldout``: the texts training prompts must not overlap (default ``data.heldout_texts()``:
    MT-Bench, HumanEval, ShareGPT's held-out tenth).  ``user_prompts``: the user-prompt evaluation
    set (default ``user_eval_prompts(cfg.user_eval_prompts)``).  ``autocast``: the drafter's training
    steps in ``"bfloat16"`` (a CPU autocast: matmuls in bfloat16, weights, optimiser and loss float32;
    the teacher float32), ``"float32"``, or ``"auto"``: bfloat16 where the CPU has it natively
    (``bf16_matmuls``).  Not a run setting: a run may resume under another.
    """
    if autocast not in AUTOCASTS:
        raise ValueError(f"--autocast: expected one of {', '.join(AUTOCASTS)}, got {autocast!r}")
    from tqdm.auto import tqdm  # optional: models extra

    if cfg.objective not in OBJECTIVES:
        raise ValueError(f"--objective: expected one of {OBJECTIVES}, got {cfg.objective!r}")
    if cfg.ttt < 1 or cfg.draft_vocab < 1 or cfg.epochs <= 0 or cfg.batch_tokens < 2 or cfg.gen_batch < 1:
        raise ValueError("train-drafter: ttt, draft vocabulary, epochs, batch tokens and gen batch must be positive")
    if cfg.prompts.lower().replace("_", "-") in EVALUATION_SETS:
        raise ValueError(f"--prompts {cfg.prompts}: an evaluation set, never trained on; use 'self', 'sharegpt-train', "
                         "'sharegpt-train-turns' or a file")
    if cfg.user_eval_prompts < 0 or cfg.user_eval_depth < 1:
        raise ValueError("train-drafter: user-eval prompts must be >= 0 and its depth >= 1")
    parse_criterion(cfg.criterion)  # ValueError for an unknown rule
    t_start = time.perf_counter()
    deadline = None if stage_minutes is None else time.monotonic() + 60.0 * stage_minutes
    if target is None:  # before anything is written: an unloadable target leaves no empty run directory
        with transformers_progress(progress):  # progress=False: no "Loading weights" bar either
            target, tokenizer = load_target(cfg.target)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    log = _Log(out / "train.log", quiet)
    cfg_path = out / "config.json"
    cfg_dict = dataclasses.asdict(cfg)
    if cfg_path.is_file():
        # settings added since the run started take their defaults (an older run directory still resumes)
        old = {**dataclasses.asdict(TrainConfig()), **json.loads(cfg_path.read_text())}
        changed = settings_changes(old, cfg_dict, [k for k in cfg_dict if k != "data"])
        if changed:
            raise ValueError(f"--out: {out} holds a run with other settings ({changed}; in {cfg_path}); rerun with "
                             "the same settings to resume it, or choose a new --out")
    write_json(cfg_path, cfg_dict)

    data = load_or_make_data(cfg, target, tokenizer, out, log, heldout, progress=progress, deadline=deadline)
    if data is None:
        log("stage ended during data generation; rerun the same command to continue")
        return None
    examples = data["examples"]
    if len(examples) < 2:
        raise ValueError("train-drafter: need at least 2 examples (train + held-out)")
    n_held = min(cfg.heldout_examples, len(examples) - 1)
    train_ex, held_ex = examples[: len(examples) - n_held], examples[len(examples) - n_held :]
    V = vocab_size_of(target)
    vocab_ids = radii_and_vocabulary(cfg, target, tokenizer, examples, len(train_ex), out / "radii.pt", log, progress,
                                     deadline=deadline)
    if vocab_ids is None:
        log("stage ended during the radii; rerun the same command to continue")
        return None
    torch.manual_seed(cfg.seed)
    drafter = EagleDrafter(target, vocab_ids, intermediate_size=cfg.mlp_width)
    dtype = target.get_output_embeddings().weight.dtype
    drafter.to(dtype)
    drafter.train()
    head_w = drafter.head_weight().detach()
    vocab_dev = drafter.vocab_ids
    teacher = TeacherHead(target, vocab_dev)  # the target's head read once, not once a batch
    bf16 = dtype == torch.float32 and (autocast == "bfloat16" or (autocast == "auto" and bf16_matmuls()))
    coverage = _coverage(held_ex, vocab_ids, V) if held_ex else None  # --heldout-examples 0: not evaluated
    covers = (f"covers {coverage:.3f} of held-out tokens" if coverage is not None
              else "held-out coverage not evaluated: --heldout-examples 0")
    log(f"drafter: {sum(p.numel() for p in drafter.parameters())} trainable parameters, draft vocabulary {len(vocab_ids)} "
        f"({covers}), objective {cfg.objective} ({cfg.criterion}), steps in {'bfloat16' if bf16 else 'float32'}")

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
            if deadline is not None and time.monotonic() >= deadline:
                break
            order = flat_order()
            idx = order[step]
            batch = collate(train_ex, idx, dtype, drafter.device)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            with torch.autocast(drafter.device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = batch_loss(drafter, batch, cfg, head_w, vocab_dev, V, teacher=teacher)
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
            if held_ex and (step % cfg.eval_every == 0 or step == total_steps):  # nothing held out: no eval
                last_eval = evaluate(drafter, held_ex, cfg, head_w, vocab_dev, V, teacher)
                rec["eval"] = last_eval
                history.append(rec)
                log("eval " + dumps_json({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()},
                                           indent=None).strip())  # strict JSON: a NaN loss is null
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
    # on a GGUF target the file holds Q8_0 blocks, what decoding computes from (models.eagle)
    save_eagle(drafter, final, extra={"objective": cfg.objective, "criterion": cfg.criterion, "steps": step,
                                      "train_seconds": round(seconds, 1)}, blocks=numerics_of(target) in CONTRACTS)
    shipped = load_eagle(final, target, dtype=dtype)  # evaluate exactly what was written, as decoding computes it
    # null: not evaluated (--heldout-examples 0), never a loss of 0 over no examples
    ev = evaluate(shipped, held_ex, cfg, shipped.head_layer(), shipped.vocab_ids, V, teacher) if held_ex else None
    result = {"objective": cfg.objective, "criterion": cfg.criterion, "prompts": cfg.prompts, "steps": step,
              "train_seconds": round(seconds, 1), "tokens_seen": tokens_seen, "data": data.get("info"),
              "draft_vocab_coverage": coverage, "heldout_eval_fp16": ev}
    if cfg.user_eval_prompts > 0 or user_prompts is not None:
        users = user_prompts if user_prompts is not None else user_eval_prompts(cfg.user_eval_prompts)
        result[USER_EVAL_KEY] = evaluate_on_user_prompts(target, tokenizer, shipped, users, depth=cfg.user_eval_depth,
                                                         max_new_tokens=cfg.max_new_tokens, cache=out / "user_eval.pt",
                                                         log=log, progress=progress)
    result.update({"wall_seconds_this_run": round(time.perf_counter() - t_start, 1), "file": str(final),
                   "file_bytes": final.stat().st_size})
    write_json(out / "train.json", result)
    log("done " + dumps_json({k: v for k, v in result.items() if k != "data"}, indent=None).strip())
    return final


RADII_CHUNK = 256  # examples per saved piece of the radii stage


def radii_and_vocabulary(cfg: TrainConfig, target, tok, examples, n_train: int, cache: Path, log, progress: bool,
                         deadline: float | None = None):
    """Each example's radii (``data.radii_of``) and the draft vocabulary of the first ``n_train``
    examples (the training ones); both kept in ``cache``, so that a resumed stage does not spend ~10 min
    per million tokens recomputing them.  None where ``deadline`` (``time.monotonic()``) ended the
    stage first.

    In pieces of ``RADII_CHUNK`` examples, each saved as it completes (``cache``'s folder,
    ``radii.parts/``; deleted once ``cache`` is written): an interrupted stage loses at most one piece,
    and a stage ends between pieces at its deadline.  A piece keeps no example's ``[V]`` expected
    counts, only the vocabulary's running score (``vocabulary_score``, the same float64 sum in the same
    order as over all the examples at once): 24,000 examples' would be 4.7 GB of memory."""
    key = {"criterion": cfg.criterion, "draft_vocab": cfg.draft_vocab, "examples": len(examples),
           "tokens": sum(len(e["ids"]) for e in examples), "teacher_terms": 1}
    if cache.is_file():
        rec = torch.load(cache, weights_only=False)
        if rec.get("key") == key:
            for e, r, lse, negent in zip(examples, rec["radius"], rec["teacher_lse"], rec["teacher_negent"]):
                e["radius"], e["teacher_lse"], e["teacher_negent"] = r, lse, negent
            log(f"radii and draft vocabulary from {cache}")
            return rec["vocab_ids"]
    V = vocab_size_of(target)
    parts = cache.parent / "radii.parts"
    parts.mkdir(exist_ok=True)
    score = torch.zeros(V, dtype=torch.float64)
    t0 = time.perf_counter()
    for i in range(0, len(examples), RADII_CHUNK):
        chunk, piece = examples[i: i + RADII_CHUNK], parts / f"radii-{i // RADII_CHUNK:05d}.pt"
        rec = torch.load(piece, weights_only=False) if piece.is_file() else None
        if rec is not None and rec.get("key") == key:
            for e, r, lse, negent in zip(chunk, rec["radius"], rec["teacher_lse"], rec["teacher_negent"]):
                e["radius"], e["teacher_lse"], e["teacher_negent"] = r, lse, negent
            score = rec["score"]
            continue
        if deadline is not None and time.monotonic() >= deadline:
            log(f"radii: stage ends at {i}/{len(examples)} (saved in {parts}); rerun to continue")
            return None
        radii_of(target, chunk, cfg.criterion, lambda *_: None)
        vocabulary_score(chunk[: max(0, n_train - i)], V, score)  # the training examples' only
        for e in chunk:
            e.pop("mass", None)  # [V] per example: the score has it
        with atomic_path(piece) as tmp:
            torch.save({"key": key, "radius": [e["radius"] for e in chunk], "score": score,
                        "teacher_lse": [e["teacher_lse"] for e in chunk],
                        "teacher_negent": [e["teacher_negent"] for e in chunk]}, tmp)
        if progress or i // RADII_CHUNK % 8 == 7:
            log(f"radii: {min(i + RADII_CHUNK, len(examples))}/{len(examples)} ({time.perf_counter() - t0:.0f} s)")
    log(f"radii ({cfg.criterion}) for {len(examples)} sequences in {time.perf_counter() - t0:.1f} s")
    vocab_ids = draft_vocabulary([], cfg.draft_vocab, V, always=sorted(eos_token_ids(target, tok)), score=score)
    with atomic_path(cache) as tmp:
        torch.save({"key": key, "radius": [e["radius"] for e in examples], "vocab_ids": vocab_ids,
                    "teacher_lse": [e["teacher_lse"] for e in examples],
                    "teacher_negent": [e["teacher_negent"] for e in examples]}, tmp)
    for piece in parts.glob("radii-*.pt"):
        piece.unlink()
    parts.rmdir()
    return vocab_ids


def _coverage(examples, vocab_ids, V):
    """The fraction of the examples' response tokens inside the draft vocabulary."""
    inv = torch.zeros(V, dtype=torch.bool)
    inv[vocab_ids] = True
    toks = torch.tensor([t for e in examples for t in e["ids"][e["n_prompt"]:]] or [0])
    return float(inv[toks].float().mean())
