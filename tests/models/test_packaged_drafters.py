"""The feature drafters shipped inside the package (models/weights/): each file is there, readable,
names the target it was trained for, carries its acceptance measured on held-out user prompts beside
it, and stays small; the pair's holds Q8_0 blocks (what decoding computes from)."""

from __future__ import annotations

import json

import pytest

from draftcert.decode.draft_shape.shape import acceptance_of
from draftcert.models.eagle import DRAFTER_BLOCKS, FORMAT, PACKAGED, packaged_path

MAX_BYTES = 30 * 2**20  # issue 47: a shipped drafter is at most 30 MB


@pytest.mark.parametrize("name", sorted(PACKAGED))
def test_packaged_drafter_is_shipped_with_its_evaluation(name):
    from safetensors import safe_open

    path = packaged_path(name)
    assert path.is_file() and path.stat().st_size <= MAX_BYTES
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        keys = set(f.keys())
    assert meta["format"] == FORMAT and "vocab_ids" in keys
    fingerprint = json.loads(meta["fingerprint"])
    assert fingerprint["vocab_size"] > int(meta["n_draft_vocab"]) > 0
    rec = json.loads((path.parent / "train.json").read_text())
    by_depth = [rec["user_prompt_eval_fp16"][f"accept@{d}"] for d in (1, 2, 3)]
    assert all(0 < a < 1 for a in by_depth)
    assert acceptance_of(f"eagle:{name}").by_depth[:3] == tuple(by_depth)  # what -k auto starts from


def test_the_pairs_drafter_holds_q8_0_blocks():
    from safetensors import safe_open

    with safe_open(str(packaged_path("qwen2.5-coder-1.5b")), "pt") as f:
        meta = f.metadata()
    blocks = json.loads(meta["blocks"])
    assert blocks and set(blocks.values()) == {DRAFTER_BLOCKS} and "fc.weight" in blocks
    assert json.loads(meta["intermediate_size"]) == 2048
    assert json.loads(meta["fingerprint"])["vocab_size"] == 151936
