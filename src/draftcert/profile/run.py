"""``draftcert.profile.profile``: certificate traces of a target (and drafter) on a prompt set.

This module orchestrates a run; the work lives beside it:

- ``settings.py``: options, prompts, the settings hash, resume checks, ``run.json``;
- ``batches.py``: the batch loop (decode, certify, one Parquet shard per batch);
- ``distributed.py``: the torchrun process group (each rank its own prompts and shards).

Pipeline per batch of prompts (see generate.py and trace.py):

1. batched greedy decoding of the target with a KV cache; every step's logits
   are summarised on the spot (``StepCertifier.summarize_step``: top-64, entropy,
   normaliser) and the radii of all criteria follow from groups of these
   summaries (``StepCertifier.rows``);
2. with a drafter: one teacher-forced forward pass of the drafter over
   prompt + the target's continuation, then divergences, acceptance and
   certificates for the same rows (``StepCertifier.rows(..., draft_logits)``);
3. the batch's rows go to one Parquet shard, written atomically.

Resume: shards record the prompt ids they hold and the hash of the settings;
rerunning the same command skips every prompt already in a shard.  Ctrl-C while
batches run lets the batch in flight finish and be written, then stops (``StopAfterBatch``; a
second Ctrl-C, SIGTERM or a kill stop at once and lose at most the batch in flight).  ``run.json`` holds the
settings and a ``status`` (running, complete, interrupted on Ctrl-C/SIGTERM,
failed); a rerun with different trace-affecting settings is refused.

Extend: a rerun with a larger ``limit`` (or the same file with prompts
appended) keeps every shard and profiles only the new prompts, provided the
prompts already traced are exactly the first ones of the new prompt set.  Each
run plans its batches (longest prompts first) over the prompts still to do, so
a resumed run reproduces an uninterrupted one batch for batch.

The report (``draftcert.report``, one layer up) is not written here: ``draftcert profile``
writes it once ``profile`` returns; a library caller runs ``draftcert.report.write_report``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from ..certificates import DEFAULT_EPSILONS
from ..criteria import DEFAULT_CRITERIA
from ..models import ModelUnavailable, check_compatible, load_drafter, load_target
from ..models.hf import module_states, parse_dtype
from ..gguf.layers import numerics_of
from ..models.loading import fetch_pair_downloads, transformers_progress
from ..prompts import encode_prompt
from ..tracefile import list_shards
from . import distributed as dist_mod
from .batches import RED, RESET, BatchContext, run_batches, trace_stats
from .greedy_steps import StepTimer
from .rollout import is_feature_model
from .settings import (
    RunRecord,
    check_out_dir,
    check_resume,
    check_resume_numerics,
    done_prompts,
    mark_stopped,
    parse_criteria,
    parse_divergences,
    parse_epsilons,
    resolve_prompts,
    settings_sha,
    trace_settings,
)
from .trace import StepCertifier

__all__ = ["profile", "ProfileResult", "Terminated", "StopAfterBatch"]


class _PeerFailed(RuntimeError):
    """Another rank reported a failure through a collective."""


class Terminated(KeyboardInterrupt):
    """SIGTERM during a profile run: stops it like Ctrl-C (finished shards kept, run.json
    marked "interrupted"); rerunning the same command resumes."""


def _on_sigterm(signum, frame):
    raise Terminated("terminated (SIGTERM)")


def _restore_sigterm(old) -> None:
    if old is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, old)


class StopAfterBatch:
    """Ctrl-C while batches run: the first one lets the batch in flight finish and be written (a batch
    is kept only whole: its prompts decode together and its drafter pass covers them all), then the run
    stops as an interrupt does (run.json "interrupted", rerun to resume); a second Ctrl-C stops at once
    and loses that batch.  Installed only over Python's own SIGINT handler, in the main thread."""

    MESSAGE = (b"\nprofile: Ctrl-C: finishing the batch in flight so that its prompts are kept, then stopping "
               b"(rerun the same command to resume); press Ctrl-C again to stop now and lose that batch\n")

    def __init__(self, announce: bool = True):
        self.requested = False
        self.announce = announce
        self._old = None

    def __call__(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        if self.announce:
            os.write(2, self.MESSAGE)  # not print(): the handler may run inside a print to stderr

    def __enter__(self) -> "StopAfterBatch":
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._old = signal.signal(signal.SIGINT, self)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None


@dataclass
class ProfileResult:
    """What a profile run produced.  Totals (steps, prompts, violations) cover the whole
    trace in ``out_dir`` (all ranks, earlier interrupted runs included) on rank 0, and
    this rank's trace on other ranks; ``new_*`` and ``timings`` cover this invocation."""

    out_dir: Path
    steps: int
    prompts: int
    nonfinite_steps: int
    soundness_violations: int
    violations_by_criterion: dict[str, int]
    new_prompts: int
    new_steps: int
    timings: dict[str, float]
    rank: int = 0
    world_size: int = 1

    @property
    def overhead(self) -> float:
        """(certificate + trace-writing time) / model time of this invocation."""
        model = self.timings.get("model", 0.0)
        extra = self.timings.get("certificate", 0.0) + self.timings.get("trace", 0.0)
        return extra / model if model > 0 else float("nan")


# ----------------------------------------------------------------------------- models

def _load_target(target, device, dtype):
    if target is None or isinstance(target, (str, os.PathLike)):
        try:
            return load_target(None if target is None else str(target), device=device, dtype=dtype)
        except (ModelUnavailable, OSError, RuntimeError) as exc:  # unreachable hub, missing files, bad checkpoint...
            raise ValueError(f"--target: {exc}") from exc
    if isinstance(target, (tuple, list)) and len(target) == 2:
        model, tok = target
    else:
        model, tok = target, None
    return model.to(device=device, dtype=dtype) if dtype is not None else model.to(device), tok


def _load_drafter(drafter, spec, model, tok, device, dtype):
    if drafter is None:
        return None
    if isinstance(drafter, (str, os.PathLike)):
        try:
            return load_drafter(spec, model, tok, device=device, dtype=dtype)
        except (ModelUnavailable, OSError, RuntimeError) as exc:  # unreachable hub, missing files, bad checkpoint...
            raise ValueError(f"--drafter: {exc}") from exc
    d = drafter.to(device=device, dtype=dtype) if dtype is not None else drafter.to(device)
    check_compatible(model, tok, d)  # a drafter object must share the target's vocabulary (before any compute)
    return d


def _encode(tok, text: str) -> list[int]:
    if tok is None:
        raise ValueError("target: a tokenizer is needed to encode text prompts; pass (model, tokenizer)")
    ids = list(encode_prompt(tok, text))
    if not ids:
        raise ValueError(f"prompts: a prompt encodes to zero tokens: {text[:60]!r}")
    return ids


# ----------------------------------------------------------------------------- the run

def profile(
    target=None,
    drafter=None,
    prompts=None,
    *,
    out: str | os.PathLike = "draftcert-profile",
    limit: int | None = None,
    max_new_tokens: int = 128,
    criteria=DEFAULT_CRITERIA,
    epsilons=DEFAULT_EPSILONS,
    divergences=("forward",),
    batch_size: int = 8,
    device: str = "cpu",
    dtype=None,
    progress: bool = True,
    command: Sequence[str] | None = None,
    on_batch: Callable[[dict], None] | None = None,
    timer: StepTimer | None = None,
) -> ProfileResult:
    """Profile acceptance radii (and, with a drafter, acceptance and certificates) step by step.

    Parameters
    ----------
    target : None / "embedded" (the embedded SmolLM2-135M-Instruct), a hub id or local
        path, or an already-loaded ``(model, tokenizer)``.
    drafter : None (target only), "default" (``models.DEFAULT_DRAFTER``), "self:skip=L,...",
        "self:quant=B", a hub id/path, or a loaded model sharing the target's vocabulary.
    prompts : a source for ``draftcert.prompts.load_prompts`` (mt-bench, humaneval, a
        .jsonl/.txt file, a dataset name) or a sequence of Prompt / (id, text) / str.
    out : output directory: ``out/trace/rank{r}-{i}.parquet`` shards and ``out/run.json``.
    criteria, epsilons, divergences : lists or comma-separated strings.  ``radius/<spec>``
        (forward KL) is always recorded; ``reverse``/``tv`` add ``radius_reverse/``, ``radius_tv/``.
    command : the command line run.json records (default ``sys.argv``).
    on_batch : called on this rank after each shard is written with a dict
        (shard, prompt_ids, steps, violations); raising from it stops the run (resumable).

    Returns a :class:`ProfileResult`.  Soundness violations (certified but rejected)
    are printed in red on stderr and counted; they indicate a bug.  The report is the
    caller's next step: ``draftcert.report.write_report(result.out_dir)`` on rank 0.
    """
    t_start = time.perf_counter()
    crits = parse_criteria(criteria)
    eps = parse_epsilons(epsilons)
    divs = parse_divergences(divergences)
    if int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(f"batch_size: expected an integer >= 1, got {batch_size!r}")
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an integer >= 1, got {max_new_tokens!r}")
    torch_dtype = parse_dtype(dtype)
    out = check_out_dir(out, "out")

    info = dist_mod.setup(device)
    record = None  # set once this invocation has marked run.json "running" (rank 0)
    old_term = None
    if threading.current_thread() is threading.main_thread():
        old_term = signal.signal(signal.SIGTERM, _on_sigterm)  # SIGTERM stops the run like Ctrl-C
    try:
        dev = dist_mod.rank_device(device, info)
        plist, source = resolve_prompts(prompts, limit)
        settings = trace_settings(target=target, drafter=drafter, source=source, prompts=plist, limit=limit,
                                  max_new_tokens=max_new_tokens, criteria=crits, divergences=divs,
                                  dtype=torch_dtype, epsilons=eps)
        sha = settings_sha(settings)
        shas = check_resume(out, settings, plist)
        # every hash this directory's shards may carry, for the next run (and the other ranks,
        # which may read the run.json rank 0 rewrites below)
        settings["shard_sha256"] = sorted(shas)
        done = done_prompts(out, shas, plist)

        try:  # a pair's first run: both models' wheels now, one line with their total size and one bar
            fetch_pair_downloads([target, drafter], device=dev, dtype=torch_dtype, progress=progress)
        except ModelUnavailable as exc:
            raise ValueError(f"--target: {exc}") from exc
        with transformers_progress(progress):  # progress=False: no "Loading weights" bar either
            model, tok = _load_target(target, dev, torch_dtype)
            model.eval()
            check_resume_numerics(out, numerics_of(model))  # before a trace of other numerics joins the run
            draft = _load_drafter(drafter, settings["drafter"], model, tok, dev, torch_dtype)
        if draft is not None:
            draft.eval()

        mine = [i for i in range(len(plist)) if i % info.world_size == info.rank]
        todo = [i for i in mine if plist[i].id not in done]
        encoded = {i: _encode(tok, plist[i].text) for i in todo}
        # Longest prompts first, in fixed chunks over this rank's prompts still to do: little
        # padding, and a resumed run gets exactly the batches the interrupted one had left
        # (those were done in order, so what remains is a suffix of the same sorted list).
        order = sorted(todo, key=lambda i: -len(encoded[i]))
        held = [m for m in (model, draft) if m is not None and hasattr(m, "modules") and module_states(m)]
        if held and batch_size > 1:  # state on its modules reads padding and holds one batch: row by row
            batch_size = 1
            if info.is_main:
                print(f"profile: {type(held[0]).__name__} keeps recurrent state on its modules, which left padding "
                      "would enter; its prompts run one at a time (--batch-size 1)", file=sys.stderr)
        chunks = [order[j:j + batch_size] for j in range(0, len(order), batch_size)]

        if info.is_main:
            # Safe before the other ranks' resume checks finish: it is written atomically and
            # carries the very settings rank 0 has just checked against the old run.json.
            out.mkdir(parents=True, exist_ok=True)
            (out / "trace").mkdir(exist_ok=True)
            run_record = RunRecord(
                settings, info.world_size, batch_size, str(dev),
                numerics_of(model),  # the dtype, or "gguf-exact-f32" for GGUF blocks computed as stored
                list(command) if command is not None else list(sys.argv))
            run_record.write(out, "running")
            record = run_record  # from here on a stop rewrites run.json ("interrupted" or "failed")
        # Collective 1 (every rank, exactly once, also on failure): all set up?
        if not dist_mod.all_ok(info, True):
            raise _PeerFailed("another rank failed while setting up; see its error")
        timer = timer or StepTimer(dev)
        timer.device = dev
        rollout = settings["rollout"]
        stop = StopAfterBatch(announce=info.is_main)
        ctx = BatchContext(
            model=model, tokenizer=tok, drafter=draft, certifier=StepCertifier(crits, divs), out=out,
            settings_sha=sha, info=info, max_new_tokens=int(max_new_tokens), timer=timer,
            rollout=tuple(rollout) if rollout and draft is not None and is_feature_model(draft) else None,
            progress=progress, on_batch=on_batch, stop_requested=lambda: stop.requested)
        with stop:  # Ctrl-C: the batch in flight is finished and kept, then the run stops
            totals = run_batches(ctx, plist, chunks, encoded, len(mine))
    except BaseException as exc:
        mark_stopped(out, record, exc)
        # Take part in the collective the other ranks are waiting in, reporting failure, so
        # they stop too instead of blocking (a peer failure was already reported that way).
        if info.world_size > 1 and not isinstance(exc, _PeerFailed):
            try:
                dist_mod.all_ok(info, False)
            except Exception:
                pass
        dist_mod.teardown(info)
        _restore_sigterm(old_term)
        raise
    try:
        # Collective 2: did every rank finish its prompts?
        if not dist_mod.all_ok(info, True):
            raise _PeerFailed("another rank failed; its finished batches are kept, rerun the same command to resume")
        dist_mod.barrier(info)
        if info.is_main:
            with timer.section("trace"), timer.section("trace.stats"):
                stats = trace_stats(list_shards(out / "trace"), ctx.specs, draft is not None)
        else:  # this rank's own shards
            stats = totals.stats
        timings = dict(timer.totals)  # after the totals pass, so that the overhead includes it
        timings["wall"] = time.perf_counter() - t_start
        result = ProfileResult(out, stats["steps"], stats["prompts"], stats["nonfinite_steps"],
                               stats["soundness_violations"], stats["violations_by_criterion"],
                               totals.new_prompts, totals.new_steps, timings, info.rank, info.world_size)
        if info.is_main:
            record.write(out, "complete", stats=stats, timings={**timings, "overhead": result.overhead})
            record = None  # complete: a later interrupt leaves it so
        dist_mod.barrier(info)
    except BaseException as exc:
        mark_stopped(out, record, exc)
        raise
    finally:
        dist_mod.teardown(info)
        _restore_sigterm(old_term)
    if result.soundness_violations:
        print(f"{RED}draftcert: {result.soundness_violations} SOUNDNESS VIOLATION(S) (certified but rejected): "
              f"{ {k: v for k, v in result.violations_by_criterion.items() if v} }. This is a bug in draftcert; "
              f"please report it with {out / 'run.json'}{RESET}", file=sys.stderr)
    return result
