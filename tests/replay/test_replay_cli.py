"""End to end on a tiny local checkpoint: `draftcert profile --drafter`, `replay --calibrate`
(which reloads the run's models), a second `replay` reusing calibration.json, `explain`."""

from __future__ import annotations

import json

import pytest
import torch

from draftcert.cli import main

pytestmark = pytest.mark.usefixtures("sound_timings")  # plumbing, not the timings' noise (conftest)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from tests.tiny_models import tiny_qwen3

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("replay-cli")
    model, tok = tiny_qwen3(3, num_layers=3, hidden_size=48, intermediate_size=96, init_std=0.3)
    model.generation_config.eos_token_id = None
    model.save_pretrained(root / "ckpt")
    tok.save_pretrained(root / "ckpt")
    (root / "prompts.txt").write_text("Say hello.\nCount to five.\n")
    out = root / "run"
    assert main(["profile", "--target", str(root / "ckpt"), "--drafter", "self:skip=1", "--prompts",
                 str(root / "prompts.txt"), "--max-new-tokens", "10", "--criteria", "strict,additive:0.1,tree:2",
                 "--out", str(out), "--no-progress", "--no-report"]) == 0
    return out


def test_calibrate_then_reuse(run, capsys):
    assert main(["replay", str(run), "--calibrate", "--repeats", "1", "-k", "1-3", "--trees", "2", "--static", "2,2"]) == 0
    out = capsys.readouterr().out
    assert "best:" in out and all(len(line) <= 80 for line in out.splitlines() if not line.startswith("wrote "))
    cal = json.loads((run / "calibration.json").read_text())
    assert cal["source"] == "calibrated" and float(cal["target"]["1"]) > 0 and cal["target_tree"]
    rj = json.loads((run / "replay.json").read_text())
    assert rj["costs"]["source"] == "calibrated"
    for spec in ("strict", "additive:0.1", "tree:2"):
        rec = rj["rules"][spec]["recommended"]
        assert rec["speedup"] > 0 and rec["shape"] in {c["shape"]["label"] for c in rj["rules"][spec]["configs"]}
        assert all(c["predicted"]["tokens_per_second"] > 0 for c in rj["rules"][spec]["configs"])
    assert main(["replay", str(run), "-k", "1-2", "--trees", "", "--static", ""]) == 0  # reuses calibration.json
    assert "calibrated" in json.loads((run / "replay.json").read_text())["costs"]["source"]
    capsys.readouterr()
    assert main(["explain", str(run), "-k", "2"]) == 0
    ex = json.loads((run / "explain.json").read_text())
    assert set(ex["rules"]) == {"strict", "additive:0.1", "tree:2"}
    ev = [e for r in ex["rules"].values() for e in r["events"]]
    assert ev and all(e["text"] is not None for e in ev)  # the tokenizer was found through run.json's target
