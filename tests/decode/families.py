"""Tiny random decoder-only models, one per transformers family, for the family test matrix.

Built in code from each family's ``Config`` class (no download).  Every model is float32, has
3 decoder layers (more only where a family needs them to show its layer mix), hidden size 64
(or the nearest the family allows), vocab 128, ``max_position_embeddings >= 256``; sliding and
local windows are 8 so that short tests cross them.  Token ids: pad 0, eos 1, bos 2.

    from .families import build, FAMILIES, KIND, MISSING   # inside tests/decode
    model = build("qwen3_5", seed=0)                         # eval(), float32, weights re-drawn
    model = build("mixtral", dtype=torch.float64)            # float64 (MoE experts set to eager)
    FAMILIES["mistral"]()                                     # the PretrainedConfig alone

``KIND[name]`` is one of "full", "sliding", "hybrid", "recurrent", "alibi", "local":
"sliding" has sliding-window attention layers (a window of 8), "hybrid" mixes recurrent /
linear-attention / convolution layers with attention layers, "recurrent" has no attention
layer at all, "alibi" takes positions from the key column (ignores ``position_ids``), "local"
is GPT-Neo's local-window layers (``attention_types``; no ``sliding_window`` in its config).

Weights: random init at std 0.02 gives near-uniform logits, so greedy argmaxes flip on
rounding.  ``build`` re-draws every ``nn.Linear`` weight at std 0.15 and the embeddings (and
an untied lm_head) at std 0.5, from a generator seeded with ``seed``: the greedy steps then
have clear top-2 margins, and attention / recurrent state matter to the output (a model
dominated by its embeddings would be a bigram model and hide cache bugs).

Names beyond the model types: "qwen2_sliding" (Qwen2 with ``use_sliding_window`` and a
sliding/full layer mix; "qwen2" has no window), "falcon_alibi" ("falcon" is rotary).
RecurrentGemma is "hybrid" and its attention layer is local (``attention_window_size=8``, a
DynamicSlidingWindowLayer in the cache).  Jamba, Nemotron-H and Kimi-Linear attention has no
positional encoding, so those models ignore ``position_ids`` without being "alibi"; MPT and
Bloom take no ``position_ids`` at all, Falcon-ALiBi takes and ignores them.

``MISSING`` names the families that the installed transformers lacks, with the reason.
This module has no pytest dependency and imports as ``families`` when tests/decode is on
``sys.path`` as well as ``tests.decode.families``.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Callable

import torch

VOCAB = 128
HIDDEN = 64
PAD, EOS, BOS = 0, 1, 2
WINDOW = 8
MAX_POS = 512

_COMMON = dict(
    vocab_size=VOCAB,
    pad_token_id=PAD,
    eos_token_id=EOS,
    bos_token_id=BOS,
    tie_word_embeddings=False,
    use_cache=True,
)

# name -> (config class name, kwargs, kind, ForCausalLM class name or None for the auto class)
_SPECS: "OrderedDict[str, tuple[str, dict, str, str | None]]" = OrderedDict()


def _llama_like(**extra):
    kw = dict(
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=MAX_POS,
        initializer_range=0.02,
    )
    kw.update(extra)
    return kw


def _spec(name, config_cls, kind, causal_lm=None, **kw):
    _SPECS[name] = (config_cls, kw, kind, causal_lm)


_SW3 = ["sliding_attention", "full_attention", "sliding_attention"]

# --- full attention ------------------------------------------------------------------------
_spec("llama", "LlamaConfig", "full", **_llama_like())
_spec("qwen2", "Qwen2Config", "full", **_llama_like(use_sliding_window=False))
_spec("qwen3", "Qwen3Config", "full", **_llama_like())
_spec("gemma", "GemmaConfig", "full", **_llama_like())
_spec("phi3", "Phi3Config", "full", **_llama_like(pad_token_id=PAD))
_spec("gpt2", "GPT2Config", "full", n_embd=HIDDEN, n_layer=3, n_head=4, n_inner=128, n_positions=MAX_POS)
_spec(
    "gpt_neox", "GPTNeoXConfig", "full",
    hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    max_position_embeddings=MAX_POS,
)
_spec(
    "opt", "OPTConfig", "full",
    hidden_size=HIDDEN, ffn_dim=128, num_hidden_layers=3, num_attention_heads=4,
    word_embed_proj_dim=HIDDEN, max_position_embeddings=MAX_POS,
)
_spec(
    "falcon", "FalconConfig", "full",
    hidden_size=HIDDEN, num_hidden_layers=3, num_attention_heads=4, num_kv_heads=2,
    new_decoder_architecture=True, alibi=False, max_position_embeddings=MAX_POS,
)
_spec("olmo2", "Olmo2Config", "full", **_llama_like())
_spec(
    "mixtral", "MixtralConfig", "full",
    **_llama_like(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
)
_spec(
    "qwen3_moe", "Qwen3MoeConfig", "full",
    **_llama_like(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1),
)
_spec(
    "deepseek_v3", "DeepseekV3Config", "full",
    **_llama_like(
        num_key_value_heads=4, head_dim=8,
        moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    ),
)

# --- sliding window --------------------------------------------------------------------------
_spec("mistral", "MistralConfig", "sliding", **_llama_like(sliding_window=WINDOW))
_spec(
    "qwen2_sliding", "Qwen2Config", "sliding",
    **_llama_like(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=3, layer_types=_SW3),
)
_spec("gemma2", "Gemma2Config", "sliding", **_llama_like(sliding_window=WINDOW, layer_types=_SW3))
_spec(
    "gemma3", "Gemma3TextConfig", "sliding", "Gemma3ForCausalLM",
    **_llama_like(sliding_window=WINDOW, layer_types=_SW3),
)
_spec(
    "gemma4", "Gemma4TextConfig", "sliding", "Gemma4ForCausalLM",
    **_llama_like(
        # Gemma4 forces its last layer to full attention
        sliding_window=WINDOW, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        per_layer_config={},
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,
    ),
)
_spec(
    "gpt_oss", "GptOssConfig", "sliding",
    **_llama_like(
        intermediate_size=64, sliding_window=WINDOW, layer_types=_SW3,
        num_local_experts=4, num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
)
_spec(  # logit_scale 1: Cohere's default 0.0625 shrinks the top-2 margins below 1e-3
    "cohere2", "Cohere2Config", "sliding", **_llama_like(sliding_window=WINDOW, layer_types=_SW3, logit_scale=1.0)
)
_spec("starcoder2", "Starcoder2Config", "sliding", **_llama_like(sliding_window=WINDOW))
_spec("olmo3", "Olmo3Config", "sliding", **_llama_like(sliding_window=WINDOW, layer_types=_SW3))

# --- hybrid / recurrent ----------------------------------------------------------------------
_LIN3 = ["linear_attention", "full_attention", "linear_attention"]
_GDN = dict(
    linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, layer_types=_LIN3,
)
_spec("qwen3_5", "Qwen3_5TextConfig", "hybrid", "Qwen3_5ForCausalLM", **_llama_like(**_GDN))
_spec(
    "qwen3_5_moe", "Qwen3_5MoeTextConfig", "hybrid", "Qwen3_5MoeForCausalLM",
    **_llama_like(
        **_GDN, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2,
    ),
)
_spec(
    "qwen3_next", "Qwen3NextConfig", "hybrid",
    **_llama_like(
        **_GDN, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
    ),
)
_spec(
    "lfm2", "Lfm2Config", "hybrid",
    hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=MAX_POS, conv_L_cache=3,
    block_auto_adjust_ff_dim=False, layer_types=["conv", "full_attention", "conv"],
)
_spec(
    "lfm2_moe", "Lfm2MoeConfig", "hybrid",
    hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POS, conv_L_cache=3,
    num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
    layer_types=["conv", "full_attention", "conv"],
)
_MAMBA = dict(
    hidden_size=HIDDEN, num_hidden_layers=3, state_size=8, conv_kernel=4, expand=2,
    time_step_rank=8, use_mambapy=False,
)
_spec("mamba", "MambaConfig", "recurrent", **_MAMBA)
_spec(
    "mamba2", "Mamba2Config", "recurrent",
    hidden_size=HIDDEN, num_hidden_layers=3, state_size=16, conv_kernel=4, expand=2,
    num_heads=8, head_dim=16, n_groups=1, chunk_size=16, time_step_rank=8,
)
_spec("falcon_mamba", "FalconMambaConfig", "recurrent", **_MAMBA)
_spec(
    "falcon_h1", "FalconH1Config", "hybrid",
    **_llama_like(
        mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
    ),
)
_spec(
    "jamba", "JambaConfig", "hybrid",
    **_llama_like(
        num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
    ),
)
_spec(
    "zamba2", "Zamba2Config", "hybrid",
    hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=3,
    layers_block_type=["linear_attention", "hybrid", "linear_attention"],
    num_attention_heads=4, num_key_value_heads=4, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
    mamba_ngroups=1, n_mamba_heads=4, chunk_size=16,
    max_position_embeddings=MAX_POS, use_mem_rope=True,
)
_spec(
    "nemotron_h", "NemotronHConfig", "hybrid",
    hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4,
    layers_block_type=["linear_attention", "full_attention", "mlp", "moe"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=MAX_POS,
    ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=1,
    conv_kernel=4, expand=2, chunk_size=16,
    n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=32, num_experts_per_tok=2,
)
_spec(
    "granitemoehybrid", "GraniteMoeHybridConfig", "hybrid",
    **_llama_like(
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=16, mamba_d_head=16, mamba_d_conv=4,
        mamba_expand=2, mamba_chunk_size=16, position_embedding_type="rope",
    ),
)
_spec(
    "olmo_hybrid", "OlmoHybridConfig", "hybrid",
    **_llama_like(
        num_key_value_heads=4, layer_types=_LIN3, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=32, linear_conv_kernel_dim=4,
    ),
)
_spec(
    "kimi_linear", "KimiLinearConfig", "hybrid",
    **_llama_like(
        num_key_value_heads=4, head_dim=8,
        moe_intermediate_size=32, num_shared_experts=1, num_experts=4, num_experts_per_token=2,
        num_expert_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        layer_types=_LIN3, mlp_layer_types=["dense", "sparse", "sparse"],
        linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4,
    ),
)
_spec(
    "bamba", "BambaConfig", "hybrid",
    **_llama_like(
        attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
    ),
)
_spec(
    "recurrent_gemma", "RecurrentGemmaConfig", "hybrid",
    hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=1, head_dim=16, lru_width=HIDDEN, attention_window_size=WINDOW,
    conv1d_width=4, block_types=["recurrent", "attention", "recurrent"],
)

# --- position schemes --------------------------------------------------------------------------
_spec(
    "mpt", "MptConfig", "alibi",
    d_model=HIDDEN, n_heads=4, n_layers=3, expansion_ratio=2, max_seq_len=MAX_POS,
)
_spec("bloom", "BloomConfig", "alibi", hidden_size=HIDDEN, n_layer=3, n_head=4)
_spec(
    "falcon_alibi", "FalconConfig", "alibi",
    hidden_size=HIDDEN, num_hidden_layers=3, num_attention_heads=4, num_kv_heads=4,
    new_decoder_architecture=False, multi_query=False, alibi=True, max_position_embeddings=MAX_POS,
)
_spec(
    "gpt_neo", "GPTNeoConfig", "local",
    hidden_size=HIDDEN, num_layers=3, num_heads=4, intermediate_size=128,
    attention_types=[[["global", "local"], 1], [["global"], 1]], window_size=WINDOW,
    max_position_embeddings=MAX_POS,
)


def _config_factory(name: str) -> Callable[[], "object"]:
    cls_name, kw, _kind, _lm = _SPECS[name]

    def make():
        import transformers

        cls = getattr(transformers, cls_name)
        merged = copy.deepcopy(_COMMON)
        merged.update(copy.deepcopy(kw))  # some configs edit their lists in place (Gemma4's layer_types)
        cfg = cls(**merged)
        cfg.dtype = torch.float32
        return cfg

    make.__name__ = f"config_{name}"
    make.__doc__ = f"A tiny {cls_name} for the {name!r} family ({_kind})."
    return make


def _available() -> tuple["OrderedDict[str, Callable]", dict[str, str]]:
    import transformers

    fams: "OrderedDict[str, Callable]" = OrderedDict()
    missing: dict[str, str] = {}
    for name, (cls_name, _kw, _kind, lm) in _SPECS.items():
        absent = [c for c in (cls_name, lm) if c is not None and not hasattr(transformers, c)]
        if absent:
            missing[name] = f"transformers {transformers.__version__} has no {', '.join(absent)}"
            continue
        fams[name] = _config_factory(name)
    return fams, missing


FAMILIES, MISSING = _available()
KIND: dict[str, str] = {name: spec[2] for name, spec in _SPECS.items()}


def _reinit(model, seed: int, std: float = 0.15, embed_std: float = 0.5) -> None:
    g = torch.Generator().manual_seed(seed)
    emb = model.get_input_embeddings()
    out = model.get_output_embeddings()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear) and mod is not out:
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=g) * std)
            elif isinstance(mod, torch.nn.Embedding) and mod is not emb:
                # learned position embeddings and per-layer inputs
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=g) * std)
        emb.weight.copy_(torch.randn(emb.weight.shape, generator=g) * embed_std)
        if out is not None and out.weight is not emb.weight:
            out.weight.copy_(torch.randn(out.weight.shape, generator=g) * embed_std)


def causal_lm_class(name: str):
    """The family's ForCausalLM class (the auto mapping's, or the text-only class named in the spec)."""
    import transformers

    lm = _SPECS[name][3]
    if lm is not None:
        return getattr(transformers, lm)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg_cls = getattr(transformers, _SPECS[name][0])
    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg_cls.model_type])


def build(name: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A tiny random ``name`` model: eval(), weights re-drawn from ``seed`` (see module doc).

    ``dtype=torch.float64`` also switches MoE experts to the "eager" implementation (the
    default grouped_mm takes no float64).  Caveat: in float64, Bloom, MPT and Gemma 2 (eager
    attention whose softmax runs in float32) give NaN for left-padded rows, so batch them
    in float32 (all families are batch-consistent there).
    """
    if name in MISSING:
        raise KeyError(f"family {name!r} is unavailable: {MISSING[name]}")
    cfg = FAMILIES[name]()
    torch.manual_seed(seed)
    model = causal_lm_class(name)._from_config(cfg, dtype=torch.float32)
    _reinit(model, seed)
    if dtype != torch.float32 and getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
        model.set_experts_implementation("eager")
    model = model.to(dtype).eval()
    gc = model.generation_config
    gc.pad_token_id, gc.eos_token_id, gc.bos_token_id = PAD, EOS, BOS
    model.config.pad_token_id, model.config.eos_token_id, model.config.bos_token_id = PAD, EOS, BOS
    return model


__all__ = ["FAMILIES", "KIND", "MISSING", "build", "causal_lm_class", "VOCAB", "PAD", "EOS", "BOS", "WINDOW"]
