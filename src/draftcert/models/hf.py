"""The transformers adapter: everything draftcert assumes about a transformers causal LM, in one place.

- ``cache_kwarg(model)``, ``new_cache(model)``: the KV cache argument's name and a fresh cache;
- ``model_forward``, ``forward_with_hidden``: one forward pass of a token list after a cache;
- ``vocab_size_of``: the logit dimension;
- ``eos_token_ids``, ``pad_token_id``, ``left_pad``: ending and batching sequences;
- ``parse_dtype``: a dtype argument as the loaders and the profiler accept it.

Left padding: a batch of sequences of lengths L_b is padded on the left to L = max L_b.  Padded
slots get attention_mask = 0 and the real tokens get position ids 0..L_b-1 (``cumsum(mask) - 1``),
so every row sees exactly the positions it would see alone, and every row ends at the last column.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Sequence

import torch

from ..forward import decoder_layers, kv_buffer

__all__ = [
    "cache_kwarg",
    "device_of",
    "new_cache",
    "continued_positions",
    "select_cache_rows",
    "module_states",
    "MODULE_STATE_ATTRS",
    "attention_free",
    "model_forward",
    "forward_with_hidden",
    "output_rows",
    "vocab_size_of",
    "eos_token_ids",
    "pad_token_id",
    "left_pad",
    "parse_dtype",
]

# cache_kwarg's answer per model object (a signature lookup costs more than a decoding step's bookkeeping).
_CACHE_KWARG: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cache_kwarg(model) -> str:
    """Name of the KV-cache argument of ``model.forward`` (a causal LM, its decoder or a decoder layer).

    transformers 5.x calls it ``cache`` (``past_key_values`` is a deprecated alias there, which warns);
    older releases, and any forward whose signature cannot be read, ``past_key_values``.  A decoder or
    layer ``forward.decoder_layers`` switched to its written-out forward (``(*args, **kwargs)``) is read as the
    transformers class it replaced: that forward hands any call it does not write out to the original.
    """
    try:
        return _CACHE_KWARG[model]
    except (KeyError, TypeError):  # TypeError: an object that cannot be weakly referenced
        pass
    # a class forward.decoder_layers switched (its ``_BASE`` attribute names the class it replaced): the original's arguments
    base = vars(type(model)).get("_draftcert_lean_base")
    try:
        params = inspect.signature(model.forward if base is None else base.forward).parameters
    except (TypeError, ValueError):
        name = "past_key_values"
    else:
        name = "cache" if "cache" in params else "past_key_values"
    try:
        _CACHE_KWARG[model] = name
    except TypeError:
        pass
    return name


def new_cache(model=None, *, config=None):
    """An empty ``DynamicCache`` for ``model`` (its ``config``), or for ``config`` when given.

    Sliding-window layers get a full layer: transformers' ``DynamicSlidingWindowLayer`` keeps only
    the last W - 1 positions and cannot be cropped back once the window is crossed, which a
    speculative round must do.  The window is still applied: by the model's own sliding mask (it
    measures the window in cache indices, which a full layer keeps equal to positions) or by the
    engine's masks (``models.cache_state.layer_masks``).  The price is a full layer's memory.

    Full layers append in place (``forward.kv_buffer.spare_layer``: no copy of the cached keys and
    values per pass), holding the same values as transformers' ``DynamicLayer``.
    """
    from transformers import DynamicCache  # optional: models extra
    from transformers.cache_utils import (DynamicLayer, DynamicSlidingWindowLayer,
                                          LinearAttentionAndFullAttentionLayer,
                                          LinearAttentionAndSlidingWindowAttentionLayer)

    cache = DynamicCache(config=model.config if config is None else config)
    spare = kv_buffer.spare_layer()
    for i, layer in enumerate(cache.layers):
        if type(layer) in (DynamicLayer, DynamicSlidingWindowLayer):
            cache.layers[i] = spare()
        elif type(layer) is LinearAttentionAndSlidingWindowAttentionLayer:
            cache.layers[i] = LinearAttentionAndFullAttentionLayer(number_of_states=layer.number_of_states)
    return cache


# recurrent state some models keep on their own modules, outside the cache (RecurrentGemma's
# recurrent blocks: the short convolution's window and the RG-LRU state)
MODULE_STATE_ATTRS = ("conv1d_state", "recurrent_states")


def module_states(model) -> list[tuple[torch.nn.Module, str]]:
    """(module, attribute) of every state ``model`` keeps on its modules rather than in the cache.

    Such a state has one row per batch row of the last pass and ignores the attention mask
    (RecurrentGemma's convolution reads left padding), so batches of such a model are not exact:
    they run row by row (``profile``; the engine decodes them row after row anyway)."""
    return [(m, a) for m in model.modules() for a in MODULE_STATE_ATTRS if a in vars(m)]


def _rows(value, keep, n_rows):
    if isinstance(value, torch.Tensor):
        return value[keep] if value.dim() and value.shape[0] == n_rows else value
    if isinstance(value, list):
        return [_rows(v, keep, n_rows) for v in value]
    if isinstance(value, dict):
        return {k: _rows(v, keep, n_rows) for k, v in value.items()}
    return value


def select_cache_rows(cache, keep: torch.Tensor, n_rows: int) -> None:
    """In place: keep the batch rows ``keep`` of a cache of ``n_rows`` rows, every layer kind.

    transformers' ``batch_select_indices`` selects attention keys and values only: linear-attention
    and SSM layers (Qwen3-Next, Mamba2, LFM2-MoE, Granite hybrids) have none, and a hybrid layer's
    would keep every row of its recurrent state.  Here every tensor of a layer whose first dimension
    is the batch is indexed (keys, values, convolution and recurrent states, in lists or dicts).
    """
    for layer in cache.layers:
        for name, value in list(vars(layer).items()):
            setattr(layer, name, _rows(value, keep, n_rows))


def attention_free(cache) -> bool:
    """True when no layer of ``cache`` is an attention layer (Mamba, Mamba2, Falcon-Mamba): such models
    take no attention mask once their states hold the prompt (Mamba broadcasts a 2-D mask over the
    new token's hidden states; transformers' ``generate`` drops it after the first step too)."""
    from transformers.cache_utils import CacheLayerMixin  # optional: models extra

    return not any(isinstance(layer, CacheLayerMixin) for layer in cache.layers)


def continued_positions(cache, n: int, device) -> torch.Tensor | None:
    """position_ids [1, n] that continue ``cache``: its attention layers' length onwards.

    Passed explicitly because some hybrid models do not derive them from the cache (Bamba numbers
    every pass from 0 when none are given: transformers' ``generate`` always passes them).  None for
    a cache of recurrent layers only, which tracks no length and whose models use no positions.
    """
    try:
        start = cache.get_seq_length()  # the first attention layer's length (recurrent layers have none)
    except ValueError:
        return None
    return torch.arange(start, start + n, device=device).unsqueeze(0)


def device_of(model) -> torch.device:
    """``model.device`` without transformers' walk over the parameters (~60 us, twice a pass): its first
    parameter's, the parameter object kept on the model (``.to()`` moves data under the same object)."""
    p = model.__dict__.get("_draftcert_first_parameter")
    if p is None:
        p = model.__dict__["_draftcert_first_parameter"] = next(model.parameters(), None)
    return model.device if p is None else p.device


def model_forward(model, cache, ids: list[int], keep: int, mask=None, position_ids=None,
                  head=None) -> torch.Tensor:
    """One forward pass of ``ids`` after ``cache`` (which it extends); logits of the last ``keep`` positions.

    ``mask``: an additive 4-D mask [1, 1, len(ids), cached + len(ids)] (tree attention), or None for
    plain causal attention; ``position_ids``: [1, len(ids)], or None to continue the cache.
    ``head``: a callable taking the final hidden states ``[keep, H]`` to the logits ``[keep, V]`` in place
    of the model's output layer (a drafter over part of the vocabulary, ``drafting.draft_vocab.VocabHead``).
    Returns [keep, V].
    """
    device = device_of(model)
    if position_ids is None:
        position_ids = continued_positions(cache, len(ids), device)
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    ready = decoder_layers.decoder_ready(model)  # the same bits without transformers' model-level plumbing (decoder_layers.py)
    if head is not None or ready:
        h = _decoder_states(model, cache, input_ids, mask, position_ids, ready)  # [1, T, H]
        if head is not None:
            return head(h[0, -keep:, :])
        return model._modules["lm_head"].forward(h[:, -keep:, :])[0]
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=position_ids,
        use_cache=True,
        logits_to_keep=keep,
        **{cache_kwarg(model): cache},
    )
    return out.logits[0, -keep:]


def _decoder_states(model, cache, input_ids: torch.Tensor, mask, position_ids, ready: bool) -> torch.Tensor:
    """The decoder's final hidden states [B, T, H] (after its norm): written out where ``ready``
    (``decoder_layers.decoder_ready``), else the decoder module's forward."""
    if ready:
        return decoder_layers.lean_decoder(model, cache, input_ids, mask, position_ids)
    dec = model.get_decoder()
    return dec(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
               **{cache_kwarg(dec): cache}).last_hidden_state


def forward_with_hidden(model, cache, ids: list[int], keep: int, mask=None, position_ids=None):
    """``model_forward`` that also returns the final hidden states of every position.

    Returns (logits [keep, V], hidden [len(ids), H]).  The logits are computed exactly as the causal
    LM computes them (its output embedding on the last hidden states), so decoding with this pass
    is identical to ``model_forward``.
    """
    device = device_of(model)
    if position_ids is None:
        position_ids = continued_positions(cache, len(ids), device)
    if decoder_layers.decoder_ready(model):  # its output layer unhooked: called as model_forward calls it
        h = _decoder_states(model, cache, torch.tensor([ids], dtype=torch.long, device=device), mask,
                            position_ids, True)
        return model._modules["lm_head"].forward(h[:, -keep:, :])[0], h[0]
    dec = model.get_decoder()
    out = dec(
        input_ids=torch.tensor([ids], dtype=torch.long, device=device),
        attention_mask=mask,
        position_ids=position_ids,
        use_cache=True,
        **{cache_kwarg(dec): cache},
    )
    h = out.last_hidden_state  # [1, len(ids), H]
    logits = model.get_output_embeddings()(h[:, -keep:, :])
    return logits[0], h[0]


def output_rows(model) -> int | None:
    """Rows of ``model``'s output layer (the logit dimension), None without one.  Read from the
    layer's size (``out_features``, ``num_embeddings``) before its ``.weight``: a GGUF layer's
    ``.weight`` decodes the whole table (0.5 s for a 151,936 x 1,536 head)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return None
    for size in ("out_features", "num_embeddings"):
        n = getattr(head, size, None)
        if isinstance(n, int):
            return n
    w = getattr(head, "weight", None)
    return None if w is None else int(w.shape[0])


def vocab_size_of(model) -> int:
    """The logit dimension V: rows of the output embedding, else ``config.vocab_size``."""
    rows = output_rows(model)
    return int(model.config.vocab_size) if rows is None else rows


def _ids(value) -> set[int]:
    """One id or a collection of ids (list, tuple, set, tensor), as a set of ints."""
    try:
        return {int(x) for x in value}
    except TypeError:  # not iterable: a single id (int, numpy or 0-d torch integer)
        return {int(value)}


def eos_token_ids(model, tokenizer=None, *, explicit=None) -> set[int]:
    """Every id that ends a sequence.

    ``explicit`` (an id or a list of ids, ``[]`` for none), when given, is the answer.  Otherwise
    the tokenizer's EOS together with the generation config's (either may be a list); when neither
    names one, the model config's ``eos_token_id``; else no EOS at all.
    """
    if explicit is not None:
        return _ids(explicit)
    gc = getattr(model, "generation_config", None)
    named = [getattr(tokenizer, "eos_token_id", None), getattr(gc, "eos_token_id", None)]
    named = [c for c in named if c is not None]
    if not named:
        fallback = getattr(getattr(model, "config", None), "eos_token_id", None)
        named = [fallback] if fallback is not None else []
    out: set[int] = set()
    for c in named:
        out |= _ids(c)
    return out


def pad_token_id(tokenizer, model) -> int:
    """The id written into left-padded slots: the tokenizer's pad, else its EOS, else the model
    config's pad, else 0.  Any id works (padded slots are masked out); this one is the conventional."""
    for cand in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None),
                 getattr(getattr(model, "config", None), "pad_token_id", None)):
        if isinstance(cand, int):
            return cand
    return 0


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids), each [B, max len], left-padded (module docstring)."""
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("prompts: every prompt must encode to at least one token")
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), int(pad_id), dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, L - len(s):] = torch.as_tensor(list(s), dtype=torch.long)
        mask[b, L - len(s):] = 1
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    return ids.to(device), mask.to(device), pos.to(device)


# Short names the command line accepts besides torch's own dtype names.
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def parse_dtype(dtype) -> torch.dtype | None:
    """A dtype argument: a ``torch.dtype``; a torch dtype name, any case, with or without "torch."
    ("float32", "bfloat16", "torch.float16", ...) or a short name (fp32, bf16, fp16); or
    None / "auto" for the loader's default (None; ``load_target`` then uses float32).
    Raises ValueError otherwise."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str):
        raise ValueError(f"dtype must be a torch.dtype or its name, got {dtype!r}")
    key = dtype.strip().lower().removeprefix("torch.")
    if key == "auto":
        return None
    out = getattr(torch, _DTYPE_ALIASES.get(key, key), None)
    if not isinstance(out, torch.dtype):
        raise ValueError(f"dtype={dtype!r} is not a torch dtype name (e.g. float32, bfloat16, float16, or auto)")
    return out
