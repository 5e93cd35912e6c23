"""Choosing the draft shape (``-k auto``): the chain or tree with the best predicted tokens/s.

Expected tokens per round.  Let ``a_d(w)`` be the probability that one of the drafter's top-w
children at depth d is the target's greedy token, given that the drafter's greedy path was
accepted up to depth d - 1.  The engine expands only the drafter's greedy child, so a chain of k
(w = 1) or an (m, D) tree (top-m children along the greedy path) emits per round::

    E = 1 + sum_{d=1..D} a_d(m) * prod_{i<d} a_i(1)

(accepted drafts, plus the target's own correction or bonus token).  Its round costs
``round_seconds(costs, nodes = m * D, fronts = [1] * D, tree = m > 1)`` (``decode.costs``: the same
model the replay's predicted speed uses), and its predicted rate is ``E / round``; the target alone
runs at ``1 / costs.target_step``.  ``choose`` returns the candidate with the highest rate.

Acceptance by depth, ``a_d(1)``: an evaluation on user-like prompts shipped next to the drafter's
weights (``train.json``'s ``user_prompt_eval*`` entries, ``accept@d``), the last depth repeated
beyond what it measured; without it, ``DEFAULT_ACCEPT`` = 0.3 at every depth.  The shipped
drafter's ``heldout_eval*`` figures are NOT used: they are teacher-forced on held-out
*self-generated* prompts (0.49 at depth 1), while the same drafter accepts 0.27-0.35 per token on
MT-Bench / HumanEval (``benchmarks/bench_speedup.py``), and choosing from the optimistic figure
picked k = 2 where k = 1 was faster.  Wider trees: each child after the
first counts as half an independent draw, ``a_d(m) = 1 - (1 - a_d(1)) ** (1 + (m - 1) / 2)``
(no shipped measurement of top-m coverage; documented in docs/speed.md).  Relaxed rules accept
more than strict, so the figures are the strict (lower) side.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ...criteria import TreeCoverage
from ...models import eagle, parse_drafter_spec
from ...models.pair import PAIR_DRAFTER_ACCEPTANCE
from .adaptive import MAX_K, AdaptiveDraftLength
from .costs import Costs, engine_costs, round_key, round_seconds
from ..config import resolve_criterion
from ...models.cache_state import layout_of

__all__ = ["Acceptance", "Candidate", "Choice", "CANDIDATES", "DEFAULT_ACCEPT", "acceptance_of", "choose",
           "expected_tokens", "candidates_for", "auto_shape", "auto_engine_args", "adaptive_draft_length"]

DEFAULT_ACCEPT = 0.3
# chains k = 1..6 and the (m, depth) trees (2, 2), (2, 3), (3, 2)
CANDIDATES = tuple([(1,) * k for k in range(1, 7)] + [(2, 2), (2, 2, 2), (3, 3)])


@dataclass(frozen=True)
class Acceptance:
    """Acceptance of the drafter's greedy draft by depth (``by_depth[d - 1]`` = a_d(1)), and its source."""

    by_depth: tuple[float, ...]
    source: str

    def __post_init__(self):
        if not self.by_depth or any(not 0.0 <= a <= 1.0 for a in self.by_depth):
            raise ValueError(f"acceptance by depth: expected probabilities in [0, 1], got {self.by_depth!r}")

    def at(self, depth: int, width: int = 1) -> float:
        a = self.by_depth[min(depth, len(self.by_depth)) - 1]
        return 1.0 - (1.0 - a) ** (1.0 + (width - 1) / 2.0)


def acceptance_of(drafter_spec: str | None) -> Acceptance:
    """Acceptance by depth of a drafter: a preset pair's measured figure (``models.pair``), its shipped
    evaluation on user-like prompts (``train.json`` next to an ``eagle:NAME`` / drafter file,
    ``user_prompt_eval*``'s ``accept@d``), else ``DEFAULT_ACCEPT``."""
    try:  # canonical: 'default' -> eagle:NAME, 'X+suffix' -> X (the suffix candidates add no figures of their own)
        parsed = parse_drafter_spec(drafter_spec) if isinstance(drafter_spec, str) else None
    except ValueError:  # not a spec (a class name for a drafter object): the prior
        parsed = None
    base = None if parsed is None else parsed.model_spec
    if parsed is not None and parsed.source in PAIR_DRAFTER_ACCEPTANCE:  # a preset pair's drafter (models/pair.py)
        # NAME@q4_1 starts from NAME's figure: as Q4_1 blocks the 0.5B drafter's depth-1 acceptance was
        # 0.741 against 0.766 stored (benchmarks/bench_drafter_blocks.py); -k auto then follows its own
        a, why = PAIR_DRAFTER_ACCEPTANCE[parsed.source]
        return Acceptance((a,), f"models.pair ({why}: {a:.2f} per depth)")
    try:
        path = eagle.resolve_spec(base) if base is not None else None
    except (ValueError, OSError):
        path = None
    if path is not None:
        meta = Path(path).parent / "train.json" if Path(path).is_file() else Path(path) / "train.json"
        try:
            rec = json.loads(meta.read_text())
        except (OSError, ValueError):
            rec = None
        for name, ev in (rec or {}).items() if isinstance(rec, dict) else ():
            if not (name.startswith("user_prompt_eval") and isinstance(ev, dict)):  # not heldout_eval: see above
                continue
            acc, d = [], 1
            while isinstance(ev.get(f"accept@{d}"), (int, float)):
                acc.append(float(ev[f"accept@{d}"]))
                d += 1
            if acc:
                return Acceptance(tuple(acc), f"{meta} ({name}: " + ", ".join(f"{a:.2f}" for a in acc) + " by depth)")
    return Acceptance((DEFAULT_ACCEPT,), f"default {DEFAULT_ACCEPT} per depth (no shipped evaluation on user-like prompts)")


def expected_tokens(acc: Acceptance, width: int, depth: int) -> float:
    """E = 1 + sum_d a_d(width) prod_{i<d} a_i(1) (module docstring)."""
    e, reach = 1.0, 1.0
    for d in range(1, depth + 1):
        e += reach * acc.at(d, width)
        reach *= acc.at(d, 1)
    return e


@dataclass(frozen=True)
class Candidate:
    widths: tuple[int, ...]
    tokens_per_round: float
    seconds_per_round: float

    @property
    def rate(self) -> float:
        return self.tokens_per_round / self.seconds_per_round if self.seconds_per_round > 0 else float("inf")

    @property
    def label(self) -> str:
        return f"k={len(self.widths)}" if max(self.widths) == 1 else f"tree {self.widths[0]}x{len(self.widths)}"

    def engine_args(self) -> dict:
        """``speculative_generate``'s k and tree for this shape."""
        d = len(self.widths)
        return {"k": d, "tree": None if max(self.widths) == 1 else (self.widths[0], d)}


@dataclass(frozen=True)
class Choice:
    best: Candidate
    ranked: list[Candidate] = field(default_factory=list)  # every candidate, best first
    baseline_rate: float | None = None  # the target alone, tokens/s

    @property
    def runner_up(self) -> Candidate | None:
        return self.ranked[1] if len(self.ranked) > 1 else None

    def why(self) -> str:
        """One line: the chosen shape, its predicted tokens/s against the runner-up and the target alone."""
        b, r = self.best, self.runner_up
        msg = f"{b.label} (predicted {b.rate:.1f} tokens/s, {b.tokens_per_round:.2f} tokens/round"
        if r is not None:
            msg += f"; runner-up {r.label} {r.rate:.1f}"
        if self.baseline_rate:
            msg += f"; target alone {self.baseline_rate:.1f}"
        msg += ")"
        if self.slower_than_target:
            msg += (". No shape is predicted to beat the target alone on this machine with this drafter: "
                    "decoding without speculation (plain greedy) is faster here")
        return msg

    @property
    def slower_than_target(self) -> bool:
        """Is even the best shape predicted slower than the target alone?"""
        return bool(self.baseline_rate) and self.best.rate < self.baseline_rate


def candidates_for(tree_width: int | None = None) -> list[tuple[int, ...]]:
    """The shapes ``-k auto`` weighs: ``CANDIDATES``, or with a fixed tree width m (``tree:M``,
    ``--tree M,auto``) depths 1..6 of width m."""
    if tree_width is None:
        return list(CANDIDATES)
    return [(tree_width,) * d for d in range(1, 7)]


def choose(costs: Costs, acc: Acceptance, candidates=CANDIDATES) -> Choice:
    """The candidate shape with the highest predicted tokens/s (ties: the shallower, listed first)."""
    if not candidates:
        raise ValueError("choose: no candidate shapes")
    ranked = []
    for w in candidates:
        w = tuple(w)
        if not w or min(w) < 1:
            raise ValueError(f"choose: bad shape {w!r}")
        sec = round_seconds(costs, sum(w), [1] * len(w), max(w) > 1, round_key(w, False))
        ranked.append(Candidate(w, expected_tokens(acc, w[0], len(w)), sec))
    order = sorted(range(len(ranked)), key=lambda i: (-ranked[i].rate, i))
    base = 1.0 / costs.target_step if costs.target_step else None
    return Choice(ranked[order[0]], [ranked[i] for i in order], base)


def auto_shape(target, drafter, drafter_spec: str, *, tree_width: int | None = None, use_cache: bool = True,
               on_note=None) -> tuple[Choice, str]:
    """``-k auto`` from Python: (the choice, where its figures came from) for a target and a drafter
    object (``make_drafter``'s) named ``drafter_spec``; ``tree_width`` fixes the width (``tree:M``).
    A target that verifies chains only (``state.Layout.tree_refusal``) weighs chains only.
    The cost curve is measured on first use (``engine_costs``; ``on_note(msg)`` hears of it) and
    cached.  Decode with ``speculative_generate(..., **choice.best.engine_args())``."""
    shapes = candidates_for(tree_width)
    why = layout_of(target).tree_refusal()
    if why is not None:  # a model that verifies chains only (recurrent state, ALiBi, ...): chains only
        if tree_width is not None and tree_width > 1:
            raise ValueError(f"tree: {why}")
        shapes = [w for w in shapes if max(w) == 1]
    costs, source = engine_costs(target, drafter, drafter_spec, [(w, False) for w in shapes], use_cache=use_cache,
                                 on_note=on_note)
    acc = acceptance_of(drafter_spec)
    return choose(costs, acc, shapes), f"acceptance from {acc.source}; costs {source}"


def auto_engine_args(target, drafter, drafter_spec: str, criterion, *, on_note=None) -> tuple[dict, Choice, str]:
    """``-k auto`` for ``criterion``: (``speculative_generate``'s k and tree, the choice, where its
    figures came from).  A ``tree:M`` criterion fixes the width to M (its tree comes from k), any
    other rule may get a chain or a tree.  Used by ``speculative_generate(k="auto")`` and the CLI."""
    crit = resolve_criterion(criterion, 1, None)[0]
    width = crit.m if isinstance(crit, TreeCoverage) else None
    choice, source = auto_shape(target, drafter, drafter_spec, tree_width=width, on_note=on_note)
    args = choice.best.engine_args()
    return {"k": args["k"], "tree": None if width is not None else args["tree"]}, choice, source


def adaptive_draft_length(target, drafter, drafter_spec: str, *, use_cache: bool = True, on_note=None,
                          timed: bool = False):
    """``-k auto`` for a chain rule: (a factory of ``adaptive.AdaptiveDraftLength``, one per decode;
    the line that says where its figures came from).  The cost curve of chains 1..``MAX_K`` is
    measured on first use (``engine_costs``; ``on_note(msg)`` hears of it) and cached; the prior
    acceptance is the drafter's shipped one (``acceptance_of``).  ``timed``: each decode corrects the
    costs by timing its own rounds (``AdaptiveDraftLength``; for rules whose tokens do not depend on
    the draft lengths)."""
    shapes = [((1,) * k, False) for k in range(1, MAX_K + 1)]
    costs, source = engine_costs(target, drafter, drafter_spec, shapes, use_cache=use_cache, on_note=on_note)
    acc = acceptance_of(drafter_spec)
    prior = acc.by_depth
    first = AdaptiveDraftLength(costs, prior)
    rates = first.rates()
    start = max(range(len(rates)), key=lambda k: (rates[k], -k))
    line = (f"adaptive draft length, k = 0..{MAX_K} chosen before each round from the acceptance "
            f"{'and round times ' if timed else ''}seen so far; "
            f"it starts at k={start} (predicted {rates[start]:.1f} tokens/s; the target alone {rates[0]:.1f}); "
            f"prior acceptance from {acc.source}"
            + (f"; the drafter catches up on tokens it has not seen (the prompt first) at {1e3 * costs.drafter_catch_up:.2f} "
               "ms a token, and drafts only where that pays within the decode" if costs.drafter_catch_up else "")
            + f"; costs {source}")
    return (lambda: AdaptiveDraftLength(costs, prior, timed=timed)), line

