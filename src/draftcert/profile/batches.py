"""The batch loop of a profile run: decode a batch, certify its steps, write its shard.

For each chunk of prompts (planned by ``run.profile``: longest first, fixed size):

1. :class:`~draftcert.profile.greedy_steps.GreedyRun` decodes the batch with a KV cache; each
   step's target logits are summarised on the spot (``StepCertifier.summarize_step``) and
   kept as a :class:`PendingStep` (rows, position, tokens, summary);
2. without a drafter, pending steps are certified as soon as about ``GROUP_ELEMENTS`` logits
   have piled up; with a drafter, after one teacher-forced pass of the drafter over the whole
   batch (a feature drafter also rolls out its own drafts, ``profile/rollout.py``), group by
   group, each group's drafter logits gathered at once;
3. the batch's rows become one Parquet shard named ``rank{r}-{first prompt index}.parquet``
   (written atomically), its soundness violations (certified but rejected) are counted and
   announced in red, and ``on_batch`` hears of it.

:class:`BatchContext` holds what stays fixed over a run's batches; :func:`trace_stats`
totals a set of shards (every shard on rank 0, a rank's own otherwise).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from ..fileio import remove_stale_temporaries
from ..models.hf import eos_token_ids, pad_token_id
from ..prompts import Prompt
from ..summary import Summary
from ..tracefile import accepted_column, certified_column, list_shards, radius_column, shard_name, trace_schema, write_shard
from .distributed import DistInfo
from .greedy_steps import GreedyRun, StepTimer, score_teacher_forced
from .rollout import score_feature_drafter
from .trace import BatchTrace, StepCertifier, StepRows

__all__ = ["BatchContext", "BatchTotals", "PendingStep", "GROUP_ELEMENTS", "run_batches", "trace_stats", "RED", "RESET"]

RED, RESET = "\033[1;91m", "\033[0m"
# Logits (rows x vocabulary) certified at once: the radii and drafter columns cost mostly
# per call (dozens of small torch operations per rule), so a group amortises them over its
# rows (on the Qwen pair, V = 151,936, about 55 steps a group instead of 13), while its float32
# copies (the group's target and drafter logits) stay ~32 MiB each.
GROUP_ELEMENTS = 1 << 23


@dataclass(frozen=True)
class BatchContext:
    """What stays fixed over the batches of one run (on one rank)."""

    model: torch.nn.Module  # the target, in eval mode on this rank's device
    tokenizer: Any  # for EOS and pad ids; may be None
    drafter: torch.nn.Module | None  # None: radii only
    certifier: StepCertifier  # the run's criteria and divergences
    out: Path  # the run directory; shards go to out/trace
    settings_sha: str  # the hash every shard carries (settings.settings_sha)
    info: DistInfo  # this rank
    max_new_tokens: int
    timer: StepTimer
    rollout: tuple[int, int] | None = None  # (depth, top-m) of a feature drafter's rollouts, else None
    progress: bool = True  # a progress bar on rank 0
    on_batch: Callable[[dict], None] | None = None  # told of each shard written
    stop_requested: Callable[[], bool] | None = None  # True: stop (KeyboardInterrupt) once a batch is written

    @property
    def specs(self) -> list[str]:
        return [c.spec for c in self.certifier.criteria]


@dataclass
class PendingStep:
    """One decoding step of a batch: summarised, not yet certified nor in the trace."""

    rows: torch.Tensor  # [n] batch rows still decoding at this step
    position: int  # t: these rows' tokens are continuation[t]
    tokens: torch.Tensor  # [n] the target's greedy tokens
    summary: Summary  # [n] the target's next-token distributions, summarised
    nonfinite: torch.Tensor  # [n] bool: non-finite target logits


@dataclass
class BatchTotals:
    """What this invocation added on this rank; ``stats`` (``trace_stats`` of this rank's
    shards) only on ranks other than 0, which totals every shard after the barrier instead."""

    new_prompts: int
    new_steps: int
    stats: dict[str, Any] | None


def run_batches(ctx: BatchContext, prompts: Sequence[Prompt], chunks: Sequence[Sequence[int]],
                encoded: dict[int, list[int]], n_mine: int) -> BatchTotals:
    """Profile ``chunks`` (lists of indices into ``prompts``, each one batch and one shard).

    ``encoded[i]`` holds prompt i's token ids; ``n_mine`` counts this rank's prompts, done
    ones included (for the progress bar)."""
    from tqdm.auto import tqdm  # optional: models extra

    out, info, timer, draft = ctx.out, ctx.info, ctx.timer, ctx.drafter
    # A killed run can leave a half-written temporary shard (never a half-written shard:
    # fileio writes atomically).  Remove this rank's leftovers.
    remove_stale_temporaries(out / "trace", f"rank{info.rank}-*")
    schema = trace_schema(ctx.certifier.criteria, ctx.certifier.divergences, draft is not None, ctx.rollout)
    eos = eos_token_ids(ctx.model, ctx.tokenizer)
    pad = pad_token_id(ctx.tokenizer, ctx.model)
    specs = ctx.specs
    n_done_mine = n_mine - sum(len(c) for c in chunks)  # chunks hold only the prompts still to do
    # The bar counts decode steps (one token of one prompt), at most max_new_tokens per prompt: a
    # batch takes minutes, so a bar of prompts or batches would sit still and then jump.  A prompt
    # that ends early (EOS) is topped up to its full share when its batch is written.
    per_prompt = ctx.max_new_tokens
    bar = tqdm(total=n_mine * per_prompt, initial=n_done_mine * per_prompt, unit="tok",
               desc=f"profile[{info.rank}]" if info.world_size > 1 else "profile",
               disable=not (ctx.progress and info.is_main), dynamic_ncols=True, file=sys.stderr)
    bar.set_postfix_str(f"prompts {n_done_mine}/{n_mine}")
    new_prompts = new_steps = 0
    t0 = time.perf_counter()
    try:
        for chunk in chunks:
            ids = [encoded[i] for i in chunk]
            pids = [prompts[i].id for i in chunk]
            batch = BatchTrace(pids, schema)
            gen = GreedyRun(ctx.model, ids, ctx.max_new_tokens, eos, pad_id=pad, timer=timer)
            start = bar.n
            pending = _decode(ctx, batch, gen, bar)
            if draft is not None:
                bar.set_postfix_str(f"prompts {n_done_mine + new_prompts}/{n_mine}, scoring the drafter")
                _certify_drafter(ctx, batch, pending, ids, gen.continuations, pad)
            del pending
            with timer.section("trace"):
                with timer.section("trace.table"):
                    table = batch.to_table()
                name = shard_name(info.rank, chunk[0])
                with timer.section("trace.write"):
                    write_shard(table, out / "trace" / name, pids, ctx.settings_sha)
                # counting soundness violations reads the certificate columns: trace work too
                with timer.section("trace.violations"):
                    viol = _violations(table, specs) if draft is not None else {}
            new_prompts += len(chunk)
            new_steps += table.num_rows
            bar.update(start + len(chunk) * per_prompt - bar.n)  # the steps its EOS-ended prompts did not take
            el = time.perf_counter() - t0
            bar.set_postfix_str(f"prompts {n_done_mine + new_prompts}/{n_mine}, {new_steps / el:.1f} tok/s" if el > 0 else "")
            if ctx.on_batch is not None:
                ctx.on_batch({"shard": out / "trace" / name, "prompt_ids": pids, "steps": table.num_rows,
                              "violations": viol})
            if ctx.stop_requested is not None and ctx.stop_requested():
                raise KeyboardInterrupt("stopped after a batch (Ctrl-C)")  # its shard is written: kept
    finally:
        bar.close()
    # this rank's totals (rank 0 computes them over every shard after the barrier instead)
    stats = None
    if not info.is_main:
        with timer.section("trace"), timer.section("trace.stats"):
            stats = trace_stats(list_shards(out / "trace", rank=info.rank), specs, draft is not None)
    return BatchTotals(new_prompts, new_steps, stats)


def _decode(ctx: BatchContext, batch: BatchTrace, gen: GreedyRun, bar) -> list[PendingStep]:
    """Decode the batch, summarising every step.  Without a drafter the radii need the target
    alone: steps are certified into ``batch`` as they pile up and nothing is returned; with
    one, the steps are returned pending, for the drafter's pass over the continuations."""
    timer, certifier = ctx.timer, ctx.certifier
    pending: list[PendingStep] = []
    for t, logits, rows, tokens in gen.steps():
        bar.update(int(rows.shape[0]))  # one token for each still-active prompt
        with timer.section("certificate"), timer.section("certificate.target"):
            summ, bad = certifier.summarize_step(logits)
            pending.append(PendingStep(rows, t, tokens, summ, bad))
            if ctx.drafter is None and sum(p.rows.shape[0] for p in pending) * logits.shape[-1] >= GROUP_ELEMENTS:
                _flush(certifier, pending, batch)
                pending = []
    if ctx.drafter is None:
        with timer.section("certificate"), timer.section("certificate.target"):
            _flush(certifier, pending, batch)
        return []
    return pending


def _certify_drafter(ctx: BatchContext, batch: BatchTrace, pending: list[PendingStep],
                     prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], pad: int) -> None:
    """Score the drafter along the target's continuations, then certify the pending steps."""
    draft, timer, rollout = ctx.drafter, ctx.timer, ctx.rollout
    if rollout is None:
        dlogits, index = score_teacher_forced(draft, prompts, continuations, pad_id=pad, timer=timer)
    else:
        dlogits, index, r_ids, r_gap = score_feature_drafter(
            draft, prompts, continuations, pad_id=pad, depth=rollout[0], width=rollout[1], timer=timer)
    # dlogits [B, T_max, V]: row b's step t sits at [b, index[b] + t]
    with timer.section("certificate"), timer.section("certificate.draft"):
        for group in _groups(pending, dlogits.shape[-1]):
            r = torch.cat([s.rows for s in group])
            c = torch.cat([index[s.rows] + s.position for s in group])
            d = dlogits[r, c]  # one gather: [rows of the group, V]
            _flush(ctx.certifier, group, batch, d, None if rollout is None else (r_ids[r, c], r_gap[r, c]))
    del dlogits


def _flush(certifier: StepCertifier, steps: Sequence[PendingStep], batch: BatchTrace,
           draft_logits: torch.Tensor | None = None, rollout=None) -> None:
    """Certificates for a group of pending steps, added to the batch's trace."""
    if not steps:
        return
    cols = certifier.rows([s.summary for s in steps], [s.nonfinite for s in steps], draft_logits, rollout)
    rows = torch.cat([s.rows for s in steps])
    pos = torch.cat([torch.full_like(s.rows, s.position) for s in steps])
    tokens = torch.cat([s.tokens for s in steps])
    batch.add(StepRows(rows, pos, tokens, cols))


def _groups(pending: Sequence[PendingStep], vocab: int) -> Iterator[list[PendingStep]]:
    """Consecutive steps grouped so that each group holds about GROUP_ELEMENTS logits."""
    group, n = [], 0
    for step in pending:
        group.append(step)
        n += step.rows.shape[0] * vocab
        if n >= GROUP_ELEMENTS:
            yield group
            group, n = [], 0
    if group:
        yield group


def _violations(table, specs: Sequence[str]) -> dict[str, int]:
    """Count certified-but-rejected steps in a shard and say so loudly: a violation is a bug."""
    out = {}
    for c in specs:
        cert = table.column(certified_column(c)).to_numpy(zero_copy_only=False)
        acc = table.column(accepted_column(c)).to_numpy(zero_copy_only=False)
        bad = np.nonzero(cert & ~acc)[0]
        out[c] = int(bad.shape[0])
        if bad.shape[0]:
            i = int(bad[0])
            pid = table.column("prompt_id")[i].as_py()
            pos = table.column("position")[i].as_py()
            kl = table.column("kl_forward")[i].as_py()
            r = table.column(radius_column(c))[i].as_py()
            print(f"{RED}SOUNDNESS VIOLATION: {c}: {bad.shape[0]} step(s) certified but rejected "
                  f"(first: prompt {pid!r} position {pos}: KL(p||q) = {kl!r} < radius = {r!r}). "
                  f"This is a bug in draftcert.{RESET}", file=sys.stderr)
    return out


def trace_stats(shards: Sequence[Path], criteria: Sequence[str], with_drafter: bool) -> dict[str, Any]:
    """Totals over the given shards (rank 0 passes every shard: all ranks, all resumed runs):
    steps, prompts, nonfinite_steps, soundness_violations and violations_by_criterion."""
    import pyarrow.parquet as pq  # optional: models extra

    steps = nonfinite = 0
    prompt_ids: set[str] = set()
    viol = {c: 0 for c in criteria} if with_drafter else {}
    for path in shards:
        cols = ["prompt_id", "nonfinite"]
        if with_drafter:
            cols += [accepted_column(c) for c in criteria] + [certified_column(c) for c in criteria]
        # ParquetFile.read, not pq.read_table: the latter's first call spends ~40 ms setting up
        # pyarrow.dataset, which a single-file read does not need
        t = pq.ParquetFile(path).read(columns=cols)
        steps += t.num_rows
        # a Python set, not Array.unique(): its first call spends ~50 ms initialising pyarrow.compute
        prompt_ids.update(t.column("prompt_id").to_pylist())
        nonfinite += int(np.count_nonzero(t.column("nonfinite").to_numpy()))
        for c in viol:
            cert = t.column(certified_column(c)).to_numpy(zero_copy_only=False)
            acc = t.column(accepted_column(c)).to_numpy(zero_copy_only=False)
            viol[c] += int(np.count_nonzero(cert & ~acc))
    return {"steps": steps, "prompts": len(prompt_ids), "nonfinite_steps": nonfinite,
            "soundness_violations": sum(viol.values()), "violations_by_criterion": viol}
