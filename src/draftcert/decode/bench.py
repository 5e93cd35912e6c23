"""Timed decodes: one decode against the target alone (``timed_generate``, ``draftcert decode
--baseline``), and ``draftcert bench``'s table of several criteria on the same prompts, one row each.

Every timing runs its candidates in turns (A B, B A, ...: ``timing.interleave``), so that a busy
spell of a shared machine slows each alike; a figure is the median of its repeats.

A row is the ``DecodeStats`` of every prompt's decode merged (``DecodeStats.merge``), so
its figures are totals over the prompts, not means of per-prompt figures: tokens per
forward = all emitted tokens / all target forwards, and so on (``stats.py``; every name and
definition: docs/metrics.md).
"""

from __future__ import annotations

import textwrap
import time
from dataclasses import replace
from functools import reduce

from ..criteria import DEFAULT_CRITERIA, TreeCoverage, parse_criterion
from ..textfit import markdown_tables
from .engine import DecodeResult, decode_loop, greedy_generate, prepare_decode, speculative_generate
from .stats import DecodeStats
from .timing import SPREAD_LIMIT, interleave, median_or_none

__all__ = ["timed_generate", "DEFAULT_BENCH_SPECS", "TARGET_ALONE", "bench_rows", "bench_row", "target_alone_row",
           "format_table", "format_positions", "timing_footnote"]

TARGET_ALONE = "target alone"  # the criterion cell of the row timing the target's own greedy decoding


def timed_generate(target, drafter, input_ids, criterion="strict", k: int | str = 4, tree=None,
                   max_new_tokens: int = 64, *, baseline: bool = False, repeats: int = 1, eos_token_id=None,
                   certificates: bool = True, tokenizer=None, on_round=None, stop=None,
                   draft_length=None, draft_margin: float | None = None) -> DecodeResult:
    """``speculative_generate`` (same arguments) timed ``repeats`` times, and with ``baseline`` the
    target's own greedy decoding of the same prompt and length timed in turns with it (decode,
    baseline, baseline, decode, ...).  ``stats.seconds`` / ``baseline_seconds`` are medians,
    ``stats.timing_reliable`` is False when the repeats disagree by more than 20 %, ``stats.speedup``
    and ``stats.baseline_match`` compare the two.  Only the first decode streams (``on_round``).
    ``draft_length``: ``engine.auto_draft``'s factory, with ``k`` its longest chain (``k="auto"`` does both)."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats: expected an integer >= 1, got {repeats!r}")
    prompt, draft_src, config = prepare_decode(target, drafter, input_ids, criterion, k, tree, max_new_tokens,
                                               eos_token_id=eos_token_id, certificates=certificates,
                                               tokenizer=tokenizer, on_round=on_round, stop=stop,
                                               draft_length=draft_length, draft_margin=draft_margin)
    quiet = replace(config, on_round=None)
    first: dict = {}
    base: list[int] = []

    def spec_run() -> float:  # the streamed decode is the first timed repeat; the rest emit the same tokens
        t0 = time.perf_counter()
        out, stats = decode_loop(target, draft_src, prompt, quiet if first else config)
        seconds = time.perf_counter() - t0
        first.setdefault("result", (out, stats))
        return seconds

    def base_run() -> float:
        t0 = time.perf_counter()
        base[:] = greedy_generate(target, prompt, max_new_tokens, eos_token_id=eos_token_id)
        return time.perf_counter() - t0

    times = interleave([spec_run, base_run] if baseline else [spec_run], repeats)
    out, stats = first["result"]
    stats.repeat_seconds = times[0]
    stats.seconds = median_or_none(times[0])
    if baseline:
        stats.baseline_repeat_seconds = times[1]
        stats.baseline_seconds = median_or_none(times[1])
        stats.baseline_tokens = len(base)
        stats.baseline_match = base == out
    return DecodeResult(tokens=out, stats=stats, baseline_tokens=list(base) if baseline else None)


# tree:8 drafts 8 children per level: too slow for a quick table
DEFAULT_BENCH_SPECS = [s for s in DEFAULT_CRITERIA if s != "tree:8"]


def bench_rows(target, drafter, prompts_ids, specs, k, max_new_tokens, tokenizer=None, on_run=None,
               repeats: int = 1, target_alone: bool = False, draft_margin: float | None = None) -> list[dict]:
    """One row per criterion spec over the given prompts (``tree:M`` -> a width-M tree of depth k).

    Each criterion's decodes of all the prompts are timed ``repeats`` times, the criteria taking
    turns (A B C, C B A, ...: ``timing.interleave``), so that a busy spell of a shared machine
    slows every row alike; a row's tokens/s is the median over the repeats, and its
    ``timing_reliable`` is False when they disagree by more than 20 %.  The counters come
    from the first repeat (greedy decoding: every repeat emits the same tokens).
    ``target_alone``: a first row (``target_alone_row``) timing the target's own greedy decoding of
    the same prompts (``engine.greedy_generate``, what ``decode --baseline`` times), taking its turns
    with the criteria.  ``on_run(spec)`` is called after each decode (progress; ``TARGET_ALONE`` for
    the target alone's)."""
    first: dict[str, DecodeStats] = {}
    emitted = []

    def base_run() -> float:  # the target alone on all the prompts: the summed decode seconds
        seconds, n = 0.0, 0
        for ids in prompts_ids:
            t0 = time.perf_counter()
            n += len(greedy_generate(target, ids, max_new_tokens))  # as decode --baseline times it
            seconds += time.perf_counter() - t0
            if on_run is not None:
                on_run(TARGET_ALONE)
        emitted.append(n)
        return seconds

    def run_of(spec):
        crit = parse_criterion(spec)
        tree = (crit.m, k) if isinstance(crit, TreeCoverage) else None

        def run() -> float:  # all the prompts under one criterion: the summed decode seconds
            runs = []
            for ids in prompts_ids:
                runs.append(speculative_generate(target, drafter, ids, crit, k=k, tree=tree, max_new_tokens=max_new_tokens,
                                                 tokenizer=tokenizer, draft_margin=draft_margin).stats)
                if on_run is not None:
                    on_run(spec)
            st = reduce(DecodeStats.merge, runs)
            first.setdefault(spec, st)
            return st.seconds
        return run

    runs = ([base_run] if target_alone else []) + [run_of(spec) for spec in specs]
    times = interleave(runs, repeats)
    rows = [target_alone_row(emitted[0], times.pop(0))] if target_alone else []
    for spec, seconds in zip(specs, times):
        st = first[spec]
        st.repeat_seconds = seconds
        rows.append(bench_row(st, f"chain k={k}" if st.tree is None else f"tree m={st.tree[0]}, depth={k}"))
    return rows


def target_alone_row(emitted: int, repeat_seconds: list[float]) -> dict:
    """The bench row of the target's own greedy decoding (the keys of every row): ``emitted`` tokens in
    one target forward each, timed ``repeat_seconds`` (per repeat, all prompts); no drafts, so no
    acceptance figures (null, zero or empty) and no certificates."""
    st = DecodeStats(TARGET_ALONE, 0, None, num_rounds=emitted, emitted=emitted)
    st.repeat_seconds = list(repeat_seconds)
    return bench_row(st, "none")


def bench_row(st: DecodeStats, draft: str) -> dict:
    """The figures of one bench row (JSON-ready; the names of ``decode --json``, docs/metrics.md),
    ``draft`` naming the draft shape."""
    return {
        "criterion": st.criterion,
        "draft": draft,
        **st.acceptance_metrics(),
        "certified_fraction": st.certified_fraction,
        "tokens_per_second": st.tokens_per_second,  # the median over the repeats
        "repeats": len(st.repeat_seconds),
        "timing_spread": st.timing_spread,  # (max - min) / median of the repeats' tokens/s; null: one timing
        "timing_reliable": st.timing_reliable,  # false: the repeats disagree by > 20 %; null: one timing
    }


def _rates(rates) -> str:
    return " ".join("-" if a is None else f"{a:.2f}" for a in rates)


def format_positions(rows) -> str:
    """Per criterion: vLLM's acceptance rate per position 1, 2, ... (accepted there / drafts), the
    conditional one (accepted / attempted there) and the accepted-tokens histogram, one block each
    (short lines: a terminal of 80 columns).  Positions run to k, or deeper where suffix-match
    candidates drafted deeper than the model (bench's header says so)."""
    blocks = [("acceptance_rate_per_pos 1, 2, ... (accepted at the position / drafts):",
               lambda r: _rates(r["acceptance_rate_per_pos"])),
              ("conditional_acceptance_rate_per_pos 1, 2, ... (accepted / attempted there):",
               lambda r: _rates(r["conditional_acceptance_rate_per_pos"])),
              ("accepted_tokens_histogram (drafts accepting 0, 1, 2, ... tokens):",
               lambda r: " ".join(map(str, r["accepted_tokens_histogram"])))]
    lines = []
    rows = [r for r in rows if r["criterion"] != TARGET_ALONE]  # no drafts: nothing by position
    for head, cells in blocks:
        lines.append(head)
        lines += [f"  {r['criterion']}: {cells(r)}" for r in rows]
    return "\n".join(lines)


_BENCH_HEAD = ["criterion", "draft", "tokens/forward", "mean acceptance length", "drift", "certified", "tokens/s"]
_BENCH_HEAD_SHORT = ["criterion", "draft", "tok/fwd", "mean acc len", "drift", "certified", "tok/s"]


def _bench_cells(r) -> list[str]:
    cert = "n/a" if r["certified_fraction"] is None else f"{r['certified_fraction']:.3f}"
    mal = "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
    return [r["criterion"], r["draft"], f"{r['tokens_per_forward']:.2f}", mal,
            f"{r['drift']:.3f}", cert, f"{r['tokens_per_second']:.2f}" + ("*" if r.get("timing_reliable") is False else "")]


def timing_footnote(rows, width: int | None = None) -> str:
    """The lines under the table saying how the tokens/s were timed and which ones to distrust,
    folded to ``width`` columns (default 80)."""
    n = max((r.get("repeats", 1) for r in rows), default=1)
    if n < 2:
        line = "tokens/s: one timing each (--repeats 3: medians of runs in turns, checked to agree)"
    else:
        bad = [r["criterion"] for r in rows if r.get("timing_reliable") is False]
        line = f"tokens/s: median of {n} repeats, the criteria timed in turns"
        if bad:
            line += (f"; * UNRELIABLE ({', '.join(bad)}): the repeats disagree by more than {SPREAD_LIMIT:.0%} "
                     "(a busy machine?); rerun when it is idle, or with more --repeats")
    return textwrap.fill(line, width or 80, break_on_hyphens=False, break_long_words=False)


def format_table(rows, width: int | None = None) -> str:
    """The bench rows as a markdown table.  ``width=None``: one unpadded table (as pasted into
    docs/decoding.md).  With a width: padded columns, short headers when the long ones do not fit,
    and the columns split over stacked tables when even that is wider (no cell is ever cut)."""
    if width is None:
        lines = ["| " + " | ".join(_BENCH_HEAD) + " |", "|---|---|---:|---:|---:|---:|---:|"]
        lines += ["| " + " | ".join(_bench_cells(r)) + " |" for r in rows]
        return "\n".join(lines)
    cells = [_bench_cells(r) for r in rows]
    align = ["l", "l"] + ["r"] * 5
    text = markdown_tables(_BENCH_HEAD, cells, None, align)
    if max(map(len, text.splitlines())) <= width:
        return text
    return markdown_tables(_BENCH_HEAD_SHORT, cells, width, align)
