"""The cost of a speculative round on this machine: the model, its measurement, its cache.

Cost model (seconds), the one the replay's predicted speed uses too (``draftcert.replay.speed``):
one round that drafts ``nodes`` tree nodes costs::

    round = T(1 + nodes) + O(1 + nodes) + drafting

``T(n)``: the target's verification of n rows in one forward over its KV cache (the pending token
and every node; ``target_tree`` with the tree mask when the draft is not a chain), followed by the
cache rollback; ``O(n)``: the engine's acceptance walk, certificates and statistics on those rows;
drafting: one drafter forward per drafted depth, ``sum D(front)`` (the first front is the catch-up
over the pending token), or, where it was timed whole (``drafter_round``, by ``round_key``), the
drafter's whole round (propose + accept).  The target alone pays ``target_step`` per token
(``greedy_generate``'s loop body: one cached forward and its argmax).  A model drafter that has not
seen some tokens (the prompt before its first draft, a plain run before a probe) first runs over
them: ``drafter_catch_up`` seconds a token beyond the ``ROUND_CATCH_UP`` a timed round includes
(``adaptive.py`` weighs it against what drafting saves).

A shape's predicted rate is ``expected tokens per round / round`` (``draftcert.decode.shape``).

``engine_costs`` measures, on first use, the curve the engine's draft-shape choice needs (``measure``:
verification by rows and tree size, each candidate shape's drafting, the per-round work, the target
alone's step; median of interleaved repeats) and caches it as JSON under
``<cache_root>/costs/``, keyed by (CPU model, torch version, thread count, target fingerprint,
its numerics and the native kernels' builds, drafter); a cached curve whose recorded key differs from this machine's is never used.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
import torch

from ..._cache import cache_root
from ...criteria import Strict
from ...fileio import write_json
from ...kernels.linear_chooser import cpu_model
from ...forward import layer_kernel
from ...kernels import block_matmul, packed_matmul
from ...gguf.layers import numerics_of
from ...drafting.draft_vocab import vocabulary_of
from ...models.hf import forward_with_hidden, model_forward, vocab_size_of
from ..round import CERT_BATCH_ROWS, CertificateBatch, accept, record, verify
from ..stats import DecodeStats
from ...models.cache_state import CacheState
from ...models.tree_attention import DraftTree, crop_cache, keep_cache
from ...summary import argmax_lowest

__all__ = ["Costs", "ROUND_CATCH_UP", "CATCH_UP_TOKENS", "round_key", "round_seconds", "forward_count_costs", "tree_for", "overhead_inputs", "verify_and_keep", "chain_for",
           "round_work", "overhead_rounds", "EngineJobs", "time_interleaved", "measure", "rows_non_decreasing", "engine_costs",
           "costs_key", "COSTS_VERSION"]

COSTS_VERSION = 8  # 2: plain rounds and greedy steps without torch.argmax (summary.argmax_lowest); 3: certificates in
# batches; 4: a model drafter's catch-up per token (drafter_catch_up); 5: rounds that make no KV views or causal
# mask, copy certificate rows through numpy, and look suffix tails up only in outputs that hold them; 6: passes
# that keep their layer plans, rotary rows, layer table and embedding rows between calls; 7: one-row passes
# that stream the 32-weight block types' weights past the caches (block_matmul.c, Q8NTA); 8: the target's step
# and passes fitted non-decreasing in rows (rows_non_decreasing)
ROUND_CATCH_UP = 3  # tokens a timed drafting round's drafter catches up on first (the pending token, two accepted drafts)
CATCH_UP_TOKENS = 64  # the extra tokens the catch-up job runs a model drafter over


@dataclass
class Costs:
    source: str  # "calibrated" | "forward-count"
    target: dict[int, float]  # tokens verified (causal) -> seconds
    drafter: dict[int, float]
    target_tree: dict[int, float] = field(default_factory=dict)  # tokens verified with a tree mask -> seconds
    overhead: dict[int, float] = field(default_factory=dict)  # engine work per round besides forwards, by verify size
    target_prefill: float | None = None
    drafter_prefill: float | None = None
    # a model drafter's seconds per token of a catch-up (its run over tokens it has not seen: the prompt
    # before its first draft, a plain run's tokens before a probe) beyond a drafting round's own
    drafter_catch_up: float | None = None
    # one round's drafting timed whole, by shape prefix "w1,w2,...[|static]" (see round_key)
    drafter_round: dict[str, float] = field(default_factory=dict)
    feature: bool = False
    target_step: float | None = None  # the target alone, one greedy step (greedy_generate's loop body)
    context: int | None = None
    prompt_length: int | None = None
    repeats: int | None = None
    note: str = ""
    # why the timings cannot be trusted (a larger pass timed cheaper than a smaller one, repeats that
    # disagree); empty: no problem found.  A prediction from them is withheld (``draftcert.replay``).
    unreliable: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        d = asdict(self)
        for k in ("target", "drafter", "target_tree", "overhead"):
            d[k] = {str(n): v for n, v in sorted(d[k].items())}
        d["drafter_round"] = dict(sorted(d["drafter_round"].items()))
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Costs":
        try:
            kw = dict(d)
            for k in ("target", "drafter", "target_tree", "overhead"):
                kw[k] = {int(n): float(v) for n, v in (d.get(k) or {}).items()}
            kw["drafter_round"] = {str(n): float(v) for n, v in (d.get("drafter_round") or {}).items()}
            return cls(**kw)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"calibration: unreadable costs ({exc}); rerun `draftcert replay DIR --calibrate`") from None

    @staticmethod
    def _interp(table: dict[int, float], n: int) -> float:
        if not table:
            raise ValueError("calibration: no timings")
        if n in table:
            return table[n]
        xs = sorted(table)
        ys = [table[x] for x in xs]
        if len(xs) == 1:
            return ys[0]
        if n > xs[-1]:  # extrapolate with the slope of the two largest sizes
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return ys[-1] + max(slope, 0.0) * (n - xs[-1])
        return float(np.interp(n, xs, ys))

    def t(self, n: int, tree: bool = False) -> float:
        return self._interp(self.target_tree if tree and self.target_tree else self.target, n)

    def d(self, n: int) -> float:
        return self._interp(self.drafter, n)

    def o(self, n: int) -> float:
        return self._interp(self.overhead, n) if self.overhead else 0.0


def round_key(widths, expand_all: bool) -> str:
    return ",".join(map(str, widths)) + ("|static" if expand_all else "")


def round_seconds(costs: Costs, nodes: int, fronts: list[int], tree: bool, key: str) -> float:
    """One round's predicted seconds: ``T(1 + nodes) + O(1 + nodes) + drafting`` (module docstring).

    ``fronts``: tokens per drafter forward (empty: nothing drafted); ``tree``: verified with the tree
    mask; ``key``: the round's ``round_key`` (drafting timed whole, when ``costs.drafter_round`` has it).
    """
    n = 1 + nodes
    s = costs.t(n, tree and n > 1) + costs.o(n)
    if not fronts:
        return s
    if costs.drafter_round:
        if key not in costs.drafter_round:
            raise ValueError(f"calibration: no drafting time for draft shape {key}; `draftcert replay DIR --calibrate` "
                             "times every shape the replay and the report need")
        return s + costs.drafter_round[key]
    return s + sum(costs.d(f) for f in fronts)


def forward_count_costs(drafter_ratio: float) -> Costs:
    if not (drafter_ratio >= 0 and np.isfinite(drafter_ratio)):
        raise ValueError(f"drafter cost: expected a finite ratio >= 0 (drafter forward / target forward), got {drafter_ratio!r}")
    return Costs("forward-count", {1: 1.0}, {1: float(drafter_ratio)}, note=(
        f"forward-count model: every target forward costs 1, every drafter forward {drafter_ratio:g} "
        "(no calibration; run `draftcert replay DIR --calibrate` to time the models)"))


# ----------------------------------------------------------------------------- timed work


def tree_for(n_nodes: int) -> DraftTree:
    """A draft tree with ``n_nodes`` nodes (a width-n root fan: same tokens and mask size as any tree of n)."""
    t = DraftTree()
    for i in range(n_nodes):
        t.add(0, -1 if i == 0 else i - 1 if i % 2 else 0)
    return t


def overhead_inputs(n: int, V: int, g: torch.Generator, dtype=torch.float32):
    """(rule, logits, draft, summary k, stats): the engine's per-round work for a chain round
    verifying n rows (random logits: the certificate work covers every drafted row whatever
    is accepted)."""
    logits = (torch.randn(n, V, generator=g) * 3).to(dtype)  # [n, V]
    d = DraftTree()
    for i in range(n - 1):
        d.add(int(torch.randint(0, V, (1,), generator=g)), i - 1)
        d.expanded.append(i - 1)
        d.widths.append(1)
    d.q = (torch.randn(n - 1, V, generator=g) * 3).to(dtype) if n > 1 else None  # [n - 1, V]
    return Strict(), logits, d, 16, DecodeStats("strict", max(1, n - 1), None)


def verify_and_keep(target, tcache, ids: list[int], context: int, draft: DraftTree, feature: bool, tree: bool,
                    tstate: CacheState | None = None) -> None:
    """One timed verification as the engine runs it: the pending token ``ids[context]`` plus ``draft``
    after a ``context``-token cache, then the cache rolled back to what a typical round keeps (a
    chain's drafts but the last; a tree's first path, gathered into place).  With ``tstate`` (the
    target's ``state.CacheState``) a model with recurrent state is verified as the engine does
    (token by token where its layout says so) and rolled back by the caller's ``restore``."""
    layout = tstate.layout if tstate is not None else None
    verify(target, tcache, context, ids[context:context + 1], draft, feature, layout)
    if layout is not None and layout.stateful:
        return  # the rollback is the restore after the timed job (EngineJobs.rewind_target)
    n = len(draft.tokens)
    if not tree:
        keep_cache(tcache, context + 1, list(range(max(0, n - 1))))
    else:
        keep_cache(tcache, context + 1, [0, 2] if n > 2 else [0])


def chain_for(ids: list[int], context: int, n_rows: int) -> DraftTree:
    """The chain of ``n_rows - 1`` drafts ``ids[context + 1 :]`` (a verification pass of ``n_rows`` rows)."""
    chain = DraftTree()
    for i in range(n_rows - 1):
        chain.add(ids[context + 1 + i], i - 1)
    return chain


def overhead_rounds(n: int) -> int:
    """Rounds of n rows one timed ``("o", n)`` job runs: enough for one certificate batch
    (``round.CERT_BATCH_ROWS`` expanded rows), so a round's share of a batch's fixed cost is in O(n)."""
    return max(1, -(-CERT_BATCH_ROWS // (n - 1))) if n > 1 else 1


def round_work(rule, logits, draft, summary_k, stats) -> None:
    """The engine's per-round work besides the forwards, for ``overhead_rounds(n)`` rounds of n rows:
    accept -> record, each round's expanded rows into a ``CertificateBatch``, certified together at the
    end, as ``engine.decode_loop`` does; the caller divides the time by ``overhead_rounds(n)``."""
    batch = CertificateBatch(rule, summary_k, stats)
    for _ in range(overhead_rounds(len(draft) + 1)):
        verdict = accept(rule, logits, draft, summary_k)
        log = record(stats, draft, verdict, None)
        if draft.q is not None and draft.expanded:
            batch.add(verdict, draft, logits, log)
    batch.flush()


@dataclass
class EngineJobs:
    """The engine's timed jobs on one machine state (the target's cache holds ``context`` tokens of
    ``ids``), shared by ``measure`` and ``replay.speed.calibrate``: ``run(kind, n)`` runs job
    ``("t", n)`` a chain verification of n rows, ``("tt", n)`` the tree ``trees[n]``'s, ``("dr", key)``
    one drafting round of ``rounds[key] = (widths, expand_all)`` (``("dc", n)``: the one-token round,
    its drafter n tokens further behind, restored by the caller), ``("o", n)`` the per-round work
    ``work[n]``, ``("g", 1)`` the target alone's greedy step; it returns False for another kind."""
    target: object
    tcache: object
    ids: list
    context: int
    feature: bool
    drafter: object
    seq: list
    trees: dict
    rounds: dict
    work: dict
    tstate: CacheState | None = None  # the target's cache state, when tcache is its cache (recurrent state)

    def __post_init__(self):
        self._tpoint = self.tstate.checkpoint(self.context) if self.tstate is not None else None

    def run(self, kind, n) -> bool:
        if kind == "t":  # a chain's verification and rollback (the engine's verify + keep_cache)
            verify_and_keep(self.target, self.tcache, self.ids, self.context, chain_for(self.ids, self.context, n),
                            self.feature, tree=False, tstate=self.tstate)
        elif kind == "tt":  # a tree's: the kept path is gathered into place
            verify_and_keep(self.target, self.tcache, self.ids, self.context, self.trees[n], self.feature, tree=True,
                            tstate=self.tstate)
        elif kind == "dr":
            w, e = self.rounds[n]
            self.drafter.propose(self.seq, w, e)
            self.drafter.accept([])
        elif kind == "dc":  # a catch-up: the drafter was restored n tokens further back
            self.drafter.propose(self.seq, [1], False)
            self.drafter.accept([])
        elif kind == "o":
            round_work(*self.work[n])
        elif kind == "g":  # the target alone: greedy_generate's step
            argmax_lowest(model_forward(self.target, self.tcache, self.ids[self.context:self.context + 1], 1)[0])
        else:
            return False
        return True

    def rewind_target(self, kind) -> None:
        """After a timed job: the target's cache back to ``context`` tokens."""
        if kind in ("t", "tt", "g"):
            if self._tpoint is not None:
                self.tstate.restore(self._tpoint)
            else:
                crop_cache(self.tcache, self.context)


def time_interleaved(jobs: list, run: Callable, repeats: int, *, before: Callable | None = None,
                     after: Callable | None = None, on_progress: Callable[[int, int], None] | None = None,
                     samples: dict | None = None) -> dict:
    """The median seconds of ``run(job)`` for every job, timed in ``repeats + 1`` round-robin passes
    over ``jobs`` (load on a shared machine then hits every job alike), the first pass a warm-up that
    is dropped.  ``before(job)`` / ``after(job)`` run untimed around each (rewinding caches);
    ``on_progress(done, total)`` hears of every timed job; ``samples``, when given, receives every
    job's timed seconds per pass (``samples[job][r]``, r = 0 .. repeats - 1: the reliability checks)."""
    times: dict = {j: [] for j in jobs}
    total, done = (repeats + 1) * len(jobs), 0
    for rep in range(repeats + 1):
        for job in jobs:
            if before is not None:
                before(job)
            t0 = time.perf_counter()
            run(job)
            dt = time.perf_counter() - t0
            if after is not None:
                after(job)
            if rep:
                times[job].append(dt)
            done += 1
            if on_progress is not None:
                on_progress(done, total)
    if samples is not None:
        samples.update(times)
    return {j: statistics.median(v) for j, v in times.items()}


@torch.inference_mode()
def measure(target, drafter, shapes: list[tuple[tuple[int, ...], bool]], *, max_rows: int = 0, context: int = 128,
            repeats: int = 4, seed: int = 0, on_progress: Callable[[int, int], None] | None = None) -> Costs:
    """Time, on this machine, what a round of each draft shape costs the engine.

    ``drafter``: a drafter object (``make_drafter``'s: model, feature or prompt-lookup drafter);
    ``shapes``: (widths, expand_all) per candidate; chain verification is timed for 1..max(max_rows,
    largest chain) rows, tree verification (tree mask) for each tree's size, each shape's drafting
    whole (propose + accept after a rewind of the drafter's cache), a model drafter's catch-up (the
    one-token round with the drafter ``CATCH_UP_TOKENS`` tokens further behind: ``drafter_catch_up``,
    the extra seconds per token), the per-round work O(n) and the target alone's greedy step.  The target's cache holds ``context`` tokens; every job is
    interleaved round robin ``repeats`` times after one warm-up round (load on a shared machine
    then hits every size alike) and the median is kept.  ``on_progress(done, total)`` hears of
    every timed job.
    """
    if repeats < 1 or context < 3:
        raise ValueError("measure: repeats must be >= 1 and context >= 3")
    V = vocab_size_of(target)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, min(V, 256), (context + 64,), generator=g).tolist()
    seq = ids[: context + 1]
    feature = drafter.needs_target_hidden
    tstate = CacheState(target)
    tcache = tstate.cache
    drafter.start(seq[:-1])
    if feature:
        _, hidden = forward_with_hidden(target, tcache, ids[:context], 1)
        drafter.observe(hidden)
    else:
        model_forward(target, tcache, ids[:context], 1)
    rewind = context + 1 - ROUND_CATCH_UP  # each timed drafting round catches up over these, as after an accepted draft
    cached = drafter.model_drafter  # the part that keeps a KV cache (the drafter itself, or a hybrid's model drafter)
    point = early = None
    behind = min(CATCH_UP_TOKENS, rewind - 1)
    if hasattr(cached, "checkpoint"):  # a model drafter: its cache at the rewind point, restored before each round
        if behind >= 8:  # ... and ``behind`` tokens further back, for the catch-up job
            drafter.propose(seq[:rewind - behind], [1])
            drafter.accept([])
            early = cached.checkpoint()
        drafter.propose(seq[:rewind], [1])
        drafter.accept([])
        point = cached.checkpoint()
    else:
        drafter.propose(seq, [1])  # the catch-up over the context, once
        drafter.accept([])
    chains = {1, max_rows} | {1 + sum(w) for w, e in shapes if max(w) == 1 and not e}
    chains = set(range(1, max(chains) + 1))
    trees = sorted({1 + _nodes(w, e) for w, e in shapes if max(w) > 1 or e})
    rounds = {round_key(w, e): (list(w), e) for w, e in shapes}
    jobs = [("t", n) for n in sorted(chains)] + [("tt", n) for n in trees] + [("dr", r) for r in rounds]
    jobs += [("dc", behind)] if early is not None and "1" in rounds else []
    jobs += [("o", n) for n in sorted(chains | set(trees))] + [("g", 1)]
    work = {n: overhead_inputs(n, V, g, next(target.parameters()).dtype) for n in sorted(chains | set(trees))}
    tree_drafts = {n: tree_for(n - 1) for n in trees}

    def before(job):
        if job[0] == "dc":
            cached.restore(early)
        elif job[0] == "dr" and point is not None:
            cached.restore(point)
        elif job[0] == "dr" and cached is not None:
            crop_cache(cached.cache, rewind)
            cached.n_valid = rewind

    engine = EngineJobs(target, tcache, ids, context, feature, drafter, seq, tree_drafts, rounds, work, tstate)
    run = lambda job: engine.run(*job)  # noqa: E731
    after = lambda job: engine.rewind_target(job[0])  # noqa: E731
    med = time_interleaved(jobs, run, repeats, before=before, after=after, on_progress=on_progress)
    step, target = rows_non_decreasing(med[("g", 1)], {n: med[("t", n)] for n in sorted(chains)})
    return Costs(
        "calibrated",
        target=target,
        drafter={1: med[("dr", "1")]} if "1" in rounds else {1: 0.0},
        drafter_round={r: med[("dr", r)] for r in rounds}, feature=feature, target_step=step,
        drafter_catch_up=max(0.0, med[("dc", behind)] - med[("dr", "1")]) / behind if ("dc", behind) in med else None,
        target_tree={n: med[("tt", n)] for n in trees},
        overhead={n: med[("o", n)] / overhead_rounds(n) for n in sorted(chains | set(trees))},
        context=context, repeats=repeats,
        note=f"timed on this machine: median of {repeats} interleaved repeats, cached context {context}; the "
             "target's step and passes fitted non-decreasing in rows",
    )


def rows_non_decreasing(step: float, passes: dict[int, float]) -> tuple[float, dict[int, float]]:
    """The target alone's step and its verification passes by rows, fitted to costs that never fall as
    rows are added: the least-squares non-decreasing sequence (pool adjacent violators) over
    ``[step, passes[n] for n increasing]``.  A greedy step does what a one-row verification does, and a
    pass of more rows does more; timings that say otherwise are noise (this VM timed a greedy step at
    8.8 ms and a 2-row pass at 6.9 ms in one curve, which made every draft look free to ``-k auto``),
    and pooling the violators keeps their mean."""
    sizes = sorted(passes)
    blocks: list[list[float]] = []  # [sum, count] of pooled runs
    for v in [step, *(passes[n] for n in sizes)]:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted = [b[0] / b[1] for b in blocks for _ in range(b[1])]
    return fitted[0], dict(zip(sizes, fitted[1:]))


def _nodes(widths, expand_all: bool) -> int:
    if not expand_all:
        return sum(widths)
    n, level = 0, 1
    for w in widths:
        level *= w
        n += level
    return n


# ----------------------------------------------------------------------------- the cache


def _fingerprint(model) -> str:
    """A cheap identity of a model's weights: config, parameter shapes and a sample of each one's values."""
    h = hashlib.sha256()
    cfg = getattr(model, "config", None)
    h.update((cfg.to_json_string(use_diff=False) if hasattr(cfg, "to_json_string") else type(model).__name__).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            h.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
            h.update(p.detach().reshape(-1)[:64].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def costs_key(target, drafter, drafter_name: str, shapes) -> dict:
    """What a cached curve is valid for: this CPU, torch build, thread count, target (and the numerics
    and native kernel builds it runs on: a rebuilt kernel has other costs), drafter and shapes."""
    dmodel = getattr(drafter, "model", None)
    return {"cpu": cpu_model(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "target": _fingerprint(target), "numerics": numerics_of(target),
            "kernels": [block_matmul.LIBRARY.build_id(), packed_matmul.LIBRARY.build_id(), layer_kernel.LIBRARY.build_id()],
            "drafter": drafter_name,
            "drafter_weights": _fingerprint(dmodel) if isinstance(dmodel, torch.nn.Module) else None,
            "draft_vocab": getattr(vocabulary_of(drafter), "key", None),  # part of the output layer costs less
            "shapes": sorted(round_key(w, e) for w, e in shapes), "version": COSTS_VERSION}


def costs_path(key: dict):
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "costs" / f"{digest}.json"


def cached_costs(key: dict) -> Costs | None:
    """The curve cached for exactly ``key``, else None (another machine's, build's, thread count's,
    model's or drafter's curve, or a damaged file, is never used)."""
    try:
        rec = json.loads(costs_path(key).read_text())
        if not isinstance(rec, dict) or rec.get("key") != key:
            return None
        return Costs.from_dict(rec["costs"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def engine_costs(target, drafter, drafter_name: str, shapes, *, max_rows: int = 0, use_cache: bool = True,
                 repeats: int = 4, on_note: Callable[[str], None] | None = None) -> tuple[Costs, str]:
    """(the cost curve, where it came from: "measured now in S s, cached at PATH" / "cached at PATH").

    ``drafter``: a drafter object; ``drafter_name``: its spec (part of the cache key).  Measured
    (``measure``) on a fork of the drafter, so ``drafter``'s own state is left alone.
    """
    key = costs_key(target, drafter, drafter_name, shapes)
    path = costs_path(key)
    if use_cache and (got := cached_costs(key)) is not None:
        return got, f"cached at {path}"
    if on_note is not None:
        on_note(f"measuring this machine's decoding cost curve (once per machine, model, drafter and thread "
                f"count; cached in {path.parent})")
    t0 = time.perf_counter()
    src = drafter.fork() or drafter
    costs = measure(target, src, list(shapes), max_rows=max_rows, repeats=repeats)
    sec = time.perf_counter() - t0
    if not use_cache:
        return costs, f"measured now in {sec:.1f} s"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"key": key, "costs": costs.as_dict(), "seconds": sec})
    except OSError:  # a read-only cache: the curve holds for this run only
        return costs, f"measured now in {sec:.1f} s (not cached: {path.parent} is not writable)"
    return costs, f"measured now in {sec:.1f} s, cached at {path}"
