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

from ._arrays import ArrayLike, check_probs, output_spec, to_tensor

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


def divergence_rows(p: torch.Tensor, q: torch.Tensor, kind: str) -> torch.Tensor:
    """(N, V) x (N, V) -> (N,) in the inputs' dtype (float64 recommended).

    KL is clamped at 0: it is non-negative, and a round-off negative would
    "certify" against a radius of exactly 0 (a rule that already rejects q = p).
    """
    if kind == "forward":
        return (torch.special.xlogy(p, p) - torch.special.xlogy(p, q)).sum(-1).clamp_min(0)
    if kind == "reverse":
        return (torch.special.xlogy(q, q) - torch.special.xlogy(q, p)).sum(-1).clamp_min(0)
    return 0.5 * (p - q).abs().sum(-1)


def probs_from(arr: ArrayLike, is_logits: bool, name: str) -> tuple[torch.Tensor, bool]:
    """Validated probabilities (same dtype) from probabilities or logits."""
    t, is_numpy = to_tensor(arr, name)
    if is_logits:
        lse = torch.logsumexp(t, -1)
        if not bool(torch.isfinite(lse).all()):
            raise ValueError(f"{name}: logits contain NaN or +inf, or a row is entirely -inf")
        return torch.exp(t - lse[..., None]), is_numpy
    check_probs(t, name)
    return t, is_numpy


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
    """
    check_divergence(kind)
    if (target_probs is None) == (target_logits is None):
        raise ValueError("pass exactly one of target_probs or target_logits=")
    if (draft_probs is None) == (draft_logits is None):
        raise ValueError("pass exactly one of draft_probs or draft_logits=")
    p, p_np = probs_from(target_probs if target_logits is None else target_logits, target_logits is not None, "target_probs" if target_logits is None else "target_logits")
    q, _ = probs_from(draft_probs if draft_logits is None else draft_logits, draft_logits is not None, "draft_probs" if draft_logits is None else "draft_logits")
    if p.shape[-1] != q.shape[-1]:
        raise ValueError(f"draft_probs: vocabulary size {q.shape[-1]} differs from the target's {p.shape[-1]}")
    try:
        p, q = torch.broadcast_tensors(p, q.to(p.device))
    except RuntimeError:
        raise ValueError(f"draft_probs: shape {tuple(q.shape)} does not broadcast with target shape {tuple(p.shape)}") from None
    out = output_spec(p if p.dtype == torch.float64 or q.dtype != torch.float64 else q, p_np)
    d = divergence_rows(p.double(), q.double(), kind)
    return out.wrap(d)
