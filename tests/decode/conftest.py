"""Tiny random Qwen3 models for the decoding tests (built in code, no downloads).

float64 makes a k-token verification pass and 1-token decoding steps agree to
~1e-15, so strict losslessness is an exact test here (no near-tie flips).
"""

from __future__ import annotations

import pytest
import torch

from draftcert.models import derive_drafter

from tests.tiny_models import tiny_qwen3


def make_target(attn: str = "sdpa", seed: int = 0, layers: int = 4):
    model, tok = tiny_qwen3(seed, num_layers=layers, hidden_size=48, intermediate_size=96, init_std=0.15)
    model.config._attn_implementation = attn
    model.to(torch.float64)
    model.generation_config.eos_token_id = None  # tests opt into EOS explicitly
    model.generation_config.pad_token_id = 256
    return model, tok


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def target_factory():
    return make_target


@pytest.fixture(scope="session")
def tiny():
    """(target, skip-layer drafter, tokenizer)."""
    target, tok = make_target()
    return target, derive_drafter(target, "self:skip=2"), tok


@pytest.fixture(scope="session")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 13)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, target_factory):
    """A tiny float32 checkpoint directory for the command-line tests (--target PATH)."""
    model, tok = target_factory(seed=2, layers=3)
    model.to(torch.float32)
    model.generation_config.eos_token_id = None
    path = tmp_path_factory.mktemp("tiny") / "ckpt"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
