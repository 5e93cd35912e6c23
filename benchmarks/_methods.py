"""Method names shared by the speed benchmarks (``bench_speedup.py``, ``bench_pair.py``).

``dc:RULE:SHAPE`` is draftcert's engine with criterion RULE and SHAPE ``kN`` (a chain of N),
``treeMxD`` (top-M children to depth D) or ``auto`` (``-k auto``'s choice, passed in as ``auto``);
``bench_pair.py`` also takes ``dc:RULE:SHAPE:vN``, the drafter proposing only the first N token ids
(``--draft-vocab N``, ``split_vocab``).
"""

from __future__ import annotations


def parse_dc(spec: str, auto: dict | None = None) -> tuple[str, dict]:
    """(criterion, ``speculative_generate``'s k and tree) of a ``dc:RULE:SHAPE`` method name."""
    rule, _, shape = spec[len("dc:"):].rpartition(":")
    if shape == "auto":
        if auto is None:
            raise ValueError(f"method {spec!r}: this benchmark has no -k auto choice; use kN or treeMxD")
        return rule, dict(auto)
    try:
        if shape.startswith("tree"):
            m, d = shape[4:].split("x")
            return rule, {"k": int(d), "tree": (int(m), int(d))}
        if shape.startswith("k"):
            return rule, {"k": int(shape[1:]), "tree": None}
    except ValueError:
        pass
    raise ValueError(f"method {spec!r}: the shape must be kN, treeMxD or auto (e.g. dc:strict:k3, dc:strict:tree2x4)")


def split_vocab(spec: str) -> tuple[str, int | str | None]:
    """(``dc:RULE:SHAPE``, N) of ``dc:RULE:SHAPE:vN``, (``dc:RULE:SHAPE``, "all") of ``dc:RULE:SHAPE:vall``;
    (spec, None) without the suffix."""
    head, _, last = spec.rpartition(":")
    if head.startswith("dc:") and last.startswith("v") and last[1:].isdigit() and int(last[1:]) > 0:
        return head, int(last[1:])
    if head.startswith("dc:") and last == "vall":
        return head, "all"
    return spec, None
