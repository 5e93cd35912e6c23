"""``draftcert profile``: step-by-step certificate traces of a target model
(and optionally a drafter) on a prompt set, written as Parquet shards.

    from draftcert.profile import profile
    res = profile(None, "default", "mt-bench", limit=8, max_new_tokens=32, out="runs/smol")
"""

from .run import DEFAULT_CRITERIA, DEFAULT_EPSILONS, ProfileResult, profile, trace_stats

__all__ = ["profile", "ProfileResult", "DEFAULT_CRITERIA", "DEFAULT_EPSILONS", "trace_stats"]
