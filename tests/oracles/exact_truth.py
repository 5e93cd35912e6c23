"""Independent exact truth for the soundness suite (imports nothing from draftcert).

Everything is decided on the *given* values (float16 / bfloat16 / float32 / float64,
probabilities or logits), as the floating-point contract of docs/theory.md (section 7)
states it: probability rows are renormalised exactly (p = x / sum x), logits give
p = softmax(x) exactly, the drafter proposes the argmax of its given values (lowest index
among ties), and each rule is evaluated in exact arithmetic.  Order statistics (strict,
top-M, trees, MARS's choice of threshold) are exact comparisons of the given values; the
other thresholds are computed in float64 with a wide margin, and every row within that
margin is recomputed in 400-bit (then 2400-bit) arithmetic with mpmath.

``exact_radius`` / ``exact_divergence``: the closed forms of docs/theory.md (sections 2-3)
in mpmath, for small V.
"""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import numpy as np

TYPICAL_C = 1e-5


def probs64(vals: np.ndarray, is_logits: bool) -> np.ndarray:
    """float64 probabilities (accurate to ~1e-15 relative): the fast first guess."""
    v = vals.astype(np.float64)
    if is_logits:
        m = v.max(-1, keepdims=True)
        e = np.exp(v - m)
        return e / e.sum(-1, keepdims=True)
    return v / v.sum(-1, keepdims=True)


def exact_probs(row: np.ndarray, is_logits: bool) -> list:
    """mpmath probabilities of one row at the current working precision."""
    mp = mpmath.mp
    vals = [float(v) for v in row]
    if is_logits:
        m = max(v for v in vals if v != -math.inf)
        e = [mp.exp(mp.mpf(v) - m) if v != -math.inf else mp.mpf(0) for v in vals]
    else:
        e = [mp.mpf(v) for v in vals]
    S = mp.fsum(e)
    return [x / S for x in e]


def parse(spec: str):
    name, *args = spec.split(":")
    return name, [float(a) for a in args]


def _tau_exact(name: str, args: list, P: list):
    mp = mpmath.mp
    mx = max(P)
    if name == "additive":
        return mx - mp.mpf(args[0])
    if name == "multiplicative":
        return mp.mpf(args[0]) * mx
    if name == "user":  # LevelSet(lambda p: c * max p)
        return mp.mpf(args[0]) * mx
    if name in ("entropy", "typical"):
        eps, dl = (args + [0.09, 0.3][len(args):])[:2]
        if name == "entropy":
            h = -mp.fsum(v * mp.log(v) for v in P if v > 0)
        else:
            c = mp.mpf(TYPICAL_C)
            h = -mp.fsum(v * mp.log(v + c) for v in P)
        return min(mp.mpf(eps), mp.mpf(dl) * mp.exp(-h))
    raise ValueError(name)


INCLUSIVE = {"entropy", "typical"}


def _accept_value_exact(name, args, row, is_logits, x) -> bool:
    for prec in (400, 2400):
        with mpmath.workprec(prec):
            P = exact_probs(row, is_logits)
            d = P[x] - _tau_exact(name, args, P)
            tie = abs(d) <= mpmath.mpf(2) ** (100 - prec)
            if not tie or prec == 2400:
                if tie:
                    d = 0
                return bool(d > 0) if name in INCLUSIVE else bool(d >= 0)


def _mars_close(theta: float, v1: float, v2: float, is_logits: bool) -> bool:
    if is_logits:
        return v2 != -math.inf and Fraction(v1) - Fraction(v2) <= Fraction(theta)
    if v2 == 0:
        return False
    with mpmath.workprec(2400):
        return bool(mpmath.log(mpmath.mpf(v1) / mpmath.mpf(v2)) <= mpmath.mpf(theta))


def truth_accepts(spec: str, t: np.ndarray, t_logits: bool, q: np.ndarray) -> np.ndarray:
    """(n,) exact acceptance of the drafter's proposal for rows of given values t (n, V)
    (target) and q (n, V) (drafter; only its order matters), both float64 copies of the
    given values (exact conversions)."""
    name, args = parse(spec)
    n, V = t.shape
    x = q.argmax(1)  # numpy: first occurrence = lowest index among ties
    rows = np.arange(n)
    tx = t[rows, x]
    srt = -np.sort(-t, axis=1)
    if name == "strict":
        return tx >= srt[:, 0]
    if name == "topm":
        return tx >= srt[:, int(args[0]) - 1]
    if name == "relaxed":  # top N (ties counted) and p(x) >= max p - DELTA
        return (tx >= srt[:, int(args[0]) - 1]) & truth_accepts(f"additive:{args[1]!r}", t, t_logits, q)
    if name == "tree":
        m = int(args[0])
        a = t.argmax(1)
        qa = q[rows, a]
        ids = np.arange(V)[None, :]
        ahead = (q > qa[:, None]) | ((q == qa[:, None]) & (ids < a[:, None]))
        return ahead.sum(1) < m
    if name == "mars":
        close = np.array([_mars_close(args[0], srt[i, 0], srt[i, 1], t_logits) for i in range(n)])
        return tx >= np.where(close, srt[:, 1], srt[:, 0])
    # value thresholds: float64 first, exact where it is close
    P = probs64(t, t_logits)
    px = P[rows, x]
    p1 = P.max(1)
    if name == "additive":
        tau = p1 - args[0]
    elif name in ("multiplicative", "user"):
        tau = args[0] * p1
    else:
        eps, dl = (args + [0.09, 0.3][len(args):])[:2]
        with np.errstate(divide="ignore", invalid="ignore"):
            if name == "entropy":
                h = -np.where(P > 0, P * np.log(np.where(P > 0, P, 1)), 0).sum(1)
            else:
                h = -(P * np.log(P + TYPICAL_C)).sum(1)
        tau = np.minimum(eps, dl * np.exp(-h))
    acc = px > tau if name in INCLUSIVE else px >= tau
    near = np.abs(px - tau) <= 1e-9 * (np.abs(tau) + px) + 1e-300
    for i in np.flatnonzero(near):
        acc[i] = _accept_value_exact(name, args, t[i], t_logits, int(x[i]))
    return acc


def rejected_exact(spec: str, t_row: np.ndarray, t_logits: bool) -> list[int]:
    """Token ids the rule rejects (exact), one row; small V only."""
    V = t_row.shape[0]
    out = []
    for y in range(V):
        q = np.full((1, V), -1.0)
        q[0, y] = 1.0
        if not truth_accepts(spec, t_row[None, :], t_logits, q)[0]:
            out.append(y)
    return out


def _lift(P: list, y: int, kind: str):
    """Exact cost of making token y a maximiser (water-filling, docs/theory.md section 3)."""
    mp = mpmath.mp
    b = P[y]
    others = sorted((P[i] for i in range(len(P)) if i != y), reverse=True)
    if kind == "reverse" and b == 0:
        return mp.inf
    best_level, best_j = None, 0
    for j in range(len(others) + 1):
        pool = [b] + others[:j]
        if kind == "reverse":
            lvl = mp.exp(mp.fsum(mp.log(v) for v in pool) / len(pool)) if min(pool) > 0 else mp.mpf(0)
        else:
            lvl = mp.fsum(pool) / len(pool)
        if best_level is None or lvl > best_level:
            best_level, best_j = lvl, j
    pool = [b] + others[:best_j]
    L = best_level
    if kind == "tv":
        return L - b
    if kind == "forward":
        return mp.fsum(v * mp.log(v / L) for v in pool if v > 0)
    outside = mp.fsum(others[best_j:])
    return -mp.log(outside + len(pool) * L)


def _tree(P: list, a: int, m: int, kind: str):
    mp = mpmath.mp
    comp = sorted((P[i] for i in range(len(P)) if i != a), reverse=True)[:m]
    pa = P[a]
    T = sorted(comp)  # ascending
    best, best_j = None, 1
    for j in range(1, m + 1):
        pool = [pa] + T[:j]
        if kind == "reverse":
            lvl = mp.exp(mp.fsum(mp.log(v) for v in pool) / len(pool)) if min(pool) > 0 else mp.mpf(0)
        else:
            lvl = mp.fsum(pool) / len(pool)
        if best is None or lvl < best:
            best, best_j = lvl, j
    L, pool = best, [pa] + T[:best_j]
    if kind == "tv":
        return pa - L
    if kind == "forward":
        return mp.fsum(v * mp.log(v / L) for v in pool if v > 0)
    rest = 1 - mp.fsum(pool)
    z = rest + len(pool) * L
    return mp.inf if z <= 0 else -mp.log(z)


def exact_radius(spec: str, t_row: np.ndarray, t_logits: bool, kind: str):
    """Exact radius (mpmath, 200 bits) of one small row of given values."""
    name, args = parse(spec)
    with mpmath.workprec(200):
        P = exact_probs(t_row, t_logits)
        if name == "tree":
            m = int(args[0])
            if m >= len(P):
                return mpmath.inf
            a = int(np.argmax(t_row))
            return _tree(P, a, m, kind)
        rej = rejected_exact(spec, t_row, t_logits)
        if not rej:
            return mpmath.inf
        return min(_lift(P, y, kind) for y in rej)


def exact_divergence(t_row, t_logits, q_row, q_logits, kind: str):
    with mpmath.workprec(200):
        P, Q = exact_probs(t_row, t_logits), exact_probs(q_row, q_logits)
        mp = mpmath.mp
        if kind == "tv":
            return mp.fsum(abs(p - q) for p, q in zip(P, Q)) / 2
        if kind == "reverse":
            P, Q = Q, P
        total = mp.mpf(0)
        for p, q in zip(P, Q):
            if p == 0:
                continue
            if q == 0:
                return mp.inf
            total += p * mp.log(p / q)
        return total
