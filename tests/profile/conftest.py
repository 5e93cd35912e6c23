"""Tiny real transformers models for profile tests (no downloads).

A byte-level BPE tokenizer without merges (every byte is a token, plus <eos>
and <pad>) and a 2-layer random Qwen3ForCausalLM whose output layer is scaled
up so that its next-token distributions are peaked like a trained model's
(a raw random init gives near-uniform distributions and trivial radii).
"""

from __future__ import annotations

import pytest
import torch

# This machine is shared: with 2 intra-op threads under load, tiny reductions wait
# milliseconds on each other; one thread keeps the tests fast and deterministic.
torch.set_num_threads(1)

VOCAB = 320  # model vocabulary (> tokenizer size, as in real checkpoints)

PROMPTS = [
    ("p0", "Write a haiku about the sea."),
    ("p1", "What is 2+2?"),
    ("p2", "Explain speculative decoding in one sentence, please."),
    ("p3", "List three colours."),
    ("p4", "Why is the sky blue?"),
]


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<eos>"] = len(vocab)
    vocab["<pad>"] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>")


def tiny_qwen3(seed: int = 0, layers: int = 3, scale: float = 12.0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=None, pad_token_id=None)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


@pytest.fixture(scope="session")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="session")
def target(tokenizer):
    return tiny_qwen3(seed=0), tokenizer
