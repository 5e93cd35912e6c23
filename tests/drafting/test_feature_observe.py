"""drafting/feature_drafter.py: the target features a feature drafter observes, appended in place."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from draftcert.forward import kv_buffer
from draftcert.drafting.feature_drafter import FeatureDrafter


def test_observed_features_are_the_rounds_features_in_order(monkeypatch):
    monkeypatch.setattr(kv_buffer, "MIN_SPARE", 3)  # reallocate often
    d = FeatureDrafter(SimpleNamespace(dtype=torch.float32))
    g = torch.Generator().manual_seed(0)
    seen = []
    for t in (5, 1, 1, 3, 1, 7, 2, 1, 1, 1, 4):
        h = torch.randn(t, 6, generator=g, dtype=torch.float64)  # converted to the drafter's dtype
        d.observe(h)
        seen.append(h.float())
        assert d.n_feat == sum(len(s) for s in seen) and torch.equal(d.feats, torch.cat(seen))
    saved = d.feats  # what the cost calibration does: a shorter view for a while, then the whole again
    d.feats = saved[:4]
    d.feats = saved
    d.observe(torch.ones(2, 6))
    assert torch.equal(d.feats, torch.cat(seen + [torch.ones(2, 6)]))


def test_appends_within_the_spare_rows_move_nothing():
    d = FeatureDrafter(SimpleNamespace(dtype=torch.float32))
    d.observe(torch.zeros(10, 4))
    ptr = d.feats.data_ptr()
    for i in range(kv_buffer.MIN_SPARE):
        d.observe(torch.full((1, 4), float(i)))
        assert d.feats.data_ptr() == ptr
    assert torch.equal(d.feats[10:, 0], torch.arange(kv_buffer.MIN_SPARE, dtype=torch.float32))
