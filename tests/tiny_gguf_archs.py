"""Tiny GGUF files of every architecture transformers reads from GGUF, written in code (no downloads).

``write_tiny_arch(path, arch)`` writes a GGUF of llama.cpp architecture ``arch`` in two passes: the
metadata alone first (hyperparameters under the keys transformers' GGUF mapping reads, and the
tiny tokenizer of ``tests.tiny_gguf``), from which transformers builds the config, the model (on
the meta device) and the map of GGUF tensor names to its parameters; then the same metadata with a
random tensor of every mapped parameter's shape, Q8_0 (or ``qtype``) where the row is whole blocks,
float32 otherwise.  The model a file describes is whatever transformers makes of those bytes: the
tests decode it, they do not compare it with another.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402

from tests.tiny_gguf import add_tiny_tokenizer  # noqa: E402

# llama.cpp architecture -> (transformers model_type, general.name)
ARCHS = {
    "llama": ("llama", "tiny llama"),
    "mistral": ("mistral", "tiny mistral"),  # written as llama.cpp does: architecture llama, a name with "mistral"
    "qwen2": ("qwen2", "tiny qwen2"),
    "qwen3": ("qwen3", "tiny qwen3"),
    "gemma2": ("gemma2", "tiny gemma2"),
    "gemma3": ("gemma3", "tiny gemma3"),
    "phi3": ("phi3", "tiny phi3"),
    "stablelm": ("stablelm", "tiny stablelm"),
    "starcoder2": ("starcoder2", "tiny starcoder2"),
    "nemotron": ("nemotron", "tiny nemotron"),
    "qwen2moe": ("qwen2_moe", "tiny qwen2moe"),
    "qwen3moe": ("qwen3_moe", "tiny qwen3moe"),
    "falcon": ("falcon", "tiny falcon"),
    "bloom": ("bloom", "tiny bloom"),
    "gpt2": ("gpt2", "tiny gpt2"),
    "lfm2": ("lfm2", "tiny lfm2"),
    "deci": ("deci", "tiny deci"),
    "mamba": ("mamba", "tiny mamba"),
    "gemma4": ("gemma4", "tiny gemma4"),
    "gpt-oss": ("gpt_oss", "tiny gpt-oss"),
    "minimax-m2": ("minimax_m2", "tiny minimax-m2"),
}
H, I, NH, NKV, HD, L, V = 64, 128, 4, 2, 16, 2, 96


def _hparams(model_type: str) -> dict:
    """The transformers config values the tiny files state (keys of transformers' GGUF mapping)."""
    return {"max_position_embeddings": 128, "num_hidden_layers": L, "intermediate_size": I, "hidden_size": H,
            "head_dim": HD, "rope_theta": 10000.0, "num_attention_heads": NH, "num_key_value_heads": NKV,
            "rms_norm_eps": 1e-5, "layer_norm_eps": 1e-5, "norm_epsilon": 1e-5, "norm_eps": 1e-5, "vocab_size": V,
            "sliding_window": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": I // 2,
            "shared_expert_intermediate_size": I // 2, "partial_rotary_factor": 0.5,
            "layer_norm_epsilon": 1e-5, "n_head": NH, "n_layer": L, "n_embd": H, "n_positions": 128, "n_inner": I,
            "n_ctx": 128, "num_kv_heads": NKV, "conv_kernel": 4, "state_size": 16, "time_step_rank": 4,
            "global_head_dim": HD, "conv_L_cache": 3, "block_ff_dim": I}


def _writer(path, arch: str):
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING  # optional: models extra

    model_type, name = ARCHS[arch]
    gguf_arch = "llama" if arch == "mistral" else arch
    w = gguf.GGUFWriter(str(path), gguf_arch)
    w.add_name(name)
    add_tiny_tokenizer(w, V, specials=True)
    hp = _hparams(model_type)
    for key, hf_key in GGUF_CONFIG_MAPPING[model_type].items():
        if hf_key is None or hf_key not in hp:
            continue
        value = hp[hf_key]
        full = f"{gguf_arch}.{key}"
        if key == "rope.dimension_count":
            value = HD
        if isinstance(value, float):
            w.add_float32(full, value)
        else:
            w.add_uint32(full, int(value))
    if arch == "stablelm":
        w.add_uint32(f"{gguf_arch}.rope.dimension_count", HD // 2)
    return w


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_arch(path, arch: str, *, qtype: int = int(QT.Q8_0), seed: int = 0, tied: bool = False) -> Path:
    """Write the tiny GGUF of ``arch`` (a key of ``ARCHS``) to ``path``; returns it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    path = Path(path)
    probe = path.with_suffix(".meta.gguf")
    _finish(_writer(probe, arch))
    config = AutoConfig.from_pretrained(str(probe.parent), gguf_file=probe.name)
    probe.unlink()
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.tie_word_embeddings = tied
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    gguf_arch = "llama" if arch == "mistral" else arch
    processor = TENSOR_PROCESSORS.get(gguf_arch, TensorProcessor)(config=config.to_dict())
    names: dict[str, list[str]] = {}  # parameter -> its GGUF tensors (two for merged expert gate/up weights)
    for g, hf in get_gguf_hf_weights_map(model, processor).items():
        names.setdefault(hf, []).append(g)
    rng = np.random.default_rng(seed)
    w = _writer(path, arch)
    written = set()
    for hf, p in model.state_dict().items():
        for g in names.get(processor.preprocess_name(hf), []):
            if (tied and g.startswith("output.")) or g in written:
                continue
            written.add(g)
            shape = tuple(p.shape)
            if len(names[processor.preprocess_name(hf)]) == 2:  # gate and up experts: each half of dim 1
                shape = (shape[0], shape[1] // 2, *shape[2:])
            if arch == "gpt2" and g.endswith(_GPT2_TRANSPOSED):  # Conv1D weights: GGUF stores them transposed
                shape = shape[::-1]
            if g.endswith("ssm_conv1d.weight"):  # [C, 1, K] stored as [C, K]
                shape = (shape[0], shape[-1])
            _add(w, g + ".weight" if g.endswith("_exps") else g, shape, rng, qtype)  # experts: named with .weight
    _finish(w)
    return path


_GPT2_TRANSPOSED = ("attn_qkv.weight", "ffn_down.weight", "ffn_up.weight", "attn_output.weight")


def _add(w, g: str, shape: tuple, rng, qtype: int) -> None:
    """A random tensor ``g`` of ``shape``: block type ``qtype`` where its rows are whole blocks."""
    if g.endswith("ssm_a"):  # Mamba's A is stored as -exp(A_log): negative
        w.add_tensor(g, -np.exp(0.1 * rng.standard_normal(shape)).astype(np.float32))
        return
    if g.endswith("ffn_gate_inp_shexp.weight"):  # a [1, H] gate stored as one row of H (llama.cpp's layout)
        shape = shape[1:]
    if len(shape) == 1:
        x = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32) if "norm" in g else \
            (0.02 * rng.standard_normal(shape)).astype(np.float32)
        w.add_tensor(g, x)
        return
    x = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
    if qtype and shape[-1] % gguf.GGML_QUANT_SIZES[QT(qtype)][0] == 0:
        q = gguf.quants.quantize(x, QT(qtype))
        w.add_tensor(g, q, raw_shape=q.shape, raw_dtype=QT(qtype))
    else:
        w.add_tensor(g, x)
