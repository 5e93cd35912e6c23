"""Figure layout (issue 31): the certified-length plot's cap box covers no title, and plots over
draft positions or draft lengths have ticks at whole numbers only."""

from __future__ import annotations

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg

from draftcert.replay import speed_figures as replay_figures
from draftcert.replay.api import replay

from . import tracegen
from .test_figures_readable import drawn  # noqa: F401  (the fixture: every figure as drawn and saved)


def _figure(drawn, name):  # noqa: F811
    return next(fig for n, fig, _ in drawn[2] if n == name)


def test_cap_box_covers_no_title(drawn):  # noqa: F811
    fig = _figure(drawn, "certified_length.png")
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    r = canvas.get_renderer()
    ax = fig.axes[0]
    boxes = [t.get_bbox_patch().get_window_extent(r) for t in ax.texts if t.get_text().startswith("cap =")]
    assert boxes, "the cap is marked"
    title, inside = ax.title.get_window_extent(r), ax.get_window_extent(r)
    for box in boxes:
        assert not box.overlaps(title), (box, title)
        assert inside.y0 <= box.y0 and box.y1 <= inside.y1, (box, inside)  # within the plot, under its top edge


@pytest.mark.parametrize("ks", [(1, 2, 3), (1, 2), tuple(range(1, 9))])
def test_draft_position_axes_have_whole_number_ticks(tmp_path, monkeypatch, ks):
    """A short chain (positions 1-3) once had ticks at 1.5 and 2.5."""
    tracegen.write_run(tmp_path, tracegen.make_steps(seed=1))
    saved = []
    monkeypatch.setattr(replay_figures, "save_png", lambda fig, path: saved.append((path.name, fig)))
    replay_figures.write_figures(replay(tmp_path, ks=ks, tree_widths=(), static=()), tmp_path / "figures")
    assert "replay_acceptance_by_position.png" in dict(saved)
    for name, fig in saved:
        ax = fig.axes[0]
        FigureCanvasAgg(fig).draw()
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks and all(float(t).is_integer() for t in ticks), (name, ks, ticks)
