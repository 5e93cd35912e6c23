"""Batched greedy speculative decoding: B prompts of different lengths, ONE target pass per round.

    from draftcert.decode import batch_speculative_generate
    res = batch_speculative_generate(target, "prompt-lookup", [ids_a, ids_b, ids_c], "strict", k=4)
    res.tokens[b], res.row_stats[b], res.stats   # res.stats: every row merged

Every row is decoded exactly as ``engine.speculative_generate`` decodes it alone: its own drafter
state (``drafter.fork()``, the weights shared), its own draft (chain or tree, cut near
``max_new_tokens``), and the engine's own ``accept`` / ``certify`` / ``record`` on its own
verification logits.  Only the target's forward is shared.  So strict is lossless per row (each
row's tokens are its own greedy decoding), and a relaxed rule gives each row what batch 1 gives,
up to the rounding of a batched matmul (none seen in float64).

One round
---------
Running row b feeds P_b pending tokens (its whole prompt in the first round, then its last
emitted token) and the N_b nodes of its draft: W_b = P_b + N_b queries, right-aligned in a block
of W = max_b W_b query columns.  Key columns are the cache's L columns, then the block's W::

    row b, query i may attend
        cache column c   iff valid[b, c]        (the row's own kept tokens; padding and holes masked)
        block column j   by the tree rule of tree.py on the row's [pending] + [nodes]
                         (causal among pending tokens, a node sees its ancestors)
        a dummy query (the W - W_b left of the row's block) sees only itself, and is never read
    position ids    pending i: n_b + i;  node at depth d: n_b + P_b - 1 + d
                    (n_b = the row's cached tokens = its own real positions, whatever its columns)

as one additive 4-D mask [A, 1, W, L + W] (A running rows).  ``logits_to_keep = 1 + max_b N_b``
gives [A, 1 + max N, V]: row b's verification rows are its last 1 + N_b (root, then its nodes).

Cache roll-back, per row
------------------------
gpt-fast rewinds a static cache by moving each row's write index; transformers' ``DynamicCache``
can only append the same number of columns to every row.  So here a row's cache is the set of
columns marked in ``valid`` [A, L], and after each round:

1. the block is compacted in place: row b keeps its P_b pending columns and the columns of its
   accepted path, gathered to the block's first K_b columns; the block is cropped to
   K = max_b K_b columns.  This copies W columns per layer, not the cache.  The K - K_b columns a
   row leaves empty are *holes*, masked exactly like left padding.  (Where a row's tokens sit does
   not matter: keys are cached after the rotary embedding and positions are explicit; only which
   columns are valid does.)
2. a row that finished (EOS, ``stop``, ``max_new_tokens``) leaves the batch; then, or when the
   columns that every row could lose, L - max_b |valid_b|, exceed ``COMPACT_HOLES`` of L, the
   cache is re-gathered: each running row's valid columns, in order, left-padded to the longest
   (one copy of the cache per layer).

Holes only add masked columns to attention; compaction copies the whole cache.  With the cache
appended by concatenation (``DynamicCache`` copies itself on every forward anyway) either choice
costs little.  Measured once (SmolLM2-135M float32, 8 MT-Bench prompts of 52..87 tokens at batch 8,
prompt lookup k=4, 64 new tokens, 1 thread, 2 CPU cores shared with other jobs, two interleaved
repeats): the roll-back took 1.0-1.3 s of a 20-28 s decode when compacting every round
(COMPACT_HOLES = 0), 0.33-0.45 s at 0.25 and 0.35-0.37 s when compacting only as rows leave
(COMPACT_HOLES = 100); the decode times were within the machine's noise of each other.  0.25 is
kept: it bounds the masked columns on long decodes at the price of a rare copy.  Both paths are
tested to give the same tokens.
"""

from __future__ import annotations

import operator
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import reduce
from typing import Callable

import torch

from ..drafting import make_drafter
from ..models.cache_state import Layout, layer_masks, layout_of
from ..models.hf import cache_kwarg, new_cache, vocab_size_of
from ..models.tree_attention import DraftTree, tree_allowed, tree_position_ids
from .config import DecodeConfig
from .engine import check_drafter_vocab, decode_loop
from .round import DecodeRow, emit, propose_draft, settle
from .stats import DecodeStats, RoundLog

__all__ = ["batch_speculative_generate", "BatchDecodeResult", "batch_rows", "fork_drafters", "COMPACT_HOLES"]

# Re-gather the cache when the columns every running row could lose exceed this fraction of it.
COMPACT_HOLES = 0.25


@dataclass
class BatchDecodeResult:
    tokens: list[list[int]]  # per row: new tokens (prompt excluded), EOS included when it ended the row
    stats: DecodeStats  # all rows merged (DecodeStats.merge: num_rounds sums the rows' rounds); seconds = wall time
    row_stats: list[DecodeStats]  # per row; seconds = from the start until the row finished
    seconds: float  # wall time of the decode


# ---------------------------------------------------------------------------
# arguments


def batch_rows(rows, attention_mask=None, vocab: int | None = None) -> list[list[int]]:
    """Per-row token ids from what a caller hands over.

    ``rows``: a list of per-row id lists (or 1-D tensors), different lengths allowed; a LongTensor
    [B, T]; or a mapping with ``input_ids`` (and ``attention_mask``), as a tokenizer returns it.
    ``attention_mask`` [B, T] (0 = padding, 1 = token): positions it marks 0 are dropped, so a
    left-padded batch gives each row's own tokens.  Ids must lie in [0, vocab) when ``vocab`` is given.
    """
    if isinstance(rows, Mapping):
        if "input_ids" not in rows:
            raise ValueError(f"rows: a mapping must hold 'input_ids' (as a tokenizer returns), got keys "
                             f"{sorted(map(str, rows.keys()))}")
        if attention_mask is None:
            attention_mask = rows.get("attention_mask")
        rows = rows["input_ids"]
    if isinstance(rows, torch.Tensor):
        if rows.ndim != 2:
            raise ValueError(f"rows: a tensor must be [B, T] (left-padded token ids), got shape {tuple(rows.shape)}")
        ids = [_int_list(r, f"rows[{b}]") for b, r in enumerate(rows)]
    elif isinstance(rows, (list, tuple)):
        ids = [_int_list(r, f"rows[{b}]") for b, r in enumerate(rows)]
    else:
        raise ValueError(f"rows: expected a list of per-row token id lists, a LongTensor [B, T] or a mapping with "
                         f"'input_ids'; got {type(rows).__name__}")
    if not ids:
        raise ValueError("rows: the batch is empty; pass at least one prompt")
    if attention_mask is not None:
        ids = _apply_mask(ids, attention_mask)
    for b, r in enumerate(ids):
        if not r:
            raise ValueError(f"rows[{b}]: no tokens (after dropping masked positions); every row needs at least one")
        if vocab is not None:
            bad = next((t for t in r if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"rows[{b}]: token id {bad} lies outside [0, {vocab}), the target's vocabulary")
    return ids


def _int_list(row, name: str) -> list[int]:
    """One row's ids: a list / tuple of ints or a 1-D integer tensor."""
    if isinstance(row, torch.Tensor):
        if row.ndim != 1 or row.is_floating_point() or row.is_complex():
            raise ValueError(f"{name}: expected a 1-D integer tensor, got {row.dtype} of shape {tuple(row.shape)}")
        return row.tolist()
    if not isinstance(row, (list, tuple)):
        raise ValueError(f"{name}: expected a list of token ids, got {type(row).__name__}")
    try:
        return [operator.index(t) for t in row]
    except TypeError:
        raise ValueError(f"{name}: token ids must be integers, got {row!r:.80}") from None


def _apply_mask(ids: list[list[int]], attention_mask) -> list[list[int]]:
    """Drop the positions the mask marks 0; the mask must have the ids' shape [B, T]."""
    if isinstance(attention_mask, torch.Tensor):
        mask = attention_mask.tolist() if attention_mask.ndim == 2 else None
    elif isinstance(attention_mask, (list, tuple)) and all(isinstance(m, (list, tuple)) for m in attention_mask):
        mask = [list(m) for m in attention_mask]
    else:
        mask = None
    shape = [len(r) for r in ids]
    if mask is None or len(mask) != len(ids) or [len(m) for m in mask] != shape:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask: expected shape [{len(ids)}, T] matching the rows' lengths {shape}, "
                         f"got {got}")
    if any(v not in (0, 1) for m in mask for v in m):
        raise ValueError("attention_mask: entries must be 0 (padding) or 1 (token)")
    return [[t for t, m in zip(r, mr) if m] for r, mr in zip(ids, mask)]


def fork_drafters(drafter, n: int) -> list:
    """``n`` drafters with their own state sharing one model: ``drafter.fork()`` each.

    A drafter object without ``fork`` serves a batch of one row as-is; more rows need ``fork``
    (``drafting.protocol``: a fresh drafter, same settings, sharing the model).
    """
    forks = [drafter.fork() for _ in range(n)] if n > 1 else [drafter.fork() or drafter]
    if any(f is None for f in forks):
        name = type(getattr(drafter, "inner", drafter)).__name__
        raise ValueError(f"drafter: {name} has no fork(); a batch of {n} rows needs one drafter "
                         "state per row: give the class a fork() returning a fresh drafter that shares its model "
                         "(see draftcert.drafting.protocol), or decode one row at a time")
    return forks


# ---------------------------------------------------------------------------
# the decode


def batch_speculative_generate(
    target,
    drafter,
    rows,
    criterion="strict",
    k: int = 4,
    tree=None,
    max_new_tokens: int = 64,
    *,
    attention_mask=None,
    eos_token_id=None,
    certificates: bool = True,
    tokenizer=None,
    stop: Callable[[int, list[int]], int | None] | None = None,
    on_round: Callable[[int, RoundLog], None] | None = None,
) -> BatchDecodeResult:
    """Greedy speculative decoding of a batch of prompts, one target forward per round (module docstring).

    Parameters
    ----------
    target : transformers causal LM.  Full-attention and sliding-window layers share one pass
        (``state.layer_masks`` applies each layer's window); a model the batched pass cannot serve
        (recurrent state, ALiBi, GPT-Neo's local layers: ``state.Layout.batch_refusal``) is decoded
        row after row, exactly as at batch 1, with a warning that says why.
    drafter : what ``make_drafter`` accepts (a spec string, a causal LM, a drafter object); it is
        made once and forked per row (``fork_drafters``), so a model is loaded once.
    rows : per-row token id lists (different lengths), or a left-padded LongTensor [B, T] with
        ``attention_mask`` [B, T], or a mapping with ``input_ids`` / ``attention_mask``.
    criterion, k, tree, max_new_tokens, eos_token_id, certificates, tokenizer : as
        ``speculative_generate``.
    stop : ``stop(row, new_tokens)`` after each of the row's rounds not ended by EOS: None continues,
        an integer n keeps the row's first n new tokens and ends the row (the round stays counted
        whole in the statistics, as at batch 1).
    on_round : ``on_round(row, log)`` with each row's ``RoundLog`` as it is accepted (streaming).
    """
    config = DecodeConfig.build(target, criterion, k, tree, max_new_tokens, eos_token_id=eos_token_id,
                                certificates=certificates)
    prompts = batch_rows(rows, attention_mask, vocab_size_of(target))
    base = make_drafter(drafter, target, tokenizer)
    check_drafter_vocab(target, base, tokenizer)
    drafters = fork_drafters(base, len(prompts))
    states = [DecodeRow(p, d, config.new_stats(), index=b) for b, (p, d) in enumerate(zip(prompts, drafters))]
    forwards0 = [d.forwards for d in drafters]
    finished = [0.0] * len(states)

    layout = config.layout
    serial = layout.batch_refusal() if len(states) > 1 else None
    if serial is not None:
        warnings.warn(f"batch_speculative_generate: {layout.model_name} is decoded row after row (as at batch 1, "
                      f"lossless), not in one batched pass: {serial}", stacklevel=2)
    t0 = time.perf_counter()
    with torch.inference_mode():
        run = _decode_serial if serial is not None else _decode_rounds
        for row in run(target, states, config, stop, on_round):
            finished[row.index] = time.perf_counter() - t0
    seconds = time.perf_counter() - t0

    for r, f0, sec in zip(states, forwards0, finished):
        r.stats.drafter_forwards = r.drafter.forwards - f0
        r.stats.seconds, r.stats.repeat_seconds = sec, [sec]
    merged = reduce(DecodeStats.merge, [r.stats for r in states])
    merged.seconds, merged.repeat_seconds = seconds, [seconds]  # the rows ran together: wall time, not a sum
    return BatchDecodeResult([r.out for r in states], merged, [r.stats for r in states], seconds)


def _row_callbacks(r: DecodeRow, stop, on_round):
    """A row's ``stop(new_tokens)`` and ``on_round(log)`` from the batch's ``stop(row, ...)`` / ``on_round(row, ...)``."""
    row_stop = None if stop is None else (lambda out, b=r.index: _checked_stop(stop, b, out))
    row_round = None if on_round is None else (lambda log, b=r.index: on_round(b, log))
    return row_stop, row_round


def _decode_serial(target, states: list[DecodeRow], config: DecodeConfig, stop, on_round):
    """A batch decoded row after row by the batch-1 engine (``engine.decode_loop``); yields each row."""
    for r in states:
        row_stop, row_round = _row_callbacks(r, stop, on_round)
        r.out, r.stats = decode_loop(target, r.drafter, r.prompt, replace(config, on_round=row_round, stop=row_stop))
        r.seq = r.prompt + r.out
        r.done = True
        yield r


def _checked_stop(stop, row: int, out: list[int]):
    n = stop(row, list(out))
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(out)):
        raise ValueError(f"stop: row {row} returned {n!r}; expected None or a number of new tokens "
                         f"to keep in [0, {len(out)}]")
    return n


def _decode_rounds(target, states: list[DecodeRow], config: DecodeConfig, stop, on_round):
    """The rounds of a batched decode; yields each row as it finishes."""
    with_hidden = states[0].drafter.needs_target_hidden
    cache = new_cache(target)  # attention layers only (layout.batch_refusal is None); sliding ones kept whole
    callbacks = {r.index: _row_callbacks(r, stop, on_round) for r in states}
    for r in states:
        r.drafter.start(r.prompt)
    running = list(states)  # in the cache's row order
    valid = torch.zeros(len(running), 0, dtype=torch.bool, device=target.device)  # [A, L] kept columns per row
    while running:
        # draft: per row, at batch 1 (never past the length limit)
        drafts = [propose_draft(r.drafter, r.seq, config.widths, config.expand_all, config.max_new_tokens - len(r.out) - 1,
                                config.min_margin) for r in running]
        pending = [r.seq[r.n_cached :] for r in running]
        logits, hidden, offsets = verify_batch(target, cache, valid, [r.n_cached for r in running], pending, drafts,
                                               with_hidden, config.layout)  # [A, 1 + max N, V], [A, W, H] or None
        kept = []  # per row: block columns its cache keeps
        for i, (r, draft, pend, off) in enumerate(zip(running, drafts, pending, offsets)):
            n_keep = logits.shape[1]
            verdict, log = settle(config, r.stats, logits[i, n_keep - 1 - len(draft) :], draft)  # [1 + N_b, V]
            cols = list(range(off, off + len(pend))) + [off + len(pend) + j for j in verdict.path]
            kept.append(cols)
            if with_hidden:  # the row's drafter gets the target's features of its newly cached positions
                r.drafter.observe(hidden[i, cols])
            r.drafter.accept(verdict.path)
            r.n_cached += len(cols)
            row_stop, row_round = callbacks[r.index]
            r.done = emit(config, r, verdict, log, row_round, row_stop)
            if r.done:
                yield r
        survivors = [i for i, r in enumerate(running) if not r.done]
        if survivors:
            valid = roll_back(cache, valid, kept, survivors)
        running = [running[i] for i in survivors]


# ---------------------------------------------------------------------------
# the batched verification pass and the per-row cache roll-back


def verify_batch(target, cache, valid: torch.Tensor, n_cached: list[int], pending: list[list[int]],
                 drafts: list[DraftTree], with_hidden: bool = False, layout: Layout | None = None):
    """The target's one forward over every running row's pending tokens and draft nodes.

    ``valid`` [A, L]: the cache columns each row may attend (its kept tokens, in order);
    ``n_cached[b]``: how many they are (the row's next real position).  Row b's P_b + N_b
    queries are right-aligned in a block of W columns (module docstring).

    The mask is ``state.layer_masks``' (a sliding layer's window on the rows' positions: a cached
    column's position is the count of the row's valid columns before it, as columns stay in order).

    Returns (logits [A, 1 + max N, V], hidden [A, W, H] or None, offsets): row b's verification
    rows are ``logits[b, -(1 + N_b):]``; its queries start at block column ``offsets[b]``.
    """
    A, L = valid.shape
    W = max(len(p) + len(d) for p, d in zip(pending, drafts))
    keep = 1 + max(len(d) for d in drafts)
    ids = torch.zeros(A, W, dtype=torch.long)  # dummy queries: token 0 at position 0, seeing only itself
    pos = torch.zeros(A, W, dtype=torch.long)
    allowed = torch.zeros(A, W, L + W, dtype=torch.bool)
    allowed[:, :, :L] = valid.cpu()[:, None, :]
    offsets = []
    for b, (pend, draft) in enumerate(zip(pending, drafts)):
        P, N = len(pend), len(draft)
        off = W - P - N
        nodes = torch.arange(N)
        ids[b, off:] = torch.tensor(pend + draft.tokens, dtype=torch.long)
        pos[b, off:] = tree_position_ids(n_cached[b], P, torch.tensor(draft.depths, dtype=torch.long))[0]
        allowed[b, off:, L + off :] = tree_allowed(0, P, draft.ancestors(), nodes, nodes)  # [P + N, P + N]
        allowed[b, :off, :] = False
        allowed[b, torch.arange(off), L + torch.arange(off)] = True
        offsets.append(off)
    dev = target.device
    k_pos = torch.cat([valid.cpu().long().cumsum(1) - 1, pos], 1)  # [A, L + W] key positions (masked ones unused)
    mask = layer_masks(layout or layout_of(target), allowed.to(dev), pos.to(dev), k_pos.to(dev),
                       target.dtype)  # [A, 1, W, L + W] (or one per layer type)
    args = dict(input_ids=ids.to(dev), attention_mask=mask, position_ids=pos.to(dev), use_cache=True)
    if not with_hidden:
        out = target(**args, logits_to_keep=keep, **{cache_kwarg(target): cache})
        return out.logits, None, offsets
    dec = target.get_decoder()  # as models.hf.forward_with_hidden: the head on the decoder's last states
    h = dec(**args, **{cache_kwarg(dec): cache}).last_hidden_state  # [A, W, H]
    return target.get_output_embeddings()(h[:, -keep:, :]), h, offsets


def roll_back(cache, valid: torch.Tensor, kept: list[list[int]], survivors: list[int]) -> torch.Tensor:
    """Keep, per row, its ``kept`` block columns; drop finished rows; compact the holes when worth it.

    ``valid`` [A, L] describes the cache before the round's block of W columns; ``kept[b]`` are
    block columns (0 .. W-1) row b keeps, in order; ``survivors`` the rows (in cache order) that
    go on.  Returns the new ``valid`` [len(survivors), L'] (module docstring, "Cache roll-back").
    """
    A, L = valid.shape
    K = max(len(c) for c in kept)
    dev = valid.device
    idx = torch.zeros(A, K, dtype=torch.long)  # [A, K] block column of each kept entry (0: a hole)
    block_valid = torch.zeros(A, K, dtype=torch.bool)
    for b, cols in enumerate(kept):
        idx[b, : len(cols)] = torch.tensor(cols, dtype=torch.long)
        block_valid[b, : len(cols)] = True
    idx = idx.to(dev)
    for layer in cache.layers:  # 1. compact the block in place, crop it to K columns
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name)  # [A, heads, L + W, head_dim]
            t[:, :, L : L + K] = t[:, :, L:].gather(2, idx[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))
            setattr(layer, name, t[:, :, : L + K])
    valid = torch.cat([valid, block_valid.to(dev)], 1)  # [A, L + K]
    counts = valid.sum(1)
    holes = valid.shape[1] - int(counts[survivors].max())
    if len(survivors) == A and holes <= COMPACT_HOLES * valid.shape[1]:
        return valid
    # 2. re-gather: the survivors' valid columns, in order, left-padded to the longest
    n = counts[survivors]
    Lp = int(n.max())
    cols = torch.zeros(len(survivors), Lp, dtype=torch.long, device=dev)
    for i, b in enumerate(survivors):
        cols[i, Lp - int(n[i]) :] = valid[b].nonzero().squeeze(1)
    rows = torch.tensor(survivors, dtype=torch.long, device=dev)
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name)[rows]  # [A', heads, L + K, head_dim]
            setattr(layer, name, t.gather(2, cols[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])))
    return torch.arange(Lp, device=dev)[None, :] >= (Lp - n)[:, None]  # [A', Lp]
