"""Replay a profile trace under every rule, draft length and tree shape (``draftcert replay``),
predict the speed of each configuration, and explain every rejection (``draftcert explain``)."""

from .data import NO_DRAFTER_MESSAGE, ReplayTrace, load_replay_trace
from .walk import ConfigReplay, Round, Shape, default_shapes, parse_shape, replay_config

__all__ = ["load_replay_trace", "ReplayTrace", "NO_DRAFTER_MESSAGE", "Shape", "parse_shape", "default_shapes",
           "replay_config", "ConfigReplay", "Round"]
