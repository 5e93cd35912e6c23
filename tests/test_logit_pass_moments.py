"""The fused native moments of summary.summarize (logit_pass.c's lp_logit_moments).

Its exp against an extended-precision exp, down through the subnormals; the log-normaliser and
entropy against mpmath within the summary's stated bounds; and the invariances the profiler and
the engine rely on: a row's bits do not depend on the other rows, the thread count or the
half-precision dtype of the same values; rows with a NaN or +inf logit and the switch back to
torch give torch's values.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import torch

from draftcert import logit_pass
from draftcert import summary as S
from draftcert.summary import summarize

U = 2.0**-53
fused = pytest.mark.skipif(logit_pass.reason("summary") != "", reason=f"no fused pass: {logit_pass.reason('summary')}")


def torch_summary(monkeypatch, x, **kw):
    """summarize() with the fused moments switched off (torch's eager moments)."""
    monkeypatch.setenv("DRAFTCERT_FUSED_SUMMARY", "0")
    try:
        return summarize(logits=x, **kw)
    finally:
        monkeypatch.delenv("DRAFTCERT_FUSED_SUMMARY")


@pytest.fixture
def ran(monkeypatch):
    """Counts the rows the fused moments computed (so that a test cannot pass on torch's path)."""
    calls = []
    orig = logit_pass.logit_moments

    def spy(x, m, want):
        out = orig(x, m, want)
        calls.append(0 if out is None else out.shape[0])
        return out

    monkeypatch.setattr(logit_pass, "logit_moments", spy)
    return calls


@fused
@pytest.mark.skipif(np.finfo(np.longdouble).nmant < 60, reason="needs an extended-precision long double")
def test_gradual_exp_is_within_two_units_and_rounds_once_into_the_subnormals():
    rng = np.random.default_rng(3)
    ln2 = np.log(np.longdouble(2))
    k = np.arange(-1080, 1)
    mid = ((k + 0.5) * ln2).astype(np.float64)  # where the reduction switches n: |r| largest
    a = np.concatenate([rng.uniform(-708, 0, 1_000_000), rng.uniform(-746, -707, 300_000), -rng.exponential(1e-3, 50_000),
                        mid, np.nextafter(mid, 0), np.nextafter(mid, -np.inf), [0.0, -1e-300, -708.0, -745.13]])
    got = logit_pass.exp_gradual(torch.from_numpy(a)).numpy().astype(np.longdouble)
    ref = np.exp(a.astype(np.longdouble))
    normal = ref >= np.longdouble(2.0) ** -1022
    rel = np.abs(got[normal] - ref[normal]) / ref[normal]
    assert float(rel.max()) <= 2 * U, (float(rel.max() / U), a[normal][rel.argmax()])
    sub = np.abs(got[~normal] - ref[~normal])
    assert (~normal).sum() > 1000 and float(sub.max()) < 2.0**-1073, float(sub.max())  # one rounding, no flush
    assert float(got[~normal].max()) > 0  # the subnormals are kept
    edge = logit_pass.exp_gradual(torch.tensor([0.0, -760.5, -1e5, -np.inf]))
    assert torch.equal(edge, torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64))


def _exact(row: list[float]):
    with mpmath.workprec(200):  # other test modules set mpmath's global precision
        fin = [mpmath.mpf(v) for v in row if v != -math.inf]
        m = max(fin)
        e = [mpmath.exp(v - m) for v in fin]
        s = mpmath.fsum(e)
        return m + mpmath.log(s), mpmath.log(s) - mpmath.fsum(t * (v - m) for t, v in zip(e, fin)) / s


def _rows(V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(9, V, generator=g) * torch.tensor([0.3, 1, 3, 10, 30, 1, 2, 0.01, 1])[:, None]
    x[1, V // 2] = x[1].max() + 40  # one token holds nearly all the mass
    x[4] = x[4] * 30  # most terms underflow
    x[5, max(1, V // 3):] = -torch.inf  # a masked tail
    x[6, : max(1, V // 4)] = x[6].max() - torch.linspace(700, 750, max(1, V // 4))  # through the subnormals
    x[7, :] = 0.5  # all tied
    x[8] = x[8] + 1e4  # large values
    return x


@fused
@pytest.mark.parametrize("V", [2, 9, 8191, 8193, 20011])
def test_log_norm_and_entropy_hold_their_bounds_against_mpmath(ran, V):
    x = _rows(V, V)
    s = summarize(logits=x, k=min(16, V))
    assert sum(ran) == x.shape[0]
    L_err, H_err = s.log_norm_err(), s.entropy_err()
    assert bool((L_err < 1e-10).all()) and bool((H_err < 1e-8).all())  # not vacuous
    for i in range(x.shape[0]):
        L, H = _exact(x[i].double().tolist())
        with mpmath.workprec(200):
            assert abs(mpmath.mpf(float(s.log_norm[i])) - L) <= float(L_err[i]), (V, i)
            assert abs(mpmath.mpf(float(s.entropy[i])) - H) <= float(H_err[i]), (V, i)
        assert s.row_min[i] == x[i].min()


@fused
def test_fused_moments_agree_with_torch_within_the_bounds(monkeypatch, ran):
    x = _rows(20011, 4)
    a, b = summarize(logits=x, k=16), torch_summary(monkeypatch, x, k=16)
    assert sum(ran) == x.shape[0]
    assert bool(((a.log_norm - b.log_norm).abs() <= a.log_norm_err() + b.log_norm_err()).all())
    assert bool(((a.entropy - b.entropy).abs() <= a.entropy_err() + b.entropy_err()).all())
    assert torch.equal(a.row_min, b.row_min) and torch.equal(a.top_vals, b.top_vals)
    assert not torch.equal(a.entropy, b.entropy)  # the fused pass did run (its sums go in another order)


@fused
def test_a_row_gets_the_same_bits_alone_in_any_batch_dtype_and_thread_count(ran):
    x = _rows(8192 * 2 + 5, 7)  # three chunks, the last one short
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = summarize(logits=x, k=16)
        torch.set_num_threads(2)
        two = summarize(logits=x, k=16)
    finally:
        torch.set_num_threads(threads)
    keys = ("log_norm", "entropy", "row_min", "top_probs")
    for i in (0, 4, 8):
        alone = summarize(logits=x[i:i + 1], k=16)
        strided = summarize(logits=x.t().contiguous().t()[i:i + 1], k=16)
        for key in keys:
            assert torch.equal(getattr(one, key)[i:i + 1], getattr(alone, key)), key
            assert torch.equal(getattr(one, key)[i:i + 1], getattr(strided, key)), key
    for key in keys:
        assert torch.equal(getattr(one, key), getattr(two, key)), key
    h = x[:4].bfloat16()  # bfloat16 values are exact in float32: the same bits
    a, b = summarize(logits=h, k=16), summarize(logits=h.float(), k=16)
    for key in ("log_norm", "entropy"):
        assert torch.equal(getattr(a, key), getattr(b, key)), key


@fused
def test_rows_with_a_nan_or_inf_get_torch_values(monkeypatch, ran):
    x = _rows(3000, 2)
    x[1, 3] = torch.nan
    x[2, 5] = torch.inf
    x[3, :] = -torch.inf
    with pytest.raises(ValueError, match="logits"):
        summarize(logits=x, k=16)
    a = summarize(logits=x, k=16, validate=False)
    b = torch_summary(monkeypatch, x, k=16, validate=False)
    assert sum(ran) > 0
    bad = ~torch.isfinite(b.log_norm)
    assert torch.equal(~torch.isfinite(a.log_norm), bad) and bad[1:4].all() and not bad[[0, 4, 5]].any()
    for key in ("log_norm", "entropy", "row_min"):
        torch.testing.assert_close(getattr(a, key)[1:4], getattr(b, key)[1:4], rtol=0, atol=0, equal_nan=True)


def test_the_switch_turns_the_fused_moments_off(monkeypatch, ran):
    x = _rows(5000, 1)
    monkeypatch.setenv("DRAFTCERT_FUSED_SUMMARY", "0")
    assert "DRAFTCERT_FUSED_SUMMARY=0" in logit_pass.reason("summary")
    a = summarize(logits=x, k=16)
    assert ran == [0]
    s, d, lo = S._logit_moments_eager(x, a.top_vals[:, :1].double(), True)  # torch's bits
    assert torch.equal(a.log_norm, a.top_vals[:, 0].double() + torch.log(s)) and torch.equal(a.row_min, lo)
