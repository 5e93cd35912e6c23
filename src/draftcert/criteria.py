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

    strict | additive:DELTA | multiplicative:ALPHA | topm:M
    | entropy[:EPSILON[:DELTA]] | mars:THETA | tree:M
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ._arrays import ArrayLike
from .summary import Summary, summarize

__all__ = [
    "Criterion",
    "LevelSet",
    "Strict",
    "Additive",
    "Multiplicative",
    "TopM",
    "EntropyThreshold",
    "MarginAware",
    "TreeCoverage",
    "parse_criterion",
    "as_criterion",
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
        return tau

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
        ok = ~self.rejected_mask(s.prob_of(ids), self.threshold_from_summary(s))
        return s.out.wrap(ok)


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


class EntropyThreshold(LevelSet):
    """Medusa's typical acceptance (as vLLM implements it):
    accept x iff p(x) > min(EPSILON, DELTA * exp(-H(p))).

    tau(p) = min(EPSILON, DELTA exp(-H(p))),  R(p) = {y : p(y) <= tau(p)}  (inclusive).
    Defaults EPSILON = 0.09 (posterior threshold), DELTA = 0.3 (posterior alpha).
    """

    needs_entropy = True

    def __init__(self, epsilon: float = 0.09, delta: float = 0.3):
        self.epsilon = _check_param("EPSILON", epsilon, float(epsilon) > 0, "entropy:EPSILON:DELTA needs EPSILON > 0")
        self.delta = _check_param("DELTA", delta, float(delta) > 0, "entropy:EPSILON:DELTA needs DELTA > 0")
        self.inclusive = True
        self.spec = f"entropy:{_fmt(self.epsilon)}:{_fmt(self.delta)}"

    def threshold_from_summary(self, s: Summary) -> torch.Tensor:
        if s.entropy is None:
            raise ValueError("entropy criterion needs the entropy; summarize(..., entropy=True)")
        return torch.minimum(torch.full_like(s.entropy, self.epsilon), self.delta * torch.exp(-s.entropy))


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
    "entropy": (EntropyThreshold, (float, float)),
    "typical": (EntropyThreshold, (float, float)),
    "mars": (MarginAware, (float,)),
    "tree": (TreeCoverage, (int,)),
}

SPEC_HELP = "strict | additive:DELTA | multiplicative:ALPHA | topm:M | entropy[:EPSILON[:DELTA]] | mars:THETA | tree:M"


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


def as_criterion(c: str | Criterion) -> Criterion:
    return parse_criterion(c)
