"""``draftcert.profile.profile``: certificate traces of a target (and drafter) on a prompt set.

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
rerunning the same command skips every prompt already in a shard, so an
interrupted run loses at most the batch in flight.  ``run.json`` holds the
settings and a ``status`` (running, complete, interrupted on Ctrl-C/SIGTERM,
failed); a rerun with different trace-affecting settings is refused.

Extend: a rerun with a larger ``limit`` (or the same file with prompts
appended) keeps every shard and profiles only the new prompts, provided the
prompts already traced are exactly the first ones of the new prompt set.  Each
run plans its batches (longest prompts first) over the prompts still to do, so
a resumed run reproduces an uninterrupted one batch for batch.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..certificates import DEFAULT_EPSILONS
from ..criteria import DEFAULT_CRITERIA, Criterion, TreeCoverage, parse_criterion
from ..divergences import check_divergence
from . import distributed as dist_mod
from .generate import GreedyRun, StepTimer, eos_token_ids, score_teacher_forced
from .trace import (
    BatchTrace,
    StepCertifier,
    StepRows,
    list_shards,
    shard_prompt_ids,
    trace_schema,
    write_shard,
    TOPK_STORED,
)

__all__ = ["profile", "ProfileResult", "DEFAULT_CRITERIA", "DEFAULT_EPSILONS", "TRACE_FORMAT"]

# /2: draft_topk_target_logp, draft_token_target_rank, accept_mask/<spec>
# /3: with a feature drafter, its own rollouts (rollout_* columns, profile/rollout.py); other traces as /2
TRACE_FORMAT = "draftcert-trace/3"
# Settings that change the trace's contents; a resumed run must repeat them exactly.  The
# prompt list itself may grow (a larger limit): the traced prompts must be its first ones.
_TRACE_KEYS = ("format", "target", "drafter", "prompts", "max_new_tokens", "criteria", "divergences", "dtype", "topk",
               "rollout")
# Shards written before runs could be extended hashed the prompt list and limit too.
_LEGACY_TRACE_KEYS = ("format", "target", "drafter", "prompts", "prompts_sha256", "limit", "max_new_tokens",
                      "criteria", "divergences", "dtype", "topk")
_RED, _RESET = "\033[1;91m", "\033[0m"


class _PeerFailed(RuntimeError):
    """Another rank reported a failure through a collective."""


class Terminated(KeyboardInterrupt):
    """SIGTERM during a profile run: stops it like Ctrl-C (finished shards kept, run.json
    marked "interrupted"); rerunning the same command resumes."""


def _on_sigterm(signum, frame):
    raise Terminated("terminated (SIGTERM)")


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
    report: Path | None = None
    report_error: str | None = None

    @property
    def overhead(self) -> float:
        """(certificate + trace-writing time) / model time of this invocation."""
        model = self.timings.get("model", 0.0)
        extra = self.timings.get("certificate", 0.0) + self.timings.get("trace", 0.0)
        return extra / model if model > 0 else float("nan")


# ----------------------------------------------------------------------------- argument parsing

def _split(value, name: str) -> list[str]:
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    out = [str(v).strip() for v in items if str(v).strip()]
    if not out:
        raise ValueError(f"{name}: expected a comma-separated list, got {value!r}")
    return out


def parse_criteria(value) -> list[Criterion]:
    crits = [parse_criterion(c) if not isinstance(c, Criterion) else c for c in _split(value, "criteria")]
    if not crits:
        raise ValueError("criteria: pass at least one criterion, e.g. strict,tree:4")
    seen, out = set(), []
    for c in crits:
        if c.spec not in seen:  # a duplicate would give two identical columns
            seen.add(c.spec)
            out.append(c)
    return out


def parse_epsilons(value) -> list[float]:
    out = []
    for e in _split(value, "epsilons"):
        try:
            x = float(e)
        except ValueError:
            raise ValueError(f"epsilons: {e!r} is not a number; pass e.g. 0.05,0.1,0.3") from None
        if not (x > 0 and np.isfinite(x)):
            raise ValueError(f"epsilons: each epsilon must be finite and > 0, got {e!r}")
        out.append(x)
    if not out:
        raise ValueError("epsilons: pass at least one value, e.g. 0.05,0.1")
    return out


def parse_divergences(value) -> list[str]:
    divs = [check_divergence(d) for d in _split(value or "forward", "divergences")]
    # forward KL is always recorded: the certificate column is defined by it
    return ["forward"] + [d for d in dict.fromkeys(divs) if d != "forward"]


def _parse_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "auto": None}
    key = str(dtype).lower().removeprefix("torch.")
    if key not in names:
        raise ValueError(f"dtype: expected one of float32, bfloat16, float16, auto; got {dtype!r}")
    return names[key]


# ----------------------------------------------------------------------------- prompts and models

@dataclass(frozen=True)
class _Prompt:
    id: str
    text: str


def _resolve_prompts(prompts, limit: int | None) -> tuple[list[_Prompt], str]:
    if limit is not None and (int(limit) != limit or limit < 1):
        raise ValueError(f"limit: expected an integer >= 1, got {limit!r}")
    if prompts is None:
        raise ValueError("prompts: pass a source (mt-bench, humaneval, a .jsonl/.txt file or a dataset name)")
    if isinstance(prompts, (str, os.PathLike)):
        from ..prompts import load_prompts

        source = str(prompts)
        raw = load_prompts(source, limit=limit)
    else:
        source = "inline"
        raw = list(prompts)[:limit] if limit else list(prompts)
    out = []
    for i, p in enumerate(raw):
        if isinstance(p, str):
            out.append(_Prompt(str(i), p))
        elif isinstance(p, (tuple, list)) and len(p) == 2:
            out.append(_Prompt(str(p[0]), str(p[1])))
        elif hasattr(p, "id") and hasattr(p, "text"):
            out.append(_Prompt(str(p.id), str(p.text)))
        else:
            raise ValueError(f"prompts: item {i} is {type(p).__name__}; expected Prompt(id, text), (id, text) or str")
    if not out:
        raise ValueError(f"prompts: {source!r} holds no prompts; pass a non-empty prompt set")
    ids = [p.id for p in out]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"prompts: prompt id {dup!r} occurs more than once; ids must be unique (they key the trace)")
    return out, source


def _prompts_sha(prompts: Sequence[_Prompt]) -> str:
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([p.id, p.text]).encode())
    return h.hexdigest()


def _model_name(model) -> str:
    cfg = getattr(model, "config", None)
    name = getattr(cfg, "_name_or_path", "") or getattr(cfg, "name_or_path", "")
    return f"object:{name}" if name else f"object:{type(model).__name__}"


def _target_spec(target) -> str:
    if target is None:
        return "embedded"
    if isinstance(target, (str, os.PathLike)):
        return str(target)
    model = target[0] if isinstance(target, (tuple, list)) else target
    return _model_name(model)


def _drafter_spec(drafter) -> str | None:
    if drafter is None:
        return None
    if isinstance(drafter, (str, os.PathLike)):
        if str(drafter) == "default":
            from ..models import DEFAULT_DRAFTER

            return DEFAULT_DRAFTER
        return str(drafter)
    return _model_name(drafter)


def _rollout_setting(drafter, crits) -> list[int] | None:
    """[depth, top-m] of the rollouts recorded for a feature drafter (``profile/rollout.py``), else None."""
    from .rollout import ROLLOUT_DEPTH, ROLLOUT_TOPK, is_feature_model

    if drafter is None:
        return None
    if isinstance(drafter, (str, os.PathLike)):
        from ..models.eagle import resolve_spec

        spec = _drafter_spec(drafter)
        try:
            feature = resolve_spec(spec) is not None
        except ValueError:
            feature = False
    else:
        feature = is_feature_model(drafter)
    if not feature:
        return None
    widths = [c.m for c in crits if isinstance(c, TreeCoverage)]
    return [ROLLOUT_DEPTH, max([ROLLOUT_TOPK] + widths)]


def _load_target(target, device, dtype):
    if target is None or isinstance(target, (str, os.PathLike)):
        from ..models import load_target

        try:
            return load_target(None if target is None else str(target), device=device, dtype=dtype)
        except ValueError:
            raise
        except (OSError, RuntimeError) as exc:  # unreachable hub, missing files, bad checkpoint...
            raise ValueError(f"--target {str(target)!r}: {exc}") from exc
    if isinstance(target, (tuple, list)) and len(target) == 2:
        model, tok = target
    else:
        model, tok = target, None
    return model.to(device=device, dtype=dtype) if dtype is not None else model.to(device), tok


def _load_drafter(drafter, spec, model, tok, device, dtype):
    if drafter is None:
        return None
    if isinstance(drafter, (str, os.PathLike)):
        from ..models import load_drafter

        try:
            return load_drafter(spec, model, tok, device=device, dtype=dtype)
        except ValueError:
            raise
        except (OSError, RuntimeError) as exc:
            raise ValueError(f"--drafter: {exc}") from exc
    d = drafter.to(device=device, dtype=dtype) if dtype is not None else drafter.to(device)
    _check_vocab(model, tok, d)
    return d


def _check_vocab(model, tok, draft) -> None:
    """A drafter object must share the target's vocabulary (checked before any compute)."""
    from ..models import check_compatible

    check_compatible(model, tok, draft)


def _encode(tok, text: str) -> list[int]:
    if tok is None:
        raise ValueError("target: a tokenizer is needed to encode text prompts; pass (model, tokenizer)")
    from ..prompts import encode_prompt

    ids = list(encode_prompt(tok, text))
    if not ids:
        raise ValueError(f"prompts: a prompt encodes to zero tokens: {text[:60]!r}")
    return ids


def _pad_id(tok, model) -> int:
    for cand in (getattr(tok, "pad_token_id", None), getattr(tok, "eos_token_id", None),
                 getattr(model.config, "pad_token_id", None)):
        if isinstance(cand, int):
            return cand
    return 0  # any id works: padded slots are masked out


# ----------------------------------------------------------------------------- run.json

def _versions() -> dict[str, str]:
    import draftcert

    v = {"python": platform.python_version(), "torch": torch.__version__, "draftcert": draftcert.__version__}
    for mod in ("transformers", "pyarrow", "numpy"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception:  # optional
            pass
    return v


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


def _settings_sha(settings: dict, keys: Sequence[str] = _TRACE_KEYS) -> str:
    return hashlib.sha256(json.dumps({k: settings[k] for k in keys}, sort_keys=True).encode()).hexdigest()


def _check_resume(out: Path, settings: dict, plist: Sequence[_Prompt]) -> set[str]:
    """Refuse to mix traces of different settings (or prompts) in one directory.

    Returns the settings hashes a shard of this directory may carry: this run's, and the
    one the previous run's shards were written with when that run predates extension."""
    run_json = out / "run.json"
    shards = list_shards(out / "trace")
    shas = {_settings_sha(settings)}
    if run_json.exists():
        try:
            old = json.loads(run_json.read_text()).get("settings", {})
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"out: {run_json} is unreadable ({exc}); choose a new --out or delete the directory") from None
        diff = {k: (old.get(k), settings[k]) for k in _TRACE_KEYS if old.get(k) != settings[k]}
        if diff:
            lines = "; ".join(f"{k}: was {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise ValueError(
                f"out: {out} already holds a profile run with different settings ({lines}). "
                "Rerun with the same settings to resume it, or choose a new --out directory"
            )
        shas.update(old.get("shard_sha256") or [])
        n_old = old.get("n_prompts")
        if n_old is None:  # run.json written before runs could be extended
            n_old = len(plist) if old.get("limit") is None else min(int(old["limit"]), len(plist))
            if all(k in old for k in _LEGACY_TRACE_KEYS):
                shas.add(_settings_sha(old, _LEGACY_TRACE_KEYS))
        if len(plist) < n_old:
            raise ValueError(
                f"out: {out} already holds a run over {n_old} prompts of {settings['prompts']!r}; this run has "
                f"{len(plist)} (limit {settings['limit']}), which would leave some out. Pass --limit {n_old} or more "
                "(a larger limit extends the run), or choose a new --out directory"
            )
        if _prompts_sha(plist[:n_old]) != old.get("prompts_sha256"):
            raise ValueError(
                f"out: {out} holds a run whose {n_old} prompts are not the first {n_old} prompts of "
                f"{settings['prompts']!r} as they are now (did the prompt source change?); choose a new --out directory"
            )
    elif shards:
        raise ValueError(f"out: {out / 'trace'} holds trace shards but no run.json; choose a new --out directory")
    return shas


def _done_prompts(out: Path, shas: set[str], plist: Sequence[_Prompt]) -> set[str]:
    done: set[str] = set()
    for path in list_shards(out / "trace"):
        ids, shard_sha = shard_prompt_ids(path)
        if shard_sha not in shas:
            raise ValueError(f"out: shard {path} was written with other settings; choose a new --out directory")
        done.update(ids)
    unknown = done - {p.id for p in plist}
    if unknown:
        raise ValueError(f"out: {out / 'trace'} holds prompts that are not in this prompt set "
                         f"(e.g. {sorted(unknown)[0]!r}); choose a new --out directory")
    return done


def trace_stats(shards: Sequence[Path], criteria: Sequence[str], with_drafter: bool) -> dict[str, Any]:
    """Totals over the given shards (rank 0 passes every shard: all ranks, all resumed runs)."""
    import pyarrow.parquet as pq

    steps = nonfinite = 0
    prompts: set[str] = set()
    viol = {c: 0 for c in criteria} if with_drafter else {}
    for path in shards:
        cols = ["prompt_id", "nonfinite"]
        if with_drafter:
            cols += [f"accepted/{c}" for c in criteria] + [f"certified/{c}" for c in criteria]
        # ParquetFile.read, not pq.read_table: the latter's first call spends ~40 ms setting up
        # pyarrow.dataset, which a single-file read does not need
        t = pq.ParquetFile(path).read(columns=cols)
        steps += t.num_rows
        # a Python set, not Array.unique(): its first call spends ~50 ms initialising pyarrow.compute
        prompts.update(t.column("prompt_id").to_pylist())
        nonfinite += int(np.count_nonzero(t.column("nonfinite").to_numpy()))
        for c in viol:
            cert = t.column(f"certified/{c}").to_numpy(zero_copy_only=False)
            acc = t.column(f"accepted/{c}").to_numpy(zero_copy_only=False)
            viol[c] += int(np.count_nonzero(cert & ~acc))
    return {"steps": steps, "prompts": len(prompts), "nonfinite_steps": nonfinite,
            "soundness_violations": sum(viol.values()), "violations_by_criterion": viol}


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
    report: bool = True,
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
    on_batch : called on this rank after each shard is written with a dict
        (shard, prompt_ids, steps, violations); raising from it stops the run (resumable).

    Returns a :class:`ProfileResult`.  Soundness violations (certified but rejected)
    are printed in red on stderr and counted; they indicate a bug.
    """
    t_start = time.perf_counter()
    crits = parse_criteria(criteria)
    eps = parse_epsilons(epsilons)
    divs = parse_divergences(divergences)
    if int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(f"batch_size: expected an integer >= 1, got {batch_size!r}")
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an integer >= 1, got {max_new_tokens!r}")
    torch_dtype = _parse_dtype(dtype)
    from ..cli.checks import check_out_dir

    out = check_out_dir(out, "out")

    info = dist_mod.setup(device)
    wrote_run_json = None  # set once this invocation has marked run.json "running"
    old_term = None
    if threading.current_thread() is threading.main_thread():
        old_term = signal.signal(signal.SIGTERM, _on_sigterm)  # SIGTERM stops the run like Ctrl-C
    try:
        dev = dist_mod.rank_device(device, info)
        plist, source = _resolve_prompts(prompts, limit)
        settings = {
            "format": TRACE_FORMAT,
            "target": _target_spec(target),
            "drafter": _drafter_spec(drafter),
            "prompts": source,
            "prompts_sha256": _prompts_sha(plist),
            "n_prompts": len(plist),
            "limit": limit,
            "max_new_tokens": int(max_new_tokens),
            "criteria": [c.spec for c in crits],
            "divergences": divs,
            "dtype": str(torch_dtype).removeprefix("torch.") if torch_dtype is not None else "default",
            "topk": TOPK_STORED,
            "epsilons": eps,
            # a feature drafter's rollouts (depth, top-m) for exact replay at every depth
            "rollout": _rollout_setting(drafter, crits),
        }
        sha = _settings_sha(settings)
        shas = _check_resume(out, settings, plist)
        # every hash this directory's shards may carry, for the next run (and the other ranks,
        # which may read the run.json rank 0 rewrites below)
        settings["shard_sha256"] = sorted(shas)
        done = _done_prompts(out, shas, plist)

        model, tok = _load_target(target, dev, torch_dtype)
        model.eval()
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
        chunks = [order[j:j + batch_size] for j in range(0, len(order), batch_size)]

        if info.is_main:
            # Safe before the other ranks' resume checks finish: it is written atomically and
            # carries the very settings rank 0 has just checked against the old run.json.
            out.mkdir(parents=True, exist_ok=True)
            (out / "trace").mkdir(exist_ok=True)
            _write_json(out / "run.json", _run_json(settings, info, batch_size, dev, model, command, status="running"))
            wrote_run_json = (settings, info, batch_size, dev, model, command)
        # Collective 1 (every rank, exactly once, also on failure): all set up?
        if not dist_mod.all_ok(info, True):
            raise _PeerFailed("another rank failed while setting up; see its error")
        timer = timer or StepTimer(dev)
        timer.device = dev
        res = _run_batches(model, tok, draft, plist, chunks, done, encoded, crits, divs, out, sha, info,
                           int(max_new_tokens), timer, progress, on_batch, len(mine), settings["rollout"])
    except BaseException as exc:
        _mark_stopped(out, info, wrote_run_json, exc)
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
        spec_list = [c.spec for c in crits]
        if info.is_main:
            with timer.section("trace"), timer.section("trace.stats"):
                stats = trace_stats(list_shards(out / "trace"), spec_list, draft is not None)
        else:  # this rank's own shards
            stats = res["stats"]
        timings = dict(timer.totals)  # after the totals pass, so that the overhead includes it
        timings["wall"] = time.perf_counter() - t_start
        result = ProfileResult(out, stats["steps"], stats["prompts"], stats["nonfinite_steps"],
                               stats["soundness_violations"], stats["violations_by_criterion"],
                               res["new_prompts"], res["new_steps"], timings, info.rank, info.world_size)
        if info.is_main:
            meta = _run_json(settings, info, batch_size, dev, model, command, status="complete")
            meta["stats"] = stats
            meta["timings"] = {**timings, "overhead": result.overhead}
            _write_json(out / "run.json", meta)
            wrote_run_json = None  # complete: a later interrupt (in the report) leaves it so
            if report:
                result.report, result.report_error = _write_report(out)
        dist_mod.barrier(info)
    except BaseException as exc:
        _mark_stopped(out, info, wrote_run_json, exc)
        raise
    finally:
        dist_mod.teardown(info)
        _restore_sigterm(old_term)
    if result.soundness_violations:
        print(f"{_RED}draftcert: {result.soundness_violations} SOUNDNESS VIOLATION(S) (certified but rejected): "
              f"{ {k: v for k, v in result.violations_by_criterion.items() if v} }. This is a bug in draftcert; "
              f"please report it with {out / 'run.json'}{_RESET}", file=sys.stderr)
    return result


def _restore_sigterm(old) -> None:
    if old is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, old)


def _mark_stopped(out: Path, info, wrote, exc: BaseException) -> None:
    """Rewrite run.json (atomically) as "interrupted" (Ctrl-C, SIGTERM) or "failed" when this
    invocation had marked it "running"; never touches a run.json it did not write."""
    if not (info.is_main and wrote):
        return
    status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
    try:
        meta = _run_json(*wrote, status=status)
        meta["stopped_by"] = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        _write_json(out / "run.json", meta)
    except Exception as err:  # best effort: never mask the exception that stopped the run
        print(f"draftcert: warning: could not mark {out / 'run.json'} {status} ({err})", file=sys.stderr)


def _run_json(settings, info, batch_size, dev, model, command, status):
    return {
        "format": TRACE_FORMAT,
        "status": status,
        "settings": settings,
        # flat copies of the main settings for readers of the schema
        "target": settings["target"],
        "drafter": settings["drafter"],
        "criteria": settings["criteria"],
        "epsilons": settings["epsilons"],
        "divergences": settings["divergences"],
        "prompts": settings["prompts"],
        "limit": settings["limit"],
        "max_new_tokens": settings["max_new_tokens"],
        "command": list(command) if command is not None else list(sys.argv),
        "versions": _versions(),
        "world_size": info.world_size,
        "batch_size": batch_size,
        "device": str(dev),
        "model_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "updated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _write_report(out: Path):
    """draftcert.report.write_report(out) when the report module is part of this build."""
    try:
        from ..report import write_report
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("draftcert"):
            return None, None  # report module not part of this build
        raise
    try:
        write_report(out)
        return out / "summary.json", None
    except Exception as exc:  # the trace is the product; a report failure must not lose it
        msg = f"{type(exc).__name__}: {exc}"
        print(f"draftcert: warning: report failed ({msg}); the trace in {out / 'trace'} is complete. "
              f"Run `draftcert report {out}` to retry", file=sys.stderr)
        return None, msg


def _run_batches(model, tok, draft, plist, chunks, done, encoded, crits, divs, out, sha, info,
                 max_new_tokens, timer, progress, on_batch, n_mine, rollout_shape=None):
    from tqdm.auto import tqdm

    # A killed run can leave a half-written temporary shard (never a half-written shard:
    # they appear by os.replace).  Remove this rank's leftovers; they hold nothing.
    for stale in (out / "trace").glob(f".rank{info.rank}-*.tmp"):
        stale.unlink(missing_ok=True)
    certifier = StepCertifier(crits, divs)
    from .rollout import is_feature_model, score_feature_drafter

    rollout = tuple(rollout_shape) if rollout_shape and draft is not None and is_feature_model(draft) else None
    schema = trace_schema(crits, certifier.divergences, draft is not None, rollout)
    eos = eos_token_ids(model, tok)
    pad = _pad_id(tok, model)
    specs = [c.spec for c in crits]
    n_done_mine = n_mine - sum(len(c) for c in chunks)  # chunks hold only the prompts still to do
    bar = tqdm(total=n_mine, initial=n_done_mine, unit="prompt", desc=f"profile[{info.rank}]" if info.world_size > 1 else "profile",
               disable=not (progress and info.is_main), dynamic_ncols=True, file=sys.stderr)
    new_prompts = new_steps = 0
    viol_total = {c: 0 for c in specs} if draft is not None else {}
    t0 = time.perf_counter()
    try:
        for chunk in chunks:
            todo = [i for i in chunk if plist[i].id not in done]
            if not todo:
                continue
            ids = [encoded[i] for i in todo]
            pids = [plist[i].id for i in todo]
            batch = BatchTrace(pids, schema)
            gen = GreedyRun(model, ids, max_new_tokens, eos, pad_id=pad, timer=timer)
            pending = []  # (rows, t, tokens, summary, nonfinite) per step, not yet in the trace
            for t, logits, rows, tokens in gen.steps():
                with timer.section("certificate"), timer.section("certificate.target"):
                    summ, bad = certifier.summarize_step(logits)
                    pending.append((rows, t, tokens, summ, bad))
                    if draft is None and sum(p[0].shape[0] for p in pending) * logits.shape[-1] >= _GROUP_ELEMENTS:
                        _flush(certifier, pending, batch)
                        pending = []
            if draft is None:
                with timer.section("certificate"), timer.section("certificate.target"):
                    _flush(certifier, pending, batch)
            else:
                if rollout is None:
                    dlogits, index = score_teacher_forced(draft, ids, gen.continuations, pad_id=pad, timer=timer)
                else:
                    dlogits, index, r_ids, r_gap = score_feature_drafter(
                        draft, ids, gen.continuations, pad_id=pad, depth=rollout[0], width=rollout[1], timer=timer)
                with timer.section("certificate"), timer.section("certificate.draft"):
                    for group in _groups(pending, dlogits.shape[-1]):
                        r = torch.cat([rows for rows, *_ in group])
                        c = torch.cat([index[rows] + t for rows, t, *_ in group])
                        d = dlogits[r, c]  # one gather: (rows of the group, V)
                        _flush(certifier, group, batch, d, None if rollout is None else (r_ids[r, c], r_gap[r, c]))
                del dlogits
            del pending
            with timer.section("trace"):
                with timer.section("trace.table"):
                    table = batch.to_table()
                name = f"rank{info.rank}-{todo[0]:06d}.parquet"
                with timer.section("trace.write"):
                    write_shard(table, out / "trace" / name, pids, sha)
                # counting soundness violations reads the certificate columns: trace work too
                with timer.section("trace.violations"):
                    viol = _violations(table, specs) if draft is not None else {}
            for c, n in viol.items():
                viol_total[c] += n
            new_prompts += len(todo)
            new_steps += table.num_rows
            bar.update(len(todo))
            el = time.perf_counter() - t0
            bar.set_postfix(tokens=new_steps, tok_s=f"{new_steps / el:.1f}" if el > 0 else "-")
            if on_batch is not None:
                on_batch({"shard": out / "trace" / name, "prompt_ids": pids, "steps": table.num_rows,
                          "violations": viol})
    finally:
        bar.close()
    # this rank's totals (rank 0 computes them over every shard after the barrier instead)
    stats = None
    if not info.is_main:
        with timer.section("trace"), timer.section("trace.stats"):
            mine = [p for p in list_shards(out / "trace") if p.name.startswith(f"rank{info.rank}-")]
            stats = trace_stats(mine, specs, draft is not None)
    return {"new_prompts": new_prompts, "new_steps": new_steps, "stats": stats}


# Logits (rows x vocabulary) processed at once by the drafter certificates: enough to
# amortise per-call overhead, small for any device, and below summarize()'s threshold
# for torch.compile (1 << 22), whose one-off compilation would cost more than it saves here.
_GROUP_ELEMENTS = 1 << 21


def _flush(certifier, steps, batch, draft_logits=None, rollout=None) -> None:
    """Certificates for a group of pending steps, added to the batch's trace."""
    if not steps:
        return
    cols = certifier.rows([s[3] for s in steps], [s[4] for s in steps], draft_logits, rollout)
    rows = torch.cat([s[0] for s in steps])
    pos = torch.cat([torch.full_like(s[0], s[1]) for s in steps])
    tokens = torch.cat([s[2] for s in steps])
    batch.add(StepRows(rows, pos, tokens, cols))


def _groups(pending, vocab: int):
    """Consecutive steps grouped so that each group holds about _GROUP_ELEMENTS logits."""
    group, n = [], 0
    for item in pending:
        group.append(item)
        n += item[0].shape[0] * vocab
        if n >= _GROUP_ELEMENTS:
            yield group
            group, n = [], 0
    if group:
        yield group


def _violations(table, specs) -> dict[str, int]:
    """Count certified-but-rejected steps in a shard and say so loudly: a violation is a bug."""
    out = {}
    for c in specs:
        cert = table.column(f"certified/{c}").to_numpy(zero_copy_only=False)
        acc = table.column(f"accepted/{c}").to_numpy(zero_copy_only=False)
        bad = np.nonzero(cert & ~acc)[0]
        out[c] = int(bad.shape[0])
        if bad.shape[0]:
            i = int(bad[0])
            pid = table.column("prompt_id")[i].as_py()
            pos = table.column("position")[i].as_py()
            kl = table.column("kl_forward")[i].as_py()
            r = table.column(f"radius/{c}")[i].as_py()
            print(f"{_RED}SOUNDNESS VIOLATION: {c}: {bad.shape[0]} step(s) certified but rejected "
                  f"(first: prompt {pid!r} position {pos}: KL(p||q) = {kl!r} < radius = {r!r}). "
                  f"This is a bug in draftcert.{_RESET}", file=sys.stderr)
    return out
