"""draftcert.radius against an independent convex-programming reference (tests/oracles/reference.py).

For random small-vocabulary targets p (V = 2..6; flat, peaked, exact ties,
zeros) every criterion and divergence is solved by brute force: one convex
program per rejected token (single-token rules) or per competing set S
(trees), minimum taken over all of them.  The library must agree to 1e-6
relative, plus an absolute floor of 1e-9: Clarabel at the tolerances in
reference.CLARABEL_OPTS reaches optimal values to ~1e-10 absolute on these
problems (measured worst ~4e-11 on radii near 0, where a relative test is
meaningless).  Both directions matter: library above the reference would be
an unsound certificate, below it would not be exact.

The minimising q the solver finds is also checked to be a genuine rejection:
nudged by 1e-7 past the tie it must make ``draftcert.accepts`` say False at a
divergence that is still (within the nudge) the radius.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import draftcert as dc
from tests.oracles import reference as R

KINDS = ("forward", "reverse", "tv")
REL, ABS = 1e-6, 1e-9

# User-defined level sets: (library criterion, (threshold on a numpy p, inclusive)).  For a user
# rule the definition IS the user's function, so the reference evaluates that same function on
# the full p (numpy would round sum(p^2) differently in the last ulp and move exact ties).
_USER_FNS = [
    (lambda P: 0.6 * P.max(-1).values - 0.1 * P.min(-1).values, True),
    (lambda P: (P * P).sum(-1), False),
]
USER_SETS = [
    (
        dc.LevelSet(fn, inclusive=inc, name="levelset"),
        ((lambda p, fn=fn: float(fn(torch.from_numpy(np.asarray(p, dtype=np.float64)[None, :]))[0])), inc),
    )
    for fn, inc in _USER_FNS
]

BASE_SPECS = [
    "strict",
    "additive:0",
    "additive:0.05",
    "additive:0.2",
    "additive:0.5",
    "multiplicative:1",
    "multiplicative:0.5",
    "multiplicative:0.2",
    "entropy",  # 0.09:0.3, vLLM defaults
    "entropy:0.3:0.6",
    "entropy:0.5:2",  # DELTA >= 1
    "entropy:1:1",
    "mars:0",
    "mars:0.3",
    "mars:1",
]


def relaxed_specs(V: int) -> list[str]:
    """TensorRT-LLM's relaxed rule at N = 1..min(V, 3) and DELTA from strict (0) to topm (1)."""
    return [f"relaxed:{m}:{d}" for m in range(1, min(V, 3) + 1) for d in (0, 0.05, 0.2, 1)]


def specs_for(V: int) -> list[str]:
    return (BASE_SPECS + [f"topm:{m}" for m in range(1, V + 1)] + relaxed_specs(V)
            + [f"tree:{m}" for m in range(1, V)] + ["tree:%d" % V])


def gen_dist(rng: np.random.Generator, family: str) -> np.ndarray:
    V = int(rng.integers(2, 7))
    if family == "flat":
        p = rng.dirichlet(np.full(V, 50.0))
    elif family == "peaked":
        p = rng.dirichlet(np.full(V, 0.25))
    elif family == "ties":
        # small integer grid -> exact ties (and zeros); equal integers give bit-equal floats
        g = rng.integers(0, 4, V).astype(np.float64)
        if g.sum() == 0:
            g[rng.integers(V)] = 1.0
        p = g / g.sum()
    elif family == "zeros":
        p = rng.dirichlet(np.ones(V))
        p[rng.choice(V, int(rng.integers(1, V)), replace=False)] = 0.0
        if p.sum() == 0:
            p[0] = 1.0
        p = p / p.sum()
    else:
        raise ValueError(family)
    # Positive masses below 1e-6 become exact zeros: the interior-point reference
    # resolves q only to ~1e-11 absolute, which on p(z) ~ 1e-10 moves p log(p/q) by
    # ~1e-9 (measured) -- the solver's limit, not the library's.  Tiny masses are
    # tested against the closed-form brute force in test_tiny_masses_closed_form.
    p[p < 1e-6] = 0.0
    return p / p.sum()


def _close(lib: float, ref: float) -> bool:
    if math.isinf(ref) or math.isinf(lib):
        return lib == ref
    return abs(lib - ref) <= REL * ref + ABS


def check_case(ref: R.ReferenceSolver, p: np.ndarray, failures: list, sanity: bool = True) -> None:
    V = p.shape[0]
    specs = specs_for(V)
    got = dc.radii(specs, p, KINDS)  # one shared summary; radius() is compared in test_api
    for kind in KINDS:
        for spec in specs:
            crit = dc.parse_criterion(spec)
            lib = float(got[(crit.spec, kind)])
            if spec.startswith("tree:"):
                val, S, sol = ref.tree_radius(int(spec.split(":")[1]), p, kind)
                y = None
            else:
                val, y, sol = ref.single_radius(spec, p, kind)
                S = None
            if not _close(lib, val):
                failures.append(f"{spec} {kind} p={p.tolist()}: library {lib!r} reference {val!r} (diff {lib - val:+.3g})")
            elif sanity and sol is not None:
                msg = _sanity(crit, p, kind, val, sol, y=y, S=S)
                if msg:
                    failures.append(f"{spec} {kind} p={p.tolist()}: {msg}")
        for lib_crit, user in USER_SETS:
            lib = float(dc.radius(lib_crit, p, kind))
            val, y, sol = ref.single_radius("levelset", p, kind, user=user)
            if not _close(lib, val):
                failures.append(f"user levelset {kind} p={p.tolist()}: library {lib!r} reference {val!r}")
            elif sanity and sol is not None:
                msg = _sanity(lib_crit, p, kind, val, sol, y=y, S=None)
                if msg:
                    failures.append(f"user levelset {kind} p={p.tolist()}: {msg}")


def _sanity(crit, p, kind, val, sol, y=None, S=None) -> str | None:
    """The solver's minimiser satisfies its constraints, and nudged by eta past the tie
    it is rejected by draftcert.accepts at a divergence within O(eta) of the radius."""
    q = sol.q
    eta = 1e-7
    if y is not None:
        if np.any(q > q[y] + 1e-7):
            return f"reference q does not lift y={y}: q={q.tolist()}"
        q2 = q.copy()
        q2[y] += eta  # y becomes the unique maximiser; p(y) > 0 whenever val is finite in reverse
    else:
        a = R.argmax_lowest(p)
        if np.any(q[list(S)] < q[a] - 1e-7):
            return f"reference q does not put S={S} above a={a}: q={q.tolist()}"
        if q[a] <= 2 * eta:
            return None  # q(a) = 0 (reverse KL, S hits a zero of p): ties at 0 cannot be nudged
        q2 = q.copy()
        q2[list(S)] += eta  # every s in S strictly above a: a falls out of the top-M
    q2 /= q2.sum()
    if bool(dc.accepts(crit, p, q2)):
        return f"nudged reference minimiser q={q2.tolist()} is accepted"
    d = R.div_np(p, q2, kind)
    if not d <= val + 1e-5:
        return f"nudged reference minimiser at D={d} far above radius {val}"
    return None


FAMILIES = ("flat", "peaked", "ties", "zeros")


@pytest.mark.parametrize("family", FAMILIES)
def test_radius_matches_convex_reference(ref, family):
    """50 distributions per family (200 in all), every criterion and divergence."""
    rng = np.random.default_rng(FAMILIES.index(family) + 1000)
    failures: list[str] = []
    for _ in range(50):
        check_case(ref, gen_dist(rng, family), failures)
    assert not failures, f"{len(failures)} mismatches, first: " + "\n".join(failures[:8])


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_radius_matches_convex_reference_many(ref, family):
    """Thousands of distributions (1000 per family)."""
    rng = np.random.default_rng(FAMILIES.index(family) + 2000)
    failures: list[str] = []
    for _ in range(1000):
        check_case(ref, gen_dist(rng, family), failures, sanity=False)
    assert not failures, f"{len(failures)} mismatches, first: " + "\n".join(failures[:8])


HANDPICKED = [
    [0.5, 0.5],
    [1.0, 0.0],
    [0.0, 1.0],
    [1.0, 0.0, 0.0],
    [0.4, 0.3, 0.3],
    [0.3, 0.3, 0.3, 0.1],
    [0.25, 0.25, 0.25, 0.25],
    [0.5, 0.5, 0.0, 0.0],
    [0.2, 0.0, 0.8],
    [0.6, 0.2, 0.2, 0.0, 0.0, 0.0],
    [1 / 3, 1 / 3, 1 / 3 - 1e-6, 1e-6],
]


@pytest.mark.parametrize("p", HANDPICKED, ids=lambda p: ",".join(f"{x:.3g}" for x in p))
def test_radius_edge_cases(ref, p):
    """Degenerate targets: point masses, uniform, ties at the top, zeros, near-ties."""
    p = np.asarray(p, dtype=np.float64)
    p = p / p.sum()
    failures: list[str] = []
    check_case(ref, p, failures)
    assert not failures, "\n".join(failures[:8])


def test_torch_input_matches_reference(ref):
    """The torch path gives the same exact numbers (batched, float64)."""
    rng = np.random.default_rng(7)
    V = 4
    ps = [rng.dirichlet(np.ones(V)) for _ in range(6)]
    P = torch.tensor(np.stack(ps))
    for kind in KINDS:
        for spec in specs_for(V):
            got = dc.radius(spec, P, kind)
            assert isinstance(got, torch.Tensor) and got.dtype == torch.float64
            for i, p in enumerate(ps):
                want = ref.radius(spec, p, kind)
                assert _close(float(got[i]), want), (spec, kind, p, float(got[i]), want)


def test_tiny_masses_closed_form():
    """Targets with masses down to 1e-300 (beyond the interior-point reference's reach):
    every rejected token's lift cost by the brute-force closed form (all pool sizes,
    feasible minimum), minimum over R(p), versus the library."""
    rng = np.random.default_rng(11)
    failures = []
    for _ in range(80):
        V = int(rng.integers(2, 9))
        logp = rng.uniform(-1, 1, V) * rng.choice([5.0, 40.0, 300.0], V)
        p = np.exp(logp - logp.max())
        p /= p.sum()
        for kind in KINDS:
            for spec in BASE_SPECS + [f"topm:{m}" for m in range(1, V + 1)] + relaxed_specs(V):
                want = min((R.waterfill_lift(p, int(y), kind) for y in R.rejected_set(spec, p)), default=math.inf)
                got = float(dc.radius(spec, p, kind))
                ok = got == want if math.isinf(want) or math.isinf(got) else abs(got - want) <= 1e-9 * want + 1e-15
                if not ok:
                    failures.append(f"{spec} {kind} p={p.tolist()}: library {got!r} closed form {want!r}")
    assert not failures, f"{len(failures)} mismatches:\n" + "\n".join(failures[:8])
