"""Per-step certificates and the Parquet trace.

Each generated step of the target gives one trace row.  Everything is computed
in torch on the device of the logits, right after the logits exist:

* ``summarize(logits=...)`` once per step: top-64 probabilities (float64),
  entropy and log-normaliser in one pass over the vocabulary;
* ``radius_rows(criterion, summary, divergence)`` for every criterion and
  divergence from that one summary (exact; rows whose decisive token lies
  below the top-64 are re-sorted exactly by the core library);
* with a drafter q (teacher-forced on the same prefix): KL(p||q), KL(q||p), TV,
  ``accepts_rows`` (the drafter proposes argmax q, or its top-m for trees) and
  the certificate ``KL(p||q) < radius(p)``.  Soundness says certified =>
  accepted on every step; a violation is a bug and is reported loudly.

Only the columns of the trace leave the device (once per batch); full
distributions are never written anywhere.

Non-finite logits (NaN, +inf, or a row that is entirely -inf) make the
log-normaliser non-finite.  Such a step is flagged ``nonfinite`` and kept: its
certificates are computed on a uniform placeholder and then overwritten with
NaN (radii, margin, entropy, divergences, top-k probabilities) and False
(accepted, certified), so it is counted but can never certify anything.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..certificates import accepts_rows, radius_rows
from ..criteria import Criterion
from ..divergences import divergence_rows
from ..summary import Summary, summarize

__all__ = [
    "TOPK_STORED",
    "SUMMARY_K",
    "StepCertifier",
    "BatchTrace",
    "trace_schema",
    "radius_column",
    "write_shard",
    "list_shards",
    "shard_prompt_ids",
    "SHARD_META_PROMPTS",
    "SHARD_META_SETTINGS",
]

TOPK_STORED = 16  # top-k ids/probs stored per step (target and drafter)
SUMMARY_K = 64  # partial sort kept on the device; exactness never depends on it
SHARD_META_PROMPTS = b"draftcert.prompt_ids"
SHARD_META_SETTINGS = b"draftcert.settings_sha256"
_PREFIX = {"forward": "radius", "reverse": "radius_reverse", "tv": "radius_tv"}


def radius_column(spec: str, divergence: str = "forward") -> str:
    return f"{_PREFIX[divergence]}/{spec}"


def trace_schema(criteria: Sequence[Criterion], divergences: Sequence[str], with_drafter: bool):
    """The Arrow schema of a trace shard (column order is part of the format)."""
    import pyarrow as pa

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
        ]
        fields += [pa.field(f"accepted/{c.spec}", pa.bool_()) for c in criteria]
        fields += [pa.field(f"certified/{c.spec}", pa.bool_()) for c in criteria]
    return pa.schema(fields)


def _summarize_guarded(logits: torch.Tensor, k: int, entropy: bool) -> tuple[Summary, torch.Tensor]:
    """summarize() that never raises on broken rows: returns (summary, nonfinite (A,) bool).

    One pass, no extra checks on the common path: a NaN/+inf/all -inf row makes
    the log-normaliser non-finite.  Only then are those rows replaced by zeros
    (uniform) and the batch re-summarised so the other rows stay exact."""
    s = summarize(logits=logits, k=k, entropy=entropy, validate=False)
    bad = ~torch.isfinite(s.log_norm)
    if entropy:
        bad |= ~torch.isfinite(s.entropy)
    if bool(bad.any()):
        clean = torch.where(bad[:, None], torch.zeros((), dtype=logits.dtype, device=logits.device), logits)
        s = summarize(logits=clean, k=k, entropy=entropy, validate=False)
    return s, bad


class StepCertifier:
    """Turns each step's logits into trace columns (torch tensors on the logits' device)."""

    def __init__(self, criteria: Sequence[Criterion], divergences: Sequence[str] = ("forward",)):
        self.criteria = list(criteria)
        self.divergences = list(divergences)
        if "forward" not in self.divergences:
            self.divergences.insert(0, "forward")
        self.k = max([SUMMARY_K, TOPK_STORED] + [c.min_k for c in self.criteria])

    def target_step(self, logits: torch.Tensor) -> tuple[dict[str, torch.Tensor], Summary, torch.Tensor]:
        """Columns of one step for A active rows, plus the summary (for the drafter later)."""
        summ, bad = _summarize_guarded(logits, self.k, entropy=True)
        top = summ.top_probs
        nan = torch.tensor(torch.nan, dtype=torch.float64, device=top.device)
        cols = {
            "target_margin": torch.where(bad, nan, top[:, 0] - top[:, 1]),
            "target_entropy": torch.where(bad, nan, summ.entropy),
            "target_topk_ids": summ.top_ids[:, :TOPK_STORED].to(torch.int32),
            "target_topk_probs": torch.where(bad[:, None], nan, top[:, :TOPK_STORED]).to(torch.float32),
            "nonfinite": bad,
        }
        for d in self.divergences:
            for c in self.criteria:
                cols[radius_column(c.spec, d)] = torch.where(bad, nan, radius_rows(c, summ, d))
        return cols, summ, bad

    def draft_step(self, summ: Summary, target_bad: torch.Tensor, draft_logits: torch.Tensor,
                   target_cols: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Drafter columns for the same A rows: divergences, acceptance, certificates."""
        dsumm, dbad = _summarize_guarded(draft_logits, TOPK_STORED, entropy=False)
        q = torch.exp(dsumm.source.double() - dsumm.log_norm[:, None])
        p = summ.probs_f64()
        bad = target_bad | dbad
        nan = torch.tensor(torch.nan, dtype=torch.float64, device=q.device)
        kl_f = torch.where(bad, nan, divergence_rows(p, q, "forward"))
        cols = {
            "draft_token": torch.argmax(q, dim=-1).to(torch.int32),  # the token accepts_rows judges
            "draft_topk_ids": dsumm.top_ids.to(torch.int32),
            "draft_topk_probs": torch.where(dbad[:, None], nan, dsumm.top_probs).to(torch.float32),
            "kl_forward": kl_f,
            "kl_reverse": torch.where(bad, nan, divergence_rows(p, q, "reverse")),
            "tv": torch.where(bad, nan, divergence_rows(p, q, "tv")),
            "draft_nonfinite": dbad,
        }
        ok = ~bad
        for c in self.criteria:
            cols[f"accepted/{c.spec}"] = accepts_rows(c, summ, q) & ok
        for c in self.criteria:
            # NaN radius or NaN divergence compare False: a broken step never certifies.
            cols[f"certified/{c.spec}"] = kl_f < target_cols[radius_column(c.spec, "forward")]
        return cols


@dataclass
class StepRows:
    """One step's columns for A rows of the batch."""

    rows: torch.Tensor  # (A,) batch indices
    position: int
    tokens: torch.Tensor  # (A,) target tokens
    cols: dict[str, torch.Tensor]


class BatchTrace:
    """Collects a batch's step columns on the device; converts to Arrow once."""

    def __init__(self, prompt_ids: Sequence[str], schema):
        self.prompt_ids = list(prompt_ids)
        self.schema = schema
        self.steps: list[StepRows] = []

    def add(self, step: StepRows) -> None:
        self.steps.append(step)

    def to_table(self):
        """Arrow table, rows ordered by (prompt in batch order, position)."""
        import pyarrow as pa

        rows = torch.cat([s.rows for s in self.steps]).cpu().numpy()
        pos = np.concatenate([np.full(s.rows.shape[0], s.position, dtype=np.int32) for s in self.steps])
        order = np.lexsort((pos, rows))  # primary key: row, then position
        n = order.shape[0]
        data = {
            "prompt_id": pa.array(np.asarray(self.prompt_ids, dtype=object)[rows[order]], type=pa.string()),
            "position": pa.array(pos[order], type=pa.int32()),
            "target_token": pa.array(torch.cat([s.tokens for s in self.steps]).cpu().numpy().astype(np.int32)[order]),
        }
        names = self.steps[0].cols.keys()
        for name in names:
            v = torch.cat([s.cols[name] for s in self.steps]).cpu().numpy()[order]
            if v.ndim == 2:  # fixed k per row -> list column via offsets (no Python loop)
                offsets = pa.array(np.arange(0, v.size + 1, v.shape[1], dtype=np.int32))
                data[name] = pa.ListArray.from_arrays(offsets, pa.array(v.reshape(-1)))
            else:
                data[name] = pa.array(v)
        cols = []
        for f in self.schema:
            arr = data[f.name]
            cols.append(arr if arr.type == f.type else arr.cast(f.type))
        assert all(len(c) == n for c in cols)
        return pa.Table.from_arrays(cols, schema=self.schema)


def write_shard(table, path: Path, prompt_ids: Sequence[str], settings_sha: str) -> None:
    """Atomic shard write: a hidden temporary file in the same directory, then os.replace."""
    import pyarrow.parquet as pq

    meta = dict(table.schema.metadata or {})
    meta[SHARD_META_PROMPTS] = json.dumps(list(prompt_ids)).encode()
    meta[SHARD_META_SETTINGS] = settings_sha.encode()
    table = table.replace_schema_metadata(meta)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, path)


_SHARD_RE = re.compile(r"^rank\d+-\d+\.parquet$")


def list_shards(trace_dir: Path) -> list[Path]:
    trace_dir = Path(trace_dir)
    if not trace_dir.is_dir():
        return []
    return sorted(p for p in trace_dir.iterdir() if _SHARD_RE.match(p.name))


def shard_prompt_ids(path: Path) -> tuple[list[str], str | None]:
    """(prompt ids, settings hash) recorded in a shard's footer (no data read)."""
    import pyarrow.parquet as pq

    try:
        meta = pq.read_schema(path).metadata or {}
    except Exception as exc:  # an unreadable shard cannot be half-written (atomic writes): say so
        raise ValueError(f"trace shard {path} is unreadable ({exc}); delete it and rerun to recompute its prompts") from None
    if SHARD_META_PROMPTS not in meta:
        raise ValueError(f"trace shard {path} lacks the draftcert prompt-id metadata; delete it and rerun")
    sha = meta.get(SHARD_META_SETTINGS)
    return json.loads(meta[SHARD_META_PROMPTS].decode()), (sha.decode() if sha else None)
