"""Replay figures: tokens per forward and predicted speedup against k per rule (chains),
and acceptance by draft position (longest chain), written atomically as PNG."""

from __future__ import annotations

from pathlib import Path

from ..fileio import atomic_path

__all__ = ["write_figures", "FIGURE_NAMES"]

FIGURE_NAMES = {
    "replay_tokens_per_forward.png": "Replay: tokens per target forward against k (chains)",
    "replay_speedup.png": "Replay: predicted speedup against k (chains)",
    "replay_acceptance_by_position.png": "Replay: acceptance rate by draft position (longest chain)",
}


def _plt():
    import matplotlib  # optional: models extra

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")


def _chains(rows):
    return sorted((r for r in rows if r["shape"]["kind"] == "chain"), key=lambda r: len(r["shape"]["widths"]))


def write_figures(res, fig_dir: Path) -> list[Path]:
    plt = _plt()
    fig_dir = Path(fig_dir)
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
                       lambda r: r["predicted"]["speedup"]))
    for name, ylabel, get in series:
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        for s, rows in chains.items():
            ks = [len(r["shape"]["widths"]) for r in rows]
            ax.plot(ks, [get(r) for r in rows], marker="o", ms=3, label=s)
        if name == "replay_speedup.png":
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("k (draft tokens per round; tree depth for tree:M)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        _save(fig, fig_dir / name)
        plt.close(fig)
        out.append(fig_dir / name)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for s, rows in chains.items():
        acc = rows[-1]["acceptance_by_position"]
        xs = [i + 1 for i, a in enumerate(acc) if a is not None]
        ax.plot(xs, [a for a in acc if a is not None], marker="o", ms=3, label=f"{s} ({rows[-1]['shape']['label']})")
    ax.set_xlabel("draft position within a round")
    ax.set_ylabel("acceptance rate (accepted / attempted)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    _save(fig, fig_dir / "replay_acceptance_by_position.png")
    plt.close(fig)
    out.append(fig_dir / "replay_acceptance_by_position.png")
    return out
