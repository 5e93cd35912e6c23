"""``explain``: the rejection events of a replay, ranked by surprise, and why each happened.

A rejection event is a draft position the replay attempted and the rule rejected
(one per round that did not accept its whole draft, at the rejected depth).  For the
event at trace step s (target p, drafter q, the drafter's candidates c_1..c_w: its
greedy token for a chain, its top-w for a width-w tree node):

* surprise = log p(a) - max_i log p(c_i) (nats, >= 0), a = p's greedy token: how
  unlikely the target finds the best token the drafter offered.  Ranked descending;
  a soundness violation always ranks first.
* D = KL(p || q) (forward, as the trace records it) against r = the rule's radius(p).

Aggregate split (a partition of the events; eps = ``epsilon``, default 0.1 nats):

* ``inside_radius``: the trace certified the step (D < r, proven by ``certify_rows``), so it
  cannot be rejected: a soundness violation (a bug), flagged loudly.
* ``low_margin``: not certified and D <= eps.  The drafter was within eps of p (as close as a good
  drafter is) and still rejected: the radius is below eps, p is nearly tied here, and
  relaxing the rule (a larger radius) is what helps.
* ``far_off``: not certified and D > eps.  The drafter was further from p than eps (and than
  the radius): the drafter is what needs fixing.  ``kl / radius`` says by how much.
* ``nonfinite``: the step's target or drafter logits were non-finite.
* ``own_features``: a feature drafter's draft at depth >= 2, made from its own predicted
  features (the trace's rollouts): its tokens and their p are recorded, D(p, q) of that q is
  not (it would cost a float64 pass over the vocabulary per depth), so the split leaves it out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..fileio import json_value, write_json
from .api import ReplayResult
from .trace_reader import load_tokenizer  # noqa: F401 - re-exported: explain's text comes from the run's tokenizer
from .walk import rule_kind

__all__ = ["explain", "Event", "DEFAULT_EPSILON", "CATEGORIES", "format_explain", "load_tokenizer"]

DEFAULT_EPSILON = 0.1
# "own_features": a feature drafter's depth >= 2 draft, made from its own predicted features: the trace
# records its tokens (rollouts) but not D(p, q) of that q, so the split cannot place it
CATEGORIES = ("inside_radius", "low_margin", "far_off", "nonfinite", "own_features")
_RED, _RESET = "\033[1;91m", "\033[0m"


@dataclass
class Event:
    rule: str
    config: str
    prompt: str
    position: int
    depth: int
    target_token: int
    drafter_tokens: list[int]
    drafter_rank_under_p: int | None  # rank of the drafter's greedy token under p (0 = argmax)
    margin: float
    kl: float
    radius: float
    surprise: float
    surprise_is_lower_bound: bool
    category: str
    accepted_by: list[str]
    estimated: bool  # the round lies after the replay left the recorded path (relaxed rules)
    context: list[int] = field(default_factory=list)  # recorded tokens before the position
    after: list[int] = field(default_factory=list)  # recorded tokens from the position on (p's greedy path)
    text: dict | None = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _category(certified: bool, kl: float, radius: float, eps: float) -> str:
    """Why a rejection happened.  ``certified`` is the trace's certificate of the step (the one
    decision, ``certificates.certify_rows``): certified yet rejected is a soundness violation."""
    if not (math.isfinite(kl) and not math.isnan(radius)):
        return "nonfinite"
    if certified:
        return "inside_radius"
    return "low_margin" if kl <= eps else "far_off"


def _logp_of(pt, s: int, tokens: list[int], ranks: list[int]) -> tuple[float, bool]:
    """max log p over the candidates, and whether it is only an upper bound (old traces)."""
    if pt.draft_logp is not None:
        return float(max(pt.draft_logp[s, r] for r in ranks)), False
    ids, probs = pt.target_topk_ids[s], pt.target_topk_probs[s]
    best, bound = -math.inf, False
    for t in tokens:
        hit = np.flatnonzero(ids == t)
        if hit.size:
            best = max(best, math.log(max(probs[hit[0]], 1e-300)))
        else:
            best, bound = max(best, math.log(max(probs[-1], 1e-300))), True
    return best, bound


def explain(res: ReplayResult, *, configs: dict[str, str] | None = None, k: int = 4, epsilon: float = DEFAULT_EPSILON,
            context: int = 8) -> dict:
    """Rejection events per rule for one configuration each (``configs[spec]`` = a shape label of
    the replay; default chain k=``k``, or tree MxK for tree:M), ranked by surprise, and the split."""
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon: expected a finite value > 0 (nats), got {epsilon!r}")
    tr = res.trace
    by_id = {p.id: p for p in tr.prompts}
    out: dict = {"epsilon": epsilon, "rules": {}}
    for spec, reps in res.configs.items():
        kind, m = rule_kind(spec)
        want = (configs or {}).get(spec) or (f"tree {m}x{k}" if kind == "tree" else f"chain k={k}")
        rep = next((c for c in reps if c.shape.label == want), None)
        if rep is None:
            raise ValueError(f"explain: no replayed configuration {want!r} for {spec}; replayed: "
                             f"{', '.join(c.shape.label for c in reps)}")
        events = []
        for pid, rounds in rep.rounds.items():
            pt = by_id[pid]
            for r in rounds:
                if not r.depth_accepted or r.depth_accepted[-1]:
                    continue
                d = len(r.depth_accepted)
                s = r.start + d - 1
                w = rep.shape.widths[d - 1]
                own = pt.roll_ids is not None and d >= 2  # a feature drafter's own rollout
                a = int(pt.target_token[s])
                la = math.log(max(float(pt.target_topk_probs[s, 0]), 1e-300))
                rad = float(pt.radius[spec][s]) if spec in pt.radius else math.nan
                if own:
                    ranks = list(range(min(w, pt.roll_ids.shape[2])))
                    toks = [int(pt.roll_ids[s, d - 2, i]) for i in ranks]
                    lc, bound = float(np.nanmax(pt.roll_logp[s, d - 2, : len(ranks)])), False
                    kl = math.nan
                    hit = np.flatnonzero(pt.target_topk_ids[s] == toks[0])
                    rank = int(hit[0]) if hit.size else None  # None: below p's stored top-16
                else:
                    ranks = list(range(min(w, pt.draft_ids.shape[1])))
                    toks = [int(pt.draft_ids[s, i]) for i in ranks]
                    lc, bound = _logp_of(pt, s, toks, ranks)
                    kl = float(pt.kl[s])
                    if pt.draft_rank is not None:
                        rank = int(pt.draft_rank[s])
                    else:
                        hit = np.flatnonzero(pt.target_topk_ids[s] == toks[0])
                        rank = int(hit[0]) if hit.size else None
                cat = "nonfinite" if pt.broken[s] else "own_features" if own else _category(
                    spec in pt.certified and bool(pt.certified[spec][s]), kl, rad, epsilon)
                events.append(Event(
                    rule=spec, config=rep.shape.label, prompt=pid, position=s, depth=d, target_token=a,
                    drafter_tokens=toks, drafter_rank_under_p=rank, margin=float(pt.margin[s]), kl=kl, radius=rad,
                    surprise=max(0.0, la - lc) if math.isfinite(lc) else math.inf, surprise_is_lower_bound=bound,
                    category=cat, accepted_by=_accepted_by(pt, tr.specs, spec, s, d if own else 1),
                    estimated=not r.exact, context=[int(x) for x in pt.target_token[max(0, s - context):s]],
                    after=[int(x) for x in pt.target_token[s:s + context]]))
        events.sort(key=lambda e: (e.category != "inside_radius", -e.surprise if not math.isnan(e.surprise) else 0.0,
                                   -(e.radius if math.isfinite(e.radius) else 1e300)))
        split = {c: sum(e.category == c for e in events) for c in CATEGORIES}
        out["rules"][spec] = {"config": rep.shape.label, "events": events, "split": split,
                              "split_fraction": {c: (v / len(events) if events else None) for c, v in split.items()}}
    return out


def _accepted_by(pt, specs, spec: str, s: int, d: int) -> list[str]:
    """The other rules that accept the drafter's rank-0 token of this event (at depth d >= 2 of a
    feature drafter: its own rollout token, from the rollout masks; strict/tree:M: is it p's greedy)."""
    if d == 1:
        return [o for o in specs if o != spec and bool(pt.accepted[o][s])]
    out = []
    for o in specs:
        if o == spec:
            continue
        kind, m = rule_kind(o)
        if kind == "tree":
            ok = int(pt.target_token[s]) in pt.roll_ids[s, d - 2, :m].tolist()
        elif o in pt.roll_mask:
            ok = bool(pt.roll_mask[o][s, d - 2] & 1)
        else:
            continue
        if ok:
            out.append(o)
    return out


def attach_text(ex: dict, tok) -> None:
    """Decoded text for every event (``text`` = {before, target, drafter}); ids when no tokenizer."""
    for r in ex["rules"].values():
        for e in r["events"]:
            if tok is None:
                e.text = None
                continue
            e.text = {"before": tok.decode(e.context), "target": tok.decode([e.target_token]),
                      "after": tok.decode(e.after), "drafter": [tok.decode([t]) for t in e.drafter_tokens]}


def explain_json(ex: dict) -> dict:
    """The ``explain.json`` contents (the JSON rule of ``draftcert.fileio``: non-finite -> null,
    so an infinite surprise is written as null)."""
    return json_value({"epsilon": ex["epsilon"], "definitions": {
        "surprise": "log p(greedy) - max log p(drafter candidates), nats",
        "inside_radius": "certified (KL(p||q) < radius, proven) yet rejected: impossible (soundness violation)",
        "low_margin": "radius <= KL <= epsilon: a drafter within epsilon of p was rejected (p nearly tied)",
        "far_off": "KL > epsilon and KL >= radius: the drafter was further than epsilon from p",
        "nonfinite": "non-finite target or drafter logits"},
        "rules": {s: {"config": r["config"], "split": r["split"], "split_fraction": r["split_fraction"],
                      "events": [e.as_dict() for e in r["events"]]} for s, r in ex["rules"].items()}})


def write_explain(out_dir, ex: dict) -> Path:
    return write_json(Path(out_dir) / "explain.json", explain_json(ex), indent=1)


def _short(s: str, n: int) -> str:
    s = s.replace("\n", "\\n")
    return s if len(s) <= n else "…" + s[-(n - 1):]


def _fit(line: str, n: int = 80) -> str:
    return line if len(line) <= n else line[: n - 1] + "…"


def format_explain(ex: dict, top: int = 5, color: bool = False) -> str:
    """Terminal text (80 columns): per rule the split, then the ``top`` most surprising events."""
    lines = [f"eps = {ex['epsilon']:g} nats; inside radius: KL < radius (a soundness violation) |",
             "low margin: radius <= KL <= eps | far off: KL > eps, KL >= radius"]
    for spec, r in ex["rules"].items():
        sp = r["split"]
        n = sum(sp.values())
        lines.append("")
        lines.append(f"{spec} [{r['config']}]: {n} rejections")
        lines.append(f"  inside radius {sp['inside_radius']}, low margin {sp['low_margin']}, far off {sp['far_off']}"
                     + (f", nonfinite {sp['nonfinite']}" if sp["nonfinite"] else "")
                     + (f", own features {sp['own_features']}" if sp.get("own_features") else ""))
        if sp["inside_radius"]:
            msg = f"SOUNDNESS VIOLATION: {sp['inside_radius']} rejection(s) inside the radius under {spec}"
            lines.append(f"{_RED}{msg}{_RESET}" if color else msg)
        for i, e in enumerate(r["events"][:top], 1):
            cat = {"inside_radius": "INSIDE RADIUS", "low_margin": "low margin", "far_off": "far off",
                   "nonfinite": "nonfinite", "own_features": "own features"}[e.category]
            sur = "inf" if math.isinf(e.surprise) else f"{e.surprise:.2f}"
            lines.append(f" #{i} prompt {e.prompt} pos {e.position} (depth {e.depth}): {cat}, surprise "
                         f"{'>=' if e.surprise_is_lower_bound else ''}{sur} nats" + (" [est.]" if e.estimated else ""))
            if e.text:
                before = _short(e.text["before"], 34)
                lines.append(f"    {before}[target {e.text['target']!r} | drafter {e.text['drafter'][0]!r}]")
            else:
                lines.append(f"    ids …{e.context[-6:]} [target {e.target_token} | drafter {e.drafter_tokens[0]}]")
            rank = "?" if e.drafter_rank_under_p is None else str(e.drafter_rank_under_p)
            ratio = f" ({e.kl / e.radius:.3g}x)" if e.radius > 0 and math.isfinite(e.radius) else ""
            if e.category == "own_features":  # drafted from the drafter's own features: no D(p, q) recorded
                lines.append(f"    KL not recorded (own-feature draft) vs radius {e.radius:.4g}; margin {e.margin:.3f}")
            else:
                lines.append(f"    KL {e.kl:.4g} vs radius {e.radius:.4g}{ratio}; margin {e.margin:.3f}")
            lines.append(f"    drafter token's rank under p: {rank}")
            acc = ", ".join(e.accepted_by) if e.accepted_by else "none"
            lines.append("    accepted by: " + _short(acc, 62))
    return "\n".join(_fit(x) for x in lines) + "\n"
