"""The one-read pass for large logits (summary._window_pass, docs/theory.md sections 4 and 7).

It sums exp(x - r) with r the maximum of the leading columns, not of the row, and finds the
top-k from strided block maxima of the same read.  These tests force it on small inputs
(the size threshold patched to 0) and check: the same top-k, ids and row minimum as the
two-pass path on rows built to break it (ties, NaN, masked prefixes, maxima far outside
the prefix, a partial last window); the error bounds on log-sum-exp and entropy against
mpmath; and the soundness suite's large-V batches (certified => exactly accepted).
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import torch

from draftcert import summary as summary_mod
from draftcert.summary import Summary, summarize
from tests import test_soundness as TS  # noqa: F401  (helpers only; its tests are collected there)
from tests.test_soundness import CERTIFIED, RULES, _check_batch, _gen, _unpack


@pytest.fixture
def window(monkeypatch):
    monkeypatch.setattr(summary_mod, "_COMPILE_MIN_NUMEL", 0)
    calls = []
    orig = summary_mod._window_pass

    def spy(*a, **kw):
        out = orig(*a, **kw)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(summary_mod, "_window_pass", spy)
    return calls


def _two_pass(x, k, entropy, validate=True):
    old = summary_mod._use_window
    summary_mod._use_window = lambda *a: False
    try:
        return summarize(logits=x, k=k, entropy=entropy, validate=validate)
    finally:
        summary_mod._use_window = old


def _adversarial(V: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(10, V, generator=g) * 3
    x[1] = torch.randint(0, 4, (V,), generator=g).float()  # massive ties, also at the k-th value
    x[2, : summary_mod._REF_COLS] = -torch.inf  # masked prefix: no finite reference
    x[3, V - 5] = x[3].max() + 40  # the maximum far outside the prefix (gap ~ 40)
    x[4, V // 2] = x[4].max() + 200  # gap beyond MAX_REF_GAP: the row is redone
    x[5, 100:] = -torch.inf  # a mostly masked row
    x[6] = x[6] * 1e3  # a wide range: most exponentials underflow
    x[7, :] = 0.0  # every value tied
    x[8, V - 3 :] = 50.0  # maxima in the partial last window (when V has one)
    x[9] = x[9] - 1e4  # far from 0: r and the values are large
    return x.to(dtype)


@pytest.mark.parametrize("V", [8192, 5 * 1024 + 384])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_pass_equals_the_two_pass_path(window, V, dtype):
    x = _adversarial(V, dtype, seed=V)
    for entropy in (True, False):
        for k in (1, 16):
            a = summarize(logits=x, k=k, entropy=entropy)
            assert window[-1], "the one-read pass did not run"
            b = _two_pass(x, k, entropy)
            assert torch.equal(a.top_vals, b.top_vals)
            assert torch.equal(x.gather(1, a.top_ids), a.top_vals)  # ids point at the values
            # where no tie crosses the k-th value the ids are unique: they must agree too
            clear = torch.topk(x.float(), k + 1, dim=-1).values[:, k] < a.top_vals[:, -1].float()
            assert torch.equal(a.top_ids[clear], b.top_ids[clear])
            assert torch.equal(a.row_min, b.row_min)
            assert bool((a.ref_gap >= 0).all()) and bool((a.ref_gap <= summary_mod.MAX_REF_GAP).all())
            assert float(a.ref_gap[3]) > 30 and float(a.ref_gap[4]) == 0.0  # used, resp. redone
            d = (a.log_norm - b.log_norm).abs()
            assert bool((d <= a.log_norm_err() + b.log_norm_err()).all())
            if entropy:
                assert bool(((a.entropy - b.entropy).abs() <= a.entropy_err() + b.entropy_err()).all())


def test_window_pass_broken_rows_are_flagged_like_the_two_pass_path(window):
    x = _adversarial(8192, torch.float32, seed=1)
    x[0, 7] = torch.nan
    x[1, 9000 % 8192] = torch.inf
    x[2, :] = -torch.inf
    with pytest.raises(ValueError, match="logits"):
        summarize(logits=x, k=16)
    a = summarize(logits=x, k=16, validate=False)
    b = _two_pass(x, 16, True, validate=False)
    assert torch.equal(torch.isfinite(a.log_norm), torch.isfinite(b.log_norm))
    assert not bool(torch.isfinite(a.log_norm[:3]).any()) and bool(torch.isfinite(a.log_norm[3:]).all())


def _exact_lse_entropy(row: np.ndarray):
    with mpmath.workdps(40):
        fin = [mpmath.mpf(float(v)) for v in row if v != -math.inf]
        m = max(fin)
        e = [mpmath.exp(v - m) for v in fin]
        s = mpmath.fsum(e)
        L = m + mpmath.log(s)
        H = mpmath.log(s) - mpmath.fsum(t * (v - m) for t, v in zip(e, fin)) / s
        return L, H


def test_window_pass_error_bounds_hold_against_mpmath(window):
    """|log_norm - L| <= log_norm_err and |entropy - H| <= entropy_err on rows with gaps from
    0 to MAX_REF_GAP, wide ranges and tails in the subnormal range; the bounds are small."""
    g = torch.Generator().manual_seed(11)
    V = 8192
    x = torch.randn(8, V, generator=g) * torch.tensor([0.3, 1, 3, 10, 30, 1, 2, 0.01])[:, None]
    x[1, 5000] = x[1, :2048].max() + 63.0  # gap just below the limit
    x[2, 7000] = x[2, :2048].max() + 17.5
    x[3, 3] = x[3].max() + 1  # the maximum inside the prefix: gap 0
    x[5, 4000:] = -torch.inf
    x[6, 6000:6100] = x[6].max() - 740  # terms near and below exp's underflow
    x[7, 8000] = 65.0 + x[7, :2048].max()  # gap just above the limit: redone
    s = summarize(logits=x, k=16)
    assert window[-1]
    L_err, H_err = s.log_norm_err(), s.entropy_err()
    assert bool((L_err < 1e-11).all()) and bool((H_err < 1e-8).all())  # not vacuous
    assert float(s.ref_gap[1]) > 60 and float(s.ref_gap[7]) == 0.0
    for i in range(x.shape[0]):
        L, H = _exact_lse_entropy(x[i].double().numpy())
        assert abs(mpmath.mpf(float(s.log_norm[i])) - L) <= float(L_err[i]), i
        assert abs(mpmath.mpf(float(s.entropy[i])) - H) <= float(H_err[i]), i
    # a summary rebuilt by hand (no gap recorded) falls back to the worst gap: never tighter
    h = Summary(s.top_probs, s.top_ids, s.entropy, s.log_norm, V, s.out, s.source, True)
    assert bool((h.log_norm_err() >= L_err).all()) and bool((h.entropy_err() >= H_err).all())


def test_window_pass_soundness_large_vocabularies(window):
    """The soundness suite's large-V batches through the one-read pass: certified => the
    rule evaluated exactly on the given values accepts, and accepts == the exact truth."""
    rng = np.random.default_rng(21)
    failures: list = []
    cases = 0
    CERTIFIED[0] = 0
    for td, V in [(torch.float32, 151936), (torch.bfloat16, 151936), (torch.float16, 32000), (torch.float32, 9000)]:
        cases += _check_batch(RULES, *_unpack(_gen(rng, 3, V, td, True, torch.float32, True), True, True), failures)
    assert all(window) and window, "the one-read pass did not run"
    assert cases >= 100 and CERTIFIED[0] > 0
    assert not failures, "\n".join(failures[:20])
