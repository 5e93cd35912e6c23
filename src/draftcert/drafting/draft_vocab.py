"""A causal-LM drafter's draft vocabulary: the tokens it may propose, and the output layer over them.

FR-Spec and EAGLE-3 cut a drafter's output layer to the frequent tokens: on the Qwen pair the 0.5B
drafter's 151,936-row head is 145 of the 391 MB a drafting step reads.  ``DraftVocabulary`` is such
a cut, of one of two kinds:

- **a prefix** (``DraftVocabulary.prefix(N, V)``, ``--draft-vocab N``): token ids ``0..N-1``.  BPE ids
  run roughly in merge order, so a prefix keeps frequent tokens; the head's first rows are a view of
  its blocks (``GGUFLinear.first_rows``), no copy.
- **a token map** (``DraftVocabulary.load(PATH)``, ``--draft-vocab PATH.json``, written by
  ``draftcert draft-vocab``): the N tokens counted most often in the target's own answers to training
  prompts (``train.distill_data.draft_vocabulary``), *plus the tokens of the sequence being decoded*:
  the prompt's at ``start`` and each new token as it is accepted (a code answer copies the prompt's
  identifiers, which no frequency count ranks).  The head's rows for the map are gathered once per
  output layer (``GGUFLinear.rows``: the same bits per output), the sequence's extra rows in a small
  layer rebuilt when one is added.

Either way the drafter's logits are ``z_y = w_y . h`` for ``y`` in the vocabulary (and the sequence's
tokens), computed as the whole head computes them, and for every other token one shared logit just
below the lowest of those::

    z_y = m - 8 eps (1 + |m|),   m = min over the computed z,

so no such token is ever among the drafts (as long as a tree's width is at most the vocabulary's
size), and q = softmax(z) is a distribution on the whole vocabulary, positive everywhere: KL(p || q)
is finite and the rounds carry certificates, for this drafter (the cut model: not the full model's
softmax).  A target token outside the vocabulary can never be drafted; the verification emits it as
any rejected position, so strict decoding stays the target's greedy decoding.
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

import torch

__all__ = ["DraftVocabulary", "VocabHead", "FORMAT", "SHIPPED", "shipped_vocab", "vocabulary_of"]

FORMAT = "draftcert-draft-vocab/1"
# The token maps shipped for preset drafters (under draftcert/models/weights/; the README beside each
# says how it was made): a drafter loaded by this name gets it unless --draft-vocab says otherwise.
SHIPPED = {"qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b/draft_vocab.json"}


@dataclass(frozen=True, eq=False)
class DraftVocabulary:
    """The token ids a drafter may propose: ``ids`` (sorted, unique, int64 ``[N]``) of a vocabulary of
    ``vocab_size``; ``grows``: the sequence's own tokens join them during a decode (a token map), or not
    (a prefix); ``source``: where it came from (a file, or ``prefix``)."""

    ids: torch.Tensor  # [N] int64, sorted, unique
    vocab_size: int
    grows: bool
    source: str
    key: str = field(init=False)  # what identifies it (a cached head, a cost measurement)

    def __post_init__(self):
        ids = self.ids
        if ids.dim() != 1 or ids.numel() == 0 or ids.dtype != torch.int64:
            raise ValueError(f"draft vocabulary: expected a non-empty 1-D int64 tensor of token ids, got {tuple(ids.shape)} {ids.dtype}")
        if int(ids[0]) < 0 or int(ids[-1]) >= self.vocab_size or bool((ids[1:] <= ids[:-1]).any()):
            raise ValueError(f"draft vocabulary: token ids must be sorted, unique and in 0..{self.vocab_size - 1}")
        n = ids.numel()
        if not self.grows and int(ids[-1]) == n - 1:
            key = f"prefix:{n}"
        else:
            digest = hashlib.sha256(ids.numpy().astype("<i8").tobytes()).hexdigest()[:16]
            key = f"map:{n}:{digest}{':grows' if self.grows else ''}"
        object.__setattr__(self, "key", key)

    def __len__(self) -> int:
        return self.ids.numel()

    @property
    def prefix_length(self) -> int | None:
        """N where this is the prefix ``0..N-1`` that does not grow, else None."""
        return len(self) if self.key.startswith("prefix:") else None

    @classmethod
    def prefix(cls, n: int, vocab_size: int) -> "DraftVocabulary":
        """Token ids ``0..n-1``; ValueError outside 1..vocab_size."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= vocab_size:
            raise ValueError(f"draft vocabulary: expected a number of tokens in 1..{vocab_size} (the drafter's output "
                             f"rows), got {n!r}")
        return cls(torch.arange(n), vocab_size, grows=False, source="prefix")

    @classmethod
    def load(cls, path, vocab_size: int | None = None) -> "DraftVocabulary":
        """A token map from ``draftcert draft-vocab``'s JSON file; ValueError naming what is wrong (not such a
        file, another vocabulary size than ``vocab_size``)."""
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"draft vocabulary {str(path)!r}: cannot read it as JSON ({exc}); "
                             f"write one with `draftcert draft-vocab`") from exc
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"draft vocabulary {str(path)!r}: not a draft vocabulary file (format {FORMAT!r}); "
                             f"write one with `draftcert draft-vocab`")
        if vocab_size is not None and d["vocab_size"] != vocab_size:
            raise ValueError(f"draft vocabulary {str(path)!r}: made for a vocabulary of {d['vocab_size']} tokens, "
                             f"the drafter has {vocab_size}")
        return cls(torch.tensor(d["token_ids"], dtype=torch.int64), int(d["vocab_size"]), grows=True, source=str(path))

    def save(self, path, **about) -> None:
        """Write it as a token map file (``about``: provenance, e.g. the data and the command, kept as given)."""
        d = {"format": FORMAT, "vocab_size": self.vocab_size, "size": len(self), **about, "token_ids": self.ids.tolist()}
        tmp = Path(f"{path}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(d, separators=(",", ":")) + "\n")
        os.replace(tmp, path)


def shipped_vocab(model_spec: str | None) -> "DraftVocabulary | None":
    """The shipped token map of a preset drafter (``SHIPPED``), else None (the whole vocabulary)."""
    name = SHIPPED.get(model_spec) if isinstance(model_spec, str) else None
    if name is None:
        return None
    vocab = DraftVocabulary.load(Path(str(files("draftcert.models") / "weights" / name)))
    return DraftVocabulary(vocab.ids, vocab.vocab_size, grows=True, source=f"shipped: {name}")


def vocabulary_of(drafter) -> "DraftVocabulary | None":
    """The draft vocabulary a drafter's causal LM computes its output layer over (a ``ModelDrafter``'s own
    or a hybrid's model drafter's); None for the whole vocabulary or a drafter without a causal LM."""
    vocab = getattr(getattr(drafter, "model_drafter", None) or drafter, "vocab", None)
    return vocab if isinstance(vocab, DraftVocabulary) else None


# the head over a vocabulary, per output layer and vocabulary key: a GGUF map's rows are a copy, built once
_HEADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _state(head) -> tuple:
    """What a head layer built from ``head`` was built from: a contract switch or new weights rebuild it."""
    from ..gguf.layers import GGUFLinear  # gguf is optional

    if isinstance(head, GGUFLinear):
        return (head.numerics, head.qweight.data_ptr(), None if head.q8weight is None else head.q8weight.data_ptr())
    w = getattr(head, "weight", None)
    return (w.data_ptr() if isinstance(w, torch.Tensor) else None,)


def _rows_layer(head, ids: torch.Tensor):
    """A callable computing ``head``'s outputs ``ids`` (``[rows, H] -> [rows, len(ids)]``), each as the whole
    layer computes it (a GGUF layer: the same bits; a dense one: its weight rows, another GEMM shape's rounding),
    or None for a head of another kind.  A prefix of a GGUF head is a view of it (``first_rows``)."""
    from ..gguf.layers import GGUFLinear  # gguf is optional

    n = ids.numel()
    prefix = int(ids[-1]) == n - 1
    if isinstance(head, GGUFLinear):
        if prefix:
            layer = head.first_rows(n)
            return lambda h: layer(h)[..., :n]
        return head.rows(ids)
    w = getattr(head, "weight", None)
    if not (isinstance(w, torch.Tensor) and w.dim() == 2):
        return None
    b = getattr(head, "bias", None)
    w_ids, b_ids = (w[:n], None if b is None else b[:n]) if prefix else (w[ids], None if b is None else b[ids])
    return lambda h: torch.nn.functional.linear(h, w_ids, b_ids)


def _cached_layer(head, vocab: DraftVocabulary):
    per = _HEADS.setdefault(head, {})
    state = _state(head)
    if vocab.key not in per or per[vocab.key][0] != state:
        per[vocab.key] = (state, _rows_layer(head, vocab.ids))
    return per[vocab.key][1]


class VocabHead:
    """A model's output layer over a draft vocabulary, for one decode: ``self(h)`` maps the final hidden
    states ``h [rows, H]`` to logits ``[rows, V]`` (module docstring: the computed rows are the vocabulary's
    and the tokens the sequence added, ``add``; every other token shares one logit below them)."""

    def __init__(self, model, vocab: DraftVocabulary):
        self.model, self.vocab = model, vocab
        self.head = model.get_output_embeddings()
        self.V = vocab.vocab_size
        self.member = torch.zeros(self.V, dtype=torch.bool)  # [V]: in the vocabulary or added
        self.member[vocab.ids] = True
        self.extra = torch.empty(0, dtype=torch.int64)  # [E] the sequence's tokens outside vocab.ids, sorted
        self._extra_layer = None
        _cached_layer(self.head, vocab)  # built now (once per output layer), not inside a timed step

    def add(self, tokens) -> None:
        """Make the sequence's ``tokens`` draftable too (a token map only; a prefix stays as it is)."""
        if not self.vocab.grows or not len(tokens):
            return
        t = torch.as_tensor(tokens, dtype=torch.int64)
        t = t[(t >= 0) & (t < self.V)]
        new = t[~self.member[t]].unique()
        if new.numel():
            self.member[new] = True
            self.extra = torch.cat([self.extra, new]).sort().values
            self._extra_layer = _rows_layer(self.head, self.extra)

    def snapshot(self):
        """The tokens taken in so far (``restore`` returns to them)."""
        return self.extra, self._extra_layer

    def restore(self, point) -> None:
        self.extra, self._extra_layer = point
        self.member.zero_()
        self.member[self.vocab.ids] = True
        self.member[self.extra] = True

    def __call__(self, h: torch.Tensor) -> torch.Tensor:  # [rows, H] -> [rows, V]
        layer = _cached_layer(self.head, self.vocab)
        part = layer(h) if layer is not None else self.head(h)[..., self.vocab.ids]  # [rows, N]
        more = None
        if self.extra.numel():
            more = self._extra_layer(h) if self._extra_layer is not None else self.head(h)[..., self.extra]  # [rows, E]
        low = part.amin(-1) if more is None else torch.minimum(part.amin(-1), more.amin(-1))  # [rows]
        # every other token: just below the lowest computed logit (8 ulps of it), so never among the drafts
        fill = low - 8 * torch.finfo(part.dtype).eps * (1 + low.abs())
        out = fill.unsqueeze(-1).expand(*h.shape[:-1], self.V).clone()  # [rows, V]
        n = self.vocab.prefix_length
        if n is not None:
            out[..., :n] = part
        else:
            out[..., self.vocab.ids] = part
        if more is not None:
            out[..., self.extra] = more
        return out
