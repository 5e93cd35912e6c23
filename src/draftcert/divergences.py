"""Divergences between a target p and a drafter q, and the water-filling costs
that give exact radii.

Conventions: natural logarithms (nats); ``forward`` = KL(p||q) (target
first), ``reverse`` = KL(q||p), ``tv`` = (1/2) sum |p - q|.

The two water-filling kernels below are the whole of the exact theory
(docs/theory.md, sections 2-4):

* ``pool_above``  -- the cheapest q that lifts a token of probability b to a
  common level with the tokens above it (single-token criteria).  The pool is
  {y} + the j largest tokens, j chosen so that the level is the *largest*
  mean of b with a prefix of the sorted top.
* ``pool_below``  -- the cheapest q that brings the target's argmax down to a
  common level with some of the m tokens below it (tree coverage).  The level
  is the *smallest* mean of p(1st) with a suffix of p(2nd..m+1).

For forward KL and TV the level is the arithmetic mean of the pooled
probabilities, for reverse KL their geometric mean.
"""

from __future__ import annotations

import torch

from ._arrays import ArrayLike, OutputSpec, check_probs, output_spec, to_tensor
from ._fp import TINY, U, gamma, psi
from . import logit_pass

DIVERGENCES = ("forward", "reverse", "tv")


def check_divergence(kind: str) -> str:
    if kind not in DIVERGENCES:
        raise ValueError(f"divergence: expected one of {', '.join(DIVERGENCES)} (forward = KL(p||q)), got {kind!r}")
    return kind


def _bregman_kl(p: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
    """p log(p/L) - p + L >= 0; summed over a pool whose mean is L it equals the KL term sum."""
    return torch.special.xlogy(p, p / level) - p + level


def _tail(s: torch.Tensor, tail: torch.Tensor | None) -> torch.Tensor:
    return (1 - s.sum(1)).clamp_min(0) if tail is None else tail


def _reverse_cost(gmass: torch.Tensor, pooled: torch.Tensor, outside: torch.Tensor) -> torch.Tensor:
    """KL(q||p) = -log Z of the geometric water-filling, Z = outside + gmass with
    gmass = (pool size) * G the pooled mass after pooling and ``outside`` the mass of p
    outside the pool (summed from nonnegative parts).

    Near Z = 1 (small costs) -log1p(gmass - pooled) keeps full precision.  For small Z
    that difference cancels catastrophically -- pooled rounds to 1 once the rest of p is
    below ~1e-16, giving Z = 0 and radius +inf, an unsound certificate -- so there Z is
    summed from its nonnegative parts instead.
    """
    x = gmass - pooled
    small_z = x < -0.5
    direct = -torch.log(torch.where(small_z, outside + gmass, torch.ones_like(x)))
    return torch.where(small_z, direct, -torch.log1p(torch.where(small_z, torch.zeros_like(x), x)))


def pool_above(s: torch.Tensor, r: torch.Tensor, kind: str, return_level: bool = False, tail: torch.Tensor | None = None):
    """Minimal D(p, q) over q that make the token at sorted position r a maximiser of q.

    s : (N, K) float64, rows sorted descending.  r : (N,) int64 positions (< K).
    The pool may only use positions < r (every token above it); positions
    >= r are <= s[r] and never need to move.  With ``return_level`` also
    returns the water level (arithmetic or geometric mean of the pool).
    ``tail`` (N,): probability mass beyond the K columns (reverse KL needs the mass
    outside the pool; default 1 - sum(s), which is 0 up to round-off for a full row).
    """
    n, K = s.shape
    b = s.gather(1, r[:, None]).squeeze(1)
    j = torch.arange(K + 1, device=s.device)
    valid = j[None, :] <= r[:, None]  # number of pooled top tokens j <= r
    zero = torch.zeros(n, 1, dtype=s.dtype, device=s.device)
    C = torch.cat([zero, s.cumsum(1)], 1)  # C_j = s_0 + ... + s_{j-1}
    if kind == "reverse":
        logs = torch.log(s)
        logC = torch.cat([zero, logs.cumsum(1)], 1)
        logG = ((torch.log(b)[:, None] + logC) / (j + 1)).masked_fill(~valid, -torch.inf)
        logG_star, jstar = logG.max(1)
        pooled = b + C.gather(1, jstar[:, None]).squeeze(1)
        pos = torch.arange(K, device=s.device)[None, :]
        out_mask = (pos >= jstar[:, None]) & (pos != r[:, None])
        outside = torch.where(out_mask, s, torch.zeros_like(s)).sum(1) + _tail(s, tail)
        cost = _reverse_cost((jstar + 1) * torch.exp(logG_star), pooled, outside)
        # b = 0: q(y) >= q(z) > 0 somewhere forces q(y) > 0 = p(y): KL(q||p) = inf.
        cost = torch.where(b > 0, cost.clamp_min(0), torch.full_like(cost, torch.inf))
        return (cost, torch.exp(logG_star)) if return_level else cost
    L = ((b[:, None] + C) / (j + 1)).masked_fill(~valid, -torch.inf)
    L_star, jstar = L.max(1)
    if kind == "tv":
        cost = (L_star - b).clamp_min(0)
    else:
        in_pool = torch.arange(K, device=s.device)[None, :] < jstar[:, None]
        terms = torch.where(in_pool, _bregman_kl(s, L_star[:, None]), torch.zeros_like(s))
        cost = terms.sum(1) + _bregman_kl(b, L_star)
    return (cost, L_star) if return_level else cost


def pool_below(s: torch.Tensor, m: int, kind: str, tail: torch.Tensor | None = None) -> torch.Tensor:
    """Minimal D(p, q) over q with at least m tokens y != a having q(y) >= q(a).

    s : (N, K) float64 sorted descending with K >= m + 1; s[:, 0] = p(a).
    ``tail``: mass beyond the K columns, as in :func:`pool_above`.
    The cheapest such tokens are the next m (positions 1..m); the optimal q
    pools a with the j smallest of them at a common level (minimum over j).
    """
    a = s[:, 0]
    T = s[:, 1 : m + 1].flip(1)  # ascending: the smallest candidate first
    j = torch.arange(1, m + 1, device=s.device)
    C = T.cumsum(1)
    if kind == "reverse":
        logG = (torch.log(a)[:, None] + torch.log(T).cumsum(1)) / (j + 1)
        logG_star, idx = logG.min(1)
        jstar = idx + 1
        pooled = a + C.gather(1, idx[:, None]).squeeze(1)
        # outside the pool: the m - jstar larger candidates, columns beyond m + 1, and the tail
        unpooled = torch.arange(m, device=s.device)[None, :] > idx[:, None]
        outside = torch.where(unpooled, T, torch.zeros_like(T)).sum(1) + s[:, m + 1 :].sum(1) + _tail(s, tail)
        return _reverse_cost((jstar + 1) * torch.exp(logG_star), pooled, outside).clamp_min(0)
    L = (a[:, None] + C) / (j + 1)
    L_star, idx = L.min(1)
    if kind == "tv":
        return (a - L_star).clamp_min(0)
    in_pool = torch.arange(m, device=s.device)[None, :] <= idx[:, None]
    terms = torch.where(in_pool, _bregman_kl(T, L_star[:, None]), torch.zeros_like(T))
    return terms.sum(1) + _bregman_kl(a, L_star)


def log_probs(arr: ArrayLike, is_logits: bool, name: str) -> tuple[torch.Tensor, torch.Tensor, bool, torch.Tensor]:
    """Validated float64 log-probabilities of (..., V) probabilities or logits.

    Returns (log p (..., V) float64, e_L (...) bound on the error of the row's
    log-normaliser, was_numpy, the given values as a tensor).  Logits: log-sum-exp in
    float64.  Probabilities: renormalised in float64, log p = log x - log(sum x)."""
    t, is_numpy = to_tensor(arr, name)
    V = t.shape[-1]
    x = t.double()
    if is_logits:
        m = x.amax(-1, keepdim=True)
        if not bool(torch.isfinite(m).all()):
            raise ValueError(f"{name}: logits contain NaN or +inf, or a row is entirely -inf")
        s = torch.exp(x - m).sum(-1, keepdim=True)
        log_s = torch.log(s)
        L = m + log_s
        if not bool(torch.isfinite(L).all()):
            raise ValueError(f"{name}: logits contain NaN or +inf, or a row is entirely -inf")
        lp = x - L
        err = gamma(2 * V + 8) + 4 * U * (L.abs() + log_s.abs() + 2)
    else:
        S = x.sum(-1, keepdim=True)
        check_probs(t, name, row_sum=S[..., 0])
        logS = torch.log(S)
        lp = torch.log(x) - logS
        err = gamma(V + 2) + 4 * U * (logS.abs() + 1)
    return lp, err[..., 0], is_numpy, t


def divergence_upper(lp: torch.Tensor, lq: torch.Tensor, ep: torch.Tensor, eq: torch.Tensor, kind: str) -> torch.Tensor:
    """Upper bound on the exact D(p, q) from float64 log-probabilities (N, V) with
    log-normaliser error bounds ep, eq (N,): docs/theory.md, section 7.

    KL is summed in log space as nonnegative Bregman terms, KL(p||q) = sum q psi(log p/q)
    and KL(q||p) = sum p psi(log q/p) with psi(w) = 1 + (w - 1) e^w (``_fp.psi``: a series
    where it would cancel), so nothing cancels at any size; the common normaliser errors
    only scale the sum (generalised KL of c p and d q is >= c KL(p||q)), and every
    per-entry rounding adds a first-order term to the bound."""
    V = lp.shape[-1]
    fin = lambda t: torch.where(torch.isfinite(t), t, torch.zeros_like(t)).abs()  # noqa: E731
    # bounds on the normaliser errors (broadcast per row)
    Lp_mag, Lq_mag = ep[:, None], eq[:, None]
    if kind == "tv":
        p, q = torch.exp(lp), torch.exp(lq)
        bp = U * (2 * fin(lp) + 6)
        bq = U * (2 * fin(lq) + 6)
        main = (p - q).abs().sum(-1) * (1 + gamma(V + 4))
        slack = (p * torch.expm1(Lp_mag + bp)).sum(-1) + (q * torch.expm1(Lq_mag + bq)).sum(-1)
        return (0.5 * (main + slack * (1 + gamma(V + 4)))) * (1 + 4 * U) + TINY
    if kind == "reverse":
        lp, lq = lq, lp
        ep, eq = eq, ep
    # forward form: KL(P||Q) = sum_i Q_i psi(log P_i - log Q_i)
    w = lp - lq
    q = torch.exp(lq)
    p = torch.exp(lp)
    ps, perr = psi(torch.where(torch.isnan(w), torch.zeros_like(w), w))
    beta = U * (2 * fin(lq) + 6) * 1.01
    eta = U * (2 * fin(lp) + 2 * fin(lq) + fin(w) + 10) * 1.01
    wf = fin(w)
    term = q * ps
    bad = torch.isposinf(lq.neg()) & torch.isposinf(w)  # q = 0 < p: infinite
    # exact P > 0 iff log P > -inf (exp(lp) may underflow to 0 for a tiny exact P)
    pos = ~torch.isneginf(lp)
    term = torch.where(torch.isnan(term) | bad, torch.where(pos, torch.full_like(term, torch.inf), torch.zeros_like(term)), term)
    # Q below the normal range (q = exp(lq) underflowed or subnormal, lq finite): q psi(w)
    # loses its relative accuracy; bound the exact term Q psi(w) = Q + (w - 1) P instead by
    # Q + max(w - 1, 0) P (Q < 2 TINY; P = exp(lp) up to the rounding of lp, eta)
    sub = (q < TINY) & torch.isfinite(lq) & torch.isfinite(lp)
    sub_term = 2 * TINY * (1 + wf) + ((w - 1).clamp_min(0) + eta * (1 + wf)) * p * torch.exp(2 * eta) * (1 + 8 * U)
    term = torch.where(sub, sub_term, term)
    deriv = torch.where(torch.isfinite(lp), p * eta * (wf + eta) * torch.exp(eta) * (1 + 8 * U), torch.zeros_like(p))
    err = term * (8 * U + beta) / (1 - beta) + torch.where(torch.isfinite(lq), q * perr, torch.zeros_like(q)) + deriv
    err = torch.where(torch.isnan(err), torch.zeros_like(err), err)
    total = (term.sum(-1) + err.sum(-1)) * (1 + gamma(V + 4))
    return total * torch.exp(ep) * (1 + 8 * U) + TINY


# Rows per chunk of the row-wise float64 passes here: their float64 buffers (CHUNK_ELEMENTS * 8
# bytes each, at least one row) then stay in the CPU's cache instead of streaming through
# memory once per elementwise op (1 row at V = 49k and 152k).
CHUNK_ELEMENTS = 1 << 16


def row_chunk(x: torch.Tensor) -> int:
    """Rows per chunk for row-wise float64 work on (N, V) input: on the CPU a few rows at a
    time, so the float64 temporaries stay in cache instead of streaming through memory
    once per elementwise op; elsewhere all rows at once.  Every op is row-wise (a row's
    reductions run over that row alone), so the result does not depend on the chunk."""
    if x.device.type != "cpu":
        return max(1, x.shape[0])
    return max(1, min(x.shape[0], CHUNK_ELEMENTS // max(1, x.shape[-1])))


# Two ulps of exp/log (docs/theory.md, section 7) and float64 underflow, as used below.
_EXP_REL = 4 * U
_HALF_TINY = 2.0**-1021


def fused_pass_reason() -> str:
    """"" where ``_logit_pair_pass`` runs the fused native pass on float32, float16 and bfloat16
    CPU rows, else why not (``draftcert.logit_pass``)."""
    return logit_pass.reason("divergence")


def exp_fused(a: torch.Tensor) -> torch.Tensor:
    """The fused pass's float64 exp on float64 ``a`` (for its tests): relative error <= 2 U where
    e^a >= 2^-1021, 0 below a = -708.  RuntimeError where the fused pass is unavailable."""
    if fused_pass_reason():
        raise RuntimeError(f"fused divergence pass unavailable: {fused_pass_reason()}")
    return logit_pass.exp_fused(a)


def _logit_pair_pass(x: torch.Tensor, y: torch.Tensor, full: bool) -> dict[str, torch.Tensor]:
    """One chunked float64 pass over rows of target logits x and drafter logits y [N, V].

    With a = fl(x - max x) <= 0, b = fl(y - max y) <= 0, d = fl(a - b), S_p = sum e^a,
    S_q = sum e^b, T = sum e^a d (everything float64; float16/bfloat16/float32 logits are
    exact in float64):

        KL(p||q) = T / S_p - log S_p + log S_q               -> "kl" and its enclosure "lo", "hi"
        KL(q||p) = -sum e^b d / S_q - log S_q + log S_p      -> "kl_reverse"      (full)
        TV       = (1/2) sum |e^a / S_p - e^b / S_q|         -> "tv"              (full)
        log Z_q  = max y + log S_q                           -> "log_zq"          (full)

    The enclosure [lo, hi] of the exact forward KL (docs/theory.md, section 7, "One
    decision"): each e^a carries a relative U(1.1|a| + 5) (the subtraction and a 2-ulp exp; an
    absolute 2^-1021 where it underflows) and |a| <= m_a = -min a, so with M = m_a + m_b
        dS_p = 1.02 U (1.1 m_a + 5) + 1.01 gamma_V + V 2^-1021 / S_p     (relative, S_p >= 1)
        eT / S_p = (1.02 gamma_V + 8.3 U) M + 1.13 U M^2 + V 2^-1020 M / S_p
    (each product e^a d is within (U(1.1|a| + 5) + 3.2 U) e^a (|a| + |b|); the mixed-sign sum
    adds gamma_V sum e^a (|a| + |b|)), and the quotient, the two logs and the two additions add
        e = 1.01 [|Q| (dS_p/(1 - dS_p) + U) + (eT/S_p)/(1 - dS_p) + dS_p/(1 - dS_p) + dS_q/(1 - dS_q)
                  + 4U (|log S_p| + |log S_q|) + 2U (|Q| + |log S_p| + |log S_q|)],   Q = T / S_p
    (1.01 covers the rounding of e itself).  Rows with a non-finite logit, or dS >= 1e-3, get
    [0, inf]: undecided.  The interval's arithmetic is the same whether ``full`` or not, so
    the profiler (full) and ``forward_kl_interval`` get the same bits.

    On float32 (or float16 / bfloat16) CPU rows the reductions come from one fused native pass
    (``logit_pass.c``, where it builds with AVX-512; ``DRAFTCERT_FUSED_DIVERGENCE=0`` or
    ``DRAFTCERT_NATIVE=0`` turn it off): the same operations per element, its own exp within
    2 U (inside the 2 ulps charged above), the sums in another order (inside gamma_V), reading
    each row once instead of a dozen float64 passes.  A row's values depend on that row alone
    either way.
    """
    n, V = x.shape
    fused = logit_pass.pair_reductions(x, y, full)
    if fused is not None:
        s_p, s_q, t, t_q, tv, m_a, m_b, max_y = fused.unbind(1)
        tv = tv / s_q * 0.5
        rows = torch.isnan(s_p).nonzero().squeeze(1)  # a non-finite logit: torch's pass gives its bits
        if rows.numel():
            sub = _torch_reductions(x[rows], y[rows], full)
            for col, val in zip((s_p, s_q, t, t_q, tv, m_a, m_b, max_y), sub):
                if val is not None:
                    col[rows] = val
    else:
        s_p, s_q, t, t_q, tv, m_a, m_b, max_y = _torch_reductions(x, y, full)
    return _pair_bounds(V, s_p, s_q, t, t_q, tv, m_a, m_b, max_y, full)


def _torch_reductions(x: torch.Tensor, y: torch.Tensor, full: bool):
    """The pass's row reductions by torch, a few rows at a time: (S_p, S_q, T, T_q, TV, max|a|,
    max|b|, max y), T_q and TV None unless ``full``."""
    n, V = x.shape
    f64 = dict(dtype=torch.float64, device=x.device)
    # Per row: the row reductions come from the chunked pass; the bound arithmetic on them runs
    # once, vectorised, after it (per-chunk work on one-row tensors costs more than the pass).
    s_p, s_q, t, m_a, m_b, max_y = (torch.empty(n, **f64) for _ in range(6))
    t_q = tv = None
    if full:
        t_q, tv = torch.empty(n, **f64), torch.empty(n, **f64)
    step = row_chunk(x)
    # Float64 work buffers reused by every chunk: fresh (rows, V) temporaries per op cost
    # more in allocation and page faults than the arithmetic.
    A, B, D, G = (torch.empty(step, V, **f64) for _ in range(4))
    for i in range(0, n, step):
        j = min(n, i + step)
        a, b, d, g = A[: j - i], B[: j - i], D[: j - i], G[: j - i]
        # min and max are exact in any dtype (taken on the given values: half the bytes of
        # float64 for float32 logits), and min fl(x - max x) = -fl(max x - min x) (monotone rounding)
        mx, my = x[i:j].amax(1).double(), y[i:j].amax(1).double()
        m_a[i:j] = mx - x[i:j].amin(1).double()               # max |a|
        m_b[i:j] = my - y[i:j].amin(1).double()               # max |b|
        max_y[i:j] = my
        a.copy_(x[i:j]).sub_(mx[:, None])                     # a = fl(x - max x) <= 0   [rows, V]
        b.copy_(y[i:j]).sub_(my[:, None])
        torch.sub(a, b, out=d)                                # d = a - b
        a.exp_(), b.exp_()                                    # e^a, e^b
        s_p[i:j], s_q[i:j] = a.sum(1), b.sum(1)
        t[i:j] = torch.mul(a, d, out=g).sum(1)                # T = sum e^a d
        if full:
            t_q[i:j] = torch.mul(b, d, out=g).sum(1)          # sum e^b d
            # TV = (1/2) sum |e^a (S_q / S_p) - e^b| / S_q: one multiply per element instead of two divisions
            tv[i:j] = a.mul_((s_q[i:j] / s_p[i:j])[:, None]).sub_(b).abs_().sum(1).div_(s_q[i:j]).mul_(0.5)
    return s_p, s_q, t, t_q, tv, m_a, m_b, max_y


def _pair_bounds(V, s_p, s_q, t, t_q, tv, m_a, m_b, max_y, full: bool) -> dict[str, torch.Tensor]:
    """The pass's outputs from its row reductions: the estimates and the enclosure [lo, hi]
    (the error model in ``_logit_pair_pass``'s docstring)."""
    gV = gamma(V)
    log_sp, log_sq = torch.log(s_p), torch.log(s_q)
    quot = t / s_p
    k = quot - log_sp + log_sq
    big_m = m_a + m_b
    ds_p = 1.02 * U * (1.1 * m_a + 5) + 1.01 * gV + V * _HALF_TINY / s_p
    ds_q = 1.02 * U * (1.1 * m_b + 5) + 1.01 * gV + V * _HALF_TINY / s_q
    e_t = (1.02 * gV + 8.3 * U) * big_m + 1.13 * U * big_m * big_m + V * 2 * _HALF_TINY * big_m / s_p  # eT / S_p
    e = 1.01 * (quot.abs() * (ds_p / (1 - ds_p) + U) + e_t / (1 - ds_p) + ds_p / (1 - ds_p)
                + ds_q / (1 - ds_q) + _EXP_REL * (log_sp.abs() + log_sq.abs())
                + 2 * U * (quot.abs() + log_sp.abs() + log_sq.abs()))
    ok = torch.isfinite(k) & torch.isfinite(e) & (ds_p < 1e-3) & (ds_q < 1e-3)
    out = {
        "kl": k,
        "lo": torch.where(ok, ((k - e) - 4 * U * (k - e).abs() - TINY).clamp_min(0), torch.zeros_like(k)),
        "hi": torch.where(ok, (k + e) * (1 + 4 * U) + TINY, torch.full_like(k, torch.inf)),
    }
    if full:
        out.update(kl_reverse=log_sp - log_sq - t_q / s_q, tv=tv, log_zq=max_y + log_sq)
    return out


def forward_kl_interval(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[lo, hi] enclosing the exact KL(softmax x || softmax y) per row, from one cheap pass.

    x, y : [N, V] target and drafter logits (any float dtype).  The error model is in
    ``_logit_pair_pass``'s docstring and docs/theory.md, section 7: the width is ~V U times
    the logits' range, about 1e-9 at V = 151,936; a dozen float64 passes per row against ~100
    for :func:`divergence_upper`.  Rows with a non-finite logit (a masked token) get [0, inf].
    """
    r = _logit_pair_pass(x, y, full=False)
    return r["lo"], r["hi"]


def divergences_from_logits(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """KL(p||q), KL(q||p), TV, the exact log-normaliser of q and the certificate's enclosure of
    KL(p||q), for rows of target logits x and drafter logits y [N, V], in float64, in one pass.

    Returns {"kl", "kl_reverse", "tv", "log_zq", "lo", "hi"}, each [N]: ``lo``, ``hi`` are
    bit for bit :func:`forward_kl_interval`'s (the profiler hands them to ``certify_rows``);
    the others are float64 estimates accurate to ~V U.  Rows with a non-finite logit (a
    masked token gives inf - inf or 0 * inf) are recomputed with 0 log 0 = 0 made explicit,
    which gives +inf exactly when the support condition fails.
    """
    r = _logit_pair_pass(x, y, full=True)
    broken = ~(torch.isfinite(r["kl"]) & torch.isfinite(r["kl_reverse"]))
    if bool(broken.any()):
        i = broken.nonzero().squeeze(1)
        lp = torch.log_softmax(x[i].double(), dim=1)
        lq = torch.log_softmax(y[i].double(), dim=1)
        p, q = lp.exp(), lq.exp()
        zero = torch.zeros((), dtype=torch.float64, device=x.device)
        r["kl"][i] = torch.where(p > 0, p * (lp - lq), zero).sum(1)
        r["kl_reverse"][i] = torch.where(q > 0, q * (lq - lp), zero).sum(1)
        r["tv"][i] = 0.5 * (p - q).abs().sum(1)
        r["log_zq"][i] = torch.logsumexp(y[i].double(), dim=1)
    # rounding can leave the KL of identical distributions at -1e-17: clamp to its true range
    r["kl"] = r["kl"].clamp_min(0)
    r["kl_reverse"] = r["kl_reverse"].clamp_min(0)
    return r


def divergence(
    target_probs: ArrayLike | None = None,
    draft_probs: ArrayLike | None = None,
    kind: str = "forward",
    *,
    target_logits: ArrayLike | None = None,
    draft_logits: ArrayLike | None = None,
) -> ArrayLike:
    """D(p, q) for target p and drafter q, shape (..., V) each (broadcasting) -> (...).

    kind: ``forward`` = KL(p||q) = sum p log(p/q); ``reverse`` = KL(q||p);
    ``tv`` = (1/2) sum |p - q|.  Infinite where the support condition fails.
    Computed in float64 from the given values (probability rows renormalised) and
    rounded up: never below the exact divergence (docs/theory.md, section 7).
    """
    check_divergence(kind)
    if (target_probs is None) == (target_logits is None):
        raise ValueError("pass exactly one of target_probs or target_logits=")
    if (draft_probs is None) == (draft_logits is None):
        raise ValueError("pass exactly one of draft_probs or draft_logits=")
    tn = "target_probs" if target_logits is None else "target_logits"
    dn = "draft_probs" if draft_logits is None else "draft_logits"
    lp, ep, p_np, pt = log_probs(target_probs if target_logits is None else target_logits, target_logits is not None, tn)
    lq, eq, _, qt = log_probs(draft_probs if draft_logits is None else draft_logits, draft_logits is not None, dn)
    d, shape = _pair_rows(lp, ep, lq, eq, tn, dn, kind)
    out = output_spec(pt if pt.dtype == torch.float64 or qt.dtype != torch.float64 else qt, p_np)
    out = OutputSpec(out.is_numpy, out.dtype, tuple(shape), pt.device)
    return out.wrap(d, direction="up")


def _pair_rows(lp, ep, lq, eq, tn, dn, kind):
    if lp.shape[-1] != lq.shape[-1]:
        raise ValueError(f"{dn}: vocabulary size {lq.shape[-1]} differs from the target's {lp.shape[-1]}")
    lq, eq = lq.to(lp.device), eq.to(lp.device)
    try:
        lp, lq = torch.broadcast_tensors(lp, lq)
        ep, eq = torch.broadcast_tensors(ep, eq)
    except RuntimeError:
        raise ValueError(f"{dn}: shape {tuple(lq.shape)} does not broadcast with target shape {tuple(lp.shape)}") from None
    V = lp.shape[-1]
    shape = lp.shape[:-1]
    d = divergence_upper(lp.reshape(-1, V), lq.reshape(-1, V), ep.reshape(-1), eq.reshape(-1), kind)
    return d, shape
