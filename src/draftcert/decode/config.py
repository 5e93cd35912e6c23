"""One decode's configuration: the rule, the draft shape and the limits every round reads.

``DecodeConfig.build(target, criterion, k, tree, max_new_tokens, ...)`` checks the arguments once,
before any work, and resolves them into what the rounds use::

    rule         the token test (a LevelSet; ``tree:M`` tests tokens strictly)
    widths       drafted children per node, one entry per depth ([1] * k: a chain of k)
    expand_all   False: only the drafter's greedy child is expanded (a (m, depth) tree); True: a static full tree
    summary_k    the top-k size of a verification summary (``summary_size``)
    eos          the token ids that end the decode
    layout       the target's ``models.cache_state.Layout`` (what it can verify: chains, trees, batches)

The single-prompt loop (``engine.decode_loop``) and the batched one (``batch``) both take it; the
callbacks (``on_round``, ``stop``) ride along so that a loop's parameters stay the target, the
drafter, the prompt and this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..criteria import Criterion, LevelSet, Strict, TreeCoverage, parse_criterion
from ..models.cache_state import Layout, layout_of
from ..models.hf import eos_token_ids
from ..models.tree_attention import parse_tree
from .stats import DecodeStats, RoundLog

__all__ = ["DecodeConfig", "resolve_criterion", "summary_size", "check_max_new_tokens", "check_target"]


def resolve_criterion(criterion, k: int, tree) -> tuple[Criterion, LevelSet, list[int], bool]:
    """(criterion, token rule, widths per depth, expand_all).

    ``tree:M`` means tree coverage: strict token test on a tree of width M
    (``(M, k)`` unless ``tree`` is given).  ``k = 0`` (no tree): nothing is drafted, every round is
    the target's own greedy step.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k: expected an integer >= 0 (number of draft tokens per round; 0: no drafts), got {k!r}")
    crit = parse_criterion(criterion)
    if k == 0:
        if tree is not None or isinstance(crit, TreeCoverage):
            raise ValueError("k: 0 drafts no tree; give k >= 1 with a tree or a tree:M rule")
        if not isinstance(crit, LevelSet):
            raise ValueError(f"criterion: {crit.spec!r} is not a token-level rule")
        return crit, crit, [], False
    shape = parse_tree(tree, k)
    if isinstance(crit, TreeCoverage):
        rule: LevelSet = Strict()
        if shape is None:
            shape = ([crit.m] * k, False)
        elif max(shape[0]) != crit.m:
            raise ValueError(f"criterion {crit.spec} needs a tree of width {crit.m}; got widths {shape[0]} (drop tree= or match it)")
    elif isinstance(crit, LevelSet):
        rule = crit
    else:
        raise ValueError(f"criterion: {crit.spec!r} is not a token-level rule")
    widths, expand_all = shape if shape is not None else ([1] * k, False)
    return crit, rule, widths, expand_all


def summary_size(rule: LevelSet, widths, certificates: bool) -> int:
    """The top-k size of a round's verification summary (``round.accept``'s ``summary_k``).  Any k
    gives exact answers (rows needing more are re-sorted exactly); 16 covers peaked rows cheaply."""
    return max(16 if certificates else 2, rule.min_k, max(widths, default=0) + 1)


def check_max_new_tokens(max_new_tokens) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an integer >= 1, got {max_new_tokens!r}")


def check_target(target, tree_shape: bool) -> Layout:
    """The target's ``Layout``, refusing a tree where it cannot verify one (before any work).

    ``tree_shape``: the caller asked for a tree (``tree=`` or a ``tree:M`` criterion).  A chain is
    exact on every layout; drafters that propose trees on their own (suffix candidates) are cut to
    their first-ranked path there (``models.cache_state.chain_of``)."""
    layout = layout_of(target)
    if layout.decode_refusal() is not None:
        raise ValueError(f"target: {layout.decode_refusal()}")
    why = layout.tree_refusal()
    if tree_shape and why is not None:
        raise ValueError(f"tree: {why}")
    return layout


@dataclass(frozen=True)
class DecodeConfig:
    """Everything the rounds of one decode read besides the target, the drafter and the prompt
    (module docstring).  ``on_round(log)`` hears each round's ``RoundLog``; ``stop(new_tokens)``
    after each round returns None to go on or n to keep the first n new tokens and end."""

    criterion: Criterion
    rule: LevelSet
    k: int
    widths: tuple[int, ...]
    expand_all: bool
    tree_shape: tuple[int, ...] | None  # the widths where a tree was asked for (``DecodeStats.tree``), else None
    summary_k: int
    eos: frozenset[int]
    certificates: bool
    max_new_tokens: int
    layout: Layout
    on_round: Callable[[RoundLog], None] | None = None
    stop: Callable[[list[int]], int | None] | None = None
    # -k auto: a new ``adaptive.AdaptiveDraftLength`` per decode, which picks each round's chain length
    # in 0..k (``widths`` is then the longest chain); None: every round drafts ``widths``
    draft_length: Callable[[], object] | None = None
    # the drafter's confidence stop: its chain ends where its top-2 logit gap is below this (nats)
    min_margin: float | None = None

    @classmethod
    def build(cls, target, criterion, k: int, tree, max_new_tokens: int, *, eos_token_id=None,
              certificates: bool = True, on_round=None, stop=None, draft_length=None,
              draft_margin: float | None = None) -> "DecodeConfig":
        """Check the arguments (ValueError naming the one that is wrong) and resolve them for ``target``."""
        if draft_margin is not None and (isinstance(draft_margin, bool) or not isinstance(draft_margin, (int, float))
                                         or not draft_margin >= 0 or draft_margin == float("inf")):
            raise ValueError(f"draft_margin: expected a finite number of nats >= 0, got {draft_margin!r}")
        crit, rule, widths, expand_all = resolve_criterion(criterion, k, tree)
        check_max_new_tokens(max_new_tokens)
        tree_asked = tree is not None or isinstance(crit, TreeCoverage)
        layout = check_target(target, tree_asked)
        return cls(criterion=crit, rule=rule, k=k, widths=tuple(widths), expand_all=expand_all,
                   tree_shape=tuple(widths) if tree_asked else None,
                   summary_k=summary_size(rule, widths, certificates),
                   eos=frozenset(eos_token_ids(target, explicit=eos_token_id)), certificates=certificates,
                   max_new_tokens=max_new_tokens, layout=layout, on_round=on_round, stop=stop,
                   draft_length=draft_length, min_margin=None if draft_margin is None else float(draft_margin))

    def new_stats(self) -> DecodeStats:
        """Empty statistics named after this decode's rule and shape."""
        return DecodeStats(criterion=self.criterion.spec, k=self.k,
                           tree=None if self.tree_shape is None else list(self.tree_shape),
                           adaptive=self.draft_length is not None)
