"""The Parquet trace of ``draftcert profile``: its format, written and read in one place.

A profile run folder ``DIR`` holds ``DIR/run.json`` (the run's settings and status) and
``DIR/trace/``, one Parquet shard per batch of prompts per rank, named
``rank{r}-{i:06d}.parquet`` (``i``: the batch's first prompt index).  Only files named so are
shards: a dotfile is an atomic write in flight (``draftcert.fileio``), anything else is not ours.
Each shard holds one row per generated step of the target and records in its footer the ids of
its prompts and the hash of the run's trace settings (``SHARD_META_*``), so a rerun resumes.

Columns (in this order; ``trace_schema`` builds the Arrow schema, and the order is part of the
format).  Every target row:

* ``prompt_id`` (string), ``position`` (int32: the step t, 0 = first generated token),
  ``target_token`` (int32: the target's greedy token),
* ``target_margin`` = p(1st) - p(2nd), ``target_entropy`` (nats) (float64),
* ``target_topk_ids`` / ``target_topk_probs``: the target's top-``TOPK_STORED``
  (list<int32> / list<float32>), ``nonfinite`` (bool: the target's logits were not finite;
  the row's statistics are NaN and it never certifies),
* ``radius/<spec>``, ``radius_reverse/<spec>``, ``radius_tv/<spec>`` (float64, +inf allowed):
  the rule's radius under forward KL, reverse KL and TV (``radius_column``).

With a drafter q (teacher-forced on the same prefix):

* ``draft_token`` (int32: argmax q), ``draft_topk_ids`` / ``draft_topk_probs``,
  ``kl_forward`` = KL(p||q), ``kl_reverse``, ``tv`` (float64), ``draft_nonfinite`` (bool),
* ``draft_topk_target_logp`` (list<float32>: log p of the drafter's top-k),
  ``draft_token_target_rank`` (int32: #{y : p(y) > p(draft_token)}),
* ``accepted/<spec>`` (bool: the rule accepts the drafter's proposal; top-m for ``tree:m``),
  ``accept_mask/<spec>`` (int32, level-set rules: bit i set iff the rule accepts the drafter's
  rank-i token), ``certified/<spec>`` (bool: KL(p||q) < radius, hence accepted).

With a feature (EAGLE-style) drafter, its own rollouts (``profile/rollout.py``): ``rollout_topk_ids``
(list<int32>: its top-m at depths 2..D for this row's token, depth-major, -1 = no such round),
``rollout_topk_target_logp``, ``rollout_logit_gap`` (top-2 logit gap per depth) (list<float32>)
and ``rollout_accept_mask/<spec>`` (list<int32>, level-set rules: per depth, bit r set iff the rule
accepts rank r, r < ``ROLLOUT_MASK_WIDTH``).

Format versions (``TRACE_FORMAT``, recorded in ``run.json``): /1 the columns above without
``draft_topk_target_logp``, ``draft_token_target_rank`` and ``accept_mask/<spec>``, which /2 adds;
/3 adds the rollout columns (feature drafters only; other traces are as /2).  Readers accept
every version and say what an older trace cannot give.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .certificates import DEFAULT_EPSILONS
from .criteria import Criterion, TreeCoverage
from .fileio import atomic_path

__all__ = [
    "TRACE_FORMAT",
    "TOPK_STORED",
    "ROLLOUT_MASK_WIDTH",
    "SHARD_META_PROMPTS",
    "SHARD_META_SETTINGS",
    "RADIUS_FAMILY",
    "radius_column",
    "accepted_column",
    "certified_column",
    "accept_mask_column",
    "rollout_mask_column",
    "column_specs",
    "has_accept_mask",
    "has_drafter_columns",
    "trace_schema",
    "shard_name",
    "write_shard",
    "list_shards",
    "run_shards",
    "shard_columns",
    "shard_prompt_ids",
    "TraceColumns",
    "read_columns",
    "load_run",
    "run_epsilons",
]

# /2: draft_topk_target_logp, draft_token_target_rank, accept_mask/<spec>
# /3: with a feature drafter, its own rollouts (rollout_* columns, profile/rollout.py); other traces as /2
TRACE_FORMAT = "draftcert-trace/3"
TOPK_STORED = 16  # top-k ids/probs stored per step (target and drafter)
ROLLOUT_MASK_WIDTH = 4  # ranks per depth whose acceptance the rollout masks record (trace/3)
SHARD_META_PROMPTS = b"draftcert.prompt_ids"
SHARD_META_SETTINGS = b"draftcert.settings_sha256"

# ----------------------------------------------------------------------------- column names

#: divergence -> family of its radius columns ("<family>/<spec>")
RADIUS_FAMILY = {"forward": "radius", "reverse": "radius_reverse", "tv": "radius_tv"}


def radius_column(spec: str, divergence: str = "forward") -> str:
    return f"{RADIUS_FAMILY[divergence]}/{spec}"


def accepted_column(spec: str) -> str:
    return f"accepted/{spec}"


def certified_column(spec: str) -> str:
    return f"certified/{spec}"


def accept_mask_column(spec: str) -> str:
    return f"accept_mask/{spec}"


def rollout_mask_column(spec: str) -> str:
    return f"rollout_accept_mask/{spec}"


def column_specs(names: Sequence[str], family: str) -> list[str]:
    """The specs of the columns ``<family>/<spec>`` among ``names``, in column order."""
    head = family + "/"
    return [c[len(head):] for c in names if c.startswith(head)]


def has_accept_mask(c: Criterion) -> bool:
    """Does the trace record ``accept_mask/<spec>`` (and rollout masks) for this rule?  Level-set
    rules only: ``tree:m`` decides on the drafter's top-m as a whole, not token by token."""
    return not isinstance(c, TreeCoverage)


def has_drafter_columns(names: Sequence[str]) -> bool:
    """Was the trace with these columns recorded with a drafter?"""
    return "draft_token" in names


def trace_schema(criteria: Sequence[Criterion], divergences: Sequence[str], with_drafter: bool,
                 rollout: tuple[int, int] | None = None):
    """The Arrow schema of a trace shard (column order is part of the format; see the module doc).

    ``rollout = (depth, width)``: a feature drafter's rollout columns (``profile.rollout``)."""
    import pyarrow as pa  # optional: models extra

    f64, i32, f32 = pa.float64(), pa.int32(), pa.float32()
    fields = [
        pa.field("prompt_id", pa.string()),
        pa.field("position", i32),
        pa.field("target_token", i32),
        pa.field("target_margin", f64),
        pa.field("target_entropy", f64),
        pa.field("target_topk_ids", pa.list_(i32)),
        pa.field("target_topk_probs", pa.list_(f32)),
        pa.field("nonfinite", pa.bool_()),
    ]
    for d in divergences:
        fields += [pa.field(radius_column(c.spec, d), f64) for c in criteria]
    if with_drafter:
        fields += [
            pa.field("draft_token", i32),
            pa.field("draft_topk_ids", pa.list_(i32)),
            pa.field("draft_topk_probs", pa.list_(f32)),
            pa.field("kl_forward", f64),
            pa.field("kl_reverse", f64),
            pa.field("tv", f64),
            pa.field("draft_nonfinite", pa.bool_()),
            pa.field("draft_topk_target_logp", pa.list_(f32)),
            pa.field("draft_token_target_rank", i32),
        ]
        fields += [pa.field(accepted_column(c.spec), pa.bool_()) for c in criteria]
        fields += [pa.field(accept_mask_column(c.spec), i32) for c in criteria if has_accept_mask(c)]
        fields += [pa.field(certified_column(c.spec), pa.bool_()) for c in criteria]
        if rollout is not None:
            fields += [
                pa.field("rollout_topk_ids", pa.list_(i32)),
                pa.field("rollout_topk_target_logp", pa.list_(f32)),
                pa.field("rollout_logit_gap", pa.list_(f32)),
            ]
            fields += [pa.field(rollout_mask_column(c.spec), pa.list_(i32)) for c in criteria if has_accept_mask(c)]
    return pa.schema(fields)


# ----------------------------------------------------------------------------- shards

_SHARD_RE = re.compile(r"^rank(\d+)-\d+\.parquet$")


def shard_name(rank: int, first: int) -> str:
    """File name of the shard of ``rank`` whose batch starts at prompt index ``first``."""
    return f"rank{rank}-{first:06d}.parquet"


def write_shard(table, path, prompt_ids: Sequence[str], settings_sha: str) -> None:
    """Write ``table`` to ``path`` atomically, its footer recording the prompt ids and settings hash."""
    import pyarrow.parquet as pq  # optional: models extra

    meta = dict(table.schema.metadata or {})
    meta[SHARD_META_PROMPTS] = json.dumps(list(prompt_ids)).encode()
    meta[SHARD_META_SETTINGS] = settings_sha.encode()
    table = table.replace_schema_metadata(meta)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, compression="zstd")


def list_shards(trace_dir, rank: int | None = None) -> list[Path]:
    """The shards in a trace folder (of one ``rank``, or all), sorted by name; none when the
    folder does not exist yet (a fresh run).  Readers of a finished run use ``run_shards``."""
    trace_dir = Path(trace_dir)
    if not trace_dir.is_dir():
        return []
    return sorted(p for p in trace_dir.iterdir()
                  if (m := _SHARD_RE.match(p.name)) and (rank is None or int(m.group(1)) == rank))


def run_shards(out_dir) -> list[Path]:
    """The shards of the profile run in ``out_dir``; ValueError naming the folder and the command
    to run when there is no run folder, no trace folder or no shard in it."""
    out_dir = Path(out_dir)
    trace = out_dir / "trace"
    if not out_dir.is_dir():
        raise ValueError(f"out_dir: {out_dir} is not a directory; pass the output directory of `draftcert profile`")
    if not trace.is_dir():
        raise ValueError(f"out_dir: {out_dir} is not a run folder (it has no trace/ folder); pass the output "
                         "directory of a `draftcert profile` run (its --out)")
    shards = list_shards(trace)
    if not shards:
        other = [p.name for p in trace.glob("*.parquet") if not p.name.startswith(".")]
        aside = (f" ({len(other)} other .parquet file(s), e.g. {other[0]}, are not shards: a shard is named "
                 "rank<r>-<i>.parquet)") if other else ""
        raise ValueError(f"out_dir: no trace shards in {trace}{aside}; run `draftcert profile --out {out_dir}` first")
    return shards


def _bad_shard(path: Path, exc: Exception) -> ValueError:
    return ValueError(
        f"trace shard {path} cannot be read ({type(exc).__name__}: {exc}); it is probably truncated by an "
        f"interrupted run: delete it and rerun `draftcert profile` with the same arguments (it resumes and "
        f"recomputes only the missing batches), then rerun this command"
    )


def shard_columns(path) -> list[str]:
    """Column names of a shard (its footer only); ValueError for an unreadable shard."""
    import pyarrow.parquet as pq  # optional: models extra

    try:
        return list(pq.read_schema(path).names)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a truncated file
        raise _bad_shard(Path(path), exc) from None


def shard_prompt_ids(path) -> tuple[list[str], str | None]:
    """(prompt ids, settings hash) recorded in a shard's footer (no data read)."""
    import pyarrow.parquet as pq  # optional: models extra

    try:
        meta = pq.read_schema(path).metadata or {}
    except Exception as exc:  # an unreadable shard cannot be half-written (atomic writes): say so
        raise ValueError(f"trace shard {path} is unreadable ({exc}); delete it and rerun to recompute its prompts") from None
    if SHARD_META_PROMPTS not in meta:
        raise ValueError(f"trace shard {path} lacks the draftcert prompt-id metadata; delete it and rerun")
    sha = meta.get(SHARD_META_SETTINGS)
    return json.loads(meta[SHARD_META_PROMPTS].decode()), (sha.decode() if sha else None)


# ----------------------------------------------------------------------------- reading


@dataclass
class TraceColumns:
    """Columns of every shard of a trace as numpy arrays, rows in shard order.

    Scalar columns are 1-D (bool, int64 or float64, as stored); list columns are 2-D
    ``[rows, width]`` (int64 or float64; every row of one column has the same width).
    ``prompt_id`` is read as int64 codes into ``prompt_names`` (in order of first appearance),
    so that millions of rows never become Python strings."""

    n: int
    data: dict[str, np.ndarray]
    prompt_names: list[str]

    def __getitem__(self, name: str) -> np.ndarray:
        return self.data[name]

    def __contains__(self, name: str) -> bool:
        return name in self.data

    def get(self, name: str) -> np.ndarray | None:
        return self.data.get(name)


class _Malformed(ValueError):
    """A shard that reads but breaks the format (not a truncated file)."""


def _dtype(typ) -> type:
    """numpy dtype of a column read by ``read_columns`` (strings: int64 codes)."""
    import pyarrow as pa  # optional: models extra

    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        return np.int64
    if pa.types.is_list(typ):
        typ = typ.value_type
    if pa.types.is_boolean(typ):
        return bool
    if pa.types.is_integer(typ):
        return np.int64
    return np.float64


def read_columns(shards: Sequence[Path], required: Sequence[str], optional: Sequence[str] = ()) -> TraceColumns:
    """Stream the named columns of every shard into numpy arrays (record batch by record
    batch, into preallocated arrays: no concatenation copies).

    Every shard must hold every ``required`` column (ValueError naming the odd shard: the
    shards of one run share their criteria).  An ``optional`` column is read when every shard
    holds it and left out otherwise.  ValueError for an unreadable shard or no rows at all."""
    import pyarrow as pa  # optional: models extra
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    # Pass 1: every shard's footer (columns, row count), no data.
    n, missing_opt, types = 0, set(), {}
    for path in shards:
        try:  # pyarrow signals a truncated/corrupt file with ArrowInvalid (a ValueError) or OSError
            f = pq.ParquetFile(path)
            schema = f.schema_arrow
            n += f.metadata.num_rows
        except Exception as exc:
            raise _bad_shard(path, exc) from None
        lack = [c for c in required if c not in schema.names]
        if lack:
            raise ValueError(
                f"trace shard {path} lacks column(s) {', '.join(lack[:5])} that {shards[0].name} has; "
                f"all shards of one run must share criteria: delete the odd shard(s) and rerun `draftcert profile`"
            )
        missing_opt |= {c for c in optional if c not in schema.names}
        for c in list(required) + list(optional):
            if c in schema.names:
                types.setdefault(c, schema.field(c).type)
    cols = list(dict.fromkeys([*required, *(c for c in optional if c not in missing_opt)]))
    if n == 0:
        where = shards[0].parent if shards else "the trace folder"
        raise ValueError(f"trace: the shards under {where} hold no rows; rerun `draftcert profile`")

    # Pass 2: record batches into the arrays; a list column's width is its first row's.
    data: dict[str, np.ndarray] = {c: np.empty(n, _dtype(types[c])) for c in cols if not pa.types.is_list(types[c])}
    codes: dict[str, int] = {}  # prompt_id -> 0..P-1 in order of first appearance
    at = 0
    for path in shards:
        try:
            for batch in pq.ParquetFile(path).iter_batches(columns=cols, batch_size=1 << 16):
                m = batch.num_rows
                if m == 0:
                    continue
                for c in cols:
                    arr = batch.column(c)
                    if c == "prompt_id":
                        if arr.null_count:
                            raise _Malformed(f"trace shard {path}: prompt_id has null values; delete it and rerun "
                                             "`draftcert profile` with the same arguments")
                        arr = arr.cast(pa.string())
                        local = pc.unique(arr)
                        lut = np.array([codes.setdefault(str(v), len(codes)) for v in local.to_pylist()], np.int64)
                        data[c][at: at + m] = lut[pc.index_in(arr, value_set=local).to_numpy()]
                    elif pa.types.is_list(arr.type):
                        lengths = arr.value_lengths().to_numpy(zero_copy_only=False)
                        if c not in data:
                            data[c] = np.empty((n, int(lengths[0])), _dtype(types[c]))
                        width = data[c].shape[1]
                        if (lengths != width).any():
                            raise _Malformed(f"trace shard {path}: the lists of column {c} are not all "
                                             f"{width} long; the directory mixes runs: profile into a fresh --out directory")
                        data[c][at: at + m] = arr.flatten().to_numpy(zero_copy_only=False).reshape(m, width)
                    else:
                        data[c][at: at + m] = arr.to_numpy(zero_copy_only=False)
                at += m
        except _Malformed:
            raise
        except Exception as exc:
            raise _bad_shard(path, exc) from None
    if at != n:
        raise ValueError(f"trace: read {at} rows but the shard footers declare {n}; delete the trace and rerun `draftcert profile`")
    return TraceColumns(n, data, list(codes))


# ----------------------------------------------------------------------------- run.json


def load_run(out_dir) -> dict:
    """``out_dir/run.json`` as a dict, {} when there is none; ValueError when it is not a JSON object."""
    path = Path(out_dir) / "run.json"
    if not path.exists():
        return {}
    try:
        run = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"run.json: {path} is not valid JSON ({exc}); fix or delete it and rerun") from None
    if not isinstance(run, dict):
        raise ValueError(f"run.json: {path} must hold a JSON object, got {type(run).__name__}")
    return run


def run_epsilons(run: dict) -> list[float]:
    """The run's epsilons (nats), sorted and unique; ``DEFAULT_EPSILONS`` when it names none."""
    eps = run.get("epsilons")
    if eps is None:
        return list(DEFAULT_EPSILONS)
    if isinstance(eps, str):
        eps = [e for e in eps.replace(" ", "").split(",") if e]
    try:
        vals = sorted({float(e) for e in eps})
    except (TypeError, ValueError):
        raise ValueError(f"run.json: epsilons must be a list of numbers, got {eps!r}") from None
    if not vals or any(not (0 < e < math.inf) for e in vals):
        raise ValueError(f"run.json: epsilons must be finite and > 0, got {eps!r}")
    return vals
