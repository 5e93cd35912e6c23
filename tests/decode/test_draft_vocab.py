"""A drafter over part of the vocabulary (``ModelDrafter(model, vocab=N | DraftVocabulary)``,
``--draft-vocab N|FILE``): its output layer computes those rows only (a token map's plus the
sequence's own tokens), every other token shares one logit just below them; strict decoding stays the
target's greedy decoding, the drafts hold only draftable ids, and the rounds carry certificates.
"""

from __future__ import annotations

import pytest
import torch

from draftcert.decode import speculative_generate
from draftcert.drafting import HybridDrafter, ModelDrafter, PromptLookupDrafter, make_drafter
from draftcert.drafting.draft_vocab import DraftVocabulary, VocabHead, shipped_vocab, vocabulary_of
from draftcert.models.hf import model_forward, new_cache


def _greedy(target, ids, n):
    x = torch.tensor([ids])
    with torch.no_grad():
        out = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n, pad_token_id=256)
    return out[0, len(ids):].tolist()


def _below_all(part, rest):
    """Every ``rest`` logit of a row is one shared value strictly below every computed one."""
    return bool((rest == rest[:, :1]).all() and (rest[:, 0] < part.min(-1).values).all())


def test_prefix_logits_are_the_first_rows_and_one_lower_logit_elsewhere(tiny):
    _, drafter, _ = tiny
    with torch.inference_mode():
        full = model_forward(drafter, new_cache(drafter), [3, 1, 4, 1, 5], 2)
        part = model_forward(drafter, new_cache(drafter), [3, 1, 4, 1, 5], 2,
                             head=VocabHead(drafter, DraftVocabulary.prefix(100, 259)))
    assert part.shape == full.shape == (2, 259)
    assert torch.allclose(part[:, :100], full[:, :100], rtol=0, atol=1e-12)  # float64: another GEMM shape's rounding
    assert _below_all(part[:, :100], part[:, 100:])
    with pytest.raises(ValueError, match=r"1\.\.259"):
        DraftVocabulary.prefix(260, 259)


def test_a_token_map_computes_its_rows_and_the_sequence_tokens_it_takes_in(tiny):
    _, drafter, _ = tiny
    ids = torch.tensor([0, 7, 8, 50, 51, 200, 258])
    vocab = DraftVocabulary(ids, 259, grows=True, source="test")
    head = VocabHead(drafter, vocab)
    with torch.inference_mode():
        full = model_forward(drafter, new_cache(drafter), [3, 1, 4], 1)
        part = model_forward(drafter, new_cache(drafter), [3, 1, 4], 1, head=head)
        assert torch.allclose(part[:, ids], full[:, ids], rtol=0, atol=1e-12)
        rest = torch.ones(259, dtype=torch.bool)
        rest[ids] = False
        assert _below_all(part[:, ids], part[:, rest])
        head.add([3, 1, 4, 7, 400, -1])  # 3, 1, 4 join; 7 is in already; ids outside the vocabulary are ignored
        assert head.extra.tolist() == [1, 3, 4]
        point = head.snapshot()
        head.add([9])
        more = model_forward(drafter, new_cache(drafter), [3, 1, 4], 1, head=head)
        assert torch.allclose(more[:, [1, 3, 4, 9]], full[:, [1, 3, 4, 9]], rtol=0, atol=1e-12)
        head.restore(point)
        assert head.extra.tolist() == [1, 3, 4] and not head.member[9] and head.member[3] and head.member[200]
    # a prefix does not grow
    pre = VocabHead(drafter, DraftVocabulary.prefix(10, 259))
    pre.add([100, 200])
    assert pre.extra.numel() == 0


def test_a_token_map_file_round_trips_and_bad_ones_are_named(tmp_path):
    ids = torch.tensor([2, 3, 5, 7, 11, 13])
    path = tmp_path / "vocab.json"
    DraftVocabulary(ids, 20, grows=True, source="x").save(path, data="d.pt", command="draftcert draft-vocab ...")
    back = DraftVocabulary.load(path, 20)
    assert torch.equal(back.ids, ids) and back.grows and back.vocab_size == 20 and back.key.startswith("map:6:")
    assert DraftVocabulary.prefix(6, 20).key == "prefix:6" and DraftVocabulary.prefix(6, 20).prefix_length == 6
    assert back.prefix_length is None
    with pytest.raises(ValueError, match="made for a vocabulary of 20 tokens, the drafter has 21"):
        DraftVocabulary.load(path, 21)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a draft vocabulary file"):
        DraftVocabulary.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="cannot read it as JSON"):
        DraftVocabulary.load(tmp_path / "missing.json")
    for bad in ([3, 2], [1, 1], [-1, 2], [2, 20]):
        with pytest.raises(ValueError, match="sorted, unique and in 0..19"):
            DraftVocabulary(torch.tensor(bad), 20, grows=True, source="x")


def test_the_shipped_map_of_the_pairs_drafter():
    vocab = shipped_vocab("qwen2.5-coder-0.5b")
    assert vocab.vocab_size == 151936 and len(vocab) == 32768 and vocab.grows
    assert 151645 in set(vocab.ids.tolist())  # the target's EOS (<|im_end|>) is always draftable
    assert shipped_vocab("qwen2.5-coder-1.5b") is None and shipped_vocab(None) is None


@pytest.mark.parametrize("k,tree", [(3, None), (3, (2, 3))], ids=["chain", "tree"])
def test_strict_with_a_prefix_drafter_is_greedy_and_drafts_only_prefix_ids(tiny, prompts, k, tree):
    target, drafter, _ = tiny
    md = ModelDrafter(drafter, vocab=120)
    for ids in prompts:
        res = speculative_generate(target, md, ids, "strict", k=k, tree=tree, max_new_tokens=20)
        assert list(res.tokens) == _greedy(target, ids, 20)
        summary = res.stats.summary()
        assert summary["checked_positions"] > 0  # q is a distribution on the whole vocabulary: certificates
    md.start(prompts[0])
    with torch.inference_mode():
        t = md.propose(prompts[0], [2, 2, 2])
    assert t.tokens and max(t.tokens) < 120 and t.q is not None


@pytest.mark.parametrize("k,tree", [(3, None), (3, (2, 3))], ids=["chain", "tree"])
def test_strict_with_a_token_map_is_greedy_and_drafts_only_its_tokens_and_the_sequences(tiny, prompts, k, tree):
    target, drafter, _ = tiny
    vocab = DraftVocabulary(torch.arange(0, 259, 3), 259, grows=True, source="every third id")
    rounds = []

    class Spy(ModelDrafter):
        def propose(self, seq, widths, expand_all=False):
            tree = super().propose(seq, widths, expand_all)
            rounds.append((set(seq), list(tree.tokens)))
            return tree

    md = Spy(drafter, vocab=vocab)
    for ids in prompts:
        rounds.clear()
        res = speculative_generate(target, md, ids, "strict", k=k, tree=tree, max_new_tokens=20)
        assert list(res.tokens) == _greedy(target, ids, 20)
        assert rounds and all(t % 3 == 0 or t in seen for seen, tokens in rounds for t in tokens)
        assert any(t % 3 for _, tokens in rounds for t in tokens)  # the sequence's own tokens are drafted too
        assert res.stats.summary()["checked_positions"] > 0


def test_the_draft_vocabulary_is_checked_and_only_for_causal_lm_drafters(tiny):
    target, drafter, tok = tiny
    with pytest.raises(ValueError, match=r"1\.\.259"):
        ModelDrafter(drafter, vocab=0)
    with pytest.raises(ValueError, match=r"1\.\.259"):
        ModelDrafter(drafter, vocab=True)
    assert ModelDrafter(drafter, vocab=259).vocab is None  # the whole vocabulary
    assert make_drafter(drafter, target, tok, draft_vocab=64).vocab.key == "prefix:64"
    assert make_drafter(ModelDrafter(drafter), target, tok, draft_vocab=64).fork().vocab.key == "prefix:64"
    assert make_drafter(ModelDrafter(drafter, 64), target, tok, draft_vocab="all").vocab is None
    with pytest.raises(ValueError, match="made for a vocabulary of 20 tokens, the drafter has 259"):
        ModelDrafter(drafter, vocab=DraftVocabulary(torch.arange(5), 20, grows=True, source="x"))
    with pytest.raises(ValueError, match="only a causal-LM drafter"):
        make_drafter("prompt-lookup", target, tok, draft_vocab=64)
    # which vocabulary a drafter drafts over, read through a hybrid too
    assert vocabulary_of(HybridDrafter(ModelDrafter(drafter, 64))).key == "prefix:64"
    assert vocabulary_of(ModelDrafter(drafter)) is None and vocabulary_of(PromptLookupDrafter()) is None


def test_gguf_heads_give_their_first_rows_and_any_rows_bit_for_bit(tmp_path):
    pytest.importorskip("gguf")
    from draftcert.gguf.layers import generation, set_numerics

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
            part = model_forward(model, new_cache(model), [5, 6, 7], 3,
                                 head=VocabHead(model, DraftVocabulary.prefix(40, 96)))
        assert torch.equal(part[:, :40], full[:, :40]) and _below_all(part[:, :40], part[:, 40:]), contract
        ids = torch.tensor([0, 3, 17, 40, 41, 95])
        before = generation()
        rows = head.rows(ids)  # a copy of those rows' blocks, the same contract
        assert generation() == before  # a new layer: no native plan has to be made again
        assert rows.numerics == contract and rows.out_features == 6
        assert torch.equal(rows(x), head(x)[:, ids]), contract
        with torch.inference_mode():
            mapped = VocabHead(model, DraftVocabulary(ids, 96, grows=True, source="t"))
            mapped.add([5, 6, 7])
            part = model_forward(model, new_cache(model), [5, 6, 7], 3, head=mapped)
        took = torch.tensor([0, 3, 5, 6, 7, 17, 40, 41, 95])
        assert torch.equal(part[:, took], full[:, took]), contract
    with pytest.raises(ValueError, match="row ids in 0..95"):
        model.lm_head.rows(torch.tensor([96]))
    with pytest.raises(ValueError, match="1..96"):
        model.lm_head.first_rows(97)


def test_the_command_line_refuses_a_draft_vocabulary_for_a_feature_drafter(capsys):
    from draftcert.cli import main

    rc = main(["decode", "--drafter", "prompt-lookup", "--draft-vocab", "1000", "--max-new-tokens", "2",
               "--prompt", "Hi", "-k", "2", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("draftcert: error: --draft-vocab: draft vocabulary: only a causal-LM")


def test_draft_vocab_command_writes_a_map_from_a_data_file(tmp_path, ckpt, capsys):
    import json

    from draftcert.cli import main

    g = torch.Generator().manual_seed(0)
    examples = [{"ids": torch.randint(0, 40, (30,), generator=g).tolist() + [200] * (i % 3), "n_prompt": 10}
                for i in range(20)]
    torch.save({"examples": examples, "info": {}, "config": {}}, tmp_path / "data.pt")
    out = tmp_path / "vocab.json"
    assert main(["draft-vocab", "--target", ckpt, "--data", str(tmp_path), "--size", "32", "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["size"] == 32 == len(d["token_ids"]) and d["examples"] == 20 and 0 < d["coverage_heldout_tenth"] <= 1
    assert d["coverage_heldout_tenth"] <= d["coverage_heldout_tenth_with_sequence"] <= 1
    assert 200 in d["token_ids"]  # counted 13 times: among the first 32
    vocab = DraftVocabulary.load(out, 259)
    assert vocab.grows and len(vocab) == 32
    torch.save({"examples": [{"ids": [300]}]}, tmp_path / "other.pt")
    assert main(["draft-vocab", "--target", ckpt, "--data", str(tmp_path / "other.pt"), "--size", "8",
                 "--out", str(out)]) == 2
    assert "beyond the target's vocabulary of 259" in capsys.readouterr().err
    assert main(["draft-vocab", "--target", ckpt, "--data", str(tmp_path / "none"), "--size", "8", "--out", str(out)]) == 2
    assert "no such file" in capsys.readouterr().err
