"""Suffix-match candidates (``drafting.suffix``): the index finds the longest match of the sequence's tail
and drafts longer after longer matches; model-free candidates and a model drafter's tree in one tree
decode exactly the target's greedy output under ``strict`` (chain and tree, causal-LM and feature
drafters), with suffix nodes actually accepted; the ``suffix`` / ``DRAFTER+suffix`` spec strings.

The tiny random target falls into loops (one token repeated) after a few tokens, so its own output
is where the suffix candidates are accepted; the slow test runs the embedded target with the
shipped drafter on prompts that quote code.
"""

from __future__ import annotations

import pytest
import torch

from draftcert.decode import (
    HybridDrafter,
    ModelDrafter,
    SuffixDrafter,
    SuffixIndex,
    SuffixStore,
    greedy_generate,
    make_drafter,
    speculative_generate,
)
from draftcert.drafting.feature_drafter import FeatureDrafter
from draftcert.drafting.suffix import graft
from draftcert.models.tree_attention import DraftTree
from draftcert.models import load_drafter, load_target, parse_drafter_spec
from draftcert.models.eagle import EagleDrafter
from draftcert.prompts import encode_prompt, load_prompts

N_NEW = 40


def _index(**kw) -> SuffixIndex:
    kw.setdefault("store", SuffixStore(0))  # no memory across tests
    return SuffixIndex(**kw)


def _draft(ix: SuffixIndex, seq, limit=16, widths=(1,)):
    return ix.draft(list(seq), list(widths), False, limit).tokens


# ---------------------------------------------------------------------------
# the index


def test_longest_match_wins_over_a_more_recent_shorter_one():
    ix = _index()
    # tail (1, 2, 3): occurs once, followed by 40; (2, 3) alone occurs more recently, followed by 50
    seq = [1, 2, 3, 40, 41, 42, 9, 2, 3, 50, 51, 52, 8, 1, 2, 3]
    ix.start(seq[:4])
    ix.sync(seq)
    m, cands = ix.match(seq)
    assert m == 3 and len(cands) == 1
    assert _draft(ix, seq) == [40, 41, 42]  # the 3-token match drafts 3 tokens (alpha = 1)


def test_draft_length_grows_with_the_match_and_is_capped():
    text = list(range(100, 140))
    ix = _index(max_draft=6)
    for m in (2, 3, 5):
        seq = text + [7] + text[10 - m : 10]  # the tail repeats text[10 - m : 10]
        ix.start(seq)
        assert _draft(ix, seq) == text[10 : 10 + min(m, 6)]
    seq = text + [7] + text[:10]  # a 10-token match: capped at max_draft
    ix.start(seq)
    assert _draft(ix, seq) == text[10:16]
    assert _draft(ix, seq, limit=2) == text[10:12]  # the engine's length budget caps it too
    assert _draft(ix, seq, limit=0) == []
    ix2 = _index(alpha=2.0, max_draft=16)
    seq = text + [7] + text[7:10]
    ix2.start(seq)
    assert _draft(ix2, seq) == text[10:16]  # alpha = 2: two tokens per matched token


def test_match_longer_than_the_indexed_ngrams_is_measured():
    text = list(range(200, 240))
    ix = _index(max_ngram=4, max_draft=32)
    seq = text + [7] + text[:20]
    ix.start(seq)
    ix.sync(seq)
    assert ix.match(seq)[0] == 20  # extended backwards past the 4-gram
    assert _draft(ix, seq, limit=32) == text[20:40]


def test_no_match_drafts_nothing():
    ix = _index()
    seq = list(range(50))
    ix.start(seq)
    assert _draft(ix, seq) == []
    ix = _index(min_match=3)
    seq = [5, 6, 1, 9, 9, 5, 6]  # (5, 6) occurs, but min_match 3 needs three tokens
    ix.start(seq)
    assert _draft(ix, seq) == []


def test_overlapping_match_continues_its_period():
    ix = _index(max_draft=8, alpha=2.0)
    seq = [9, 1, 2, 3, 1, 2, 3, 1, 2, 3]  # the tail's 6-token match (ending at 7) overlaps the tail itself
    ix.start(seq)
    assert _draft(ix, seq) == [1, 2, 3, 1, 2, 3, 1, 2]
    seq = [4, 4, 4, 4]
    ix.start(seq)
    assert _draft(ix, seq, limit=5) == [4] * 5  # match (4, 4, 4) ending at 3: 6 tokens wanted, copied past the end


def test_frequency_picks_the_continuation_and_min_prob_stops_the_draft():
    # (1, 2) was followed by 7 twice and by 8 once (most recently)
    seq = [1, 2, 7, 5, 1, 2, 7, 6, 1, 2, 8, 4, 1, 2]
    ix = _index()
    ix.start(seq)
    tree = ix.draft(seq, [2], False, 16)
    # two children by count (7: 2, 8: 1); only the best continues, 7 -> 6 (the most recent of 5 and 6, 1 each)
    assert (tree.tokens, tree.parents) == ([7, 8, 6], [-1, -1, 0])
    strict = _index(min_prob=0.5)
    strict.start(seq)
    assert _draft(strict, seq) == [7]  # 5 and 6 are each 1 of 3 candidates: below 0.5


def test_store_carries_outputs_across_sequences_but_not_the_same_prompt():
    store = SuffixStore(max_sequences=2)
    ix = _index(store=store)
    ix.start([100])
    ix.sync([100, 11, 12, 13, 14, 15])  # the first sequence's output: 11 .. 15
    ix.start([200])  # stores it
    assert len(store) == 1 and _draft(ix, [200, 11, 12]) == [13, 14]
    ix.start([100])  # the same prompt again: its own earlier output is not a candidate
    assert _draft(ix, [100, 11, 12]) == []
    other = ix.fork()  # a fork shares the store
    other.start([300])
    assert _draft(other, [300, 11, 12]) == [13, 14]
    for p in (400, 500, 600):  # bounded: the oldest outputs go first
        other.sync([p - 100, p, p + 1, p + 2])
        other.start([p])
    assert len(store) == 2 and _draft(other, [1, 11, 12]) == []


def test_the_store_counts_the_outputs_holding_each_ngram_through_evictions():
    """``SuffixStore.keys`` (which tails ``match`` looks up in the stored outputs at all) is the count,
    over the outputs held, of those holding each n-gram, as outputs come and the oldest go (by number
    and by tokens); a match finds what a look-up in every output finds."""
    import random
    from collections import Counter

    rnd, store = random.Random(3), SuffixStore(max_sequences=5, max_tokens=60)
    for step in range(40):
        store.add(step % 7, [rnd.randint(0, 9) for _ in range(rnd.randint(1, 25))])
        want = Counter(key for _, index in store.docs for key in index.ends)
        assert store.keys == dict(want), step
        ix = _index(store=store)
        ix.start([1000 + step])
        seq = [1000 + step] + [rnd.randint(0, 9) for _ in range(6)]
        ix.sync(seq)
        m, cands = ix.match(seq)
        tail = tuple(seq[len(seq) - min(m, ix.max_ngram):]) if m else None
        full = [(d.tokens, e) for d in [ix.live] + [d for _, d in reversed(store.docs)] if m
                for e in reversed(d.find(tail)) if e < len(d)]
        assert [(toks, e) for toks, e, _ in cands] == full[: ix.max_candidates], step
    store.clear()
    assert store.keys == {} and len(store) == 0


def test_graft_merges_shared_prefixes_without_duplicate_siblings():
    tree = DraftTree()
    a = tree.add(5, -1)
    tree.add(6, a)
    tree.add(9, -1)
    tree.q, tree.expanded, tree.widths = torch.zeros(1, 4), [-1], [2]
    assert graft(tree, [5, 6, 7, 8]) == 2  # 5 and 6 are the model's nodes: 7 and 8 hang below 6
    assert tree.tokens == [5, 6, 9, 7, 8] and tree.parents == [-1, 0, -1, 1, 3]
    assert graft(tree, [4]) == 1 and tree.parents[-1] == -1  # a new root child
    assert graft(tree, [5, 6]) == 0  # already there
    assert tree.expanded == [-1] and tree.widths == [2]  # the model's expansion (and q rows) untouched
    sib = [(p, t) for p, t in zip(tree.parents, tree.tokens)]
    assert len(sib) == len(set(sib))


class _ScriptedModel:
    """A model drafter stand-in: proposes ``tokens`` as a chain, records what it is told to keep."""

    needs_target_hidden = False
    forwards = 0

    def __init__(self, tokens):
        self.tokens, self.kept = list(tokens), []

    def start(self, prompt_ids):
        pass

    def propose(self, seq, widths, expand_all=False):
        tree, node = DraftTree(), -1
        for t in self.tokens[: len(widths)]:
            node = tree.add(t, node)
        return tree

    def accept(self, path):
        self.kept.append(list(path))


def _hybrid_at(model_tokens, seq):
    """A hybrid whose suffix chain at the tail of ``SEQ`` is 4, 5, 6, 7, 8, 9, 1, 2, 3 (a 3-token
    match, 3 drafted tokens per matched one)."""
    h = HybridDrafter(_ScriptedModel(model_tokens), _index(alpha=3.0))
    h.start(seq[:1])
    h.depth_limit = 16
    return h


SEQ = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]  # the tail 1, 2, 3 matched earlier: continuation 4 5 6 7 8 9 1 2 3


def test_a_priced_graft_asks_for_each_added_row_and_stops_where_refused():
    asked = []

    def keep(reach, rows):
        asked.append((round(reach, 12), rows))
        return len(asked) < 3  # the third added node is refused

    h = _hybrid_at([4, 5], SEQ)
    h.keep_grafting = keep
    tree = h.propose(SEQ, [1, 1])
    s = h.graft_acceptance()
    assert s == pytest.approx(0.7)  # the prior: nothing tried yet
    # 4, 5 are the model's nodes (free); 6 and 7 are added (rows 3 and 4 before each); 8 is refused
    assert tree.tokens == [4, 5, 6, 7] and tree.parents == [-1, 0, 1, 2]
    assert asked == [(round(s ** 3, 12), 3), (round(s ** 4, 12), 4), (round(s ** 5, 12), 5)]
    h.keep_grafting = None  # without pricing the whole chain (9 tokens here) hangs below the model's
    assert len(h.propose(SEQ, [1, 1])) == 2 + 7


def test_graft_acceptance_counts_reached_grafted_nodes():
    h = _hybrid_at([4], SEQ)
    h.keep_grafting = lambda reach, rows: rows < 5  # nodes 1 .. 3 grafted below the model's 4
    tree = h.propose(SEQ, [1])
    assert tree.tokens == [4, 5, 6, 7] and h.suffix_drafted == 3
    h.accept([0, 1, 2])  # the model's node and two grafted ones accepted, the third refused
    assert (h.suffix_accepted, h.suffix_attempted) == (2, 3)
    assert h.model_drafter.kept[-1] == [0]
    h.propose(SEQ, [1])
    h.accept([])  # the model's first node refused: its grafted child was never reached
    assert (h.suffix_accepted, h.suffix_attempted) == (2, 3)
    h.model_drafter.tokens = [9]  # the model now disagrees at the root: the graft hangs off the root
    tree = h.propose(SEQ, [1])
    assert tree.parents[:2] == [-1, -1]
    h.accept([])  # both root children refused: the grafted one was tried
    assert (h.suffix_accepted, h.suffix_attempted) == (2, 4)
    assert h.graft_acceptance() == pytest.approx((0.7 * 2 + 2) / (2 + 4))
    h.start(SEQ[:1])  # a new decode starts from the prior; the counters keep running
    assert h.graft_acceptance() == pytest.approx(0.7) and (h.suffix_accepted, h.suffix_attempted) == (2, 4)


def test_the_controller_prices_a_row_against_its_best_rate():
    from draftcert.decode.draft_shape.adaptive import AdaptiveDraftLength
    from draftcert.decode.draft_shape.costs import Costs

    costs = Costs("calibrated", {1: 0.010, 2: 0.011, 3: 0.012}, {1: 0.001}, overhead={1: 0.0}, target_step=0.010)
    ctl = AdaptiveDraftLength(costs, (0.5,), max_k=2)
    rates = ctl.rates()
    best = max(rates)
    # one more row costs 1 ms (beyond the curve: the slope of its two largest sizes); it pays iff
    # reach / 0.001 > best
    for rows in (1, 2, 3, 7):
        assert ctl.keep_grafting(best * 0.001 * 1.01, rows) and not ctl.keep_grafting(best * 0.001 * 0.99, rows)


# ---------------------------------------------------------------------------
# decoding: strict with suffix candidates equals greedy


@pytest.fixture(scope="module")
def looping(tiny):
    target, drafter, tok = tiny
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 256, (12,), generator=g).tolist()
    prompt = base + base + base[:6]  # repeated text in the prompt too
    return target, drafter, prompt, greedy_generate(target, prompt, N_NEW)


@pytest.mark.parametrize("k, tree", [(2, None), (3, None), (2, (2, 2)), (2, [2, 2])])
def test_hybrid_with_a_causal_lm_drafter_is_lossless(looping, k, tree):
    target, drafter, prompt, ref = looping
    h = HybridDrafter(ModelDrafter(drafter), _index())
    res = speculative_generate(target, h, prompt, "strict", k=k, tree=tree, max_new_tokens=N_NEW)
    assert res.tokens == ref
    assert h.suffix_accepted > 0  # suffix nodes were on accepted paths: the model drafter had to catch up
    alone = speculative_generate(target, ModelDrafter(drafter), prompt, "strict", k=k, tree=tree, max_new_tokens=N_NEW)
    assert res.stats.tokens_per_forward > alone.stats.tokens_per_forward


def test_hybrid_with_a_feature_drafter_is_lossless(looping):
    target, _, prompt, ref = looping
    eagle = EagleDrafter(target, torch.arange(0, target.config.vocab_size, 2)).to(torch.float64).eval()
    for tree in (None, (2, 2)):
        h = HybridDrafter(FeatureDrafter(eagle), _index())
        assert h.needs_target_hidden
        res = speculative_generate(target, h, prompt, "strict", k=2, tree=tree, max_new_tokens=N_NEW)
        assert res.tokens == ref and h.suffix_accepted > 0


def test_suffix_alone_is_lossless_and_respects_the_length(looping):
    target, _, prompt, ref = looping
    for n in (N_NEW, 17, 1):
        s = SuffixDrafter(_index())
        res = speculative_generate(target, s, prompt, "strict", k=2, max_new_tokens=n)
        assert res.tokens == ref[:n]  # drafts run deeper than k, never past max_new_tokens
    assert res.stats.checked_positions == 0  # no distribution: no certificates


def test_certificates_hold_with_suffix_nodes(looping):
    target, drafter, prompt, ref = looping
    h = HybridDrafter(ModelDrafter(drafter), _index())
    res = speculative_generate(target, h, prompt, "strict", k=2, tree=(2, 2), max_new_tokens=N_NEW, certificates=True)
    assert res.tokens == ref and res.stats.checked_positions > 0  # the model's nodes keep their certificates
    res = speculative_generate(target, HybridDrafter(ModelDrafter(drafter), _index()), prompt, "additive:0.1", k=2,
                               max_new_tokens=N_NEW)  # a relaxed rule: certified-but-rejected would raise
    assert len(res.tokens) == N_NEW


# ---------------------------------------------------------------------------
# spec strings


def test_spec_strings(tiny):
    target, _, tok = tiny
    assert (parse_drafter_spec("suffix").kind, parse_drafter_spec("suffix").suffix) == ("suffix", False)
    spec = parse_drafter_spec("self:skip=1+suffix")
    assert (spec.spec, spec.kind, spec.suffix, spec.model_spec) == ("self:skip=1+suffix", "self", True, "self:skip=1")
    assert parse_drafter_spec("default+suffix").model_spec == parse_drafter_spec("default").spec
    assert isinstance(make_drafter("suffix"), SuffixDrafter)
    h = make_drafter("self:skip=1+suffix", target, tok)
    assert isinstance(h, HybridDrafter) and isinstance(h.model_drafter, ModelDrafter)
    for bad in ("pld+suffix", "suffix+suffix", "self:skip=1+suffix+suffix"):
        with pytest.raises(ValueError, match=r"\+suffix"):
            parse_drafter_spec(bad)
    with pytest.raises(ValueError, match="decoding loop"):
        load_drafter("self:skip=1+suffix", target, tok)


# ---------------------------------------------------------------------------
# the embedded target


@pytest.mark.slow
def test_default_plus_suffix_is_lossless_on_the_embedded_target():
    target, tok = load_target(None)
    accepted = 0
    for p in load_prompts("humaneval", limit=2) + load_prompts("mt-bench", limit=1):
        ids = encode_prompt(tok, p.text)
        ref = greedy_generate(target, ids, 64)
        h = make_drafter("default+suffix", target, tok)
        assert isinstance(h, HybridDrafter)
        h.suffix = SuffixIndex(store=SuffixStore(0))
        res = speculative_generate(target, h, ids, "strict", k=1, max_new_tokens=64)
        assert res.tokens == ref
        accepted += h.suffix_accepted
    assert accepted > 0
