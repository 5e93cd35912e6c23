"""``replay(DIR)``: every rule x every draft shape of a profile trace, with predicted speed.

A configuration's row carries the figures ``draftcert decode --json`` prints, under the same
names and definitions (``DecodeStats.acceptance_metrics``; every name: docs/metrics.md), over
all prompts of the trace: vLLM's ``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``,
``num_accepted_tokens_per_pos``, ``mean_acceptance_length`` (1 + accepted / drafts),
``draft_acceptance_rate`` (accepted / draft tokens), ``acceptance_rate_per_pos`` (accepted at
position i / drafts), and ours: ``target_forwards`` (rounds; the prefill shares the first
verification, as in the engine), ``tokens_per_forward`` (emitted / target forwards),
``conditional_acceptance_rate_per_pos`` (accepted / attempted at depth d; a depth is attempted
when every shallower depth of the round was accepted and the node reached has drafted
children), ``accepted_tokens_histogram``, ``drift`` (accepted non-greedy tokens / emitted
tokens: the quality cost of relaxed rules).  The replay adds ``exact_fraction`` = rounds
replayed entirely on the recorded path (1 for strict and tree:M; for relaxed rules the rest is
the *aligned estimate*, see ``walk.py``), ``estimated`` and ``predicted`` speed.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from ..fileio import json_value, write_json
from ..models import DEFAULT_DRAFTER, parse_drafter_spec
from .trace_reader import ReplayTrace, load_replay_trace, load_tokenizer, prompt_token_ids
from .speed_figures import write_figures
from ..decode.draft_shape.costs import Costs
from .speed import missing_costs, predict
from .walk import DEFAULT_KS, DEFAULT_STATIC, DEFAULT_TREE_WIDTHS, ConfigReplay, Shape, default_shapes, replay_config, rule_kind

__all__ = ["replay", "ReplayResult", "write_replay", "format_table", "parse_ks", "calibration_shapes", "DEFAULT_MARGINS",
           "missing_costs_note", "unreliable_note", "replay_drafter", "decode_default_drafter", "choose_drafter", "REPLAY_FORMAT"]

SUFFIX = "+suffix"

REPLAY_FORMAT = "draftcert-replay/1"


@dataclass
class ReplayResult:
    trace: ReplayTrace
    configs: dict[str, list[ConfigReplay]]
    costs: Costs | None
    rows: dict[str, list[dict]] = field(default_factory=dict)
    recommended: dict[str, dict | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # per rule: labels of the configurations whose speed the costs cannot price (a calibration
    # made without their draft shapes); their acceptance figures are whole, "predicted" is None
    missing_costs: dict[str, list[str]] = field(default_factory=dict)
    calibrate_command: str | None = None  # what fills missing_costs
    # the calibration's timing problems (``Costs.unreliable``): predicted speed-ups withheld when not empty
    unreliable: list[str] = field(default_factory=list)
    drafter: str | None = None  # the drafter replayed: the trace's, or the trace's + "+suffix"
    prompt_order: list[str] | None = None  # with suffix candidates: the decode order of the prompts
    # per rule, with margins: the best chain with a confidence stop against the best fixed chain
    margin_fit: dict[str, dict] = field(default_factory=dict)

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
            "drafter": self.drafter or tr.run.get("drafter"),
            "trace_drafter": tr.run.get("drafter"),
            "prompt_order": self.prompt_order,
            "prompts": len(tr.prompts),
            "steps": tr.steps,
            "max_new_tokens": tr.max_new_tokens,
            "costs": self.costs.as_dict() if self.costs else None,
            "rules": {s: {"exact": rule_kind(s)[0] in ("strict", "tree"), "configs": self.rows[s],
                          "recommended": self.recommended.get(s), "margin_fit": self.margin_fit.get(s)}
                      for s in self.rows},
            "missing_costs": self.missing_costs,
            "timings_unreliable": self.unreliable,
            "notes": self.notes,
        })


def replay(source, *, rules=None, ks=DEFAULT_KS, tree_widths=DEFAULT_TREE_WIDTHS, static=DEFAULT_STATIC,
           shapes: list[Shape] | None = None, costs: Costs | None = None, drafter: str | None = None,
           prompts=None, margins=()) -> ReplayResult:
    """Replay a profile trace (a directory or a loaded ``ReplayTrace``) under every rule and shape.

    rules: subset of the trace's criteria (default all); ks: chain lengths / tree depths;
    tree_widths: m of the (m, depth) trees; static: static trees (tuples of widths);
    shapes: explicit shapes instead (applied to every level-set rule; tree:M keeps the
    shapes of width M); costs: ``speed.calibrate`` / ``Costs`` for predicted speed.  A
    configuration the costs cannot price (``speed.missing_costs``: a calibration made without
    its draft shape) keeps its acceptance figures, gets ``predicted = None``, is listed in
    ``missing_costs`` and named in one note with the command that times it.

    drafter: None or the trace's drafter (the model drafter alone), or ``DRAFTER+suffix`` with DRAFTER
    the trace's (``default+suffix`` for the shipped default, ``draftcert decode``'s default): its tree
    plus suffix-match candidates, as ``drafting.suffix.HybridDrafter`` drafts (``walk.walk_prompt_suffix``).
    The candidates come from the prompt, the output so far and the earlier prompts' outputs, so the
    prompts are replayed in decode order with one suffix index carried across them: ``prompts`` =
    [(id, token ids), ...] in that order, or None to read them again from the run's prompt source
    with its tokenizer (``data.prompt_token_ids``: the profile's order).

    margins: confidence stops (nats) to fit: every chain of ``ks`` is replayed again with the drafter
    stopping where its top-2 logit gap falls below each (``Shape.min_margin``, as ``decode
    --draft-margin`` drafts); the recommendation then weighs them with the fixed shapes, and
    ``margin_fit`` says what the best stop gains over the best fixed chain.
    """
    tr = source if isinstance(source, ReplayTrace) else load_replay_trace(source)
    ks = _check_ks(ks)
    specs = _rule_specs(tr, rules)
    dspec, suffix = replay_drafter(tr, drafter)
    order = None
    if suffix:
        if prompts is None:
            try:
                prompts = prompt_token_ids(tr, load_tokenizer(tr.run))
            except ValueError as exc:
                raise ValueError(f"drafter {drafter}: the suffix candidates need the prompts' tokens, and {exc}") from None
        order = [(str(pid), [int(x) for x in ids]) for pid, ids in prompts]
        have = {p.id for p in tr.prompts}
        if sorted(pid for pid, _ in order) != sorted(have):
            raise ValueError(f"prompts: expected every prompt of the trace once ({len(have)}), got {len(order)} "
                             "(ids: " + ", ".join(sorted({pid for pid, _ in order} ^ have))[:200] + " differ)")
    res = ReplayResult(tr, {}, costs, notes=list(tr.notes), drafter=dspec,
                       prompt_order=[pid for pid, _ in order] if order else None)
    if suffix:
        res.notes.append(f"drafter {dspec}: the model drafter's tree plus suffix-match candidates from the prompt, "
                         f"the output so far and the earlier prompts' outputs, as `draftcert decode --drafter "
                         f"{drafter}` drafts; the {len(order)} prompts in the profile's order with one suffix index "
                         "across them (as one process decoding them in turn with one drafter; a separate "
                         "`draftcert decode` per prompt has no earlier outputs)")
    res.unreliable = list(costs.unreliable) if costs is not None else []
    baseline = sum(len(p) for p in tr.prompts)
    margins = _check_margins(margins)
    for spec, cand in _shapes_by_rule(tr, specs, ks, tree_widths, static, shapes, margins).items():
        if not cand:
            res.notes.append(f"{spec}: none of the requested shapes applies (tree:M needs width M); skipped")
            continue
        res.configs[spec] = [replay_config(tr, spec, s, order) for s in cand]
        rows = []
        for c in res.configs[spec]:
            row = {"shape": c.shape.as_dict(), **c.totals()}
            row["estimated"] = row["exact_fraction"] < 1.0
            row["predicted"] = None
            if costs is not None and missing_costs(c, costs):
                res.missing_costs.setdefault(spec, []).append(c.shape.label)
            elif costs is not None and res.unreliable:  # kept in replay.json, marked; never quoted plainly
                row["predicted_unreliable"] = predict(c, costs, baseline, len(tr.prompts))
            elif costs is not None:
                row["predicted"] = predict(c, costs, baseline, len(tr.prompts))
            rows.append(row)
        res.rows[spec] = rows
        priced = [r for r in rows if r["predicted"] is not None]
        best = max(priced, key=lambda r: (r["predicted"]["speedup"] or 0.0)) if priced else None
        res.recommended[spec] = None if best is None else {
            "shape": best["shape"]["label"], "speedup": best["predicted"]["speedup"],
            "tokens_per_forward": best["tokens_per_forward"], "estimated": best["estimated"],
            "untimed": len(rows) - len(priced)}  # configurations left out of the choice (no costs)
        if margins and priced:
            res.margin_fit[spec] = _margin_fit(priced)
    if costs is None:
        res.notes.append("no costs: predicted speed and recommendations need `--calibrate` (or --drafter-cost R)")
    elif costs.note:
        res.notes.append(costs.note)
    if res.unreliable:
        res.notes.append(unreliable_note(res))
    if res.missing_costs:
        res.calibrate_command = _calibrate_command(tr, res.configs, res.missing_costs, ks, tree_widths, static, shapes)
        res.notes.append(missing_costs_note(res))
    return res


def _canonical(spec: str) -> str:
    try:
        return parse_drafter_spec(spec).spec
    except ValueError:
        return spec


def replay_drafter(trace: ReplayTrace, drafter: str | None) -> tuple[str | None, bool]:
    """(the drafter spec replayed, with suffix candidates?) for ``replay(drafter=...)``: None or the
    trace's drafter is the model drafter alone; ``X+suffix`` with X the trace's drafter adds the
    suffix candidates (``default`` names the shipped feature drafter).  ValueError for another drafter:
    the trace holds this drafter's proposals only."""
    trace_d = trace.run.get("drafter")
    if drafter is None:
        return trace_d, False
    d = str(drafter).strip()
    suffix = d.endswith(SUFFIX)
    base = d[: -len(SUFFIX)] if suffix else d
    if trace_d is not None and (base == trace_d or _canonical(base) == _canonical(str(trace_d))):
        return str(trace_d) + (SUFFIX if suffix else ""), suffix
    raise ValueError(f"drafter {drafter!r}: this trace holds the proposals of drafter {trace_d}, so replay "
                     f"simulates {trace_d} alone or with suffix-match candidates ({trace_d}{SUFFIX}); "
                     "profile with another --drafter to replay another one")


def decode_default_drafter(trace: ReplayTrace) -> str | None:
    """The drafter ``draftcert decode`` uses by default for this trace's target, when the trace can
    replay it: ``default+suffix`` for the embedded target profiled with the shipped drafter (None
    otherwise: decode has no default drafter for another target, or the trace holds another one)."""
    if trace.run.get("target") in (None, "embedded") and _canonical(str(trace.run.get("drafter"))) == DEFAULT_DRAFTER:
        return "default" + SUFFIX
    return None


def choose_drafter(trace: ReplayTrace, drafter: str | None = None) -> tuple[str | None, list | None, str | None]:
    """(drafter, prompts, note) for ``replay(trace, drafter=..., prompts=...)`` as ``draftcert replay``
    chooses them: ``drafter`` when given (its prompts read again when it has suffix candidates:
    ValueError when they cannot be); else ``draftcert decode``'s default for the trace
    (``decode_default_drafter``) when the prompts can be read again, else the trace's drafter alone,
    with a note saying why."""
    if drafter is not None:
        _, suffix = replay_drafter(trace, drafter)
        if not suffix:
            return drafter, None, None
        try:
            return drafter, prompt_token_ids(trace, load_tokenizer(trace.run)), None
        except ValueError as exc:
            raise ValueError(f"--drafter {drafter}: the suffix candidates need the prompts' tokens, and {exc}") from None
    dd = decode_default_drafter(trace)
    if dd is None:
        return None, None, None
    try:
        return dd, prompt_token_ids(trace, load_tokenizer(trace.run)), None
    except ValueError as exc:
        return None, None, (f"replayed the drafter alone, not `draftcert decode`'s default {dd}: its suffix "
                            f"candidates need the prompts' tokens, and {exc}")


def unreliable_note(res: ReplayResult) -> str:
    """One line: the calibration's timing problems, and that no speed-up is predicted from them."""
    d = shlex.quote(str(res.trace.out_dir)) if res.trace.out_dir else "DIR"
    return (f"timings unreliable: {'; '.join(res.unreliable)}. No speed-up is predicted and no configuration "
            f"is chosen from them (replay.json keeps them as predicted_unreliable); the acceptance figures need "
            f"no timing. `draftcert replay {d} --calibrate` times again (on a quieter machine, or with fewer "
            f"--threads than idle cores)")


def missing_costs_note(res: ReplayResult) -> str:
    """One line: which configurations have no predicted speed, and the command that times them."""
    labels = {lab for labs in res.missing_costs.values() for lab in labs}
    shapes = [s for cs in res.configs.values() for s in (c.shape for c in cs) if s.label in labels]
    return (f"the calibration has no drafting time for {_shape_names(shapes)}: no predicted speed there "
            f"(the acceptance figures need none); `{res.calibrate_command}` times them")


def _shape_names(shapes) -> str:
    """Shapes named compactly: ``chain k=1-8, tree 3x(1-8), static [4,2,1]``."""
    chains, trees, static = set(), {}, []
    for s in shapes:
        if s.kind == "chain":
            chains.add(s.depth)
        elif s.kind == "tree":
            trees.setdefault(s.widths[0], set()).add(s.depth)
        elif s.label not in static:
            static.append(s.label)
    out = [f"chain k={_ranges(chains)}"] if chains else []
    for m, ds in sorted(trees.items()):
        out.append(f"tree {m}x{_ranges(ds)}" if len(ds) == 1 else f"tree {m}x({_ranges(ds)})")
    return ", ".join(out + static)


def _ranges(xs) -> str:
    """1,2,3,5 -> '1-3,5'."""
    xs, out = sorted(xs), []
    for x in xs:
        if out and out[-1][1] == x - 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def _calibrate_command(tr, configs, missing, ks, tree_widths, static, shapes) -> str:
    """The command whose calibration times the missing shapes: ``replay DIR --calibrate`` times the
    default shapes of every rule of the trace (``calibration_shapes``); other shapes need their options."""
    d = shlex.quote(str(tr.out_dir)) if tr.out_dir else "DIR"
    defaults = set(calibration_shapes(tr))
    lacking = {c.shape for spec, cs in configs.items() for c in cs if c.shape.label in missing.get(spec, ())}
    if lacking <= defaults:
        return f"draftcert replay {d} --calibrate"
    if shapes is not None:
        return "draftcert.replay.calibrate(target, drafter, shapes) with these shapes, passed as costs= to replay()"
    opts = []
    if tuple(ks) != DEFAULT_KS:
        contiguous = len(ks) > 1 and list(ks) == list(range(ks[0], ks[-1] + 1))
        opts.append(f"-k {ks[0]}-{ks[-1]}" if contiguous else "-k " + ",".join(map(str, ks)))
    if tuple(tree_widths) != DEFAULT_TREE_WIDTHS:
        opts.append("--trees " + (",".join(map(str, tree_widths)) or "''"))
    if tuple(map(tuple, static)) != DEFAULT_STATIC:
        opts.append("--static " + shlex.quote(";".join(",".join(map(str, w)) for w in static)))
    return " ".join([f"draftcert replay {d} --calibrate"] + opts)


def calibration_shapes(source, *, rules=None, ks=DEFAULT_KS, tree_widths=DEFAULT_TREE_WIDTHS,
                       static=DEFAULT_STATIC, shapes: list[Shape] | None = None) -> list[Shape]:
    """Every shape a calibration of this trace times: the default shapes of every rule of the trace
    (all that ``draftcert replay DIR`` and the report's Replay section replay, whichever ``--rules``
    the calibration was asked for) and the shapes of the replay asked for (rules, ks, trees, static)."""
    tr = source if isinstance(source, ReplayTrace) else load_replay_trace(source)
    out = set()
    for cand in _shapes_by_rule(tr, list(tr.specs), DEFAULT_KS, DEFAULT_TREE_WIDTHS, DEFAULT_STATIC, None).values():
        out.update(cand)
    for cand in _shapes_by_rule(tr, _rule_specs(tr, rules), _check_ks(ks), tree_widths, static, shapes).values():
        out.update(cand)
    return sorted(out, key=lambda s: (s.kind, s.widths))


def _rule_specs(tr: ReplayTrace, rules) -> list[str]:
    if rules is None:
        specs = list(tr.specs)
    else:
        specs = [r.strip() for r in (rules.split(",") if isinstance(rules, str) else rules) if r.strip()]
    unknown = [s for s in specs if s not in tr.specs]
    if unknown:
        raise ValueError(f"rules: {', '.join(unknown)} not in the trace (it holds {', '.join(tr.specs)}); "
                         "profile again with --criteria to add a rule")
    if not specs:
        raise ValueError("rules: pass at least one rule of the trace")
    return specs


def _shapes_by_rule(tr: ReplayTrace, specs, ks, tree_widths, static, shapes, margins=()) -> dict[str, list[Shape]]:
    """{rule: the shapes replayed for it} (a level-set rule of a trace without accept masks: chains only;
    with ``margins``, a chain rule's chains of ``ks`` again with each confidence stop)."""
    out = {}
    for spec in specs:
        kind, m = rule_kind(spec)
        if shapes is not None:
            cand = [s for s in shapes if (max(s.widths) == m if kind == "tree" else True)]
        else:
            cand = default_shapes(spec, ks, tree_widths, static)
        if kind == "levelset" and not any(spec in p.accept_mask for p in tr.prompts):
            cand = [s for s in cand if max(s.widths) == 1]
        if kind != "tree":
            cand = cand + [Shape((1,) * k, min_margin=t) for t in margins for k in ks]
        out[spec] = cand
    return out


DEFAULT_MARGINS = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0)  # nats: ``--fit-margin``'s grid


def _check_margins(margins) -> tuple[float, ...]:
    if isinstance(margins, str):
        margins = [m for m in margins.split(",") if m.strip()]
    try:
        out = tuple(float(m) for m in margins)
    except (TypeError, ValueError):
        raise ValueError(f"margins: expected numbers of nats >= 0, got {margins!r}") from None
    if any(not 0 <= m < float("inf") for m in out):
        raise ValueError(f"margins: expected finite numbers of nats >= 0, got {margins!r}")
    return out


def _margin_fit(priced: list[dict]) -> dict:
    """The best priced chain with a confidence stop against the best priced fixed chain (one rule's rows)."""
    def speed(r):
        return r["predicted"]["speedup"] or 0.0
    chains = [r for r in priced if r["shape"]["kind"] == "chain"]
    fixed = [r for r in chains if r["shape"].get("min_margin") is None]
    stopped = [r for r in chains if r["shape"].get("min_margin") is not None]
    best_fixed = max(fixed, key=speed, default=None)
    best_stop = max(stopped, key=speed, default=None)
    out = {"fixed": None, "stop": None, "margin": None, "gain": None}
    if best_fixed is not None:
        out["fixed"] = {"shape": best_fixed["shape"]["label"], "speedup": speed(best_fixed),
                        "tokens_per_forward": best_fixed["tokens_per_forward"]}
    if best_stop is not None:
        out["stop"] = {"shape": best_stop["shape"]["label"], "speedup": speed(best_stop),
                       "tokens_per_forward": best_stop["tokens_per_forward"]}
        out["margin"] = best_stop["shape"]["min_margin"]
    if best_fixed is not None and best_stop is not None and speed(best_fixed) > 0:
        out["gain"] = speed(best_stop) / speed(best_fixed)
    return out


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

_HEAD = f"{'config':<16} {'tok/fwd':>7} {'mal':>6} {'dar':>6} {'pos1':>6} {'last':>6} {'exact':>6} {'speedup':>8}"


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
            acc = r["acceptance_rate_per_pos"]  # vLLM's: accepted at position i / drafts
            sp = r["predicted"]["speedup"] if r["predicted"] else None
            lines.append(f"{r['shape']['label']:<16} {_f(r['tokens_per_forward'], 7)} "
                         f"{_f(r['mean_acceptance_length'], 6)} {_f(r['draft_acceptance_rate'], 6)} "
                         f"{_f(acc[0] if acc else None, 6)} {_f(acc[-1] if acc else None, 6)} "
                         f"{_f(r['exact_fraction'], 6)} {_f(sp, 8)}")
        rec = res.recommended.get(spec)
        if res.unreliable and res.costs is not None:
            lines.append("  best: not chosen: timings unreliable (see the note)")
        if rec:
            lines.append(f"  best: {rec['shape']}, predicted speedup {rec['speedup']:.3f}"
                         + (" (estimated)" if rec["estimated"] else "")
                         + (f" ({rec['untimed']} untimed left out)" if rec.get("untimed") else ""))
        fit = res.margin_fit.get(spec)
        if fit and fit["stop"] and fit["fixed"] and not res.unreliable:
            lines.append(f"  margin fit: {fit['stop']['shape']} (decode --draft-margin {fit['margin']:g} -k "
                         f"{fit['stop']['shape'].split()[0][2:]}) {fit['stop']['speedup']:.3f} against "
                         f"{fit['fixed']['shape']} {fit['fixed']['speedup']:.3f}: x{fit['gain']:.3f}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _pick(rows, by_speed: bool) -> list[dict]:
    def key(r):  # by predicted speedup where priced (an untimed shape ranks below), else tokens per forward
        p = r["predicted"] if by_speed else None
        return (True, p["speedup"] or 0.0) if p else (False, r["tokens_per_forward"])

    out, fams = [], {}
    for r in rows:
        s = r["shape"]
        if s["kind"] == "tree" or s.get("min_margin") is not None:  # a family: its best depth
            fam = (s["kind"], s["widths"][0], s.get("min_margin"))
            if fam not in fams or key(r) > key(fams[fam]):
                fams[fam] = r
        else:
            out.append(r)
    chains = [r for r in out if r["shape"]["kind"] == "chain"]
    static = [r for r in out if r["shape"]["kind"] == "static"]
    return chains + list(fams.values()) + static
