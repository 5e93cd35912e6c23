"""The profiler's trace columns: its fast paths against the core library's reference
functions, and the columns it writes against the format (``draftcert.tracefile``)."""

import numpy as np
import torch

from draftcert import divergence, parse_criterion
from draftcert.certificates import accepts_from_topk, accepts_rows, radius_rows
from draftcert.criteria import DEFAULT_CRITERIA
from draftcert.divergences import divergences_from_logits, forward_kl_interval
from draftcert.profile.trace import BatchTrace, StepCertifier, StepRows, draft_topk
from draftcert.summary import summarize
from draftcert.tracefile import (
    list_shards,
    radius_column,
    read_columns,
    shard_name,
    shard_prompt_ids,
    trace_schema,
    write_shard,
)


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
    div = divergences_from_logits(x, y)
    kf, kr, tv, log_zq = div["kl"], div["kl_reverse"], div["tv"], div["log_zq"]
    lo, hi = forward_kl_interval(x, y)
    assert torch.equal(div["lo"], lo) and torch.equal(div["hi"], hi)  # the certificate's enclosure, bit for bit
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


def test_trace_radii_are_the_core_radii():
    """The trace's radius columns (``StepCertifier.rows``) are the core's ``radius_rows``, including
    empty rejection regions (+inf) and deep rows (rejected token below the top-64)."""
    specs = DEFAULT_CRITERIA + ("additive:0", "additive:0.5", "entropy:0.01:0.9", "multiplicative:0.05")
    crits = [parse_criterion(spec) for spec in specs]
    certifier = StepCertifier(crits, ["forward", "reverse", "tv"])
    x, _ = _logits(2, n=40, V=400)
    x[:10] *= 0.05  # flat: p(1st) < 0.1, so additive:0.1 can reject nothing
    x[10:25] *= 0.3  # fairly flat: entropy's rejected tokens lie below the top 64
    s, bad = certifier.summarize_step(x)
    cols = certifier.rows([s], [bad])
    deep_seen = 0
    for c in crits:
        if hasattr(c, "rejected_mask"):
            tau = c.threshold_from_summary(s)
            deep_seen += int((~c.rejected_mask(s.top_probs[:, :64], tau[:, None]).any(1) & (tau > 0)).sum())
        for d in ("forward", "reverse", "tv"):
            np.testing.assert_allclose(cols[radius_column(c.spec, d)].numpy(), radius_rows(c, s, d).numpy(),
                                       rtol=1e-12, atol=0, err_msg=f"{c.spec} {d}")
    assert deep_seen > 10
    assert torch.isinf(cols[radius_column("additive:0.1")][:10]).all()


def test_the_profiler_writes_exactly_the_format(tmp_path):
    """Every column of ``trace_schema`` is produced by the profiler and none other (with a drafter
    and a feature drafter's rollouts), and a shard reads back as written."""
    crits = [parse_criterion(c) for c in DEFAULT_CRITERIA]
    certifier = StepCertifier(crits, ["tv"])  # forward is always added, first
    x, y = _logits(3, n=6, V=300)
    s, bad = certifier.summarize_step(x)
    depth, width = 3, 4
    ids = torch.randint(0, 300, (6, depth - 1, width), generator=torch.Generator().manual_seed(0))
    cols = certifier.rows([s], [bad], y, (ids, torch.rand(6, depth - 1)))
    schema = trace_schema(crits, certifier.divergences, True, (depth, width))
    assert certifier.divergences == ["forward", "tv"]
    assert set(cols) | {"prompt_id", "position", "target_token"} == set(schema.names)

    batch = BatchTrace(["b", "a"], schema)
    batch.add(StepRows(rows=torch.tensor([1, 1, 1, 0, 0, 0]), positions=torch.tensor([0, 1, 2, 0, 1, 2]),
                       tokens=x.argmax(1), cols=cols))
    table = batch.to_table()
    assert table.schema.names == schema.names
    write_shard(table, tmp_path / shard_name(0, 0), ["b", "a"], "abc")
    (shard,) = list_shards(tmp_path)
    assert shard_prompt_ids(shard) == (["b", "a"], "abc")
    back = read_columns([shard], schema.names)
    # rows ordered by (prompt in batch order, position): batch row 0 is "b"
    assert [back.prompt_names[i] for i in back["prompt_id"]] == ["b"] * 3 + ["a"] * 3
    order = [3, 4, 5, 0, 1, 2]
    for name in ("kl_forward", radius_column("tree:2", "tv"), "accepted/strict", "accept_mask/mars:0.5",
                 "rollout_topk_ids", "rollout_accept_mask/strict", "target_topk_probs"):
        want = cols[name].numpy()[order]
        np.testing.assert_array_equal(back[name], want.astype(back[name].dtype), err_msg=name)
    assert back["target_topk_ids"].shape == (6, 16) and back["rollout_topk_ids"].shape == (6, (depth - 1) * width)
