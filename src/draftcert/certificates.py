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

import math
from typing import Iterable, NamedTuple, Sequence

import numpy as np
import torch

from ._arrays import ArrayLike, check_probs, to_tensor
from .criteria import Criterion, LevelSet, TreeCoverage, exact_accept, parse_criterion
from ._fp import TINY, U, gamma
from .divergences import check_divergence, divergence_upper, forward_kl_interval, log_probs
from .summary import DEFAULT_TOPK, Summary, summarize

__all__ = ["radius", "radii", "radius_rows", "accepts", "accepts_rows", "accepts_from_topk", "certified",
           "certify_rows", "Certificate", "certified_run_length", "DEFAULT_EPSILONS"]

# Per-step drifts (nats of forward KL) at which certified run lengths are reported by default.
DEFAULT_EPSILONS = (0.05, 0.1, 0.3, 0.5)


def _first_cut(vals: torch.Tensor, cut: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Position of the first value < cut in rows of descending given values, and whether
    there is one (exact comparisons in the values' dtype)."""
    n_rej = (vals < cut[:, None]).sum(1)
    r = (vals.shape[1] - n_rej).clamp(max=vals.shape[1] - 1)
    return r, n_rej > 0


def _tail_bound(summ: Summary) -> torch.Tensor:
    """(N,) upper bound on the exact mass beyond the top-k (0 for a complete summary).
    1 - sum(top-k) (with the top-k at their lower bounds) where that is not tiny; where it
    is, the tail summed directly from the given values (one pass over those rows, once
    per summary: ``radii`` asks once per criterion)."""
    if summ.complete:
        return torch.zeros_like(summ.top_probs[:, 0])
    if summ.tail_cache is None:
        top = summ.top_probs
        lo = top * (1 - summ.top_entry_err() - 8 * U) / (1 + summ.common_err()[:, None])
        tail = (1 - lo.sum(1)).clamp_min(0) + gamma(summ.k + 4)
        rows = (tail < 1e-3).nonzero().squeeze(1)
        if rows.numel():
            P = summ.probs_f64(rows)
            err = summ.entry_err(summ.source[rows], rows)
            P = P * (1 + err + 8 * U) + TINY
            P.scatter_(1, summ.top_ids[rows], 0.0)
            direct = P.sum(1) * (1 + gamma(summ.vocab_size + 4)) * (1 + 2 * summ.common_err(rows))
            tail[rows] = torch.minimum(tail[rows], direct)
        summ.tail_cache = tail
    return summ.tail_cache


_SIGMA_FLOOR = 2.0**-40


def _bounds_lo_hi(s: torch.Tensor, es: torch.Tensor, zero: torch.Tensor):
    """Per-entry bounds on the exact probabilities up to the common factor:
    p_lo <= p / kappa <= p_hi (TINY covers underflow of a nonzero probability)."""
    lo = (s * (1 - es - 8 * U)).clamp_min(0)
    hi = s * (1 + es + 8 * U) + TINY * (~zero)
    return lo, hi


def single_bound(s: torch.Tensor, es: torch.Tensor, zero: torch.Tensor, r: torch.Tensor, kind: str,
                 uc: torch.Tensor, outside_extra: torch.Tensor | None):
    """Lower bound on the exact cost of making the token at sorted position r a maximiser,
    from float64 probabilities s (N, K) (descending; position r holds b) with per-entry
    relative errors es, exact-zero mask ``zero`` and common factor error uc.

    The pool (the water level, docs/theory.md section 3) is computed as before; the value is
    then a Lagrange dual bound (section 7): weak duality makes it a lower bound for *any*
    multipliers, so rounding in the level costs nothing, and the dual is linear in p, so
    the input errors enter as pessimised coefficients.  Returns (bound, level)."""
    n, K = s.shape
    dev = s.device
    pos = torch.arange(K, device=dev)[None, :]
    b = s.gather(1, r[:, None]).squeeze(1)
    b_zero = zero.gather(1, r[:, None]).squeeze(1)
    j = torch.arange(K + 1, device=dev)
    valid = j[None, :] <= r[:, None]
    zcol = torch.zeros(n, 1, dtype=s.dtype, device=dev)
    above = pos < r[:, None]
    lo, hi = _bounds_lo_hi(s, es, zero)
    b_hi = hi.gather(1, r[:, None]).squeeze(1)
    if kind == "reverse":
        logs = torch.log(torch.where(above, s, torch.ones_like(s)))
        logC = torch.cat([zcol, logs.cumsum(1)], 1)
        logG = ((torch.log(b)[:, None] + logC) / (j + 1)).masked_fill(~valid, -torch.inf)
        logG_star, jstar = logG.max(1)
        J = pos < jstar[:, None]
        eps = gamma(jstar.double() + 34)  # |J| + 1 nonzero terms per sum (zeros add no rounding)
        mu = torch.where(J, (logs - logG_star[:, None]).clamp_min(0), torch.zeros_like(s))
        mu = torch.where(torch.isfinite(mu), mu, torch.zeros_like(mu))
        S = mu.sum(1)
        S_hi = S * (1 + gamma(jstar.double() + 2)) + TINY
        A = (lo * -torch.expm1(-mu)).sum(1) * (1 - eps)
        B = b_hi * torch.expm1(S_hi) * (1 + eps)
        x_lo = ((A - B).clamp_min(0) / (1 + uc) * (1 - 4 * U)).clamp(max=1.0)
        r1 = -torch.log1p(-x_lo) * (1 - 4 * U)
        out_mask = ~J & (pos != r[:, None])
        outside = torch.where(out_mask, hi, torch.zeros_like(hi)).sum(1) * (1 + gamma(K + 4))
        if outside_extra is not None:
            outside = outside + outside_extra
        Z = (outside + (hi * torch.exp(-mu)).where(J, torch.zeros_like(hi)).sum(1) * (1 + eps)
             + b_hi * torch.exp(S_hi) * (1 + eps)) * (1 + eps) * (1 + 2 * uc) + TINY
        r2 = torch.where(Z < 1, -torch.log(Z) * (1 - 4 * U), torch.zeros_like(Z))
        cost = torch.maximum(r1, r2)
        cost = torch.where(b_zero, torch.full_like(cost, torch.inf), cost)
        return cost, torch.exp(logG_star)
    C = torch.cat([zcol, s.cumsum(1)], 1)
    L = ((b[:, None] + C) / (j + 1)).masked_fill(~valid, -torch.inf)
    L_star, jstar = L.max(1)
    J = pos < jstar[:, None]
    eps = gamma(jstar.double() + 34)
    if kind == "tv":
        d = torch.where(J, lo - b_hi[:, None], torch.zeros_like(s))
        tot = d.clamp_min(0).sum(1) * (1 - eps) - (-d).clamp_min(0).sum(1) * (1 + eps)
        cost = (tot / (jstar + 1)).clamp_min(0) / (1 + uc) * (1 - 4 * U)
        return cost, L_star
    mu = torch.where(J, (s / L_star[:, None] - 1).clamp_min(0), torch.zeros_like(s))
    S_hi = mu.sum(1) * (1 + gamma(jstar.double() + 2)) + TINY
    kappa = torch.where(S_hi > 1 - _SIGMA_FLOOR, (1 - _SIGMA_FLOOR) / S_hi * (1 - 4 * U), torch.ones_like(S_hi))
    mu = mu * kappa[:, None]
    S_hi = mu.sum(1) * (1 + gamma(jstar.double() + 2)) + TINY
    # b log(1 - sum mu) <= b log1p(-S_hi): log1p keeps it exact near 1 (near-ties), where
    # log(1 - S) would carry an absolute error U that swamps a radius ~ gap^2
    A = (lo * torch.log1p(mu)).sum(1) * (1 - eps)
    B = torch.where(b_hi > 0, b_hi * -torch.log1p(-S_hi), torch.zeros_like(b_hi)) * (1 + eps)
    cost = (A - B).clamp_min(0) / (1 + uc) * (1 - 4 * U)
    return cost, L_star


def tree_bound(s: torch.Tensor, es: torch.Tensor, zero: torch.Tensor, m: int, kind: str,
               uc: torch.Tensor, outside_extra: torch.Tensor | None) -> torch.Tensor:
    """Lower bound on the exact tree:m radius (docs/theory.md sections 3 and 7): the pool
    of ``divergences.pool_below`` turned into Lagrange multipliers, the dual evaluated
    with pessimised coefficients.  s (N, K) float64 descending, K >= m + 1."""
    n, K = s.shape
    dev = s.device
    lo, hi = _bounds_lo_hi(s, es, zero)
    a, a_lo, a_hi = s[:, 0], lo[:, 0], hi[:, 0]
    T = s[:, 1 : m + 1].flip(1)  # ascending: the smallest competitor first
    T_hi, T_zero = hi[:, 1 : m + 1].flip(1), zero[:, 1 : m + 1].flip(1)
    j = torch.arange(1, m + 1, device=dev)
    idx_pos = torch.arange(m, device=dev)[None, :]
    if kind == "reverse":
        logT = torch.log(T)
        logG = (torch.log(a)[:, None] + logT.cumsum(1)) / (j + 1)
        logG_star, idx = logG.min(1)
        pooled = idx_pos <= idx[:, None]
        eps = gamma(idx.double() + 36)
        mu = logG_star[:, None] - logT  # NaN where both are -inf
        mu = torch.where(torch.isnan(mu), torch.full_like(mu, 600.0), mu).clamp(0, 600)
        # an exactly-zero competitor (weight 0 in the dual) takes mu = inf: then a's term vanishes
        mu = torch.where(pooled, torch.where(T_zero, torch.full_like(mu, torch.inf), mu), torch.zeros_like(mu))
        nz = lambda t: torch.where(T_zero, torch.zeros_like(t), T_hi * t)  # noqa: E731
        S = mu.sum(1)
        S_lo = S * (1 - gamma(m + 2))
        A = a_lo * -torch.expm1(-S_lo) * (1 - eps)
        B = nz(torch.expm1(mu)).sum(1) * (1 + eps)
        x_lo = ((A - B).clamp_min(0) / (1 + uc) * (1 - 4 * U)).clamp(max=1.0)
        r1 = -torch.log1p(-x_lo) * (1 - 4 * U)
        outside = (torch.where(pooled, torch.zeros_like(T_hi), T_hi).sum(1) + hi[:, m + 1 :].sum(1)) * (1 + gamma(K + 4))
        if outside_extra is not None:
            outside = outside + outside_extra
        a_term = a_hi * torch.exp(-S_lo) * (1 + eps) + TINY * torch.isfinite(S_lo)  # TINY: underflow
        Z = (outside + nz(torch.exp(mu)).sum(1) * (1 + eps) + a_term) * (1 + eps) * (1 + 2 * uc)
        r2 = torch.where(Z < 1, -torch.log(Z) * (1 - 4 * U), torch.zeros_like(Z))
        return torch.maximum(r1, r2)
    C = T.cumsum(1)
    L = (a[:, None] + C) / (j + 1)
    L_star, idx = L.min(1)
    pooled = idx_pos <= idx[:, None]
    eps = gamma(idx.double() + 36)
    if kind == "tv":
        d = torch.where(pooled, a_lo[:, None] - T_hi, torch.zeros_like(T))
        tot = d.clamp_min(0).sum(1) * (1 - eps) - (-d).clamp_min(0).sum(1) * (1 + eps)
        return (tot / (idx + 2)).clamp_min(0) / (1 + uc) * (1 - 4 * U)
    lam = torch.where(pooled, (T / L_star[:, None]).clamp(2.0**-1000, 1.0), torch.ones_like(T))
    S_lo = (1 - lam).sum(1) * (1 - gamma(m + 2))
    A = a_lo * torch.log1p(S_lo) * (1 - eps)
    B = -torch.special.xlogy(T_hi, lam).sum(1) * (1 + eps)
    return (A - B).clamp_min(0) / (1 + uc) * (1 - 4 * U)


def _exact_cut(crit: LevelSet, summ: Summary, i: int, cut: torch.Tensor) -> torch.Tensor:
    """Row i's candidates for the most probable rejected token lie within rounding of the
    threshold: walk its distinct values below ``cut`` (descending) and settle each in
    arbitrary precision until one is surely or exactly rejected.  Returns the exact cut
    (just above that value; -inf if the rule rejects nothing)."""
    row = summ.source[i]
    tau_hat = float(crit.threshold_from_summary(summ)[i])
    # compare in the cut's dtype: a 0-d float32 cut against 16-bit values would otherwise be
    # rounded to the values' dtype (torch promotion ignores 0-d operands' dtypes)
    uniq = torch.unique(row[row.to(cut.dtype) < cut]).flip(0)  # distinct candidates, descending
    dt = summ.cut_dtype()
    ri = torch.tensor([i], device=row.device)
    for n, v in enumerate(uniq):
        acc, rej = crit.sure(summ, ri, v.reshape(1))
        if n >= 64:  # pathological: keep the conservative cut (sound, maybe below exact)
            return cut
        if bool(rej) or (not bool(acc) and not _exact_ok(crit, summ, row, v, tau_hat)):
            c = v.to(dt)
            return torch.nextafter(c, torch.full_like(c, torch.inf))  # x < c  <=>  x <= v
    return torch.full((), -torch.inf, dtype=dt, device=row.device)


def _exact_ok(crit, summ, row, v, tau_hat) -> bool:
    x = int((row == v).nonzero()[0, 0])
    return exact_accept(crit, row, summ.is_logits, x, tau_hat)


def _level_set_radius(crit: LevelSet, summ: Summary, kind: str) -> torch.Tensor:
    top, vals = summ.top_probs, summ.top_vals
    n = top.shape[0]
    cut = crit.rejection_cut(summ)
    r, found = _first_cut(vals, cut)
    uc = summ.common_err()
    es = summ.top_entry_err()
    zero = summ.top_zero_mask()
    extra = _tail_bound(summ) if kind == "reverse" else None
    out = torch.full((n,), torch.inf, dtype=torch.float64, device=top.device)
    redo = []  # rows settled in arbitrary precision, then from a full sort
    if not crit.exact_order:
        f = found.nonzero().squeeze(1)
        if f.numel():
            _, rej = crit.sure(summ, f, vals[f].gather(1, r[f, None])[:, 0])
            redo += f[~rej].tolist()
    f = found.nonzero().squeeze(1)
    if f.numel():
        out[f] = single_bound(top[f], es[f], zero[f], r[f], kind, uc[f], None if extra is None else extra[f])[0]
    if not summ.complete:
        deep = (~found).nonzero().squeeze(1)
        if deep.numel():
            # is any token beyond the top-k below the cut?  (the row minimum decides)
            has = deep[summ.row_min_src(deep) < cut[deep]]
            if has.numel():
                b_src = summ.max_src_below(has, cut[has])
                bv = b_src[:, None].to(vals.dtype)
                if not crit.exact_order:
                    _, rej = crit.sure(summ, has, bv[:, 0])
                    redo += has[~rej].tolist()
                s = torch.cat([top[has], summ.to_prob(bv, has)], 1)
                e2 = torch.cat([es[has], summ.entry_err(bv, has)], 1)
                z2 = torch.cat([zero[has], summ.zero_mask(bv)], 1)
                rr = torch.full((has.numel(),), s.shape[1] - 1, dtype=torch.long, device=top.device)
                cost, level = single_bound(s, e2, z2, rr, kind, uc[has], None if extra is None else extra[has])
                # Exact unless a token beyond the top-k lies above the level (it would join the pool).
                flat = top[has, -1] >= level * (1 - 1e-9)
                out[has] = cost
                redo += has[flat].tolist()
    if redo:
        rows = torch.tensor(sorted(set(redo)), dtype=torch.long, device=top.device)
        # the exact cuts are in the cut dtype (float32 for 16-bit values): a cut held in the
        # values' own dtype (additive:0, multiplicative:1 return x_1) would round them back
        cut = cut.to(summ.cut_dtype())
        if not crit.exact_order:
            for i in rows.tolist():
                cut[i] = _exact_cut(crit, summ, i, cut[i])
        full, fvals = summ.sorted_rows(rows)
        r2, found2 = _first_cut(fvals, cut[rows])
        cost = single_bound(full, summ.entry_err(fvals, rows), summ.zero_mask(fvals), r2, kind, uc[rows], None)[0]
        out[rows] = torch.where(found2, cost, torch.full_like(cost, torch.inf))
    return out


def radius_rows(crit: Criterion, summ: Summary, kind: str) -> torch.Tensor:
    """Radius for every row of a summary: (N,) float64 (+inf where no drafter can be rejected).

    Never above the exact radius of the given values, and equal to it up to the error
    model of docs/theory.md, section 7."""
    top = summ.top_probs
    if isinstance(crit, TreeCoverage):
        if crit.m >= summ.vocab_size:
            return torch.full((top.shape[0],), torch.inf, dtype=torch.float64, device=top.device)
        if summ.k < crit.m + 1:
            raise ValueError(f"summary holds top-{summ.k}; tree:{crit.m} needs k >= {crit.m + 1}")
        extra = _tail_bound(summ) if kind == "reverse" else None
        return tree_bound(top, summ.top_entry_err(), summ.top_zero_mask(), crit.m, kind,
                          summ.common_err(), extra)
    if not isinstance(crit, LevelSet):
        raise ValueError(f"criterion: unsupported type {type(crit).__name__}")
    if summ.k < min(crit.min_k, summ.vocab_size):
        raise ValueError(f"summary holds top-{summ.k}; {crit.spec} needs k >= {crit.min_k}")
    return _level_set_radius(crit, summ, kind)


def radius(
    criterion: str | Criterion,
    probs: ArrayLike | None = None,
    divergence: str = "forward",
    *,
    logits: ArrayLike | None = None,
    k: int = DEFAULT_TOPK,
) -> ArrayLike:
    """Radius of ``criterion`` at target distributions ``probs`` (..., V) -> (...).

    ``divergence`` is ``forward`` (KL(p||q)), ``reverse`` (KL(q||p)) or ``tv``.
    Any drafter q with D(p, q) < radius(p) is accepted.  The value never exceeds the exact
    radius of the given values (float32 results are rounded down) and equals it up to the
    error model of docs/theory.md, section 7.  ``k`` only tunes the partial sort; the
    result does not depend on it.
    """
    crit = parse_criterion(criterion)
    check_divergence(divergence)
    summ = summarize(probs, logits=logits, k=max(k, crit.min_k), entropy=crit.needs_entropy)
    return summ.out.wrap(radius_rows(crit, summ, divergence), direction="down")


def radii(
    criteria: str | Criterion | Iterable[str | Criterion],
    probs: ArrayLike | None = None,
    divergence: str | Iterable[str] = "forward",
    *,
    logits: ArrayLike | None = None,
    k: int = DEFAULT_TOPK,
) -> dict[str, ArrayLike]:
    """Radii of several criteria (and divergences) from one pass over the input.

    Returns ``{spec: array}`` for a single divergence, or
    ``{(spec, divergence): array}`` when several divergences are asked for.  A single
    spec string (or Criterion) counts as one criterion: ``radii("strict", p)`` is
    ``{"strict": radius("strict", p)}``.
    """
    if isinstance(criteria, (str, Criterion)):
        criteria = [criteria]
    try:
        crits = [parse_criterion(c) for c in criteria]
    except TypeError:
        raise ValueError(f"criteria: expected a spec string or a list of them, got {type(criteria).__name__}") from None
    if not crits:
        raise ValueError("criteria: pass at least one criterion")
    kinds = [divergence] if isinstance(divergence, str) else list(divergence)
    if not kinds:
        raise ValueError("divergence: pass at least one of forward, reverse, tv")
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
            res[key] = summ.out.wrap(radius_rows(c, summ, d), direction="down")
    return res


def _pair(target_probs, draft_probs, target_logits, draft_logits):
    """Validated (target values, target is logits, target name, draft values, ..., the
    common batch shape): the two inputs broadcast against each other like ``divergence``."""
    if (target_probs is None) == (target_logits is None):
        raise ValueError("pass exactly one of target_probs or target_logits=")
    if (draft_probs is None) == (draft_logits is None):
        raise ValueError("pass exactly one of draft_probs or draft_logits=")
    tn = "target_probs" if target_logits is None else "target_logits"
    dn = "draft_probs" if draft_logits is None else "draft_logits"
    t, t_np = to_tensor(target_probs if target_logits is None else target_logits, tn)
    d, _ = to_tensor(draft_probs if draft_logits is None else draft_logits, dn)
    if t.shape[-1] != d.shape[-1]:
        raise ValueError(f"{dn}: vocabulary size {d.shape[-1]} differs from the target's {t.shape[-1]}")
    d = d.to(t.device)
    try:
        bt, bd = torch.broadcast_tensors(t, d)
    except RuntimeError:
        raise ValueError(f"{dn}: shape {tuple(d.shape)} does not broadcast with target shape {tuple(t.shape)}") from None
    if t_np:
        bt = bt.numpy()
    return bt, target_logits is not None, tn, bd, draft_logits is not None, dn


def _draft_source(d: torch.Tensor, is_logits: bool, name: str, V: int) -> torch.Tensor:
    """The drafter's given values as (N, V), validated (its proposal is their argmax)."""
    q = d.reshape(-1, V)
    if is_logits:
        m = q.amax(-1)
        if not bool(torch.isfinite(m).all()):
            raise ValueError(f"{name}: logits contain NaN or +inf, or a row is entirely -inf")
    else:
        check_probs(q, name)
    return q


def accepts_rows(crit: Criterion, summ: Summary, q: torch.Tensor) -> torch.Tensor:
    """(N,) bool: is the drafter's proposal accepted, by the rule evaluated exactly on the
    given values?  The drafter proposes the argmax of its given values q (logits or
    probabilities; lowest index among ties), or its top-m for trees (ties to the lower index)."""
    if isinstance(crit, TreeCoverage):
        a = torch.argmax(summ.source, dim=-1)  # lowest-index maximiser of the given target values
        qa = q.gather(1, a[:, None])
        ids = torch.arange(q.shape[1], device=q.device)[None, :]
        ahead = (q > qa) | ((q == qa) & (ids < a[:, None]))
        return ahead.sum(1) < crit.m
    x = torch.argmax(q, dim=-1)  # first maximal value: the lowest index
    return crit.accept_ids(summ, x)


def accepts(
    criterion: str | Criterion,
    target_probs: ArrayLike | None = None,
    draft_probs: ArrayLike | None = None,
    *,
    target_logits: ArrayLike | None = None,
    draft_logits: ArrayLike | None = None,
) -> ArrayLike:
    """Would ``criterion`` accept the drafter's greedy proposal (top-m for trees)? (..., V) -> (...) bool.

    The proposal is the argmax of the drafter's given values (lowest index among ties);
    the decision is that of the rule evaluated exactly on the target's given values
    (renormalised probabilities or softmax of the logits).  Target and drafter broadcast."""
    crit = parse_criterion(criterion)
    t, t_log, tn, d, d_log, dn = _pair(target_probs, draft_probs, target_logits, draft_logits)
    summ = summarize(None if t_log else t, logits=t if t_log else None, k=crit.min_k,
                     entropy=crit.needs_entropy, name=tn)
    q = _draft_source(d, d_log, dn, summ.vocab_size)
    return summ.out.wrap(accepts_rows(crit, summ, q))


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
            acc[i] = accepts_rows(c, summ.select(i), q_logits[i])
        out[c.spec] = acc
    return out


class Certificate(NamedTuple):
    """What :func:`certify_rows` decided, per row."""

    divergence: torch.Tensor  # [rows] float64: a proven upper bound on the exact D(p, q) (inf where none was needed)
    certified: torch.Tensor  # [rows] (or [rows, C]) bool: D(p, q) < radius(p), proven


def certify_rows(summ: Summary, draft: torch.Tensor, radius: torch.Tensor, divergence: str = "forward", *,
                 draft_is_logits: bool = True, interval: tuple[torch.Tensor, torch.Tensor] | None = None) -> Certificate:
    """The one place where draftcert decides a certificate: ``D(p, q) < radius``, proven.

    summ   : the target's summary of the rows to certify (``summ.source`` [rows, V] are the
             given target values: logits or probabilities).
    draft  : [rows, V] the drafter's given values (logits, or probabilities with
             ``draft_is_logits=False``).
    radius : [rows] float64 lower bounds on the exact radius (``radius_rows``, or the
             larger of several, as the engine takes for a tree row), or [rows, C] for C
             rules at once (one divergence bound per row serves them all).  NaN never
             certifies.
    interval : the stage-1 enclosure when the caller already has it for exactly these rows
             (``divergences_from_logits``, which computes it bit for bit as
             :func:`forward_kl_interval` does, alongside the profiler's other divergences).

    Certified iff an upper bound on the exact divergence is below the radius, in two
    stages that both give proven bounds (docs/theory.md, section 7):

    1. forward KL between logits: the interval [lo, hi] of :func:`forward_kl_interval`
       (a dozen float64 passes per row, error ~V U).  hi < radius certifies; lo >= radius
       refutes (every upper bound is then >= radius too).
    2. every row stage 1 leaves open (a radius inside [lo, hi], another divergence,
       probability input, a masked token): :func:`divergence_upper`, the nonnegative
       Bregman-sum bound, on float64 log-probabilities of the given values.

    The decision depends on nothing but the given values and the radius (no summary
    field, no top-k size, no batch composition), so the library's ``certified``, the
    profiler's trace and the engine's live certificates, which all call this, agree bit
    for bit on the same rows.
    """
    n = draft.shape[0]
    dev = draft.device
    if divergence == "forward" and summ.is_logits and draft_is_logits:
        lo, hi = interval if interval is not None else forward_kl_interval(summ.source, draft)  # [rows] each
    else:
        lo = torch.zeros(n, dtype=torch.float64, device=dev)
        hi = torch.full((n,), torch.inf, dtype=torch.float64, device=dev)
    r = radius if radius.ndim == 2 else radius[:, None]  # [rows, C]
    certified = hi[:, None] < r
    open_rows = (~certified & (lo[:, None] < r)).any(1).nonzero().squeeze(1)
    d_up = hi
    if open_rows.numel():
        lp, ep, _, _ = log_probs(summ.source[open_rows], summ.is_logits, "target")
        lq, eq, _, _ = log_probs(draft[open_rows], draft_is_logits, "draft")
        exact = divergence_upper(lp, lq, ep, eq, divergence)  # [open rows]
        d_up = hi.clone()
        d_up[open_rows] = torch.minimum(hi[open_rows], exact)
        certified[open_rows] = exact[:, None] < r[open_rows]
    return Certificate(d_up, certified if radius.ndim == 2 else certified[:, 0])


def certified(
    criterion: str | Criterion,
    target_probs: ArrayLike | None = None,
    draft_probs: ArrayLike | None = None,
    divergence: str = "forward",
    *,
    target_logits: ArrayLike | None = None,
    draft_logits: ArrayLike | None = None,
) -> ArrayLike:
    """Certificate D(p, q) < radius(p), which implies acceptance. (..., V) -> (...) bool.

    Floating-point contract (docs/theory.md, section 7): the comparison is between an upper
    bound on the exact divergence and a lower bound on the exact radius of the given values,
    so True implies that the rule evaluated exactly on the given values accepts the
    drafter's proposal; within the error margin the answer is False.  Target and drafter
    broadcast like ``divergence``."""
    crit = parse_criterion(criterion)
    check_divergence(divergence)
    t, t_log, tn, d, d_log, dn = _pair(target_probs, draft_probs, target_logits, draft_logits)
    summ = summarize(None if t_log else t, logits=t if t_log else None, k=max(DEFAULT_TOPK, crit.min_k),
                     entropy=crit.needs_entropy, name=tn)
    q = _draft_source(d, d_log, dn, summ.vocab_size)
    cert = certify_rows(summ, q, radius_rows(crit, summ, divergence), divergence, draft_is_logits=d_log)
    return summ.out.wrap(cert.certified)


def certified_run_length(radii: ArrayLike, epsilon: float, block: int | None = None) -> ArrayLike:
    """Guaranteed accepted run from each position of a trajectory of radii.

    radii : (..., T) per-step radii along the last axis.  A step is certified for
    every drafter with per-step divergence < epsilon iff epsilon <= radius.
    Returns (..., T) integers: L[t] = number of consecutive certified steps
    t, t+1, ..., capped at ``block`` when given.
    """
    if isinstance(radii, torch.Tensor):
        r, is_np = radii.detach(), False
        if r.dtype.is_complex or r.dtype == torch.bool:
            raise ValueError(f"radii: expected real numbers, got dtype {r.dtype}")
    else:
        try:
            a = np.asarray(radii)
        except ValueError as exc:
            raise ValueError(f"radii: not a rectangular array of numbers ({exc})") from None
        if a.dtype == np.bool_ or not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
            raise ValueError(f"radii: expected real numbers, got dtype {a.dtype}")
        r, is_np = torch.as_tensor(a.astype(np.float64)), True
    if r.ndim < 1:
        raise ValueError("radii: expected shape (..., T) with a time axis")
    if bool(torch.isnan(r).any()) or bool((r < 0).any()):
        raise ValueError("radii: must be non-negative and not NaN (+inf is allowed)")
    if isinstance(epsilon, (bool, str, bytes)) or not isinstance(epsilon, (int, float, np.integer, np.floating)):
        raise ValueError(f"epsilon: expected a finite number >= 0, got {epsilon!r}")
    eps = float(epsilon)
    if not eps >= 0 or eps == float("inf"):
        raise ValueError(f"epsilon: expected a finite value >= 0, got {epsilon!r}")
    if block is not None:
        if isinstance(block, bool) or not isinstance(block, (int, float, np.integer, np.floating)) \
                or not math.isfinite(block) or int(block) != block or block < 1:
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
