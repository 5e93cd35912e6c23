"""The adaptive draft length of ``-k auto`` (decode/draft_shape/adaptive.py) and ``k = 0``: a drafter that is always
wrong falls back to the target's own greedy steps (probing now and then), one that is always right keeps
speculating, and strict stays the greedy decoding whatever the lengths."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from draftcert.decode import greedy_generate, speculative_generate
from draftcert.decode.draft_shape.adaptive import PLAIN_MEASURES, RATIO_CLIP, TIMED_WEIGHT, AdaptiveDraftLength
from draftcert.decode.config import DecodeConfig
from draftcert.decode.draft_shape.costs import Costs
from draftcert.decode.engine import decode_loop
from draftcert.drafting import ModelDrafter, as_drafter
from tests.chain_round import chain_draft

N_NEW = 40


def _costs(draft_share: float = 0.1) -> Costs:
    """A machine where a verification row costs 5 % of a pass and a drafted token ``draft_share`` of one."""
    target = {n: 1.0 + 0.05 * (n - 1) for n in range(1, 9)}
    return Costs("forward-count", target, {n: draft_share for n in range(1, 9)}, target_step=1.0)


class _Scripted:
    """Drafts the target's greedy continuation (``right``) or a token that is never the greedy one."""

    def __init__(self, greedy: list[int], right: bool, vocab: int):
        self.greedy, self.right, self.vocab, self.forwards = greedy, right, vocab, 0
        self.proposed = 0

    def start(self, prompt_ids):
        self.n_prompt = len(prompt_ids)

    def propose(self, seq, widths, expand_all=False):
        self.proposed += 1
        t = len(seq) - self.n_prompt
        greedy = self.greedy[t: t + len(widths)]
        return chain_draft(greedy if self.right else [(g + 1) % self.vocab for g in greedy])

    def accept(self, path):
        pass


def _adaptive_decode(target, prompt, drafter, costs=None):
    factory = lambda: AdaptiveDraftLength(costs or _costs(), (0.5,))  # noqa: E731
    config = DecodeConfig.build(target, "strict", 6, None, N_NEW, draft_length=factory)
    return decode_loop(target, as_drafter(drafter), prompt, config)


def test_an_always_wrong_drafter_falls_back_to_plain_decoding(tiny, prompts):
    target, _, _ = tiny
    prompt = prompts[1]
    ref = greedy_generate(target, prompt, N_NEW)
    wrong = _Scripted(ref, right=False, vocab=target.config.vocab_size)
    out, st = _adaptive_decode(target, prompt, wrong)
    assert out == ref
    plain, drafted = st.draft_lengths[0], sum(st.draft_lengths[1:])
    assert st.num_accepted_tokens == 0 and drafted >= 1  # it tried, and every draft failed
    assert plain >= 0.8 * st.num_rounds, st.draft_lengths  # then the target's own steps, probing now and then
    assert wrong.proposed == drafted  # a plain round asks the drafter for nothing
    assert st.adaptive and st.summary()["rounds_by_draft_length"] == st.draft_lengths


def test_an_always_right_drafter_keeps_speculating(tiny, prompts):
    target, _, _ = tiny
    prompt = prompts[0]
    ref = greedy_generate(target, prompt, N_NEW)
    out, st = _adaptive_decode(target, prompt, _Scripted(ref, right=True, vocab=target.config.vocab_size))
    assert out == ref
    assert st.draft_lengths[0] == 0  # never plain
    assert max(range(len(st.draft_lengths)), key=st.draft_lengths.__getitem__) == 6  # mostly the longest chain
    assert st.tokens_per_forward > 4


def test_costly_drafts_are_not_worth_it_even_when_right(tiny, prompts):
    """A drafter as slow as the target: speculating loses even at acceptance 1, so no round drafts
    but the probes."""
    target, _, _ = tiny
    prompt = prompts[0]
    ref = greedy_generate(target, prompt, N_NEW)
    drafter = _Scripted(ref, right=True, vocab=target.config.vocab_size)
    out, st = _adaptive_decode(target, prompt, drafter, costs=_costs(draft_share=1.5))
    assert out == ref and st.draft_lengths[0] >= 0.8 * st.num_rounds


def test_the_controller_follows_the_evidence():
    lengths = AdaptiveDraftLength(_costs(), (0.6,), probe_every=3)
    first = lengths.next_k()
    assert first >= 1  # a 0.6 prior pays at these costs
    for _ in range(6):
        lengths.observe([False])
    a = lengths.acceptance()
    assert a[0] == pytest.approx(0.6 * 2 / 8) and a[1] == pytest.approx(a[0])  # depth 2 unseen: depth 1's estimate
    picks = [lengths.next_k() for _ in range(8)]
    assert picks[:3] == [0, 0, 0] and picks[3] >= 1 and picks[4:7] == [0, 0, 0]  # a probe after 3 plain rounds
    for _ in range(40):
        lengths.observe([True] * 6)
    assert lengths.next_k() == 6


@pytest.mark.parametrize("spec", ["strict", "additive:0.1"])
def test_k_zero_is_the_targets_own_decoding(tiny, prompts, spec):
    target, drafter, _ = tiny
    res = speculative_generate(target, drafter, prompts[0], spec, k=0, max_new_tokens=N_NEW)
    assert res.tokens == greedy_generate(target, prompts[0], N_NEW)  # nothing drafted: any rule is greedy
    st = res.stats
    assert st.num_drafts == 0 and st.drafter_forwards == 0 and st.num_rounds == N_NEW == st.draft_lengths[0]


def test_bad_controller_settings_are_refused():
    with pytest.raises(ValueError, match="probabilities"):
        AdaptiveDraftLength(_costs(), (1.5,))
    with pytest.raises(ValueError, match="max_k"):
        AdaptiveDraftLength(_costs(), (0.5,), max_k=0)


def _run_rounds(ctl: AdaptiveDraftLength, rounds: int, seconds_of, accepted: bool = True) -> list[int]:
    """The lengths ``ctl`` picks over ``rounds`` rounds whose cost is ``seconds_of(k)`` and whose drafts
    are all accepted (or all rejected)."""
    ks = []
    for _ in range(rounds):
        k = ctl.next_k()
        ks.append(k)
        ctl.observe([accepted] * k)
        ctl.observe_seconds(k, seconds_of(k))
    return ks


def test_timed_rounds_overrule_a_prediction_that_drafting_pays():
    """The calibrated costs say a drafted token costs 0.1 of a pass; on this decode it costs 0.9.  A
    drafter right at depth 1 every other round is then slower than the target alone: the timed
    controller finds it out, the untimed one keeps trusting the prediction."""
    truth = lambda k: 1.0 + 0.05 * k + 0.9 * k  # noqa: E731  (the target alone: 1.0)
    for timed, want_plain in ((True, True), (False, False)):
        ctl = AdaptiveDraftLength(_costs(0.1), (0.5,), timed=timed)
        ks = []
        for i in range(80):
            k = ctl.next_k()
            ks.append(k)
            ctl.observe([i % 2 == 0] + [False] * (k - 1) if k else [])
            ctl.observe_seconds(k, truth(k))
        plain = ks[-30:].count(0)
        assert (plain >= 27 if want_plain else plain == 0), (timed, ks)


def test_timed_rounds_keep_drafting_where_it_does_pay():
    """Rounds that cost what was predicted change nothing: an always-right drafter keeps drafting, and
    the plain rounds that measure the target alone come once, after the first timed draft."""
    ctl = AdaptiveDraftLength(_costs(0.1), (0.5,), timed=True)
    ks = _run_rounds(ctl, 40, lambda k: 1.0 + 0.05 * k + 0.1 * k)
    assert ks[0] >= 1 and ks[1] >= 1  # round 1 holds the prefill: not timed, so no plain round yet
    assert ks.count(0) == PLAIN_MEASURES and ks[2:2 + PLAIN_MEASURES] == [0] * PLAIN_MEASURES
    assert min(ks[2 + PLAIN_MEASURES:]) >= 3
    assert ctl.timed_n[0] == PLAIN_MEASURES and sum(ctl.timed_n) == 39  # the prefill's round is not a cost


def test_a_stretched_round_moves_the_estimate_by_a_bounded_amount():
    ctl = AdaptiveDraftLength(_costs(0.1), (0.5,), timed=True)
    ctl.observe_seconds(2, 1.0)  # the prefill's round: skipped
    before = ctl.round_seconds()
    ctl.observe_seconds(2, 1000.0)  # a page fault, another process: clipped to RATIO_CLIP
    after = ctl.round_seconds()
    assert after[2] == pytest.approx(before[2] * (TIMED_WEIGHT * 3.0 + 3.0) / (TIMED_WEIGHT + 1))
    assert after[2] <= before[2] * RATIO_CLIP


def test_only_strict_is_steered_by_its_timing(tiny):
    """Relaxed rules keep the predicted costs: their tokens depend on the draft lengths, and a decode
    steered by timing could not be repeated."""
    from draftcert.decode.engine import auto_draft

    target, tok, _ = tiny
    seen = {}
    for crit in ("strict", "relaxed:2:0.1", "typical:0.09:0.3"):
        _, _, _, factory, line = auto_draft(target, "prompt-lookup", tok, crit, None)
        seen[crit] = factory().timed
    assert seen == {"strict": True, "relaxed:2:0.1": False, "typical:0.09:0.3": False}


def test_a_drafter_object_made_from_a_spec_is_priced_as_its_spec(tiny):
    """make_drafter's object remembers its spec: -k auto reads the same shipped acceptance and cost
    curve for it as for the string (a user builds a drafter once and decodes with it often)."""
    from draftcert.decode.engine import auto_draft
    from draftcert.drafting import make_drafter

    target, tok, _ = tiny
    made = make_drafter("pld:3")
    assert made.spec == "prompt-lookup:3"
    auto_draft(target, "prompt-lookup:3", tok, "strict", None)  # measured once, then cached under the spec
    by_string = auto_draft(target, "prompt-lookup:3", tok, "strict", None)[4]
    assert "cached at" in by_string and auto_draft(target, made, tok, "strict", None)[4] == by_string


def test_rejected_probes_back_off_and_an_accepted_one_resets_the_wait():
    from draftcert.decode.draft_shape.adaptive import MAX_PROBE_GAP

    lengths = AdaptiveDraftLength(_costs(), (0.05,), probe_every=4)
    gaps = []
    for _ in range(6):  # plain rounds until a probe (one drafted token); the probe rejected
        n = 0
        while (k := lengths.next_k()) == 0:
            n += 1
        gaps.append(n)
        assert lengths.probing and k == 1
        lengths.observe([False])
    assert gaps == [4, 8, 16, 32, 64, 128] and lengths.probe_gap == MAX_PROBE_GAP
    n = 0
    while lengths.next_k() == 0:
        n += 1
    assert n == MAX_PROBE_GAP  # capped
    lengths.observe([True])  # an accepted probe: back to probe_every
    assert lengths.probe_gap == 4


def test_a_probe_after_a_plain_run_is_not_timed():
    """A probe's drafter catches up on every token of the plain run before it: its round is no measure of
    a drafting round's cost, so a slow probe must not make drafting look dear (it is not timed)."""
    from draftcert.decode.draft_shape.adaptive import UNTIMED_AFTER_PLAIN

    lengths = AdaptiveDraftLength(_costs(), (0.05,), probe_every=8, timed=True)
    lengths.observe_seconds(0, 5.0)  # the prefill's round: never timed
    plain = 0
    while (k := lengths.next_k()) == 0:
        lengths.observe_seconds(0, 1.0)
        plain += 1
    assert lengths.probing and plain > UNTIMED_AFTER_PLAIN
    before = lengths.round_seconds()
    lengths.observe([True])
    lengths.observe_seconds(k, 10 * before[k])  # a probe ten times dearer than its prediction
    assert lengths.timed_n[k] == 0 and lengths.round_seconds()[k] == pytest.approx(before[k])
    # steady drafting rounds are timed again
    lengths.prior = 0.95
    for _ in range(3):
        k = lengths.next_k()
        lengths.observe([True] * k)
        lengths.observe_seconds(k, before[k] if k else 1.0)
    assert sum(lengths.timed_n[1:]) >= 1


def test_the_first_drafting_round_is_not_timed():
    """Its drafter catches up on the whole prompt first (a feature drafter has no features before the
    prefill, so it drafts only in the second round): that round says nothing of a drafting round's cost."""
    lengths = AdaptiveDraftLength(_costs(), (0.9,), timed=True)
    predicted = lengths.round_seconds()
    for k, seconds in ((0, 5.0), (2, 10 * predicted[2])):  # the prefill's round drafted nothing; then a dear first draft
        lengths.next_k()
        lengths.observe([True] * k)
        lengths.observe_seconds(k, seconds)
    assert sum(lengths.timed_n) == 0 and lengths.round_seconds() == pytest.approx(predicted)
    lengths.next_k()
    lengths.observe([True, True])
    lengths.observe_seconds(2, 2 * predicted[2])  # the next drafting round is timed
    assert lengths.timed_n[2] == 1 and lengths.round_seconds()[2] > predicted[2]



# ---------------------------------------------------------------------------
# the chain's length from the drafter's confidence (AdaptiveDraftLength.keep_drafting)


def _pays(ctl: AdaptiveDraftLength, pis) -> bool:
    """The module docstring's inequality, written out: R_d a_1 / (s(d+1) - s(d)) > E_d / s(d)."""
    s, a1, d = ctl.round_seconds(), ctl.acceptance()[0], len(pis)
    reach = [math.prod(pis[: j + 1]) for j in range(d)]
    return reach[-1] * a1 / (s[d + 1] - s[d]) > (1 + sum(reach)) / s[d]


def test_keep_drafting_is_the_marginal_rate_rule():
    ctl = AdaptiveDraftLength(_costs(0.3), (0.7,))
    ctl.next_k()
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        d = int(torch.randint(1, 6, (1,), generator=g))
        pis = torch.rand(d, generator=g, dtype=torch.float64).tolist()
        assert ctl.keep_drafting(pis) == _pays(ctl, pis), pis
    cheap = AdaptiveDraftLength(_costs(0.05), (0.9,))
    cheap.next_k()
    assert cheap.keep_drafting([0.99] * 5) and not cheap.keep_drafting([0.99] * 6)  # max_k = 6 depths at most
    assert not ctl.keep_drafting([0.99] * 5)  # drafts at 0.3 of a pass: depth 6 no longer pays
    assert not ctl.keep_drafting([0.05])  # an unsure first token: the round stops there
    # an unsure drafter stops sooner: fewer depths for lower probabilities, never more
    for p in (0.3, 0.5, 0.7, 0.9):
        depth = next(d for d in range(1, 7) if not ctl.keep_drafting([p] * d))
        assert depth <= next(d for d in range(1, 7) if not ctl.keep_drafting([min(1.0, p + 0.09)] * d))


def test_keep_drafting_follows_this_decodes_acceptance():
    ctl = AdaptiveDraftLength(_costs(0.3), (0.7,))
    ctl.next_k()
    assert ctl.keep_drafting([0.9])
    for _ in range(30):
        ctl.observe([False])
    ctl.next_k()
    assert not ctl.keep_drafting([0.9])  # depth 1 fails in this decode: a confident drafter is not believed


class _Spy(AdaptiveDraftLength):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.asked = []

    def keep_drafting(self, pis):
        ok = super().keep_drafting(pis)
        self.asked.append((tuple(pis), ok))
        return ok


def test_a_model_drafters_chains_stop_on_its_confidence_and_strict_stays_greedy(tiny, prompts):
    target, drafter_model, _ = tiny
    prompt = prompts[1]
    ref = greedy_generate(target, prompt, N_NEW)
    spies = []

    def factory():
        spies.append(_Spy(_costs(0.2), (0.6,)))
        return spies[-1]

    sharp = copy.deepcopy(drafter_model)  # the same greedy tokens, confident ones: logits x 8
    sharp.lm_head.register_forward_hook(lambda module, inputs, out: out * 8)
    drafter = ModelDrafter(sharp)
    config = DecodeConfig.build(target, "strict", 6, None, N_NEW, draft_length=factory)
    out, st = decode_loop(target, drafter, prompt, config)
    assert out == ref
    asked = spies[0].asked
    assert asked and any(ok for _, ok in asked) and any(not ok for _, ok in asked)  # it went on, and it stopped
    drafted = [n for n in st.draft_lengths[1:]]
    assert sum(1 for n in drafted if n) >= 2, st.draft_lengths  # chains of several lengths, not one fixed k


class _Pattern:
    """A draft-length controller that plays a fixed pattern of k (0: a plain round)."""

    timed = False

    def __init__(self, ks):
        self.ks, self.i = list(ks), 0

    def next_k(self):
        k = self.ks[self.i % len(self.ks)]
        self.i += 1
        return k

    def observe(self, depth_accepted):
        pass

    def keep_drafting(self, pis):
        return True


def test_plain_rounds_hand_a_feature_drafter_every_feature_in_order(tiny, prompts):
    """Plain rounds keep the target's features back and hand them over when the drafter next drafts:
    the drafter then holds exactly the target's features of the sequence, in order."""
    from draftcert.drafting.feature_drafter import FeatureDrafter
    from draftcert.models.eagle import EagleDrafter
    from draftcert.models.hf import forward_with_hidden, new_cache

    target, _, _ = tiny
    prompt = prompts[0]
    eagle = EagleDrafter(target, torch.arange(target.config.vocab_size)).to(torch.float64).eval()
    drafter = FeatureDrafter(eagle)
    config = DecodeConfig.build(target, "strict", 3, None, N_NEW, draft_length=lambda: _Pattern([0, 0, 0, 2, 0, 1]))
    out, st = decode_loop(target, drafter, prompt, config)
    assert out == greedy_generate(target, prompt, N_NEW)
    assert st.draft_lengths[0] > 0 and sum(st.draft_lengths[1:]) > 0
    seq = prompt + out
    n = drafter.n_feat
    assert n >= len(seq) - 8  # handed over up to the last drafting round (at most 3 plain rounds and a chain after it)
    with torch.inference_mode():
        _, want = forward_with_hidden(target, new_cache(target), seq[:n], 1)
    torch.testing.assert_close(drafter.feats[:n], want.to(drafter.feats.dtype), rtol=1e-9, atol=1e-9)


class _RightSuffix:
    """A suffix index whose chain is always the target's greedy continuation, up to ``limit`` tokens."""

    def __init__(self, greedy: list[int], length: int = 4):
        self.greedy, self.length = greedy, length

    def start(self, prompt_ids):
        self.n_prompt = len(prompt_ids)

    def draft(self, seq, widths, expand_all=False, limit=None):
        t = len(seq) - self.n_prompt
        return chain_draft(self.greedy[t: t + min(self.length, limit or self.length)])


@pytest.mark.parametrize("grafts", [True, False])
def test_plain_rounds_of_a_hybrid_verify_its_priced_suffix_chain(tiny, prompts, grafts):
    """A hybrid whose model is always wrong: -k auto stops asking the model, and its plain rounds still
    verify the suffix chain (right here), so most tokens come from copies; without that, only the rounds
    that ask the model graft anything."""
    from draftcert.drafting.suffix import HybridDrafter

    target, _, _ = tiny
    prompt = prompts[1]
    ref = greedy_generate(target, prompt, N_NEW)
    wrong = _Scripted(ref, right=False, vocab=target.config.vocab_size)
    hybrid = HybridDrafter(as_drafter(wrong), suffix=_RightSuffix(ref))
    hybrid.grafts_in_plain_rounds = grafts
    factory = lambda: AdaptiveDraftLength(_costs(draft_share=1.5), (0.5,))  # noqa: E731  the model never pays
    config = DecodeConfig.build(target, "strict", 6, None, N_NEW, draft_length=factory)
    out, st = decode_loop(target, hybrid, prompt, config)
    assert out == ref
    asked = wrong.proposed  # rounds that asked the model (probes)
    assert asked <= 0.3 * st.num_rounds
    if grafts:
        assert hybrid.suffix_accepted >= 0.6 * N_NEW and st.tokens_per_forward > 2.5
    else:
        assert hybrid.suffix_drafted <= 4 * asked and st.tokens_per_forward < 1.6


def test_a_counted_untimed_round_keeps_the_next_catch_up_untimed():
    """A plain round's grafts are observed as ``observe_seconds(0, 0.0)``: no timing, but a round without the
    model drafting, so a drafting round after more than UNTIMED_AFTER_PLAIN of them (its drafter catches up
    on them) is not timed either."""
    from draftcert.decode.draft_shape.adaptive import UNTIMED_AFTER_PLAIN

    ctl = AdaptiveDraftLength(_costs(), (0.5,), timed=True)
    ctl.observe_seconds(0, 1.0)  # the prefill's round: skipped
    ctl.observe_seconds(1, 1.1)  # a drafting round after the prompt's catch-up: untimed
    ctl.observe_seconds(1, 1.1)  # timed
    assert ctl.timed_n[1] == 1
    for _ in range(UNTIMED_AFTER_PLAIN + 1):
        ctl.observe_seconds(0, 0.0)
    assert ctl.timed_n[0] == 0  # counted, not timed
    ctl.observe_seconds(1, 5.0)  # catches up on them: untimed
    assert ctl.timed_n[1] == 1


# ---------------------------------------------------------------------------
# a model drafter's catch-up (AdaptiveDraftLength.set_budget, Costs.drafter_catch_up)


def _catch_up_gain(ctl: AdaptiveDraftLength, remaining: int) -> float:
    """What drafting saves over ``remaining`` tokens at the best predicted rate: the rule's left side."""
    rates = ctl.rates()
    return remaining * (1.0 / rates[0] - 1.0 / max(rates[1:]))


def test_a_catch_up_dearer_than_what_drafting_saves_keeps_the_round_plain():
    """remaining * (1/rate(0) - 1/rate(k)) > behind * catch_up decides, on either side of the boundary;
    a round's own catch-up (costs.ROUND_CATCH_UP tokens) is not counted twice."""
    from draftcert.decode.draft_shape.costs import ROUND_CATCH_UP

    ctl = AdaptiveDraftLength(_costs(), (0.6,), catch_up=0.01)
    gain = _catch_up_gain(ctl, 64)
    assert gain > 0 and ctl.next_k() >= 1  # no budget given: the rule is off
    for behind, drafts in ((gain / 0.01 * 0.99, True), (gain / 0.01 * 1.01, False)):
        ctl = AdaptiveDraftLength(_costs(), (0.6,), catch_up=0.01)
        ctl.set_budget(64, int(behind) + ROUND_CATCH_UP)
        assert (ctl.next_k() >= 1) == drafts, behind
        assert ctl.declined == (0 if drafts else 1)
    ctl = AdaptiveDraftLength(_costs(), (0.6,), catch_up=0.01)
    ctl.set_budget(64, ROUND_CATCH_UP)  # only what a drafting round catches up on anyway
    assert ctl.next_k() >= 1
    ctl = AdaptiveDraftLength(_costs(), (0.6,))  # no catch-up cost (a feature drafter): any prompt length
    ctl.set_budget(1, 10**6)
    assert ctl.next_k() >= 1
    with pytest.raises(ValueError, match="catch_up"):
        AdaptiveDraftLength(_costs(), (0.6,), catch_up=-1.0)


def test_the_catch_up_cost_comes_from_the_cost_curve():
    c = _costs()
    c.drafter_catch_up = 0.25
    assert AdaptiveDraftLength(c, (0.6,)).catch_up == 0.25
    assert AdaptiveDraftLength(_costs(), (0.6,)).catch_up == 0.0


def test_no_probe_where_even_the_shipped_acceptance_could_not_pay_the_catch_up():
    """A plain run's probe first catches the drafter up on the run: near the end of a decode, or far
    behind, it cannot pay even if the drafter turns out as good as shipped, so it is not made."""
    probes = {}
    for catch_up in (0.0, 0.5):  # 0.5: a token of catch-up costs half a target step (_costs: 1 s)
        ctl = AdaptiveDraftLength(_costs(), (0.6,), probe_every=4, catch_up=catch_up)
        for _ in range(8):
            ctl.observe([False])  # the evidence: depth 1 fails, plain is best
        ks = []
        for i in range(30):
            ctl.set_budget(30 - i, 40 + i)  # 40 tokens behind and growing, the budget shrinking
            k = ctl.next_k()
            ks.append(k)
            if k:
                ctl.observe([False])
        probes[catch_up] = sum(1 for k in ks if k)
    assert probes[0.0] >= 2 and probes[0.5] == 0 and ctl.declined >= 20, probes


def test_a_long_prompt_before_a_short_answer_is_left_to_the_target():
    """The first round: the drafter is a whole prompt behind.  A long prompt's catch-up is more than
    a short answer's drafting saves (plain), not more than a long answer's (drafting), and a short
    prompt's is paid at once."""
    picks = {}
    for prompt, remaining in ((2000, 64), (2000, 4000), (20, 64)):
        ctl = AdaptiveDraftLength(_costs(0.1), (0.8,), timed=True, catch_up=0.02)
        ctl.set_budget(remaining, prompt)
        picks[prompt, remaining] = ctl.next_k()
    assert picks[2000, 64] == 0 and picks[2000, 4000] >= 1 and picks[20, 64] >= 1, picks


def test_a_model_drafter_too_far_behind_leaves_the_decode_to_the_target(tiny, prompts):
    """Engine end to end: with a catch-up priced far above what drafting saves, the model drafter is
    never run and the output is the greedy one; priced at nothing, it drafts."""
    target, drafter, _ = tiny
    prompt = prompts[1]
    ref = greedy_generate(target, prompt, N_NEW)
    for catch_up, drafted in ((10.0, False), (0.0, True)):
        model = ModelDrafter(drafter)
        factory = lambda: AdaptiveDraftLength(_costs(), (0.9,), catch_up=catch_up)  # noqa: E731
        config = DecodeConfig.build(target, "strict", 6, None, N_NEW, draft_length=factory)
        out, st = decode_loop(target, model, prompt, config)
        assert out == ref
        assert (model.forwards > 0) == drafted and (st.num_drafts > 0) == drafted, (catch_up, st.draft_lengths)
        assert (st.catch_up_plain == st.num_rounds) != drafted and st.summary()["rounds_plain_for_catch_up"] == st.catch_up_plain


def test_decode_says_when_a_drafters_catch_up_kept_its_rounds_plain(ckpt, monkeypatch, capsys):
    """``draftcert decode``: a catch-up priced far above what drafting saves keeps every round plain,
    and the summary line and ``--json`` say so."""
    from draftcert.cli import main
    from draftcert.decode.draft_shape import shape as shape_mod

    measured = shape_mod.engine_costs

    def dear(*args, **kwargs):
        costs, source = measured(*args, **kwargs)
        costs.target = {n: costs.target[1] for n in costs.target}  # rows and drafting free: drafting would pay ...
        costs.drafter_round = {key: 1e-9 for key in costs.drafter_round}
        costs.drafter_catch_up = 10.0  # ... but for its catch-up, seconds a token: no decode of 8 tokens pays for it
        return costs, source

    monkeypatch.setattr(shape_mod, "engine_costs", dear)
    base = ["decode", "--target", ckpt, "--drafter", "self:skip=1", "--prompt", "hello", "--max-new-tokens", "8",
            "--no-progress"]
    assert main(base) == 0
    assert "8 rounds plain where the drafter's run over tokens it had not seen" in capsys.readouterr().err
    assert main(base + ["--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]
    assert summary["rounds_plain_for_catch_up"] == 8 and summary["num_drafts"] == 0
