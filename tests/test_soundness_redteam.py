"""Red-team regressions for the floating-point contract (docs/theory.md, section 7).

Each case was a violation found through the public API; the expected values come from
the independent exact truth (tests/oracles/exact_truth.py style: mpmath), not from draftcert."""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import torch

import draftcert as dc

from tests.chain_round import chain_certificates


def _exact_strict_radius_fwd(row, is_logits):
    """Exact forward-KL radius of strict (== additive:0 == multiplicative:1) by brute force
    over the pools of docs/theory.md, section 3 (mpmath, 60 digits)."""
    mp = mpmath.mp
    mp.dps = 60
    v = [float(x) for x in row]
    if is_logits:
        m = max(v)
        e = [mp.e ** (mp.mpf(x) - m) for x in v]
    else:
        e = [mp.mpf(x) for x in v]
    s = mp.fsum(e)
    P = [x / s for x in e]
    best = mp.inf
    for y in range(len(v)):
        if v[y] == max(v):
            continue
        others = sorted((i for i in range(len(v)) if i != y), key=lambda i: -P[i])
        for j in range(len(v)):
            J = others[:j] + [y]
            L = mp.fsum(P[i] for i in J) / len(J)
            if others[j:] and P[others[j]] > L:
                continue
            best = min(best, mp.fsum(P[i] * mp.log(P[i] / L) for i in J if P[i] > 0))
            break
    return best


@pytest.mark.parametrize("spec", ["additive:0", "multiplicative:1", "strict"])
@pytest.mark.parametrize("dtype,row", [
    (torch.float16, [0.71044921875, 0.71044921875, 0.421875, 0.58251953125, 0.393798828125]),
    (torch.bfloat16, [-1.4140625, -1.4140625, -7.59375, -7.40625, -2.375]),
])
@pytest.mark.parametrize("k", [1, 2, 5])
def test_tied_top_16bit_radius_below_exact_for_every_k(spec, dtype, row, k):
    # An exact tie at the top of 16-bit logits with the rejected token beyond the top-k:
    # the exact cut (float32) used to be stored back into a 16-bit cut array, rounding it
    # down onto the rejected value, so the next token was taken as the first rejected one
    # and the radius came out 4.7x the exact radius (certified() could then be wrong).
    t = torch.tensor(row, dtype=dtype)
    ex = _exact_strict_radius_fwd(row, True)
    r = float(dc.radius(spec, logits=t, k=k))
    assert r <= ex
    assert r >= float(ex) * (1 - 1e-6)
    assert r == float(dc.radius(spec, logits=t))  # k does not change the radius


def test_divergence_infinite_when_target_mass_underflows():
    # float16 logits of huge spread: exact p > 0 everywhere although exp underflows in
    # float64; a drafter with zero probabilities has infinite forward KL.
    x = torch.tensor([3626.0, 21184.0, -29664.0, 11512.0], dtype=torch.float16)
    q = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float16)
    assert math.isinf(float(dc.divergence(target_logits=x, draft_probs=q, kind="forward")))
    assert math.isinf(float(dc.divergence(target_probs=q, draft_logits=x, kind="reverse")))


def test_divergence_bounds_subnormal_drafter_terms():
    # q = exp(-746) underflows to 0 in float64 while p's second entry is e^-44 (log ratio
    # 702: psi finite, so q psi = 0): the exact forward KL is about 701 e^-44 (5e-17), not ~0.
    p = np.array([1.0, math.exp(-44)], dtype=np.float64)
    p = p / p.sum()
    ql = np.array([0.0, -746.0])
    mpmath.mp.dps = 60
    P = [mpmath.mpf(float(a)) for a in p]
    S = mpmath.fsum(P)
    P = [a / S for a in P]
    Q = [mpmath.mpf(1) / (1 + mpmath.e ** -746), mpmath.e ** -746 / (1 + mpmath.e ** -746)]
    ex = mpmath.fsum(a * mpmath.log(a / b) for a, b in zip(P, Q))
    d = float(dc.divergence(target_probs=p, draft_logits=ql, kind="forward"))
    assert d >= ex
    assert d <= float(ex) * 1.01
    r = float(dc.divergence(target_logits=ql, draft_probs=p, kind="reverse"))
    assert r >= ex


def test_entropy_16bit_deep_candidate_not_skipped():
    # float16 logits, entropy rule, rejected token just below EPSILON and beyond the top-k:
    # the arbitrary-precision walk compared the values with a 0-d float32 cut, which torch
    # rounds to float16 (onto the candidate), skipping it; the radius came out 1.3x exact.
    row = [-0.65185546875, -2.408203125, -2.890625, -1.09765625]
    t = torch.tensor(row, dtype=torch.float16)
    mpmath.mp.dps = 60
    e = [mpmath.e ** (mpmath.mpf(x) - max(row)) for x in row]
    P = [x / mpmath.fsum(e) for x in e]
    H = -mpmath.fsum(p * mpmath.log(p) for p in P)
    tau = min(mpmath.mpf(0.09), mpmath.mpf(0.3) * mpmath.e ** -H)
    assert P[1] <= tau < P[3]  # token 1 (third most probable) is the most probable rejected one
    a, b = P[0], P[3]
    L = (a + b + P[1]) / 3  # its optimal pool: all three tokens above it (docs/theory.md, section 3)
    ex = sum(x * mpmath.log(x / L) for x in (a, b, P[1]))
    for k in (1, 2, 3, 4):
        r = float(dc.radius("entropy:0.09:0.3", logits=t, k=k))
        assert r <= ex and r >= float(ex) * (1 - 1e-6)


# --- the profiler's accepted/ column and the decoding engine use the exact decision ---------

# additive:0.1 rows with p(1) within float64 rounding of p(1st) - 0.1: the float64 comparison
# the profiler and the engine used got these wrong (found by a search; truth: mpmath below).
_NEAR_ADDITIVE = [
    (False, [0.28823318729323966, 0.18823318729323965, 0.18364037168755823, 0.13027385208306935,
             0.11673571538673491, 0.09288368625615817]),
    (True, [-1.3197028922531517, -1.788476772825859, -1.5563396803122342, -1.7249306985650559,
            -1.8720823552269594, -3.786468673076233]),
]


def _exact_additive_accepts(row, is_logits, x, delta):
    mpmath.mp.dps = 80
    if is_logits:
        e = [mpmath.e ** mpmath.mpf(v) for v in row]
    else:
        e = [mpmath.mpf(v) for v in row]
    S = mpmath.fsum(e)
    P = [v / S for v in e]
    return bool(P[x] >= max(P) - mpmath.mpf(delta))


# token 1 is 2nd (probabilities) or 4th (logits): inside relaxed:4's top 4, outside relaxed:2's in the logit row
@pytest.mark.parametrize("spec", ["additive:0.1", "relaxed:4:0.1", "relaxed:2:0.1"])
@pytest.mark.parametrize("is_logits,row", _NEAR_ADDITIVE)
def test_trace_accepted_column_is_exact(is_logits, row, spec):
    from draftcert.certificates import accepts_rows
    from draftcert.certificates import accepts_from_topk
    from draftcert.profile.trace import draft_topk
    from draftcert.summary import summarize

    x = torch.tensor([row], dtype=torch.float64)
    q = torch.full((1, 6), -5.0, dtype=torch.float64)
    q[0, 1] = 0.0  # the drafter proposes token 1
    truth = _exact_additive_accepts(row, is_logits, 1, 0.1) and _in_top(row, 1, spec)
    crit = dc.parse_criterion(spec)
    s = summarize(**({"logits": x} if is_logits else {"probs": x}), k=6)
    dv, di = draft_topk(q, 4)
    got = accepts_from_topk([crit], s, dv, di, q)[spec]
    assert bool(got[0]) == truth == bool(accepts_rows(crit, s, q)[0])


def _in_top(row, x, spec):
    """relaxed:N:DELTA also needs x among the N largest (ties counted); other rules: no condition."""
    return not spec.startswith("relaxed:") or row[x] >= sorted(row, reverse=True)[int(spec.split(":")[1]) - 1]


@pytest.mark.parametrize("spec", ["additive:0.1", "relaxed:4:0.1", "relaxed:2:0.1"])
def test_engine_acceptance_is_exact(spec):
    from draftcert.decode import DraftTree, round as round_mod

    row = _NEAR_ADDITIVE[1][1]
    truth = _exact_additive_accepts(row, True, 1, 0.1) and _in_top(row, 1, spec)
    t = DraftTree()
    t.add(1, -1)
    logits = torch.full((2, 6), -5.0, dtype=torch.float64)
    logits[0] = torch.tensor(row, dtype=torch.float64)
    verdict = round_mod.accept(dc.parse_criterion(spec), logits, t, 16)
    assert (verdict.path == [0]) == truth


def test_engine_kl_is_an_upper_bound():
    # float32 logits, drafter 1e-3 away: the old float32 fast path returned 0 (below the
    # exact KL ~3e-7), so kl < radius could certify a drafter the exact KL does not.
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 2000, generator=g) * 4).float()
    y = x + 1e-3 * torch.randn(2, 2000, generator=g)
    kl = chain_certificates(dc.parse_criterion("strict"), x, y).divergence
    mpmath.mp.dps = 40
    for i in range(2):
        a = [mpmath.mpf(float(v)) for v in x[i]]
        b = [mpmath.mpf(float(v)) for v in y[i]]
        la = mpmath.log(mpmath.fsum(mpmath.e ** v for v in a))
        lb = mpmath.log(mpmath.fsum(mpmath.e ** v for v in b))
        ex = mpmath.fsum(mpmath.e ** (s - la) * ((s - la) - (u - lb)) for s, u in zip(a, b))
        # an upper bound, tight to the enclosure's absolute error (~V U times the logits' range,
        # here 2000 * 1.1e-16 * ~60 ~ 1.3e-11: divergences.forward_kl_interval)
        assert float(kl[i]) >= ex and float(kl[i]) <= float(ex) * (1 + 1e-6) + 5e-11
    # far above the radius: not certified, and the reported bound is above it
    certs = chain_certificates(dc.parse_criterion("strict"), x, x + 2 * torch.randn(2, 2000, generator=g))
    assert not any(certs.certified) and all(k > r for k, r in zip(certs.divergence, certs.radius))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_redteam_sweep(seed):
    """Random small rows in every dtype pairing (exact and 1-ulp ties, -inf / 0 entries,
    subnormal and huge values, off-normalised rows) with drafters moving the argmax onto
    each of the top tokens: certified => exact acceptance, accepts == exact, radius <=
    exact (forward) and independent of k, margin_bound <= radius."""
    from tests.oracles import redteam_truth as T  # deferred: it sets mpmath's global precision to 300 digits

    rng = np.random.default_rng(seed)
    DT = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
    specs = ["strict", "topm:2", "additive:0.1", "additive:0", "multiplicative:0.5", "multiplicative:1",
             "relaxed:2:0.1", "relaxed:2:0", "entropy:0.09:0.3", "typical:0.09:0.3", "mars:0.5", "tree:2"]
    certified = 0
    for _ in range(25):
        V = int(rng.choice([3, 5, 8]))
        dt, dq = DT[rng.integers(4)], DT[rng.integers(4)]
        is_l = bool(rng.integers(2))
        fam = int(rng.integers(5))
        if is_l:
            x = rng.normal(0, rng.choice([0.5, 3.0]), V) * (1e3 if fam == 3 else 1)
            if fam == 1:
                x[1] = x[0]
            if fam == 2:
                x[-1] = -np.inf
        else:
            x = rng.dirichlet(np.ones(V))
            if fam == 1:
                x[1] = x[0]
            if fam == 2:
                x[-1] = 0
            if fam == 3:
                x = x * (1 + 5e-5)
        t = torch.tensor(x, dtype=torch.float64).to(dt)
        if fam == 4:
            t[1] = torch.nextafter(t[0], torch.tensor(-math.inf, dtype=dt))
        if not is_l and abs(float(t.double().sum()) - 1) > 1e-4:
            continue  # a 16-bit rounding the API rejects (sum off by more than 1e-4)
        kw = {"logits": t} if is_l else {"probs": t}
        for spec in specs[:-1]:
            r = float(dc.radius(spec, **kw))
            assert r <= T.radius_fwd(spec, t.tolist(), is_l), (spec, t)
            assert r == float(dc.radius(spec, k=1, **kw)) or spec.startswith("mars"), (spec, t)
            assert float(dc.margin_bound(spec, **kw)) <= r
        base = t.double() if is_l else torch.log(t.double())
        for y in torch.argsort(-t.double(), stable=True).tolist()[:3]:
            q = base.clone().to(dq)
            if torch.isinf(q[y]):
                continue
            q[y] = torch.nextafter(q.max(), torch.tensor(math.inf, dtype=dq))
            a = {("target_logits" if is_l else "target_probs"): t, "draft_logits": q}
            xq = T.argmax_low(q.tolist())
            for spec in specs:
                ex = T.accept(spec, t.tolist(), is_l, xq, q.tolist())
                assert bool(dc.accepts(spec, **a)) == bool(ex), (spec, t, q)
                for kind in ("forward", "reverse", "tv"):
                    c = bool(dc.certified(spec, **a, divergence=kind))
                    certified += c
                    assert not c or ex, (spec, kind, t, q)
    assert certified > 0
