"""Per-step certificates and the Parquet trace.

Each generated step of the target gives one trace row.  Everything is computed
in torch on the device of the logits, right after the logits exist:

* ``summarize(logits=...)`` once per step: top-64 probabilities (float64),
  entropy and log-normaliser in one pass over the vocabulary;
* ``radius_rows(criterion, summary, divergence)`` for every criterion and
  divergence from that one summary (exact; rows whose decisive token lies
  below the top-64 are re-sorted exactly by the core library);
* with a drafter q (teacher-forced on the same prefix): KL(p||q), KL(q||p), TV,
  ``accepts_rows`` (the drafter proposes argmax q, or its top-m for trees) and
  the certificate ``KL(p||q) < radius(p)``.  Soundness says certified =>
  accepted on every step; a violation is a bug and is reported loudly.

Only the columns of the trace leave the device (once per batch); full
distributions are never written anywhere.

Non-finite logits (NaN, +inf, or a row that is entirely -inf) make the
log-normaliser non-finite.  Such a step is flagged ``nonfinite`` and kept: its
certificates are computed on a uniform placeholder and then overwritten with
NaN (radii, margin, entropy, divergences, top-k probabilities) and False
(accepted, certified), so it is counted but can never certify anything.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..certificates import accepts_rows, radius_rows
from ..criteria import Criterion, TreeCoverage
from ..summary import Summary, summarize

__all__ = [
    "TOPK_STORED",
    "SUMMARY_K",
    "StepCertifier",
    "BatchTrace",
    "trace_schema",
    "radius_column",
    "write_shard",
    "list_shards",
    "shard_prompt_ids",
    "SHARD_META_PROMPTS",
    "SHARD_META_SETTINGS",
]

TOPK_STORED = 16  # top-k ids/probs stored per step (target and drafter)
ROLLOUT_MASK_WIDTH = 4  # ranks per depth whose acceptance the rollout masks record (trace/3)
SUMMARY_K = 64  # partial sort kept on the device; exactness never depends on it
SHARD_META_PROMPTS = b"draftcert.prompt_ids"
SHARD_META_SETTINGS = b"draftcert.settings_sha256"
_PREFIX = {"forward": "radius", "reverse": "radius_reverse", "tv": "radius_tv"}


def radius_column(spec: str, divergence: str = "forward") -> str:
    return f"{_PREFIX[divergence]}/{spec}"


def trace_schema(criteria: Sequence[Criterion], divergences: Sequence[str], with_drafter: bool,
                 rollout: tuple[int, int] | None = None):
    """The Arrow schema of a trace shard (column order is part of the format).

    ``rollout = (depth, width)``: a feature drafter's rollout columns (``profile.rollout``)."""
    import pyarrow as pa

    f64, i32, f32 = pa.float64(), pa.int32(), pa.float32()
    fields = [
        pa.field("prompt_id", pa.string()),
        pa.field("position", i32),
        pa.field("target_token", i32),
        pa.field("target_margin", f64),
        pa.field("target_entropy", f64),
        pa.field("target_topk_ids", pa.list_(i32)),
        pa.field("target_topk_probs", pa.list_(f32)),
        pa.field("nonfinite", pa.bool_()),
    ]
    for d in divergences:
        fields += [pa.field(radius_column(c.spec, d), f64) for c in criteria]
    if with_drafter:
        fields += [
            pa.field("draft_token", i32),
            pa.field("draft_topk_ids", pa.list_(i32)),
            pa.field("draft_topk_probs", pa.list_(f32)),
            pa.field("kl_forward", f64),
            pa.field("kl_reverse", f64),
            pa.field("tv", f64),
            pa.field("draft_nonfinite", pa.bool_()),
            # for replay/explain (draftcert.replay): p's log-probability of each of the drafter's
            # top-k tokens, and the rank under p of the drafter's token (0 = p's argmax)
            pa.field("draft_topk_target_logp", pa.list_(f32)),
            pa.field("draft_token_target_rank", i32),
        ]
        fields += [pa.field(f"accepted/{c.spec}", pa.bool_()) for c in criteria]
        # bit i set iff the rule accepts the drafter's rank-i token (level-set rules; replay of trees)
        fields += [pa.field(f"accept_mask/{c.spec}", i32) for c in criteria if not isinstance(c, TreeCoverage)]
        fields += [pa.field(f"certified/{c.spec}", pa.bool_()) for c in criteria]
        if rollout is not None:
            # draftcert-trace/3, feature drafters: the drafter's top-m at depths 2..depth for this
            # row's token (flattened depth-major, -1 = no such round), their log p, the top-2 logit
            # gap per depth, and per level-set rule a bit mask per depth (bit r: rank r accepted)
            fields += [
                pa.field("rollout_topk_ids", pa.list_(i32)),
                pa.field("rollout_topk_target_logp", pa.list_(f32)),
                pa.field("rollout_logit_gap", pa.list_(f32)),
            ]
            fields += [pa.field(f"rollout_accept_mask/{c.spec}", pa.list_(i32)) for c in criteria
                       if not isinstance(c, TreeCoverage)]
    return pa.schema(fields)


def _summarize_guarded(logits: torch.Tensor, k: int, entropy: bool) -> tuple[Summary, torch.Tensor]:
    """summarize() that never raises on broken rows: returns (summary, nonfinite (A,) bool).

    One pass, no extra checks on the common path: a NaN/+inf/all -inf row makes
    the log-normaliser non-finite.  Only then are those rows replaced by zeros
    (uniform) and the batch re-summarised so the other rows stay exact."""
    s = summarize(logits=logits, k=k, entropy=entropy, validate=False)
    bad = ~torch.isfinite(s.log_norm)
    if entropy:
        bad |= ~torch.isfinite(s.entropy)
    if bool(bad.any()):
        clean = torch.where(bad[:, None], torch.zeros((), dtype=logits.dtype, device=logits.device), logits)
        s = summarize(logits=clean, k=k, entropy=entropy, validate=False)
    return s, bad


class StepCertifier:
    """Turns each step's logits into trace columns (torch tensors on the logits' device)."""

    def __init__(self, criteria: Sequence[Criterion], divergences: Sequence[str] = ("forward",)):
        self.criteria = list(criteria)
        self.divergences = list(divergences)
        if "forward" not in self.divergences:
            self.divergences.insert(0, "forward")
        self.k = max([SUMMARY_K, TOPK_STORED] + [c.min_k for c in self.criteria])

    def summarize_step(self, logits: torch.Tensor) -> tuple[Summary, torch.Tensor]:
        """One step's (A, V) logits -> (summary, nonfinite mask), right as they are produced.
        The summary keeps a reference to the logits for the exact fallbacks."""
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # the normaliser and entropy sums need float32 at least
        return _summarize_guarded(logits, self.k, entropy=True)

    def rows(self, summaries: Sequence[Summary], bads: Sequence[torch.Tensor],
             draft_logits: torch.Tensor | None = None, rollout=None) -> dict[str, torch.Tensor]:
        """Trace columns for the rows of several steps at once (concatenated in order).

        Radii of every criterion and divergence come from one concatenated summary
        (``radius_rows`` per criterion: its per-call overhead is paid once per group of
        steps, not once per step).  With ``draft_logits`` (N, V), the drafter's logits for
        the same rows, the drafter columns are added.
        """
        summ = concat_summaries(summaries)
        bad = torch.cat(list(bads))
        top = summ.top_probs
        nan = torch.tensor(torch.nan, dtype=torch.float64, device=top.device)
        cols = {
            "target_margin": torch.where(bad, nan, top[:, 0] - top[:, 1]),
            "target_entropy": torch.where(bad, nan, summ.entropy),
            "target_topk_ids": summ.top_ids[:, :TOPK_STORED].to(torch.int32),
            "target_topk_probs": torch.where(bad[:, None], nan, top[:, :TOPK_STORED]).to(torch.float32),
            "nonfinite": bad,
        }
        for c in self.criteria:
            for d, r in _radii(c, summ, self.divergences).items():
                cols[radius_column(c.spec, d)] = torch.where(bad, nan, r)
        if draft_logits is not None:
            cols.update(self._draft_cols(summ, bad, cols, draft_logits))
            if rollout is not None:
                cols.update(self._rollout_cols(summ, bad | cols["draft_nonfinite"], *rollout))
        return cols

    def _rollout_cols(self, summ: Summary, bad: torch.Tensor, ids: torch.Tensor, gap: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rollout columns of rows whose proposals at depths 2.. are ``ids`` (N, D, m), -1 = none."""
        N, D, m = ids.shape
        flat = ids.reshape(N, D * m)
        valid = (flat >= 0) & ~bad[:, None]
        safe = flat.clamp_min(0)
        lp = summ.source.gather(-1, safe).double() - summ.log_norm[:, None]
        nan = torch.tensor(torch.nan, dtype=torch.float64, device=lp.device)
        cols = {
            "rollout_topk_ids": flat.to(torch.int32),
            "rollout_topk_target_logp": torch.where(valid, lp, nan).to(torch.float32),
            "rollout_logit_gap": gap.to(torch.float32),
        }
        # level-set rules on trees of width <= ROLLOUT_MASK_WIDTH below the root (every default shape)
        mw = min(m, ROLLOUT_MASK_WIDTH)
        sub, vsub = safe.reshape(N, D, m)[:, :, :mw].reshape(N, D * mw), valid.reshape(N, D, m)[:, :, :mw].reshape(N, D * mw)
        bits = 2 ** torch.arange(mw, device=ids.device, dtype=torch.int64)
        for c in self.criteria:
            if not isinstance(c, TreeCoverage):
                keep = c.accept_ids(summ, sub) & vsub  # as the engine decides a child ((N, K) ids: one pass)
                cols[f"rollout_accept_mask/{c.spec}"] = (keep.reshape(N, D, mw).to(torch.int64) * bits).sum(2).to(torch.int32)
        return cols

    def _draft_cols(self, summ: Summary, target_bad: torch.Tensor, tcols: dict[str, torch.Tensor],
                    draft_logits: torch.Tensor) -> dict[str, torch.Tensor]:
        radius = {c.spec: tcols[radius_column(c.spec, "forward")] for c in self.criteria}
        if draft_logits.dtype in (torch.float16, torch.bfloat16):
            draft_logits = draft_logits.float()
        # The drafter needs no entropy and no normaliser of its own: its top-k (values are
        # logits, stable tie order) and its max as a provisional normaliser, which
        # divergences_from_logits corrects to the exact float64 one.
        dvals, dids = draft_topk(draft_logits, TOPK_STORED)
        dbad = ~torch.isfinite(dvals[:, 0])  # NaN or +inf anywhere surfaces as the max; all -inf too
        y = draft_logits
        if bool(dbad.any()):
            y = torch.where(dbad[:, None], torch.zeros((), dtype=y.dtype, device=y.device), y)
            dvals, dids = draft_topk(y, TOPK_STORED)
        kl_f, kl_r, tv, log_zq = divergences_from_logits(summ.source, summ.log_norm, y, dvals[:, 0].double())
        bad = target_bad | dbad
        nan = torch.tensor(torch.nan, dtype=torch.float64, device=kl_f.device)
        kl_f = torch.where(bad, nan, kl_f)
        dprobs = torch.exp(dvals.double() - log_zq[:, None])
        cols = {
            "draft_token": dids[:, 0].to(torch.int32),
            "draft_topk_ids": dids.to(torch.int32),
            "draft_topk_probs": torch.where(dbad[:, None], nan, dprobs).to(torch.float32),
            "kl_forward": kl_f,
            "kl_reverse": torch.where(bad, nan, kl_r),
            "tv": torch.where(bad, nan, tv),
            "draft_nonfinite": dbad,
        }
        ok = ~bad
        # p's log-probability of the drafter's top-k tokens (as Summary.prob_of computes it)
        # and the exact rank of its greedy token under p: #{y : p(y) > p(x)}
        lp = summ.source.gather(-1, dids).double() - summ.log_norm[:, None]
        cols["draft_topk_target_logp"] = torch.where(bad[:, None], nan, lp).to(torch.float32)
        cols["draft_token_target_rank"] = _rank_under(summ.source, dids[:, 0]).to(torch.int32)
        acc = accepts_from_topk(self.criteria, summ, dvals, dids, y)
        for c in self.criteria:
            cols[f"accepted/{c.spec}"] = acc[c.spec] & ok
        bits = (2 ** torch.arange(dids.shape[1], device=dids.device, dtype=torch.int64))
        for c in self.criteria:
            if not isinstance(c, TreeCoverage):
                # exactly as the engine decides a child (``accept_ids``: the rule on the given values)
                keep = c.accept_ids(summ, dids) & ok[:, None]  # every column at once: the same decisions
                cols[f"accept_mask/{c.spec}"] = (keep.to(torch.int64) * bits).sum(1).to(torch.int32)
        # Floating-point contract (docs/theory.md, section 7): radii are lower bounds on the
        # exact radius; kl_f is float64 but not a proven upper bound, so rows whose kl_f lies
        # within 1e-6 of a radius are decided with the proven upper bound instead.
        kl_cert = kl_f
        near = torch.zeros_like(bad)
        for c in self.criteria:
            r = radius[c.spec]
            near |= (kl_f - r).abs() <= 1e-6 * (1 + r.abs().nan_to_num(posinf=0.0))
        idx = (near & ok).nonzero().squeeze(1)
        if idx.numel():
            from ..divergences import forward_kl_upper

            kl_cert = kl_f.clone()
            kl_cert[idx] = forward_kl_upper(summ.source[idx], y[idx])
        for c in self.criteria:
            # NaN radius or NaN divergence compare False: a broken step never certifies.
            cols[f"certified/{c.spec}"] = kl_cert < radius[c.spec]
        return cols


# Rows per chunk in divergences_from_logits: its four float64 buffers (CHUNK_ELEMENTS * 8
# bytes each, at least one row) then stay in the CPU's cache instead of streaming through
# memory once per elementwise op (1 row at V = 49k and 152k; on (256, 49152) float32 logits,
# 1 thread: 75 ms against 87 ms with 2 rows and 123 ms with 21).
CHUNK_ELEMENTS = 1 << 16


def divergences_from_logits(x: torch.Tensor, log_zp: torch.Tensor, y: torch.Tensor, log_zq: torch.Tensor):
    """KL(p||q), KL(q||p), TV and the exact log-normaliser of q, for rows of target logits
    x and drafter logits y, in float64.

    log_zp, log_zq are provisional log-normalisers: ``Summary.log_norm`` (which for float32
    logits carries the float32 summation error, ~1e-7), or just the row maximum.  Each row is renormalised
    here in float64 so the result is exact for the given logits: with
    p~ = exp(x - log_zp), S_p = sum p~ (and likewise q~, S_q), p = p~ / S_p and
    d~ = (x - log_zp) - (y - log_zq),
        KL(p||q) = sum p~ d~ / S_p - log S_p + log S_q
        KL(q||p) = -sum q~ d~ / S_q - log S_q + log S_p
        TV       = (1/2) sum |p~ / S_p - q~ / S_q|.
    (x and y are float32/bfloat16 logits, exact in float64.)  The fast path assumes finite
    logits; rows where it is not finite (a -inf, i.e. a masked token, gives inf - inf or
    0 * inf) are recomputed with 0 log 0 = 0 made explicit, which gives +inf exactly when
    the support condition fails.
    """
    n, V = x.shape
    kl_f = torch.empty(n, dtype=torch.float64, device=x.device)
    kl_r, tv, log_sq = torch.empty_like(kl_f), torch.empty_like(kl_f), torch.empty_like(kl_f)
    step = min(n, max(1, CHUNK_ELEMENTS // V)) if x.device.type == "cpu" else n
    # Four float64 work buffers reused by every chunk: fresh (rows, V) float64 temporaries
    # per op cost more in allocation and first-touch page faults than the arithmetic.
    P, Q, D, T = (torch.empty(step, V, dtype=torch.float64, device=x.device) for _ in range(4))
    for i in range(0, n, step):
        j = min(n, i + step)
        p, q, d, t = P[: j - i], Q[: j - i], D[: j - i], T[: j - i]
        p.copy_(x[i:j]).sub_(log_zp[i:j, None])  # log p~ (float32 -> float64 is exact)
        q.copy_(y[i:j]).sub_(log_zq[i:j, None])
        torch.sub(p, q, out=d)  # d~
        p.exp_(), q.exp_()
        sp, sq = p.sum(1), q.sum(1)
        log_sq[i:j] = sq.log()
        ls = sp.log() - log_sq[i:j]
        # sum p~ d~ and sum q~ d~ (as linalg.vecdot computes them, but the products go to a
        # reused buffer instead of a fresh temporary)
        kl_f[i:j] = torch.mul(p, d, out=t).sum(1) / sp - ls
        kl_r[i:j] = ls - torch.mul(q, d, out=t).sum(1) / sq
        # TV = (1/2) sum |p~ (S_q / S_p) - q~| / S_q: one multiply per element instead of
        # two divisions (the extra rounding is one float64 ulp per term).
        tv[i:j] = p.mul_((sq / sp)[:, None]).sub_(q).abs_().sum(1).div_(sq).mul_(0.5)
    broken = ~(torch.isfinite(kl_f) & torch.isfinite(kl_r))
    if bool(broken.any()):
        i = broken.nonzero().squeeze(1)
        lp = torch.log_softmax(x[i].double(), dim=1)
        lq = torch.log_softmax(y[i].double(), dim=1)
        p, q = lp.exp(), lq.exp()
        zero = torch.zeros((), dtype=torch.float64, device=x.device)
        kl_f[i] = torch.where(p > 0, p * (lp - lq), zero).sum(1)
        kl_r[i] = torch.where(q > 0, q * (lq - lp), zero).sum(1)
        tv[i] = 0.5 * (p - q).abs().sum(1)
        log_sq[i] = torch.logsumexp(y[i].double(), dim=1) - log_zq[i]
    # rounding can leave the KL of identical distributions at -1e-17: clamp to its true range
    return kl_f.clamp_min(0), kl_r.clamp_min(0), tv, log_zq + log_sq


def _rank_under(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """#{y : x[n, y] > x[n, ids[n]]} per row (x: logits; a few rows at a time, no (N, V) bool temporary)."""
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    step = max(1, CHUNK_ELEMENTS // max(1, x.shape[1])) if x.device.type == "cpu" else x.shape[0]
    for i in range(0, x.shape[0], step):
        j = min(x.shape[0], i + step)
        v = x[i:j].gather(-1, ids[i:j, None])
        out[i:j] = (x[i:j] > v).sum(1)
    return out


def draft_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k logits per row, descending, lower token id first among equal values (also across the
    k-th value: a feature drafter's out-of-vocabulary tokens share one logit)."""
    from ..summary import topk_lowest_ids

    return topk_lowest_ids(logits, min(k, logits.shape[-1]))


def accepts_from_topk(criteria: Sequence[Criterion], summ: Summary, dv: torch.Tensor, di: torch.Tensor,
                      q_logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """accepted/<spec> for every criterion from the top-k lists, exactly as
    ``certificates.accepts_rows(c, summ, q_logits)`` decides it, without a pass over the
    vocabulary per criterion.  ``dv, di``: the drafter's top-k logits and ids (``draft_topk``).

    The drafter proposes x = argmax q with the lowest index among ties: the first entry
    of its stable (value desc, id asc) top-k.  A level-set rule decides x with
    ``accept_ids`` (exact on the given values, as ``accepts`` is).  Tree:m
    accepts iff the target's greedy token a (first entry of its stable top-k) is among
    the first m entries of the drafter's stable top-k, i.e. fewer than m tokens y have
    q(y) > q(a) or q(y) = q(a) with y < a.  (The logits stand in for q: exp is monotone,
    so they order the tokens as q does, without rounding ties.)

    The top-k lists are exact except where a tie crosses their end (torch.topk may keep
    any of several equal values at the boundary).  Rows where that could matter -- all k
    drafter values equal (argmax), the drafter's m-th value equal to its k-th (tree:m),
    all k target values equal (a) -- are decided by ``accepts_rows`` on the full rows.
    """
    from ..criteria import TreeCoverage

    kd = dv.shape[1]
    x = di[:, 0]
    a = summ.top_ids[:, 0]
    unsure_x = dv[:, 0] == dv[:, -1]  # >= k tied maxima: the lowest id may lie outside the top-k
    unsure_a = summ.top_probs[:, 0] == summ.top_probs[:, -1]
    out: dict[str, torch.Tensor] = {}
    for c in criteria:
        if isinstance(c, TreeCoverage):
            m = c.m
            if m >= kd:
                acc = accepts_rows(c, summ, q_logits)
            else:
                acc = (di[:, :m] == a[:, None]).any(1)
                unsure = unsure_a | (dv[:, m - 1] == dv[:, -1])
        else:
            # the rule evaluated exactly on the given values (float64 where the error
            # bounds decide, arbitrary precision for the rare near-threshold rows)
            acc = c.accept_ids(summ, x)
            unsure = unsure_x
        if not (isinstance(c, TreeCoverage) and c.m >= kd) and bool(unsure.any()):
            i = unsure.nonzero().squeeze(1)
            acc = acc.clone()
            acc[i] = accepts_rows(c, _rows_of(summ, i), q_logits[i])
        out[c.spec] = acc
    return out


def _rows_of(summ: Summary, i: torch.Tensor) -> Summary:
    return Summary(summ.top_probs[i], summ.top_ids[i], None if summ.entropy is None else summ.entropy[i],
                   None if summ.log_norm is None else summ.log_norm[i], summ.vocab_size, summ.out,
                   summ.source[i], summ.is_logits)


def _radii(c: Criterion, summ: Summary, divergences: Sequence[str]) -> dict[str, torch.Tensor]:
    """``radius_rows`` for each divergence.  (Rows whose rejected token lies beyond the
    top-k cost the core one pass over those rows, not a sort: no shortcut needed here.)"""
    return {d: radius_rows(c, summ, d) for d in divergences}


def concat_summaries(parts: Sequence[Summary]) -> Summary:
    """One Summary over the rows of several (same k, same V, logits input)."""
    if len(parts) == 1:
        return parts[0]
    cat = lambda name: torch.cat([getattr(s, name) for s in parts])  # noqa: E731
    p0 = parts[0]
    return Summary(cat("top_probs"), cat("top_ids"), None if p0.entropy is None else cat("entropy"),
                   cat("log_norm"), p0.vocab_size, p0.out, cat("source"), p0.is_logits)


@dataclass
class StepRows:
    """Trace columns for N rows of a batch (any mix of prompts and steps)."""

    rows: torch.Tensor  # (N,) batch indices
    positions: torch.Tensor  # (N,) step index t
    tokens: torch.Tensor  # (N,) target tokens
    cols: dict[str, torch.Tensor]


class BatchTrace:
    """Collects a batch's step columns on the device; converts to Arrow once."""

    def __init__(self, prompt_ids: Sequence[str], schema):
        self.prompt_ids = list(prompt_ids)
        self.schema = schema
        self.steps: list[StepRows] = []

    def add(self, step: StepRows) -> None:
        self.steps.append(step)

    def to_table(self):
        """Arrow table, rows ordered by (prompt in batch order, position)."""
        import pyarrow as pa

        rows = torch.cat([s.rows for s in self.steps]).cpu().numpy()
        pos = torch.cat([s.positions for s in self.steps]).cpu().numpy().astype(np.int32)
        order = np.lexsort((pos, rows))  # primary key: row, then position
        n = order.shape[0]
        data = {
            "prompt_id": pa.array(np.asarray(self.prompt_ids, dtype=object)[rows[order]], type=pa.string()),
            "position": pa.array(pos[order], type=pa.int32()),
            "target_token": pa.array(torch.cat([s.tokens for s in self.steps]).cpu().numpy().astype(np.int32)[order]),
        }
        names = self.steps[0].cols.keys()
        for name in names:
            v = torch.cat([s.cols[name] for s in self.steps]).cpu().numpy()[order]
            if v.ndim == 2:  # fixed k per row -> list column via offsets (no Python loop)
                offsets = pa.array(np.arange(0, v.size + 1, v.shape[1], dtype=np.int32))
                data[name] = pa.ListArray.from_arrays(offsets, pa.array(v.reshape(-1)))
            else:
                data[name] = pa.array(v)
        cols = []
        for f in self.schema:
            arr = data[f.name]
            cols.append(arr if arr.type == f.type else arr.cast(f.type))
        assert all(len(c) == n for c in cols)
        return pa.Table.from_arrays(cols, schema=self.schema)


def write_shard(table, path: Path, prompt_ids: Sequence[str], settings_sha: str) -> None:
    """Atomic shard write: a hidden temporary file in the same directory, then os.replace."""
    import pyarrow.parquet as pq

    meta = dict(table.schema.metadata or {})
    meta[SHARD_META_PROMPTS] = json.dumps(list(prompt_ids)).encode()
    meta[SHARD_META_SETTINGS] = settings_sha.encode()
    table = table.replace_schema_metadata(meta)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, path)


_SHARD_RE = re.compile(r"^rank\d+-\d+\.parquet$")


def list_shards(trace_dir: Path) -> list[Path]:
    trace_dir = Path(trace_dir)
    if not trace_dir.is_dir():
        return []
    return sorted(p for p in trace_dir.iterdir() if _SHARD_RE.match(p.name))


def shard_prompt_ids(path: Path) -> tuple[list[str], str | None]:
    """(prompt ids, settings hash) recorded in a shard's footer (no data read)."""
    import pyarrow.parquet as pq

    try:
        meta = pq.read_schema(path).metadata or {}
    except Exception as exc:  # an unreadable shard cannot be half-written (atomic writes): say so
        raise ValueError(f"trace shard {path} is unreadable ({exc}); delete it and rerun to recompute its prompts") from None
    if SHARD_META_PROMPTS not in meta:
        raise ValueError(f"trace shard {path} lacks the draftcert prompt-id metadata; delete it and rerun")
    sha = meta.get(SHARD_META_SETTINGS)
    return json.loads(meta[SHARD_META_PROMPTS].decode()), (sha.decode() if sha else None)
