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

A depth's prior is the estimate of the depth above it: depths a decode has not attempted yet follow
what it has seen (a drafter that has been right at every depth so far is tried deeper; one that
fails at depth 1 is not), where a fixed per-depth prior would never move them.

A prompt whose drafts are mostly rejected drives ``a_1`` down until ``k = 0`` wins; a decode in
plain mode sees no attempts, so every ``probe_every`` plain rounds one round drafts with the best
``k >= 1`` again (its cost, a few percent of the plain rounds, is what lets a decode that turns
predictable speculate again).  Relaxed rules accept more than strict: the posterior learns it.
"""

from __future__ import annotations

from .costs import Costs, round_key, round_seconds

__all__ = ["AdaptiveDraftLength", "PRIOR_WEIGHT", "PROBE_EVERY", "MAX_K"]

PRIOR_WEIGHT = 2.0  # a depth's prior counts as this many observed rounds
PROBE_EVERY = 16  # plain rounds between two probing drafts
MAX_K = 6


class AdaptiveDraftLength:
    """The draft length of each round (module docstring); one instance per decode."""

    def __init__(self, costs: Costs, prior: tuple[float, ...], *, max_k: int = MAX_K,
                 prior_weight: float = PRIOR_WEIGHT, probe_every: int = PROBE_EVERY):
        if not prior or any(not 0.0 <= a <= 1.0 for a in prior):
            raise ValueError(f"adaptive draft length: prior acceptance must be probabilities, got {prior!r}")
        if max_k < 1 or prior_weight <= 0 or probe_every < 1:
            raise ValueError("adaptive draft length: need max_k >= 1, prior_weight > 0 and probe_every >= 1")
        self.costs, self.max_k, self.prior_weight, self.probe_every = costs, max_k, prior_weight, probe_every
        self.prior = prior[0]  # depth 1's; deeper depths take the estimate of the depth above
        self.accepted = [0] * max_k
        self.attempted = [0] * max_k
        self.plain_run = 0  # plain rounds since the last draft
        # the predicted seconds of a round of each length; plain: the target alone's step
        self.seconds = [costs.target_step or round_seconds(costs, 0, [], False, "")]
        self.seconds += [round_seconds(costs, k, [1] * k, False, round_key((1,) * k, False)) for k in range(1, max_k + 1)]

    def acceptance(self) -> list[float]:
        """a_d for d = 1..max_k, the posterior means (module docstring)."""
        w, out, prior = self.prior_weight, [], self.prior
        for a, n in zip(self.accepted, self.attempted):
            prior = (prior * w + a) / (w + n)
            out.append(prior)
        return out

    def rates(self) -> list[float]:
        """Predicted tokens/s of k = 0..max_k."""
        out, tokens, reach = [1.0 / self.seconds[0]], 1.0, 1.0
        for k, a in enumerate(self.acceptance(), start=1):
            reach *= a
            tokens += reach
            out.append(tokens / self.seconds[k])
        return out

    def next_k(self) -> int:
        """The draft length of the next round."""
        rates = self.rates()
        best = max(range(len(rates)), key=lambda k: (rates[k], -k))  # ties: the shorter draft
        if best == 0:
            self.plain_run += 1
            if self.plain_run > self.probe_every:  # probe: draft once with the best length
                best = max(range(1, len(rates)), key=lambda k: (rates[k], -k))
        if best:
            self.plain_run = 0
        return best

    def observe(self, depth_accepted) -> None:
        """A round's outcome: ``depth_accepted[d]`` says whether the attempt at depth d + 1 was accepted."""
        for d, ok in enumerate(depth_accepted[: self.max_k]):
            self.attempted[d] += 1
            self.accepted[d] += int(bool(ok))
