"""The fused native divergence pass (logit_pass.c) behind divergences._logit_pair_pass.

Its exp against an extended-precision exp, its enclosure of the exact KL (mpmath) on adversarial
rows, its agreement with torch's pass within the stated error, and the invariances the profiler
relies on: a row's bits do not depend on the other rows or the thread count; non-finite rows
and the switch back to torch give torch's values.
"""

from __future__ import annotations

import mpmath
import numpy as np
import pytest
import torch

from draftcert import divergences as D
from tests.test_certify import ORACLE_TOL, adversarial_rows, exact_kl

U = 2.0**-53
fused = pytest.mark.skipif(D.fused_pass_reason() != "", reason=f"no fused pass: {D.fused_pass_reason()}")


def torch_pass(x, y, full=True):
    """The torch reductions through the same bound arithmetic: the pass without logit_pass.c."""
    return D._pair_bounds(x.shape[1], *D._torch_reductions(x, y, full), full)


@fused
@pytest.mark.skipif(np.finfo(np.longdouble).nmant < 60, reason="needs an extended-precision long double")
def test_exp_is_within_two_units_roundoff_and_flushes_below_minus_708():
    rng = np.random.default_rng(0)
    ln2 = np.log(np.longdouble(2))
    k = np.arange(-1021, 1)
    mid = ((k + 0.5) * ln2).astype(np.float64)  # where the reduction switches n: |r| largest
    a = np.concatenate([rng.uniform(-708, 0, 1_000_000), rng.uniform(-1, 0, 300_000), -rng.exponential(1e-3, 100_000),
                        mid, np.nextafter(mid, 0), np.nextafter(mid, -np.inf), [0.0, -1e-300, -708.0]])
    a = a[a >= -708]
    got = D.exp_fused(torch.from_numpy(a)).numpy().astype(np.longdouble)
    ref = np.exp(a.astype(np.longdouble))
    rel = np.abs(got - ref) / ref
    assert float(rel.max()) <= 2 * U, (float(rel.max() / U), a[rel.argmax()])
    assert D.exp_fused(torch.tensor([0.0])).item() == 1.0
    under = D.exp_fused(torch.tensor([-708.0001, -745.2, -1e5, -np.inf]))
    assert torch.equal(under, torch.zeros(4, dtype=torch.float64))  # each below 2^-1021, as charged


@fused
@pytest.mark.parametrize("V", [1, 9, 257])
def test_fused_interval_encloses_the_exact_kl_on_adversarial_rows(V):
    g = torch.Generator().manual_seed(11)
    x, y = adversarial_rows(V, g)
    x, y = x.float(), y.float()
    lo, hi = D.forward_kl_interval(x, y)
    for i in range(x.shape[0]):
        if not bool(torch.isfinite(x[i]).all() and torch.isfinite(y[i]).all()):
            assert lo[i] == 0 and hi[i] == torch.inf
            continue
        with mpmath.workprec(200):  # other test modules set mpmath's global precision
            kl = exact_kl(x[i].double().tolist(), y[i].double().tolist())
            assert mpmath.mpf(lo[i].item()) - ORACLE_TOL <= kl <= mpmath.mpf(hi[i].item()) + ORACLE_TOL, (V, i)


@fused
def test_fused_pass_agrees_with_torch_within_the_error_bound():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(12, 20011, generator=g) * 3
    x[:, :40] += 8 * torch.randn(12, 40, generator=g)
    y = x + 0.4 * torch.randn(12, 20011, generator=g)
    y[3] = x[3]
    y[4, 7] += 300.0  # the drafter's mass on one token: most of q underflows
    a, b = D.divergences_from_logits(x, y), torch_pass(x, y)
    width = (a["hi"] - a["lo"]) + (b["hi"] - b["lo"])
    assert bool(((a["kl"] - b["kl"]).abs() <= width).all())
    assert bool((a["lo"] <= b["hi"]).all() and (b["lo"] <= a["hi"]).all())  # the two enclosures meet
    for key in ("kl_reverse", "tv", "log_zq"):  # estimates: ~V U apart
        assert torch.allclose(a[key], b[key], rtol=1e-10, atol=1e-12), key
    assert not torch.equal(a["kl"], b["kl"])  # the fused pass did run (its sums go in another order)


@fused
def test_a_row_gets_the_same_bits_alone_in_any_batch_and_at_any_thread_count():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(9, 4099, generator=g) * 4
    y = x + 0.5 * torch.randn(9, 4099, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = D.divergences_from_logits(x, y)
        torch.set_num_threads(2)
        two = D.divergences_from_logits(x, y)
    finally:
        torch.set_num_threads(threads)
    for i in (0, 4, 8):
        alone = D.divergences_from_logits(x[i:i + 1], y[i:i + 1])
        strided = D.divergences_from_logits(x[i:i + 1], y.t().contiguous().t()[i:i + 1])  # column-major y
        for key in one:
            assert torch.equal(one[key][i:i + 1], alone[key]), key
            assert torch.equal(one[key][i:i + 1], strided[key]), key
    for key in one:
        assert torch.equal(one[key], two[key]), key


def without_fused(monkeypatch, fn):
    """fn() with the fused pass switched off (torch's pass throughout)."""
    monkeypatch.setenv("DRAFTCERT_FUSED_DIVERGENCE", "0")
    try:
        return fn()
    finally:
        monkeypatch.delenv("DRAFTCERT_FUSED_DIVERGENCE")


@fused
def test_rows_with_a_non_finite_logit_get_torch_values(monkeypatch):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 300, generator=g)
    y = x + 0.2 * torch.randn(5, 300, generator=g)
    x[1, 3] = -torch.inf  # a masked target token
    y[2, 5] = torch.nan
    x[3, 0] = torch.inf
    a = D.divergences_from_logits(x, y)
    b = without_fused(monkeypatch, lambda: D.divergences_from_logits(x, y))
    assert D.fused_pass_reason() == ""
    for i in (1, 2, 3):
        assert a["lo"][i] == 0 and a["hi"][i] == torch.inf
    for key in a:
        torch.testing.assert_close(a[key][1:4], b[key][1:4], rtol=0, atol=0, equal_nan=True)
    for i in (0, 4):  # the finite rows still come from the fused pass, within the bound
        assert abs(a["kl"][i] - b["kl"][i]) <= (a["hi"][i] - a["lo"][i]) + (b["hi"][i] - b["lo"][i])


def test_the_switch_turns_the_fused_pass_off(monkeypatch):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 500, generator=g)
    y = x + 0.3 * torch.randn(3, 500, generator=g)

    def run():
        assert "DRAFTCERT_FUSED_DIVERGENCE=0" in D.fused_pass_reason()
        with pytest.raises(RuntimeError, match="unavailable"):
            D.exp_fused(torch.zeros(2, dtype=torch.float64))
        return D.divergences_from_logits(x, y)

    a, b = without_fused(monkeypatch, run), torch_pass(x, y)
    for key in ("lo", "hi", "tv", "log_zq"):
        assert torch.equal(a[key], b[key]), key
