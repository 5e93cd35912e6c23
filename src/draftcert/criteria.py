"""Deterministic acceptance criteria for speculative decoding.

Every single-token rule here rejects a drafted token ``x`` exactly when it lies
in a lower level set of the target distribution ``p``::

    R(p) = {y : p(y) < tau(p)}          (inclusive=False)
    R(p) = {y : p(y) <= tau(p)}         (inclusive=True)

so a rule is fully described by its threshold function ``tau``.  ``LevelSet``
is the generic form (give ``tau`` and get exact radii for free); the named
rules are instances of it.  ``TreeCoverage`` is the tree rule: the target's
greedy token must be among the drafter's top-m.

Spec grammar (``parse_criterion``)::

    strict | additive:DELTA | multiplicative:ALPHA | topm:M | relaxed:N:DELTA
    | entropy[:EPSILON[:DELTA]] | typical[:EPSILON[:DELTA]] | mars:THETA | tree:M
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Callable

import torch

from ._arrays import ArrayLike
from ._fp import TINY, U, gamma
from .summary import TYPICAL_EPS, Summary, summarize

__all__ = [
    "Criterion",
    "LevelSet",
    "Strict",
    "Additive",
    "Multiplicative",
    "TopM",
    "RelaxedAcceptance",
    "EntropyThreshold",
    "TypicalAcceptance",
    "MarginAware",
    "TreeCoverage",
    "parse_criterion",
    "DEFAULT_CRITERIA",
]


class Criterion:
    """Base class. ``spec`` is the canonical spec string (the key used in traces)."""

    spec: str = ""
    needs_entropy: bool = False
    #: how many of the largest target probabilities the rule needs to see
    min_k: int = 2

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"

    def __str__(self) -> str:
        return self.spec

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Criterion) and type(other) is type(self) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.spec))


class LevelSet(Criterion):
    """Generic lower-level-set rule: reject ``x`` iff ``p(x) < tau(p)`` (``<=`` if inclusive).

    Parameters
    ----------
    threshold : callable mapping float64 probabilities ``(N, V)`` to ``tau`` of shape ``(N,)``.
    inclusive : reject on equality too (``p(x) <= tau``).
    name : spec string used as the key in results.

    Exact radii, margin bounds and acceptance tests come for free from ``tau``.
    Built-in rules override :meth:`threshold_from_summary` to read ``tau`` off the
    top-k statistics instead of the full distribution.
    """

    inclusive: bool = False

    def __init__(self, threshold: Callable[[torch.Tensor], torch.Tensor], *, inclusive: bool = False, name: str = "levelset"):
        if not callable(threshold):
            raise ValueError("threshold: expected a callable mapping probabilities (N, V) to tau (N,)")
        self._threshold = threshold
        self.inclusive = bool(inclusive)
        self.spec = name

    # -- threshold -------------------------------------------------------
    def threshold_from_summary(self, s: Summary) -> torch.Tensor:
        """tau for every row of a summary, float64 (N,)."""
        tau = torch.as_tensor(self._threshold(s.probs_f64()), dtype=torch.float64, device=s.top_probs.device)
        tau = tau.reshape(-1)
        if tau.shape[0] != s.top_probs.shape[0]:
            raise ValueError(f"threshold of {self.spec!r} returned shape {tuple(tau.shape)}; expected one value per row")
        if bool(torch.isnan(tau).any()):
            raise ValueError(f"threshold: the threshold function of {self.spec!r} returned NaN; it must return a number per row")
        return tau

    # -- floating-point contract (docs/theory.md, section 7) -------------------
    def tau_bounds(self, s: Summary) -> tuple[torch.Tensor, torch.Tensor]:
        """(tau_lo, tau_hi) bracketing the threshold of the exact distribution.  A user rule's
        threshold is its function's value on the float64 probabilities, taken as given."""
        t = self.threshold_from_summary(s)
        return t, t

    def rejection_cut(self, s: Summary) -> torch.Tensor:
        """(N,) cut c with R(p) contained in {y : x_y < c} (x the given values): the tokens the
        exact rule might reject, decided by exact comparisons of the given values."""
        return s.cut_from_tau(self.tau_bounds(s)[1], self.inclusive)

    #: the rejection region is decided by exact comparisons of the given values (rules
    #: whose threshold is one of the values); otherwise near-threshold tokens are settled
    #: in arbitrary precision
    exact_order: bool = False

    def sure(self, s: Summary, rows: torch.Tensor, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(surely accepted, surely rejected) for tokens with given values ``vals`` (n,) in
        rows ``rows`` (n,), from float64 and the error bounds of docs/theory.md, section 7."""
        v = vals[:, None]
        px = s.to_prob(v, rows)[:, 0]
        tau_lo, tau_hi = self.tau_bounds(s)
        tau_lo, tau_hi = tau_lo[rows], tau_hi[rows]
        e = s.common_err(rows) + s.entry_err(v, rows)[:, 0] + 4 * U
        px_lo, px_hi = px * (1 - e), px * (1 + e) + TINY * ~s.zero_mask(v)[:, 0]
        if self.inclusive:  # accept iff p > tau
            return px_lo > tau_hi, px_hi <= tau_lo
        return px_lo >= tau_hi, px_hi < tau_lo  # accept iff p >= tau

    def accept_ids(self, s: Summary, ids: torch.Tensor) -> torch.Tensor:
        """(N,) bool: is token ids[n] accepted by the rule evaluated exactly on the given
        values?  float64 decides every row whose p(x) is clear of the threshold by more
        than the error bounds; the others are decided in arbitrary precision (mpmath).
        ``ids`` may also be (N, K) (K tokens per row): then (N, K), the same decisions."""
        n = ids.shape[0]
        rows = torch.arange(n, device=ids.device)
        if ids.ndim == 2:
            rows = rows[:, None].expand(ids.shape).reshape(-1)
        flat = ids.reshape(-1)
        acc, rej = self.sure(s, rows, s.source[rows, flat])
        out = acc.clone()
        unsure = (~acc & ~rej).nonzero().squeeze(1)
        if unsure.numel():
            tau = self.threshold_from_summary(s)
            for i in unsure.tolist():
                r = int(rows[i])
                out[i] = exact_accept(self, s.source[r], s.is_logits, int(flat[i]), float(tau[r]))
        return out.reshape(ids.shape)

    def exact_tau(self, P: list, tau_hat: float, mp):
        """The threshold of the exact distribution P (mpmath numbers); a user rule's is
        its function's float64 value."""
        return mp.mpf(tau_hat)

    def threshold(self, probs: ArrayLike | None = None, *, logits: ArrayLike | None = None) -> ArrayLike:
        """tau(p) for a batch (..., V) -> (...)."""
        s = summarize(probs, logits=logits, entropy=self.needs_entropy, k=self.min_k)
        return s.out.wrap(self.threshold_from_summary(s))

    def rejected_mask(self, values: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        """Boolean mask of rejected probability values; ``tau`` broadcasts against ``values``."""
        return values <= tau if self.inclusive else values < tau

    def accepts_tokens(self, probs: ArrayLike | None = None, tokens: ArrayLike | None = None, *, logits: ArrayLike | None = None) -> ArrayLike:
        """Does the rule accept proposed token ids ``tokens`` (shape ``(...)``) under target (..., V)?"""
        if tokens is None:
            raise ValueError("tokens: pass the proposed token ids, shape (...) matching the batch shape")
        s = summarize(probs, logits=logits, entropy=self.needs_entropy, k=self.min_k)
        ids = torch.as_tensor(tokens, device=s.source.device).reshape(-1).long()
        if ids.shape[0] != s.source.shape[0]:
            raise ValueError(f"tokens: expected {s.source.shape[0]} ids (one per row), got {ids.shape[0]}")
        if bool(((ids < 0) | (ids >= s.vocab_size)).any()):
            raise ValueError(f"tokens: ids must lie in [0, {s.vocab_size})")
        return s.out.wrap(self.accept_ids(s, ids))


def _given(s: Summary, ids: torch.Tensor) -> torch.Tensor:
    """The given values of tokens ids (N,) or (N, K), in the shape of ids."""
    if ids.ndim == 2:
        return s.source.gather(-1, ids)
    return s.source.gather(-1, ids[:, None])[:, 0]


def _per_row(t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A per-row (N,) value broadcast against ids (N,) or (N, K)."""
    return t[:, None] if ids.ndim == 2 else t


def _check_param(name: str, value: float, ok: bool, what: str) -> float:
    v = float(value)
    if not math.isfinite(v) or not ok:
        raise ValueError(f"{name}: {what}, got {value!r}")
    return v


def _fmt(x: float) -> str:
    return f"{x:g}"


class Strict(LevelSet):
    """Strict greedy matching: accept x iff x is a maximiser of p.

    tau(p) = max p,  R(p) = {y : p(y) < max p}.
    """

    def __init__(self):
        self.inclusive = False
        self.spec = "strict"

    def threshold_from_summary(self, s: Summary) -> torch.Tensor:
        return s.top_probs[:, 0]

    exact_order = True

    def rejection_cut(self, s: Summary) -> torch.Tensor:
        return s.top_vals[:, 0]  # reject exactly the values below the maximum

    def accept_ids(self, s: Summary, ids: torch.Tensor) -> torch.Tensor:
        return _given(s, ids) >= _per_row(s.top_vals[:, 0], ids)

    def exact_tau(self, P, tau_hat, mp):
        return max(P)


def _p1_bounds(s: Summary) -> tuple[torch.Tensor, torch.Tensor]:
    p1 = s.top_probs[:, 0]
    e = s.common_err() + s.top_entry_err()[:, 0] + 4 * U
    return p1 * (1 - e), p1 * (1 + e)


class Additive(LevelSet):
    """Additive relaxation: accept x iff p(x) >= max p - DELTA.

    tau(p) = max p - DELTA,  DELTA >= 0.
    """

    def __init__(self, delta: float = 0.1):
        self.delta = _check_param("DELTA", delta, float(delta) >= 0, "additive:DELTA needs DELTA >= 0")
        self.inclusive = False
        self.spec = f"additive:{_fmt(self.delta)}"

    def threshold_from_summary(self, s: Summary) -> torch.Tensor:
        return s.top_probs[:, 0] - self.delta

    def tau_bounds(self, s: Summary):
        lo, hi = _p1_bounds(s)
        return (lo - self.delta) - U * (lo + self.delta), (hi - self.delta) + U * (hi + self.delta)

    def exact_tau(self, P, tau_hat, mp):
        return max(P) - mp.mpf(self.delta)

    def rejection_cut(self, s: Summary) -> torch.Tensor:
        # reject iff p(y) < p1 - DELTA, i.e. x_y - x_1 < log(1 - DELTA / p1) (logits) or
        # x_y < x_1 - DELTA * sum(x) (probabilities): relative to x_1, exact when DELTA = 0
        x1 = s.top_vals[:, 0].double()
        if self.delta == 0:
            return s.top_vals[:, 0]
        if s.is_logits:
            _, p1_hi = _p1_bounds(s)
            v = self.delta / p1_hi
            ell = torch.log1p(-v.clamp(max=1.0))
            ell_hi = ell + 4 * U * (v / (1 - v).clamp_min(TINY) + ell.abs() + 1)
            t = x1 + ell_hi
        else:
            S_lo = s.row_norm() * (1 - gamma(s.vocab_size + 2))
            t = x1 - self.delta * S_lo
        none = torch.isnan(t) | torch.isneginf(t)  # p1 <= DELTA: nothing is rejected
        t = torch.nextafter(t, torch.full_like(t, torch.inf))
        c = s.cut_up(t, inclusive=False)
        return torch.where(none, torch.full_like(c, -torch.inf), c)


class Multiplicative(LevelSet):
    """Multiplicative relaxation: accept x iff p(x) >= ALPHA * max p.

    tau(p) = ALPHA * max p,  0 < ALPHA <= 1.
    """

    def __init__(self, alpha: float = 0.5):
        self.alpha = _check_param("ALPHA", alpha, 0 < float(alpha) <= 1, "multiplicative:ALPHA needs 0 < ALPHA <= 1")
        self.inclusive = False
        self.spec = f"multiplicative:{_fmt(self.alpha)}"

    def threshold_from_summary(self, s: Summary) -> torch.Tensor:
        return self.alpha * s.top_probs[:, 0]

    def tau_bounds(self, s: Summary):
        lo, hi = _p1_bounds(s)
        return self.alpha * lo * (1 - 2 * U), self.alpha * hi * (1 + 2 * U)

    def exact_tau(self, P, tau_hat, mp):
        return mp.mpf(self.alpha) * max(P)

    def rejection_cut(self, s: Summary) -> torch.Tensor:
        # reject iff x_y - x_1 < log ALPHA (logits) or x_y < ALPHA x_1 (probabilities):
        # the normaliser cancels; exact when ALPHA = 1
        if self.alpha == 1:
            return s.top_vals[:, 0]
        x1 = s.top_vals[:, 0].double()
        if s.is_logits:
            ell = math.log(self.alpha)
            t = x1 + (ell + 4 * U * abs(ell))
        else:
            t = x1 * self.alpha
        t = torch.nextafter(t, torch.full_like(t, torch.inf))
        return s.cut_up(t, inclusive=False)


class TopM(LevelSet):
    """Top-M acceptance: accept x iff p(x) >= the M-th largest value of p.

    tau(p) = p_(M) (M-th order statistic, counting ties),  M >= 1.
    """

    def __init__(self, m: int = 2):
        if isinstance(m, float) and not float(m).is_integer():
            raise ValueError(f"M: topm:M needs an integer M >= 1, got {m!r}")
        self.m = int(_check_param("M", m, float(m) >= 1, "topm:M needs an integer M >= 1"))
        self.inclusive = False
        self.spec = f"topm:{self.m}"
        self.min_k = self.m + 1

    def threshold_from_summary(self, s: Summary) -> torch.Tensor:
        if self.m > s.vocab_size:
            raise ValueError(f"M: topm:{self.m} exceeds the vocabulary size V = {s.vocab_size}")
        return s.top_probs[:, self.m - 1]

    exact_order = True

    def rejection_cut(self, s: Summary) -> torch.Tensor:
        self.threshold_from_summary(s)  # the V check
        return s.top_vals[:, self.m - 1]

    def accept_ids(self, s: Summary, ids: torch.Tensor) -> torch.Tensor:
        self.threshold_from_summary(s)
        return _given(s, ids) >= _per_row(s.top_vals[:, self.m - 1], ids)

    def exact_tau(self, P, tau_hat, mp):
        return sorted(P, reverse=True)[self.m - 1]


class RelaxedAcceptance(LevelSet):
    """TensorRT-LLM's relaxed acceptance (DeepSeek-R1 MTP, ``relaxed_topk`` = N,
    ``relaxed_delta`` = DELTA): accept x iff x is among the N most probable tokens of p
    (ties counted, below) AND p(x) >= max p - DELTA.

    tau(p) = max(p_(N), max p - DELTA),  R(p) = {y : p(y) < tau(p)}  (not inclusive),
    N >= 1 an integer, DELTA >= 0.  Both sides are *probabilities* (softmax of the logits),
    not log-probabilities: TensorRT-LLM takes ``torch.topk`` (k = relaxed_topk) of
    ``torch.softmax(logits)`` (``gen_logprobs`` in ``_torch/speculative/mtp.py`` holds
    probabilities despite its name), and ``mtpRelaxedAcceptanceKernel`` (``mtpKernels.cu``)
    accepts the draft when it is one of those k indices whose value is at least
    ``top-1 value - relaxed_delta`` (the top-1 itself always).  So the accepted set is
    topm:N intersected with additive:DELTA, and the rejection region is the union of
    theirs: a lower level set with the larger of the two thresholds.

    Ties at the N-th place are counted in, never broken: p_(N) is the N-th largest value
    counted with ties (as in topm:N), x passes the top-N part iff p(x) >= p_(N), so every
    token whose probability equals the N-th largest passes it (the accepted set can hold more
    than N tokens) and the decision depends on the values of p alone, never on token ids.
    This is TensorRT-LLM's published definition (its tech blog "DeepSeek R1 MTP
    Implementation and Optimization", for ``MTPDecodingConfig(relaxed_topk, relaxed_delta)``:
    take the top-N tokens, drop those whose probability is below the top-1 probability minus
    ``relaxed_delta``, accept the draft if it is one of the rest), which does not say how
    ties are broken.  Its code does break them: the kernel accepts
    only the N indices ``torch.topk`` returns, and which of several tokens tied with the
    N-th value those are is implementation-defined.  So the two differ only at such a tie:
    there TensorRT-LLM may reject a token that this rule accepts, and it never accepts one
    that this rule rejects (for N = 1 that tie is a tie for the top).  As for every
    rule here, the decision is the rule evaluated exactly on the given values; TensorRT-LLM
    evaluates it on its own rounded softmax (model dtype) with a float32 threshold, so a
    token within that rounding of max p - DELTA can be decided differently.  TensorRT-LLM
    also applies DELTA only inside the thinking phase (DELTA = 0 elsewhere): this is the
    rule inside it.  relaxed:1:DELTA and relaxed:N:0 are strict; relaxed:N:DELTA with
    DELTA >= 1 is topm:N.
    """

    def __init__(self, n: int, delta: float):
        if isinstance(n, float) and not float(n).is_integer():
            raise ValueError(f"N: relaxed:N:DELTA needs an integer N >= 1, got {n!r}")
        self.n = int(_check_param("N", n, float(n) >= 1, "relaxed:N:DELTA needs an integer N >= 1"))
        self.delta = _check_param("DELTA", delta, float(delta) >= 0, "relaxed:N:DELTA needs DELTA >= 0")
        self._top, self._add = TopM(self.n), Additive(self.delta)
        self.inclusive = False
        self.spec = f"relaxed:{self.n}:{_fmt(self.delta)}"
        self.min_k = self.n + 1

    def _v_check(self, s: Summary) -> None:
        # before topm:N's own check, so that the error names this rule
        if self.n > s.vocab_size:
            raise ValueError(f"N: {self.spec} exceeds the vocabulary size V = {s.vocab_size}")

    def threshold_from_summary(self, s: Summary) -> torch.Tensor:
        self._v_check(s)
        return torch.maximum(self._top.threshold_from_summary(s), self._add.threshold_from_summary(s))

    def tau_bounds(self, s: Summary):
        self._v_check(s)
        t = self._top.threshold_from_summary(s)
        e = s.common_err() + s.top_entry_err()[:, self.n - 1] + 4 * U
        a_lo, a_hi = self._add.tau_bounds(s)
        return torch.maximum(t * (1 - e), a_lo), torch.maximum(t * (1 + e), a_hi)

    def sure(self, s: Summary, rows: torch.Tensor, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the top-N part is an exact comparison of given values (the order of p is theirs);
        # the additive part is decided as additive:DELTA decides it
        self._v_check(s)
        in_top = vals >= s.top_vals[rows, self.n - 1]
        acc, rej = self._add.sure(s, rows, vals)
        return acc & in_top, rej | ~in_top

    def rejection_cut(self, s: Summary) -> torch.Tensor:
        self._v_check(s)
        dt = s.cut_dtype()
        return torch.maximum(self._top.rejection_cut(s).to(dt), self._add.rejection_cut(s).to(dt))

    def exact_tau(self, P, tau_hat, mp):
        return max(sorted(P, reverse=True)[self.n - 1], max(P) - mp.mpf(self.delta))


class EntropyThreshold(LevelSet):
    """Medusa's typical acceptance with the textbook Shannon entropy:
    accept x iff p(x) > min(EPSILON, DELTA * exp(-H(p))),  H(p) = -sum p log p.

    tau(p) = min(EPSILON, DELTA exp(-H(p))),  R(p) = {y : p(y) <= tau(p)}  (inclusive).
    Defaults EPSILON = 0.09 (posterior threshold), DELTA = 0.3 (posterior alpha).
    Medusa's code and vLLM's TypicalAcceptanceSampler compute the entropy as
    -sum p log(p + 1e-5) instead: that rule is :class:`TypicalAcceptance` (``typical:``).
    """

    needs_entropy = True
    _name = "entropy"  # the spec's rule name

    def __init__(self, epsilon: float = 0.09, delta: float = 0.3):
        n = self._name
        self.epsilon = _check_param("EPSILON", epsilon, float(epsilon) > 0, f"{n}:EPSILON:DELTA needs EPSILON > 0")
        self.delta = _check_param("DELTA", delta, float(delta) > 0, f"{n}:EPSILON:DELTA needs DELTA > 0")
        self.inclusive = True
        self.spec = f"{n}:{_fmt(self.epsilon)}:{_fmt(self.delta)}"

    def threshold_from_summary(self, s: Summary) -> torch.Tensor:
        if s.entropy is None:
            raise ValueError("entropy criterion needs the entropy; summarize(..., entropy=True)")
        return torch.minimum(torch.full_like(s.entropy, self.epsilon), self.delta * torch.exp(-s.entropy))

    def _h_bounds(self, s: Summary):
        if s.entropy is None:
            raise ValueError("entropy criterion needs the entropy; summarize(..., entropy=True)")
        e = s.entropy_err()
        return s.entropy - e, s.entropy + e

    def tau_bounds(self, s: Summary):
        h_lo, h_hi = self._h_bounds(s)
        eps = torch.full_like(h_lo, self.epsilon)
        lo = torch.minimum(eps, self.delta * torch.exp(-h_hi) * (1 - 4 * U))
        hi = torch.minimum(eps, self.delta * torch.exp(-h_lo) * (1 + 4 * U))
        return lo, hi

    def _exact_h(self, P, mp):
        return -mp.fsum(p * mp.log(p) for p in P if p > 0)

    def exact_tau(self, P, tau_hat, mp):
        return min(mp.mpf(self.epsilon), mp.mpf(self.delta) * mp.exp(-self._exact_h(P, mp)))


class TypicalAcceptance(EntropyThreshold):
    """Medusa's typical acceptance exactly as Medusa and vLLM's TypicalAcceptanceSampler
    compute it: accept x iff p(x) > min(EPSILON, DELTA * exp(-H~(p))) with
    H~(p) = -sum p log(p + 1e-5).

    tau(p) = min(EPSILON, DELTA exp(-H~(p))),  R(p) = {y : p(y) <= tau(p)}  (inclusive).
    H~ needs the normaliser first, so it costs a second pass over the rows (float64).
    """

    needs_entropy = False
    _name = "typical"

    def threshold_from_summary(self, s: Summary) -> torch.Tensor:
        h = s.tilde_entropy()
        return torch.minimum(torch.full_like(h, self.epsilon), self.delta * torch.exp(-h))

    def _h_bounds(self, s: Summary):
        h, e = s.tilde_entropy(), s.tilde_entropy_err()
        return h - e, h + e

    def _exact_h(self, P, mp):
        c = mp.mpf(TYPICAL_EPS)
        return -mp.fsum(p * mp.log(p + c) for p in P)


class MarginAware(LevelSet):
    """Margin-aware verification (MARS, arXiv 2601.15498).

    Accept the maximiser; when log p(1st) - log p(2nd) <= THETA also accept
    every token with probability at least the runner-up's:
    tau(p) = p(2nd) if log(p(1st)/p(2nd)) <= THETA else p(1st).
    """

    def __init__(self, theta: float = 0.5):
        self.theta = _check_param("THETA", theta, float(theta) >= 0, "mars:THETA needs THETA >= 0")
        self.inclusive = False
        self.spec = f"mars:{_fmt(self.theta)}"

    def threshold_from_summary(self, s: Summary) -> torch.Tensor:
        p1, p2 = s.top_probs[:, 0], s.top_probs[:, 1]
        close = torch.log(p1) - torch.log(p2) <= self.theta  # p2 = 0 gives +inf: not close
        return torch.where(close, p2, p1)

    def _close(self, s: Summary):
        """(surely close, surely not close) from log p1 - log p2 = the difference of the
        given logits, or log(x1 / x2) of probabilities (the normaliser cancels)."""
        v1, v2 = s.top_vals[:, 0].double(), s.top_vals[:, 1].double()
        if s.is_logits:
            d = v1 - v2
            err = 2 * U * (v1.abs() + v2.abs())
        else:
            d = torch.log(v1 / v2)
            err = 4 * U * (1 + d.abs())
        d = torch.where(torch.isnan(d), torch.full_like(d, torch.inf), d)  # both -inf / both 0: p2 = 0
        return d + err <= self.theta, d - err > self.theta

    exact_order = True

    def _close_exact(self, s: Summary) -> torch.Tensor:
        sure, not_close = self._close(s)
        close = sure.clone()
        for i in (~sure & ~not_close).nonzero().squeeze(1).tolist():
            close[i] = _exact_mars_close(self.theta, s.top_vals[i, 0].item(), s.top_vals[i, 1].item(), s.is_logits)
        return close

    def rejection_cut(self, s: Summary) -> torch.Tensor:
        return torch.where(self._close_exact(s), s.top_vals[:, 1], s.top_vals[:, 0])

    def accept_ids(self, s: Summary, ids: torch.Tensor) -> torch.Tensor:
        return _given(s, ids) >= _per_row(self.rejection_cut(s), ids)

    def exact_tau(self, P, tau_hat, mp):
        srt = sorted(P, reverse=True)
        p1, p2 = srt[0], srt[1]
        close = p2 > 0 and mp.log(p1) - mp.log(p2) <= mp.mpf(self.theta)
        return p2 if close else p1


class TreeCoverage(Criterion):
    """Tree coverage of width M: the drafter proposes its top-M tokens and the
    draft is accepted iff the target's greedy token a = argmax p (lowest index
    among ties) is among them.  Rejection (ties in q against us):
    |{y != a : q(y) >= q(a)}| >= M.
    """

    def __init__(self, m: int = 2):
        if isinstance(m, float) and not float(m).is_integer():
            raise ValueError(f"M: tree:M needs an integer M >= 1, got {m!r}")
        self.m = int(_check_param("M", m, float(m) >= 1, "tree:M needs an integer M >= 1"))
        self.spec = f"tree:{self.m}"
        self.min_k = self.m + 1


_DEFAULTS = {
    "strict": (Strict, ()),
    "additive": (Additive, (float,)),
    "multiplicative": (Multiplicative, (float,)),
    "topm": (TopM, (int,)),
    "relaxed": (RelaxedAcceptance, (int, float)),
    "entropy": (EntropyThreshold, (float, float)),
    "typical": (TypicalAcceptance, (float, float)),
    "mars": (MarginAware, (float,)),
    "tree": (TreeCoverage, (int,)),
}

# The rules draftcert profiles, decodes and tabulates when none are named: one of each family
# at its usual parameter (Medusa's entropy defaults; TensorRT-LLM's relaxed rule as the
# intersection of the topm and additive defaults) and three tree widths.
DEFAULT_CRITERIA = (
    "strict", "additive:0.1", "multiplicative:0.5", "topm:2", "relaxed:2:0.1", "entropy:0.09:0.3", "mars:0.5",
    "tree:2", "tree:4", "tree:8",
)

SPEC_HELP = ("strict | additive:DELTA | multiplicative:ALPHA | topm:M | relaxed:N:DELTA | entropy[:EPSILON[:DELTA]] "
             "| typical[:EPSILON[:DELTA]] | mars:THETA | tree:M")


def parse_criterion(spec: str | Criterion) -> Criterion:
    """Parse a spec string such as ``"additive:0.1"`` or ``"tree:8"`` into a Criterion."""
    if isinstance(spec, Criterion):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"criterion spec: expected a non-empty string ({SPEC_HELP}), got {spec!r}")
    name, *args = [a.strip() for a in spec.strip().split(":")]
    key = name.lower()
    if key not in _DEFAULTS:
        raise ValueError(f"criterion spec: unknown rule {name!r} in {spec!r}; expected one of {SPEC_HELP}")
    cls, types = _DEFAULTS[key]
    if len(args) > len(types):
        raise ValueError(f"criterion spec: {spec!r} has too many parameters; expected {SPEC_HELP}")
    if key == "relaxed" and len(args) != 2:
        raise ValueError(f"criterion spec: {spec!r} needs both parameters, relaxed:N:DELTA (e.g. relaxed:2:0.1)")
    vals = []
    for a, t in zip(args, types):
        try:
            vals.append(t(a) if t is float else _parse_int(a))
        except (TypeError, ValueError):
            raise ValueError(f"criterion spec: parameter {a!r} in {spec!r} is not a valid {t.__name__}") from None
    return cls(*vals)


def _parse_int(a: str) -> int:
    f = float(a)
    if not f.is_integer():
        raise ValueError(a)
    return int(f)


# -- arbitrary-precision decisions (the rare rows float64 cannot settle) ----------------
_PRECS = (256, 2400)  # bits; 2400 sums any float64 values exactly


def _exact_probs(vals: list, is_logits: bool, mp) -> list:
    if is_logits:
        fin = [v for v in vals if v != -math.inf]
        m = mp.mpf(max(fin))
        e = [mp.exp(mp.mpf(v) - m) if v != -math.inf else mp.mpf(0) for v in vals]
    else:
        e = [mp.mpf(v) for v in vals]
    S = mp.fsum(e)
    return [x / S for x in e]


def exact_accept(crit: LevelSet, row: torch.Tensor, is_logits: bool, x: int, tau_hat: float) -> bool:
    """Does ``crit`` accept token x of one row of given values, decided in arbitrary
    precision (mpmath, escalating; a difference below 2^-2300 counts as an exact tie)?"""
    import mpmath  # deferred: only the rare rows float64 cannot settle need it

    vals = row.double().tolist()
    for prec in _PRECS:
        with mpmath.workprec(prec):
            P = _exact_probs(vals, is_logits, mpmath.mp)
            tau = crit.exact_tau(P, tau_hat, mpmath.mp)
            diff = P[x] - tau
            if abs(diff) > mpmath.mpf(2) ** (100 - prec) or prec == _PRECS[-1]:
                if abs(diff) <= mpmath.mpf(2) ** (100 - prec):
                    diff = 0
                return bool(diff > 0) if crit.inclusive else bool(diff >= 0)
    raise AssertionError("unreachable")


def _exact_mars_close(theta: float, v1: float, v2: float, is_logits: bool) -> bool:
    import mpmath  # deferred: only the rare rows float64 cannot settle need it

    if is_logits:
        if v2 == -math.inf:
            return False
        return Fraction(v1) - Fraction(v2) <= Fraction(theta)
    if v2 == 0:
        return False
    with mpmath.workprec(2400):
        return bool(mpmath.log(mpmath.mpf(v1) / mpmath.mpf(v2)) <= mpmath.mpf(theta))
