"""Draft trees, tree attention and KV-cache rollback.

A round's draft is a tree hanging off the *root*: the last token of the
accepted sequence.  Nodes are stored parents-first; a chain of k drafts is the
tree with ``parents = [-1, 0, 1, ..., k-2]``.

Verifying a tree in one forward pass
------------------------------------
The target sees ``[pending tokens] + [all nodes]`` after its cache (length S).
Query row i may attend to key column j iff::

    j < S                                   (the cached prefix)
    pending i, pending j:   j <= i          (ordinary causal)
    node i,    pending j:   always          (every node continues the prefix)
    node i,    node j:      j is i or an ancestor of i

and node i sits at position ``S + P - 1 + depth(i)`` (siblings share a
position).  transformers (5.x) passes a 4-D mask through untouched (
``masking_utils._preprocess_mask_arguments`` returns it as-is) to the attention
kernel: sdpa accepts bool or additive float masks, eager *adds* the mask to
the scores, so we always build the additive float form (0 = attend,
``finfo.min`` = blocked), which means the same thing to both.

Rollback
--------
After acceptance only the accepted path survives.  Its cache entries are
gathered into place right after the prefix and the rest is cropped
(``DynamicCache.crop``).  For a chain the accepted path is a prefix of the
drafts, so this is a plain crop.  These two act on attention layers; ``state.CacheState`` is the
engine's rollback for every kind of layer (recurrent state included) and calls them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["DraftTree", "parse_tree", "tree_allowed", "tree_attention_mask", "additive_mask", "tree_position_ids",
           "crop_cache", "keep_cache"]


@dataclass
class DraftTree:
    """A round's draft.  ``parents[i] = -1`` means a child of the root.

    ``expanded[e]`` is the node (-1 = root) whose children were proposed from
    drafter logits ``q[e]``, taking its top ``widths[e]``; ``q`` is None for
    drafters without a distribution (prompt lookup).
    """

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    expanded: list[int] = field(default_factory=list)
    widths: list[int] = field(default_factory=list)
    q: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int, parent: int) -> int:
        self.tokens.append(int(token))
        self.parents.append(int(parent))
        self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
        return len(self.tokens) - 1

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def children_table(self) -> list[list[int]]:
        """children[r] for rows r = 0 (root) and r = i + 1 (node i), in drafter-rank order."""
        ch: list[list[int]] = [[] for _ in range(len(self.tokens) + 1)]
        for i, p in enumerate(self.parents):
            ch[p + 1].append(i)
        return ch

    def ancestors(self, device=None) -> torch.Tensor:
        """(N, N) bool: A[i, j] iff j == i or j is an ancestor of i."""
        n = len(self.tokens)
        anc = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                anc[i] = anc[p]
            anc[i, i] = True
        return anc.to(device) if device is not None else anc


def parse_tree(tree, k: int) -> tuple[list[int], bool] | None:
    """Normalise the ``tree`` argument to (widths per depth, expand_all).

    ``None``             -> None (a chain of k drafts)
    ``(m, depth)``       -> ([m] * depth, False): the drafter expands its top-m
                            children at each depth and only its greedy child continues
    ``[w1, w2, ...]``    -> ([w1, w2, ...], True): a static full tree; every node at
                            depth d-1 gets the drafter's top-w_d children
    ``"m,depth"``        -> as (m, depth) (CLI form)
    """
    if tree is None:
        return None
    if isinstance(tree, str):
        parts = [p.strip() for p in tree.split(",") if p.strip()]
        if len(parts) != 2:
            raise ValueError(f"tree: expected 'm,depth' (e.g. '4,3'), got {tree!r}")
        try:
            tree = (int(parts[0]), int(parts[1]))
        except ValueError:
            raise ValueError(f"tree: expected two integers 'm,depth', got {tree!r}") from None
    if isinstance(tree, tuple):
        if len(tree) != 2:
            raise ValueError(f"tree: expected (m, depth), got {tree!r}")
        m, depth = tree
        _check_int("tree m", m)
        _check_int("tree depth", depth)
        return [int(m)] * int(depth), False
    if isinstance(tree, list):
        if not tree:
            raise ValueError("tree: a static tree needs at least one width, e.g. [3, 2, 1]")
        for w in tree:
            _check_int("tree width", w)
        return [int(w) for w in tree], True
    raise ValueError(f"tree: expected None, (m, depth), a list of widths or 'm,depth'; got {type(tree).__name__}")


def _check_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}: expected an integer >= 1, got {v!r}")


def tree_allowed(
    n_prefix: int,
    n_pending: int,
    anc: torch.Tensor,
    kv_nodes: torch.Tensor,
    q_nodes: torch.Tensor,
) -> torch.Tensor:
    """Bool (P + len(q_nodes), S + P + len(kv_nodes)): query row i may attend key column j (module docstring).

    The key layout after the cache is ``[pending] + kv_nodes``; the query
    layout is ``[pending] + q_nodes`` (every query node must be in kv_nodes).
    """
    device = anc.device
    n_q, n_kv = n_pending + q_nodes.numel(), n_prefix + n_pending + kv_nodes.numel()
    allowed = torch.zeros(n_q, n_kv, dtype=torch.bool, device=device)
    allowed[:, :n_prefix] = True
    allowed[:n_pending, n_prefix : n_prefix + n_pending] = torch.ones(n_pending, n_pending, dtype=torch.bool, device=device).tril()
    allowed[n_pending:, n_prefix : n_prefix + n_pending] = True
    allowed[n_pending:, n_prefix + n_pending :] = anc[q_nodes][:, kv_nodes]
    return allowed


def tree_attention_mask(
    n_prefix: int,
    n_pending: int,
    anc: torch.Tensor,
    kv_nodes: torch.Tensor,
    q_nodes: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Additive 4-D mask (1, 1, P + len(q_nodes), S + P + len(kv_nodes)) of ``tree_allowed``."""
    allowed = tree_allowed(n_prefix, n_pending, anc, kv_nodes, q_nodes)
    return additive_mask(allowed, dtype)[None, None]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive form of a bool mask (same shape): 0 where allowed, ``finfo(dtype).min`` where blocked."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def tree_position_ids(n_prefix: int, n_pending: int, depths: torch.Tensor) -> torch.Tensor:
    """(1, P + len(depths)): pending tokens continue the prefix; a node at depth d sits d after the root."""
    pend = torch.arange(n_prefix, n_prefix + n_pending, device=depths.device)
    return torch.cat([pend, n_prefix + n_pending - 1 + depths])[None]


def crop_cache(cache, length: int) -> None:
    """Drop every cached position >= length (transformers 5.x: crop(-tokens_to_remove))."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)
    elif extra < 0:
        raise RuntimeError(f"cache holds {length + extra} positions; cannot crop to {length}")


def keep_cache(cache, start: int, offsets: list[int]) -> None:
    """Keep the prefix [0, start) followed by positions start + offsets (in that order); drop the rest."""
    if offsets == list(range(len(offsets))):
        crop_cache(cache, start + len(offsets))
        return
    layers = getattr(cache, "layers", None)
    if layers is None:  # pragma: no cover - older cache classes
        raise TypeError(f"keep_cache: unsupported cache type {type(cache).__name__}")
    for layer in layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:  # a dummy or uninitialised layer
            continue
        idx = torch.as_tensor(offsets, dtype=torch.long, device=layer.keys.device) + start
        # Gather the kept entries, write them right after the prefix, then crop.
        for name in ("keys", "values"):
            t = getattr(layer, name)
            t[..., start : start + len(offsets), :] = t[..., idx, :]
    crop_cache(cache, start + len(offsets))
