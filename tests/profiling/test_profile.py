"""End to end: `profile` on tiny random Qwen3 models (no downloads)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from draftcert import parse_criterion
from draftcert.criteria import TreeCoverage
from draftcert.divergences import pool_above, pool_below
from draftcert.profile import DEFAULT_CRITERIA, profile
from draftcert.summary import Summary

from .conftest import PROMPTS, VOCAB, tiny_qwen3

T = 10


def _read(out):
    t = pq.read_table(out / "trace")
    order = np.lexsort((t.column("position").to_numpy(), np.asarray(t.column("prompt_id").to_pylist())))
    return t.take(pa.array(order))


@pytest.fixture(scope="module")
def drafter():
    return tiny_qwen3(seed=1)


@pytest.fixture(scope="module")
def run_plain(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("plain")
    res = profile(target, None, PROMPTS, out=out, max_new_tokens=T, batch_size=2, progress=False,
                  divergences="forward,reverse,tv")
    return res, out


@pytest.fixture(scope="module")
def run_draft(target, drafter, tmp_path_factory):
    out = tmp_path_factory.mktemp("draft")
    res = profile(target, drafter, PROMPTS, out=out, max_new_tokens=T, batch_size=3, progress=False)
    return res, out


def test_schema_without_drafter(run_plain):
    res, out = run_plain
    t = _read(out)
    assert res.steps == t.num_rows == len(PROMPTS) * T and res.prompts == len(PROMPTS)
    s = t.schema
    assert s.field("prompt_id").type == pa.string()
    for c in ("position", "target_token"):
        assert s.field(c).type == pa.int32()
    for c in ("target_margin", "target_entropy"):
        assert s.field(c).type == pa.float64()
    assert s.field("target_topk_ids").type == pa.list_(pa.int32())
    assert s.field("target_topk_probs").type == pa.list_(pa.float32())
    assert s.field("nonfinite").type == pa.bool_()
    for spec in DEFAULT_CRITERIA:
        for pre in ("radius", "radius_reverse", "radius_tv"):
            assert s.field(f"{pre}/{spec}").type == pa.float64()
    assert "draft_token" not in s.names and not any(n.startswith("accepted/") for n in s.names)
    assert sorted(set(t.column("prompt_id").to_pylist())) == sorted(p for p, _ in PROMPTS)
    for pid, _ in PROMPTS:
        pos = t.filter(pa.compute.equal(t.column("prompt_id"), pid)).column("position").to_pylist()
        assert pos == list(range(T))
    ids = np.array(t.column("target_topk_ids").to_pylist())
    probs = np.array(t.column("target_topk_probs").to_pylist())
    assert ids.shape == probs.shape == (t.num_rows, 16)
    assert (np.diff(probs, axis=1) <= 0).all()
    np.testing.assert_array_equal(ids[:, 0], t.column("target_token").to_numpy())
    np.testing.assert_allclose(t.column("target_margin").to_numpy(), probs[:, 0] - probs[:, 1], atol=1e-6)
    meta = json.loads((out / "run.json").read_text())
    assert meta["status"] == "complete" and meta["criteria"] == list(DEFAULT_CRITERIA)
    assert meta["max_new_tokens"] == T and meta["world_size"] == 1 and "torch" in meta["versions"]
    assert meta["stats"]["steps"] == t.num_rows


@pytest.mark.parametrize("kind", ["forward", "reverse", "tv"])
def test_radii_agree_with_recomputation_from_stored_top16(run_plain, kind):
    """Rebuild the sorted top-16 values and recompute every radius with the core
    water-filling kernels wherever the decisive tokens lie in the top 16."""
    _, out = run_plain
    t = _read(out)
    s16 = torch.tensor(np.array(t.column("target_topk_probs").to_pylist()), dtype=torch.float64)
    ids16 = torch.tensor(np.array(t.column("target_topk_ids").to_pylist()))
    ent = torch.tensor(t.column("target_entropy").to_numpy())
    summ = Summary(s16, ids16, ent, None, VOCAB, None, s16, False)
    pre = {"forward": "radius", "reverse": "radius_reverse", "tv": "radius_tv"}[kind]
    checked = 0
    for spec in DEFAULT_CRITERIA:
        crit = parse_criterion(spec)
        got = torch.tensor(t.column(f"{pre}/{spec}").to_numpy())
        if isinstance(crit, TreeCoverage):
            want, rows = pool_below(s16[:, : crit.m + 1], crit.m, kind), torch.ones_like(got, dtype=torch.bool)
        else:
            tau = crit.threshold_from_summary(summ)
            rej = crit.rejected_mask(s16, tau[:, None])
            rows = rej.any(1)
            r = (16 - rej.sum(1)).clamp(max=15)
            want = pool_above(s16, r, kind)
            if spec.startswith("additive"):  # tau < 0: nothing can be rejected anywhere
                none = s16[:, 0] < crit.delta
                assert torch.isinf(got[none]).all()
        # float32 storage of p: compare where the margin is not at rounding level
        rows &= (s16[:, 0] - s16[:, 1]) > 1e-4
        torch.testing.assert_close(got[rows], want[rows], rtol=2e-3, atol=1e-7)
        checked += int(rows.sum())
    assert checked > 100


def test_drafter_columns_and_soundness(run_draft, target, drafter):
    res, out = run_draft
    assert res.soundness_violations == 0 and res.nonfinite_steps == 0
    t = _read(out)
    assert t.num_rows == len(PROMPTS) * T
    s = t.schema
    for c in ("draft_token",):
        assert s.field(c).type == pa.int32()
    for c in ("kl_forward", "kl_reverse", "tv"):
        assert s.field(c).type == pa.float64()
    assert s.field("draft_topk_probs").type == pa.list_(pa.float32())
    kl = t.column("kl_forward").to_numpy()
    for spec in DEFAULT_CRITERIA:
        acc = t.column(f"accepted/{spec}").to_numpy(zero_copy_only=False)
        cert = t.column(f"certified/{spec}").to_numpy(zero_copy_only=False)
        np.testing.assert_array_equal(cert, kl < t.column(f"radius/{spec}").to_numpy())
        assert not (cert & ~acc).any()
    # strict accepts exactly the target's own greedy token
    np.testing.assert_array_equal(t.column("accepted/strict").to_numpy(zero_copy_only=False),
                                  t.column("draft_token").to_numpy() == t.column("target_token").to_numpy())
    d_ids = np.array(t.column("draft_topk_ids").to_pylist())
    np.testing.assert_array_equal(d_ids[:, 0], t.column("draft_token").to_numpy())
    # tree:m accepts iff the target token is among the drafter's top-m
    tgt = t.column("target_token").to_numpy()
    for m in (2, 4, 8):
        np.testing.assert_array_equal(t.column(f"accepted/tree:{m}").to_numpy(zero_copy_only=False),
                                      (d_ids[:, :m] == tgt[:, None]).any(1))
    # divergences against a from-scratch computation on one prompt
    from draftcert import divergence

    model, tok = target
    pid, text = PROMPTS[1]
    from draftcert.prompts import encode_prompt

    sub = t.filter(pa.compute.equal(t.column("prompt_id"), pid))
    seq = list(encode_prompt(tok, text)) + sub.column("target_token").to_pylist()
    n = len(seq) - T
    with torch.no_grad():
        p = model(input_ids=torch.tensor([seq])).logits[0, n - 1:-1].double()
        q = drafter(input_ids=torch.tensor([seq])).logits[0, n - 1:-1].double()
    qp = torch.softmax(q, -1)
    np.testing.assert_allclose(np.array(sub.column("draft_topk_probs").to_pylist()),
                               torch.topk(qp, 16).values.numpy(), rtol=1e-5, atol=1e-7)
    pp = torch.softmax(p, -1)
    np.testing.assert_allclose(np.array(sub.column("target_topk_probs").to_pylist()),
                               torch.topk(pp, 16).values.numpy(), rtol=1e-5, atol=1e-7)
    for kind, col in (("forward", "kl_forward"), ("reverse", "kl_reverse"), ("tv", "tv")):
        want = divergence(target_logits=p, draft_logits=q, kind=kind).numpy()
        np.testing.assert_allclose(sub.column(col).to_numpy(), want, rtol=1e-4, atol=1e-6)


def test_drafter_with_other_vocabulary_is_refused_before_compute(target, tmp_path):
    other = tiny_qwen3(seed=2)
    other.resize_token_embeddings(VOCAB + 64)
    with pytest.raises(ValueError, match="vocabular"):
        profile(target, other, PROMPTS, out=tmp_path / "x", max_new_tokens=2, progress=False)
    assert not (tmp_path / "x" / "trace").exists()


def test_resume_after_interruption_equals_uninterrupted(target, drafter, run_draft, tmp_path):
    _, full_out = run_draft
    out = tmp_path / "resumed"
    calls = []

    def boom(info):
        calls.append(info)
        raise KeyboardInterrupt  # as if Ctrl-C arrived right after the first shard

    with pytest.raises(KeyboardInterrupt):
        profile(target, drafter, PROMPTS, out=out, max_new_tokens=T, batch_size=3, progress=False, on_batch=boom)
    assert len(calls) == 1 and len(list((out / "trace").glob("*.parquet"))) == 1
    assert json.loads((out / "run.json").read_text())["status"] == "interrupted"  # not left "running"
    stale = out / "trace" / ".rank0-000003.parquet.12345.tmp"  # what a kill -9 mid-write leaves
    stale.write_bytes(b"PAR1 truncated")
    res = profile(target, drafter, PROMPTS, out=out, max_new_tokens=T, batch_size=3, progress=False)
    assert res.new_prompts == len(PROMPTS) - len(calls[0]["prompt_ids"])
    assert res.prompts == len(PROMPTS) and res.soundness_violations == 0
    assert _read(out).equals(_read(full_out))
    assert not stale.exists()
    # a third run finds nothing to do
    again = profile(target, drafter, PROMPTS, out=out, max_new_tokens=T, batch_size=3, progress=False)
    assert again.new_prompts == 0 and again.steps == len(PROMPTS) * T


def test_resume_with_other_settings_is_refused(target, run_plain):
    _, out = run_plain
    with pytest.raises(ValueError, match=f"--max-new-tokens was {T}, now {T + 1}"):
        profile(target, None, PROMPTS, out=out, max_new_tokens=T + 1, batch_size=2, progress=False,
                divergences="forward,reverse,tv")
    with pytest.raises(ValueError, match="criteria"):
        profile(target, None, PROMPTS, out=out, max_new_tokens=T, criteria="strict", progress=False,
                divergences="forward,reverse,tv")


def test_nan_logits_are_flagged_and_counted_not_dropped(target, drafter, tmp_path):
    model, tok = target
    calls = {"n": 0}

    def poison(module, inputs, output):
        calls["n"] += 1
        if calls["n"] == 3:  # third target forward = decoding step 2; poison batch row 0 only
            output = output.clone()
            output[0, -1, 7] = float("nan")
            return output
        return output

    h = model.lm_head.register_forward_hook(poison)
    try:
        res = profile(target, drafter, PROMPTS[:2], out=tmp_path, max_new_tokens=T, batch_size=2, progress=False)
    finally:
        h.remove()
    assert res.nonfinite_steps == 1 and res.steps == 2 * T and res.soundness_violations == 0
    t = _read(tmp_path)
    bad = t.column("nonfinite").to_numpy(zero_copy_only=False)
    assert bad.sum() == 1
    i = int(np.nonzero(bad)[0][0])
    assert t.column("position")[i].as_py() == 2
    row = t.slice(i, 1).to_pylist()[0]
    for spec in DEFAULT_CRITERIA:
        assert np.isnan(row[f"radius/{spec}"]) and not row[f"certified/{spec}"] and not row[f"accepted/{spec}"]
    assert np.isnan(row["kl_forward"]) and np.isnan(row["target_margin"])
    ok = ~bad
    assert np.isfinite(t.column("radius/strict").to_numpy()[ok]).all()


def test_bad_inputs_name_the_argument(target, tmp_path):
    with pytest.raises(ValueError, match="prompts"):
        profile(target, None, [], out=tmp_path, progress=False)
    with pytest.raises(ValueError, match="criterion"):
        profile(target, None, PROMPTS, out=tmp_path, criteria="strict,nonsense:3", progress=False)
    with pytest.raises(ValueError, match="epsilons"):
        profile(target, None, PROMPTS, out=tmp_path, epsilons="0.1,-1", progress=False)
    with pytest.raises(ValueError, match="divergence"):
        profile(target, None, PROMPTS, out=tmp_path, divergences="forward,js", progress=False)
    with pytest.raises(ValueError, match="prompt id"):
        profile(target, None, [("a", "x"), ("a", "y")], out=tmp_path, progress=False)
