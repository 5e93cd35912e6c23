"""A feature drafter's own draft rollouts along the target's greedy path (``draftcert-trace/3``).

A feature (EAGLE-style) drafter drafts depth 1 of a round from the target's true features,
and every deeper depth from its *own* predicted feature ``g`` of the node above
(``drafting.feature_drafter.FeatureDrafter.propose``).  Teacher-forced scoring (one drafter step per
position, on the target's features) therefore gives the engine's drafts at depth 1 only.

For replay, every round the replay can reach exactly (strict rules and tree:M always; relaxed
rules until the first accepted non-greedy token) walks the target's greedy path: the nodes it
expands are the target's greedy tokens.  So at every root position of the greedy path this
module runs the drafter's rollout as the engine would, fed the target's greedy tokens (for a
chain and an (m, depth) tree these are the drafter's own greedy tokens wherever the round can
go on; for a static tree they are the one node of each level on the greedy path), with each
node's feature the drafter's ``g`` of its parent, at the engine's positions (root pair at
position s, its depth-d node at s + d), attending to the true-feature pairs up to the root and
to its own ancestors.  All roots are batched: one drafter step per depth for the whole batch
(the tree-attention mask keeps each rollout to its own prefix and ancestors).

Stored per trace row t (the step that predicts continuation[t]) for depths j = 2..depth: the
drafter's top-``width`` token ids at depth j of the round whose root is j - 1 steps before t
(``rollout_topk_ids``, -1 where no such round exists), and the gap between its top-2 logits
(``rollout_logit_gap``, to tell near ties).  Acceptance and p's log-probabilities of these
tokens are computed from the target's summary of row t (``trace.StepCertifier``).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..models.eagle import EagleDrafter, target_hidden
from ..models.hf import left_pad
from ..summary import topk_lowest_ids
from .greedy_steps import StepTimer

__all__ = ["ROLLOUT_DEPTH", "ROLLOUT_TOPK", "is_feature_model", "score_feature_drafter"]

ROLLOUT_DEPTH = 8  # deepest draft depth replayed exactly (the default k range is 1..8)
ROLLOUT_TOPK = 8  # drafter top-m stored per depth: covers tree:8 and every default tree shape


def is_feature_model(model) -> bool:
    return isinstance(model, EagleDrafter)


@torch.inference_mode()
def score_feature_drafter(draft, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], *,
                          pad_id: int = 0, depth: int = ROLLOUT_DEPTH, width: int = ROLLOUT_TOPK,
                          timer: StepTimer | None = None):
    """``(logits, index, rollout_ids, rollout_gap)``.

    ``logits`` (B, T, V) and ``index`` (B,) as ``generate.score_teacher_forced`` returns them
    (identical to ``draft.forward``'s teacher-forced logits); ``rollout_ids`` (B, T, depth - 1,
    width) int64 and ``rollout_gap`` (B, T, depth - 1) float32 use the same layout: step t of row
    b sits at ``[b, index[b] + t]``.
    """
    timer = timer or StepTimer()
    dev = draft.device
    dt = draft.dtype
    seqs = [list(p) + list(c) for p, c in zip(prompts, continuations)]
    lens = [len(c) for c in continuations]
    T = max(lens)
    B = len(seqs)
    nd = max(0, depth - 1)
    roll_ids = torch.full((B, T, nd, width), -1, dtype=torch.long, device=dev)
    roll_gap = torch.full((B, T, nd), float("nan"), dtype=torch.float32, device=dev)
    with timer.section("model"):
        ids, mask, pos = left_pad(seqs, pad_id, dev)
        L = ids.shape[1]
        f = target_hidden(draft.target, ids, mask, pos)
        head = draft.head_layer()
        cache = draft.new_cache()
        # Depth 1: the teacher-forced pass (pair (x_{s+1}, f_s) at row s, position pos[s]), as
        # EagleDrafter.forward computes it, keeping its KV cache for the rollouts.
        keyok = mask.bool()[:, :-1] & mask.bool()[:, 1:]  # pair row s (x_{s+1}, f_s) is real iff both positions are
        n = L - 1
        causal = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        allowed = (causal[None] & keyok[:, None, :]) | torch.eye(n, dtype=torch.bool, device=dev)[None]
        m4 = torch.zeros(B, 1, n, n, dtype=dt, device=dev).masked_fill_(~allowed[:, None], torch.finfo(dt).min)
        g, red, tail = draft.step(ids[:, 1:], f[:, :-1], pos[:, :-1], m4, cache=cache, head_weight=head)
        logits = torch.zeros(B, T, draft.vocab_size, dtype=dt, device=dev)
        lo = L - T - 2  # step row of kept index 0 (kept index u <-> logits row L - T - 1 + u <-> step row lo + u)
        u0 = max(0, -lo)
        logits[:, u0:] = draft.full_logits(red[:, lo + u0: L - 2], tail[:, lo + u0: L - 2])
    index = torch.tensor([T - n_ for n_ in lens], device=dev)
    # Rollouts: roots sigma in [s0, L - 3] (the depth-1 rows of kept indices u >= u0).
    s0 = max(lo, 0)
    roots = torch.arange(s0, L - 2, device=dev)
    nq = int(roots.numel())
    if nd == 0 or nq == 0:
        return logits, index, roll_ids, roll_gap
    g_prev = g[:, roots]  # (B, nq, H): the feature guessed at each root, fed to its depth-1 node
    key_sigma = torch.arange(n, device=dev)
    teacher_ok = (key_sigma[None, None, :] <= roots[None, :, None]) & keyok[:, None, :]  # (B, nq, n)
    eye = torch.eye(nq, dtype=torch.bool, device=dev)
    fast = _fast_top(draft, width)
    for j in range(2, depth + 1):
        with timer.section("model"), timer.section("model.rollout"):
            tok_idx = (roots + j).clamp(max=L - 1)  # the node of depth j - 1 holds token x_{sigma + j}
            tokens = ids[:, tok_idx]
            p_ids = pos[:, roots] + (j - 1)
            allowed = torch.cat([teacher_ok] + [eye[None].expand(B, nq, nq)] * (j - 1), 2)
            m4 = torch.zeros(B, 1, nq, allowed.shape[2], dtype=dt, device=dev)
            m4.masked_fill_(~allowed[:, None], torch.finfo(dt).min)
            g_prev, red, tail = draft.step(tokens, g_prev, p_ids, m4, cache=cache, head_weight=head)
        with timer.section("certificate"), timer.section("certificate.rollout"):
            # kept index of the predicted token: u = sigma + j + 1 - (L - T)
            u = roots + j + 1 - (L - T)
            ok = u < T
            if not bool(ok.any()):
                continue
            for b in range(B):
                vals, top = _top_of(draft, red[b, ok], tail[b, ok], width, fast)
                roll_ids[b, u[ok], j - 2, : top.shape[1]] = top
                if vals.shape[1] > 1:
                    roll_gap[b, u[ok], j - 2] = (vals[:, 0] - vals[:, 1]).float()
    return logits, index, roll_ids, roll_gap


def _fast_top(draft, width: int):
    """For ``_top_of``: the ``width`` lowest out-of-vocabulary ids, when the draft vocabulary is
    sorted (then the reduced rows' index order is the id order); None: use the full logits."""
    vid = draft.vocab_ids
    V, Vd = draft.vocab_size, int(vid.numel())
    if Vd == V or Vd < width or not bool((vid[1:] > vid[:-1]).all()):
        return None
    inv = torch.ones(V, dtype=torch.bool, device=vid.device)
    inv[vid] = False
    oov = inv.nonzero().flatten()[:width]
    return oov if oov.numel() == width else None


def _top_of(draft, red, tail, width: int, oov):
    """Top-``width`` (values, ids) of ``draft.full_logits(red, tail)``, lowest ids first among equal
    values (``summary.topk_lowest_ids``, what the engine drafts with).  With ``oov`` (``_fast_top``)
    without building the full rows: the top of the draft vocabulary (sorted ids: the same tie
    rule) merged with the lowest out-of-vocabulary ids, which all carry the tail logit."""
    if oov is None:
        return topk_lowest_ids(draft.full_logits(red, tail), min(width, draft.vocab_size))
    v, i = topk_lowest_ids(red, width)
    fill = (tail - math.log(draft.vocab_size - draft.n_draft_vocab)).to(red.dtype)
    vals = torch.cat([v, fill[:, None].expand(-1, width)], 1)
    ids = torch.cat([draft.vocab_ids[i], oov[None].expand(v.shape[0], -1)], 1)
    by_id, perm = torch.sort(ids, dim=-1)
    v_by_id = vals.gather(-1, perm)
    order = torch.sort(v_by_id, dim=-1, descending=True, stable=True).indices[:, :width]
    return v_by_id.gather(-1, order), by_id.gather(-1, order)
