"""The shared tree-growing loop (``drafting.tree_growth``): what it feeds a drafter, and the one tie rule.

Both drafters with a distribution (a causal LM's ``ModelDrafter``, the ``FeatureDrafter``) are
driven to exact ties of q (every odd token id gets one top logit) and must draft the same trees,
lowest token id first, in chains and full trees (``torch.topk`` leaves the order of ties open).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from draftcert.drafting import ModelDrafter
from draftcert.drafting.feature_drafter import FeatureDrafter
from draftcert.drafting.tree_growth import grow_tree, top_children, top_probability
from draftcert.models.eagle import EagleDrafter
from draftcert.models.hf import forward_with_hidden, new_cache
from draftcert.summary import topk_lowest_ids

TOP = 100.0  # the logit every odd token id shares: far above any other
SEQ = [5, 17, 200, 3, 42, 9]


def _odd_ids_on_top(module, inputs, out):
    out = out.clone()
    out[..., 1::2] = TOP
    return out


@pytest.fixture(scope="module")
def drafters(target_factory):
    """(ModelDrafter, FeatureDrafter), each of whose q puts every odd token id at one equal top value."""
    target, _ = target_factory()
    lm = copy.deepcopy(target)
    lm.lm_head.register_forward_hook(_odd_ids_on_top)
    # a feature drafter over the whole vocabulary whose head layer puts the odd ids on top (a tail
    # logit cannot: it is capped below the draft vocabulary's top, models/eagle.py)
    eagle = EagleDrafter(target, torch.arange(target.config.vocab_size)).to(torch.float64).eval()
    head = torch.nn.Linear(eagle.hidden_size, eagle.n_draft_vocab, bias=False).to(torch.float64)
    with torch.no_grad():
        head.weight.copy_(eagle.head_weight())
    head.register_forward_hook(_odd_ids_on_top)
    eagle.head_layer = lambda: head  # what FeatureDrafter computes its logits with
    return ModelDrafter(lm), FeatureDrafter(eagle), target


def _propose(drafter, target, widths, expand_all):
    with torch.inference_mode():
        drafter.start(SEQ)
        if isinstance(drafter, FeatureDrafter):  # the target's features of the cached prefix
            _, hidden = forward_with_hidden(target, new_cache(target), SEQ[:-1], 1)
            drafter.observe(hidden)
        return drafter.propose(SEQ, widths, expand_all)


@pytest.mark.parametrize("widths, expand_all", [([1, 1, 1], False), ([3, 3, 3], False), ([3, 2], True),
                                                ([2, 2, 2], True)])
def test_both_drafters_break_exact_ties_to_the_lowest_id(drafters, widths, expand_all):
    model_drafter, feature_drafter, target = drafters
    trees = [_propose(d, target, widths, expand_all) for d in (model_drafter, feature_drafter)]
    for tree in trees:
        odd = tree.q[:, 1::2]
        assert (odd == odd[:, :1]).all() and (tree.q.max(-1).values == odd[:, 0]).all()  # the ties are real
        children = tree.children_table()
        for e, (node, w) in enumerate(zip(tree.expanded, tree.widths)):
            kids = [tree.tokens[c] for c in children[node + 1]]
            assert kids == list(range(1, 2 * w, 2))  # the w lowest odd ids, in increasing order
            assert kids == topk_lowest_ids(tree.q[e : e + 1], w)[1][0].tolist()
    a, b = trees
    assert (a.tokens, a.parents, a.expanded, a.widths) == (b.tokens, b.parents, b.expanded, b.widths)


def test_top_children_ranks_by_value_then_lowest_id():
    q = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0]])
    assert top_children(q, 1).tolist() == [[1]]
    assert top_children(q, 3).tolist() == [[1, 3, 4]]
    assert top_children(q, 4).tolist() == [[1, 3, 4, 2]]


def test_grow_tree_feeds_chains_causally_and_trees_with_their_mask():
    V, n_prefix = 8, 5
    calls = []

    def feed(tree, nodes, mask, pos):
        calls.append((list(nodes), None if mask is None else tuple(mask.shape), pos.tolist()))
        return torch.arange(V, dtype=torch.float64).flip(0).expand(len(nodes), V)  # q ranks token 0 first

    root = torch.zeros(1, V, dtype=torch.float64)  # all tied: children 0, 1, ...
    tree, fed = grow_tree(root, [2, 2, 1], False, feed, n_prefix=n_prefix, device="cpu", dtype=torch.float64)
    # a chain of greedy children: one node per feed, plain causal attention, position n_prefix - 1 + depth
    assert calls == [([0], None, [[5]]), ([2], None, [[6]])] and fed == [0, 2]
    assert tree.tokens == [0, 1, 0, 1, 0] and tree.parents == [-1, -1, 0, 0, 2]
    assert tree.q.shape == (3, V)

    calls.clear()
    tree, fed = grow_tree(root, [2, 2, 1], True, feed, n_prefix=n_prefix, device="cpu", dtype=torch.float64)
    # every new node is fed; the mask covers the prefix, the nodes fed before and the new ones
    assert calls == [([0, 1], (1, 1, 2, n_prefix + 2), [[5, 5]]),
                     ([2, 3, 4, 5], (1, 1, 4, n_prefix + 6), [[6, 6, 6, 6]])]
    assert fed == [0, 1, 2, 3, 4, 5] and len(tree) == 2 + 4 + 4
    assert tree.q.shape == (1 + 2 + 4, V)


def test_the_confidence_stop_ends_a_chain_where_the_drafter_is_unsure():
    """grow_tree with ``min_margin``: depth d is drafted only where the front's top-2 logit gap is at
    least the margin; the chain ends at the first smaller gap (at the root: nothing drafted)."""
    from draftcert.drafting.tree_growth import grow_tree, top2_margin

    V = 8
    gaps = [3.0, 2.0, 0.5, 4.0]  # the drafter's gap at depth 1, 2, 3, 4

    def row(gap):
        q = torch.zeros(1, V, dtype=torch.float64)
        q[0, 5], q[0, 2] = gap, 0.0
        q[0, 3] = -1.0
        return q

    def feed(tree, nodes, mask, pos):
        return row(gaps[tree.depths[nodes[0]]])  # a node at depth d feeds the q of depth d + 1

    assert top2_margin(row(2.0)) == 2.0
    full, _ = grow_tree(row(gaps[0]), [1] * 4, False, feed, n_prefix=3, device="cpu", dtype=torch.float64)
    assert len(full) == 4
    for margin, drafted in ((0.4, 4), (1.0, 2), (2.5, 1), (3.5, 0)):
        tree, fed = grow_tree(row(gaps[0]), [1] * 4, False, feed, n_prefix=3, device="cpu", dtype=torch.float64,
                              min_margin=margin)
        assert len(tree) == drafted, margin
        assert (tree.q is None) == (drafted == 0) and (tree.q is None or tree.q.shape[0] == drafted)


@pytest.mark.parametrize("margin", [0.0, 1.0, 1e9])
def test_strict_with_a_confidence_stop_is_greedy(tiny, prompts, margin):
    from draftcert.decode import greedy_generate, speculative_generate

    target, drafter, _ = tiny
    res = speculative_generate(target, drafter, prompts[1], "strict", k=4, max_new_tokens=24, draft_margin=margin)
    assert res.tokens == greedy_generate(target, prompts[1], 24)
    if margin == 1e9:  # never sure enough: nothing drafted, one target step a token
        assert res.stats.num_drafts == 0 and res.stats.num_rounds == 24
    with pytest.raises(ValueError, match="draft_margin"):
        speculative_generate(target, drafter, prompts[1], "strict", k=4, max_new_tokens=4, draft_margin=-1.0)



# ---------------------------------------------------------------------------
# keep_drafting: the draft length from the drafter's own confidence


def _chain_feed(rows: list[torch.Tensor], fed: list):
    """A feed that returns the given q rows in turn and records each call."""
    def feed(tree, nodes, mask, pos):
        fed.append(list(nodes))
        return rows[len(fed)][None]
    return feed


@pytest.mark.parametrize("stop_after", [1, 2, 4])
def test_keep_drafting_stops_the_chain_before_the_next_drafter_step(stop_after):
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(50, generator=g, dtype=torch.float64) for _ in range(6)]
    fed, seen = [], []

    def keep(pis):
        seen.append(list(pis))
        return len(pis) < stop_after

    tree, nodes = grow_tree(rows[0][None], [1] * 6, False, _chain_feed(rows, fed), n_prefix=3, device="cpu",
                            dtype=torch.float64, keep_drafting=keep)
    assert len(tree) == stop_after and tree.tokens == [int(r.argmax()) for r in rows[:stop_after]]
    assert len(fed) == stop_after - 1 == len(nodes)  # the step that would follow the stop is never computed
    # what the rule heard: softmax(q_j)[greedy] at depths 1..d, exactly
    want = [float(torch.softmax(r, 0).max()) for r in rows[:stop_after]]
    assert list(seen[-1]) == pytest.approx(want, rel=1e-12, abs=0) and len(seen) == stop_after
    assert tree.q.shape[0] == stop_after  # certificates keep the rows the chain was expanded from


def test_keep_drafting_is_not_asked_at_the_last_depth_nor_for_full_trees():
    rows = [torch.arange(10, dtype=torch.float64) + i for i in range(4)]
    calls = []
    tree, _ = grow_tree(rows[0][None], [1] * 3, False, _chain_feed(rows, []), n_prefix=2, device="cpu",
                        dtype=torch.float64, keep_drafting=lambda p: calls.append(p) or True)
    assert len(tree) == 3 and [len(c) for c in calls] == [1, 2]

    def feed_all(tree, nodes, mask, pos):
        return torch.stack([rows[0]] * len(nodes))
    calls.clear()
    tree, _ = grow_tree(rows[0][None], [2, 2], True, feed_all, n_prefix=2, device="cpu", dtype=torch.float64,
                        keep_drafting=lambda p: calls.append(p) or False)
    assert len(tree) == 6 and calls == []  # a static tree has its shape


def test_top_probability_is_accurate_on_wide_rows():
    """float32 rows are reduced in float32 (a float64 copy of a 49k-wide row cost a tenth of a
    drafted token): within 1e-6 relative even where 199,999 tiny terms add up; float64 rows stay exact."""
    q = torch.full((1, 200_000), -30.0)
    q[0, 7] = 4.0
    exact = 1.0 / (1.0 + 199_999 * math.exp(-34.0))
    assert top_probability(q) == pytest.approx(exact, rel=1e-6)
    assert top_probability(q.double()) == pytest.approx(exact, rel=1e-14)
    q = torch.full((1, 200_000), -10.0)
    q[0, 3] = 0.0  # the tail holds most of the mass: p = 1 / (1 + 199,999 e^-10) ~ 0.1
    exact = 1.0 / (1.0 + 199_999 * math.exp(-10.0))
    assert top_probability(q) == pytest.approx(exact, rel=1e-6)
    assert top_probability(torch.zeros(1, 4)) == pytest.approx(0.25, rel=1e-7)
    assert top_probability(torch.zeros(1, 4, dtype=torch.bfloat16)) == pytest.approx(0.25, rel=1e-7)
