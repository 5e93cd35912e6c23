"""Replay figures: tokens per forward and predicted speedup against k per rule (chains),
and the conditional acceptance rate by draft position (longest chain; accepted / attempted there,
``conditional_acceptance_rate_per_pos`` of docs/metrics.md), written atomically as PNG."""

from __future__ import annotations

from pathlib import Path

from ..fileio import atomic_path

__all__ = ["write_figures", "save_png", "FIGURE_NAMES", "MIN_TRIES"]

FIGURE_NAMES = {
    "replay_tokens_per_forward.png": "Replay: tokens per target forward against k (chains)",
    "replay_speedup.png": "Replay: predicted speedup against k (chains)",
    "replay_acceptance_by_position.png": "Replay: conditional acceptance rate by draft position (longest chain)",
}

# A rate at a draft position rests on the rounds that attempted it, few at deep positions:
# below MIN_TRIES the figure leaves the point out and the report's table gives the counts.
MIN_TRIES = 10

# The report page shows these figures at their own size (6.4 in + legend, under its 1100 px
# at 110 dpi): every text at least 9 pt reads at >= 9 pt there (see draftcert.report.figures).
RC = {"font.size": 10, "axes.titlesize": 10, "axes.labelsize": 10, "xtick.labelsize": 9, "ytick.labelsize": 9,
      "legend.fontsize": 9, "legend.title_fontsize": 9}


def _plt():
    import matplotlib  # optional: models extra

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: Path) -> None:
    """Write ``fig`` to ``path`` as PNG atomically and close it."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    _plt().close(fig)


def _chains(rows):
    return sorted((r for r in rows if r["shape"]["kind"] == "chain"), key=lambda r: len(r["shape"]["widths"]))


def _legend(fig, ax) -> None:
    """Right of the axes, outside them: the lines cross every height, so no corner is free."""
    if ax.get_legend_handles_labels()[0]:
        fig.legend(*ax.get_legend_handles_labels(), loc="outside right upper")


def write_figures(res, fig_dir: Path) -> list[Path]:
    plt = _plt()
    with plt.rc_context(RC):
        return _write_figures(plt, res, Path(fig_dir))


def _write_figures(plt, res, fig_dir: Path) -> list[Path]:
    from matplotlib.ticker import MaxNLocator  # optional (models extra), as matplotlib itself

    fig_dir.mkdir(parents=True, exist_ok=True)
    out = []
    chains = {s: _chains(rows) for s, rows in res.rows.items() if _chains(rows)}
    # tree:M rules have no chains: their (M, k) trees play that part
    for s, rows in res.rows.items():
        if s not in chains:
            t = sorted((r for r in rows if r["shape"]["kind"] == "tree"), key=lambda r: len(r["shape"]["widths"]))
            if t:
                chains[s] = t
    if not chains:
        return out
    series = [("replay_tokens_per_forward.png", "tokens per target forward", lambda r: r["tokens_per_forward"])]
    if res.costs is not None:
        series.append(("replay_speedup.png", "predicted speedup over the target alone",
                       lambda r: r["predicted"]["speedup"] if r["predicted"] else float("nan")))  # nan: untimed
    for name, ylabel, get in series:
        fig, ax = plt.subplots(figsize=(6.4, 4.0), layout="constrained")
        for s, rows in chains.items():
            ks = [len(r["shape"]["widths"]) for r in rows]
            ax.plot(ks, [get(r) for r in rows], marker="o", ms=3, label=s)
        if name == "replay_speedup.png":
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("k (draft tokens per round; tree depth for tree:M)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # draft lengths are whole numbers
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        _legend(fig, ax)
        save_png(fig, fig_dir / name)
        out.append(fig_dir / name)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), layout="constrained")
    for s, rows in chains.items():
        acc, tries = rows[-1]["conditional_acceptance_rate_per_pos"], rows[-1]["num_attempted_per_pos"]
        xs = [i + 1 for i, (a, n) in enumerate(zip(acc, tries)) if a is not None and n >= MIN_TRIES]
        ax.plot(xs, [acc[x - 1] for x in xs], marker="o", ms=3, label=f"{s} ({rows[-1]['shape']['label']})")
    ax.set_xlabel(f"draft position within a round\n(positions tried fewer than {MIN_TRIES} times are left out;"
                  " the report's table gives their counts)")
    ax.set_ylabel("conditional acceptance rate (accepted / attempted)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no tick at position 1.5
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    _legend(fig, ax)
    save_png(fig, fig_dir / "replay_acceptance_by_position.png")
    out.append(fig_dir / "replay_acceptance_by_position.png")
    return out
