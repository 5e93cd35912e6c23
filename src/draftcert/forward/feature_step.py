"""A feature drafter's step under ``gguf-q8`` in one native call (``layer_kernel.dl_feature_step``).

``models.eagle.EagleDrafter.step`` written out (its docstring has the drafter's math)::

    x = fc([embed(x_{s+1}) ; f_s])           # [B, T, hidden]         Q8_0 blocks, dq8_linear
    x = decoder_layer(x)                      # the layer's native plan (native_layer), the cache appended
    g = rms(x; w_norm)                        # [B, R, hidden]         R = T, or 1 (last_only)
    z = W_d g                                 # [B, R, V_d]            the draft vocabulary's head rows
    t = min(w_t . g + b_t, cap(z))            # [B, R]                 EagleDrafter.capped_tail's cap
    q = z at the draft vocabulary's ids,      # [B, R, V]              EagleDrafter.full_logits, where V_d < V:
        t - log(V - V_d) at every other id    #                        take_full_logits

Why: a drafted token on the embedded target is about one target pass in ten, and most of a step was
the ~15 torch operations and module calls around four small kernels (the layer itself already ran
natively): 0.6 ms a step against 0.25 ms of kernels.

Numbers: ``fc``, the layer and the head are the kernels a ``gguf-q8`` drafter runs anyway
(``dq8_linear``, ``dl_layers``), the same bits as calling them one by one.  The final norm is
``layer_kernel``'s rms (the target's layers' norm, not torch's), the tail's dot product a fixed
float64 sum, and the cap is ``capped_tail``'s float32 expression evaluated operation by operation.
So every row's outputs depend on that row (and the keys it sees) alone: the same bits in a chain's
one-row step, a catch-up over many rows, a tree, and a teacher-forced batch.  It is the drafter's
contract wherever it runs from blocks under ``gguf-q8`` outside autograd (decoding, profiling, the
user-prompt evaluation); training runs float weights through torch.
"""

from __future__ import annotations

import ctypes
import math

import torch

from . import layer_kernel, native_layer

__all__ = ["Plan", "plan_of", "step", "DecodeStep", "take_full_logits", "causal_mask", "kept_rows", "keep", "kept_rotary", "ROW_CACHE_SIZE", "ROW_CACHE_MAX_CALL",
           "FULL_ROWS_MAX"]

_PLAN = "_draftcert_feature_plan"  # the drafter's (parts, values, Plan or None), in its __dict__
FULL_ROWS_MAX = 16  # result rows (B R) up to which a step also writes q's full-vocabulary rows (take_full_logits)


class Plan:
    """What ``dl_feature_step`` reads of a drafter: its fc and head calls, its layer's plan, its final norm's
    and tail's weights (pointers into tensors kept alive here), the cap's width and spread."""

    def __init__(self, fc, layer, layer_plan, norm, head, tail, width: int, spread: float, vocab_ids=None, vocab_size=0):
        self.fc = layer_kernel.Linear(fc.qtype, fc.q8weight, fc.out_features, fc.in_features, None)
        self.head = layer_kernel.Linear(head.qtype, head.q8weight, head.out_features, head.in_features, None)
        self.fc_struct, self.head_struct = self.fc.struct(), self.head.struct()
        self.fc_ref, self.head_ref = ctypes.addressof(self.fc_struct), ctypes.addressof(self.head_struct)
        self.layer_plan, self.attn = layer_plan, layer.self_attn
        self.norm_weight, self.eps = norm.weight.detach(), float(norm.variance_epsilon)
        self.tail_weight, self.tail_bias = tail.weight.detach().reshape(-1), tail.bias.detach()
        self.width, self.spread, self.n_vocab = int(width), float(spread), int(head.out_features)
        # the full rows' scatter: the draft vocabulary's ids (V_d < V only), and the last step's (z, t, q)
        self.vocab, self.vocab_size, self.last = vocab_ids, int(vocab_size), None


def _float_vector(t, n: int) -> bool:
    return t is not None and t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() and t.numel() == n


def plan_of(owner, *, fc, layer, norm, head, tail, vocab_size: int, width: int, vocab_ids=None) -> Plan | None:
    """The plan of the drafter ``owner`` (kept in its ``__dict__``, made again when a part was replaced):
    its ``fc``, decoder ``layer``, final ``norm``, ``head`` (the draft vocabulary's rows of the target's
    output layer, ``V_d`` of ``vocab_size``, their ids ``vocab_ids``) and ``tail``; the cap keeps the top
    ``width`` of q in the draft vocabulary.  None where they do not run from ``gguf-q8`` blocks on the CPU
    or the native path is off."""
    layer_plan = native_layer.plan_of(layer)
    nw, tw, tb = norm._parameters.get("weight"), tail._parameters.get("weight"), tail._parameters.get("bias")
    parts = (fc, layer_plan, head, nw, tw, tb, vocab_ids)  # compared by identity
    values = tuple(None if t is None else t.data_ptr() for t in (nw, tw, tb)) + (vocab_size, width)  # by value
    memo = owner.__dict__.get(_PLAN)
    if memo is not None and memo[1] == values and all(a is b for a, b in zip(memo[0], parts)):
        return memo[2]
    plan = None
    H = getattr(fc, "out_features", 0)
    if (layer_plan is not None and native_layer.is_q8(fc) and head is not None and native_layer.is_q8(head)
            and fc.bias is None and head.bias is None and fc.in_features == 2 * H and head.in_features == H
            and _float_vector(nw, H) and _float_vector(tw, H) and _float_vector(tb, 1)
            and hasattr(norm, "variance_epsilon")):
        V, Vd = int(vocab_size), head.out_features
        width = 0 if Vd >= V else min(int(width), Vd)
        ids = None
        if width and vocab_ids is not None and vocab_ids.numel() == Vd and vocab_ids.device.type == "cpu":
            ids = vocab_ids.to(torch.int64).clone()  # the ids the head's rows were taken at
            if not (int(ids.min()) >= 0 and int(ids.max()) < V and ids.unique().numel() == Vd):
                ids = None  # not a draft vocabulary of this target: full_logits scatters it in torch
        plan = Plan(fc, layer, layer_plan, norm, head, tail, width, math.log(V - Vd) if width else 0.0, ids, V)
    owner.__dict__[_PLAN] = (parts, values, plan)
    return plan


def step(plan: Plan, emb: torch.Tensor, feats: torch.Tensor, position_embeddings, mask, cache,
         last_only: bool = False):
    """(g [B, R, hidden], z [B, R, V_d], capped tail [B, R]) of the rows ``emb``, ``feats`` [B, T, hidden]
    (float32), R = T or 1 (``last_only``); ``mask`` additive ``[B or 1, 1, T, past + T]``, or None: causal
    (:func:`causal_mask`); the drafter's cache (``kv_buffer``'s layer, or None: no cache)
    gains the T rows.  None (before anything was changed) for a call the kernel does not take: a mask with
    a bias, a cache layer of another kind."""
    B, T, H = emb.shape
    attn = plan.attn
    idx = attn.layer_idx
    if cache is not None:
        lc = native_layer.cache_layer(cache, idx)
        if lc is None:
            return None
        past = lc.get_seq_length()
    else:
        lc, past = None, 0
    ok, vis = native_layer.visible_rows(mask, B, T, past + T)
    if not ok:
        return None
    e = emb.reshape(B * T, H)
    f = feats.reshape(B * T, H)
    if e.stride(-1) != 1:
        e = e.contiguous()
    if f.stride(-1) != 1:
        f = f.contiguous()
    cos, sin_signed = native_layer.rotary_rows(position_embeddings, B, T)
    return _native_step(plan, e, f, B, T, cos, sin_signed, vis, lc, past, last_only)


def _native_step(plan: Plan, e, f, B: int, T: int, cos, sin_signed, vis, lc, past: int, last_only: bool,
                 kept: tuple | None = None):
    """``dl_feature_step`` on rows ``e``, ``f`` ``[B * T, hidden]`` (unit stride within a row), rotary rows
    ``[B * T, D]``, visibility ``vis`` (None: causal) and cache layer ``lc`` holding ``past`` rows (None: none).
    ``kept``: (``reserve``'s buffers by shape, an int64 ``[10]`` for the layer's io row) reused call to call."""
    lp = plan.layer_plan
    if lc is not None:
        io = native_layer.reserve(lc, lp, B, T, kept[0] if kept is not None else None)
    else:  # no cache: the T rows' keys and values in buffers of their own
        kb = torch.empty(B, lp.kv_heads, T, lp.head_dim)
        vb = torch.empty_like(kb)
        io = [lp.ref, kb.data_ptr(), vb.data_ptr(), *kb.stride()[:3], *vb.stride()[:3], 0]
    R = 1 if last_only else T
    H = e.shape[-1]
    g = torch.empty(B, R, H)
    z = torch.empty(B, R, plan.n_vocab)
    t = torch.empty(B, R)
    # [B, R, V]: a decode's few rows (a teacher-forced batch's full rows would be written for nothing)
    q = None if plan.vocab is None or B * R > FULL_ROWS_MAX else torch.empty(B, R, plan.vocab_size)
    if kept is not None and len(io) == kept[1].numel():
        table = kept[1]
        table.numpy()[:] = io
    else:
        table = torch.tensor(io, dtype=torch.int64)
    rc = layer_kernel.LIBRARY.require().dl_feature_step(
        plan.fc_ref, table.data_ptr(), float(plan.attn.scaling), e.data_ptr(), e.stride(0), f.data_ptr(), f.stride(0),
        B, T, cos.data_ptr(), sin_signed.data_ptr(), vis.data_ptr() if vis is not None else None,
        vis.stride(0) if vis is not None else 0, vis.stride(1) if vis is not None else 0, int(last_only),
        plan.norm_weight.data_ptr(), plan.eps, plan.head_ref, plan.tail_weight.data_ptr(),
        plan.tail_bias.data_ptr(), plan.width, plan.spread, g.data_ptr(), z.data_ptr(), t.data_ptr(),
        None if q is None else plan.vocab.data_ptr(), plan.vocab_size, None if q is None else q.data_ptr(),
        torch.get_num_threads())
    if rc:
        raise RuntimeError(f"feature_step: the native step failed ({rc}: "
                           f"{'out of memory' if rc == -2 else 'a plan the kernel refuses'})")
    if lc is not None:
        lc.commit(past + T)
    plan.last = None if q is None else (z, t, q)
    return g, z, t


class DecodeStep:
    """A decode's drafter steps as :func:`step` computes them, with what a step looks up made once per
    decode: ``__call__(tokens, feats, pos0, cache, last_only)`` is ``step`` of the rows ``tokens`` (a list
    of at most ``ROW_CACHE_MAX_CALL`` ids) and ``feats`` ``[T, hidden]`` at positions ``pos0 ..
    pos0 + T - 1``, causal over ``cache``.  Each token's embedding row is kept (the owner's ``_embed``
    rows, ``kept_rows(owner, "embed", ...)``); the rotary rows are a slice of the rotary module's table
    (``native_layer.position_table``: each position's pair computed alone, as a one-row step computes
    it).  So the bits are ``step``'s.  Why: around a 0.23 ms kernel, a one-token step spent 0.2 ms in
    Python finding its plan, embedding, rotary and cache rows (a drafted token on the embedded target
    is about a tenth of a target pass).  The plan, modules and weights are taken as they are when the
    decode starts (``FeatureDrafter.start``); None for a call it does not take (more rows, no native cache)."""

    def __init__(self, owner, plan: Plan, embedding, rotary, dtype: torch.dtype, kept_key):
        self.owner, self.plan, self.embedding, self.rotary, self.dtype = owner, plan, embedding, rotary, dtype
        self.kept_key = kept_key  # the owner's ``kept_rows`` key: the rows its ``_embed`` keeps
        self.like = torch.empty(1, 1, 1, dtype=dtype)  # what the rotary reads of x: dtype and device
        self.cos = self.signed = None  # the rotary table's rows [n, D] (position_table), refreshed to grow
        self.kept = ({}, torch.empty(10, dtype=torch.int64))  # _native_step's reused buffers

    def __call__(self, tokens: list[int], feats: torch.Tensor, pos0: int, cache, last_only: bool = False):
        T = len(tokens)
        if not 0 < T <= ROW_CACHE_MAX_CALL or torch.is_grad_enabled() or feats.dtype != self.dtype:
            return None
        lc = native_layer.cache_layer(cache, self.plan.attn.layer_idx)
        if lc is None:
            return None
        top = pos0 + T
        if self.cos is None or top > self.cos.shape[0]:
            table = native_layer.position_table(self.rotary, top, self.like)
            if table is None:
                return None
            self.cos, self.signed = table
        kept = kept_rows(self.owner, "embed", self.embedding, self.kept_key)
        rows = [kept[t] if t in kept else
                keep(kept, t, self.embedding(torch.tensor([t])).to(self.dtype)[0]) for t in tokens]
        e = rows[0].view(1, -1) if T == 1 else torch.stack(rows)  # [T, hidden]
        f = feats if feats.stride(-1) == 1 else feats.contiguous()
        return _native_step(self.plan, e, f, 1, T, self.cos[pos0:top], self.signed[pos0:top], None, lc,
                            lc.get_seq_length(), last_only, self.kept)


def take_full_logits(owner, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor | None:
    """The full-vocabulary rows ``q [B, R, V]`` that the drafter ``owner``'s last native step wrote of the
    ``z`` and ``t`` it returned (``EagleDrafter.full_logits(z, t)``, the same bits), taken once: ask right
    after the step, before anything writes into them; None for other tensors (the torch path's, a second
    ask).  Inference tensors keep no version counter, so "unchanged since" is the caller's to keep."""
    memo = owner.__dict__.get(_PLAN)
    plan = memo[2] if memo is not None else None
    last = plan.last if plan is not None else None
    if last is None or last[0] is not z or last[1] is not t:
        return None
    plan.last = None
    return last[2]


def causal_mask(T: int, past: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask ``[1, 1, T, past + T]`` that :func:`step` reads ``None`` as: row i sees keys <= past + i."""
    allowed = torch.ones(T, past + T, dtype=torch.bool).tril(past)
    return torch.zeros(T, past + T, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


# Rows a decode's steps keep (EagleDrafter._embed's by token, _rope's by position), cleared when full.
ROW_CACHE_SIZE = 8192
ROW_CACHE_MAX_CALL = 16  # a step over more tokens (a prompt's catch-up) embeds them in one call


def kept_rows(owner, kind: str, key, like: torch.Tensor) -> dict:
    """The dict of rows of ``kind`` kept in ``owner``'s ``__dict__`` (``_row_caches``; ``bind`` drops it), a new
    one when ``key`` (a module, compared by identity, or a dtype) or ``like``'s dtype or device changed."""
    full = (key if isinstance(key, torch.dtype) else id(key), like.dtype, like.device)
    caches = owner.__dict__.setdefault("_row_caches", {})
    if kind not in caches or caches[kind][0] != full:
        caches[kind] = (full, {})
    return caches[kind][1]


def keep(rows: dict, item, value):
    """``rows[item] = value`` (item not there yet), the dict cleared first when full; returns the value."""
    if len(rows) >= ROW_CACHE_SIZE:
        rows.clear()
    return rows.setdefault(item, value)


def kept_rotary(kept: dict, rotary, x: torch.Tensor, position_ids: torch.Tensor):
    """``rotary(x, position_ids)``'s (cos, sin) ``[1, T, D]`` for ``position_ids`` ``[1, T]``, from each position's
    pair computed alone once and kept in ``kept`` (an element depends on its own position only)."""
    if position_ids.shape[-1] > 1:  # several rows: gathered from the rotary's table (the same bits), rows kept on it
        pair = native_layer.position_pair(rotary, position_ids, x)
        if pair is not None:
            return pair
    pairs = []
    for pos in position_ids.reshape(-1).tolist():
        pair = kept.get(pos)
        if pair is None:
            pair = keep(kept, pos, rotary(x, position_ids=torch.tensor([[pos]], device=x.device)))
        pairs.append(pair)
    return pairs[0] if len(pairs) == 1 else tuple(torch.cat([p[i] for p in pairs], -2) for i in (0, 1))
