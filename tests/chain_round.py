"""Test helper: the engine's accept and certify stages on one hand-built chain round."""

from __future__ import annotations

import torch

from draftcert.decode import DraftTree
from draftcert.decode.round import RoundCertificates, accept, certify


def chain_draft(tokens) -> DraftTree:
    """A drafted chain as a drafter hands it to the engine: each token the child of the one before,
    every node but the last expanded with width 1."""
    draft = DraftTree()
    for i, tok in enumerate(tokens):
        draft.add(int(tok), i - 1)
    draft.expanded, draft.widths = list(range(-1, len(draft) - 1)), [1] * len(draft)
    return draft


def chain_certificates(rule, x: torch.Tensor, y: torch.Tensor) -> RoundCertificates:
    """The engine's live certificates on a chain round whose expanded rows have target logits
    x [N, V] and drafter logits y [N, V] (each draft token the drafter's argmax)."""
    draft = chain_draft(y.argmax(-1).tolist())
    draft.q = y
    logits = torch.cat([x, x[-1:]])  # [1 + N, V]: the last node's row is never an expanded one
    return certify(rule, accept(rule, logits, draft, 16), draft, logits, 16)
