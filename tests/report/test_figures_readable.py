"""Figures that read at a glance: coinciding criteria stay visible, the length cap is marked."""

from __future__ import annotations

import numpy as np

from draftcert.report import figures
from draftcert.report.summary import read_trace, summarize_trace
from draftcert.tracefile import load_run, run_shards

from . import tracegen


def _summary(tmp_path, steps):
    tracegen.write_run(tmp_path, steps)
    return summarize_trace(read_trace(run_shards(tmp_path)), load_run(tmp_path), [0.05, 0.1, 0.3, 0.5])


def test_length_cap_is_the_mean_remaining_run(tmp_path):
    steps = tracegen.make_steps(seed=3)
    summary, plot = _summary(tmp_path, steps)
    # brute force: from each finite step, the steps up to its sequence's end or the next nonfinite step
    total = n = 0
    for pid in sorted(set(steps["prompt_id"])):
        rows = np.flatnonzero(steps["prompt_id"] == pid)
        bad = steps["nonfinite"][rows[np.argsort(steps["position"][rows])]]
        for i in np.flatnonzero(~bad):
            j = i
            while j < len(bad) and not bad[j]:
                j += 1
            total += j - i
            n += 1
    assert plot["length_cap"] == total / n
    for spec in summary["criteria"]:
        assert np.all(np.asarray(plot["curve"][spec]) <= plot["length_cap"] + 1e-12)


def test_every_criterion_has_its_own_marker_and_line_style(tmp_path, monkeypatch):
    summary, plot = _summary(tmp_path, tracegen.make_steps(seed=0))
    saved = []
    monkeypatch.setattr(figures, "save_png", lambda fig, path: saved.append(fig))
    figures.certified_by_margin(summary, tmp_path / "a.png")
    figures.certified_length(summary, plot, tmp_path / "b.png")
    margin_fig, length_fig = saved
    ax = margin_fig.axes[0]
    lines = [l for l in ax.get_lines() if l.get_label() in summary["criteria"]]
    assert len({(l.get_marker(), l.get_linestyle()) for l in lines}) == len(summary["criteria"])
    xs = [tuple(np.round(l.get_xdata(), 6)) for l in lines]
    assert len(set(xs)) == len(xs)  # dodged: no two criteria share their x positions
    ax = length_fig.axes[0]
    caps = [l for l in ax.get_lines() if np.allclose(l.get_ydata(), plot["length_cap"])]
    assert caps and any("cap" in t.get_text() for t in ax.texts)
