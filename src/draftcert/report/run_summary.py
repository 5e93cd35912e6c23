"""Read a profile run's traces and reduce them to summary statistics.

Input: ``DIR/trace/*.parquet`` (one shard per batch per rank, one row per
generated step; the format is ``draftcert.tracefile``'s) and ``DIR/run.json``.
Only the columns the report needs are read, shard by shard and row group by
row group, straight into numpy arrays (never Python lists of rows).

Conventions (all statistics are over *finite* steps, i.e. rows whose target
logits were finite; ``nonfinite_steps`` counts the others):

* radius quantiles use linear interpolation between order statistics
  (numpy's default ``linear`` method), with +inf radii kept: a quantile that
  interpolates towards a +inf order statistic is +inf.
* ``certified_fraction[eps]`` = fraction of steps with radius >= eps: every
  drafter whose per-step divergence is < eps is accepted there.
* ``certified_length[eps]`` = mean over steps t of L_t, the number of
  consecutive certified steps t, t+1, ... of the same prompt
  (``draftcert.certified_run_length`` along positions sorted ascending, no
  cap).  A nonfinite step or a missing position breaks a run.
* with a drafter (over steps whose drafter logits were finite too,
  ``drafter_steps``): ``accept_rate`` = mean of ``accepted/<spec>``,
  ``certified_rate`` = mean of ``certified/<spec>`` (forward KL < radius),
  ``soundness_violations`` = #rows (all rows) with certified and not accepted;
  the theory says it is 0, so any other value is a bug upstream.

In ``summary.json`` (the JSON rule of ``draftcert.fileio``: non-finite -> null) a
statistic over no steps at all is null (e.g. every step nonfinite), and a null radius
quantile or drafter KL over at least one step is +inf (no drafter is rejected there):
``stat_value`` reads them back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..certificates import DEFAULT_EPSILONS, certified_run_length
from ..tracefile import (
    RADIUS_FAMILY,
    accepted_column,
    certified_column,
    column_specs,
    has_drafter_columns,
    radius_column,
    read_columns,
    shard_columns,
)

# Bins of the target margin p(1st) - p(2nd) in [0, 1]; the last bin includes 1.
MARGIN_EDGES = tuple(round(x, 2) for x in np.linspace(0.0, 1.0, 11))
# Continuous epsilon grid (nats) for the certified-length curve.
EPS_GRID = tuple(float(x) for x in np.logspace(-3, 1, 161))
QUANTILES = {"q05": 0.05, "median": 0.5}
SCATTER_POINTS = 6000  # subsample of (radius, KL) pairs kept for the scatter plot
CDF_POINTS = 2000  # order statistics kept per radius CDF curve


def eps_key(eps: float) -> str:
    """JSON key of an epsilon: shortest repr (0.3 -> "0.3", 1.0 -> "1")."""
    return f"{float(eps):g}"


def stat_value(x, steps: int):
    """A radius quantile or drafter-KL statistic of ``summary.json`` as a number: null over
    ``steps`` >= 1 steps is +inf (the JSON rule writes +inf as null), over no step it stays None."""
    return math.inf if x is None and steps else x


# ----------------------------------------------------------------------------- reading


def run_notes(out_dir: Path, run: dict) -> list[str]:
    """What the report says about ``run.json`` (``tracefile.load_run``'s dict): missing, or the
    run not complete."""
    path = Path(out_dir) / "run.json"
    if not path.exists():
        return [f"{path} not found: using defaults (epsilons {', '.join(map(eps_key, DEFAULT_EPSILONS))}); metadata unknown"]
    status = run.get("status")
    if status is not None and status != "complete":
        return [f"run.json status is {status!r}: the run is not complete; statistics cover the shards written so far "
                f"(rerun `draftcert profile` with the same arguments to finish it)"]
    return []


@dataclass
class Trace:
    """The columns of all shards the report needs, concatenated (rows in shard order)."""

    n: int
    prompt: np.ndarray  # int64 code per row, 0..n_prompts-1
    prompt_names: list[str]
    position: np.ndarray  # int64
    margin: np.ndarray  # float64
    nonfinite: np.ndarray  # bool
    specs: list[str]
    radius: dict[str, dict[str, np.ndarray]]  # divergence ("forward"|"reverse"|"tv") -> spec -> float64
    kl: np.ndarray | None = None  # forward KL per row when a drafter ran
    draft_nonfinite: np.ndarray | None = None  # drafter logits non-finite (target may be fine)
    accepted: dict[str, np.ndarray] = field(default_factory=dict)
    certified: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def has_drafter(self) -> bool:
        return self.kl is not None


def read_trace(shards: list[Path]) -> Trace:
    """Stream the columns the report needs from every shard (``tracefile.read_columns``)."""
    names = shard_columns(shards[0])
    specs = column_specs(names, RADIUS_FAMILY["forward"])
    if not specs:
        raise ValueError(f"trace shard {shards[0]} has no radius/<spec> columns; is it a draftcert profile trace?")
    required = ["prompt_id", "position", "target_margin"]
    missing = [c for c in required if c not in names]
    if missing:
        raise ValueError(f"trace shard {shards[0]} lacks column(s) {', '.join(missing)}; is it a draftcert profile trace?")
    radius_cols = {d: {s: radius_column(s, d) for s in specs if radius_column(s, d) in names} for d in RADIUS_FAMILY}
    radius_cols = {d: cs for d, cs in radius_cols.items() if cs}
    has_drafter = has_drafter_columns(names) and "kl_forward" in names
    # a column of the first shard is needed in every shard: the shards of one run share their columns
    cols = required + (["nonfinite"] if "nonfinite" in names else []) + [c for cs in radius_cols.values() for c in cs.values()]
    if has_drafter:
        cols += ["kl_forward"] + (["draft_nonfinite"] if "draft_nonfinite" in names else [])
        cols += [c for s in specs for c in (accepted_column(s), certified_column(s)) if c in names]
    data = read_columns(shards, cols)
    n = data.n
    position = data["position"]
    if (position < 0).any():
        raise ValueError("trace: negative positions; the trace is corrupt, delete it and rerun `draftcert profile`")

    radius = {d: {s: data[c] for s, c in cs.items()} for d, cs in radius_cols.items()}
    nonfinite = data["nonfinite"] if "nonfinite" in data else np.zeros(n, bool)
    # A NaN radius is only legitimate on a nonfinite step; treat it as one either way.
    for r in radius["forward"].values():
        nonfinite = nonfinite | np.isnan(r)
    tr = Trace(
        n=n,
        prompt=data["prompt_id"],
        prompt_names=data.prompt_names,
        position=position,
        margin=data["target_margin"],
        nonfinite=nonfinite,
        specs=specs,
        radius=radius,
    )
    if has_drafter:
        tr.kl = data["kl_forward"]
        tr.draft_nonfinite = data["draft_nonfinite"] if "draft_nonfinite" in data else np.zeros(n, bool)
        tr.accepted = {s: data[accepted_column(s)] for s in specs if accepted_column(s) in data}
        tr.certified = {s: data[certified_column(s)] for s in specs if certified_column(s) in data}
    return tr


# ----------------------------------------------------------------------------- statistics


def quantile(x: np.ndarray, q: float) -> float:
    """Linear-interpolation quantile (numpy's default) that handles +inf exactly.

    With sorted s and h = (n - 1) q: s[lo] + (h - lo) (s[hi] - s[lo]); when
    s[hi] = +inf the result is +inf if h > lo, else s[lo].  NaN if x is empty.
    """
    if x.size == 0:
        return math.nan
    h = (x.size - 1) * q
    lo, hi = int(math.floor(h)), int(math.ceil(h))
    part = np.partition(x, [lo, hi]) if x.size > 1 else x
    a, b = float(part[lo]), float(part[hi])
    if hi == lo or a == b:
        return a
    if math.isinf(b):
        return math.inf
    return a + (h - lo) * (b - a)


class RunGrid:
    """Steps laid out as a (prompts, columns) grid so that ``certified_run_length``
    runs along each prompt's positions in ascending order.

    Column of a step = its rank within its prompt (sorted by position) plus the
    number of position gaps before it; with the usual contiguous positions
    0..n-1 that is the position itself, and a sparse or offset trace does not
    blow up the grid.  Cells without a finite step (nonfinite steps, one cell
    per gap, padding after a prompt's last step) hold radius 0, which is <
    every epsilon > 0, so they end runs and are never counted themselves.
    """

    def __init__(self, tr: Trace):
        self.valid = ~tr.nonfinite
        self.P = len(tr.prompt_names)
        order = np.lexsort((tr.position, tr.prompt))
        pr, pos = tr.prompt[order], tr.position[order]
        new_prompt = np.r_[True, pr[1:] != pr[:-1]]
        dup = ~new_prompt & (pos == np.r_[-1, pos[:-1]])
        if dup.any():
            k = int(np.flatnonzero(dup)[0])
            raise ValueError(
                f"trace: prompt {tr.prompt_names[pr[k]]!r} position {pos[k]} appears more than once; a shard "
                f"was written twice (e.g. two runs into one directory): delete the duplicate shard(s) under "
                f"trace/ and rerun `draftcert profile`"
            )
        # +1 column per step, +1 more after a gap (positions not consecutive); restart per prompt
        step = np.where(new_prompt, 0, np.where(pos == np.r_[-1, pos[:-1]] + 1, 1, 2))
        csum = np.cumsum(step)
        col_sorted = csum - np.maximum.accumulate(np.where(new_prompt, csum, 0))
        col = np.empty_like(col_sorted)
        col[order] = col_sorted
        self.T = int(col.max()) + 1
        self.flat = (tr.prompt * self.T + col)[self.valid]

    def grid(self, r: np.ndarray) -> np.ndarray:
        g = np.zeros(self.P * self.T, np.float64)
        g[self.flat] = r[self.valid]
        return g.reshape(self.P, self.T)

    def length_curve(self, g: np.ndarray):
        """Exact mean certified run length for every eps > 0 at once.

        sum_t L_t(eps) counts the windows [t, t+k] of one prompt whose steps are
        all certified, i.e. whose minimum radius is >= eps.  Attribute each
        window to its rightmost minimum i: i is that minimum for
        w_i = left_i * right_i windows, where left_i - 1 steps before i are
        >= r_i and right_i - 1 steps after i are > r_i (within the row; a
        non-step cell is -1 and stops both).  Hence
            mean L(eps) = sum_{steps i : r_i >= eps} w_i / #steps,
        a tail sum over the radii sorted once.  Returns f(eps_array) -> means.
        """
        x = np.full(g.shape, -1.0)
        x.reshape(-1)[self.flat] = g.reshape(-1)[self.flat]
        w_grid = np.empty(g.shape, np.float64)
        rows = max(1, (1 << 20) // self.T)  # bound the sparse table's memory: ~1M cells per block
        for a in range(0, self.P, rows):
            xb = x[a : a + rows]
            left = _extent(xb, strict=False) + 1  # steps before i with r >= r_i, plus i
            right = _extent(xb[:, ::-1], strict=True)[:, ::-1] + 1  # steps after i with r > r_i, plus i
            w_grid[a : a + rows] = left * right
        w = w_grid.reshape(-1)[self.flat]
        r = g.reshape(-1)[self.flat]
        order = np.argsort(-r, kind="stable")
        r_desc, tail = r[order], np.concatenate([[0.0], np.cumsum(w[order])])
        n = max(self.flat.size, 1)

        def f(eps):
            k = np.searchsorted(-r_desc, -np.asarray(eps, np.float64), side="right")  # #{r >= eps}
            return tail[k] / n

        return f

    def mean_length(self, g: np.ndarray, eps: float) -> float:
        if self.flat.size == 0:
            return math.nan
        run = certified_run_length(g, eps)
        return float(run.reshape(-1)[self.flat].mean())


def _extent(x: np.ndarray, strict: bool) -> np.ndarray:
    """For each cell (rows independent): how many cells directly before it are
    >= it (``strict=False``) or > it (``strict=True``), stopping at the first
    that is not.  Binary lifting over a sparse table of running minima:
    O(P T log T) vectorised work instead of a Python loop over steps."""
    P, T = x.shape
    mins = [x]  # mins[k][:, i] = min x[:, i - 2^k + 1 .. i] (clipped at 0)
    while (1 << len(mins)) <= T:
        h, prev = 1 << (len(mins) - 1), mins[-1]
        nxt = prev.copy()
        nxt[:, h:] = np.minimum(prev[:, h:], prev[:, :-h])
        mins.append(nxt)
    cur = np.broadcast_to(np.arange(T), (P, T)).copy()  # exclusive left end of the extension
    for k in range(len(mins) - 1, -1, -1):
        start = cur - (1 << k)
        ok = start >= 0
        blk = np.take_along_axis(mins[k], np.maximum(cur - 1, 0), axis=1)
        ok &= (blk > x) if strict else (blk >= x)
        cur = np.where(ok, start, cur)
    return np.arange(T)[None, :] - cur


def _cdf_points(r: np.ndarray, points: int = CDF_POINTS) -> dict:
    """Empirical CDF at <= ``points`` order statistics (exact values, sampled ranks)."""
    n = r.size
    if n == 0:
        return {"x": np.zeros(0), "y": np.zeros(0), "n": 0, "n_inf": 0}
    idx = np.unique(np.linspace(0, n - 1, min(n, points)).round().astype(np.int64))
    x = np.sort(r) if n <= 4 * points else np.partition(r, idx)
    return {"x": x[idx], "y": (idx + 1) / n, "n": n, "n_inf": int(np.isinf(r).sum())}


def _first(run: dict, *keys: str):
    """First present key of run.json (profile's field names, with a few aliases)."""
    for k in keys:
        if run.get(k) is not None:
            return run[k]
    return None


def _margin_bin(margin: np.ndarray) -> np.ndarray:
    edges = np.asarray(MARGIN_EDGES)
    return np.clip(np.searchsorted(edges, margin, side="right") - 1, 0, len(edges) - 2)


def _binned_mean(values: np.ndarray, bins: np.ndarray, nb: int) -> list:
    cnt = np.bincount(bins, minlength=nb)
    tot = np.bincount(bins, weights=values.astype(np.float64), minlength=nb)
    return [float(t / c) if c else None for t, c in zip(tot, cnt)]


def summarize_trace(tr: Trace, run: dict, epsilons: list[float]) -> tuple[dict, dict]:
    """(summary dict per the summary.json contract, plot data for the figures)."""
    valid = ~tr.nonfinite
    nvalid = int(valid.sum())
    grid = RunGrid(tr)
    bins = _margin_bin(tr.margin[valid])
    nb = len(MARGIN_EDGES) - 1
    rng = np.random.default_rng(0)
    # Drafter statistics: steps where target and drafter logits were both finite (a broken
    # drafter row has NaN KL and is stored as rejected; it says nothing about the rule).
    dvalid = valid & ~tr.draft_nonfinite & ~np.isnan(tr.kl) if tr.has_drafter else valid
    ndvalid = int(dvalid.sum())
    dbins = _margin_bin(tr.margin[dvalid])
    scatter_idx = np.flatnonzero(dvalid)
    if scatter_idx.size > SCATTER_POINTS:
        scatter_idx = np.sort(rng.choice(scatter_idx, SCATTER_POINTS, replace=False))

    crit: dict[str, dict] = {}
    by_bin: dict[str, dict] = {}
    plot = {"cdf": {}, "curve": {}, "scatter": {}, "eps_grid": list(EPS_GRID)}
    for spec in tr.specs:
        r_all = tr.radius["forward"][spec]
        r = r_all[valid]
        if (r < 0).any():
            raise ValueError(f"trace: column radius/{spec} has negative values; the trace is corrupt")
        d: dict = {}
        for name, q in QUANTILES.items():
            d[f"radius_{name}"] = quantile(r, q)
        for div in ("reverse", "tv"):
            if spec in tr.radius.get(div, {}):
                rr = tr.radius[div][spec][valid]
                for name, q in QUANTILES.items():
                    d[f"{RADIUS_FAMILY[div]}_{name}"] = quantile(rr, q)
        d["inf_fraction"] = float(np.isinf(r).mean()) if nvalid else math.nan
        d["certified_fraction"] = {eps_key(e): float((r >= e).mean()) if nvalid else math.nan for e in epsilons}
        g = grid.grid(r_all)
        d["certified_length"] = {eps_key(e): grid.mean_length(g, e) for e in epsilons}
        plot["curve"][spec] = grid.length_curve(g)(EPS_GRID)
        plot["cdf"][spec] = _cdf_points(r)
        b = {"certified_fraction": {eps_key(e): _binned_mean(r >= e, bins, nb) for e in epsilons}}
        if tr.has_drafter and spec in tr.accepted and spec in tr.certified:
            acc, cert = tr.accepted[spec], tr.certified[spec]
            d["accept_rate"] = float(acc[dvalid].mean()) if ndvalid else math.nan
            d["certified_rate"] = float(cert[dvalid].mean()) if ndvalid else math.nan
            d["soundness_violations"] = int((cert & ~acc).sum())  # over every row, broken or not
            b["accept_rate"] = _binned_mean(acc[dvalid], dbins, nb)
            b["certified_rate"] = _binned_mean(cert[dvalid], dbins, nb)
            plot["scatter"][spec] = {
                "radius": r_all[scatter_idx],
                "kl": tr.kl[scatter_idx],
                "accepted": acc[scatter_idx],
            }
        crit[spec] = d
        by_bin[spec] = b

    # The certified length if every step were certified: each step's remaining run within its
    # sequence (ended by the sequence's end or a nonfinite step); no curve can exceed it.
    plot["length_cap"] = float(grid.length_curve(grid.grid(np.ones(tr.n)))([0.5])[0]) if nvalid else math.nan
    plot["max_run"] = int(grid.T)
    summary = dict(crit)
    summary.update(
        {
            "steps": int(tr.n),
            "finite_steps": nvalid,
            "prompts": len(tr.prompt_names),
            "nonfinite_steps": int(tr.n - nvalid),
            "criteria": list(tr.specs),
            "epsilons": [float(e) for e in epsilons],
            "models": {"target": _first(run, "target", "target_spec", "model"), "drafter": _first(run, "drafter", "drafter_spec")},
            "versions": run.get("versions", {}),
            "command": run.get("command"),
            "margin_bins": {
                "edges": list(MARGIN_EDGES),
                "steps": [int(c) for c in np.bincount(bins, minlength=nb)],
                "by_criterion": by_bin,
            },
        }
    )
    if tr.has_drafter:
        kl = tr.kl[dvalid]
        summary["drafter_steps"] = ndvalid
        summary["draft_nonfinite_steps"] = int((valid & ~dvalid).sum())
        summary["drafter_kl_forward"] = {"q05": quantile(kl, 0.05), "median": quantile(kl, 0.5), "mean": float(kl.mean()) if ndvalid else math.nan}
        summary["margin_bins"]["drafter_steps"] = [int(c) for c in np.bincount(dbins, minlength=nb)]
    return summary, plot
