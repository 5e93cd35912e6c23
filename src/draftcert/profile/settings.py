"""The settings of a profile run, and whether an output directory lets it resume.

Owns everything decided before a model is loaded:

- option parsing: :func:`parse_criteria`, :func:`parse_epsilons`, :func:`parse_divergences`,
  and :func:`check_out_dir` (no file in the way of the output path);
- the prompt set: :func:`resolve_prompts` (prompt ids key the trace) and :func:`prompts_sha`;
- the settings dict ``run.json`` records (:func:`trace_settings`) and its hash
  :func:`settings_sha` over ``TRACE_KEYS``, the settings that change the trace's contents;
  every shard carries this hash;
- resume: :func:`check_resume` refuses a directory that holds a run with other settings or
  other first prompts, :func:`done_prompts` lists the prompts already in a shard;
- ``run.json`` itself: :class:`RunRecord` writes it ("running", then "complete"), and
  :func:`mark_stopped` rewrites it "interrupted" or "failed".

Extension: the prompt list may grow between runs (a larger limit); the prompts already traced
must be the first ones of the new list (``prompts_sha256`` of the first ``n_prompts``).  Shards
written before runs could be extended hashed the prompt list and the limit too
(``LEGACY_TRACE_KEYS``); :func:`check_resume` still accepts them.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .. import __version__ as DRAFTCERT_VERSION
from ..criteria import Criterion, TreeCoverage, parse_criterion
from ..divergences import check_divergence
from ..fileio import check_writable_dir, write_json
from ..models import DEFAULT_DRAFTER
from ..models.eagle import resolve_spec
from ..models.loading import weights_for_numerics
from ..prompts import EMPTY_PROMPT, Prompt, limit_note, load_prompts
from ..tracefile import TOPK_STORED, TRACE_FORMAT, list_shards, shard_prompt_ids
from .rollout import ROLLOUT_DEPTH, ROLLOUT_TOPK, is_feature_model

__all__ = [
    "TRACE_KEYS", "LEGACY_TRACE_KEYS", "RunRecord",
    "parse_criteria", "parse_epsilons", "parse_divergences", "check_out_dir",
    "resolve_prompts", "prompts_sha", "trace_settings", "settings_sha",
    "check_resume", "check_resume_numerics", "done_prompts", "mark_stopped",
]

# Settings that change the trace's contents; a resumed run must repeat them exactly.  The
# prompt list itself may grow (a larger limit): the traced prompts must be its first ones.
TRACE_KEYS = ("format", "target", "drafter", "prompts", "max_new_tokens", "criteria", "divergences", "dtype", "topk",
              "rollout")
# Shards written before runs could be extended hashed the prompt list and limit too.
LEGACY_TRACE_KEYS = ("format", "target", "drafter", "prompts", "prompts_sha256", "limit", "max_new_tokens",
                     "criteria", "divergences", "dtype", "topk")


# ----------------------------------------------------------------------------- options

def _split(value, name: str) -> list[str]:
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    out = [str(v).strip() for v in items if str(v).strip()]
    if not out:
        raise ValueError(f"{name}: expected a comma-separated list, got {value!r}")
    return out


def parse_criteria(value) -> list[Criterion]:
    """Criteria from specs (a comma-separated string or a list; Criterion objects pass), duplicates dropped."""
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
    """Per-step divergence budgets of the report: finite and > 0."""
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
    """Divergences whose radii are recorded: "forward" first, always."""
    divs = [check_divergence(d) for d in _split(value or "forward", "divergences")]
    # forward KL is always recorded: the certificate column is defined by it
    return ["forward"] + [d for d in dict.fromkeys(divs) if d != "forward"]


def check_out_dir(path, option: str = "--out") -> Path:
    """An output directory that exists as a directory or can be created (no file in the way), and
    that files can be written into (``fileio.check_writable_dir``: not a read-only mount, not under
    ``/proc``, not a folder without write permission); nothing is left behind."""
    p = Path(os.path.expanduser(str(path)))
    for q in (p, *p.parents):
        if q.exists():
            if not q.is_dir():
                where = "is a file" if q == p else f"lies under {str(q)!r}, which is a file"
                raise ValueError(f"{option}: {str(p)!r} {where}, not a directory; pass a directory path "
                                 "(it is created if missing)")
            break
    try:
        check_writable_dir(p)
    except OSError as exc:
        how = "cannot be written" if p.exists() else f"cannot be created in {exc.filename!r}"
        raise ValueError(f"{option}: {str(p)!r} {how} ({exc.strerror}); pass a directory you can write to") from None
    return p


# ----------------------------------------------------------------------------- prompts

def resolve_prompts(prompts, limit: int | None) -> tuple[list[Prompt], str]:
    """``(prompts, source)`` from a source for ``load_prompts`` or a sequence of Prompt / (id, text) / str.

    Ids must be unique: they key the trace (a str item's id is its index)."""
    if limit is not None and (int(limit) != limit or limit < 1):
        raise ValueError(f"limit: expected an integer >= 1, got {limit!r}")
    if prompts is None:
        raise ValueError("prompts: pass a source (mt-bench, humaneval, a .jsonl/.txt file or a dataset name)")
    if isinstance(prompts, (str, os.PathLike)):
        source = str(prompts)
        raw = load_prompts(source, limit=limit)
        note = limit_note(source, limit, len(raw))
        if note and os.environ.get("RANK", "0") == "0":  # one line per run, not per torchrun rank
            print(f"profile: {note}", file=sys.stderr)
    else:
        source = "inline"
        raw = list(prompts)[:limit] if limit else list(prompts)
    out = []
    for i, p in enumerate(raw):
        if isinstance(p, str):
            out.append(Prompt(str(i), p))
        elif isinstance(p, (tuple, list)) and len(p) == 2:
            out.append(Prompt(str(p[0]), str(p[1])))
        elif hasattr(p, "id") and hasattr(p, "text"):
            out.append(Prompt(str(p.id), str(p.text)))
        else:
            raise ValueError(f"prompts: item {i} is {type(p).__name__}; expected Prompt(id, text), (id, text) or str")
    if not out:
        raise ValueError(f"prompts: {source!r} holds no prompts; pass a non-empty prompt set")
    empty = next((i for i, p in enumerate(out) if not p.text.strip()), None)
    if empty is not None:  # as decode and bench: an empty prompt is refused (load_prompts says so for a source)
        raise ValueError(f"prompts: item {empty} (id {out[empty].id!r}): {EMPTY_PROMPT}")
    ids = [p.id for p in out]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"prompts: prompt id {dup!r} occurs more than once; ids must be unique (they key the trace)")
    return out, source


def prompts_sha(prompts: Sequence[Prompt]) -> str:
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([p.id, p.text]).encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------- the settings

def _model_name(model) -> str:
    """How run.json names a model passed as an object."""
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
        return DEFAULT_DRAFTER if str(drafter) == "default" else str(drafter)
    return _model_name(drafter)


def _rollout_setting(drafter, crits) -> list[int] | None:
    """[depth, top-m] of the rollouts recorded for a feature drafter (``profile/rollout.py``), else None."""
    if drafter is None:
        return None
    if isinstance(drafter, (str, os.PathLike)):
        try:
            feature = resolve_spec(_drafter_spec(drafter)) is not None
        except ValueError:
            feature = False
    else:
        feature = is_feature_model(drafter)
    if not feature:
        return None
    widths = [c.m for c in crits if isinstance(c, TreeCoverage)]
    return [ROLLOUT_DEPTH, max([ROLLOUT_TOPK] + widths)]


def trace_settings(*, target, drafter, source: str, prompts: Sequence[Prompt], limit, max_new_tokens: int,
                   criteria: Sequence[Criterion], divergences: Sequence[str], dtype: torch.dtype | None,
                   epsilons: Sequence[float]) -> dict:
    """The settings run.json records (``TRACE_KEYS`` of them decide the trace's contents)."""
    return {
        "format": TRACE_FORMAT,
        "target": _target_spec(target),
        "drafter": _drafter_spec(drafter),
        "prompts": source,
        "prompts_sha256": prompts_sha(prompts),
        "n_prompts": len(prompts),
        "limit": limit,
        "max_new_tokens": int(max_new_tokens),
        "criteria": [c.spec for c in criteria],
        "divergences": list(divergences),
        "dtype": str(dtype).removeprefix("torch.") if dtype is not None else "default",
        "topk": TOPK_STORED,
        "epsilons": list(epsilons),
        # a feature drafter's rollouts (depth, top-m) for exact replay at every depth
        "rollout": _rollout_setting(drafter, criteria),
    }


def settings_sha(settings: dict, keys: Sequence[str] = TRACE_KEYS) -> str:
    """The hash every shard carries: sha256 of the ``keys`` of ``settings`` as sorted JSON."""
    return hashlib.sha256(json.dumps({k: settings[k] for k in keys}, sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------- resume

# the options behind the settings a resumed run must repeat; the other TRACE_KEYS are derived
_OPTION_OF = {"target": "--target", "drafter": "--drafter", "prompts": "--prompts", "max_new_tokens": "--max-new-tokens",
              "criteria": "--criteria", "divergences": "--divergences", "dtype": "--dtype"}


def _shown(value) -> str:
    """A setting as it is typed: a list comma-separated, None as none."""
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def trace_settings_changes(old: dict, new: dict) -> str:
    """How a run folder's settings differ from this run's, named by the options a user types
    (``--drafter was A, now B; ...``), empty when they agree.  The settings draftcert derives are not
    named: ``rollout`` (a feature drafter's recorded rollouts) follows --drafter and --criteria; the
    trace format and its top-k (``format``, ``topk``) say that another version of draftcert wrote it."""
    changed = [k for k in TRACE_KEYS if old.get(k) != new.get(k)]
    parts = [f"{_OPTION_OF[k]} was {_shown(old.get(k))}, now {_shown(new.get(k))}" for k in changed if k in _OPTION_OF]
    derived = [k for k in changed if k not in _OPTION_OF]
    if "rollout" in derived and {"drafter", "criteria"} & set(changed):
        derived.remove("rollout")  # it follows the drafter and the tree:M criteria, already named
    if derived:
        fmt = f" ({old.get('format')}, now {new.get('format')})" if "format" in derived else ""
        parts.append(f"the trace was recorded by another version of draftcert{fmt}")
    return "; ".join(parts)

def check_resume(out: Path, settings: dict, plist: Sequence[Prompt]) -> set[str]:
    """Refuse to mix traces of different settings (or prompts) in one directory.

    Returns the settings hashes a shard of this directory may carry: this run's, and the
    one the previous run's shards were written with when that run predates extension."""
    run_json = out / "run.json"
    shards = list_shards(out / "trace")
    shas = {settings_sha(settings)}
    if run_json.exists():
        try:
            old = json.loads(run_json.read_text()).get("settings", {})
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"out: {run_json} is unreadable ({exc}); choose a new --out or delete the directory") from None
        lines = trace_settings_changes(old, settings)
        if lines:
            raise ValueError(
                f"out: {out} already holds a profile run with different settings ({lines}). "
                "Rerun with the same settings to resume it, or choose a new --out directory"
            )
        shas.update(old.get("shard_sha256") or [])
        n_old = old.get("n_prompts")
        if n_old is None:  # run.json written before runs could be extended
            n_old = len(plist) if old.get("limit") is None else min(int(old["limit"]), len(plist))
            if all(k in old for k in LEGACY_TRACE_KEYS):
                shas.add(settings_sha(old, LEGACY_TRACE_KEYS))
        if len(plist) < n_old:
            raise ValueError(
                f"out: {out} already holds a run over {n_old} prompts of {settings['prompts']!r}; this run has "
                f"{len(plist)} (limit {settings['limit']}), which would leave some out. Pass --limit {n_old} or more "
                "(a larger limit extends the run), or choose a new --out directory"
            )
        if prompts_sha(plist[:n_old]) != old.get("prompts_sha256"):
            raise ValueError(
                f"out: {out} holds a run whose {n_old} prompts are not the first {n_old} prompts of "
                f"{settings['prompts']!r} as they are now (did the prompt source change?); choose a new --out directory"
            )
    elif shards:
        raise ValueError(f"out: {out / 'trace'} holds trace shards but no run.json; choose a new --out directory")
    return shas


def check_resume_numerics(out: Path, numerics: str) -> None:
    """Refuse to add traces computed under another numeric contract (run.json's ``model_dtype``:
    ``float32``, ``gguf-exact-f32`` ...) to a run that has shards: ``--weights`` or ``--dtype`` changed."""
    run_json = out / "run.json"
    if not run_json.exists() or not list_shards(out / "trace"):
        return
    try:
        old = json.loads(run_json.read_text()).get("model_dtype")
    except (OSError, json.JSONDecodeError):
        return  # check_resume has already said so
    if old and old != numerics:
        w = weights_for_numerics(old)
        hint = f"--weights {w}" if w != "float32" else f"--weights float32 (and --dtype {old})"
        raise ValueError(f"out: {out} holds traces computed under {old}; this run computes under {numerics}. "
                         f"Rerun with {hint} to resume it, or choose a new --out directory")


def done_prompts(out: Path, shas: set[str], plist: Sequence[Prompt]) -> set[str]:
    """Ids of the prompts already in a shard (each shard's hash must be one of ``shas``)."""
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


# ----------------------------------------------------------------------------- run.json

def _versions() -> dict[str, str]:
    v = {"python": platform.python_version(), "torch": torch.__version__, "draftcert": DRAFTCERT_VERSION}
    for mod in ("transformers", "pyarrow", "numpy"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception:  # optional
            pass
    return v


@dataclass(frozen=True)
class RunRecord:
    """What ``run.json`` says about one invocation besides its status; only rank 0 writes it."""

    settings: dict
    world_size: int
    batch_size: int
    device: str
    model_dtype: str
    command: list[str]

    def as_json(self, status: str) -> dict:
        s = self.settings
        return {
            "format": TRACE_FORMAT,
            "status": status,
            "settings": s,
            # flat copies of the main settings for readers of the schema
            "target": s["target"],
            "drafter": s["drafter"],
            "criteria": s["criteria"],
            "epsilons": s["epsilons"],
            "divergences": s["divergences"],
            "prompts": s["prompts"],
            "limit": s["limit"],
            "max_new_tokens": s["max_new_tokens"],
            "command": list(self.command),
            "versions": _versions(),
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "device": self.device,
            "model_dtype": self.model_dtype,
            "updated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }

    def write(self, out: Path, status: str, **extra) -> None:
        """``out/run.json`` with this status (and ``extra`` keys), written atomically."""
        write_json(out / "run.json", {**self.as_json(status), **extra})


def mark_stopped(out: Path, record: RunRecord | None, exc: BaseException) -> None:
    """Rewrite run.json as "interrupted" (Ctrl-C, SIGTERM) or "failed" when this invocation
    had marked it "running" (``record`` is then set); never touches a run.json it did not write."""
    if record is None:
        return
    status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed"
    try:
        record.write(out, status, stopped_by=f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
    except Exception as err:  # best effort: never mask the exception that stopped the run
        print(f"draftcert: warning: could not mark {out / 'run.json'} {status} ({err})", file=sys.stderr)
