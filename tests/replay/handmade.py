"""Hand-built profile traces (no model): every column the replay reads, written as shards."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

K = 16
EOS = 99


def prompt_columns(pid: str, target: list[int], draft_ranks: list[list[int]], *, relaxed=None, kl=None, radius=None,
                   logp0=None, margin=None) -> dict:
    """Columns of one prompt.  ``draft_ranks[s]``: the drafter's top tokens at step s, rank order
    (padded with tokens 200+ to K).  ``relaxed``: {spec: (accepted (T,), mask (T,))} for level-set rules
    besides strict.  The target's top-K at step s is target[s] then 300+."""
    T = len(target)
    cols = {"prompt_id": [pid] * T, "position": list(range(T)), "target_token": target}
    tids = [[t] + [300 + i for i in range(K - 1)] for t in target]
    tprobs = [[0.6] + [0.4 / (K - 1)] * (K - 1) for _ in target]
    cols["target_topk_ids"], cols["target_topk_probs"] = tids, tprobs
    cols["target_margin"] = margin if margin is not None else [0.6 - 0.4 / (K - 1)] * T
    dids = [list(r) + [200 + i for i in range(K - len(r))] for r in draft_ranks]
    cols["draft_topk_ids"] = dids
    cols["draft_token"] = [r[0] for r in dids]
    cols["kl_forward"] = kl if kl is not None else [0.5] * T
    strict_acc = [d[0] == t for d, t in zip(dids, target)]
    strict_mask = [sum(1 << i for i in range(K) if d[i] == t) for d, t in zip(dids, target)]
    cols["draft_topk_target_logp"] = [[float(np.log(0.6)) if d[i] == t else (logp0[s] if (logp0 and i == 0) else -5.0)
                                       for i in range(K)] for s, (d, t) in enumerate(zip(dids, target))]
    cols["draft_token_target_rank"] = [0 if a else 5 for a in strict_acc]
    rules = {"strict": (strict_acc, strict_mask), **(relaxed or {})}
    for spec, (acc, mask) in rules.items():
        cols[f"accepted/{spec}"] = list(acc)
        cols[f"accept_mask/{spec}"] = list(mask)
        r = radius if radius is not None else [0.2] * T
        cols[f"radius/{spec}"] = r
        cols[f"certified/{spec}"] = [k < rr for k, rr in zip(cols["kl_forward"], r)]
    return cols


def write_trace(out: Path, prompts: list[dict], max_new_tokens: int, *, drafter: bool = True) -> Path:
    out = Path(out)
    (out / "trace").mkdir(parents=True, exist_ok=True)
    for i, cols in enumerate(prompts):
        data = {}
        for name, v in cols.items():
            if not drafter and (name.startswith(("draft", "accepted/", "accept_mask/", "certified/")) or name == "kl_forward"):
                continue
            if name in ("target_topk_ids", "draft_topk_ids"):
                data[name] = pa.array(v, pa.list_(pa.int32()))
            elif name in ("target_topk_probs", "draft_topk_target_logp"):
                data[name] = pa.array(v, pa.list_(pa.float32()))
            elif name in ("position", "target_token", "draft_token", "draft_token_target_rank") or name.startswith("accept_mask/"):
                data[name] = pa.array(v, pa.int32())
            else:
                data[name] = pa.array(v)
        pq.write_table(pa.table(data), out / "trace" / f"rank0-{i:06d}.parquet")
    specs = [c.split("/", 1)[1] for c in prompts[0] if c.startswith("radius/")]
    (out / "run.json").write_text(json.dumps({"status": "complete", "target": "hand-built", "drafter": "hand-built" if drafter else None,
                                              "criteria": specs, "max_new_tokens": max_new_tokens}))
    return out
