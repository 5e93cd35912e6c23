"""Tiny real transformers models for profile tests (no downloads).

``tests.tiny_models.tiny_qwen3``: a random Qwen3ForCausalLM with a byte-level
ChatML tokenizer, built in code.  init_std = 0.5 makes its next-token
distributions peaked like a trained model's (near-uniform p would make every
radius trivially small), and vocab_size 320 > 259 tokenizer tokens gives padded
vocabulary rows like real checkpoints have.
"""

from __future__ import annotations

import pytest
import torch

# This machine is shared: with 2 intra-op threads under load, tiny reductions wait
# milliseconds on each other; one thread keeps the tests fast and deterministic.
torch.set_num_threads(1)

VOCAB = 320

PROMPTS = [
    ("p0", "Write a haiku about the sea."),
    ("p1", "What is 2+2?"),
    ("p2", "Explain speculative decoding in one sentence, please."),
    ("p3", "List three colours."),
    ("p4", "Why is the sky blue?"),
]


def tiny_qwen3(seed: int = 0, layers: int = 3):
    from tests.tiny_models import tiny_qwen3 as build

    model, _ = build(seed, vocab_size=VOCAB, hidden_size=64, num_layers=layers, intermediate_size=128,
                     init_std=0.5, with_tokenizer=False)
    return model


def byte_tokenizer():
    from tests.tiny_models import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture(scope="session")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="session")
def target(tokenizer):
    return tiny_qwen3(seed=0), tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
    """A tiny Qwen3 checkpoint directory (model + tokenizer), as a user would pass to --target."""
    d = tmp_path_factory.mktemp("tiny-ckpt")
    tiny_qwen3(0).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    f.write_text("\n".join(text for _, text in PROMPTS) + "\n")
    return f
