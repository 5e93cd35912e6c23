"""Replay equals the engine for a FEATURE (EAGLE-style) drafter too, at every depth.

A feature drafter drafts depth >= 2 from its own predicted features; the profile records its own
rollouts along the target's greedy path (draftcert-trace/3), and replay uses them.  Tiny float64
Qwen3 target, a tiny feature drafter built from it (random, its layer initialised from the
target's last layer, a reduced draft vocabulary so the tail mass is exercised): strict chains and
trees must match the engine round by round, relaxed rules until they leave the recorded path."""

from __future__ import annotations

import pytest
import torch

from draftcert.prompts import encode_prompt
from draftcert.replay import Shape, load_replay_trace, replay_config

from .conftest import PROMPTS, T, exact_prefix_matches, run_engine, run_profile

STRICT_SHAPES = [Shape((1,) * k) for k in (1, 2, 3, 5, 8)] + [Shape((2,) * 3), Shape((4,) * 4), Shape((3, 2, 1), True),
                                                              Shape((2, 2, 2), True)]
CASES = ([("strict", s) for s in STRICT_SHAPES] + [("tree:2", Shape((2,) * k)) for k in (1, 3, 8)]
         + [("tree:4", Shape((4,) * k)) for k in (2, 6)])
RELAXED = [(r, s) for r in ("additive:0.05", "topm:2") for s in (Shape((1,) * 3), Shape((1,) * 7), Shape((2,) * 4),
                                                                 Shape((3, 2), True))]


@pytest.fixture(scope="module")
def fpair():
    from tests.tiny_models import tiny_qwen3
    from draftcert.models.eagle import EagleDrafter

    torch.set_num_threads(1)
    model, tok = tiny_qwen3(0, num_layers=4, hidden_size=48, intermediate_size=96, init_std=0.15)
    model.to(torch.float64)
    torch.manual_seed(1)
    drafter = EagleDrafter(model, torch.arange(200), init_from_last_layer=True).to(torch.float64)
    _fit(model, drafter, tok)
    return model, drafter, tok


def _fit(model, drafter, tok, steps=50):
    """A few teacher-forced steps on the target's own greedy continuations of the test prompts, so
    that rounds accept several tokens (a random drafter accepts almost nothing on this target)."""
    from draftcert.decode import greedy_generate

    seqs = []
    for _, text in PROMPTS:
        ids = encode_prompt(tok, text)
        seqs.append(torch.tensor(ids + greedy_generate(model, ids, T)))
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-2)
    for _ in range(steps):
        loss = sum(torch.nn.functional.cross_entropy(drafter(s[None]).logits[0, 1:-1], s[2:]) for s in seqs)
        opt.zero_grad()
        loss.backward()
        opt.step()
    drafter.eval()


@pytest.fixture(scope="module")
def ftrace(fpair, tmp_path_factory):
    return load_replay_trace(run_profile(fpair, tmp_path_factory.mktemp("replay-feature")))


def test_feature_trace_records_rollouts(ftrace):
    assert ftrace.feature and ftrace.rollout == (8, 8) and ftrace.run["format"] == "draftcert-trace/3"
    pt = ftrace.prompts[0]
    assert pt.roll_ids.shape == (len(pt), 7, 8) and set(pt.roll_mask) == {"strict", "additive:0.05", "topm:2"}
    # row t holds depth j's proposals only when a round can start j - 1 steps before it
    assert (pt.roll_ids[0] == -1).all() and (pt.roll_ids[1, 1:] == -1).all() and (pt.roll_ids[1, 0] >= 0).all()
    assert not any("estimate" in n for n in ftrace.notes)


@pytest.mark.parametrize("spec,shape", CASES, ids=[f"{r}-{s.label}" for r, s in CASES])
def test_strict_replay_equals_engine_with_a_feature_drafter(fpair, ftrace, spec, shape):
    rep = replay_config(ftrace, spec, shape)
    deep = 0
    for pid, text in PROMPTS:
        st = run_engine(fpair, spec, shape, text)
        assert [r.num_accepted_tokens for r in st.rounds] == rep.accepted_lengths(pid), (pid, shape.label)
        assert [r.num_draft_tokens for r in st.rounds][0] == 0 and rep.rounds[pid][0].budget == 0  # the prefill round
        assert all(r.exact for r in rep.rounds[pid])
        deep += sum(r.num_accepted_tokens >= 2 for r in st.rounds)
    if shape.depth >= 3:
        assert deep > 0, "no round accepted depth 2: the test would not exercise the rollouts"


@pytest.mark.parametrize("spec,shape", RELAXED, ids=[f"{r}-{s.label}" for r, s in RELAXED])
def test_relaxed_replay_with_a_feature_drafter_is_exact_until_it_leaves_the_path(fpair, ftrace, spec, shape):
    exact_prefix_matches(fpair, replay_config(ftrace, spec, shape), spec, shape)


def test_teacher_forced_replay_would_differ(fpair, ftrace):
    """The rollouts matter: replaying depth >= 2 from the teacher-forced top-K instead (what a
    trace/2 holds) disagrees with the engine on some round of this pair."""
    import copy

    tf = copy.deepcopy(ftrace)
    for pt in tf.prompts:
        pt.roll_ids = None
    tf.rollout = None  # as a feature drafter's draftcert-trace/2 is read
    shape = Shape((1,) * 8)
    rep = replay_config(ftrace, "strict", shape)
    rep_tf = replay_config(tf, "strict", shape)
    assert any(rep.accepted_lengths(p) != rep_tf.accepted_lengths(p) for p, _ in PROMPTS)
    # without rollouts only depth 1 is exact: rounds that reach depth 2 are labelled estimates
    rounds = [r for rs in rep_tf.rounds.values() for r in rs]
    assert all(r.exact == (len(r.depth_accepted) <= 1) for r in rounds)
    assert any(not r.exact for r in rounds)


def test_explain_leaves_own_feature_drafts_out_of_the_split(ftrace):
    """A rejection at depth >= 2 is of the drafter's own-feature draft, whose D(p, q) the trace does
    not hold: explain names its rollout tokens and files it under own_features, never inside_radius."""
    from draftcert.replay.api import replay
    from draftcert.replay.explain import explain

    res = replay(ftrace, rules="strict,additive:0.05", ks=(4,), tree_widths=(), static=())
    ex = explain(res, k=4)
    for spec in ("strict", "additive:0.05"):
        evs = ex["rules"][spec]["events"]
        deep = [e for e in evs if e.depth >= 2]
        assert deep and all(e.category == "own_features" for e in deep)
        assert all(e.category != "own_features" for e in evs if e.depth == 1)
        assert ex["rules"][spec]["split"]["inside_radius"] == 0
        pt = next(p for p in ftrace.prompts if p.id == deep[0].prompt)
        assert deep[0].drafter_tokens[0] == pt.roll_ids[deep[0].position, deep[0].depth - 2, 0]
    from draftcert.replay.explain import format_explain

    text = format_explain(ex, top=50)
    assert "own features" in text and "KL not recorded" in text
