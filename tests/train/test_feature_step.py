"""A feature drafter's step under gguf-q8 in one native call (forward/feature_step.py): the kernels it
composes, row by row, the same bits however the rows are grouped; the cap as capped_tail's torch
expression, bit for bit, on adversarial rows."""

from __future__ import annotations

import math

import pytest
import torch

from draftcert.forward import feature_step, layer_kernel, native_layer
from draftcert.gguf.layers import set_numerics
from draftcert.models.eagle import PROPOSAL_WIDTH, load_eagle, save_eagle
from draftcert.models.tree_attention import crop_cache
from tests.tiny_gguf import tiny_gguf_llama
from tests.train.test_drafter_blocks import VOCAB_IDS, random_drafter

pytestmark = pytest.mark.skipif(not layer_kernel.LIBRARY.available(), reason="no native layer kernel")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("feature-step")
    target = tiny_gguf_llama(tmp, out_type=8)
    set_numerics(target, "gguf-q8")
    d = load_eagle(save_eagle(random_drafter(target), tmp / "d.safetensors", blocks=True), target)
    return target, d


def step_inputs(d, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 96, (1, T), generator=g)  # the tiny target's 96 tokens
    feats = torch.randn(1, T, d.hidden_size, generator=g)
    return tokens, feats


def causal_mask_of(T, past=0):
    allowed = torch.ones(T, past + T, dtype=torch.bool).tril(past)
    return torch.zeros(T, past + T).masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]


def _tail_sum(w, g):
    """The kernel's tail before its cap: a float64 sum, i increasing, rounded to float32."""
    s = 0.0
    for wi, gi in zip(w.tolist(), g.tolist()):
        s += wi * gi
    return s


def test_the_step_is_its_kernels_composed(pair, monkeypatch):
    """g = the kernel's rms of the layer's output (the layer and fc as the torch path runs them: the same
    kernels), z = the head's rows of g, t = capped_tail of the float64 tail sum: bit for bit."""
    target, d = pair
    assert feature_step.plan_of(d, fc=d.fc, layer=d.layer, norm=d.norm, head=d.head_layer(), tail=d.tail,
                                vocab_size=d.vocab_size, width=PROPOSAL_WIDTH) is not None
    tokens, feats = step_inputs(d, 5)
    pos, mask = torch.arange(5)[None], causal_mask_of(5)
    with torch.no_grad():
        g, z, t = d.step(tokens, feats, pos, mask, cache=d.new_cache())
        seen = []
        hook = d.layer.register_forward_hook(lambda m, a, out: seen.append(out[0] if isinstance(out, tuple) else out))
        monkeypatch.setattr(feature_step, "plan_of", lambda *a, **k: None)  # the torch path: fc, the layer (its plan), ...
        try:
            d.step(tokens, feats, pos, mask, cache=d.new_cache())
        finally:
            hook.remove()
    x = seen[0]  # [1, 5, H]: the layer's output
    g_ref = layer_kernel.rms(x, d.norm.weight, d.norm.variance_epsilon)
    assert torch.equal(g, g_ref)
    head = d.head_layer()
    assert torch.equal(z, head(g_ref))
    w, b = d.tail.weight.reshape(-1), d.tail.bias
    pre = torch.tensor([[_tail_sum(w, g_ref[0, i]) for i in range(5)]], dtype=torch.float64).float() + b
    assert torch.equal(t, d.capped_tail(z, pre))


@pytest.mark.parametrize("T", [6, 20])  # 20: past the rows a step keeps rotary pairs for (ROW_CACHE_MAX_CALL)
def test_rows_give_the_same_bits_however_they_are_grouped(pair, T):
    """A catch-up over T rows, the rows one by one (a chain), last_only and a batch of two sequences."""
    target, d = pair
    tokens, feats = step_inputs(d, T, seed=1)
    with torch.no_grad():
        whole = d.step(tokens, feats, torch.arange(T)[None], causal_mask_of(T), cache=d.new_cache())
        cache = d.new_cache()
        ones = [d.step(tokens[:, i:i + 1], feats[:, i:i + 1], torch.tensor([[i]]), None, cache=cache) for i in range(T)]
        cache = d.new_cache()
        last = d.step(tokens, feats, torch.arange(T)[None], causal_mask_of(T), cache=cache, last_only=True)
        assert cache.get_seq_length(0) == T  # every row went into the cache
        again = d.step(tokens[:, :1], feats[:, :1], torch.tensor([[T]]), None, cache=cache)  # after a last_only step
        tokens2, feats2 = step_inputs(d, T, seed=2)
        batch = d.step(torch.cat([tokens2, tokens]), torch.cat([feats2, feats]), torch.arange(T)[None].expand(2, -1),
                       causal_mask_of(T).expand(2, -1, -1, -1))
    for k in range(3):
        assert torch.equal(whole[k], torch.cat([o[k] for o in ones], 1))
        assert torch.equal(last[k], whole[k][:, -1:])
        assert torch.equal(batch[k][1:], whole[k])
    with torch.no_grad():
        cache = d.new_cache()
        d.step(tokens, feats, torch.arange(T)[None], causal_mask_of(T), cache=cache)
        crop_cache(cache, T - 2)  # a rejected chain's rows dropped, then re-fed
        redo = d.step(tokens[:, T - 2:], feats[:, T - 2:], torch.arange(T - 2, T)[None], causal_mask_of(2, T - 2), cache=cache)
    assert all(torch.equal(redo[k], whole[k][:, T - 2:]) for k in range(3))
    assert torch.isfinite(again[1]).all()


def test_the_torch_path_is_close(pair, monkeypatch):
    """Off the native path (DRAFTCERT_NATIVE_LAYERS=0: the written-out torch layer) the step computes the same
    function up to float32 rounding (its norm is torch's, its layer transformers')."""
    target, d = pair
    tokens, feats = step_inputs(d, 4, seed=3)
    with torch.no_grad():
        native = d.step(tokens, feats, torch.arange(4)[None], causal_mask_of(4), cache=d.new_cache())
        monkeypatch.setenv("DRAFTCERT_NATIVE_LAYERS", "0")
        native_layer.forget(d)  # the variable is read when a plan is made
        try:
            assert feature_step.plan_of(d, fc=d.fc, layer=d.layer, norm=d.norm, head=d.head_layer(), tail=d.tail,
                                        vocab_size=d.vocab_size, width=PROPOSAL_WIDTH) is None
            other = d.step(tokens, feats, torch.arange(4)[None], causal_mask_of(4), cache=d.new_cache())
        finally:
            monkeypatch.delenv("DRAFTCERT_NATIVE_LAYERS")
            native_layer.forget(d)
    for a, b in zip(native, other):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def _torch_cap(z, tail, width, spread):
    """EagleDrafter.capped_tail's expression."""
    floor = z.topk(width, dim=-1).values[..., -1]
    margin = 8 * torch.finfo(z.dtype).eps * (1 + floor.abs() + spread)
    return torch.minimum(tail, (floor + spread - margin).to(tail.dtype))


@pytest.mark.parametrize("n,width", [(12, 8), (4096, 8), (8, 8), (200, 1), (70, 64)])
def test_the_cap_is_capped_tails_expression_bit_for_bit(n, width):
    g = torch.Generator().manual_seed(n + width)
    rows = [torch.randn(n, generator=g) * 5,
            torch.full((n,), 3.25),  # every value tied
            torch.randint(-3, 3, (n,), generator=g).float(),  # many ties at the w-th value
            torch.randn(n, generator=g) * 1e30,  # huge magnitudes
            torch.randn(n, generator=g) * 1e-30,  # tiny ones
            -torch.rand(n, generator=g) - 1e4]
    z = torch.stack(rows)
    spread = math.log(151_936 - n)
    floor = z.topk(width, dim=-1).values[:, -1]
    # tails just below, at and above the cap, and far from it
    for tail in (floor + spread, floor + spread - 1e-3, floor - 50.0, floor + 50.0,
                 torch.nextafter(floor + spread, torch.tensor(-math.inf))):
        got = layer_kernel.capped_tail(z, tail, width, spread)
        assert torch.equal(got, _torch_cap(z, tail, width, spread))
        # what the cap is for: every token outside the draft vocabulary stays below the top w
        assert bool((got.double() - torch.tensor(spread, dtype=torch.float32).double() < floor.double()).all()
                    | ~torch.isfinite(floor).all())


def test_a_width_the_kernel_does_not_take_is_refused():
    with pytest.raises(ValueError, match="width"):
        layer_kernel.capped_tail(torch.zeros(1, 4), torch.zeros(1), 5, 1.0)


_WORKER = r"""
import sys, numpy as np, torch
from pathlib import Path
torch.set_num_threads(1)
from draftcert.forward import layer_kernel
from draftcert.gguf.layers import set_numerics
from draftcert.models.eagle import load_eagle, save_eagle
from tests.tiny_gguf import tiny_gguf_llama
from tests.train.test_drafter_blocks import random_drafter
from tests.train.test_feature_step import causal_mask_of, step_inputs
tmp = Path(sys.argv[1])
assert layer_kernel.LIBRARY.available(), layer_kernel.LIBRARY.reason()
target = tiny_gguf_llama(tmp, out_type=8)
set_numerics(target, "gguf-q8")
d = load_eagle(save_eagle(random_drafter(target), tmp / "d.safetensors", blocks=True), target)
tokens, feats = step_inputs(d, 7, seed=4)
with torch.no_grad():
    g, z, t = d.step(tokens, feats, torch.arange(7)[None], causal_mask_of(7), cache=d.new_cache())
np.savez(sys.argv[2], g=g.numpy(), z=z.numpy(), t=t.numpy())
"""


def test_the_avx2_build_gives_the_same_bits(pair, tmp_path):
    """The step (and with it the drafter's native decoder layer) built without AVX-512 (the AVX2 code of every
    kernel, ``DRAFTCERT_NATIVE_CFLAGS``) gives this build's bits on the same drafter and rows."""
    import os
    import subprocess
    import sys

    import numpy as np

    from draftcert.native import cpu_flags

    if not {"avx2", "fma", "f16c"} <= set(cpu_flags().split()) or "avx512f" not in cpu_flags().split():
        pytest.skip("needs an AVX-512 machine that also runs AVX2 code")
    target, d = pair
    tokens, feats = step_inputs(d, 7, seed=4)
    with torch.no_grad():
        mine = d.step(tokens, feats, torch.arange(7)[None], causal_mask_of(7), cache=d.new_cache())
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: src/, tests/
    env = {**os.environ, "DRAFTCERT_NATIVE_CFLAGS": "-mno-avx512f -mno-avxvnni", "DRAFTCERT_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([os.path.join(root, "src"), root, os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "avx2.npz"
    run = subprocess.run([sys.executable, "-c", _WORKER, str(tmp_path), str(out)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    got = np.load(out)
    for name, a in zip("gzt", mine):
        assert np.array_equal(got[name].view(np.int32), a.numpy().view(np.int32)), f"{name} differs on the AVX2 build"


def test_a_replaced_weight_makes_the_plan_again(pair):
    """The final norm's weight replaced by a new tensor (twice the old: an exact scaling) is what the next step
    reads: g exactly doubles."""
    target, d = pair
    tokens, feats = step_inputs(d, 3, seed=5)
    old = d.norm.weight
    with torch.no_grad():
        g1, _, _ = d.step(tokens, feats, torch.arange(3)[None], None, cache=d.new_cache())
        d.norm.weight = torch.nn.Parameter(old.detach() * 2, requires_grad=False)
        try:
            g2, _, _ = d.step(tokens, feats, torch.arange(3)[None], None, cache=d.new_cache())
        finally:
            d.norm.weight = old
        g3, _, _ = d.step(tokens, feats, torch.arange(3)[None], None, cache=d.new_cache())
    assert torch.equal(g2, 2 * g1) and torch.equal(g3, g1)


def test_the_full_rows_are_full_logits_bit_for_bit(pair):
    """The native step also writes q, ``EagleDrafter.full_logits`` of its z and t (z at the draft vocabulary's
    ids, t - log(V - V_d) at every other): the bits of full_logits' own computation.  It is taken once, and
    only for the tensors that step returned."""
    target, d = pair
    assert d.n_draft_vocab < d.vocab_size
    tokens, feats = step_inputs(d, 4, seed=3)
    with torch.inference_mode():  # as decoding runs it: no version counters
        g, z, t = d.step(tokens, feats, torch.arange(4)[None], None, cache=d.new_cache())
        assert feature_step.take_full_logits(d, z.clone(), t) is None  # another tensor
        q = feature_step.take_full_logits(d, z, t)
        assert q is not None and q.shape == (1, 4, d.vocab_size)
        assert torch.equal(q, d.full_logits(z, t)) and torch.equal(q[0], d.full_logits(z[0], t[0]))
        assert feature_step.take_full_logits(d, z, t) is None  # taken once
        g2, z2, t2 = d.step(tokens, feats, torch.arange(4)[None], None, cache=d.new_cache(), last_only=True)
        assert torch.equal(feature_step.take_full_logits(d, z2, t2), d.full_logits(z2, t2))
        n = feature_step.FULL_ROWS_MAX + 1  # a teacher-forced batch's rows: no full rows written
        tokens, feats = step_inputs(d, n, seed=4)
        g3, z3, t3 = d.step(tokens, feats, torch.arange(n)[None], None, cache=d.new_cache())
        assert feature_step.take_full_logits(d, z3, t3) is None


def test_a_decode_step_gives_the_steps_bits(pair):
    """``DecodeStep`` (a decode's steps with their lookups made once: kept embedding rows, rotary rows sliced
    from the table) gives ``step``'s g, z, t and full rows bit for bit, for chains of 1..16 rows at positions
    running past the rotary table's first block, with or without ``last_only``; the two caches stay equal.
    It declines what it does not take: more than 16 rows, autograd on."""
    from draftcert.drafting.feature_drafter import FeatureDrafter

    target, d = pair
    fd = FeatureDrafter(d)
    fd.start([1, 2, 3])
    assert isinstance(fd._native, feature_step.DecodeStep)
    fast, ref = d.new_cache(), d.new_cache()
    head = d.head_layer()
    gen = torch.Generator().manual_seed(11)
    pos = 0
    with torch.inference_mode():
        while pos < native_layer.TABLE_BLOCK + 40:
            T = int(torch.randint(1, 17, (1,), generator=gen))
            last = bool(torch.randint(0, 2, (1,), generator=gen))
            tokens, feats = step_inputs(d, T, seed=pos)
            got = fd._native(tokens[0].tolist(), feats[0], pos, fast, last)
            q_got = feature_step.take_full_logits(d, got[1], got[2])
            want = d.step(tokens, feats, torch.arange(pos, pos + T)[None], None, cache=ref, head_weight=head,
                          last_only=last)
            q_want = feature_step.take_full_logits(d, want[1], want[2])
            for a, b in zip(got + (q_got,), want + (q_want,)):
                assert torch.equal(a, b), (pos, T, last)
            pos += T
        for a, b in ((fast.layers[0].keys, ref.layers[0].keys), (fast.layers[0].values, ref.layers[0].values)):
            assert torch.equal(a, b)
        tokens, feats = step_inputs(d, 17)
        assert fd._native(tokens[0].tolist(), feats[0], pos, fast) is None  # a prompt's catch-up: step's own call
    with torch.enable_grad():
        assert fd._native([1], feats[0, :1], pos, fast) is None


def test_the_drafters_confidence_from_its_draft_vocabulary_is_top_probability(pair):
    """``FeatureDrafter._confidence`` (softmax(q)[argmax] from z [V_d] and the tail t) equals
    ``top_probability`` of the full row up to float32 rounding, on rows whose tail is at the cap (the
    drafter's head scaled up: a peaked z) and below it; another tensor gets ``top_probability`` itself."""
    from draftcert.drafting.feature_drafter import FeatureDrafter
    from draftcert.drafting.tree_growth import top_probability

    target, d = pair
    fd = FeatureDrafter(d)
    fd.start([1, 2, 3])
    seen = []
    with torch.inference_mode():
        for seed in range(6):
            tokens, feats = step_inputs(d, 2, seed=seed)
            _, q = fd._step(tokens[0].tolist(), feats[0] * (1 + 4 * seed), 2 * seed, None)
            row = q[-1:]
            got, want = fd._confidence(row), top_probability(row)
            assert got == pytest.approx(want, rel=1e-5), seed
            seen.append(want)
        other = q[-1:].clone()
        assert fd._confidence(other) == top_probability(other)
    assert max(seen) - min(seen) > 0.05  # rows of different confidence
