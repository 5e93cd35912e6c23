"""The native kernel for GGUF blocks (``block_matmul.c``): decode each weight row once, apply it to every row.

``linear(x, blocks, qtype, n, k, bias)`` computes ``x @ dequantize(W).T (+ bias)`` for ``x`` of any
number of rows with ``W`` kept as the GGUF tensor's block bytes (``[N, row_bytes]`` uint8, the
layout ``gguf.GGUFReader`` returns), for the GGML types the C source decodes (Q4_1, Q5_0, Q8_0,
Q4_K, Q6_K; ``draftcert.gguf.blocks`` is the table of types).  Each weight row is decoded once per
call into an L1 buffer and fed to every input row, so the block bytes are read once whatever M is.
Under the contract ``gguf-exact-f32`` the weights are exactly gguf-py's dequantised values
(``gguf.quants.dequantize``, what the float32 checkpoints hold), activations and accumulation
float32, one fixed reduction order per output that depends on nothing but ``K`` and the build
(``block_matmul.c`` states it), so outputs are batch invariant: a row's bits are the same alone and
inside a pass of any size, at any thread count.  Error bound: :func:`error_bound`.  Under
``gguf-q8`` (:func:`pack_q8`, :func:`linear_q8`) each input row is quantised per block to 8 bits as
llama.cpp does, with integer block dot products and float32 sums in one fixed order.

Built through ``draftcert.native`` (output rows split over torch's thread count, OpenMP);
``-ffp-contract=off`` keeps every multiply and add of a decode rounded on its own, as numpy's are; the
accumulation uses explicit fused multiply-adds.  Where the library is unavailable (:data:`LIBRARY`'s
``reason()``) callers use the dequantised float32 weights (``draftcert.gguf.layers``).
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

import torch

from ..native import NativeLibrary

__all__ = ["LIBRARY", "vector_width", "block_shape", "linear", "dequantize", "error_bound", "reduction_roundings",
           "q8_vectorised", "Q8_PATHS", "pack_q8", "packed_bytes", "linear_q8", "linear_q8_portable", "quantize_q8"]

LIBRARY = NativeLibrary(Path(__file__).with_name("block_matmul.c"), "dq", {  # dq_ (exact f32) and dq8_ (gguf-q8)
    "dq_vector_width": ("", "I"), "dq_block": ("IPP", "I"),
    "dq_linear": ("IPLLLPLPPI", "I"), "dq_dequantize": ("IPLLLPI", "I"), "dq8_vectorised": ("", "I"),
    "dq8_packed_bytes": ("ILL", "L"), "dq8_pack": ("IPLLLPI", "I"), "dq8_linear": ("IPLLPLPPI", "I"),
    "dq8_linear_portable": ("IPLLPLPP", "I"), "dq8_quantize": ("IPLLPPPPI", "I"),
})


def vector_width() -> int:
    """Float32 lanes of the build's vectors (16 AVX-512, 8 AVX2, 4 otherwise); 0 where unavailable."""
    lib = LIBRARY.lib
    return lib.dq_vector_width() if lib is not None else 0


def block_shape(qtype: int) -> tuple[int, int]:
    """(elements, bytes) of one block of GGML type ``qtype``, as the kernel decodes it; ValueError
    for a type it does not decode."""
    elements, nbytes = ctypes.c_int(), ctypes.c_int()
    if LIBRARY.require().dq_block(int(qtype), ctypes.byref(elements), ctypes.byref(nbytes)):
        raise ValueError(f"block_matmul: GGML type {qtype} has no kernel")
    return elements.value, nbytes.value


def reduction_roundings(k: int, vw: int | None = None) -> int:
    """Roundings one product passes through in the kernel's sum over ``k`` terms: ``k / vw``
    fused multiply-adds in its lane and ``log2(vw)`` adds of the lanes' tree."""
    vw = vw or vector_width() or 4
    return -(-k // vw) + int(math.log2(vw))


def error_bound(abs_products: torch.Tensor, k: int, *, extra_roundings: int = 0) -> torch.Tensor:
    """``gamma_n * abs_products`` with ``n = reduction_roundings(k) + extra_roundings`` and
    ``gamma_n = n u / (1 - n u)``, ``u = 2**-24``: the bound on ``|y_kernel - y_exact|`` where
    ``abs_products = sum_k |w_k x_k|`` (Higham, Accuracy and Stability, Lemma 3.1 / eq. 3.5: each
    product is rounded at most ``n`` times on its way into the sum).  Add ``error_bound(.., k)`` of
    another summation (``F.linear``'s, whose order is unknown: take ``n = k``) to compare two kernels."""
    n = reduction_roundings(k) + extra_roundings
    u = 2.0 ** -24
    return abs_products * (n * u / (1 - n * u))


def _check(blocks: torch.Tensor, qtype: int, n: int, k: int) -> int:
    qk, qb = block_shape(qtype)
    if k % qk:
        raise ValueError(f"block_matmul: K={k} is not a multiple of the GGML type {qtype} block of {qk}")
    row_bytes = k // qk * qb
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != (n, row_bytes) or not blocks.is_contiguous():
        raise ValueError(f"block_matmul: expected contiguous uint8 blocks of shape ({n}, {row_bytes}) for a "
                         f"GGML type {qtype} weight [{n}, {k}], got {blocks.dtype} {tuple(blocks.shape)}")
    return row_bytes


def _operands(x: torch.Tensor, bias, n: int, k: int, who: str):
    """(x in the kernel's layout or None when it has no rows, the float32 bias or None, the output
    ``[..., n]`` to fill) for a kernel call; ValueError for an input the kernels do not take.  A
    contiguous ``[..., k]`` x is read as ``[rows, k]`` where it lies: a decode step makes ~100 calls
    for a few microseconds of kernel each, so nothing already in that layout is copied."""
    if x.dtype != torch.float32 or x.shape[-1] != k or x.device.type != "cpu":
        raise ValueError(f"{who}: x {tuple(x.shape)} {x.dtype} on {x.device} does not fit a [{n}, {k}] weight")
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    if x.numel() == 0:
        return None, None, y
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or bias.device.type != "cpu"):
        bias = bias.detach().to("cpu", torch.float32).contiguous()
    return (x if x.is_contiguous() else x.contiguous()), bias, y


def linear(x: torch.Tensor, blocks: torch.Tensor, qtype: int, n: int, k: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, dequantize(blocks), bias)`` for float32 CPU ``x`` of shape ``(..., k)``, any rows."""
    lib = LIBRARY.require()
    row_bytes = _check(blocks, qtype, n, k)
    x2, b, y = _operands(x, bias, n, k, "block_matmul.linear")
    if x2 is None:
        return y
    rows = x2.numel() // k
    rc = lib.dq_linear(int(qtype), blocks.data_ptr(), row_bytes, n, k, x2.data_ptr(), rows,
                       b.data_ptr() if b is not None else None, y.data_ptr(), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"block_matmul kernel refused the call ({rc}): GGML type {qtype} [{n}, {k}], {rows} rows")
    return y


def dequantize(blocks: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """The ``[n, k]`` float32 weights ``blocks`` encode (the kernel's own decode)."""
    lib = LIBRARY.require()
    row_bytes = _check(blocks, qtype, n, k)
    out = torch.empty(n, k, dtype=torch.float32)
    if lib.dq_dequantize(int(qtype), blocks.data_ptr(), row_bytes, n, k, out.data_ptr(), torch.get_num_threads()):
        raise RuntimeError(f"block_matmul could not decode GGML type {qtype} [{n}, {k}]")
    return out


# ----------------------------------------------------------------------------- the contract "gguf-q8"

Q8_PATHS = {2: "avx512-vnni", 3: "avx-vnni", 4: "avx2"}  # dq8_vectorised() -> name; 0: the portable code


def q8_vectorised() -> str:
    """Which vector code the loaded build runs ``gguf-q8`` with: ``"avx512-vnni"`` (512-bit vpdpbusd),
    ``"avx-vnni"`` (256-bit vpdpbusd), ``"avx2"`` (vpmaddubsw + vpmaddwd), or ``""`` for the portable
    code (also where the library is unavailable).  Chosen when the kernel is compiled (``-march=native``
    and ``$DRAFTCERT_NATIVE_CFLAGS``); every one gives the same bits, only the speed differs."""
    lib = LIBRARY.lib
    return Q8_PATHS.get(int(lib.dq8_vectorised()), "") if lib is not None else ""


def pack_q8(blocks: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """The ``gguf-q8`` layout of a ``[n, row_bytes]`` GGUF tensor: uint8, groups of 16 output rows,
    each block's 16 scales then its codes interleaved 4 k at a time (``block_matmul.c``)."""
    lib = LIBRARY.require()
    row_bytes = _check(blocks, qtype, n, k)
    out = torch.empty(packed_bytes(qtype, n, k), dtype=torch.uint8)
    if lib.dq8_pack(int(qtype), blocks.data_ptr(), row_bytes, n, k, out.data_ptr(), torch.get_num_threads()):
        raise RuntimeError(f"block_matmul could not pack GGML type {qtype} [{n}, {k}]")
    return out


def packed_bytes(qtype: int, n: int, k: int) -> int:
    """Bytes of :func:`pack_q8`'s packing of an ``[n, k]`` weight of ``qtype``: whole groups of 16
    output rows one after another, so the first ``16 g`` rows' packing is its first
    ``packed_bytes(qtype, 16 g, k)`` bytes."""
    lib = LIBRARY.require()
    size = int(lib.dq8_packed_bytes(int(qtype), int(n), int(k)))
    if size < 0:
        raise ValueError(f"block_matmul.packed_bytes: [{n}, {k}] does not fit GGML type {qtype}")
    return size


_PACKED_BYTES: dict[tuple[int, int, int], int] = {}  # (qtype, n, k) -> packed_bytes, asked of the library once


def _q8_call(fn: str, x: torch.Tensor, packed: torch.Tensor, qtype: int, n: int, k: int, bias, threads: bool):
    lib = LIBRARY.require()
    key = (int(qtype), int(n), int(k))
    size = _PACKED_BYTES.get(key)
    if size is None:
        size = _PACKED_BYTES[key] = int(lib.dq8_packed_bytes(*key))
    if packed.dtype != torch.uint8 or packed.numel() != size or not packed.is_contiguous():
        raise ValueError(f"block_matmul.linear_q8: {packed.numel()} packed bytes are not a GGML type {qtype} [{n}, {k}] pack_q8")
    x2, b, y = _operands(x, bias, n, k, "block_matmul.linear_q8")
    if x2 is None:
        return y
    rows = x2.numel() // k
    args = [key[0], packed.data_ptr(), n, k, x2.data_ptr(), rows, b.data_ptr() if b is not None else None, y.data_ptr()]
    rc = getattr(lib, fn)(*args, torch.get_num_threads()) if threads else getattr(lib, fn)(*args)
    if rc:
        raise RuntimeError(f"block_matmul {fn} refused the call ({rc}): GGML type {qtype} [{n}, {k}], {rows} rows")
    return y


def linear_q8(x: torch.Tensor, packed: torch.Tensor, qtype: int, n: int, k: int,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x @ W.T (+ bias)`` under the contract ``gguf-q8`` (``packed`` from :func:`pack_q8`):
    each row of ``x`` quantised per block to 8 bits as llama.cpp does, integer block dot products,
    the scaled block sums added in float32 in one fixed order.  Batch invariant, thread invariant and
    the same bits on every build (see :func:`linear_q8_portable`)."""
    return _q8_call("dq8_linear", x, packed, qtype, n, k, bias, True)


def linear_q8_portable(x: torch.Tensor, packed: torch.Tensor, qtype: int, n: int, k: int,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same outputs from the kernel's portable code, one output at a time (for tests: slow)."""
    return _q8_call("dq8_linear_portable", x, packed, qtype, n, k, bias, False)


def quantize_q8(x: torch.Tensor, qtype: int, portable: bool = False) -> dict[str, torch.Tensor]:
    """The kernel's 8-bit rows for weights of type ``qtype``: ``q`` [M, K] int8, ``d`` [M, K/qk] the
    float32 block scales its dot products use, ``sums`` [M, K/sub] int32 (sub 16 for Q6_K, else
    32) and, for Q4_1, ``s`` [M, K/32] (Q8_1's s); ``portable``: by the scalar code (the same values)."""
    lib = LIBRARY.require()
    qtype = int(qtype)
    x2 = x.detach().to(torch.float32).reshape(-1, x.shape[-1]).contiguous()
    m, k = x2.shape
    qk = block_shape(qtype)[0]
    sub = 16 if qtype == 14 else 32
    out = {"q": torch.empty(m, k, dtype=torch.int8), "d": torch.empty(m, k // qk), "sums": torch.empty(m, k // sub, dtype=torch.int32),
           "s": torch.empty(m, k // 32)}
    if k % qk or lib.dq8_quantize(qtype, x2.data_ptr(), m, k, out["q"].data_ptr(), out["d"].data_ptr(),
                                  out["sums"].data_ptr(), out["s"].data_ptr(), int(portable)):
        raise ValueError(f"block_matmul.quantize_q8: K={k} does not fit GGML type {qtype}")
    if qtype != 3:
        del out["s"]
    return out
