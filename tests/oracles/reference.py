"""Independent reference radii: each case solved as a convex program (cvxpy + Clarabel).

Nothing here imports draftcert.  The rejecting sets are computed from each
criterion's *definition* on the full distribution p (numpy), and every
candidate rejection pattern is solved as its own convex program:

single-token rule, rejected token y:
    min_q D(p, q)  s.t.  q(y) >= q(z) for all z,  q in the simplex
    radius = min over y in R(p)            (+inf if R(p) is empty)

tree:M, a = argmax p (lowest index):
    for every set S of M tokens != a:
    min_q D(p, q)  s.t.  q(s) >= q(a) for s in S,  q in the simplex
    radius = min over S                    (+inf if M > V - 1)

D is forward KL(p||q), reverse KL(q||p) (q must vanish where p does) or
tv = (1/2)||p - q||_1.  D is invariant under a common permutation of p and q,
so each pattern is solved on a permuted p that puts the constrained tokens
first; then one DPP problem per (V, divergence, pattern shape) is compiled once
and re-solved with new parameter values.
"""

from __future__ import annotations

import functools
import itertools
import math
import warnings
from dataclasses import dataclass

import cvxpy as cp
import numpy as np

# Clarabel at (near) its tightest useful tolerances.  Measured accuracy of the
# optimal value on V <= 6 is ~1e-10 absolute, far inside the 1e-6 relative /
# 1e-9 absolute comparison used by the tests.
CLARABEL_OPTS = dict(
    tol_gap_abs=1e-11,
    tol_gap_rel=1e-11,
    tol_feas=1e-11,
    tol_ktratio=1e-9,
    max_iter=400,
)
OK_STATUS = (cp.OPTIMAL, cp.OPTIMAL_INACCURATE)
INFEASIBLE_STATUS = (cp.INFEASIBLE, cp.INFEASIBLE_INACCURATE)


# ---------------------------------------------------------------------------
# criteria, from their definitions (numpy, full distribution)
# ---------------------------------------------------------------------------


def entropy(p: np.ndarray) -> float:
    nz = p[p > 0]
    return float(-(nz * np.log(nz)).sum())


def rejected_set(spec: str, p: np.ndarray, user=None) -> np.ndarray:
    """Indices of tokens the rule rejects at target p (definition, not library code).

    Decided exactly on the given values: the row is renormalised (p / sum p) exactly, as
    the floating-point contract of docs/theory.md (section 7) demands.  Order statistics
    (strict, top-M, MARS's threshold) are exact comparisons of the given values; other
    thresholds are computed in float64 and every token within 1e-9 of the threshold is
    re-decided in 2400-bit arithmetic (mpmath).  ``user`` = (threshold_fn_numpy,
    inclusive) for a user LevelSet, whose threshold is its value on p / sum(p).
    """
    p = np.asarray(p, dtype=np.float64)
    name, *args = spec.split(":")
    srt = np.sort(p)[::-1]
    if name == "strict":
        return np.flatnonzero(p < srt[0])
    if name == "topm":
        return np.flatnonzero(p < srt[int(args[0]) - 1])
    if name == "relaxed":  # TensorRT-LLM: accepted iff in the top N (ties counted) and p >= max p - DELTA
        return np.union1d(rejected_set(f"topm:{args[0]}", p), rejected_set(f"additive:{args[1]}", p))
    if name == "mars":
        import mpmath

        theta = float(args[0])
        with mpmath.workprec(2400):
            close = srt[1] > 0 and mpmath.log(mpmath.mpf(srt[0]) / mpmath.mpf(srt[1])) <= mpmath.mpf(theta)
        return np.flatnonzero(p < (srt[1] if close else srt[0]))
    P = p / p.sum()
    inclusive = name in ("entropy", "typical")
    if name == "levelset":
        fn, inclusive = user
        tau = float(fn(P))
    elif name == "additive":
        tau = P.max() - float(args[0])
    elif name == "multiplicative":
        tau = float(args[0]) * P.max()
    elif name in ("entropy", "typical"):
        eps = float(args[0]) if len(args) > 0 else 0.09
        dl = float(args[1]) if len(args) > 1 else 0.3
        h = entropy(P) if name == "entropy" else float(-(P * np.log(P + 1e-5)).sum())
        tau = min(eps, dl * math.exp(-h))
    else:
        raise ValueError(spec)
    rej = P <= tau if inclusive else P < tau
    near = np.abs(P - tau) <= 1e-9 * abs(tau) + 1e-300
    if near.any():
        exact = _rejected_exact(name, args, p, user, inclusive)
        rej[near] = exact[near]
    return np.flatnonzero(rej)


def _rejected_exact(name, args, p, user, inclusive) -> np.ndarray:
    import mpmath

    with mpmath.workprec(2400):
        mp = mpmath.mp
        S = mp.fsum(mp.mpf(float(v)) for v in p)
        P = [mp.mpf(float(v)) / S for v in p]
        mx = max(P)
        if name == "levelset":
            tau = mp.mpf(float(user[0](p / p.sum())))
        elif name == "additive":
            tau = mx - mp.mpf(float(args[0]))
        elif name == "multiplicative":
            tau = mp.mpf(float(args[0])) * mx
        else:
            eps = float(args[0]) if len(args) > 0 else 0.09
            dl = float(args[1]) if len(args) > 1 else 0.3
            if name == "entropy":
                h = -mp.fsum(v * mp.log(v) for v in P if v > 0)
            else:
                h = -mp.fsum(v * mp.log(v + mp.mpf(1e-5)) for v in P)
            tau = min(mp.mpf(eps), mp.mpf(dl) * mp.exp(-h))
        tol = mp.mpf(2) ** -2200  # agreement to 2200 bits counts as an exact tie (e.g. tau = 1/3 = p)
        return np.array([(v <= tau + tol) if inclusive else (v < tau - tol) for v in P])


def argmax_lowest(p: np.ndarray) -> int:
    return int(np.flatnonzero(p == p.max())[0])


# ---------------------------------------------------------------------------
# divergences (numpy)
# ---------------------------------------------------------------------------


def div_np(p: np.ndarray, q: np.ndarray, kind: str) -> float:
    p = np.asarray(p, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    if kind == "tv":
        return 0.5 * float(np.abs(p - q).sum())
    a, b = (p, q) if kind == "forward" else (q, p)
    m = a > 0
    if np.any(b[m] <= 0):
        return math.inf
    return float((a[m] * np.log(a[m] / b[m])).sum())


# ---------------------------------------------------------------------------
# convex programs
# ---------------------------------------------------------------------------


@dataclass
class _Prog:
    prob: cp.Problem
    q: cp.Variable
    p: cp.Parameter


@functools.lru_cache(maxsize=None)
def _program(V: int, kind: str, m: int | None) -> _Prog:
    """m None: q[0] >= q[z] for all z (lift token 0).  m int: q[1..m] >= q[0] (tree;
    m = 0 leaves q free).  For reverse KL the parameter is log p (p > 0 everywhere:
    zero coordinates are removed before, see ``solve_pattern``)."""
    q = cp.Variable(V)
    cons = [cp.sum(q) == 1, q >= 0]
    if m is None:
        cons.append(q[1:] <= q[0])
    elif m > 0:
        cons.append(q[1 : m + 1] >= q[0])
    if kind == "forward":
        p = cp.Parameter(V, nonneg=True)
        # kl_div(p, q) = p log(p/q) - p + q; summed over two distributions it is KL(p||q).
        obj = cp.sum(cp.kl_div(p, q))
    elif kind == "reverse":
        p = cp.Parameter(V)  # log p
        # KL(q||p) = sum q log q - sum q log p
        obj = -cp.sum(cp.entr(q)) - p @ q
    elif kind == "tv":
        p = cp.Parameter(V, nonneg=True)
        obj = 0.5 * cp.norm1(q - p)
    else:
        raise ValueError(kind)
    prob = cp.Problem(cp.Minimize(obj), cons)
    assert prob.is_dcp(dpp=True)
    return _Prog(prob, q, p)


@dataclass
class Solution:
    value: float  # optimal D (math.inf if infeasible)
    q: np.ndarray | None  # optimal drafter, in the ORIGINAL token order


def _solve(pp: np.ndarray, kind: str, m: int | None) -> np.ndarray | None:
    """Optimal q of the pattern on (already permuted) pp, or None if infeasible."""
    V = pp.shape[0]
    if V == 1:
        return np.ones(1)  # the only distribution; every ordering constraint holds
    prog = _program(V, kind, m)
    prog.p.value = np.log(pp) if kind == "reverse" else pp
    with warnings.catch_warnings():
        # "Solution may be inaccurate" at these tolerances: the value is re-checked
        # by recomputing D from q, and the tests compare to 1e-6 relative.
        warnings.simplefilter("ignore", UserWarning)
        try:
            prog.prob.solve(solver=cp.CLARABEL, **CLARABEL_OPTS)
        except cp.error.SolverError:
            prog.prob.solve(solver=cp.CLARABEL)
    st = prog.prob.status
    if st in INFEASIBLE_STATUS:
        return None
    if st not in OK_STATUS:
        raise RuntimeError(f"reference solver status {st} for pp={pp!r} kind={kind} m={m}")
    q = np.clip(np.asarray(prog.q.value, dtype=np.float64), 0.0, None)
    return q / q.sum()


def solve_pattern(p: np.ndarray, kind: str, order: np.ndarray, m: int | None) -> Solution:
    """Solve the pattern on p permuted by ``order`` (constrained tokens first:
    m None -> order[0] = y is lifted above all; m int -> order[0] = a, order[1..m] = S)."""
    pp = np.asarray(p, dtype=np.float64)[order]
    qp = np.zeros_like(pp)
    if kind == "reverse":
        # KL(q||p) < inf forces q = 0 wherever p = 0; those coordinates are removed
        # from the program (they satisfy q(z) <= q(y) trivially).  For a tree, a token
        # of S with p = 0 forces q(a) <= 0, so a is removed too and q is free.
        pos = pp > 0
        if m is None:
            if not pos[0]:
                return Solution(math.inf, None)
            idx, mm = np.flatnonzero(pos), None
        elif not pos[1 : m + 1].all():
            idx, mm = np.flatnonzero(pos & (np.arange(pp.size) != 0)), 0
        else:
            idx, mm = np.flatnonzero(pos), m  # a and S are all kept, still first
        if idx.size == 0:
            return Solution(math.inf, None)
        sub = _solve(pp[idx], kind, mm)
        if sub is None:
            return Solution(math.inf, None)
        qp[idx] = sub
    else:
        sub = _solve(pp, kind, m)
        if sub is None:
            return Solution(math.inf, None)
        qp = sub
    q = np.empty_like(qp)
    q[order] = qp
    q = _polish(np.asarray(p, dtype=np.float64), q, kind, order, m)
    # Value: D recomputed in numpy from the cleaned-up optimal q (the solver's own
    # objective evaluates entr/kl_div at round-off negatives as +inf).
    return Solution(div_np(p, q, kind), q)


def _polish(p: np.ndarray, q: np.ndarray, kind: str, order: np.ndarray, m: int | None) -> np.ndarray:
    """Active-set polish (as OSQP/Clarabel-style solvers do): take the set of tokens the
    solver left tied with the constrained token (within 1e-6), set them exactly equal at
    the level that minimises D for that equality set (mean of p for forward/tv, geometric
    mean renormalised for reverse), keep the rest of p, and use this q instead when it is
    feasible and cheaper.  Interior-point solvers stall ~1e-8 short of the optimum on
    nearly degenerate instances; the polished q is still a feasible point of the program,
    so the value remains an honest upper bound on the minimum, just a tighter one."""
    lead = order[0]
    tied = np.flatnonzero(np.abs(q - q[lead]) <= 1e-6)
    cand = p.copy()
    if kind == "reverse":
        if np.any(p[tied] == 0):
            return q
        cand[tied] = math.exp(np.log(p[tied]).mean())
    else:
        cand[tied] = p[tied].mean()
    cand /= cand.sum()
    if m is None:
        feasible = np.all(cand <= cand[lead] * (1 + 1e-15))
    else:
        feasible = np.all(cand[order[1 : m + 1]] >= cand[lead] * (1 - 1e-15))
    if feasible and div_np(p, cand, kind) < div_np(p, q, kind):
        return cand
    return q


# ---------------------------------------------------------------------------
# radii
# ---------------------------------------------------------------------------


class ReferenceSolver:
    """Caches per (p, y) single-token solutions and per (p, M) tree radii, so every
    criterion evaluated on the same p reuses the same convex programs."""

    def __init__(self):
        self._single: dict = {}
        self._tree: dict = {}

    @staticmethod
    def _key(p: np.ndarray):
        return np.asarray(p, dtype=np.float64).tobytes()

    def lift(self, p: np.ndarray, y: int, kind: str) -> Solution:
        """min D(p, q) s.t. q(y) >= q(z) for all z."""
        key = (self._key(p), int(y), kind)
        sol = self._single.get(key)
        if sol is None:
            p = np.asarray(p, dtype=np.float64)
            order = np.array([y] + [z for z in range(p.shape[0]) if z != y])
            sol = solve_pattern(p, kind, order, None)
            self._single[key] = sol
        return sol

    def single_radius(self, spec: str, p: np.ndarray, kind: str, user=None) -> tuple[float, int | None, Solution | None]:
        """(radius, minimising y, its solution) over y in R(p)."""
        best = (math.inf, None, None)
        for y in rejected_set(spec, p, user):
            sol = self.lift(p, int(y), kind)
            if sol.value < best[0]:
                best = (sol.value, int(y), sol)
        return best

    def tree_radius(self, m: int, p: np.ndarray, kind: str) -> tuple[float, tuple | None, Solution | None]:
        key = (self._key(p), m, kind)
        hit = self._tree.get(key)
        if hit is not None:
            return hit
        p = np.asarray(p, dtype=np.float64)
        V = p.shape[0]
        a = argmax_lowest(p)
        others = [z for z in range(V) if z != a]
        best = (math.inf, None, None)
        if m <= V - 1:
            for S in itertools.combinations(others, m):
                rest = [z for z in others if z not in S]
                order = np.array([a, *S, *rest])
                sol = solve_pattern(p, kind, order, m)
                if sol.value < best[0]:
                    best = (sol.value, S, sol)
        self._tree[key] = best
        return best

    def radius(self, spec: str, p: np.ndarray, kind: str, user=None) -> float:
        if spec.startswith("tree:"):
            return self.tree_radius(int(spec.split(":")[1]), p, kind)[0]
        return self.single_radius(spec, p, kind, user)[0]


# ---------------------------------------------------------------------------
# plain full-sort closed form (for vocabularies too large for cvxpy)
# ---------------------------------------------------------------------------


def waterfill_lift(p: np.ndarray, y: int, kind: str) -> float:
    """Closed-form min D(p, q) s.t. q(y) >= q(z) for all z, by brute force over pools.

    The optimal q equalises y with the j largest other tokens at a common level
    and leaves the rest alone.  We evaluate *every* j = 0..V-1 (vectorised with
    cumulative sums, O(V)), keep those whose level is no lower than the largest
    unpooled token (feasible q), and return the cheapest: no argument about
    which j is optimal is needed.
    """
    p = np.asarray(p, dtype=np.float64)
    b = float(p[y])
    s = np.sort(np.delete(p, y))[::-1]
    n = s.shape[0]
    j = np.arange(n + 1)
    C = np.concatenate([[0.0], np.cumsum(s)])  # mass of the j largest others
    nxt = np.concatenate([s, [-np.inf]])  # largest unpooled other token
    if kind == "reverse":
        if b == 0:
            return math.inf
        with np.errstate(divide="ignore"):
            logs = np.log(s)
        logG = (math.log(b) + np.concatenate([[0.0], np.cumsum(logs)])) / (j + 1)
        G = np.exp(logG)
        feas = nxt <= G * (1 + 1e-15)
        # q = (G on the pool, p elsewhere) / Z with Z = (mass outside the pool) + (j+1) G;
        # the outside mass is a suffix sum (never 1 - pooled, which cancels when Z is tiny).
        outside = np.concatenate([np.cumsum(s[::-1])[::-1], [0.0]])
        Z = outside + (j + 1) * G
        cost = -np.log(Z)
    else:
        L = (b + C) / (j + 1)
        feas = nxt <= L
        if kind == "tv":
            cost = _tv_fast(b, s, L, feas)
        else:
            xlogx = np.where(s > 0, s * np.log(np.where(s > 0, s, 1.0)), 0.0)
            X = np.concatenate([[0.0], np.cumsum(xlogx)]) + (b * math.log(b) if b > 0 else 0.0)
            cost = X - (b + C) * np.log(L)
    cost = np.where(feas, cost, np.inf)
    return float(max(cost.min(), 0.0))


def _tv_fast(b, s, L, feas):
    """TV cost per pool size k: sum over the pool {b, s[:k]} of (p - L_k)^+ (s sorted descending)."""
    C = np.concatenate([[0.0], np.cumsum(s)])
    k = np.arange(L.shape[0])
    c = np.minimum(k, np.searchsorted(-s, -L, side="left"))  # pooled tokens strictly above L_k
    out = C[c] - c * L + np.maximum(b - L, 0.0)
    return np.where(feas, out, np.inf)


# ---------------------------------------------------------------------------
# explicit optimal rejecting drafters (for adversarial property tests)
# ---------------------------------------------------------------------------


def lift_q(p: np.ndarray, y: int, kind: str) -> tuple[np.ndarray, float]:
    """The cheapest q with q(y) tied for the maximum, built by water-filling: pool y with
    the j largest other tokens at a common level (arithmetic mean for forward/tv,
    geometric mean then renormalised for reverse), keep the rest of p; every j is tried
    and the cheapest feasible one (level >= every unpooled token) is returned with D(p, q)."""
    p = np.asarray(p, dtype=np.float64)
    others = [z for z in np.argsort(-p, kind="stable") if z != y]
    best = (None, math.inf)
    for j in range(len(others) + 1):
        pool = [y] + others[:j]
        q = p.copy()
        if kind == "reverse":
            if np.any(p[pool] == 0):
                break  # level 0 would zero q(y): no finite-cost drafter with this (or a larger) pool
            q[pool] = math.exp(np.log(p[pool]).mean())
        else:
            q[pool] = p[pool].mean()
        q /= q.sum()
        if j < len(others) and q[others[j]] > q[y] * (1 + 1e-12):
            continue  # an unpooled token stays above the level: not feasible
        d = div_np(p, q, kind)
        if d < best[1]:
            best = (q, d)
    return best


def tree_q(p: np.ndarray, m: int, kind: str) -> tuple[np.ndarray, float]:
    """The cheapest q with the m runners-up of p at or above q(a): pool a with the j
    smallest of them (j = 1..m, cheapest feasible), rest of p unchanged."""
    p = np.asarray(p, dtype=np.float64)
    order = list(np.argsort(-p, kind="stable"))
    a, S = order[0], order[1 : m + 1]
    best = (None, math.inf)
    for j in range(1, m + 1):
        pool = [a] + S[m - j :]  # the j smallest runners-up
        q = p.copy()
        if kind == "reverse":
            with np.errstate(divide="ignore"):
                q[pool] = math.exp(np.log(p[pool]).mean())
        else:
            q[pool] = p[pool].mean()
        if q.sum() == 0:
            continue
        q /= q.sum()
        if any(q[s] < q[a] * (1 - 1e-12) for s in S):
            continue
        d = div_np(p, q, kind)
        if d < best[1]:
            best = (q, d)
    return best
