"""A float32 linear kernel for a few rows that streams the weight once (``packed_matmul.c``).

A verification pass at batch 1 runs 2..16 rows (drafts, trees, suffix candidates) through every linear layer and is bound by reading
the weights; BLAS kernels for a small M re-pack or re-read them once M passes 3 or 4, so a pass of
4..9 rows can cost 2-3 passes of one row.  ``packed_matmul.c`` holds the weight packed as
``[ceil(N / BW)][K][BW]`` (``BW`` output columns per block, a multiple of the vector width) and,
for every ``k``, feeds one load of a block to ``M`` register accumulators: the weight is read once
whatever ``M`` is (up to 16).  Arithmetic is plain float32 fused multiply-add in ``k`` order, so it
agrees with ``F.linear`` to float32 rounding (a different summation order, like any two GEMMs).

Built through ``draftcert.native`` (the one build path) with ``-ffp-contract=fast`` on top of its
flags: the source's vector ``acc += w * x`` is meant as one fused multiply-add.  Blocks are split
over torch's thread count (OpenMP).  Where the library is unavailable (:data:`LIBRARY`'s
``reason()``), ``draftcert.kernels.linear_chooser`` does not offer the candidate.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..native import NativeLibrary

__all__ = ["LIBRARY", "block_width", "max_rows", "pack", "linear"]

LIBRARY = NativeLibrary(Path(__file__).with_name("packed_matmul.c"), "pm_", {
    "pm_block_width": ("", "I"), "pm_max_rows": ("", "I"), "pm_linear": ("PLLPLPPI", "I")},
    source_flags=("-ffp-contract=fast",))


def block_width() -> int:
    """Output columns per packed block (``BW``)."""
    return LIBRARY.require().pm_block_width()


def max_rows() -> int:
    """The most rows one call takes (0 where the library is unavailable)."""
    lib = LIBRARY.lib
    return lib.pm_max_rows() if lib is not None else 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` (float32) as the kernel reads it: ``[ceil(N/BW), K, BW]``, zero padded."""
    if weight.dtype != torch.float32 or weight.ndim != 2:
        raise ValueError(f"packed_matmul.pack: expected a 2-D float32 weight, got {weight.dtype} {tuple(weight.shape)}")
    bw = block_width()
    n, k = weight.shape
    nb = -(-n // bw)
    with torch.no_grad():
        padded = torch.zeros(nb * bw, k, dtype=torch.float32)
        padded[:n] = weight.detach()
        return padded.view(nb, bw, k).transpose(1, 2).contiguous()  # [nb, K, BW]


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for ``x`` of shape ``(..., K)`` with ``rows = x.numel() // K`` in
    ``1..max_rows()``, ``W`` given as ``pack(W)`` and its ``n`` output features.  Float32, CPU."""
    lib = LIBRARY.lib
    k = x.shape[-1]
    rows = x.numel() // max(k, 1)
    if lib is None or not 1 <= rows <= lib.pm_max_rows():
        raise ValueError(f"packed_matmul.linear: {rows} rows (the kernel takes 1..{max_rows()}; {LIBRARY.reason() or 'ok'})")
    if packed.shape[1] != k or x.dtype != torch.float32:
        raise ValueError(f"packed_matmul.linear: x {tuple(x.shape)} {x.dtype} does not fit the packed weight {tuple(packed.shape)}")
    x2 = x.reshape(rows, k).contiguous()  # [rows, K]
    y = torch.empty(rows, n, dtype=torch.float32)  # [rows, N]
    b = bias.detach().contiguous() if bias is not None else None
    rc = lib.pm_linear(x2.data_ptr(), rows, k, packed.data_ptr(), n, b.data_ptr() if b is not None else None,
                       y.data_ptr(), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"packed_matmul kernel refused {rows} rows")
    return y.view(*x.shape[:-1], n)
