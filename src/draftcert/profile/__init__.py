"""``draftcert profile``: step-by-step certificate traces of a target model
(and optionally a drafter) on a prompt set, written as Parquet shards.

    from draftcert.profile import profile
    res = profile(None, "default", "mt-bench", limit=8, max_new_tokens=32, out="runs/smol")

Modules: ``run`` (the ``profile`` call: orchestration, signals, ranks), ``settings``
(options, prompts, resume, run.json), ``batches`` (the batch loop), ``generate`` (greedy
decoding, drafter scoring), ``rollout`` (a feature drafter's own rollouts), ``trace``
(step certificates, shard format), ``distributed`` (torchrun), ``paper`` (reproduce-paper).
"""

from ..certificates import DEFAULT_EPSILONS
from ..criteria import DEFAULT_CRITERIA
from .batches import trace_stats
from .run import ProfileResult, profile

__all__ = ["profile", "ProfileResult", "DEFAULT_CRITERIA", "DEFAULT_EPSILONS", "trace_stats"]
