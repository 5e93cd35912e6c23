"""Dual-layout linear layers (``draftcert.models.fastlinear``): same function, kept in sync, lossless decoding."""

from __future__ import annotations

import copy

import pytest
import torch

from draftcert.decode import greedy_generate, speculative_generate
from draftcert.models import fastlinear, loading, tiny_qwen3


@pytest.fixture()
def pair():
    torch.set_num_threads(1)
    model, tok = tiny_qwen3(0, num_layers=2, hidden_size=48, intermediate_size=96, init_std=0.15)
    model.to(torch.float64).eval().requires_grad_(False)
    fast = copy.deepcopy(model)
    n = fastlinear.enable(fast)
    assert n == sum(type(m) is torch.nn.Linear for m in model.modules()) and n > 0
    return model, fast


def _logits(m, ids):
    with torch.inference_mode():
        return m(input_ids=torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 33])
def test_same_function_as_the_plain_layers(pair, rows):
    plain, fast = pair
    ids = torch.randint(0, 256, (rows,), generator=torch.Generator().manual_seed(rows)).tolist()
    a, b = _logits(plain, ids), _logits(fast, ids)
    if rows < fastlinear.MIN_ROWS:
        assert torch.equal(a, b)  # the original code path, bit for bit
    else:
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
        # and it really is the other copy: the column-major weight is what the layer used
        lin = next(m for m in fast.modules() if type(m) is fastlinear.DualLayoutLinear)
        assert lin.weight_cm.stride() == (1, lin.weight.shape[0]) and torch.equal(lin.weight_cm, lin.weight)


def test_state_dict_and_disable(pair):
    plain, fast = pair
    assert fast.state_dict().keys() == plain.state_dict().keys()
    assert fastlinear.is_enabled(fast) and not fastlinear.is_enabled(plain)
    assert fastlinear.enable(fast) == 0 or fastlinear.is_enabled(fast)  # idempotent
    fastlinear.disable(fast)
    assert not fastlinear.is_enabled(fast)
    assert all("weight_cm" not in m.__dict__ for m in fast.modules())


def test_copy_follows_in_place_weight_changes(pair):
    plain, fast = pair
    ids = list(range(10, 18))
    with torch.no_grad():
        for m in (plain, fast):
            for mod in m.modules():
                if isinstance(mod, torch.nn.Linear):
                    mod.weight.mul_(0.5)  # e.g. quantize_rtn_ edits weights in place
    torch.testing.assert_close(_logits(fast, ids), _logits(plain, ids), rtol=0, atol=1e-12)
    with torch.no_grad():
        for m in (plain, fast):
            for mod in m.modules():
                if isinstance(mod, torch.nn.Linear):
                    mod.weight.data = mod.weight.data * 2  # reassigned storage
    torch.testing.assert_close(_logits(fast, ids), _logits(plain, ids), rtol=0, atol=1e-12)


def test_gradient_reaches_trainable_weights():
    lin = torch.nn.Linear(6, 5, bias=False).double()
    fastlinear.enable(lin)
    x = torch.randn(7, 6, dtype=torch.float64)
    lin(x).sum().backward()
    assert lin.weight.grad is not None and torch.allclose(lin.weight.grad, x.sum(0).expand(5, 6))


@pytest.mark.parametrize("tree", [None, (2, 3)])
@pytest.mark.parametrize("k", [2, 5])
def test_strict_decoding_on_a_dual_layout_target_is_lossless(pair, tree, k):
    plain, fast = pair
    g = torch.Generator().manual_seed(7)
    for n in (3, 12):
        prompt = torch.randint(0, 256, (n,), generator=g).tolist()
        ref = greedy_generate(plain, prompt, 16, eos_token_id=[])
        assert greedy_generate(fast, prompt, 16, eos_token_id=[]) == ref
        res = speculative_generate(fast, "self:skip=1", prompt, "strict", k=k, tree=tree, max_new_tokens=16, eos_token_id=[])
        assert res.tokens == ref


def test_load_target_turns_it_on_only_for_models_that_fit(tmp_path, monkeypatch):
    """Auto (fast_linear=None): on for small CPU models, off once the copies would exceed the cap
    (they double the linear weights' memory); True/False force it."""
    model, tok = tiny_qwen3(seed=0)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    assert fastlinear.is_enabled(loading.load_target(str(tmp_path / "m"))[0])
    assert not fastlinear.is_enabled(loading.load_target(str(tmp_path / "m"), fast_linear=False)[0])
    monkeypatch.setattr(loading, "FAST_LINEAR_AUTO_MAX_BYTES", 1024)
    assert not fastlinear.is_enabled(loading.load_target(str(tmp_path / "m"))[0])
    assert fastlinear.is_enabled(loading.load_target(str(tmp_path / "m"), fast_linear=True)[0])
