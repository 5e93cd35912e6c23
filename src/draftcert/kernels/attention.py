"""Grouped-query SDPA that never copies the KV cache: transformers' ``sdpa`` with ``enable_gqa``
whenever the mask is shared by all heads.

Why: a verification pass (2..16 query rows) comes with a 4-D mask (``[B, 1, q, S]``: causal with an
offset, or a tree).  transformers' ``sdpa`` attention passes ``enable_gqa=True`` to
``torch.nn.functional.scaled_dot_product_attention`` only without a mask (or for one query row), and
otherwise calls ``repeat_kv``: a copy of the whole cached K and V, ``num_key_value_groups`` times, in
every layer of every pass.  On SmolLM2-135M (9 query heads, 3 KV heads) after a 128-token cache that
copy is most of the attention time of a 9-row pass.  torch's CPU SDPA (>= 2.5) takes ``enable_gqa``
with a mask and gives the same values (each query head reads its group's K and V in place).

:func:`use_grouped_sdpa` registers the implementation ``"draftcert_sdpa"`` (transformers'
``AttentionInterface``; its masks are sdpa's) and switches a model to it.  It changes nothing but the
copy: the arguments reach ``scaled_dot_product_attention`` as transformers' own ``sdpa`` builds them,
and every case it does not cover (per-head masks, position bias, softcap, one KV group) is handed to
transformers' ``sdpa`` as is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import row_attention

__all__ = ["IMPLEMENTATION", "ROW_INVARIANT", "visibility", "grouped_sdpa_forward", "use_grouped_sdpa", "use_row_invariant_attention"]

IMPLEMENTATION = "draftcert_sdpa"
ROW_INVARIANT = "draftcert_row_invariant"  # attention-module flag: compute it with row_attention


def grouped_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query [B, H, q, D]``, ``key``/``value [B, Hkv, S, D]``,
    ``attention_mask [B, 1, q, S]`` (bool or additive) or None; returns ``([B, q, H, D], None)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # optional: models extra

    groups = getattr(module, "num_key_value_groups", 1)
    shared_mask = attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
    if getattr(module, ROW_INVARIANT, False) and _row_invariant_case(query, key, value, attention_mask, dropout, kwargs):
        mask = attention_mask
        if mask is not None and mask.dtype != torch.bool:  # additive: 0 where visible, very negative elsewhere
            mask = mask == 0
        elif mask is None and query.shape[2] > 1 and (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
            q_len, s_len = query.shape[2], key.shape[2]  # causal, the queries the last q_len positions
            mask = torch.ones(q_len, s_len, dtype=torch.bool).tril(s_len - q_len)[None, None]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return row_attention.attention(query, key, value, mask, scale), None
    if (groups <= 1 or not shared_mask or query.device.type != "cpu" or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or kwargs.get("output_attentions", False)
            or kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None  # attention sinks (gpt-oss)
            or key.shape[-1] != value.shape[-1]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    # With a mask transformers' sdpa passes is_causal=False (the mask carries causality): the same here.
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=False, enable_gqa=True)  # [B, H, q, D]
    return out.transpose(1, 2).contiguous(), None  # [B, q, H, D]


def visibility(mask: torch.Tensor) -> torch.Tensor | None:
    """A mask as bool, True where a query may attend: a bool mask itself, an additive one ``mask == 0``
    where it holds only 0 and "minus infinity" (``<= finfo.min / 2``); None for an additive bias of
    other values (alibi and the like), which is not a visibility."""
    if mask.dtype == torch.bool:
        return mask
    if bool(((mask == 0) | (mask <= torch.finfo(mask.dtype).min / 2)).all()):
        return mask == 0
    return None


def _row_invariant_case(query, key, value, mask, dropout, kwargs) -> bool:
    """Can row_attention compute this call exactly as sdpa would (up to rounding)?"""
    if query.device.type != "cpu" or query.dtype != torch.float32 or dropout or not row_attention.LIBRARY.available():
        return False
    if any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "s_aux", "sinks")) or kwargs.get("output_attentions"):
        return False
    if key.shape[-1] != value.shape[-1] or query.shape[1] % key.shape[1]:
        return False
    if mask is not None:
        if mask.dim() != 4 or mask.shape[1] != 1:
            return False
        if visibility(mask) is None:
            return False  # an additive bias (alibi and the like): not only visible / hidden
    return True


def use_row_invariant_attention(model: torch.nn.Module) -> int:
    """Compute ``model``'s attention one query row at a time (``row_attention``) wherever it can, so a row's
    bits do not depend on the pass it is in; returns how many attention modules were switched (0 where
    the model's attention is not sdpa-based or the kernel is unavailable)."""
    config = getattr(model, "config", None)
    if config is None or not row_attention.LIBRARY.available() or not _register():
        return 0
    if getattr(config, "_attn_implementation", None) == "sdpa":
        try:
            model.set_attn_implementation(IMPLEMENTATION)
        except (AttributeError, ValueError, TypeError):
            config._attn_implementation = IMPLEMENTATION
    if getattr(config, "_attn_implementation", None) != IMPLEMENTATION:
        return 0
    n = 0
    for mod in model.modules():
        if hasattr(mod, "num_key_value_groups") or type(mod).__name__.endswith("Attention"):
            setattr(mod, ROW_INVARIANT, True)
            n += 1
    return n


def _register() -> bool:
    try:  # optional (models extra), and absent from older transformers
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:  # an older transformers: the model keeps its own attention
        return False
    AttentionInterface.register(IMPLEMENTATION, grouped_sdpa_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return True


def use_grouped_sdpa(model: torch.nn.Module) -> bool:
    """Switch ``model`` from transformers' ``sdpa`` to ``"draftcert_sdpa"`` (in place); True if it did.

    Only a model on CPU whose attention is ``sdpa`` and that groups query heads over fewer KV heads is
    switched; anything else (eager, flash, one KV head per query head, another device) is left alone."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if not heads or not kv or kv >= heads or next(model.parameters()).device.type != "cpu" or not _register():
        return False
    try:
        model.set_attn_implementation(IMPLEMENTATION)
    except (AttributeError, ValueError, TypeError):
        config._attn_implementation = IMPLEMENTATION
    return config._attn_implementation == IMPLEMENTATION
