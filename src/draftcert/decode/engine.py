"""Greedy speculative decoding with exact acceptance certificates: the loop.

``speculative_generate`` runs rounds of the stages in ``round.py`` until the length limit, EOS or
``stop``::

    draft   = propose_draft(drafter, seq, widths, ...)        # a chain of k tokens, or a tree of N nodes
    n_cached, _ = catch_up(target, ...)                       # recurrent state only: bound the re-fed rows
    logits  = verify(target, cache, n_cached, pending, draft) # ONE target forward over [pending] + nodes
    verdict = accept(rule, logits, draft, summary_k, eos)     # accepted path, emitted tokens, drift
    certs   = certify(rule, verdict, draft)                   # KL(p || q) < radius at every expanded node
    log     = record(stats, draft, verdict, certs)            # the round's RoundLog, counted into DecodeStats
    n_cached = state.keep(len(seq), verdict.path, len(draft)) # the target's cache back to seq + path (state.py)

``k="auto"``: each round's chain length is chosen before it (``adaptive.py``: this machine's cost
curve and the acceptance seen so far; no draft is one choice), a ``tree:M`` rule's tree once
(``shape.auto_engine_args``).

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
from typing import Callable

import torch

from ..criteria import Criterion
from ..drafting import Drafter, ModelDrafter, make_drafter
from ..forward.kv_buffer import append_rows
from ..models import check_compatible
from ..models.cache_state import CacheState, chain_of
from ..models.hf import eos_token_ids, model_forward, new_cache, vocab_size_of
from ..criteria import Strict, TreeCoverage
from ..models.tree_attention import DraftTree
from ..summary import argmax_lowest
from .draft_shape.adaptive import MAX_K
from .config import DecodeConfig, check_max_new_tokens, resolve_criterion
from .round import CertificateBatch, DecodeRow, catch_up, emit, propose_draft, settle, verify
from .draft_shape.shape import adaptive_draft_length, auto_engine_args
from .stats import STAGES, DecodeStats, RoundLog

__all__ = ["speculative_generate", "greedy_generate", "DecodeResult", "check_drafter_vocab", "prepare_decode",
           "decode_loop", "as_prompt_ids"]


@dataclass
class DecodeResult:
    tokens: list[int]  # new tokens (the prompt excluded), EOS included when it ended the run
    stats: DecodeStats
    baseline_tokens: list[int] | None = None  # the target's own greedy decoding, when baseline=True


# ---------------------------------------------------------------------------
# argument handling


def as_prompt_ids(input_ids) -> list[int]:
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


def check_drafter_vocab(target, drafter, tokenizer=None) -> None:
    """Refuse a drafter with a different vocabulary before any decoding."""
    drafter = drafter.model_drafter  # a suffix.HybridDrafter: the model inside it
    if not isinstance(drafter, ModelDrafter):
        return
    check_compatible(target, tokenizer, drafter.model, None)  # config vocab, logit rows (and tokenizers when given)
    vt, vd = vocab_size_of(target), vocab_size_of(drafter.model)
    if vt != vd:
        raise ValueError(
            f"drafter: vocabulary size {vd} differs from the target's {vt}; speculative decoding needs a drafter "
            "sharing the target's tokenizer (use a self:skip=N / self:quant=4 drafter or prompt-lookup)"
        )


# ---------------------------------------------------------------------------
# the decoding loops


def greedy_generate(target, input_ids, max_new_tokens: int = 64, *, eos_token_id=None,
                    stop: Callable[[list[int]], int | None] | None = None) -> list[int]:
    """The target's own greedy decoding with a KV cache (the lossless reference).  ``stop``: as
    ``speculative_generate``'s, called after each token not ending the decode by EOS."""
    prompt = as_prompt_ids(input_ids)
    check_max_new_tokens(max_new_tokens)
    eos = eos_token_ids(target, explicit=eos_token_id)
    out: list[int] = []
    with torch.inference_mode():
        cache, ids = new_cache(target), prompt  # sliding layers kept whole (models.hf.new_cache), as the engine
        while len(out) < max_new_tokens:
            tok = argmax_lowest(model_forward(target, cache, ids, 1)[0])  # lowest index among ties
            out.append(tok)
            if tok in eos:
                break
            if stop is not None and (keep := stop(out)) is not None:
                del out[keep:]
                break
            ids = [tok]
    return out


def auto_draft(target, drafter, tokenizer, criterion, tree, *, spec: str | None = None, on_note=None):
    """``k="auto"``: (k, tree, the drafter object, ``DecodeConfig.draft_length``, the line that says
    what was chosen and why), as ``draftcert decode -k auto`` chooses.  ``spec``: the drafter's
    ``--drafter`` string where ``drafter`` is an object (its shipped acceptance and the cost cache key);
    an object ``make_drafter`` built from a spec string carries it (``.spec``).

    A chain rule gets the adaptive draft length (``adaptive.AdaptiveDraftLength``: each round's
    chain length, no draft included, from the acceptance seen so far); a ``tree:M`` rule the best
    tree of width M before the decode (``shape.auto_engine_args``)."""
    if tree is not None:
        raise ValueError("k='auto' chooses the chain or tree itself: pass tree=None, or an integer k with a tree")
    obj = make_drafter(drafter, target, tokenizer)
    # a spec names the drafter's shipped acceptance figures: the string, else the spec make_drafter built the
    # object from; any other object is keyed by its class (0.3 prior)
    spec = spec or (drafter if isinstance(drafter, str) else getattr(obj, "spec", None) or type(obj).__name__)
    if isinstance(resolve_criterion(criterion, 1, None)[0], TreeCoverage):
        args, choice, source = auto_engine_args(target, obj, spec, criterion, on_note=on_note)
        return args["k"], args["tree"], obj, None, f"-k auto: {choice.why()}; {source}"
    # strict's tokens do not depend on the draft lengths: its rounds may be steered by their own timing
    timed = isinstance(resolve_criterion(criterion, 1, None)[1], Strict)
    factory, line = adaptive_draft_length(target, obj, spec, on_note=on_note, timed=timed)
    return MAX_K, None, obj, factory, f"-k auto: {line}"


def prepare_decode(target, drafter, input_ids, criterion="strict", k: int | str = 4, tree=None,
                   max_new_tokens: int = 64, *, eos_token_id=None, certificates: bool = True, tokenizer=None,
                   on_round=None, stop=None, draft_length=None,
                   draft_margin: float | None = None) -> tuple[list[int], Drafter, DecodeConfig]:
    """Check ``speculative_generate``'s arguments before any work and resolve them: (the prompt's
    ids, the drafter object, the ``DecodeConfig``); ``k="auto"`` is chosen here (``auto_draft``),
    or given as ``k`` = the longest chain and its ``draft_length`` factory."""
    if isinstance(k, str) and k == "auto":
        k, tree, drafter, draft_length, _ = auto_draft(target, drafter, tokenizer, criterion, tree)
    config = DecodeConfig.build(target, criterion, k, tree, max_new_tokens, eos_token_id=eos_token_id,
                                certificates=certificates, on_round=on_round, stop=stop, draft_length=draft_length,
                                draft_margin=draft_margin)
    prompt = as_prompt_ids(input_ids)
    vocab = vocab_size_of(target)
    if max(prompt) >= vocab or min(prompt) < 0:
        raise ValueError(f"input_ids: token ids must lie in [0, {vocab}) for this target")
    draft_src = make_drafter(drafter, target, tokenizer)
    check_drafter_vocab(target, draft_src, tokenizer)
    return prompt, draft_src, config


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
    tokenizer=None,
    on_round: Callable[[RoundLog], None] | None = None,
    stop: Callable[[list[int]], int | None] | None = None,
    draft_margin: float | None = None,
) -> DecodeResult:
    """Greedy speculative decoding of one prompt.

    Parameters
    ----------
    target : transformers causal LM (batch size 1).
    drafter : a spec string, the same as the CLI's ``--drafter`` (``default``, ``self:skip=N``,
        ``self:quant=4``, ``prompt-lookup``, ``suffix``, ``DRAFTER+suffix``, ``eagle:NAME``, a path or
        hub id), a transformers causal LM sharing the target's vocabulary, or a drafter object
        (``draftcert.drafting.Drafter``: ``ModelDrafter``, ``PromptLookupDrafter``, ``FeatureDrafter``,
        ``SuffixDrafter``, ``HybridDrafter``, or any object with ``start``/``propose``/``accept``).
    input_ids : one prompt's token ids: a list, a tensor (T,) / (1, T), or a dict /
        ``BatchEncoding`` with ``input_ids`` (what ``tok(text, return_tensors="pt")`` and
        ``tok.apply_chat_template(..., return_dict=True)`` return).
    criterion : spec string or Criterion: a level-set rule (``strict``,
        ``additive:0.1``, ...) or ``tree:M`` (tree coverage, strict test).
    k : draft tokens per round for a chain (default tree depth for tree:M; 0: no drafts, the target's
        own greedy steps), or ``"auto"`` (the CLI's default): for a chain rule, each round's chain
        length in 0..6 with the best predicted tokens/s from this machine's cost curve (measured on
        first use, then cached: ``decode.draft_shape.costs``) and the acceptance seen so far in this decode,
        starting from the drafter's shipped acceptance by depth, a drafter with a distribution then
        growing each drafting round's chain while its own probabilities say one more token pays
        (``decode.draft_shape.adaptive``; ``stats.draft_lengths`` counts the rounds of each length); for ``tree:M`` the width-M tree
        with the best prediction, chosen once (``decode.draft_shape.shape.auto_engine_args``).  With an explicit
        ``tree``, ``"auto"`` is not allowed (the tree fixes the shape).
    tree : None (chain), ``(m, depth)`` (top-m children along the drafter's
        greedy path), or ``[w1, w2, ...]`` (static full tree, width w_d at depth d).
    certificates : compute the per-position certificates (KL < radius).
    on_round : callback receiving each round's ``RoundLog`` in order, with its certificates: these
        are computed several rounds at a time (``round.CertificateBatch``), so a drafting round's
        log can arrive up to ``CERT_BATCH_SECONDS`` (0.25 s) after its tokens were decided.
    stop : called after each round with the new tokens so far; None continues, an integer n keeps
        the first n new tokens and ends the decode (stopping criteria; the round stays counted whole).
    draft_margin : the drafter's confidence stop, in nats: a drafter with a distribution ends its
        chain (or its tree's greedy path) at the first depth where its top-2 logit gap is below
        this (``drafting.tree_growth``; ``draftcert replay --fit-margin`` fits it); None: never.

    ``stats.seconds`` is this decode's wall time.  Timing against the target alone, with repeats in
    turns, is ``decode.bench.timed_generate``.
    """
    prompt, draft_src, config = prepare_decode(target, drafter, input_ids, criterion, k, tree, max_new_tokens,
                                               eos_token_id=eos_token_id, certificates=certificates,
                                               tokenizer=tokenizer, on_round=on_round, stop=stop,
                                               draft_margin=draft_margin)
    t0 = time.perf_counter()
    out, stats = decode_loop(target, draft_src, prompt, config)
    stats.seconds = time.perf_counter() - t0
    stats.repeat_seconds = [stats.seconds]
    return DecodeResult(tokens=out, stats=stats)


def decode_loop(target, drafter: Drafter, prompt: list[int], config: DecodeConfig) -> tuple[list[int], DecodeStats]:
    """The rounds of one speculative decode: (the new tokens, their statistics).

    On a target that verifies chains only (``config.layout``), a drafter's tree is cut to its
    first-ranked path (``models.cache_state.chain_of``)."""
    row = DecodeRow(prompt, drafter, config.new_stats())
    lengths = config.draft_length() if config.draft_length is not None else None  # -k auto: one per decode
    forwards0 = drafter.forwards
    with_hidden = drafter.needs_target_hidden
    confident = drafter.model_drafter is not None  # its chains stop on its own confidence (adaptive.keep_drafting)
    with torch.inference_mode():
        state = CacheState(target, config.layout)  # the target's cache and its rollback (models/cache_state.py)
        chains_only = state.layout.tree_refusal() is not None
        drafter.start(prompt)
        n_observed = 0  # the drafter has seen the target's features of seq[:n_observed] (or holds them in unseen)
        # the target's features from plain rounds, copied into a buffer of spare rows (the next pass may
        # reuse the buffer they sit in) and handed to the drafter in one piece when it next needs them: a
        # plain round then costs what the target's own greedy step does
        unseen_buffer, unseen = None, None  # unseen: [n, H], a prefix view of unseen_buffer

        def hand_over(rows, later: bool = False) -> None:
            nonlocal unseen_buffer, unseen
            if later:
                unseen_buffer, unseen = append_rows(unseen_buffer, unseen, rows)
                return
            if unseen is not None:
                drafter.observe(unseen)
                unseen_buffer, unseen = None, None  # the drafter may keep what it was handed: a new buffer next
            if rows is not None:
                drafter.observe(rows)

        clock = time.perf_counter
        spent = row.stats.stage_seconds = [0.0] * len(STAGES)  # seconds per stage (stats.STAGES), added up in place
        # the rounds' certificates, computed several rounds at a time (round.CertificateBatch); the
        # rounds reach on_round in order, each once its certificates are in
        batch = CertificateBatch(config.rule, config.summary_k, row.stats, config.on_round) if config.certificates else None
        on_round = None if batch is not None else config.on_round
        ended = False
        while not ended:
            seq, n_cached = row.seq, row.n_cached
            t0 = clock()
            widths, keep_drafting, keep_grafting, grafts = config.widths, None, None, False
            if lengths is not None:  # -k auto: whether to draft; a drafter with a distribution then sets the length
                if hasattr(lengths, "set_budget"):  # what is left to decode, and what a model drafter must catch up on
                    seen = getattr(drafter.model_drafter, "n_valid", None)
                    lengths.set_budget(config.max_new_tokens - len(row.out), len(seq) - seen if seen is not None else 0)
                k = lengths.next_k()
                grafts = not k and getattr(drafter, "grafts_in_plain_rounds", False)  # a hybrid's priced suffix chain, its model idle
                keep_grafting = getattr(lengths, "keep_grafting", None)  # a hybrid's suffix nodes, each priced by its row
                if k and confident:
                    keep_drafting = lengths.keep_drafting
                else:
                    widths = widths[:k]
            if widths and unseen is not None:
                hand_over(None)
            draft = (propose_draft(drafter, seq, widths, config.expand_all, config.max_new_tokens - len(row.out) - 1,
                                   config.min_margin, keep_drafting, keep_grafting) if widths or grafts else DraftTree())  # N nodes
            if chains_only:
                draft = chain_of(draft)
            n_before = n_cached  # recurrent state: re-fed tokens beyond a pass's worth are caught up first
            n_cached, fed = catch_up(target, state.cache, n_cached, seq[n_cached:], len(draft), state.layout,
                                     with_hidden, row.stats)
            if fed is not None and n_observed < n_cached:
                hand_over(fed[n_observed - n_before:])
                n_observed = n_cached
            t1 = clock()
            state.mark(n_cached)
            logits, hidden = verify(target, state.cache, n_cached, seq[n_cached:], draft, with_hidden,
                                    state.layout, row.stats)  # [1 + N, V]
            t2 = clock()
            verdict, log = settle(config, row.stats, logits, draft, spent, batch)  # accept, certify (or keep), record
            if lengths is not None:  # the model drafter's acceptance (a plain round's grafts are not its drafts)
                lengths.observe(log.depth_accepted if widths else [])
            t3 = clock()
            if with_hidden:  # a feature drafter gets the target's features of every position it has not seen
                n_pending = len(seq) - n_cached
                if verdict.path == list(range(len(verdict.path))):  # a chain's accepted prefix: one slice (a view)
                    hand_over(hidden[n_observed - n_cached: n_pending + len(verdict.path)], later=not widths)
                else:
                    rows = list(range(n_observed - n_cached, n_pending)) + [n_pending + j for j in verdict.path]
                    hand_over(hidden[rows], later=not widths)
                n_observed = len(seq) + len(verdict.path)
            if widths or len(draft):  # a plain round without grafts asked the drafter for nothing
                drafter.accept(verdict.path)
            # [pending] + the accepted nodes, or (recurrent state, draft not accepted whole) back to n_cached
            row.n_cached = state.keep(len(seq), verdict.path, len(draft))
            if lengths is not None and lengths.timed:  # strict's -k auto: the round's own cost (adaptive.py)
                grafted = not widths and len(draft)  # a plain round's grafts: a round without the model, untimed
                lengths.observe_seconds(0 if grafted else len(draft), 0.0 if grafted else clock() - t0)
            spent[0] += t1 - t0
            spent[1] += t2 - t1
            spent[4] += clock() - t3
            ended = emit(config, row, verdict, log, on_round, config.stop)
            if batch is not None:
                batch.deliver(log)
                if ended or batch.due():  # outside the round's timing: the certificates of several rounds
                    t4 = clock()
                    batch.flush()
                    spent[3] += clock() - t4
    row.stats.drafter_forwards = drafter.forwards - forwards0
    row.stats.catch_up_plain = getattr(lengths, "declined", 0)
    return row.out, row.stats
