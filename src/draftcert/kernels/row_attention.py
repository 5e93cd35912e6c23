"""Attention computed one query row at a time (``row_attention.c``): a row's output bits do not depend on
how many rows share the pass.

``attention(query, key, value, mask, scale)`` returns what ``scaled_dot_product_attention`` returns
(``query [B, H, M, D]``, ``key``/``value [B, Hkv, S, D]`` with ``H`` a multiple of ``Hkv``,
``mask [B, 1 or absent, M, S]`` bool, True = may attend), transposed to transformers' ``[B, M, H, D]``,
computed so that each (batch, row, head) sees exactly its visible keys in cache order with one fixed
sequence of float32 operations (``row_attention.c`` states it).  With batch-invariant linears
(``block_matmul``), a model's logits for a token are then the same bits in a verification pass of any
size and in the one-row decode step: strict decoding is its greedy decoding bit for bit, which 8-bit
activations (``gguf-q8``) need, since a last-bit change of a layer's input can move a rounding of
its quantisation.  Built through ``draftcert.native``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..native import NativeLibrary

__all__ = ["LIBRARY", "attention", "exp"]

LIBRARY = NativeLibrary(Path(__file__).with_name("row_attention.c"), "ra_", {
    "ra_attention": ("PLLLPLLLPLLLPLLLLLLLLFPII", "I"), "ra_exp": ("PPLI", "I")})


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              scale: float, generic: bool = False) -> torch.Tensor:
    """``[B, M, H, D]`` float32: softmax(scale q k^T over the visible keys) v, one row at a time
    (``generic``: one head at a time everywhere, the same bits; for tests)."""
    lib = LIBRARY.require()
    B, H, M, D = query.shape
    _, Hkv, S, Dk = key.shape
    if (query.dtype, key.dtype, value.dtype) != (torch.float32,) * 3 or Dk != D or tuple(value.shape) != (B, Hkv, S, D) \
            or H % Hkv or query.device.type != "cpu":
        raise ValueError(f"row_attention: q {tuple(query.shape)} {query.dtype}, k {tuple(key.shape)}, v {tuple(value.shape)} "
                         "are not float32 CPU [B, H, M, D] / [B, Hkv, S, D]")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    m = None
    if mask is not None:
        if mask.dim() == 4:
            if mask.shape[1] != 1:
                raise ValueError(f"row_attention: a per-head mask {tuple(mask.shape)} is not supported")
            mask = mask[:, 0]
        m = mask.expand(B, M, S)
        # a bool tensor's bytes are 0 and 1: read them as uint8 in place (no copy per layer)
        m = m.view(torch.uint8) if m.dtype == torch.bool else m.to(torch.uint8)
        if m.stride(-1) != 1:
            m = m.contiguous()
    out = torch.empty(B, M, H, D, dtype=torch.float32)
    rc = lib.ra_attention(q.data_ptr(), q.stride(0), q.stride(1), q.stride(2),
                          k.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
                          v.data_ptr(), v.stride(0), v.stride(1), v.stride(2),
                          m.data_ptr() if m is not None else None, m.stride(0) if m is not None else 0,
                          m.stride(1) if m is not None else 0, B, H, Hkv, M, S, D, float(scale), out.data_ptr(),
                          torch.get_num_threads(), int(generic))
    if rc:
        raise RuntimeError(f"row_attention ran out of memory ({rc})")
    return out


def exp(x: torch.Tensor, vector: bool = True) -> torch.Tensor:
    """The kernel's exp of float32 ``x`` (glibc's expf on [-104, 0], libm's elsewhere; for tests)."""
    lib = LIBRARY.require()
    x = x.detach().to(torch.float32).contiguous()
    y = torch.empty_like(x)
    lib.ra_exp(x.data_ptr(), y.data_ptr(), x.numel(), int(vector))
    return y
