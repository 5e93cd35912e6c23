"""The feature drafter in the decoding loop (``FeatureDrafter``) and the verification forward
that also returns the target's hidden states (``forward_with_hidden``).

A feature drafter (``draftcert.models.eagle.EagleDrafter``) drafts from pairs (token x_{s+1},
target feature f_s).  The engine hands it the target's final hidden states of every position the
verification pass kept (``observe``), so after a round it knows f_s for every cached position
s < n_cached = len(seq) - 1, which is exactly what the next draft needs:

    propose:  catch up on the new pairs (x_{s+1}, f_s) in one drafter step (true features, kept
              in the drafter's KV cache); its last row gives q at the root and the feature g
              guessed for the root; each drafted node is then fed (its token, its parent's g).
    accept:   drop every drafted node from the drafter's cache: next round re-feeds the
              accepted tokens with the target's true features.

The first round has no feature yet, so it drafts nothing: its verification pass is the prefill.
"""

from __future__ import annotations

import torch

from ..summary import topk_lowest_ids
from .drafters import _cache_kwarg
from .tree import DraftTree, crop_cache, tree_attention_mask, tree_position_ids

__all__ = ["FeatureDrafter", "forward_with_hidden"]


def forward_with_hidden(model, cache, ids: list[int], keep: int, mask=None, position_ids=None):
    """(logits of the last ``keep`` positions (keep, V), final hidden states of all positions (T, H)).

    The logits are computed exactly as the causal LM computes them (its output embedding on the
    last hidden states), so decoding with this pass is identical to ``model_forward``.
    """
    dev = model.device
    dec = model.get_decoder()
    out = dec(
        input_ids=torch.tensor([ids], dtype=torch.long, device=dev),
        attention_mask=mask,
        position_ids=position_ids,
        use_cache=True,
        **{_cache_kwarg(dec): cache},  # "cache" in transformers 5, "past_key_values" before
    )
    h = out.last_hidden_state
    logits = model.get_output_embeddings()(h[:, -keep:, :])
    return logits[0], h[0]


class FeatureDrafter:
    """Drafter interface (start / propose / observe / accept) around an ``EagleDrafter``."""

    needs_target_hidden = True

    def __init__(self, model):
        self.model = model
        self.forwards = 0
        self.cache = None
        self.feats = None
        self.n_valid = 0

    def start(self, prompt_ids: list[int]) -> None:
        self.cache = self.model.new_cache()
        self._head = self.model.head_weight()  # the draft-vocabulary rows of the target's head, gathered once
        self.feats = None
        self.n_valid = 0  # pairs (x_{s+1}, f_s), s < n_valid, are in the drafter's cache

    def observe(self, hidden: torch.Tensor) -> None:
        """Target features of the positions the target's cache just gained (in order)."""
        h = hidden.detach().to(self.model.fc.weight.dtype)
        self.feats = h if self.feats is None else torch.cat([self.feats, h], 0)

    @property
    def n_feat(self) -> int:
        return 0 if self.feats is None else int(self.feats.shape[0])

    def _step(self, tokens, feats, pos, mask):
        self.forwards += 1
        dev = self.model.fc.weight.device
        g, red, tail = self.model.step(
            torch.as_tensor(tokens, dtype=torch.long, device=dev)[None], feats[None], pos, mask, cache=self.cache,
            head_weight=self._head,
        )
        return g[0], self.model.full_logits(red[0], tail[0])

    def propose(self, seq: list[int], widths: list[int], expand_all: bool = False) -> DraftTree:
        tree = DraftTree()
        n_feat = self.n_feat
        if not widths or n_feat == 0:
            return tree
        if n_feat > len(seq) - 1:
            raise RuntimeError(f"feature drafter: {n_feat} features for a sequence of {len(seq)} tokens")
        m = self.model
        dev, dt = m.fc.weight.device, m.fc.weight.dtype
        # Depth 0: the new pairs (x_{s+1}, f_s) for s in [n_valid, n_feat), causal over the cache.
        new = n_feat - self.n_valid
        if new <= 0:
            raise RuntimeError("feature drafter: no new target features since the last round")
        pos = torch.arange(self.n_valid, n_feat, device=dev)[None]
        allowed = torch.ones(new, self.n_valid + new, dtype=torch.bool, device=dev).tril(self.n_valid)
        mask = torch.zeros(new, self.n_valid + new, dtype=dt, device=dev).masked_fill_(~allowed, torch.finfo(dt).min)
        g, q = self._step(seq[self.n_valid + 1 : n_feat + 1], self.feats[self.n_valid : n_feat], pos, mask[None, None])
        self.n_valid = n_feat
        front, front_g, front_q = [-1], g[-1:], q[-1:]
        fed: list[int] = []
        node_g: dict[int, torch.Tensor] = {}
        q_rows = []
        for d, w in enumerate(widths, 1):
            q_rows.append(front_q)
            # top-w, lower id first among equal logits (the tokens outside the draft vocabulary share
            # one logit): a deterministic order, the one the profile's trace records
            top = front_q.argmax(-1, keepdim=True) if w == 1 else topk_lowest_ids(front_q, w)[1]
            new_nodes = []
            for i, (f, row) in enumerate(zip(front, top.tolist())):
                tree.expanded.append(f)
                tree.widths.append(w)
                kids = [tree.add(t, f) for t in row]
                for k in kids:
                    node_g[k] = front_g[i]
                new_nodes.append(kids)
            if d == len(widths):
                break
            if not expand_all:
                nxt = new_nodes[0][0]  # only the greedy child continues: a chain, plain attention
                fed.append(nxt)
                pos = torch.tensor([[n_feat - 1 + tree.depths[nxt]]], device=dev)
                front_g, front_q = self._step([tree.tokens[nxt]], node_g[nxt][None], pos, None)
                front = [nxt]
            else:
                front = [n for grp in new_nodes for n in grp]
                anc = tree.ancestors(dev)
                kv = torch.tensor(fed + front, device=dev)
                qn = torch.tensor(front, device=dev)
                mask = tree_attention_mask(n_feat, 0, anc, kv, qn, dt)
                pos = tree_position_ids(n_feat, 0, torch.tensor([tree.depths[n] for n in front], device=dev))
                feats = torch.stack([node_g[n] for n in front])
                front_g, front_q = self._step([tree.tokens[n] for n in front], feats, pos, mask)
                fed.extend(front)
        tree.q = torch.cat(q_rows, 0)
        return tree

    def accept(self, path: list[int]) -> None:
        """Forget the drafted nodes; the accepted ones come back next round with true features."""
        crop_cache(self.cache, self.n_valid)
