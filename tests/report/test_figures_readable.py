"""Figures that read at a glance: coinciding criteria stay visible, the length cap is marked, every
text reads at >= 9 pt at the report page's width, axes fit the data, legends cover no data, and a
rate resting on few tries is not drawn as a bare number."""

from __future__ import annotations

import matplotlib.image as mpimg
import numpy as np
import pytest
from matplotlib.text import Text

from draftcert.replay import speed_figures as replay_figures
from draftcert.replay.api import replay
from draftcert.report import figures, render
from draftcert.report.run_summary import read_trace, summarize_trace
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


# --- readable at the report page's width ------------------------------------------------------------


def _capture(mp, module, saved):
    """Replace ``module.save_png`` by one that saves as usual and records (name, figure, PNG width in px)."""
    real = module.save_png

    def save(fig, path):
        real(fig, path)
        saved.append((path.name, fig, mpimg.imread(path).shape[1]))

    mp.setattr(module, "save_png", save)


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    """Every figure of a report with a drafter and of its replay section, as drawn and saved."""
    out = tmp_path_factory.mktemp("figs")
    tracegen.write_run(out, tracegen.make_steps(seed=1))
    summary, plot = summarize_trace(read_trace(run_shards(out)), load_run(out), [0.05, 0.1, 0.3, 0.5])
    saved = []
    with pytest.MonkeyPatch.context() as mp:
        _capture(mp, figures, saved)
        _capture(mp, replay_figures, saved)
        figures.write_figures(summary, plot, out / "figures", True)
        replay_figures.write_figures(replay(out, ks=tuple(range(1, 9)), tree_widths=(4,), static=()), out / "figures")
    names = [name for name, _, _ in saved]
    assert "kl_vs_radius.png" in names and "replay_acceptance_by_position.png" in names
    return summary, plot, saved


def _texts(fig):
    """The texts a reader sees: visible, not empty, not in a hidden panel."""
    for t in fig.findobj(Text):
        if t.get_visible() and t.get_text().strip() and (t.axes is None or t.axes.get_visible()):
            yield t


def test_every_text_reads_at_9pt_at_the_page_width(drawn):
    """A font of s pt in a PNG W px wide shows on the page as s * min(1, page / W) pt (read at
    the figures' 110 px per inch; report.html's max-width is the page)."""
    page = figures.PAGE_WIDTH_PX
    assert f"max-width:{page}px" in render.STYLE
    small = []
    for name, fig, width in drawn[2]:
        for t in _texts(fig):
            pt = t.get_fontsize() * min(1.0, page / width)
            if pt < 9:
                small.append(f"{name}: {t.get_text()[:30]!r} {pt:.1f} pt")
    assert not small, small


def test_kl_against_radius_axes_fit_the_data(drawn):
    _, plot, saved = drawn
    fig = next(fig for name, fig, _ in saved if name == "kl_vs_radius.png")
    kl = np.concatenate([d["kl"] for d in plot["scatter"].values()])
    radius = np.concatenate([d["radius"] for d in plot["scatter"].values()])
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.collections]
    assert len(panels) == len(plot["scatter"])
    for ax in panels:
        for (lo, hi), v in ((ax.get_ylim(), kl), (ax.get_xlim(), radius)):
            v = v[np.isfinite(v) & (v > 0)]
            assert v.min() / 3 <= lo <= v.min() and v.max() <= hi <= v.max() * 3, (ax.get_title(), lo, hi, v.min(), v.max())


def _drawn_points(ax) -> np.ndarray:
    """[n, 2] display coordinates of everything plotted in ``ax`` that lies inside it: the points of
    each line, 20 more along each of its segments (steps drawn as steps), and scatter points."""
    pts = []
    for line in ax.get_lines():
        if not line.get_visible():
            continue
        xy = np.asarray(line.get_xydata(), float)
        if line.get_drawstyle().startswith("steps-post") and len(xy) > 1:
            corners = np.c_[xy[1:, 0], xy[:-1, 1]]
            xy = np.insert(xy, np.arange(1, len(xy)), corners, axis=0)
        d = line.get_transform().transform(xy)
        d = d[np.isfinite(d).all(1)]
        t = np.linspace(0, 1, 21)[:, None, None]
        pts.append(d)
        if len(d) > 1:
            pts.append((d[:-1] + t * (d[1:] - d[:-1])).reshape(-1, 2))
    for c in ax.collections:
        if c.get_visible() and len(c.get_offsets()):
            pts.append(c.get_offset_transform().transform(c.get_offsets()))
    pts = np.concatenate(pts) if pts else np.zeros((0, 2))
    box = ax.get_window_extent()
    inside = (pts[:, 0] >= box.x0) & (pts[:, 0] <= box.x1) & (pts[:, 1] >= box.y0) & (pts[:, 1] <= box.y1)
    return pts[inside]


def test_legends_cover_no_data(drawn):
    covered = []
    for name, fig, _ in drawn[2]:
        fig.canvas.draw()
        legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
        assert legends, name
        for leg in legends:
            box = leg.get_window_extent()
            for ax in fig.axes:
                if not ax.get_visible():
                    continue
                p = _drawn_points(ax)
                n = int(((p[:, 0] >= box.x0) & (p[:, 0] <= box.x1) & (p[:, 1] >= box.y0) & (p[:, 1] <= box.y1)).sum())
                if n:
                    covered.append(f"{name}: legend covers {n} drawn points of {ax.get_title() or 'the axes'}")
    assert not covered, covered


def test_acceptance_by_position_leaves_out_rates_of_few_tries(drawn, tmp_path):
    """A deep position tried a handful of times is not drawn as a bare 0.0 or 0.5."""
    fig = next(fig for name, fig, _ in drawn[2] if name == "replay_acceptance_by_position.png")
    tracegen.write_run(tmp_path, tracegen.make_steps(seed=1))
    res = replay(tmp_path, ks=tuple(range(1, 9)), tree_widths=(4,), static=())
    few = 0
    lines = {l.get_label(): l for l in fig.axes[0].get_lines()}
    for spec, rows in res.rows.items():
        row = max((r for r in rows if r["shape"]["kind"] == ("tree" if spec.startswith("tree:") else "chain")),
                  key=lambda r: len(r["shape"]["widths"]))
        line = lines[f"{spec} ({row['shape']['label']})"]
        shown = set(np.asarray(line.get_xdata(), int).tolist())
        for d, n in enumerate(row["num_attempted_per_pos"], 1):
            assert (d in shown) == (n >= replay_figures.MIN_TRIES), (spec, d, n)
            few += 0 < n < replay_figures.MIN_TRIES
    assert few  # the trace has such positions
    assert any(f"fewer than {replay_figures.MIN_TRIES}" in t.get_text() for t in _texts(fig))
