"""Report figures (matplotlib, Agg backend, PNG), written atomically.

1. radius_cdf.png          empirical CDF of the forward-KL radius per criterion
2. certified_by_margin.png certified fraction against target-margin bins, one panel per epsilon
3. certified_length.png    mean certified acceptance length against epsilon
4. kl_vs_radius.png        (drafter) actual forward KL against radius per criterion
5. rates_by_margin.png     (drafter) acceptance and certified rate by margin bin per criterion

Readable at the page's width.  report.html shows each PNG at its own size, shrunk to the
page's width (``PAGE_WIDTH_PX``, the page's CSS max-width) when wider.  A font of s pt in a
figure saved at ``DPI`` whose PNG is W px wide shows on the page as

    page_points(s, W) = s * min(1, PAGE_WIDTH_PX / W)

points of a page read at ``DPI`` px per inch (conservative: a browser's 96 px per inch shows
it 110/96 larger).  Every figure keeps its PNG within the page's width and every text at least
``MIN_FONT_PT`` (the ``RC`` sizes below), so every text reads at >= 9 pt.  Legends sit outside
the axes (they cover no data), axes are fitted to the data, and a rate shows the number of
steps it rests on (the "steps in bin" axis on top of the margin panels).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np

from ..fileio import atomic_path
from .run_summary import eps_key


DPI = 110
PAGE_WIDTH_PX = 1100  # report.html's max-width (render.py): a wider PNG is shrunk to it
MIN_FONT_PT = 9
RC = {"font.size": 10, "axes.titlesize": 10, "axes.labelsize": 10, "xtick.labelsize": 9, "ytick.labelsize": 9,
      "legend.fontsize": 9, "legend.title_fontsize": 9, "figure.titlesize": 10.5}


def page_points(font_pt: float, png_width_px: float) -> float:
    """The size (pt) at which text of ``font_pt`` in a PNG ``png_width_px`` wide shows on the page."""
    return font_pt * min(1.0, PAGE_WIDTH_PX / png_width_px)


def _plt():
    import matplotlib  # optional: models extra

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _colors(specs: list[str]) -> dict[str, tuple]:
    plt = _plt()
    cmap = plt.get_cmap("tab10" if len(specs) <= 10 else "tab20")
    return {s: cmap(i % cmap.N) for i, s in enumerate(specs)}


_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">")
_LINESTYLES = ("-", "--", "-.", ":")


def _styles(specs: list[str]) -> dict[str, dict]:
    """Per criterion: colour, marker and line style all differ, so that curves that coincide
    (strict and mars:θ often do) stay distinguishable where they overlap."""
    colors = _colors(specs)
    return {s: {"color": colors[s], "marker": _MARKERS[i % len(_MARKERS)], "ls": _LINESTYLES[i % len(_LINESTYLES)]}
            for i, s in enumerate(specs)}


def save_png(fig, path: Path) -> None:
    """Write ``fig`` to ``path`` as PNG atomically and close it."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=DPI, bbox_inches="tight")
    _plt().close(fig)


def _page_style(fn):
    """Draw (and save) the figure under ``RC``: every text >= ``MIN_FONT_PT``."""
    @functools.wraps(fn)
    def wrapper(*args, **kw):
        with _plt().rc_context(RC):
            return fn(*args, **kw)
    return wrapper


def _legend(fig, ax, ncols: int, **kw) -> None:
    """The legend of ``ax``'s lines under the axes, outside every panel (it covers no data)."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:  # nothing drawn (e.g. no finite steps): no empty legend
        fig.legend(handles, labels, loc="outside lower center", ncols=min(ncols, len(handles)), **kw)


def _count(n: int) -> str:
    return str(n) if n < 1000 else f"{n / 1000:.0f}k" if n < 10**6 else f"{n / 10**6:.0f}M"


def _steps_axis(ax, xc: np.ndarray, counts: list[int]) -> None:
    """The number of steps each bin's rate rests on, as a second x axis on top."""
    top = ax.secondary_xaxis("top")
    top.set_xticks(xc, [_count(int(n)) for n in counts])
    top.tick_params(length=0, pad=2)
    top.set_xlabel("steps in bin")


def _log_limits(v: np.ndarray, default: tuple[float, float]) -> tuple[float, float]:
    """Log-axis limits fitted to the positive finite values of ``v`` (a factor 2 of room each
    side), widened about their geometric middle to at least one decade."""
    v = v[np.isfinite(v) & (v > 0)]
    if not v.size:
        return default
    lo, hi = float(v.min()) / 2, float(v.max()) * 2
    if hi < lo * 10:
        mid = math.sqrt(lo * hi)
        lo, hi = mid / math.sqrt(10), mid * math.sqrt(10)
    return lo, hi


def _grid(n: int, max_cols: int = 4) -> tuple[int, int]:
    cols = min(n, max_cols)
    return math.ceil(n / cols), cols


@_page_style
def radius_cdf(summary: dict, plot: dict, path: Path) -> None:
    plt = _plt()
    specs = summary["criteria"]
    colors = _colors(specs)
    fin = [c["x"] for c in plot["cdf"].values()]
    lo, hi = _log_limits(np.concatenate(fin) if fin else np.zeros(0), (1e-3, 10.0))
    fig, ax = plt.subplots(figsize=(7.5, 5.4), layout="constrained")
    notes = []
    for spec in specs:
        c = plot["cdf"][spec]
        n, n_inf = c["n"], c["n_inf"]
        if n == 0:
            continue
        x = np.clip(c["x"], lo, hi)  # zeros sit at the left edge, +inf at the right edge
        label = spec + (f"  ({n_inf / n:.0%} = +inf)" if n_inf else "")
        ax.step(np.r_[lo, x], np.r_[0, c["y"]], where="post", color=colors[spec], label=label, lw=1.6)
        if n_inf:
            ax.plot([hi], [1 - n_inf / n], marker=">", color=colors[spec], ms=7, clip_on=False)
            notes.append(spec)
    ax.set_xscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(0, 1.01)
    ax.set_xlabel("acceptance radius, forward KL(p||q) (nats, log scale;\n0 at left edge, +inf at right edge)")
    ax.set_ylabel("fraction of steps with radius <= x")
    ax.set_title("Radius distribution per criterion (empirical CDF)")
    ax.grid(True, alpha=0.25)
    title = "criterion" + ("  (▶ share of +inf radii: never rejected)" if notes else "")
    _legend(fig, ax, 3, title=title)
    save_png(fig, path)


def _bin_centers(edges: list[float]) -> np.ndarray:
    e = np.asarray(edges)
    return (e[:-1] + e[1:]) / 2


@_page_style
def certified_by_margin(summary: dict, path: Path) -> None:
    plt = _plt()
    specs = summary["criteria"]
    styles = _styles(specs)
    mb = summary["margin_bins"]
    xc = _bin_centers(mb["edges"])
    # Criteria often coincide (strict and mars:θ agree wherever the top two are not close):
    # hollow markers of different shapes and sizes, different line styles, and each
    # criterion's points shifted a little inside the bin ("dodged"), so none hides another.
    width = float(np.min(np.diff(mb["edges"]))) if len(mb["edges"]) > 1 else 0.1
    n = len(specs)
    dodge = {s: (i - (n - 1) / 2) * min(0.6 * width / max(n, 1), 0.012) for i, s in enumerate(specs)}
    eps_list = [eps_key(e) for e in summary["epsilons"]]
    rows, cols = _grid(len(eps_list), 2)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows + 1.6), sharey=True, squeeze=False,
                             layout="constrained")
    for k, eps in enumerate(eps_list):
        ax = axes.flat[k]
        for i, spec in enumerate(specs):
            y = np.array([np.nan if v is None else v for v in mb["by_criterion"][spec]["certified_fraction"][eps]], float)
            st = styles[spec]
            ax.plot(xc + dodge[spec], y, marker=st["marker"], ls=st["ls"], color=st["color"], label=spec, lw=1.3,
                    ms=7.5 - 3.5 * i / max(n - 1, 1), mfc="none", mew=1.3, zorder=2 + n - i)
        ax.set_title(f"eps = {eps} nats")
        ax.set_xlim(0, 1)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("target margin p(1st) - p(2nd)")
        _steps_axis(ax, xc, mb["steps"])
        ax.grid(True, alpha=0.25)
        if k % cols == 0:
            ax.set_ylabel("certified fraction\n(radius >= eps)")
    for ax in list(axes.flat)[len(eps_list):]:
        ax.set_visible(False)
    _legend(fig, axes.flat[0], 4, title="criterion")
    fig.suptitle("Certified fraction by target-margin bin\n"
                 "(points of a bin are spread slightly so that equal values stay visible)")
    save_png(fig, path)


@_page_style
def certified_length(summary: dict, plot: dict, path: Path) -> None:
    plt = _plt()
    specs = summary["criteria"]
    styles = _styles(specs)
    grid = np.asarray(plot["eps_grid"])
    fig, ax = plt.subplots(figsize=(7.5, 5.6), layout="constrained")
    n = len(specs)
    for i, spec in enumerate(specs):
        st = styles[spec]
        ax.plot(grid, plot["curve"][spec], color=st["color"], ls=st["ls"], label=spec, lw=2.2 - 0.9 * i / max(n - 1, 1),
                zorder=2 + n - i)
    for e in summary["epsilons"]:
        ax.axvline(e, color="0.6", lw=0.8, ls=":")
    cap = plot.get("length_cap")
    if cap is not None and np.isfinite(cap) and cap > 0:
        # Runs cannot outlast their sequence: with every step certified the mean run is this cap,
        # and the curves flatten there at small eps (and at large eps where radii are +inf).
        ax.axhline(cap, color="k", lw=1.0, ls=(0, (6, 3)), zorder=1)
        cap_box = ax.annotate(f"cap = {cap:.3g} tokens: every step certified\n(runs end with their sequence, "
                    f"<= {plot.get('max_run', '?')} steps)", xy=(grid[-1], cap), xytext=(-4, 4),
                    textcoords="offset points", ha="right", va="bottom", fontsize=MIN_FONT_PT,
                    bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "0.7", "alpha": 0.9})
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_xlim(grid[0], grid[-1])
    ax.set_ylim(bottom=0, top=max(ax.get_ylim()[1], (cap or 0) * 1.6))
    ax.set_xlabel("per-step drafter divergence budget eps, forward KL (nats, log scale)")
    ax.set_ylabel("mean certified run length (tokens)")
    ax.set_title("Certified acceptance length: consecutive steps with radius >= eps")
    ax.grid(True, which="both", alpha=0.25)
    _legend(fig, ax, 4, title="criterion (dotted verticals: the run's epsilons)")
    if cap is not None and np.isfinite(cap) and cap > 0:
        _raise_top_to_fit(fig, ax, cap_box)  # the box sits over the line: inside the plot, under the title
    save_png(fig, path)


def _raise_top_to_fit(fig, ax, text, margin_px: float = 4.0) -> None:
    """Raise the y-axis top until ``text`` (and its box) lies inside the axes: the space above a
    line near the top depends on the scale (symlog here), the font and the layout, so it is measured
    on the drawn figure rather than guessed as a factor of the data."""
    for _ in range(6):
        fig.canvas.draw()  # the constrained layout and the text's extent
        r = fig.canvas.get_renderer()
        patch = text.get_bbox_patch()
        box = (patch if patch is not None else text).get_window_extent(r)
        axes = ax.get_window_extent(r)
        excess = box.y1 + margin_px - axes.y1
        if excess <= 0:
            return
        lo, hi = ax.get_ylim()
        x0 = ax.transData.transform((ax.get_xlim()[0], hi))[0]
        new_hi = ax.transData.inverted().transform((x0, axes.y1 + 1.2 * excess))[1]
        ax.set_ylim(lo, max(new_hi, hi * 1.05))


@_page_style
def kl_vs_radius(summary: dict, plot: dict, path: Path) -> None:
    """Per criterion, the drafter's forward KL (y) against the step's radius (x).  Each axis is
    fitted to its own data (KL and radius ranges differ by orders of magnitude), the same for
    every panel so that the diagonal KL = radius sits alike in all.  A zero KL sits on the
    bottom edge, a zero radius on the left edge and +inf on the right edge."""
    plt = _plt()
    specs = [s for s in summary["criteria"] if s in plot["scatter"]]
    rows, cols = _grid(len(specs), 3)
    fig, axes = plt.subplots(rows, cols, figsize=(3.1 * cols, 3.0 * rows + 1.3), squeeze=False, layout="constrained")
    kl = np.concatenate([plot["scatter"][s]["kl"] for s in specs]) if specs else np.zeros(0)
    radius = np.concatenate([plot["scatter"][s]["radius"] for s in specs]) if specs else np.zeros(0)
    ylo, yhi = _log_limits(kl, (1e-4, 10.0))
    xlo, xhi = _log_limits(radius, (ylo, yhi))
    for k, spec in enumerate(specs):
        ax = axes.flat[k]
        d = plot["scatter"][spec]
        x, y, acc = np.clip(d["radius"], xlo, xhi), np.clip(d["kl"], ylo, yhi), d["accepted"]
        ax.scatter(x[acc], y[acc], s=4, alpha=0.35, color="tab:green", label="accepted", rasterized=True)
        ax.scatter(x[~acc], y[~acc], s=6, alpha=0.6, color="tab:red", label="rejected", rasterized=True)
        lo, hi = min(xlo, ylo), max(xhi, yhi)
        ax.plot([lo, hi], [lo, hi], color="k", lw=1, label="KL = radius (below: certified)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(xlo, xhi)
        ax.set_ylim(ylo, yhi)
        ax.set_title(spec)
        ax.set_xlabel("radius (nats)")
        if k % cols == 0:
            ax.set_ylabel("actual KL(p||q) (nats)")
        ax.grid(True, alpha=0.25)
    for ax in list(axes.flat)[len(specs):]:
        ax.set_visible(False)
    _legend(fig, axes.flat[0], 3, markerscale=2)
    n = len(next(iter(plot["scatter"].values()))["kl"]) if plot["scatter"] else 0
    fig.suptitle(f"Drafter forward KL against acceptance radius ({n} steps shown; +inf radius at the right edge)\n"
                 "points below the diagonal are certified; red points there would be soundness violations")
    save_png(fig, path)


@_page_style
def rates_by_margin(summary: dict, path: Path) -> None:
    plt = _plt()
    mb = summary["margin_bins"]
    specs = [s for s in summary["criteria"] if "accept_rate" in mb["by_criterion"][s]]
    xc = _bin_centers(mb["edges"])
    counts = mb.get("drafter_steps", mb["steps"])
    rows, cols = _grid(len(specs), 3)
    fig, axes = plt.subplots(rows, cols, figsize=(3.1 * cols, 3.0 * rows + 1.2), sharey=True, sharex=True,
                             squeeze=False, layout="constrained")
    for k, spec in enumerate(specs):
        ax = axes.flat[k]
        b = mb["by_criterion"][spec]
        for key, style, label in (("accept_rate", "-", "accepted"), ("certified_rate", "--", "certified")):
            y = np.array([np.nan if v is None else v for v in b[key]], float)
            ax.plot(xc, y, style, marker="o", ms=3, label=label, lw=1.5)
        ax.set_title(spec)
        ax.set_xlim(0, 1)
        ax.set_ylim(-0.02, 1.02)
        _steps_axis(ax, xc, counts)
        ax.grid(True, alpha=0.25)
        if k // cols == rows - 1 or k + cols >= len(specs):
            ax.set_xlabel("target margin p(1st) - p(2nd)")
            ax.xaxis.set_tick_params(labelbottom=True)
        if k % cols == 0:
            ax.set_ylabel("fraction of steps")
    for ax in list(axes.flat)[len(specs):]:
        ax.set_visible(False)
    _legend(fig, axes.flat[0], 2)
    fig.suptitle("Drafter acceptance rate and certified rate (forward KL < radius)\nby target-margin bin")
    save_png(fig, path)


def write_figures(summary: dict, plot: dict, fig_dir: Path, has_drafter: bool) -> list[Path]:
    """Render every figure into fig_dir; returns the paths written."""
    fig_dir.mkdir(parents=True, exist_ok=True)
    out = []
    jobs = [
        ("radius_cdf.png", lambda p: radius_cdf(summary, plot, p)),
        ("certified_by_margin.png", lambda p: certified_by_margin(summary, p)),
        ("certified_length.png", lambda p: certified_length(summary, plot, p)),
    ]
    if has_drafter and plot["scatter"]:
        jobs += [
            ("kl_vs_radius.png", lambda p: kl_vs_radius(summary, plot, p)),
            ("rates_by_margin.png", lambda p: rates_by_margin(summary, p)),
        ]
    for name, fn in jobs:
        p = fig_dir / name
        fn(p)
        out.append(p)
    return out
