"""Real profile-style traces without a model: random target/drafter logits, every
column computed with the core library exactly as `draftcert profile` does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

import draftcert
from draftcert.tracefile import shard_name

CRITERIA = ["strict", "additive:0.2", "multiplicative:0.5", "topm:3", "entropy:0.09:0.3", "mars:0.5", "tree:4"]
V = 200
K = 16


def make_steps(seed: int = 0, lengths=(30, 27, 32, 25), drafter: bool = True, nonfinite=((1, 7),),
               draft_nonfinite=((2, 4),)) -> dict:
    """Columns (numpy) of all steps, rows ordered by (prompt, position)."""
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    # temperatures from very flat (some +inf radii for additive:0.2) to very peaked
    scale = np.exp(rng.uniform(np.log(0.05), np.log(8.0), n))[:, None]
    logits = rng.standard_normal((n, V)) * scale
    ties = rng.random(n) < 0.05  # exact top-2 ties: radius 0 for strict
    top = logits.argmax(1)
    other = (top + 1) % V
    logits[ties, other[ties]] = logits[ties, top[ties]]
    t = torch.from_numpy(logits)
    p = torch.softmax(t, -1)
    cols: dict = {
        "prompt_id": np.concatenate([[f"p{i}"] * L for i, L in enumerate(lengths)]).astype(object),
        "position": np.concatenate([np.arange(L) for L in lengths]).astype(np.int32),
        "target_token": t.argmax(-1).numpy().astype(np.int32),
    }
    tp, ti = torch.topk(p, K, dim=-1)
    cols["target_margin"] = (tp[:, 0] - tp[:, 1]).numpy().astype(np.float64)
    cols["target_entropy"] = (-torch.special.xlogy(p, p).sum(-1)).numpy()
    cols["target_topk_ids"] = ti.numpy().astype(np.int32)
    cols["target_topk_probs"] = tp.numpy().astype(np.float32)
    bad = np.zeros(n, bool)
    starts = np.cumsum((0,) + tuple(lengths))
    for prompt, pos in nonfinite:
        bad[starts[prompt] + pos] = True
    cols["nonfinite"] = bad
    for kind, prefix in (("forward", "radius"), ("reverse", "radius_reverse"), ("tv", "radius_tv")):
        for spec, r in draftcert.radii(CRITERIA, logits=logits, divergence=kind).items():
            r = np.asarray(r, np.float64).copy()
            r[bad] = np.nan
            cols[f"{prefix}/{spec}"] = r
    if drafter:
        sigma = np.exp(rng.uniform(np.log(0.02), np.log(3.0), n))[:, None]
        dl = logits + rng.standard_normal((n, V)) * sigma
        q = torch.softmax(torch.from_numpy(dl), -1)
        cols["draft_token"] = q.argmax(-1).numpy().astype(np.int32)
        dp, di = torch.topk(q, K, dim=-1)
        cols["draft_topk_ids"] = di.numpy().astype(np.int32)
        cols["draft_topk_probs"] = dp.numpy().astype(np.float32)
        # a step whose drafter logits were broken (as profile stores it: NaN KL, not accepted)
        dbad = np.zeros(n, bool)
        for prompt, pos in draft_nonfinite:
            dbad[starts[prompt] + pos] = True
        cols["draft_nonfinite"] = dbad
        for kind, name in (("forward", "kl_forward"), ("reverse", "kl_reverse"), ("tv", "tv")):
            d = np.asarray(draftcert.divergence(kind=kind, target_logits=logits, draft_logits=dl), np.float64).copy()
            d[bad | dbad] = np.nan
            cols[name] = d
        for spec in CRITERIA:
            acc = np.asarray(draftcert.accepts(spec, target_logits=logits, draft_logits=dl)).copy()
            acc[bad | dbad] = False
            cols[f"accepted/{spec}"] = acc
            # NaN radius / NaN KL compare False: a nonfinite step is never certified
            cols[f"certified/{spec}"] = cols["kl_forward"] < cols[f"radius/{spec}"]
    for c in ("target_margin", "target_entropy"):
        cols[c] = cols[c].copy()
        cols[c][bad] = np.nan
    return cols


def _table(cols: dict, rows: np.ndarray) -> pa.Table:
    data = {}
    for name, v in cols.items():
        v = v[rows]
        if name == "prompt_id":
            data[name] = pa.array(list(v), pa.string())
        elif v.ndim == 2:
            typ = pa.int32() if v.dtype == np.int32 else pa.float32()
            data[name] = pa.array(list(v), pa.list_(typ))
        else:
            data[name] = pa.array(v)
    return pa.table(data)


def write_run(out: Path, cols: dict, *, run_json: bool = True, seed: int = 0, epsilons=(0.05, 0.1, 0.3, 0.5)) -> list[Path]:
    """Shards across two ranks (prompts alternate ranks; each rank's steps split into
    two batches, rows shuffled inside a shard), plus run.json."""
    rng = np.random.default_rng(seed + 1)
    trace = out / "trace"
    trace.mkdir(parents=True, exist_ok=True)
    prompts = sorted(set(cols["prompt_id"]))
    paths = []
    for rank in (0, 1):
        mine = np.flatnonzero(np.isin(cols["prompt_id"], prompts[rank::2]))
        for b, rows in enumerate(np.array_split(mine, 2)):
            rows = rng.permutation(rows)
            path = trace / shard_name(rank, b)
            pq.write_table(_table(cols, rows), path, row_group_size=17)
            paths.append(path)
    if run_json:
        run = {
            "command": ["draftcert", "profile", "--out", str(out)],
            "target": "synthetic-target",
            "drafter": "synthetic-drafter" if "kl_forward" in cols else None,
            "criteria": CRITERIA,
            "epsilons": list(epsilons),
            "prompts": "synthetic",
            "max_new_tokens": 32,
            "versions": {"python": "3.11", "draftcert": draftcert.__version__},
            "world_size": 2,
        }
        (out / "run.json").write_text(json.dumps(run))
    return paths
