"""Layers that keep a GGUF tensor's blocks as stored, and the numeric contracts they compute under.

:class:`GGUFLinear` replaces ``nn.Linear`` for a weight held as GGUF blocks (``[N, row_bytes]``
uint8, as ``gguf.GGUFReader`` returns a tensor's ``.data``) of a type the native kernel decodes
(``blocks.KERNEL_TYPES``: Q4_1, Q5_0, Q8_0, Q4_K, Q6_K).  Its forward, for float32 CPU inputs, is
``block_matmul.linear``: exactly the dequantised weights (gguf-py's values, those the float32 checkpoints
hold), float32 activations and accumulation, one fixed reduction order per output, so a row's
output bits do not depend on how many rows share the pass (batch invariant, any M: prefills too).
That is the numeric contract ``"gguf-exact-f32"`` (:data:`CONTRACT`, :func:`numerics_of`).  Versus
``F.linear`` on the float32 weights the two differ only by float32 summation order:

    |y_kernel - y_exact| <= gamma_n * sum_k |w_k x_k|,  n = K / VW + log2(VW),  gamma_n = n u / (1 - n u),

with ``u = 2**-24`` and VW the kernel's lanes (16 on AVX-512); ``F.linear``'s own error is at most
``gamma_K`` of the same sum, so the two agree within ``(gamma_n + gamma_K) * sum_k |w_k x_k|``
(``block_matmul.error_bound``).  Other inputs (another dtype or device, or no native kernel) use the
dequantised weights with ``F.linear``.

``.weight`` is the float32 weight: for an output layer tied to the embedding, the embedding's own
parameter (the same values, no copy); otherwise dequantised on each access (a full decode: read it
rarely; writing to it changes nothing).

``loader.load_gguf_causal_lm`` installs these layers in a transformers model built from a GGUF file.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import block_matmul
from ..kernels.attention import ROW_INVARIANT, use_row_invariant_attention
from .blocks import block_type, check_blocks, decode_rows
from .reader import release_file_pages

__all__ = ["CONTRACT", "CONTRACT_Q8", "CONTRACTS", "generation", "GGUFLinear", "GGUFEmbedding", "Siblings", "group_siblings",
           "dissolve_siblings", "numerics_of", "set_numerics", "row_invariant_attention"]

# The numeric contracts a GGUF layer computes under (docs/gguf.md): the exact dequantised weights with
# float32 sums, or 8-bit activations as llama.cpp computes them (block_matmul.c states both orders).
CONTRACT = "gguf-exact-f32"
CONTRACT_Q8 = "gguf-q8"
CONTRACTS = (CONTRACT, CONTRACT_Q8)

KEPT_ROWS = 4096  # GGUFEmbedding: decoded rows kept (cleared when full)
KEPT_ROWS_CALL = 16  # ... for calls of at most this many tokens (a prefill decodes its rows in one go)

_GENERATION = [0]  # counts the changes of any GGUFLinear's computation (contract, packing, siblings)


def generation() -> int:
    """A number that changes whenever some ``GGUFLinear`` changes how it computes (``set_numerics``,
    ``Siblings`` formed or dissolved): what a plan built from their tensors is made again on."""
    return _GENERATION[0]


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
        check_blocks("GGUFLinear", blocks, qtype, out_features, in_features)
        self.in_features, self.out_features, self.qtype = int(in_features), int(out_features), qtype
        self.register_buffer("qweight", blocks.contiguous())
        self.bias = nn.Parameter(bias.detach().to(torch.float32), requires_grad=False) if bias is not None else None
        self.__dict__["_tied"] = tied
        self.numerics = CONTRACT
        self.q8weight = None
        self._compute_under(numerics)  # a new layer: nothing was planned from it, so no generation() change

    def set_numerics(self, numerics: str) -> "GGUFLinear":
        """Compute under ``numerics`` from now on: ``"gguf-exact-f32"`` (the blocks as stored) or
        ``"gguf-q8"`` (8-bit activations: the blocks repacked once for the integer kernel, kept
        beside them)."""
        if numerics not in CONTRACTS:
            raise ValueError(f"GGUFLinear: numerics must be one of {', '.join(CONTRACTS)}, got {numerics!r}")
        dissolve_siblings(self)
        _GENERATION[0] += 1
        return self._compute_under(numerics)

    def _compute_under(self, numerics: str) -> "GGUFLinear":
        if numerics not in CONTRACTS:
            raise ValueError(f"GGUFLinear: numerics must be one of {', '.join(CONTRACTS)}, got {numerics!r}")
        if numerics == CONTRACT_Q8 and self.q8weight is None:
            self.q8weight = block_matmul.pack_q8(self.qweight.cpu().contiguous(), self.qtype, self.out_features, self.in_features)
            release_file_pages(self.qweight)  # the repacked copy is what runs: the file's pages need not stay resident
        elif numerics == CONTRACT:
            self.q8weight = None
        self.numerics = numerics
        return self

    @property
    def qtype_name(self) -> str:
        return block_type(self.qtype).name

    def dequantized(self) -> torch.Tensor:
        """The float32 ``[out, in]`` weight the blocks encode (decoded now)."""
        return decode_rows(self.qweight, self.qtype, self.in_features).to(self.qweight.device)

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
        return decode_rows(blocks, self.qtype, self.in_features).to(self.qweight.device)

    @weight.setter
    def weight(self, value) -> None:  # transformers' tie_weights(): keep the blocks, remember the tie
        if tuple(value.shape) != (self.out_features, self.in_features):
            raise ValueError(f"GGUFLinear: cannot tie a {tuple(value.shape)} weight to [{self.out_features}, {self.in_features}]")
        self.__dict__["_tied"] = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if x.dtype == torch.float32 and x.device.type == "cpu" and self.qweight.device.type == "cpu" and block_matmul.LIBRARY.available():
            siblings = self.__dict__.get("_siblings")
            if siblings is not None:  # one stacked pass under this layer's own contract
                return siblings.output(self, x)
            if self.q8weight is not None:
                return block_matmul.linear_q8(x, self.q8weight, self.qtype, self.out_features, self.in_features, self.bias)
            return block_matmul.linear(x, self.qweight, self.qtype, self.out_features, self.in_features, self.bias)
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
            layer.q8weight = self.q8weight[: block_matmul.packed_bytes(self.qtype, m, self.in_features)]
            layer.numerics = self.numerics
        return layer

    def rows(self, idx: torch.Tensor) -> "GGUFLinear":
        """A layer computing this one's outputs ``idx`` (1-D token ids: a drafter's draft vocabulary), a copy
        of those rows' blocks under the same contract: each output the same bits as this layer's (an output
        depends on its weight row, its bias and x only)."""
        idx = torch.as_tensor(idx, dtype=torch.int64).reshape(-1)
        if idx.numel() == 0 or int(idx.min()) < 0 or int(idx.max()) >= self.out_features:
            raise ValueError(f"GGUFLinear.rows: expected row ids in 0..{self.out_features - 1}")
        tied = self.__dict__.get("_tied")
        return GGUFLinear(self.qweight.index_select(0, idx.to(self.qweight.device)), self.qtype, self.in_features,
                          idx.numel(), bias=None if self.bias is None else self.bias[idx],
                          tied=None if tied is None else tied.index_select(0, idx.to(tied.device)), numerics=self.numerics)

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
        _GENERATION[0] += 1

    def output(self, member: "GGUFLinear", x: torch.Tensor) -> torch.Tensor:
        i = next(j for j, m in enumerate(self.members) if m is member)
        last = self._last
        version = None if x.is_inference() else x._version  # inference tensors keep no version counter
        if last is not None and last[0] is x and last[1] == version and i in last[2]:
            y = last[2].pop(i)
            if not last[2]:
                self._last = None
            return y
        linear = block_matmul.linear_q8 if self.q8 else block_matmul.linear
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
        _GENERATION[0] += 1
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
    dequantised ``nn.Embedding``, bit for bit: ``block_matmul.dequantize`` is gguf-py's decode, tested).

    The float32 table of a 151,936-token vocabulary is 0.9 GB at 1,536 dimensions; its Q4_K blocks
    are 0.13 GB.  ``blocks``: ``[num_embeddings, row_bytes]`` uint8 (a buffer, ``qweight``), of a type
    in ``blocks.KERNEL_TYPES``.  ``.weight`` is the whole float32 table, decoded on each access (read
    it rarely).
    """

    def __init__(self, blocks: torch.Tensor, qtype: int, num_embeddings: int, embedding_dim: int,
                 padding_idx: int | None = None):
        super().__init__()
        qtype = int(qtype)
        check_blocks("GGUFEmbedding", blocks, qtype, num_embeddings, embedding_dim)
        self.num_embeddings, self.embedding_dim, self.qtype = int(num_embeddings), int(embedding_dim), qtype
        self.padding_idx = padding_idx  # as nn.Embedding's: only what it records (no gradient here)
        self.register_buffer("qweight", blocks.contiguous())

    @property
    def qtype_name(self) -> str:
        return block_type(self.qtype).name

    @property
    def weight(self) -> torch.Tensor:
        """The float32 ``[num_embeddings, embedding_dim]`` table (decoded now)."""
        return decode_rows(self.qweight, self.qtype, self.embedding_dim).to(self.qweight.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # noqa: D102
        flat = ids.reshape(-1)  # [n]
        if 0 < flat.numel() <= KEPT_ROWS_CALL and ids.device.type == "cpu":
            return self._kept(flat.tolist()).reshape(*ids.shape, self.embedding_dim)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"GGUFEmbedding: token ids must lie in [0, {self.num_embeddings}); got "
                             f"{int(flat.min())}..{int(flat.max())}")
        rows = self.qweight.cpu().index_select(0, flat.cpu())  # [n, row_bytes]: the looked-up rows' blocks
        return decode_rows(rows, self.qtype, self.embedding_dim).to(ids.device).reshape(*ids.shape, self.embedding_dim)  # [..., D]

    def _kept(self, toks: list[int]) -> torch.Tensor:
        """The rows ``[n, D]`` of a few tokens (a decode's step, a round's verification) from decoded rows
        kept per token: a row decodes alone, so it is the same bits, without the ~7 small operations of a
        lookup (each several times its hot-loop cost after a pass has evicted the caches)."""
        q = self._buffers["qweight"]
        if q.is_inference():  # made under inference_mode: no version counter to tell a write in place, so no memo
            return decode_rows(q.index_select(0, torch.tensor(toks)), self.qtype, self.embedding_dim)
        key = (q.data_ptr(), q._version, self.qtype)  # blocks written in place or swapped: decoded again
        memo = self.__dict__.get("_kept_rows")
        if memo is None or memo[0] != key or memo[1] is not q:
            memo = self.__dict__["_kept_rows"] = (key, q, {})
        rows = memo[2]
        out = []
        for t in toks:
            row = rows.get(t)
            if row is None:
                if not 0 <= t < self.num_embeddings:
                    raise IndexError(f"GGUFEmbedding: token ids must lie in [0, {self.num_embeddings}); got {t}")
                if len(rows) >= KEPT_ROWS:
                    rows.clear()
                row = rows[t] = decode_rows(q[t: t + 1], self.qtype, self.embedding_dim)[0]
            out.append(row)
        return torch.stack(out)  # [n, D], a new tensor (the kept rows are never handed out)

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
    if block_matmul.LIBRARY.available() and layers:
        return CONTRACT_Q8 if any(m.q8weight is not None for m in layers) else CONTRACT
    p = next(iter(model.parameters()), None)
    return str(p.dtype).removeprefix("torch.") if p is not None else "float32"


def set_numerics(model: nn.Module, numerics: str) -> nn.Module:
    """Every ``GGUFLinear`` of ``model`` computes under ``numerics`` (``CONTRACTS``) from now
    on; returns ``model``.  ``"gguf-q8"`` repacks each layer's blocks once (seconds for 1.5B weights)."""
    if numerics not in CONTRACTS:
        raise ValueError(f"numerics must be one of {', '.join(CONTRACTS)}, got {numerics!r}")
    for m in model.modules():
        if isinstance(m, GGUFLinear):
            m.set_numerics(numerics)
    row_invariant_attention(model, numerics)
    group_siblings(model)
    return model


def row_invariant_attention(model: nn.Module, numerics: str) -> None:
    """Under ``gguf-q8`` the attention too is computed one query row at a time (``row_attention``): a
    last-bit difference between a verification pass and the decode step would otherwise reach the
    next layer's 8-bit rounding, and strict decoding could leave greedy decoding."""
    if numerics == CONTRACT_Q8:
        use_row_invariant_attention(model)
    else:
        for m in model.modules():
            if getattr(m, ROW_INVARIANT, False):
                setattr(m, ROW_INVARIANT, False)
