"""Reading a GGUF file: its scalar metadata and a table of its tensors, each a view of the mapped file.

:func:`read_gguf` maps the file copy-on-write and parses the header and tensor table itself (what
``gguf.GGUFReader`` gives as ``.tensors``, without the seconds it spends on building every metadata
field); the tensors' bytes stay in the file's pages (:func:`release_file_pages` gives them back).
"""

from __future__ import annotations

import ctypes
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["GGUFTensor", "read_gguf", "release_file_pages"]


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: ``data`` is a view of the mapped file (uint8 ``[rows, row_bytes]``
    for block types, the element dtype otherwise), ``shape`` in numpy order (rows last to first
    GGUF dimension)."""

    name: str
    qtype: int
    shape: tuple[int, ...]
    data: np.ndarray


_SCALAR = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}


# (start, end, the memmap) of every GGUF file mapped by read_gguf: copy-on-write mappings nothing writes
# to, so their pages are the file's and can be given back to the page cache (release_file_pages)
_FILE_MAPS: list[tuple[int, int, np.memmap]] = []


def release_file_pages(t: torch.Tensor) -> bool:
    """Drop the resident pages of ``t``'s bytes where they are a GGUF file's mapped pages
    (``madvise(MADV_DONTNEED)`` on the whole pages inside them): the memory returns to the page cache
    and a later read faults the same bytes back in from the file.  False (nothing done) where ``t``
    is not inside such a mapping (a copy, e.g. permuted rows) or the platform has no madvise."""
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    if not any(a <= start and end <= b for a, b, _ in _FILE_MAPS) or not hasattr(mmap, "MADV_DONTNEED"):
        return False
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, end // page * page
    if hi <= lo:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(lo, hi - lo, mmap.MADV_DONTNEED) == 0


def read_gguf(path: str | Path) -> tuple[dict, dict[str, GGUFTensor]]:
    """``(scalar and string metadata, {name: GGUFTensor})`` of a GGUF file (versions 2 and 3).

    Reads only the header and the tensor table, skipping metadata arrays (the tokenizer's): what
    ``gguf.GGUFReader`` gives as ``.tensors`` (``.data``, ``.tensor_type``), without the seconds it
    spends on building every metadata field (6 s for SmolLM2's vocabulary here).
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # optional: models extra (gguf, transformers)

    mm = np.memmap(str(path), dtype=np.uint8, mode="c")
    _FILE_MAPS.append((mm.ctypes.data, mm.ctypes.data + mm.size, mm))  # never written: pages can be dropped
    buf = memoryview(mm)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    pos = 24

    def string(p):
        (n,) = struct.unpack_from("<Q", buf, p)
        return bytes(buf[p + 8:p + 8 + n]).decode("utf-8", "replace"), p + 8 + n

    def skip(p, vtype):
        if vtype == 8:
            (n,) = struct.unpack_from("<Q", buf, p)
            return p + 8 + n
        if vtype == 9:
            itype, count = struct.unpack_from("<IQ", buf, p)
            p += 12
            if itype in _SCALAR:
                return p + count * np.dtype(_SCALAR[itype]).itemsize
            for _ in range(count):
                p = skip(p, itype)
            return p
        return p + np.dtype(_SCALAR[vtype]).itemsize

    meta = {}
    for _ in range(n_kv):
        key, pos = string(pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if vtype == 8:
            meta[key], pos = string(pos)
        elif vtype in _SCALAR:
            meta[key] = np.frombuffer(buf, dtype=_SCALAR[vtype], count=1, offset=pos)[0].item()
            pos = skip(pos, vtype)
        else:
            pos = skip(pos, vtype)
    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (nd,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{nd}Q", buf, pos + 4)
        qtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * nd)
        pos += 4 + 8 * nd + 12
        infos.append((name, qtype, dims, offset))
    align = int(meta.get("general.alignment", 32))
    start = -(-pos // align) * align
    tensors = {}
    for name, qtype, dims, offset in infos:
        elems, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        shape = tuple(int(d) for d in reversed(dims))
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        row_bytes = shape[-1] // elems * nbytes
        raw = mm[start + offset:start + offset + rows * row_bytes]
        if qtype in (0, 1):  # F32, F16: the elements themselves (as GGUFReader gives them)
            data = raw.view({0: np.float32, 1: np.float16}[qtype]).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], row_bytes) if len(shape) > 1 else raw
        tensors[name] = GGUFTensor(name, qtype, shape, data)
    return meta, tensors
