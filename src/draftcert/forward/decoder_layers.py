"""Decoder layers of the Llama family run as one function each: the same torch operations as
transformers' modules, without the module calls between them.

Why: on a CPU a one-row pass of a small quantised model is a few milliseconds of kernels and a few
milliseconds of Python around them.  transformers' decoder layer calls eight modules per layer
(two norms, the attention and its four projections, the MLP and its activation), each through
``nn.Module.__call__``, keyword plumbing, deprecation wrappers and the kernels hub's context
switch; a 28-layer model makes ~430 such calls a pass.  ``lean_layer_forward`` is that layer's
``forward`` written out::

    x = rms(h)          ; q, k, v = q_proj(x), k_proj(x), v_proj(x)   # [B, T, H*D] -> [B, H, T, D]
    q, k = q cos + roll(q, D/2) sin', k cos + roll(k, D/2) sin'        # rotary: sin' = sin, first half negated
    k, v = cache.update(k, v, layer)                                     # [B, Hkv, S, D]
    h = h + o_proj(attention(q, k, v, mask))                             # the model's own attention
    h = h + down_proj(silu(gate_proj(rms'(h))) * up_proj(rms'(h)))

(Qwen3 first norms q and k over each head's D values) with every operation transformers' (``rms`` is
``w * (h * rsqrt(mean(h^2) + eps))``), in its order,
on the same tensors, so the output is the same bits (``tests/cpu_kernels/test_decoder_layers.py`` compares logits of
tiny Llama, Qwen2 and Qwen3 models, float32 and GGUF under both contracts, 1..16 rows, trees, batches).
The projections are called through their ``forward`` (``GGUFLinear``, ``linear_chooser``'s layers or
``nn.Linear``), the attention through transformers' attention interface with the arguments its
attention module passes, the cache through its public ``update``.  ``hf.model_forward`` and
``hf.forward_with_hidden`` also write out the decoder around them (``lean_decoder``: the embedding,
the rotary tables, transformers' own ``create_causal_mask``, the layers, the final norm) where
``decoder_ready``: a Llama / Qwen2 / Qwen3 causal LM with every layer switched, full attention only,
no hooks, no autograd, and the transformers 5 mask signature; anything else calls the model.  The
decoder module itself (``LlamaModel`` / ``Qwen2Model`` / ``Qwen3Model``, once all its layers are
switched) runs ``lean_model_forward``: the same written-out decoder for the calls transformers'
``generate`` makes (token ids, a cache, nothing recorded), its own forward for any other call.

A layer is switched only when it and its children are exactly the classes written out here
(``FAMILIES``), silu MLPs, no sliding window, no kernels-hub replacement; per call it hands back to
the original forward whenever something is outside the written-out case: autograd or training
mode, hooks on a child, attention weights requested, an eager attention, a cache layer that is
not a plain ``DynamicLayer`` (or ``kv_buffer``'s in-place one).  ``DRAFTCERT_LEAN=0`` leaves every model as transformers built it.
"""

from __future__ import annotations

import inspect
import itertools
import operator
import os

import torch
import torch.nn.functional as F
from torch.nn.modules import module as _nn_module  # the global hook registries

from ..gguf.layers import generation
from . import native_layer
from .kv_buffer import spare_layer

__all__ = ["FAMILIES", "CAUSAL_LMS", "DECODERS", "enabled", "use_lean_layers", "restore_layers", "lean_layers",
           "decoder_ready", "lean_decoder", "lean_model_forward"]

# decoder layer class -> (attention class, MLP class, RMSNorm class, whether the attention module
# passes ``sliding_window=`` to the attention interface, whether q and k are normed per head first)
FAMILIES = {
    "LlamaDecoderLayer": ("LlamaAttention", "LlamaMLP", "LlamaRMSNorm", False, False),
    "Qwen2DecoderLayer": ("Qwen2Attention", "Qwen2MLP", "Qwen2RMSNorm", True, False),
    "Qwen3DecoderLayer": ("Qwen3Attention", "Qwen3MLP", "Qwen3RMSNorm", True, True),
}
_BASE = "_draftcert_lean_base"  # attribute of a switched layer's class: the class it was
_SUBCLASSES: dict[type, type] = {}  # original decoder-layer class -> its switched subclass


def enabled() -> bool:
    """False under ``DRAFTCERT_LEAN=0``."""
    return os.environ.get("DRAFTCERT_LEAN", "1").strip() != "0"


def _eligible(layer: torch.nn.Module, config) -> str | None:
    """None if ``layer`` is the written-out case, else why not."""
    family = FAMILIES.get(type(layer).__name__)
    if family is None:
        return f"{type(layer).__name__} is not written out"
    attn_cls, mlp_cls, norm_cls, _, qk_norm = family
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    if qk_norm:
        norms += (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))
    if type(attn).__name__ != attn_cls or type(mlp).__name__ != mlp_cls or any(type(n).__name__ != norm_cls for n in norms):
        return "a child module is not its family's class"
    for mod in (layer, attn, mlp, *norms):
        if "forward" in vars(mod):  # replaced on the instance (kernelize, another patch)
            return f"{type(mod).__name__}.forward is replaced on the instance"
    if getattr(config, "hidden_act", None) != "silu" or type(mlp.act_fn).__name__ != "SiLUActivation":
        return "the MLP's activation is not silu"
    if getattr(attn, "sliding_window", None) is not None or getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    if getattr(attn, "head_dim", 1) % 2:  # the rotary tables pair dimension i with i + D/2
        return "an odd head dimension"
    ret = inspect.signature(type(layer).forward).return_annotation
    if "tuple" in str(ret).lower():  # older transformers returned (hidden, ...) tuples
        return "its forward returns a tuple"
    return None


def _rms(norm: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    # transformers' LlamaRMSNorm / Qwen2RMSNorm.forward on float32 input (its two .to() are no-ops)
    variance = h.pow(2).mean(-1, keepdim=True)
    return norm._parameters["weight"] * (h * torch.rsqrt(variance + norm.variance_epsilon))


_SIN_SIGNED = "_draftcert_sin_signed"  # attribute of a rotary sin table: its signed form (below)


def _rotary_tables(position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin with its first half negated), unsqueezed on heads ``[B, 1, T, D]``.  With them
    ``rotate_half(x) * sin`` is ``x.roll(D / 2, -1) * sin_signed``: elementwise ``(-x2) s1`` becomes
    ``x2 (-s1)``, the same float32 value (negation is exact), in two operations instead of five.
    The signed table is built once a pass (the decoder hands every layer the same sin tensor) and
    kept on that tensor, so it goes when the pass's tables go, and threads never share one."""
    cos, sin = position_embeddings
    signed = sin.__dict__.get(_SIN_SIGNED)
    if signed is None:
        half = sin.shape[-1] // 2
        signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1)
        sin.__dict__[_SIN_SIGNED] = signed
    return cos.unsqueeze(1), signed


def _hooked(*mods: torch.nn.Module) -> bool:
    for m in mods:
        if m is not None and (m._forward_hooks or m._forward_pre_hooks):
            return True
    return False


def _plain_cache_layer(cache, idx: int, plain: type) -> bool:
    """Is layer ``idx`` of ``cache`` a plain ``DynamicLayer``, or ``kv_buffer``'s (a cache of another kind: no)?"""
    layers = getattr(cache, "layers", None)
    return isinstance(layers, list) and 0 <= idx < len(layers) and type(layers[idx]) in (plain, spare_layer())


def _global_hooks() -> bool:
    return bool(_nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks)


def lean_layer_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The decoder layer's forward (module docstring); the original one outside the written-out case."""
    from transformers.cache_utils import DynamicLayer  # optional: models extra (imported: a dict lookup)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # children read from the module dicts (nn.Module.__getattr__'s lookup costs ~1 us per access)
    mods = self._modules
    attn, mlp, norm_in, norm_post = mods["self_attn"], mods["mlp"], mods["input_layernorm"], mods["post_attention_layernorm"]
    am, mm = attn._modules, mlp._modules
    q_proj, k_proj, v_proj, o_proj = am["q_proj"], am["k_proj"], am["v_proj"], am["o_proj"]
    gate_proj, up_proj, down_proj = mm["gate_proj"], mm["up_proj"], mm["down_proj"]
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    position_embeddings = kwargs.get("position_embeddings")
    family = FAMILIES[type(self).__name__]
    if (args or position_embeddings is None or torch.is_grad_enabled() or self.training
            or hidden_states.dtype != torch.float32 or kwargs.get("output_attentions")
            or (cache is not None and not _plain_cache_layer(cache, attn.layer_idx, DynamicLayer))
            or _hooked(attn, mlp, norm_in, norm_post, mm["act_fn"], q_proj, k_proj, v_proj, o_proj,
                       gate_proj, up_proj, down_proj, am.get("q_norm"), am.get("k_norm"))
            or _global_hooks()):
        return getattr(type(self), _BASE).forward(self, hidden_states, *args, **kwargs)
    # every projection gguf-q8: the layer in two native calls (its attention is the kernel's, whatever
    # the model's attention implementation: which layer runs is a property of the model, not the call)
    plan = native_layer.plan_of(self)
    if plan is not None:
        out = native_layer.forward(plan, attn, hidden_states, cache, position_embeddings, kwargs.get("attention_mask"))
        if out is not None:
            return out
    impl = attn.config._attn_implementation
    if impl == "eager" or impl not in ALL_ATTENTION_FUNCTIONS:
        return getattr(type(self), _BASE).forward(self, hidden_states, *args, **kwargs)
    _, _, _, sliding_kwarg, qk_norm = family
    # what the layer hands its attention module as **kwargs: everything but the named arguments
    attn_kwargs = {k: v for k, v in kwargs.items()
                   if k not in ("attention_mask", "position_embeddings", "cache", "past_key_values")}
    residual = hidden_states
    x = _rms(norm_in, hidden_states)  # [B, T, hidden]
    input_shape = x.shape[:-1]
    hidden_shape = (*input_shape, -1, attn.head_dim)
    q = q_proj.forward(x).view(hidden_shape)  # [B, T, H, D]
    k = k_proj.forward(x).view(hidden_shape)  # [B, T, Hkv, D]
    if qk_norm:  # Qwen3: RMSNorm over each head's D values
        q, k = _rms(am["q_norm"], q), _rms(am["k_norm"], k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, D], [B, Hkv, T, D]
    v = v_proj.forward(x).view(hidden_shape).transpose(1, 2)
    # transformers' q cos + rotate_half(q) sin, the same bits (_rotary_tables)
    cos, sin_signed = _rotary_tables(position_embeddings)  # [B, 1, T, D]
    half = attn.head_dim // 2
    q = (q * cos) + (q.roll(half, -1) * sin_signed)
    k = (k * cos) + (k.roll(half, -1) * sin_signed)
    if cache is not None:
        k, v = cache.update(k, v, attn.layer_idx)  # [B, Hkv, S, D]
    if sliding_kwarg:
        attn_kwargs["sliding_window"] = attn.sliding_window
    out, _ = ALL_ATTENTION_FUNCTIONS[impl](attn, q, k, v, kwargs.get("attention_mask"), dropout=0.0,
                                           scaling=attn.scaling, **attn_kwargs)  # [B, T, H, D]
    out = out.reshape(*input_shape, -1).contiguous()
    hidden_states = residual + o_proj.forward(out)
    residual = hidden_states
    x = _rms(norm_post, hidden_states)
    x = down_proj.forward(F.silu(gate_proj.forward(x)) * up_proj.forward(x))
    return residual + x


def _switched_class(cls: type, forward) -> type:
    """``cls`` with ``forward`` (``lean_layer_forward``, ``lean_model_forward``): a subclass of the same
    name (what class-name checks read), so ``isinstance``, ``copy.deepcopy`` and transformers' output
    recording keep working."""
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {"forward": forward, _BASE: cls, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
        _SUBCLASSES[cls] = sub
    return sub


def _switched(mod: torch.nn.Module) -> bool:
    return _BASE in vars(type(mod))


def lean_layers(model: torch.nn.Module) -> int:
    """How many of ``model``'s decoder layers run ``lean_layer_forward``."""
    return sum(1 for m in model.modules() if _switched(m) and type(m).__name__ in FAMILIES)


def use_lean_layers(model: torch.nn.Module) -> int:
    """Switch every written-out decoder layer of ``model`` to ``lean_layer_forward`` (in place), and
    each Llama / Qwen2 / Qwen3 decoder (``LlamaModel`` ...) to ``lean_model_forward``; returns how
    many layers were switched (0 under ``DRAFTCERT_LEAN=0``, or for another family)."""
    if not enabled():
        return 0
    config = getattr(model, "config", None)
    n = 0
    for mod in model.modules():
        name = type(mod).__name__
        if _switched(mod):
            n += name in FAMILIES
        elif name in FAMILIES and _eligible(mod, getattr(mod.self_attn, "config", config)) is None:
            mod.__class__ = _switched_class(type(mod), lean_layer_forward)
            n += 1
    for mod in model.modules():  # a decoder whose layers are all switched
        layers = mod._modules.get("layers")
        if (type(mod).__name__ in DECODERS and not _switched(mod) and "forward" not in vars(mod)
                and layers is not None and len(layers) and all(_switched(layer) for layer in layers)):
            mod.__class__ = _switched_class(type(mod), lean_model_forward)
    return n


def restore_layers(model: torch.nn.Module) -> int:
    """Give every switched layer (and decoder) of ``model`` its original forward back; returns how
    many layers."""
    n = 0
    for mod in model.modules():
        if _switched(mod):
            n += type(mod).__name__ in FAMILIES
            mod.__class__ = getattr(type(mod), _BASE)
    return n


# ----------------------------------------------------------------------------- the causal LM around them

# causal LM class -> its decoder class, whose forward ``lean_decoder`` writes out
CAUSAL_LMS = {"LlamaForCausalLM": "LlamaModel", "Qwen2ForCausalLM": "Qwen2Model", "Qwen3ForCausalLM": "Qwen3Model"}
DECODERS = frozenset(CAUSAL_LMS.values())
# transformers' create_causal_mask arguments that lean_decoder passes (5.x names); another signature:
# the model's own forward
_MASK_ARGS = ("config", "inputs_embeds", "attention_mask", "cache", "position_ids")


def _mask_function():
    """transformers' ``create_causal_mask`` if its arguments are ``_MASK_ARGS``, else None."""
    global _MASK_FN
    if _MASK_FN is False:
        try:  # optional: models extra
            from transformers.masking_utils import create_causal_mask
        except ImportError:
            create_causal_mask = None
        ok = create_causal_mask is not None and all(a in inspect.signature(create_causal_mask).parameters for a in _MASK_ARGS)
        _MASK_FN = create_causal_mask if ok else None
    return _MASK_FN


_MASK_FN = False  # not looked up yet


def _decoder_base_ready(base) -> bool:
    """Can ``_lean_decode`` run the decoder ``base`` (``LlamaModel`` ...) right now?"""
    if _mask_function() is None or "forward" in vars(base):
        return False
    if torch.is_grad_enabled() or base.training or getattr(base, "has_sliding_layers", False) or _global_hooks():
        return False
    if any(t != "full_attention" for t in getattr(base.config, "layer_types", None) or ()):
        return False
    bm = base._modules
    if _hooked(base, bm.get("embed_tokens"), bm.get("norm"), bm.get("rotary_emb")):
        return False
    return all(_switched(layer) and not _hooked(layer) for layer in bm["layers"])


def decoder_ready(model) -> bool:
    """Can ``lean_decoder`` run ``model`` (a whole causal LM, every layer switched) right now?"""
    if CAUSAL_LMS.get(type(model).__name__) is None or "forward" in vars(model):
        return False
    base = model._modules.get("model")
    if base is None or type(base).__name__ != CAUSAL_LMS[type(model).__name__]:
        return False
    return not model.training and not _hooked(model, model._modules.get("lm_head")) and _decoder_base_ready(base)


def _lean_decode(base, cache, input_ids: torch.Tensor, attention_mask, position_ids: torch.Tensor) -> torch.Tensor:
    bm = base._modules
    h = bm["embed_tokens"].forward(input_ids)  # [B, T, hidden]
    layers = list(itertools.islice(bm["layers"]._modules.values(), base.config.num_hidden_layers))  # in order
    # (slicing a ModuleList builds a new one: ~100 us)
    plans = _native_plans(base, layers) if cache is not None else None
    # the native layers read the rotary's rows from its kept table; the module is called where another path runs
    rows = native_layer.position_rows(bm["rotary_emb"], position_ids, h) if plans is not None else None
    position_embeddings = bm["rotary_emb"](h, position_ids) if rows is None else None

    def model_mask():  # transformers' own mask for this call
        return _mask_function()(config=base.config, inputs_embeds=h, attention_mask=attention_mask, cache=cache,
                                position_ids=position_ids)

    if attention_mask is None and (plans is not None or (input_ids.shape[1] == 1 and native_layer.plan_of(layers[0]) is not None)):
        # what the native layers read None as: row i of T sees every key up to its own position (S - T + i),
        # transformers' causal mask after a cache; a chain's verification then builds no [T, S] mask
        mask = None
    else:
        mask = model_mask()
    if plans is not None:  # every layer native: all of them in one C call where the cache allows it
        out = native_layer.forward_layers(plans, [layer._modules["self_attn"] for layer in layers], h, cache,
                                          position_embeddings, mask, rows)
        if out is not None:
            return bm["norm"].forward(out)
        if position_embeddings is None:
            position_embeddings = bm["rotary_emb"](h, position_ids)
        if mask is None and input_ids.shape[1] > 1:  # layer by layer, where one may run transformers' attention
            mask = model_mask()
    for layer in layers:
        h = lean_layer_forward(layer, h, attention_mask=mask, position_embeddings=position_embeddings,
                               position_ids=position_ids, cache=cache, use_cache=cache is not None)
    return bm["norm"].forward(h)


def _native_plans(base, layers: list) -> list | None:
    """Each layer's native plan where every layer would run natively in ``lean_layer_forward`` (no hooks
    on its children, not training; the decoder's own checks are ``_decoder_base_ready``'s), else None.

    Kept on ``base`` with a snapshot of all it read (``_PlansMemo``): a pass then checks the snapshot in
    a few C-level sweeps (~40 us hot) instead of ~420 hook checks and 30 plans' validation (~110 us hot,
    several times that after a pass has evicted the caches)."""
    if _global_hooks():
        return None
    memo = base.__dict__.get(native_layer.PLANS_MEMO)
    if memo is not None and memo.holds(layers):
        return memo.plans
    plans = []
    for layer in layers:
        if layer.training or _hooked(*(owner.get(name) for owner, name in _watched(layer))):
            return None
        plan = native_layer.plan_of(layer)
        if plan is None:
            return None
        plans.append(plan)
    base.__dict__[native_layer.PLANS_MEMO] = _PlansMemo(layers, plans)
    return plans


_is = operator.is_
_get = dict.get
_data_ptr = torch.Tensor.data_ptr
_training = operator.attrgetter("training")
_WATCHED = (("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"),  # a layer's children
            ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"), ("gate_proj", "up_proj", "down_proj", "act_fn"))


def _watched(layer) -> list[tuple[dict, str]]:
    """(module dict, name) of every child of ``layer`` a native plan depends on: the layer's, its attention's
    and its MLP's (q_norm / k_norm may be absent: ``dict.get`` gives None)."""
    mods = layer._modules
    owners = (mods, mods["self_attn"]._modules, mods["mlp"]._modules)
    return [(owner, name) for owner, names in zip(owners, _WATCHED) for name in names]


class _PlansMemo:
    """What ``_native_plans`` and ``native_layer.plan_of`` read to give ``plans``, and :meth:`holds` to
    tell it still holds: the layers (by identity), ``gguf.layers.generation()``, each child they read
    by name and each norm weight and bias (by identity: ``(dict, key)`` pairs looked up again), the
    parameters' storage (``.to()`` swaps it under the same object), the children's hook dicts (empty)
    and the layers' training flags (off).  ``native_layer.forget`` drops it."""

    def __init__(self, layers: list, plans: list):
        self.layers, self.plans, self.generation = tuple(layers), plans, generation()
        dicts, keys, hooks = [], [], []
        for layer in layers:
            for owner, name in _watched(layer):
                dicts.append(owner)
                keys.append(name)
                child = owner.get(name)
                if child is not None:
                    hooks += [child._forward_hooks, child._forward_pre_hooks]
                    for pname in ("weight", "bias") if "norm" in name else ("bias",) if "proj" in name else ():
                        dicts.append(child._parameters)
                        keys.append(pname)
        self.dicts, self.keys, self.hooks = tuple(dicts), tuple(keys), tuple(hooks)
        self.values = tuple(map(_get, self.dicts, self.keys))
        self.params = tuple(v for v in self.values if isinstance(v, torch.Tensor))
        self.ptrs = tuple(map(_data_ptr, self.params))

    def holds(self, layers: list) -> bool:
        return (self.generation == generation() and len(layers) == len(self.layers)
                and all(map(_is, layers, self.layers)) and all(map(_is, map(_get, self.dicts, self.keys), self.values))
                and not any(self.hooks) and not any(map(_training, self.layers))
                and tuple(map(_data_ptr, self.params)) == self.ptrs)


def lean_decoder(model, cache, input_ids: torch.Tensor, attention_mask, position_ids: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden states ``[B, T, hidden]`` (after its final norm), as its forward computes
    them (``decoder_ready(model)`` first): embed, rotary tables, transformers' causal mask, the layers
    (``lean_layer_forward``), the norm."""
    return _lean_decode(model._modules["model"], cache, input_ids, attention_mask, position_ids)


# the keywords of the call ``generate`` makes to a decoder (transformers 5 names); the two output
# switches only when off.  Any other call (positional arguments, ``past_key_values=``, embeddings,
# outputs recorded) goes to the decoder's own forward exactly as it was made.
_PLAIN_KWARGS = frozenset({"input_ids", "attention_mask", "position_ids", "cache", "inputs_embeds", "use_cache",
                           "output_attentions", "output_hidden_states"})


def _plain_decoder_call(self, kwargs) -> bool:
    from transformers.cache_utils import Cache  # optional: models extra

    cfg = self.config
    mask = kwargs.get("attention_mask")
    return (kwargs.keys() <= _PLAIN_KWARGS and kwargs.get("input_ids") is not None
            and kwargs.get("inputs_embeds") is None and isinstance(kwargs.get("cache"), Cache)
            and bool(kwargs.get("use_cache")) and (mask is None or isinstance(mask, torch.Tensor))
            and not kwargs.get("output_attentions") and not kwargs.get("output_hidden_states")
            and not getattr(cfg, "output_attentions", False) and not getattr(cfg, "output_hidden_states", False)
            and getattr(cfg, "return_dict", True) is not False)


def lean_model_forward(self, *args, **kwargs):
    """The decoder's forward (``LlamaModel`` / ``Qwen2Model`` / ``Qwen3Model``) written out for the
    call ``generate`` makes every step (token ids, a cache, no outputs recorded): ``_lean_decode``, the
    same bits; any other call, the original forward with the same arguments."""
    if args or not _plain_decoder_call(self, kwargs) or not _decoder_base_ready(self):
        return getattr(type(self), _BASE).forward(self, *args, **kwargs)
    from transformers.modeling_outputs import BaseModelOutputWithPast  # optional: models extra

    input_ids, cache, position_ids = kwargs["input_ids"], kwargs["cache"], kwargs.get("position_ids")
    if position_ids is None:  # as the original: the positions after what the cache holds
        position_ids = (torch.arange(input_ids.shape[1], device=input_ids.device) + cache.get_seq_length()).unsqueeze(0)
    h = _lean_decode(self, cache, input_ids, kwargs.get("attention_mask"), position_ids)
    return BaseModelOutputWithPast(last_hidden_state=h, cache=cache)
