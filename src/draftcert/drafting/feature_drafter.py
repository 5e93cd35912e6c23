"""The feature drafter in the decoding loop (``FeatureDrafter``); the verification forward that also
returns the target's hidden states is ``models.hf.forward_with_hidden``.

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

import numpy as np
import torch

from .tree_growth import grow_tree, top_probability
from ..forward import feature_step
from ..forward.kv_buffer import append_rows
from ..models.tree_attention import DraftTree, crop_cache
from .protocol import Drafter

__all__ = ["FeatureDrafter"]


class FeatureDrafter(Drafter):
    """Drafter interface (start / propose / observe / accept / fork) around an ``EagleDrafter``."""

    needs_target_hidden = True

    def __init__(self, model):
        self.model = model
        self.forwards = 0
        self.cache = None
        self.feats = None
        self._feat_buffer = None
        self.n_valid = 0
        self._native = None  # start's feature_step.DecodeStep
        self._last = None  # the last step's (q row, z row, t): _confidence's

    @property
    def model_drafter(self) -> "FeatureDrafter":
        return self

    def fork(self) -> "FeatureDrafter":
        """A fresh drafter on the same feature-drafter model (shared weights; its own cache and features)."""
        return FeatureDrafter(self.model)

    def start(self, prompt_ids: list[int]) -> None:
        self.cache = self.model.new_cache()
        m = self.model
        self._head = m.head_layer()  # the draft vocabulary's rows of the target's head, gathered once
        # gguf-q8 blocks: a step's plan, embedding and rotary rows looked up once per decode (feature_step.DecodeStep)
        plan = m.native_plan(self._head) if m.dtype == torch.float32 else None
        self._native = plan and feature_step.DecodeStep(m, plan, m.target.get_input_embeddings(), m.rotary, m.dtype,
                                                        m.norm.weight)
        self.feats = None
        self._feat_buffer = None
        self.n_valid = 0  # pairs (x_{s+1}, f_s), s < n_valid, are in the drafter's cache

    def observe(self, hidden: torch.Tensor) -> None:
        """Target features of the positions the target's cache just gained (in order).

        ``feats`` [n_feat, H] is a prefix view of a buffer with spare rows, appended in place (a
        ``torch.cat`` per round would copy every feature of the decode so far, in every round)."""
        h = hidden.detach().to(self.model.dtype)
        self._feat_buffer, self.feats = append_rows(self._feat_buffer, self.feats, h)

    @property
    def n_feat(self) -> int:
        return 0 if self.feats is None else int(self.feats.shape[0])

    def _step(self, tokens, feats, pos, mask, last_only: bool = False):
        """One drafter step over ``tokens`` at positions ``pos`` (an int p: p, p + 1, ...; or ``[1, T]``):
        (features g [T, H], full-vocabulary logits q [T, V]); ``last_only``: g and q of the last row only (a
        catch-up step drafts from its last row: the other rows' norm, head and [V]-wide logits would be
        computed for nothing)."""
        self.forwards += 1
        chain = isinstance(pos, int) and mask is None
        out = self._native(tokens, feats, pos, self.cache, last_only) if chain and self._native else None
        if out is None:
            dev = self.model.device
            pos = torch.arange(pos, pos + len(tokens), device=dev)[None] if isinstance(pos, int) else pos
            out = self.model.step(torch.as_tensor(tokens, dtype=torch.long, device=dev)[None], feats[None], pos, mask,
                                  cache=self.cache, head_weight=self._head, last_only=last_only)
        g, red, tail = out
        q = feature_step.take_full_logits(self.model, red, tail)  # [1, R, V]: the native step wrote them
        q = q[0] if q is not None else self.model.full_logits(red[0], tail[0])
        self._last = (q[-1], red[0, -1], tail[0, -1])  # _confidence's: the last row's q, z [V_d] and t
        return g[0], q

    def _confidence(self, q_row: torch.Tensor) -> float:
        """``top_probability`` of a q row [1, V], from the draft-vocabulary logits z and tail t of the step
        that made it where it is the last step's last row: the V - V_d tokens outside the draft vocabulary
        share ``exp(t)`` (each ``t - log(V - V_d)``) and the cap keeps t below max z, so
        ``softmax(q)[argmax] = 1 / (sum_z exp(z - m) + exp(t - m))``, m = max z: a [V_d] sum, not a [V] one
        (the same value up to float32 rounding; 0.06 ms of a drafting round on the embedded target)."""
        last, m = self._last, self.model
        if (last is None or m.n_draft_vocab >= m.vocab_size or q_row.data_ptr() != last[0].data_ptr()
                or last[1].dtype != torch.float32 or last[1].device.type != "cpu"):
            return top_probability(q_row)
        z = last[1].numpy()
        top = z.max()
        return float(1.0 / (np.exp(z - top).sum() + np.exp(np.float32(last[2].item()) - top)))

    def propose(self, seq: list[int], widths: list[int], expand_all: bool = False) -> DraftTree:
        n_feat = self.n_feat
        if not widths or n_feat == 0:
            return DraftTree()
        if n_feat > len(seq) - 1:
            raise RuntimeError(f"feature drafter: {n_feat} features for a sequence of {len(seq)} tokens")
        m = self.model
        dev, dt = m.device, m.dtype
        # Depth 0: the new pairs (x_{s+1}, f_s) for s in [n_valid, n_feat), causal over the cache.
        new = n_feat - self.n_valid
        if new <= 0:
            raise RuntimeError("feature drafter: no new target features since the last round")
        g, q = self._step(seq[self.n_valid + 1 : n_feat + 1], self.feats[self.n_valid : n_feat], self.n_valid, None,
                          last_only=True)  # causal over the cache; q [1, V]: the root's
        self.n_valid = n_feat
        # g_of[n]: the feature the drafter guessed at node n (-1: the root); a node is fed its parent's.
        g_of = {-1: g[-1]}

        def feed(tree, nodes, mask, pos):
            feats = torch.stack([g_of[tree.parents[n]] for n in nodes])  # [len(nodes), H]
            chain = mask is None and len(nodes) == 1  # one node after the cache: its position, an int
            g, q = self._step([tree.tokens[n] for n in nodes], feats, int(pos[0, 0]) if chain else pos, mask)
            g_of.update(zip(nodes, g))
            return q

        tree, _ = grow_tree(q[-1:], widths, expand_all, feed, n_prefix=n_feat, device=dev, dtype=dt,
                            min_margin=self.min_margin, keep_drafting=self.keep_drafting,
                            confidence=self._confidence)
        return tree

    def accept(self, path: list[int]) -> None:
        """Forget the drafted nodes; the accepted ones come back next round with true features."""
        crop_cache(self.cache, self.n_valid)
