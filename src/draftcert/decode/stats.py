"""Statistics of speculative decoding: one type for a decode, a bench row and a replay.

``DecodeStats`` holds counters only (``merge`` adds two of them); every figure is
derived from the counters.  ``draftcert decode`` fills one per prompt, ``bench``
merges one per prompt into a row, and the replay counts its replayed rounds into one.
Every figure has one name, the same in ``decode --json``, ``bench --json``, ``replay.json``
and the report; docs/metrics.md maps each to vLLM's and SGLang's.

A round is one target forward (the prompt's prefill shares the first one); a draft is a
round that proposed at least one token (a feature drafter's first round, prompt lookup
without a match and a round the length limit leaves no room in propose none).

vLLM's counters and figures, with its names and definitions (``vllm/v1/spec_decode/metrics.py``:
``SpecDecodingStats.observe_draft``, ``SpecDecodingLogging.log``):

* ``num_drafts``: rounds that proposed at least one draft token;
* ``num_draft_tokens``: draft tokens proposed (every node of a tree);
* ``num_accepted_tokens``: draft tokens accepted;
* ``num_accepted_tokens_per_pos[i]``: drafts whose token at position (depth) i + 1 was accepted;
* mean acceptance length = 1 + num_accepted_tokens / num_drafts (the round's own target
  token, correction or bonus, included; SGLang's ``avg_spec_accept_length`` is the same
  quantity, so it has no second name here);
* draft acceptance rate = num_accepted_tokens / num_draft_tokens;
* acceptance rate per position i = num_accepted_tokens_per_pos[i] / num_drafts (not
  conditional on the earlier positions).

Ours, for which vLLM has no name (all per run):

* tokens per target forward = emitted / target forwards.  It equals the mean acceptance
  length only when every round drafts and no token is cut by the length limit or an EOS:
  a round without a draft counts here (1 token) and not there;
* conditional acceptance rate per position d = num_accepted_tokens_per_pos[d] /
  num_attempted_per_pos[d], where a depth is attempted when every shallower draft of the
  round was accepted and the node reached has drafted children (the drafter's quality at
  that depth, which vLLM's unconditional rate mixes with the depths before it);
* accepted-tokens histogram: entry n = drafts that accepted exactly n tokens;
* drift = drift_tokens / emitted, drift_tokens = emitted tokens that differ from the target's
  greedy token at the same (emitted) prefix; 0 under ``strict``;
* divergence spent (nats) = sum over emitted tokens x of log p(a) - log p(x), a = the
  target's greedy token at that prefix;
* mean forward KL = mean of the proven upper bound on KL(p_target || q_drafter) over
  accepted draft positions;
* timings (``timing.py``): tokens/s = emitted / the median of the repeated timings; with a
  baseline, speedup = the median per-repeat ratio of the two tokens/s, each repeat timing the
  decode and the target alone next to each other; ``timing_reliable`` is False when the repeats'
  spread exceeds 20 % (None for a single timing);
* stage seconds (the engine's rounds of the first timed decode, ``STAGES``): propose (drafting,
  the drafter's forwards), verify (the target's pass, its catch-up included), accept (the rule's
  walk), certify (the certificates), record (the counters, the round log, the caches' rollback and
  the drafter's bookkeeping); certificate share = certify / the sum of the five (the certificates'
  share of a round);
* certificates: at every expanded node whose drafter distribution is known,
  certified = KL(p || q) < radius (for a width-m tree node radius = max(radius(criterion),
  radius(tree:m))); certified fraction = certified_positions / checked_positions.  Certified
  and rejected never happens (the engine raises ``CertificateViolation``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Sequence

from .timing import median_or_none, reliable, spread


STAGES = ("propose", "verify", "accept", "certify", "record")  # a round's stages (round.py), stage_seconds' order


class CertificateViolation(RuntimeError):
    """A draft position was certified (KL < radius) but its acceptance failed: a bug."""


@dataclass
class RoundLog:
    """One verification round, as the engine records it (``decode --json`` prints one per line).

    Its counts use the run's names: a round adds ``num_draft_tokens``, ``num_accepted_tokens``
    and ``drift_tokens`` to the ``DecodeStats`` counters of the same names."""

    num_draft_tokens: int  # tree nodes proposed (0: no draft this round)
    num_accepted_tokens: int  # draft tokens accepted
    emitted: list[int]  # tokens emitted this round (accepted drafts + correction/bonus, after truncation)
    from_draft: list[bool]  # per emitted token: an accepted draft (True) or the target's token (False)
    depths: list[int] = field(default_factory=list)  # reached depths with drafted children (1-based)
    depth_accepted: list[bool] = field(default_factory=list)
    certified: list[bool | None] = field(default_factory=list)  # per reached depth (None: no drafter q)
    kl: list[float | None] = field(default_factory=list)  # per reached depth: upper bound on KL(p || q)
    radius: list[float | None] = field(default_factory=list)
    drift_tokens: int = 0  # accepted tokens that are not the target's greedy token
    divergence_spent: float = 0.0  # nats: sum over them of log p(greedy) - log p(token)
    checked_positions: int = 0  # expanded nodes with a certificate (reached or not)
    certified_positions: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def _add_lists(a: list, b: list) -> list:
    """Elementwise sum, the shorter list padded with zeros."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def _grow(a: list[int], n: int) -> None:
    a.extend([0] * (n - len(a)))


@dataclass
class DecodeStats:
    """Counters of one or more speculative decodes under one configuration (see the module docstring).

    ``rounds`` is the per-round log (``RoundLog``) of the decodes counted through
    ``add_round``; a replay counts its rounds with ``count_round`` and leaves it empty.
    """

    criterion: str
    k: int  # the chain's length (with ``adaptive``: the longest a round may draft)
    tree: list[int] | None  # widths per depth, None for a chain of k
    adaptive: bool = False  # -k auto: each round's chain length chosen during the decode (decode/draft_shape/adaptive.py)
    num_rounds: int = 0  # verification rounds (one target forward each, but see stepwise_forwards)
    stepwise_forwards: int = 0  # target forwards beyond one per round (models verified token by token: models.cache_state)
    catchup_forwards: int = 0  # target forwards feeding re-fed tokens of recurrent state on their own (round.catch_up)
    emitted: int = 0
    drafter_forwards: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [depth]
    num_attempted_per_pos: list[int] = field(default_factory=list)  # [depth]
    accepted_tokens_histogram: list[int] = field(default_factory=list)  # [depth + 1]
    drift_tokens: int = 0
    divergence_spent: float = 0.0  # nats
    kl_sum: float = 0.0
    kl_count: int = 0
    certified_positions: int = 0
    checked_positions: int = 0  # positions with a drafter distribution (certificate computed)
    seconds: float = 0.0  # the timed decode's wall time: the median of ``repeat_seconds`` when timed repeatedly
    baseline_seconds: float | None = None  # likewise for the target alone
    repeat_seconds: list[float] = field(default_factory=list)  # [repeat] wall time of each timed decode
    baseline_repeat_seconds: list[float] = field(default_factory=list)  # [repeat] the target alone, interleaved
    baseline_tokens: int | None = None
    baseline_match: bool | None = None  # strict: emitted tokens identical to plain greedy decoding
    rounds: list[RoundLog] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)  # [k] rounds that drafted k nodes (0: none)
    # -k auto: plain rounds (of draft_lengths[0]) a model drafter's catch-up kept plain (adaptive.py)
    catch_up_plain: int = 0
    stage_seconds: list[float] = field(default_factory=list)  # [stage] (STAGES): the engine's rounds, first decode

    def __post_init__(self):
        _grow(self.accepted_tokens_histogram, self.depth + 1)

    @property
    def depth(self) -> int:
        """Draft depth of the configuration: tree levels, or k for a chain."""
        return len(self.tree) if self.tree else self.k

    # ------------------------------------------------------------------ counting

    def count_round(self, num_draft_tokens: int, num_accepted_tokens: int, emitted: int,
                    depth_accepted: Sequence[bool], drift_tokens: int = 0, divergence_spent: float = 0.0) -> None:
        """Count one round: ``num_draft_tokens`` nodes proposed, ``num_accepted_tokens`` of them
        accepted, ``emitted`` tokens out; ``depth_accepted[d]`` says whether depth d + 1
        (attempted) was accepted."""
        self.num_rounds += 1
        _grow(self.draft_lengths, num_draft_tokens + 1)
        self.draft_lengths[num_draft_tokens] += 1
        self.emitted += emitted
        self.num_accepted_tokens += num_accepted_tokens
        self.drift_tokens += drift_tokens
        self.divergence_spent += divergence_spent
        if num_draft_tokens:  # a draft, as vLLM counts one
            self.num_drafts += 1
            self.num_draft_tokens += num_draft_tokens
            _grow(self.accepted_tokens_histogram, num_accepted_tokens + 1)
            self.accepted_tokens_histogram[num_accepted_tokens] += 1
        _grow(self.num_attempted_per_pos, len(depth_accepted))
        _grow(self.num_accepted_tokens_per_pos, len(depth_accepted))
        for d, ok in enumerate(depth_accepted):
            self.num_attempted_per_pos[d] += 1
            self.num_accepted_tokens_per_pos[d] += int(ok)

    def add_round(self, log: RoundLog) -> None:
        """Count one engine round from its log (and keep the log)."""
        self.rounds.append(log)
        self.count_round(log.num_draft_tokens, log.num_accepted_tokens, len(log.emitted), log.depth_accepted,
                         log.drift_tokens, log.divergence_spent)
        self.add_certificates(log)

    def add_certificates(self, log: RoundLog) -> None:
        """Count a round's certificates (``add_round`` does; a round certified later, once they are in)."""
        for ok, kl in zip(log.depth_accepted, log.kl):
            if ok and kl is not None:
                self.kl_sum += kl
                self.kl_count += 1
        self.checked_positions += log.checked_positions
        self.certified_positions += log.certified_positions

    def merge(self, other: DecodeStats) -> DecodeStats:
        """The counters of both runs added (same criterion and draft shape); round logs concatenated."""
        if (self.criterion, self.k, self.tree, self.adaptive) != (other.criterion, other.k, other.tree, other.adaptive):
            raise ValueError(f"merge: statistics of different configurations ({self.criterion}, k={self.k}, "
                             f"tree={self.tree}) and ({other.criterion}, k={other.k}, tree={other.tree})")
        out = DecodeStats(self.criterion, self.k, self.tree, self.adaptive)
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name in ("criterion", "k", "tree", "adaptive"):
                continue
            if f.name == "rounds":
                v = a + b
            elif f.name == "baseline_match":
                v = None if a is None or b is None else a and b
            elif isinstance(a, list):
                v = _add_lists(a, b)
            else:
                v = None if a is None or b is None else a + b
            setattr(out, f.name, v)
        return out

    # ------------------------------------------------------------------ vLLM's figures

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + num_accepted_tokens / num_drafts (vLLM's; SGLang's avg_spec_accept_length); None: no draft."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def draft_acceptance_rate(self) -> float | None:
        """num_accepted_tokens / num_draft_tokens (vLLM's); None: no draft."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def acceptance_rate_per_pos(self) -> list[float | None]:
        """num_accepted_tokens_per_pos[i] / num_drafts (vLLM's: not conditional on positions < i)."""
        return [a / self.num_drafts if self.num_drafts else None for a in self.num_accepted_tokens_per_pos]

    # ------------------------------------------------------------------ ours

    @property
    def target_forwards(self) -> int:
        """One target forward per round (the prefill shares the first verification pass), plus the
        extra passes of a model verified token by token (``stepwise_forwards``) and the catch-up passes
        of a model with recurrent state (``catchup_forwards``)."""
        return self.num_rounds + self.stepwise_forwards + self.catchup_forwards

    @property
    def tokens_per_forward(self) -> float:
        """Emitted tokens / target forwards (rounds without a draft included)."""
        return self.emitted / self.target_forwards if self.num_rounds else 0.0

    @property
    def conditional_acceptance_rate_per_pos(self) -> list[float | None]:
        """num_accepted_tokens_per_pos[d] / num_attempted_per_pos[d] (None where never attempted)."""
        return [a / n if n else None for a, n in zip(self.num_accepted_tokens_per_pos, self.num_attempted_per_pos)]

    @property
    def drift(self) -> float:
        return self.drift_tokens / self.emitted if self.emitted else 0.0

    @property
    def mean_kl(self) -> float | None:
        return self.kl_sum / self.kl_count if self.kl_count else None

    @property
    def certified_fraction(self) -> float | None:
        return self.certified_positions / self.checked_positions if self.checked_positions else None

    @property
    def certificate_share(self) -> float | None:
        """The certify stage's seconds / all five stages' (None: no stage timed, e.g. a replay)."""
        total = sum(self.stage_seconds)
        return self.stage_seconds[STAGES.index("certify")] / total if total > 0 else None

    @property
    def tokens_per_second(self) -> float:
        """Emitted tokens / the median timed decode (``timing.py``; merged runs: per-repeat totals)."""
        sec = median_or_none(self.repeat_seconds) or self.seconds
        return self.emitted / sec if sec > 0 else 0.0

    @property
    def baseline_tokens_per_second(self) -> float | None:
        sec = median_or_none(self.baseline_repeat_seconds) or self.baseline_seconds
        if sec is None or not sec > 0 or self.baseline_tokens is None:
            return None
        return self.baseline_tokens / sec

    def _speedups(self) -> list[float]:
        """Per repeat: speculative tokens/s over the target alone's, timed next to each other."""
        if not self.baseline_tokens:
            return []
        pairs = zip(self.repeat_seconds, self.baseline_repeat_seconds)
        return [(self.emitted / s) / (self.baseline_tokens / b) for s, b in pairs if s > 0 and b > 0]

    def _per_repeat(self) -> list[float]:
        """The figure the repeats are judged by: the speedup with a baseline, else tokens/s."""
        return self._speedups() or [self.emitted / s for s in self.repeat_seconds if s > 0]

    @property
    def speedup(self) -> float | None:
        """The median per-repeat speedup (one repeat: that one; ``timing.py``)."""
        per = self._speedups()
        if per:
            return median_or_none(per)
        b = self.baseline_tokens_per_second
        return self.tokens_per_second / b if b else None

    @property
    def timing_spread(self) -> float | None:
        """How much the repeats disagree: (max - min) / median of the per-repeat speedup (with a
        baseline) or tokens/s (without); None for a single timing."""
        return spread(self._per_repeat())

    @property
    def timing_reliable(self) -> bool | None:
        """False when the repeats disagree by more than ``timing.SPREAD_LIMIT``; None for one timing."""
        return reliable(self._per_repeat())

    def vllm_metrics(self) -> dict:
        """vLLM's counters and derived figures under vLLM's names (JSON-ready)."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "acceptance_rate_per_pos": self.acceptance_rate_per_pos,
        }

    def acceptance_metrics(self) -> dict:
        """The acceptance figures every output shares (``decode --json``, bench rows, ``replay.json``):
        vLLM's, then ours that vLLM has no name for (JSON-ready; docs/metrics.md)."""
        return {
            **self.vllm_metrics(),
            "emitted": self.emitted,
            "target_forwards": self.target_forwards,
            "tokens_per_forward": self.tokens_per_forward,
            "num_attempted_per_pos": list(self.num_attempted_per_pos),
            "conditional_acceptance_rate_per_pos": self.conditional_acceptance_rate_per_pos,
            "accepted_tokens_histogram": list(self.accepted_tokens_histogram),
            "drift_tokens": self.drift_tokens,
            "drift": self.drift,
        }

    def summary(self) -> dict:
        """Headline numbers of a decode (``decode --json``'s summary; JSON-ready)."""
        return {
            "criterion": self.criterion,
            "k": self.depth,  # draft depth: a chain's length, a tree's levels (not the unused -k of --tree)
            "tree_widths": list(self.tree) if self.tree else None,  # drafted children per depth; null: a chain
            "adaptive": self.adaptive,  # -k auto: each round's chain length chosen during the decode, 0..k
            "rounds_by_draft_length": list(self.draft_lengths),  # [n] rounds that drafted n nodes
            "rounds_plain_for_catch_up": self.catch_up_plain,  # of them plain: the drafter's catch-up would not pay
            **self.acceptance_metrics(),
            "drafter_forwards": self.drafter_forwards,
            "divergence_spent": self.divergence_spent,  # nats
            "mean_forward_kl_accepted": self.mean_kl,
            "certified_fraction": self.certified_fraction,
            "certified_positions": self.certified_positions,
            "checked_positions": self.checked_positions,
            "stage_seconds": dict(zip(STAGES, self.stage_seconds)) if self.stage_seconds else None,
            "certificate_share": self.certificate_share,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "baseline_tokens_per_second": self.baseline_tokens_per_second,
            "speedup": self.speedup,
            "repeats": len(self.repeat_seconds),
            "repeat_seconds": list(self.repeat_seconds),
            "baseline_repeat_seconds": list(self.baseline_repeat_seconds),
            "timing_spread": self.timing_spread,  # (max - min) / median over the repeats; null: one timing
            "timing_reliable": self.timing_reliable,  # false: the repeats disagree by > 20 %; null: one timing
            "baseline_match": self.baseline_match,
        }
