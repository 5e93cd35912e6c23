"""Margin bounds of the entropy rules (``entropy:ε:δ``, ``typical:ε:δ``) in KL: the exact
forward-KL infimum (``forward_infimum``) and a certified reverse-KL relaxation
(``reverse_infimum``, at the end of the module).

docs/theory.md, section 5 ("Entropy rules in forward KL: the exact infimum") proves that
for every p with rejection gap G, top s0 = G + b and competitor b, the forward radius is at
least

    max(F1(b, L), F2(b, L))      at the level L of its own water-filling pool, where

    F1 = L [φ(s0/L) + φ(b/L) + K φ(1 + e/K)],   K = floor(1/L) - 2,  e = (2L - s0 - b)/L
    F2 = log(b / (δ (L + c))) + r log((L + c) / (r + c)),   r = 1 - floor(1/L) L

φ(u) = u log u - u + 1, c = 0 (``entropy``) or 1e-5 (``typical``), L in [(s0 + b)/2, s0].
F1 is the radius of the pool with its intermediates tied (K of them, as many as the mass
allows); F2 is the entropy constraint b <= δ exp(-H) with the off-pool mass filled at the
level and one remainder r.  So the infimum over all p with statistic G is

    I(G) = inf over b in (0, min(ε, (1 - G)/2)], L   of   max(F1, F2),

and the family (s0, b, t x K, r) with t = L (1 + e/K) attains it (c = 0, while t <= s0).

Monotonicity (section 5): F1 is non-decreasing in L and non-increasing in b; F2 is
non-increasing in L and non-decreasing in b.  So over a box b in [b0, b1]

    f(L) = F1(b1, max(L, ℓ(b1)))   <=  F1,   non-decreasing in L   (ℓ(b) = (s0 + b)/2)
    g(L) = F2(b0, L)               <=  F2,   non-increasing in L

and bisection on L brackets their crossing [La, Lb]; max(f(La), g(Lb)) is a lower bound of
max(F1, F2) over the whole box (for L < La, g(L) >= g(La) >= f(La); for L > Lb,
f(L) >= f(Lb) >= g(Lb)).  The bound is the minimum over boxes that cover (0, b_max], so it
never exceeds I(G) whatever the boxes; boxes are split (branch and bound, vectorised over
rows) until the lower bound is within ``TOL`` of a value the family attains.  Evaluated in
float64; the result is lowered by ``_REL`` relative and ``_ABS`` absolute for round-off.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

#: Relative gap at which the branch and bound stops (lower bound vs an attained value).
TOL = 3e-4
_ROUNDS = 48
_BISECT = 18
#: float64 round-off allowance: F2 is a logarithm of a ratio near 1 (a few ulps absolute),
#: F1 a sum of non-negative Bregman terms (a few ulps relative).
_REL = 1e-10
_ABS = 1e-15
_B_START = 10  # initial boxes per row (geometric in b)
_CHUNK = 1024  # rows per branch and bound
_MAX_BOXES = 1 << 18  # never more live boxes than this (their lower bounds still count)


def _phi(v: np.ndarray) -> np.ndarray:
    """φ(1 + v) = (1 + v) log(1 + v) - v >= 0, without cancellation near v = 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        near = (1 + v) * np.log1p(v) - v
        u = np.maximum(1 + v, 0.0)
        far = np.where(u > 0, u * np.log(np.where(u > 0, u, 1.0)), 0.0) - v
    return np.where(np.abs(v) < 0.5, near, far)


def f1(G, b, L):
    """F1: forward radius of the pool (s0, b, K x t) at level L, K = floor(1/L) - 2 (+inf if
    the pool cannot hold the excess)."""
    s0 = G + b
    n = np.floor(1 / L)  # floor(fl(1/L)) >= floor(1/L): K never too small, F1 never too large
    K = n - 2
    exc = (2 * L - s0 - b) / L  # e >= 0 on the domain
    exc = np.maximum(exc, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        tail = np.where((exc > 0) & (K >= 1), K * _phi(exc / np.maximum(K, 1.0)), 0.0)
        v = L * (_phi((s0 - L) / L) + _phi((b - L) / L) + tail)
    # No intermediates fit (K < 1): only the pair's own level is feasible.  Up to a relative
    # 1e-12 of rounding in 2L - s0 - b, L still counts as that level (the pair's cost, a
    # lower value): F1 must never come out above the radius through round-off.
    return np.where((exc > 1e-12) & (K < 1), np.inf, v)


def q_level(L, c):
    """Q(L) = -log(L + c) + r log((L + c)/(r + c)), r = 1 - floor(1/L) L: the level part of
    F2, continuous and non-increasing in L."""
    n = np.floor(1 / L)
    r = np.clip(1 - n * L, 0.0, None)
    r = np.minimum(r, L)
    with np.errstate(divide="ignore", invalid="ignore"):
        if c:
            rem = r * (np.log1p(c / L) + np.log(L) - np.log(r + c))
        else:
            rem = np.where(r > 0, r * (np.log(L) - np.log(np.where(r > 0, r, 1.0))), 0.0)
    return -np.log(L + c), np.maximum(rem, 0.0)


def f2(b, L, delta, c):
    lev, rem = q_level(L, c)
    with np.errstate(divide="ignore"):
        return np.where(b > 0, np.log(b / delta) + lev + rem, -np.inf)


def _box_lower(G, b0, b1, delta, c):
    """Lower bound of max(F1, F2) over the box b in [b0, b1], arrays (N,)."""
    lo = (G + 2 * b0) / 2
    hi = G + b1
    l1 = (G + 2 * b1) / 2

    def f(L):
        return f1(G, b1, np.maximum(L, l1))

    def g(L):
        return f2(b0, L, delta, c)

    La, Lb = lo.copy(), hi.copy()
    f_lo, g_lo = f(La), g(La)
    f_hi, g_hi = f(Lb), g(Lb)
    left = f_lo >= g_lo  # f above g everywhere: the minimum of max is f(lo)
    right = f_hi <= g_hi  # g above f everywhere: g(hi)
    for _ in range(_BISECT):
        Lm = 0.5 * (La + Lb)
        up = f(Lm) <= g(Lm)
        La = np.where(up, Lm, La)
        Lb = np.where(up, Lb, Lm)
    lb = np.maximum(f(La), g(Lb))
    lb = np.where(left, f_lo, np.where(right, g_hi, lb))
    return lb


def _point(G, b, delta, c):
    """min over L of max(F1(b, L), F2(b, L)) at one b (by bisection): a value the family
    attains (up to the bracket width)."""
    La, Lb = (G + 2 * b) / 2, G + b
    for _ in range(_BISECT):
        Lm = 0.5 * (La + Lb)
        up = f1(G, b, Lm) <= f2(b, Lm, delta, c)
        La = np.where(up, Lm, La)
        Lb = np.where(up, Lb, Lm)
    return np.minimum(np.maximum(f1(G, b, Lb), f2(b, Lb, delta, c)), np.maximum(f1(G, b, La), f2(b, La, delta, c)))


def _rows(G, eps, fn, delta, c, floor):
    """Flatten G (and the floor); rows are independent, so more than _CHUNK of them go
    through ``fn`` in chunks (that keeps the live boxes bounded).  Returns (G, shape, zeros,
    b_max, rows to solve, floor, the chunked result or None)."""
    G = np.asarray(G, dtype=np.float64)
    shape = G.shape
    G = G.ravel()
    floor = np.zeros_like(G) if floor is None else np.broadcast_to(np.asarray(floor, dtype=np.float64), shape).ravel()
    if G.size > _CHUNK:
        res = np.concatenate([fn(G[i:i + _CHUNK], eps, delta, c, floor[i:i + _CHUNK]) for i in range(0, G.size, _CHUNK)])
        return G, shape, None, None, None, floor, res.reshape(shape)
    bmax = np.minimum(eps, (1 - G) / 2)
    todo = np.flatnonzero((G > 0) & (G < 1) & (bmax > 0))
    return G, shape, np.zeros_like(G), bmax, todo, floor, None


def forward_infimum(G, eps: float, delta: float, c: float = 0.0, floor=None) -> np.ndarray:
    """Certified lower bound on I(G), the infimum of the forward radius of ``entropy:eps:delta``
    (c = 0) or ``typical:eps:delta`` (c = 1e-5) over every p with rejection gap G.

    G: float64 array, entries in (0, 1).  ``floor``: a lower bound the caller already has
    (the two-token bound); rows where it is within TOL of an attained value stop there.
    Returns an array of the same shape (at least the floor)."""
    G, shape, out, bmax, todo, floor, chunked = _rows(G, eps, forward_infimum, delta, c, floor)
    if chunked is not None:
        return chunked
    if todo.size == 0:
        return out.reshape(shape)
    # initial boxes: [0, bmax * 1e-6] and geometric up to bmax
    fr = np.concatenate([[0.0], np.geomspace(1e-6, 1.0, _B_START)])
    rows = np.repeat(todo, _B_START)
    b0 = (bmax[todo][:, None] * fr[None, :-1]).ravel()
    b1 = (bmax[todo][:, None] * fr[None, 1:]).ravel()
    best = np.full(G.shape, np.inf)  # attained values
    best[todo] = _point(G[todo], bmax[todo], delta, c)  # b at its cap: the two-token optimum
    done_lb = np.full(G.shape, np.inf)  # min lower bound over retired boxes
    for _ in range(_ROUNDS):
        lb = _box_lower(G[rows], b0, b1, delta, c)
        # a value the family attains, per row: the middle b of the row's lowest box at its
        # own crossing (only for the pruning decision, never for the bound)
        order = np.lexsort((lb, rows))
        first = order[np.r_[True, rows[order][1:] != rows[order][:-1]]]
        bm = np.where(b0[first] > 0, np.sqrt(b0[first] * b1[first]), b1[first])
        np.minimum.at(best, rows[first], _point(G[rows[first]], bm, delta, c))
        # a row whose floor (a lower bound the caller already has) is within TOL of a value
        # the family attains is done: the floor is the answer there
        settled = best[rows] * (1 - TOL) <= floor[rows]
        lb = np.where(settled, np.maximum(lb, floor[rows]), lb)
        split = (lb < best[rows] * (1 - TOL)) & ~settled
        np.minimum.at(done_lb, rows[~split], lb[~split])
        if not split.any():
            rows = rows[:0]
            break
        if split.sum() > _MAX_BOXES:  # safety valve: retire the rest with their lower bounds
            np.minimum.at(done_lb, rows[split], lb[split])
            rows = rows[:0]
            break
        rows, b0, b1 = rows[split], b0[split], b1[split]
        mid = np.where(b0 > 0, np.sqrt(b0 * b1), b1 * 1e-3)
        rows = np.concatenate([rows, rows])
        b0, b1 = np.concatenate([b0, mid]), np.concatenate([mid, b1])
    if rows.size:  # out of rounds: what is left still counts with its own lower bound
        lb = _box_lower(G[rows], b0, b1, delta, c)
        np.minimum.at(done_lb, rows, lb)
    v = done_lb[todo]
    out[todo] = np.maximum(np.maximum(v * (1 - _REL) - _ABS, 0.0), floor[todo])
    return out.reshape(shape)


def _tied_family(G, b, L):
    """(s0, b, t x K, r) at level L: the pool with K = floor(1/L) - 2 tied intermediates."""
    n = int(np.floor(1 / L))
    K = n - 2
    s0 = G + b
    r = max(1 - n * L, 0.0)
    parts = [np.array([s0, b])]
    if K > 0:
        parts.append(np.full(K, (n * L - s0 - b) / K))
    if r > 0:
        parts.append(np.array([r]))
    return np.sort(np.concatenate(parts))[::-1]


def extremal(G: float, eps: float, delta: float, c: float = 0.0, n_b: int = 20001, slack: float = 1e-9) -> np.ndarray:
    """The attaining distribution (s0, b, t x K, r) at (numerically) the best b: a float64
    vector summing to 1, for tests and the benchmark.  Independent of the certification: a
    grid over b, then bisection over L on the *rule itself* evaluated on the built vector
    (b <= delta exp(-H) with H the rule's entropy, checked with a relative margin ``slack``),
    so that b is rejected in exact arithmetic and not only on the boundary."""
    bmax = min(eps, (1 - G) / 2) * (1 - slack)
    bs = np.geomspace(bmax * 1e-6, bmax, n_b)
    vals = _point(np.full_like(bs, G), bs, delta, c)
    i = int(np.argmin(vals))  # zoom in around the best grid point
    fine = np.geomspace(bs[max(i - 1, 0)], bs[min(i + 1, bs.size - 1)], 4001)
    bs = np.concatenate([fine, bs])
    vals = np.concatenate([_point(np.full_like(fine, G), fine, delta, c), vals])
    order = np.argsort(vals, kind="stable")
    for i in order[:50]:
        b = float(bs[i])
        lo, hi = (G + 2 * b) / 2, G + b

        def ok(L):
            p = _tied_family(G, b, L)
            if np.floor(1 / L) < 3 and L > lo * (1 + 1e-15):
                return False
            neg_h = float(np.sum(p * np.log(p + c)))
            need = np.log(b / delta)
            return need + slack * max(1.0, abs(need)) <= neg_h

        if ok(lo):
            return _tied_family(G, b, lo)
        hi = min(hi, 1 / 3 * (1 - 1e-12))  # above 1/3 no intermediate fits (K < 1)
        if hi <= lo or not ok(hi):
            continue
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if ok(mid) else (mid, hi)
        return _tied_family(G, b, hi)
    raise ValueError(f"no member of the tied family found at G={G}")


# --- reverse KL ------------------------------------------------------------------------------
#
# docs/theory.md section 5 ("Entropy rules in reverse KL"): with the pool's geometric level g,
# its excess D = Σ_pool (x - g) (radius = -log(1 - D)), Λ = log(g² / (s0 b)), u_t = log(s0/g),
# every p with statistic G satisfies, at its own (b, g),
#
#     D >= R1 = s0 + b - 2g + g K (e^{Λ/K} - 1),            K = floor(1/g) - 2   (tied pool)
#     D >= R2 = s0 + b - 2g + g [Kr ψ(Λ/Kr) + β C]           Kr = 1/g - 2 (a real count)
#
# for every β in [0, 1/(u_t + 2)], ψ(u) = (e^u - 1)(1 - β u), and
# C = log(b / (δ (g + c))) / g - (s0/g - 1) u_t - (b/g - 1) log(b/g) (the entropy constraint).
# R2 is not monotone in g, so the minimum over (b, g) is certified by branch and bound over
# rectangles with an interval evaluation of every term (each elementary term is monotone in
# b and g, or bounded at the rectangle's corners); β is one value per rectangle.

_R_TOL = 2e-4
_R_TOL_COARSE = 1e-2
_R_COUNT_PASSES = 2
_R_ROUNDS = 60
_R_MAX_BOXES = 1 << 19


def _r1_lower(G, b0, b1, g0, g1, dlo=0.0):
    """Lower bound of R1 over b in [b0, b1], g in [g0, g1]: R1 is non-decreasing in g and
    non-increasing in b (section 5), and below the pair's own level it is at least the pair's
    cost at b1, so R1(b1, max(g0, sqrt(s0(b1) b1)))."""
    s0 = G + b1
    g = np.maximum(g0, np.sqrt(s0 * b1))
    # k <= (1 - D)/g - 2 <= (1 - dlo)/g - 2 for any lower bound dlo of D in the rectangle;
    # the float floor is nudged up so it is never too small
    K = np.floor((1 - np.clip(dlo, 0.0, 1.0)) / g * (1 + 1e-15)) - 2
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        lam = np.maximum(2 * np.log(g) - np.log(s0) - np.log(b1), 0.0)
        Kc = np.maximum(K, 1.0)
        v = (s0 + b1 - 2 * g) + g * Kc * np.expm1(lam / Kc)
    pair = (np.sqrt(s0) - np.sqrt(b1)) ** 2
    # no intermediate fits (K < 1): only the pair itself; lam ~ 0 up to rounding
    v = np.where(K < 1, np.where(lam <= 1e-12, pair, np.inf), v)
    return np.maximum(v, 0.0)


def _xlog_m1(y):
    """(y - 1) log y >= 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(y > 0, (y - 1) * np.log(np.where(y > 0, y, 1.0)), np.inf)


def _rem_u(u, g, c):
    """The off-pool remainder's share of C: u log(1/u) (c = 0) or u log((g + c)/(u g + c)),
    u = frac((1 - D)/g); >= 0, concave in u, increasing in g."""
    with np.errstate(divide="ignore", invalid="ignore"):
        v = u * (np.log1p(c / g) + np.log(g) - np.log(u * g + c)) if c else -u * np.log(np.where(u > 0, u, 1.0))
    return np.where(u > 0, np.maximum(v, 0.0), 0.0)


def _r2_lower(G, b0, b1, g0, g1, delta, c, dlo=0.0, dcap=np.inf):
    """Lower bound of R2 over the rectangle, by interval arithmetic.  With dcap (a value of D
    some member of the family attains, so D <= dcap may be assumed) the off-pool remainder
    counts too: u = frac((1 - D)/g) over D in [dlo, dcap], g in [g0, g1]."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s_lo, s_hi = G + b0, G + b1
        A = s_lo + b0 - 2 * g1  # s0 + b - 2g
        lam_lo = np.maximum(2 * np.log(g0) - np.log(s_hi) - np.log(b1), 0.0)
        ut_hi = np.log(s_hi / g0)
        beta = 1 / (ut_hi + 2)  # one beta valid at every point of the rectangle
        # the count: k <= floor(1/g) - 2 <= floor(1/g0) - 2 (floor(fl(1/g0)) never too
        # small); with no room (< 1) the pool is the pair and the tied term is 0
        kr_hi = np.floor((1 - np.clip(dlo, 0.0, 1.0)) / g0 * (1 + 1e-15)) - 2
        room = kr_hi >= 1
        w_lo = np.where(room, lam_lo / np.where(room, kr_hi, 1.0), 0.0)
        tied = np.where(room & (lam_lo > 0), kr_hi * np.expm1(w_lo) * (1 - beta * w_lo), 0.0)
        # C = T1 - T2 - T3
        n_lo, n_hi = np.log(b0 / (delta * (g1 + c))), np.log(b1 / (delta * (g0 + c)))
        i_lo, i_hi = 1 / g1, 1 / g0
        T1 = np.minimum(np.minimum(n_lo * i_lo, n_lo * i_hi), np.minimum(n_hi * i_lo, n_hi * i_hi))
        T2 = _xlog_m1(s_hi / g0)  # (y_t - 1) log y_t, increasing for y_t >= 1
        T3 = _xlog_m1(np.minimum(b0 / g1, 1.0))  # (y_b - 1) log y_b, decreasing on (0, 1]
        x_lo = (1 - dcap) / g1 * (1 - 1e-15)
        x_hi = (1 - np.clip(dlo, 0.0, 1.0)) / g0 * (1 + 1e-15)
        fl = np.floor(np.where(np.isfinite(x_lo), np.maximum(x_lo, 0.0), 0.0))
        same = np.isfinite(x_lo) & (x_lo >= 0) & (np.floor(x_hi) == fl)
        u_lo = np.clip(x_lo - fl, 0.0, 1.0)
        u_hi = np.clip(x_hi - fl, 0.0, 1.0)
        T4 = np.where(same, np.minimum(_rem_u(u_lo, g0, c), _rem_u(u_hi, g0, c)), 0.0)
        X = tied + beta * (T1 - T2 - T3 + T4)
        v = A + np.where(X >= 0, g0 * X, g1 * X)
    v = np.where(np.isnan(v) | (b0 <= 0), -np.inf, v)
    return v


def _r_lower(G, b0, b1, g0, g1, delta, c, dcap=np.inf):
    """max(R1, R2) over the rectangle, with the count tightened twice by the bound itself
    (k <= (1 - D)/g - 2: a larger excess leaves room for fewer intermediates)."""
    d = np.zeros_like(G * b0)
    for _ in range(_R_COUNT_PASSES):
        d = np.maximum(d, np.maximum(_r1_lower(G, b0, b1, g0, g1, d),
                                     _r2_lower(G, b0, b1, g0, g1, delta, c, d, dcap)))
    return d


def _r_point(G, b, g, delta, c):
    """max(R1, R2) at a point with beta = 1/(u_t + 2): a value for the pruning decision."""
    return _r_lower(G, b, b, g, g, delta, c)


def _reverse_family(G, b, N, g, delta, c, eps, slack=1e-9):
    """The tied family (s0, b, t x N, g' x q, r) at geometric level g (t from g, g' = g just
    below): (D, feasible), vectorised.  Feasible = the rule, evaluated in closed form on the
    family with a relative margin ``slack``, rejects b and nothing above it and accepts the
    top, so its statistic is G and its reverse radius -log(1 - D) is attained."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s0 = G + b
        n = N + 2
        t = np.exp((n * np.log(g) - np.log(s0) - np.log(b)) / np.maximum(N, 1))
        t = np.where(N > 0, t, g)
        m = s0 + b + N * t
        gp = g * (1 - 1e-12)
        mo = 1 - m
        q = np.floor(np.maximum(mo, 0) / gp)
        r = np.maximum(mo - q * gp, 0.0)
        xl = lambda x: np.where(x > 0, x * np.log(np.where(x > 0, x + c, 1.0)), 0.0)  # noqa: E731
        neg_h = xl(s0) + xl(b) + N * xl(t) + q * xl(gp) + xl(r)
        tau = np.minimum(eps, delta * np.exp(neg_h))
        lam_ok = (N == 0) & (np.abs(n * np.log(g) - np.log(s0) - np.log(b)) < 1e-12) | (N > 0)
        ok = (mo >= 0) & lam_ok & (t >= g) & (t < s0) & (b <= eps)
        ok &= np.log(b / delta) + slack * np.maximum(1.0, np.abs(np.log(b / delta))) <= neg_h  # b rejected
        ok &= (gp > tau * (1 + slack)) & (t > tau * (1 + slack)) & (s0 > tau * (1 + slack))
        ok &= (r <= b) | (r > tau * (1 + slack))
        Z = 1 - m + n * g
        rej = np.log(b / delta) + slack * np.maximum(1.0, np.abs(np.log(b / delta))) <= neg_h
        rej |= mo < 0  # past the mass limit: monotone in g for the bisection (then not ok)
    return np.where(ok, 1 - Z, np.inf), ok, rej


def _reverse_cap(G, b, g, d, delta, c, eps, full=False, b_factors=(1.0,), n_offsets=(0, 1, 2, 3, 5, 8)):
    """An attained D near the relaxed minimiser (b, g) of each row (inf if none found): the
    family with N = N0 - {0, 1, 2, 3, 5, 8} or N0 x {0.98, 0.96, 0.93} intermediates
    (N0 = floor((1 - d)/g) - 2), at the minimiser's b, its level raised by bisection until the rule rejects b; every condition
    of the family is then checked (D = inf where one fails)."""
    best = np.full(G.shape, np.inf)
    arg_n, arg_g, arg_b = np.zeros(G.shape), np.zeros(G.shape), b.copy()
    for db in b_factors:
        # b strictly inside its cap: a member with b = ε exactly is rejected or not by the
        # last ulp of its normalisation (the rule is evaluated exactly on the given values)
        bb = np.minimum(b * db, np.minimum(eps * (1 - 1e-9), (1 - G) / 2))
        N0 = np.floor((1 - d) / g) - 2
        for dn, f in itertools.chain(((k, 1.0) for k in n_offsets), ((0, f) for f in (0.98, 0.96, 0.93))):
            # the family's intermediates sit above the level, so it has room for fewer
            N = np.maximum(np.floor(N0 * f) - dn, 0)
            lo = np.sqrt((G + bb) * bb)
            hi = G + bb
            for _ in range(44):  # the lowest level at which the rule rejects b
                mid = 0.5 * (lo + hi)
                _, _, rej = _reverse_family(G, bb, N, mid, delta, c, eps)
                lo, hi = np.where(rej, lo, mid), np.where(rej, mid, hi)
            D, _, _ = _reverse_family(G, bb, N, hi, delta, c, eps)  # every condition checked
            arg_n, arg_g, arg_b = np.where(D < best, N, arg_n), np.where(D < best, hi, arg_g), np.where(D < best, bb, arg_b)
            best = np.minimum(best, D)
    if full:
        return best, arg_b, arg_n, arg_g
    return best


def _reverse_start(G, bmax):
    """Initial rectangles covering b in (0, bmax], g in [sqrt(s0 b), s0] for every row."""
    nb, ng = 8, 4
    fr = np.concatenate([[0.0], np.geomspace(1e-6, 1.0, nb)])
    gf = np.linspace(0, 1, ng + 1)
    nrow = G.size
    rows = np.repeat(np.arange(nrow), nb * ng)
    B = bmax[:, None, None]
    Gt = G[:, None, None]
    b0 = np.broadcast_to(B * fr[None, :-1, None], (nrow, nb, ng))
    b1 = np.broadcast_to(B * fr[None, 1:, None], (nrow, nb, ng))
    # g from the smallest possible level sqrt(s0 b) (at b0) to the top s0 (at b1)
    glo = np.sqrt((Gt + b0) * b0)
    ghi = Gt + b1
    g0 = glo + (ghi - glo) * gf[None, None, :-1]
    g1 = glo + (ghi - glo) * gf[None, None, 1:]
    b0, b1, g0, g1 = (np.ascontiguousarray(x).ravel() for x in (b0, b1, g0, g1))
    return rows, b0, b1, np.maximum(g0, 1e-300), g1


def _reverse_bb(G, bmax, delta, c, tol, dcap, start=None, floor=None):
    """Branch and bound over rectangles in (b, g) for every row of G (all rows valid), from
    ``start`` (rectangles that cover the domain; default ``_reverse_start``): (certified
    lower bound on D, the best point's b, g and value, the final rectangles -- they still
    cover the domain)."""
    nrow = G.size
    rows, b0, b1, g0, g1 = _reverse_start(G, bmax) if start is None else start
    kept = []  # retired rectangles (with the live ones at the end, a cover of the domain)
    best_b, best_g = bmax.copy(), np.sqrt((G + bmax) * bmax)
    best = _r_point(G, best_b, best_g, delta, c)  # the pair with b at its cap
    best = np.where(np.isfinite(best), best, np.inf)
    done = np.full(nrow, np.inf)
    for _ in range(_R_ROUNDS):
        Gr = G[rows]
        lb = _r_lower(Gr, b0, b1, g0, g1, delta, c, dcap[rows])
        # the rectangle holds no level of any of its b: g above the top or below sqrt(s0 b)
        empty = (g0 > Gr + b1) | (g1 < np.sqrt((Gr + b0) * np.maximum(b0, 0)))
        lb = np.where(empty, np.inf, lb)
        bm = np.where(b0 > 0, np.sqrt(b0 * b1), b1)
        gm = np.clip(0.5 * (g0 + g1), np.sqrt((Gr + bm) * bm), Gr + bm)
        pv = _r_point(Gr, bm, gm, delta, c)
        pv = np.where(np.isfinite(pv) & ~empty, pv, np.inf)
        order = np.lexsort((pv, rows))
        first = order[np.r_[True, rows[order][1:] != rows[order][:-1]]]
        better = pv[first] < best[rows[first]]
        sel = first[better]
        best[rows[sel]] = pv[sel]
        best_b[rows[sel]], best_g[rows[sel]] = bm[sel], gm[sel]
        settled = np.zeros(rows.shape, bool) if floor is None else best[rows] * (1 - tol) <= floor[rows]
        if floor is not None:
            lb = np.where(settled, np.maximum(lb, floor[rows]), lb)
        split = (lb < best[rows] * (1 - tol)) & ~settled
        np.minimum.at(done, rows[~split], lb[~split])
        kept.append(tuple(x[~split] for x in (rows, b0, b1, g0, g1)))
        if not split.any() or split.sum() > _R_MAX_BOXES:
            np.minimum.at(done, rows[split], lb[split])
            kept.append(tuple(x[split] for x in (rows, b0, b1, g0, g1)))
            rows = rows[:0]
            break
        rows, b0, b1, g0, g1 = rows[split], b0[split], b1[split], g0[split], g1[split]
        # split the wider side (b in log scale, g relative to its own scale)
        with np.errstate(divide="ignore"):
            wb = np.where(b0 > 0, np.log(b1 / b0), 8.0)
        wg = (g1 - g0) / g1 * 2
        on_b = wb >= wg
        bmid = np.where(b0 > 0, np.sqrt(b0 * b1), b1 * 1e-3)
        gmid = 0.5 * (g0 + g1)
        nb0 = np.concatenate([b0, np.where(on_b, bmid, b0)])
        nb1 = np.concatenate([np.where(on_b, bmid, b1), b1])
        ng0 = np.concatenate([g0, np.where(on_b, g0, gmid)])
        ng1 = np.concatenate([np.where(on_b, g1, gmid), g1])
        rows = np.concatenate([rows, rows])
        b0, b1, g0, g1 = nb0, nb1, ng0, ng1
    if rows.size:
        lb = _r_lower(G[rows], b0, b1, g0, g1, delta, c, dcap[rows])
        np.minimum.at(done, rows, lb)
        kept.append((rows, b0, b1, g0, g1))
    leaves = tuple(np.concatenate([k[i] for k in kept]) for i in range(5))
    return done, best_b, best_g, best, leaves


def reverse_infimum(G, eps: float, delta: float, c: float = 0.0, floor=None) -> np.ndarray:
    """Certified lower bound on the infimum of the reverse radius of ``entropy:eps:delta``
    (c = 0) or ``typical:eps:delta`` (c = 1e-5) over every p with rejection gap G.

    Two passes of branch and bound over rectangles in (b, g): a coarse one without the
    off-pool remainder locates the minimiser; the tied family near it gives an attained
    excess D_cap (so D <= D_cap may be assumed: the infimum is at most D_cap); the second
    pass then counts the remainder over D in [lower bound, D_cap].  The larger of the two
    lower bounds on D, as -log(1 - D)."""
    G, shape, out, bmax, todo, floor, chunked = _rows(G, eps, reverse_infimum, delta, c, floor)
    if chunked is not None:
        return chunked
    if todo.size == 0:
        return out.reshape(shape)
    Gt, bt = G[todo], bmax[todo]
    # the floor (a radius) as an excess: D = 1 - exp(-radius)
    fl = -np.expm1(-floor[todo])
    lb1, b_star, g_star, d_star, leaves = _reverse_bb(Gt, bt, delta, c, _R_TOL_COARSE, np.full(Gt.shape, np.inf), floor=fl)
    dcap = _reverse_cap(Gt, b_star, g_star, np.where(np.isfinite(d_star), d_star, 0.0), delta, c, eps)
    # second pass from the first pass's rectangles (a cover), now with the remainder where an
    # attained D_cap is known (rows without one keep D_cap = inf: no remainder term)
    lb2, *_ = _reverse_bb(Gt, bt, delta, c, _R_TOL, dcap, start=leaves, floor=fl)
    lb = np.maximum(lb1, lb2)
    D = np.clip(lb * (1 - _REL) - _ABS, 0.0, None)
    with np.errstate(divide="ignore"):
        out[todo] = np.maximum(np.where(D >= 1, np.inf, -np.log1p(-np.minimum(D, 1.0))), floor[todo])
    return out.reshape(shape)


def reverse_extremal(G: float, eps: float, delta: float, c: float = 0.0, n_b: int = 1001, zooms: int = 2) -> np.ndarray:
    """The family member behind D_cap at G: (s0, b, t x N, g' x q, r) as a float64 vector
    (for tests and the benchmark; its reverse radius is -log(1 - D_cap), above the bound)."""
    Ga = np.array([float(G)])
    bm = np.minimum(eps, (1 - Ga) / 2)
    _, b_star, g_star, d_star, _ = _reverse_bb(Ga, bm, delta, c, _R_TOL_COARSE, np.full(1, np.inf))
    d0 = np.where(np.isfinite(d_star), d_star, 0.0)
    # the family's excess is jagged in b (the remainder's share jumps where (1 - D)/g crosses
    # an integer), so: a fine scan of b around the relaxed minimiser, then a zoom around the best
    best = (np.inf, 0.0, 0, 0.0)
    lo, hi, n = 0.7, 1.4, n_b
    centre = float(b_star[0])
    for _ in range(zooms + 1):
        f = np.geomspace(lo, hi, n)
        ones = np.ones_like(f)
        D, b, N, g = _reverse_cap(Ga * ones, centre * f, g_star * ones, d0 * ones, delta, c, eps, full=True,
                                  n_offsets=range(-4, 16))
        i = int(np.argmin(D))
        if D[i] < best[0]:
            best = (float(D[i]), float(b[i]), int(N[i]), float(g[i]))
        if not np.isfinite(best[0]):
            break
        step = (hi / lo) ** (1 / (n - 1))
        centre, lo, hi, n = best[1], step ** -2, step ** 2, 401
    if not np.isfinite(best[0]):
        raise ValueError(f"no member of the reverse family found at G={G}")
    _, b, N, g = best
    s0 = G + b
    t = math.exp(((N + 2) * math.log(g) - math.log(s0) - math.log(b)) / N) if N > 0 else g
    gp = g * (1 - 1e-12)
    rest = 1 - s0 - b - N * t
    q = int(math.floor(max(rest, 0) / gp))
    r = max(rest - q * gp, 0.0)
    parts = [np.array([s0, b]), np.full(N, t), np.full(q, gp)] + ([np.array([r])] if r > 0 else [])
    return np.sort(np.concatenate(parts))[::-1]
