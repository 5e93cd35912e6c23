"""Per-position acceptance (vLLM's and the conditional one) and the accepted-tokens histogram in
DecodeStats, decode --json and bench."""

from __future__ import annotations

import json

import pytest
import torch

from draftcert.cli import main
from draftcert.decode import speculative_generate


@pytest.mark.parametrize("spec,tree", [("strict", None), ("additive:0.05", None), ("strict", (2, 3)), ("strict", [2, 2, 1])])
def test_histogram_and_positions_count_the_rounds(tiny, prompts, spec, tree):
    target, drafter, _ = tiny
    st = speculative_generate(target, drafter, prompts[1], spec, k=4, tree=tree, max_new_tokens=20).stats
    hist = st.accepted_tokens_histogram
    drafted = [r for r in st.rounds if r.num_draft_tokens]
    assert sum(hist) == len(drafted) and len(hist) == (len(tree) if isinstance(tree, list) else 3 if tree else 4) + 1
    assert sum(n * h for n, h in enumerate(hist)) == sum(r.num_accepted_tokens for r in st.rounds)
    assert st.num_attempted_per_pos[0] == len(drafted) == st.num_drafts
    # a depth is attempted exactly when the previous one was accepted (and the node had children)
    acc = st.num_accepted_tokens_per_pos
    assert all(a <= b for a, b in zip(st.num_attempted_per_pos[1:], acc))
    assert st.conditional_acceptance_rate_per_pos == [a / n for a, n in zip(acc, st.num_attempted_per_pos)]
    assert st.acceptance_rate_per_pos == [a / len(drafted) for a in acc]  # vLLM's: not conditional
    s = st.summary()
    assert s["accepted_tokens_histogram"] == hist and s["num_attempted_per_pos"] == st.num_attempted_per_pos
    assert s["num_accepted_tokens_per_pos"] == acc and "accepted_by_depth" not in s  # one name: vLLM's
    assert s["mean_acceptance_length"] == pytest.approx(1 + sum(acc) / len(drafted))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, target_factory):
    model, tok = target_factory(seed=2, layers=3)
    model.to(torch.float32)
    path = tmp_path_factory.mktemp("tiny-pos") / "ckpt"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_decode_json_and_bench_report_positions(ckpt, capsys):
    assert main(["decode", "--target", ckpt, "--drafter", "self:skip=1", "--prompt", "hello", "-k", "3",
                 "--max-new-tokens", "10", "--json"]) == 0
    s = json.loads(capsys.readouterr().out.splitlines()[-1])["summary"]
    assert len(s["conditional_acceptance_rate_per_pos"]) >= 1 and sum(s["accepted_tokens_histogram"]) >= 1
    assert s["num_drafts"] == sum(s["accepted_tokens_histogram"]) and s["draft_acceptance_rate"] is not None
    assert main(["bench", "--target", ckpt, "--drafter", "self:skip=1", "--prompt", "hi", "--prompt", "yo",
                 "--criteria", "strict,tree:2", "-k", "3", "--max-new-tokens", "8", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()][1:]  # after the target alone's
    assert all(len(r["accepted_tokens_histogram"]) == 4 and len(r["conditional_acceptance_rate_per_pos"]) <= 3 for r in rows)
    assert all(r["num_drafts"] == sum(r["accepted_tokens_histogram"]) for r in rows)
    assert main(["bench", "--target", ckpt, "--drafter", "self:skip=1", "--prompt", "hi", "--criteria", "strict",
                 "-k", "2", "--max-new-tokens", "6"]) == 0
    assert "acceptance_rate_per_pos 1, 2, ..." in capsys.readouterr().out
