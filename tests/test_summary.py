"""summary internals whose speed-ups must not change any value."""

import pytest
import torch

from draftcert import summary as summary_mod
from draftcert.summary import _stable_tie_order, summarize, topk_rows


def _reference(x: torch.Tensor, k: int):
    vals, ids = torch.topk(x, k, dim=-1, sorted=True)
    return _stable_tie_order(vals, ids)


def test_topk_rows_matches_topk_values_and_ids():
    g = torch.Generator().manual_seed(0)
    for V in (64 * 256, 64 * 256 + 37, 49152, 1000):  # block path (whole / partial last block), plain path
        x = torch.randn(6, V, generator=g)
        x[1] = torch.randint(0, 5, (V,), generator=g).float()  # massive ties, also at the k-th value
        x[2, 7::97] = torch.inf
        x[3] = -torch.inf
        x[3, 5] = 1.0
        x[4, :] = 0.0  # every value tied
        x[5, V - 3:] = 50.0  # maxima inside the partial last block
        for k in (1, 16, 64):
            v, i = topk_rows(x, k)
            rv, ri = _reference(x, k)
            assert torch.equal(v, rv)
            assert torch.equal(torch.gather(x, 1, i), v)  # ids point at the values
            assert all(len(set(r.tolist())) == k for r in i)  # no column twice
            # where no tie crosses the k-th value the chosen ids are unique: they must agree too
            clear = torch.topk(x, k + 1, dim=-1).values[:, k] < v[:, -1]
            assert torch.equal(i[clear], ri[clear])


def test_topk_rows_nan_ranks_first_like_topk():
    x = torch.randn(2, 64 * 300)
    x[0, 1234] = torch.nan
    v, i = topk_rows(x, 8)
    assert torch.isnan(v[0, 0]) and int(i[0, 0]) == 1234
    rv, _ = _reference(x, 8)
    assert torch.equal(v[1], rv[1]) and torch.equal(v[0, 1:], rv[0, 1:])


@pytest.mark.parametrize("compiled", [False, True])
def test_max_src_below_is_the_largest_value_strictly_below_the_cut(monkeypatch, compiled):
    """The deep-row lookup behind radii and margin bounds: exact comparisons in the values'
    own dtype, with cuts placed exactly on a value, one ulp either side of it, on a
    repeated value and on a masked row; -inf where nothing lies below the cut."""
    if compiled:
        monkeypatch.setattr(summary_mod, "_COMPILE_MIN_NUMEL", 0)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4096, generator=g) * 3
    x[1, 100:110] = x[1, 50]  # the cut's value repeated
    x[2, 200] = torch.nextafter(x[2, 50], torch.tensor(torch.inf))  # a second distinct value next to it
    x[3, 300] = torch.nextafter(x[3, 50], torch.tensor(-torch.inf))
    x[4, 7] = -torch.inf
    summ = summarize(logits=x, k=16)
    rows = torch.arange(6)
    v50 = x[:, 50]
    for cut in (v50, torch.nextafter(v50, torch.full_like(v50, torch.inf)),
                torch.nextafter(v50, torch.full_like(v50, -torch.inf)), x.amin(-1)):
        got = summ.max_src_below(rows, cut)
        want = torch.where(x < cut[:, None], x, torch.full_like(x, -torch.inf)).amax(-1)
        assert torch.equal(got.to(x.dtype), want)


def test_chunked_moments_and_float64_sums_match_the_plain_formulas():
    """The eager moments go through reused buffers a few rows at a time: same values as the
    plain formulas (exactly the same products; float64 sums equal up to float64 rounding,
    as the reduction order over a single row can differ from that over a batch)."""
    g = torch.Generator().manual_seed(5)
    for shape in [(8, 49152), (3, 151936), (40, 1000), (7, 70000)]:
        x = torch.randn(*shape, generator=g) * 4
        x[0, 3] = -torch.inf  # a masked token: contributes 0 to both sums
        m = x.amax(-1, keepdim=True)
        for want in (True, False):
            got = summary_mod._logit_moments_eager(x, m, want)
            ref = summary_mod._logit_moments(x, m, want)
            assert torch.equal(got[2], ref[2])
            for a, b in zip(got[:2], ref[:2]):
                assert (a is None and b is None) or torch.allclose(a, b, rtol=1e-15, atol=0)
        e = torch.exp(x - m)
        torch.testing.assert_close(summary_mod._sum_f64(e), e.sum(-1, dtype=torch.float64), rtol=1e-15, atol=0)


@pytest.mark.parametrize("seed", range(6))
def test_topk_lowest_ids_is_the_stable_sort_prefix(seed):
    """topk_lowest_ids == the first k of a stable descending sort, also when a tie crosses the
    k-th value (a feature drafter's shared out-of-vocabulary logit), with NaN and all -inf rows."""
    from draftcert.summary import topk_lowest_ids

    g = torch.Generator().manual_seed(seed)
    for trial in range(60):
        N = int(torch.randint(1, 6, (1,), generator=g))
        V = int(torch.randint(2, 6000, (1,), generator=g))
        k = min(int(torch.randint(1, 17, (1,), generator=g)), V)
        x = torch.randint(-3, 3, (N, V), generator=g).float()
        if trial % 3 == 0:  # a few distinct values above one shared tail value
            x = torch.full((N, V), -1.0)
            x[:, :5] = torch.randn(N, 5, generator=g)
        if trial % 5 == 0:
            x[0, min(3, V - 1)] = float("nan")
        if trial % 7 == 0:
            x[-1, :] = float("-inf")
        vals, ids = topk_lowest_ids(x, k)
        for r in range(N):
            sv, si = torch.sort(x[r], descending=True, stable=True)
            assert torch.equal(si[:k], ids[r]), (seed, trial, r, V, k)
            assert torch.equal(sv[:k].nan_to_num(9.0), vals[r].nan_to_num(9.0))


def test_argmax_lowest_is_torch_argmax_on_ties_nan_and_inf():
    """numpy's argmax stands in for torch's on CPU float rows: the same index on every adversary."""
    from draftcert.summary import argmax_lowest

    g = torch.Generator().manual_seed(5)
    rows = []
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(49_152, generator=g).to(dtype)
        rows.append(x)
        t = x.clone(); t[[7, 300, 40_000]] = 1e4; rows.append(t)  # exact ties: the lowest index
        t = x.clone(); t[[11, 12]] = float("nan"); rows.append(t)  # NaN ranks first
        t = x.clone(); t[[900, 50]] = float("inf"); rows.append(t)
        rows.append(torch.full((10,), -float("inf"), dtype=dtype))
        rows.append(x[::3])  # a strided view
        rows.append(torch.zeros(5, dtype=dtype))
    rows.append(torch.randn(100, generator=g).to(torch.bfloat16))  # no numpy dtype: torch's own
    for r in rows:
        assert argmax_lowest(r) == int(r.argmax()), (r.dtype, r.shape)
