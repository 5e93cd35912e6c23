"""The evaluation's report: one row per rule against strict, the flips, the files and the figure.

``write_scoreboard(out_dir)`` reads ``evaluate.json`` and ``results/`` and writes, each atomically:

* ``evaluation.json``: the settings, the rows, the flips, and (with ``--baseline``) whether strict's
  completions equal the target's greedy ones bit for bit;
* ``evaluation.parquet`` (the rows) and ``completions.parquet`` (one row per problem and rule), with
  the names ``decode --json`` and ``profile``'s trace use (``prompt_id``, ``criterion``, ``emitted``,
  ``target_forwards``, ``tokens_per_forward``, ``tokens_per_second``, ``drift``, ``drift_tokens``,
  ``certified_fraction``, ...);
* ``evaluation.md`` and ``figures/pass_at_1_vs_tokens_per_forward.png`` (one point per rule).

A row counts the problems that strict and the rule both have (paired):

* ``pass_at_1``: passed / problems (one greedy completion each: pass@1 is the pass rate);
* ``lost`` (strict passes, the rule fails), ``gained`` (the reverse), and ``mcnemar_p``: McNemar's
  exact test, the two-sided binomial test of ``lost`` among ``lost + gained`` at 1/2
  (``mcnemar_exact``): the chance of a split at least this uneven if the rule changed nothing;
* ``tokens_per_forward`` = sum of emitted / sum of target forwards; ``tokens_per_second`` = sum of
  emitted / sum of decode seconds (each decode timed once); ``speedup`` = that over the target
  alone's (``--baseline``); emitted counts the tokens kept (a stopped decode's, ``session``); ``drift``
  = drift_tokens / the tokens the rounds emitted (``decoded_tokens``; accepted tokens that are not the
  target's greedy token at their prefix); ``certified_fraction`` = certified / checked positions;
  ``identical`` = completions equal to strict's, token for token; ``first_drift_step_median`` and
  ``first_drift_margin_median``: the median step and target top-2 margin of the first non-greedy
  token, over the completions that leave greedy.

A flip is a problem that strict and the rule score differently; it carries the rule's
``first_drift`` (``session.first_drift``).
"""

from __future__ import annotations

import json
import statistics
from math import comb
from pathlib import Path

from ..fileio import atomic_path, atomic_write, write_json
from .session import CONTROL, GREEDY, SETTINGS_FILE, read_results

__all__ = ["mcnemar_exact", "scoreboard_rows", "write_scoreboard", "format_rows", "is_evaluation_dir", "FIGURE"]

FIGURE = "figures/pass_at_1_vs_tokens_per_forward.png"
COMPLETION_COLUMNS = ("prompt_id", "criterion", "passed", "status", "emitted", "target_forwards", "tokens_per_forward",
                      "seconds", "tokens_per_second", "drift", "drift_tokens", "certified_fraction",
                      "certified_positions", "checked_positions", "identical_to_strict", "completion", "program")


def is_evaluation_dir(path) -> bool:
    return (Path(path) / SETTINGS_FILE).is_file()


def _binom_two_sided(k: int, n: int) -> float:
    """Exact two-sided binomial p-value at 1/2 (symmetric: twice the smaller tail, at most 1)."""
    if n == 0:
        return 1.0
    m = min(k, n - k)
    tail = sum(comb(n, i) for i in range(m + 1))
    return min(1.0, 2 * tail / 2 ** n)


def mcnemar_exact(lost: int, gained: int) -> float:
    """McNemar's exact test on the discordant pairs: the two-sided binomial test of ``lost`` in
    ``lost + gained`` trials at 1/2 (scipy's ``binomtest`` where scipy is installed; the same exact
    sum otherwise).  1.0 when there is no discordant pair."""
    n = lost + gained
    if n == 0:
        return 1.0
    try:
        from scipy.stats import binomtest  # optional: exact sums below otherwise
    except ImportError:
        return _binom_two_sided(lost, n)
    return float(binomtest(lost, n, 0.5, alternative="two-sided").pvalue)


def _ratio(a: float, b: float):
    return a / b if b else None


def _median(xs: list[float]):
    return statistics.median(xs) if xs else None


def scoreboard_rows(out_dir) -> tuple[list[dict], list[dict], dict]:
    """(rows, flips, checks) of an evaluation folder (module docstring)."""
    settings = json.loads((Path(out_dir) / SETTINGS_FILE).read_text())
    strict = read_results(out_dir, CONTROL)
    greedy = read_results(out_dir, GREEDY)
    base_tps = None
    checks: dict = {}
    if greedy:
        both = [pid for pid in greedy if pid in strict]
        mismatch = [pid for pid in both if greedy[pid]["tokens"] != strict[pid]["tokens"]]
        checks = {"baseline_compared": len(both), "baseline_match": not mismatch, "baseline_mismatches": mismatch}
        sec = sum(greedy[p]["seconds"] for p in both)
        base_tps = _ratio(sum(greedy[p]["emitted"] for p in both), sec)
    rows, flips = [], []
    for spec in settings["criteria"]:
        recs = read_results(out_dir, spec)
        pids = [p for p in settings["problems"] if p in recs and p in strict]
        if not pids:
            continue
        r = [recs[p] for p in pids]
        lost = [p for p in pids if strict[p]["passed"] and not recs[p]["passed"]]
        gained = [p for p in pids if recs[p]["passed"] and not strict[p]["passed"]]
        emitted = sum(x["emitted"] for x in r)
        seconds = sum(x["seconds"] for x in r)
        checked = sum(x["checked_positions"] for x in r)
        tps = _ratio(emitted, seconds)
        drifts = [x for x in r if x.get("first_drift")]
        rows.append({
            "criterion": spec, "problems": len(pids), "passed": sum(x["passed"] for x in r),
            "pass_at_1": sum(x["passed"] for x in r) / len(pids), "lost": len(lost), "gained": len(gained),
            "mcnemar_p": mcnemar_exact(len(lost), len(gained)),
            "tokens_per_forward": _ratio(emitted, sum(x["target_forwards"] for x in r)),
            "tokens_per_second": tps, "speedup": _ratio(tps, base_tps) if tps is not None and base_tps else None,
            "drift": _ratio(sum(x["drift_tokens"] for x in r), sum(x.get("decoded_tokens", x["emitted"]) for x in r)),
            "certified_fraction": _ratio(sum(x["certified_positions"] for x in r), checked),
            "identical": sum(x["tokens"] == strict[p]["tokens"] for p, x in zip(pids, r)),
            "first_drift_step_median": _median([x["first_drift"]["step"] for x in drifts]),
            "first_drift_margin_median": _median([x["first_drift"]["target_margin"] for x in drifts]),
            "emitted": emitted, "seconds": seconds,
        })
        for p, direction in [(p, "lost") for p in lost] + [(p, "gained") for p in gained]:
            flips.append({"prompt_id": p, "criterion": spec, "direction": direction,
                          "strict_status": strict[p]["status"], "rule_status": recs[p]["status"],
                          "first_drift": recs[p].get("first_drift")})
    return rows, flips, checks


def _f(x, fmt=".2f") -> str:
    return "-" if x is None else format(x, fmt)


def format_rows(rows: list[dict]) -> str:
    """The markdown table of the rows."""
    head = ("| rule | problems | pass@1 | lost | gained | McNemar p | tokens/forward | tokens/s | speedup | drift "
            "| certified | identical to strict |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['criterion']} | {r['problems']} | {r['pass_at_1']:.3f} ({r['passed']}) | {r['lost']} | "
                     f"{r['gained']} | {_f(r['mcnemar_p'], '.3g')} | {_f(r['tokens_per_forward'])} | "
                     f"{_f(r['tokens_per_second'])} | {_f(r['speedup'])} | {_f(r['drift'], '.3f')} | "
                     f"{_f(r['certified_fraction'])} | {r['identical']}/{r['problems']} |")
    return "\n".join(lines)


def _one_line(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("|", "\\|").replace("`", "'")


def format_flips(flips: list[dict]) -> str:
    if not flips:
        return "No flips: every rule passes and fails the same problems as strict."
    out = ["| problem | rule | flip | step | margin | radius | before | rule's text | greedy's text |",
           "|---|---|---|---:|---:|---:|---|---|---|"]
    for f in flips:
        d = f["first_drift"] or {}
        out.append(f"| {f['prompt_id']} | {f['criterion']} | {f['direction']} ({f['rule_status']}) | "
                   f"{d.get('step', '-')} | {_f(d.get('target_margin'), '.3f')} | "
                   f"{'inf' if d and d.get('radius') is None else _f(d.get('radius'), '.3f')} | "
                   f"`{_one_line(d.get('text_before', '')[-40:])}` | `{_one_line(d.get('text_rule', '')[:40])}` | "
                   f"`{_one_line(d.get('text_greedy', '')[:40])}` |")
    return "\n".join(out)


def _figure(path: Path, rows: list[dict]) -> None:
    import matplotlib  # optional: models extra

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    markers = "osD^v<>ph*"
    for i, r in enumerate(x for x in rows if x["tokens_per_forward"] is not None):  # a legend: labels never overlap
        ax.scatter(r["tokens_per_forward"], r["pass_at_1"], marker=markers[i % len(markers)], s=50,
                   color="black" if r["criterion"] == CONTROL else f"C{i % 10}",
                   label=f"{r['criterion']}  (lost {r['lost']}, gained {r['gained']})")
    ax.set_xlabel("tokens per target forward")
    ax.set_ylabel("pass@1")
    ax.set_ylim(-0.03, 1.03)
    ax.legend(fontsize=7, loc="best")
    n = max((r["problems"] for r in rows), default=0)
    ax.set_title(f"pass@1 against tokens per forward ({n} problems)")
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)


def _parquet(path: Path, records: list[dict]) -> None:
    import pyarrow as pa  # optional: models extra
    import pyarrow.parquet as pq

    with atomic_path(path) as tmp:
        pq.write_table(pa.Table.from_pylist(records), tmp)


def write_scoreboard(out_dir, *, figure: bool = True) -> dict:
    """Write the report files of an evaluation folder (module docstring); returns evaluation.json's content."""
    out = Path(out_dir)
    settings = json.loads((out / SETTINGS_FILE).read_text())
    rows, flips, checks = scoreboard_rows(out)
    doc = {"settings": settings, "rows": rows, "flips": flips, **checks}
    write_json(out / "evaluation.json", doc)
    completions = []
    for spec in settings["criteria"]:
        for pid, rec in read_results(out, spec).items():
            completions.append({c: rec.get(c) for c in COMPLETION_COLUMNS})
    if rows:
        _parquet(out / "evaluation.parquet", rows)
        _parquet(out / "completions.parquet", completions)
        if figure:
            _figure(out / FIGURE, rows)
    md = [f"# Evaluation: {settings['task']}, target {settings['target']}, drafter {settings['drafter']}", "",
          f"k={settings['k']}, up to {settings['max_new_tokens']} new tokens, numerics {settings['model_dtype']}; "
          "strict is the control (the target's greedy completions); McNemar p: exact, on the problems strict and "
          "the rule score differently.", ""]
    if checks:
        md += [f"Strict against the target's own greedy decoding: {checks['baseline_compared']} problems compared, "
               f"identical: {checks['baseline_match']}.", ""]
    md += [format_rows(rows), "", f"![pass@1 against tokens per forward]({FIGURE})" if rows and figure else "", "",
           "## Flips", "", format_flips(flips), ""]
    atomic_write(out / "evaluation.md", "\n".join(md))
    return doc
