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

Only the columns of the trace leave the device (once per batch, as one Arrow
table: ``BatchTrace``); full distributions are never written anywhere.  The
format itself (columns, schema, shards) is ``draftcert.tracefile``'s.

Non-finite logits (NaN, +inf, or a row that is entirely -inf) make the
log-normaliser non-finite.  Such a step is flagged ``nonfinite`` and kept: its
certificates are computed on a uniform placeholder and then overwritten with
NaN (radii, margin, entropy, divergences, top-k probabilities) and False
(accepted, certified), so it is counted but can never certify anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..certificates import accepts_from_topk, certify_rows, radius_rows
from ..criteria import Criterion
from ..divergences import divergences_from_logits, row_chunk
from ..summary import Summary, summarize, topk_lowest_ids
from ..tracefile import (
    ROLLOUT_MASK_WIDTH,
    TOPK_STORED,
    accept_mask_column,
    accepted_column,
    certified_column,
    has_accept_mask,
    radius_column,
    rollout_mask_column,
)

__all__ = ["SUMMARY_K", "StepCertifier", "StepRows", "BatchTrace"]

SUMMARY_K = 64  # partial sort kept on the device; exactness never depends on it


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
        summ = Summary.concat(summaries)
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
            for d in self.divergences:
                # exact: rows whose rejected token lies beyond the top-k cost the core one pass
                # over those rows, not a sort
                cols[radius_column(c.spec, d)] = torch.where(bad, nan, radius_rows(c, summ, d))
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
            if has_accept_mask(c):
                keep = c.accept_ids(summ, sub) & vsub  # as the engine decides a child ((N, K) ids: one pass)
                cols[rollout_mask_column(c.spec)] = (keep.reshape(N, D, mw).to(torch.int64) * bits).sum(2).to(torch.int32)
        return cols

    def _draft_cols(self, summ: Summary, target_bad: torch.Tensor, tcols: dict[str, torch.Tensor],
                    draft_logits: torch.Tensor) -> dict[str, torch.Tensor]:
        radius = {c.spec: tcols[radius_column(c.spec, "forward")] for c in self.criteria}
        if draft_logits.dtype in (torch.float16, torch.bfloat16):
            draft_logits = draft_logits.float()
        # The drafter needs no entropy and no normaliser of its own: its top-k (values are
        # logits, stable tie order); divergences_from_logits gives its exact float64 normaliser.
        dvals, dids = draft_topk(draft_logits, TOPK_STORED)
        dbad = ~torch.isfinite(dvals[:, 0])  # NaN or +inf anywhere surfaces as the max; all -inf too
        y = draft_logits
        if bool(dbad.any()):
            y = torch.where(dbad[:, None], torch.zeros((), dtype=y.dtype, device=y.device), y)
            dvals, dids = draft_topk(y, TOPK_STORED)
        div = divergences_from_logits(summ.source, y)  # one float64 pass: KL both ways, TV, log Z_q, [lo, hi]
        kl_f, kl_r, tv, log_zq = div["kl"], div["kl_reverse"], div["tv"], div["log_zq"]
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
            cols[accepted_column(c.spec)] = acc[c.spec] & ok
        bits = (2 ** torch.arange(dids.shape[1], device=dids.device, dtype=torch.int64))
        for c in self.criteria:
            if has_accept_mask(c):
                # exactly as the engine decides a child (``accept_ids``: the rule on the given values)
                keep = c.accept_ids(summ, dids) & ok[:, None]  # every column at once: the same decisions
                cols[accept_mask_column(c.spec)] = (keep.to(torch.int64) * bits).sum(1).to(torch.int32)
        # the library's certificate (certificates.certify_rows), bit for bit, for every rule
        # from one divergence bound per row; a broken step never certifies
        cert = certify_rows(summ, y, torch.stack([radius[c.spec] for c in self.criteria], 1),
                            interval=(div["lo"], div["hi"])).certified
        for i, c in enumerate(self.criteria):
            cols[certified_column(c.spec)] = cert[:, i] & ok
        return cols


def _rank_under(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """#{y : x[n, y] > x[n, ids[n]]} per row (x: logits; a few rows at a time, no (N, V) bool temporary)."""
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    step = row_chunk(x)
    for i in range(0, x.shape[0], step):
        j = min(x.shape[0], i + step)
        v = x[i:j].gather(-1, ids[i:j, None])
        out[i:j] = (x[i:j] > v).sum(1)
    return out


def draft_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k logits per row, descending, lower token id first among equal values (also across the
    k-th value: a feature drafter's out-of-vocabulary tokens share one logit)."""
    return topk_lowest_ids(logits, min(k, logits.shape[-1]))


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
        import pyarrow as pa  # optional: models extra

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
