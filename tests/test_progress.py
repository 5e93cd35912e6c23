"""Progress at the granularity of work (issue 23, item 5): bars that move per token, not per
batch, for profile, train-drafter's stages and replay --calibrate; and --no-progress, which
silences every bar, transformers' "Loading weights" included."""

from __future__ import annotations

import pytest
import torch
import tqdm.auto

from draftcert.cli import main
from draftcert.models import derive_drafter
from tests.tiny_models import tiny_qwen3
from draftcert.profile import profile
from draftcert.replay.speed import calibrate
from draftcert.replay.walk import Shape
from draftcert.train.distill_data import generate_examples

torch.set_num_threads(1)  # a shared machine: tiny reductions on 2 threads wait on each other


class _Recorder(tqdm.auto.tqdm):
    """A tqdm that remembers every bar and the position after each update."""

    bars: list = []

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.seen = [self.n]
        _Recorder.bars.append(self)

    def update(self, n=1):
        out = super().update(n)
        self.seen.append(self.n)
        return out


@pytest.fixture
def recorder(monkeypatch):
    _Recorder.bars = []
    monkeypatch.setattr(tqdm.auto, "tqdm", _Recorder)  # the bars import it at call time
    return _Recorder


def _bar(rec, desc):
    (bar,) = [b for b in rec.bars if b.desc.startswith(desc)]
    return bar


def _tiny():
    model, tok = tiny_qwen3(0, vocab_size=320, hidden_size=32, num_layers=2, intermediate_size=64, init_std=0.5)
    model.generation_config.eos_token_id = None  # full-length rows: a predictable number of steps
    return model, tok


def test_profile_bar_moves_per_token_within_a_batch(recorder, tmp_path):
    model, tok = _tiny()
    profile((model, tok), prompts=["one", "two", "three"], out=tmp_path / "p", max_new_tokens=5, batch_size=3,
            criteria="strict", progress=True)
    bar = _bar(recorder, "profile")
    assert bar.total == 3 * 5 and bar.seen[-1] == 15
    # one batch of 3 prompts: the bar moves at every decode step (3 tokens each), not once at its end
    assert len(set(bar.seen)) >= 5 and 0 < bar.seen[1] < 15


def test_train_data_stages_move_per_token(recorder):
    model, tok = _tiny()
    examples, _ = generate_examples(model, tok, 2, max_prompt_tokens=12, max_new_tokens=3, batch=2, progress=True,
                                    log=lambda *_: None)
    assert len(examples) == 2
    prompts, answers = _bar(recorder, "writing prompts"), _bar(recorder, "writing answers")
    assert len(set(prompts.seen)) >= 4 and prompts.seen[-1] == prompts.total  # per generated token
    assert answers.total == 2 * 3 and len(set(answers.seen)) >= 3 and answers.seen[-1] == 6


def test_calibrate_reports_every_timed_forward():
    model, _ = _tiny()
    drafter = derive_drafter(model, "self:skip=1")
    seen = []
    calibrate(model, drafter, [Shape((1,) * 2)], context=8, prompt_length=4, repeats=1,
              on_progress=lambda done, total: seen.append((done, total)))
    total = seen[-1][1]
    assert [d for d, _ in seen] == list(range(1, total + 1)) and all(t == total for _, t in seen)


BAR_MARKS = ("Loading weights", "%|", "it/s]", "tok/s]")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model, tok = _tiny()
    d = tmp_path_factory.mktemp("tiny-ckpt")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


@pytest.mark.parametrize("argv", [
    ["profile", "--prompts", "{prompts}", "--max-new-tokens", "2", "--criteria", "strict", "--out", "{out}", "--no-report"],
    ["bench", "--prompt", "hi", "--criteria", "strict", "--drafter", "self:skip=1", "--max-new-tokens", "2", "-k", "1"],
])
def test_no_progress_silences_every_bar(argv, ckpt, tmp_path, capsys):
    (tmp_path / "p.txt").write_text("hello\n")
    argv = [a.format(prompts=tmp_path / "p.txt", out=tmp_path / "o") for a in argv] + ["--target", ckpt]
    assert main(argv) == 0
    shown = capsys.readouterr().err
    assert any(m in shown for m in BAR_MARKS), shown  # the check can fail: bars do show by default
    import shutil

    shutil.rmtree(tmp_path / "o", ignore_errors=True)
    assert main(argv + ["--no-progress"]) == 0
    err = capsys.readouterr().err
    assert not [m for m in BAR_MARKS if m in err], err
