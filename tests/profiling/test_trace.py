"""The trace's fast paths against the core library's reference functions."""

import numpy as np
import torch

from draftcert import divergence, parse_criterion
from draftcert.certificates import accepts_rows
from draftcert.profile import DEFAULT_CRITERIA
from draftcert.profile.trace import accepts_from_topk, divergences_from_logits, draft_topk
from draftcert.summary import summarize


def _logits(seed, n=12, V=300):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, V, generator=g) * 3
    y = x + torch.randn(n, V, generator=g) * 0.5
    return x, y


def test_divergences_match_core_including_masked_tokens():
    x, y = _logits(0)
    y[1] = x[1]  # identical rows: 0, not -1e-17
    x[2, 5] = -torch.inf  # target masks a token the drafter allows: finite KL(p||q), inf KL(q||p)
    y[3, 7] = -torch.inf  # drafter masks a token the target allows: KL(p||q) = inf
    x[4, 9] = y[4, 9] = -torch.inf  # both mask it: 0 log 0 terms
    # approximate normalisers (as float32 summaries give) must not leak into the result
    lp = torch.logsumexp(x.double(), 1) + 1e-6
    lq = torch.logsumexp(y.double(), 1) - 2e-6
    kf, kr, tv, log_zq = divergences_from_logits(x, lp, y, lq)
    np.testing.assert_allclose(log_zq.numpy(), torch.logsumexp(y.double(), 1).numpy(), rtol=1e-14)
    for kind, got in (("forward", kf), ("reverse", kr), ("tv", tv)):
        want = divergence(target_logits=x.double(), draft_logits=y.double(), kind=kind)
        # divergence() is a proven upper bound (docs/theory.md, section 7); for TV it carries
        # an absolute term ~ 2 V U from the two normalisers
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-11, atol=1e-14 if kind != "tv" else 1e-12)
        assert np.all(got.numpy() <= want.numpy() * (1 + 1e-12) + 1e-15)
    assert 0 <= kf[1] < 1e-14 and 0 <= kr[1] < 1e-14 and tv[1] < 1e-14
    assert torch.isfinite(kf[2]) and torch.isinf(kr[2]) and torch.isinf(kf[3]) and torch.isfinite(kf[4])


def test_acceptance_fast_path_equals_accepts_rows_with_ties():
    crits = [parse_criterion(c) for c in DEFAULT_CRITERIA]
    x, y = _logits(1, n=40)
    # integer-valued drafter logits: many exact ties, also across the top-16 boundary
    y = torch.round(y / 2)
    y[0] = 0.0  # every token tied: argmax is token 0, tree:m keeps tokens 0..m-1
    y[1, :40] = 9.0  # 40 tied maxima
    x[2] = torch.round(x[2])  # target ties
    x[3] = 0.0
    t = summarize(logits=x, k=64)
    dv, di = draft_topk(y, 16)
    got = accepts_from_topk(crits, t, dv, di, y)
    for c in crits:
        np.testing.assert_array_equal(got[c.spec].numpy(), accepts_rows(c, t, y).numpy(), err_msg=c.spec)


def test_radius_shortcuts_are_exact():
    """Empty rejection regions (+inf) and deep rows (rejected token below the top-64,
    decided on a top-(n+1) summary) agree with the core's full-sort fallback."""
    from draftcert.certificates import radius_rows
    from draftcert.profile.trace import _radii

    x, _ = _logits(2, n=40, V=400)
    x[:10] *= 0.05  # flat: p(1st) < 0.1, so additive:0.1 can reject nothing
    x[10:25] *= 0.3  # fairly flat: entropy's rejected tokens lie below the top 64
    s = summarize(logits=x, k=64)
    deep_seen = 0
    for spec in DEFAULT_CRITERIA + ("additive:0", "additive:0.5", "entropy:0.01:0.9", "multiplicative:0.05"):
        c = parse_criterion(spec)
        if hasattr(c, "rejected_mask"):
            tau = c.threshold_from_summary(s)
            deep_seen += int((~c.rejected_mask(s.top_probs, tau[:, None]).any(1) & (tau > 0)).sum())
        got = _radii(c, s, ["forward", "reverse", "tv"])
        for d, r in got.items():
            np.testing.assert_allclose(r.numpy(), radius_rows(c, s, d).numpy(), rtol=1e-12, atol=0,
                                       err_msg=f"{spec} {d}")
    assert deep_seen > 10
    assert torch.isinf(_radii(parse_criterion("additive:0.1"), s, ["forward"])["forward"][:10]).all()
