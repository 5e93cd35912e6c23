"""A drafter over a prefix of the vocabulary (``ModelDrafter(model, vocab=N)``, ``--draft-vocab N``):
its output layer computes the first N rows only, the other tokens get q = 0; strict decoding stays
the target's greedy decoding, the drafts hold only ids < N, and its rounds carry no certificates.
"""

from __future__ import annotations

import pytest
import torch

from draftcert.decode import speculative_generate
from draftcert.drafting import ModelDrafter, make_drafter
from draftcert.models.hf import model_forward, new_cache


def _greedy(target, ids, n):
    x = torch.tensor([ids])
    with torch.no_grad():
        out = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n, pad_token_id=256)
    return out[0, len(ids):].tolist()


def test_prefix_logits_are_the_first_rows_and_minus_inf_elsewhere(tiny):
    _, drafter, _ = tiny
    with torch.inference_mode():
        full = model_forward(drafter, new_cache(drafter), [3, 1, 4, 1, 5], 2)
        part = model_forward(drafter, new_cache(drafter), [3, 1, 4, 1, 5], 2, vocab_rows=100)
    assert part.shape == full.shape == (2, 259)
    assert torch.allclose(part[:, :100], full[:, :100], rtol=0, atol=1e-12)  # float64: another GEMM shape's rounding
    assert torch.isneginf(part[:, 100:]).all()
    with pytest.raises(ValueError, match="vocab_rows must be in 1..259"):
        model_forward(drafter, new_cache(drafter), [1], 1, vocab_rows=260)


@pytest.mark.parametrize("k,tree", [(3, None), (3, (2, 3))], ids=["chain", "tree"])
def test_strict_with_a_prefix_drafter_is_greedy_and_drafts_only_prefix_ids(tiny, prompts, k, tree):
    target, drafter, _ = tiny
    md = ModelDrafter(drafter, vocab=120)
    for ids in prompts:
        res = speculative_generate(target, md, ids, "strict", k=k, tree=tree, max_new_tokens=20)
        assert list(res.tokens) == _greedy(target, ids, 20)
        summary = res.stats.summary()
        assert summary["checked_positions"] == summary["certified_positions"] == 0  # no q on the whole vocabulary
    md.start(prompts[0])
    with torch.inference_mode():
        t = md.propose(prompts[0], [2, 2, 2])
    assert t.tokens and max(t.tokens) < 120 and t.q is None


def test_the_draft_vocabulary_is_checked_and_only_for_causal_lm_drafters(tiny):
    target, drafter, tok = tiny
    with pytest.raises(ValueError, match=r"1\.\.259"):
        ModelDrafter(drafter, vocab=0)
    with pytest.raises(ValueError, match=r"1\.\.259"):
        ModelDrafter(drafter, vocab=True)
    assert ModelDrafter(drafter, vocab=259).vocab is None  # the whole vocabulary
    assert make_drafter(drafter, target, tok, draft_vocab=64).vocab == 64
    assert make_drafter(ModelDrafter(drafter), target, tok, draft_vocab=64).fork().vocab == 64
    with pytest.raises(ValueError, match="only a causal-LM drafter"):
        make_drafter("prompt-lookup", target, tok, draft_vocab=64)


def test_gguf_heads_give_their_first_rows_bit_for_bit(tmp_path):
    pytest.importorskip("gguf")
    from draftcert.gguf.layers import set_numerics

    from tests.tiny_gguf import tiny_gguf_llama

    model = tiny_gguf_llama(tmp_path, out_type=8)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    for contract in ("gguf-exact-f32", "gguf-q8"):
        set_numerics(model, contract)
        head = model.lm_head
        for n in (1, 20, 32, 96):
            layer = head.first_rows(n)
            assert layer.out_features >= n and layer.numerics == contract
            assert layer.qweight.data_ptr() == head.qweight.data_ptr()  # views, no copy
            assert torch.equal(layer(x)[:, :n], head(x)[:, :n]), (contract, n)
        with torch.inference_mode():
            full = model_forward(model, new_cache(model), [5, 6, 7], 3)
            part = model_forward(model, new_cache(model), [5, 6, 7], 3, vocab_rows=40)
        assert torch.equal(part[:, :40], full[:, :40]) and torch.isneginf(part[:, 40:]).all(), contract
    with pytest.raises(ValueError, match="1..96"):
        model.lm_head.first_rows(97)


def test_the_command_line_refuses_a_draft_vocabulary_for_a_feature_drafter(capsys):
    from draftcert.cli import main

    rc = main(["decode", "--drafter", "prompt-lookup", "--draft-vocab", "1000", "--max-new-tokens", "2",
               "--prompt", "Hi", "-k", "2", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("draftcert: error: --draft-vocab: draft vocabulary: only a causal-LM")
