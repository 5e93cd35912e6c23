"""Tiny random transformers models for the decoding tests (no downloads)."""

from __future__ import annotations

import copy

import pytest
import torch


def tiny_qwen3(seed: int = 0, vocab_size: int = 96, layers: int = 4, attn: str = "sdpa", dtype=torch.float64, scale: float = 4.0):
    """A tiny random Qwen3ForCausalLM.  ``scale`` sharpens the output distribution
    (random init gives near-uniform logits; real models are peaked)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab_size, hidden_size=48, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def skip_layer_copy(model, skip: int):
    """Drafter: the target with one decoder layer removed (shares the vocabulary)."""
    d = copy.deepcopy(model)
    layers = [l for i, l in enumerate(d.model.layers) if i != skip]
    d.model.layers = torch.nn.ModuleList(layers)
    for i, l in enumerate(layers):
        l.self_attn.layer_idx = i
    d.config.num_hidden_layers = len(layers)
    if getattr(d.config, "layer_types", None):
        d.config.layer_types = d.config.layer_types[: len(layers)]
    return d


@pytest.fixture(scope="session")
def pair():
    torch.set_num_threads(1)
    target = tiny_qwen3(0)
    return target, skip_layer_copy(target, 2)


@pytest.fixture(scope="session")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 11, 17)]
