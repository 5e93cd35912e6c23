"""Floating-point helpers behind the contract of docs/theory.md, section 7.

Everything the certificates compute is float64.  ``U`` is the float64 unit
roundoff (2^-53); every error bound below is written as a multiple of it.
"""

from __future__ import annotations

import math

import torch

U = 2.0**-53  # float64 unit roundoff: |fl(a op b) - a op b| <= U |a op b|
TINY = 2.0**-1022  # smallest normal float64: absorbs underflow in bounds


def gamma(n) -> float | torch.Tensor:
    """gamma_n = n U / (1 - n U): the classical bound on the relative error of a sum
    (or product) of n nonnegative float64 terms in any order."""
    return n * U / (1 - n * U)


# psi(w) = w e^w - e^w + 1 = 1 + (w - 1) e^w >= 0, the Bregman term of KL written in
# log space: KL(p||q) = sum_i q_i psi(log(p_i/q_i)), KL(q||p) = sum_i p_i psi(log(q_i/p_i)).
# Its Taylor series sum_{k>=2} (k-1) w^k / k! has no cancellation for small |w|.
_SERIES_R = 0.5
_N_TERMS = 16  # truncation: (k-1) 0.5^k / k! at k = 18 is < 1e-17 of the leading w^2/2 term: below U


def psi(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(psi(w), abs error bound of the computed value) for float64 w (may be +-inf).

    |w| < 1/2: Horner on the series (all coefficients (k-1)/k! > 0, alternating at most
    in w's sign, terms decreasing by >= 2x), relative error <= 8 U.  Elsewhere the
    direct form 1 + (w - 1) e^w, absolute error <= 6 U (1 + |w - 1| e^w).
    psi(-inf) = 1, psi(+inf) = +inf.
    """
    small = w.abs() < _SERIES_R
    ws = torch.where(small, w, torch.zeros_like(w))
    acc = torch.zeros_like(w)
    for k in range(_N_TERMS + 1, 1, -1):  # sum_{k=2..N+1} c_k w^k = w^2 (c_2 + w (c_3 + ...))
        acc = acc * ws + (k - 1) / math.factorial(k)
    ser = acc * ws * ws
    wd = torch.where(small, torch.zeros_like(w), w)
    ew = torch.exp(wd)
    direct = 1 + torch.where(torch.isneginf(wd), torch.zeros_like(wd), (wd - 1) * ew)
    direct = torch.where(torch.isposinf(wd), torch.full_like(wd, torch.inf), direct)
    val = torch.where(small, ser, direct.clamp_min(0))
    err_d = 6 * U * (1 + torch.where(torch.isneginf(wd), torch.zeros_like(wd), (wd - 1).abs() * ew))
    err = torch.where(small, 8 * U * ser, err_d)
    return val, err


def round_out(t: torch.Tensor, dtype: torch.dtype, direction: str) -> torch.Tensor:
    """Cast float64 ``t`` to ``dtype`` so the result is <= t (``down``) or >= t (``up``)."""
    if dtype == t.dtype or direction is None:
        return t.to(dtype)
    c = t.to(dtype)
    c64 = c.double()
    if direction == "down":
        wrong = c64 > t
        return torch.where(wrong, torch.nextafter(c, torch.full_like(c, -torch.inf)), c)
    wrong = c64 < t
    return torch.where(wrong, torch.nextafter(c, torch.full_like(c, torch.inf)), c)


def down(t: torch.Tensor, rel: float | torch.Tensor = 4 * U) -> torch.Tensor:
    """A float64 value below ``t`` by a relative margin (for nonnegative ``t``), keeping 0 and inf."""
    return torch.where(torch.isinf(t), t, (t * (1 - rel)).clamp_min(0))


def up(t: torch.Tensor, rel: float | torch.Tensor = 4 * U) -> torch.Tensor:
    return t * (1 + rel) + TINY
