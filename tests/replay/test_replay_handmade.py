"""Replay of hand-built traces gives hand-computed accepted lengths; explain; refusals; CLI."""

from __future__ import annotations

import json

import pytest

from draftcert.cli import main
from draftcert.replay import Shape, load_replay_trace, replay_config
from draftcert.replay.api import format_table, replay
from draftcert.replay.explain import explain, format_explain

from .handmade import EOS, prompt_columns, write_trace

# Prompt A, 10 steps, max_new_tokens 10.  The drafter's greedy token matches the target at
# every step but 2 and 7; at step 2 its rank-1 token is the target's, at step 7 no top-2 is.
TARGET_A = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
RANKS_A = [[1], [2], [50, 3], [4], [5], [6], [7], [51, 52, 8], [9], [10]]
# Prompt B ends with EOS after 5 steps (< max_new_tokens): the drafter proposes all of it.
TARGET_B = [1, 2, 3, 4, EOS]
RANKS_B = [[1], [2], [3], [4], [EOS]]


@pytest.fixture
def run_dir(tmp_path):
    # additive:0.5 (hand-set flags): accepts the drafter's greedy token at step 2 of A (a non-greedy token)
    acc = [True, True, True, True, True, True, True, False, True, True]
    mask = [1, 1, 1 | 2, 1, 1, 1, 1, 4, 1, 1]
    a = prompt_columns("A", TARGET_A, RANKS_A, relaxed={"additive:0.5": (acc, mask)})
    b = prompt_columns("B", TARGET_B, RANKS_B, relaxed={"additive:0.5": ([True] * 5, [1] * 5)})
    return write_trace(tmp_path / "run", [a, b], max_new_tokens=10)


def lengths(tr, spec, shape):
    rep = replay_config(tr, spec, shape)
    return {p: rep.accepted_lengths(p) for p in rep.rounds}, rep


def test_strict_chain_hand_computed(run_dir):
    tr = load_replay_trace(run_dir)
    got, rep = lengths(tr, "strict", Shape((1,) * 3))
    # A: t=0 budget 3: steps 0,1 ok, 2 rejected -> 2 (emit 3); t=3: 3,4,5 ok -> 3 (+bonus 6);
    #    t=7 budget min(3, 10-7-1)=2: 7 rejected -> 0; t=8 budget 1: 8 ok -> 1 (+bonus 9); done.
    # B: t=0: 0,1,2 ok -> 3 (+bonus 3); t=4: step 4 is the recorded EOS, accepted: output ends, no bonus.
    assert got == {"A": [2, 3, 0, 1], "B": [3, 1]}
    tot = rep.totals()
    assert tot["emitted"] == 10 + 5 and tot["target_forwards"] == 6 and tot["num_drafts"] == 6
    assert tot["tokens_per_forward"] == pytest.approx(15 / 6)
    # depth 1 attempted in all 6 rounds, accepted in 5; depth 2: A r1, A r2, B r1, accepted in all;
    # depth 3: A r1 (rejected), A r2, B r1
    assert tot["num_attempted_per_pos"] == [6, 3, 3] and tot["num_accepted_tokens_per_pos"] == [5, 3, 2]
    assert tot["acceptance_rate_per_pos"] == pytest.approx([5 / 6, 3 / 6, 2 / 6])  # vLLM's: / drafts
    assert tot["conditional_acceptance_rate_per_pos"] == pytest.approx([5 / 6, 1, 2 / 3])  # / attempted
    assert tot["accepted_tokens_histogram"] == [1, 2, 1, 2]  # lengths 0: A r3; 1: A r4, B r2; 2: A r1; 3: A r2, B r1
    assert tot["exact_fraction"] == 1.0


def test_strict_trees_hand_computed(run_dir):
    tr = load_replay_trace(run_dir)
    # (2, 3): step 2's target token is the drafter's rank-1 child: accepted, but a leaf (only the
    # greedy child is expanded) -> round ends with 3 accepted + bonus (step 3).  t=4: 4,5,6 ok -> 3,
    # bonus 7; t=8 budget 1: 8 ok -> 1.
    got, _ = lengths(tr, "strict", Shape((2, 2, 2)))
    assert got["A"] == [3, 3, 1]
    # static [2, 2, 2]: every node is expanded; the same here, the round just stops at depth 3.
    got, _ = lengths(tr, "strict", Shape((2, 2, 2), True))
    assert got["A"] == [3, 3, 1]
    # (3, 4): t=0: 0,1 ok, 2 rank-1 leaf -> 3 (+bonus 3); t=4: 4,5,6 ok, 7 = rank 2 (a leaf) ->
    # 4 accepted, budget min(4, 10-4-1) = 4, emit 5 -> t=9; budget 0: a round without drafts.
    got, rep = lengths(tr, "strict", Shape((3, 3, 3, 3)))
    assert got["A"] == [3, 4, 0]
    assert rep.rounds["A"][-1].budget == 0 and rep.rounds["A"][-1].depth_accepted == []
    # static [1, 3]: width 1 at depth 1, 3 at depth 2.  t=0: 0 ok, 1 ok (2 depths) -> 2 (+bonus 2);
    # t=3: 3, 4 -> 2 (+bonus 5); t=6: 6 ok, 7 rank 2 -> 2 (+bonus 8) t=9: budget 0 -> 0.
    got, _ = lengths(tr, "strict", Shape((1, 3), True))
    assert got["A"] == [2, 2, 2, 0]
    assert got["B"] == [2, 2]  # t=0: 2 (+bonus 2); t=3: 3 ok, step 4 = EOS accepted: ends


def test_relaxed_chain_exact_then_estimated(run_dir):
    tr = load_replay_trace(run_dir)
    rep = replay_config(tr, "additive:0.5", Shape((1, 1, 1)))
    rounds = rep.rounds["A"]
    # t=0: steps 0,1 ok, step 2: the drafter's token 50 is accepted although p's greedy is 3: a drift
    # at the last depth -> the round (3 accepted + bonus) is still exact, everything after is an estimate
    assert [r.accepted for r in rounds][0] == 3 and rounds[0].exact and rounds[0].drift == 1
    assert not any(r.exact for r in rounds[1:])
    # aligned estimate: t=4: 4,5,6 -> 3 (+bonus 7); t=8 budget 1: ok -> 1
    assert [r.accepted for r in rounds] == [3, 3, 1]
    # tree (2, 2) with the masks: t=0: 0, 1 -> 2 (+bonus 2); t=3: 3, 4 -> 2 (+bonus 5); t=6: 6 ok, at
    # step 7 only rank 2 passes, not among the top 2 -> 1; t=8, budget 1: 8 -> 1.  No drift: exact.
    rep = replay_config(tr, "additive:0.5", Shape((2, 2)))
    assert rep.accepted_lengths("A") == [2, 2, 1, 1] and all(r.exact for r in rep.rounds["A"])
    # tree (2, 3): at step 2 both children pass; the engine takes the one p prefers, p's greedy token
    # (rank 1, a leaf): no drift, 3 accepted + bonus 3; t=4: 4, 5, 6 -> 3; t=8: 1.
    rep = replay_config(tr, "additive:0.5", Shape((2, 2, 2)))
    assert rep.accepted_lengths("A") == [3, 3, 1] and all(r.exact and r.drift == 0 for r in rep.rounds["A"])


def test_explain_ranks_planted_far_off_step_first(tmp_path):
    T = 12
    target = list(range(1, T + 1))
    ranks = [[t] for t in target]
    kl, radius, logp0 = [0.05] * T, [0.01] * T, [-5.0] * T
    for s in (2, 5, 9):  # ordinary low-margin rejections: p(drafter token) close to p(greedy)
        ranks[s] = [60 + s, target[s]]
        logp0[s] = -0.7
    ranks[7] = [77]  # planted: the drafter is far off at a confident step
    kl[7], radius[7], logp0[7] = 9.0, 1.5, -18.0
    cols = prompt_columns("P", target, ranks, kl=kl, radius=radius, logp0=logp0)
    d = write_trace(tmp_path / "run", [cols], max_new_tokens=T)
    from draftcert.replay.api import replay as rp

    res = rp(d, ks=(3,), tree_widths=(), static=())
    ex = explain(res, k=3, epsilon=0.1)
    ev = ex["rules"]["strict"]["events"]
    assert ev[0].position == 7 and ev[0].category == "far_off"
    assert ev[0].surprise == pytest.approx(float(__import__("numpy").float32(__import__("math").log(0.6))) + 18.0, rel=1e-6)
    assert all(e.category == "low_margin" for e in ev[1:])
    assert ex["rules"]["strict"]["split"] == {"inside_radius": 0, "low_margin": len(ev) - 1, "far_off": 1, "nonfinite": 0,
                                                 "own_features": 0}
    text = format_explain(ex)
    assert "far off" in text and all(len(line) <= 80 for line in text.splitlines())


def test_explain_flags_rejection_inside_radius(tmp_path):
    target = [1, 2, 3, 4]
    ranks = [[1], [9], [3], [4]]
    kl = [0.01, 0.01, 0.01, 0.01]
    cols = prompt_columns("P", target, ranks, kl=kl, radius=[0.2] * 4)  # step 1: KL < radius, rejected
    d = write_trace(tmp_path / "run", [cols], max_new_tokens=4)
    rc = main(["explain", str(d), "--no-color"])
    assert rc == 1
    ex = json.loads((d / "explain.json").read_text())
    assert ex["rules"]["strict"]["split"]["inside_radius"] == 1
    assert ex["rules"]["strict"]["events"][0]["category"] == "inside_radius"


def test_trace_without_drafter_is_refused(tmp_path, capsys):
    cols = prompt_columns("A", TARGET_A, RANKS_A)
    d = write_trace(tmp_path / "run", [cols], max_new_tokens=10, drafter=False)
    with pytest.raises(ValueError, match=r"without a drafter.*draftcert profile --drafter"):
        load_replay_trace(d)
    for cmd in ("replay", "explain"):
        assert main([cmd, str(d)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "draftcert profile --drafter" in err[0]


def test_cli_replay_writes_json_and_fits_80_columns(run_dir, capsys):
    assert main(["replay", str(run_dir), "-k", "1-3", "--drafter-cost", "0.25"]) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if not line.startswith("wrote ")]  # paths are as long as they are
    assert all(len(line) <= 80 for line in table), [line for line in table if len(line) > 80]
    rj = json.loads((run_dir / "replay.json").read_text())
    assert rj["format"] == "draftcert-replay/1" and set(rj["rules"]) == {"strict", "additive:0.5"}
    strict = {c["shape"]["label"]: c for c in rj["rules"]["strict"]["configs"]}
    assert strict["chain k=3"]["mean_acceptance_length"] == pytest.approx(1 + (2 + 3 + 0 + 1 + 3 + 1) / 6)
    # forward-count model: a chain-3 round costs 1 + 3 * 0.25 (k drafter forwards); a budget-b round 1 + b/4
    c3 = strict["chain k=3"]
    budgets = 3 + 3 + 2 + 1 + 3 + 3  # A: 3,3,2,1; B: 3,3
    cost = 6 + 0.25 * budgets
    assert c3["predicted"]["speedup"] == pytest.approx((15 / cost) / 1.0)
    assert rj["rules"]["strict"]["recommended"]["shape"] in strict
    assert (run_dir / "figures" / "replay_tokens_per_forward.png").stat().st_size > 1000
    assert (run_dir / "figures" / "replay_speedup.png").exists()


def test_bad_arguments(run_dir):
    with pytest.raises(ValueError, match="not in the trace"):
        replay(run_dir, rules="tree:8")
    with pytest.raises(ValueError, match="top-16"):
        replay(run_dir, rules="strict", tree_widths=(17,), ks=(1,), static=())
    assert main(["replay", str(run_dir), "-k", "x"]) == 2
    assert main(["replay", str(run_dir), "--static", "4,0"]) == 2
    assert main(["replay", str(run_dir / "nope")]) == 2
    res = replay(run_dir, ks=(1, 2), tree_widths=(2,), static=())
    assert "strict" in format_table(res)


def test_old_trace_format_is_read_and_trees_of_relaxed_rules_are_skipped(tmp_path):
    """A draftcert-trace/1 trace (no accept_mask / draft_topk_target_logp): chains for every rule,
    trees for strict and tree:M, a note saying how to get the rest."""
    from tests.report import tracegen

    out = tmp_path / "old"
    tracegen.write_run(out, tracegen.make_steps(lengths=(20, 18), nonfinite=(), draft_nonfinite=()))
    res = replay(out, ks=(1, 2), tree_widths=(2,), static=())
    assert any("draftcert-trace/1" in n for n in res.notes)
    assert {c.shape.kind for c in res.configs["strict"]} == {"chain", "tree"}
    assert {c.shape.kind for c in res.configs["additive:0.2"]} == {"chain"}
    assert {c.shape.label for c in res.configs["tree:4"]} == {"tree 4x1", "tree 4x2"}
    with pytest.raises(ValueError, match="accept_mask"):
        replay_config(res.trace, "additive:0.2", Shape((2, 2)))
