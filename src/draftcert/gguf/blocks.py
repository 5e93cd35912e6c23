"""The GGUF block types draftcert knows: one table of their traits, and their float32 values.

:func:`block_types` holds, per GGML type a GGUF file may store a weight in, its name, its block
geometry (elements per block, bytes per block: gguf-py's ``GGML_QUANT_SIZES``) and whether
``draftcert.kernels.block_matmul`` computes it from its blocks (``kernel``: the types the C source
decodes, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K).  A weight of a type without a kernel is dequantised to
float32 at load (gguf-py's decode) and computed as a plain ``nn.Linear``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ..kernels import block_matmul

__all__ = ["BlockType", "KERNEL_TYPES", "block_type", "block_types", "dequantize_gguf", "decode_rows", "quantize_rows", "check_blocks"]

# GGMLQuantizationType values of the types block_matmul.c decodes (its dq_block answers for exactly these)
KERNEL_TYPES = frozenset({3, 6, 8, 12, 14})  # Q4_1, Q5_0, Q8_0, Q4_K, Q6_K


@dataclass(frozen=True)
class BlockType:
    """One GGML type: ``elements`` weights stored in ``nbytes`` bytes per block; ``kernel``: computed
    from its blocks by ``block_matmul`` (else dequantised to float32 at load)."""

    ggml_type: int
    name: str
    elements: int
    nbytes: int
    kernel: bool


@lru_cache(maxsize=None)
def block_type(qtype: int) -> BlockType:
    """The traits of GGML type ``qtype``; ValueError for a number gguf-py does not know."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # optional: models extra (gguf)

    try:
        t = GGMLQuantizationType(int(qtype))
    except ValueError:
        raise ValueError(f"GGML type {qtype} is not a type this version of gguf-py knows") from None
    elements, nbytes = GGML_QUANT_SIZES[t]
    return BlockType(int(t), t.name, int(elements), int(nbytes), int(t) in KERNEL_TYPES)


def block_types() -> dict[int, BlockType]:
    """The table: every GGML type gguf-py knows, ``{ggml_type: BlockType}`` (built from its registry
    on first use: gguf-py is an optional dependency, the ``models`` extra)."""
    from gguf.constants import GGMLQuantizationType  # optional: models extra (gguf)

    return {int(t): block_type(int(t)) for t in GGMLQuantizationType}


def dequantize_gguf(data, qtype: int) -> np.ndarray:
    """float32 values of GGUF tensor data of GGML type ``qtype``: gguf-py's own dequantisation, or
    for a type with a kernel the kernel's own decode (the same values, tested, faster)."""
    from gguf import GGMLQuantizationType  # optional: models extra (gguf, transformers)
    from gguf.quants import dequantize

    data = np.asarray(data)
    if int(qtype) in KERNEL_TYPES and block_matmul.LIBRARY.available() and data.ndim == 2 and data.dtype == np.uint8:
        t = block_type(qtype)
        n, k = data.shape[0], data.shape[1] // t.nbytes * t.elements
        return block_matmul.dequantize(torch.from_numpy(np.ascontiguousarray(data)), int(qtype), n, k).numpy()

    return np.asarray(dequantize(np.asarray(data), GGMLQuantizationType(int(qtype))), dtype=np.float32)


def decode_rows(blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """float32 ``[n, k]`` values of ``n`` rows of GGUF blocks (CPU uint8 ``[n, row_bytes]``)."""
    return torch.from_numpy(dequantize_gguf(blocks.cpu().contiguous().numpy(), qtype)).reshape(blocks.shape[0], k)


def quantize_rows(weight: torch.Tensor, qtype: int) -> torch.Tensor:
    """GGUF blocks (CPU uint8 ``[n, row_bytes]``) of a float ``[n, k]`` weight in type ``qtype``, by
    gguf-py's own quantiser (what ``llama-quantize`` writes for Q8_0: per 32 weights, ``d = amax / 127``
    in float16 and ``round(w / d)``); ``decode_rows`` of them is the weight the blocks hold."""
    from gguf import GGMLQuantizationType  # optional: models extra (gguf)
    from gguf.quants import quantize

    w = weight.detach().to(torch.float32).cpu().contiguous()
    if w.ndim != 2 or w.shape[1] % block_type(qtype).elements:
        raise ValueError(f"quantize_rows: a {block_type(qtype).name} weight needs [n, k] with k a multiple of "
                         f"{block_type(qtype).elements}, got {tuple(w.shape)}")
    return torch.from_numpy(np.ascontiguousarray(quantize(w.numpy(), GGMLQuantizationType(int(qtype)))))


def check_blocks(who: str, blocks: torch.Tensor, qtype: int, n: int, k: int) -> None:
    """Refuse ``blocks`` that are not ``[n, k / qk * block_bytes]`` uint8 of ``qtype``."""
    t = block_type(qtype)
    if k % t.elements or tuple(blocks.shape) != (n, k // t.elements * t.nbytes) or blocks.dtype != torch.uint8:
        raise ValueError(f"{who}: {tuple(blocks.shape)} {blocks.dtype} blocks do not hold a "
                         f"{t.name} weight [{n}, {k}]")


