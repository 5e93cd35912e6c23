"""Public API: numpy/torch and dtype parity, batch shapes, logits path, a full-size
vocabulary (Qwen3, V = 151,936) against a plain full-sort reference, input validation,
and certified_run_length."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import draftcert as dc
from tests.oracles import reference as R

KINDS = ("forward", "reverse", "tv")
SPECS = [
    "strict",
    "additive:0.1",
    "multiplicative:0.5",
    "topm:2",
    "topm:5",
    "relaxed:2:0.1",
    "relaxed:5:0.3",
    "entropy",
    "entropy:0.5:2",
    "mars:0.5",
    "tree:1",
    "tree:2",
    "tree:4",
    "tree:8",
]


def _batch(rng, shape, V, conc=1.0):
    return rng.dirichlet(np.full(V, conc), size=shape)


# ---------------------------------------------------------------------------
# array types, dtypes, shapes, logits
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("V", [10, 100])
def test_numpy_torch_dtypes_and_shapes(V):
    rng = np.random.default_rng(V)
    P = _batch(rng, (2, 3), V, 0.3)
    P32 = P.astype(np.float32)
    P32 = P32 / P32.sum(-1, keepdims=True)
    for kind in KINDS:
        for spec in SPECS:
            a = dc.radius(spec, P, kind)
            b = dc.radius(spec, torch.from_numpy(P), kind)
            assert isinstance(a, np.ndarray) and a.shape == (2, 3) and a.dtype == np.float64
            assert isinstance(b, torch.Tensor) and b.shape == (2, 3) and b.dtype == torch.float64
            np.testing.assert_array_equal(a, b.numpy())
            c = dc.radius(spec, P32, kind)
            d = dc.radius(spec, torch.from_numpy(P32), kind)
            assert c.dtype == np.float32 and d.dtype == torch.float32 and c.shape == (2, 3)
            np.testing.assert_array_equal(c, d.numpy())
            # float32 results: the float64 answer for the same (float32) values rounded
            # DOWN (the certificate direction: never above the exact radius), within one ulp
            e = dc.radius(spec, P32.astype(np.float64), kind)
            assert np.all(c.astype(np.float64) <= e), (spec, kind, c, e)
            np.testing.assert_allclose(c, e, rtol=2.0**-22, atol=0)
            # one row at a time gives the same numbers as the batch
            np.testing.assert_array_equal(dc.radius(spec, P[1, 2], kind), a[1, 2])


def test_radius_equals_radii_and_margin_shapes():
    rng = np.random.default_rng(3)
    P = _batch(rng, (4,), 12, 0.5)
    got = dc.radii(SPECS, P, KINDS)
    one = dc.radii(SPECS, P, "forward")
    for spec in SPECS:
        key = dc.parse_criterion(spec).spec  # canonical spec string, e.g. entropy:0.09:0.3
        np.testing.assert_array_equal(one[key], got[(key, "forward")])
        for kind in KINDS:
            np.testing.assert_array_equal(got[(key, kind)], dc.radius(spec, P, kind))
            assert dc.margin_bound(spec, P, kind).shape == (4,)
        assert dc.margin_statistic(spec, P).shape == (4,)


def test_logits_path_equals_probs_path():
    rng = np.random.default_rng(5)
    P = _batch(rng, (3, 2), 40, 0.5)
    P[0, 0, :5] = 0.0  # masked tokens: logits -inf
    P[0, 0] /= P[0, 0].sum()
    with np.errstate(divide="ignore"):
        L = np.log(P) + rng.normal(size=(3, 2, 1)) * 5  # arbitrary per-row shift
    for kind in KINDS:
        for spec in SPECS:
            a = dc.radius(spec, P, kind)
            b = dc.radius(spec, logits=L, divergence=kind)
            np.testing.assert_allclose(b, a, rtol=1e-9, atol=1e-15, err_msg=f"{spec} {kind}")
            bt = dc.radius(spec, logits=torch.from_numpy(L), divergence=kind)
            np.testing.assert_allclose(bt.numpy(), b, rtol=1e-12, atol=0)


def test_top_k_parameter_does_not_change_answers():
    rng = np.random.default_rng(9)
    P = _batch(rng, (6,), 300, 5.0)  # fairly flat: rejected tokens sit deep
    for kind in KINDS:
        for spec in ["multiplicative:0.5", "entropy", "additive:0.001", "strict", "mars:0.5"]:
            ref = dc.radius(spec, P, kind, k=300)
            for k in (1, 2, 8, 64):
                np.testing.assert_allclose(dc.radius(spec, P, kind, k=k), ref, rtol=1e-12, atol=1e-18)


# ---------------------------------------------------------------------------
# full-size vocabulary
# ---------------------------------------------------------------------------

QWEN3_V = 151_936


def _qwen_rows(seed=0):
    """8 rows of float32 logits with a realistic mix of shapes."""
    g = torch.Generator().manual_seed(seed)
    V = QWEN3_V
    x = torch.randn(8, V, generator=g, dtype=torch.float32)
    x[0] *= 3.0
    x[0, 17] += 25.0  # very peaked
    x[1] *= 2.0
    x[1, 5] += 8.0  # peaked
    x[2] *= 0.05  # nearly flat: multiplicative:0.5 accepts most of the vocabulary
    x[3] *= 0.01  # flatter still
    x[4] *= 2.0
    x[4, 100] += 10.0
    x[4, 200] = x[4, 100] - 1e-3  # near-tie top-2
    x[5] *= 1.5
    x[5, 7] += 12.0
    x[5, 8] = x[5, 7]  # exact tie at the top
    x[6] *= 1.0  # plain random
    x[7] *= 4.0
    x[7, 3] += 80.0  # extremely peaked: runner-ups ~1e-27 (reverse KL cancellation regime)
    return x


@pytest.fixture(scope="module")
def qwen_logits():
    return _qwen_rows()


def test_qwen3_vocab_float32_matches_float64(qwen_logits):
    """float32 logits at V = 151,936: the float32 radius is the float64 answer for the same
    values rounded down -- never above it (the certificate direction; the float64 value is
    itself within ~1e-12 of the exact radius, test_soundness checks that against mpmath)."""
    x32 = qwen_logits
    x64 = x32.double()
    got32 = dc.radii(SPECS, logits=x32, divergence=KINDS)
    got64 = dc.radii(SPECS, logits=x64, divergence=KINDS)
    assert set(got32) == {(dc.parse_criterion(s).spec, k) for s in SPECS for k in KINDS}
    for key, v32 in got32.items():
        v64 = got64[key]
        assert v32.dtype == torch.float32 and v64.dtype == torch.float64
        a, b = v32.double().numpy(), v64.numpy()
        fin = np.isfinite(b)
        assert np.array_equal(np.isfinite(a), fin), key
        assert np.all(a[fin] <= b[fin] * (1 + 1e-12)), key  # one-sided: never above
        assert np.all(a[fin] >= b[fin] * (1 - 2.0**-22) - 1e-300), key  # and not lossy


def test_qwen3_vocab_against_full_sort_reference(qwen_logits):
    """float64 answer at V = 151,936 against a plain full-sort numpy reference: rejected set by
    definition on the full p, the most probable rejected token lifted by the brute-force
    closed form (rearrangement: the most probable one is the cheapest, checked exhaustively
    at small V in test_reference.py), trees by brute force over the pool size."""
    x = qwen_logits.double().numpy()
    P = np.exp(x - x.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    got = dc.radii(SPECS, logits=qwen_logits.double(), divergence=KINDS)
    # the exact fallback beyond the top-64 really triggers on the nearly flat rows
    for i in (2, 3):
        assert P.shape[1] - len(R.rejected_set("multiplicative:0.5", P[i])) > 64
    for i in range(P.shape[0]):
        p = P[i]
        for spec in SPECS:
            for kind in KINDS:
                if spec.startswith("tree:"):
                    want = R.tree_q(p, int(spec[5:]), kind)[1]
                else:
                    rej = R.rejected_set(spec, p)
                    want = math.inf if len(rej) == 0 else R.waterfill_lift(p, int(rej[np.argmax(p[rej])]), kind)
                g = float(got[(dc.parse_criterion(spec).spec, kind)][i])
                if math.isinf(want):
                    assert math.isinf(g), (i, spec, kind, g)
                else:
                    assert g == pytest.approx(want, rel=1e-7, abs=1e-13), (i, spec, kind, g, want)


def test_deep_fallback_rows_small_k():
    """Fallback beyond the top-k on a moderate vocabulary for every level-set criterion,
    compared with the full-sort reference (k = 64 default, V = 5000, nearly flat rows)."""
    rng = np.random.default_rng(21)
    V = 5000
    x = rng.normal(size=(4, V)) * np.array([[0.02], [0.1], [0.3], [1.0]])
    P = np.exp(x - x.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    for spec in ["multiplicative:0.5", "multiplicative:0.9", "additive:0.0001", "entropy", "entropy:0.001:0.9", "topm:100"]:
        for kind in KINDS:
            got = dc.radius(spec, P, kind)
            for i in range(P.shape[0]):
                rej = R.rejected_set(spec, P[i])
                want = math.inf if len(rej) == 0 else R.waterfill_lift(P[i], int(rej[np.argmax(P[i][rej])]), kind)
                # rel 1e-7: float64 round-off of pools of hundreds of near-equal tokens at
                # radii ~1e-6 (reverse KL: -log1p of a cancelling difference) is ~1e-9 relative
                assert float(got[i]) == pytest.approx(want, rel=1e-7, abs=1e-15), (spec, kind, i)


# ---------------------------------------------------------------------------
# input validation
# ---------------------------------------------------------------------------

P_OK = np.array([0.5, 0.3, 0.2])


@pytest.mark.parametrize(
    "probs, match",
    [
        (np.array([0.5, np.nan, 0.5]), r"probs.*NaN"),
        (np.array([0.5, np.inf, 0.5]), r"probs.*(NaN|infinite)"),
        (np.array([0.7, -0.1, 0.4]), r"probs.*negative"),
        (np.array([0.5, 0.3, 0.3]), r"probs.*sum to 1"),
        (np.array([0.5, 0.3, 0.2 - 2e-4]), r"probs.*sum to 1"),
        (np.array([1.0]), r"probs.*V >= 2"),
        (np.array(0.5), r"probs"),
        (np.array(["a", "b"]), r"probs.*float"),
    ],
)
def test_bad_probs(probs, match):
    with pytest.raises(ValueError, match=match):
        dc.radius("strict", probs)


def test_row_sum_tolerance_accepts_small_errors():
    dc.radius("strict", np.array([0.5, 0.3, 0.2 + 5e-5]))  # within 1e-4: fine


@pytest.mark.parametrize(
    "logits, match",
    [
        (np.array([0.0, np.nan, 1.0]), r"logits.*NaN"),
        (np.array([0.0, np.inf, 1.0]), r"logits"),
        (np.array([-np.inf, -np.inf]), r"logits.*-inf"),
    ],
)
def test_bad_logits(logits, match):
    with pytest.raises(ValueError, match=match):
        dc.radius("strict", logits=logits)


def test_probs_xor_logits():
    with pytest.raises(ValueError, match="logits"):
        dc.radius("strict", P_OK, logits=np.log(P_OK))
    with pytest.raises(ValueError, match="logits"):
        dc.radius("strict")


@pytest.mark.parametrize(
    "spec, match",
    [
        ("additive:-0.1", r"DELTA"),
        ("multiplicative:0", r"ALPHA"),
        ("multiplicative:1.5", r"ALPHA"),
        ("multiplicative:-1", r"ALPHA"),
        ("topm:0", r"\bM\b"),
        ("topm:1.5", r"topm"),
        ("tree:0", r"\bM\b"),
        ("tree:-2", r"\bM\b"),
        ("entropy:0:0.3", r"EPSILON"),
        ("entropy:-1", r"EPSILON"),
        ("entropy:0.09:0", r"DELTA"),
        ("entropy:0.09:-1", r"DELTA"),
        ("mars:-1", r"THETA"),
        ("additive:nan", r"DELTA"),
        ("bogus", r"criterion spec.*unknown"),
        ("strict:1", r"criterion spec.*too many"),
        ("additive:abc", r"criterion spec.*not a valid"),
        ("", r"criterion spec"),
    ],
)
def test_bad_criterion(spec, match):
    with pytest.raises(ValueError, match=match):
        dc.radius(spec, P_OK)


def test_topm_larger_than_vocab():
    with pytest.raises(ValueError, match=r"M.*vocabulary"):
        dc.radius("topm:4", P_OK)


def test_bad_divergence():
    with pytest.raises(ValueError, match="divergence"):
        dc.radius("strict", P_OK, "js")
    with pytest.raises(ValueError, match="divergence"):
        dc.divergence(P_OK, P_OK, "kl")


def test_target_drafter_shape_mismatch():
    with pytest.raises(ValueError, match="draft_probs.*vocabulary"):
        dc.accepts("strict", P_OK, np.array([0.5, 0.5]))
    # accepts / certified broadcast target against drafter exactly like divergence
    Q2 = np.stack([P_OK, [0.2, 0.3, 0.5]])
    for fn in (dc.accepts, lambda c, p, q: dc.certified(c, p, q)):
        got = np.asarray(fn("strict", P_OK, Q2))
        assert got.shape == (2,) and got.tolist() == [True, False]
        assert np.asarray(fn("strict", Q2, P_OK)).shape == (2,)
    assert np.asarray(dc.divergence(P_OK, Q2)).shape == (2,)
    for fn in (dc.accepts, dc.certified, dc.divergence):
        with pytest.raises(ValueError, match="draft_probs.*broadcast"):
            fn(np.stack([P_OK] * 3), np.stack([P_OK] * 2)) if fn is dc.divergence else fn("strict", np.stack([P_OK] * 3), np.stack([P_OK] * 2))
    with pytest.raises(ValueError, match="draft_probs.*vocabulary"):
        dc.certified("strict", P_OK, np.array([0.5, 0.5]))
    with pytest.raises(ValueError, match="draft_probs"):
        dc.divergence(P_OK, np.array([0.5, 0.5]))
    with pytest.raises(ValueError, match="draft_probs.*negative"):
        dc.accepts("strict", P_OK, np.array([0.7, 0.4, -0.1]))
    with pytest.raises(ValueError, match="target_probs.*sum to 1"):
        dc.accepts("strict", np.array([0.7, 0.4, 0.1]), P_OK)


def test_accepts_tokens_validation():
    crit = dc.parse_criterion("additive:0.1")
    assert bool(crit.accepts_tokens(P_OK, np.array(0)))
    assert not bool(crit.accepts_tokens(P_OK, np.array(2)))
    with pytest.raises(ValueError, match="tokens"):
        crit.accepts_tokens(P_OK, np.array(3))
    with pytest.raises(ValueError, match="tokens"):
        crit.accepts_tokens(P_OK, None)


def test_levelset_threshold_validation():
    with pytest.raises(ValueError, match="threshold"):
        dc.LevelSet(0.5)


# ---------------------------------------------------------------------------
# divergence / accepts / certified basics
# ---------------------------------------------------------------------------


def test_divergence_values():
    p, q = np.array([0.5, 0.5, 0.0]), np.array([0.25, 0.25, 0.5])
    assert float(dc.divergence(p, q, "forward")) == pytest.approx(math.log(2))
    assert float(dc.divergence(p, q, "reverse")) == math.inf  # q > 0 where p = 0
    assert float(dc.divergence(q, p, "forward")) == math.inf
    assert float(dc.divergence(p, q, "tv")) == pytest.approx(0.5)
    lq = np.log(np.array([0.25, 0.25, 0.5]))
    assert float(dc.divergence(p, kind="forward", draft_logits=lq)) == pytest.approx(math.log(2))


def test_accepts_tie_breaking_and_trees():
    p = np.array([0.4, 0.35, 0.25])
    # drafter's argmax ties between tokens 1 and 2: lowest index (1) is proposed
    assert bool(dc.accepts("additive:0.1", p, np.array([0.2, 0.4, 0.4])))
    assert not bool(dc.accepts("strict", p, np.array([0.2, 0.4, 0.4])))
    # trees: a = 0 must be in the drafter's top-m; ties go to the lower index
    q = np.array([0.3, 0.3, 0.4])
    assert not bool(dc.accepts("tree:1", p, q))
    assert bool(dc.accepts("tree:2", p, q))
    q = np.array([0.3, 0.4, 0.3])
    assert bool(dc.accepts("tree:2", p, q))  # token 0 ties token 2 and wins by index


# ---------------------------------------------------------------------------
# certified_run_length
# ---------------------------------------------------------------------------


def _run_length_loop(r, eps, block=None):
    out = np.zeros(r.shape, dtype=np.int64)
    for idx in np.ndindex(r.shape[:-1]):
        row = r[idx]
        T = row.shape[0]
        for t in range(T):
            n = 0
            while t + n < T and eps <= row[t + n]:
                n += 1
                if block is not None and n == block:
                    break
            out[idx + (t,)] = n
    return out


@pytest.mark.parametrize("block", [None, 1, 3, 8])
def test_certified_run_length_matches_loop(block):
    rng = np.random.default_rng(0 if block is None else block)
    r = rng.exponential(0.3, size=(3, 2, 40))
    r[r > 0.8] = np.inf
    r[0, 0, 5] = 0.0
    for eps in (0.0, 0.05, 0.2, 0.5):
        want = _run_length_loop(r, eps, block)
        got = dc.certified_run_length(r, eps, block)
        np.testing.assert_array_equal(got, want)
        gt = dc.certified_run_length(torch.from_numpy(r), eps, block)
        np.testing.assert_array_equal(gt.numpy(), want)


def test_certified_run_length_epsilon_edge():
    r = np.array([0.1, 0.1, 0.05, 0.1])
    np.testing.assert_array_equal(dc.certified_run_length(r, 0.1), [2, 1, 0, 1])  # radius == eps counts
    np.testing.assert_array_equal(dc.certified_run_length(r, np.nextafter(0.1, 1)), [0, 0, 0, 0])
    np.testing.assert_array_equal(dc.certified_run_length(r, 0.1, block=1), [1, 1, 0, 1])


@pytest.mark.parametrize(
    "args, match",
    [
        ((np.array([0.1, np.nan]), 0.1), "radii"),
        ((np.array([0.1, -1.0]), 0.1), "radii"),
        ((np.array(0.1), 0.1), "radii"),
        ((np.array([0.1]), -0.1), "epsilon"),
        ((np.array([0.1]), float("nan")), "epsilon"),
        ((np.array([0.1]), float("inf")), "epsilon"),
        ((np.array([0.1]), 0.1, 0), "block"),
        ((np.array([0.1]), 0.1, 1.5), "block"),
    ],
)
def test_certified_run_length_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        dc.certified_run_length(*args)


# ---------------------------------------------------------------------------
# issue 8: bad input that used to return a number; the typical: rule
# ---------------------------------------------------------------------------


def test_bad_inputs_that_used_to_return_numbers():
    p = np.array([0.5, 0.3, 0.2])
    with pytest.raises(ValueError, match="probs.*complex"):
        dc.radius("strict", p.astype(np.complex128))
    with pytest.raises(ValueError, match="probs.*bool"):
        dc.radius("strict", np.array([True, False]))
    with pytest.raises(ValueError, match="probs.*bool"):
        dc.radius("strict", torch.tensor([True, False]))
    with pytest.raises(ValueError, match="logits.*complex"):
        dc.radius("strict", logits=torch.tensor([1.0, 2.0], dtype=torch.complex64))
    if np.dtype(np.longdouble).itemsize > 8:
        with pytest.raises(ValueError, match="probs.*long double"):
            dc.radius("strict", p.astype(np.longdouble))
    with pytest.raises(ValueError, match="threshold.*NaN"):
        dc.radius(dc.LevelSet(lambda q: q.max(-1).values * float("nan"), name="nan"), p)
    with pytest.raises(ValueError, match="divergence"):
        dc.radii(["strict"], p, [])
    with pytest.raises(ValueError, match="block"):
        dc.certified_run_length(np.array([1.0, 2.0]), 0.5, block=float("inf"))
    with pytest.raises(ValueError, match="epsilon"):
        dc.certified_run_length(np.array([1.0, 2.0]), "x")
    with pytest.raises(ValueError, match="epsilon"):
        dc.certified_run_length(np.array([1.0, 2.0]), float("nan"))
    # a bare spec string is one criterion, not a list of one-letter specs
    one = dc.radii("strict", p)
    assert list(one) == ["strict"] and float(one["strict"]) == float(dc.radius("strict", p))


def _vllm_typical_tau(p: np.ndarray, eps: float, delta: float) -> float:
    """vLLM TypicalAcceptanceSampler / Medusa: entropy = -sum p log(p + 1e-5)."""
    h = -np.sum(p * np.log(p + 1e-5))
    return min(eps, delta * math.exp(-h))


def test_typical_is_the_medusa_vllm_formula_and_entropy_the_textbook_one():
    rng = np.random.default_rng(3)
    x = rng.standard_normal(151936) * 2
    P = np.exp(x - x.max())
    P /= P.sum()
    crit = dc.parse_criterion("typical:0.09:0.3")
    assert isinstance(crit, dc.TypicalAcceptance) and crit.spec == "typical:0.09:0.3"
    assert not isinstance(dc.parse_criterion("entropy"), dc.TypicalAcceptance)
    tau_t = float(crit.threshold(P))
    assert tau_t == pytest.approx(_vllm_typical_tau(P, 0.09, 0.3), rel=1e-9)
    h = -np.sum(P * np.log(P))
    tau_e = float(dc.parse_criterion("entropy:0.09:0.3").threshold(P))
    assert tau_e == pytest.approx(min(0.09, 0.3 * math.exp(-h)), rel=1e-9)
    assert tau_t > 1.5 * tau_e  # the two rules really differ on a flat row (issue: 7.0e-6 vs 3.3e-6)
    # exact radii and valid margin bounds, like every other rule
    small = np.array([0.6, 0.25, 0.1, 0.05])
    for spec in ("typical:0.2:0.3", "typical:0.5:0.9", "typical:0.09:2"):
        for kind in KINDS:
            r = float(dc.radius(spec, small, kind))
            b = float(dc.margin_bound(spec, small, kind))
            assert b <= r
            rej = [y for y in range(4) if small[y] <= _vllm_typical_tau(small, *map(float, spec.split(":")[1:]))]
            want = min((R.waterfill_lift(small, y, kind) for y in rej), default=math.inf)
            assert r == pytest.approx(want, rel=1e-9), (spec, kind)
