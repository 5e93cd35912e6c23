"""The training objectives of a feature drafter, and the held-out metrics (``evaluate``).

Per training position t, with teacher p_t = the target's full next-token distribution and the
drafter's q_t on the full vocabulary through the shared tail mass, KL_t = KL(p_t || q_t) exactly:

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
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..certificates import certify_rows
from ..summary import summarize
from .distill_data import collate

__all__ = ["OBJECTIVES", "TeacherHead", "teacher_terms", "kl_from_terms", "kl_full", "certificate_loss", "unrolled", "batch_loss",
           "evaluate"]

OBJECTIVES = ("kl", "certificate")


class TeacherHead:
    """The target's output layer as the objective reads it, read once per run: ``full`` [V, H] and
    ``draft_rows`` [V_d, H] (the draft vocabulary's).  A GGUF head's ``.weight`` decodes every block
    on each read (0.2 GB of blocks into 0.9 GB of float32 on the 1.5B pair target): once a batch, it
    cost about a third of a training step there."""

    def __init__(self, target, vocab_ids):
        self.full = target.get_output_embeddings().weight.detach()
        self.draft_rows = self.full.index_select(0, vocab_ids.to(self.full.device))


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
    """w * tau * softplus((KL - r) / tau) per row, tau = max(0.25 r, 0.02), w = 1[r >= min_radius] (see above)."""
    tau = torch.clamp(0.25 * r, min=0.02)
    w = (r >= min_radius) & torch.isfinite(r)
    rr = torch.where(w, r, torch.zeros_like(r))
    return torch.where(w, tau * F.softplus((kl - rr) / tau), torch.zeros_like(kl))


def _ttt_mask(Tp, j, dtype, device):
    """Additive mask [1, 1, Tp, j * Tp] of unrolled step j: causal over step 1's rows (true features),
    and each row sees its own row of steps 2..j (its own drafted features)."""
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
        mask = _ttt_mask(Tp, j, drafter.dtype, dev)
        g, red, tail = drafter.step(tokens, g, pos, mask, cache=cache, head_weight=head_w)
        valid = (rows[None] + j) <= (lengths[:, None] - 1)
        yield j, red, tail, valid, tok_idx


def batch_loss(drafter, batch, cfg, head_w, vocab_ids, V, stats=None, teacher: TeacherHead | None = None):
    """The objective ``cfg.objective`` on one batch from ``data.collate`` (ids [B, T], features
    [B, T, H], lengths [B], radii [B, T], skip [B], and the teacher's log-normaliser and negentropy
    [B, T] where ``radii_of`` stored them); ``stats`` collects what ``evaluate`` reports; ``teacher``:
    the target's head read once (``TeacherHead``; default: read now).

    The teacher p_t is the target's full next-token distribution, recomputed from its features.  With
    the stored normaliser and negentropy, training computes only the draft vocabulary's logits z_in:
    p_in = exp(z_in - lse), p_oov = 1 - sum p_in (``kl_from_terms``'s terms, a tenth of the work of
    the [B, T, V] logits on a 16,384-token draft vocabulary of 151,936).  The teacher is float32 even
    under a bfloat16 autocast (``train_drafter``'s ``autocast``): its logits set the target."""
    ids, feats, lengths, radii, skip = batch[:5]
    lse, negent = batch[5:7] if len(batch) >= 7 else (None, None)
    head = teacher if teacher is not None else TeacherHead(drafter.target, vocab_ids)
    with torch.no_grad(), torch.autocast(feats.device.type, enabled=False):
        if stats is None and lse is not None:
            z_in = feats @ head.draft_rows.T.to(feats.dtype)  # [B, T, V_d]
            p_in = torch.exp(z_in.float() - lse.float()[..., None])
            terms = (negent.float(), p_in, (1 - p_in.sum(-1)).clamp_min(0))
        else:
            teacher_logits = feats @ head.full.T.to(feats.dtype)  # [B, T, V]
            terms = teacher_terms(teacher_logits, vocab_ids)
            t_top = teacher_logits.argmax(-1) if stats is not None else None
            if stats is None:
                del teacher_logits  # training needs only the terms; the held-out certificates need the logits
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
                # the library's certificate (certify_rows) of the drafter's full distribution
                # against the teacher's logits, not the training estimate of KL
                cert = torch.zeros_like(valid)
                if bool(valid.any()):
                    t_rows = teacher_logits[:, tidx][valid]  # [n, V]
                    cert[valid] = certify_rows(summarize(logits=t_rows, entropy=False), q_full[valid].to(t_rows.dtype),
                                               r[valid].double()).certified
                stats.setdefault("acc", {}).setdefault(j, []).append(acc.cpu())
                stats.setdefault("valid", {}).setdefault(j, []).append(valid.cpu())
                stats.setdefault("cert", {}).setdefault(j, []).append(cert.cpu())
                stats.setdefault("kl", {}).setdefault(j, []).append(kl.detach()[valid].cpu())
    return total / max(norm, 1.0)


@torch.no_grad()
def evaluate(drafter, examples, cfg, head_w, vocab_ids, V, teacher: TeacherHead | None = None):
    """Teacher-forced held-out metrics: accept / certified rate per unrolled step, mean run length."""
    was = drafter.training
    drafter.eval()
    stats: dict = {}
    losses = []
    dtype = drafter.dtype
    teacher = teacher if teacher is not None else TeacherHead(drafter.target, vocab_ids)
    for i in range(len(examples)):
        b = collate(examples, [i], dtype, drafter.device)
        losses.append(float(batch_loss(drafter, b, cfg, head_w, vocab_ids, V, stats, teacher)))
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
