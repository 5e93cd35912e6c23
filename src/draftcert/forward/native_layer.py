"""A written-out decoder layer whose projections all run ``gguf-q8``, computed natively
(``layer_kernel``): two C calls and the cache append instead of ~120 torch operations.

    qkv  = layer_kernel.qkv(plan, h, cos, sin')          # rms, q/k/v, (Qwen3: head norms), rotary   [B, T, (H + 2 Hkv) D]
    K, V = cache.update(k, v, layer)                       # the model's own cache (DynamicLayer or kv_buffer's)
    layer_kernel.attn_mlp(plan, h', qkv, K, V, visible)   # h' = h + o(attention) + mlp(rms(.)), in place

``decoder_layers.lean_layer_forward`` takes this path whenever :func:`plan_of` gives a plan: every one
of the layer's seven projections a ``GGUFLinear`` under ``gguf-q8`` on CPU, float32 norms.  That is a
property of the model (its contract), not of the call, so every pass of a model (prefill, one-row
step, chain, tree, batch) runs the same arithmetic.  Its bits are ``layer_kernel.c``'s (its norms and
activation are its own, exactly specified, not torch's), the same for a row alone and inside any pass.
Under ``gguf-exact-f32``, float32 weights or ``DRAFTCERT_NATIVE_LAYERS=0`` the written-out torch layer
runs, which gives transformers' bits.

A call it cannot take (a mask with a bias other than 0 / -inf, a per-head mask) returns None and the
torch layer runs it; the engine's and transformers' passes never make one.
"""

from __future__ import annotations

import operator
import os

import torch

from ..gguf.layers import CONTRACT_Q8, GGUFLinear, generation
from ..kernels.attention import visibility
from . import layer_kernel
from .kv_buffer import spare_layer

__all__ = ["enabled", "is_q8", "plan_of", "forward", "forward_layers", "forget", "reserve", "cache_layer", "rotary_rows",
           "position_rows", "position_pair", "position_table", "visible_rows", "ALL_LAYERS_IN_ONE_CALL", "PLANS_MEMO", "TABLE_BLOCK"]

_PLAN = "_draftcert_native_plan"  # a layer's (generation, sources, Plan or None), in its __dict__
PLANS_MEMO = "_draftcert_native_plans"  # a decoder's plans for all its layers (decoder_layers), in its __dict__
_ROWS = "_draftcert_rotary_rows"  # a rotary sin table's (B, cos rows, signed sin rows)
_VISIBLE = "_draftcert_visible"  # a mask's (B, uint8 visibility [B, T, S] or None where it has a bias)
_IO = "_draftcert_layers_io"  # a cache's last forward_layers table (plans, B, room, layers, buffers, tables)
_is = operator.is_
_LENGTH, _KEY_BUFFER, _VALUE_BUFFER = (operator.attrgetter(a) for a in ("_length", "_key_buffer", "_value_buffer"))
_TABLE = "_draftcert_rotary_table"  # a rotary module's [key, positions filled, cos, signed sin, inv_freq, sin] rows
TABLE_BLOCK = 256  # positions a rotary table grows by
_CHANGING_ROPE = ("dynamic", "longrope")  # rope types whose frequencies follow the sequence length


def enabled() -> bool:
    """False under ``DRAFTCERT_NATIVE_LAYERS=0`` (read when a layer's plan is made) or without the kernel."""
    return os.environ.get("DRAFTCERT_NATIVE_LAYERS", "1").strip() != "0" and layer_kernel.LIBRARY.available()


def is_q8(mod) -> bool:
    """A ``GGUFLinear`` a native call can run: ``gguf-q8``, packed, on the CPU, untied, float32 bias or none."""
    return (isinstance(mod, GGUFLinear) and mod.numerics == CONTRACT_Q8 and mod.q8weight is not None
            and mod.q8weight.device.type == "cpu" and mod.__dict__.get("_tied") is None
            and (mod.bias is None or mod.bias.dtype == torch.float32))


def _calls(mods: list) -> list[layer_kernel.Linear]:
    """The linear calls computing ``mods``' outputs side by side: a ``Siblings`` group that is a run
    of them in order is one call on its stacked weights (one quantisation of x), the rest one each."""
    out, i = [], 0
    while i < len(mods):
        group = mods[i].__dict__.get("_siblings")
        run = len(group.members) if group is not None else 0
        if group is not None and group.q8 and list(group.members) == mods[i: i + run]:
            bias = group.bias.contiguous() if group.bias is not None else None
            out.append(layer_kernel.Linear(group.qtype, group.weight, group.n, group.k, bias))
            i += run
        else:
            m = mods[i]
            out.append(layer_kernel.Linear(m.qtype, m.q8weight, m.out_features, m.in_features, m.bias))
            i += 1
    return out


def _sources(layer) -> tuple:
    """The objects a plan reads besides what ``gguf.layers.generation`` tracks: the seven projections and
    the norms' weights (a plan is made again when one of them is replaced)."""
    lm = layer._modules  # the module dicts, not nn.Module.__getattr__ (~1 us an access; this runs per layer per pass)
    am, mm = lm["self_attn"]._modules, lm["mlp"]._modules
    qn, kn = am.get("q_norm"), am.get("k_norm")
    return (am["q_proj"], am["k_proj"], am["v_proj"], am["o_proj"], mm["gate_proj"], mm["up_proj"], mm["down_proj"],
            lm["input_layernorm"]._parameters["weight"], lm["post_attention_layernorm"]._parameters["weight"],
            qn._parameters["weight"] if qn is not None else None, kn._parameters["weight"] if kn is not None else None)


def _build(layer, qk_norm: bool) -> layer_kernel.Plan | None:
    attn, mlp = layer.self_attn, layer.mlp
    am, mm = attn._modules, mlp._modules
    proj = [am["q_proj"], am["k_proj"], am["v_proj"], am["o_proj"], mm["gate_proj"], mm["up_proj"], mm["down_proj"]]
    if not all(is_q8(m) for m in proj):
        return None
    norms = [layer.input_layernorm, layer.post_attention_layernorm] + ([am["q_norm"], am["k_norm"]] if qk_norm else [])
    weights = [n._parameters["weight"] for n in norms]
    if any(w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous() for w in weights):
        return None
    eps = [float(n.variance_epsilon) for n in norms]
    q, k, v, o, gate, up, down = proj
    D = attn.head_dim
    try:
        return layer_kernel.Plan(
            hidden=q.in_features, heads=q.out_features // D, kv_heads=k.out_features // D, head_dim=D,
            inter=gate.out_features, norms=[(weights[0], eps[0]), (weights[1], eps[1])],
            head_norms=[(weights[2], eps[2]), (weights[3], eps[3])] if qk_norm else None,
            qkv=_calls([q, k, v]), o=_calls([o])[0], gate_up=_calls([gate, up]), down=_calls([down])[0])
    except ValueError:  # shapes the kernel does not take: the torch layer
        return None


def plan_of(layer) -> layer_kernel.Plan | None:
    """The layer's native plan (made once, made again when one of its tensors was replaced), or None
    where the layer is not all ``gguf-q8`` (or the path is off)."""
    memo = layer.__dict__.get(_PLAN)
    sources, gen = _sources(layer), generation()
    if memo is not None and memo[0] == gen:
        old = memo[1]
        if (old[0] is sources[0] and old[1] is sources[1] and old[2] is sources[2] and old[3] is sources[3]
                and old[4] is sources[4] and old[5] is sources[5] and old[6] is sources[6] and old[7] is sources[7]
                and old[8] is sources[8] and old[9] is sources[9] and old[10] is sources[10]
                and all(t.data_ptr() == ptr for t, ptr in memo[3])):
            return memo[2]
    plan = _build(layer, sources[9] is not None) if enabled() else None  # Qwen3: its q/k head norms
    # parameters whose storage a module's ``_apply`` (``.to()``, ``.float()``) can swap under the same object
    params = [t for t in sources[7:] if t is not None] + [m.bias for m in sources[:7] if getattr(m, "bias", None) is not None]
    layer.__dict__[_PLAN] = (gen, sources, plan, [(t, t.data_ptr()) for t in params])
    return plan


def forget(model: torch.nn.Module) -> None:
    """Drop every layer's plan and every decoder's (the next pass decides again, e.g. after
    ``DRAFTCERT_NATIVE_LAYERS`` changed)."""
    for mod in model.modules():
        mod.__dict__.pop(_PLAN, None)
        mod.__dict__.pop(PLANS_MEMO, None)


def rotary_rows(position_embeddings, B: int, T: int):
    """(cos, sin with its first half negated), contiguous ``[B * T, D]`` (kept on the sin tensor: the
    decoder hands every layer the same one)."""
    cos, sin = position_embeddings
    memo = sin.__dict__.get(_ROWS)
    if memo is None or memo[0] != B:
        half = sin.shape[-1] // 2
        signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        c = cos.to(torch.float32).expand(B, T, -1).reshape(B * T, -1).contiguous()
        s = signed.to(torch.float32).expand(B, T, -1).reshape(B * T, -1).contiguous()
        memo = sin.__dict__[_ROWS] = (B, c, s)
    return memo[1], memo[2]


def position_rows(rotary, position_ids: torch.Tensor, x: torch.Tensor):
    """:func:`rotary_rows` of ``rotary(x, position_ids)`` for one sequence's ``position_ids`` ``[1, T]``,
    read from a table kept on the rotary module: each position's pair computed alone (``[[p]]``, the
    call a one-row pass makes; an element depends on its own position only) and filled ``TABLE_BLOCK``
    positions at a time.  Why: the module's call and the rows it makes are ~10 small torch operations,
    ~0.15 ms of a pass on caches the pass has just evicted; two row gathers replace them.  None (the
    caller calls the module) for several sequences, negative positions, or a rope type whose
    frequencies follow the sequence length."""
    return _rows(rotary, position_ids, x, (2, 3))


def position_pair(rotary, position_ids: torch.Tensor, x: torch.Tensor):
    """``rotary(x, position_ids)`` (cos, sin) ``[1, T, D]`` of float32 ``x`` from the same table (each
    position's pair computed alone), with :func:`rotary_rows`' rows kept on the sin tensor, so a native
    step reads them without making them; None where :func:`position_rows` is, or for another dtype."""
    rows = _rows(rotary, position_ids, x, (2, 5, 3)) if x.dtype == torch.float32 else None
    if rows is None:
        return None
    cos, sin, signed = rows  # [T, D] each
    sin.__dict__[_ROWS] = (1, cos, signed)
    return cos[None], sin[None]


def position_table(rotary, top: int, x: torch.Tensor):
    """(cos, signed sin) ``[n, D]`` (n >= ``top``) of the table :func:`position_rows` reads, grown first to hold
    positions ``0 .. top - 1``: row p is :func:`rotary_rows` of ``rotary(x, [[p]])``, so a slice
    ``[p0 : p0 + T]`` is a sequence's rows without a gather.  None where :func:`position_rows` is."""
    if top < 1 or _rows(rotary, torch.tensor([[top - 1]]), x, (2,)) is None:  # a gather past the table grows it
        return None
    memo = rotary.__dict__[_TABLE]
    return memo[2], memo[3]


def _rows(rotary, position_ids: torch.Tensor, x: torch.Tensor, parts: tuple) -> list | None:
    """Rows of the rotary module's table ``[key, positions filled, cos, signed sin, inv_freq, sin]`` (its
    entries ``parts``) for ``position_ids`` ``[1, T]``, the table grown first where it does not reach
    them; None where it cannot serve them (see :func:`position_rows`)."""
    if (position_ids.dim() != 2 or position_ids.shape[0] != 1 or x.shape[0] != 1
            or str(getattr(rotary, "rope_type", "")) in _CHANGING_ROPE):
        return None
    inv = rotary._buffers.get("inv_freq")
    if inv is None:
        return None
    inference = inv.is_inference()  # made under inference_mode: no version counter, so its values are compared
    key = (type(rotary), inv.data_ptr(), None if inference else inv._version, getattr(rotary, "attention_scaling", None),
           x.dtype, x.device)
    memo = rotary.__dict__.get(_TABLE)
    if (memo is None or memo[0] != key or memo[4] is not inv  # the frequencies changed, or their storage
            or (inference and not torch.equal(memo[6], inv))):
        memo = rotary.__dict__[_TABLE] = [key, 0, None, None, inv, None, inv.clone() if inference else None]
    ids = position_ids[0]
    while True:
        if memo[1]:
            try:
                return [memo[i].index_select(0, ids) for i in parts]
            except (IndexError, RuntimeError):  # a position past the table (or negative: below)
                pass
        if ids.numel() == 0 or int(ids.min()) < 0:
            return None
        top = int(ids.max()) + 1
        if top <= memo[1]:
            return None
        _grow_table(rotary, memo, -(-top // TABLE_BLOCK) * TABLE_BLOCK, x)


def _grow_table(rotary, memo: list, n: int, x: torch.Tensor) -> None:
    one = x.new_empty((1, 1, 1))  # what the module reads of x: its dtype and device
    pairs = [rotary(one, torch.tensor([[p]], device=x.device)) for p in range(memo[1], n)]
    cos = torch.cat([c.reshape(1, -1) for c, _ in pairs]).to(torch.float32)  # [n - filled, D]
    sin = torch.cat([s.reshape(1, -1) for _, s in pairs]).to(torch.float32)
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    if memo[2] is not None:
        cos, signed, sin = torch.cat((memo[2], cos)), torch.cat((memo[3], signed)), torch.cat((memo[5], sin))
    memo[1], memo[2], memo[3], memo[5] = n, cos.contiguous(), signed.contiguous(), sin.contiguous()


def visible_rows(mask, B: int, T: int, S: int):
    """(ok, uint8 ``[B, T, S]`` visibility or None for causal) of the mask the layer was handed."""
    if mask is None:
        return True, None
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-2:] != (T, S) or mask.shape[0] not in (1, B):
        return False, None
    memo = mask.__dict__.get(_VISIBLE)
    if memo is None or memo[0] != B:
        vis = visibility(mask[:, 0].expand(B, T, S))  # None: a bias, not the kernel's case
        vis = vis.view(torch.uint8) if vis is not None else None
        memo = mask.__dict__[_VISIBLE] = (B, vis if vis is None or vis.stride(-1) == 1 else vis.contiguous())
    return memo[1] is not None, memo[1]


def forward(plan: layer_kernel.Plan, attn, hidden_states: torch.Tensor, cache, position_embeddings,
            mask) -> torch.Tensor | None:
    """The layer's output ``[B, T, hidden]`` (module docstring), or None for a call the kernel does not
    take (before anything was written to the cache)."""
    B, T, _ = hidden_states.shape
    idx = attn.layer_idx
    past = cache.get_seq_length(idx) if cache is not None else 0
    ok, vis = visible_rows(mask, B, T, past + T)
    if not ok:
        return None
    h = hidden_states.contiguous()
    cos, sin_signed = rotary_rows(position_embeddings, B, T)
    qkv = layer_kernel.qkv(plan, h, cos, sin_signed)  # [B, T, (H + 2 Hkv) D]
    H, Hkv, D = plan.heads, plan.kv_heads, plan.head_dim
    k = qkv[..., H * D: (H + Hkv) * D].view(B, T, Hkv, D).transpose(1, 2)  # [B, Hkv, T, D]
    v = qkv[..., (H + Hkv) * D:].view(B, T, Hkv, D).transpose(1, 2)
    if cache is not None:
        k, v = cache.update(k, v, idx)  # [B, Hkv, S, D]
    out = h.clone()
    layer_kernel.attn_mlp(plan, out, qkv, k, v, vis, attn.scaling)
    return out


def reserve(lc, plan: layer_kernel.Plan, B: int, T: int, likes: dict | None = None) -> list[int]:
    """Room for ``T`` new rows in ``kv_buffer``'s cache layer ``lc`` (its keys and values unchanged; the
    caller writes them and commits ``n + T``): the layer's row of ``layer_kernel.layers``' ``io``,
    ``[plan, key buffer, value buffer, kb, kh, ks, vb, vh, vs, n]``.  ``likes``: shapes' buffers reused."""
    shape = (B, plan.kv_heads, T, plan.head_dim)
    like = likes.get(shape) if likes is not None else None
    if like is None:
        like = torch.empty(shape, dtype=torch.float32)
        if likes is not None:
            likes[shape] = like
    kb, vb, n = lc.reserve(like, like)
    return [plan.ref, kb.data_ptr(), vb.data_ptr(), *kb.stride()[:3], *vb.stride()[:3], n]


def cache_layer(cache, idx: int):
    """``cache``'s layer ``idx`` where it is ``kv_buffer``'s (what :func:`reserve` takes), else None."""
    layers = getattr(cache, "layers", None)
    lc = layers[idx] if isinstance(layers, list) and 0 <= idx < len(layers) else None
    return lc if type(lc) is spare_layer() else None


ALL_LAYERS_IN_ONE_CALL = True  # ``forward_layers``' path (tests turn it off to compare it with the per-layer one)


def forward_layers(plans: list, attns: list, hidden_states: torch.Tensor, cache, position_embeddings,
                   mask, rows=None) -> torch.Tensor | None:
    """Every layer of a decoder, all native, in one C call (``layer_kernel.layers``: the per-layer
    calls' operations in the same order, so the same bits as :func:`forward` layer after layer),
    where every layer's cache is ``kv_buffer``'s layer with the same length; the hidden states after the
    last layer, or None (before anything was changed) where the call is not that case.  ``rows``: the
    rotary's (cos, signed sin) rows (:func:`position_rows`) in place of ``position_embeddings``."""
    if cache is None or not ALL_LAYERS_IN_ONE_CALL or hidden_states.dtype != torch.float32:
        return None
    B, T, _ = hidden_states.shape
    mine, past = [], None
    for attn in attns:
        lc = cache_layer(cache, attn.layer_idx)
        if lc is None:
            return None
        n = lc.get_seq_length()
        if past is None:
            past = n
        elif n != past:
            return None
        mine.append(lc)
    ok, vis = visible_rows(mask, B, T, past + T)
    if not ok:
        return None
    cos, sin_signed = rows if rows is not None else rotary_rows(position_embeddings, B, T)
    memo = cache.__dict__.get(_IO)
    if (memo is not None and memo[0] is plans and memo[1] == B and past + T <= memo[2] and len(mine) == len(memo[3])
            and all(map(_is, mine, memo[3])) and None not in map(_LENGTH, mine)
            and all(map(_is, map(_KEY_BUFFER, mine), memo[4])) and all(map(_is, map(_VALUE_BUFFER, mine), memo[5]))):
        table, scales = memo[6], memo[7]  # the buffers of the last pass, with room: only n changes
        memo[8][:, 9] = past
    else:
        io, scales, likes = [], [], {}
        for plan, attn, lc in zip(plans, attns, mine):
            io.append(reserve(lc, plan, B, T, likes))
            scales.append(float(attn.scaling))
        table, scales = torch.tensor(io, dtype=torch.int64), torch.tensor(scales, dtype=torch.float64)
        kbs, vbs = tuple(map(_KEY_BUFFER, mine)), tuple(map(_VALUE_BUFFER, mine))
        room = min(b.shape[-2] for b in kbs + vbs)
        cache.__dict__[_IO] = (plans, B, room, tuple(mine), kbs, vbs, table, scales, table.numpy())
    h = hidden_states.contiguous().clone()
    layer_kernel.layers(table, scales, h, cos, sin_signed, vis)
    for lc in mine:
        lc.commit(past + T)
    return h
