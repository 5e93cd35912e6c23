"""Linear layers that keep a GGUF tensor's blocks as stored, and GGUF files loaded through them.

:class:`GGUFLinear` replaces ``nn.Linear`` for a weight held as GGUF blocks (``[N, row_bytes]``
uint8, as ``gguf.GGUFReader`` returns a tensor's ``.data``) of a type the native kernel decodes
(``quantmm.SUPPORTED``: Q4_1, Q5_0, Q8_0, Q4_K, Q6_K).  Its forward, for float32 CPU inputs, is
``quantmm.linear``: exactly the dequantised weights (gguf-py's values, those the float32 checkpoints
hold), float32 activations and accumulation, one fixed reduction order per output, so a row's
output bits do not depend on how many rows share the pass (batch invariant, any M: prefills too).
That is the numeric contract ``"gguf-exact-f32"`` (:data:`CONTRACT`, :func:`numerics_of`).  Versus
``F.linear`` on the float32 weights the two differ only by float32 summation order:

    |y_kernel - y_exact| <= gamma_n * sum_k |w_k x_k|,  n = K / VW + log2(VW),  gamma_n = n u / (1 - n u),

with ``u = 2**-24`` and VW the kernel's lanes (16 on AVX-512); ``F.linear``'s own error is at most
``gamma_K`` of the same sum, so the two agree within ``(gamma_n + gamma_K) * sum_k |w_k x_k|``
(``quantmm.error_bound``).  Other inputs (another dtype or device, or no native kernel) use the
dequantised weights with ``F.linear``.

``.weight`` is the float32 weight: for an output layer tied to the embedding, the embedding's own
parameter (the same values, no copy); otherwise dequantised on each access (a full decode: read it
rarely; writing to it changes nothing).

:func:`load_gguf_causal_lm` builds the transformers model from a GGUF file as transformers' own
GGUF loading does (config, names, the llama q/k row permutation), but installs a ``GGUFLinear`` for
every linear weight of a supported type instead of dequantising it, and a :class:`GGUFEmbedding` for
an input embedding of a supported type (an output layer tied to it computes from the same blocks);
everything else (norms, biases, weights of other types, with one line naming them) is dequantised at load.  Where the
native kernel is unavailable every weight is dequantised (one line says why) and the model is the
plain float32 one.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import struct
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import quantmm
from .attention import ROW_INVARIANT, use_row_invariant_attention

__all__ = ["CONTRACT", "CONTRACT_Q8", "CONTRACTS", "set_numerics", "GGUFLinear", "GGUFEmbedding", "Siblings", "group_siblings", "dissolve_siblings", "GGUFTensor", "numerics_of", "read_gguf", "load_gguf_causal_lm", "dequantize_gguf",
           "write_gguf_metadata", "load_gguf_folder", "GGUF_FILE"]

CONTRACT = quantmm.CONTRACT
CONTRACT_Q8 = quantmm.CONTRACT_Q8
CONTRACTS = quantmm.CONTRACTS


def dequantize_gguf(data, qtype: int) -> np.ndarray:
    """float32 values of GGUF tensor data of GGML type ``qtype``: gguf-py's own dequantisation, or
    for a ``quantmm.SUPPORTED`` type the native kernel's decode (the same values, tested, faster)."""
    from gguf import GGMLQuantizationType  # optional: models extra (gguf, transformers)
    from gguf.quants import dequantize

    data = np.asarray(data)
    if int(qtype) in quantmm.SUPPORTED and quantmm.available() and data.ndim == 2 and data.dtype == np.uint8:
        qk, qb = quantmm.block_shape(int(qtype))
        n, k = data.shape[0], data.shape[1] // qb * qk
        return quantmm.dequantize(torch.from_numpy(np.ascontiguousarray(data)), int(qtype), n, k).numpy()

    return np.asarray(dequantize(np.asarray(data), GGMLQuantizationType(int(qtype))), dtype=np.float32)


def _decode_rows(blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """float32 ``[n, k]`` values of ``n`` rows of GGUF blocks (CPU uint8 ``[n, row_bytes]``)."""
    return torch.from_numpy(dequantize_gguf(blocks.cpu().contiguous().numpy(), qtype)).reshape(blocks.shape[0], k)


def _check_blocks(who: str, blocks: torch.Tensor, qtype: int, n: int, k: int) -> None:
    """Refuse ``blocks`` that are not ``[n, k / qk * block_bytes]`` uint8 of ``qtype``."""
    qk, qb = quantmm.block_shape(qtype)
    if k % qk or tuple(blocks.shape) != (n, k // qk * qb) or blocks.dtype != torch.uint8:
        raise ValueError(f"{who}: {tuple(blocks.shape)} {blocks.dtype} blocks do not hold a "
                         f"{quantmm.SUPPORTED[qtype]} weight [{n}, {k}]")


class GGUFLinear(nn.Module):
    """``y = x @ dequant(W).T + b`` with ``W`` kept as GGUF blocks (see the module docstring).

    ``blocks``: ``[out_features, row_bytes]`` uint8 (a buffer, ``qweight``); ``qtype``: the GGML type
    number; ``bias``: float32 ``[out_features]`` or None; ``tied``: a float32 parameter holding the
    same values (an embedding the output layer is tied to), returned as ``.weight``.
    """

    def __init__(self, blocks: torch.Tensor, qtype: int, in_features: int, out_features: int,
                 bias: torch.Tensor | None = None, tied: torch.Tensor | None = None, numerics: str = CONTRACT):
        super().__init__()
        qtype = int(qtype)
        _check_blocks("GGUFLinear", blocks, qtype, out_features, in_features)
        self.in_features, self.out_features, self.qtype = int(in_features), int(out_features), qtype
        self.register_buffer("qweight", blocks.contiguous())
        self.bias = nn.Parameter(bias.detach().to(torch.float32), requires_grad=False) if bias is not None else None
        self.__dict__["_tied"] = tied
        self.numerics = CONTRACT
        self.q8weight = None
        self.set_numerics(numerics)

    def set_numerics(self, numerics: str) -> "GGUFLinear":
        """Compute under ``numerics`` from now on: ``"gguf-exact-f32"`` (the blocks as stored) or
        ``"gguf-q8"`` (8-bit activations: the blocks repacked once for the integer kernel, kept
        beside them)."""
        if numerics not in quantmm.CONTRACTS:
            raise ValueError(f"GGUFLinear: numerics must be one of {', '.join(quantmm.CONTRACTS)}, got {numerics!r}")
        dissolve_siblings(self)
        if numerics == quantmm.CONTRACT_Q8 and self.q8weight is None:
            self.q8weight = quantmm.pack_q8(self.qweight.cpu().contiguous(), self.qtype, self.out_features, self.in_features)
            release_file_pages(self.qweight)  # the repacked copy is what runs: the file's pages need not stay resident
        elif numerics == CONTRACT:
            self.q8weight = None
        self.numerics = numerics
        return self

    @property
    def qtype_name(self) -> str:
        return quantmm.SUPPORTED[self.qtype]

    def dequantized(self) -> torch.Tensor:
        """The float32 ``[out, in]`` weight the blocks encode (decoded now)."""
        return _decode_rows(self.qweight, self.qtype, self.in_features).to(self.qweight.device)

    @property
    def weight(self) -> torch.Tensor:
        tied = self.__dict__.get("_tied")
        return tied if tied is not None else self.dequantized()

    def weight_rows(self, idx: torch.Tensor) -> torch.Tensor:
        """``self.weight[idx]`` (float32 ``[len(idx), in]``), decoding only those rows' blocks."""
        tied = self.__dict__.get("_tied")
        if tied is not None:
            return tied.index_select(0, idx.to(tied.device))
        blocks = self.qweight.cpu().index_select(0, idx.reshape(-1).cpu())  # [n, row_bytes]
        return _decode_rows(blocks, self.qtype, self.in_features).to(self.qweight.device)

    @weight.setter
    def weight(self, value) -> None:  # transformers' tie_weights(): keep the blocks, remember the tie
        if tuple(value.shape) != (self.out_features, self.in_features):
            raise ValueError(f"GGUFLinear: cannot tie a {tuple(value.shape)} weight to [{self.out_features}, {self.in_features}]")
        self.__dict__["_tied"] = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if x.dtype == torch.float32 and x.device.type == "cpu" and self.qweight.device.type == "cpu" and quantmm.available():
            siblings = self.__dict__.get("_siblings")
            if siblings is not None:  # one stacked pass under this layer's own contract
                return siblings.output(self, x)
            if self.q8weight is not None:
                return quantmm.linear_q8(x, self.q8weight, self.qtype, self.out_features, self.in_features, self.bias)
            return quantmm.linear(x, self.qweight, self.qtype, self.out_features, self.in_features, self.bias)
        return F.linear(x, self.weight.to(x.device, x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def first_rows(self, n: int) -> "GGUFLinear":
        """A layer computing this one's first ``m >= n`` outputs on views of its weights (no copy), with
        the same bits as this layer's first m columns under either contract (an output column depends
        on its weight row, its bias and x only).  Under ``gguf-q8`` the packing holds whole groups of 16
        rows, so m is n rounded up to a multiple of 16 (at most ``out_features``); else m = n."""
        if not 1 <= n <= self.out_features:
            raise ValueError(f"GGUFLinear.first_rows: n must be in 1..{self.out_features}, got {n}")
        m = n if self.q8weight is None else min(self.out_features, -(-n // 16) * 16)
        tied = self.__dict__.get("_tied")
        layer = GGUFLinear(self.qweight[:m], self.qtype, self.in_features, m,
                           bias=None if self.bias is None else self.bias[:m], tied=None if tied is None else tied[:m])
        if self.q8weight is not None:  # a prefix of the packing: the first m / 16 groups
            layer.q8weight = self.q8weight[: quantmm.packed_bytes(self.qtype, m, self.in_features)]
            layer.numerics = self.numerics
        return layer

    def to_linear(self) -> nn.Linear:
        """A plain float32 ``nn.Linear`` holding the weights the blocks encode (a copy: editing it leaves
        the blocks as they are), e.g. for a drafter derived from the target that rewrites its weights."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device=self.qweight.device)
        with torch.no_grad():
            lin.weight.copy_(self.weight)
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return lin.requires_grad_(False)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, type={self.qtype_name}, "
                f"bias={self.bias is not None}{', tied' if self.__dict__.get('_tied') is not None else ''}, numerics={self.numerics}")


# Projections of one module that read the same input: computed as one pass where they share a type.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class Siblings:
    """``GGUFLinear`` layers that a module calls on one input tensor (``SIBLINGS``: attention's
    q/k/v, the MLP's gate/up), computed as one layer of their stacked outputs, under either contract.

    The first member called on ``x`` computes ``x @ [W_1; ...; W_n].T (+ [b_1; ...])`` in one kernel
    call (one pass over the weights, one thread fork; under ``gguf-q8`` one quantisation of ``x``)
    and returns its own columns; the others, called next on the same tensor object, take theirs
    from that pass.  The bits are each member's own: under both contracts an output column depends
    on its weight row, its bias and ``x`` only (one fixed order per output, not on the other columns
    of the pass).  The stacked weights are the members' end to end (``gguf``: their block rows;
    ``gguf-q8``: their packings, every member but the last with a multiple of 16 outputs, whole
    groups), and each member's ``qweight`` / ``q8weight`` becomes a view into them, so no memory is
    added (the file pages the ``gguf`` blocks were copied from are given back).  A member called on
    another tensor, or twice, computes the stacked pass again (right, only slower)."""

    def __init__(self, members: list["GGUFLinear"]):
        first = members[0]
        self.members = list(members)
        self.numerics, self.qtype, self.k = first.numerics, first.qtype, first.in_features
        self.n = sum(m.out_features for m in members)
        self.bias = torch.cat([m.bias for m in members]) if first.bias is not None else None  # [n]
        self.q8 = self.numerics == CONTRACT_Q8
        # gguf-q8: [sum of the members' packed bytes]; gguf: [n, row_bytes] block rows
        self.weight = torch.cat([m.q8weight if self.q8 else m.qweight for m in members])
        self.spans: list[tuple[int, int]] = []  # [member] its output columns (a copy.deepcopy keeps them)
        col = byte = 0
        for m in members:
            if self.q8:
                size = m.q8weight.numel()
                m.q8weight = self.weight[byte: byte + size]  # a view: the stacked copy is the only one
                byte += size
            else:
                old = m.qweight
                m.qweight = self.weight[col: col + m.out_features]  # rows of the stacked blocks
                release_file_pages(old)  # the copy is what runs: the file's pages need not stay resident
            self.spans.append((col, col + m.out_features))
            col += m.out_features
            m.__dict__["_siblings"] = self
        self._last = None  # (x, its version, the columns not yet taken by member index)

    def output(self, member: "GGUFLinear", x: torch.Tensor) -> torch.Tensor:
        i = next(j for j, m in enumerate(self.members) if m is member)
        last = self._last
        version = None if x.is_inference() else x._version  # inference tensors keep no version counter
        if last is not None and last[0] is x and last[1] == version and i in last[2]:
            y = last[2].pop(i)
            if not last[2]:
                self._last = None
            return y
        linear = quantmm.linear_q8 if self.q8 else quantmm.linear
        y_all = linear(x, self.weight, self.qtype, self.n, self.k, self.bias)  # [..., n]
        cols = {j: y_all[..., a:b] for j, (a, b) in enumerate(self.spans)}
        y = cols.pop(i)
        self._last = (x, version, cols) if cols else None  # holds x: its identity cannot be reused meanwhile
        return y

    @staticmethod
    def can_join(members: list["GGUFLinear"]) -> bool:
        first = members[0]
        q8 = first.numerics == CONTRACT_Q8
        return (len(members) > 1 and all(m.numerics == first.numerics and (m.q8weight is not None) == q8
                                         and m.qweight.device.type == "cpu" and m.qtype == first.qtype
                                         and m.in_features == first.in_features
                                         and (m.bias is None) == (first.bias is None)
                                         and m.__dict__.get("_tied") is None for m in members)
                and (not q8 or all(m.out_features % 16 == 0 for m in members[:-1])))


def dissolve_siblings(layer: "GGUFLinear") -> None:
    """``layer``'s ``Siblings`` (if any) computes no more: each member computes alone (on its own
    view of the stacked weights)."""
    group = layer.__dict__.get("_siblings")
    if group is not None:
        for m in group.members:
            m.__dict__["_siblings"] = None
        group._last = None


def group_siblings(model: nn.Module) -> int:
    """Form ``Siblings`` in ``model``: per module, its ``SIBLINGS`` children that are ``GGUFLinear``
    of one type and contract (q and k together where v has another type); the groups formed."""
    formed = 0
    for mod in model.modules():
        for names in SIBLINGS:
            layers = [getattr(mod, n, None) for n in names]
            layers = [m for m in layers if isinstance(m, GGUFLinear)]
            for m in layers:
                dissolve_siblings(m)
            by_kind: dict[tuple[str, int], list[GGUFLinear]] = {}
            for m in layers:
                by_kind.setdefault((m.numerics, m.qtype), []).append(m)
            for members in by_kind.values():
                if Siblings.can_join(members):
                    Siblings(members)
                    formed += 1
    return formed


class GGUFEmbedding(nn.Module):
    """``nn.Embedding`` with its table kept as GGUF blocks: ``forward(ids)[..., :]`` is row ``ids`` of
    the dequantised table, decoded only for the rows looked up (the same float32 values as the
    dequantised ``nn.Embedding``, bit for bit: ``quantmm.dequantize`` is gguf-py's decode, tested).

    The float32 table of a 151,936-token vocabulary is 0.9 GB at 1,536 dimensions; its Q4_K blocks
    are 0.13 GB.  ``blocks``: ``[num_embeddings, row_bytes]`` uint8 (a buffer, ``qweight``), of a type
    in ``quantmm.SUPPORTED``.  ``.weight`` is the whole float32 table, decoded on each access (read
    it rarely).
    """

    def __init__(self, blocks: torch.Tensor, qtype: int, num_embeddings: int, embedding_dim: int,
                 padding_idx: int | None = None):
        super().__init__()
        qtype = int(qtype)
        _check_blocks("GGUFEmbedding", blocks, qtype, num_embeddings, embedding_dim)
        self.num_embeddings, self.embedding_dim, self.qtype = int(num_embeddings), int(embedding_dim), qtype
        self.padding_idx = padding_idx  # as nn.Embedding's: only what it records (no gradient here)
        self.register_buffer("qweight", blocks.contiguous())

    @property
    def qtype_name(self) -> str:
        return quantmm.SUPPORTED[self.qtype]

    @property
    def weight(self) -> torch.Tensor:
        """The float32 ``[num_embeddings, embedding_dim]`` table (decoded now)."""
        return _decode_rows(self.qweight, self.qtype, self.embedding_dim).to(self.qweight.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # noqa: D102
        flat = ids.reshape(-1)  # [n]
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"GGUFEmbedding: token ids must lie in [0, {self.num_embeddings}); got "
                             f"{int(flat.min())}..{int(flat.max())}")
        rows = self.qweight.cpu().index_select(0, flat.cpu())  # [n, row_bytes]: the looked-up rows' blocks
        return _decode_rows(rows, self.qtype, self.embedding_dim).to(ids.device).reshape(*ids.shape, self.embedding_dim)  # [..., D]

    def to_embedding(self) -> nn.Embedding:
        """A plain float32 ``nn.Embedding`` of the same table (a copy)."""
        emb = nn.Embedding(self.num_embeddings, self.embedding_dim, self.padding_idx, device=self.qweight.device)
        with torch.no_grad():
            emb.weight.copy_(self.weight)
        return emb.requires_grad_(False)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.qtype_name}"


def numerics_of(model: nn.Module) -> str:
    """The numeric contract a model computes under: ``"gguf-q8"`` where any layer is a ``GGUFLinear``
    computing with 8-bit activations, ``"gguf-exact-f32"`` where any is one run by the native kernel
    on its blocks, else the dtype of its parameters (``"float32"``, ...)."""
    layers = [m for m in model.modules() if isinstance(m, GGUFLinear) and m.qweight.device.type == "cpu"]
    if quantmm.available() and layers:
        return quantmm.CONTRACT_Q8 if any(m.q8weight is not None for m in layers) else CONTRACT
    p = next(iter(model.parameters()), None)
    return str(p.dtype).removeprefix("torch.") if p is not None else "float32"


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


@contextmanager
def _parameters_on_meta():
    """Inside: new module parameters are created on the meta device (no memory, no init), buffers
    as usual (rotary tables are computed in ``__init__``)."""
    orig = nn.Module.register_parameter

    def register(self, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        orig(self, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = orig


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"draftcert: {msg}", file=sys.stderr, flush=True)


def _row_order(processor, name: str, n: int) -> np.ndarray | None:
    """The row permutation transformers' tensor processor applies to GGUF tensor ``name`` (llama's
    q/k un-permutation), found by running it on the row numbers; None when it does more than
    reorder rows."""
    idx = np.arange(n, dtype=np.float64).reshape(n, 1)
    try:
        out = processor.process(weights=idx, name=name, tensor_key_mapping={}, parsed_parameters={"tensors": {}})
    except Exception:  # noqa: BLE001 - a processor that needs the real tensor: not a pure permutation
        return None
    w = np.asarray(out.weights)
    if out.name != name or w.shape != (n, 1) or not np.array_equal(np.sort(w[:, 0]), idx[:, 0]):
        return None
    return w[:, 0].astype(np.int64)


def _set_param(model: nn.Module, hf_name: str, value: torch.Tensor) -> None:
    mod_name, _, attr = hf_name.rpartition(".")
    mod = model.get_submodule(mod_name)
    old = getattr(mod, attr)
    if tuple(old.shape) != tuple(value.shape):
        raise ValueError(f"GGUF tensor for {hf_name} has shape {tuple(value.shape)}, the model expects {tuple(old.shape)}")
    mod._parameters[attr] = nn.Parameter(value.to(old.dtype), requires_grad=False)


def _hf_names(model: nn.Module, arch: str, processor) -> dict[str, str]:
    """{GGUF tensor name: transformers parameter name} for ``model`` (what transformers'
    ``get_gguf_hf_weights_map`` computes, with gguf-py's name map built once instead of per module)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map  # optional: models extra (gguf, transformers)
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    key = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
    if key is None:
        return get_gguf_hf_weights_map(model, processor)
    tmap = get_tensor_name_map(key, model.config.num_hidden_layers)
    out = {}
    for hf_name in model.state_dict():
        base, dot, suffix = processor.preprocess_name(hf_name).rpartition(".")
        if suffix not in ("weight", "bias"):
            base, dot, suffix = hf_name, "", ""
        g = tmap.get_name(base)
        if g is not None:
            out[g + dot + suffix] = hf_name
    return out


def load_gguf_causal_lm(gguf_path: str | Path, config, *, quiet: bool = False, numerics: str = CONTRACT):
    """A transformers causal LM from the GGUF file ``gguf_path``, linear weights kept as blocks.

    ``config``: its transformers config (``AutoConfig.from_pretrained(dir, gguf_file=name)``, or
    that saved once).  Returns the model (CPU, eval, no grad), with ``model.draftcert_gguf``
    recording the file, the quantised layers and their types.  ``numerics``: the contract its
    quantised layers compute under (``CONTRACTS``; ``"gguf-q8"``: 8-bit activations).
    """
    if numerics not in CONTRACTS:
        raise ValueError(f"numerics must be one of {', '.join(CONTRACTS)}, got {numerics!r}")
    from gguf import GGMLQuantizationType  # optional: models extra (gguf, transformers)
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    gguf_path = Path(gguf_path)
    meta, tensors = read_gguf(gguf_path)  # copy on write: the blocks stay in the mapped file
    arch = meta.get("general.architecture", "")
    native = quantmm.available()
    if not native:
        _log(f"GGUF linear weights dequantised to float32 at load (no native kernel: {quantmm.unavailable_reason()})", quiet)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    name_map = _hf_names(model, arch, processor)
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    names = {id(m): n for n, m in model.named_modules()}
    emb = model.get_input_embeddings()
    emb_name = names.get(id(emb)) if type(emb) is nn.Embedding else None  # a subclass (scaled, ...) stays float32
    emb_blocks: tuple[torch.Tensor, int] | None = None  # the embedding table kept as blocks
    quantised: dict[str, tuple[torch.Tensor, int]] = {}  # hf module name -> (blocks, qtype)
    other_types: dict[str, int] = {}
    by_hf = {}
    plain = (int(GGMLQuantizationType.F32), int(GGMLQuantizationType.F16), int(GGMLQuantizationType.BF16))
    for t in tensors.values():
        hf = name_map.get(t.name)
        if hf is None:
            continue
        by_hf[hf] = t
        mod_name = hf.removesuffix(".weight")
        if emb_name is not None and hf == emb_name + ".weight" and native and t.qtype in quantmm.SUPPORTED \
                and t.shape == (emb.num_embeddings, emb.embedding_dim):
            order = _row_order(processor, t.name, emb.num_embeddings)
            if order is not None and np.array_equal(order, np.arange(emb.num_embeddings)):
                emb_blocks = (torch.from_numpy(t.data), t.qtype)
                continue
        if hf.endswith(".weight") and mod_name in linears:
            lin = linears[mod_name]
            if native and t.qtype in quantmm.SUPPORTED and t.shape == (lin.out_features, lin.in_features):
                order = _row_order(processor, t.name, lin.out_features)
                if order is not None:
                    same = np.array_equal(order, np.arange(lin.out_features))
                    quantised[mod_name] = (torch.from_numpy(t.data if same else t.data[order]), t.qtype)
                    continue
            if t.qtype not in plain:
                name = GGMLQuantizationType(t.qtype).name
                other_types[name] = other_types.get(name, 0) + 1
        w = dequantize_gguf(t.data, t.qtype).reshape(t.shape)
        w = processor.process(weights=w, name=t.name, tensor_key_mapping=name_map, parsed_parameters={"tensors": {}}).weights
        _set_param(model, hf, torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)))
    if native and other_types:
        _log("GGUF linear weights of types without a kernel dequantised to float32 at load: "
             + ", ".join(f"{k} ({v})" for k, v in sorted(other_types.items())), quiet)
    # an output layer tied to the embedding (no output.weight in the file) computes from the embedding's blocks
    head = model.get_output_embeddings()
    head_name = names.get(id(head)) if head is not None else None
    head_tie = None
    if head is not None and head_name not in quantised and head.weight.device.type == "meta" and emb_blocks is not None:
        quantised[head_name] = emb_blocks  # both from the embedding's blocks (one copy, the file's)
    elif head is not None and head_name not in quantised and head.weight.device.type == "meta" \
            and emb is not None and emb.weight.device.type != "meta":
        head_tie = emb.weight
        t = by_hf.get(names[id(emb)] + ".weight")
        if native and t is not None and t.qtype in quantmm.SUPPORTED and t.shape == tuple(head.weight.shape):
            quantised[head_name] = (torch.from_numpy(t.data), t.qtype)
        else:
            head.weight = head_tie  # tied, dequantised (no kernel for its type)
    for mod_name, (blocks, qtype) in quantised.items():
        lin = linears[mod_name]
        bias = lin.bias  # set from its GGUF tensor above
        if bias is not None and bias.device.type == "meta":
            raise ValueError(f"{gguf_path.name}: no GGUF tensor for {mod_name}.bias")
        layer = GGUFLinear(blocks, qtype, lin.in_features, lin.out_features, bias=bias,
                           tied=head_tie if mod_name == head_name else None, numerics=numerics)
        parent_name, _, attr = mod_name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, layer)
    if emb_blocks is not None:
        parent_name, _, attr = emb_name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr,
                GGUFEmbedding(emb_blocks[0], emb_blocks[1], emb.num_embeddings, emb.embedding_dim, emb.padding_idx))
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ValueError(f"{gguf_path.name}: no GGUF tensor for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    model.eval()
    model.requires_grad_(False)
    if quantised:
        _row_invariant_attention(model, numerics)
        group_siblings(model)
    model.draftcert_gguf = {"file": gguf_path.name, "quantised_layers": len(quantised),
                            "types": sorted({quantmm.SUPPORTED[q] for _, q in quantised.values()}),
                            "embedding": quantmm.SUPPORTED[emb_blocks[1]] if emb_blocks is not None else "float32"}
    return model


def set_numerics(model: nn.Module, numerics: str) -> nn.Module:
    """Every ``GGUFLinear`` of ``model`` computes under ``numerics`` (``quantmm.CONTRACTS``) from now
    on; returns ``model``.  ``"gguf-q8"`` repacks each layer's blocks once (seconds for 1.5B weights)."""
    if numerics not in CONTRACTS:
        raise ValueError(f"numerics must be one of {', '.join(CONTRACTS)}, got {numerics!r}")
    for m in model.modules():
        if isinstance(m, GGUFLinear):
            m.set_numerics(numerics)
    _row_invariant_attention(model, numerics)
    group_siblings(model)
    return model


def _row_invariant_attention(model: nn.Module, numerics: str) -> None:
    """Under ``gguf-q8`` the attention too is computed one query row at a time (``rowattn``): a
    last-bit difference between a verification pass and the decode step would otherwise reach the
    next layer's 8-bit rounding, and strict decoding could leave greedy decoding."""
    if numerics == CONTRACT_Q8:
        use_row_invariant_attention(model)
    else:
        for m in model.modules():
            if getattr(m, ROW_INVARIANT, False):
                setattr(m, ROW_INVARIANT, False)


# ----------------------------------------------------------------------------- cached GGUF models

GGUF_FILE = "model.gguf"
MARKER = "draftcert.json"  # written last: the directory is complete


def write_gguf_metadata(folder: Path, record: dict) -> None:
    """Next to ``folder/model.gguf``: the transformers config and tokenizer parsed from it (once:
    parsing a large vocabulary from GGUF metadata takes seconds) and the marker ``draftcert.json``."""
    from transformers import AutoConfig, AutoTokenizer  # optional: models extra

    folder = Path(folder)
    config = AutoConfig.from_pretrained(str(folder), gguf_file=GGUF_FILE)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF_FILE).save_pretrained(str(folder))
    (folder / MARKER).write_text(json.dumps({**record, "weights": "gguf"}, indent=2) + "\n")


def load_gguf_folder(folder: str | Path, *, quiet: bool = False, numerics: str = CONTRACT):
    """``(model, tokenizer)`` from a folder made by :func:`write_gguf_metadata` (GGUF blocks kept)."""
    from transformers import AutoConfig, AutoTokenizer  # optional: models extra

    folder = Path(folder)
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return load_gguf_causal_lm(folder / GGUF_FILE, config, quiet=quiet, numerics=numerics), tok
