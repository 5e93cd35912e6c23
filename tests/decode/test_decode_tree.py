"""Tree attention masks, tree parsing and KV-cache rollback, checked against fresh forwards."""

from __future__ import annotations

import pytest
import torch

from draftcert.decode import DraftTree, parse_tree
from draftcert.models.hf import model_forward, new_cache
from draftcert.models.tree_attention import keep_cache, tree_attention_mask, tree_position_ids


def _fresh(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0]


def _tree():
    t = DraftTree()
    a = t.add(7, -1)
    b = t.add(8, -1)
    c = t.add(9, a)
    t.add(10, a)
    t.add(11, c)
    t.add(12, b)
    return t  # paths: 7-9-11, 7-10, 8-12


def _path_to(t, i):
    out = []
    while i >= 0:
        out.append(i)
        i = t.parents[i]
    return out[::-1]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("n_pending", [1, 4])
def test_tree_verification_equals_fresh_forwards(target_factory, attn, n_pending):
    """Every node's logits in the one-pass tree verification equal a plain forward of its path.

    The model is float64.  sdpa computes in float64 throughout: equal to 1e-10.  transformers'
    eager attention takes the softmax in float32 (``softmax(..., dtype=torch.float32)``), and a
    float32 sum over the longer, partly masked key row of the tree pass rounds differently from
    the fresh forward's on some CPUs (AVX2's 8-float lanes; with AVX-512 both rows fit in one
    vector and the results happen to agree bit for bit): equal there to float32 rounding, which
    is still four orders below what a wrong mask does (checked below)."""
    tol = 1e-10 if attn == "sdpa" else 1e-5
    model, _ = target_factory(attn=attn, seed=5, layers=2)
    seq = [3, 4, 5, 6, 20, 21, 22]
    n_cached = len(seq) - n_pending
    tree = _tree()
    n = len(tree)
    anc = tree.ancestors()
    nodes = torch.arange(n)
    pos = tree_position_ids(n_cached, n_pending, torch.tensor(tree.depths))

    def verify(anc):
        with torch.inference_mode():
            cache = new_cache(model)
            model_forward(model, cache, seq[:n_cached], 1)
            mask = tree_attention_mask(n_cached, n_pending, anc, nodes, nodes, model.dtype)
            return model_forward(model, cache, seq[n_cached:] + tree.tokens, n + 1, mask, pos)

    logits = verify(anc)
    torch.testing.assert_close(logits[0], _fresh(model, seq)[-1], rtol=tol, atol=tol)
    fresh = []
    for i in range(n):
        ids = seq + [tree.tokens[j] for j in _path_to(tree, i)]
        fresh.append(_fresh(model, ids)[-1])
        torch.testing.assert_close(logits[i + 1], fresh[-1], rtol=tol, atol=tol)
    # the tolerance still tells a wrong mask: node 2 (7-9) also seeing its uncle 8 is far off
    wrong = anc.clone()
    wrong[2, 1] = True
    assert (verify(wrong)[3] - fresh[2]).abs().max() > 1e3 * tol


@pytest.mark.parametrize("leaf", [4, 3, 5, 1])
def test_rollback_to_accepted_path_then_continue_equals_fresh_forward(target_factory, leaf):
    """Gather the accepted path's KV entries into place, then decode on: same as from scratch."""
    model, _ = target_factory(seed=6, layers=2)
    seq = [3, 4, 5, 6, 20]
    tree = _tree()
    path = _path_to(tree, leaf)
    with torch.inference_mode():
        cache = new_cache(model)
        n = len(tree)
        mask = tree_attention_mask(0, len(seq), tree.ancestors(), torch.arange(n), torch.arange(n), model.dtype)
        pos = tree_position_ids(0, len(seq), torch.tensor(tree.depths))
        model_forward(model, cache, seq + tree.tokens, 1, mask, pos)
        keep_cache(cache, len(seq), path)
        assert cache.get_seq_length() == len(seq) + len(path)
        cont = model_forward(model, cache, [30, 31], 2)
    full = seq + [tree.tokens[j] for j in path] + [30, 31]
    torch.testing.assert_close(cont, _fresh(model, full)[-2:], rtol=1e-10, atol=1e-10)


def test_chain_crop_then_continue_equals_fresh_forward(target_factory):
    model, _ = target_factory(seed=7, layers=2)
    with torch.inference_mode():
        cache = new_cache(model)
        model_forward(model, cache, [1, 2, 3, 4, 5, 6, 7, 8], 1)
        keep_cache(cache, 4, [0, 1])  # keep 6 positions: a crop
        assert cache.get_seq_length() == 6
        cont = model_forward(model, cache, [40], 1)
    torch.testing.assert_close(cont[0], _fresh(model, [1, 2, 3, 4, 5, 6, 40])[-1], rtol=1e-10, atol=1e-10)


def test_tree_attention_mask_layout():
    t = _tree()
    m = tree_attention_mask(2, 2, t.ancestors(), torch.arange(len(t)), torch.arange(len(t)), torch.float32)
    assert m.shape == (1, 1, 2 + 6, 2 + 2 + 6)
    allowed = (m[0, 0] == 0).int()
    assert allowed[0].tolist() == [1, 1, 1, 0] + [0] * 6  # first pending: prefix + itself
    assert allowed[2 + 4].tolist() == [1, 1, 1, 1] + [1, 0, 1, 0, 1, 0]  # node 4 (token 11): 7, 9, itself
    assert allowed[2 + 5].tolist() == [1, 1, 1, 1] + [0, 1, 0, 0, 0, 1]  # node 5 (token 12): 8, itself
    assert tree_position_ids(2, 2, torch.tensor(t.depths)).tolist() == [[2, 3, 4, 4, 5, 5, 6, 5]]


def test_parse_tree():
    assert parse_tree(None, 4) is None
    assert parse_tree((3, 2), 4) == ([3, 3], False)
    assert parse_tree("4,3", 4) == ([4, 4, 4], False)
    assert parse_tree([3, 2, 1], 4) == ([3, 2, 1], True)
    for bad in [(0, 2), (2, 0), [], [1, 0], "3", "a,b", (1, 2, 3), 3.5, (True, 2)]:
        with pytest.raises(ValueError, match="tree"):
            parse_tree(bad, 4)


@pytest.mark.parametrize("tree", [None, (3, 3), [2, 2, 2]])
def test_drafter_cache_after_decoding_equals_fresh_prefill(tiny, prompts, tree):
    """The drafter's rolled-back cache holds exactly seq[:n_valid] (chain crop, path tree, static tree gather)."""
    from draftcert.decode import ModelDrafter, speculative_generate

    target, drafter_model, _ = tiny
    d = ModelDrafter(drafter_model)
    res = speculative_generate(target, d, prompts[1], "additive:0.1", k=3, tree=tree, max_new_tokens=15)
    seq = prompts[1] + res.tokens
    assert d.n_valid == d.cache.get_seq_length() and d.n_valid <= len(seq)
    with torch.inference_mode():
        fresh = new_cache(drafter_model)
        model_forward(drafter_model, fresh, seq[: d.n_valid], 1)
    for a, b in zip(d.cache.layers, fresh.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(a.values, b.values, rtol=1e-9, atol=1e-9)
