"""``draftcert demo``: a certificate table for a few example target distributions.

No model needed: shows, for hand-picked distributions (confident, near-tie,
flat, a tied top), the exact radius of every criterion in each divergence and
the margin bound, so a user can see what the certificates look like.
"""

from __future__ import annotations

import argparse
import textwrap

import numpy as np

from ..bounds import margin_bound
from ..certificates import radii
from ..criteria import DEFAULT_CRITERIA as _DEFAULT_SPECS
from ..divergences import DIVERGENCES
from ..textfit import compact_number, terminal_width
from .checks import check_specs

DEFAULT_CRITERIA = ",".join(_DEFAULT_SPECS)  # the --criteria default, as the flag spells it


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


_DIV_TITLE = {"forward": "forward KL(p||q)", "reverse": "reverse KL(q||p)", "tv": "total variation"}


def _short(name: str) -> str:
    """Column label of an example: its name without the parenthesised head ("near-tie")."""
    return name.split(" (")[0]


def run_demo(criteria: list[str], divergences: list[str], vocab: int = 32, width: int = 80) -> str:
    """The demo's text: a legend of the examples, then per divergence one table with a row of
    radii per criterion and, under it, the margin bound.  Numbers have 4 significant digits
    (compact scientific notation below 1e-3) and are never cut; the table is as narrow as
    its widest cell allows (75 columns with the default criteria), and its explanatory
    text is wrapped at ``width``."""
    dists = example_distributions(vocab)
    names = list(dists)
    P = np.stack([dists[n] for n in names])
    wrap = lambda text: textwrap.fill(text, width=width, subsequent_indent="  ")  # noqa: E731
    lines = [wrap(f"Example target distributions p over {vocab} tokens (largest probabilities first; "
                  "the rest of the mass is spread over a fixed random tail):")]
    lines += [f"  {n}" for n in names]
    lines.append(wrap("Each table: the exact radius of every criterion, i.e. the smallest divergence D(p,q) of "
                      "a drafter q that can be rejected (a drafter with D(p,q) < radius is certified to be "
                      "accepted; inf: never rejected), and under it the margin bound (a lower bound on the "
                      "radius from the margin statistic alone)."))
    labels = [_short(n) for n in names]
    for div in divergences:
        res = radii(criteria, P, div)
        body = []
        for spec in res:
            mb = margin_bound(spec, P, div)
            body.append([spec] + [compact_number(r, 4) for r in res[spec]])
            body.append(["  margin bound"] + [compact_number(b, 4) for b in mb])
        w0 = max(len("criterion"), *(len(r[0]) for r in body))
        ws = [max(len(lab), *(len(r[i + 1]) for r in body)) for i, lab in enumerate(labels)]
        header = "criterion".ljust(w0) + "".join(f"  {lab:>{w}}" for lab, w in zip(labels, ws))
        lines += ["", wrap(f"radius, {_DIV_TITLE.get(div, div)} (nats)" if div != "tv" else "radius, total variation"),
                  header, "-" * len(header)]
        lines += [r[0].ljust(w0) + "".join(f"  {c:>{w}}" for c, w in zip(r[1:], ws)) for r in body]
    if any(c.startswith("tree:") for c in criteria):
        lines += ["", wrap(TIED_TOP_NOTE)]
    return "\n".join(lines)


# Why a tree can be below strict on the tied top (docs/theory.md, section 3, "Ties").
TIED_TOP_NOTE = (
    "Note (tied top): there tree:M can be below strict, and both are right. strict accepts either of "
    "the two tied top tokens, so a drafter is rejected only when a third token rises above both. "
    "tree:M fixes one greedy token a and counts the other tied token against it (tree:1 has radius 0 "
    "there), so tree:2 is rejected as soon as one more token reaches a, which is cheaper "
    "(docs/theory.md, section 3, \"Ties\").")


def _main(args: argparse.Namespace) -> int:
    if args.vocab < 4:  # the examples fix their three largest probabilities and spread the rest over a tail
        raise ValueError(f"--vocab: expected an integer >= 4 (each example fixes its 3 largest probabilities and "
                         f"spreads the rest over the other tokens), got {args.vocab}; e.g. --vocab 32 (the default)")
    crits = [c.spec for c in check_specs(args.criteria, "--criteria")]  # clear error before any output
    divs = [d.strip() for d in args.divergences.split(",") if d.strip()]
    for d in divs:
        if d not in DIVERGENCES:
            raise ValueError(f"--divergences: unknown divergence {d!r}; expected some of {','.join(DIVERGENCES)}")
    print(run_demo(crits, divs, args.vocab, width=min(terminal_width(), 100)))
    return 0


DEMO_EXAMPLES = """\
examples:
  draftcert demo                       # every default rule, three divergences
  draftcert demo --criteria strict,tree:2,tree:4 --divergences forward
  draftcert demo --criteria additive:0.1,entropy:0.09:0.3 --vocab 1000
"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="print a certificate table for a few example distributions (no model needed)",
        description=__doc__,
        epilog=DEMO_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--criteria", default=DEFAULT_CRITERIA, help=f"comma-separated criterion specs (default: {DEFAULT_CRITERIA})")
    p.add_argument("--divergences", default="forward,reverse,tv", help="comma-separated: forward,reverse,tv")
    p.add_argument("--vocab", type=int, default=32, help="vocabulary size of the examples (default 32)")
    p.set_defaults(func=_main)
