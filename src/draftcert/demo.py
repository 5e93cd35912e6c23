"""``draftcert demo``: a certificate table for a few example target distributions.

No model needed: shows, for hand-picked distributions (confident, near-tie,
flat, a tied top), the exact radius of every criterion in each divergence and
the margin bound, so a user can see what the certificates look like.
"""

from __future__ import annotations

import argparse

import numpy as np

from .bounds import margin_bound
from .certificates import radii
from .criteria import parse_criterion
from .divergences import DIVERGENCES

DEFAULT_CRITERIA = "strict,additive:0.1,multiplicative:0.5,topm:2,entropy:0.09:0.3,mars:0.5,tree:2,tree:4,tree:8"


def example_distributions(vocab: int = 32) -> dict[str, np.ndarray]:
    """Named float64 distributions over `vocab` tokens."""
    rng = np.random.default_rng(0)
    tail = rng.dirichlet(np.full(vocab - 3, 0.5))

    def mix(head):
        head = np.asarray(head, dtype=np.float64)
        return np.concatenate([head, (1 - head.sum()) * tail])

    return {
        "confident (0.90, 0.05, 0.02)": mix([0.90, 0.05, 0.02]),
        "near-tie (0.40, 0.38, 0.10)": mix([0.40, 0.38, 0.10]),
        "moderate (0.60, 0.20, 0.10)": mix([0.60, 0.20, 0.10]),
        "tied top (0.30, 0.30, 0.20)": mix([0.30, 0.30, 0.20]),
        "flat (uniform-ish)": rng.dirichlet(np.full(vocab, 50.0)),
    }


def run_demo(criteria: list[str], divergences: list[str], vocab: int = 32) -> str:
    dists = example_distributions(vocab)
    names = list(dists)
    P = np.stack([dists[n] for n in names])
    lines = []
    for div in divergences:
        res = radii(criteria, P, div)
        header = f"{'criterion':<20}" + "".join(f"{n[:26]:>28}" for n in names)
        lines.append(f"\nradius ({div}{' = KL(p||q)' if div == 'forward' else ' = KL(q||p)' if div == 'reverse' else ''}), "
                     f"with the margin bound in brackets; a drafter with D(p,q) < radius is certified to be accepted")
        lines.append(header)
        lines.append("-" * len(header))
        for spec in res:
            mb = margin_bound(spec, P, div)
            cells = "".join(f"{_fmt(r):>17} [{_fmt(b):>8}]" for r, b in zip(res[spec], mb))
            lines.append(f"{spec:<20}{cells}")
    return "\n".join(lines)


def _fmt(x: float) -> str:
    return "inf" if not np.isfinite(x) else f"{x:.4g}"


def _main(args: argparse.Namespace) -> int:
    crits = [c.strip() for c in args.criteria.split(",") if c.strip()]
    for c in crits:
        parse_criterion(c)  # clear error on a bad spec before any output
    divs = [d.strip() for d in args.divergences.split(",") if d.strip()]
    for d in divs:
        if d not in DIVERGENCES:
            raise ValueError(f"--divergences: unknown divergence {d!r}; expected some of {','.join(DIVERGENCES)}")
    print(run_demo(crits, divs, args.vocab))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="print a certificate table for a few example distributions (no model needed)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--criteria", default=DEFAULT_CRITERIA, help=f"comma-separated criterion specs (default: {DEFAULT_CRITERIA})")
    p.add_argument("--divergences", default="forward,reverse,tv", help="comma-separated: forward,reverse,tv")
    p.add_argument("--vocab", type=int, default=32, help="vocabulary size of the examples (default 32)")
    p.set_defaults(func=_main)
