"""Margin bounds: lower bounds on the radius that see p only through one number.

Single-token rules use the *two-token relaxation* of the radius problem: keep only the
constraint q(y) >= q(1st) for the cheapest rejected token y, which gives

    H_D(G, s):  p(1st) = (s + G)/2,  p(y) = (s - G)/2
      forward  s * g(G/s),   g(x) = (1+x)/2 log(1+x) + (1-x)/2 log(1-x)
      reverse  -log(1 - (sqrt(p(1st)) - sqrt(p(y)))^2)
      tv       G / 2

decreasing in the pooled mass s = p(1st) + p(y) and increasing in the gap
G = p(1st) - p(y).  The margin statistic fixes G, and each rule's rejection condition
caps s at ``s_max(G)``; ``H_D(G, s_max(G))`` is then a bound depending on p only through
the statistic.  Trees use the exact infimum instead (``_tree_bound``).  "sharp" = the
infimum of the radius over all distributions (any V) with that statistic:

==================  ===================================  ===========================================
Every bound is rounded down by 2^-32 relative and 2^-51 per summed term absolute, so it
never exceeds the radius as the library computes it, even at the extremal distribution.
Where no token can be rejected the statistic is undefined and the bound is +inf, like the
radius.  Proofs, extremal families and measured gaps: docs/theory.md, section 5.
"""

from __future__ import annotations

import math

import torch

from ._arrays import ArrayLike
from .criteria import (Additive, Criterion, EntropyThreshold, LevelSet, MarginAware, Multiplicative, RelaxedAcceptance,
                       Strict, TopM, TreeCoverage, TypicalAcceptance, parse_criterion)
from .certificates import radius_rows
from .divergences import check_divergence
from ._entropy_margin import forward_infimum, reverse_infimum
from .summary import DEFAULT_TOPK, TYPICAL_EPS, Summary, summarize

__all__ = ["margin_bound", "margin_statistic", "margin_bound_from_statistic"]


def _first_rejected(crit: LevelSet, s: torch.Tensor, tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted position of the most probable rejected token and whether one exists in s
    (s float64 probabilities compared with tau: the margin statistic's view)."""
    rej = crit.rejected_mask(s, tau[:, None])  # monotone along a descending row
    n_rej = rej.sum(1)
    r = (s.shape[1] - n_rej).clamp(max=s.shape[1] - 1)
    return r, n_rej > 0


def _lo_mass(crit: Criterion, G: torch.Tensor, co: torch.Tensor) -> torch.Tensor:
    """s_max(G) - G, the cap on the pair mass of the module table minus the gap,
    written through co = 1 - G so that nothing cancels as G -> 1."""
    if isinstance(crit, (Strict, Additive)) or type(crit) is LevelSet:
        return co
    if isinstance(crit, Multiplicative):
        return co if crit.alpha >= 1 else torch.minimum(co, G * 2 * crit.alpha / (1 - crit.alpha))
    if isinstance(crit, TopM):
        return 2 * co / (crit.m + 1)
    if isinstance(crit, RelaxedAcceptance):
        # G > DELTA: b fails p >= p(1st) - DELTA whatever the rest is (the pair at s = 1);
        # G <= DELTA: b passes it, so it is rejected for lying outside the top N: the top-M cap
        return torch.where(G > crit.delta, co, 2 * co / (crit.n + 1))
    if isinstance(crit, TypicalAcceptance):
        # b <= tau <= EPSILON, and H~ >= -log(p(1st) + 1e-5) (every p <= p(1st)) gives
        # b <= DELTA (p(1st) + 1e-5) = DELTA (G + b + 1e-5), i.e. b <= DELTA (G + 1e-5) / (1 - DELTA)
        d = torch.minimum(co, torch.full_like(G, 2 * crit.epsilon))
        if crit.delta < 1:
            d = torch.minimum(d, (G + TYPICAL_EPS) * 2 * crit.delta / (1 - crit.delta))
        return d
    if isinstance(crit, EntropyThreshold):
        d = torch.minimum(co, torch.full_like(G, 2 * crit.epsilon))
        if crit.delta < 1:
            d = torch.minimum(d, G * 2 * crit.delta / (1 - crit.delta))
        return d
    if isinstance(crit, MarginAware):
        a = math.exp(-crit.theta)
        d_a = co if a >= 1 else G * 2 * a / (1 - a)
        d_b = torch.minimum((2 - (2 + 2 * a) * G) / (2 + a), 2 * co / 3)
        return torch.minimum(co, torch.maximum(d_a, d_b))
    return co


#: Relative and absolute amounts the closed-form bounds are rounded down by, so that they
#: never exceed the radius as the library computes it at the extremal distribution itself
#: (both are float64 sums of O(1) terms with round-off of a few ulps of each term).
_REL_SHAVE = 2.0**-32
_ABS_SHAVE = 2.0**-51  # per summed term


def _shave(v: torch.Tensor, n_terms: int) -> torch.Tensor:
    return (v * (1 - _REL_SHAVE) - n_terms * _ABS_SHAVE).clamp_min(0)


def _phi1p(u: torch.Tensor) -> torch.Tensor:
    """(1+u) log(1+u) - u >= 0, accurate for small |u| (the Bregman term of KL at ratio 1+u)."""
    return torch.where(u.abs() > 0.5, torch.special.xlogy(1 + u, 1 + u), (1 + u) * torch.log1p(u)) - u


def _tree_bound(m: int, G: torch.Tensor, co: torch.Tensor, kind: str) -> torch.Tensor:
    """Exact infimum of the tree:m radius over all p with p(1st) - p((m+1)-th) = G
    (docs/theory.md, section 5): attained at V = m + 1 by p = (a, t, ..., t, b),
    a - b = G, a + (m-1) t + b = 1, with t the geometric (forward), harmonic (reverse)
    mean of a and b, or t = min(1/(m+1), (1-G)/(m-1)) (tv).  co = 1 - G (no cancellation)."""
    n = m + 1
    if kind == "tv":
        v = torch.maximum(G / 2, G - 1.0 / n) if m > 1 else G / 2
        return _shave(v, 1)
    one_m_g2 = co * (1 + G)  # 1 - G^2
    if kind == "forward":
        # t = sqrt(ab) solves (4 - (m-1)^2) t^2 + 2 (m-1) t - (1 - G^2) = 0 (stable root)
        if m == 1:  # no intermediates: the strict pair ((1+G)/2, (1-G)/2), t = sqrt(ab)
            t = torch.sqrt(one_m_g2) / 2
        else:
            t = one_m_g2 / ((m - 1) + torch.sqrt(4 * one_m_g2 + (m - 1) ** 2 * G * G))
        S = torch.sqrt(G * G + 4 * t * t)  # a + b
        b = 2 * t * t / (S + G)  # (S - G)/2 without cancellation
        a = b + G
        # sum over the pool (level 1/n) of L phi(p/L), u = n p - 1
        v = (_phi1p(n * a - 1) + (m - 1) * _phi1p(n * t - 1) + _phi1p(n * b - 1)) / n
        return _shave(v, n)
    # reverse: S = a + b solves n S^2 - 2 S - (m-1) G^2 = 0; t = 2ab / S
    D = torch.sqrt(1 + (m * m - 1) * G * G)
    S = (1 + D) / n
    s2g2 = 2 * one_m_g2 * (D + 1) / (n * (D + m))  # S^2 - G^2 = 4ab
    t = s2g2 / (2 * S)
    b = s2g2 / (2 * (S + G))
    a = b + G
    e = (m * m - 1) * G * G / (D + 1)  # n S - 2 = D - 1
    ua, ub, ut = (e + n * G) / 2, (e - n * G) / 2, -G * G / S  # n p - 1 for a, b, t
    small = G < 0.5
    near = torch.log1p(ua) + torch.log1p(torch.where(small, ub, torch.zeros_like(ub)))
    far = torch.log(n * a) + torch.log(n * b)
    if m > 1:
        near, far = near + (m - 1) * torch.log1p(ut), far + (m - 1) * torch.log(n * t)
    v = -torch.where(small, near, far) / n
    return _shave(v.clamp_min(0), n)


def _bound_rows(crit: Criterion, G: torch.Tensor, co: torch.Tensor, kind: str) -> torch.Tensor:
    """H_D(G, s_max) with s_max - G and 1 - s_max computed from co = 1 - G without cancellation.

    For reverse KL, 1 - (sqrt(hi) - sqrt(lo))^2 = (1 - s) + 2 sqrt(hi lo): when p(y) is below
    ~1e-16 the left side cancels to 0 (bound +inf, above the true radius), the right does not.
    """
    if isinstance(crit, TreeCoverage):
        return _tree_bound(crit.m, G, co, kind)
    out = _shave(_pair_bound(crit, G, co, kind), 2)
    if kind != "tv" and isinstance(crit, EntropyThreshold):
        # forward: the exact infimum; reverse: a relaxation of it (docs/theory.md section 5);
        # both certified from below by branch and bound.  The two-token bound stays as a
        # floor (all are valid lower bounds).
        c = TYPICAL_EPS if isinstance(crit, TypicalAcceptance) else 0.0
        fn = forward_infimum if kind == "forward" else reverse_infimum
        exact = fn(G.detach().cpu().numpy(), crit.epsilon, crit.delta, c, floor=out.detach().cpu().numpy())
        out = torch.maximum(out, torch.from_numpy(exact).to(out))
    return out


def _pair_bound(crit: Criterion, G: torch.Tensor, co: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "tv":
        return G / 2
    d = _lo_mass(crit, G, co).clamp_min(0)  # s - G
    s, hi, lo = G + d, G + d / 2, d / 2
    if kind == "forward":
        return torch.special.xlogy(hi, 2 * hi / s) + torch.special.xlogy(lo, 2 * lo / s)
    z = (co - d).clamp_min(0) + 2 * torch.sqrt(hi * lo)
    small = z < 0.5
    e = torch.sqrt(hi) - torch.sqrt(lo)
    near = -torch.log1p(torch.where(small, torch.zeros_like(e), -(e * e)))  # precise near z = 1
    return torch.where(small, -torch.log(torch.where(small, z, torch.ones_like(z))), near)


def margin_bound_from_statistic(criterion: str | Criterion, statistic: ArrayLike, divergence: str = "forward") -> ArrayLike:
    """The bound as a function of the margin statistic alone (array in, array out).

    ``statistic`` is taken as exact.  A float64 statistic computed as p(1st) - b near 1 has
    lost 1 - G (for p = (1, 1e-18) it is exactly 1.0, and the reverse bound +inf, above the
    radius 20.03; in general the float value is off by ~1e-16 absolute, a relative error of
    1e-16 / (1 - G) in 1 - G): there, use ``margin_bound(criterion, probs)``, which forms
    1 - G from non-negative parts and is capped by the radius (docs/theory.md section 5)."""
    crit = parse_criterion(criterion)
    check_divergence(divergence)
    is_t = isinstance(statistic, torch.Tensor)
    G = statistic.double() if is_t else torch.as_tensor(statistic, dtype=torch.float64)
    if bool(((G < 0) | ((G > 1) & ~torch.isinf(G)) | torch.isnan(G)).any()):
        raise ValueError("statistic: margins lie in [0, 1] (+inf meaning no rejectable token)")
    inf = torch.isinf(G)
    Gf = torch.where(inf, torch.zeros_like(G), G)
    out = _bound_rows(crit, Gf, 1 - Gf, divergence)
    out = torch.where(inf, torch.full_like(out, torch.inf), out)
    return out if is_t else out.numpy()


def statistic_rows(crit: Criterion, summ: Summary) -> torch.Tensor:
    return _statistic_parts(crit, summ)[0]


def _statistic_parts(crit: Criterion, summ: Summary) -> tuple[torch.Tensor, torch.Tensor]:
    """(G, b): the statistic G = p(1st) - b and the competing probability b itself
    (needed to form 1 - G = (1 - p(1st)) + b without cancellation)."""
    top = summ.top_probs
    if isinstance(crit, TreeCoverage):
        if crit.m >= summ.vocab_size:
            return torch.full_like(top[:, 0], torch.inf), torch.zeros_like(top[:, 0])
        return top[:, 0] - top[:, crit.m], top[:, crit.m]
    if isinstance(crit, Strict):
        return top[:, 0] - top[:, 1], top[:, 1]
    tau = crit.threshold_from_summary(summ)
    r, found = _first_rejected(crit, top, tau)
    b = top.gather(1, r[:, None]).squeeze(1)
    gap = top[:, 0] - b
    gap = torch.where(found, gap, torch.full_like(gap, torch.inf))
    if not summ.complete:
        deep = (~found).nonzero().squeeze(1)
        if deep.numel():
            # Rejected tokens beyond the top-k: b is read, in one pass over those rows, as the
            # largest given value below the rule's conservative rejection cut -- the radius's
            # own lookup (certificates._level_set_radius).  That region can only hold more
            # tokens than the exact one, so b can only be larger and G smaller: the bound
            # (increasing in G) stays below the infimum.  The rest of p is far from 0 there,
            # so nothing cancels.
            cut = crit.rejection_cut(summ)[deep]
            has = summ.row_min_src(deep) < cut
            rows = deep[has]
            if rows.numel():
                b_src = summ.max_src_below(rows, cut[has])[:, None].to(summ.top_vals.dtype)
                b[rows] = summ.to_prob(b_src, rows)[:, 0]
                gap[rows] = top[rows, 0] - b[rows]
    return gap, b


def margin_statistic(criterion: str | Criterion, probs: ArrayLike | None = None, *, logits: ArrayLike | None = None) -> ArrayLike:
    """The margin statistic each criterion's bound depends on (table above), (..., V) -> (...)."""
    crit = parse_criterion(criterion)
    summ = summarize(probs, logits=logits, k=max(DEFAULT_TOPK, crit.min_k), entropy=crit.needs_entropy)
    return summ.out.wrap(statistic_rows(crit, summ))


def margin_bound(
    criterion: str | Criterion,
    probs: ArrayLike | None = None,
    divergence: str = "forward",
    *,
    logits: ArrayLike | None = None,
) -> ArrayLike:
    """Lower bound on ``radius(criterion, probs, divergence)`` through one margin statistic.

    Never exceeds the radius.  Sharp (the infimum of the radius over all distributions with
    the same statistic, up to rounding down) for strict, additive, multiplicative, topm,
    relaxed, mars and tree:M in all three divergences; for ``strict``: forward g(Δ), reverse
    -½ log(1 - Δ²), tv Δ/2 with Δ = p(1st) - p(2nd).  For entropy and typical: sharp in tv
    (G/2; for typical at every G when EPSILON <= 1/3) and in forward KL (the exact infimum
    over the tied-pool family, certified from below by branch and bound to within 3e-4;
    typical within 1e-3); in reverse KL a certified relaxation of the infimum, not proven
    exact, but within 3e-4 of the radius of a distribution with the same statistic at every G
    measured, for each of the sixteen entropy and typical rules measured (docs/theory.md, section 5).
    """
    crit = parse_criterion(criterion)
    check_divergence(divergence)
    summ = summarize(probs, logits=logits, k=max(DEFAULT_TOPK, crit.min_k), entropy=crit.needs_entropy)
    G, b = _statistic_parts(crit, summ)
    # 1 - G = (mass outside the top token) + b, summed from nonnegative parts: as G -> 1 the
    # float64 statistic cannot resolve b (< ~1e-16) and 1 - G would make the reverse bound
    # +inf while the radius is finite.
    top = summ.top_probs
    rest = top[:, 1:].sum(1) + (torch.zeros_like(G) if summ.complete else (1 - top.sum(1)).clamp_min(0))
    inf = torch.isinf(G)
    Gf = torch.where(inf, torch.zeros_like(G), G)
    out = _bound_rows(crit, Gf, torch.where(inf, torch.ones_like(G), rest + b), divergence)
    out = torch.where(inf, torch.full_like(out, torch.inf), out)
    # Floating-point contract: the bound, evaluated in float64 on float64 statistics, is
    # capped by the radius (itself a proven lower bound on the exact radius), so it can
    # never claim more than the certificate; where no token can be rejected both are +inf.
    rad = radius_rows(crit, summ, divergence)
    out = torch.where(torch.isinf(rad), rad, torch.minimum(out, rad))
    return summ.out.wrap(out, direction="down")
