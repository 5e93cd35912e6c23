"""Grouped-query SDPA without the cache copy (``draftcert.kernels.attention``): the same logits as
transformers' ``sdpa`` for every verification shape, chains and trees, and no ``repeat_kv``."""

from __future__ import annotations

import copy

import pytest
import torch

from draftcert.decode import batch_speculative_generate, greedy_generate, speculative_generate
from draftcert.kernels import attention
from tests.tiny_models import tiny_qwen3
from draftcert.models.hf import model_forward, new_cache


@pytest.fixture()
def pair():
    torch.set_num_threads(1)
    model, _ = tiny_qwen3(3, num_layers=2, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, init_std=0.15)
    model = model.float().eval().requires_grad_(False)
    model.set_attn_implementation("sdpa")
    grouped = copy.deepcopy(model)
    assert attention.use_grouped_sdpa(grouped)
    assert grouped.config._attn_implementation == attention.IMPLEMENTATION
    return model, grouped


def _pass(model, ids, n_new):
    cache = new_cache(model)
    model_forward(model, cache, ids[:-n_new], 1)
    return model_forward(model, cache, ids[-n_new:], n_new)  # the last n_new rows, with a cache: a 4-D mask


def test_same_logits_as_sdpa_for_every_row_count(pair):
    model, grouped = pair
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    for rows in range(1, 10):
        a, b = _pass(model, ids, rows), _pass(grouped, ids, rows)
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grouped(input_ids=torch.tensor([ids])).logits, model(input_ids=torch.tensor([ids])).logits)


def test_the_cache_is_not_copied(pair, monkeypatch):
    """The point of it: with a mask, transformers' sdpa calls repeat_kv; ours never does."""
    from transformers.integrations import sdpa_attention

    model, grouped = pair
    calls = []
    real = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: calls.append(1) or real(*a))
    ids = list(range(5, 30))
    _pass(model, ids, 4)
    assert calls, "transformers' sdpa no longer copies the cache: this module may be unnecessary"
    calls.clear()
    _pass(grouped, ids, 4)
    assert not calls


@pytest.mark.parametrize("tree", [None, (2, 3)])
def test_strict_decoding_is_lossless(pair, tree):
    model, grouped = pair
    g = torch.Generator().manual_seed(7)
    for n in (3, 12):
        prompt = torch.randint(0, 256, (n,), generator=g).tolist()
        ref = greedy_generate(model, prompt, 16, eos_token_id=[])
        res = speculative_generate(grouped, "self:skip=1", prompt, "strict", k=4, tree=tree, max_new_tokens=16,
                                   eos_token_id=[])
        assert res.tokens == ref


def test_left_alone_where_it_does_not_apply():
    model, _ = tiny_qwen3(0, num_layers=1, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=2)
    model.set_attn_implementation("sdpa")
    assert not attention.use_grouped_sdpa(model)  # one KV head per query head: nothing to save
    gqa, _ = tiny_qwen3(0, num_layers=1, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2)
    gqa.set_attn_implementation("eager")
    assert not attention.use_grouped_sdpa(gqa) and gqa.config._attn_implementation == "eager"


@pytest.mark.parametrize("tree", [None, (2, 3)])
def test_batched_strict_decoding_with_left_padding_is_lossless(pair, tree):
    """Rows of mixed lengths (left padding in the 4-D mask, per-row positions): every row gets its
    own greedy output through the grouped attention."""
    model, grouped = pair
    g = torch.Generator().manual_seed(11)
    rows = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 5, 14)]
    refs = [greedy_generate(model, r, 12, eos_token_id=[]) for r in rows]
    res = batch_speculative_generate(grouped, "self:skip=1", rows, "strict", k=3, tree=tree, max_new_tokens=12,
                                     eos_token_id=[])
    assert res.tokens == refs
