"""Cheaper verification passes on CPU: a second, column-major copy of every linear weight.

Why: with MKL's float32 GEMM on CPU, ``F.linear(x, W)`` for an (N, K) row-major weight costs
about the same for 1..3 rows of ``x`` and then jumps by a whole weight read every few rows (a
1-token target forward = 1.00, 4 tokens = 1.6-1.7, 9 tokens = 2.2 on SmolLM2-135M, 1 thread),
while the same product with the weight stored column-major (``W.t().contiguous().t()``, same
values, same shape) stays close to one weight read up to ~8 rows and is no slower for large
batches -- but is ~25% slower for 2-3 rows.  Speculative verification of a chain of k drafts runs
k + 1 rows, so ``enable(model)`` keeps both layouts and lets each call pick: rows <= 3 use the
original weight, more rows the column-major copy (``benchmarks/bench_speedup.py`` prints the
forward cost by token count).

Only the summation order inside the GEMM changes (the values are the same), so outputs agree with
the original layout to float32 rounding, as any two GEMM kernels do; a 1-row pass (plain greedy
decoding) runs exactly the original code path.  The copy costs one more weight's memory per
linear layer; it is rebuilt on first use after the weight changes (in place, reassigned, moved or
cast).  ``disable`` restores the plain modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["enable", "disable", "is_enabled", "MIN_ROWS"]

# From this many rows on, the column-major copy is used (measured on this machine's MKL; see above).
MIN_ROWS = 4


class DualLayoutLinear(nn.Linear):
    """An ``nn.Linear`` that also holds its weight column-major (``weight_cm``, not a parameter)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        rows = x.numel() // max(x.shape[-1], 1)
        if rows < MIN_ROWS or (self.weight.requires_grad and torch.is_grad_enabled()):
            return F.linear(x, self.weight, self.bias)  # (training: the gradient needs the parameter itself)
        return F.linear(x, _column_major(self), self.bias)


def _stamp(w: torch.Tensor) -> tuple:
    return (w.data_ptr(), w._version, w.device, w.dtype, tuple(w.shape))


def _column_major(mod: nn.Linear) -> torch.Tensor:
    """The column-major copy of ``mod.weight``, rebuilt whenever the weight changed since it was made
    (in-place updates bump the tensor's version; ``.data =``, ``.to()`` change its storage)."""
    w = mod.weight
    d = mod.__dict__
    if d.get("_weight_cm_stamp") != _stamp(w):
        with torch.no_grad():
            d["weight_cm"] = w.detach().t().contiguous().t()
        d["_weight_cm_stamp"] = _stamp(w)
    return d["weight_cm"]


def enable(model: nn.Module) -> int:
    """Give every plain float ``nn.Linear`` of ``model`` on CPU the dual layout, in place.

    Idempotent; returns the number of layers converted.  Modules on other devices and subclasses
    of ``nn.Linear`` (quantised layers, LoRA, ...) are left alone.
    """
    n = 0
    for mod in model.modules():
        if type(mod) is not nn.Linear:
            continue
        w = mod.weight
        if w.device.type != "cpu" or not w.is_floating_point() or w.ndim != 2:
            continue
        mod.__class__ = DualLayoutLinear
        _column_major(mod)  # a plain attribute (weight_cm): not saved, not a parameter
        n += 1
    return n


def disable(model: nn.Module) -> int:
    """Undo ``enable``: plain ``nn.Linear`` modules again; returns the number restored."""
    n = 0
    for mod in model.modules():
        if type(mod) is DualLayoutLinear:
            mod.__class__ = nn.Linear
            mod.__dict__.pop("weight_cm", None)
            mod.__dict__.pop("_weight_cm_stamp", None)
            n += 1
    return n


def is_enabled(model: nn.Module) -> bool:
    return any(type(m) is DualLayoutLinear for m in model.modules())
