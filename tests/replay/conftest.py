"""A tiny float64 Qwen3 target and a skip-layer drafter, profiled once per session."""

from __future__ import annotations

import pytest
import torch

PROMPTS = [("p0", "Write a haiku about the sea."), ("p1", "What is 2+2?"), ("p2", "List three colours.")]
T = 24
CRITERIA = "strict,additive:0.05,topm:2,tree:2,tree:4"


@pytest.fixture(scope="session")
def pair():
    from draftcert.models import derive_drafter
    from tests.tiny_models import tiny_qwen3

    torch.set_num_threads(1)
    model, tok = tiny_qwen3(0, num_layers=4, hidden_size=48, intermediate_size=96, init_std=0.15)
    model.to(torch.float64)
    return model, derive_drafter(model, "self:skip=2"), tok


def run_profile(pair, out):
    """Profile PROMPTS with the pair's drafter into ``out`` (the trace every replay test reads)."""
    from draftcert.profile import profile

    model, drafter, tok = pair
    profile((model, tok), drafter, PROMPTS, out=out, max_new_tokens=T, batch_size=2, progress=False,
            criteria=CRITERIA)
    return out


def run_engine(pair, spec, shape, text):
    """DecodeStats of the engine on one prompt, with the shape's arguments."""
    from draftcert.decode import speculative_generate
    from draftcert.models.hf import eos_token_ids
    from draftcert.prompts import encode_prompt

    model, drafter, tok = pair
    ids = encode_prompt(tok, text)
    return speculative_generate(model, drafter, ids, spec, max_new_tokens=T, eos_token_id=sorted(eos_token_ids(model, tok)),
                                **shape.engine_args(spec)).stats


def exact_prefix_matches(pair, rep, spec, shape):
    """Per prompt: the engine's accepted lengths equal the replay's up to its first inexact round.
    Returns each prompt's replayed rounds after that point (for further checks)."""
    rest = {}
    for pid, text in PROMPTS:
        real = [r.num_accepted_tokens for r in run_engine(pair, spec, shape, text).rounds]
        rounds = rep.rounds[pid]
        n_exact = next((i for i, r in enumerate(rounds) if not r.exact), len(rounds))
        assert real[:n_exact] == [r.accepted for r in rounds[:n_exact]], (pid, shape.label)
        rest[pid] = rounds[n_exact:]
    return rest


@pytest.fixture(scope="session")
def profiled(pair, tmp_path_factory):
    return run_profile(pair, tmp_path_factory.mktemp("replay-run"))


@pytest.fixture
def sound_timings(monkeypatch):
    """Calibrations taken as reliable: for tests of the calibrate -> predict plumbing on tiny models,
    whose sub-millisecond forwards, timed once on a shared test machine, often fail
    ``speed.timing_problems`` (rightly; tests/replay/test_calibrate_unreliable.py tests that path)."""
    from draftcert.replay import speed

    monkeypatch.setattr(speed, "timing_problems", lambda *a, **k: [])
