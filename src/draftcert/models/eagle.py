"""EAGLE-style feature drafter with a reduced draft vocabulary and a shared tail mass.

Architecture (one step, for the pair "token x_{s+1}, target feature f_s")::

    h   = fc([embed(x_{s+1}) ; f_s])            # Linear(2H -> H); embed = the target's (frozen)
    h   = decoder_layer(h)                       # ONE layer of the target's own class (Llama, Qwen3, ...)
    g   = norm(h)                                # the target's final-norm class, initialised from it
    z   = W_d g        (V_d rows)                # rows of the target's LM head for the draft vocabulary
    t   = w_t . g + b_t                          # one learned "tail" logit

``f_s`` is the target's last hidden state (after its final norm, what its LM head reads) at
position s; ``g`` is the drafter's guess of ``f_{s+1}`` and is fed back as the feature of the
next drafting step, so a chain of k drafts costs k one-layer steps.

Full-vocabulary distribution: the V - V_d tokens outside the draft vocabulary share the tail mass
equally, i.e. each gets the logit ``t - log(V - V_d)``.  q is then a proper distribution on the
whole vocabulary with q(y) > 0 everywhere, so KL(p||q) is finite and the certificates exact.
A token outside the draft vocabulary is never worth drafting (the drafter knows nothing of it), so
the tail logit is capped: ``t <= z_(w) + log(V - V_d) - margin`` with ``z_(w)`` the
``w = PROPOSAL_WIDTH``-th largest draft logit and a margin of a few ulps, which keeps every token
outside the vocabulary strictly below the top ``w`` of q: a chain, and a tree up to ``w`` children
wide, proposes only draft-vocabulary tokens.  The cap is part of q (training, certificates, profile
and decoding all see the capped tail); it binds only where the tail would outrank the w-th draft token.

The draft-vocabulary head rows are *frozen copies* of the target's LM head rows: the drafter's
logit space is the target's, so matching the target's feature matches its distribution; and the
rows are not stored in the weights file (only their token ids), which keeps the file small and
guarantees it uses exactly the target's head.  The embedding is the target's too (frozen, not
stored).  The weights file (safetensors) stores ``fc``, the decoder layer, the norm, the tail row,
the draft vocabulary ids and a fingerprint of the target, checked at load time.  The decoder
layer is the target's class with its MLP width ``intermediate_size`` (the target's own unless a
smaller one is asked for: a drafter of a 1.5B target with the target's width would cost 50M
weights a step).

On a target computed from GGUF blocks (``gguf.layers.numerics_of``: ``gguf-exact-f32`` or
``gguf-q8``) a loaded drafter computes as the target does (``run_from_blocks``): its linear
weights as Q8_0 blocks (``DRAFTER_BLOCKS``; stored so in the file when saved with ``blocks=True``,
else quantised at load) and its head as the draft vocabulary's rows of the target's own output
blocks, each a ``GGUFLinear`` under the target's contract.  A drafted token then reads about
``(layer + fc + V_d x H)`` bytes of blocks, a few percent of a target pass.  Under ``gguf-q8`` outside
autograd a step is one native call (``forward.feature_step``: its final norm is the target's layers' rms).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import weakref
from importlib.resources import files
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn

from ..fileio import atomic_path
from .hf import cache_kwarg, new_cache
from ..forward import feature_step
from ..forward.decoder_layers import use_lean_layers
from ..gguf.blocks import check_blocks, decode_rows, quantize_rows
from ..gguf.layers import CONTRACTS, GGUFLinear, group_siblings, numerics_of

FORMAT = "draftcert-eagle-1"
WEIGHTS_NAME = "drafter.safetensors"
DRAFTER_BLOCKS = 8  # Q8_0 (GGML type 8): a drafter's linear weights on a GGUF target
PROPOSAL_WIDTH = 8  # the top this many tokens of q are always draft-vocabulary tokens (module docstring)

__all__ = [
    "EagleDrafter",
    "target_fingerprint",
    "target_hidden",
    "load_eagle",
    "save_eagle",
    "is_eagle_path",
    "FORMAT",
]


def _parts(target):
    """(decoder, embed_tokens, final norm, lm_head module) of a transformers causal LM (the head's
    weights not read: a GGUF head's ``.weight`` decodes its blocks)."""
    dec = target.get_decoder() if hasattr(target, "get_decoder") else getattr(target, "model", None)
    layers = getattr(dec, "layers", None)
    norm = getattr(dec, "norm", None)
    head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    if layers is None or norm is None or head is None or (getattr(head, "qweight", None) is None
                                                          and getattr(head, "weight", None) is None):
        raise ValueError(f"eagle drafter: {type(target).__name__} is not a Llama/Qwen-style causal LM "
                         "(expected model.layers, model.norm and an output embedding)")
    if getattr(head, "bias", None) is not None:
        raise ValueError("eagle drafter: targets whose LM head has a bias are not supported")
    if getattr(target.config, "final_logit_softcapping", None):
        raise ValueError("eagle drafter: targets with logit soft-capping are not supported")
    return dec, dec.get_input_embeddings(), norm, head


def _head_shape(head) -> tuple[int, int]:
    """(V, H) of an output layer, from its sizes where it has them (no decode)."""
    if isinstance(getattr(head, "out_features", None), int) and isinstance(getattr(head, "in_features", None), int):
        return head.out_features, head.in_features
    return int(head.weight.shape[0]), int(head.weight.shape[1])


# target -> (what its fingerprint was computed from, the fingerprint): hashing the head and the
# embedding (and decoding them, for GGUF layers) took 0.4 s per look on the embedded target, and
# loading and binding a drafter looks several times per decode call
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _stored(*mods) -> tuple:
    """The identity and in-place version of every tensor the modules hold: any change to their weights
    (a new tensor, or an in-place write) changes it."""
    return tuple((id(t), t._version) for m in mods for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)))


def target_fingerprint(target) -> dict:
    """What a drafter must match: architecture, sizes, and a hash of the LM head and embedding."""
    dec, emb, norm, head = _parts(target)
    key = (type(target).__name__, type(dec.layers[-1]).__name__, id(head), id(emb), id(norm), _stored(head, emb, norm))
    try:
        cached = _FINGERPRINTS.get(target)
    except TypeError:  # not weak-referenceable: computed each time
        cached = None
    if cached is not None and cached[0] == key:
        return dict(cached[1])
    V, H = _head_shape(head)
    h = hashlib.sha256()
    for get in (lambda: head.weight, lambda: emb.weight, lambda: norm.weight):  # one decoded table at a time
        h.update(get().detach().to(torch.float32).cpu().contiguous().numpy().tobytes())
    fp = {
        "architecture": type(target).__name__,
        "layer_class": type(dec.layers[-1]).__name__,
        "hidden_size": int(H),
        "vocab_size": int(V),
        "weights_sha256": h.hexdigest(),
    }
    try:
        _FINGERPRINTS[target] = (key, dict(fp))
    except TypeError:
        pass
    return fp


def target_hidden(target, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=False):
    """The target's final hidden states (B, T, H), after its final norm: the features a drafter reads
    (its logits are ``f @ target.get_output_embeddings().weight.T``)."""
    dec = _parts(target)[0]
    kw = {cache_kwarg(dec): cache} if cache is not None else {}
    return dec(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache,
               **kw).last_hidden_state


def _layer_config(target, intermediate_size: int | None = None):
    """A copy of the target's config describing one decoder layer (cache slot 0, full attention),
    with MLP width ``intermediate_size`` where given."""
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = 1
    if intermediate_size is not None:
        if not hasattr(cfg, "intermediate_size"):
            raise ValueError(f"eagle drafter: {type(target).__name__}'s layer has no MLP width to set")
        cfg.intermediate_size = int(intermediate_size)
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        cfg.layer_types = ["full_attention"]
    if hasattr(cfg, "use_sliding_window"):
        cfg.use_sliding_window = False
    return cfg


class EagleDrafter(nn.Module):
    """The feature drafter (see the module docstring).  ``bind(target)`` before use."""

    def __init__(self, target, vocab_ids, *, init_from_last_layer: bool = False, intermediate_size: int | None = None):
        super().__init__()
        if intermediate_size is not None and (int(intermediate_size) < 1 or init_from_last_layer):
            raise ValueError("eagle drafter: intermediate_size must be >= 1, and not given with init_from_last_layer")
        dec, emb, norm, head = _parts(target)
        V, H = _head_shape(head)
        ids = torch.as_tensor(vocab_ids, dtype=torch.long).flatten()
        if ids.numel() < 1 or ids.numel() > V:
            raise ValueError(f"eagle drafter: draft vocabulary has {ids.numel()} ids; need 1..{V}")
        if int(ids.min()) < 0 or int(ids.max()) >= V or torch.unique(ids).numel() != ids.numel():
            raise ValueError(f"eagle drafter: draft vocabulary ids must be distinct and lie in [0, {V})")
        self.vocab_size, self.hidden_size = V, H
        self.layer_config = _layer_config(target, intermediate_size)
        self.fc = nn.Linear(2 * H, H, bias=False)
        layer = copy.deepcopy(dec.layers[-1]) if init_from_last_layer else type(dec.layers[-1])(self.layer_config, 0)
        for mod in layer.modules():
            if hasattr(mod, "layer_idx"):
                mod.layer_idx = 0
            if hasattr(mod, "config"):
                mod.config = self.layer_config
            if hasattr(mod, "sliding_window"):
                mod.sliding_window = None
        self.layer = layer
        self.norm = copy.deepcopy(norm)
        self.rotary = copy.deepcopy(dec.rotary_emb)
        self.tail = nn.Linear(H, 1, bias=True)
        with torch.no_grad():
            # fc starts as "feature + a little token": the layer sees the target's feature scale.
            self.fc.weight.zero_()
            self.fc.weight[:, H:] = torch.eye(H)
            self.fc.weight[:, :H] = 0.1 * torch.eye(H)
            self.tail.weight.zero_()
            self.tail.bias.fill_(-4.0)
        self.register_buffer("vocab_ids", ids.clone(), persistent=True)
        self._target = None
        self._block_head = None  # run_from_blocks: the draft vocabulary's rows of the target's output blocks
        self.fingerprint = target_fingerprint(target)
        self.bind(target)

    # ------------------------------------------------------------------ target binding
    def bind(self, target) -> "EagleDrafter":
        """Attach the target (not a submodule: never saved, moved or trained with the drafter)."""
        fp = target_fingerprint(target)
        mine = self.fingerprint
        bad = [f"{k}: drafter {mine.get(k)!r} vs target {fp[k]!r}" for k in fp if mine.get(k) != fp[k]]
        if bad:
            raise ValueError("eagle drafter does not match this target (" + "; ".join(bad)
                             + "); train one for this target with `draftcert train-drafter`")
        object.__setattr__(self, "_target", target)
        self.__dict__.pop("_head_rows", None)
        self.__dict__.pop("_row_caches", None)  # _embed's rows were the previous target's
        if self._block_head is not None:
            object.__setattr__(self, "_block_head", self._head_blocks(self._block_head.numerics))
        return self

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the drafter computes in (its norm's: linears run from blocks have no float weight)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def intermediate_size(self) -> int | None:
        return getattr(self.layer_config, "intermediate_size", None)

    def block_linears(self) -> dict[str, nn.Module]:
        """The linears of ``fc`` and the decoder layer by their ``trainable_state`` names (without
        ``.weight``): those run from (and stored as) Q8_0 blocks; one whose input size is not a multiple
        of the block's 32 stays float."""
        out = {}
        for prefix, mod in (("fc", self.fc), ("layer", self.layer)):
            for name, m in ([("", mod)] if isinstance(mod, (nn.Linear, GGUFLinear)) else mod.named_modules()):
                if isinstance(m, (nn.Linear, GGUFLinear)) and m.in_features % 32 == 0:
                    out[prefix + ("." + name if name else "")] = m
        return out

    def _head_blocks(self, numerics: str):
        """A ``GGUFLinear`` of the draft vocabulary's rows of the target's output blocks, or None where
        the target's head is not one."""
        head = self.target.get_output_embeddings()
        if not isinstance(head, GGUFLinear):
            return None
        ids = self.vocab_ids.cpu()
        return GGUFLinear(head.qweight.cpu().index_select(0, ids), head.qtype, head.in_features, int(ids.numel()),
                          numerics=numerics)

    def run_from_blocks(self, numerics: str, stored: dict[str, torch.Tensor] | None = None) -> "EagleDrafter":
        """Compute as a GGUF target does (module docstring): each of ``block_linears`` becomes a
        ``GGUFLinear`` of Q8_0 blocks (``stored[name]`` where given, else its float weight quantised now)
        under ``numerics``, and the head the draft vocabulary's rows of the target's output blocks.
        For inference only (float32, CPU): the blocks are not trained."""
        if numerics not in CONTRACTS:
            raise ValueError(f"eagle drafter: numerics must be one of {', '.join(CONTRACTS)}, got {numerics!r}")
        if self.dtype != torch.float32 or self.device.type != "cpu":
            raise ValueError("eagle drafter: run_from_blocks needs a float32 drafter on the CPU")
        for name, lin in self.block_linears().items():
            if isinstance(lin, GGUFLinear):
                lin.set_numerics(numerics)
                continue
            blocks = stored[name] if stored is not None and name in stored else quantize_rows(lin.weight, DRAFTER_BLOCKS)
            new = GGUFLinear(blocks, DRAFTER_BLOCKS, lin.in_features, lin.out_features, bias=lin.bias, numerics=numerics)
            parent, _, attr = name.rpartition(".")
            setattr(self.get_submodule(parent) if parent else self, attr, new)
        group_siblings(self.layer)  # q/k/v and gate/up: one pass each, as the target's
        object.__setattr__(self, "_block_head", self._head_blocks(numerics))  # not a submodule: never saved
        self.requires_grad_(False)
        return self

    def head_layer(self):
        """What maps the drafter's feature to its draft-vocabulary logits: the target's output blocks'
        rows (``run_from_blocks``), else the float rows of ``head_weight``."""
        return self._block_head if self._block_head is not None else self.head_weight()

    @property
    def target(self):
        if self._target is None:
            raise ValueError("eagle drafter: no target bound; call drafter.bind(target)")
        return self._target

    def _embed(self, ids):
        """The target's embedding of ``ids`` (..., T) in the drafter's dtype.  Outside autograd, a
        decode's few-token steps read rows kept by ``feature_step.kept_rows`` (a GGUF embedding decodes its
        blocks on every call: 40-110 us a step, about a tenth of a drafted token on the embedded
        target); a row is the same bits either way (rows decode independently)."""
        emb = self.target.get_input_embeddings()
        if torch.is_grad_enabled() or ids.numel() > feature_step.ROW_CACHE_MAX_CALL:
            return emb(ids).to(self.dtype)
        kept, toks = feature_step.kept_rows(self, "embed", emb, self.norm.weight), ids.reshape(-1).tolist()
        rows = [kept[t] if t in kept else feature_step.keep(kept, t, emb(torch.tensor([t], device=ids.device)).to(self.dtype)[0])
                for t in toks]  # one token: a view of its kept row (read only: ``step`` concatenates it)
        return rows[0].view(*ids.shape, -1) if len(rows) == 1 else torch.stack(rows).reshape(*ids.shape, -1)

    def _rope(self, x, position_ids):
        """The rotary (cos, sin) of ``position_ids`` (1, T), as ``self.rotary`` computes them; outside autograd
        a few-position step reads each position's from ``feature_step.kept_rows`` (an element is computed from
        its own position alone, so a kept pair is the same bits)."""
        if torch.is_grad_enabled() or position_ids.shape[0] != 1 or position_ids.numel() > feature_step.ROW_CACHE_MAX_CALL:
            return self.rotary(x, position_ids=position_ids)
        return feature_step.kept_rotary(feature_step.kept_rows(self, "rope", x.dtype, self.norm.weight), self.rotary, x,
                                        position_ids)

    def head_weight(self):
        """The draft vocabulary's rows of the target's output layer (``[V_d, H]``, the drafter's
        dtype), gathered once per bound target, dtype and device: every decode starts from them, and
        a GGUF head's ``.weight`` is a full decode of its blocks (``weight_rows`` decodes just these)."""
        head = self.target.get_output_embeddings()
        key = (id(head), self.dtype, self.device)
        cached = self.__dict__.get("_head_rows")
        if cached is not None and cached[0] == key:
            return cached[1]
        rows = getattr(head, "weight_rows", None)
        if rows is not None:
            w = rows(self.vocab_ids)
        else:
            w = head.weight
            w = w.index_select(0, self.vocab_ids.to(w.device))
        w = w.to(self.dtype)
        self.__dict__["_head_rows"] = (key, w)
        return w

    @property
    def config(self):
        """What vocabulary checks read (``config.vocab_size``), as for a causal LM."""
        return SimpleNamespace(vocab_size=self.vocab_size, hidden_size=self.hidden_size, _name_or_path=getattr(self, "draftcert_spec", "eagle"))

    def get_output_embeddings(self):
        """The target's LM head: the drafter's logits live on the target's full vocabulary."""
        return self.target.get_output_embeddings()

    @property
    def n_draft_vocab(self) -> int:
        return int(self.vocab_ids.numel())

    # ------------------------------------------------------------------ compute
    def step(self, tokens, feats, position_ids, mask, cache=None, head_weight=None, last_only: bool = False):
        """One drafting step for rows (B, T): returns (feature g (B,T,H), reduced logits (B,T,V_d), tail (B,T)).

        ``mask`` is an additive 4-D attention mask (B or 1, 1, T, cached + T) over the cache; None: causal.
        ``head_weight``: the float rows ``[V_d, H]`` or a layer (``head_layer``); default ``head_layer()``.
        ``last_only``: every row goes through the layer (and into the cache), but g, the logits and
        the tail are computed for the last row only (T = 1 in the results): a decode's catch-up step
        over the pairs of many plain rounds drafts from its last row alone.
        """
        w = self.head_layer() if head_weight is None else head_weight
        e = self._embed(tokens)
        plan = None if torch.is_grad_enabled() else self.native_plan(w)  # gguf-q8 blocks: one native call
        out = plan and feature_step.step(plan, e, feats.to(self.dtype), self._rope(e, position_ids), mask, cache, last_only)
        if out:
            return out
        if mask is None and tokens.shape[-1] > 1:  # causal over the cache, as the native step reads None
            mask = feature_step.causal_mask(tokens.shape[-1], cache.get_seq_length(0) if cache is not None else 0, self.dtype)
        x = self.fc(torch.cat([e, feats.to(self.dtype)], -1))
        pe = self._rope(x, position_ids)
        kw = {cache_kwarg(self.layer): cache, "use_cache": True} if cache is not None else {}
        x = self.layer(x, attention_mask=mask, position_ids=position_ids, position_embeddings=pe, **kw)
        if isinstance(x, tuple):
            x = x[0]
        if last_only:
            x = x[:, -1:]
        g = self.norm(x)
        red = g @ w.T if isinstance(w, torch.Tensor) else w(g)
        return g, red, self.capped_tail(red, self.tail(g).squeeze(-1))

    def native_plan(self, head):
        """``forward.feature_step``'s plan of a step with ``head`` (one native call), None unless it is ``head_layer``'s blocks."""
        return None if head is not self._block_head else feature_step.plan_of(
            self, fc=self.fc, layer=self.layer, norm=self.norm, head=head, tail=self.tail, vocab_size=self.vocab_size,
            width=PROPOSAL_WIDTH, vocab_ids=self.vocab_ids)

    def capped_tail(self, red, tail):
        """``min(tail, z_(w) + log(V - V_d) - margin)`` (module docstring): no token outside the draft
        vocabulary reaches the top ``PROPOSAL_WIDTH`` of q.  ``red`` (..., V_d), ``tail`` (...)."""
        V, Vd = self.vocab_size, self.n_draft_vocab
        if Vd == V:
            return tail
        floor = red.topk(min(PROPOSAL_WIDTH, Vd), dim=-1).values[..., -1]
        spread = math.log(V - Vd)
        # a margin of 8 ulps of the largest magnitude involved survives the later ``tail - log(V - V_d)``
        margin = 8 * torch.finfo(red.dtype).eps * (1 + floor.detach().abs() + spread)
        return torch.minimum(tail, (floor + spread - margin).to(tail.dtype))

    def full_logits(self, reduced, tail):
        """Full-vocabulary logits (..., V): out-of-vocabulary tokens share the tail mass equally."""
        V, Vd = self.vocab_size, self.n_draft_vocab
        if Vd == V:
            out = torch.empty(*reduced.shape[:-1], V, dtype=reduced.dtype, device=reduced.device)
            out[..., self.vocab_ids] = reduced
            return out
        fill = tail - math.log(V - Vd)
        if reduced.device.type == "cpu" and reduced.dtype == fill.dtype == torch.float32 and not (
                torch.is_grad_enabled() and (reduced.requires_grad or fill.requires_grad)):  # numpy: a third of the time
            out = torch.empty(*reduced.shape[:-1], V).numpy()
            out[...] = fill.numpy()[..., None]
            out[..., self.vocab_ids.cpu().numpy()] = reduced.numpy()
            return torch.from_numpy(out)
        out = fill.unsqueeze(-1).expand(*reduced.shape[:-1], V).clone()
        out[..., self.vocab_ids] = reduced
        return out

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False, logits_to_keep=0, **_):
        """Teacher-forced scoring, the interface of a causal LM (used by ``draftcert profile``).

        Row t of the logits predicts token t + 1 from the target's feature at t - 1 and token t
        (the feature drafter's one-step prediction); row 0 has no feature before it and is uniform.
        Returns an object with ``.logits`` (B, T or logits_to_keep, V).
        """
        B, T = input_ids.shape
        with torch.no_grad():
            f = target_hidden(self.target, input_ids, attention_mask, position_ids)
        dt = self.dtype
        keyok = torch.ones(B, T, dtype=torch.bool, device=input_ids.device) if attention_mask is None else attention_mask.bool()
        causal = torch.ones(T - 1, T - 1, dtype=torch.bool, device=input_ids.device).tril()
        # pair row s = (token s + 1, feature s) is real iff both are: with left padding, iff token s is
        # (the first real token's pair would carry a padded position's feature)
        allowed = causal[None] & keyok[:, None, :-1] & keyok[:, None, 1:]
        allowed |= torch.eye(T - 1, dtype=torch.bool, device=input_ids.device)[None]  # pad rows see themselves
        mask = torch.zeros(B, 1, T - 1, T - 1, dtype=dt, device=input_ids.device)
        mask.masked_fill_(~allowed[:, None], torch.finfo(dt).min)
        pos = position_ids[:, :-1] if position_ids is not None else torch.arange(T - 1, device=input_ids.device)[None].expand(B, -1)
        _, red, tail = self.step(input_ids[:, 1:], f[:, :-1], pos, mask)
        logits = torch.zeros(B, T, self.vocab_size, dtype=dt, device=input_ids.device)
        logits[:, 1:] = self.full_logits(red, tail)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return SimpleNamespace(logits=logits)

    def new_cache(self):
        """An empty KV cache for the drafter's one layer."""
        return new_cache(config=self.layer_config)

    # ------------------------------------------------------------------ what is saved
    def trainable_state(self) -> dict[str, torch.Tensor]:
        sd = {}
        for prefix, mod in (("fc.", self.fc), ("layer.", self.layer), ("norm.", self.norm), ("tail.", self.tail)):
            for k, v in mod.state_dict().items():
                sd[prefix + k] = v
        sd["vocab_ids"] = self.vocab_ids
        return sd


# Drafters shipped inside the package (models/weights/), by name: ``eagle:NAME``.
PACKAGED = {"smollm2-135m-instruct": "smollm2-135m-instruct.safetensors",
            "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b/drafter.safetensors"}  # the pair's target (models/pair.py)


def packaged_path(name: str) -> Path:
    if name not in PACKAGED:
        raise ValueError(f"drafter 'eagle:{name}': no such packaged drafter (known: {', '.join(sorted(PACKAGED))})")
    return Path(str(files("draftcert.models") / "weights" / PACKAGED[name]))


def resolve_spec(spec) -> Path | None:
    """The weights file of an ``eagle:NAME`` spec or a path to a drafter file/directory, else None."""
    s = str(spec)
    if s.startswith("eagle:"):
        return packaged_path(s[len("eagle:") :])
    return Path(s).expanduser() if is_eagle_path(s) else None


def is_eagle_path(spec) -> bool:
    p = Path(str(spec)).expanduser()
    if p.is_dir():
        return (p / WEIGHTS_NAME).is_file()
    return p.suffix == ".safetensors"


def save_eagle(drafter: EagleDrafter, path, *, dtype=torch.float16, extra: dict | None = None,
               blocks: bool = False) -> Path:
    """Write the drafter atomically as safetensors (``dtype`` for float tensors); returns the file.

    ``blocks``: the weights of ``block_linears`` as Q8_0 blocks (uint8 ``[out, in / 32 * 34]``, listed in
    the metadata's ``blocks``), what a GGUF target's drafter computes from: about half the bytes of
    float16.  A drafter trained in float is quantised here."""
    from safetensors.torch import save_file  # optional: models extra

    path = Path(path)
    if path.suffix != ".safetensors":
        path.mkdir(parents=True, exist_ok=True)
        path = path / WEIGHTS_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = {}
    for k, v in drafter.trainable_state().items():
        v = v.detach().cpu()
        sd[k] = (v.to(dtype) if v.is_floating_point() and dtype is not None else v).contiguous()
    as_blocks = {}
    for name, lin in drafter.block_linears().items():
        if isinstance(lin, GGUFLinear):  # run from blocks: its blocks, or their values as floats
            sd.pop(name + ".qweight", None)
            sd[name + ".weight"] = lin.qweight.cpu().contiguous() if blocks else lin.dequantized().to(dtype or torch.float32)
        elif blocks:
            sd[name + ".weight"] = quantize_rows(lin.weight, DRAFTER_BLOCKS)
        if blocks:
            as_blocks[name + ".weight"] = DRAFTER_BLOCKS
    meta = {
        "format": FORMAT,
        "fingerprint": json.dumps(drafter.fingerprint, sort_keys=True),
        "n_draft_vocab": str(drafter.n_draft_vocab),
        "intermediate_size": json.dumps(drafter.intermediate_size),
        "blocks": json.dumps(as_blocks, sort_keys=True),
        "extra": json.dumps(getattr(drafter, "extra", {}) if extra is None else extra, sort_keys=True),
    }
    with atomic_path(path) as tmp:
        save_file(sd, str(tmp), metadata=meta)
    return path


def load_eagle(path, target, *, dtype=torch.float32) -> EagleDrafter:
    """Load a drafter file (or a directory holding ``drafter.safetensors``) for ``target``.

    Raises ValueError (before any decoding) for a missing/corrupt file, a file of another format,
    or a drafter trained for a different target (architecture, sizes, vocabulary or weights).
    On a target computed from GGUF blocks, a float32 drafter runs from blocks too
    (``EagleDrafter.run_from_blocks``: the file's own blocks where it stores them).
    """
    from safetensors import safe_open  # optional: models extra

    p = resolve_spec(path) or Path(str(path)).expanduser()
    if p.is_dir():
        p = p / WEIGHTS_NAME
    if not p.is_file():
        raise ValueError(f"eagle drafter: no such file {str(p)!r}")
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            sd = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for truncated/garbled files
        raise ValueError(f"eagle drafter: {str(p)!r} is not a readable safetensors file ({exc}); "
                         "re-download or retrain it") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"eagle drafter: {str(p)!r} has format {meta.get('format')!r}, expected {FORMAT!r}")
    try:
        fp = json.loads(meta["fingerprint"])
    except (KeyError, ValueError):
        raise ValueError(f"eagle drafter: {str(p)!r} has no valid target fingerprint") from None
    mine = target_fingerprint(target)
    bad = [f"{k}: file {fp.get(k)!r} vs target {mine[k]!r}" for k in mine if fp.get(k) != mine[k]]
    if bad:
        raise ValueError(f"eagle drafter {str(p)!r} was trained for another target (" + "; ".join(bad) + ")")
    if "vocab_ids" not in sd:
        raise ValueError(f"eagle drafter: {str(p)!r} lacks vocab_ids")
    try:
        width = json.loads(meta.get("intermediate_size", "null"))
        stored_blocks = json.loads(meta.get("blocks", "{}"))
    except ValueError:
        raise ValueError(f"eagle drafter: {str(p)!r} has unreadable metadata (intermediate_size, blocks)") from None
    if width is not None and width == getattr(target.config, "intermediate_size", None):
        width = None  # the target's own width
    d = EagleDrafter(target, sd["vocab_ids"], intermediate_size=width)
    state = {k: v for k, v in sd.items() if k != "vocab_ids"}
    linears = d.block_linears()
    blocks = {}
    for k, qtype in stored_blocks.items():
        name = k.removesuffix(".weight")
        if name not in linears or qtype != DRAFTER_BLOCKS or k not in state or state[k].dtype != torch.uint8:
            raise ValueError(f"eagle drafter {str(p)!r}: stored blocks {k!r} do not fit the drafter's layer")
        lin = linears[name]
        check_blocks(f"eagle drafter {str(p)!r}: stored {k!r}", state[k], DRAFTER_BLOCKS, lin.out_features, lin.in_features)
        blocks[name] = state[k]
        state[k] = decode_rows(state[k], DRAFTER_BLOCKS, lin.in_features)
    expected = {k: v for k, v in d.trainable_state().items() if k != "vocab_ids"}
    missing, unexpected = set(expected) - set(state), set(state) - set(expected)
    wrong = [k for k in set(expected) & set(state) if tuple(expected[k].shape) != tuple(state[k].shape)]
    if missing or unexpected or wrong:
        raise ValueError(f"eagle drafter {str(p)!r}: tensors do not fit the target's layer "
                         f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}, wrong shape {wrong[:3]})")
    for k, v in state.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise ValueError(f"eagle drafter {str(p)!r}: tensor {k} has non-finite values (corrupt file)")
    with torch.no_grad():
        for k, v in d.trainable_state().items():
            if k != "vocab_ids":
                v.copy_(state[k].to(v.dtype))
    d.to(dtype)
    d.eval()
    d.requires_grad_(False)
    numerics = numerics_of(target)
    if numerics in CONTRACTS and dtype == torch.float32 and d.device.type == "cpu":
        d.run_from_blocks(numerics, blocks)
    use_lean_layers(d)  # its decoder layer written out, as the target's: the same bits (forward/decoder_layers.py)
    d.draftcert_spec = str(path)
    try:
        d.extra = json.loads(meta.get("extra", "{}"))
    except ValueError:
        d.extra = {}
    return d
