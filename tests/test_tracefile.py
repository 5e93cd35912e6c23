"""draftcert.tracefile: one shard-matching rule, clear errors for a missing or empty trace,
atomic shard writes with their footer, and the column reader report and replay share."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from draftcert.criteria import parse_criterion
from draftcert.tracefile import (
    accept_mask_column,
    column_specs,
    list_shards,
    load_run,
    radius_column,
    read_columns,
    run_epsilons,
    run_shards,
    shard_name,
    shard_prompt_ids,
    trace_schema,
    write_shard,
)


def _shard(path, prompts, positions, extra=None):
    cols = {"prompt_id": pa.array(prompts, pa.string()), "position": pa.array(positions, pa.int32()),
            "target_topk_ids": pa.array([[p, p + 1] for p in positions], pa.list_(pa.int32())),
            **(extra or {})}
    pq.write_table(pa.table(cols), path)


def test_only_rank_files_are_shards(tmp_path):
    assert list_shards(tmp_path / "missing") == []  # a fresh run: no trace folder yet
    for name in (shard_name(0, 0), shard_name(1, 4), shard_name(12, 8), ".rank0-000008.parquet.123.tmp",
                 "zz-copy.parquet", "rank0-000009.parquet.bak", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in list_shards(tmp_path)] == ["rank0-000000.parquet", "rank1-000004.parquet",
                                                       "rank12-000008.parquet"]
    assert [p.name for p in list_shards(tmp_path, rank=1)] == ["rank1-000004.parquet"]


def test_a_missing_or_empty_trace_says_what_to_run(tmp_path):
    with pytest.raises(ValueError, match="not a directory.*draftcert profile"):
        run_shards(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"is not a run folder \(it has no trace/ folder\)"):
        run_shards(tmp_path)
    (tmp_path / "trace").mkdir()
    with pytest.raises(ValueError, match=rf"no trace shards in {tmp_path / 'trace'}; run `draftcert profile --out"):
        run_shards(tmp_path)
    (tmp_path / "trace" / "old-batch0.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"old-batch0.parquet.*are not shards.*rank<r>-<i>.parquet"):
        run_shards(tmp_path)


def test_write_shard_is_atomic_and_records_its_prompts(tmp_path):
    schema = trace_schema([parse_criterion("strict"), parse_criterion("tree:2")], ["forward", "tv"], False)
    assert schema.names[:2] == ["prompt_id", "position"]
    assert column_specs(schema.names, "radius") == ["strict", "tree:2"]
    assert radius_column("tree:2", "tv") in schema.names and accept_mask_column("strict") not in schema.names
    table = pa.table({"prompt_id": pa.array(["a"]), "position": pa.array([0], pa.int32())})
    path = tmp_path / shard_name(0, 0)
    write_shard(table, path, ["a"], "sha")
    assert shard_prompt_ids(path) == (["a"], "sha")
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left behind


def test_read_columns(tmp_path):
    a, b = tmp_path / shard_name(0, 0), tmp_path / shard_name(1, 2)
    _shard(a, ["p1", "p0", "p1"], [1, 0, 0], {"kl_forward": pa.array([0.5, 1.0, 2.0])})
    _shard(b, ["p2", "p0"], [0, 1])
    got = read_columns([a, b], ["prompt_id", "position", "target_topk_ids"], ["kl_forward", "nonfinite"])
    assert got.n == 5 and got.prompt_names == ["p1", "p0", "p2"]  # codes in order of first appearance
    assert got["prompt_id"].tolist() == [0, 1, 0, 2, 1] and got["position"].dtype.kind == "i"
    assert got["target_topk_ids"].tolist() == [[1, 2], [0, 1], [0, 1], [0, 1], [1, 2]]
    assert "kl_forward" not in got and got.get("nonfinite") is None  # optional: only when every shard has it
    with pytest.raises(ValueError, match=rf"{b}.*lacks column.*kl_forward.*share criteria"):
        read_columns([a, b], ["prompt_id", "kl_forward"])
    empty = tmp_path / shard_name(2, 0)
    _shard(empty, [], [])
    with pytest.raises(ValueError, match="hold no rows"):
        read_columns([empty], ["prompt_id"])
    data = a.read_bytes()
    a.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"{a.name}.*delete it and rerun `draftcert profile`"):
        read_columns([a, b], ["prompt_id"])


def test_run_json(tmp_path):
    assert load_run(tmp_path) == {}
    (tmp_path / "run.json").write_text("[1]")
    with pytest.raises(ValueError, match="JSON object"):
        load_run(tmp_path)
    assert run_epsilons({"epsilons": "0.3, 0.1,0.3"}) == [0.1, 0.3]
    with pytest.raises(ValueError, match="finite and > 0"):
        run_epsilons({"epsilons": [0.1, 0]})
