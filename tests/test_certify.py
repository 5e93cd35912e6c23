"""The one certification path: ``certificates.certify_rows``.

Checks that the cheap forward-KL interval encloses the exact KL (mpmath) on adversarial rows in
every dtype, that it is narrow enough to decide almost every row, that a certificate always
implies an exact KL below the radius, and that the profiler's trace, the engine's live
certificates and the library's ``certified`` give identical flags on the same rows, including
rows inside the old 1e-6 / 1e-2 bands around the radius that the profiler and the engine used
to decide on their own.
"""

from __future__ import annotations

import mpmath
import numpy as np
import pytest
import torch

import draftcert as dc
from draftcert.certificates import certify_rows, radius_rows
from draftcert.criteria import parse_criterion
from draftcert.divergences import forward_kl_interval
from draftcert.profile.trace import StepCertifier
from draftcert.summary import summarize

from tests.chain_round import chain_certificates

mpmath.mp.prec = 200
# The oracle's own error at 200 bits: below 2^-190 times the largest |logit| (<= 1e4 here).
ORACLE_TOL = mpmath.mpf(2) ** -160


def kl_upper(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The library's proven upper bound on KL(softmax x || softmax y) per row (the Bregman sum)."""
    return torch.as_tensor(dc.divergence(target_logits=x.double(), draft_logits=y.double()))  # float64 out


def exact_kl(x, y) -> mpmath.mpf:
    """KL(softmax x || softmax y) of the given values, in 200-bit arithmetic."""
    x = [mpmath.mpf(float(v)) for v in x]
    y = [mpmath.mpf(float(v)) for v in y]
    lzx = mpmath.log(mpmath.fsum(mpmath.exp(v) for v in x))
    lzy = mpmath.log(mpmath.fsum(mpmath.exp(v) for v in y))
    return mpmath.fsum(mpmath.exp(a - lzx) * ((a - lzx) - (b - lzy)) for a, b in zip(x, y))


def adversarial_rows(V: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs of logit rows that stress the error model: identical rows (KL = 0), rows one
    ulp apart, a dominant token 700 nats above the rest (underflowing tail), huge logits,
    near-ties, flat rows and ordinary drafters."""
    x = torch.randn(12, V, generator=g, dtype=torch.float64) * 3
    y = x + 0.3 * torch.randn(12, V, generator=g, dtype=torch.float64)
    y[0] = x[0]                                                   # KL = 0 exactly
    y[1] = torch.nextafter(x[1], torch.full_like(x[1], np.inf))  # one ulp apart
    x[2, 0] += 700.0                                              # underflowing tail under p
    y[3, -1] += 745.0                                             # ... and under q
    x[4] *= 3000.0                                                # huge logits
    y[4] = x[4] + torch.randn(V, generator=g, dtype=torch.float64)
    x[5, :2] = 10.0                                               # an exact tie at the top
    y[5] = x[5] + 1e-9 * torch.randn(V, generator=g, dtype=torch.float64)
    x[6] = 0.0                                                    # flat target
    x[7] = x[7] - 1e6                                             # large common offset
    y[7] = y[7] + 1e6
    return x, y


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_forward_kl_interval_encloses_the_exact_kl(dtype):
    g = torch.Generator().manual_seed(3)
    for V in (2, 7, 64):
        x, y = adversarial_rows(V, g)
        x, y = x.to(dtype), y.to(dtype)
        lo, hi = forward_kl_interval(x, y)
        for i in range(x.shape[0]):
            if not bool(torch.isfinite(x[i]).all() and torch.isfinite(y[i]).all()):  # overflowed in float16
                assert lo[i] == 0 and hi[i] == torch.inf  # left open for the exact bound
                continue
            kl = exact_kl(x[i].double().tolist(), y[i].double().tolist())
            assert mpmath.mpf(lo[i].item()) - ORACLE_TOL <= kl <= mpmath.mpf(hi[i].item()) + ORACLE_TOL, (V, i, lo[i], kl, hi[i])


def test_forward_kl_interval_is_narrow_and_below_the_bregman_bound():
    """Width ~V U times the logits' range: it decides every row farther than ~1e-8 from its radius.
    The loose bound would make the certificates needlessly incomplete, a mutant without the
    error term would fail the enclosure test above."""
    g = torch.Generator().manual_seed(5)
    V = 151_936
    x = torch.randn(3, V, generator=g) * 4
    y = x + 0.2 * torch.randn(3, V, generator=g)
    lo, hi = forward_kl_interval(x, y)
    up = kl_upper(x, y)
    assert bool(((hi - lo) < 1e-8).all()), hi - lo
    assert bool((lo <= up).all())  # both enclose the same exact value
    kl = exact_kl(x[0].double().tolist(), y[0].double().tolist())
    assert mpmath.mpf(lo[0].item()) <= kl <= mpmath.mpf(hi[0].item())


def test_a_masked_token_leaves_the_interval_open():
    x = torch.randn(2, 16)
    y = x.clone()
    x[0, 3] = -torch.inf
    lo, hi = forward_kl_interval(x, y)
    assert lo[0] == 0 and hi[0] == torch.inf and hi[1] < 1e-12


def rows_at_the_radius(crit, V: int, n: int, seed: int, rel: float):
    """Target rows and drafters whose forward KL lies within a relative ``rel`` of the
    target's radius (bisection along a fixed direction), half on each side."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, V, generator=g, dtype=torch.float64) * 2
    direction = torch.randn(n, V, generator=g, dtype=torch.float64)
    r = radius_rows(crit, summarize(logits=x.float(), k=16), "forward")
    xs = x.float()
    ys = []
    for i in range(n):
        lo_t, hi_t = 0.0, 1.0
        while float(kl_upper(xs[i:i + 1], (x[i] + hi_t * direction[i]).float()[None])) < r[i]:
            hi_t *= 2
        target = float(r[i]) * (1 + rel * (1 if i % 2 else -1))
        for _ in range(60):
            mid = 0.5 * (lo_t + hi_t)
            kl = float(kl_upper(xs[i:i + 1], (x[i] + mid * direction[i]).float()[None]))
            lo_t, hi_t = (mid, hi_t) if kl < target else (lo_t, mid)
        ys.append((x[i] + lo_t * direction[i]).float())
    return xs, torch.stack(ys)


@pytest.mark.parametrize("spec", ["strict", "additive:0.1", "topm:2", "entropy:0.09:0.3"])
def test_profiler_engine_and_library_give_identical_flags_inside_the_old_bands(spec):
    crit = parse_criterion(spec)
    flags = []
    for rel in (1e-3, 1e-7, 1e-10):
        x, y = rows_at_the_radius(crit, 96, 8, seed=11, rel=rel)
        lib = dc.certified(spec, target_logits=x, draft_logits=y)
        sc = StepCertifier([crit])
        s, bad = sc.summarize_step(x)
        cols = sc.rows([s], [bad], draft_logits=y)
        prof = cols[f"certified/{spec}"]
        assert torch.equal(prof, lib), (rel, prof, lib)
        eng = torch.tensor(chain_certificates(crit, x, y).certified)  # raises CertificateViolation if certified yet rejected
        assert torch.equal(eng, lib), (rel, eng, lib)
        flags.append(lib)
        # soundness: a certificate means the exact KL is below the (lower bound on the) radius
        r = radius_rows(crit, summarize(logits=x, k=16), "forward")
        for i in torch.nonzero(lib).flatten().tolist():
            assert exact_kl(x[i].double().tolist(), y[i].double().tolist()) < mpmath.mpf(r[i].item())
    # the rows straddle the radius: some are certified, some are not (the test is not vacuous)
    allf = torch.cat(flags)
    assert bool(allf.any()) and not bool(allf.all())


def test_certify_rows_depends_on_the_rows_alone():
    """The same row gives the same decision and bound alone, in a batch, or from a summary
    of another top-k size: nothing but the given values and the radius enters."""
    crit = parse_criterion("additive:0.1")
    x, y = rows_at_the_radius(crit, 64, 6, seed=2, rel=1e-9)
    s16 = summarize(logits=x, k=16)
    r = radius_rows(crit, s16, "forward")
    full = certify_rows(s16, y, r)
    for i in range(x.shape[0]):
        one = certify_rows(summarize(logits=x[i:i + 1], k=40), y[i:i + 1], r[i:i + 1])
        assert torch.equal(one.certified, full.certified[i:i + 1])
        assert torch.equal(one.divergence, full.divergence[i:i + 1])


def test_certify_rows_other_divergences_and_probabilities_use_the_exact_bound():
    g = torch.Generator().manual_seed(9)
    p = torch.softmax(torch.randn(5, 32, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(torch.log(p) + 0.05 * torch.randn(5, 32, generator=g, dtype=torch.float64), -1)
    for kind in ("forward", "reverse", "tv"):
        s = summarize(p, k=16)
        r = radius_rows(parse_criterion("topm:2"), s, kind)
        cert = certify_rows(s, q, r, kind, draft_is_logits=False)
        d = torch.as_tensor(dc.divergence(p, q, kind))
        pos = r > 0  # a zero radius certifies nothing and needs no bound
        assert bool(pos.any())
        assert torch.equal(cert.divergence[pos], d[pos])
        assert torch.equal(cert.certified, (d < r) & pos)


def test_several_rules_at_once_equal_one_at_a_time():
    """A [rows, C] radius (the profiler's form) decides each column as a [rows] call would."""
    specs = ["strict", "additive:0.1", "tree:2"]
    x, y = rows_at_the_radius(parse_criterion("strict"), 64, 6, seed=4, rel=1e-9)
    s = summarize(logits=x, k=16)
    r = torch.stack([radius_rows(parse_criterion(c), s, "forward") for c in specs], 1)  # [rows, 3]
    many = certify_rows(s, y, r)
    assert many.certified.shape == r.shape
    for i in range(len(specs)):
        one = certify_rows(s, y, r[:, i])
        assert torch.equal(one.certified, many.certified[:, i])
    assert bool(many.certified.any()) and not bool(many.certified.all())
