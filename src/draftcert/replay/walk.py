"""Replay speculative decoding rounds on a recorded greedy path.

The engine (``draftcert.decode.engine``), one round starting after ``t`` emitted
tokens, with budget ``b = min(len(widths), max_new_tokens - t - 1)``::

    depth d = 1..b, position t + d - 1:
        children  = the drafter's top-w_d tokens at the node reached so far
        passing   = children the rule accepts (level-set test on p at that node)
        none      -> reject: emit p's greedy token (correction), the round ends
        else      -> accept the passing child with the largest p
        the child is expanded further only if it is the drafter's greedy child
        (chain, (m, depth) trees) or always (static trees [w1, w2, ...])
    all b depths accepted (or a leaf reached) -> emit the bonus greedy token
    an accepted EOS ends the output (no bonus)

Along the target's greedy path the drafter's children at position s are exactly the
trace's ``draft_topk_ids[s]`` (teacher-forced on the same prefix), and p at that node
is the trace's step s.  As long as every accepted token is p's greedy token (always
for ``strict`` and ``tree:M``), the prefix of every node the round visits *is* the
recorded prefix, so the replayed round is exact.  A relaxed rule may accept a
non-greedy token; from then on the real sequence leaves the recorded path.  The
replay then continues on the recorded path at the same output position (the
*aligned estimate*: the step t of the trace stands in for the unrecorded step t of
the real sequence) and marks every later decision of that prompt ``exact=False``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from ..criteria import TreeCoverage, parse_criterion
from ..decode.stats import DecodeStats
from ..tracefile import ROLLOUT_MASK_WIDTH, accept_mask_column, rollout_mask_column
from .data import PromptTrace, ReplayTrace

__all__ = ["Shape", "default_shapes", "parse_shape", "Round", "ConfigReplay", "replay_config", "rule_kind"]


@dataclass(frozen=True)
class Shape:
    """A draft shape: ``widths`` per depth; ``expand_all`` = static full tree."""

    widths: tuple[int, ...]
    expand_all: bool = False

    @property
    def kind(self) -> str:
        if self.expand_all:
            return "static"
        return "chain" if max(self.widths) == 1 else "tree"

    @property
    def depth(self) -> int:
        return len(self.widths)

    @property
    def label(self) -> str:
        if self.kind == "chain":
            return f"chain k={self.depth}"
        if self.kind == "tree":
            return f"tree {self.widths[0]}x{self.depth}"
        return "static [" + ",".join(map(str, self.widths)) + "]"

    def nodes(self, budget: int | None = None) -> int:
        w = self.widths[: self.depth if budget is None else budget]
        if self.expand_all:
            return sum(prod(w[: i + 1]) for i in range(len(w)))
        return sum(w)

    def drafter_fronts(self, budget: int | None = None) -> list[int]:
        """Tokens per drafter forward in a round (the first is the catch-up over the pending tokens)."""
        b = self.depth if budget is None else budget
        if b == 0:
            return []
        if self.expand_all:
            return [1] + [prod(self.widths[:i]) for i in range(1, b)]
        return [1] * b

    def engine_args(self, spec: str) -> dict:
        """``speculative_generate`` keyword arguments for this shape under rule ``spec``."""
        if self.kind == "chain":
            return {"k": self.depth, "tree": None}
        if self.kind == "tree":
            if isinstance(parse_criterion(spec), TreeCoverage):
                return {"k": self.depth, "tree": None}
            return {"k": self.depth, "tree": (self.widths[0], self.depth)}
        return {"k": self.depth, "tree": list(self.widths)}

    def as_dict(self) -> dict:
        return {"kind": self.kind, "widths": list(self.widths), "expand_all": self.expand_all, "label": self.label}


def parse_shape(text: str) -> Shape:
    """``chain:K``, ``tree:M,DEPTH`` / ``M,DEPTH``, or ``static:W1,W2,...`` / ``[W1,W2,...]``."""
    s = str(text).strip().replace(" ", "")
    try:
        if s.startswith("chain:"):
            return Shape((1,) * _pos(s[6:]))
        if s.startswith("static:") or s.startswith("["):
            body = s[7:] if s.startswith("static:") else s.strip("[]")
            w = tuple(_pos(x) for x in body.split(",") if x)
            if not w:
                raise ValueError
            return Shape(w, True)
        body = s[5:] if s.startswith("tree:") else s
        m, d = body.split(",")
        return Shape((_pos(m),) * _pos(d))
    except ValueError:
        raise ValueError(f"tree shape {text!r}: expected chain:K, M,DEPTH (top-M along the greedy path) or "
                         "static:W1,W2,... (a static full tree)") from None


def _pos(x: str) -> int:
    v = int(x)
    if v < 1:
        raise ValueError
    return v


DEFAULT_KS = tuple(range(1, 9))
DEFAULT_TREE_WIDTHS = (2, 4)
DEFAULT_STATIC = ((4, 2, 1), (3, 2, 2, 1))


def rule_kind(spec: str) -> tuple[str, int | None]:
    """("strict" | "tree" | "levelset", tree width M for tree:M)."""
    c = parse_criterion(spec)
    if isinstance(c, TreeCoverage):
        return "tree", c.m
    return ("strict" if c.spec == "strict" else "levelset"), None


def default_shapes(spec: str, ks=DEFAULT_KS, tree_widths=DEFAULT_TREE_WIDTHS, static=DEFAULT_STATIC) -> list[Shape]:
    """Every shape replayed for a rule: chains k in ks, (m, k) trees, static trees.

    ``tree:M`` is the engine's tree-coverage rule (strict test on a width-M tree): its
    shapes are (M, k) for k in ks and the static trees whose widest level is M."""
    kind, m = rule_kind(spec)
    if kind == "tree":
        return [Shape((m,) * k) for k in ks] + [Shape(tuple(w), True) for w in static if max(w) == m]
    out = [Shape((1,) * k) for k in ks]
    out += [Shape((w,) * k) for w in tree_widths if w > 1 for k in ks]
    out += [Shape(tuple(w), True) for w in static]
    return out


@dataclass
class Round:
    start: int  # output position where the round starts
    budget: int  # depths drafted (0: the length limit leaves no room for a draft)
    accepted: int
    emitted: int
    depth_accepted: list[bool]  # per attempted depth
    exact: bool  # every decision of the round was made on the recorded path
    drift: int = 0  # accepted tokens that are not p's greedy token


@dataclass
class ConfigReplay:
    """Replay of one (rule, shape) over every prompt of a trace."""

    spec: str
    shape: Shape
    rounds: dict[str, list[Round]] = field(default_factory=dict)

    def accepted_lengths(self, pid: str) -> list[int]:
        return [r.accepted for r in self.rounds[pid]]

    def _all(self):
        return [r for rs in self.rounds.values() for r in rs]

    def stats(self) -> DecodeStats:
        """The replayed rounds of every prompt counted as the engine counts its own (``DecodeStats``):
        a round drafts the shape's nodes up to its budget; one target forward per round."""
        sh = self.shape
        st = DecodeStats(self.spec, sh.depth, None if sh.kind == "chain" else list(sh.widths),
                         num_accepted_tokens_per_pos=[0] * sh.depth, num_attempted_per_pos=[0] * sh.depth)
        for r in self._all():
            st.count_round(sh.nodes(r.budget), r.accepted, r.emitted, r.depth_accepted, r.drift)
        return st

    def totals(self) -> dict:
        """Figures of the replayed configuration (``replay.json``'s rows), from ``stats()``: the
        acceptance figures of ``decode --json`` under the same names (docs/metrics.md), and the
        replay's own exact rounds."""
        st = self.stats()
        exact = sum(r.exact for r in self._all())
        return {
            **st.acceptance_metrics(),
            "exact_rounds": exact,
            "exact_fraction": exact / st.num_rounds if st.num_rounds else 1.0,
        }

    def work(self) -> tuple[dict[int, int], dict[int, int]]:
        """(target verification sizes {tokens: count}, drafter forward sizes {tokens: count}) over all rounds,
        the pending token included (1 per round; the prompt prefill is counted separately)."""
        tv: dict[int, int] = {}
        dv: dict[int, int] = {}
        for r in self._all():
            n = 1 + self.shape.nodes(r.budget)
            tv[n] = tv.get(n, 0) + 1
            for f in self.shape.drafter_fronts(r.budget):
                dv[f] = dv.get(f, 0) + 1
        return tv, dv


def _children(pt: PromptTrace, d: int, pos: int):
    """(drafter's ranked proposals for step ``pos`` at draft depth ``d``, their log p, accept masks by spec).

    Depth 1 is the teacher-forced top-K; a feature drafter's deeper depths come from its own
    rollouts (trace/3) when recorded."""
    if d == 1 or pt.roll_ids is None:
        return pt.draft_ids[pos], pt.draft_logp[pos] if pt.draft_logp is not None else None, None
    return pt.roll_ids[pos, d - 2], pt.roll_logp[pos, d - 2], d - 2


def _passing(pt: PromptTrace, spec: str, kind: str, pos: int, w: int, d: int = 1) -> tuple[list[int], object]:
    """(drafter ranks (< w) the rule accepts at trace step ``pos``, depth ``d``; their log p under p)."""
    ids, lp, j = _children(pt, d, pos)
    if pt.broken[pos]:
        return [], lp
    if kind in ("strict", "tree"):
        g = pt.target_token[pos]
        return [r for r in range(min(w, ids.shape[0])) if ids[r] == g], lp
    if j is not None:
        m = int(pt.roll_mask[spec][pos, j])
    elif w == 1:
        return ([0] if pt.accepted[spec][pos] else []), lp
    else:
        m = int(pt.accept_mask[spec][pos])
    return [r for r in range(w) if (m >> r) & 1], lp


def walk_prompt(pt: PromptTrace, spec: str, shape: Shape, max_new_tokens: int, feature: bool = False,
                max_depth: int | None = None) -> list[Round]:
    """Replay one prompt.  ``feature``: a feature drafter, whose first round drafts nothing (the engine
    has no target feature before the prefill).  ``max_depth``: deepest depth the trace replays exactly."""
    kind, _ = rule_kind(spec)
    width = pt.draft_ids.shape[1] if pt.roll_ids is None or shape.depth == 1 else min(pt.draft_ids.shape[1], pt.roll_ids.shape[2])
    if max(shape.widths) > width:
        raise ValueError(f"tree shape {shape.label}: the trace stores the drafter's top-{width} only; "
                         f"use widths <= {width}")
    if kind == "levelset" and max(shape.widths) > 1 and spec not in pt.accept_mask:
        raise ValueError(f"{spec} on {shape.label}: the trace lacks {accept_mask_column(spec)} (recorded by an older "
                         "draftcert); re-record it with `draftcert profile --drafter ...`")
    if pt.roll_ids is not None and shape.depth > pt.roll_ids.shape[1] + 1:
        raise ValueError(f"{shape.label}: the trace records the feature drafter's rollouts to depth "
                         f"{pt.roll_ids.shape[1] + 1}; replay depths <= {pt.roll_ids.shape[1] + 1}")
    if pt.roll_ids is not None and kind == "levelset" and shape.depth > 1:
        if spec not in pt.roll_mask:
            raise ValueError(f"{spec} on {shape.label}: the trace lacks {rollout_mask_column(spec)}; re-record it")
        if max(shape.widths[1:]) > ROLLOUT_MASK_WIDTH:
            raise ValueError(f"{spec} on {shape.label}: below the root the trace records which of the feature "
                             f"drafter's top-{ROLLOUT_MASK_WIDTH} a level-set rule accepts; use widths <= "
                             f"{ROLLOUT_MASK_WIDTH} there (strict and tree:M take up to {pt.roll_ids.shape[2]})")
    T = len(pt)
    ended_by_eos = T < max_new_tokens
    rounds: list[Round] = []
    t, exact = 0, True
    while t < min(T, max_new_tokens):
        b = max(0, min(shape.depth, max_new_tokens - t - 1))
        if feature and t == 0:
            b = 0  # the engine's first round is the prefill: a feature drafter has nothing to draft from
        accepted, drift, dep, r_exact, stop_eos = 0, 0, [], exact, False
        for d in range(b):
            pos = t + d
            if pos >= T:
                break
            w = shape.widths[d]
            passing, lp = _passing(pt, spec, kind, pos, w, d + 1)
            r_exact = r_exact and exact and (max_depth is None or d < max_depth)
            dep.append(bool(passing))
            if not passing:
                break
            g = pt.target_token[pos]
            ids = _children(pt, d + 1, pos)[0]
            ranks = [r for r in passing if ids[r] == g]
            if ranks:
                rank = ranks[0]
            else:  # only non-greedy children pass: the real sequence leaves the recorded path here
                rank = max(passing, key=lambda r: (lp[r], -r)) if lp is not None else passing[0]
                drift += 1
                exact = False
            accepted += 1
            if ended_by_eos and pos == T - 1:
                stop_eos = True  # the accepted token is the recorded EOS: the output ends here
                break
            if not shape.expand_all and rank != 0:
                break  # a non-greedy drafter child is a leaf: the bonus token follows it
        emitted = accepted + (0 if stop_eos else 1)
        rounds.append(Round(t, b, accepted, emitted, dep, r_exact, drift))
        t += emitted
        if stop_eos:
            break
    return rounds


def replay_config(trace: ReplayTrace, spec: str, shape: Shape) -> ConfigReplay:
    out = ConfigReplay(spec, shape)
    for pt in trace.prompts:
        out.rounds[pt.id] = walk_prompt(pt, spec, shape, trace.max_new_tokens, trace.feature, trace.max_depth)
    return out
