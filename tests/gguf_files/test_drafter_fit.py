"""A drafter from its own GGUF file compared with its target before any work (models.tokenizer_fit):
another vocabulary, other probe ids, another bos/eos are one `--drafter:` error line naming the
difference; padding rows past the vocabulary and another padding id are handled and said once."""

from __future__ import annotations

import json

import pytest

from draftcert.cli import main
from draftcert.decode import greedy_generate, speculative_generate
from draftcert.models import load_drafter, load_target
from draftcert.models.hf import output_rows
from tests.test_cli_errors import _one_error_line
from tests.tiny_gguf import write_tiny_llama

Q8 = {k: 8 for k in ("emb", "q", "k", "v", "o", "gate", "up", "down", "out")}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A target and drafters that differ from it in one way each."""
    d = tmp_path_factory.mktemp("fit")
    write_tiny_llama(d / "target.gguf", tied=False, qtypes=Q8, tokenizer=True)
    variants = {
        "same": dict(tokenizer=True),
        "swapped": dict(tokenizer={"swap": (10, 20)}),
        "eos": dict(tokenizer={"eos": 94}),
        "pad": dict(tokenizer={"pad": 95}),
        "more-rows": dict(tokenizer=True, rows=112),
        "more-tokens": dict(tokenizer={"vocab": 112}, rows=112),
    }
    for name, kw in variants.items():
        write_tiny_llama(d / f"{name}.gguf", tied=True, qtypes=Q8, layers=1, seed=3, **kw)
    # the same 98 tokens split differently: "the" is t|he for the target (merge "h e" first), th|e for its drafter
    write_tiny_llama(d / "merge-target.gguf", tied=False, qtypes=Q8, rows=98,
                     tokenizer={"vocab": 98, "extra_tokens": ["he", "th"], "merges": ["h e", "t h"]})
    write_tiny_llama(d / "other-merges.gguf", tied=True, qtypes=Q8, layers=1, seed=3, rows=98,
                     tokenizer={"vocab": 98, "extra_tokens": ["he", "th"], "merges": ["t h", "h e"]})
    write_tiny_llama(d / "padded-target.gguf", tied=False, qtypes=Q8, tokenizer=True, rows=128)
    return d


@pytest.fixture
def cache(monkeypatch, tmp_path_factory):
    monkeypatch.setenv("DRAFTCERT_CACHE", str(tmp_path_factory.getbasetemp() / "fit-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _decode(target, drafter, capsys):
    code = main(["decode", "--target", str(target), "--drafter", str(drafter), "--prompt", "the cat", "-k", "3",
                 "--max-new-tokens", "8", "--no-progress", "--no-warmup", "--json", "--baseline"])
    return code, capsys.readouterr()


@pytest.mark.parametrize("drafter, phrase", [
    ("swapped", "token id 10 is '+' in the target's tokenizer and '5' in the drafter's"),
    ("eos", "the eos token is id 95 ('<|endoftext|>') for the target and 94 ('Ġ') for the drafter"),
    ("more-tokens", "the target's tokenizer has 96 tokens and the drafter's 112: the drafter's has 16 the target's lacks"),
])
def test_a_drafter_with_another_vocabulary_is_one_error_line(drafter, phrase, files, cache, capsys):
    code, out = _decode(files / "target.gguf", files / f"{drafter}.gguf", capsys)
    assert code == 2
    line = _one_error_line(out.err, "--drafter:")
    assert phrase in line, line


def test_the_same_vocabulary_split_another_way_is_one_error_line(files, cache, capsys):
    code, out = _decode(files / "merge-target.gguf", files / "other-merges.gguf", capsys)
    assert code == 2
    line = _one_error_line(out.err, "--drafter:")
    assert "the probe text" in line and "first different at position" in line, line


@pytest.mark.parametrize("target, drafter, note", [
    ("target.gguf", "more-rows.gguf", "the drafter's output layer has 112 rows and the target's 96"),
    ("padded-target.gguf", "same.gguf", "gives the 32 padding rows it lacks q = 0"),
    ("target.gguf", "pad.gguf", "the padding id is None for the target and 95 for the drafter"),
])
def test_harmless_differences_are_handled_and_said_once(target, drafter, note, files, cache, capsys):
    code, out = _decode(files / target, files / drafter, capsys)
    assert code == 0, out.err
    notes = [ln for ln in out.err.splitlines() if ln.startswith("draftcert: drafter fitted to the target")]
    assert len(notes) == 1 and note in notes[0], out.err
    summary = json.loads(out.out.strip().splitlines()[-1])["summary"]
    assert summary["baseline_match"] is True and summary["num_draft_tokens"] > 0  # strict stays lossless


def test_a_fitted_drafter_answers_for_the_target_rows(files, cache):
    """More rows: the drafter computes the target's first rows; fewer: -inf (q = 0) on the padding rows."""
    target, tok = load_target(str(files / "target.gguf"))
    drafter = load_drafter(str(files / "more-rows.gguf"), target, tok)
    assert output_rows(drafter) == 96 == drafter.config.vocab_size
    padded, ptok = load_target(str(files / "padded-target.gguf"))
    small = load_drafter(str(files / "same.gguf"), padded, ptok)
    import torch

    logits = small(torch.tensor([[5, 6, 7]])).logits
    assert logits.shape[-1] == 128 and torch.isneginf(logits[..., 96:]).all() and torch.isfinite(logits[..., :96]).all()
    ids = ptok("the cat")["input_ids"]
    assert list(speculative_generate(padded, small, ids, "strict", k=3, max_new_tokens=8).tokens) == \
        greedy_generate(padded, ids, 8)
