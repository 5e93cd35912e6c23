"""Replay a profile trace under every rule, draft length and tree shape (``draftcert replay``),
predict the speed of each configuration, and explain every rejection (``draftcert explain``).

    from draftcert.replay import replay, calibrate, explain
    res = replay("runs/r8")                      # every rule x chain k=1..8, (m, k) trees, static trees
    res.row("strict", "chain k=4")["tokens_per_forward"]
    res.config("strict", "tree 4x3").accepted_lengths("mt-bench/81")   # round by round
"""

from .api import REPLAY_FORMAT, ReplayResult, format_table, replay, write_replay
from .trace_reader import NO_DRAFTER_MESSAGE, ReplayTrace, load_replay_trace
from .explain import CATEGORIES, DEFAULT_EPSILON, explain
from .speed import calibrate
from .walk import ConfigReplay, Round, Shape, default_shapes, parse_shape, replay_config

__all__ = ["replay", "ReplayResult", "write_replay", "format_table", "REPLAY_FORMAT", "load_replay_trace",
           "ReplayTrace", "NO_DRAFTER_MESSAGE", "explain", "CATEGORIES", "DEFAULT_EPSILON", "calibrate", "Shape",
           "parse_shape", "default_shapes", "replay_config", "ConfigReplay", "Round"]
