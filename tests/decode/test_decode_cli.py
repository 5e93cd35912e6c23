"""``draftcert decode`` / ``draftcert bench`` on a tiny local checkpoint (no downloads)."""

from __future__ import annotations

import json

import pytest

from draftcert.cli import main
from draftcert.decode import greedy_generate
from draftcert.prompts import encode_prompt



def _loaded(path):
    from draftcert.models import load_target

    return load_target(path)


def test_decode_json_rounds_reassemble_the_greedy_output(ckpt, capsys):
    rc = main(["decode", "--target", ckpt, "--drafter", "self:skip=1", "--prompt", "hello there", "-k", "3",
               "--max-new-tokens", "12", "--json"])
    assert rc == 0
    lines = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    rounds, summary = lines[:-1], lines[-1]["summary"]
    toks = [t for r in rounds for t in r["emitted"]]
    model, tok = _loaded(ckpt)
    assert toks == greedy_generate(model, encode_prompt(tok, "hello there"), 12)
    assert summary["emitted"] == len(toks) == 12 and summary["target_forwards"] == len(rounds)
    assert all(set(r) >= {"num_draft_tokens", "num_accepted_tokens", "drift_tokens", "from_draft", "certified", "kl", "radius", "text"} for r in rounds)
    # vLLM's counters in the summary reconcile with the round lines
    assert summary["num_accepted_tokens"] == sum(r["num_accepted_tokens"] for r in rounds)
    assert summary["num_drafts"] == sum(r["num_draft_tokens"] > 0 for r in rounds)
    assert summary["num_draft_tokens"] == sum(r["num_draft_tokens"] for r in rounds)
    assert summary["checked_positions"] == sum(r["checked_positions"] for r in rounds)


def test_decode_text_streams_without_colour_when_piped(ckpt, capsys):
    rc = main(["decode", "--target", ckpt, "--drafter", "prompt-lookup", "--prompt", "abc abc abc", "--tree", "2,3",
               "--max-new-tokens", "8", "--baseline"])
    assert rc == 0
    cap = capsys.readouterr()
    assert "\033[" not in cap.out
    assert "tokens/target forward" in cap.err and "identical: True" in cap.err


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["decode", "--prompt", "  "], "--prompt"),
        (["decode", "--prompt", "x", "-k", "-1"], "-k"),
        (["decode", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["bench", "--criteria", "bogus"], "unknown rule"),
    ],
)
def test_cli_bad_input(ckpt, capsys, argv, msg):
    argv = argv[:1] + ["--target", ckpt, "--drafter", "self:skip=1"] + argv[1:]
    assert main(argv) == 2
    assert msg in capsys.readouterr().err


def test_cli_needs_drafter_for_other_targets(ckpt, capsys):
    assert main(["decode", "--target", ckpt, "--prompt", "x"]) == 2
    assert "--drafter" in capsys.readouterr().err


def test_bench_json_rows(ckpt, capsys):
    rc = main(["bench", "--target", ckpt, "--drafter", "self:skip=1", "--prompt", "one two", "--prompt", "three",
               "--criteria", "strict,additive:0.2,tree:2", "--max-new-tokens", "8", "-k", "2", "--json"])
    assert rc == 0
    alone, *rows = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert [r["criterion"] for r in rows] == ["strict", "additive:0.2", "tree:2"]
    # the target's own greedy decoding first (issue 51): one token a forward, the tokens strict emits
    assert (alone["criterion"], alone["draft"], alone["tokens_per_forward"]) == ("target alone", "none", 1.0)
    assert alone["emitted"] == alone["target_forwards"] == rows[0]["emitted"] and alone["num_drafts"] == 0
    assert alone["tokens_per_second"] > 0 and alone["certified_fraction"] is None and sorted(alone) == sorted(rows[0])
    assert rows[0]["drift"] == 0 and rows[2]["drift"] == 0
    assert rows[2]["draft"] == "tree m=2, depth=2"
    assert all(r["tokens_per_forward"] >= 1 for r in rows)
    for r in rows:  # vLLM's figures from the merged counters of both prompts
        assert r["mean_acceptance_length"] == pytest.approx(1 + r["num_accepted_tokens"] / r["num_drafts"])
        assert r["draft_acceptance_rate"] == pytest.approx(r["num_accepted_tokens"] / r["num_draft_tokens"])
        assert sum(r["num_accepted_tokens_per_pos"]) == r["num_accepted_tokens"]


def test_colour_only_on_a_tty_without_no_color(monkeypatch):
    import argparse

    from draftcert.cli.decode import use_color

    class Tty:
        def isatty(self):
            return True

    class Pipe:
        def isatty(self):
            return False

    args = argparse.Namespace(no_color=False)
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm")
    assert use_color(args, Tty()) and not use_color(args, Pipe())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_color(args, Tty())
    monkeypatch.delenv("NO_COLOR")
    assert not use_color(argparse.Namespace(no_color=True), Tty())
