"""forward/kv_buffer.py: the KV cache layer that appends in place holds what ``DynamicLayer`` holds.

Every comparison is ``torch.equal`` against transformers' own ``DynamicLayer`` fed the same operations:
appends of 1..20 positions, crops, the engine's in-place tree gather (``keep_cache``), keys assigned a
tensor of the caller's (a batch roll-back), batch selection; and a model's logits with ``new_cache``
against a cache of plain ``DynamicLayer``s over the passes the engine makes, with the buffers forced to
grow at nearly every pass.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")

from transformers.cache_utils import DynamicCache, DynamicLayer  # noqa: E402

from draftcert.forward import kv_buffer  # noqa: E402
from draftcert.models.hf import forward_with_hidden, model_forward, new_cache  # noqa: E402
from draftcert.models.tree_attention import crop_cache, keep_cache  # noqa: E402
from tests.cpu_kernels.test_decoder_layers import V, tiny_lm, tree_pass, use_attention  # noqa: E402


class _Pair:
    """A DynamicLayer and a spare layer, each in a cache of its own, fed the same operations."""

    def __init__(self, batch: int = 1, heads: int = 2, dim: int = 8):
        self.shape = (batch, heads, dim)
        self.plain, self.spare = DynamicCache(), DynamicCache()
        self.plain.layers, self.spare.layers = [DynamicLayer()], [kv_buffer.spare_layer()()]
        self.g = torch.Generator().manual_seed(0)

    def append(self, t: int):
        b, h, d = self.shape
        k, v = torch.randn(b, h, t, d, generator=self.g), torch.randn(b, h, t, d, generator=self.g)
        out_p = self.plain.layers[0].update(k.clone(), v.clone())
        out_s = self.spare.layers[0].update(k, v)
        for a, s in zip(out_p, out_s):
            assert torch.equal(a, s)

    def both(self, fn):
        fn(self.plain)
        fn(self.spare)

    def check(self):
        p, s = self.plain.layers[0], self.spare.layers[0]
        assert self.plain.get_seq_length() == self.spare.get_seq_length()
        if p.keys.numel():
            assert torch.equal(p.keys, s.keys) and torch.equal(p.values, s.values)


@pytest.mark.parametrize("batch", [1, 3])
def test_random_operations_hold_what_dynamic_layer_holds(monkeypatch, batch):
    monkeypatch.setattr(kv_buffer, "MIN_SPARE", 3)  # grow often: the copy into a new buffer is exercised
    monkeypatch.setattr(kv_buffer, "GROWTH", 1.1)
    pair, rnd = _Pair(batch), random.Random(1)
    pair.append(7)
    for _ in range(300):
        n = pair.plain.get_seq_length()
        op = rnd.random()
        if op < 0.45:
            pair.append(rnd.randint(1, 20))
        elif op < 0.65 and n:
            keep = rnd.randint(0, n)
            pair.both(lambda c: crop_cache(c, keep))
        elif op < 0.85 and n > 4:  # a tree's accepted nodes gathered behind the prefix, in place
            start = rnd.randint(0, n - 4)
            offsets = sorted(rnd.sample(range(n - start), rnd.randint(1, min(4, n - start))))
            pair.both(lambda c: keep_cache(c, start, offsets))
        elif op < 0.93 and n:  # a caller assigns tensors of its own (a batch roll-back's gather)
            idx = torch.tensor(sorted(rnd.sample(range(n), rnd.randint(1, n))))

            def gather(c):
                layer = c.layers[0]
                layer.keys, layer.values = layer.keys[:, :, idx].clone(), layer.values[:, :, idx].clone()
            pair.both(gather)
        elif batch > 1 and n:
            rows = torch.tensor(sorted(rnd.sample(range(pair.shape[0]), rnd.randint(1, pair.shape[0]))))
            pair.both(lambda c: c.layers[0].batch_select_indices(rows))
            pair.shape = (len(rows), *pair.shape[1:])
        pair.check()


def test_appends_within_the_spare_room_move_nothing():
    pair = _Pair()
    pair.append(10)
    layer = pair.spare.layers[0]
    ptr, cap = layer.keys.data_ptr(), layer._key_buffer.shape[-2]
    assert cap >= 10 + kv_buffer.MIN_SPARE
    for _ in range(cap - 10):
        pair.append(1)
        assert layer.keys.data_ptr() == ptr  # the cached positions stayed where they were
    pair.check()
    pair.append(1)  # one past the room: a new buffer, the same values
    assert layer._key_buffer.shape[-2] > cap and layer.keys.data_ptr() != ptr
    pair.check()
    layer.reset()
    assert layer._key_buffer is None and layer.get_seq_length() == 0


def test_a_native_pass_and_a_crop_make_no_view():
    """What a native pass does (``reserve``, write the buffers, ``commit``) and a round's roll-back
    (``crop``) only move the layer's length; ``keys`` / ``values`` are sliced from the buffers when read,
    and hold what ``DynamicLayer`` would."""
    pair = _Pair()
    pair.append(6)
    layer = pair.spare.layers[0]
    k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    kb, vb, n = layer.reserve(k, v)
    kb[..., n: n + 3, :], vb[..., n: n + 3, :] = k, v
    layer.commit(n + 3)
    pair.plain.layers[0].update(k.clone(), v.clone())
    made = layer.__dict__["_keys"]
    assert n == 6 and layer.get_seq_length() == 9 and made is not None and made.shape[-2] == 6  # the old view, unread
    pair.both(lambda c: crop_cache(c, 7))
    assert layer.get_seq_length() == 7 and layer.__dict__["_keys"] is made  # still nothing made
    pair.check()  # read: views of the buffers' first 7 positions, DynamicLayer's values
    assert layer.keys.data_ptr() == kb.data_ptr() and layer.keys.shape[-2] == 7
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.keys is None


def _engine_passes(model, cache) -> list[torch.Tensor]:
    """A prefill, one-row steps, chain verifications cropped back, a tree pass kept in part, hidden states."""
    gen = torch.Generator().manual_seed(2)
    out = [model_forward(model, cache, torch.randint(0, V, (9,), generator=gen).tolist(), 2)]
    for step in range(12):
        out.append(model_forward(model, cache, [step + 3], 1))
        n = cache.get_seq_length()
        rows = 2 + step % 5
        out.append(model_forward(model, cache, torch.randint(0, V, (rows,), generator=gen).tolist(), rows))
        keep_cache(cache, n, list(range(step % rows)))  # a chain accepted up to some depth
        n = cache.get_seq_length()
        out.append(tree_pass(model, cache, n))
        keep_cache(cache, n, [0, 1, 3])  # pending, a, then c (b rejected): gathered in place
    logits, hidden = forward_with_hidden(model, cache, [7, 8], 2)
    crop_cache(cache, 5)
    return out + [logits, hidden, model_forward(model, cache, [1, 2, 3], 3)]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("attention", ["sdpa", "grouped", "row_attention"])
def test_a_model_computes_the_same_bits_with_either_layer(monkeypatch, family, attention):
    monkeypatch.setattr(kv_buffer, "MIN_SPARE", 1)
    monkeypatch.setattr(kv_buffer, "GROWTH", 1.0)
    model = use_attention(tiny_lm(family), attention)
    with torch.inference_mode():
        spare = new_cache(model)
        assert all(type(layer) is kv_buffer.spare_layer() for layer in spare.layers)
        plain = new_cache(model)
        plain.layers = [DynamicLayer() for _ in plain.layers]
        a, b = _engine_passes(model, spare), _engine_passes(model, plain)
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"pass {i}: max difference {(x - y).abs().max().item()}"


def test_states_that_carry_gradients_are_appended_as_dynamic_layer_does():
    layer = kv_buffer.spare_layer()()
    w = torch.ones(1, requires_grad=True)
    k1, k2 = torch.randn(1, 2, 3, 4) * w, torch.randn(1, 2, 2, 4) * w
    first, _ = layer.update(k1, k1.detach().clone())
    loss = (first * first).sum()  # autograd saves the first pass's keys
    keys, _ = layer.update(k2, k2.detach().clone())
    (loss + (keys * keys).sum()).backward()  # an in-place append would have changed the saved keys
    assert w.grad is not None and torch.equal(keys, torch.cat([k1, k2], -2))
