"""How sharp are the entropy rules' KL margin bounds at *every* G, not only in the best
candidate of a bin?

``bench_margin_gap.py`` reports, per bin of G, the best ratio bound / radius that its
searches find: a bound that is sharp somewhere in a bin passes there.  This benchmark asks
the stronger question pointwise.  At each G of a geometric grid it builds the attaining
tied family member of docs/theory.md section 5 (``_entropy_margin.extremal`` for forward
KL, ``_entropy_margin.reverse_extremal`` for reverse KL: an independent search over the
family's parameters, the rule checked on the member itself), measures that member like any
other target (``draftcert.radius``, ``draftcert.margin_statistic``) and divides
``draftcert.margin_bound_from_statistic(G(member))`` by its radius.

Since the bound is certified from below and the member is a real distribution with that
statistic, bound <= infimum <= radius(member): the ratio is a certified lower estimate of
bound / infimum at that G.  A ratio above 1 would be a soundness bug (reported).

Last line: ``min_pointwise_ratio=X``, the worst over all rules, divergences and G.

    python benchmarks/bench_entropy_sharpness.py [--criteria entropy:0.09:0.3,typical:0.09:0.3]
        [--kinds forward,reverse] [--points 40] [--gmin 1e-4] [--gmax 0.45]
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

import draftcert as dc
from draftcert._entropy_margin import extremal, reverse_extremal


def pointwise(crit: str, kind: str, Gs: np.ndarray):
    """(G, ratio, V) per grid point where a member exists."""
    name, eps, delta = crit.split(":")
    c = 1e-5 if name == "typical" else 0.0
    build = extremal if kind == "forward" else reverse_extremal
    out = []
    for G in Gs:
        try:
            p = build(float(G), float(eps), float(delta), c)
        except ValueError:
            continue
        P = p[None, :]
        r = float(dc.radius(crit, P, kind)[0])
        Gp = float(dc.margin_statistic(crit, P)[0])
        if not (math.isfinite(r) and r > 0) or abs(Gp - G) > 1e-9 * max(1.0, G):
            continue
        bound = float(dc.margin_bound_from_statistic(crit, np.array([Gp]), kind)[0])
        out.append((float(G), bound / r, p.size))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--criteria", default="entropy:0.09:0.3,typical:0.09:0.3", help="comma-separated entropy/typical rules")
    ap.add_argument("--kinds", default="forward,reverse", help="comma-separated divergences (forward, reverse)")
    ap.add_argument("--points", type=int, default=40, help="grid points in G (geometric)")
    ap.add_argument("--gmin", type=float, default=1e-4)
    ap.add_argument("--gmax", type=float, default=0.45)
    args = ap.parse_args()
    Gs = np.geomspace(args.gmin, args.gmax, args.points)
    t0 = time.time()
    worst_all, bad = math.inf, 0
    print(f"{'criterion':<18} {'divergence':<9} {'points':>6} {'worst':>9} {'at G':>10} {'median':>9}")
    for crit in args.criteria.split(","):
        for kind in args.kinds.split(","):
            rows = pointwise(crit, kind, Gs)
            if not rows:
                print(f"{crit:<18} {kind:<9} {0:>6}  (no member found)")
                continue
            ratios = np.array([r for _, r, _ in rows])
            i = int(np.argmin(ratios))
            bad += int(np.sum(ratios > 1 + 1e-9))
            worst_all = min(worst_all, float(ratios[i]))
            print(f"{crit:<18} {kind:<9} {len(rows):>6} {ratios[i]:>9.6f} {rows[i][0]:>10.3g} {np.median(ratios):>9.6f}", flush=True)
    print(f"members with a radius below the bound: {bad}")
    print(f"elapsed {time.time() - t0:.1f}s")
    print(f"min_pointwise_ratio={worst_all:.6f}")


if __name__ == "__main__":
    main()
