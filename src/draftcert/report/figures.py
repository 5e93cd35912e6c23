"""Report figures (matplotlib, Agg backend, PNG), written atomically.

1. radius_cdf.png          empirical CDF of the forward-KL radius per criterion
2. certified_by_margin.png certified fraction against target-margin bins, one panel per epsilon
3. certified_length.png    mean certified acceptance length against epsilon
4. kl_vs_radius.png        (drafter) actual forward KL against radius per criterion
5. rates_by_margin.png     (drafter) acceptance and certified rate by margin bin per criterion
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from ..fileio import atomic_path
from .summary import eps_key


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
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    _plt().close(fig)


def _legend(ax, **kw) -> None:
    if ax.get_legend_handles_labels()[0]:  # nothing drawn (e.g. no finite steps): no empty legend
        ax.legend(**kw)


def _grid(n: int, max_cols: int = 4) -> tuple[int, int]:
    cols = min(n, max_cols)
    return math.ceil(n / cols), cols


def radius_cdf(summary: dict, plot: dict, path: Path) -> None:
    plt = _plt()
    specs = summary["criteria"]
    colors = _colors(specs)
    fin = [c["x"][np.isfinite(c["x"]) & (c["x"] > 0)] for c in plot["cdf"].values()]
    fin = np.concatenate(fin) if fin else np.zeros(0)
    lo = float(fin.min()) / 2 if fin.size else 1e-3
    hi = float(fin.max()) * 2 if fin.size else 10.0
    lo, hi = min(lo, hi / 10), max(hi, lo * 10)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
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
    ax.set_xlabel("acceptance radius, forward KL(p||q) (nats, log scale; 0 at left edge, +inf at right edge)")
    ax.set_ylabel("fraction of steps with radius <= x")
    ax.set_title("Radius distribution per criterion (empirical CDF)")
    ax.grid(True, alpha=0.25)
    title = "criterion" + ("\n(▶ share of +inf radii:\nnever rejected)" if notes else "")
    _legend(ax, fontsize=8, loc="upper left", title=title, title_fontsize=8)
    save_png(fig, path)


def _bin_centers(edges: list[float]) -> np.ndarray:
    e = np.asarray(edges)
    return (e[:-1] + e[1:]) / 2


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
    rows, cols = _grid(len(eps_list))
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols + 0.6, 3.2 * rows + 0.9), sharey=True, squeeze=False)
    for k, eps in enumerate(eps_list):
        ax = axes.flat[k]
        for i, spec in enumerate(specs):
            y = np.array([np.nan if v is None else v for v in mb["by_criterion"][spec]["certified_fraction"][eps]], float)
            st = styles[spec]
            ax.plot(xc + dodge[spec], y, marker=st["marker"], ls=st["ls"], color=st["color"], label=spec, lw=1.3,
                    ms=7.5 - 3.5 * i / max(n - 1, 1), mfc="none", mew=1.3, zorder=2 + n - i)
        ax.set_title(f"eps = {eps} nats", fontsize=10)
        ax.set_xlim(0, 1)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("target margin p(1st) - p(2nd)")
        ax.grid(True, alpha=0.25)
        if k % cols == 0:
            ax.set_ylabel("certified fraction\n(radius >= eps)")
    for ax in list(axes.flat)[len(eps_list):]:
        ax.set_visible(False)
    _legend(axes.flat[0], fontsize=7, loc="lower right", title="criterion", title_fontsize=7)
    steps = mb["steps"]
    fig.suptitle(f"Certified fraction by target-margin bin (steps per bin: {', '.join(map(str, steps))}; "
                 "points of a bin are spread slightly so that equal values stay visible)", fontsize=10)
    fig.tight_layout()
    save_png(fig, path)


def certified_length(summary: dict, plot: dict, path: Path) -> None:
    plt = _plt()
    specs = summary["criteria"]
    styles = _styles(specs)
    grid = np.asarray(plot["eps_grid"])
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
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
        ax.annotate(f"cap = {cap:.3g} tokens: every step certified\n(runs end with their sequence, "
                    f"<= {plot.get('max_run', '?')} steps)", xy=(grid[-1], cap), xytext=(-4, -4),
                    textcoords="offset points", ha="right", va="top", fontsize=8,
                    bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "0.7", "alpha": 0.9})
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_xlim(grid[0], grid[-1])
    ax.set_ylim(bottom=0, top=max(ax.get_ylim()[1], (cap or 0) * 1.6))
    ax.set_xlabel("per-step drafter divergence budget eps, forward KL (nats, log scale)")
    ax.set_ylabel("mean certified run length (tokens)")
    ax.set_title("Certified acceptance length: consecutive steps with radius >= eps")
    ax.grid(True, which="both", alpha=0.25)
    _legend(ax, fontsize=8, title="criterion\n(dotted: run epsilons)", title_fontsize=8,
              loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    save_png(fig, path)


def kl_vs_radius(summary: dict, plot: dict, path: Path) -> None:
    plt = _plt()
    specs = [s for s in summary["criteria"] if s in plot["scatter"]]
    rows, cols = _grid(len(specs), 3)
    fig, axes = plt.subplots(rows, cols, figsize=(3.8 * cols, 3.6 * rows + 0.6), squeeze=False)
    allv = np.concatenate([np.r_[d["radius"], d["kl"]] for d in plot["scatter"].values()])
    allv = allv[np.isfinite(allv) & (allv > 0)]
    lo = float(allv.min()) / 2 if allv.size else 1e-4
    hi = float(allv.max()) * 2 if allv.size else 10.0
    lo, hi = min(lo, hi / 10), max(hi, lo * 10)
    for k, spec in enumerate(specs):
        ax = axes.flat[k]
        d = plot["scatter"][spec]
        x, y, acc = np.clip(d["radius"], lo, hi), np.clip(d["kl"], lo, hi), d["accepted"]
        ax.scatter(x[acc], y[acc], s=4, alpha=0.35, color="tab:green", label="accepted", rasterized=True)
        ax.scatter(x[~acc], y[~acc], s=6, alpha=0.6, color="tab:red", label="rejected", rasterized=True)
        ax.plot([lo, hi], [lo, hi], color="k", lw=1, label="KL = radius")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_title(spec, fontsize=10)
        ax.set_xlabel("radius (nats; +inf at right edge)", fontsize=8)
        if k % cols == 0:
            ax.set_ylabel("actual KL(p||q) (nats)", fontsize=8)
        ax.grid(True, alpha=0.25)
        ax.text(0.97, 0.03, "certified:\nKL < radius", transform=ax.transAxes, ha="right", va="bottom", fontsize=7, color="0.35")
    for ax in list(axes.flat)[len(specs):]:
        ax.set_visible(False)
    _legend(axes.flat[0], fontsize=7, loc="upper left", markerscale=2)
    n = len(next(iter(plot["scatter"].values()))["kl"]) if plot["scatter"] else 0
    fig.suptitle(f"Drafter forward KL against acceptance radius ({n} steps shown)\n"
                 "points below the diagonal are certified; red points there would be soundness violations", fontsize=10)
    fig.tight_layout()
    save_png(fig, path)


def rates_by_margin(summary: dict, path: Path) -> None:
    plt = _plt()
    mb = summary["margin_bins"]
    specs = [s for s in summary["criteria"] if "accept_rate" in mb["by_criterion"][s]]
    xc = _bin_centers(mb["edges"])
    rows, cols = _grid(len(specs), 4)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 3.0 * rows + 0.6), sharey=True, sharex=True, squeeze=False)
    for k, spec in enumerate(specs):
        ax = axes.flat[k]
        b = mb["by_criterion"][spec]
        for key, style, label in (("accept_rate", "-", "accepted"), ("certified_rate", "--", "certified")):
            y = np.array([np.nan if v is None else v for v in b[key]], float)
            ax.plot(xc, y, style, marker="o", ms=3, label=label, lw=1.5)
        ax.set_title(spec, fontsize=10)
        ax.set_xlim(0, 1)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(True, alpha=0.25)
        if k // cols == rows - 1 or k + cols >= len(specs):
            ax.set_xlabel("target margin p(1st) - p(2nd)", fontsize=8)
            ax.xaxis.set_tick_params(labelbottom=True)
        if k % cols == 0:
            ax.set_ylabel("fraction of steps", fontsize=8)
    for ax in list(axes.flat)[len(specs):]:
        ax.set_visible(False)
    _legend(axes.flat[0], fontsize=7, loc="lower right")
    counts = mb.get("drafter_steps", mb["steps"])
    fig.suptitle("Drafter acceptance rate and certified rate (forward KL < radius) by target-margin bin\n"
                 f"(steps per bin: {', '.join(map(str, counts))})", fontsize=10)
    fig.tight_layout()
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
