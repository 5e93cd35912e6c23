"""Greedy speculative decoding (chain and tree) with exact acceptance certificates.

    from draftcert.decode import speculative_generate
    res = speculative_generate(target, drafter, input_ids, "additive:0.1", k=4)
    res.tokens, res.stats.tokens_per_forward, res.stats.summary()

    from draftcert.decode import batch_speculative_generate     # B prompts, one target pass per round
    res = batch_speculative_generate(target, "prompt-lookup", [ids_a, ids_b], "strict", k=4)
    res.tokens[b], res.row_stats[b], res.stats
"""

from .batch import BatchDecodeResult, batch_speculative_generate
from .drafters import ModelDrafter, PromptLookupDrafter, make_drafter
from .engine import DecodeResult, greedy_generate, speculative_generate
from .round import resolve_criterion
from .stats import CertificateViolation, DecodeStats, RoundLog
from .suffix import HybridDrafter, SuffixDrafter, SuffixIndex, SuffixStore
from .tree import DraftTree, parse_tree

__all__ = [
    "speculative_generate",
    "batch_speculative_generate",
    "BatchDecodeResult",
    "greedy_generate",
    "resolve_criterion",
    "DecodeResult",
    "DecodeStats",
    "RoundLog",
    "CertificateViolation",
    "ModelDrafter",
    "PromptLookupDrafter",
    "SuffixDrafter",
    "HybridDrafter",
    "SuffixIndex",
    "SuffixStore",
    "make_drafter",
    "DraftTree",
    "parse_tree",
]
