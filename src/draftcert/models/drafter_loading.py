"""Drafters: derived from the target ("self:...") or loaded separately, and compatibility checks.

Derived drafters are deep copies of the target that share no parameter, buffer or config with it:

``self:skip=L[,L2,...]``  drop decoder layers (layer skipping / "self-speculative" drafting).
    Ranges ``a-b`` (inclusive) are allowed: ``self:skip=12-17``.  The remaining layers are
    renumbered so each attention module's ``layer_idx`` (its slot in the KV cache) is its new
    position, and ``config.num_hidden_layers`` / ``config.layer_types`` are shortened to match,
    so ``generate()`` with a KV cache behaves exactly like a no-cache forward of the smaller net.
    Cost per token: (n_layers - skipped) / n_layers of the target's decoder compute.

``self:quant=B[,group=G]``  round-to-nearest (RTN) B-bit requantisation of every nn.Linear weight
    inside the decoder layers (attention q/k/v/o and MLP projections).  Asymmetric min/max affine
    grid, per output channel (each row of W gets its own scale and zero point) by default, or per
    group of G consecutive input weights with ``group=G``:

        s = (max(w) - min(w)) / (2^B - 1),   w_hat = s * round((w - min(w)) / s) + min(w)

    lm_head / embeddings stay untouched (tied in SmolLM2; the usual RTN baseline keeps them).
    Weights are stored dequantised in the original dtype: the drafter is as expensive as the
    target on CPU; it models "the same network at lower precision".

Combos ``self:skip=15,quant=4`` apply the skip first, then the requantisation.

Anything else is a separate model (hub id or local path, via ``load_target``) and must pass
``check_compatible`` with the target before it is used.  ``NAME@q4_1`` (``@q5_0``, ``@q8_0``) loads a
GGUF-sourced model drafter with its linear layers recomputed as those blocks (``gguf.requantize``).

Drafter spec strings are the same everywhere (``--drafter`` of every subcommand, ``load_drafter``,
``decode.make_drafter``, ``speculative_generate``): ``parse_drafter_spec`` is the one resolver.
``default`` is ``DEFAULT_DRAFTER``; ``prompt-lookup[:N]`` (alias ``pld``) is the n-gram drafter,
which has no model (``drafting.make`` builds it); ``suffix`` drafts suffix-match candidates (no model)
and ``DRAFTER+suffix`` adds them to DRAFTER's tree (``drafting.suffix`` builds both).
"""

from __future__ import annotations

import copy
import hashlib
import os
import re
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .eagle import load_eagle, resolve_spec
from .hf import output_rows, parse_dtype
from .loading import load_target
from .tokenizer_fit import fit_drafter
from ..gguf.layers import GGUFLinear
from ..gguf.requantize import requant_type, requantize_linears

# self:skip=5 was chosen with benchmarks/bench_drafters.py (embedded target, 640 MT-Bench positions): about 80 %
# teacher-forced argmax agreement at 29 of 30 layers (results: benchmarks/results/bench_drafters_smollm2_135m.txt).
# The default is the trained feature drafter of models/weights/ (a few percent of the target per drafted token).
SKIP_DRAFTER = "self:skip=5"
DEFAULT_DRAFTER = "eagle:smollm2-135m-instruct"


PROMPT_LOOKUP = "prompt-lookup"
_PROMPT_LOOKUP_NAMES = (PROMPT_LOOKUP, "pld")
SUFFIX = "suffix"  # suffix-match candidates (drafting.suffix): alone, or "DRAFTER+suffix" in the drafter's tree
_PLUS_SUFFIX = "+" + SUFFIX


@dataclass(frozen=True)
class DrafterSpec:
    """A resolved drafter spec string.

    ``spec`` is canonical (``default`` -> ``DEFAULT_DRAFTER``, ``pld`` -> ``prompt-lookup``, a
    path as a string); ``kind`` is ``"self"`` (derived from the target), ``"feature"`` (an
    EAGLE-style drafter file, ``eagle:NAME``), ``"prompt-lookup"`` (no model; ``max_ngram`` is
    its N, None for the default), ``"suffix"`` (suffix-match candidates, no model) or ``"model"``
    (a hub id or checkpoint directory).  ``DRAFTER+suffix`` has DRAFTER's kind with ``suffix``
    True: the drafter's tree plus suffix-match candidates; ``model_spec`` is DRAFTER alone.
    """

    spec: str
    kind: str
    max_ngram: int | None = None
    suffix: bool = False
    blocks: str | None = None  # NAME@TYPE: the model's linear layers recomputed as TYPE blocks

    @property
    def model_spec(self) -> str:
        """The spec of the drafter alone (without ``+suffix``)."""
        return self.spec[: -len(_PLUS_SUFFIX)] if self.suffix else self.spec

    @property
    def source(self) -> str:
        """The model it is loaded from: ``model_spec`` without ``@TYPE``."""
        return self.model_spec[: -len(self.blocks) - 1] if self.blocks else self.model_spec


def parse_drafter_spec(spec) -> DrafterSpec:
    """Resolve what a user wrote as a drafter (a string or a path) before any model loads.

    Raises ValueError on a malformed ``self:`` or ``prompt-lookup:`` spec, an unknown
    ``eagle:NAME`` and an empty spec; a hub id or path is only checked when it is loaded.
    """
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("drafter spec must be 'default', 'self:...', 'prompt-lookup', 'eagle:NAME', a local path "
                         f"or a hub id, got {spec!r}")
    spec = spec.strip()
    if spec.endswith(_PLUS_SUFFIX):
        base = parse_drafter_spec(spec[: -len(_PLUS_SUFFIX)])
        if base.kind in ("prompt-lookup", SUFFIX) or base.suffix:
            raise ValueError(f"drafter spec {spec!r}: '+suffix' joins a drafter with a model (e.g. 'default+suffix'); "
                             f"use 'suffix' alone for model-free drafting")
        return DrafterSpec(base.spec + _PLUS_SUFFIX, base.kind, base.max_ngram, suffix=True, blocks=base.blocks)
    name, at, blocks = spec.rpartition("@")
    if at and re.fullmatch(r"[qQ]\d+_[0-9a-zA-Z]+", blocks):  # NAME@q4_1: requant_type refuses other types
        base = parse_drafter_spec(name)
        if base.kind != "model" or base.suffix:
            raise ValueError(f"drafter spec {spec!r}: @{blocks} recomputes a separately loaded model drafter's "
                             f"layers (e.g. qwen2.5-coder-0.5b@q4_1), not a {base.kind} drafter's")
        requant_type(blocks, f"drafter spec {spec!r}")
        return DrafterSpec(f"{base.spec}@{blocks.lower()}", "model", blocks=blocks.lower())
    if spec == SUFFIX:
        return DrafterSpec(SUFFIX, SUFFIX)
    if spec == "default":
        spec = DEFAULT_DRAFTER
    name, sep, arg = spec.partition(":")
    if name in _PROMPT_LOOKUP_NAMES:
        if not sep:
            return DrafterSpec(PROMPT_LOOKUP, "prompt-lookup")
        if not arg.isdigit() or int(arg) < 1:
            raise ValueError(f"drafter spec {spec!r}: prompt-lookup:N takes the longest n-gram N >= 1, got {arg!r}")
        return DrafterSpec(f"{PROMPT_LOOKUP}:{int(arg)}", "prompt-lookup", int(arg))
    if spec == "self":
        raise ValueError("drafter spec 'self' needs options, e.g. 'self:skip=15' or 'self:quant=4'")
    if name == "self":
        parse_self_spec(spec)  # a malformed spec fails here, before the target loads
        return DrafterSpec(spec, "self")
    if resolve_spec(spec) is not None:  # eagle:NAME (ValueError if unknown), a .safetensors file or its directory
        return DrafterSpec(spec, "feature")
    return DrafterSpec(spec, "model")


@dataclass(frozen=True)
class SelfDrafterSpec:
    skip: tuple[int, ...] = ()
    quant_bits: int | None = None
    quant_group: int = 0  # 0 = per output channel
    spec: str = field(default="", compare=False)


def parse_self_spec(spec: str) -> SelfDrafterSpec:
    """Parse ``self:skip=10,11,quant=4,group=32`` (bare integers continue the skip list)."""
    if not isinstance(spec, str) or not spec.startswith("self:"):
        raise ValueError(f"drafter spec {spec!r} is not a 'self:...' spec")
    body = spec[len("self:") :].replace(" ", "")
    if not body:
        raise ValueError("drafter spec 'self:' is empty; use e.g. 'self:skip=15' or 'self:quant=4'")
    skip: list[int] = []
    bits = None
    group = 0
    key = None
    for item in body.split(","):
        if "=" in item:
            key, _, val = item.partition("=")
        else:
            val = item
        if key is None or val == "":
            raise ValueError(f"drafter spec {spec!r}: cannot parse {item!r}")
        if key == "skip":
            m = re.fullmatch(r"(\d+)(?:-(\d+))?", val)
            if not m:
                raise ValueError(f"drafter spec {spec!r}: skip takes layer indices or ranges a-b, got {val!r}")
            lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
            if hi < lo:
                raise ValueError(f"drafter spec {spec!r}: empty layer range {val!r}")
            skip.extend(range(lo, hi + 1))
        elif key in ("quant", "group"):
            if not val.isdigit():
                raise ValueError(f"drafter spec {spec!r}: {key} takes a positive integer, got {val!r}")
            if key == "quant":
                bits = int(val)
                if not 1 <= bits <= 16:
                    raise ValueError(f"drafter spec {spec!r}: quant bits must be in 1..16, got {bits}")
            else:
                group = int(val)
            key = None  # bare integers after quant/group are errors
        else:
            raise ValueError(f"drafter spec {spec!r}: unknown option {key!r} (known: skip, quant, group)")
    if len(set(skip)) != len(skip):
        raise ValueError(f"drafter spec {spec!r}: a layer is listed twice")
    if group and bits is None:
        raise ValueError(f"drafter spec {spec!r}: group= needs quant=")
    return SelfDrafterSpec(skip=tuple(sorted(skip)), quant_bits=bits, quant_group=group, spec=spec)


def _decoder_layers(model):
    """The nn.ModuleList of decoder layers (Llama/Qwen/Mistral-style ``model.model.layers``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(
            f"cannot derive a self drafter from {type(model).__name__}: expected decoder layers at "
            "model.model.layers (Llama/Qwen-style); pass a separate drafter model instead"
        )
    return layers


def skip_layers(model, layers_to_skip) -> None:
    """In place: remove decoder layers and renumber the survivors' KV-cache slots."""
    layers = _decoder_layers(model)
    n = len(layers)
    bad = [i for i in layers_to_skip if not 0 <= i < n]
    if bad:
        raise ValueError(f"skip layers {bad} out of range: the model has layers 0..{n - 1}")
    drop = set(layers_to_skip)
    if len(drop) >= n:
        raise ValueError(f"cannot skip all {n} decoder layers")
    keep = [i for i in range(n) if i not in drop]
    model.model.layers = nn.ModuleList([layers[i] for i in keep])
    for new_idx, layer in enumerate(model.model.layers):
        # Attention modules index the KV cache by layer_idx; after removal they must be dense
        # 0..n_kept-1 or the cache built from config.num_hidden_layers would be misindexed.
        for mod in layer.modules():
            if hasattr(mod, "layer_idx"):
                mod.layer_idx = new_idx
    for cfg in {id(c): c for c in (model.config, getattr(model.model, "config", model.config))}.values():
        types = getattr(cfg, "layer_types", None)
        if types is not None and len(types) == n:
            cfg.layer_types = [types[i] for i in keep]
        cfg.num_hidden_layers = len(keep)


def quantize_rtn_(weight, bits: int, group: int = 0) -> None:
    """In place RTN requantisation of a 2-D weight (out, in): asymmetric min/max grid.

    Per output channel if ``group == 0``, else per ``group`` consecutive input columns
    (``in`` must be divisible by ``group``).  Computed in float32, written back in w's dtype.
    """
    out_f, in_f = weight.shape
    g = in_f if group == 0 else group
    if in_f % g:
        raise ValueError(f"quant group {group} does not divide the input size {in_f}")
    w = weight.detach().to(torch.float32).reshape(out_f, in_f // g, g)
    lo = w.amin(dim=-1, keepdim=True)
    hi = w.amax(dim=-1, keepdim=True)
    levels = (1 << bits) - 1
    scale = (hi - lo) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant rows stay exact
    q = torch.clamp(torch.round((w - lo) / scale), 0, levels)
    w_hat = q * scale + lo
    with torch.no_grad():
        weight.copy_(w_hat.reshape(out_f, in_f).to(weight.dtype))


def quantize_linears(model, bits: int, group: int = 0) -> int:
    """RTN-requantise every nn.Linear inside the decoder layers (a GGUF layer first becomes the
    nn.Linear of its float32 weights: the blocks themselves stay the target's); returns how many."""
    count = 0
    for layer in _decoder_layers(model):
        for name, mod in list(layer.named_modules()):
            if isinstance(mod, GGUFLinear):
                parent, _, attr = name.rpartition(".")
                setattr(layer.get_submodule(parent) if parent else layer, attr, mod.to_linear())
        for mod in layer.modules():
            if isinstance(mod, nn.Linear):
                quantize_rtn_(mod.weight, bits, group)
                count += 1
    return count


def derive_drafter(target, spec: str):
    """A ``self:...`` drafter: a deep copy of ``target`` with the spec's modifications."""
    parsed = parse_self_spec(spec)
    # deepcopy copies parameters, buffers and the config object (tied weights stay tied within
    # the copy), so editing the drafter can never change the target.
    drafter = copy.deepcopy(target)
    if parsed.skip:
        skip_layers(drafter, parsed.skip)
    if parsed.quant_bits is not None:
        quantize_linears(drafter, parsed.quant_bits, parsed.quant_group)
    drafter.eval()
    drafter.requires_grad_(False)
    drafter.draftcert_spec = spec
    return drafter


def _vocab_digest(tokenizer) -> str:
    vocab = tokenizer.get_vocab()
    h = hashlib.sha256()
    for tok, idx in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{tok}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def check_compatible(target_model, target_tok, drafter_model, drafter_tok=None) -> None:
    """Raise ValueError unless target and drafter share one vocabulary (before any compute).

    Compared: config.vocab_size, the output layer's row count (logit dimension), and, when the
    drafter brings its own tokenizer, len(tokenizer) and the full token->id map (by a sha256 of
    the sorted vocabulary).  Speculative decoding compares p and q index by index, so any
    mismatch would silently compare unrelated tokens.
    """
    problems = []
    tv = getattr(getattr(target_model, "config", None), "vocab_size", None)
    dv = getattr(getattr(drafter_model, "config", None), "vocab_size", None)
    if tv != dv:
        problems.append(f"config.vocab_size {tv} (target) vs {dv} (drafter)")
    to, do = output_rows(target_model), output_rows(drafter_model)
    if to != do:
        problems.append(f"output layer rows {to} (target) vs {do} (drafter)")
    if drafter_tok is not None and target_tok is not None and drafter_tok is not target_tok:
        if len(target_tok) != len(drafter_tok):
            problems.append(f"len(tokenizer) {len(target_tok)} (target) vs {len(drafter_tok)} (drafter)")
        elif _vocab_digest(target_tok) != _vocab_digest(drafter_tok):
            problems.append("tokenizers map tokens to ids differently (get_vocab() differs)")
    if problems:
        raise ValueError(
            "drafter is incompatible with the target: " + "; ".join(problems)
            + ". A drafter must use exactly the target's tokenizer and vocabulary."
        )


def load_drafter(spec, target, tokenizer, *, device="cpu", dtype=None):
    """The drafter model for ``spec`` (``default``, ``self:...`` derived from ``target``,
    ``eagle:NAME`` or a feature-drafter file, or a hub id / path; see ``parse_drafter_spec``).

    A separately loaded drafter is compared with ``target`` and ``tokenizer`` (``tokenizer_fit.fit_drafter``:
    vocabulary, probe ids, special tokens, output rows; padding rows fitted) and ``check_compatible``,
    and rejected (ValueError) before it is used.  ``prompt-lookup`` has no model:
    pass that spec to ``decode.speculative_generate`` or ``decode.make_drafter`` instead.
    """
    parsed = parse_drafter_spec(spec)
    torch_dtype = parse_dtype(dtype)
    if parsed.kind == "prompt-lookup":
        raise ValueError(f"drafter spec {parsed.spec!r} is the n-gram drafter and has no model to load; pass the "
                         "string to draftcert.decode.speculative_generate (or decode.make_drafter) instead")
    if parsed.kind == SUFFIX or parsed.suffix:
        raise ValueError(f"drafter spec {parsed.spec!r} drafts suffix-match candidates, which need the decoding loop; "
                         "pass the string to draftcert.decode.speculative_generate (or decode.make_drafter) instead")
    if parsed.kind == "self":
        drafter = derive_drafter(target, parsed.spec)
        if torch_dtype is not None:
            drafter.to(torch_dtype)
        return drafter.to(device)
    if parsed.kind == "feature":
        head_dtype = target.get_output_embeddings().weight.dtype
        return load_eagle(parsed.spec, target, dtype=head_dtype if torch_dtype is None else torch_dtype).to(device)
    drafter, dtok = load_target(parsed.source, device=device, dtype=dtype, role="drafter")
    if parsed.blocks:
        requantize_linears(drafter, parsed.blocks, who="drafter")
    fit_drafter(target, tokenizer, drafter, dtok)  # tokenizers compared, padding rows fitted (models/tokenizer_fit.py)
    check_compatible(target, tokenizer, drafter, dtok)
    return drafter
