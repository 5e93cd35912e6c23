"""The "Replay" section of the profile report (``draftcert report`` on a trace with a drafter).

The report (``draftcert.report``) does not import the replay: the command that writes a report
calls ``section_for_report(out_dir)`` and hands the result to ``write_report(out_dir, replay=...)``.
"""

from __future__ import annotations

import base64
import html
import json
import shlex
from pathlib import Path

from ..fileio import json_value
from .api import missing_costs_note, replay, unreliable_note
from .trace_reader import trace_has_drafter
from .explain import DEFAULT_EPSILON, explain
from .speed_figures import FIGURE_NAMES, MIN_TRIES, write_figures
from ..decode.draft_shape.costs import Costs

__all__ = ["replay_section", "section_for_report"]

_KS = (1, 2, 4, 8)

HOW_TO_READ = (
    "Speculative decoding replayed offline on the recorded greedy path: for strict and tree:M the "
    "accepted lengths are exactly those `draftcert decode` measures on the same prompts; relaxed rules "
    "are exact until they accept a non-greedy token (exact = fraction of rounds replayed exactly at k=4; "
    "the rest is an estimate on the recorded path). tok/fwd = tokens per target forward; mean acceptance "
    "length = 1 + accepted / drafts (vLLM's); conditional acceptance by position = accepted / attempted "
    "at that position (a position is attempted when every earlier one was accepted); every name: "
    "docs/metrics.md. Rejections "
    "(chain k=4, tree Mx4 for tree:M) are split into inside radius (KL < radius: a soundness violation, "
    "must be 0), low margin (radius <= KL <= eps: a drafter within eps of p was rejected, p is nearly tied; "
    "relax the rule) and far off (KL > eps, KL >= radius: fix the drafter). `draftcert replay DIR --calibrate` adds predicted speed; "
    "`draftcert explain DIR` lists the events."
)


def _rate(rate: float | None, tries: int) -> str:
    """A position's conditional acceptance rate, or its counts accepted/tries when fewer than MIN_TRIES."""
    if rate is None:
        return "-"
    return f"{rate:.2f}" if tries >= MIN_TRIES else f"{round(rate * tries)}/{tries}"


def replay_section(out_dir, fig_dir: Path | None = None) -> dict:
    """{"md": ..., "html": ..., "figures": [...], "summary": {...}, "notes": [...]} for a trace with a
    drafter (ValueError for a trace without one).  What the section cannot show (predicted speed without
    a calibration, or for shapes the calibration lacks) it says in its text, with the command that fills
    it; "notes" repeats the problems (an unreadable or partial calibration) for the report's notes."""
    out_dir = Path(out_dir)
    costs, missing = None, []  # missing: what the section leaves out, each with the command that fills it
    cal = out_dir / "calibration.json"
    calibrate = f"draftcert replay {shlex.quote(str(out_dir))} --calibrate"
    if cal.exists():
        try:
            costs = Costs.from_dict(json.loads(cal.read_text()))
        except (ValueError, json.JSONDecodeError) as exc:
            missing.append(f"predicted speed: {cal.name} is unreadable ({str(exc).split(';')[0]}); "
                           f"`{calibrate}` rewrites it")
    else:  # the usual state, said in the section only (not among the run's notes)
        missing.append(f"predicted speed: no {cal.name} (the models were not timed here); `{calibrate}` times them")
    res = replay(out_dir, ks=tuple(range(1, 9)), tree_widths=(4,), static=(), costs=costs)
    if res.missing_costs:
        missing.append(missing_costs_note(res))
    if res.unreliable:  # no predicted speed-up from impossible or disagreeing timings
        missing.append(f"predicted speed: {unreliable_note(res)}")
    ex = explain(res, k=4, epsilon=DEFAULT_EPSILON)
    figs = write_figures(res, fig_dir or out_dir / "figures")
    head = ["rule"] + [f"tok/fwd k={k}" for k in _KS] + [
        f"conditional acceptance by position (k=8; a/n: fewer than {MIN_TRIES} tries)", "mean acceptance length k=4",
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
        acc = " ".join(_rate(a, n) for a, n in zip(k8["conditional_acceptance_rate_per_pos"], k8["num_attempted_per_pos"]))
        mal = k4["mean_acceptance_length"]
        row = [spec] + ["-" if x is None else f"{x:.2f}" for x in tpf] + [
            acc, "-" if mal is None else f"{mal:.2f}",
            f"{k4['exact_fraction']:.3f}", f"{sp['inside_radius']} / {sp['low_margin']} / {sp['far_off']}"]
        rec = res.recommended.get(spec)
        if costs is not None:  # a choice that left untimed shapes out says so
            row.append("-" if not rec else f"{rec['shape']} ({rec['speedup']:.2f}x"
                       + (f"; {rec['untimed']} untimed)" if rec.get("untimed") else ")"))
        rows.append(row)
        summ[spec] = {"tokens_per_forward": dict(zip([lab(k) for k in _KS], tpf)),
                      "conditional_acceptance_rate_per_pos_k8": k8["conditional_acceptance_rate_per_pos"],
                      "num_attempted_per_pos_k8": k8["num_attempted_per_pos"],
                      "mean_acceptance_length_k4": k4["mean_acceptance_length"], "exact_fraction_k4": k4["exact_fraction"],
                      "rejections_k4": sp, "recommended": rec, "untimed": res.missing_costs.get(spec, [])}
    bad = sum(r["split"]["inside_radius"] for r in ex["rules"].values())
    md = ["## Replay", "", HOW_TO_READ + f" eps = {DEFAULT_EPSILON:g} nats.", ""]
    if bad:
        md += [f"**SOUNDNESS VIOLATION: {bad} rejection(s) inside the radius. This is a bug in draftcert.**", ""]
    md += [f"**Not in this section:** {m}" for m in missing] + ([""] if missing else [])
    md += ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    md += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    md.append("")
    for f in figs:
        md += [f"### {FIGURE_NAMES.get(f.name, f.stem)}", "", f"![{f.stem}]({f.relative_to(out_dir).as_posix()})", ""]
    e = html.escape
    h = [f"<h2>Replay</h2><p>{html_text(HOW_TO_READ)} eps = {DEFAULT_EPSILON:g} nats.</p>"]
    h += [f"<p class='missing'><b>Not in this section:</b> {html_text(m)}</p>" for m in missing]
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
            "notes": [f"replay section: {m}" for m in missing if cal.exists()],
            "summary": json_value({"epsilon": DEFAULT_EPSILON, "soundness_violations": bad, "rules": summ,
                                   "missing": missing})}


def html_text(text: str) -> str:
    """Plain text with `code` spans as HTML: escaped, each backticked span in <code>."""
    return "".join(f"<code>{html.escape(p)}</code>" if i % 2 else html.escape(p) for i, p in enumerate(text.split("`")))


def section_for_report(out_dir) -> dict | None:
    """``replay_section(out_dir)`` as ``draftcert.report.write_report(out_dir, replay=...)`` takes it:
    None when there is no trace (the report says so itself) or it was recorded without a drafter,
    and ``{"note": ..., "fix": ...}`` when the section fails, so that the rest of the report is written
    anyway, with a Replay section that says why it is empty and which command shows the error."""
    try:
        if not trace_has_drafter(out_dir):
            return None
    except ValueError:
        return None  # no readable trace: write_report raises the error that says what to do
    try:
        return replay_section(out_dir)
    except Exception as exc:  # noqa: BLE001 - the report is written anyway, with a note
        d = shlex.quote(str(out_dir))
        return {"note": f"replay section skipped: {type(exc).__name__}: {exc}",
                "fix": f"`draftcert replay {d}` shows the same error; once it runs, `draftcert report {d}` "
                       "writes the section"}
