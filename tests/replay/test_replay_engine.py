"""Replay equals the engine: strict chains and trees round by round, on a tiny float64 Qwen3 pair.

float64 makes the profile's batched greedy pass, its teacher-forced drafter pass and the
engine's cached verification agree to ~1e-15, so there are no near-tie flips: every
round must match exactly."""

from __future__ import annotations

from functools import reduce

import numpy as np
import pytest

from draftcert.decode import DecodeStats
from draftcert.replay import Shape, load_replay_trace, replay_config

from .conftest import PROMPTS, exact_prefix_matches, run_engine

STRICT_SHAPES = [Shape((1,) * k) for k in (1, 2, 3, 5, 8)] + [Shape((2,) * 3), Shape((4,) * 2), Shape((3, 2, 1), True),
                                                              Shape((2, 2), True)]
# the drafter's confidence stop (decode --draft-margin): chains that end where its top-2 logit gap is small
MARGIN_SHAPES = [Shape((1,) * 3, min_margin=0.5), Shape((1,) * 6, min_margin=1.0), Shape((1,) * 8, min_margin=2.0),
                 Shape((2,) * 3, min_margin=1.0)]
CASES = ([("strict", s) for s in STRICT_SHAPES + MARGIN_SHAPES] + [("tree:2", Shape((2,) * k)) for k in (1, 3, 8)]
         + [("tree:4", Shape((4,) * k)) for k in (2, 5)])
RELAXED = [(r, s) for r in ("additive:0.05", "topm:2") for s in (Shape((1,) * 3), Shape((1,) * 6), Shape((2,) * 3),
                                                                 Shape((3, 2), True))]


@pytest.fixture(scope="module")
def trace(profiled):
    return load_replay_trace(profiled)


@pytest.mark.parametrize("spec,shape", CASES, ids=[f"{r}-{s.label}" for r, s in CASES])
def test_strict_replay_equals_engine_round_by_round(pair, trace, spec, shape):
    rep = replay_config(trace, spec, shape)
    tot = rep.totals()
    att, acc, emitted, fwd = [0] * shape.depth, [0] * shape.depth, 0, 0
    runs = []
    for pid, text in PROMPTS:
        st = run_engine(pair, spec, shape, text)
        assert [r.num_accepted_tokens for r in st.rounds] == rep.accepted_lengths(pid), (pid, shape.label)
        # a round's draft nodes are exact unless a confidence stop could have cut depths past a rejection
        for r, x in zip(st.rounds, rep.rounds[pid]):
            if x.nodes_exact:
                assert r.num_draft_tokens == x.n_nodes(shape), (pid, shape.label, x.start)
        assert [r.emitted for r in st.rounds] == [x.tolist() for x in _emitted(trace, pid, rep)]  # the recorded path
        assert all(r.exact for r in rep.rounds[pid])
        for d, (a, n) in enumerate(zip(st.num_accepted_tokens_per_pos, st.num_attempted_per_pos)):
            acc[d] += a
            att[d] += n
        emitted += st.emitted
        fwd += st.target_forwards
        runs.append(st)
    assert tot["num_attempted_per_pos"] == att and tot["num_accepted_tokens_per_pos"] == acc
    assert tot["emitted"] == emitted and tot["target_forwards"] == fwd
    # one statistics type: the replay counts its rounds as the engine's merged statistics do
    eng = reduce(DecodeStats.merge, runs)
    mine = rep.stats()
    nodes_exact = all(r.nodes_exact for rs in rep.rounds.values() for r in rs)
    for name in ("num_rounds", "emitted", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "drift_tokens",
                 "accepted_tokens_histogram"):
        if name != "num_draft_tokens" or nodes_exact:
            assert getattr(mine, name) == getattr(eng, name), name
    n = len(eng.num_accepted_tokens_per_pos)
    assert mine.num_accepted_tokens_per_pos[:n] == eng.num_accepted_tokens_per_pos and not any(mine.num_accepted_tokens_per_pos[n:])
    assert tot["mean_acceptance_length"] == eng.mean_acceptance_length and tot["num_drafts"] == eng.num_drafts


def test_margin_stops_happen_and_cut_the_drafts(trace):
    """The margin cases above are not vacuous: on this trace each stop ends some drafts early, and a
    stop of 0 nats never does (every chain is then the fixed chain)."""
    for shape in MARGIN_SHAPES:
        rep = replay_config(trace, "strict", shape)
        assert any(r.stopped for rs in rep.rounds.values() for r in rs), shape.label
    fixed = replay_config(trace, "strict", Shape((1,) * 6))
    zero = replay_config(trace, "strict", Shape((1,) * 6, min_margin=0.0))
    assert zero.totals() == fixed.totals()


def _emitted(trace, pid, rep):
    pt = next(p for p in trace.prompts if p.id == pid)
    return [pt.target_token[r.start:r.start + r.emitted] for r in rep.rounds[pid]]


@pytest.mark.parametrize("spec,shape", RELAXED, ids=[f"{r}-{s.label}" for r, s in RELAXED])
def test_relaxed_replay_exact_until_it_leaves_the_path(pair, trace, spec, shape):
    rest = exact_prefix_matches(pair, replay_config(trace, spec, shape), spec, shape)
    # once a round is inexact, every later one is too (the path never comes back)
    assert not any(r.exact for rounds in rest.values() for r in rounds)


def test_trace_replay_columns(trace, profiled):
    """trace/2: bit 0 of accept_mask is the accepted flag; the rank and log-probs agree with p's top-16."""
    import pyarrow.parquet as pq

    t = pq.read_table(profiled / "trace")
    for spec in ("strict", "additive:0.05", "topm:2"):
        mask = t.column(f"accept_mask/{spec}").to_numpy()
        np.testing.assert_array_equal(mask & 1 == 1, t.column(f"accepted/{spec}").to_numpy())
    assert "accept_mask/tree:2" not in t.column_names
    rank = t.column("draft_token_target_rank").to_numpy()
    tids = np.array(t.column("target_topk_ids").to_pylist())
    tp = np.array(t.column("target_topk_probs").to_pylist())
    dl = np.array(t.column("draft_topk_target_logp").to_pylist())
    dtok = t.column("draft_token").to_numpy()
    inside = rank < 16
    assert inside.any() and (~inside).any()
    np.testing.assert_array_equal(tids[inside, rank[inside]], dtok[inside])
    np.testing.assert_allclose(dl[inside, 0], np.log(tp[inside, rank[inside]]), rtol=1e-5)
    assert (dl[~inside, 0] <= np.log(tp[~inside, -1]) + 1e-6).all()
    # strict: the greedy token's rank is 0 exactly where strict accepts
    np.testing.assert_array_equal(rank == 0, t.column("accepted/strict").to_numpy())


def test_calibrate_and_predict(pair, trace, sound_timings):
    from draftcert.replay.api import replay
    from draftcert.decode.draft_shape.costs import Costs
    from draftcert.replay.speed import calibrate

    model, drafter, _ = pair
    shapes = [Shape((1,) * 2), Shape((2,) * 2), Shape((2, 2), True)]
    costs = calibrate(model, drafter, shapes, context=16, prompt_length=8, repeats=1)
    assert set(costs.target) == {1, 2, 3} and set(costs.target_tree) == {3, 5, 7} and set(costs.drafter) == {1, 2}
    assert set(costs.overhead) == {1, 2, 3, 5, 7}
    assert all(v > 0 for tab in (costs.target, costs.drafter, costs.target_tree, costs.overhead) for v in tab.values())
    assert Costs.from_dict(__import__("json").loads(__import__("json").dumps(costs.as_dict()))) == costs
    res = replay(trace, rules="strict", shapes=shapes, costs=costs)
    for row in res.rows["strict"]:
        p = row["predicted"]
        assert p["tokens_per_second"] > 0 and p["speedup"] > 0
    assert res.recommended["strict"]["shape"] in {s.label for s in shapes}


def test_profile_report_gets_a_replay_section(profiled):
    """`draftcert report` computes the replay section and hands it to write_report (the report
    itself never imports the replay)."""
    import json

    from draftcert.cli import main
    from draftcert.report import write_report

    assert main(["report", str(profiled), "--quiet"]) == 0
    summary = json.loads((profiled / "summary.json").read_text())
    md = (profiled / "report.md").read_text()
    assert "## Replay" in md and "replay_tokens_per_forward.png" in md
    assert "<h2>Replay</h2>" in (profiled / "report.html").read_text()
    rep = summary["replay"]
    assert rep["soundness_violations"] == 0 and set(rep["rules"]) == set(summary["criteria"])
    assert "notes" not in summary or not any("replay" in n for n in summary["notes"])
    plain = write_report(profiled, verbose=False)  # no replay= given: no section
    assert "replay" not in plain and "## Replay" not in (profiled / "report.md").read_text()
