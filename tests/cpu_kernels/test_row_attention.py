"""row_attention: attention one query row at a time, the same bits for a row in a pass of any size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftcert.kernels import row_attention
from draftcert.models.hf import cache_kwarg

needs_kernel = pytest.mark.skipif(not row_attention.LIBRARY.available(), reason=f"no row_attention kernel: {row_attention.LIBRARY.reason()}")


def _case(B=2, H=6, Hkv=2, M=9, S=40, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, D, generator=g) for h, n in ((H, M), (Hkv, S), (Hkv, S)))
    return q, k, v


@needs_kernel
@pytest.mark.parametrize("D", [64, 80, 7])
def test_matches_sdpa(D):
    q, k, v = _case(D=D)
    B, H, M, _ = q.shape
    S = k.shape[2]
    mask = torch.ones(M, S, dtype=torch.bool).tril(S - M)[None, None].expand(B, 1, M, S).clone()
    mask[1, 0, :, 3] = False  # a hole (a tree's or a window's)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    got = row_attention.attention(q, k, v, mask, D ** -0.5)
    assert got.shape == (B, M, H, D) and torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    none = row_attention.attention(q, k, v, None, D ** -0.5)
    assert torch.allclose(none, F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_row_alone_and_in_any_pass_is_the_same_bits():
    q, k, v = _case(B=1, M=16, S=50)
    M, S = q.shape[2], k.shape[2]
    full = torch.ones(M, S, dtype=torch.bool).tril(S - M)[None, None]
    all_rows = row_attention.attention(q, k, v, full, 0.125)
    for i in range(M):  # the decode step of row i: its one query, the keys up to its position, no mask
        L = S - M + i + 1
        alone = row_attention.attention(q[:, :, i:i + 1], k[:, :, :L], v[:, :, :L], None, 0.125)
        assert torch.equal(alone[:, 0], all_rows[:, i]), i
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(row_attention.attention(q, k, v, full, 0.125), all_rows)
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("D,H,Hkv", [(64, 9, 3), (64, 8, 2), (64, 6, 6), (64, 14, 2), (128, 12, 2), (128, 7, 1), (32, 4, 2)])
def test_heads_of_a_group_together_give_the_one_head_codes_bits(D, H, Hkv):
    """row_attention.c computes the heads of a KV group together (heads16, D = 64 or 128 on AVX-512):
    the same bits as its one-head loop (generic=True) for every head, mask, row count and thread count,
    a row with no visible key included."""
    for M, S, seed in ((1, 1, 0), (5, 133, 1), (9, 40, 2)):
        q, k, v = _case(B=2, H=H, Hkv=Hkv, M=M, S=S, D=D, seed=seed)
        mask = torch.ones(M, S, dtype=torch.bool).tril(S - M)[None, None].expand(2, 1, M, S).clone()
        mask[1, 0, :, S // 2] = False  # a hole
        mask[0, 0, M - 1, :] = False  # a row that sees nothing
        for threads in (1, 2):
            before = torch.get_num_threads()
            try:
                torch.set_num_threads(threads)
                for m in (mask, None):
                    want = row_attention.attention(q, k, v, m, D ** -0.5, generic=True)
                    got = row_attention.attention(q, k, v, m, D ** -0.5)
                    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (M, S, threads, m is None)
            finally:
                torch.set_num_threads(before)


@needs_kernel
def test_its_exp_is_glibcs_expf_on_the_softmax_range():
    """row_attention.c's own exp (16 lanes, and one at a time in the one-head loop) gives the same bits
    as glibc's expf on [-104, 0] (where the softmax's s - max lies; checked there exhaustively once,
    sampled here) and calls libm elsewhere (NaN, -inf, below -104, above 0)."""
    import ctypes
    import ctypes.util
    import platform

    g = torch.Generator().manual_seed(7)
    bits = torch.randint(0x80000000 - 2**32, 0xC2D00000 - 2**32 + 1, (400_000,), generator=g, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)  # uniform over the float bit patterns of [-104, -0]
    edges = torch.tensor([0.0, -0.0, -104.0, -103.97, -87.3, -1e-45, -1e-8, float("nan"), float("-inf"),
                          float("inf"), 1.0, 88.0, -105.0, -200.0,
                          float.fromhex("-0x1.f8cbb2p+5")])  # the one input where an unfused remainder differs
    x = torch.cat([edges, x, edges])  # the edges in 16-lane chunks and in the scalar tail
    vec, one = row_attention.exp(x), row_attention.exp(x, vector=False)
    assert torch.equal(vec.view(torch.int32), one.view(torch.int32))
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("the exp's equality is with glibc's expf")
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.expf.argtypes, libm.expf.restype = [ctypes.c_float], ctypes.c_float
    pick = torch.cat([torch.arange(len(edges)), torch.arange(len(edges), len(x), 8), torch.arange(len(x) - len(edges), len(x))])
    want = torch.tensor([libm.expf(float(v)) for v in x[pick].tolist()])
    got = vec[pick]
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@needs_kernel
def test_a_model_scores_a_token_the_same_in_a_pass_of_any_size():
    """A tiny llama with row-invariant attention and float32 linears computed one row at a time:
    the logits of 6 tokens scored together equal the 6 decode steps' bits."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    from draftcert.kernels.attention import use_row_invariant_attention

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval()
    assert use_row_invariant_attention(model) == 2

    class RowLinear(torch.nn.Module):  # batch invariant stand-in for block_matmul: one row at a time
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            flat = x.reshape(-1, x.shape[-1])
            return torch.cat([self.lin(r[None]) for r in flat]).reshape(*x.shape[:-1], -1)

    for name, mod in list(model.named_modules()):
        for attr, child in list(mod.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(mod, attr, RowLinear(child))
    ids = torch.randint(0, 64, (1, 14))
    kw = cache_kwarg(model)  # past_key_values is deprecated in newer transformers (FutureWarning)
    with torch.no_grad():
        c = DynamicCache()
        model(ids[:, :8], use_cache=True, **{kw: c})
        together = model(ids[:, 8:], use_cache=True, **{kw: c}).logits[0]
        c2 = DynamicCache()
        model(ids[:, :8], use_cache=True, **{kw: c2})
        steps = torch.cat([model(ids[:, i:i + 1], use_cache=True, **{kw: c2}).logits[0] for i in range(8, 14)])
    assert torch.equal(together, steps)
