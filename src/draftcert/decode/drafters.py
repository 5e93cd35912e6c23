"""Drafters: something that proposes a draft tree given the accepted sequence.

Interface (duck-typed; both classes below implement it)::

    start(prompt_ids)                      # new sequence; reset any cache
    propose(seq, widths, expand_all)       # -> DraftTree hanging off seq[-1]
    accept(path)                           # the engine kept these tree nodes
    forwards                               # number of model forward passes so far
    fork()                                 # a fresh drafter, same settings, sharing the model (batching)

``fork`` is what batched decoding (``batch.py``) needs: every row keeps its own drafter state
(KV cache, features), while the weights are loaded once and shared by all rows.

A chain of k drafts is ``widths = [1] * k``.  ``expand_all=False`` grows only
the drafter's greedy child at each depth (``tree=(m, depth)``);
``expand_all=True`` expands every node (a static full tree ``[w1, w2, ...]``).

The drafters with a distribution (``ModelDrafter`` here, ``feature.FeatureDrafter``) grow their
trees with ``propose.grow_tree``: one loop, one tie rule (lower token id first among equal q).
"""

from __future__ import annotations

import os

import torch

from ..models import load_drafter, parse_drafter_spec
from ..models.eagle import EagleDrafter
from ..models.hf import model_forward
from .feature import FeatureDrafter
from .propose import grow_tree
from .state import CacheState
from .suffix import HybridDrafter, SuffixDrafter
from .tree import DraftTree

__all__ = ["ModelDrafter", "PromptLookupDrafter", "make_drafter", "DEFAULT_DRAFTER_TRAINED", "DEFAULT_DRAFTER_UNTRAINED", "FEATURE_K", "MODEL_K"]

# Defaults of ``draftcert decode`` and ``draftcert.generate`` (benchmarks/bench_suffix.py on held-out prompts:
# default+suffix 1.31x the target alone, the feature drafter alone 1.08x, suffix alone 1.27x; docs/decoding.md).
# "trained": the target has a shipped feature drafter (the embedded SmolLM2); "untrained": any other target.
DEFAULT_DRAFTER_TRAINED, DEFAULT_DRAFTER_UNTRAINED = "default+suffix", "suffix"
# Fixed draft lengths (``bench``, ``-k`` omitted outside ``decode``): a feature drafter is cheap but accepted at
# ~0.27 per token on held-out prompts, where the best measured chain is short (docs/speed.md); other drafters: 4.
FEATURE_K, MODEL_K = 1, 4


class ModelDrafter:
    """A transformers causal LM proposing greedy drafts from its own KV cache.

    Cache invariant between rounds: it holds the first ``n_valid`` tokens of
    the accepted sequence.  During a round it additionally holds the tree
    nodes it was fed (``fed``, in cache order); ``accept`` keeps those on the
    accepted path (gathered into place) and crops the rest, through ``state.CacheState``: a
    drafter with recurrent state goes back to the state after the round's catch-up unless it
    fed nothing that was rejected, and catches up on the accepted tokens next round.  Such a
    drafter drafts chains and (m, depth) trees (only the greedy child is fed), not static full trees.
    """

    def __init__(self, model, vocab: int | None = None):
        self.model = model
        # The first ``vocab`` token ids only (None: all): its output layer computes those rows and
        # every other token gets q = 0, so it never proposes one (strict stays lossless; KL(p || q)
        # is infinite, so its trees carry no q and its rounds no certificates).  BPE ids run roughly
        # in merge order, so a prefix of the vocabulary keeps the frequent tokens (docs/decoding.md).
        self.vocab = self.checked_vocab(model, vocab)
        self.state: CacheState | None = None
        self.n_valid = 0
        self.fed: list[int] = []
        self.forwards = 0

    def fork(self) -> "ModelDrafter":
        """A fresh drafter on the same model (shared weights; its own cache and counter)."""
        return ModelDrafter(self.model, self.vocab)

    @staticmethod
    def checked_vocab(model, vocab: int | None) -> int | None:
        """``vocab`` as ``ModelDrafter`` keeps it: None for the whole vocabulary; ValueError outside 1..V."""
        from ..models.hf import vocab_size_of  # the logit dimension (models extra: transformers)

        if vocab is None:
            return None
        V = vocab_size_of(model)
        if isinstance(vocab, bool) or not isinstance(vocab, int) or not 1 <= vocab <= V:
            raise ValueError(f"draft vocabulary: expected a number of tokens in 1..{V} (the drafter's output rows), "
                             f"got {vocab!r}")
        return None if vocab == V else vocab

    @property
    def cache(self):
        return None if self.state is None else self.state.cache

    def start(self, prompt_ids: list[int]) -> None:
        self.state = CacheState(self.model)
        self.n_valid = 0
        self.fed = []

    def _fwd(self, ids, keep, mask=None, pos=None):
        if self.state.layout.stepwise and self.n_valid and len(ids) > 1:  # its multi-token passes lose the state
            return torch.cat([self._fwd([t], 1) for t in ids])[-keep:]
        self.forwards += 1
        return model_forward(self.model, self.state.cache, ids, keep, mask, pos, vocab_rows=self.vocab)

    def propose(self, seq: list[int], widths: list[int], expand_all: bool = False) -> DraftTree:
        self.fed = []
        if not widths:
            return DraftTree()
        # Depth 1: catch up on the tokens the drafter has not seen; the last row is q at the root.
        if expand_all and self.state.layout.tree_refusal() is not None:
            raise ValueError(f"drafter: static full trees need tree attention in the drafter; "
                             f"{self.state.layout.tree_refusal()}")
        root_q = self._fwd(seq[self.n_valid :], 1)
        self.n_valid = n_seq = len(seq)
        self.state.mark(n_seq)

        def feed(tree, nodes, mask, pos):
            # a chain (mask None) continues the cache: the model's own positions are the nodes'
            return self._fwd([tree.tokens[n] for n in nodes], len(nodes), mask, pos if mask is not None else None)

        tree, self.fed = grow_tree(root_q, widths, expand_all, feed, n_prefix=n_seq, device=self.model.device,
                                   dtype=self.model.dtype)
        if self.vocab is not None:  # q vanishes outside the prefix: KL(p || q) = inf, nothing to certify
            tree.q = None
        return tree

    def checkpoint(self):
        """The cache as it is now (``restore`` brings it back: timing repeats)."""
        return self.state.checkpoint(self.n_valid)

    def restore(self, point) -> None:
        self.n_valid = self.state.restore(point)
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


class PromptLookupDrafter:
    """Prompt-lookup decoding (n-gram drafter, no model).

    Proposes what followed the most recent earlier occurrence of the context's
    last n tokens (n from ``max_ngram`` down to ``min_ngram``).  For trees,
    distinct continuations from several matches are merged into a trie
    (at most ``widths[d]`` children per node at depth d + 1).  It has no
    distribution, so its drafts carry no certificates.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_matches: int = 32):
        if not (1 <= int(min_ngram) <= int(max_ngram)):
            raise ValueError(f"prompt lookup: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.max_matches = int(max_ngram), int(min_ngram), int(max_matches)
        self.forwards = 0

    def fork(self) -> "PromptLookupDrafter":
        """A drafter with the same settings (it keeps no state between rounds)."""
        return PromptLookupDrafter(self.max_ngram, self.min_ngram, self.max_matches)

    def start(self, prompt_ids: list[int]) -> None:
        pass

    def continuations(self, seq: list[int], length: int):
        """Continuations (up to ``length`` tokens) of earlier matches of the last n-gram, best first."""
        n_seq = len(seq)
        seen = 0
        for n in range(min(self.max_ngram, n_seq - 1), self.min_ngram - 1, -1):
            tail = seq[n_seq - n :]
            # Most recent match first; a match must end before the tail itself starts.
            for end in range(n_seq - 1, n - 1, -1):
                if seq[end - n : end] == tail:
                    cont = seq[end : end + length]
                    if cont:
                        yield cont
                        seen += 1
                        if seen >= self.max_matches:
                            return

    def propose(self, seq: list[int], widths: list[int], expand_all: bool = False) -> DraftTree:
        tree = DraftTree()
        if not widths:
            return tree
        children: dict[int, dict[int, int]] = {-1: {}}
        for cont in self.continuations(seq, len(widths)):
            node = -1
            for d, tok in enumerate(cont):
                kids = children[node]
                if tok in kids:
                    node = kids[tok]
                    continue
                if len(kids) >= widths[d]:
                    break
                new = tree.add(tok, node)
                kids[tok] = new
                children[new] = {}
                node = new
            if len(children[-1]) >= widths[0] and widths == [1] * len(widths):
                break  # a chain: the best match is all we need
        tree.expanded = [n for n, kids in children.items() if kids]
        tree.widths = [len(children[n]) for n in tree.expanded]
        return tree

    def accept(self, path: list[int]) -> None:
        pass


def make_drafter(drafter, target=None, tokenizer=None, *, dtype=None, draft_vocab: int | None = None):
    """A drafter object from whatever the caller passed.

    A spec string (or path) is resolved by ``models.parse_drafter_spec``, exactly as the CLI's
    ``--drafter``: ``default`` (the shipped feature drafter of the embedded target),
    ``prompt-lookup`` / ``pld`` (optionally ``:MAX_NGRAM``) -> PromptLookupDrafter; ``suffix`` ->
    ``suffix.SuffixDrafter``; ``DRAFTER+suffix`` -> ``suffix.HybridDrafter`` around DRAFTER; ``self:skip=N``,
    ``self:quant=4``, ``eagle:NAME``, a drafter file, a hub id or a path -> ``models.load_drafter``.
    A transformers model -> ModelDrafter; a feature drafter model -> FeatureDrafter (bound to
    ``target``); an object with ``start``/``propose`` is used as-is.  ``dtype``: the compute dtype of
    a drafter model loaded from a spec (``models.load_drafter``'s; None: its loader's default).
    ``draft_vocab``: a causal-LM drafter proposes only the first ``draft_vocab`` token ids
    (``ModelDrafter``'s ``vocab``); ValueError for any other drafter.
    """
    if draft_vocab is not None:
        made = make_drafter(drafter, target, tokenizer, dtype=dtype)
        inner = made.model_drafter if isinstance(made, HybridDrafter) else made
        if not isinstance(inner, ModelDrafter):
            raise ValueError(f"draft vocabulary: only a causal-LM drafter computes a prefix of its output layer; "
                             f"this drafter is a {type(inner).__name__} (drop --draft-vocab)")
        inner.vocab = ModelDrafter.checked_vocab(inner.model, draft_vocab)
        return made
    if hasattr(drafter, "propose") and hasattr(drafter, "start"):
        return drafter
    if isinstance(drafter, (str, os.PathLike)):
        spec = parse_drafter_spec(drafter)
        if spec.kind == "prompt-lookup":
            return PromptLookupDrafter() if spec.max_ngram is None else PromptLookupDrafter(max_ngram=spec.max_ngram)
        if spec.kind == "suffix":
            return SuffixDrafter()
        if target is None:
            raise ValueError(f"drafter {spec.spec!r}: loading it needs the target model (make_drafter(spec, target, tokenizer))")
        model = _wrap_model(load_drafter(spec.model_spec, target, tokenizer, dtype=dtype), target)
        return HybridDrafter(model) if spec.suffix else model
    if isinstance(drafter, torch.nn.Module) and (hasattr(drafter, "config") or hasattr(drafter, "vocab_ids")):
        return _wrap_model(drafter, target)
    raise ValueError(
        "drafter: expected a spec string (default, self:skip=N, self:quant=4, prompt-lookup, eagle:NAME, a path or "
        "hub id), a transformers causal LM or a drafter object with start/propose/accept; "
        f"got {type(drafter).__name__}"
    )


def _wrap_model(model, target):
    """A feature drafter (``models.eagle.EagleDrafter``, bound to ``target``) or a plain causal LM."""
    if isinstance(model, EagleDrafter):
        if target is not None:
            model.bind(target)  # ValueError if it was trained for another target
        return FeatureDrafter(model)
    return ModelDrafter(model)
