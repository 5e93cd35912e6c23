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
    """φ(1 + v) = (1 + v) log(1 + v) - v >= 0 for v >= -1 (φ(0) = 1).  log1p keeps the
    logarithm accurate at every v; near v = 0 the subtraction still leaves an absolute error of
    a few ulps of |v| (a relative one of ~1e-16/|v|), which the absolute allowance _ABS covers
    (terms are at most O(1) in |v| and the pool's total excess is at most 1)."""
    return np.where(v > -1, (1 + v) * np.log1p(v), 0.0) - v


def f1(G, b, L):
    """F1: forward radius of the pool (s0, b, K x t) at level L, K = floor(1/L) - 2 (+inf if
    the pool cannot hold the excess)."""
    s0 = G + b
    n = np.floor(1 / L)  # floor(fl(1/L)) >= floor(1/L): K never too small, F1 never too large
    K = n - 2
    exc = (2 * L - s0 - b) / L  # e >= 0 on the domain
    exc = np.maximum(exc, 0.0)
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
    if c:
        rem = r * (np.log1p(c / L) + np.log(L) - np.log(r + c))
    else:
        rem = np.where(r > 0, r * (np.log(L) - np.log(np.where(r > 0, r, 1.0))), 0.0)
    return -np.log(L + c), np.maximum(rem, 0.0)


def f2(b, L, delta, c):
    lev, rem = q_level(L, c)
    return np.where(b > 0, np.log(b / delta) + lev + rem, -np.inf)


# F1, F2 and their parts take logarithms of 0 and divide by 0 at the domain's ends by design
# (the results are masked with np.where); the two routines that evaluate them silence numpy
# there once per call, not once per term (otherwise ~3.5k enters and exits of np.errstate per
# 256 rows, most of the branch and bound's time).
_QUIET = dict(divide="ignore", invalid="ignore", over="ignore")


@np.errstate(**_QUIET)
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


@np.errstate(**_QUIET)
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
        # values the family attains: the middle b of every box at its own crossing (only for
        # the pruning decision, never for the bound).  Every box, not only each row's lowest:
        # max(F1, F2) is jagged in b (F1 jumps where floor(1/L) steps), and a row whose
        # probes all miss its narrow valleys would split its boxes without end
        bm = np.where(b0 > 0, np.sqrt(b0 * b1), b1)
        np.minimum.at(best, rows, _point(G[rows], bm, delta, c))
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


def _best_valleys(v, k):
    """Indices of the ``k`` lowest local minima of the finite values of v (1-D): the excess of
    either family is jagged in b, with narrow valleys, and the lowest grid point is often not
    in the deepest one, so the member searches zoom around several."""
    vp = np.r_[np.inf, v, np.inf]
    valleys = np.flatnonzero((v <= vp[:-2]) & (v <= vp[2:]) & np.isfinite(v))
    return valleys[np.argsort(v[valleys], kind="stable")[:k]]


def extremal(G: float, eps: float, delta: float, c: float = 0.0, n_b: int = 20001, slack: float = 1e-9,
             starts: int = 20) -> np.ndarray:
    """The attaining distribution (s0, b, t x K, r) at (numerically) the best b: a float64
    vector summing to 1, for tests and the benchmark.  Independent of the certification: a
    grid over b, then bisection over L on the *rule itself* evaluated on the built vector
    (b <= delta exp(-H) with H the rule's entropy, checked with a relative margin ``slack``),
    so that b is rejected in exact arithmetic and not only on the boundary."""
    bmax = min(eps, (1 - G) / 2) * (1 - slack)
    bs = np.geomspace(bmax * 1e-6, bmax, n_b)
    vals = _point(np.full_like(bs, G), bs, delta, c)
    # zoom in around each of the grid's ``starts`` best local minima (max(F1, F2) is jagged in b)
    fine = np.concatenate([np.geomspace(bs[max(i - 1, 0)], bs[min(i + 1, bs.size - 1)], 401)
                           for i in _best_valleys(vals, starts)])
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
# b and g, or bounded at the rectangle's corners); β is one value per rectangle.  The second
# pass also splits the excess D (boxes in (b, g, D)), so that the off-pool remainder, a
# function of frac((1 - D)/g), counts at each box's own D.

_R_TOL = 2e-4
_R_TOL_COARSE = 1e-2
_R_COUNT_PASSES = 2
_R_ROUNDS = 60
_R_MAX_BOXES = 1 << 19
_R_POINT_ITERS = 2


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


def _lam_ut_hi(G, b0, b1, g0, g1):
    """Upper ends over the rectangle of Λ = log(g²/(s0 b)) (>= 0) and u_t = log(s0/g)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        lam_hi = np.maximum(2 * np.log(g1) - np.log(G + b0) - np.log(b0), 0.0)
        ut_hi = np.log((G + b1) / g0)
    return lam_hi, ut_hi


def _r2_lower(G, b0, b1, g0, g1, delta, c, dlo=0.0, dcap=np.inf):
    """Lower bound of R2 over the rectangle, by interval arithmetic.  With dcap (a value of D
    some member of the family attains, so D <= dcap may be assumed) the off-pool remainder
    counts too: u = frac((1 - D)/g) over D in [dlo, dcap], g in [g0, g1]."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s_lo, s_hi = G + b0, G + b1
        A = s_lo + b0 - 2 * g1  # s0 + b - 2g
        lam_lo = np.maximum(2 * np.log(g0) - np.log(s_hi) - np.log(b1), 0.0)
        lam_hi, ut_hi = _lam_ut_hi(G, b0, b1, g0, g1)
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
        C_lo = T1 - T2 - T3 + T4
        X = tied + beta * C_lo
        v = A + np.where(X >= 0, g0 * X, g1 * X)
        # feasibility: each intermediate has u <= u_t and sum u = Λ, so Σ_P u a(u) <= Λ a(u_t);
        # a box whose C exceeds that everywhere holds no p whose b the rule rejects (with no
        # intermediates, or the pool at the pair's level, this is C <= 0)
        cap = np.where(room, lam_hi * np.expm1(ut_hi), 0.0)
        slack = 1e-12 * (np.abs(T1) + np.abs(T2) + np.abs(T3) + np.abs(T4) + np.abs(cap)) + 1e-300
        v = np.where(C_lo > cap + slack, np.inf, v)
    v = np.where(np.isnan(v) | (b0 <= 0), -np.inf, v)
    return v


def _d_upper(G, b0, b1, g0, g1):
    """An upper bound of D over the rectangle: a is convex with a(0) = 0 and each u_i lies in
    [0, u_t], so a(u_i) <= u_i a(u_t)/u_t and D = s0 + b - 2g + g Σ_P a(u_i) <= s0 + b - 2g +
    g Λ a(u_t)/u_t (a(u)/u increasing; -> 1 as u -> 0).  At the pair's level (Λ = 0) D is the
    pair's own cost: the excess is not free above its lower bounds."""
    lam_hi, ut_hi = _lam_ut_hi(G, b0, b1, g0, g1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ut_hi = np.maximum(ut_hi, 0.0)
        slope = np.where(ut_hi > 1e-8, np.expm1(ut_hi) / np.where(ut_hi > 1e-8, ut_hi, 1.0), 1 + ut_hi)
        v = ((G + b1) + b1 - 2 * g0) + g1 * lam_hi * slope
    v = np.where(np.isnan(v) | (b0 <= 0), np.inf, v)
    return v * (1 + 1e-12) + 1e-15


def _r_lower(G, b0, b1, g0, g1, delta, c, dcap=np.inf, dlo=0.0):
    """max(R1, R2) over the box b in [b0, b1], g in [g0, g1], D in [dlo, dcap], with the
    count tightened twice by the bound itself (k <= (1 - D)/g - 2: a larger excess leaves room
    for fewer intermediates); never below dlo.  D is also at most ``_d_upper`` of the box: the
    range of D is cut there (so the remainder counts over the D the box can hold), and a box
    whose dlo lies above it is empty (+inf)."""
    d_up = _d_upper(G, b0, b1, g0, g1)
    dcap = np.minimum(dcap, d_up)
    d = np.maximum(np.zeros_like(G * b0), dlo)
    for _ in range(_R_COUNT_PASSES):
        d = np.maximum(d, np.maximum(_r1_lower(G, b0, b1, g0, g1, d),
                                     _r2_lower(G, b0, b1, g0, g1, delta, c, d, dcap)))
    return np.where(d > d_up, np.inf, d)


def _r_point(G, b, g, delta, c, dlo, dhi, dref):
    """The relaxation at a point, for the pruning decision only (never a bound): the
    smallest D in [dlo, dhi] with D >= v(D), v the bound with the remainder taken at D itself
    (what the lower bounds of ever smaller boxes converge to), by fixed-point iteration from
    dlo; without an upper end (dhi = inf) the remainder is not counted, as in the boxes.
    Where it has not settled inside [dlo, dhi], dref, an attained value (a high reference
    only costs more splitting; a low one would stop the search early)."""
    d = np.asarray(dlo, dtype=np.float64) * np.ones_like(G * b)
    if not np.isfinite(dhi).any():  # the first pass: no remainder, the count tightened twice
        return _r_lower(G, b, b, g, g, delta, c, np.inf, d)
    for _ in range(_R_POINT_ITERS):
        # the remainder only where D is bounded (the second pass), as in the boxes
        v = _r_lower(G, b, b, g, g, delta, c, np.where(np.isfinite(dhi), d, np.inf), d)
        settled = v <= d * (1 + 1e-12)
        d = np.maximum(d, v)
    return np.where(settled & (d <= dhi), d, dref)


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
        # every token above b is accepted (the fills and intermediates only where there are any)
        ok &= ((q == 0) | (gp > tau * (1 + slack))) & ((N == 0) | (t > tau * (1 + slack))) & (s0 > tau * (1 + slack))
        ok &= (r <= b) | (r > tau * (1 + slack))
        Z = 1 - m + n * g
        rej = np.log(b / delta) + slack * np.maximum(1.0, np.abs(np.log(b / delta))) <= neg_h
        rej |= mo < 0  # past the mass limit: monotone in g for the bisection (then not ok)
    return np.where(ok, 1 - Z, np.inf), ok, rej


def _reverse_cap(G, b, g, d, delta, c, eps, full=False, n_offsets=(0, 1, 2, 3, 5, 8)):
    """An attained D near the relaxed minimiser (b, g) of each row (inf if none found): the
    family with N = N0 - n_offsets or N0 x {0.98, 0.96, 0.93} intermediates
    (N0 = floor((1 - d)/g) - 2), at b, its level raised by bisection until the rule rejects
    b; every condition of the family is then checked (D = inf where one fails).  With
    ``full``, also the best member's b, N and level."""
    best = np.full(G.shape, np.inf)
    arg_n, arg_g = np.zeros(G.shape), np.zeros(G.shape)
    # b strictly inside its caps: a member with b = ε exactly is rejected or not by the
    # last ulp of its normalisation (the rule is evaluated exactly on the given values), and
    # one with b = (1 - G)/2 has s0 + b = 1 only up to rounding
    bb = np.minimum(b, np.minimum(eps, (1 - G) / 2) * (1 - 1e-9))
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
        # without intermediates the pool is the pair, at its own level exactly
        hi = np.where(N > 0, hi, np.sqrt((G + bb) * bb))
        D, _, _ = _reverse_family(G, bb, N, hi, delta, c, eps)  # every condition checked
        arg_n, arg_g = np.where(D < best, N, arg_n), np.where(D < best, hi, arg_g)
        best = np.minimum(best, D)
    if full:
        return best, bb, arg_n, arg_g
    return best


def _reverse_cap_scan(G, b, g, d, delta, c, eps, lo=0.5, hi=1.4, n=49, n_offsets=range(-4, 16)):
    """The best family member over a geometric scan of ``n`` values of b in [lo, hi] x b per
    row (``_reverse_cap`` at each, with N offsets ``n_offsets``): (D, b, N, level) per row.
    The family's excess is jagged in b (the remainder's share jumps where (1 - D)/g crosses an
    integer) and a member may exist only away from the relaxed minimiser's b (where the level
    that rejects b would pass the top), so a scan finds one where a single b does not."""
    f = np.geomspace(lo, hi, n)
    rep = lambda x: np.repeat(np.asarray(x, dtype=np.float64), n)  # noqa: E731
    D, bb, N, gg = _reverse_cap(rep(G), rep(b) * np.tile(f, G.size), rep(g), rep(d), delta, c, eps,
                                full=True, n_offsets=n_offsets)
    i = np.arange(G.size) * n + np.argmin(D.reshape(G.size, n), axis=1)
    return D[i], bb[i], N[i], gg[i]


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


def _reverse_bb(G, bmax, delta, c, tol, dtop, start=None, floor=None):
    """Branch and bound over boxes b in [b0, b1], g in [g0, g1], D in [d0, d1] for every row
    of G (all rows valid), from ``start`` (rectangles in (b, g) that cover the domain; default
    ``_reverse_start``), with D in [0, dtop] (dtop = inf: D is not bounded and the remainder
    is not counted).  A box whose lower bound exceeds its d1 holds no distribution and is
    dropped.  Returns (certified lower bound on D over every p with D <= dtop -- inf if every
    box was dropped --, the best point's b, g and value, the final rectangles in (b, g), a
    cover of the domain)."""
    nrow = G.size
    rows, b0, b1, g0, g1 = _reverse_start(G, bmax) if start is None else start
    d0, d1 = np.zeros(rows.shape), dtop[rows].astype(np.float64)
    kept = []  # retired rectangles (with the live ones at the end, a cover of the domain)
    best_b, best_g = bmax.copy(), np.sqrt((G + bmax) * bmax)
    best = _r_point(G, best_b, best_g, delta, c, 0.0, dtop, dtop)  # the pair with b at its cap
    best = np.where(np.isfinite(best), best, np.inf)
    done = np.full(nrow, np.inf)
    bounded = np.isfinite(dtop)
    for _ in range(_R_ROUNDS):
        Gr = G[rows]
        lb = _r_lower(Gr, b0, b1, g0, g1, delta, c, d1, d0)
        # the rectangle holds no level of any of its b (g above the top or below sqrt(s0 b)),
        # or no D of its range
        empty = (g0 > Gr + b1) | (g1 < np.sqrt((Gr + b0) * np.maximum(b0, 0))) | (lb > d1)
        lb = np.where(empty, np.inf, lb)
        bm = np.where(b0 > 0, np.sqrt(b0 * b1), b1)
        gm = np.clip(0.5 * (g0 + g1), np.sqrt((Gr + bm) * bm), Gr + bm)
        pv = _r_point(Gr, bm, gm, delta, c, d0, d1, dtop[rows])
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
        rows, b0, b1, g0, g1, d0, d1 = (x[split] for x in (rows, b0, b1, g0, g1, d0, d1))
        d0 = np.maximum(d0, lb[split])
        # split the widest side: b in log scale, g relative to its own scale, D in units of
        # the remainder's share u = frac((1 - D)/g) (its only effect)
        with np.errstate(divide="ignore", invalid="ignore"):
            wb = np.where(b0 > 0, np.log(b1 / b0), 8.0)
            wd = np.where(bounded[rows], (d1 - d0) / g0, 0.0)
        wg = (g1 - g0) / g1 * 2
        on_b = (wb >= wg) & (wb >= wd)
        on_g = ~on_b & (wg >= wd)
        on_d = ~on_b & ~on_g
        bmid = np.where(b0 > 0, np.sqrt(b0 * b1), b1 * 1e-3)
        gmid = 0.5 * (g0 + g1)
        dmid = 0.5 * (d0 + d1)
        nb0 = np.concatenate([b0, np.where(on_b, bmid, b0)])
        nb1 = np.concatenate([np.where(on_b, bmid, b1), b1])
        ng0 = np.concatenate([g0, np.where(on_g, gmid, g0)])
        ng1 = np.concatenate([np.where(on_g, gmid, g1), g1])
        nd0 = np.concatenate([d0, np.where(on_d, dmid, d0)])
        nd1 = np.concatenate([np.where(on_d, dmid, d1), d1])
        rows = np.concatenate([rows, rows])
        b0, b1, g0, g1, d0, d1 = nb0, nb1, ng0, ng1, nd0, nd1
    if rows.size:
        lb = _r_lower(G[rows], b0, b1, g0, g1, delta, c, d1, d0)
        np.minimum.at(done, rows, np.where(lb > d1, np.inf, lb))
        kept.append((rows, b0, b1, g0, g1))
    # (boxes split in D repeat their (b, g) rectangle: still a cover)
    leaves = tuple(np.concatenate([k[i] for k in kept]) for i in range(5))
    return done, best_b, best_g, best, leaves


def reverse_infimum(G, eps: float, delta: float, c: float = 0.0, floor=None) -> np.ndarray:
    """Certified lower bound on the infimum of the reverse radius of ``entropy:eps:delta``
    (c = 0) or ``typical:eps:delta`` (c = 1e-5) over every p with rejection gap G.

    Two passes of branch and bound: a coarse one over rectangles in (b, g), without the
    off-pool remainder, locates the minimiser; the tied family near it gives an attained
    excess D_cap (so only D <= D_cap needs a bound: the infimum is at most D_cap); the second
    pass works on boxes in (b, g, D) with D in [0, D_cap], so that each box counts the
    remainder over its own range of D.  The larger of the two lower bounds on D, as
    -log(1 - D)."""
    G, shape, out, bmax, todo, floor, chunked = _rows(G, eps, reverse_infimum, delta, c, floor)
    if chunked is not None:
        return chunked
    if todo.size == 0:
        return out.reshape(shape)
    Gt, bt = G[todo], bmax[todo]
    # the floor (a radius) as an excess: D = 1 - exp(-radius)
    fl = -np.expm1(-floor[todo])
    lb1, b_star, g_star, d_star, leaves = _reverse_bb(Gt, bt, delta, c, _R_TOL_COARSE, np.full(Gt.shape, np.inf), floor=fl)
    d_ref = np.where(np.isfinite(d_star), d_star, 0.0)
    dcap = _reverse_cap(Gt, b_star, g_star, d_ref, delta, c, eps)
    # no member at the relaxed minimiser's own b (the level that rejects b passes the top, or
    # the family's intermediates fall below the rule's threshold): scan b for one, since
    # without D_cap the second pass cannot count the remainder (entropy:0.2:0.9 at G = 0.045:
    # 0.912 of the best member without the scan, 0.9998 with it)
    miss = ~np.isfinite(dcap)
    if miss.any():
        dcap[miss] = _reverse_cap_scan(Gt[miss], b_star[miss], g_star[miss], d_ref[miss], delta, c, eps)[0]
    # second pass from the first pass's rectangles (a cover), now with the remainder where an
    # attained D_cap is known (rows without one keep D_cap = inf: no remainder term)
    dtop = dcap * (1 + 1e-9)  # the member's D, with room for its rounding
    lb2, *_ = _reverse_bb(Gt, bt, delta, c, _R_TOL, dtop, start=leaves, floor=fl)
    # every p with D <= dtop lies in a box, the member among them, so lb2 <= dtop; if every
    # box were dropped (only possible through rounding in the member) keep the first pass
    lb = np.maximum(lb1, np.where(lb2 <= dtop, lb2, 0.0))
    D = np.clip(lb * (1 - _REL) - _ABS, 0.0, None)
    with np.errstate(divide="ignore"):
        out[todo] = np.maximum(np.where(D >= 1, np.inf, -np.log1p(-np.minimum(D, 1.0))), floor[todo])
    return out.reshape(shape)


def reverse_extremal(G: float, eps: float, delta: float, c: float = 0.0, n_b: int = 1001, zooms: int = 3,
                     starts: int = 20) -> np.ndarray:
    """The best tied-family member found near the relaxed minimiser at G: (s0, b, t x N,
    g' x q, r) as a float64 vector, every condition of the rule checked on it in closed form
    (for tests and the benchmarks; its reverse radius is above the bound, and at 0.09:0.3
    within 3e-4 of it)."""
    Ga = np.array([float(G)])
    bm = np.minimum(eps, (1 - Ga) / 2)
    _, b_star, g_star, d_star, _ = _reverse_bb(Ga, bm, delta, c, _R_TOL_COARSE, np.full(1, np.inf))
    d0 = np.where(np.isfinite(d_star), d_star, 0.0)
    # the family's excess is jagged in b, with narrow valleys (where the fills' remainder
    # vanishes): a fine scan of b around the relaxed minimiser, then zooms around each of its
    # ``starts`` best local minima (the best of the scan alone is often in the wrong valley)
    f = np.geomspace(0.5, 1.4, n_b)
    ones = np.ones(n_b)
    D, b, _, _ = _reverse_cap(Ga * ones, b_star * f, g_star * ones, d0 * ones, delta, c, eps, full=True,
                              n_offsets=range(-4, 16))
    if not np.isfinite(D).any():
        raise ValueError(f"no member of the reverse family found at G={G}")
    cand = b[_best_valleys(D, starts)]
    half = 1.5 * math.log(1.4 / 0.5) / (n_b - 1)  # 1.5 scan steps either side, in log b
    k = cand.size
    for _ in range(zooms):
        D, cand, N, g = _reverse_cap_scan(Ga.repeat(k), cand, g_star.repeat(k), d0.repeat(k), delta, c, eps,
                                          math.exp(-half), math.exp(half), 201)
        half *= 3 / 200
    i = int(np.argmin(D))
    best = (float(D[i]), float(cand[i]), int(N[i]), float(g[i]))
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
