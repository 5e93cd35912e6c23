"""Reading a GGUF file: its scalar metadata and a table of its tensors, each a view of the mapped file.

:func:`read_gguf` maps the file copy-on-write and parses the header and tensor table itself (what
``gguf.GGUFReader`` gives as ``.tensors``, without the seconds it spends on building every metadata
field); the tensors' bytes stay in the file's pages (:func:`release_file_pages` gives them back).

Every size the header states is checked against the file before it is used: a file that is not
GGUF, a truncated one, counts or string and array lengths that run past its end, an unknown value
or tensor type, a tensor whose shape is not whole blocks of its type, and tensor data that runs
past the end of the file or into the next tensor's each raise one :class:`GGUFFileError` (a
ValueError) naming the file and what is wrong, so no view reaches a kernel with fewer bytes than
its shape and type need.
"""

from __future__ import annotations

import ctypes
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["GGUFFileError", "GGUFTensor", "read_gguf", "release_file_pages"]


class GGUFFileError(ValueError):
    """A file that cannot be read as a GGUF model: the message names the file and what is wrong
    (a ValueError: the command line prints it as one error line, exit 2)."""


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


def read_gguf(path: str | Path, *, keep: bool = True) -> tuple[dict, dict[str, GGUFTensor]]:
    """``(scalar and string metadata, {name: GGUFTensor})`` of a GGUF file (versions 2 and 3).

    Reads only the header and the tensor table, skipping metadata arrays (the tokenizer's): what
    ``gguf.GGUFReader`` gives as ``.tensors`` (``.data``, ``.tensor_type``), without the seconds it
    spends on building every metadata field (6 s for SmolLM2's vocabulary here).  A damaged file
    raises :class:`GGUFFileError` (see the module docstring) before any tensor view is made.
    ``keep=False``: a check only; the mapping is not registered for :func:`release_file_pages` and
    goes when the views do.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # optional: models extra (gguf, transformers)

    path = Path(path)

    def bad(what: str) -> GGUFFileError:
        return GGUFFileError(f"{path}: {what}")

    try:
        size = path.stat().st_size
    except OSError as e:
        raise bad(f"cannot be read ({e.strerror})") from None
    if not path.is_file():
        raise bad("is not a file")
    if size < 24:
        raise bad(f"not a GGUF file ({size} bytes, shorter than a GGUF header)")
    try:
        mm = np.memmap(str(path), dtype=np.uint8, mode="c")
    except (OSError, ValueError) as e:
        raise bad(f"cannot be mapped ({e})") from None
    buf = memoryview(mm)
    if bytes(buf[:4]) != b"GGUF":
        raise bad("not a GGUF file (it does not start with the bytes 'GGUF')")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise bad(f"GGUF version {version} is not supported (2 or 3)")
    # every key/value takes at least 13 bytes (key length, type, one byte), every tensor entry 24
    if n_kv * 13 > size - 24 or n_tensors * 24 > size - 24:
        raise bad(f"the header states {n_tensors} tensors and {n_kv} metadata keys, more than its "
                  f"{size} bytes can hold (truncated or damaged)")
    pos = 24

    def need(p: int, n: int, what: str) -> None:
        if n < 0 or p + n > size:
            raise bad(f"truncated or damaged: {what} needs {n} bytes at offset {p}, the file has {size}")

    def unpack(fmt: str, p: int, what: str):
        need(p, struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, buf, p)

    def string(p, what):
        (n,) = unpack("<Q", p, what)
        need(p + 8, n, what)
        return bytes(buf[p + 8:p + 8 + n]).decode("utf-8", "replace"), p + 8 + n

    def skip(p, vtype, what):
        if vtype == 8:
            return string(p, what)[1]
        if vtype == 9:
            itype, count = unpack("<IQ", p, what)
            p += 12
            if itype in _SCALAR:
                n = count * np.dtype(_SCALAR[itype]).itemsize
                need(p, n, what)
                return p + n
            if itype not in (8, 9):
                raise bad(f"{what} has an unknown value type {itype}")
            need(p, count * (8 if itype == 8 else 12), what)  # each item takes at least that: no long loop
            for _ in range(count):
                p = skip(p, itype, what)
            return p
        if vtype not in _SCALAR:
            raise bad(f"{what} has an unknown value type {vtype}")
        need(p, np.dtype(_SCALAR[vtype]).itemsize, what)
        return p + np.dtype(_SCALAR[vtype]).itemsize

    meta = {}
    for i in range(n_kv):
        key, pos = string(pos, f"metadata key {i}")
        (vtype,) = unpack("<I", pos, f"metadata {key!r}")
        pos += 4
        if vtype == 8:
            meta[key], pos = string(pos, f"metadata {key!r}")
        elif vtype in _SCALAR:
            end = skip(pos, vtype, f"metadata {key!r}")
            meta[key] = np.frombuffer(buf, dtype=_SCALAR[vtype], count=1, offset=pos)[0].item()
            pos = end
        else:
            pos = skip(pos, vtype, f"metadata {key!r}")
    infos = []
    for i in range(n_tensors):
        name, pos = string(pos, f"the name of tensor {i}")
        (nd,) = unpack("<I", pos, f"tensor {name!r}")
        if not 1 <= nd <= 4:
            raise bad(f"tensor {name!r} has {nd} dimensions (GGUF tensors have 1 to 4)")
        dims = unpack(f"<{nd}Q", pos + 4, f"tensor {name!r}")
        qtype, offset = unpack("<IQ", pos + 4 + 8 * nd, f"tensor {name!r}")
        pos += 4 + 8 * nd + 12
        infos.append((name, qtype, dims, offset))
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align < 1 or align & (align - 1):
        raise bad(f"general.alignment {align!r} is not a power of two")
    start = -(-pos // align) * align
    tensors = {}
    spans = []
    for name, qtype, dims, offset in infos:
        if name in tensors:
            raise bad(f"tensor {name!r} is listed twice")
        try:
            elems, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        except (ValueError, KeyError):
            raise bad(f"tensor {name!r} has an unknown type {qtype} (not a GGML type this gguf-py knows)") from None
        tname = GGMLQuantizationType(qtype).name
        if any(d < 1 or d >= 1 << 40 for d in dims):
            raise bad(f"tensor {name!r} has dimensions {list(dims)} (each must be 1 to 2**40)")
        shape = tuple(int(d) for d in reversed(dims))
        if shape[-1] % elems:
            raise bad(f"tensor {name!r}: a row of {shape[-1]} elements is not whole {tname} blocks of {elems}")
        rows = int(np.prod(shape[:-1], dtype=object)) if len(shape) > 1 else 1
        row_bytes = shape[-1] // elems * nbytes
        n = rows * row_bytes
        if offset % align:
            raise bad(f"tensor {name!r}: data offset {offset} is not a multiple of the alignment {align}")
        if start + offset + n > size:
            raise bad(f"tensor {name!r} ({tname} {list(shape)}) needs {n} bytes at offset {start + offset}, "
                      f"past the end of the file ({size} bytes): truncated or damaged")
        spans.append((offset, offset + n, name))
        raw = mm[start + offset:start + offset + n]
        if qtype in (0, 1):  # F32, F16: the elements themselves (as GGUFReader gives them)
            data = raw.view({0: np.float32, 1: np.float16}[qtype]).reshape(shape)
        else:
            data = raw.reshape(*shape[:-1], row_bytes) if len(shape) > 1 else raw
        tensors[name] = GGUFTensor(name, qtype, shape, data)
    spans.sort()
    for (a0, a1, a), (b0, _, b) in zip(spans, spans[1:]):
        if b0 < a1:
            raise bad(f"tensor {a!r} needs {a1 - a0} bytes from data offset {a0}, which runs into tensor {b!r} "
                      f"at {b0}: its data is shorter than its shape and type need")
    if keep:
        _FILE_MAPS.append((mm.ctypes.data, mm.ctypes.data + mm.size, mm))  # never written: pages can be dropped
    return meta, tensors
