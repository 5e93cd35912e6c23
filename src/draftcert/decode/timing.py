"""Timings that survive a shared machine: runs interleaved, repeated, summarised by medians.

One wall-clock timing on a shared CPU measures the neighbours as much as the decoder: a
busy spell during the speculative run and not during the baseline turns a 1.2x speedup
into 0.03x.  So the runs to be compared are timed in turns, A B B A A B ... (the order
flips every repeat, so neither run always goes first), and each figure is a median:

    seconds(A)  = median over repeats of A's wall time
    speedup     = median over repeats r of  (tokens_A / seconds_A[r]) / (tokens_B / seconds_B[r])

(the runs of one repeat are adjacent in time, so their ratio shares the machine's state).
The repeats *disagree* when their spread, (max - min) / median of the per-repeat figure,
exceeds ``SPREAD_LIMIT``; a figure from disagreeing repeats is printed with a note, never
plainly, and a single timing has no spread (``None``: unknown).
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

__all__ = ["SPREAD_LIMIT", "interleave", "spread", "reliable", "median_or_none"]

# 20 %: repeats on a quiet machine agree within a few per cent (docs/speed.md); a neighbour
# taking a core for part of the runs moves them by far more than that.
SPREAD_LIMIT = 0.20


def interleave(runs: Sequence[Callable[[], float]], repeats: int) -> list[list[float]]:
    """Call each run ``repeats`` times, in turns: repeat r calls them in order when r is even,
    in reverse when odd (A B, B A, A B, ...).  Each call returns its own timing (seconds).
    Returns ``out[i][r]``: run i's timing in repeat r."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats: expected an integer >= 1, got {repeats!r}")
    out: list[list[float]] = [[] for _ in runs]
    for r in range(repeats):
        order = range(len(runs)) if r % 2 == 0 else reversed(range(len(runs)))
        for i in order:
            out[i].append(float(runs[i]()))
    return out


def median_or_none(values: Sequence[float]) -> float | None:
    return statistics.median(values) if len(values) else None


def spread(values: Sequence[float]) -> float | None:
    """(max - min) / median of the per-repeat figures; None with fewer than two repeats."""
    vals = [v for v in values if v is not None]
    if len(vals) < 2:
        return None
    mid = statistics.median(vals)
    return (max(vals) - min(vals)) / mid if mid > 0 else None


def reliable(values: Sequence[float], limit: float = SPREAD_LIMIT) -> bool | None:
    """Do the repeats agree (spread <= ``limit``)?  None when there is a single timing."""
    s = spread(values)
    return None if s is None else s <= limit
