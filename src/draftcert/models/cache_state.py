"""A model's decoding state: which kinds of layers its cache holds, what a draft pass may ask of
them, and taking the state back to "after the accepted tokens".  The one place the engine, the
batched engine and the model drafter roll a cache back.

Layer kinds (transformers' ``DynamicCache`` layers; ``layout_of`` classifies a model)::

    full       keys and values of every position (``DynamicLayer``).  Rollback: crop, or gather the
               accepted tree nodes into place and crop (``keep_cache``).
    sliding    transformers keeps the last W - 1 positions of a window-W layer
               (``DynamicSlidingWindowLayer``), which cannot be cropped back once the window is crossed.
               ``models.hf.new_cache`` gives such layers a plain full layer instead, and the window is
               applied by the mask: the model's own sliding mask for a chain at batch 1 (transformers
               measures the window in cache indices, which are the positions there), and
               ``layer_masks`` for trees and batches (query position - key position < W, on position
               ids).  The cache of a sliding layer then grows like a full one: exact across the window
               boundary, at the memory of a full-attention layer.
    recurrent  a state summarising every position: Mamba / Mamba2 SSM states, Gated DeltaNet and
               other linear attention, LFM2's short convolutions, and the state half of hybrid
               layers (``LinearAttentionCacheLayerMixin``).  It cannot be cropped.  Rollback:
               ``mark`` copies the states before the verification pass; after acceptance, when the
               pass's every token was accepted the new state is exact and kept, otherwise the copy is
               put back (with the attention layers cropped to the same point) and the accepted tokens
               are fed again as the *pending* tokens of the next verification pass: no extra pass, a
               few more rows in the next one.  RecurrentGemma keeps its states on its own modules
               (``conv1d_state``, ``recurrent_states``), not in the cache: they are copied and put
               back the same way.
    dummy      nothing cached (key/value sharing, MLP-only layers).

What a draft pass needs (``Layout``):

* a tree needs attention over the tree (a mask on every layer), which recurrent layers cannot
  take: trees are refused on models with recurrent state (``tree_refusal``), before any work; the
  engine verifies chains there (a drafter's tree is cut to its first-ranked path).
* a multi-token pass after cached state must continue that state.  transformers' Mamba (v1) and
  Falcon-Mamba restart their SSM state in every multi-token pass ("initial hidden state is not
  supported"), so ``multi_token_ok`` probes it once per model (``probe_continuation``: the same
  tokens fed in one pass and one at a time); where it fails, verification feeds the tokens one at
  a time (``Layout.stepwise``): exact, and as slow as the target alone.
* position schemes that ignore position ids: ALiBi by key column (MPT, Bloom, Falcon with
  ``alibi=True``) and GPT-Neo's local layers (a band over cache columns) are exact for a chain
  at batch 1, where columns are positions; trees are refused and batches are decoded row after
  row (``batch_refusal``).
* a batched pass gives each row its own columns (holes, left padding; ``batch.py``): it needs
  attention layers only, with the window (if any) applied by ``layer_masks``; everything else is
  decoded row after row, exactly as at batch 1.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

from .hf import model_forward, module_states, new_cache
from .tree_attention import DraftTree, additive_mask, keep_cache

__all__ = ["Layout", "layout_of", "CacheState", "layer_masks", "chain_of", "probe_continuation", "ATTENTION_MASK_KINDS"]

# layer_types entries that take an attention mask of their own (the keys of a model's mask mapping)
ATTENTION_MASK_KINDS = {"full_attention", "sliding_attention"}

_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a model's Layout, worked out once


@dataclass(frozen=True)
class Layout:
    """What a model's cache holds and what a draft pass may do with it (module docstring)."""

    model_name: str
    kinds: tuple[str, ...]  # per cache layer: "full", "sliding", "recurrent", "hybrid" (recurrent + attention), "dummy", "other"
    layer_classes: tuple[str, ...]  # transformers' cache layer class per layer (in messages)
    window: int | None = None  # the sliding window W of the "sliding" layers
    mask_types: tuple[str, ...] = ()  # per decoder layer: its entry of config.layer_types ("" when absent)
    dict_masks: bool = False  # the model takes a {layer type: mask} mapping as attention_mask
    positions_ignored: str | None = None  # why position ids do not set attention (ALiBi by column, GPT-Neo local)
    stepwise: bool = False  # multi-token passes after cached state are not exact: verify token by token
    module_state: bool = False  # recurrent state kept on the model's modules, outside the cache (RecurrentGemma)
    other: tuple[str, ...] = field(default_factory=tuple)  # cache layer classes of no kind above

    @cached_property  # read several times a round (mark, keep, catch_up): worked out once (the fields are frozen)
    def stateful(self) -> bool:
        return any(k in ("recurrent", "hybrid") for k in self.kinds)

    @cached_property
    def sliding(self) -> bool:
        return "sliding" in self.kinds

    def _state_classes(self) -> str:
        names = sorted({c for c, k in zip(self.layer_classes, self.kinds) if k in ("recurrent", "hybrid")})
        return ", ".join(names)

    def decode_refusal(self) -> str | None:
        """Why this model cannot be verified speculatively at all (None: it can)."""
        if self.module_state:
            return (f"{self.model_name} keeps its recurrent state on its own modules, outside the cache, where "
                    "draftcert cannot yet prove its roll-back exact in every case; decode it with the target "
                    "alone (model.generate), or profile it (draftcert profile runs it row by row)")
        return None

    def tree_refusal(self) -> str | None:
        """Why this model cannot verify a draft tree in one pass (None: it can)."""
        if self.other:
            return (f"{self.model_name}'s cache has layers draftcert cannot roll back per tree node "
                    f"({', '.join(sorted(set(self.other)))}); use a chain (tree=None, no tree:M criterion)")
        if self.stateful:
            return (f"{self.model_name} has recurrent state ({self._state_classes()}), which reads tokens in order "
                    "and cannot attend over a tree; use a chain (tree=None, k=N; criteria other than tree:M)")
        if self.positions_ignored:
            return (f"{self.model_name} {self.positions_ignored}, so tree nodes (which share positions) would see "
                    "the wrong attention; use a chain (tree=None, k=N; criteria other than tree:M)")
        if self.sliding and not self._masks_expressible():
            return (f"{self.model_name} mixes sliding-window and full-attention layers but takes one attention mask "
                    "for all of them; use a chain (tree=None, k=N)")
        return None

    def batch_refusal(self) -> str | None:
        """Why this model cannot verify several rows in one batched pass (None: it can); such a batch
        is decoded row after row instead, exactly as at batch 1."""
        if self.other:
            return f"its cache has layers of kind {', '.join(sorted(set(self.other)))}"
        if self.stateful:
            return f"its recurrent state ({self._state_classes()}) cannot skip another row's padding or holes"
        if self.positions_ignored:
            return self.positions_ignored
        if self.sliding and not self._masks_expressible():
            return "it mixes sliding-window and full-attention layers but takes one attention mask"
        return None

    def _masks_expressible(self) -> bool:
        kinds = {t for t in self.mask_types if t in ATTENTION_MASK_KINDS}
        return self.dict_masks or len(kinds) <= 1 or not self.window


def _text_config(model):
    cfg = model.config
    return cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg


def _positions_ignored(cfg) -> str | None:
    mt = getattr(cfg, "model_type", "")
    attn = getattr(cfg, "attn_config", None)
    alibi = bool(getattr(cfg, "alibi", False)) or bool(getattr(attn, "alibi", False) if attn is not None else False)
    if mt in ("bloom", "mpt") or alibi:
        return "biases attention by key column (ALiBi), not by position id"
    if mt == "gpt_neo" and "local" in (getattr(cfg, "attention_layers", None) or []):
        return "bands its local layers by key column (GPT-Neo's window), not by position id"
    return None


def _takes_dict_masks(model) -> bool:
    """Does the decoder's forward take ``attention_mask`` as a {layer type: mask} mapping?"""
    try:
        dec = model.get_decoder()
        src = inspect.getsource(type(dec).forward)
    except (AttributeError, TypeError, OSError):
        return False
    return "causal_mask_mapping := attention_mask, dict" in src


def _kind(layer) -> str:
    from transformers.cache_utils import (DummyLayer, DynamicLayer, DynamicSlidingWindowLayer,  # models extra
                                          LinearAttentionCacheLayerMixin)

    recurrent = isinstance(layer, LinearAttentionCacheLayerMixin)
    if isinstance(layer, DummyLayer):
        return "dummy"
    if recurrent and isinstance(layer, DynamicLayer):
        return "hybrid" if not isinstance(layer, DynamicSlidingWindowLayer) else "other"
    if recurrent:
        return "recurrent"
    if type(layer) is DynamicLayer:
        return "full"
    if type(layer) is DynamicSlidingWindowLayer:
        return "sliding"
    return "other"


def layout_of(model) -> Layout:
    """The model's ``Layout``, worked out once per model object (the continuation probe runs forwards)."""
    try:
        return _LAYOUTS[model]
    except (KeyError, TypeError):
        pass
    from transformers import DynamicCache  # models extra

    cfg = _text_config(model)
    raw = DynamicCache(config=model.config)  # transformers' own layers, before new_cache replaces sliding ones
    kinds = tuple(_kind(layer) for layer in raw.layers)
    classes = tuple(type(layer).__name__ for layer in raw.layers)
    window = getattr(cfg, "sliding_window", None) if "sliding" in kinds else None
    types = tuple(getattr(cfg, "layer_types", None) or ())
    layout = Layout(
        model_name=type(model).__name__, kinds=kinds, layer_classes=classes, window=window, mask_types=types,
        dict_masks=_takes_dict_masks(model), positions_ignored=_positions_ignored(cfg),
        other=tuple(c for c, k in zip(classes, kinds) if k == "other"), module_state=bool(module_states(model)),
    )
    if layout.stateful and not probe_continuation(model):
        layout = replace(layout, stepwise=True)
    try:
        _LAYOUTS[model] = layout
    except TypeError:
        pass
    return layout


def probe_continuation(model, n_prefix: int = 3, n_more: int = 3) -> bool:
    """Does a multi-token pass after cached state continue that state?

    Feeds ``n_prefix`` tokens, then ``n_more`` in one pass, against the same tokens fed one at a
    time.  A model that restarts its state in multi-token passes (transformers' Mamba v1) differs
    by the state's whole contribution, O(1) in the logits; the two exact computations differ by
    rounding only (a chunked against a recurrent kernel), ~1e-6 of the logits in float32.  The
    bound between them: 1e-3 of the logits' scale in float32/float64, 5e-2 in 16-bit dtypes.
    """
    vocab = int(getattr(_text_config(model), "vocab_size", 2))
    ids = [(7 * i + 3) % vocab for i in range(n_prefix + n_more)]
    with torch.inference_mode():
        c1 = new_cache(model)
        model_forward(model, c1, ids[:n_prefix], 1)
        chunk = model_forward(model, c1, ids[n_prefix:], n_more).float()  # [n_more, V]
        c2 = new_cache(model)
        model_forward(model, c2, ids[:n_prefix], 1)
        step = torch.cat([model_forward(model, c2, [t], 1) for t in ids[n_prefix:]]).float()
    scale = 1.0 + float(step.abs().max())
    tol = (5e-2 if model.dtype in (torch.float16, torch.bfloat16) else 1e-3) * scale
    return bool((chunk - step).abs().max() <= tol)


# ---- masks per layer kind ---------------------------------------------------


def layer_masks(layout: Layout, allowed: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, dtype):
    """The ``attention_mask`` argument for a pass with an explicit mask.

    ``allowed`` [B, Q, K] (bool): which key columns each query may attend, by draftcert's rules
    (tree, holes, padding); ``q_pos`` [B, Q] and ``k_pos`` [B, K]: the position ids of the queries
    and of the keys (cached columns and the block's own).  Full-attention layers take ``allowed``;
    sliding layers also need ``q_pos - k_pos < W`` (transformers' window, on positions).  Returns
    an additive mask [B, 1, Q, K], or a {layer type: mask} mapping where the model mixes both kinds.
    """
    full = additive_mask(allowed, dtype)[:, None]
    if not layout.sliding:
        return full
    in_window = (q_pos[:, :, None] - k_pos[:, None, :]) < int(layout.window)  # [B, Q, K]
    windowed = additive_mask(allowed & in_window, dtype)[:, None]
    kinds = {t for t in layout.mask_types if t in ATTENTION_MASK_KINDS}
    if layout.dict_masks and "full_attention" in kinds:
        return {t: (windowed if t == "sliding_attention" else full) for t in set(layout.mask_types)}
    if not kinds or kinds == {"sliding_attention"}:
        return windowed  # every attention layer slides (Mistral, Starcoder2: one mask for all)
    return full


# ---- rollback ---------------------------------------------------------------


def _copy(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


_ATTENTION_ATTRS = ("keys", "values", "cumulative_length", "_sliding_window_tensor")


class CacheState:
    """A model's cache with what its rollback needs.

        state = CacheState(model)          # state.cache: the cache to pass to the model
        state.mark(n_cached)               # before a pass: the cache holds n_cached tokens of the sequence
        ... one forward over pending tokens + draft nodes ...
        n_cached = state.keep(start, offsets, n_fed)   # after acceptance

    ``keep``: ``start`` = the sequence's length before the draft (pending tokens included),
    ``offsets`` = the accepted nodes' places among the ``n_fed`` nodes fed after it.  Attention
    layers keep exactly those (``keep_cache``).  With recurrent state, the state after the pass is
    kept when everything fed was accepted (a chain accepted whole); otherwise the copy ``mark``
    made is put back and the attention layers are cropped to the marked length, and the returned
    n_cached is the marked one: the caller feeds the accepted tokens again next pass.
    """

    def __init__(self, model, layout: Layout | None = None):
        self.layout = layout_of(model) if layout is None else layout
        self.cache = new_cache(model)
        self._marked: tuple[int, list, list] | None = None
        # state held on the model's modules rather than in the cache: (module, attribute) pairs
        self._held = module_states(model)

    def checkpoint(self, n_cached: int) -> tuple[int, list, list]:
        """What ``restore`` needs to bring the cache back to holding ``n_cached`` tokens: that length,
        and copies of the recurrent states, in the cache and on the modules (attention layers are
        cropped back instead)."""
        from transformers.cache_utils import LinearAttentionCacheLayerMixin  # models extra

        saved = []
        for layer in self.cache.layers:
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                saved.append({k: _copy(v) for k, v in vars(layer).items() if k not in _ATTENTION_ATTRS})
            else:
                saved.append(None)
        return n_cached, saved, [_copy(getattr(m, a)) for m, a in self._held]

    def restore(self, point: tuple[int, list, list]) -> int:
        """Back to a ``checkpoint``: recurrent states copied back, attention layers cropped to its
        length (a hybrid layer's attention half alone: its own ``crop`` refuses).  Returns the length;
        the point stays valid for another ``restore``."""
        from transformers.cache_utils import DynamicLayer  # models extra

        n, saved, held = point
        for (module, attr), value in zip(self._held, held):
            setattr(module, attr, _copy(value))
        for layer, snap in zip(self.cache.layers, saved):
            if snap is not None:
                vars(layer).update({k: _copy(v) for k, v in snap.items()})
            if isinstance(layer, DynamicLayer) and getattr(layer, "keys", None) is not None and layer.keys.numel():
                extra = layer.keys.shape[-2] - n
                if extra > 0:
                    DynamicLayer.crop(layer, -extra)
                elif extra < 0:
                    raise RuntimeError(f"cache layer holds {n + extra} positions; cannot restore {n}")
        return n

    def mark(self, n_cached: int) -> None:
        """Before a pass: remember the state at ``n_cached`` tokens (recurrent states only need it)."""
        self._marked = self.checkpoint(n_cached) if self.layout.stateful else None

    def keep(self, start: int, offsets: list[int], n_fed: int) -> int:
        if not self.layout.stateful and n_fed:
            keep_cache(self.cache, start, offsets)
            return start + len(offsets)
        if offsets == list(range(n_fed)):  # everything fed accepted, or nothing fed (a plain round): exact as it is
            self._marked = None
            return start + len(offsets)
        if self._marked is None:
            raise RuntimeError("CacheState.keep: mark() was not called before the pass")
        n, self._marked = self.restore(self._marked), None
        return n


def chain_of(tree):
    """The tree's first-ranked root-to-leaf path as a chain (for models that verify chains only).

    Children keep the drafter's rank order (node index), so the path is the drafter's greedy
    chain, a suffix match grafted below it included.  Expanded nodes off the path, and their q
    rows, are dropped; the kept ones keep width 1.
    """
    if tree.is_chain:
        return tree
    children = tree.children_table()
    path, r = [], 0
    while children[r]:
        node = children[r][0]
        path.append(node)
        r = node + 1
    out = DraftTree()
    for i, node in enumerate(path):
        out.add(tree.tokens[node], i - 1)
    keep = [e for e, node in enumerate(tree.expanded) if node == -1 or node in path]
    where = {node: i for i, node in enumerate(path)}
    out.expanded = [-1 if tree.expanded[e] == -1 else where[tree.expanded[e]] for e in keep]
    out.widths = [1 for _ in keep]
    if tree.q is not None:
        out.q = tree.q[keep] if keep else None
    return out
