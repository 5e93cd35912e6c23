"""Greedy speculative decoding (chain and tree) with exact acceptance certificates.

    from draftcert.decode import speculative_generate
    res = speculative_generate(target, drafter, input_ids, "additive:0.1", k=4)
    res.tokens, res.stats.tokens_per_forward, res.stats.summary()
"""

from .drafters import ModelDrafter, PromptLookupDrafter, make_drafter
from .engine import DecodeResult, greedy_generate, resolve_criterion, speculative_generate
from .stats import CertificateViolation, DecodeStats, RoundLog
from .tree import DraftTree, parse_tree

__all__ = [
    "speculative_generate",
    "greedy_generate",
    "resolve_criterion",
    "DecodeResult",
    "DecodeStats",
    "RoundLog",
    "CertificateViolation",
    "ModelDrafter",
    "PromptLookupDrafter",
    "make_drafter",
    "DraftTree",
    "parse_tree",
]
