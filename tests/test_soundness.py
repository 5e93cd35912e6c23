"""Adversarial soundness suite for the floating-point contract (docs/theory.md, section 7).

``certified(...) True`` must imply that the drafter's proposal is accepted by the rule
evaluated exactly on the given values, for every input the API accepts.  The truth is
independent (tests/oracles/exact_truth.py: exact comparisons, float64 with a margin, mpmath
in the margin; it imports nothing from draftcert).  Cases: near-ties between the top two
tokens from 1e-1 down to 1e-12 (in logit space), every target x drafter dtype pairing
among float16, bfloat16, float32, float64, probabilities and logits, V from 2 to 151,936,
probability rows off-normalised within the 1e-4 tolerance, peaked rows with tiny tails and
tiny thresholds, every rule (and a user LevelSet), all three divergences.  Each case also
checks that ``accepts`` equals the exact truth.  For small V the radius is checked to be
<= the exact radius and the divergence >= the exact divergence (mpmath closed forms).

Default run: ~6.8 * 10^4 cases (~30 s on one core); ``-m slow``: > 10^6.  The count is printed (``-s``).
"""

from __future__ import annotations

import itertools
import math

import mpmath
import numpy as np
import pytest
import torch

import draftcert as dc
from tests.oracles import exact_truth as X

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
KINDS = ("forward", "reverse", "tv")
USER = dc.LevelSet(lambda p: 0.7 * p.max(-1).values, name="user:0.7")
RULES = ["strict", "additive:0.05", "multiplicative:0.5", "topm:2", "relaxed:2:0.05", "relaxed:1:0.3",
         "entropy:0.09:0.3", "typical:0.09:0.3", "mars:0.3", "tree:1", "tree:3", USER]
TINY_RULES = ["multiplicative:1e-20", "additive:1e-12", "relaxed:2:1e-12", "typical:1e-9:0.5", "strict", "tree:2"]


def _spec(r) -> str:
    return r if isinstance(r, str) else r.spec


def _gen(rng: np.random.Generator, n: int, V: int, t_dtype, t_logits: bool, q_dtype, q_logits: bool,
         peaked: bool = False):
    """n target rows and n drafter rows as (given tensors, their exact float64 copies)."""
    scale = rng.uniform(0.3, 4.0, (n, 1)) * (12.0 if peaked else 1.0)
    z = rng.standard_normal((n, V)) * scale
    i0 = rng.integers(0, V, n)
    i1 = (i0 + rng.integers(1, V, n)) % V
    top = z.max(1) + (rng.uniform(0.1, 3.0, n) * (8.0 if peaked else 1.0))
    delta = 10.0 ** rng.uniform(-12, -1, n)
    rows = np.arange(n)
    z[rows, i0] = top
    z[rows, i1] = top - delta
    if peaked:  # tiny tails: every other token far below the top two
        z = np.where(np.arange(V)[None, :] == i0[:, None], z, z - 40)
        z[rows, i1] = top - delta
    # drafter: near the target, often with the top two swapped (it then proposes the loser)
    noise = 10.0 ** rng.uniform(-12, -2, (n, 1))
    y = z + noise * rng.standard_normal((n, V))
    swap = rng.random(n) < 0.6
    y[rows[swap], i0[swap]], y[rows[swap], i1[swap]] = z[rows[swap], i1[swap]], z[rows[swap], i0[swap]]
    # near the certificate's boundary: the optimal rejecting drafter for the top two (both at
    # their mean probability), nudged by +-delta * 10^-j toward either side of the tie
    edge = rng.random(n) < 0.35
    lvl = np.logaddexp(z[rows, i0], z[rows, i1]) - math.log(2)
    nu = delta * 10.0 ** -rng.integers(1, 7, n) * rng.choice([-1.0, 1.0], n)
    y[edge] = z[edge]
    y[rows[edge], i0[edge]] = lvl[edge] - nu[edge]
    y[rows[edge], i1[edge]] = lvl[edge] + nu[edge]

    def given(a, dtype, as_logits):
        a = torch.from_numpy(a)
        if as_logits:
            g = a.to(dtype)
        else:
            p = torch.softmax(a, -1)
            p = p * (1 + torch.from_numpy(rng.uniform(-9e-5, 9e-5, (n, 1))))  # off-normalised
            g = p.to(dtype)
        return g, g.double().numpy()

    t, t64 = given(z, t_dtype, t_logits)
    q, q64 = given(y, q_dtype, q_logits)
    keep = np.ones(n, dtype=bool)
    if not t_logits:
        keep &= np.abs(t64.sum(1) - 1) <= 9.9e-5
    if not q_logits:
        keep &= np.abs(q64.sum(1) - 1) <= 9.9e-5
    if t_logits:
        keep &= np.isfinite(t64).all(1)
    if q_logits:
        keep &= np.isfinite(q64).all(1)
    idx = torch.from_numpy(np.flatnonzero(keep))
    return t[idx], t64[keep], q[idx], q64[keep]


def _kw(t, t_logits, q, q_logits):
    return {("target_logits" if t_logits else "target_probs"): t, ("draft_logits" if q_logits else "draft_probs"): q}


def _check_batch(rules, t, t64, t_logits, q, q64, q_logits, failures: list) -> int:
    """Certified => exactly accepted, and accepts == exact truth, for every rule and
    divergence on one batch of rows.  Returns the number of (row, rule, divergence) cases."""
    if t64.shape[0] == 0:
        return 0
    kw = _kw(t, t_logits, q, q_logits)
    cases = 0
    for rule in rules:
        spec = _spec(rule)
        truth = X.truth_accepts(spec, t64, t_logits, q64)
        acc = np.asarray(dc.accepts(rule, **kw))
        for i in np.flatnonzero(acc != truth)[:3]:
            failures.append(f"accepts {spec}: row {i} library {acc[i]} exact {truth[i]}; t={t64[i][:4]} q={q64[i][:4]}")
        for kind in KINDS:
            cert = np.asarray(dc.certified(rule, divergence=kind, **kw))
            CERTIFIED[0] += int(cert.sum())
            bad = np.flatnonzero(cert & ~truth)
            for i in bad[:3]:
                failures.append(f"VIOLATION {spec} {kind} {t.dtype}/{q.dtype} logits={t_logits}/{q_logits} "
                                f"V={t64.shape[1]} row {i}: certified, exact rule rejects; t={t64[i][:4]} q={q64[i][:4]}")
            cases += cert.shape[0]
    return cases


CERTIFIED = [0]  # how many cases were certified at all (the suite must not be vacuous)


def _pairings():
    for (td, qd), (tl, ql) in itertools.product(itertools.product(DTYPES, DTYPES), [(True, True), (False, True), (True, False), (False, False)]):
        yield td, tl, qd, ql


def _run(scale: int, seed: int) -> tuple[int, list]:
    rng = np.random.default_rng(seed)
    failures: list = []
    cases = 0
    pairings = list(_pairings())
    # small and medium V: every dtype pairing
    for j, (td, tl, qd, ql) in enumerate(pairings):
        V = [2, 3, 5, 8, 17, 64, 300, 1000][j % 8]
        n = 12 * scale
        cases += _check_batch(RULES, *_unpack(_gen(rng, n, V, td, tl, qd, ql), tl, ql), failures)
        # tiny tails with tiny thresholds (float32 / float64 only: lower precisions flush them)
        if td in (torch.float32, torch.float64) and j % 2 == 0:
            cases += _check_batch(TINY_RULES, *_unpack(_gen(rng, 4 * scale, max(V, 4), td, tl, qd, ql, peaked=True), tl, ql), failures)
    # large V: one batch per target dtype, logits (the profiler's case) and probabilities
    for td, tl in [(torch.float32, True), (torch.bfloat16, True), (torch.float64, False), (torch.float16, True)]:
        V = 151936 if td != torch.float16 else 32000
        cases += _check_batch(RULES, *_unpack(_gen(rng, max(2, scale // 2), V, td, tl, torch.float32, True), tl, True), failures)
    return cases, failures


def _unpack(g, tl, ql):
    t, t64, q, q64 = g
    return t, t64, tl, q, q64, ql


def test_certified_implies_exactly_accepted():
    CERTIFIED[0] = 0
    cases, failures = _run(scale=4, seed=0)
    print(f"\nsoundness suite: {cases} cases, {CERTIFIED[0]} certified, {len(failures)} failures")
    assert cases >= 10_000
    assert CERTIFIED[0] >= cases // 10  # many near-boundary certificates, not a vacuous pass
    assert not failures, "\n".join(failures[:20])


@pytest.mark.slow
def test_certified_implies_exactly_accepted_large():
    total, failures = 0, []
    for seed in range(1, 6):
        c, f = _run(scale=16, seed=seed)
        total += c
        failures += f
    print(f"\nsoundness suite (slow): {total} cases, {CERTIFIED[0]} certified, {len(failures)} failures")
    assert total >= 1_000_000
    assert not failures, "\n".join(failures[:20])


# ---------------------------------------------------------------------------
# directed safety against the exact closed forms (small V, mpmath)
# ---------------------------------------------------------------------------


def test_radius_below_and_divergence_above_exact():
    rng = np.random.default_rng(7)
    failures = []
    n_checked = 0
    for j, (td, tl, qd, ql) in enumerate(_pairings()):
        V = [2, 3, 4, 6][j % 4]
        t, t64, q, q64 = _gen(rng, 3, V, td, tl, qd, ql)
        for i in range(t64.shape[0]):
            for rule in RULES[:-1]:
                for kind in KINDS:
                    r = float(dc.radius(rule, logits=t[i], divergence=kind)) if tl else float(dc.radius(rule, t[i], kind))
                    ex = X.exact_radius(rule, t64[i], tl, kind)
                    n_checked += 1
                    if r > ex:
                        failures.append(f"radius {rule} {kind} {td} logits={tl}: {r!r} > exact {mpmath.nstr(ex, 20)}; t={t64[i]}")
                    elif ex < mpmath.inf and ex > 1e-8 and r < float(ex) * (1 - 1e-6):
                        failures.append(f"radius {rule} {kind}: {r!r} far below exact {mpmath.nstr(ex, 20)}; t={t64[i]}")
            for kind in KINDS:
                d = float(dc.divergence(**{("target_logits" if tl else "target_probs"): t[i],
                                           ("draft_logits" if ql else "draft_probs"): q[i]}, kind=kind))
                ex = X.exact_divergence(t64[i], tl, q64[i], ql, kind)
                n_checked += 1
                if d < ex:
                    failures.append(f"divergence {kind}: {d!r} < exact {mpmath.nstr(ex, 20)}")
                elif d > float(ex) * (1 + 1e-6) + 1e-13:  # tv: an absolute error term (section 7)
                    failures.append(f"divergence {kind}: {d!r} far above exact {mpmath.nstr(ex, 20)}")
    assert n_checked > 500
    assert not failures, "\n".join(failures[:20])


# ---------------------------------------------------------------------------
# the five reproductions of issue 8
# ---------------------------------------------------------------------------


def test_issue8_low_precision_inputs():
    t = torch.tensor([1.9377510594469194, 1.9262515141490022], dtype=torch.float64)
    d = torch.tensor([1.9296875, 1.9375], dtype=torch.bfloat16)
    assert not bool(dc.accepts("strict", target_logits=t, draft_logits=d))
    assert not bool(dc.certified("strict", target_logits=t, draft_logits=d))
    kl = float(dc.divergence(target_logits=t, draft_logits=d))
    ex = X.exact_divergence(t.numpy(), True, d.double().numpy(), True, "forward")
    assert float(ex) <= kl <= float(ex) * (1 + 1e-9)
    assert float(dc.radius("strict", logits=t)) <= float(X.exact_radius("strict", t.numpy(), True, "forward"))
    V = 151936
    x = torch.full((V,), -5.3)
    x[0], x[1] = 0.1, 0.099
    y = x.double().clone()
    y[0], y[1] = x[1].double(), x[0].double()
    assert not bool(dc.accepts("strict", target_logits=x, draft_logits=y))
    for kind in KINDS:
        assert not bool(dc.certified("strict", target_logits=x, draft_logits=y, divergence=kind))


def test_issue8_unnormalised_rows_are_renormalised():
    p, q = [0.51, 0.49], [0.49995, 0.50015]
    assert not bool(dc.accepts("strict", p, q))
    for kind in KINDS:
        assert not bool(dc.certified("strict", p, q, kind))


def test_issue8_near_tie_reverse_radius():
    p = np.array([0.5 + 1e-9, 0.5 - 1e-9])
    for kind in KINDS:
        ex = X.exact_radius("strict", p, False, kind)
        r = float(dc.radius("strict", p, kind))
        assert r <= ex and r >= float(ex) * (1 - 1e-4), (kind, r, ex)
    assert float(dc.radius("strict", p, "reverse")) == pytest.approx(2.0e-18, rel=1e-4)


def test_issue8_reverse_tail_does_not_depend_on_k():
    x = np.full(202, math.log(5e-18))
    x[0], x[1] = 0.0, math.log(1e-30)
    got = {k: float(dc.radius("multiplicative:1e-25", logits=x, divergence="reverse", k=k)) for k in (1, 2, 8, 64, 202)}
    for k, r in got.items():
        assert round(r, 3) == 33.440, (k, r)
    assert max(got.values()) - min(got.values()) < 1e-12


def test_issue8_proposal_is_argmax_of_logits():
    d = np.array([0, 1e-8, -5], dtype=np.float32)  # proposes token 1, although exp() ties 0 and 1
    assert not bool(dc.accepts("strict", [0.6, 0.3, 0.1], draft_logits=d))
    assert not bool(dc.certified("strict", [0.6, 0.3, 0.1], draft_logits=d))
