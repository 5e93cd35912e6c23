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
settings; a rerun with different trace-affecting settings is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..criteria import Criterion, parse_criterion
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

DEFAULT_CRITERIA = (
    "strict", "additive:0.1", "multiplicative:0.5", "topm:2", "entropy:0.09:0.3", "mars:0.5", "tree:2", "tree:4", "tree:8",
)
DEFAULT_EPSILONS = (0.05, 0.1, 0.3, 0.5)
TRACE_FORMAT = "draftcert-trace/2"  # /2: draft_topk_target_logp, draft_token_target_rank, accept_mask/<spec>
# Settings that change the trace's contents; a resumed run must repeat them exactly.
_TRACE_KEYS = ("format", "target", "drafter", "prompts", "prompts_sha256", "limit", "max_new_tokens",
               "criteria", "divergences", "dtype", "topk")
_RED, _RESET = "\033[1;91m", "\033[0m"


class _PeerFailed(RuntimeError):
    """Another rank reported a failure through a collective."""


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
            raise ValueError(f"--drafter {spec!r}: {exc} (or pass self:skip=LAYERS, self:quant=BITS or "
                             "'default' for a drafter derived from the target)") from exc
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


def _settings_sha(settings: dict) -> str:
    return hashlib.sha256(json.dumps({k: settings[k] for k in _TRACE_KEYS}, sort_keys=True).encode()).hexdigest()


def _check_resume(out: Path, settings: dict) -> None:
    """Refuse to mix traces of different settings in one directory."""
    run_json = out / "run.json"
    shards = list_shards(out / "trace")
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
    elif shards:
        raise ValueError(f"out: {out / 'trace'} holds trace shards but no run.json; choose a new --out directory")


def _done_prompts(out: Path, sha: str) -> set[str]:
    done: set[str] = set()
    for path in list_shards(out / "trace"):
        ids, shard_sha = shard_prompt_ids(path)
        if shard_sha != sha:
            raise ValueError(f"out: shard {path} was written with other settings; choose a new --out directory")
        done.update(ids)
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
    out = Path(out)

    info = dist_mod.setup(device)
    try:
        dev = dist_mod.rank_device(device, info)
        plist, source = _resolve_prompts(prompts, limit)
        settings = {
            "format": TRACE_FORMAT,
            "target": _target_spec(target),
            "drafter": _drafter_spec(drafter),
            "prompts": source,
            "prompts_sha256": _prompts_sha(plist),
            "limit": limit,
            "max_new_tokens": int(max_new_tokens),
            "criteria": [c.spec for c in crits],
            "divergences": divs,
            "dtype": str(torch_dtype).removeprefix("torch.") if torch_dtype is not None else "default",
            "topk": TOPK_STORED,
            "epsilons": eps,
        }
        sha = _settings_sha(settings)
        _check_resume(out, settings)
        done = _done_prompts(out, sha)

        model, tok = _load_target(target, dev, torch_dtype)
        model.eval()
        draft = _load_drafter(drafter, settings["drafter"], model, tok, dev, torch_dtype)
        if draft is not None:
            draft.eval()

        mine = [i for i in range(len(plist)) if i % info.world_size == info.rank]
        encoded = {i: _encode(tok, plist[i].text) for i in mine}
        # Longest prompts first, in fixed chunks over *all* of this rank's prompts:
        # little padding, and the same batches on every rerun (so a resumed run
        # reproduces an uninterrupted one exactly).
        order = sorted(mine, key=lambda i: -len(encoded[i]))
        chunks = [order[j:j + batch_size] for j in range(0, len(order), batch_size)]

        if info.is_main:
            # Safe before the other ranks' resume checks finish: it is written atomically and
            # carries the very settings rank 0 has just checked against the old run.json.
            out.mkdir(parents=True, exist_ok=True)
            (out / "trace").mkdir(exist_ok=True)
            _write_json(out / "run.json", _run_json(settings, info, batch_size, dev, model, command, status="running"))
        # Collective 1 (every rank, exactly once, also on failure): all set up?
        if not dist_mod.all_ok(info, True):
            raise _PeerFailed("another rank failed while setting up; see its error")
        timer = timer or StepTimer(dev)
        timer.device = dev
        res = _run_batches(model, tok, draft, plist, chunks, done, encoded, crits, divs, out, sha, info,
                           int(max_new_tokens), timer, progress, on_batch, len(mine))
    except BaseException as exc:
        # Take part in the collective the other ranks are waiting in, reporting failure, so
        # they stop too instead of blocking (a peer failure was already reported that way).
        if info.world_size > 1 and not isinstance(exc, _PeerFailed):
            try:
                dist_mod.all_ok(info, False)
            except Exception:
                pass
        dist_mod.teardown(info)
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
            if report:
                result.report, result.report_error = _write_report(out)
        dist_mod.barrier(info)
    finally:
        dist_mod.teardown(info)
    if result.soundness_violations:
        print(f"{_RED}draftcert: {result.soundness_violations} SOUNDNESS VIOLATION(S) (certified but rejected): "
              f"{ {k: v for k, v in result.violations_by_criterion.items() if v} }. This is a bug in draftcert; "
              f"please report it with {out / 'run.json'}{_RESET}", file=sys.stderr)
    return result


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
                 max_new_tokens, timer, progress, on_batch, n_mine):
    from tqdm.auto import tqdm

    # A killed run can leave a half-written temporary shard (never a half-written shard:
    # they appear by os.replace).  Remove this rank's leftovers; they hold nothing.
    for stale in (out / "trace").glob(f".rank{info.rank}-*.tmp"):
        stale.unlink(missing_ok=True)
    certifier = StepCertifier(crits, divs)
    schema = trace_schema(crits, certifier.divergences, draft is not None)
    eos = eos_token_ids(model, tok)
    pad = _pad_id(tok, model)
    specs = [c.spec for c in crits]
    n_done_mine = sum(1 for c in chunks for i in c if plist[i].id in done)
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
                dlogits, index = score_teacher_forced(draft, ids, gen.continuations, pad_id=pad, timer=timer)
                with timer.section("certificate"), timer.section("certificate.draft"):
                    for group in _groups(pending, dlogits.shape[-1]):
                        r = torch.cat([rows for rows, *_ in group])
                        c = torch.cat([index[rows] + t for rows, t, *_ in group])
                        d = dlogits[r, c]  # one gather: (rows of the group, V)
                        _flush(certifier, group, batch, d)
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


def _flush(certifier, steps, batch, draft_logits=None) -> None:
    """Certificates for a group of pending steps, added to the batch's trace."""
    if not steps:
        return
    cols = certifier.rows([s[3] for s in steps], [s[4] for s in steps], draft_logits)
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
