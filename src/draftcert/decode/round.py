"""The stages of one speculative round: propose -> verify -> accept -> certify -> record.

    draft   = propose_draft(drafter, seq, widths, ...)          # a chain of k tokens, or a tree of N nodes
    n_cached, _ = catch_up(target, cache, n_cached, pending, len(draft), layout)  # recurrent state: bound re-fed rows
    logits  = verify(target, cache, n_cached, pending, draft)   # ONE target forward over [pending] + nodes: [1 + N, V]
    verdict = accept(rule, logits, draft, summary_k, eos)       # walk the tree: accepted path, emitted tokens, drift
    certs   = certify(rule, verdict, draft, logits)             # KL(p || q) < radius at every expanded node
                                                                # (the engine: several rounds at once, CertificateBatch)
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

import math

import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np
import torch

from ..certificates import certify_rows, radius_rows
from ..criteria import LevelSet, Strict, TreeCoverage
from ..models.cache_state import Layout, layer_masks, layout_of
from ..models.hf import forward_with_hidden, model_forward
from ..models.tree_attention import DraftTree, tree_allowed, tree_position_ids
from ..summary import Summary, argmax_lowest, summarize
from .config import DecodeConfig
from .stats import CertificateViolation, DecodeStats, RoundLog

__all__ = ["propose_draft", "catch_up", "verify", "accept", "certify", "record", "settle", "emit", "Verdict",
           "RoundCertificates", "DecodeRow", "CertificateBatch", "RowBuffer", "CERT_BATCH_ROWS", "CERT_BATCH_SECONDS",
           "accept_strict", "certify_summary", "fill_certificates"]


# ---------------------------------------------------------------------------
# the stages of a round: propose -> verify -> accept -> certify -> record


def propose_draft(draft_src, seq: list[int], widths: list[int], expand_all: bool, remaining: int,
                  min_margin: float | None = None, keep_drafting=None, keep_grafting=None) -> DraftTree:
    """The round's draft tree: ``widths`` cut to ``remaining`` (the tokens still allowed after the
    bonus one), so no draft runs past the length limit.  A suffix drafter's matches may run deeper
    than ``widths``; its ``depth_limit`` is set to ``remaining`` first.  ``min_margin``: the
    drafter's confidence stop; ``keep_drafting``: its draft length from confidence (both
    ``drafting.tree_growth``); ``keep_grafting``: whether a model-free node is worth its
    verification row (``drafting.suffix.HybridDrafter``)."""
    draft_src.depth_limit = remaining
    draft_src.min_margin = min_margin
    draft_src.keep_drafting = keep_drafting
    draft_src.keep_grafting = keep_grafting
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
    passed: list[bool]  # [1 + N]: some drafted child of the row passes the rule (accept_strict: rows it scanned)
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
    if type(rule) is Strict and (fast := accept_strict(logits, draft, eos)) is not None:
        return fast
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


def accept_strict(logits: torch.Tensor, draft: DraftTree, eos) -> Verdict | None:
    """``accept`` under ``strict`` from each row's maximum alone, without a summary; None where it
    cannot decide as the summary's walk would (then ``accept`` takes that walk).

    Strict passes a child x of row r iff ``logits[r, x] >= max_y logits[r, y]`` (``Strict.accept_ids``
    on the given values: a maximiser of p), and among passing children takes the drafter's first (they
    all share the maximum).  That decides every row whose maximum is finite; the greedy token is
    numpy's argmax, the lowest index of the maximum, as ``summarize``'s top-1 and ``argmax_lowest``.
    An accepted child that ties the maximum but is not that token is drift, whose divergence the
    summary's walk accounts for: None then (and for rows with a NaN or an infinite maximum, or
    logits numpy cannot read).

    Only the rows the walk reaches and the expanded nodes' rows (what ``record`` and the certificates
    read of ``passed``) are scanned: a [V] argmax a row, and a round with a long suffix graft verifies
    up to 17 rows, most of them past a rejection.  ``passed`` is False at the rows not scanned."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.float64):
        return None
    a = logits.detach().numpy()  # [1 + N, V]
    n = a.shape[0] - 1
    children, tokens = draft.children_table(), draft.tokens
    passed, best, top = [False] * (n + 1), [0] * (n + 1), {}

    def scan(r: int) -> bool:
        """passed[r], best[r] and top[r] (the row's argmax) filled in; False where its maximum is not finite."""
        t = top[r] = int(a[r].argmax())  # first index of the maximum (of the first NaN, if any)
        mx = a[r, t]
        if not math.isfinite(mx):
            return False
        for i, c in enumerate(children[r]):
            if a[r, tokens[c]] >= mx:
                passed[r], best[r] = True, i
                break
        return True

    path, reached, r = [], [0], 0
    while True:
        if not scan(r):
            return None
        if not passed[r]:
            break
        node = children[r][best[r]]
        if tokens[node] != top[r]:
            return None  # a tied maximum above the lowest index: drift, counted by the summary's walk
        path.append(node)
        r = node + 1
        reached.append(r)
        if tokens[node] in eos:
            reached.pop()
            break
    for e in draft.expanded:  # rows the certificates check (certified but rejected is a bug)
        if e + 1 not in top and not scan(e + 1):
            return None
    emitted = [tokens[i] for i in path]
    if len(reached) > len(path):
        emitted.append(top[r])
    return Verdict(None, passed, path, [row for row in reached if children[row]], emitted, 0, 0.0)


class RoundCertificates(NamedTuple):
    """The certify stage's result: one entry per expanded node (``draft.expanded``)."""

    rows: list[int]  # verification row of the expanded node (0: the root, 1 + i: node i)
    divergence: list[float]  # proven upper bound on KL(p || q)
    radius: list[float]  # proven lower bound on the radius
    certified: list[bool]  # divergence < radius


def certify(rule: LevelSet, verdict: Verdict, draft: DraftTree, logits: torch.Tensor | None = None,
            summary_k: int = 16) -> RoundCertificates | None:
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
    A verdict without a summary (strict's walk, ``accept_strict``) has the rows summarised here
    from ``logits`` (``verify``'s, with ``summary_k``).
    """
    if draft.q is None or not draft.expanded:
        return None
    er = [e + 1 for e in draft.expanded]  # [E] rows of the expanded nodes
    if verdict.summary is not None:
        sub = verdict.summary.select(torch.tensor(er, device=verdict.summary.top_probs.device))  # [E rows]
    elif logits is None:
        raise ValueError("certify: this verdict has no summary (strict's walk); pass the verification logits")
    else:
        sub = summarize(logits=logits[er], k=summary_k, entropy=rule.needs_entropy)
    divergence, radius, certified = certify_summary(rule, sub, draft.q, draft.widths)
    out = RoundCertificates(er, divergence, radius, certified)
    _check_violations(rule, out, [verdict.passed[row] for row in er], draft.widths)
    return out


def certify_summary(rule: LevelSet, sub, q: torch.Tensor, widths: list[int]) -> tuple[list, list, list]:
    """(divergence, radius, certified) lists for the E summarised rows ``sub`` (``certify``'s formula),
    whose drafter logits are ``q`` [E, V] and drafted widths ``widths`` [E]."""
    rad = radius_rows(rule, sub, "forward")  # [E]
    w = torch.tensor(widths, device=rad.device)  # [E]
    takes_max = rule.accept_ids(sub, sub.top_ids[:, 0])  # [E] does the rule accept the argmax?
    for m in sorted(set(widths)):
        if m > 1:
            use = (w == m) & takes_max
            rad = torch.where(use, torch.maximum(rad, radius_rows(TreeCoverage(m), sub, "forward")), rad)
    cert = certify_rows(sub, q.to(rad.device), rad, "forward")  # divergence, certified: [E]
    return cert.divergence.tolist(), rad.tolist(), cert.certified.tolist()


def _check_violations(rule: LevelSet, certs: RoundCertificates, passed: list[bool], widths: list[int]) -> None:
    for i, row in enumerate(certs.rows):
        if certs.certified[i] and not passed[i]:
            raise CertificateViolation(
                f"certified but rejected at tree row {row}: KL(p||q) <= {certs.divergence[i]!r} < radius "
                f"{certs.radius[i]!r} under {rule.spec} (width {widths[i]}); this is a bug, please report it"
            )


def record(stats: DecodeStats, draft: DraftTree, verdict: Verdict, certs: RoundCertificates | None) -> RoundLog:
    """The round's log: per attempted depth whether it was accepted and its certificate; counted into ``stats``."""
    n_acc = len(verdict.path)
    log = RoundLog(
        num_draft_tokens=len(draft), num_accepted_tokens=n_acc, emitted=verdict.emitted,
        from_draft=[True] * n_acc + [False] * (len(verdict.emitted) - n_acc),
        drift_tokens=verdict.drift, divergence_spent=verdict.divergence_spent,
    )
    for row in verdict.rows:
        log.depths.append(1 if row == 0 else draft.depths[row - 1] + 1)
        log.depth_accepted.append(verdict.passed[row])
    log.certified = [None] * len(verdict.rows)
    log.kl = [None] * len(verdict.rows)
    log.radius = [None] * len(verdict.rows)
    if certs is not None:
        fill_certificates(log, verdict.rows, certs)
    stats.add_round(log)
    return log


def fill_certificates(log: RoundLog, rows: list[int], certs: RoundCertificates) -> None:
    """The round's certificates into its log: per attempted depth (``rows``: the verdict's reached
    rows, in the log's order) the certificate of its row, and the counts over every expanded node."""
    at = {row: i for i, row in enumerate(certs.rows)}
    for j, row in enumerate(rows):
        i = at.get(row)
        if i is not None:
            log.certified[j], log.kl[j], log.radius[j] = certs.certified[i], certs.divergence[i], certs.radius[i]
    log.checked_positions = len(certs.rows)
    log.certified_positions = sum(certs.certified)


# Deferred certificates (``CertificateBatch``): rounds' rows wait until this many are pending, or until
# the oldest has waited this long (what a streamed round's callback may lag behind its tokens).
CERT_BATCH_ROWS = 16
CERT_BATCH_SECONDS = 0.25


_NUMPY_COPY = (torch.float32, torch.float64)  # dtypes RowBuffer copies through numpy on a CPU


class RowBuffer:
    """Rows [n, V] appended by copying into one buffer that grows (doubling) and is kept when cleared.

    ``append(src, idx)`` copies ``src[idx]`` (``idx`` None: all of ``src``) after the rows held;
    ``rows()`` is the rows held, a view [n, V].  The buffer takes the dtype and device of the first
    rows appended; rows of another dtype are cast as ``torch.cat`` would promote (the buffer is then
    reallocated in the promoted dtype)."""

    def __init__(self):
        self.buf: torch.Tensor | None = None
        self.n = 0

    def append(self, src: torch.Tensor, idx: list[int] | None = None) -> None:
        m = src.shape[0] if idx is None else len(idx)
        buf = self.buf
        if buf is not None and (buf.shape[1:] != src.shape[1:] or buf.device != src.device):
            raise ValueError(f"RowBuffer: rows of shape {tuple(src.shape[1:])} on {src.device} after "
                             f"{tuple(buf.shape[1:])} on {buf.device}")
        dtype = src.dtype if buf is None else torch.promote_types(buf.dtype, src.dtype)
        need = self.n + m
        if buf is None or need > buf.shape[0] or dtype != buf.dtype:
            cap = need if buf is None else max(need, buf.shape[0] * (2 if need > buf.shape[0] else 1))
            new = torch.empty((cap, *src.shape[1:]), dtype=dtype, device=src.device)
            if self.n:
                new[: self.n] = buf[: self.n]
            self.buf = buf = new
        out = buf[self.n: need]  # [m, V], contiguous: a slice of the leading dimension
        if src.dtype == dtype and src.device.type == "cpu" and dtype in _NUMPY_COPY:
            # numpy's copy runs on this thread: torch's copy of a row wider than its 32,768-element grain
            # wakes the thread pool, which in a decode (the pool idle since the target's pass) cost twice
            # the copy itself
            a = src.detach().numpy()
            if idx is None:
                out.numpy()[...] = a
            elif m and idx == list(range(idx[0], idx[0] + m)):  # a chain's rows: one slice
                out.numpy()[...] = a[idx[0]: idx[0] + m]
            else:
                np.take(a, idx, axis=0, out=out.numpy())
        elif idx is None:
            out.copy_(src)
        elif src.dtype == dtype:
            torch.index_select(src, 0, torch.tensor(idx, device=src.device), out=out)
        else:
            out.copy_(src[idx])
        self.n = need

    def rows(self) -> torch.Tensor:
        return self.buf[: self.n]

    def clear(self) -> None:
        self.n = 0


class CertificateBatch:
    """The certificates of many rounds, computed together (``engine.decode_loop``).

    A round's certificates (``certify``) cost a fixed ~0.7 ms of small tensor operations whatever
    its rows, then ~0.1 ms a row (V = 49,152; 1.5 ms and 0.2 ms at V = 151,936): a decode drafting
    one or two tokens a round paid mostly the fixed part.  No decision of the decode reads a
    certificate (the accepted tokens are ``accept``'s), so the engine keeps each round's expanded
    rows (``add``: the verification logits and the drafter's q of those rows) and certifies them in
    one ``summarize`` and one ``certify_summary`` once ``CERT_BATCH_ROWS`` rows wait or the oldest has
    waited ``CERT_BATCH_SECONDS`` (``due``; the time only where ``on_round`` listens), and at the end of the
    decode (``flush``).  The round logs
    are then filled in and counted into the statistics, and a certified-but-rejected row raises
    ``CertificateViolation`` as ``certify`` does.  ``on_round`` hears the rounds in order, each
    once its own and every earlier round's certificates are in (``deliver``).
    """

    def __init__(self, rule: LevelSet, summary_k: int, stats: DecodeStats, on_round: Callable | None = None,
                 rows: int = CERT_BATCH_ROWS, seconds: float = CERT_BATCH_SECONDS):
        self.rule, self.summary_k, self.stats, self.on_round = rule, summary_k, stats, on_round
        self.max_rows, self.max_seconds = rows, seconds
        self.entries: list[tuple] = []  # (log, reached rows, expanded rows, widths, passed) per waiting round
        # the waiting rounds' rows, copied straight into buffers kept across flushes: a list of
        # per-round copies joined by ``torch.cat`` at the flush copied every [V] row twice, into
        # newly allocated memory each time
        self.logits = RowBuffer()  # [rows waiting, V]
        self.q = RowBuffer()  # [rows waiting, V]
        self.since: float | None = None  # when the oldest waiting round was added
        self.waiting: list[RoundLog] = []  # logs whose on_round waits for an earlier round's certificates

    def add(self, verdict: Verdict, draft: DraftTree, logits: torch.Tensor, log: RoundLog) -> None:
        """Keep a round's expanded rows (copies: the next pass may reuse the logits' buffer) and its
        ``draft.q`` (the tree's own, built each round)."""
        er = [e + 1 for e in draft.expanded]
        self.logits.append(logits, er)  # [E, V] copied: the next pass may reuse the logits' buffer
        self.q.append(draft.q)
        self.entries.append((log, list(verdict.rows), er, list(draft.widths), [verdict.passed[r] for r in er]))
        if self.since is None:
            self.since = time.perf_counter()

    def deliver(self, log: RoundLog) -> None:
        """``on_round(log)`` now, or after the certificates of every round before it (order kept)."""
        if self.on_round is None:
            return
        if self.entries or self.waiting:
            self.waiting.append(log)
        else:
            self.on_round(log)

    def due(self) -> bool:
        """``max_rows`` rows wait, or (someone hears the rounds: ``on_round``) the oldest has waited
        ``max_seconds``.  Without a listener the time does not count: a decode that drafts a round now and
        then (``-k auto``'s probes) paid a batch's fixed cost, about half a target step, for each one."""
        return self.logits.n >= self.max_rows or (self.on_round is not None and self.since is not None
                                                and time.perf_counter() - self.since >= self.max_seconds)

    def flush(self) -> None:
        """Certify every waiting round, fill in and count their logs, then call the waiting ``on_round``s."""
        if self.entries:
            sub = summarize(logits=self.logits.rows(), k=self.summary_k, entropy=self.rule.needs_entropy)  # [R rows]
            widths = [w for entry in self.entries for w in entry[3]]
            divergence, radius, certified = certify_summary(self.rule, sub, self.q.rows(), widths)
            i = 0
            for log, rows, er, widths, passed in self.entries:
                j = i + len(er)
                certs = RoundCertificates(er, divergence[i:j], radius[i:j], certified[i:j])
                _check_violations(self.rule, certs, passed, widths)
                fill_certificates(log, rows, certs)
                self.stats.add_certificates(log)
                i = j
            self.logits.clear()
            self.q.clear()
            self.entries, self.since = [], None
        waiting, self.waiting = self.waiting, []
        for log in waiting:
            self.on_round(log)


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
           spent: list[float] | None = None, batch: CertificateBatch | None = None) -> tuple[Verdict, RoundLog]:
    """accept -> certify -> record on one row's verification logits [1 + N, V]: (the verdict, the
    round's log, counted into ``stats``).  ``spent``: the accept, certify and record seconds are
    added to its entries 2, 3 and 4 (``stats.STAGES``).  ``batch``: the certificates wait there
    (``CertificateBatch``; the log is filled in when it flushes)."""
    clock = time.perf_counter
    t0 = clock()
    verdict = accept(config.rule, logits, draft, config.summary_k, config.eos)
    t1 = clock()
    deferred = batch is not None and config.certificates and draft.q is not None and bool(draft.expanded)
    certs = certify(config.rule, verdict, draft, logits, config.summary_k) if config.certificates and not deferred else None
    t2 = clock()
    log = record(stats, draft, verdict, certs)
    if deferred:
        batch.add(verdict, draft, logits, log)
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
