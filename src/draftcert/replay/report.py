"""The "Replay" section of the profile report (``draftcert report`` on a trace with a drafter).

The report (``draftcert.report``) does not import the replay: the command that writes a report
calls ``section_for_report(out_dir)`` and hands the result to ``write_report(out_dir, replay=...)``.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from ..fileio import json_value
from .api import replay
from .data import trace_has_drafter
from .explain import DEFAULT_EPSILON, explain
from .figures import FIGURE_NAMES, write_figures
from .speed import Costs

__all__ = ["replay_section", "section_for_report"]

_KS = (1, 2, 4, 8)

HOW_TO_READ = (
    "Speculative decoding replayed offline on the recorded greedy path: for strict and tree:M the "
    "accepted lengths are exactly those `draftcert decode` measures on the same prompts; relaxed rules "
    "are exact until they accept a non-greedy token (exact = fraction of rounds replayed exactly at k=4; "
    "the rest is an estimate on the recorded path). tok/fwd = tokens per target forward. Rejections "
    "(chain k=4, tree Mx4 for tree:M) are split into inside radius (KL < radius: a soundness violation, "
    "must be 0), low margin (radius <= KL <= eps: a drafter within eps of p was rejected, p is nearly tied; "
    "relax the rule) and far off (KL > eps, KL >= radius: fix the drafter). `draftcert replay DIR --calibrate` adds predicted speed; "
    "`draftcert explain DIR` lists the events."
)


def replay_section(out_dir, fig_dir: Path | None = None) -> dict:
    """{"md": ..., "html": ..., "figures": [...], "summary": {...}} for a trace with a drafter
    (ValueError for a trace without one)."""
    out_dir = Path(out_dir)
    costs = None
    cal = out_dir / "calibration.json"
    if cal.exists():
        try:
            costs = Costs.from_dict(json.loads(cal.read_text()))
        except (ValueError, json.JSONDecodeError):
            costs = None
    res = replay(out_dir, ks=tuple(range(1, 9)), tree_widths=(4,), static=(), costs=costs)
    ex = explain(res, k=4, epsilon=DEFAULT_EPSILON)
    figs = write_figures(res, fig_dir or out_dir / "figures")
    head = ["rule"] + [f"tok/fwd k={k}" for k in _KS] + ["acceptance by position (k=8)", "zero-accept k=4",
                                                          "exact k=4", "rejections k=4: inside / low margin / far off"]
    if costs is not None:
        head.append("best (predicted speedup)")
    rows, summ = [], {}
    for spec, rs in res.rows.items():
        by = {r["shape"]["label"]: r for r in rs}
        tree = spec.startswith("tree:")
        lab = (lambda k: f"tree {spec[5:]}x{k}") if tree else (lambda k: f"chain k={k}")
        tpf = [by[lab(k)]["tokens_per_forward"] if lab(k) in by else None for k in _KS]
        k8 = by.get(lab(8)) or rs[-1]
        k4 = by.get(lab(4)) or rs[0]
        sp = ex["rules"][spec]["split"]
        acc = " ".join("-" if a is None else f"{a:.2f}" for a in k8["acceptance_by_position"])
        row = [spec] + ["-" if x is None else f"{x:.2f}" for x in tpf] + [
            acc, "-" if k4["zero_accept_fraction"] is None else f"{k4['zero_accept_fraction']:.3f}",
            f"{k4['exact_fraction']:.3f}", f"{sp['inside_radius']} / {sp['low_margin']} / {sp['far_off']}"]
        rec = res.recommended.get(spec)
        if costs is not None:
            row.append(f"{rec['shape']} ({rec['speedup']:.2f}x)" if rec else "-")
        rows.append(row)
        summ[spec] = {"tokens_per_forward": dict(zip([lab(k) for k in _KS], tpf)),
                      "acceptance_by_position_k8": k8["acceptance_by_position"],
                      "zero_accept_fraction_k4": k4["zero_accept_fraction"], "exact_fraction_k4": k4["exact_fraction"],
                      "rejections_k4": sp, "recommended": rec}
    bad = sum(r["split"]["inside_radius"] for r in ex["rules"].values())
    md = ["## Replay", "", HOW_TO_READ + f" eps = {DEFAULT_EPSILON:g} nats.", ""]
    if bad:
        md += [f"**SOUNDNESS VIOLATION: {bad} rejection(s) inside the radius. This is a bug in draftcert.**", ""]
    md += ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    md += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    md.append("")
    for f in figs:
        md += [f"### {FIGURE_NAMES.get(f.name, f.stem)}", "", f"![{f.stem}]({f.relative_to(out_dir).as_posix()})", ""]
    e = html.escape
    h = [f"<h2>Replay</h2><p>{e(HOW_TO_READ)} eps = {DEFAULT_EPSILON:g} nats.</p>"]
    if bad:
        h.append(f"<p style='color:#c00;font-weight:bold'>SOUNDNESS VIOLATION: {bad} rejection(s) inside the radius. "
                 "This is a bug in draftcert.</p>")
    h.append("<table><tr>" + "".join(f"<th>{e(c)}</th>" for c in head) + "</tr>")
    h += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in rows]
    h.append("</table>")
    for f in figs:
        data = base64.b64encode(f.read_bytes()).decode()
        h.append(f"<h3>{e(FIGURE_NAMES.get(f.name, f.stem))}</h3><img alt='{e(f.stem)}' src='data:image/png;base64,{data}'>")
    return {"md": "\n".join(md), "html": "\n".join(h), "figures": figs,
            "summary": json_value({"epsilon": DEFAULT_EPSILON, "soundness_violations": bad, "rules": summ})}


def section_for_report(out_dir) -> dict | None:
    """``replay_section(out_dir)`` as ``draftcert.report.write_report(out_dir, replay=...)`` takes it:
    None when there is no trace (the report says so itself) or it was recorded without a drafter,
    and ``{"note": ...}`` when the section fails, so that the rest of the report is written anyway."""
    try:
        if not trace_has_drafter(out_dir):
            return None
    except ValueError:
        return None  # no readable trace: write_report raises the error that says what to do
    try:
        return replay_section(out_dir)
    except Exception as exc:  # noqa: BLE001 - the report is written anyway, with a note
        return {"note": f"replay section skipped: {type(exc).__name__}: {exc}"}
