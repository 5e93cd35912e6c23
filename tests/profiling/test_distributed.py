"""Data-parallel profile: two CPU processes (gloo), set up exactly as torchrun would."""

from __future__ import annotations

import json
import os
import socket

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.multiprocessing as mp

from draftcert.profile import profile

from .conftest import PROMPTS, byte_tokenizer, tiny_qwen3

T = 6


def _worker(rank, world, port, out, result_dir):
    # what torchrun exports; profile() joins the process group itself
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    res = profile((tiny_qwen3(0), byte_tokenizer()), tiny_qwen3(1), PROMPTS, out=out, max_new_tokens=T,
                  batch_size=2, progress=False)
    with open(os.path.join(result_dir, f"{rank}.json"), "w") as f:
        json.dump({"rank": res.rank, "world": res.world_size, "new_prompts": res.new_prompts,
                   "steps": res.steps, "violations": res.soundness_violations}, f)


def _failing_worker(rank, world, port, out, result_dir):
    """Rank 1 fails after its first shard; both ranks must stop (no hang), rank 0 saying why."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)

    def boom(info):
        if rank == 1:
            raise OSError("disk full (simulated)")

    try:
        profile((tiny_qwen3(0), byte_tokenizer()), None, PROMPTS, out=out, max_new_tokens=T, batch_size=1,
                progress=False, on_batch=boom)
        outcome = "finished"
    except Exception as exc:  # noqa: BLE001 - recorded for the parent to check
        outcome = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(result_dir, f"{rank}.txt"), "w") as f:
        f.write(outcome)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sorted(t):
    order = np.lexsort((t.column("position").to_numpy(), np.asarray(t.column("prompt_id").to_pylist())))
    return t.take(pa.array(order))


def test_two_ranks_split_prompts_and_match_a_single_process_run(target, tmp_path):
    out, res_dir = tmp_path / "dp", tmp_path / "res"
    res_dir.mkdir()
    # fork: the children inherit the imported torch/transformers (spawn would re-import them)
    mp.start_processes(_worker, args=(2, _free_port(), str(out), str(res_dir)), nprocs=2, join=True,
                       start_method="fork")
    results = {r: json.loads((res_dir / f"{r}.json").read_text()) for r in (0, 1)}
    assert results[0]["world"] == results[1]["world"] == 2
    # rank r profiles prompts i with i % 2 == r
    assert results[0]["new_prompts"] == 3 and results[1]["new_prompts"] == 2
    assert results[0]["steps"] == len(PROMPTS) * T  # rank 0 totals every shard
    assert results[0]["violations"] == 0
    shards = sorted(p.name for p in (out / "trace").glob("*.parquet"))
    assert any(s.startswith("rank0-") for s in shards) and any(s.startswith("rank1-") for s in shards)
    for s in shards:
        ids = json.loads(pq.read_schema(out / "trace" / s).metadata[b"draftcert.prompt_ids"])
        r = int(s[4])
        assert all(int(i[1:]) % 2 == r for i in ids)
    meta = json.loads((out / "run.json").read_text())
    assert meta["world_size"] == 2 and meta["status"] == "complete" and meta["stats"]["prompts"] == len(PROMPTS)

    single = profile(target, tiny_qwen3(1), PROMPTS, out=tmp_path / "single", max_new_tokens=T, batch_size=2,
                     progress=False)
    assert single.steps == results[0]["steps"]
    a, b = _sorted(pq.read_table(out / "trace")), _sorted(pq.read_table(tmp_path / "single" / "trace"))
    assert a.column("prompt_id").equals(b.column("prompt_id"))
    assert a.column("target_token").equals(b.column("target_token"))
    # batches differ between the two layouts, so values may differ at rounding level only
    for col in ("radius/strict", "radius/tree:4", "kl_forward"):
        np.testing.assert_allclose(a.column(col).to_numpy(), b.column(col).to_numpy(), rtol=1e-4, atol=1e-9)


def test_a_failing_rank_stops_all_ranks_and_the_run_resumes(target, tmp_path):
    out, res_dir = tmp_path / "dp", tmp_path / "res"
    res_dir.mkdir()
    ctx = mp.start_processes(_failing_worker, args=(2, _free_port(), str(out), str(res_dir)), nprocs=2, join=False,
                             start_method="fork")
    deadline = 120
    import time

    t0 = time.time()
    while not ctx.join(timeout=5):
        assert time.time() - t0 < deadline, "ranks hang after a failure"
    r0, r1 = (res_dir / "0.txt").read_text(), (res_dir / "1.txt").read_text()
    assert r1.startswith("OSError") and "another rank failed" in r0
    done = len(list((out / "trace").glob("*.parquet")))
    assert 1 <= done < len(PROMPTS)
    res = profile(target, None, PROMPTS, out=out, max_new_tokens=T, batch_size=1, progress=False)
    assert res.prompts == len(PROMPTS) and res.new_prompts == len(PROMPTS) - done
