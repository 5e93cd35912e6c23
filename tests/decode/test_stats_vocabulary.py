"""One metrics vocabulary: vLLM's counters and figures agree with hand-counted rounds of a scripted
drafter (one that proposes the target's greedy continuation for a planned number of tokens, then a
wrong token), and decode --json, bench rows and replay.json carry the same names, each one listed in
docs/metrics.md, none of the retired second names."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from draftcert.cli import main
from draftcert.decode import DecodeStats, greedy_generate, speculative_generate
from draftcert.decode.bench import bench_row
from draftcert.models.tree_attention import DraftTree
from tests.chain_round import chain_draft
from draftcert.replay.api import replay

from ..report import tracegen

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
VOCAB = 256  # the tiny Qwen3's vocabulary

# names an output once used for a figure that now has one name (docs/metrics.md)
RETIRED = {"mean_accepted_length", "mean_accepted", "acceptance_rate_by_depth", "acceptance_by_position",
           "attempted_by_depth", "attempted_by_position", "accepted_by_position", "accepted_by_depth",
           "zero_accept_fraction", "accepted_length_histogram", "divergence_spent_nats", "rounds",
           "drafted", "accepted", "drift_count", "avg_spec_accept_length"}
# keys that name the configuration or carry text, not a figure
LABELS = {"criterion", "k", "tree", "draft", "shape", "round", "text", "drafter"}


class ScriptedDrafter:
    """Round r proposes a chain: the target's greedy continuation for ``script[r]`` tokens, then (if
    the budget allows) a token that is not the greedy one; ``None`` proposes nothing.  Under
    ``strict`` round r therefore accepts exactly min(script[r], budget) tokens."""

    def __init__(self, greedy: list[int], script: list[int | None]):
        self.greedy, self.script, self.forwards = greedy, script, 0

    def start(self, prompt_ids):
        self.n_prompt, self.round = len(prompt_ids), 0

    def propose(self, seq, widths, expand_all=False):
        a, self.round = self.script[self.round], self.round + 1
        tree = DraftTree()
        if a is None or not widths:
            return tree
        t = len(seq) - self.n_prompt  # tokens emitted so far: the greedy path under strict
        chain = self.greedy[t : t + min(a, len(widths))]
        if a < len(widths):  # wrong (the greedy token is greedy[t + a]), then filler to the full chain
            chain += [(self.greedy[t + a] + 1) % VOCAB] * (len(widths) - a)
        return chain_draft(chain)

    def accept(self, path):
        pass

    def fork(self):
        return ScriptedDrafter(self.greedy, self.script)


def _scripted(tiny, prompts, script, k, n):
    target, _, _ = tiny
    greedy = greedy_generate(target, prompts[0], n)
    res = speculative_generate(target, ScriptedDrafter(greedy, script), prompts[0], "strict", k=k, max_new_tokens=n)
    assert res.tokens == greedy  # strict: the scripted drafts change nothing but the counts
    return res.stats


def test_vllm_counters_agree_with_hand_counted_rounds(tiny, prompts):
    # k = 3; rounds: no draft, then accept 2, 3, 0, 1, 3 of 3 drafted tokens each.
    # emitted 1 + 3 + 4 + 1 + 2 + 4 = 15 = max_new_tokens, so no round is cut by the length limit
    st = _scripted(tiny, prompts, [None, 2, 3, 0, 1, 3], k=3, n=15)
    assert [(r.num_draft_tokens, r.num_accepted_tokens) for r in st.rounds] == [(0, 0), (3, 2), (3, 3), (3, 0),
                                                                                (3, 1), (3, 3)]
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens) == (5, 15, 9)
    # position 1 accepted in the rounds accepting >= 1 (2, 3, 1, 3), 2 in those >= 2, 3 in those >= 3
    assert st.num_accepted_tokens_per_pos == [4, 3, 2]
    assert st.mean_acceptance_length == pytest.approx(1 + 9 / 5)  # vLLM: the bonus token included
    assert st.draft_acceptance_rate == pytest.approx(9 / 15)
    assert st.acceptance_rate_per_pos == pytest.approx([4 / 5, 3 / 5, 2 / 5])  # / drafts, not conditional
    # ours: a position is attempted when the previous one was accepted
    assert st.num_attempted_per_pos == [5, 4, 3]
    assert st.conditional_acceptance_rate_per_pos == pytest.approx([4 / 5, 3 / 4, 2 / 3])
    assert st.accepted_tokens_histogram == [1, 1, 1, 2]
    assert (st.emitted, st.target_forwards) == (15, 6)
    assert st.tokens_per_forward == pytest.approx(15 / 6)  # the undrafted round counts here, not above
    s = st.summary()
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos",
                 "mean_acceptance_length", "draft_acceptance_rate", "acceptance_rate_per_pos"):
        assert s[name] == pytest.approx(getattr(st, name)), name


def test_tokens_per_forward_equals_mean_acceptance_length_when_every_round_drafts(tiny, prompts):
    # every round drafts 3 and nothing is cut: emitted = accepted + one target token per round
    st = _scripted(tiny, prompts, [2, 3, 0, 1, 3], k=3, n=14)
    assert (st.num_drafts, st.target_forwards, st.emitted) == (5, 5, 14)
    assert st.tokens_per_forward == pytest.approx(st.mean_acceptance_length) == pytest.approx(1 + 9 / 5)
    # the length limit shortens the last draft (budget = 1 token left before the limit, 2 to emit)
    st = _scripted(tiny, prompts, [3, 3], k=3, n=6)
    assert [(r.num_draft_tokens, r.num_accepted_tokens) for r in st.rounds] == [(3, 3), (1, 1)]
    assert st.draft_acceptance_rate == 1.0 and st.acceptance_rate_per_pos == [1.0, 0.5, 0.5]


def _documented() -> set[str]:
    """Every `name` the first column of docs/metrics.md's mapping table gives (each figure once), and
    the per-round keys it lists."""
    table = DOC.read_text().split("## The table", 1)[1].split("##", 1)[0]
    firsts = [line.split("|")[1] for line in table.splitlines() if line.startswith("| ")]
    names = [n for cell in firsts for n in re.findall(r"`([a-z_][a-z0-9_]*)(?:\[[a-z]\])?`", cell)]  # name or name[i]
    assert len(names) == len(set(names)), "a name documented twice"
    per_round = DOC.read_text().split("Per round, `decode --json` prints", 1)[1].split("##", 1)[0]
    return set(names) | set(re.findall(r"`([a-z_]+)`", per_round))


def _check_names(keys, where):
    keys = set(keys)
    assert not keys & RETIRED, (where, keys & RETIRED)
    assert keys - LABELS <= _documented(), (where, keys - LABELS - _documented())


def test_decode_json_bench_and_replay_share_one_documented_vocabulary(tiny, prompts, ckpt, capsys, tmp_path):
    shared = set(DecodeStats("strict", 3, None).acceptance_metrics())
    vllm = {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos",
            "mean_acceptance_length", "draft_acceptance_rate", "acceptance_rate_per_pos"}
    assert vllm <= shared
    # decode --json: round lines and the summary
    assert main(["decode", "--target", ckpt, "--drafter", "self:skip=1", "--prompt", "hello", "-k", "3",
                 "--max-new-tokens", "10", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    summary = lines[-1]["summary"]
    assert shared <= set(summary)
    _check_names(summary, "decode --json summary")
    for r in lines[:-1]:
        _check_names(r, "decode --json round")
    assert sum(r["num_accepted_tokens"] for r in lines[:-1]) == summary["num_accepted_tokens"]
    # a bench row
    row = bench_row(_scripted(tiny, prompts, [1, 2, 3], k=3, n=8), "chain k=3")
    assert shared <= set(row)
    _check_names(row, "bench row")
    # replay.json rows: the same names, and the same values as the statistics they count
    tracegen.write_run(tmp_path, tracegen.make_steps(seed=1))
    res = replay(tmp_path, ks=(2,), tree_widths=(), static=())
    for spec, rows in res.rows.items():
        for r in rows:
            assert shared <= set(r)
            _check_names(set(r) - {"predicted"}, f"replay.json {spec}")
            st = res.config(spec, r["shape"]["label"]).stats()
            assert {n: r[n] for n in vllm} == st.vllm_metrics()
