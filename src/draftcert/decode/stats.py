"""Per-run statistics of speculative decoding.

Definitions (all per run):

* tokens per target forward = emitted tokens / target forward passes (the
  prompt's prefill shares the first verification pass, so a run with R
  rounds makes exactly R target forwards).
* mean accepted length = mean number of *draft* tokens accepted per round
  (each round also emits one target token: correction or bonus).
* acceptance rate at depth d = accepted / attempted drafts at depth d, where a
  depth is attempted when every shallower draft of that round was accepted.
* accepted-length histogram: entry n = rounds that drafted at least one token and
  accepted exactly n of them (rounds the length limit left without a draft are not counted).
* drift = fraction of emitted tokens that differ from the target's greedy
  token at the same (emitted) prefix; 0 under ``strict``.
* divergence spent (nats) = sum over emitted tokens x of
  log p(a) - log p(x), a = the target's greedy token at that prefix.
* mean forward KL = mean of KL(p_target || q_drafter) over accepted draft positions.
* certificates: at every verification and every draft position whose drafter
  distribution is known, certified = KL(p || q) < radius (for a width-m
  tree node radius = max(radius(criterion), radius(tree:m))).  Certified and
  rejected never happens (the engine raises ``CertificateViolation``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


class CertificateViolation(RuntimeError):
    """A draft position was certified (KL < radius) but its acceptance failed: a bug."""


@dataclass
class RoundLog:
    """One verification round."""

    drafted: int  # tree nodes proposed
    accepted: int  # draft tokens accepted
    emitted: list[int]  # tokens emitted this round (accepted drafts + correction/bonus, after truncation)
    from_draft: list[bool]  # per emitted token: an accepted draft (True) or the target's token (False)
    depths: list[int] = field(default_factory=list)  # reached depths (1-based)
    depth_accepted: list[bool] = field(default_factory=list)
    certified: list[bool | None] = field(default_factory=list)  # per reached depth (None: no drafter q)
    kl: list[float | None] = field(default_factory=list)
    radius: list[float | None] = field(default_factory=list)
    drift: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class DecodeStats:
    criterion: str
    k: int
    tree: list[int] | None
    emitted: int = 0
    target_forwards: int = 0
    drafter_forwards: int = 0
    rounds: list[RoundLog] = field(default_factory=list)
    attempted_by_depth: list[int] = field(default_factory=list)
    accepted_by_depth: list[int] = field(default_factory=list)
    drift_tokens: int = 0
    divergence_spent: float = 0.0  # nats
    kl_sum: float = 0.0
    kl_count: int = 0
    certified_positions: int = 0
    checked_positions: int = 0  # positions with a drafter distribution (certificate computed)
    seconds: float = 0.0
    baseline_seconds: float | None = None
    baseline_tokens: int | None = None
    baseline_match: bool | None = None  # strict: emitted tokens identical to plain greedy decoding

    def record_depth(self, d: int, accepted: bool) -> None:
        while len(self.attempted_by_depth) < d:
            self.attempted_by_depth.append(0)
            self.accepted_by_depth.append(0)
        self.attempted_by_depth[d - 1] += 1
        self.accepted_by_depth[d - 1] += int(accepted)

    @property
    def tokens_per_forward(self) -> float:
        return self.emitted / self.target_forwards if self.target_forwards else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return sum(r.accepted for r in self.rounds) / len(self.rounds) if self.rounds else 0.0

    @property
    def acceptance_rate_by_depth(self) -> list[float]:
        return [a / n if n else 0.0 for a, n in zip(self.accepted_by_depth, self.attempted_by_depth)]

    @property
    def accepted_length_histogram(self) -> list[int]:
        depth = max([len(self.tree) if self.tree else self.k] + [r.accepted for r in self.rounds])
        hist = [0] * (depth + 1)
        for r in self.rounds:
            if r.drafted:
                hist[r.accepted] += 1
        return hist

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
    def tokens_per_second(self) -> float:
        return self.emitted / self.seconds if self.seconds > 0 else 0.0

    @property
    def baseline_tokens_per_second(self) -> float | None:
        if self.baseline_seconds is None or not self.baseline_seconds > 0:
            return None
        return self.baseline_tokens / self.baseline_seconds

    @property
    def speedup(self) -> float | None:
        b = self.baseline_tokens_per_second
        return self.tokens_per_second / b if b else None

    def summary(self) -> dict:
        """Headline numbers (JSON-ready)."""
        return {
            "criterion": self.criterion,
            "k": self.k,
            "tree": self.tree,
            "emitted": self.emitted,
            "rounds": len(self.rounds),
            "target_forwards": self.target_forwards,
            "drafter_forwards": self.drafter_forwards,
            "tokens_per_forward": self.tokens_per_forward,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_rate_by_depth": self.acceptance_rate_by_depth,  # = by draft position 1..k
            "attempted_by_depth": list(self.attempted_by_depth),
            "accepted_by_depth": list(self.accepted_by_depth),
            "accepted_length_histogram": self.accepted_length_histogram,
            "drift": self.drift,
            "divergence_spent_nats": self.divergence_spent,
            "mean_forward_kl_accepted": self.mean_kl,
            "certified_fraction": self.certified_fraction,
            "certified_positions": self.certified_positions,
            "checked_positions": self.checked_positions,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "baseline_tokens_per_second": self.baseline_tokens_per_second,
            "speedup": self.speedup,
            "baseline_match": self.baseline_match,
        }
