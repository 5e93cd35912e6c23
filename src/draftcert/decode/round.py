"""The stages of one speculative round: propose -> verify -> accept -> certify -> record.

    draft   = propose_draft(drafter, seq, widths, ...)          # a chain of k tokens, or a tree of N nodes
    n_cached, _ = catch_up(target, cache, n_cached, pending, len(draft), layout)  # recurrent state: bound re-fed rows
    logits  = verify(target, cache, n_cached, pending, draft)   # ONE target forward over [pending] + nodes: [1 + N, V]
    verdict = accept(rule, logits, draft, summary_k, eos)       # walk the tree: accepted path, emitted tokens, drift
    certs   = certify(rule, verdict, draft)                     # KL(p || q) < radius at every expanded node
    log     = record(stats, draft, verdict, certs)              # the round's RoundLog, counted into DecodeStats

After verification both loops (``engine.decode_loop``, one prompt; ``batch``, one pass for many)
run the same code on each row: ``settle`` (accept, certify, record) and ``emit`` (the row's new
tokens, the round's callback, the end of the row); only the cache roll-back differs.  The loops, the
cost curve that times the stages (``costs``) and the shape choice above it (``shape``, ``-k auto``)
all import the stages from here, so the layers inside ``decode`` only go down:
config -> round -> costs -> shape -> engine -> batch.

Acceptance at a node whose target distribution is p and whose drafted children are c_1..c_m
(m = 1 for a chain): the criterion's level-set rule keeps the children with p(c) not in the lower
level set {y : p(y) < tau(p)}; among them the one with the largest p is accepted (for ``strict``
that is the target's argmax, so strict is lossless: every emitted token is the target's greedy
token at its prefix).  If none passes, the target's greedy token is emitted instead and the round
ends; at a leaf it is the bonus token.  Certificates: see ``certify``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..certificates import certify_rows, radius_rows
from ..criteria import LevelSet, TreeCoverage
from ..models.cache_state import Layout, layer_masks, layout_of
from ..models.hf import forward_with_hidden, model_forward
from ..models.tree_attention import DraftTree, tree_allowed, tree_position_ids
from ..summary import Summary, argmax_lowest, summarize
from .config import DecodeConfig
from .stats import CertificateViolation, DecodeStats, RoundLog

__all__ = ["propose_draft", "catch_up", "verify", "accept", "certify", "record", "settle", "emit", "Verdict",
           "RoundCertificates", "DecodeRow"]


# ---------------------------------------------------------------------------
# the stages of a round: propose -> verify -> accept -> certify -> record


def propose_draft(draft_src, seq: list[int], widths: list[int], expand_all: bool, remaining: int,
                  min_margin: float | None = None, keep_drafting=None) -> DraftTree:
    """The round's draft tree: ``widths`` cut to ``remaining`` (the tokens still allowed after the
    bonus one), so no draft runs past the length limit.  A suffix drafter's matches may run deeper
    than ``widths``; its ``depth_limit`` is set to ``remaining`` first.  ``min_margin``: the
    drafter's confidence stop; ``keep_drafting``: its draft length from confidence (both
    ``drafting.tree_growth``)."""
    draft_src.depth_limit = remaining
    draft_src.min_margin = min_margin
    draft_src.keep_drafting = keep_drafting
    return draft_src.propose(seq, list(widths[: min(len(widths), remaining)]), expand_all)


# The most rows a verification pass over recurrent state takes before the re-fed tokens are
# caught up in a pass of their own: on a CPU passes of up to 16 rows cost about one (the
# linear_chooser / block_matmul kernels read the weights once for 1..16 rows; docs/speed.md).
MAX_PASS_ROWS = 16


def catch_up(target, cache, n_cached: int, pending: list[int], n_draft: int, layout: Layout, with_hidden: bool = False,
             stats: DecodeStats | None = None):
    """Keep a recurrent model's re-fed tokens bounded: (n_cached, hidden of the fed rows or None).

    A model with recurrent state that rejected part of a draft goes back to the state before the
    pass (``state.CacheState.keep``), and the accepted tokens become pending rows of the next pass:
    no extra forward.  Rounds that each reject something would grow the pending rows without end,
    so when pending + draft exceed ``MAX_PASS_ROWS``, all pending tokens but the last are fed in a
    pass of their own first (counted in ``stats.catchup_forwards``): the state is exact after them,
    and the verification pass starts from there with one pending token, as on attention layers.
    Attention-only and token-by-token (``stepwise``) models are left as they are.
    """
    if not layout.stateful or layout.stepwise or len(pending) < 2 or len(pending) + n_draft <= MAX_PASS_ROWS:
        return n_cached, None
    fed = pending[:-1]
    res = (forward_with_hidden if with_hidden else model_forward)(target, cache, fed, 1)
    if stats is not None:
        stats.catchup_forwards += 1
    return n_cached + len(fed), (res[1] if with_hidden else None)


def verify(target, cache, n_cached: int, pending: list[int], draft: DraftTree, with_hidden: bool = False,
           layout: Layout | None = None, stats: DecodeStats | None = None):
    """The target's one forward pass over the pending tokens and every draft node.

    ``cache`` holds the first ``n_cached`` tokens of the sequence; ``pending`` (P tokens,
    at least the last emitted one) and the N nodes of ``draft`` are fed after it, a tree
    with the tree attention mask and position ids (``tree.py``; per layer kind, ``state.layer_masks``).
    The cache then holds all P + N of them (``state.CacheState.keep`` rolls it back to the accepted path).
    A ``layout.stepwise`` model (multi-token passes do not continue its state) is fed one token at a
    time after its prefill, the extra passes counted in ``stats.stepwise_forwards``.

    Returns (logits [1 + N, V], hidden [P + N, H] or None): logits row 0 is the target's
    next-token distribution after the last pending token, row 1 + i the one after node i;
    with ``with_hidden`` the target's final hidden states of all P pending tokens and N
    nodes come along (for a feature drafter).
    """
    n = len(draft)
    fwd = forward_with_hidden if with_hidden else model_forward
    if layout is not None and layout.stepwise and (n > 0 if n_cached == 0 else len(pending) + n > 1):
        return _verify_stepwise(target, cache, n_cached, pending, draft, with_hidden, stats)
    if draft.is_chain:  # ordinary causal attention
        out = fwd(target, cache, pending + draft.tokens, n + 1)
    else:
        dev = target.device
        anc = draft.ancestors(dev)  # [N, N]
        nodes = torch.arange(n, device=dev)
        pos = tree_position_ids(n_cached, len(pending), torch.tensor(draft.depths, device=dev))  # [1, P + N]
        allowed = tree_allowed(n_cached, len(pending), anc, nodes, nodes)  # [P + N, S + P + N]
        k_pos = torch.cat([torch.arange(n_cached, device=dev), pos[0]])[None]  # [1, S + P + N]
        mask = layer_masks(layout or layout_of(target), allowed[None], pos, k_pos, target.dtype)  # [1, 1, P + N, S + P + N]
        out = fwd(target, cache, pending + draft.tokens, n + 1, mask, pos)
    return out if with_hidden else (out, None)


def _verify_stepwise(target, cache, n_cached, pending, draft, with_hidden, stats):
    """``verify`` of a chain one token at a time (the prompt's prefill, from an empty state, in one pass)."""
    fwd = forward_with_hidden if with_hidden else model_forward
    ids = pending + draft.tokens
    chunks = [ids[: len(pending)]] + [[t] for t in draft.tokens] if n_cached == 0 else [[t] for t in ids]
    logits, hidden = [], []
    for chunk in chunks:
        res = fwd(target, cache, chunk, 1)
        lg, h = res if with_hidden else (res, None)
        logits.append(lg)
        hidden.append(h)
    if stats is not None:
        stats.stepwise_forwards += len(chunks) - 1
    out = torch.cat(logits[-(len(draft) + 1):])  # [1 + N, V]
    return (out, torch.cat(hidden)) if with_hidden else (out, None)


@dataclass
class Verdict:
    """What the accept stage decided on one round's verification logits."""

    summary: Summary | None  # the target's top-k view of the 1 + N verification rows (row 0: root, row 1 + i: node i); None: no draft
    passed: list[bool]  # [1 + N]: some drafted child of the row passes the rule
    path: list[int]  # accepted nodes, root downwards
    rows: list[int]  # rows reached whose children were drafted: one per attempted depth 1, 2, ...
    emitted: list[int]  # the accepted draft tokens, then the target's greedy token (none after an accepted EOS)
    drift: int  # accepted tokens that are not the target's greedy token at their prefix
    divergence_spent: float  # nats: sum over those tokens x of log p(greedy) - log p(x)


def accept(rule: LevelSet, logits: torch.Tensor, draft: DraftTree, summary_k: int, eos=frozenset()) -> Verdict:
    """Walk the draft tree from the root, accepting what ``rule`` accepts.

    ``logits`` [1 + N, V] are ``verify``'s.  At a row with target distribution p and drafted
    children c_1..c_m (m = 1 for a chain), the rule keeps the children outside its lower
    level set {y : p(y) < tau(p)}, evaluated exactly on the given logits (``accept_ids``:
    float64 where the error bounds settle it, arbitrary precision near the threshold).
    Among them the one with the largest logit (an exact order; ties: the drafter's order)
    is accepted and the walk continues below it; if none passes, or at a leaf, the
    target's greedy token at that row is emitted and the round ends.  An accepted EOS
    ends the output right there (no target token after it).

    The summary (top-``summary_k``, one ``summarize`` of the logits) is kept in the
    verdict for ``certify``.
    """
    n = len(draft)
    if n == 0:  # nothing drafted: the target's greedy token (lowest id among ties), as greedy decoding takes it
        return Verdict(None, [False], [], [], [argmax_lowest(logits[0])], 0, 0.0)
    summ = summarize(logits=logits, k=summary_k, entropy=rule.needs_entropy)
    greedy = summ.top_ids[:, 0].tolist()  # [1 + N] the target's greedy token per row (lowest id among ties)
    children = draft.children_table()  # [1 + N] lists, in the drafter's rank order
    passed, best, logp_child = [False] * (n + 1), [0] * (n + 1), None
    if n:
        width = max(len(c) for c in children)
        C = torch.tensor([c + [-1] * (width - len(c)) for c in children], device=logits.device)  # [1 + N, width]
        tok = torch.tensor(draft.tokens, device=logits.device)[C.clamp(min=0)]  # [1 + N, width] child tokens
        lx = logits.gather(1, tok)  # [1 + N, width]
        logp_child = lx.double() - summ.log_norm[:, None]  # same formula as Summary.prob_of
        ok = torch.stack([rule.accept_ids(summ, tok[:, j]) for j in range(width)], 1) & (C >= 0)
        best_t = torch.where(ok, lx, torch.full_like(lx, -torch.inf)).argmax(1)  # [1 + N]
        passed, best = ok.any(1).tolist(), best_t.tolist()

    path, reached, r = [], [0], 0  # reached: rows 0, 1 + path[0], ...
    while passed[r]:
        node = children[r][best[r]]
        path.append(node)
        r = node + 1
        reached.append(r)
        if draft.tokens[node] in eos:
            reached.pop()  # the output ends at this EOS: nothing after it is verified
            break
    emitted = [draft.tokens[i] for i in path]
    if len(reached) > len(path):
        emitted.append(greedy[r])

    drift, spent = 0, 0.0
    if path:
        log_p_max = torch.log(summ.top_probs[:, 0])  # [1 + N]
        for parent, node in zip(reached, path):
            if draft.tokens[node] != greedy[parent]:
                drift += 1
                spent += float(log_p_max[parent] - logp_child[parent, best[parent]])
    rows = [row for row in reached if children[row]]
    return Verdict(summ, passed, path, rows, emitted, drift, spent)


class RoundCertificates(NamedTuple):
    """The certify stage's result: one entry per expanded node (``draft.expanded``)."""

    rows: list[int]  # verification row of the expanded node (0: the root, 1 + i: node i)
    divergence: list[float]  # proven upper bound on KL(p || q)
    radius: list[float]  # proven lower bound on the radius
    certified: list[bool]  # divergence < radius


def certify(rule: LevelSet, verdict: Verdict, draft: DraftTree) -> RoundCertificates | None:
    """Certificates at every expanded node, reached or not (the implication holds at any node).

    At a node with target distribution p (its verification row) whose children the drafter
    proposed from logits q (its top ``w``): certified = KL(p || q) < radius, with

        radius = radius(rule, p)                              (w = 1, or the rule rejects argmax p)
        radius = max(radius(rule, p), radius(tree:w, p))      (w > 1 and the rule accepts argmax p)

    (covering the target's argmax among the w candidates guarantees acceptance only where the
    rule accepts the argmax; a user LevelSet, or entropy with DELTA >= 1, may reject it).  The
    decision is the core's ``certify_rows``: the same upper bound on KL and comparison as
    ``certified`` (docs/theory.md, section 7).  Certified but rejected raises
    ``CertificateViolation``: it is a bug.  None when the drafter gives no distribution.
    """
    if draft.q is None or not draft.expanded:
        return None
    summ = verdict.summary
    er = torch.tensor(draft.expanded, device=summ.top_probs.device) + 1  # [E] rows of the expanded nodes
    sub = summ.select(er)  # [E rows]
    rad = radius_rows(rule, sub, "forward")  # [E]
    w = torch.tensor(draft.widths, device=er.device)  # [E]
    takes_max = rule.accept_ids(sub, sub.top_ids[:, 0])  # [E] does the rule accept the argmax?
    for m in sorted(set(draft.widths)):
        if m > 1:
            use = (w == m) & takes_max
            rad = torch.where(use, torch.maximum(rad, radius_rows(TreeCoverage(m), sub, "forward")), rad)
    cert = certify_rows(sub, draft.q.to(er.device), rad, "forward")  # divergence, certified: [E]
    out = RoundCertificates(er.tolist(), cert.divergence.tolist(), rad.tolist(), cert.certified.tolist())
    for i, row in enumerate(out.rows):
        if out.certified[i] and not verdict.passed[row]:
            raise CertificateViolation(
                f"certified but rejected at tree row {row}: KL(p||q) <= {out.divergence[i]!r} < radius "
                f"{out.radius[i]!r} under {rule.spec} (width {draft.widths[i]}); this is a bug, please report it"
            )
    return out


def record(stats: DecodeStats, draft: DraftTree, verdict: Verdict, certs: RoundCertificates | None) -> RoundLog:
    """The round's log: per attempted depth whether it was accepted and its certificate; counted into ``stats``."""
    n_acc = len(verdict.path)
    log = RoundLog(
        num_draft_tokens=len(draft), num_accepted_tokens=n_acc, emitted=verdict.emitted,
        from_draft=[True] * n_acc + [False] * (len(verdict.emitted) - n_acc),
        drift_tokens=verdict.drift, divergence_spent=verdict.divergence_spent,
    )
    at = {} if certs is None else {row: i for i, row in enumerate(certs.rows)}
    for row in verdict.rows:
        i = at.get(row)
        log.depths.append(1 if row == 0 else draft.depths[row - 1] + 1)
        log.depth_accepted.append(verdict.passed[row])
        log.certified.append(None if i is None else certs.certified[i])
        log.kl.append(None if i is None else certs.divergence[i])
        log.radius.append(None if i is None else certs.radius[i])
    if certs is not None:
        log.checked_positions = len(certs.rows)
        log.certified_positions = sum(certs.certified)
    stats.add_round(log)
    return log


# ---------------------------------------------------------------------------
# after verification: the same code for a row of either loop


@dataclass
class DecodeRow:
    """One prompt's decoding state: its drafter, its statistics, the sequence so far."""

    prompt: list[int]
    drafter: object  # a drafting.Drafter
    stats: DecodeStats
    seq: list[int] = field(default_factory=list)  # prompt + new tokens
    out: list[int] = field(default_factory=list)  # new tokens
    n_cached: int = 0  # the target's cache holds seq[:n_cached] for this row
    index: int = 0  # the row's place in the caller's batch
    done: bool = False

    def __post_init__(self):
        if not self.seq:
            self.seq = list(self.prompt)


def settle(config: DecodeConfig, stats: DecodeStats, logits: torch.Tensor, draft: DraftTree,
           spent: list[float] | None = None) -> tuple[Verdict, RoundLog]:
    """accept -> certify -> record on one row's verification logits [1 + N, V]: (the verdict, the
    round's log, counted into ``stats``).  ``spent``: the accept, certify and record seconds are
    added to its entries 2, 3 and 4 (``stats.STAGES``)."""
    clock = time.perf_counter
    t0 = clock()
    verdict = accept(config.rule, logits, draft, config.summary_k, config.eos)
    t1 = clock()
    certs = certify(config.rule, verdict, draft) if config.certificates else None
    t2 = clock()
    log = record(stats, draft, verdict, certs)
    if spent is not None:
        spent[2] += t1 - t0
        spent[3] += t2 - t1
        spent[4] += clock() - t2
    return verdict, log


def emit(config: DecodeConfig, row: DecodeRow, verdict: Verdict, log: RoundLog, on_round=None, stop=None) -> bool:
    """The round's emitted tokens onto ``row``, ``on_round(log)``; True where the row ends: EOS, the
    length limit, or ``stop(new_tokens)`` returning n (the first n new tokens are kept)."""
    row.seq += verdict.emitted
    row.out += verdict.emitted
    if on_round is not None:
        on_round(log)
    if verdict.emitted and verdict.emitted[-1] in config.eos:
        return True
    if stop is not None and (keep := stop(row.out)) is not None:
        del row.out[keep:]
        return True
    return len(row.out) >= config.max_new_tokens
