"""train-drafter (issue 31): --heldout-examples 0 records "not evaluated", never a perfect score;
a run folder with other settings is refused naming the settings that differ; docs/training.md
says what `--prompts self` downloads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from draftcert.cli import main
from tests.tiny_models import tiny_qwen3
from draftcert.prompts import SHAREGPT_WHEEL
from draftcert.train import TrainConfig, train_drafter
from draftcert.train.distill_data import HELDOUT_SOURCES

HELD = ["Write a haiku about rain."]
ROOT = Path(__file__).resolve().parents[2]


def _target():
    model, tok = tiny_qwen3(0, num_layers=2, hidden_size=48, intermediate_size=96, init_std=0.15)
    model.to(torch.float64)
    model.generation_config.eos_token_id = 258
    return model, tok


def _cfg(**kw):
    base = dict(examples=4, heldout_examples=0, max_prompt_tokens=12, max_new_tokens=8, draft_vocab=64, epochs=1,
                batch_tokens=128, eval_every=1, warmup=1, checkpoint_every=100, user_eval_prompts=0)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return _target()


def test_no_heldout_examples_is_not_evaluated(tiny, tmp_path):
    target, tok = tiny
    path = train_drafter(_cfg(), tmp_path, target=target, tokenizer=tok, heldout=HELD, progress=False, quiet=True)
    assert path is not None and path.is_file()
    result = json.loads((tmp_path / "train.json").read_text())
    assert result["heldout_eval_fp16"] is None and result["draft_vocab_coverage"] is None
    log = (tmp_path / "train.log").read_text()
    assert "covers 0.000" not in log and "not evaluated" in log
    assert not re.search(r"^\S+ eval ", log, re.M)  # no progress evaluation over nothing


def test_other_settings_are_named(tiny, tmp_path):
    target, tok = tiny
    train_drafter(_cfg(), tmp_path, target=target, tokenizer=tok, heldout=HELD, progress=False, quiet=True)
    with pytest.raises(ValueError) as info:
        train_drafter(_cfg(lr=1e-4, seed=7), tmp_path, target=target, tokenizer=tok, heldout=HELD, progress=False,
                      quiet=True)
    msg = str(info.value)
    assert msg.startswith("--out:") and "other settings" in msg
    assert "lr: was 0.001, now 0.0001" in msg and "seed: was 0, now 7" in msg and "epochs" not in msg


def test_negative_heldout_examples_is_refused(capsys, tmp_path, monkeypatch):
    import draftcert.cli.train as cli_train

    monkeypatch.setattr(cli_train, "train_drafter", lambda *a, **kw: pytest.fail("trained with -1 held out"))
    assert main(["train-drafter", "--out", str(tmp_path / "t"), "--heldout-examples", "-1"]) == 2
    assert capsys.readouterr().err.strip().startswith("draftcert: error: --heldout-examples:")


def test_training_doc_says_what_prompts_self_downloads():
    text = " ".join((ROOT / "docs" / "training.md").read_text().split())
    assert "nothing downloaded" not in text and "nothing is downloaded" not in text
    assert "sharegpt" in HELDOUT_SOURCES  # the held-out filter reads ShareGPT's wheel, even for --prompts self
    assert f"{SHAREGPT_WHEEL.size_mb} MB" in text and "`--prompts self` fetches" in text
