"""``draftcert decode --target DIR`` on a hybrid model (a tiny random Qwen3.5 saved with a tokenizer):
a chain is lossless (--baseline checks it against the target alone), a tree is one error line before
any token is printed."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from draftcert.cli import main

from .families import FAMILIES


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    import transformers  # models extra

    from tests.tiny_models import tiny_tokenizer

    tok = tiny_tokenizer()
    cfg = FAMILIES["qwen3_5"]()
    cfg.vocab_size = 320  # the byte tokenizer's 259 tokens fit
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.Qwen3_5ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.3)
    d = tmp_path_factory.mktemp("qwen3_5")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_decode_chain_on_a_hybrid_is_its_greedy_text(hybrid_dir, capsys):
    rc = main(["decode", "--target", str(hybrid_dir), "--drafter", "prompt-lookup", "-k", "3", "--prompt",
               "abc abc abc abc", "--max-new-tokens", "12", "--baseline", "--repeats", "1", "--json",
               "--no-progress", "--no-warmup"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]
    assert summary["baseline_match"] is True


def test_decode_tree_on_a_hybrid_is_refused_before_any_token(hybrid_dir, capsys):
    rc = main(["decode", "--target", str(hybrid_dir), "--drafter", "prompt-lookup", "--tree", "2,2", "--prompt",
               "abc abc", "--max-new-tokens", "8", "--no-progress", "--no-warmup"])
    out, err = capsys.readouterr()
    assert rc == 2, err
    assert out == ""
    assert "recurrent state" in err and "use a chain" in err and len(err.strip().splitlines()) == 1, err
