"""accept_ids on (N, K) token ids (the profiler's accept masks) decides exactly as K calls
on (N,) ids, for every level-set rule, including rows settled in arbitrary precision."""

import torch

import draftcert as dc
from draftcert.criteria import parse_criterion
from draftcert.summary import summarize

RULES = ["strict", "additive:0.05", "multiplicative:0.5", "topm:2", "relaxed:2:0.05", "relaxed:3:0.5", "entropy:0.09:0.3",
         "typical:0.09:0.3", "mars:0.3", dc.LevelSet(lambda p: 0.7 * p.max(-1).values, name="user:0.7")]


def test_accept_ids_2d_equals_columnwise():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(12, 300, generator=g) * 2
    x[1, 5] = x[1].max()  # an exact tie at the top
    x[2, 7] = x[2].max() - 1e-7  # a near-tie: float64 cannot settle multiplicative:1 / strict-like rows
    x[3, :] = 0.0  # every value tied
    x[4, 10] = x[4, 11] = x[4].max() + 0.693147  # the threshold of multiplicative:0.5 right at a token
    ids = torch.topk(x, 16, dim=-1).indices
    ids[:, 15] = torch.randint(0, 300, (12,), generator=g)
    for rule in RULES:
        c = parse_criterion(rule)
        for logits in (True, False):
            s = summarize(logits=x, k=16) if logits else summarize(torch.softmax(x.double(), -1), k=16)
            want = torch.stack([c.accept_ids(s, ids[:, j]) for j in range(ids.shape[1])], 1)
            got = c.accept_ids(s, ids)
            assert got.shape == ids.shape and torch.equal(got, want), c.spec
