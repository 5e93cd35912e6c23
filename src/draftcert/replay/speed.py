"""Predicted speed of a replayed configuration.

The cost model and its table (``Costs``, ``round_seconds``) live in ``draftcert.decode.draft_shape.costs``,
shared with the engine's draft-shape choice (``-k auto``).  Cost model (seconds): one round =
``T(1 + nodes)`` (the target verifies the pending
token and every draft node in one forward over its KV cache) + ``O(1 + nodes)`` (the
engine's acceptance walk and certificates on those rows) + one drafter forward per
drafted depth, ``D(front)`` (the first is the catch-up over the pending token, then one
per further depth: 1 token for chains and (m, depth) trees, the whole front for static
trees).  The first round also pays the prompt prefills: ``T_pre - T(1)`` and
``D_pre - D(1)``.  The target alone pays ``T_pre + (N - 1) T(1)`` for N tokens.
``speedup = (tokens / predicted time) / (recorded tokens / target-alone time)``, the target
alone timed as ``greedy_generate``'s step (``target_step``: one cached forward and its argmax).

``calibrate`` measures T(n), D(n), O(n) (median of interleaved repeats, at a fixed cached
context) and both prefills on this machine; tree verifications are timed with the
engine's 4-D tree mask.  Without a calibration the speed is left out, unless a drafter
cost ratio is given (``forward-count`` model: T(n) = 1, D(n) = ratio).

What is timed is what the engine runs: verification is the engine's ``verify`` stage followed
by the cache rollback (``keep_cache``: a crop for chains, a gather of the kept nodes for trees),
with the target's hidden states for a feature drafter; the per-round work O(n) is the engine's
``accept``, ``certify`` and ``record`` stages (acceptance walk, certificates, statistics).  A feature drafter's drafting of a round is timed whole, per
draft shape and budget: ``FeatureDrafter.propose`` (the catch-up step over the new target
features, then one step per further depth, each with its full-vocabulary logits and top-w) and
``accept``; its first round drafts nothing (the verification is the prefill) and its second
round's catch-up covers the whole prompt (``drafter_prefill``).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..decode.draft_shape.costs import (Costs, EngineJobs, overhead_inputs, overhead_rounds, round_key, round_seconds, time_interleaved,
                            tree_for)
from ..drafting.make import make_drafter
from ..decode.timing import SPREAD_LIMIT, spread
from ..models.tree_attention import crop_cache
from ..models.hf import forward_with_hidden, model_forward, new_cache, vocab_size_of
from .walk import ConfigReplay, Shape

__all__ = ["calibrate", "predict", "missing_costs", "timing_problems", "RETIMES"]

# re-timings of a calibration whose timings fail ``timing_problems`` (then it is kept, marked unreliable)
RETIMES = 2
# the forwards whose timings set the predicted speed (verification, drafting, prefills, the target alone)
_MAIN_JOBS = ("t", "tt", "g", "d", "dr", "tp", "dp")


def missing_costs(rep: ConfigReplay, costs: Costs) -> list[str]:
    """The draft shapes (``round_key``) whose drafting ``rep`` needs and ``costs`` lacks.

    Only a feature drafter's costs can lack one: its drafting is timed whole per shape and budget,
    which no other shape's time stands in for (every other table is interpolated by size).  Empty
    when ``predict`` can price ``rep``."""
    if not costs.drafter_round:
        return []
    sh = rep.shape
    need = {round_key(sh.widths[: r.budget], sh.expand_all) for rs in rep.rounds.values() for r in rs if r.budget > 0}
    return sorted(need - set(costs.drafter_round))


def predict(rep: ConfigReplay, costs: Costs, baseline_tokens: int, n_prompts: int) -> dict:
    """Predicted seconds, tokens/s and speedup of one replayed configuration
    (ValueError when ``missing_costs(rep, costs)`` is not empty)."""
    sh = rep.shape
    t1, d1 = costs.t(1), costs.d(1)
    # a round verifies its own nodes (with suffix candidates: the model's and the grafted ones, with
    # the tree mask once the graft branches); its drafting is the model drafter's (the suffix
    # look-up, a few dict reads, is not timed)
    t_spec = sum(round_seconds(costs, r.n_nodes(sh), sh.drafter_fronts(r.budget), r.verified_as_tree(sh),
                               round_key(sh.widths[: r.budget], sh.expand_all))
                 + (d1 if r.stopped else 0.0)  # a confidence stop read one more q than it drafted from
                 for rs in rep.rounds.values() for r in rs)
    if costs.drafter_prefill is not None:  # the second round's catch-up covers the prompt
        t_spec += n_prompts * (costs.drafter_prefill - (0.0 if costs.drafter_round else d1))
    if costs.target_prefill is not None:
        t_spec += n_prompts * (costs.target_prefill - t1)
    g1 = costs.target_step if costs.target_step is not None else t1
    t_base = baseline_tokens * g1 + (n_prompts * (costs.target_prefill - g1) if costs.target_prefill is not None else 0.0)
    emitted = sum(r.emitted for rs in rep.rounds.values() for r in rs)
    tps = emitted / t_spec if t_spec > 0 else float("inf")
    tps_base = baseline_tokens / t_base if t_base > 0 else float("inf")
    return {
        "seconds": t_spec if costs.source == "calibrated" else None,
        "tokens_per_second": tps if costs.source == "calibrated" else None,
        "baseline_tokens_per_second": tps_base if costs.source == "calibrated" else None,
        "speedup": tps / tps_base if np.isfinite(tps_base) and tps_base > 0 else None,
    }


# ----------------------------------------------------------------------------- calibration


def _sizes(shapes: list[Shape]) -> tuple[set[int], set[int], set[int]]:
    chain, tree, draft = {1}, set(), {1}
    for s in shapes:
        for b in range(0, s.depth + 1):
            n = 1 + s.nodes(b)
            (chain if s.kind == "chain" or b == 0 else tree).add(n)
            draft.update(s.drafter_fronts(b))
    return chain, tree, draft


@torch.inference_mode()
def calibrate(target, drafter, shapes: list[Shape], *, context: int = 128, prompt_length: int = 64,
              repeats: int = 5, vocab: int | None = None, seed: int = 0,
              on_progress: Callable[[int, int], None] | None = None, retimes: int = RETIMES,
              on_retime: Callable[[int, list[str]], None] | None = None) -> Costs:
    """Time target and drafter forwards on this machine for every size the shapes need.

    The target's cache holds ``context`` tokens; each timed forward appends n tokens and
    is cropped back.  Sizes are interleaved round-robin ``repeats`` times (load on a shared
    machine then hits every size alike) and the median is kept.  ``on_progress(done, total)``
    hears of every timed forward (a progress bar).  Timings that fail ``timing_problems`` (a
    larger pass timed cheaper than a smaller one, passes that disagree by > 20 %) are timed
    again, at most ``retimes`` times; the attempt with the fewest problems is returned, its
    problems in ``Costs.unreliable`` (the replay then withholds its predicted speed-ups).
    ``on_progress`` follows the first attempt; ``on_retime(attempt, problems)`` hears of each
    re-timing (attempt = 2, 3, ...) and why.
    """
    if repeats < 1 or context < 1 or prompt_length < 1:
        raise ValueError("calibrate: repeats, context and prompt_length must be >= 1")
    chain, tree, draft = _sizes(shapes)
    V = vocab or vocab_size_of(target)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, min(V, 256), (context + 64,), generator=g).tolist()
    src = make_drafter(drafter, target)
    feature = src.needs_target_hidden
    tcache = new_cache(target)
    seq = ids[: context + 1]
    if feature:
        _, hidden = forward_with_hidden(target, tcache, ids[:context], 1)
        src.start(seq)
        src.observe(hidden)
        src.propose(seq, [1])  # the catch-up over the context, once
        src.accept([])
        rounds = sorted({round_key(s.widths[:b], s.expand_all) for s in shapes for b in range(1, s.depth + 1)})
        shape_of = {round_key(s.widths[:b], s.expand_all): (list(s.widths[:b]), s.expand_all)
                    for s in shapes for b in range(1, s.depth + 1)}
        draft = set()
    else:
        dcache = new_cache(drafter)
        model_forward(target, tcache, ids[:context], 1)
        model_forward(drafter, dcache, ids[:context], 1)
        rounds, shape_of = [], {}
    trees = {n: tree_for(n - 1) for n in tree}
    jobs = [("t", n) for n in sorted(chain)] + [("tt", n) for n in sorted(tree)] + [("d", n) for n in sorted(draft)]
    jobs += [("dr", r) for r in rounds]
    jobs += [("o", n) for n in sorted(chain | tree)]
    jobs += [("tp", prompt_length), ("dp", prompt_length), ("g", 1)]
    rows = {n: overhead_inputs(n, V, g, next(target.parameters()).dtype) for n in sorted(chain | tree)}

    def before(job):
        if job[0] == "dr":  # rewind: the round's catch-up covers 2 new target features
            crop_cache(src.cache, context - 2)
            src.n_valid = context - 2

    engine = EngineJobs(target, tcache, ids, context, feature, src, seq, trees, shape_of, rows)

    def run(job):
        kind, n = job
        if engine.run(kind, n):  # the engine's jobs: verification, drafting round, round work, greedy step
            return
        if kind == "d":
            model_forward(drafter, dcache, ids[context:context + n], 1)
        elif kind == "tp":
            (forward_with_hidden if feature else model_forward)(target, new_cache(target), ids[:n], 1)
        elif feature:  # the catch-up over a whole prompt (the second round)
            src.cache = src.model.new_cache()
            src.n_valid = 0
            src.feats, saved = src.feats[:n], src.feats
            src.propose(ids[: n + 1], [1])
            src.accept([])
            src.feats = saved
        else:
            model_forward(drafter, new_cache(drafter), ids[:n], 1)

    def after(job):
        kind = job[0]
        engine.rewind_target(kind)
        if kind == "d":
            crop_cache(dcache, context)
        elif kind == "dp" and feature:  # back to the context state
            src.cache = src.model.new_cache()
            src.n_valid = 0
            src.propose(seq, [1])
            src.accept([])

    best = None
    for attempt in range(1 + max(0, int(retimes))):
        if attempt and on_retime is not None:
            on_retime(attempt + 1, costs.unreliable)
        samples: dict = {}
        med = time_interleaved(jobs, run, repeats, before=before, after=after,
                               on_progress=on_progress if attempt == 0 else None, samples=samples)
        costs = _costs(med, chain, tree, draft, rounds, feature, context, prompt_length, repeats)
        costs.unreliable = timing_problems(costs, samples)
        if best is None or len(costs.unreliable) <= len(best.unreliable):
            best = costs  # the latest of the attempts with the fewest problems
        if not costs.unreliable:
            break
    if best.unreliable:
        best.note += f"; timings unreliable after {attempt + 1} attempts"
    elif attempt:
        best.note += f"; re-timed {attempt} time(s) after unreliable timings"
    return best


def timing_problems(costs: Costs, samples: dict | None = None, limit: float = SPREAD_LIMIT) -> list[str]:
    """Why a calibration's timings cannot be trusted (empty: no problem found).

    * **impossible order**: a pass of more tokens timed cheaper than a pass of fewer by more than
      the noise ``limit`` (``T(n_large) * (1 + limit) < T(n_small)``; a forward over more rows does
      more work), in the target's chain and tree verifications (the tree's against T(1) too), the
      drafter's forwards, and the target's prefill against T(1); the worst pair of each table is named;
    * **disagreeing repeats**: the timing passes' totals over the main forwards (verification,
      drafting, prefills, the target alone) spread by more than ``limit``
      (``decode.timing.spread``: (max - min) / median; the same 20 % as ``decode --baseline``).

    ``samples``: ``time_interleaved``'s per-pass seconds by job (None: the order checks alone).
    """
    out = []

    def order(name: str, table: dict[int, float]) -> None:
        sizes = sorted(n for n, v in table.items() if v is not None)
        worst = None
        for j, big in enumerate(sizes):
            for small in sizes[:j]:
                ratio = table[small] / table[big] if table[big] > 0 else float("inf")
                if ratio > 1 + limit and (worst is None or ratio > worst[0]):
                    worst = (ratio, small, big)
        if worst:
            _, small, big = worst
            out.append(f"a {big}-token {name} timed {table[big]:.3g} s, cheaper than a {small}-token one "
                       f"({table[small]:.3g} s)")

    order("target pass", costs.target)
    if costs.target_tree:
        order("target tree pass", {**({1: costs.target[1]} if 1 in costs.target else {}), **costs.target_tree})
    if not costs.feature:
        order("drafter pass", costs.drafter)
    if costs.target_prefill is not None and costs.prompt_length and 1 in costs.target and costs.prompt_length > 1:
        order("target prefill", {1: costs.target[1], costs.prompt_length: costs.target_prefill})
    if samples:
        main = [v for j, v in samples.items() if isinstance(j, tuple) and j and j[0] in _MAIN_JOBS]
        passes = min((len(v) for v in main), default=0)
        totals = [sum(v[r] for v in main) for r in range(passes)]
        s = spread(totals)
        if s is not None and s > limit:
            out.append(f"the {passes} timing passes disagree by {s:.0%} (more than {limit:.0%}: the machine's "
                       "load changed while timing)")
    return out


def _costs(med, chain, tree, draft, rounds, feature, context, prompt_length, repeats) -> Costs:
    return Costs(
        "calibrated",
        target={n: med[("t", n)] for n in sorted(chain)},
        drafter={n: med[("d", n)] for n in sorted(draft)} or {1: med[("dr", round_key([1], False))] if feature and
                                                               ("dr", round_key([1], False)) in med else 0.0},
        drafter_round={r: med[("dr", r)] for r in rounds}, feature=feature, target_step=med[("g", 1)],
        target_tree={n: med[("tt", n)] for n in sorted(tree)},
        overhead={n: med[("o", n)] / overhead_rounds(n) for n in sorted(chain | tree)},
        target_prefill=med[("tp", prompt_length)],
        drafter_prefill=med[("dp", prompt_length)],
        context=context, prompt_length=prompt_length, repeats=repeats,
        note=f"timed on this machine: median of {repeats} interleaved repeats, cached context {context}, "
             f"prompt {prompt_length} tokens",
    )
