"""Exact acceptance radii and certificates.

radius(p) = inf { D(p, q) : some maximiser of q lies in R(p) }     (single token)
radius(p) = inf { D(p, q) : |{y != a : q(y) >= q(a)}| >= m }     (tree:m)

Certificate: D(p, q) < radius(p)  =>  the draft is accepted.

Single-token rules: the cheapest rejected token is the most probable one,
y* (rearrangement: swapping q(y) and q(y') toward the larger p never costs
more, for all three divergences), and lifting it is a water-filling against
the tokens above it (``pool_above``).  Trees: the cheapest m competitors are
p(2nd..m+1), and the argmax is pooled with the smallest of them
(``pool_below``).  Derivations: docs/theory.md.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ._arrays import ArrayLike
from .criteria import Criterion, LevelSet, TreeCoverage, as_criterion
from .divergences import check_divergence, divergence_rows, pool_above, pool_below, probs_from
from .summary import DEFAULT_TOPK, Summary, summarize

__all__ = ["radius", "radii", "radius_rows", "accepts", "certified", "certified_run_length"]


def _first_rejected(crit: LevelSet, s: torch.Tensor, tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted position of the most probable rejected token and whether one exists in s."""
    rej = crit.rejected_mask(s, tau[:, None])  # monotone along a descending row
    n_rej = rej.sum(1)
    r = (s.shape[1] - n_rej).clamp(max=s.shape[1] - 1)
    return r, n_rej > 0


def _deep_rejected(crit: LevelSet, summ: Summary, rows: torch.Tensor, tau: torch.Tensor):
    """For rows whose top-k holds no rejected token: which of them have one at all (the row
    minimum decides), and for those the probability b of the most probable one."""
    sel = crit.rejected_mask(summ.min_prob(rows), tau).nonzero().squeeze(1)
    b = summ.max_prob_where(rows[sel], tau[sel], crit.inclusive) if sel.numel() else None
    return sel, b


def _deep_radius(crit: LevelSet, summ: Summary, rows: torch.Tensor, tau: torch.Tensor, kind: str) -> torch.Tensor:
    out = torch.full((rows.numel(),), torch.inf, dtype=torch.float64, device=tau.device)
    sel, b = _deep_rejected(crit, summ, rows, tau)
    if sel.numel() == 0:
        return out
    rws, tau_s = rows[sel], tau[sel]
    s = torch.cat([summ.top_probs[rws], b[:, None]], 1)
    r = torch.full_like(sel, s.shape[1] - 1)
    cost, level = pool_above(s, r, kind, return_level=True)
    # Exact unless a token beyond the top-k lies above the level (it would join the pool).
    flat = summ.top_probs[rws, -1] > level
    if bool(flat.any()):
        f = flat.nonzero().squeeze(1)
        full = summ.sorted_rows(rws[f])
        r2, _ = _first_rejected(crit, full, tau_s[f])
        cost[f] = pool_above(full, r2, kind, tail=torch.zeros_like(cost[f]))
    out[sel] = cost
    return out


def deep_gap(crit: LevelSet, summ: Summary, rows: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """p(1st) - b for rows whose rejected tokens all lie beyond the top-k (+inf if none)."""
    out = torch.full((rows.numel(),), torch.inf, dtype=torch.float64, device=tau.device)
    sel, b = _deep_rejected(crit, summ, rows, tau)
    if sel.numel():
        out[sel] = summ.top_probs[rows[sel], 0] - b
    return out


def _known_tail(summ: Summary, kind: str) -> torch.Tensor | None:
    """Mass beyond the top-k, needed by reverse KL: exactly 0 for a complete summary
    (1 - sum would leave round-off that caps reverse-KL radii near -log(1e-16)).  For an
    incomplete one 1 - sum(top-k) is exact enough unless the tail is tiny; those rows
    (reverse KL only) get it summed directly from the source, one pass each, once per
    summary (cached: ``radii`` asks for it once per criterion)."""
    if summ.complete:
        return torch.zeros_like(summ.top_probs[:, 0])
    if kind != "reverse":
        return None
    if summ.tail_cache is None:
        tail = (1 - summ.top_probs.sum(1)).clamp_min(0)
        rows = (tail < 1e-6).nonzero().squeeze(1)
        if rows.numel():
            P = summ.probs_f64(rows)
            P.scatter_(1, summ.top_ids[rows], 0.0)
            tail[rows] = P.sum(1)
        summ.tail_cache = tail
    return summ.tail_cache


def radius_rows(crit: Criterion, summ: Summary, kind: str) -> torch.Tensor:
    """Exact radius for every row of a summary: (N,) float64 (+inf where no drafter can be rejected)."""
    top = summ.top_probs
    if isinstance(crit, TreeCoverage):
        if crit.m >= summ.vocab_size:
            return torch.full((top.shape[0],), torch.inf, dtype=torch.float64, device=top.device)
        if summ.k < crit.m + 1:
            raise ValueError(f"summary holds top-{summ.k}; tree:{crit.m} needs k >= {crit.m + 1}")
        return pool_below(top, crit.m, kind, tail=_known_tail(summ, kind))
    if not isinstance(crit, LevelSet):
        raise ValueError(f"criterion: unsupported type {type(crit).__name__}")
    if summ.k < min(crit.min_k, summ.vocab_size):
        raise ValueError(f"summary holds top-{summ.k}; {crit.spec} needs k >= {crit.min_k}")
    tau = crit.threshold_from_summary(summ)
    r, found = _first_rejected(crit, top, tau)
    out = pool_above(top, r, kind, tail=_known_tail(summ, kind))
    out = torch.where(found, out, torch.full_like(out, torch.inf))
    if not summ.complete:
        deep = (~found).nonzero().squeeze(1)
        if deep.numel():
            out[deep] = _deep_radius(crit, summ, deep, tau[deep], kind)
    return out


def radius(
    criterion: str | Criterion,
    probs: ArrayLike | None = None,
    divergence: str = "forward",
    *,
    logits: ArrayLike | None = None,
    k: int = DEFAULT_TOPK,
) -> ArrayLike:
    """Exact radius of ``criterion`` at target distributions ``probs`` (..., V) -> (...).

    ``divergence`` is ``forward`` (KL(p||q)), ``reverse`` (KL(q||p)) or ``tv``.
    Any drafter q with D(p, q) < radius(p) is accepted.  ``k`` only tunes the
    partial sort; results are exact for every k.
    """
    crit = as_criterion(criterion)
    check_divergence(divergence)
    summ = summarize(probs, logits=logits, k=max(k, crit.min_k), entropy=crit.needs_entropy)
    return summ.out.wrap(radius_rows(crit, summ, divergence))


def radii(
    criteria: Iterable[str | Criterion],
    probs: ArrayLike | None = None,
    divergence: str | Iterable[str] = "forward",
    *,
    logits: ArrayLike | None = None,
    k: int = DEFAULT_TOPK,
) -> dict[str, ArrayLike]:
    """Radii of several criteria (and divergences) from one pass over the input.

    Returns ``{spec: array}`` for a single divergence, or
    ``{(spec, divergence): array}`` when several divergences are asked for.
    """
    crits = [as_criterion(c) for c in criteria]
    if not crits:
        raise ValueError("criteria: pass at least one criterion")
    kinds = [divergence] if isinstance(divergence, str) else list(divergence)
    for d in kinds:
        check_divergence(d)
    summ = summarize(
        probs,
        logits=logits,
        k=max([k] + [c.min_k for c in crits]),
        entropy=any(c.needs_entropy for c in crits),
    )
    res = {}
    for c in crits:
        for d in kinds:
            key = c.spec if isinstance(divergence, str) else (c.spec, d)
            res[key] = summ.out.wrap(radius_rows(c, summ, d))
    return res


def _two_inputs(target_probs, draft_probs, target_logits, draft_logits):
    if (target_probs is None) == (target_logits is None):
        raise ValueError("pass exactly one of target_probs or target_logits=")
    if (draft_probs is None) == (draft_logits is None):
        raise ValueError("pass exactly one of draft_probs or draft_logits=")


def _draft_rows(draft, is_logits: bool, summ: Summary, name: str) -> torch.Tensor:
    q, _ = probs_from(draft, is_logits, name)
    if q.shape[-1] != summ.vocab_size:
        raise ValueError(f"{name}: vocabulary size {q.shape[-1]} differs from the target's {summ.vocab_size}")
    if tuple(q.shape[:-1]) != summ.out.batch_shape:
        raise ValueError(f"{name}: batch shape {tuple(q.shape[:-1])} differs from the target's {summ.out.batch_shape}")
    return q.reshape(-1, summ.vocab_size).to(summ.source.device)


def accepts_rows(crit: Criterion, summ: Summary, q: torch.Tensor) -> torch.Tensor:
    """(N,) bool: is the drafter's proposal accepted?  Drafter proposes argmax q
    (lowest index among ties), or its top-m for trees (ties to the lower index)."""
    if isinstance(crit, TreeCoverage):
        a = torch.argmax(summ.source, dim=-1)  # lowest-index maximiser of p
        qa = q.gather(1, a[:, None])
        ids = torch.arange(q.shape[1], device=q.device)[None, :]
        ahead = (q > qa) | ((q == qa) & (ids < a[:, None]))
        return ahead.sum(1) < crit.m
    x = torch.argmax(q, dim=-1)
    px = summ.prob_of(x)
    return ~crit.rejected_mask(px, crit.threshold_from_summary(summ))


def accepts(
    criterion: str | Criterion,
    target_probs: ArrayLike | None = None,
    draft_probs: ArrayLike | None = None,
    *,
    target_logits: ArrayLike | None = None,
    draft_logits: ArrayLike | None = None,
) -> ArrayLike:
    """Would ``criterion`` accept the drafter's greedy proposal (top-m for trees)? (..., V) -> (...) bool."""
    crit = as_criterion(criterion)
    _two_inputs(target_probs, draft_probs, target_logits, draft_logits)
    summ = summarize(target_probs, logits=target_logits, k=crit.min_k, entropy=crit.needs_entropy, name="target_probs")
    q = _draft_rows(draft_probs if draft_logits is None else draft_logits, draft_logits is not None, summ, "draft_probs" if draft_logits is None else "draft_logits")
    return summ.out.wrap(accepts_rows(crit, summ, q))


def certified(
    criterion: str | Criterion,
    target_probs: ArrayLike | None = None,
    draft_probs: ArrayLike | None = None,
    divergence: str = "forward",
    *,
    target_logits: ArrayLike | None = None,
    draft_logits: ArrayLike | None = None,
) -> ArrayLike:
    """Certificate D(p, q) < radius(p) (which implies acceptance). (..., V) -> (...) bool."""
    crit = as_criterion(criterion)
    check_divergence(divergence)
    _two_inputs(target_probs, draft_probs, target_logits, draft_logits)
    summ = summarize(target_probs, logits=target_logits, k=max(DEFAULT_TOPK, crit.min_k), entropy=crit.needs_entropy, name="target_probs")
    q = _draft_rows(draft_probs if draft_logits is None else draft_logits, draft_logits is not None, summ, "draft_probs" if draft_logits is None else "draft_logits")
    d = divergence_rows(summ.probs_f64(), q.double(), divergence)
    return summ.out.wrap(d < radius_rows(crit, summ, divergence))


def certified_run_length(radii: ArrayLike, epsilon: float, block: int | None = None) -> ArrayLike:
    """Guaranteed accepted run from each position of a trajectory of radii.

    radii : (..., T) per-step radii along the last axis.  A step is certified for
    every drafter with per-step divergence < epsilon iff epsilon <= radius.
    Returns (..., T) integers: L[t] = number of consecutive certified steps
    t, t+1, ..., capped at ``block`` when given.
    """
    import numpy as np

    if isinstance(radii, torch.Tensor):
        r, is_np = radii.detach(), False
    else:
        r, is_np = torch.as_tensor(np.asarray(radii, dtype=np.float64)), True
    if r.ndim < 1:
        raise ValueError("radii: expected shape (..., T) with a time axis")
    if bool(torch.isnan(r).any()) or bool((r < 0).any()):
        raise ValueError("radii: must be non-negative and not NaN (+inf is allowed)")
    eps = float(epsilon)
    if not eps >= 0 or eps != eps or eps == float("inf"):
        raise ValueError(f"epsilon: expected a finite value >= 0, got {epsilon!r}")
    if block is not None and (int(block) != block or block < 1):
        raise ValueError(f"block: expected an integer >= 1 or None, got {block!r}")
    T = r.shape[-1]
    ok = r >= eps
    idx = torch.arange(T, device=r.device).expand(r.shape)
    # next failing position at or after t (T if none): reversed running minimum
    fail_pos = torch.where(ok, torch.full_like(idx, T), idx)
    nxt = torch.flip(torch.cummin(torch.flip(fail_pos, [-1]), dim=-1).values, [-1])
    run = nxt - idx
    if block is not None:
        run = run.clamp(max=int(block))
    return run.cpu().numpy() if is_np else run
