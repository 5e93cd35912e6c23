"""A causal LM drafting greedy chains and trees from its own KV cache (``ModelDrafter``).

It grows its trees with ``tree_growth.grow_tree`` (one loop, one tie rule: lower token id first
among equal q), as the feature drafter does, and keeps its cache in step with the accepted
sequence through ``models.cache_state.CacheState`` (any model family's roll-back).
"""

from __future__ import annotations

import torch

from ..models.cache_state import CacheState
from ..models.hf import model_forward, vocab_size_of
from ..models.tree_attention import DraftTree
from .draft_vocab import DraftVocabulary, VocabHead
from .protocol import Drafter
from .tree_growth import grow_tree

__all__ = ["ModelDrafter"]


class ModelDrafter(Drafter):
    """A transformers causal LM proposing greedy drafts from its own KV cache.

    Cache invariant between rounds: it holds the first ``n_valid`` tokens of
    the accepted sequence.  During a round it additionally holds the tree
    nodes it was fed (``fed``, in cache order); ``accept`` keeps those on the
    accepted path (gathered into place) and crops the rest, through ``state.CacheState``: a
    drafter with recurrent state goes back to the state after the round's catch-up unless it
    fed nothing that was rejected, and catches up on the accepted tokens next round.  Such a
    drafter drafts chains and (m, depth) trees (only the greedy child is fed), not static full trees.
    """

    def __init__(self, model, vocab: "int | DraftVocabulary | None" = None):
        self.model = model
        # A draft vocabulary (None: all tokens; an int N: the first N ids): its output layer computes
        # those rows and every other token shares one logit below them, so it never proposes one (strict
        # stays lossless; q is positive everywhere, so its rounds are certified).  A token map also takes
        # in the sequence's own tokens as they come (draft_vocab.py, docs/decoding.md).
        self.vocab = self.checked_vocab(model, vocab)
        self.vocab_head: VocabHead | None = None  # the output layer over the vocabulary, for the current decode
        self.state: CacheState | None = None
        self.n_valid = 0
        self.fed: list[int] = []
        self.forwards = 0

    @property
    def model_drafter(self) -> "ModelDrafter":
        return self

    def fork(self) -> "ModelDrafter":
        """A fresh drafter on the same model (shared weights; its own cache and counter)."""
        return ModelDrafter(self.model, self.vocab)

    @staticmethod
    def checked_vocab(model, vocab: "int | DraftVocabulary | None") -> DraftVocabulary | None:
        """``vocab`` as ``ModelDrafter`` keeps it: None for the whole vocabulary, an int N as the prefix
        ``0..N-1`` (ValueError outside 1..V), a ``DraftVocabulary`` checked against the drafter's V."""
        if vocab is None:
            return None
        V = vocab_size_of(model)
        if isinstance(vocab, DraftVocabulary):
            if vocab.vocab_size != V:
                raise ValueError(f"draft vocabulary {vocab.source!r}: made for a vocabulary of {vocab.vocab_size} "
                                 f"tokens, the drafter has {V}")
            return vocab
        vocab = DraftVocabulary.prefix(vocab, V)
        return None if len(vocab) == V else vocab

    @property
    def cache(self):
        return None if self.state is None else self.state.cache

    def start(self, prompt_ids: list[int]) -> None:
        self.state = CacheState(self.model)
        self.n_valid = 0
        self.fed = []
        self.vocab_head = None if self.vocab is None else VocabHead(self.model, self.vocab)

    def _fwd(self, ids, keep, mask=None, pos=None):
        if self.state.layout.stepwise and self.n_valid and len(ids) > 1:  # its multi-token passes lose the state
            return torch.cat([self._fwd([t], 1) for t in ids])[-keep:]
        self.forwards += 1
        return model_forward(self.model, self.state.cache, ids, keep, mask, pos, head=self.vocab_head)

    def propose(self, seq: list[int], widths: list[int], expand_all: bool = False) -> DraftTree:
        self.fed = []
        if not widths:
            return DraftTree()
        # Depth 1: catch up on the tokens the drafter has not seen; the last row is q at the root.
        if expand_all and self.state.layout.tree_refusal() is not None:
            raise ValueError(f"drafter: static full trees need tree attention in the drafter; "
                             f"{self.state.layout.tree_refusal()}")
        if self.vocab_head is not None:  # the sequence's new tokens (the prompt, then the accepted ones) join a token map
            self.vocab_head.add(seq[self.n_valid :])
        root_q = self._fwd(seq[self.n_valid :], 1)
        self.n_valid = n_seq = len(seq)
        self.state.mark(n_seq)

        def feed(tree, nodes, mask, pos):
            # a chain (mask None) continues the cache: the model's own positions are the nodes'
            return self._fwd([tree.tokens[n] for n in nodes], len(nodes), mask, pos if mask is not None else None)

        tree, self.fed = grow_tree(root_q, widths, expand_all, feed, n_prefix=n_seq, min_margin=self.min_margin,
                                   keep_drafting=self.keep_drafting,
                                   device=self.model.device,
                                   dtype=self.model.dtype)
        return tree

    def checkpoint(self):
        """The cache as it is now, and the tokens a token map took in (``restore`` brings both back: timing repeats)."""
        return self.state.checkpoint(self.n_valid), None if self.vocab_head is None else self.vocab_head.snapshot()

    def restore(self, point) -> None:
        cache_point, vocab_point = point
        self.n_valid = self.state.restore(cache_point)
        if vocab_point is not None:
            self.vocab_head.restore(vocab_point)
        self.fed = []

    def accept(self, path: list[int]) -> None:
        """Keep the cache entries of the accepted path's fed prefix; drop the rest of the tree."""
        where = {n: i for i, n in enumerate(self.fed)}
        offsets = []
        for n in path:
            if n not in where:
                break
            offsets.append(where[n])
        self.n_valid = self.state.keep(self.n_valid, offsets, len(self.fed))
        self.fed = []
