"""A whole decoder layer under ``gguf-q8`` in two native calls (``layer_kernel.c``).

:func:`qkv` is the attention's input side (norm, the q/k/v projections, Qwen3's per-head norms, the
rotary embedding), :func:`attn_mlp` the rest after the caller appended k and v to its cache (the
attention over the cache, the output projection, the residual, the MLP).  :class:`Plan` is a layer's
weights and shapes as the C code reads them: pointers into tensors it keeps alive.  The arithmetic
(``layer_kernel.c`` states it) is fixed and per row, so a row's bits depend on that row alone (and
on the keys it may see); the linear layers are ``block_matmul``'s ``gguf-q8`` kernel and the
attention ``row_attention``'s.  Built through ``draftcert.native`` with ``block_matmul.c`` and
``row_attention.c`` compiled in (hidden: only ``dl_*`` is exported).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..native import NativeLibrary

__all__ = ["LIBRARY", "Linear", "Plan", "qkv", "attn_mlp", "layers", "rms", "silu_mul", "capped_tail"]

_HERE = Path(__file__).parent
_KERNELS = _HERE.parent / "kernels"
LIBRARY = NativeLibrary(_HERE / "layer_kernel.c", "dl_", {
    "dl_qkv": ("PPLPPPI", "I"), "dl_attn_mlp": ("PPLLPPLLLPLLLLPLLFI", "I"), "dl_layers": ("PLPPLLPPPLLI", "I"),
    "dl_rms": ("PPFLLP", "I"),
    "dl_feature_step": ("PPDPLPLLLPPPLLLPFPPPLFPPPPLPI", "I"), "dl_capped_tail": ("PLLPLFP", "I"),
    "dl_silu": ("PPLP", "I")}, source_flags=("-fvisibility=hidden",),
    includes=(_KERNELS / "block_matmul.c", _KERNELS / "row_attention.c"))


class _Lin(ctypes.Structure):
    _fields_ = [("qtype", ctypes.c_int64), ("packed", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("bias", ctypes.c_void_p)]


class _Plan(ctypes.Structure):  # dl_plan
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("inter", ctypes.c_int64),
                ("norm_in", ctypes.c_void_p), ("norm_post", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("eps_in", ctypes.c_float), ("eps_post", ctypes.c_float),
                ("eps_q", ctypes.c_float), ("eps_k", ctypes.c_float), ("n_qkv", ctypes.c_int64), ("qkv", _Lin * 3),
                ("o", _Lin), ("n_gate_up", ctypes.c_int64), ("gate_up", _Lin * 2), ("down", _Lin)]


class Linear:
    """One ``gguf-q8`` linear call: ``packed`` (``block_matmul.pack_q8``'s layout) of GGML type
    ``qtype`` for a ``[n, k]`` weight, float32 ``bias [n]`` or None."""

    def __init__(self, qtype: int, packed: torch.Tensor, n: int, k: int, bias: torch.Tensor | None):
        if packed.dtype != torch.uint8 or not packed.is_contiguous() or packed.device.type != "cpu":
            raise ValueError("layer_kernel: packed weights must be contiguous uint8 CPU bytes")
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or tuple(bias.shape) != (n,)):
            raise ValueError(f"layer_kernel: a bias must be a contiguous float32 [{n}]")
        # aliases of the storages the pointers read: they stay alive whatever happens to the module's tensors
        self.qtype, self.packed, self.n, self.k = int(qtype), packed.detach(), int(n), int(k)
        self.bias = bias.detach() if bias is not None else None

    def struct(self) -> _Lin:
        return _Lin(self.qtype, self.packed.data_ptr(), self.n, self.k, self.bias.data_ptr() if self.bias is not None else None)


def _vector(t: torch.Tensor, n: int, who: str) -> torch.Tensor:
    if t.dtype != torch.float32 or tuple(t.shape) != (n,) or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"layer_kernel: {who} must be a contiguous float32 CPU [{n}]")
    return t


class Plan:
    """A layer as ``layer_kernel.c`` reads it (``dl_plan``), with the tensors its pointers point into.

    ``qkv``: 1..3 :class:`Linear` whose outputs are the columns ``[q | k | v]`` in order; ``gate_up``:
    one (``[gate | up]`` stacked) or two; ``norms``: (input, post-attention) weights and epsilons;
    ``head_norms``: Qwen3's (q, k) per-head norm weights and epsilons, or None."""

    def __init__(self, *, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, norms, head_norms,
                 qkv: list[Linear], o: Linear, gate_up: list[Linear], down: Linear):
        (w_in, eps_in), (w_post, eps_post) = norms
        w_in, w_post = w_in.detach(), w_post.detach()  # aliases: the storages stay alive with the plan
        head_norms = [(t.detach(), e) for t, e in head_norms] if head_norms is not None else None
        self.keep = [w_in, w_post, *(t for t, _ in head_norms or ())]  # the tensors the pointers read
        _vector(w_in, hidden, "the input norm"), _vector(w_post, hidden, "the post-attention norm")
        if head_dim % 2 or head_dim > 512 or heads % kv_heads:
            raise ValueError(f"layer_kernel: head_dim {head_dim} must be even and <= 512, heads {heads} a multiple of {kv_heads}")
        if not 1 <= len(qkv) <= 3 or sum(lin.n for lin in qkv) != (heads + 2 * kv_heads) * head_dim:
            raise ValueError("layer_kernel: the q/k/v calls must cover the columns [q | k | v]")
        if len(gate_up) not in (1, 2) or sum(lin.n for lin in gate_up) != 2 * inter or (len(gate_up) == 2 and gate_up[0].n != inter):
            raise ValueError("layer_kernel: the gate/up calls must cover [gate | up]")
        for lin in [*qkv, *gate_up]:
            if lin.k != hidden:
                raise ValueError(f"layer_kernel: a projection reads {lin.k} inputs, not the hidden size {hidden}")
        if (o.n, o.k, down.n, down.k) != (hidden, heads * head_dim, hidden, inter):
            raise ValueError("layer_kernel: o_proj / down_proj shapes do not fit the layer")
        s = _Plan(hidden, heads, kv_heads, head_dim, inter, w_in.data_ptr(), w_post.data_ptr(), None, None,
                  eps_in, eps_post, 0.0, 0.0, len(qkv))
        if head_norms is not None:
            (wq, eq), (wk, ek) = head_norms
            _vector(wq, head_dim, "the q norm"), _vector(wk, head_dim, "the k norm")
            s.q_norm, s.k_norm, s.eps_q, s.eps_k = wq.data_ptr(), wk.data_ptr(), eq, ek
        for i, lin in enumerate(qkv):
            s.qkv[i] = lin.struct()
        s.o, s.n_gate_up, s.down = o.struct(), len(gate_up), down.struct()
        for i, lin in enumerate(gate_up):
            s.gate_up[i] = lin.struct()
        self.linears = [*qkv, o, *gate_up, down]
        self.struct = s
        self.ref = ctypes.addressof(s)
        self.hidden, self.heads, self.kv_heads, self.head_dim = hidden, heads, kv_heads, head_dim
        self.columns = (heads + 2 * kv_heads) * head_dim


def qkv(plan: Plan, h: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``[B, T, (H + 2 Hkv) D]``: q, k (normed per head for Qwen3, rotated) and v of the rows of ``h
    [B, T, hidden]`` (contiguous float32); ``cos``, ``sin_signed`` ``[B * T, D]`` contiguous: each row's
    rotary tables, ``sin_signed`` with its first half negated."""
    B, T, _ = h.shape
    out = torch.empty(B, T, plan.columns, dtype=torch.float32)
    rc = LIBRARY.require().dl_qkv(plan.ref, h.data_ptr(), B * T, cos.data_ptr(), sin_signed.data_ptr(), out.data_ptr(),
                                  torch.get_num_threads())
    if rc:
        raise RuntimeError(f"layer_kernel.qkv failed ({rc}: {'out of memory' if rc == -2 else 'a plan the kernels refuse'})")
    return out


def attn_mlp(plan: Plan, h: torch.Tensor, qkv_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             visible: torch.Tensor | None, scale: float) -> None:
    """``h [B, T, hidden]`` (contiguous float32) += the attention of ``qkv_rows``' queries over ``k``,
    ``v`` ``[B, Hkv, S, D]`` (the cache after the append, the T new rows last; D contiguous) through
    o_proj, then += the MLP of its norm; in place.  ``visible``: uint8 ``[B, T, S]`` (any strides but
    the last), nonzero where a row may attend; None: causal."""
    B, T, _ = h.shape
    S = k.shape[2]
    m = visible
    rc = LIBRARY.require().dl_attn_mlp(
        plan.ref, h.data_ptr(), B, T, qkv_rows.data_ptr(), k.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
        v.data_ptr(), v.stride(0), v.stride(1), v.stride(2), S, m.data_ptr() if m is not None else None,
        m.stride(0) if m is not None else 0, m.stride(1) if m is not None else 0, float(scale), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"layer_kernel.attn_mlp failed ({rc}: {'out of memory' if rc == -2 else 'a plan the kernels refuse'})")


def layers(io, scales, h: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
           visible: torch.Tensor | None) -> None:
    """Every layer of a decoder on ``h [B, T, hidden]`` (contiguous float32, in place), in one call: per
    layer :func:`qkv`, the append of its k and v rows to its cache buffers, :func:`attn_mlp`, the same
    bits.  ``io``: per layer ``[plan.ref, key buffer, value buffer, kb, kh, ks, vb, vh, vs, n]`` (the
    buffers' pointers and strides in floats, n the positions they hold before the pass; positions
    n .. n + T - 1 reserved; lists, or that int64 table ``[L, 10]`` made already), ``scales`` the
    attentions' scales (a list or float64 ``[L]``); ``visible`` as :func:`attn_mlp`'s."""
    B, T, _ = h.shape
    table = io if isinstance(io, torch.Tensor) else torch.tensor(io, dtype=torch.int64)  # [L, 10]
    sc = scales if isinstance(scales, torch.Tensor) else torch.tensor(scales, dtype=torch.float64)
    m = visible
    rc = LIBRARY.require().dl_layers(
        table.data_ptr(), table.shape[0], sc.data_ptr(), h.data_ptr(), B, T, cos.data_ptr(), sin_signed.data_ptr(),
        m.data_ptr() if m is not None else None, m.stride(0) if m is not None else 0, m.stride(1) if m is not None else 0,
        torch.get_num_threads())
    if rc:
        raise RuntimeError(f"layer_kernel.layers failed ({rc}: {'out of memory' if rc == -2 else 'a plan the kernels refuse'})")


def rms(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel's RMSNorm of each row of float32 ``h [..., n]`` (for tests)."""
    h2 = h.detach().to(torch.float32).reshape(-1, h.shape[-1]).contiguous()
    w = weight.detach().to(torch.float32).contiguous()
    out = torch.empty_like(h2)
    LIBRARY.require().dl_rms(h2.data_ptr(), w.data_ptr(), float(eps), h2.shape[0], h2.shape[1], out.data_ptr())
    return out.reshape(h.shape)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The kernel's ``silu(g) * u`` of float32 vectors (for tests)."""
    g2, u2 = (t.detach().to(torch.float32).reshape(-1).contiguous() for t in (g, u))
    out = torch.empty_like(g2)
    LIBRARY.require().dl_silu(g2.data_ptr(), u2.data_ptr(), g2.numel(), out.data_ptr())
    return out.reshape(g.shape)


def capped_tail(z: torch.Tensor, tail: torch.Tensor, width: int, spread: float) -> torch.Tensor:
    """The kernel's capped tail (``dl_feature_step``'s cap) of float32 rows ``z [R, n]`` and ``tail [R]`` (for tests)."""
    z2, t2 = z.detach().to(torch.float32).contiguous(), tail.detach().to(torch.float32).reshape(-1).contiguous()
    out = torch.empty_like(t2)
    if LIBRARY.require().dl_capped_tail(z2.data_ptr(), z2.shape[0], z2.shape[1], t2.data_ptr(), int(width), float(spread),
                                        out.data_ptr()):
        raise ValueError(f"layer_kernel.capped_tail: width must be 1..min(64, {z2.shape[1]})")
    return out
