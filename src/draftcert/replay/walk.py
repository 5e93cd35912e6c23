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

import numpy as np

from ..criteria import TreeCoverage, parse_criterion
from ..decode.stats import DecodeStats
from ..drafting.suffix import SuffixIndex, SuffixStore, graft
from ..models.tree_attention import DraftTree
from ..tracefile import ROLLOUT_MASK_WIDTH, accept_mask_column, rollout_mask_column
from .trace_reader import PromptTrace, ReplayTrace

__all__ = ["Shape", "default_shapes", "parse_shape", "Round", "ConfigReplay", "replay_config", "rule_kind",
           "walk_prompt", "walk_prompt_suffix", "new_suffix_index"]


@dataclass(frozen=True)
class Shape:
    """A draft shape: ``widths`` per depth; ``expand_all`` = static full tree; ``min_margin``: the
    drafter's confidence stop (nats; ``drafting.tree_growth``), for chains and (m, depth) trees."""

    widths: tuple[int, ...]
    expand_all: bool = False
    min_margin: float | None = None

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
        if self.min_margin is not None:  # drafts while the drafter's top-2 gap is >= min_margin
            head = f"k={self.depth}" if self.kind == "chain" else f"{self.widths[0]}x{self.depth}"
            return f"{head} gap>={self.min_margin:g}"
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
        stop = {} if self.min_margin is None else {"draft_margin": self.min_margin}
        if self.kind == "chain":
            return {"k": self.depth, "tree": None, **stop}
        if self.kind == "tree":
            if isinstance(parse_criterion(spec), TreeCoverage):
                return {"k": self.depth, "tree": None, **stop}
            return {"k": self.depth, "tree": (self.widths[0], self.depth), **stop}
        return {"k": self.depth, "tree": list(self.widths)}

    def as_dict(self) -> dict:
        return {"kind": self.kind, "widths": list(self.widths), "expand_all": self.expand_all, "label": self.label,
                "min_margin": self.min_margin}


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
    # with suffix candidates (``walk_prompt_suffix``): the round's draft nodes, model and grafted (None: the
    # shape's ``nodes(budget)``), whether its verification needs the tree mask, and the grafted nodes
    nodes: int | None = None
    tree_verify: bool | None = None
    grafted: int = 0
    grafted_accepted: int = 0
    nodes_exact: bool = True  # False: a graft followed a model node off the recorded path (count estimated)
    stopped: bool = False  # the drafter's confidence stop ended the draft before the shape's depth

    def n_nodes(self, shape: "Shape") -> int:
        """Draft nodes the round verifies (the pending token excluded)."""
        return shape.nodes(self.budget) if self.nodes is None else self.nodes

    def verified_as_tree(self, shape: "Shape") -> bool:
        return shape.kind != "chain" if self.tree_verify is None else self.tree_verify


@dataclass
class ConfigReplay:
    """Replay of one (rule, shape) over every prompt of a trace."""

    spec: str
    shape: Shape
    rounds: dict[str, list[Round]] = field(default_factory=dict)
    suffix: bool = False  # the model drafter's tree plus suffix-match candidates (``walk_prompt_suffix``)

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
            st.count_round(r.n_nodes(sh), r.accepted, r.emitted, r.depth_accepted, r.drift)
        return st

    def totals(self) -> dict:
        """Figures of the replayed configuration (``replay.json``'s rows), from ``stats()``: the
        acceptance figures of ``decode --json`` under the same names (docs/metrics.md), and the
        replay's own exact rounds."""
        st = self.stats()
        rounds = self._all()
        exact = sum(r.exact for r in rounds)
        out = {
            **st.acceptance_metrics(),
            "exact_rounds": exact,
            "exact_fraction": exact / st.num_rounds if st.num_rounds else 1.0,
        }
        if self.suffix:  # HybridDrafter's counters: grafted nodes proposed / accepted
            out["suffix_drafted"] = sum(r.grafted for r in rounds)
            out["suffix_accepted"] = sum(r.grafted_accepted for r in rounds)
            out["node_count_estimated_rounds"] = sum(not r.nodes_exact for r in rounds)
        return out

    def work(self) -> tuple[dict[int, int], dict[int, int]]:
        """(target verification sizes {tokens: count}, drafter forward sizes {tokens: count}) over all rounds,
        the pending token included (1 per round; the prompt prefill is counted separately)."""
        tv: dict[int, int] = {}
        dv: dict[int, int] = {}
        for r in self._all():
            n = 1 + r.n_nodes(self.shape)
            tv[n] = tv.get(n, 0) + 1
            for f in self.shape.drafter_fronts(r.budget) + ([1] if r.stopped else []):  # a stop read one more q
                dv[f] = dv.get(f, 0) + 1
        return tv, dv


def _children(pt: PromptTrace, d: int, pos: int):
    """(drafter's ranked proposals for step ``pos`` at draft depth ``d``, their log p, accept masks by spec).

    Depth 1 is the teacher-forced top-K; a feature drafter's deeper depths come from its own
    rollouts (trace/3) when recorded."""
    if d == 1 or pt.roll_ids is None:
        return pt.draft_ids[pos], pt.draft_logp[pos] if pt.draft_logp is not None else None, None
    return pt.roll_ids[pos, d - 2], pt.roll_logp[pos, d - 2], d - 2


def drafter_margin(pt: PromptTrace, d: int, pos: int) -> float | None:
    """The drafter's top-2 logit gap for step ``pos`` at draft depth ``d`` (log q_(1) - log q_(2) of the
    teacher-forced top-K at depth 1 or for a model drafter; a feature drafter's recorded rollout gap
    below); None where the trace does not hold it."""
    if d > 1 and pt.roll_gap is not None:
        return float(pt.roll_gap[pos, d - 2])
    if pt.draft_probs is None or pt.draft_probs.shape[1] < 2:
        return None
    q1, q2 = float(pt.draft_probs[pos, 0]), float(pt.draft_probs[pos, 1])
    if q1 <= 0:
        return 0.0
    return float("inf") if q2 <= 0 else float(np.log(q1) - np.log(q2))


def _stop_budget(pt: PromptTrace, shape: Shape, t: int, b: int) -> tuple[int, bool]:
    """(the depths a round at output position t drafts, whether the confidence stop cut them): the drafter
    stops at the first depth whose margin is below ``shape.min_margin``, before any verification, as
    ``tree_growth.grow_tree`` does (past a rejection the recorded path's margins stand in: an estimate)."""
    if shape.min_margin is None or shape.expand_all:
        return b, False
    for d in range(min(b, len(pt) - t)):
        gap = drafter_margin(pt, d + 1, t + d)
        if gap is not None and gap < shape.min_margin:
            return d, True
    return b, False


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
    kind = _check_shape(pt, spec, shape)
    T = len(pt)
    ended_by_eos = T < max_new_tokens
    rounds: list[Round] = []
    t, exact = 0, True
    while t < min(T, max_new_tokens):
        b = max(0, min(shape.depth, max_new_tokens - t - 1))
        if feature and t == 0:
            b = 0  # the engine's first round is the prefill: a feature drafter has nothing to draft from
        b, stopped = _stop_budget(pt, shape, t, b)
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
        # past a rejection the drafter drafted on from its own token, whose margins the trace does not hold:
        # where a confidence stop was checked there, the round's node count is the path's estimate
        rejected = bool(dep) and not dep[-1]
        estimated = shape.min_margin is not None and rejected and (stopped or len(dep) < b)
        rounds.append(Round(t, b, accepted, emitted, dep, r_exact, drift, stopped=stopped, nodes_exact=not estimated))
        t += emitted
        if stop_eos:
            break
    return rounds


def _check_shape(pt: PromptTrace, spec: str, shape: Shape) -> str:
    """The rule's kind, after refusing a shape the trace cannot replay (ValueError naming why)."""
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
    return kind


def new_suffix_index() -> SuffixIndex:
    """The suffix index a replay of ``DRAFTER+suffix`` drives: ``drafting.suffix.HybridDrafter``'s default
    settings, on a store of its own (``SuffixStore()``'s bounds) that starts empty, so that no output
    of this process leaks into the replay (``SHARED_STORE`` is left alone)."""
    return SuffixIndex(store=SuffixStore())


def walk_prompt_suffix(pt: PromptTrace, spec: str, shape: Shape, max_new_tokens: int, prompt: list[int],
                       index: SuffixIndex, feature: bool = False, max_depth: int | None = None) -> list[Round]:
    """Replay one prompt with ``DRAFTER+suffix`` (``drafting.suffix.HybridDrafter``): every round's tree is
    the model drafter's tree with the suffix candidate chain grafted onto it, as the engine builds it.

    ``prompt``: the prompt's token ids; ``index``: the suffix index, carried from prompt to prompt in
    decode order (its store holds the earlier prompts' outputs; ``index.start(prompt)`` is called here).
    Per round, at output position t with remaining budget ``R = max_new_tokens - t - 1``:

    * the suffix chain is ``index.draft(seq, [1] * b, False, R)`` on ``seq`` = prompt + the tokens emitted
      so far, with b = min(depth, R): the call ``HybridDrafter.propose`` makes (the same index, synced
      every round, so its state and store are the engine's);
    * the model tree is ``propose.grow_tree``'s shape cut to b (nothing in a feature drafter's first
      round), its tokens the trace's proposals (depth 1 the teacher-forced top-K, deeper the feature
      drafter's rollouts) at each expanded node;
    * ``suffix.graft`` joins them (no duplicate sibling tokens; grafted nodes are never expanded);
    * the accept walk is the engine's: at each reached node whose children were drafted, the children
      the rule accepts at that step; the one with the largest p is accepted (for strict: the target's
      greedy token), and the walk goes on below it while it has children.

    Strict rules are exact as long as the trace's proposals are the drafter's (the same argument as
    ``walk_prompt``): every node the walk reaches lies on the recorded path.  The number of draft
    nodes is exact unless the chain follows a model node off the recorded path (whose children the
    trace does not hold; the recorded ones at that step stand in, ``nodes_exact=False``).  Relaxed
    rules decide a grafted token from the rule's accept mask when it is among the drafter's recorded
    proposals there, else accept it when it is the target's greedy token and reject it otherwise
    (those rounds are marked inexact); after a non-greedy acceptance, the aligned estimate of
    ``walk_prompt``.
    """
    kind = _check_shape(pt, spec, shape)
    T = len(pt)
    ended_by_eos = T < max_new_tokens
    g = pt.target_token
    index.start(list(prompt))
    seq = [int(x) for x in prompt]
    rounds: list[Round] = []
    t, exact = 0, True
    while t < min(T, max_new_tokens):
        remaining = max_new_tokens - t - 1
        b = max(0, min(shape.depth, remaining))
        chain = index.draft(seq, [1] * b, False, remaining).tokens  # HybridDrafter.propose's call
        model_b = 0 if (feature and t == 0) else b  # a feature drafter drafts nothing before the prefill
        model_b, stopped = _stop_budget(pt, shape, t, model_b)  # the model drafter's confidence stop
        tree, rank_of, on_path = _model_tree(pt, shape, t, model_b)
        n_model = len(tree)
        n_graft = graft(tree, chain)
        nodes_exact = _graft_stays_known(tree, n_model, chain, on_path)
        kids = tree.children_table()
        accepted, drift, grafted_acc, dep, r_exact, stop_eos = 0, 0, 0, [], exact, False
        row, depth = -1, 0
        while kids[row + 1]:
            s = t + depth
            if s >= T:
                break
            model_kids = [c for c in kids[row + 1] if c < n_model]
            if model_kids:
                r_exact = r_exact and (max_depth is None or depth < max_depth)
            passing, known = _passing_nodes(pt, spec, kind, s, depth + 1, tree, kids[row + 1], rank_of, n_model,
                                            shape.widths[depth] if depth < len(shape.widths) else 1)
            r_exact = r_exact and exact and known
            dep.append(bool(passing))
            if not passing:
                break
            greedy = [c for c, _ in passing if tree.tokens[c] == g[s]]
            if greedy:
                node = greedy[0]
            else:  # only non-greedy children pass: the real sequence leaves the recorded path here
                node = max(passing, key=lambda cl: cl[1])[0]
                drift += 1
                exact = False
            accepted += 1
            grafted_acc += node >= n_model
            if ended_by_eos and s == T - 1:
                stop_eos = True  # the accepted token is the recorded EOS: the output ends here
                break
            row, depth = node, depth + 1
        emitted = accepted + (0 if stop_eos else 1)
        rounds.append(Round(t, model_b, accepted, emitted, dep, r_exact, drift, nodes=len(tree),
                            tree_verify=not tree.is_chain, grafted=n_graft, grafted_accepted=grafted_acc,
                            nodes_exact=nodes_exact, stopped=stopped))
        seq += [int(x) for x in g[t : t + emitted]]  # the recorded path (the real one while exact)
        t += emitted
        if stop_eos:
            break
    return rounds


def _model_tree(pt: PromptTrace, shape: Shape, t: int, b: int) -> tuple[DraftTree, dict[int, int], dict[int, bool]]:
    """The model drafter's tree of a round at output position t with budget b, as ``propose.grow_tree``
    grows it (every front node gets its top-w children; the next front is all of them for a static tree,
    else the first front node's first child), tokens from the trace (``_children``).
    Returns (tree, drafter rank of each node among its siblings, node lies on the recorded path)."""
    tree = DraftTree()
    rank_of: dict[int, int] = {}
    on_path: dict[int, bool] = {-1: True}
    front = [-1]
    T = len(pt)
    for d in range(1, b + 1):
        w, s = shape.widths[d - 1], t + d - 1
        groups = []
        for f in front:
            ids = _children(pt, d, s)[0] if s < T else []
            group = []
            for r in range(w):
                tok = int(ids[r]) if r < len(ids) else -2 - len(tree)  # no recorded proposal: a token nothing matches
                node = tree.add(tok, f)
                rank_of[node] = r
                on_path[node] = on_path[f] and s < T and tok == int(pt.target_token[s])
                group.append(node)
            groups.append(group)
        if d == b:
            break
        front = [n for grp in groups for n in grp] if shape.expand_all else [groups[0][0]]
    return tree, rank_of, on_path


def _graft_stays_known(tree: DraftTree, n_model: int, chain: list[int], on_path: dict[int, bool]) -> bool:
    """Did the graft only look at children of nodes whose children the trace records exactly (the root
    and model nodes on the recorded path)?  Else the count of grafted nodes is an estimate."""
    node = -1
    for tok in chain:
        if not on_path.get(node, False) and any(p == node and i < n_model for i, p in enumerate(tree.parents)):
            return False  # the chain walks below a model node off the recorded path
        nxt = next((i for i, (p, x) in enumerate(zip(tree.parents, tree.tokens)) if p == node and x == tok), None)
        if nxt is None or nxt >= n_model:
            return True  # from here on the chain is grafted: its nodes are new whatever the model proposed
        node = nxt
    return True


def _passing_nodes(pt: PromptTrace, spec: str, kind: str, s: int, d: int, tree: DraftTree, children: list[int],
                   rank_of: dict[int, int], n_model: int, w: int) -> tuple[list[tuple[int, tuple]], bool]:
    """([(child, order key)] the rule accepts at step s, depth d; whether every decision is known exactly).

    Order key: larger = larger p (the engine takes the passing child with the largest logit; the
    drafter's order among ties)."""
    if pt.broken[s]:
        return [], True
    gs = int(pt.target_token[s])
    if kind in ("strict", "tree"):
        return [(c, (1,)) for c in children if tree.tokens[c] == gs], True
    model_ranks = [rank_of[c] for c in children if c < n_model]
    if model_ranks:  # model nodes lie at depths the trace records (_check_shape)
        ids, lp, _ = _children(pt, d, s)
        passing_ranks = set(_passing(pt, spec, kind, s, w, d)[0])
    out, known = [], True
    for i, c in enumerate(children):
        tok = tree.tokens[c]
        if c < n_model:
            r = rank_of[c]
            ok = r in passing_ranks
            logp = float(lp[r]) if lp is not None else float("-inf")
        else:  # a grafted token: the rule's verdict where the trace records it for this token
            verdict = _recorded_verdict(pt, spec, kind, s, d, tok)
            if verdict is None:
                ok, logp, known = tok == gs, float("-inf"), False
            else:
                ok, logp = verdict
        if ok:
            out.append((c, (float("inf") if tok == gs else logp, -i)))
    return out, known


def _recorded_verdict(pt: PromptTrace, spec: str, kind: str, s: int, d: int, tok: int) -> tuple[bool, float] | None:
    """(does the rule accept token ``tok`` at step s, its log p) where the trace records the rule's verdict on
    that token at step s, else None.  A level-set rule's verdict depends on p at step s and the token only,
    so every recorded proposal at step s answers it: the drafter's at depth d (its rollouts, trace/3) and,
    failing that or below the deepest recorded rollout (a suffix chain runs deeper than the model's draft,
    up to the length budget), its teacher-forced top-K at depth 1."""
    for depth in dict.fromkeys((d, 1)):
        if depth > 1 and (pt.roll_ids is None or depth - 2 >= pt.roll_ids.shape[1]):
            continue
        ids, lp, _ = _children(pt, depth, s)
        mask_width = _mask_width(pt, spec, depth)
        r = next((j for j in range(min(len(ids), mask_width)) if int(ids[j]) == tok), None)
        if r is not None:
            ok = r in set(_passing(pt, spec, kind, s, mask_width, depth)[0])
            return ok, float(lp[r]) if lp is not None else float("-inf")
    return None


def _mask_width(pt: PromptTrace, spec: str, d: int) -> int:
    """How many of the drafter's ranked proposals at depth d the trace records the rule's verdict for."""
    if d == 1 or pt.roll_ids is None:
        return pt.draft_ids.shape[1] if spec in pt.accept_mask else 1
    return ROLLOUT_MASK_WIDTH if spec in pt.roll_mask else 0


def replay_config(trace: ReplayTrace, spec: str, shape: Shape, prompts: list[tuple[str, list[int]]] | None = None) -> ConfigReplay:
    """Replay (spec, shape) over every prompt of the trace.  ``prompts``: for ``DRAFTER+suffix``, every
    prompt's (id, token ids) in decode order: the prompts are replayed in that order with one suffix
    index (``new_suffix_index``), whose store carries each output to the later prompts, as one
    ``HybridDrafter`` decoding them in turn does; None: the model drafter alone (``walk_prompt``)."""
    out = ConfigReplay(spec, shape, suffix=prompts is not None)
    if prompts is None:
        for pt in trace.prompts:
            out.rounds[pt.id] = walk_prompt(pt, spec, shape, trace.max_new_tokens, trace.feature, trace.max_depth)
        return out
    by_id = {pt.id: pt for pt in trace.prompts}
    index = new_suffix_index()
    for pid, ids in prompts:
        out.rounds[pid] = walk_prompt_suffix(by_id[pid], spec, shape, trace.max_new_tokens, ids, index,
                                             trace.feature, trace.max_depth)
    return out
