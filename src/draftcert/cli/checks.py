"""Checks the command-line tools run on their arguments before any model is loaded.

``check_specs(value, option)`` parses criterion specs the way the library does and, on a
bad one, raises a ValueError naming the option, the spec and the closest valid spec
(``difflib``), so that a typo costs no model load.  (The output-directory check,
``check_out_dir``, belongs to the profiler's settings: ``draftcert.profile.settings``.)
"""

from __future__ import annotations

import difflib

from ..criteria import DEFAULT_CRITERIA, SPEC_HELP, Criterion, parse_criterion

# Examples of every rule family (the defaults of the CLIs), the pool suggestions come from.
EXAMPLE_SPECS = DEFAULT_CRITERIA
_FAMILIES = ("strict", "additive", "multiplicative", "topm", "entropy", "typical", "mars", "tree")


def suggest_spec(spec: str) -> str | None:
    """The closest valid spec to a bad one, or None when nothing is close.

    A misspelt rule name keeps the user's parameters when they then parse
    (``aditive:0.2`` -> ``additive:0.2``); otherwise the closest example spec.
    """
    spec = str(spec).strip()
    name, sep, params = spec.partition(":")
    fam = difflib.get_close_matches(name.lower(), _FAMILIES, n=1, cutoff=0.6)
    if fam:
        cand = fam[0] + sep + params
        try:
            return parse_criterion(cand).spec if cand != spec else _closest_example(spec, fam[0])
        except ValueError:
            return _closest_example(spec, fam[0])
    close = difflib.get_close_matches(spec.lower(), EXAMPLE_SPECS, n=1, cutoff=0.5)
    return close[0] if close else None


def _closest_example(spec: str, family: str) -> str:
    same = [e for e in EXAMPLE_SPECS if e.split(":")[0] == family] or [family]
    # highest similarity; ties go to the first example (the family's usual setting)
    return max(same, key=lambda e: (difflib.SequenceMatcher(None, spec.lower(), e).ratio(), -same.index(e)))


def check_specs(value, option: str, *, single: bool = False) -> list[Criterion]:
    """Parse a comma-separated spec list (or one spec with ``single=True``).

    Raises ``ValueError("--criteria: unknown rule 'aditive' in 'aditive:0.1' ...; did you
    mean 'additive:0.1'?")`` on the first bad spec.
    """
    items = [value] if single else str(value).split(",")
    specs = [s.strip() for s in items if s.strip()]
    if not specs:
        raise ValueError(f"{option}: give at least one criterion ({SPEC_HELP})")
    out = []
    for s in specs:
        try:
            out.append(parse_criterion(s))
        except ValueError as exc:
            msg = str(exc).removeprefix("criterion spec: ")
            hint = suggest_spec(s)
            raise ValueError(f"{option}: {msg}" + (f"; did you mean {hint!r}?" if hint else "")) from None
    return out
