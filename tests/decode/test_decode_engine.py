"""Speculative decoding engine: losslessness, relaxed criteria, the round's stages, stats
(vLLM's counters too, and merge), live certificates equal to the library's, EOS, bad input."""

from __future__ import annotations

import copy
from functools import reduce

import pytest
import torch

import draftcert
from draftcert import LevelSet, TreeCoverage, parse_criterion
from draftcert.decode import (
    CertificateViolation,
    PromptLookupDrafter,
    greedy_generate,
    speculative_generate,
)
from draftcert.decode import round as round_mod
from draftcert.decode.bench import timed_generate
from draftcert.decode.config import resolve_criterion
from draftcert.models import derive_drafter
from tests.tiny_models import tiny_qwen3

N_NEW = 24
RELAXED = ["additive:0.1", "multiplicative:0.5", "topm:2", "entropy:0.09:0.3", "mars:0.5"]


@pytest.fixture(scope="module")
def refs(tiny, prompts):
    target, _, _ = tiny
    return [greedy_generate(target, p, N_NEW) for p in prompts]


def test_own_greedy_matches_transformers_generate(tiny, prompts, refs):
    target, _, _ = tiny
    for p, ref in zip(prompts, refs):
        out = target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=N_NEW, min_new_tokens=N_NEW)
        assert out[0, len(p) :].tolist() == ref


@pytest.mark.parametrize("k", range(1, 7))
def test_strict_chain_is_lossless(tiny, prompts, refs, k):
    target, drafter, tok = tiny
    for p, ref in zip(prompts, refs):
        res = speculative_generate(target, drafter, p, "strict", k=k, max_new_tokens=N_NEW, tokenizer=tok)
        assert res.tokens == ref
        assert res.stats.drift_tokens == 0 and res.stats.divergence_spent == 0.0


@pytest.mark.parametrize("depth", range(1, 7))
@pytest.mark.parametrize("m", [2, 3])
def test_strict_tree_is_lossless(tiny, prompts, refs, m, depth):
    target, drafter, tok = tiny
    for p, ref in zip(prompts, refs):
        res = speculative_generate(target, drafter, p, "strict", tree=(m, depth), max_new_tokens=N_NEW, tokenizer=tok)
        assert res.tokens == ref
        # tree:m means the same thing: coverage by the drafter's top-m
        res2 = speculative_generate(target, drafter, p, f"tree:{m}", k=depth, max_new_tokens=N_NEW)
        assert res2.tokens == ref
        assert res2.stats.target_forwards == res.stats.target_forwards


@pytest.mark.parametrize("widths", [[2, 2, 2], [3, 1, 2], [4, 2], [1, 1, 1, 1]])
def test_strict_static_tree_is_lossless(tiny, prompts, refs, widths):
    target, drafter, tok = tiny
    for p, ref in zip(prompts, refs):
        res = speculative_generate(target, drafter, p, "strict", tree=list(widths), max_new_tokens=N_NEW)
        assert res.tokens == ref


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_tree_mask_works_for_eager_and_sdpa(attn, target_factory):
    target, _ = target_factory(attn=attn, seed=3, layers=3)
    drafter = derive_drafter(target, "self:skip=1")
    p = [5, 9, 2, 77, 31]
    ref = greedy_generate(target, p, 16)
    for tree in [(3, 3), [2, 2, 2]]:
        assert speculative_generate(target, drafter, p, "strict", tree=tree, max_new_tokens=16).tokens == ref


def test_perfect_drafter_accepts_everything_and_certifies(tiny, prompts, refs):
    """The target drafting for itself: KL = 0 < radius wherever the radius is positive."""
    target, _, _ = tiny
    res = speculative_generate(target, target, prompts[0], "strict", k=4, max_new_tokens=N_NEW)
    assert res.tokens == refs[0]
    st = res.stats
    assert all(r == 1.0 for r in st.conditional_acceptance_rate_per_pos)
    assert st.tokens_per_forward == pytest.approx(N_NEW / st.target_forwards)
    assert st.target_forwards == -(-N_NEW // 5)  # 4 drafts + 1 bonus per round
    assert st.certified_positions > 0


def _target_logits_along(target, prompt, tokens):
    """Independent reference: one cache-free forward over prompt + tokens."""
    with torch.inference_mode():
        ids = torch.tensor([prompt + tokens])
        return target(input_ids=ids).logits[0, len(prompt) - 1 : -1]


@pytest.mark.parametrize("spec", RELAXED)
@pytest.mark.parametrize("tree", [None, (2, 3)])
def test_relaxed_criteria_emit_tokens_the_rule_accepts(tiny, prompts, spec, tree):
    target, drafter, _ = tiny
    crit = parse_criterion(spec)
    for p in prompts:
        res = speculative_generate(target, drafter, p, spec, k=4, tree=tree, max_new_tokens=N_NEW)
        toks, st = res.tokens, res.stats
        assert len(toks) == N_NEW and all(0 <= t < 259 for t in toks)
        logits = _target_logits_along(target, p, toks)
        # every emitted token passes the level-set test at its prefix (recomputed from scratch)
        assert bool(torch.as_tensor(crit.accepts_tokens(logits=logits, tokens=torch.tensor(toks))).all())
        greedy = logits.argmax(-1).tolist()
        differ = sum(a != b for a, b in zip(toks, greedy))
        assert st.drift_tokens == differ
        assert st.drift == pytest.approx(differ / len(toks))
        logp = torch.log_softmax(logits, -1)
        spent = float(sum(logp[i].max() - logp[i, t] for i, t in enumerate(toks)))
        assert st.divergence_spent == pytest.approx(spent, abs=1e-9)
        assert st.checked_positions > 0


def test_relaxed_rule_actually_relaxes(tiny, prompts):
    target, drafter, _ = tiny
    strict = speculative_generate(target, drafter, prompts[1], "strict", k=4, max_new_tokens=N_NEW).stats
    loose = speculative_generate(target, drafter, prompts[1], "additive:0.3", k=4, max_new_tokens=N_NEW).stats
    assert loose.tokens_per_forward > strict.tokens_per_forward
    assert loose.drift_tokens > 0


def test_certified_but_rejected_raises(tiny, prompts, monkeypatch):
    """Sabotage the radius: every position looks certified, so a rejection must raise."""
    target, drafter, _ = tiny
    monkeypatch.setattr(round_mod, "radius_rows", lambda crit, summ, kind: torch.full((summ.top_probs.shape[0],), torch.inf, dtype=torch.float64))
    with pytest.raises(CertificateViolation, match="certified but rejected"):
        speculative_generate(target, drafter, prompts[1], "strict", k=4, max_new_tokens=N_NEW)


@pytest.mark.parametrize("spec,tree", [("strict", None), ("additive:0.1", None), ("strict", (3, 3)), ("topm:2", [2, 2])])
def test_stats_are_consistent(tiny, prompts, spec, tree):
    target, drafter, _ = tiny
    res = timed_generate(target, drafter, prompts[0], spec, k=3, tree=tree, max_new_tokens=N_NEW, baseline=True)
    st = res.stats
    assert st.emitted == len(res.tokens) == N_NEW
    assert st.tokens_per_forward == st.emitted / st.target_forwards
    assert st.target_forwards == len(st.rounds)
    assert sum(len(r.emitted) for r in st.rounds) == st.emitted
    assert [t for r in st.rounds for t in r.emitted] == res.tokens
    assert sum(r.num_accepted_tokens for r in st.rounds) == sum(st.num_accepted_tokens_per_pos) == st.num_accepted_tokens
    assert sum(n * h for n, h in enumerate(st.accepted_tokens_histogram)) == st.num_accepted_tokens
    # vLLM's counters, counted by hand from the round logs
    drafted = [r for r in st.rounds if r.num_draft_tokens]
    assert st.num_drafts == len(drafted) and st.num_draft_tokens == sum(r.num_draft_tokens for r in drafted)
    assert st.mean_acceptance_length == pytest.approx(1 + st.num_accepted_tokens / len(drafted))
    assert st.draft_acceptance_rate == pytest.approx(st.num_accepted_tokens / st.num_draft_tokens)
    for d, rate in enumerate(st.acceptance_rate_per_pos):
        n = sum(len(r.depth_accepted) > d and r.depth_accepted[d] for r in st.rounds)
        assert st.num_accepted_tokens_per_pos[d] == n and rate == pytest.approx(n / len(drafted))
    assert sum(sum(r.from_draft) for r in st.rounds) == sum(r.num_accepted_tokens for r in st.rounds)
    for r in st.rounds:  # accepted depths are a prefix 1..a, then at most one rejection
        assert r.depths == list(range(1, len(r.depths) + 1))
        assert r.depth_accepted[: r.num_accepted_tokens] == [True] * r.num_accepted_tokens
        assert all(c is not None for c in r.certified)
        assert not any(c and not a for c, a in zip(r.certified, r.depth_accepted))
    assert st.kl_count == sum(r.num_accepted_tokens for r in st.rounds)
    assert st.baseline_tokens == N_NEW and st.speedup is not None and st.speedup > 0
    if spec == "strict":
        assert st.baseline_match is True and res.baseline_tokens == res.tokens


@pytest.mark.parametrize("tree", [None, (2, 4)])
def test_eos_inside_accepted_draft_ends_output(tiny, prompts, tree):
    """Perfect drafter: the EOS token arrives inside an accepted draft; nothing after it is emitted."""
    target, _, _ = tiny
    ref = greedy_generate(target, prompts[1], N_NEW)
    # an EOS id that greedy decoding first emits at position j, not a bonus slot (every 5th token)
    firsts = [j for j in range(1, N_NEW) if ref[j] not in ref[:j] and j % 5 != 4]
    assert firsts, f"test needs a more varied greedy output than {ref}"
    j = firsts[0]
    eos = ref[j]
    res = speculative_generate(target, target, prompts[1], "strict", k=4, tree=tree, max_new_tokens=N_NEW, eos_token_id=eos)
    assert res.tokens == ref[: j + 1]
    last = res.stats.rounds[-1]
    assert last.emitted[-1] == eos and last.from_draft[-1] is True  # it was a draft token, accepted
    assert greedy_generate(target, prompts[1], N_NEW, eos_token_id=eos) == ref[: j + 1]


def test_max_new_tokens_is_exact(tiny, prompts, refs):
    target, drafter, _ = tiny
    for n in (1, 2, 5, 7):
        for tree in (None, (2, 3)):
            res = speculative_generate(target, target, prompts[0], "strict", k=4, tree=tree, max_new_tokens=n)
            assert res.tokens == refs[0][:n]


def test_greedy_stop_keeps_what_it_returns_as_speculative_does(tiny, prompts, refs):
    target, drafter, _ = tiny
    seen = []

    def stop(out):  # fires once 7 tokens are out, keeping 5; rounds of up to 5 tokens overshoot 7
        seen.append(len(out))
        return 5 if len(out) >= 7 else None

    assert greedy_generate(target, prompts[0], N_NEW, stop=stop) == refs[0][:5]
    assert seen == list(range(1, 8))  # after every token
    res = speculative_generate(target, target, prompts[0], "strict", k=4, max_new_tokens=N_NEW, stop=stop)
    assert res.tokens == refs[0][:5]


def test_prompt_lookup_drafter(tiny):
    target, _, _ = tiny
    # A prompt with repeats, and a target whose greedy output repeats: lookup finds matches.
    p = [10, 11, 12, 13, 10, 11, 12, 13, 10, 11]
    ref = greedy_generate(target, p, 40)
    for tree in (None, (3, 4), [2, 2]):
        res = speculative_generate(target, "prompt-lookup", p, "strict", k=4, tree=tree, max_new_tokens=40)
        assert res.tokens == ref
        assert res.stats.drafter_forwards == 0 and res.stats.checked_positions == 0
    assert speculative_generate(target, PromptLookupDrafter(), p, "strict", k=4, max_new_tokens=40).stats.tokens_per_forward > 1


def test_prompt_lookup_proposals():
    pl = PromptLookupDrafter(max_ngram=2)
    seq = [1, 2, 3, 4, 9, 1, 2, 5, 6, 7, 1, 2]
    chain = pl.propose(seq, [1, 1, 1])
    assert chain.tokens == [5, 6, 7] and chain.is_chain  # most recent match of (1, 2) first
    t = pl.propose(seq, [2, 2, 2])
    assert sorted(t.tokens[i] for i, par in enumerate(t.parents) if par == -1) == [3, 5]  # distinct continuations
    assert t.tokens[:3] == [5, 6, 7]
    assert pl.propose([4, 5, 6], [1, 1]).tokens == []  # no match: no draft


def test_different_vocabulary_is_refused_before_decoding(tiny, prompts):
    target, _, tok = tiny
    other, _ = tiny_qwen3(1, vocab_size=300, num_layers=1)
    calls = []
    h = target.register_forward_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match="vocab"):
            speculative_generate(target, other.double(), prompts[0], "strict", k=2, max_new_tokens=4, tokenizer=tok)
    finally:
        h.remove()
    assert calls == []


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"k": -1}, "k: expected an integer >= 0"),
        ({"k": 2.5}, "k: expected an integer >= 0"),
        ({"k": 0, "tree": (2, 2)}, "k: 0 drafts no tree"),
        ({"tree": (0, 3)}, "tree m"),
        ({"tree": (2, 0)}, "tree depth"),
        ({"tree": []}, "tree"),
        ({"tree": [2, 0]}, "tree width"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"input_ids": []}, "prompt is empty"),
        ({"input_ids": [1, 10**6]}, "token ids must lie"),
        ({"criterion": "bogus:1"}, "unknown rule"),
        ({"criterion": "tree:3", "tree": (2, 2)}, "width 3"),
        ({"drafter": 42}, "drafter"),
    ],
)
def test_bad_input_raises_clear_value_error(tiny, kwargs, match):
    target, drafter, _ = tiny
    args = dict(target=target, drafter=drafter, input_ids=[1, 2, 3], criterion="strict", k=2, max_new_tokens=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        speculative_generate(**args)


def test_tree_acceptance_picks_most_probable_passing_child():
    """Synthetic round: root children [3, 5] both pass additive:0.3; 5 is likelier under p -> chosen.
    Below 5 the only child (7) fails, so the target's greedy token there is emitted."""
    from draftcert.decode import DraftTree
    from draftcert.decode.stats import DecodeStats

    V = 10
    t = DraftTree()
    a = t.add(3, -1)
    b = t.add(5, -1)
    t.add(7, b)
    logits = torch.full((4, V), -5.0, dtype=torch.float64)
    logits[0, 3], logits[0, 5], logits[0, 1] = 1.0, 1.2, 1.3  # root: argmax 1, children 3 and 5 close behind
    logits[b + 1, 2] = 4.0  # after 5: greedy 2, child 7 far below
    st = DecodeStats("additive:0.3", 2, [2, 1])
    verdict = round_mod.accept(parse_criterion("additive:0.3"), logits, t, 16)
    assert verdict.path == [b] and verdict.emitted == [5, 2] and verdict.rows == [0, b + 1]
    assert round_mod.certify(parse_criterion("additive:0.3"), verdict, t) is None  # no drafter distribution
    log = round_mod.record(st, t, verdict, None)
    assert log.depth_accepted == [True, False] and log.drift_tokens == 1 and st.drift_tokens == 1
    assert (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, st.num_accepted_tokens_per_pos) == (1, 3, 1, [1, 0])
    p = torch.softmax(logits[0], -1)
    assert st.divergence_spent == pytest.approx(float(torch.log(p[1]) - torch.log(p[5])))
    # strict on the same tree: neither child is the argmax (1) -> emit 1 and stop
    verdict = round_mod.accept(parse_criterion("strict"), logits, t, 16)
    assert verdict.path == [] and verdict.emitted == [1] and verdict.rows == [0]


def test_generic_levelset_criterion(tiny, prompts):
    """A user-defined LevelSet rule works end to end (threshold from the full distribution)."""
    target, drafter, _ = tiny
    rule = LevelSet(lambda p: 0.8 * p.max(-1).values, name="ratio0.8")
    res = speculative_generate(target, drafter, prompts[0], rule, k=3, tree=(2, 2), max_new_tokens=N_NEW)
    logits = _target_logits_along(target, prompts[0], res.tokens)
    assert bool(torch.as_tensor(rule.accepts_tokens(logits=logits, tokens=torch.tensor(res.tokens))).all())
    assert res.stats.criterion == "ratio0.8" and res.stats.checked_positions > 0


def test_tree_certificate_where_the_rule_rejects_the_argmax(tiny, prompts):
    """A rule that rejects every token (tau above max p) accepts nothing, even when the
    drafter is the target itself: the tree-coverage radius must not certify such a node
    (covering the argmax only helps where the rule accepts the argmax)."""
    target, _, _ = tiny
    rule = LevelSet(lambda p: 2.0 * p.max(-1).values, name="reject-all")
    res = speculative_generate(target, target, prompts[0], rule, tree=(2, 2), max_new_tokens=6)
    assert all(not any(r.depth_accepted) for r in res.stats.rounds)
    assert res.stats.certified_positions == 0
    assert res.stats.checked_positions > 0


def test_stats_merge_adds_the_counters(tiny, prompts):
    """bench's rows: the merge of per-prompt statistics counts what the prompts count together."""
    target, drafter, _ = tiny
    runs = [speculative_generate(target, drafter, p, "additive:0.1", k=3, max_new_tokens=N_NEW).stats for p in prompts]
    m = reduce(lambda a, b: a.merge(b), runs)
    assert m.rounds == runs[0].rounds + runs[1].rounds and m.num_rounds == len(m.rounds)
    for name in ("emitted", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "drift_tokens", "checked_positions",
                 "certified_positions", "drafter_forwards", "kl_count"):
        assert getattr(m, name) == getattr(runs[0], name) + getattr(runs[1], name), name
    n = max(len(r.num_accepted_tokens_per_pos) for r in runs)
    pad = lambda a: a + [0] * (n - len(a))  # noqa: E731
    assert m.num_accepted_tokens_per_pos == [a + b for a, b in zip(*(pad(r.num_accepted_tokens_per_pos) for r in runs))]
    assert m.accepted_tokens_histogram == [a + b for a, b in zip(*(r.accepted_tokens_histogram for r in runs))]
    assert m.tokens_per_forward == pytest.approx(m.emitted / (runs[0].target_forwards + runs[1].target_forwards))
    assert m.seconds == runs[0].seconds + runs[1].seconds and m.baseline_seconds is None
    with pytest.raises(ValueError, match="different configurations"):
        runs[0].merge(speculative_generate(target, drafter, prompts[0], "strict", k=3, max_new_tokens=4).stats)


def _noisy(model, scale: float):
    """A drafter: ``model`` with Gaussian noise of ``scale`` added to every weight."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g).to(p.dtype))
    return out


def _certified_rows(monkeypatch):
    """Wrap the one place the engine computes certificates (``round.certify_summary``: a round's
    ``certify`` and the engine's ``CertificateBatch`` both call it): every call's (target logits
    [E, V], drafter logits [E, V], widths, (divergence, radius, certified)) is kept."""
    seen = []
    stage = round_mod.certify_summary

    def spy(rule, sub, q, widths):
        out = stage(rule, sub, q, widths)
        seen.append((sub.source, q, list(widths), out))
        return out

    monkeypatch.setattr(round_mod, "certify_summary", spy)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("spec,tree", [("strict", None), ("additive:0.01", None), ("topm:2", None),
                                       ("additive:0.01", (2, 3)), ("tree:2", None)])
def test_live_certificates_are_the_librarys(target_factory, prompts, monkeypatch, dtype, spec, tree):
    """The engine's live certificate at every expanded node equals ``draftcert.certified`` on the
    same target logits and drafter logits.  For a width-w node where the rule accepts the target's
    argmax the engine's radius is the larger of the rule's and tree:w's, so its flag is the OR of
    the two library certificates (certify_rows is monotone in the radius)."""
    target, _ = target_factory(seed=4, layers=3)
    target.to(dtype)
    seen = _certified_rows(monkeypatch)
    _, rule, _, _ = resolve_criterion(spec, 3, tree)
    checked = 0
    for drafter in [_noisy(target, s) for s in (0.003, 0.01, 0.1)] + [target]:  # KL from ~radius to far above, and 0
        for p in prompts:
            checked += speculative_generate(target, drafter, p, spec, k=3, tree=tree, max_new_tokens=16).stats.checked_positions
    flags, near = [], 0
    assert sum(len(w) for _, _, w, _ in seen) == checked  # every expanded node of every round, once
    for x, q, widths, (divergence, radius, certified) in seen:
        assert x.dtype == dtype  # [E, V] the target's verification logits of the expanded nodes; q: the drafter's
        want = torch.as_tensor(draftcert.certified(rule, target_logits=x, draft_logits=q))
        widths = torch.tensor(widths)
        for m in set(widths.tolist()) - {1}:
            takes_max = torch.as_tensor(rule.accepts_tokens(logits=x, tokens=x.argmax(-1)))
            tree_cert = torch.as_tensor(draftcert.certified(TreeCoverage(m), target_logits=x, draft_logits=q))
            want = want | ((widths == m) & takes_max & tree_cert)
        assert certified == want.tolist()
        flags += certified
        near += sum(r / 2 < d < 2 * r for d, r in zip(divergence, radius))
    assert True in flags and False in flags and near >= 2  # rows on both sides, some close to the radius


def test_stage_seconds_add_up_to_the_rounds_and_name_the_certificates_share(tiny, prompts):
    from draftcert.decode.stats import STAGES, DecodeStats

    target, drafter, _ = tiny
    res = speculative_generate(target, drafter, prompts[0], "strict", k=3, max_new_tokens=N_NEW)
    st = res.stats
    assert len(st.stage_seconds) == len(STAGES) and all(s >= 0 for s in st.stage_seconds)
    assert 0 < sum(st.stage_seconds) <= st.seconds  # the rounds, inside the timed decode
    assert st.stage_seconds[STAGES.index("verify")] > 0 and st.stage_seconds[STAGES.index("propose")] > 0
    summary = st.summary()
    assert summary["stage_seconds"] == dict(zip(STAGES, st.stage_seconds))
    assert summary["certificate_share"] == pytest.approx(st.stage_seconds[STAGES.index("certify")] / sum(st.stage_seconds))
    off = speculative_generate(target, drafter, prompts[0], "strict", k=3, max_new_tokens=N_NEW, certificates=False).stats
    assert off.stage_seconds[STAGES.index("certify")] < 0.01 * sum(off.stage_seconds)  # nothing certified
    merged = st.merge(st)
    assert merged.stage_seconds == [2 * s for s in st.stage_seconds]
    assert DecodeStats("strict", 3, None).certificate_share is None  # nothing timed (a replay's stats)
