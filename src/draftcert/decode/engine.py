"""Greedy speculative decoding with exact acceptance certificates.

One round (``speculative_generate``'s loop body) in five named stages::

    draft   = drafter.propose(seq, widths)            # propose: a chain of k tokens, or a tree of N nodes
    logits  = verify(target, cache, ..., draft)       # ONE target forward over [pending] + nodes: [1 + N, V]
    verdict = accept(rule, logits, draft, ...)        # walk the tree: accepted path, emitted tokens, drift
    certs   = certify(rule, verdict, draft)           # KL(p || q) < radius at every expanded node
    log     = record(stats, draft, verdict, certs)    # the round's RoundLog, counted into DecodeStats
    roll back both KV caches to seq + path            # crop (chain) / gather + crop (tree)

Acceptance at a node whose target distribution is p and whose drafted
children are c_1..c_m (m = 1 for a chain): the criterion's level-set rule
keeps the children with p(c) not in the lower level set {y : p(y) < tau(p)};
among them the one with the largest p is accepted (for ``strict`` that is
the target's argmax, so strict is lossless: every emitted token is the
target's greedy token at its prefix).  If none passes, the target's greedy
token is emitted instead and the round ends; at a leaf it is the bonus token.

Certificates (``certificates=True``): for every node expanded with drafter logits
q, certified = KL(p || q) < radius, radius = radius(criterion, p) for a
chain, max(radius(criterion), radius(tree:m)) for a width-m node where the
rule accepts the target's argmax (covering the argmax then suffices); the
rule's own radius where it does not (possible for a user LevelSet).
The decision is the core's ``certify_rows``, the one ``certified`` makes (docs/theory.md,
section 7): an upper bound on the exact KL against a lower bound on the exact radius,
while acceptance is the rule evaluated exactly on the given logits (``accept_ids``), so
certified-but-rejected, which raises ``CertificateViolation``, is a bug.  Both come from
one ``summarize(logits=...)`` of the verification logits.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from ..certificates import certify_rows, radius_rows
from ..criteria import Criterion, LevelSet, Strict, TreeCoverage, parse_criterion
from ..models import check_compatible
from ..models.hf import eos_token_ids, forward_with_hidden, model_forward, new_cache, vocab_size_of
from ..summary import Summary, summarize
from .drafters import ModelDrafter, make_drafter
from .stats import CertificateViolation, DecodeStats, RoundLog
from .timing import interleave, median_or_none
from .state import CacheState, Layout, chain_of, layer_masks, layout_of
from .tree import DraftTree, parse_tree, tree_allowed, tree_position_ids

__all__ = ["speculative_generate", "greedy_generate", "DecodeResult", "resolve_criterion",
           "propose_draft", "verify", "accept", "certify", "record", "Verdict", "RoundCertificates", "check_drafter_vocab",
           "check_max_new_tokens", "summary_size", "check_target", "decode_loop"]


@dataclass
class DecodeResult:
    tokens: list[int]  # new tokens (the prompt excluded), EOS included when it ended the run
    stats: DecodeStats
    baseline_tokens: list[int] | None = None  # the target's own greedy decoding, when baseline=True


# ---------------------------------------------------------------------------
# argument handling


def _as_ids(input_ids) -> list[int]:
    """One prompt's token ids from what a tokenizer or a user hands over.

    A tensor (T,) / (1, T), a list (or [[...]], one row), or a mapping with ``"input_ids"``: a
    dict or transformers' ``BatchEncoding`` (``tok(text, return_tensors="pt")``,
    ``tok.apply_chat_template(..., return_dict=True)``); positions its ``attention_mask`` marks 0
    (padding) are dropped.  A batch of more than one row is refused.
    """
    mask = None
    if isinstance(input_ids, Mapping):
        if "input_ids" not in input_ids:
            raise ValueError(f"input_ids: a mapping must hold 'input_ids' (as a tokenizer returns), got keys "
                             f"{sorted(map(str, input_ids.keys()))}")
        mask = input_ids.get("attention_mask")
        input_ids = input_ids["input_ids"]
    ids = _one_row(input_ids, "input_ids")
    if mask is not None:
        keep = _one_row(mask, "attention_mask")
        if len(keep) != len(ids):
            raise ValueError(f"attention_mask: length {len(keep)} differs from input_ids' {len(ids)}")
        ids = [t for t, m in zip(ids, keep) if m]
    if not ids:
        raise ValueError("input_ids: the prompt is empty; pass at least one token (e.g. BOS or an encoded prompt)")
    return ids


def _one_row(x, name: str) -> list[int]:
    """A tensor (T,) / (1, T) or a list (T) / [[T]] as a list of ints; more rows is an error."""
    if isinstance(x, torch.Tensor):
        if x.ndim == 2:
            if x.shape[0] != 1:
                raise ValueError(f"{name}: batch size {x.shape[0]} is not supported; pass one sequence (1, T) or (T,)")
            x = x[0]
        if x.ndim != 1:
            raise ValueError(f"{name}: expected shape (T,) or (1, T), got {tuple(x.shape)}")
        return [int(v) for v in x.tolist()]
    if isinstance(x, (list, tuple)):
        if x and all(isinstance(r, (list, tuple)) or (isinstance(r, torch.Tensor) and r.ndim) for r in x):  # [[...]]: rows
            if len(x) != 1:
                raise ValueError(f"{name}: batch size {len(x)} is not supported; pass one sequence")
            return _one_row(x[0], name)
        return [int(v) for v in x]
    raise ValueError(f"{name}: expected a list of token ids, a tensor, or a dict / BatchEncoding with 'input_ids', "
                     f"got {type(x).__name__}")


def resolve_criterion(criterion, k: int, tree) -> tuple[Criterion, LevelSet, list[int], bool]:
    """(criterion, token rule, widths per depth, expand_all).

    ``tree:M`` means tree coverage: strict token test on a tree of width M
    (``(M, k)`` unless ``tree`` is given).
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k: expected an integer >= 1 (number of draft tokens per round), got {k!r}")
    crit = parse_criterion(criterion)
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


def check_drafter_vocab(target, drafter, tokenizer=None) -> None:
    """Refuse a drafter with a different vocabulary before any decoding."""
    drafter = getattr(drafter, "model_drafter", drafter)  # a suffix.HybridDrafter: check the model inside it
    if not isinstance(drafter, ModelDrafter):
        return
    check_compatible(target, tokenizer, drafter.model, None)  # config vocab, logit rows (and tokenizers when given)
    vt, vd = vocab_size_of(target), vocab_size_of(drafter.model)
    if vt != vd:
        raise ValueError(
            f"drafter: vocabulary size {vd} differs from the target's {vt}; speculative decoding needs a drafter "
            "sharing the target's tokenizer (use a self:skip=N / self:quant=4 drafter or prompt-lookup)"
        )


def check_target(target, tree_shape: bool) -> Layout:
    """The target's ``state.Layout``, refusing a tree where it cannot verify one (before any work).

    ``tree_shape``: the caller asked for a tree (``tree=`` or a ``tree:M`` criterion).  A chain is
    exact on every layout; drafters that propose trees on their own (suffix candidates) are cut to
    their first-ranked path there (``state.chain_of``)."""
    layout = layout_of(target)
    why = layout.tree_refusal()
    if tree_shape and why is not None:
        raise ValueError(f"tree: {why}")
    return layout


# ---------------------------------------------------------------------------
# the decoding loops


def greedy_generate(target, input_ids, max_new_tokens: int = 64, *, eos_token_id=None) -> list[int]:
    """The target's own greedy decoding with a KV cache (the lossless reference)."""
    prompt = _as_ids(input_ids)
    check_max_new_tokens(max_new_tokens)
    eos = eos_token_ids(target, explicit=eos_token_id)
    out: list[int] = []
    with torch.inference_mode():
        cache, ids = new_cache(target), prompt  # sliding layers kept whole (models.hf.new_cache), as the engine
        while len(out) < max_new_tokens:
            tok = int(model_forward(target, cache, ids, 1)[0].argmax())  # lowest index among ties
            out.append(tok)
            if tok in eos:
                break
            ids = [tok]
    return out


def summary_size(rule: LevelSet, widths: list[int], certificates: bool) -> int:
    """The top-k size of a round's verification summary (``accept``'s ``summary_k``)."""
    return max(16 if certificates else 2, rule.min_k, max(widths) + 1)


def check_max_new_tokens(max_new_tokens) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an integer >= 1, got {max_new_tokens!r}")


def _auto_shape(target, drafter, tokenizer, criterion, tree):
    """``k="auto"``: (k, tree, the drafter object) of ``decode.shape.auto_engine_args``, as
    ``draftcert decode -k auto`` chooses."""
    if tree is not None:
        raise ValueError("k='auto' chooses the chain or tree itself: pass tree=None, or an integer k with a tree")
    from .shape import auto_engine_args  # decode.costs times the engine's stages, so it cannot be imported at the top

    obj = make_drafter(drafter, target, tokenizer)
    # a spec names the drafter's shipped acceptance figures; an object is keyed by its class (0.3 prior)
    spec = drafter if isinstance(drafter, str) else type(obj).__name__
    args, _, _ = auto_engine_args(target, obj, spec, criterion)
    return args["k"], args["tree"], obj


def speculative_generate(
    target,
    drafter,
    input_ids,
    criterion: str | Criterion = "strict",
    k: int | str = 4,
    tree=None,
    max_new_tokens: int = 64,
    *,
    eos_token_id=None,
    certificates: bool = True,
    baseline: bool = False,
    repeats: int = 1,
    tokenizer=None,
    on_round: Callable[[RoundLog], None] | None = None,
    stop: Callable[[list[int]], int | None] | None = None,
) -> DecodeResult:
    """Greedy speculative decoding of one prompt.

    Parameters
    ----------
    target : transformers causal LM (batch size 1).
    drafter : a spec string, the same as the CLI's ``--drafter`` (``default``, ``self:skip=N``,
        ``self:quant=4``, ``prompt-lookup``, ``suffix``, ``DRAFTER+suffix``, ``eagle:NAME``, a path or
        hub id), a transformers causal LM sharing the target's vocabulary, or a drafter object
        (``ModelDrafter``, ``PromptLookupDrafter``, ``FeatureDrafter``, ``SuffixDrafter``, ``HybridDrafter``).
    input_ids : one prompt's token ids: a list, a tensor (T,) / (1, T), or a dict /
        ``BatchEncoding`` with ``input_ids`` (what ``tok(text, return_tensors="pt")`` and
        ``tok.apply_chat_template(..., return_dict=True)`` return).
    criterion : spec string or Criterion: a level-set rule (``strict``,
        ``additive:0.1``, ...) or ``tree:M`` (tree coverage, strict test).
    k : draft tokens per round for a chain (default tree depth for tree:M), or ``"auto"`` (the CLI's
        default): the chain or tree with the best predicted tokens/s from this machine's cost curve
        (measured on first use, then cached: ``decode.costs``) and the drafter's acceptance by depth
        (``decode.shape.auto_engine_args``); ``stats.k`` / ``stats.tree`` record the choice.  With an
        explicit ``tree``, ``"auto"`` is not allowed (the tree fixes the shape).
    tree : None (chain), ``(m, depth)`` (top-m children along the drafter's
        greedy path), or ``[w1, w2, ...]`` (static full tree, width w_d at depth d).
    certificates : compute the per-position certificates (KL < radius).
    baseline : also time the target's own greedy decoding (same prompt, same
        length) for ``stats.speedup`` and ``stats.baseline_match``.
    repeats : time the decode (and the baseline) this many times, in turns (decode, baseline,
        baseline, decode, ...: ``timing.py``); the figures are medians, and ``stats.timing_reliable``
        is False when the repeats disagree by more than 20 %.  Only the first decode streams.
    on_round : callback receiving each round's ``RoundLog`` as it is accepted (streaming).
    stop : called after each round with the new tokens so far; None continues, an integer n keeps
        the first n new tokens and ends the decode (stopping criteria; the round stays counted whole).
    """
    if isinstance(k, str) and k == "auto":
        k, tree, drafter = _auto_shape(target, drafter, tokenizer, criterion, tree)
    crit, rule, widths, expand_all = resolve_criterion(criterion, k, tree)
    check_max_new_tokens(max_new_tokens)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats: expected an integer >= 1, got {repeats!r}")
    prompt = _as_ids(input_ids)
    vocab = vocab_size_of(target)
    if max(prompt) >= vocab or min(prompt) < 0:
        raise ValueError(f"input_ids: token ids must lie in [0, {vocab}) for this target")
    layout = check_target(target, tree is not None or isinstance(crit, TreeCoverage))
    draft_src = make_drafter(drafter, target, tokenizer)
    check_drafter_vocab(target, draft_src, tokenizer)
    eos = eos_token_ids(target, explicit=eos_token_id)
    # Any k gives exact answers (rows needing more are re-sorted exactly); 16 covers peaked rows cheaply.
    summary_k = summary_size(rule, widths, certificates)
    shape = None if tree is None and not isinstance(crit, TreeCoverage) else widths
    stats = DecodeStats(criterion=crit.spec, k=k, tree=shape)
    d_forwards0 = draft_src.forwards

    def decode(st: DecodeStats, callback) -> tuple[list[int], float]:
        t0 = time.perf_counter()
        toks = decode_loop(target, draft_src, prompt, rule, widths, expand_all, summary_k, eos, certificates,
                            max_new_tokens, st, callback, stop, layout)
        return toks, time.perf_counter() - t0

    out, first = decode(stats, on_round)  # the streamed decode is the first timed repeat
    stats.drafter_forwards = draft_src.forwards - d_forwards0
    base: list[int] | None = None

    def spec_run() -> float:
        nonlocal first
        if first is not None:
            seconds, first = first, None
            return seconds
        return decode(DecodeStats(criterion=crit.spec, k=k, tree=shape), None)[1]  # same tokens: greedy, deterministic

    def base_run() -> float:
        nonlocal base
        t0 = time.perf_counter()
        base = greedy_generate(target, prompt, max_new_tokens, eos_token_id=eos_token_id)
        return time.perf_counter() - t0

    # decode and baseline in turns (A B, B A, ...) so that a busy spell of the machine hits both (timing.py)
    times = interleave([spec_run, base_run] if baseline else [spec_run], repeats)
    stats.repeat_seconds = times[0]
    stats.seconds = median_or_none(times[0])
    if baseline:
        stats.baseline_repeat_seconds = times[1]
        stats.baseline_seconds = median_or_none(times[1])
        stats.baseline_tokens = len(base)
        stats.baseline_match = base == out
    return DecodeResult(tokens=out, stats=stats, baseline_tokens=base)


def decode_loop(target, draft_src, prompt, rule, widths, expand_all, summary_k, eos, certificates,
                 max_new_tokens, stats: DecodeStats, on_round, stop=None, layout: Layout | None = None) -> list[int]:
    """The rounds of one speculative decode, counted into ``stats``; returns the new tokens.

    ``layout``: the target's ``state.Layout`` (None: worked out here).  On a target that verifies
    chains only, a drafter's tree is cut to its first-ranked path (``state.chain_of``)."""
    with_hidden = bool(getattr(draft_src, "needs_target_hidden", False))
    with torch.inference_mode():
        state = CacheState(target, layout)  # the target's cache and its rollback (state.py)
        chains_only = state.layout.tree_refusal() is not None
        draft_src.start(prompt)
        seq, out = list(prompt), []
        n_cached = n_observed = 0  # the target's cache holds seq[:n_cached]; the drafter has seen features of seq[:n_observed]
        while len(out) < max_new_tokens:
            draft = propose_draft(draft_src, seq, widths, expand_all, max_new_tokens - len(out) - 1)  # N nodes
            if chains_only:
                draft = chain_of(draft)
            state.mark(n_cached)
            logits, hidden = verify(target, state.cache, n_cached, seq[n_cached:], draft, with_hidden,
                                    state.layout, stats)  # [1 + N, V]
            verdict = accept(rule, logits, draft, summary_k, eos)  # path, emitted tokens
            certs = certify(rule, verdict, draft) if certificates else None  # per expanded node
            log = record(stats, draft, verdict, certs)  # RoundLog, counted into stats

            if with_hidden:  # a feature drafter gets the target's features of every position it has not seen
                n_pending = len(seq) - n_cached
                rows = list(range(n_observed - n_cached, n_pending)) + [n_pending + j for j in verdict.path]
                draft_src.observe(hidden[rows])
                n_observed = len(seq) + len(verdict.path)
            draft_src.accept(verdict.path)
            # [pending] + the accepted nodes, or (recurrent state, draft not accepted whole) back to n_cached
            n_cached = state.keep(len(seq), verdict.path, len(draft))
            seq += verdict.emitted
            out += verdict.emitted
            if on_round is not None:
                on_round(log)
            if verdict.emitted and verdict.emitted[-1] in eos:
                break
            if stop is not None and (keep := stop(out)) is not None:
                del out[keep:]
                break
    return out


# ---------------------------------------------------------------------------
# the stages of a round: propose -> verify -> accept -> certify -> record


def propose_draft(draft_src, seq: list[int], widths: list[int], expand_all: bool, remaining: int) -> DraftTree:
    """The round's draft tree: ``widths`` cut to ``remaining`` (the tokens still allowed after the
    bonus one), so no draft runs past the length limit.  A suffix drafter's matches may run deeper
    than ``widths``; its ``depth_limit`` is set to ``remaining`` first."""
    if hasattr(draft_src, "depth_limit"):
        draft_src.depth_limit = remaining
    return draft_src.propose(seq, widths[: min(len(widths), remaining)], expand_all)


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

    summary: Summary  # the target's top-k view of the 1 + N verification rows (row 0: root, row 1 + i: node i)
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
