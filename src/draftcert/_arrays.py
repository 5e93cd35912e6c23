"""Array plumbing shared by every public function.

Inputs are numpy arrays or torch tensors of shape ``(..., V)`` holding either
probabilities or logits.  Everything is computed in torch (a numpy array is
wrapped without a copy) and handed back in the caller's array type and float
dtype, with the vocabulary axis reduced away: shape ``(...)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._fp import round_out

ArrayLike = Any  # numpy.ndarray | torch.Tensor

ROW_SUM_RTOL = 1e-4


@dataclass(frozen=True)
class OutputSpec:
    """How to hand a result back: array library, float dtype, batch shape."""

    is_numpy: bool
    dtype: torch.dtype
    batch_shape: tuple[int, ...]
    device: torch.device

    def wrap(self, t: torch.Tensor, direction: str | None = None) -> ArrayLike:
        """(N,) result (any float/bool dtype) -> caller's type, shape batch_shape.
        ``direction``: ``down`` (radii) or ``up`` (divergences) rounds a float64 result
        toward that side when it is handed back in float32 (docs/theory.md, section 7)."""
        if t.dtype.is_floating_point:
            t = round_out(t, self.dtype, direction) if t.dtype == torch.float64 else t.to(self.dtype)
        t = t.reshape(self.batch_shape)
        if self.is_numpy:
            return t.detach().cpu().numpy()
        return t.to(self.device)

    def flat(self, n: int) -> "OutputSpec":
        """The same output type for n rows without the caller's batch shape (a selection
        or concatenation of rows has no batch shape of its own)."""
        return OutputSpec(self.is_numpy, self.dtype, (n,), self.device)


def to_tensor(x: ArrayLike, name: str) -> tuple[torch.Tensor, bool]:
    """Wrap ``x`` as a torch tensor (no copy for numpy). Returns (tensor, was_numpy)."""
    if isinstance(x, torch.Tensor):
        t, is_numpy = x.detach(), False
        if t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"{name}: expected real numbers (float16, bfloat16, float32 or float64), got dtype {t.dtype}")
    elif isinstance(x, np.ndarray) or isinstance(x, (list, tuple)):
        try:
            a = np.asarray(x)
        except ValueError as exc:
            raise ValueError(f"{name}: not a rectangular array of numbers ({exc})") from None
        if a.dtype == np.bool_ or np.issubdtype(a.dtype, np.complexfloating):
            raise ValueError(f"{name}: expected real numbers (float16, float32 or float64), got dtype {a.dtype}")
        if np.issubdtype(a.dtype, np.floating) and a.dtype.itemsize > 8:
            raise ValueError(f"{name}: dtype {a.dtype} (long double) is not supported; convert to float64 "
                             "(the certificates are computed in float64, and a long double would be rounded)")
        if a.dtype == np.float16:
            a = a.astype(np.float32)  # exact
        if not np.issubdtype(a.dtype, np.floating):
            if np.issubdtype(a.dtype, np.integer):
                a = a.astype(np.float64)
            else:
                raise ValueError(f"{name}: expected a float array, got dtype {a.dtype}")
        t, is_numpy = torch.from_numpy(np.ascontiguousarray(a)), True
    else:
        raise ValueError(
            f"{name}: expected a numpy array or torch tensor of shape (..., V), got {type(x).__name__}"
        )
    if not t.dtype.is_floating_point:
        t = t.to(torch.float64)
    if t.ndim < 1:
        raise ValueError(f"{name}: expected shape (..., V) with a vocabulary axis, got a scalar")
    if t.shape[-1] < 2:
        raise ValueError(f"{name}: vocabulary size V = {t.shape[-1]} but V >= 2 is required")
    return t, is_numpy


def output_spec(t: torch.Tensor, is_numpy: bool) -> OutputSpec:
    dtype = t.dtype if t.dtype in (torch.float32, torch.float64) else torch.float32
    return OutputSpec(is_numpy=is_numpy, dtype=dtype, batch_shape=tuple(t.shape[:-1]), device=t.device)


def pick_input(probs: ArrayLike | None, logits: ArrayLike | None, name: str = "probs") -> tuple[ArrayLike, bool]:
    """Exactly one of ``probs`` / ``logits`` must be given. Returns (array, is_logits)."""
    if (probs is None) == (logits is None):
        raise ValueError(f"pass exactly one of `{name}` (probabilities) or `logits=` (unnormalised log-probabilities)")
    return (logits, True) if probs is None else (probs, False)


def check_probs(p: torch.Tensor, name: str, row_sum: torch.Tensor | None = None) -> None:
    """Clear errors for non-finite, negative or unnormalised probability rows."""
    if not bool(torch.isfinite(p).all()):
        raise ValueError(f"{name}: contains NaN or infinite values; pass finite probabilities (or use logits=)")
    if bool((p < 0).any()):
        raise ValueError(f"{name}: contains negative probabilities; pass a distribution (or use logits=)")
    s = p.sum(-1, dtype=torch.float64) if row_sum is None else row_sum
    bad = (s - 1.0).abs() > ROW_SUM_RTOL
    if bool(bad.any()):
        worst = float(s[bad].flatten()[0])
        raise ValueError(
            f"{name}: rows must sum to 1 (relative tolerance {ROW_SUM_RTOL:g}); a row sums to {worst:.6g}. "
            "Normalise it, or pass unnormalised scores as logits="
        )


def check_logits_rows(lse: torch.Tensor, name: str) -> None:
    """The log-normaliser of each row exposes NaN, +inf and all -inf rows for free."""
    if not bool(torch.isfinite(lse).all()):
        raise ValueError(
            f"{name}: logits contain NaN or +inf, or a row is entirely -inf; pass finite logits "
            "(-inf is allowed for masked tokens as long as one token per row is finite)"
        )
