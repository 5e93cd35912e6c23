"""Greedy speculative decoding with exact acceptance certificates.

One round (``speculative_generate``'s loop body)::

    draft  = drafter.propose(seq)                 # a chain of k tokens, or a tree
    logits = target([pending] + draft)            # ONE forward pass, KV cache reused
    path   = accepted nodes, walking from the root  # level-set test per depth
    emit     draft tokens on the path + the target's greedy token after it
    roll back both KV caches to seq + path        # crop (chain) / gather + crop (tree)

Acceptance at a node whose target distribution is p and whose drafted
children are c_1..c_m (m = 1 for a chain): the criterion's level-set rule
keeps the children with p(c) not in the lower level set {y : p(y) < tau(p)};
among them the one with the largest p is accepted (for ``strict`` that is
the target's argmax, so strict is lossless: every emitted token is the
target's greedy token at its prefix).  If none passes, the target's greedy
token is emitted instead and the round ends; at a leaf it is the bonus token.

Certificates (``certify=True``): for every node expanded with drafter logits
q, certified = KL(p || q) < radius, radius = radius(criterion, p) for a
chain, max(radius(criterion), radius(tree:m)) for a width-m node where the
rule accepts the target's argmax (covering the argmax then suffices); the
rule's own radius where it does not (possible for a user LevelSet).
Both sides are those of ``certified`` (docs/theory.md, section 7): the core's upper
bound on the exact KL (``divergence_upper``) against the lower bound on the exact
radius, and acceptance is the rule evaluated exactly on the given logits
(``accept_ids``), so certified-but-rejected, which raises ``CertificateViolation``,
is a bug.  Computed from one ``summarize(logits=...)`` of the verification logits and
``radius_rows``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..certificates import radius_rows
from ..criteria import Criterion, LevelSet, Strict, TreeCoverage, as_criterion
from ..divergences import forward_kl_upper
from ..summary import summarize
from .drafters import ModelDrafter, make_drafter, model_forward, new_cache, vocab_size_of
from .feature import forward_with_hidden
from .stats import CertificateViolation, DecodeStats, RoundLog
from .tree import DraftTree, keep_cache, parse_tree, tree_attention_mask, tree_position_ids

__all__ = ["speculative_generate", "greedy_generate", "DecodeResult", "resolve_criterion"]


@dataclass
class DecodeResult:
    tokens: list[int]  # new tokens (the prompt excluded), EOS included when it ended the run
    stats: DecodeStats
    baseline_tokens: list[int] | None = None  # the target's own greedy decoding, when baseline=True


# ---------------------------------------------------------------------------
# argument handling


def _as_ids(input_ids) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        t = input_ids
        if t.ndim == 2:
            if t.shape[0] != 1:
                raise ValueError(f"input_ids: batch size {t.shape[0]} is not supported; pass one sequence (1, T) or (T,)")
            t = t[0]
        if t.ndim != 1:
            raise ValueError(f"input_ids: expected shape (T,) or (1, T), got {tuple(input_ids.shape)}")
        ids = [int(x) for x in t.tolist()]
    elif isinstance(input_ids, (list, tuple)):
        ids = [int(x) for x in input_ids]
    else:
        raise ValueError(f"input_ids: expected a list of token ids or a tensor, got {type(input_ids).__name__}")
    if not ids:
        raise ValueError("input_ids: the prompt is empty; pass at least one token (e.g. BOS or an encoded prompt)")
    return ids


def _eos_ids(target, eos_token_id) -> set[int]:
    if eos_token_id is None:
        gc = getattr(target, "generation_config", None)
        eos_token_id = getattr(gc, "eos_token_id", None) if gc is not None else None
        if eos_token_id is None:
            eos_token_id = getattr(target.config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(e) for e in eos_token_id}


def resolve_criterion(criterion, k: int, tree) -> tuple[Criterion, LevelSet, list[int], bool]:
    """(criterion, token rule, widths per depth, expand_all).

    ``tree:M`` means tree coverage: strict token test on a tree of width M
    (``(M, k)`` unless ``tree`` is given).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k: expected an integer >= 1 (number of draft tokens per round), got {k!r}")
    crit = as_criterion(criterion)
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


def _check_vocab(target, drafter, tokenizer=None) -> None:
    """Refuse a drafter with a different vocabulary before any decoding."""
    if not isinstance(drafter, ModelDrafter):
        return
    try:
        from draftcert.models import check_compatible  # config vocab, logit rows (and tokenizers when given)
    except ImportError:
        check_compatible = None
    if check_compatible is not None:
        check_compatible(target, tokenizer, drafter.model, None)
    vt, vd = vocab_size_of(target), vocab_size_of(drafter.model)
    if vt != vd:
        raise ValueError(
            f"drafter: vocabulary size {vd} differs from the target's {vt}; speculative decoding needs a drafter "
            "sharing the target's tokenizer (use a self:skip=N / self:quant=4 drafter or prompt-lookup)"
        )


# ---------------------------------------------------------------------------
# the decoding loops


def greedy_generate(target, input_ids, max_new_tokens: int = 64, *, eos_token_id=None) -> list[int]:
    """The target's own greedy decoding with a KV cache (the lossless reference)."""
    prompt = _as_ids(input_ids)
    _check_max(max_new_tokens)
    eos = _eos_ids(target, eos_token_id)
    out: list[int] = []
    with torch.inference_mode():
        cache, ids = new_cache(target), prompt
        while len(out) < max_new_tokens:
            tok = int(model_forward(target, cache, ids, 1)[0].argmax())  # lowest index among ties
            out.append(tok)
            if tok in eos:
                break
            ids = [tok]
    return out


def _check_max(max_new_tokens) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an integer >= 1, got {max_new_tokens!r}")


def speculative_generate(
    target,
    drafter,
    input_ids,
    criterion: str | Criterion = "strict",
    k: int = 4,
    tree=None,
    max_new_tokens: int = 64,
    *,
    eos_token_id=None,
    certify: bool = True,
    baseline: bool = False,
    tokenizer=None,
    on_round: Callable[[RoundLog], None] | None = None,
) -> DecodeResult:
    """Greedy speculative decoding of one prompt.

    Parameters
    ----------
    target : transformers causal LM (batch size 1).
    drafter : transformers causal LM sharing the target's vocabulary, a spec
        string (``self:skip=N``, ``self:quant=4``, ``prompt-lookup``), or a drafter
        object (``ModelDrafter``, ``PromptLookupDrafter``).
    input_ids : prompt token ids, list or tensor (T,) / (1, T).
    criterion : spec string or Criterion: a level-set rule (``strict``,
        ``additive:0.1``, ...) or ``tree:M`` (tree coverage, strict test).
    k : draft tokens per round for a chain (default tree depth for tree:M).
    tree : None (chain), ``(m, depth)`` (top-m children along the drafter's
        greedy path), or ``[w1, w2, ...]`` (static full tree, width w_d at depth d).
    certify : compute the per-position certificates (KL < radius).
    baseline : also time the target's own greedy decoding (same prompt, same
        length) for ``stats.speedup`` and ``stats.baseline_match``.
    on_round : callback receiving each round's ``RoundLog`` as it is accepted (streaming).
    """
    crit, rule, widths, expand_all = resolve_criterion(criterion, k, tree)
    _check_max(max_new_tokens)
    prompt = _as_ids(input_ids)
    vocab = vocab_size_of(target)
    if max(prompt) >= vocab or min(prompt) < 0:
        raise ValueError(f"input_ids: token ids must lie in [0, {vocab}) for this target")
    draft_src = make_drafter(drafter, target, tokenizer)
    _check_vocab(target, draft_src, tokenizer)
    eos = _eos_ids(target, eos_token_id)
    # Any k gives exact answers (rows needing more are re-sorted exactly); 16 covers peaked rows cheaply.
    summary_k = max(16 if certify else 2, rule.min_k, max(widths) + 1)
    tree_crits = {w: TreeCoverage(w) for w in set(widths) if w > 1}
    stats = DecodeStats(criterion=crit.spec, k=k, tree=None if tree is None and not isinstance(crit, TreeCoverage) else widths)
    d_forwards0 = draft_src.forwards
    with_hidden = bool(getattr(draft_src, "needs_target_hidden", False))

    with torch.inference_mode():
        t0 = time.perf_counter()
        cache = new_cache(target)
        draft_src.start(prompt)
        seq, out, n_cached = list(prompt), [], 0  # n_cached: target cache holds seq[:n_cached]
        while len(out) < max_new_tokens:
            budget = min(len(widths), max_new_tokens - len(out) - 1)  # never draft past the length limit
            draft = draft_src.propose(seq, widths[:budget], expand_all)
            logits, hidden = _verify(target, cache, n_cached, seq[n_cached:], draft, with_hidden)
            stats.target_forwards += 1
            path, emitted, log = _accept(rule, logits, draft, certify, summary_k, tree_crits, stats, eos)
            keep_cache(cache, len(seq), path)  # [pending] is now cached; keep only the accepted nodes
            if with_hidden:  # a feature drafter gets the target's features of every newly cached position
                n_pending = len(seq) - n_cached
                draft_src.observe(hidden[list(range(n_pending)) + [n_pending + j for j in path]])
            n_cached = len(seq) + len(path)
            draft_src.accept(path)
            seq += emitted
            out += emitted
            stats.rounds.append(log)
            if on_round is not None:
                on_round(log)
            if emitted and emitted[-1] in eos:
                break
        stats.seconds = time.perf_counter() - t0
    stats.emitted = len(out)
    stats.drafter_forwards = draft_src.forwards - d_forwards0

    base = None
    if baseline:
        t0 = time.perf_counter()
        base = greedy_generate(target, prompt, max_new_tokens, eos_token_id=eos_token_id)
        stats.baseline_seconds = time.perf_counter() - t0
        stats.baseline_tokens = len(base)
        stats.baseline_match = base == out
    return DecodeResult(tokens=out, stats=stats, baseline_tokens=base)


def _verify(target, cache, n_cached: int, pending: list[int], draft: DraftTree, with_hidden: bool = False):
    """(target logits (1 + N, V), hidden states (P + N, H) or None).

    Logits row 0 is after the last pending token, row 1 + i after node i; with ``with_hidden``
    the target's final hidden states of all P pending tokens and N nodes come along (feature drafters).
    """
    n = len(draft)
    fwd = forward_with_hidden if with_hidden else model_forward
    if draft.is_chain:  # ordinary causal attention
        out = fwd(target, cache, pending + draft.tokens, n + 1)
    else:
        dev = target.device
        anc = draft.ancestors(dev)
        nodes = torch.arange(n, device=dev)
        mask = tree_attention_mask(n_cached, len(pending), anc, nodes, nodes, target.dtype)
        pos = tree_position_ids(n_cached, len(pending), torch.tensor(draft.depths, device=dev))
        out = fwd(target, cache, pending + draft.tokens, n + 1, mask, pos)
    return out if with_hidden else (out, None)


def _accept(rule: LevelSet, logits, draft: DraftTree, certify: bool, summary_k: int, tree_crits, stats: DecodeStats, eos=frozenset()):
    """Walk the tree from the root; returns (accepted node path, emitted tokens, RoundLog).

    An EOS token among the accepted drafts ends the output right there (no
    correction/bonus token after it).
    """
    n = len(draft)
    summ = summarize(logits=logits, k=summary_k, entropy=rule.needs_entropy)
    log_p_max = torch.log(summ.top_probs[:, 0])
    greedy = summ.top_ids[:, 0].tolist()
    children = draft.children_table()
    has, best, logp_child = [False] * (n + 1), [0] * (n + 1), None
    if n:
        width = max(len(c) for c in children)
        C = torch.tensor([c + [-1] * (width - len(c)) for c in children], device=logits.device)
        tok = torch.tensor(draft.tokens, device=logits.device)[C.clamp(min=0)]
        logp_child = logits.gather(1, tok).double() - summ.log_norm[:, None]  # same formula as Summary.prob_of
        # The rule evaluated exactly on the given logits (as ``accepts`` decides it: float64
        # where the error bounds settle it, arbitrary precision near the threshold).
        ok = torch.stack([rule.accept_ids(summ, tok[:, j]) for j in range(width)], 1) & (C >= 0)
        # Among passing children take the most probable under the target: the largest given
        # logit, an exact order (ties: the drafter's order).
        lx = logits.gather(1, tok)
        best_t = torch.where(ok, lx, torch.full_like(lx, -torch.inf)).argmax(1)
        has, best = ok.any(1).tolist(), best_t.tolist()

    # Walk: row 0 is the root, row i + 1 is node i.
    path, rows, r = [], [0], 0
    while has[r]:
        node = children[r][best[r]]
        path.append(node)
        r = node + 1
        rows.append(r)
        if draft.tokens[node] in eos:
            rows.pop()  # the output ends at this EOS: nothing after it is verified
            break
    emitted = [draft.tokens[i] for i in path]
    if len(rows) > len(path):
        emitted.append(greedy[r])
    log = RoundLog(drafted=n, accepted=len(path), emitted=emitted, from_draft=[True] * len(path) + [False] * (len(emitted) - len(path)))

    # Drift and divergence spent for accepted drafts (the final token is the target's own greedy token).
    for parent_row, node in zip(rows, path):
        if draft.tokens[node] != greedy[parent_row]:
            log.drift += 1
            stats.drift_tokens += 1
            stats.divergence_spent += float(log_p_max[parent_row] - logp_child[parent_row, best[parent_row]])

    # Certificates at every expanded node (all of them, reached or not: the implication holds at any node).
    cert_by_row, kl_by_row, rad_by_row = {}, {}, {}
    if certify and draft.q is not None and draft.expanded:
        er = torch.tensor(draft.expanded, device=logits.device) + 1
        rad = radius_rows(rule, summ, "forward")[er]
        w = torch.tensor(draft.widths, device=logits.device)
        # Covering the target's argmax among the m candidates only guarantees acceptance
        # where the rule accepts the argmax; a user LevelSet (or entropy with DELTA >= 1)
        # may reject it, and there only the rule's own radius certifies.
        takes_max = rule.accept_ids(summ, summ.top_ids[:, 0])[er]
        for m, tc in tree_crits.items():
            use = (w == m) & takes_max
            rad = torch.where(use, torch.maximum(rad, radius_rows(tc, summ, "forward")[er]), rad)
        kl, decided = _forward_kl(logits[er], draft.q.to(logits.device), rad)
        cert = decided & (kl < rad)
        er_l, cert_l, kl_l, rad_l = er.tolist(), cert.tolist(), kl.tolist(), rad.tolist()
        for i, row in enumerate(er_l):
            if cert_l[i] and not has[row]:
                raise CertificateViolation(
                    f"certified but rejected at tree row {row}: KL(p||q) = {kl_l[i]!r} < radius {rad_l[i]!r} "
                    f"under {rule.spec} (width {draft.widths[i]}); this is a bug, please report it"
                )
            cert_by_row[row], kl_by_row[row], rad_by_row[row] = cert_l[i], kl_l[i], rad_l[i]
        stats.checked_positions += len(er_l)
        stats.certified_positions += sum(cert_l)

    # Per reached depth: attempted (the row has drafted children), accepted, certified.
    for row in rows:
        if not children[row]:
            break
        depth = 1 if row == 0 else draft.depths[row - 1] + 1
        log.depths.append(depth)
        log.depth_accepted.append(has[row])
        log.certified.append(cert_by_row.get(row))
        log.kl.append(kl_by_row.get(row))
        log.radius.append(rad_by_row.get(row))
        stats.record_depth(depth, has[row])
        if has[row] and row in kl_by_row:
            stats.kl_sum += kl_by_row[row]
            stats.kl_count += 1
    return path, emitted, log


# Rows whose fast (float32) KL estimate exceeds the radius by this much are reported as
# not certified without the float64 bound: a completeness shortcut only (every True is the
# proven bound's), missing a certificate only if float32 erred by more than the band.
_SKIP_ABS, _SKIP_REL = 1e-2, 0.5


def _forward_kl(x: torch.Tensor, y: torch.Tensor, rad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kl, decided) per row for logits x (target), y (drafter).  Where ``decided``, kl is
    an upper bound on the exact KL(softmax x || softmax y): the core's ``divergence_upper``
    (docs/theory.md, section 7), so ``kl < radius`` is the same sound comparison as
    ``certified``.  Elsewhere kl is a fast estimate in the logits' dtype (KL = sum p (x - y)
    - lse(x) + lse(y)) far above the radius: not certified, the value only reported."""
    if x.dtype != torch.float64:
        lse_x, lse_y = torch.logsumexp(x, -1), torch.logsumexp(y, -1)
        p = torch.exp(x - lse_x[:, None])
        kl = ((p * (x - y)).sum(-1) - lse_x + lse_y).double().clamp_min(0)
        need = ~torch.isfinite(kl) | (kl <= rad * (1 + _SKIP_REL) + _SKIP_ABS)
    else:
        kl = torch.zeros(x.shape[0], dtype=torch.float64, device=x.device)
        need = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    idx = need.nonzero().squeeze(1)
    if idx.numel():
        kl[idx] = forward_kl_upper(x[idx], y[idx])  # an upper bound on the exact KL
    return kl, need
