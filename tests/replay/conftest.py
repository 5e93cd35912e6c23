"""A tiny float64 Qwen3 target and a skip-layer drafter, profiled once per session."""

from __future__ import annotations

import pytest
import torch

PROMPTS = [("p0", "Write a haiku about the sea."), ("p1", "What is 2+2?"), ("p2", "List three colours.")]
T = 24
CRITERIA = "strict,additive:0.05,topm:2,tree:2,tree:4"


@pytest.fixture(scope="session")
def pair():
    from draftcert.models import derive_drafter, tiny_qwen3

    torch.set_num_threads(1)
    model, tok = tiny_qwen3(0, num_layers=4, hidden_size=48, intermediate_size=96, init_std=0.15)
    model.to(torch.float64)
    return model, derive_drafter(model, "self:skip=2"), tok


@pytest.fixture(scope="session")
def profiled(pair, tmp_path_factory):
    from draftcert.profile import profile

    model, drafter, tok = pair
    out = tmp_path_factory.mktemp("replay-run")
    profile((model, tok), drafter, PROMPTS, out=out, max_new_tokens=T, batch_size=2, progress=False, report=False,
            criteria=CRITERIA)
    return out
