"""Growing a round's draft tree from a drafter's distributions: the one loop and the one tie rule.

Both model-based drafters (``drafters.ModelDrafter``, a causal LM; ``feature.FeatureDrafter``, a
feature drafter) grow their trees here; they differ only in how they compute q for the nodes
they are fed (``feed``).  Starting from q at the root (the last accepted token), for depth
d = 1 .. len(widths), with w = widths[d - 1]:

    expand   every node of the front gets its top-w tokens as children, from its q row
             (``top_children``: by value, descending; the lower token id first among equal values);
    feed     unless d is the last depth, the next front is fed to the drafter for its q rows:
             with ``expand_all`` every new node (tree attention over the nodes fed before it),
             else only the first front node's greedy child (a chain: plain causal attention).

Confidence stop (``min_margin``, chains and (m, depth) trees): before expanding depth d, the
drafter's top-2 logit gap on the front's q row, ``margin = q_(1) - q_(2)``, is compared with
``min_margin``; below it the tree stops there (a round may draft nothing).  A small margin is
where the drafter is unsure, and where a rejection is likely: the verification rows and drafter
passes beyond it are saved (AdaEDL stops on an entropy bound; the margin is what the profile's
trace records at every depth, so ``draftcert replay --fit-margin`` can fit the threshold).

Draft length from confidence (``keep_drafting``, chains and (m, depth) trees): after expanding depth
d, the drafter's probability of its greedy child at each depth so far, ``pi_j = softmax(q_j)[top]``
for j = 1..d, is handed to ``keep_drafting(pis)``; where it returns False the tree stops there,
before the drafter's next forward (no pass is computed and thrown away, unlike the margin stop, which
needs the next depth's q).  ``decode.draft_shape.adaptive.AdaptiveDraftLength.keep_drafting`` is the rule the
engine passes: one more depth while its expected tokens pay its drafter step and verification row.

Tie rule: ``summary.topk_lowest_ids``, deterministic on every device, and the order the profile's
trace records.  Exact ties are real: a feature drafter gives every token outside its draft
vocabulary one shared logit.  (``torch.topk`` leaves the order of equal values unspecified.)
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from ..summary import argmax_lowest, topk_lowest_ids
from ..models.tree_attention import DraftTree, tree_attention_mask, tree_position_ids

__all__ = ["top_children", "grow_tree", "top2_margin", "top_probability"]

# feed(tree, nodes, mask, position_ids) -> q rows [len(nodes), V] after feeding ``nodes`` (their tokens).
Feed = Callable[[DraftTree, list[int], torch.Tensor | None, torch.Tensor], torch.Tensor]


def top_children(q: torch.Tensor, w: int) -> torch.Tensor:
    """[rows, w] token ids: each row of q [rows, V] ranked by value, descending, lower id first among ties."""
    if w == 1:
        if q.shape[0] == 1:  # a chain's one row: numpy's argmax, the same rule, far faster on a CPU
            return torch.tensor([[argmax_lowest(q[0])]], device=q.device)
        return q.argmax(-1, keepdim=True)  # torch.argmax: the lowest index among ties (documented)
    return topk_lowest_ids(q, w)[1]


def top_probability(q: torch.Tensor) -> float:
    """softmax(q)[argmax q] of one q row [1, V] (logits): the drafter's own confidence in its greedy
    token, ``exp(max - logsumexp) = 1 / sum_y exp(q_y - max)``, in q's precision (float32 at least: a
    relative error near 1e-6 is far below what ``keep_drafting``'s estimate can resolve, and a float64
    copy of a 49k-wide row cost a tenth of a drafted token)."""
    row = q.reshape(-1)
    if row.dtype not in (torch.float32, torch.float64):
        row = row.float()
    if row.device.type == "cpu" and not row.requires_grad:
        # numpy, on this thread: torch's reductions over a row wider than their 32,768-element grain wake
        # the thread pool, about 60 us a call inside a decode against 20 here.  1 / sum exp(q - max):
        # the largest term is exactly 1, the others in (0, 1], summed pairwise in q's precision
        a = row.numpy()
        return float(1.0 / np.exp(a - a.max()).sum())
    return float(torch.exp(row.max() - torch.logsumexp(row, 0)))


def top2_margin(q: torch.Tensor) -> float:
    """The gap between the largest and the second largest value of one q row [1, V] (logits: nats)."""
    top = torch.topk(q.reshape(-1).float(), 2).values
    return float(top[0] - top[1])


def grow_tree(root_q: torch.Tensor, widths: list[int], expand_all: bool, feed: Feed, *, n_prefix: int,
              device, dtype: torch.dtype, min_margin: float | None = None,
              keep_drafting: Callable[[Sequence[float]], bool] | None = None,
              confidence: Callable[[torch.Tensor], float] | None = None) -> tuple[DraftTree, list[int]]:
    """The draft tree (with ``tree.q``: the q rows it was expanded from, [len(expanded), V]) and the
    nodes fed to the drafter, in the order they were fed.

    root_q     [1, V]: the drafter's q at the root.
    feed       ``feed(tree, nodes, mask, position_ids)`` feeds ``nodes`` after everything fed before and
               returns their q rows [len(nodes), V].  ``mask`` is None for a chain (plain causal attention
               after the cache), else the additive tree mask [1, 1, len(nodes), n_prefix + fed + len(nodes)];
               ``position_ids`` [1, len(nodes)]: a node at depth d sits at n_prefix - 1 + d.
    n_prefix   positions in the drafter's cache before the tree (the root is the last of them).
    device, dtype   where the mask is built, and its dtype (the drafter's compute dtype).
    min_margin the confidence stop (module docstring); None: none (static trees never stop).
    keep_drafting  the draft length from confidence (module docstring): called after each depth but the
               last with the greedy children's probabilities so far (a tuple); False stops the tree.  None: none.
    confidence the greedy child's probability of a q row [1, V] (None: ``top_probability``; a drafter that
               knows a cheaper form of the same value passes its own).
    """
    tree = DraftTree()
    fed: list[int] = []
    front, front_q = [-1], root_q
    q_rows = []
    pis: list[float] = []  # keep_drafting's: softmax(q_j)[greedy child] at depths 1..d
    for d, w in enumerate(widths, 1):
        if min_margin is not None and not expand_all and top2_margin(front_q[:1]) < min_margin:
            break  # the drafter is unsure here: a rejection is likely
        q_rows.append(front_q)
        children = []
        for f, row in zip(front, top_children(front_q, w).tolist()):
            tree.expanded.append(f)
            tree.widths.append(w)
            children.append([tree.add(t, f) for t in row])
        if d == len(widths):
            break
        if keep_drafting is not None and not expand_all:
            pis.append((confidence or top_probability)(front_q[:1]))
            if not keep_drafting(tuple(pis)):
                break
        front = [n for group in children for n in group] if expand_all else [children[0][0]]
        pos = tree_position_ids(n_prefix, 0, torch.tensor([tree.depths[n] for n in front], device=device))
        mask = None
        if expand_all:
            anc = tree.ancestors(device)
            kv, qn = torch.tensor(fed + front, device=device), torch.tensor(front, device=device)
            mask = tree_attention_mask(n_prefix, 0, anc, kv, qn, dtype)
        front_q = feed(tree, front, mask, pos)
        fed.extend(front)
    # one row (a chain of one): the drafter's own [1, V] tensor, made for this round (no copy)
    tree.q = (q_rows[0] if len(q_rows) == 1 else torch.cat(q_rows, 0)) if q_rows else None
    return tree, fed
