"""``-k auto`` during a decode: each round's draft length, plain decoding included, from the acceptance seen so far.

Before a round the controller picks ``k`` in ``0..max_k`` (``k = 0``: no draft, the target's own
greedy step) with the highest predicted tokens/s on this machine::

    rate(0) = 1 / target_step                      (the target alone; decode/costs.py)
    rate(k) = E_k / round_seconds(k),   E_k = 1 + sum_{d=1..k} prod_{i<=d} a_i

where ``a_d`` is the probability that the drafter's depth-d token is accepted given depths < d
were (``shape.expected_tokens``' chain case), and ``round_seconds`` is the cost model the static
choice and the replay use.  ``a_d`` is a Beta posterior mean: a prior counted as ``prior_weight``
rounds, plus every attempt at depth d this decode has seen (a round's ``RoundLog.depth_accepted``)::

    a_d = (prior_d * prior_weight + accepted_d) / (prior_weight + attempted_d)
    prior_1 = the drafter's shipped acceptance at depth 1 (``shape.acceptance_of``),  prior_d = a_{d-1}

**The chain's length from the drafter's confidence** (``keep_drafting``).  Where the drafter gives a
distribution (a model or feature drafter, alone or in a hybrid), a round that drafts does not stop
at the chosen k: the chain grows while one more depth pays.  After depth d the drafter's own
probabilities of its greedy tokens, pi_1..pi_d (``drafting.tree_growth``), give the chance that the
chain so far is accepted whole, R_d = prod_{j<=d} pi_j, and the round's expected tokens,
E_d = 1 + sum_{j<=d} R_j.  Depth d + 1 adds about R_d * a_1 tokens (a_1: the acceptance at depth 1,
the one estimate no confidence stop biases) for s(d + 1) - s(d) seconds (one drafter step and one
verification row: ``round_seconds``); it is drafted while that marginal rate beats the round's own::

    R_d * a_1 / (s(d + 1) - s(d))  >  E_d / s(d)                       (up to max_k)

so a confident drafter drafts deep and an unsure one stops after a token or two, before the drafter
step it would throw away.  No threshold is fitted: the costs are this machine's and a_1 is this
decode's.  Drafters without a distribution (suffix, prompt lookup, a user's) draft the chosen k.

A depth's prior is the estimate of the depth above it: depths a decode has not attempted yet follow
what it has seen (a drafter that has been right at every depth so far is tried deeper; one that
fails at depth 1 is not), where a fixed per-depth prior would never move them.

A prompt whose drafts are mostly rejected drives ``a_1`` down until ``k = 0`` wins; a decode in
plain mode sees no attempts, so after ``probe_every`` plain rounds one round drafts a single token
(a probe: what lets a decode that turns predictable speculate again; one token because depth 1 is what
it tests, and a longer chain that fails at depth 1 costs its drafting steps and verification rows for
nothing; a drafter with a distribution goes deeper only where ``keep_drafting`` says so).  A probe whose
first draft is rejected doubles the plain rounds before the next one, up to ``MAX_PROBE_GAP``; an
accepted probe, or a round that drafts because the rates say so, sets the wait back to
``probe_every``.  On text the drafter cannot follow, the probes' share of the rounds then falls from
1/16 to about 1/128.
Relaxed rules accept more than strict: the posterior learns it.

**A drafter that must first catch up** (``catch_up``: a separate model's seconds per token it has not
seen, timed with the cost curve, ``Costs.drafter_catch_up``; 0 for drafters that read the target's
features).  A model drafter has not seen the prompt when a decode starts, nor the tokens of a plain
run when it probes: its next drafting round first runs it over those ``behind`` tokens, a prefill that
can cost more than speculation then saves.  Before each round the engine says how many new tokens
are left (``remaining``) and how far behind the drafter is (``set_budget``); a drafting round (or a
probe) is chosen only where the speed-up it predicts pays for the catch-up within the decode::

    remaining * (1 / rate(0) - 1 / rate(k))  >  behind * catch_up

with ``rate(k)`` the best drafting rate (a probe: the best under the prior acceptance, the drafter as
good as shipped), else the round is plain.  A short answer after a long prompt is then decoded by
the target alone, and a plain run near the end of a decode is not probed.  The first round decides
on the calibrated costs: measuring the target alone first (plain rounds before the first draft)
lost more on prompts where drafting pays than it saved where it does not.

**Model-free nodes priced by their rows** (``keep_grafting``).  A hybrid drafter's suffix chain
(``drafting.suffix.HybridDrafter``) may run far deeper than the model's chain (a 16-token match
copied from the prompt), and every node it adds is one more verification row.  Before adding a node
that the drafter expects to be reached and accepted with probability ``reach`` (its graft acceptance
to the node's depth), it asks whether that node's marginal rate beats the best predicted rate::

    reach / (T(rows + 1) - T(rows))  >  max_k rate(k)

with T the cost curve's verification of ``rows`` causal rows (the timed rounds' drift applied), so a
match that keeps being accepted drafts deep and one that fails is cut to the rows it pays for.  A
plain round (k = 0) prices the same chain, hung from the root with the model drafter idle
(``grafts_in_plain_rounds``): a copy from the prompt needs no drafter step, so a prompt whose model
drafts do not pay still gets its copies.  Such a round's outcome says nothing of the model drafter's
acceptance, and it counts as a round without a draft but is not timed as a plain step.

**Timed rounds** (``timed=True``; the engine sets it for strict, whose tokens do not depend on the
draft lengths).  The calibrated ``round_seconds`` is a prediction made once per machine, under
whatever load the machine had then; a decode also times its own rounds (``observe_seconds``)::

    seconds(k) = predicted(k) * r_k,   r_k = (W_k * r + sum of measured/predicted over k's rounds) / (W_k + n_k)

where ``n_k`` is the number of timed rounds of length k and ``r`` the mean measured/predicted ratio
of the drafting rounds (for k >= 1) or of every round (for k = 0), 1 before any: a length not run
yet follows the others' drift, one that has run converges to what it costs in this decode.  The
first timed drafting round is followed by ``PLAIN_MEASURES`` plain rounds (``k = 0``), so that the
target alone's step is measured, not only predicted; its prior weighs less (``W_0 = PLAIN_WEIGHT``
against ``W_k = TIMED_WEIGHT``) because a drafting round's drift (a drafter that costs more than
calibrated) says little about a plain round.  A drafting round after more than
``UNTIMED_AFTER_PLAIN`` rounds without a draft (a probe, the decode's first drafting round) is not
timed: its drafter first catches up on every token it has not seen (the whole prompt, the first
time), a cost that steady drafting does not pay.  Ratios are clipped to
``[1/RATIO_CLIP, RATIO_CLIP]`` (a round that a page fault or another process stretched says little about the next).  Relaxed rules keep
the predicted costs: their tokens depend on the draft lengths, and a decode that timing steered
could not be repeated.
"""

from __future__ import annotations

from .costs import ROUND_CATCH_UP, Costs, round_key, round_seconds

__all__ = ["AdaptiveDraftLength", "PRIOR_WEIGHT", "PROBE_EVERY", "MAX_PROBE_GAP", "MAX_K", "TIMED_WEIGHT"]

PRIOR_WEIGHT = 2.0  # a depth's prior counts as this many observed rounds
PROBE_EVERY = 16  # plain rounds before a probing draft ...
MAX_PROBE_GAP = 128  # ... doubled after each rejected probe, up to this
MAX_K = 6
TIMED_WEIGHT = 1.0  # a drafting length's predicted seconds count as this many timed rounds
PLAIN_WEIGHT = 0.5  # ... and the target alone's
PLAIN_MEASURES = 2  # plain rounds that measure the target alone, after the first timed drafting round
RATIO_CLIP = 3.0
UNTIMED_AFTER_PLAIN = 3  # a drafting round after more plain rounds than this is not timed (its catch-up)


class AdaptiveDraftLength:
    """The draft length of each round (module docstring); one instance per decode."""

    def __init__(self, costs: Costs, prior: tuple[float, ...], *, max_k: int = MAX_K,
                 prior_weight: float = PRIOR_WEIGHT, probe_every: int = PROBE_EVERY, timed: bool = False,
                 catch_up: float | None = None):
        if not prior or any(not 0.0 <= a <= 1.0 for a in prior):
            raise ValueError(f"adaptive draft length: prior acceptance must be probabilities, got {prior!r}")
        if max_k < 1 or prior_weight <= 0 or probe_every < 1:
            raise ValueError("adaptive draft length: need max_k >= 1, prior_weight > 0 and probe_every >= 1")
        self.costs, self.max_k, self.prior_weight, self.probe_every = costs, max_k, prior_weight, probe_every
        self.prior = prior[0]  # depth 1's; deeper depths take the estimate of the depth above
        self.accepted = [0] * max_k
        self.attempted = [0] * max_k
        self.plain_run = 0  # plain rounds since the last draft
        self.probe_gap = probe_every  # plain rounds before the next probe
        self.probing = False  # the round just chosen is a probe
        # the predicted seconds of a round of each length; plain: the target alone's step
        self.seconds = [costs.target_step or round_seconds(costs, 0, [], False, "")]
        self.seconds += [round_seconds(costs, k, [1] * k, False, round_key((1,) * k, False)) for k in range(1, max_k + 1)]
        self.timed = timed
        # seconds per token a drafter catching up on tokens it has not seen spends (module docstring)
        self.catch_up = float(costs.drafter_catch_up or 0.0) if catch_up is None else float(catch_up)
        if not self.catch_up >= 0.0:
            raise ValueError(f"adaptive draft length: catch_up must be seconds >= 0, got {catch_up!r}")
        self.remaining, self.behind = None, 0  # set_budget's, for the next round
        self.declined = 0  # drafting rounds and probes the catch-up rule turned into plain rounds
        self._round_seconds, self._a1 = list(self.seconds), self.prior  # keep_drafting's, set by rates()
        self._best_rate, self._drift = 1.0 / self.seconds[0], 1.0  # keep_grafting's, set by rates()
        self.ratio_sum = [0.0] * (max_k + 1)  # measured / predicted seconds, summed per draft length
        self.timed_n = [0] * (max_k + 1)
        self.rounds_seen = 0  # observe_seconds calls, the prefill's included
        self.plain_measures = 0  # plain rounds run to measure the target alone (PLAIN_MEASURES)
        # rounds without a draft since the last one that drafted; "more than UNTIMED_AFTER_PLAIN" at the
        # start: the first drafting round catches its drafter up on the whole prompt
        self.plain_since_draft = UNTIMED_AFTER_PLAIN + 1

    def observe_seconds(self, k: int, seconds: float) -> None:
        """A round of ``k`` drafted tokens took ``seconds`` (wall clock, drafting to acceptance); the
        first call (the round holding the prefill) is not a round's cost and is skipped, and so is a
        drafting round whose drafter first caught up on more than ``UNTIMED_AFTER_PLAIN`` rounds'
        tokens (the first drafting round, a probe).  ``seconds`` 0: a round counted, not timed (a plain
        round's suffix grafts: the model drafter idle, so the next drafting round catches up on it)."""
        self.rounds_seen += 1
        caught_up = k > 0 and self.plain_since_draft > UNTIMED_AFTER_PLAIN
        self.plain_since_draft = 0 if k > 0 else self.plain_since_draft + 1
        if self.rounds_seen == 1 or caught_up or not 0 <= k <= self.max_k or not seconds > 0:
            return
        r = min(max(seconds / self.seconds[k], 1.0 / RATIO_CLIP), RATIO_CLIP)
        self.ratio_sum[k] += r
        self.timed_n[k] += 1

    def round_seconds(self) -> list[float]:
        """Seconds of a round of k = 0..max_k drafted tokens: predicted, corrected by the timed rounds
        (module docstring; the prediction itself where ``timed`` is off)."""
        if not self.timed:
            return list(self.seconds)
        n, n_draft = sum(self.timed_n), sum(self.timed_n[1:])
        drift_all = sum(self.ratio_sum) / n if n else 1.0
        drift = sum(self.ratio_sum[1:]) / n_draft if n_draft else drift_all
        out = []
        for k, (s, rs, nk) in enumerate(zip(self.seconds, self.ratio_sum, self.timed_n)):
            w, r = (PLAIN_WEIGHT, drift_all) if k == 0 else (TIMED_WEIGHT, drift)
            out.append(s * (w * r + rs) / (w + nk))
        return out

    def acceptance(self) -> list[float]:
        """a_d for d = 1..max_k, the posterior means (module docstring)."""
        w, out, prior = self.prior_weight, [], self.prior
        for a, n in zip(self.accepted, self.attempted):
            prior = (prior * w + a) / (w + n)
            out.append(prior)
        return out

    def rates(self) -> list[float]:
        """Predicted tokens/s of k = 0..max_k (the round seconds and a_1 are kept for ``keep_drafting``)."""
        seconds = self.round_seconds()
        acceptance = self.acceptance()
        self._round_seconds, self._a1 = seconds, acceptance[0]
        out = self._rates_of(seconds, acceptance)
        self._best_rate = max(out)  # keep_grafting's
        self._drift = seconds[1] / self.seconds[1] if self.seconds[1] > 0 else 1.0
        return out

    @staticmethod
    def _rates_of(seconds: list[float], acceptance: list[float]) -> list[float]:
        out, tokens, reach = [1.0 / seconds[0]], 1.0, 1.0
        for k, a in enumerate(acceptance, start=1):
            reach *= a
            tokens += reach
            out.append(tokens / seconds[k])
        return out

    def set_budget(self, remaining: int | None, behind: int = 0) -> None:
        """Before a round: ``remaining`` new tokens the decode may still emit (None: no limit known) and
        ``behind``, the tokens of the sequence the drafter has not been run over yet (the whole prompt
        before its first draft; a plain run's tokens before a probe).  The first ``costs.ROUND_CATCH_UP``
        of them are part of a drafting round's calibrated cost; the rule prices the rest."""
        self.remaining, self.behind = remaining, max(0, int(behind) - ROUND_CATCH_UP)  # a round's own: in its cost

    def _catch_up_pays(self, rate0: float, rate: float) -> bool:
        """``remaining * (1 / rate0 - 1 / rate) > behind * catch_up`` (module docstring); True where
        nothing is behind or no budget was given."""
        cost = self.behind * self.catch_up
        if cost <= 0.0 or self.remaining is None:
            return True
        return self.remaining * (1.0 / rate0 - 1.0 / rate) > cost

    def next_k(self) -> int:
        """The draft length of the next round."""
        rates = self.rates()
        best = max(range(len(rates)), key=lambda k: (rates[k], -k))  # ties: the shorter draft
        if self.timed and best and self.plain_measures < PLAIN_MEASURES and sum(self.timed_n[1:]):
            self.plain_measures += 1  # after the first timed drafting round: measure the target alone
            return 0
        declined = bool(best) and not self._catch_up_pays(rates[0], rates[best])
        if declined:  # the drafter's catch-up costs more than drafting would save
            best = 0
        self.probing = False
        if best == 0:
            self.plain_run += 1
            if self.plain_run > self.probe_gap and not declined and self._probe_pays(rates[0]):
                best = 1  # probe: one drafted token, the cheapest test of depth 1
                self.probing = True
            elif self.plain_run > self.probe_gap or declined:
                self.declined += 1
        elif self.probe_gap != self.probe_every:  # drafting on the evidence: probes start over
            self.probe_gap = self.probe_every
        if best:
            self.plain_run = 0
        return best

    def _probe_pays(self, rate0: float) -> bool:
        """Whether a probe's catch-up could pay: the catch-up rule with the best rate the drafter would
        reach at its prior acceptance (as good as shipped)."""
        rates = self._rates_of(self._round_seconds, [self.prior] * self.max_k)
        return self._catch_up_pays(rate0, max(rates[1:]))

    def keep_grafting(self, reach: float, rows: int) -> bool:
        """Whether a model-free node (a hybrid's suffix graft, ``drafting.suffix.HybridDrafter``) is
        worth one more verification row: ``reach``, its chance of being reached and accepted, over the
        row's seconds beats the round's predicted rate (module docstring)::

            reach / (T(rows + 1) - T(rows))  >  max_k rate(k)

        T: the cost curve's verification of n causal rows, scaled as the timed rounds scale a drafting
        round; beyond the curve's largest size it grows with the slope of its two largest."""
        step = (self.costs.t(rows + 1) - self.costs.t(rows)) * self._drift
        return step <= 0 or reach > step * self._best_rate

    def keep_drafting(self, pis) -> bool:
        """Whether a chain drafted to depth d = ``len(pis)`` grows one more depth (module docstring);
        ``pis``: the drafter's probabilities of its greedy tokens at depths 1..d."""
        d = len(pis)
        if d >= self.max_k:
            return False
        s, a1 = self._round_seconds, self._a1
        reach, tokens = 1.0, 1.0
        for p in pis:
            reach *= p
            tokens += reach
        step = s[d + 1] - s[d]
        return step <= 0 or reach * a1 * s[d] > tokens * step

    def observe(self, depth_accepted) -> None:
        """A round's outcome: ``depth_accepted[d]`` says whether the attempt at depth d + 1 was accepted."""
        if self.probing:  # a rejected probe doubles the wait for the next one; an accepted one resets it
            self.probing = False
            taken = len(depth_accepted) > 0 and bool(depth_accepted[0])
            self.probe_gap = self.probe_every if taken else min(2 * self.probe_gap, max(MAX_PROBE_GAP, self.probe_every))
        for d, ok in enumerate(depth_accepted[: self.max_k]):
            self.attempted[d] += 1
            self.accepted[d] += int(bool(ok))
