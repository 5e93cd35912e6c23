"""``replay(DIR)``: every rule x every draft shape of a profile trace, with predicted speed.

Definitions (per configuration, over all prompts of the trace):

* rounds = target forwards (the prefill shares the first verification, as in the engine);
* tokens per forward = emitted tokens / rounds; mean accepted = accepted drafts / rounds;
* acceptance at position d = rounds accepting depth d / rounds attempting depth d (a
  depth is attempted when every shallower depth of the round was accepted and the node
  reached has drafted children) -- ``DecodeStats.acceptance_rate_by_depth``;
* zero-accept fraction = rounds accepting nothing / rounds that drafted at least one token;
* accepted-length histogram over the rounds that drafted;
* exact fraction = rounds replayed entirely on the recorded path (1 for strict and tree:M;
  for relaxed rules the rest is the *aligned estimate*, see ``walk.py``);
* drift = accepted non-greedy tokens / emitted tokens (relaxed rules: the quality cost).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..fileio import json_value, write_json
from .data import ReplayTrace, load_replay_trace
from .figures import write_figures
from .speed import Costs, predict
from .walk import DEFAULT_KS, DEFAULT_STATIC, DEFAULT_TREE_WIDTHS, ConfigReplay, Shape, default_shapes, replay_config, rule_kind

__all__ = ["replay", "ReplayResult", "write_replay", "format_table", "parse_ks", "REPLAY_FORMAT"]

REPLAY_FORMAT = "draftcert-replay/1"


@dataclass
class ReplayResult:
    trace: ReplayTrace
    configs: dict[str, list[ConfigReplay]]
    costs: Costs | None
    rows: dict[str, list[dict]] = field(default_factory=dict)
    recommended: dict[str, dict | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def row(self, spec: str, label: str) -> dict:
        return next(r for r in self.rows[spec] if r["shape"]["label"] == label)

    def config(self, spec: str, label: str) -> ConfigReplay:
        return next(c for c in self.configs[spec] if c.shape.label == label)

    def as_dict(self) -> dict:
        """The ``replay.json`` contents (the JSON rule of ``draftcert.fileio``: non-finite -> null)."""
        tr = self.trace
        return json_value({
            "format": REPLAY_FORMAT,
            "trace": str(tr.out_dir) if tr.out_dir else None,
            "target": tr.run.get("target"),
            "drafter": tr.run.get("drafter"),
            "prompts": len(tr.prompts),
            "steps": tr.steps,
            "max_new_tokens": tr.max_new_tokens,
            "costs": self.costs.as_dict() if self.costs else None,
            "rules": {s: {"exact": rule_kind(s)[0] in ("strict", "tree"), "configs": self.rows[s],
                          "recommended": self.recommended.get(s)} for s in self.rows},
            "notes": self.notes,
        })


def replay(source, *, rules=None, ks=DEFAULT_KS, tree_widths=DEFAULT_TREE_WIDTHS, static=DEFAULT_STATIC,
           shapes: list[Shape] | None = None, costs: Costs | None = None) -> ReplayResult:
    """Replay a profile trace (a directory or a loaded ``ReplayTrace``) under every rule and shape.

    rules: subset of the trace's criteria (default all); ks: chain lengths / tree depths;
    tree_widths: m of the (m, depth) trees; static: static trees (tuples of widths);
    shapes: explicit shapes instead (applied to every level-set rule; tree:M keeps the
    shapes of width M); costs: ``speed.calibrate`` / ``Costs`` for predicted speed.
    """
    tr = source if isinstance(source, ReplayTrace) else load_replay_trace(source)
    ks = _check_ks(ks)
    specs = list(tr.specs) if rules is None else [r.strip() for r in (rules.split(",") if isinstance(rules, str) else rules) if r.strip()]
    unknown = [s for s in specs if s not in tr.specs]
    if unknown:
        raise ValueError(f"rules: {', '.join(unknown)} not in the trace (it holds {', '.join(tr.specs)}); "
                         "profile again with --criteria to add a rule")
    if not specs:
        raise ValueError("rules: pass at least one rule of the trace")
    res = ReplayResult(tr, {}, costs, notes=list(tr.notes))
    baseline = sum(len(p) for p in tr.prompts)
    for spec in specs:
        kind, m = rule_kind(spec)
        if shapes is not None:
            cand = [s for s in shapes if (max(s.widths) == m if kind == "tree" else True)]
        else:
            cand = default_shapes(spec, ks, tree_widths, static)
        if kind == "levelset" and not any(spec in p.accept_mask for p in tr.prompts):
            dropped = [s for s in cand if max(s.widths) > 1]
            if dropped:
                cand = [s for s in cand if max(s.widths) == 1]
        if not cand:
            res.notes.append(f"{spec}: none of the requested shapes applies (tree:M needs width M); skipped")
            continue
        res.configs[spec] = [replay_config(tr, spec, s) for s in cand]
        rows = []
        for c in res.configs[spec]:
            row = {"shape": c.shape.as_dict(), **c.totals()}
            row["drift"] = row["drift_tokens"] / row["emitted"] if row["emitted"] else 0.0
            row["estimated"] = row["exact_fraction"] < 1.0
            row["predicted"] = predict(c, costs, baseline, len(tr.prompts)) if costs is not None else None
            rows.append(row)
        res.rows[spec] = rows
        best = None
        if costs is not None:
            best = max(rows, key=lambda r: (r["predicted"]["speedup"] or 0.0))
        res.recommended[spec] = None if best is None else {
            "shape": best["shape"]["label"], "speedup": best["predicted"]["speedup"],
            "tokens_per_forward": best["tokens_per_forward"], "estimated": best["estimated"]}
    if costs is None:
        res.notes.append("no costs: predicted speed and recommendations need `--calibrate` (or --drafter-cost R)")
    elif costs.note:
        res.notes.append(costs.note)
    return res


def _check_ks(ks) -> tuple[int, ...]:
    if isinstance(ks, str):
        ks = parse_ks(ks)
    out = tuple(int(k) for k in ks)
    if not out or any(k < 1 for k in out):
        raise ValueError(f"k: expected draft lengths >= 1, got {ks!r}")
    return out


def parse_ks(text: str) -> tuple[int, ...]:
    """Draft lengths from ``-k``: a range ``1-8`` or a list ``1,2,4``."""
    try:
        if "-" in text and "," not in text:
            a, b = text.split("-")
            return tuple(range(int(a), int(b) + 1))
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"-k: expected a range like 1-8 or a list like 1,2,4; got {text!r}") from None


def write_replay(out_dir, res: ReplayResult, *, figures: bool = True) -> list[Path]:
    """``replay.json`` (atomic) and, with ``figures``, ``figures/replay_*.png``."""
    out_dir = Path(out_dir)
    paths = [write_json(out_dir / "replay.json", res.as_dict())]
    if figures:
        paths += write_figures(res, out_dir / "figures")
    return paths


# ----------------------------------------------------------------------------- terminal table

_HEAD = f"{'config':<16} {'tok/fwd':>7} {'acc/rnd':>7} {'zero':>6} {'pos1':>6} {'last':>6} {'exact':>6} {'speedup':>8}"


def _f(x, w, d=3):
    return f"{'-':>{w}}" if x is None else f"{x:>{w}.{d}f}"


def format_table(res: ReplayResult, full: bool = False) -> str:
    """Per rule: chains, the best depth of each (m, depth) tree family, static trees (all with ``full``).
    Fits 80 columns.  speedup is predicted (needs costs); exact = fraction of rounds replayed exactly."""
    lines = []
    for spec, rows in res.rows.items():
        kind, _ = rule_kind(spec)
        tag = "exact" if kind in ("strict", "tree") else "exact until it leaves the recorded path, then estimated"
        lines += [f"{spec}  ({tag})", _HEAD]
        shown = rows if full else _pick(rows, res.costs is not None)
        for r in shown:
            acc = [a for a in r["acceptance_by_position"] if a is not None]
            sp = r["predicted"]["speedup"] if r["predicted"] else None
            lines.append(f"{r['shape']['label']:<16} {_f(r['tokens_per_forward'], 7)} {_f(r['mean_accepted'], 7)} "
                         f"{_f(r['zero_accept_fraction'], 6)} {_f(acc[0] if acc else None, 6)} "
                         f"{_f(acc[-1] if acc else None, 6)} {_f(r['exact_fraction'], 6)} {_f(sp, 8)}")
        rec = res.recommended.get(spec)
        if rec:
            lines.append(f"  best: {rec['shape']}, predicted speedup {rec['speedup']:.3f}"
                         + (" (estimated)" if rec["estimated"] else ""))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _pick(rows, by_speed: bool) -> list[dict]:
    key = (lambda r: r["predicted"]["speedup"] or 0.0) if by_speed else (lambda r: r["tokens_per_forward"])
    out, fams = [], {}
    for r in rows:
        s = r["shape"]
        if s["kind"] == "tree":
            w = s["widths"][0]
            if w not in fams or key(r) > key(fams[w]):
                fams[w] = r
        else:
            out.append(r)
    chains = [r for r in out if r["shape"]["kind"] == "chain"]
    static = [r for r in out if r["shape"]["kind"] == "static"]
    return chains + list(fams.values()) + static
