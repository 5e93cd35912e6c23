"""A calibration that lacks some draft shapes (issue 23, item 2).

A feature drafter's drafting is timed per draft shape, so a calibration made for some rules used to
break every later replay of the others (`draftcert replay R` exited 2 naming a shape no option
names) and silently drop the report's Replay section.  Now ``replay --calibrate`` times every
rule's default shapes whatever ``--rules`` says; a replay whose shapes a calibration lacks (one made
by an older draftcert, or custom shapes) prints its exact acceptance figures with one note naming
the untimed shapes and the command that times them; and a report says in report.md and report.html
what its Replay section leaves out, or why it could not be built, with the command that fills it.

Tiny local checkpoint, a random tiny feature drafter saved beside it, rules strict and tree:3
(tree:3's (3, k) trees are no default shape of strict)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from draftcert.cli import main

pytestmark = pytest.mark.usefixtures("sound_timings")  # plumbing, not the timings' noise (conftest)
from draftcert.decode.draft_shape.costs import Costs
from draftcert.replay import Shape, load_replay_trace, replay
from draftcert.replay import report_section as replay_report
from draftcert.replay.api import calibration_shapes

CRITERIA = "strict,tree:3"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    from tests.tiny_models import tiny_qwen3
    from draftcert.models.eagle import EagleDrafter, save_eagle

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("partial-cal")
    model, tok = tiny_qwen3(3, num_layers=3, hidden_size=48, intermediate_size=96, init_std=0.3)
    model.generation_config.eos_token_id = None
    model.save_pretrained(root / "ckpt")
    tok.save_pretrained(root / "ckpt")
    torch.manual_seed(1)
    save_eagle(EagleDrafter(model, torch.arange(200), init_from_last_layer=True), root / "drafter.safetensors")
    (root / "prompts.txt").write_text("Say hello.\nCount to five.\n")
    out = root / "run"
    assert main(["profile", "--target", str(root / "ckpt"), "--drafter", str(root / "drafter.safetensors"),
                 "--prompts", str(root / "prompts.txt"), "--max-new-tokens", "10", "--criteria", CRITERIA,
                 "--out", str(out), "--no-progress", "--no-report"]) == 0
    return out


@pytest.fixture
def run(recorded, tmp_path):
    """A fresh copy of the recorded run (tests write calibration.json and reports into it)."""
    return shutil.copytree(recorded, tmp_path / "run")


def _calibrate_strict_only(run, capsys):
    assert main(["replay", str(run), "--calibrate", "--rules", "strict", "--repeats", "1", "--no-figures"]) == 0
    capsys.readouterr()


def _drop_tree3(run) -> None:
    """calibration.json as a calibration made without the (3, k) trees leaves it."""
    cal = json.loads((run / "calibration.json").read_text())
    cal["drafter_round"] = {k: v for k, v in cal["drafter_round"].items() if set(k.split(",")) != {"3"}}
    (run / "calibration.json").write_text(json.dumps(cal))


def test_issue_sequence_calibrate_one_rule_then_replay_and_report(run, capsys):
    """The issue's commands: `replay R --calibrate --rules strict --repeats 1`, `replay R`, `report R`."""
    _calibrate_strict_only(run, capsys)
    costs = Costs.from_dict(json.loads((run / "calibration.json").read_text()))
    assert costs.feature and {"3", "3,3", ",".join(["3"] * 8)} <= set(costs.drafter_round)
    assert Shape((3,) * 8) in calibration_shapes(run, rules="strict")  # every rule's defaults, whatever --rules
    assert main(["replay", str(run), "--no-figures"]) == 0
    out = capsys.readouterr().out
    assert "no drafting time" not in out and "tree:3" in out
    rj = json.loads((run / "replay.json").read_text())
    assert rj["missing_costs"] == {}
    for spec in CRITERIA.split(","):
        assert all(c["predicted"] and c["predicted"]["speedup"] > 0 for c in rj["rules"][spec]["configs"]), spec
        assert rj["rules"][spec]["recommended"]["untimed"] == 0
    assert main(["report", str(run), "-q"]) == 0
    page = (run / "report.html").read_text()
    assert "<h2>Replay</h2>" in page and "best (predicted speedup)" in page
    assert "Not built" not in page and "Not in this section" not in page
    assert "replay section" not in (run / "report.md").read_text()


def test_replay_with_a_partial_calibration_prints_its_exact_figures_and_one_note(run, capsys):
    _calibrate_strict_only(run, capsys)
    _drop_tree3(run)
    assert main(["replay", str(run), "--no-figures"]) == 0  # was: exit 2, "no drafting time for draft shape 3"
    out = capsys.readouterr().out
    assert "tree 3x1 " in out and "tok/fwd" in out
    notes = [n for n in out.split("\nnote: ")[1:] if "no drafting time" in n]
    assert len(notes) == 1
    note = " ".join(notes[0].split())  # unfolded
    assert "tree 3x(1-8)" in note and f"`draftcert replay {run} --calibrate`" in note
    assert f"draftcert replay {run} --calibrate" in out  # the command is never folded inside
    rj = json.loads((run / "replay.json").read_text())
    assert rj["missing_costs"] == {"tree:3": [f"tree 3x{k}" for k in range(1, 9)]}
    exact = replay(load_replay_trace(run))  # no costs: the acceptance figures alone
    for spec in CRITERIA.split(","):
        for row, ref in zip(rj["rules"][spec]["configs"], exact.rows[spec]):
            for key in ("tokens_per_forward", "conditional_acceptance_rate_per_pos", "mean_acceptance_length",
                        "acceptance_rate_per_pos"):
                assert row[key] == ref[key], (spec, row["shape"]["label"], key)
    tree3 = rj["rules"]["tree:3"]
    assert all((c["predicted"] is None) == (c["shape"]["kind"] == "tree") for c in tree3["configs"])
    assert all(c["predicted"]["speedup"] > 0 for c in rj["rules"]["strict"]["configs"])
    assert tree3["recommended"]["shape"] == "static [3,2,2,1]" and tree3["recommended"]["untimed"] == 8
    # the note's command fills it
    assert main(["replay", str(run), "--calibrate", "--repeats", "1", "--no-figures"]) == 0
    assert "no drafting time" not in capsys.readouterr().out
    assert json.loads((run / "replay.json").read_text())["missing_costs"] == {}


def test_untimed_custom_shapes_name_the_options_that_time_them(run, capsys):
    _calibrate_strict_only(run, capsys)
    assert main(["replay", str(run), "--rules", "strict", "-k", "2-3", "--trees", "5", "--static", "",
                 "--no-figures"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "tree 5x(2-3)" in out and f"`draftcert replay {run} --calibrate -k 2-3 --trees 5 --static ''`" in out
    assert "(2 untimed left out)" in out  # the best shape is chosen among the timed ones, and says so


def test_report_says_what_its_replay_section_leaves_out(run, capsys):
    _calibrate_strict_only(run, capsys)
    _drop_tree3(run)
    assert main(["report", str(run), "-q"]) == 0
    page, md = (run / "report.html").read_text(), (run / "report.md").read_text()
    replay_html = page[page.index("<h2>Replay</h2>"):]
    assert "tok/fwd k=1" in replay_html and "<b>Not in this section:</b>" in replay_html
    assert "tree 3x(1-8)" in replay_html and f"<code>draftcert replay {run} --calibrate</code>" in replay_html
    assert "`" not in replay_html.split("<img")[0]  # no markdown left in the HTML
    replay_md = md[md.index("## Replay"):]
    assert "**Not in this section:**" in replay_md and f"`draftcert replay {run} --calibrate`" in replay_md
    summ = json.loads((run / "summary.json").read_text())
    assert summ["replay"]["rules"]["tree:3"]["untimed"] and summ["replay"]["missing"]


def test_report_without_calibration_says_how_to_add_speed(run):
    assert main(["report", str(run), "-q"]) == 0
    page = (run / "report.html").read_text()
    replay_html = page[page.index("<h2>Replay</h2>"):]
    assert "no calibration.json" in replay_html and f"<code>draftcert replay {run} --calibrate</code>" in replay_html


def test_a_replay_section_that_fails_says_so_in_place(run, monkeypatch):
    def broken(*a, **k):
        raise ValueError("the trace lacks a column; re-record it")

    monkeypatch.setattr(replay_report, "replay_section", broken)
    assert main(["report", str(run), "-q"]) == 0
    page, md = (run / "report.html").read_text(), (run / "report.md").read_text()
    replay_html = page[page.index("<h2>Replay</h2>"):]
    assert "Not built" in replay_html and "the trace lacks a column" in replay_html
    assert f"<code>draftcert replay {run}</code>" in replay_html
    assert "## Replay" in md and "the trace lacks a column" in md[md.index("## Replay"):]
    assert json.loads((run / "summary.json").read_text())["replay"]["skipped"].startswith("replay section skipped")
