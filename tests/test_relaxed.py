"""relaxed:N:DELTA, TensorRT-LLM's relaxed acceptance (DeepSeek-R1 MTP): accept x iff x is among
the N most probable tokens (ties at the N-th place counted in) and p(x) >= max p - DELTA.

Checked here: the rule against a literal emulation of TensorRT-LLM's kernel (torch.topk of the
softmax, then ``mtpRelaxedAcceptanceKernel``'s loop), equal away from ties at the N-th place and
a superset of it at such ties (the documented difference); its radius as the minimum of topm:N's
and additive:DELTA's (its rejection region is the union of theirs) at small and large V, every
dtype and every top-k size; the reductions to strict and topm; exact decisions and radii on 16-bit
ties against the independent exact truth; parameter errors; the command line's suggestion for a
misspelt name.  The convex reference, the property, soundness and margin suites carry relaxed as
well (test_reference, test_properties, test_soundness, test_soundness_redteam, test_margin_sharp).
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import torch

import draftcert as dc
from draftcert.cli.checks import suggest_spec
from tests.oracles import exact_truth as X

KINDS = ("forward", "reverse", "tv")
PARAMS = ((1, 0.1), (2, 0.1), (2, 0.02), (3, 0.3), (5, 0.05), (10, 0.6))


def _trtllm_accepts(logits: torch.Tensor, draft: torch.Tensor, topk: int, delta: float) -> torch.Tensor:
    """TensorRT-LLM's relaxed acceptance of one draft token per row, transcribed: ``torch.topk``
    (k = relaxed_topk) of ``torch.softmax`` of the target logits, then the kernel's loop: the
    threshold is the top-1 value minus relaxed_delta; walk the top-k in order, stop at the first
    entry after the first whose value is below the threshold, accept if the draft is one of the
    entries walked."""
    probs = torch.softmax(logits, dim=-1)
    val, idx = torch.topk(probs, k=topk, dim=-1)
    out = torch.zeros(logits.shape[0], dtype=torch.bool)
    for i in range(logits.shape[0]):
        threshold = float(val[i, 0]) - delta
        for jj in range(topk):
            if jj > 0 and threshold > float(val[i, jj]):
                break
            if int(draft[i]) == int(idx[i, jj]):
                out[i] = True
                break
    return out


def _draft_logits(ids: torch.Tensor, V: int) -> torch.Tensor:
    q = torch.zeros(ids.shape[0], V, dtype=torch.float64)
    q[torch.arange(ids.shape[0]), ids] = 1.0
    return q


@pytest.mark.parametrize("n,delta", PARAMS)
def test_matches_tensorrt_llm_kernel_away_from_ties(n, delta):
    """Random float64 logits (V = 12 and 3000), the drafter proposing one of the N + 3 most probable
    tokens: draftcert's decision equals the transcribed kernel on every row where no tie sits at
    the N-th place and p(x) is not within 1e-9 of max p - DELTA (rounding of the softmax)."""
    g = torch.Generator().manual_seed(n * 1000 + int(delta * 100))
    checked = accepted = 0
    for V in (12, 3000):
        x = torch.randn(400, V, generator=g, dtype=torch.float64) * torch.rand(400, 1, generator=g, dtype=torch.float64) * 4
        order = torch.argsort(x, dim=-1, descending=True)
        pick = order[torch.arange(400), torch.randint(0, min(n + 3, V), (400,), generator=g)]
        ours = torch.as_tensor(dc.accepts(f"relaxed:{n}:{delta}", target_logits=x, draft_logits=_draft_logits(pick, V)))
        trt = _trtllm_accepts(x, pick, n, delta)
        p = torch.softmax(x, -1)
        srt = p.sort(-1, descending=True).values
        clear = ((p[torch.arange(400), pick] - (srt[:, 0] - delta)).abs() > 1e-9) & (srt[:, n - 1] != srt[:, min(n, V - 1)])
        assert torch.equal(ours[clear], trt[clear])
        checked += int(clear.sum())
        accepted += int(ours[clear].sum())
    assert checked > 700 and 0 < accepted < checked  # both outcomes occur


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_ties_at_the_nth_place_accept_every_tied_token(dtype):
    """Three tokens tie at the 2nd place: relaxed:2:DELTA accepts all three (the rule is a
    function of p), while the kernel's torch.topk keeps one of them and rejects the others.
    Ours is a superset of TensorRT-LLM's decision on every token, as the docstring says."""
    row = torch.tensor([2.0, 1.5, 1.5, 1.5, -1.0, 0.25], dtype=dtype)
    V = row.shape[0]
    crit = dc.parse_criterion("relaxed:2:0.5")
    ids = torch.arange(V)
    ours = torch.as_tensor(crit.accepts_tokens(logits=row.expand(V, V), tokens=ids))
    trt = _trtllm_accepts(row.double().expand(V, V), ids, 2, 0.5)
    assert ours.tolist() == [True, True, True, True, False, False]
    assert bool((ours | ~trt).all())  # never accepts less than TensorRT-LLM
    assert int(trt[1:4].sum()) == 1  # torch.topk keeps one of the three tied tokens
    t64 = row.double().numpy()
    for x in range(V):  # the independent exact truth agrees token by token
        q = np.full((1, V), -1.0)
        q[0, x] = 1.0
        assert bool(X.truth_accepts("relaxed:2:0.5", t64[None, :], True, q)[0]) == bool(ours[x])
    for kind in KINDS:
        r = float(dc.radius(crit, logits=row, divergence=kind))
        ex = X.exact_radius("relaxed:2:0.5", t64, True, kind)
        rel = 1e-9 if dtype == torch.float64 else 2.0**-22  # 16/32-bit input: a float32 radius, rounded down
        assert r <= ex and r >= float(ex) * (1 - rel), (kind, r, ex)


def _radii(n, delta, kw, kind, k):
    """relaxed's radius and the smaller of topm's and additive's, from one shared summary."""
    specs = [f"relaxed:{n}:{delta}", f"topm:{n}", f"additive:{delta}"]
    r = {s: torch.as_tensor(v) for s, v in dc.radii(specs, divergence=kind, k=k, **kw).items()}
    return r[specs[0]], torch.minimum(r[specs[1]], r[specs[2]])


@pytest.mark.parametrize("n,delta", PARAMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_radius_is_the_min_of_topm_and_additive(n, delta, dtype):
    """R = R(topm:N) union R(additive:DELTA), so the radius (an infimum over R) is the smaller of
    the two: equal bit for bit (one shared summary) at every top-k size, at V = 64 (rejected tokens beyond the
    top-k) and V = 20000 (the one-read pass), logits and probabilities."""
    g = torch.Generator().manual_seed(7 + n)
    for V in (64, 20000):
        z = torch.randn(24, V, generator=g, dtype=torch.float64) * torch.rand(24, 1, generator=g, dtype=torch.float64) * 6
        z[::3, 1] = z[::3, 0]  # a tie at the top
        z[1::3, n] = z[1::3, n - 1] if n > 1 else z[1::3, n]  # and one at the N-th place
        inputs = [{"logits": z.to(dtype)}]
        if dtype != torch.bfloat16:  # bfloat16 probability rows miss the 1e-4 row-sum tolerance
            inputs.append({"probs": torch.softmax(z, -1).to(dtype)})
        for kw in inputs:
            for kind in KINDS:
                for k in (1, 16, n + 1):
                    got, want = _radii(n, delta, kw, kind, k)
                    assert torch.equal(got, want), (V, kind, k, got - want)


def test_reductions_to_strict_and_topm():
    """relaxed:1:DELTA and relaxed:N:0 are strict; relaxed:N:DELTA with DELTA >= 1 is topm:N;
    relaxed:V:DELTA is additive:DELTA -- the same radii, acceptances and margin bounds."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(40, 9, generator=g, dtype=torch.float64) * 3
    z[::4, 1] = z[::4, 0]
    q = z + 0.3 * torch.randn(40, 9, generator=g, dtype=torch.float64)
    pairs = [("relaxed:1:0.3", "strict"), ("relaxed:4:0", "strict"), ("relaxed:3:1", "topm:3"), ("relaxed:2:5", "topm:2"),
             ("relaxed:9:0.1", "additive:0.1")]
    for a, b in pairs:
        for kind in KINDS:
            assert torch.equal(torch.as_tensor(dc.radius(a, logits=z, divergence=kind)),
                               torch.as_tensor(dc.radius(b, logits=z, divergence=kind))), (a, b, kind)
        assert torch.equal(torch.as_tensor(dc.accepts(a, target_logits=z, draft_logits=q)),
                           torch.as_tensor(dc.accepts(b, target_logits=z, draft_logits=q))), (a, b)
    for a, b in (("relaxed:3:1", "topm:3"), ("relaxed:4:0", "additive:0")):
        for kind in KINDS:
            assert torch.equal(torch.as_tensor(dc.margin_bound(a, logits=z, divergence=kind)),
                               torch.as_tensor(dc.margin_bound(b, logits=z, divergence=kind))), (a, b, kind)


def test_near_threshold_rows_are_decided_exactly():
    """p(x) within a few ulps of max p - DELTA, x inside the top N: the decision (and the radius's
    choice of the most probable rejected token) is the exact one, in arbitrary precision."""
    delta = 0.1
    rows, truth = [], []
    for eps in (-3e-16, -1e-17, 0.0, 1e-17, 3e-16):
        p = np.array([0.4, 0.3 + eps, 0.2, 0.1 - eps])  # p(1) = 0.4 - 0.1 + eps: the boundary
        rows.append(p)
        with mpmath.workprec(2400):
            P = [mpmath.mpf(v) / mpmath.fsum(mpmath.mpf(u) for u in p) for v in p]
            truth.append(bool(P[1] >= max(P) - mpmath.mpf(delta)))
    P = torch.tensor(np.stack(rows))
    q = torch.tensor([[0.0, 1.0, 0.0, 0.0]] * len(rows), dtype=torch.float64)
    got = torch.as_tensor(dc.accepts("relaxed:2:0.1", P, q)).tolist()
    assert got == truth and True in truth and False in truth
    for i, p in enumerate(rows):
        for kind in KINDS:
            r = float(dc.radius("relaxed:2:0.1", p, kind))
            ex = X.exact_radius("relaxed:2:0.1", p, False, kind)
            assert r <= ex and r >= float(ex) * (1 - 1e-9), (i, kind, r, ex)


def test_tree_ids_and_tokens():
    """accept_ids on (N, K) ids (the engine's tree children) equals the per-column decisions."""
    from draftcert.summary import summarize

    g = torch.Generator().manual_seed(5)
    z = torch.randn(30, 50, generator=g, dtype=torch.float64) * 2
    crit = dc.parse_criterion("relaxed:3:0.05")
    s = summarize(logits=z, k=16)
    ids = torch.argsort(z, -1, descending=True)[:, :6]
    both = crit.accept_ids(s, ids)
    cols = torch.stack([crit.accept_ids(s, ids[:, j]) for j in range(6)], 1)
    assert torch.equal(both, cols) and bool(both[:, 0].all()) and not bool(both[:, 3:].any())


@pytest.mark.parametrize("spec,pattern", [
    ("relaxed", r"needs both parameters"), ("relaxed:2", r"needs both parameters"), ("relaxed:0:0.1", r"\bN\b"),
    ("relaxed:-1:0.1", r"\bN\b"), ("relaxed:1.5:0.1", r"not a valid int"), ("relaxed:2:-0.1", r"DELTA"),
    ("relaxed:2:nan", r"DELTA"), ("relaxed:2:inf", r"DELTA"), ("relaxed:2:0.1:1", r"too many"), ("relaxed:x:0.1", r"not a valid int"),
])
def test_bad_parameters_name_the_argument(spec, pattern):
    with pytest.raises(ValueError, match=pattern):
        dc.parse_criterion(spec)


def test_n_above_vocabulary_is_an_error_and_spec_round_trips():
    for call in (dc.radius, dc.margin_statistic, dc.margin_bound):  # the error names this rule, not topm:4
        with pytest.raises(ValueError, match=r"^N: relaxed:4:0.1 exceeds the vocabulary size V = 3$"):
            call("relaxed:4:0.1", np.array([0.5, 0.3, 0.2]))
    with pytest.raises(ValueError, match=r"relaxed:4:0.1 exceeds"):
        dc.accepts("relaxed:4:0.1", target_probs=np.array([0.5, 0.3, 0.2]), draft_probs=np.array([0.2, 0.3, 0.5]))
    c = dc.parse_criterion(" relaxed:2:0.10 ")
    assert c.spec == "relaxed:2:0.1" and c == dc.RelaxedAcceptance(2, 0.1) and dc.parse_criterion(c.spec) == c
    assert "relaxed:N:DELTA" in dc.criteria.SPEC_HELP
    assert math.isinf(float(dc.radius("relaxed:3:1", np.array([0.5, 0.3, 0.2]))))  # nothing rejected


@pytest.mark.parametrize("typo,hint", [("relax:3:0.2", "relaxed:3:0.2"), ("realxed:4:0.3", "relaxed:4:0.3")])
def test_a_misspelt_name_keeps_its_parameters(typo, hint):
    assert suggest_spec(typo) == hint  # as aditive:0.2 -> additive:0.2
