"""`replay --calibrate` never quotes a speed-up from impossible timings (issue 31, item 2).

On a loaded machine a calibration once timed a 1-token target pass at 0.146 s and an 8-token pass at
0.085 s, then printed `best: tree 2x1, predicted speedup 2.028` and report.md repeated it.  Now the
calibration checks its timings (``speed.timing_problems``), times again a bounded number of times
(``speed.RETIMES``), and if they stay unreliable the replay says so ("timings unreliable: ...") in the
printed output and in report.md and quotes no predicted speed-up.  The timer is faked at its public
seam, ``draftcert.replay.speed.time_interleaved`` (the one timer of decode/draft_shape/costs.py)."""

from __future__ import annotations

import json

import pytest
import torch

from draftcert.cli import main
from draftcert.decode.draft_shape.costs import Costs
from draftcert.replay import speed


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    from tests.tiny_models import tiny_qwen3

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("unreliable-cal")
    model, tok = tiny_qwen3(3, num_layers=2, hidden_size=32, intermediate_size=64, init_std=0.3)
    model.generation_config.eos_token_id = None
    model.save_pretrained(root / "ckpt")
    tok.save_pretrained(root / "ckpt")
    (root / "prompts.txt").write_text("Say hello.\nCount to five.\n")
    out = root / "run"
    assert main(["profile", "--target", str(root / "ckpt"), "--drafter", "self:skip=1", "--prompts",
                 str(root / "prompts.txt"), "--max-new-tokens", "8", "--criteria", "strict,tree:2",
                 "--out", str(out), "--no-progress", "--no-report"]) == 0
    return out


def _fake_timer(calls: list, bad_attempts: int):
    """A stand-in for ``time_interleaved``: plausible timings, except that in the first ``bad_attempts``
    calls every target pass of more than one token is timed cheaper (0.085 s) than the 1-token pass
    (0.146 s), as on the loaded machine of the issue."""

    def fake(jobs, run, repeats, *, before=None, after=None, on_progress=None, samples=None):
        calls.append(len(jobs))
        bad = len(calls) <= bad_attempts
        med = {}
        for kind, n in jobs:
            if kind in ("t", "g"):
                v = (0.146 if n == 1 else 0.085) if bad else 0.02 + 0.001 * n
            elif kind == "tt":
                v = 0.085 if bad else 0.02 + 0.0012 * n
            elif kind == "tp":
                v = 0.4
            elif kind in ("d", "dr", "dp"):
                v = 0.005
            else:
                v = 0.0005
            med[(kind, n)] = v
        if samples is not None:
            samples.update({j: [v] * repeats for j, v in med.items()})
        return med

    return fake


def test_impossible_timings_are_retimed_then_reported_unreliable(recorded, tmp_path, monkeypatch, capsys):
    import shutil

    run = shutil.copytree(recorded, tmp_path / "run")
    calls: list = []
    monkeypatch.setattr(speed, "time_interleaved", _fake_timer(calls, bad_attempts=99))
    assert main(["replay", str(run), "--calibrate", "--repeats", "2", "-k", "1-2", "--trees", "2", "--static", "",
                 "--no-figures", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "timings unreliable" in out
    assert "cheaper than a 1-token one" in " ".join(out.split())
    assert "predicted speedup" not in out  # no speed-up quoted from them, and no "best" chosen by them
    assert "best: not chosen: timings unreliable" in out
    assert len(calls) == 1 + speed.RETIMES  # re-timed, a bounded number of times
    cal = json.loads((run / "calibration.json").read_text())
    assert cal["unreliable"]  # kept with the calibration: a later replay and the report say it too
    rj = json.loads((run / "replay.json").read_text())
    assert rj["timings_unreliable"] and all(r["recommended"] is None for r in rj["rules"].values())
    assert all(c["predicted"] is None and c["predicted_unreliable"]["speedup"] > 0
               for r in rj["rules"].values() for c in r["configs"])

    assert main(["replay", str(run), "-k", "1-2", "--trees", "2", "--static", "", "--no-figures"]) == 0  # reuses it
    again = capsys.readouterr().out
    assert "timings unreliable" in again and "predicted speedup" not in again

    assert main(["report", str(run)]) == 0
    md = (run / "report.md").read_text()
    assert "timings unreliable" in md
    assert "x)" not in md.split("## Replay", 1)[1].split("###", 1)[0]  # no "(2.03x)" in the best column


def test_a_retime_that_comes_back_sound_is_used(recorded, tmp_path, monkeypatch, capsys):
    import shutil

    run = shutil.copytree(recorded, tmp_path / "run")
    calls: list = []
    monkeypatch.setattr(speed, "time_interleaved", _fake_timer(calls, bad_attempts=1))
    assert main(["replay", str(run), "--calibrate", "--repeats", "2", "-k", "1-2", "--trees", "2", "--static", "",
                 "--no-figures", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert len(calls) == 2
    assert "timings unreliable" not in out and "predicted speedup" in out
    assert "re-timed 1 time(s)" in out
    assert json.loads((run / "calibration.json").read_text())["unreliable"] == []


def test_timing_problems():
    ok = Costs("calibrated", {1: 0.020, 2: 0.021, 5: 0.024}, {1: 0.004}, target_tree={3: 0.023, 5: 0.025},
               target_prefill=0.3, prompt_length=64)
    assert speed.timing_problems(ok) == []
    assert speed.timing_problems(ok, {("t", 1): [0.020, 0.021, 0.020], ("g", 1): [0.02, 0.02, 0.021]}) == []
    # noise within 20 % is not impossible: a 2-token pass 10 % cheaper than the 1-token one passes
    assert speed.timing_problems(Costs("calibrated", {1: 0.020, 2: 0.018}, {1: 0.004})) == []
    bad = Costs("calibrated", {1: 0.146, 8: 0.085}, {1: 0.004}, target_tree={4: 0.05}, target_prefill=0.01,
                prompt_length=64)
    probs = speed.timing_problems(bad)
    assert len(probs) == 3 and "8-token target pass" in probs[0] and "tree" in probs[1] and "prefill" in probs[2]
    drift = speed.timing_problems(ok, {("t", 1): [0.02, 0.04, 0.02], ("o", 1): [1e-4] * 3})
    assert len(drift) == 1 and "disagree by 100%" in drift[0]
