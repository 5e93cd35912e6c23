"""Training an EAGLE-style feature drafter by self-distillation (``train_drafter``).

Objectives (per training position t, teacher p_t = the target's full next-token distribution,
drafter q_t on the full vocabulary through the shared tail mass, KL_t = KL(p_t || q_t) exact):

``kl``            mean_t KL_t  (forward-KL distillation).
``certificate``   sum_t w_t * tau_t * softplus((KL_t - r_t) / tau_t) / #positions, with
                  r_t = radius(criterion, p_t) (``draftcert.radius``, exact, forward KL),
                  tau_t = max(0.25 r_t, 0.02) and w_t = 1[r_t >= min_radius].  Its gradient in KL
                  is sigmoid((KL_t - r_t)/tau_t): ~1 far outside the certified ball (as KL
                  distillation), ~0 once the step is certified (capacity goes elsewhere), and 0 on
                  near-ties (r_t < min_radius), which no realistic drafter can certify.

Both unroll the drafter ``ttt`` steps ("training-time test", EAGLE-3): step j > 1 feeds the
drafter's own feature from step j - 1 at the same row, attending to the true-feature steps before
it, exactly the attention pattern of drafting; step j's loss is weighted 0.8^(j-1).

Everything resumable: the data file, checkpoints (atomic ``os.replace``), the log.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

OBJECTIVES = ("kl", "certificate")


@dataclasses.dataclass
class TrainConfig:
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


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _atomic_text(text: str, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class _Log:
    def __init__(self, path: Path, quiet: bool):
        self.path, self.quiet = path, quiet

    def __call__(self, msg: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {msg}"
        with open(self.path, "a") as f:
            f.write(line + "\n")
        if not self.quiet:
            print(line, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- losses


def teacher_terms(teacher_logits, vocab_ids):
    """(sum p log p, p on the draft vocabulary, p outside it) of the teacher rows, float32."""
    logp = torch.log_softmax(teacher_logits.float(), -1)
    p = logp.exp()
    negent = (p * logp).sum(-1)
    p_in = p.index_select(-1, vocab_ids)
    return negent, p_in, (1 - p_in.sum(-1)).clamp_min(0)


def kl_from_terms(terms, red, tail, V):
    """Exact KL(p || q); q = reduced logits + a tail logit shared by the V - V_d other tokens."""
    negent, p_in, p_oov = terms
    Vd = p_in.shape[-1]
    if Vd == V:
        return negent - (p_in * torch.log_softmax(red.float(), -1)).sum(-1)
    z = torch.cat([red.float(), tail.float().unsqueeze(-1)], -1)
    lse = torch.logsumexp(z, -1)
    lq_in = red.float() - lse.unsqueeze(-1)
    lq_oov = tail.float() - lse - math.log(V - Vd)
    return negent - (p_in * lq_in).sum(-1) - p_oov * lq_oov


def kl_full(teacher_logits, red, tail, vocab_ids, V):
    """Exact KL(p || q) per row from the teacher's full logits (see ``kl_from_terms``)."""
    return kl_from_terms(teacher_terms(teacher_logits, vocab_ids), red, tail, V)


def certificate_loss(kl, r, min_radius):
    tau = torch.clamp(0.25 * r, min=0.02)
    w = (r >= min_radius) & torch.isfinite(r)
    rr = torch.where(w, r, torch.zeros_like(r))
    return torch.where(w, tau * F.softplus((kl - rr) / tau), torch.zeros_like(kl))


def _ttt_mask(Tp, j, dtype, device):
    allowed = [torch.ones(Tp, Tp, dtype=torch.bool, device=device).tril()]
    allowed += [torch.eye(Tp, dtype=torch.bool, device=device)] * (j - 1)
    allowed = torch.cat(allowed, 1)
    mask = torch.zeros(Tp, allowed.shape[1], dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def unrolled(drafter, ids, feats, lengths, ttt, head_w):
    """Yield (j, reduced logits, tail, valid (B, T'), teacher index) for steps j = 1..ttt.

    Rows s = 0..T-2; step j at row s reads token s + j and (j = 1) the target feature at s or
    (j > 1) the drafter's step j - 1 output at s; it predicts token s + j + 1, teacher row s + j.
    """
    B, T = ids.shape
    Tp = T - 1
    cache = drafter.new_cache()
    g = feats[:, :Tp]
    dev = ids.device
    rows = torch.arange(Tp, device=dev)
    for j in range(1, ttt + 1):
        tok_idx = (rows + j).clamp(max=T - 1)
        tokens = ids[:, tok_idx]
        pos = (rows + j - 1)[None].expand(B, -1)
        mask = _ttt_mask(Tp, j, drafter.fc.weight.dtype, dev)
        g, red, tail = drafter.step(tokens, g, pos, mask, cache=cache, head_weight=head_w)
        valid = (rows[None] + j) <= (lengths[:, None] - 1)
        yield j, red, tail, valid, tok_idx


def batch_loss(drafter, batch, cfg, head_w, vocab_ids, V, stats=None):
    ids, feats, lengths, radii, skip = batch
    W = drafter.target.get_output_embeddings().weight
    with torch.no_grad():
        # The target's full next-token distribution at every position, recomputed from its features.
        teacher = feats @ W.T.to(feats.dtype)
        terms = teacher_terms(teacher, vocab_ids)
        t_top = teacher.argmax(-1) if stats is not None else None
        del teacher
    total, norm = 0.0, 0.0
    for j, red, tail, valid, tidx in unrolled(drafter, ids, feats, lengths, cfg.ttt, head_w):
        kl = kl_from_terms(tuple(t[:, tidx] for t in terms), red, tail, V)
        valid = valid & (tidx[None] >= skip[:, None] - 1)  # no loss on predicting the shared template prefix
        r = radii[:, tidx]
        if cfg.objective == "kl":
            per = kl
        else:
            per = certificate_loss(kl, r, cfg.min_radius)
        wj = 0.8 ** (j - 1)
        vf = valid.float()
        total = total + wj * (per * vf).sum()
        norm += wj * float(vf.sum())
        if stats is not None:
            with torch.no_grad():
                q_full = drafter.full_logits(red, tail)
                acc = (q_full.argmax(-1) == t_top[:, tidx]) & valid
                cert = (kl < r) & valid
                stats.setdefault("acc", {}).setdefault(j, []).append(acc.cpu())
                stats.setdefault("valid", {}).setdefault(j, []).append(valid.cpu())
                stats.setdefault("cert", {}).setdefault(j, []).append(cert.cpu())
                stats.setdefault("kl", {}).setdefault(j, []).append(kl.detach()[valid].cpu())
    return total / max(norm, 1.0)


# ----------------------------------------------------------------------------- data


def _radii_of(target, examples, criterion, log):
    import draftcert as dc

    W = target.get_output_embeddings().weight
    t0 = time.perf_counter()
    for e in examples:
        if "radius" in e:
            continue
        f = e["features"].to(W.dtype)
        with torch.no_grad():
            z = f @ W.T
            e["radius"] = torch.as_tensor(dc.radius(criterion, logits=z.float())).float()
            # the target's expected token counts here: ranks the draft vocabulary (smoother than counts)
            e["mass"] = torch.softmax(z.float(), -1).sum(0)
    log(f"radii ({criterion}) for {len(examples)} sequences in {time.perf_counter() - t0:.1f} s")


def _batches(examples, batch_tokens, rng):
    order = sorted(range(len(examples)), key=lambda i: len(examples[i]["ids"]))
    groups, cur, cur_max = [], [], 0
    for i in order:
        L = len(examples[i]["ids"])
        if cur and max(cur_max, L) * (len(cur) + 1) > batch_tokens:
            groups.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, L)
    if cur:
        groups.append(cur)
    rng.shuffle(groups)
    return groups


def _collate(examples, idx, dtype, device):
    L = [len(examples[i]["ids"]) for i in idx]
    T = max(L)
    H = examples[idx[0]]["features"].shape[1]
    ids = torch.zeros(len(idx), T, dtype=torch.long)
    feats = torch.zeros(len(idx), T, H, dtype=dtype)
    radii = torch.zeros(len(idx), T)
    skip = torch.tensor([examples[i].get("n_skip", 0) for i in idx], device=device)
    for b, i in enumerate(idx):
        e = examples[i]
        n = L[b]
        ids[b, :n] = torch.tensor(e["ids"])
        feats[b, :n] = e["features"].to(dtype)
        radii[b, :n] = e["radius"]
    return ids.to(device), feats.to(device), torch.tensor(L, device=device), radii.to(device), skip


@torch.no_grad()
def evaluate(drafter, examples, cfg, head_w, vocab_ids, V):
    """Teacher-forced held-out metrics: accept / certified rate per unrolled step, mean run length."""
    was = drafter.training
    drafter.eval()
    stats: dict = {}
    losses = []
    dtype = drafter.fc.weight.dtype
    for i in range(len(examples)):
        b = _collate(examples, [i], dtype, drafter.fc.weight.device)
        losses.append(float(batch_loss(drafter, b, cfg, head_w, vocab_ids, V, stats)))
    drafter.train(was)
    out = {"loss": sum(losses) / max(len(losses), 1)}
    for j in sorted(stats.get("acc", {})):
        acc = torch.cat([a.flatten() for a in stats["acc"][j]])
        val = torch.cat([v.flatten() for v in stats["valid"][j]])
        cert = torch.cat([c.flatten() for c in stats["cert"][j]])
        out[f"accept@{j}"] = float(acc.sum() / val.sum().clamp(min=1))
        out[f"certified@{j}"] = float(cert.sum() / val.sum().clamp(min=1))
        kl = torch.cat(stats["kl"][j])
        out[f"kl_median@{j}"] = float(kl.median()) if kl.numel() else float("nan")
    # mean accepted run (chain of ttt drafts, teacher-forced): leading accepted steps per row
    if stats.get("acc"):
        total = 0.0
        count = 0
        for rows in zip(*[stats["acc"][j] for j in sorted(stats["acc"])], stats["valid"][1]):
            *accs, val = rows
            Tp = val.shape[1]
            alive = val.clone()
            length = torch.zeros_like(val, dtype=torch.float)
            for a in accs:
                a = a[:, :Tp]
                alive = alive & a
                length += alive.float()
            total += float(length[val].sum())
            count += int(val.sum())
        out["mean_run"] = total / max(count, 1)
    return out


# ----------------------------------------------------------------------------- main entry


def load_or_make_data(cfg: TrainConfig, target, tok, out: Path, log, heldout=None):
    from .data import HeldOut, generate_examples, heldout_texts

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
                                       max_new_tokens=cfg.max_new_tokens, seed=cfg.seed, heldout=held, log=log)
    data = {"examples": examples, "info": info, "config": {"examples": cfg.examples, "heldout_examples": cfg.heldout_examples,
            "max_prompt_tokens": cfg.max_prompt_tokens, "max_new_tokens": cfg.max_new_tokens, "seed": cfg.seed}}
    _atomic_save(data, path)
    log(f"data: {n} examples written to {path} ({info['seconds']:.0f} s; dropped {info['dropped']})")
    return data


def train_drafter(cfg: TrainConfig, out, *, target=None, tokenizer=None, progress: bool = True, quiet: bool = False,
                  max_steps: int | None = None, heldout=None):
    """Train (or resume) a feature drafter into ``out``; returns the path of ``drafter.safetensors``.

    ``target``/``tokenizer`` may be passed as objects (tests); otherwise ``cfg.target`` is loaded.
    ``max_steps`` stops early (tests / interruption drills); rerunning resumes.  ``heldout``: the
    texts generated prompts must not overlap (default: every MT-Bench and HumanEval prompt).
    """
    from tqdm.auto import tqdm

    from ..models.eagle import EagleDrafter, save_eagle

    if cfg.objective not in OBJECTIVES:
        raise ValueError(f"--objective: expected one of {OBJECTIVES}, got {cfg.objective!r}")
    if cfg.ttt < 1 or cfg.draft_vocab < 1 or cfg.epochs <= 0 or cfg.batch_tokens < 2:
        raise ValueError("train-drafter: ttt, draft vocabulary, epochs and batch tokens must be positive")
    import draftcert as dc

    dc.parse_criterion(cfg.criterion)  # ValueError for an unknown rule
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    log = _Log(out / "train.log", quiet)
    t_start = time.perf_counter()
    if target is None:
        from ..models import load_target

        target, tokenizer = load_target(cfg.target)
    cfg_path = out / "config.json"
    cfg_dict = dataclasses.asdict(cfg)
    if cfg_path.is_file():
        old = json.loads(cfg_path.read_text())
        if {k: v for k, v in old.items() if k != "data"} != {k: v for k, v in cfg_dict.items() if k != "data"}:
            raise ValueError(f"{out} holds a run with other settings ({cfg_path}); use a new --out or the same settings")
    _atomic_text(json.dumps(cfg_dict, indent=2) + "\n", cfg_path)

    data = load_or_make_data(cfg, target, tokenizer, out, log, heldout)
    examples = data["examples"]
    if len(examples) < 2:
        raise ValueError("train-drafter: need at least 2 examples (train + held-out)")
    n_held = min(cfg.heldout_examples, len(examples) - 1)
    train_ex, held_ex = examples[: len(examples) - n_held], examples[len(examples) - n_held :]
    _radii_of(target, examples, cfg.criterion, log)

    from .data import draft_vocabulary, eos_ids

    V = int(target.get_output_embeddings().weight.shape[0])
    vocab_ids = draft_vocabulary(train_ex, cfg.draft_vocab, V, always=sorted(eos_ids(target, tokenizer)))
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
    n_batches = len(_batches(train_ex, cfg.batch_tokens, random.Random(0)))
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
        _atomic_save({"model": drafter.state_dict(), "opt": opt.state_dict(), "step": step, "orders": epoch_orders,
                      "seconds": seconds_before + (time.perf_counter() - t_run), "tokens": tokens_seen, "history": history,
                      "rng": rng.getstate(), "torch_rng": torch.get_rng_state()}, ckpt)

    def flat_order():
        while sum(len(o) for o in epoch_orders) <= step:
            epoch_orders.append(_batches(train_ex, cfg.batch_tokens, rng))
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
            batch = _collate(train_ex, idx, dtype, drafter.fc.weight.device)
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
    from ..models.eagle import load_eagle

    shipped = load_eagle(final, target, dtype=dtype)  # evaluate exactly what was written (fp16-rounded)
    ev = evaluate(shipped, held_ex, cfg, shipped.head_weight(), shipped.vocab_ids, V)
    result = {"objective": cfg.objective, "criterion": cfg.criterion, "steps": step, "train_seconds": round(seconds, 1),
              "tokens_seen": tokens_seen, "data": data.get("info"), "draft_vocab_coverage": coverage,
              "heldout_eval_fp16": ev, "wall_seconds_this_run": round(time.perf_counter() - t_start, 1),
              "file": str(final), "file_bytes": final.stat().st_size}
    _atomic_text(json.dumps(result, indent=2, default=str) + "\n", out / "train.json")
    log("done " + json.dumps({k: v for k, v in result.items() if k != "data"}, default=str))
    return final


def _coverage(examples, vocab_ids, V):
    inv = torch.zeros(V, dtype=torch.bool)
    inv[vocab_ids] = True
    toks = torch.tensor([t for e in examples for t in e["ids"][e["n_prompt"]:]] or [0])
    return float(inv[toks].float().mean())
