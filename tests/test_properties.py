"""Property tests (hypothesis): soundness, tightness, monotonicity, identities, bounds."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import draftcert as dc
from tests.oracles import reference as R

KINDS = ("forward", "reverse", "tv")
SINGLE = [
    "strict",
    "additive:0.05",
    "additive:0.3",
    "multiplicative:0.5",
    "multiplicative:0.1",
    "topm:2",
    "topm:3",
    "relaxed:2:0.05",  # N <= 2 <= V for every drawn p (N > V is a ValueError, as for topm)
    "relaxed:2:0.3",
    "relaxed:1:0.1",
    "entropy",
    "entropy:0.3:2",
    "typical",
    "typical:0.3:0.8",
    "mars:0.3",
    "mars:1",
]
TREES = ["tree:1", "tree:2", "tree:3", "tree:5"]


@st.composite
def dists(draw, min_v=2, max_v=8, zeros=True):
    """Distributions with exact ties (small-integer weights), zeros and continuous values."""
    V = draw(st.integers(min_v, max_v))
    atoms = [st.integers(1, 4).map(float), st.floats(1e-3, 1.0)]
    if zeros:
        atoms.append(st.just(0.0))
    w = np.array(draw(st.lists(st.one_of(*atoms), min_size=V, max_size=V)), dtype=np.float64)
    assume(w.sum() > 0)
    return w / w.sum()


def _mix(p, q, t):
    return (1 - t) * p + t * q


# ---------------------------------------------------------------------------
# soundness and tightness
# ---------------------------------------------------------------------------



def _assert_mixtures_certified(spec, p, q_star, kind, rad):
    """Drafters on the segment from p toward the optimal rejecting q*, stopping short of
    it, lie strictly inside the radius: each must be certified and accepted."""
    for t in (0.5, 0.9, 0.999, 1 - 1e-6):
        q_t = _mix(p, q_star, t)
        assert R.div_np(p, q_t, kind) < rad
        assert bool(dc.certified(spec, p, q_t, kind))
        assert bool(dc.accepts(spec, p, q_t)), f"certified drafter rejected at t={t}: q={q_t.tolist()}"

@given(p=dists(), spec=st.sampled_from(SINGLE), kind=st.sampled_from(KINDS))
def test_adversarial_single_token(p, spec, kind):
    """q* = the optimal rejecting drafter for the most probable rejected token (explicit
    water-filling).  Its cost equals the radius; mixtures (1-t) p + t q* for t < 1 lie
    strictly inside the radius (convexity) and must be accepted; q* nudged past its tie
    must be rejected (so the radius cannot be any larger)."""
    assume(not spec.startswith("topm:") or int(spec[5:]) <= p.shape[0])
    rad = float(dc.radius(spec, p, kind))
    R_ = R.rejected_set(spec, p)
    if len(R_) == 0:
        assert rad == math.inf
        return
    y = int(R_[np.argmax(p[R_])])
    q_star, cost = R.lift_q(p, y, kind)
    if q_star is None:  # reverse KL and p(y) = 0 for every rejected y
        assert rad == math.inf
        return
    assert rad <= cost * (1 + 1e-9) + 1e-12, "radius above the cost of an explicit rejecting drafter: unsound"
    assert rad >= cost * (1 - 1e-9) - 1e-12, "radius below the cheapest rejection: not exact"
    # nudged q*: y strictly on top -> rejected, at a divergence ~ the radius
    q_n = q_star.copy()
    q_n[y] += 1e-9
    q_n /= q_n.sum()
    assert not bool(dc.accepts(spec, p, q_n))
    if rad == 0:
        return
    _assert_mixtures_certified(spec, p, q_star, kind, rad)


@given(p=dists(), m=st.integers(1, 5), kind=st.sampled_from(KINDS))
def test_adversarial_tree(p, m, kind):
    """Same for tree:m with the explicit optimal drafter that pools a with runners-up."""
    V = p.shape[0]
    spec = f"tree:{m}"
    rad = float(dc.radius(spec, p, kind))
    if m >= V:
        assert rad == math.inf
        return
    q_star, cost = R.tree_q(p, m, kind)
    if q_star is None:
        assert rad == math.inf
        return
    assert abs(rad - cost) <= 1e-9 * cost + 1e-12, (rad, cost)
    a = R.argmax_lowest(p)
    S = [z for z in np.argsort(-p, kind="stable") if z != a][:m]
    if q_star[a] > 1e-6:
        q_n = q_star.copy()
        q_n[S] += 1e-9
        q_n /= q_n.sum()
        assert not bool(dc.accepts(spec, p, q_n))
    if rad == 0:
        return
    _assert_mixtures_certified(spec, p, q_star, kind, rad)


@settings(max_examples=15)
@given(p=dists(), seed=st.integers(0, 2**31 - 1), sigma=st.sampled_from([1e-3, 1e-2, 0.1, 0.5, 2.0]))
def test_random_drafters_near_p(p, seed, sigma):
    """Random q = softmax(log p + sigma * noise) (support of p kept, or smoothed):
    certified => accepted, for every criterion and divergence."""
    rng = np.random.default_rng(seed)
    V = p.shape[0]
    Q = []
    for _ in range(32):
        base = np.log(np.where(p > 0, p, 1e-300)) if rng.random() < 0.5 else np.log(p + 1e-3)
        z = base + sigma * rng.standard_normal(V)
        q = np.exp(z - z.max())
        Q.append(q / q.sum())
    Q = np.stack(Q)
    P = np.broadcast_to(p, Q.shape).copy()
    for spec in SINGLE + TREES:
        if spec.startswith("topm:") and int(spec[5:]) > V:
            continue
        acc = dc.accepts(spec, P, Q)
        for kind in KINDS:
            cert = dc.certified(spec, P, Q, kind)
            assert not np.any(cert & ~acc), (spec, kind, Q[cert & ~acc])


# ---------------------------------------------------------------------------
# monotonicity: relaxing a parameter never shrinks the radius
# ---------------------------------------------------------------------------

# (family, parameter pairs (strict -> relaxed)); direction checked against the definitions:
#   additive: accept p(x) >= max - DELTA        -> larger DELTA relaxes
#   multiplicative: accept p(x) >= ALPHA max    -> smaller ALPHA relaxes
#   topm / tree: larger M relaxes
#   relaxed: accept top N and p(x) >= max - DELTA -> larger N or DELTA relaxes
#   mars: accept runner-up when log(p1/p2) <= THETA -> larger THETA relaxes
#   entropy: reject p(x) <= min(EPS, DELTA e^-H)  -> SMALLER EPS or DELTA relaxes


def _pairs(draw_lo, draw_hi):
    return st.tuples(draw_lo, draw_hi)


@given(
    p=dists(),
    kind=st.sampled_from(KINDS),
    a=st.floats(0, 1),
    b=st.floats(0, 1),
    fam=st.sampled_from(["additive", "multiplicative", "mars", "entropy_eps", "entropy_delta", "relaxed"]),
)
def test_monotone_in_parameters(p, kind, a, b, fam):
    lo, hi = min(a, b), max(a, b)
    if fam == "additive":
        tight, relaxed = f"additive:{lo!r}", f"additive:{hi!r}"
    elif fam == "relaxed":  # relaxed:N:DELTA: larger DELTA (and larger N) relaxes
        tight, relaxed = f"relaxed:1:{lo!r}", f"relaxed:2:{hi!r}"
    elif fam == "multiplicative":
        assume(lo > 0)
        tight, relaxed = f"multiplicative:{hi!r}", f"multiplicative:{lo!r}"
    elif fam == "mars":
        tight, relaxed = f"mars:{3 * lo!r}", f"mars:{3 * hi!r}"
    elif fam == "entropy_eps":
        assume(lo > 0)
        tight, relaxed = f"entropy:{hi!r}:0.3", f"entropy:{lo!r}:0.3"
    else:
        assume(lo > 0)
        tight, relaxed = f"entropy:0.09:{3 * hi!r}", f"entropy:0.09:{3 * lo!r}"
    r_t = float(dc.radius(dc.parse_criterion(tight), p, kind))
    r_r = float(dc.radius(dc.parse_criterion(relaxed), p, kind))
    assert r_r >= r_t, (tight, r_t, relaxed, r_r)


@given(p=dists(), kind=st.sampled_from(KINDS))
def test_monotone_in_m(p, kind):
    V = p.shape[0]
    top = [float(dc.radius(f"topm:{m}", p, kind)) for m in range(1, V + 1)]
    tree = [float(dc.radius(f"tree:{m}", p, kind)) for m in range(1, V + 1)]
    assert all(x <= y for x, y in zip(top, top[1:])), top
    assert all(x <= y for x, y in zip(tree, tree[1:])), tree
    assert tree[-1] == math.inf and top[-1] == math.inf  # topm:V and tree:V reject nothing


# ---------------------------------------------------------------------------
# identities and closed-form bounds
# ---------------------------------------------------------------------------


@given(p=dists(zeros=True), kind=st.sampled_from(KINDS))
def test_tree1_vs_strict(p, kind):
    """Without a tie at the top tree:1 == strict; with one, tree:1 has radius 0 (the tied
    runner-up already counts against a) while strict accepts any maximiser."""
    s = np.sort(p)[::-1]
    r_tree = float(dc.radius("tree:1", p, kind))
    r_strict = float(dc.radius("strict", p, kind))
    if s[0] > s[1]:
        assert r_tree == pytest.approx(r_strict, rel=1e-12, abs=1e-15)
    else:
        assert r_tree == 0.0
        assert r_strict > 0.0  # strict: infinite if all of p sits on the tied maximisers


@given(p=dists(), spec=st.sampled_from(SINGLE + ["multiplicative:1", "additive:0"]))
def test_forward_radius_at_most_log2(p, spec):
    assume(not spec.startswith("topm:") or int(spec[5:]) <= p.shape[0])
    r = float(dc.radius(spec, p, "forward"))
    assert r == math.inf or r <= math.log(2) + 1e-12


@given(p=dists(), m=st.integers(1, 7))
def test_forward_tree_radius_at_most_log_m_plus_1(p, m):
    r = float(dc.radius(f"tree:{m}", p, "forward"))
    assert r == math.inf or r <= math.log(m + 1) + 1e-12


def test_log_bounds_are_attained():
    """The suprema are reached by point masses."""
    assert float(dc.radius("strict", np.array([1.0, 0.0]), "forward")) == pytest.approx(math.log(2))
    for m in (1, 3, 5):
        p = np.zeros(m + 2)
        p[0] = 1
        assert float(dc.radius(f"tree:{m}", p, "forward")) == pytest.approx(math.log(m + 1))


@given(p=dists(), spec=st.sampled_from(SINGLE + TREES + ["tree:7", "topm:1", "multiplicative:1"]), kind=st.sampled_from(KINDS))
def test_margin_bound_below_radius(p, spec, kind):
    assume(not spec.startswith("topm:") or int(spec[5:]) <= p.shape[0])
    b = float(dc.margin_bound(spec, p, kind))
    r = float(dc.radius(spec, p, kind))
    assert b <= r, (b, r)  # no tolerance: the bound never claims more than the (rounded-down) radius
    # where no token can be rejected both are +inf; where one can, both are finite
    assert (b == math.inf) == (r == math.inf), (b, r)


@given(d=st.floats(0, 1), kind=st.sampled_from(KINDS))
def test_strict_margin_bound_sharp(d, kind):
    """For strict the bound is the infimum over all p with margin d, attained on V = 2:
    bound(d) == radius(((1+d)/2, (1-d)/2)) up to rounding down, and never above it."""
    p = np.array([(1 + d) / 2, (1 - d) / 2])
    d = p[0] - p[1]  # the margin actually represented
    r = float(dc.radius("strict", p, kind))
    b = float(dc.margin_bound("strict", p, kind))
    g = float(np.asarray(dc.margin_bound_from_statistic("strict", np.array(p[0] - p[1]), kind)))
    if d == 0:
        assert r == math.inf
        return
    # equal up to the bound's documented rounding down (2^-32 relative + 2 * 2^-51 absolute),
    # and never above the radius as the library computes it
    for v in (b, g):
        assert v <= r
        assert v >= r * (1 - 1e-9) - 2e-15
    closed = {
        "forward": (1 + d) / 2 * math.log1p(d) + (1 - d) / 2 * math.log1p(-d) if d < 1 else math.log(2),
        "reverse": -0.5 * math.log1p(-d * d) if d < 1 else math.inf,
        "tv": d / 2,
    }[kind]
    assert r == pytest.approx(closed, rel=1e-9, abs=1e-15)


@given(p=dists(min_v=3), kind=st.sampled_from(KINDS))
def test_strict_bound_is_infimum(p, kind):
    """Any target with margin d has strict radius >= the V=2 radius at margin d (= bound)."""
    s = np.sort(p)[::-1]
    d = s[0] - s[1]
    assume(d > 0)
    two = np.array([(1 + d) / 2, (1 - d) / 2])
    assert float(dc.radius("strict", p, kind)) >= float(dc.radius("strict", two, kind)) * (1 - 1e-9) - 1e-15


def test_certified_path_is_exercised():
    """Guard against a vacuous 'certified => accepted' check: close drafters are certified."""
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.49, 0.31, 0.2])
    for kind in KINDS:
        for spec in ["strict", "additive:0.05", "topm:2", "relaxed:2:0.05", "tree:1", "tree:2", "mars:0.3"]:
            assert bool(dc.certified(spec, p, q, kind)) and bool(dc.accepts(spec, p, q))


@pytest.mark.parametrize("spec", ["strict", "additive:0.1", "multiplicative:0.5", "tree:2"])
def test_margin_bound_reverse_extremely_peaked(spec):
    """Regression: the reverse-KL bound used 1 - G, which float64 cannot resolve below
    ~1e-16; for p = (1, 1e-18) it was +inf while the exact radius is ~20 nats
    (found by benchmarks/bench_margin_gap.py)."""
    for p2 in (1e-18, 6e-17, 1e-13):
        p = np.array([1.0 - p2, p2, 0.0])
        p = p / p.sum()
        b = float(dc.margin_bound(spec, p, "reverse"))
        r = float(dc.radius(spec, p, "reverse"))
        assert b <= r * (1 + 1e-9), (p2, b, r)
        assert math.isfinite(b)


def test_margin_bound_below_radius_tiny_masses():
    """margin_bound <= radius on targets with masses down to 1e-300 (logits over a wide range)."""
    rng = np.random.default_rng(5)
    for _ in range(25):
        V = int(rng.integers(2, 9))
        z = rng.uniform(-1, 1, (16, V)) * rng.choice([5.0, 40.0, 300.0], (16, V))
        P = np.exp(z - z.max(1, keepdims=True))
        P /= P.sum(1, keepdims=True)
        for spec in SINGLE + TREES:
            if spec.startswith("topm:") and int(spec[5:]) > V:
                continue
            for kind in KINDS:
                b = dc.margin_bound(spec, P, kind)
                r = dc.radius(spec, P, kind)
                bad = ~(b <= r * (1 + 1e-9) + 1e-15)
                assert not bad.any(), (spec, kind, P[bad][:2], b[bad][:2], r[bad][:2])
