"""Greedy speculative decoding (chain and tree) with exact acceptance certificates.

    from draftcert.decode import speculative_generate
    res = speculative_generate(target, drafter, input_ids, "additive:0.1", k=4)
    res.tokens, res.stats.tokens_per_forward, res.stats.summary()

    from draftcert.decode import batch_speculative_generate     # B prompts, one target pass per round
    res = batch_speculative_generate(target, "prompt-lookup", [ids_a, ids_b], "strict", k=4)
    res.tokens[b], res.row_stats[b], res.stats
"""

from ..drafting import HybridDrafter, ModelDrafter, PromptLookupDrafter, SuffixDrafter, SuffixIndex, SuffixStore, make_drafter
from ..models.tree_attention import DraftTree, parse_tree
from .batch import BatchDecodeResult, batch_speculative_generate
from .engine import DecodeResult, greedy_generate, speculative_generate
from .config import DecodeConfig, resolve_criterion
from .stats import CertificateViolation, DecodeStats, RoundLog

__all__ = [
    "speculative_generate",
    "batch_speculative_generate",
    "BatchDecodeResult",
    "greedy_generate",
    "resolve_criterion",
    "DecodeConfig",
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
