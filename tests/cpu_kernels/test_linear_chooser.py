"""Measured linear kernels (``draftcert.kernels.linear_chooser``): same function as the plain layers for
1..9 rows under every strategy, the measured choice cached per machine, copies kept in sync,
lossless decoding."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from draftcert.decode import greedy_generate, speculative_generate
from draftcert.kernels import linear_chooser, packed_matmul
from draftcert.models import loading
from tests.tiny_models import tiny_qwen3

STREAMED = pytest.param("streamed", marks=pytest.mark.skipif(not packed_matmul.LIBRARY.available(), reason=f"packed_matmul kernel: {packed_matmul.LIBRARY.reason()}"))
USABLE = [s if s != "streamed" else STREAMED for s in linear_chooser.STRATEGIES]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTCERT_CACHE", str(tmp_path / "cache"))  # plans go to a private cache


@pytest.fixture()
def plain():
    torch.set_num_threads(1)
    model, _ = tiny_qwen3(0, num_layers=2, hidden_size=48, intermediate_size=96, init_std=0.15)
    return model.float().eval().requires_grad_(False)


def _logits(m, ids):
    with torch.inference_mode():
        return m(input_ids=torch.tensor([ids])).logits[0]  # [rows, vocab]


@pytest.mark.parametrize("how", USABLE)
def test_every_strategy_gives_the_plain_logits_for_1_to_9_rows(plain, how):
    fast = copy.deepcopy(plain)
    n = linear_chooser.enable(fast, force=how)
    assert n == sum(type(m) is torch.nn.Linear for m in plain.modules()) and n > 0
    lin = next(m for m in fast.modules() if type(m) is linear_chooser.MeasuredLinear)
    assert lin.fl_choice == ("rowmajor",) + (how,) * (linear_chooser.MAX_ROWS - 1)
    if how != "rowmajor":  # the layout copy was made, and it is what the layer runs
        assert how in lin.fl_copies
    for rows in [*range(1, linear_chooser.MAX_ROWS + 1), 33]:
        ids = torch.randint(0, 256, (rows,), generator=torch.Generator().manual_seed(rows)).tolist()
        a, b = _logits(plain, ids), _logits(fast, ids)
        if rows == 1 or rows > linear_chooser.MAX_ROWS or how == "rowmajor":
            assert torch.equal(a, b)  # the original code path, bit for bit
        else:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)  # float32 rounding of another kernel


def test_a_wrong_kernel_is_caught(plain, monkeypatch):
    """The comparison above can fail: a kernel reading the weight transposed is refused as unusable."""
    w = torch.randn(8, 8)
    monkeypatch.setattr(linear_chooser, "_layout", lambda w, how: w.t().contiguous() if how == "colmajor" else w)
    assert not linear_chooser._usable("colmajor", w, None)
    assert linear_chooser._usable("rowmajor", w, None)


def test_measured_choice_is_cached_per_machine(plain, monkeypatch):
    fast = copy.deepcopy(plain)
    linear_chooser.enable(fast)
    plan = linear_chooser.plan_of(fast)
    assert plan and all(c[0] == "rowmajor" and set(c) <= set(linear_chooser.STRATEGIES) for c in plan.values())
    lin = next(m for m in fast.modules() if type(m) is linear_chooser.MeasuredLinear)
    key = linear_chooser.plan_key(tuple(lin.weight.shape), lin.weight.dtype, lin.bias is not None)
    rec = json.loads(linear_chooser.plan_path(key).read_text())
    assert rec["key"] == key and rec["key"]["cpu"] == linear_chooser.cpu_model()
    assert set(rec["seconds"]) >= {"rowmajor"} and len(rec["seconds"]["rowmajor"]) == linear_chooser.MAX_ROWS
    torch.testing.assert_close(_logits(fast, list(range(9))), _logits(plain, list(range(9))), rtol=1e-5, atol=1e-5)

    def no_timing(*a, **k):
        raise AssertionError("timed again although a plan is cached")

    monkeypatch.setattr(linear_chooser, "measure_passes", no_timing)
    again = copy.deepcopy(plain)
    linear_chooser.enable(again)  # read back from the cache, no timing
    assert linear_chooser.plan_of(again) == plan
    # another machine's plan (same file name, another CPU recorded), or one timed with another build
    # of draftcert's own kernel, is never used
    assert key["kernel"] == packed_matmul.LIBRARY.build_id()
    for other in ({"cpu": "Some Other CPU"}, {"kernel": "packed_matmul-another-build"}):
        rec["key"] = {**key, **other}
        linear_chooser.plan_path(key).write_text(json.dumps(rec))
        with pytest.raises(AssertionError, match="timed again"):
            linear_chooser.enable(copy.deepcopy(plain))


def test_state_dict_and_disable(plain):
    fast = copy.deepcopy(plain)
    linear_chooser.enable(fast, force="colmajor")
    assert fast.state_dict().keys() == plain.state_dict().keys()
    assert linear_chooser.is_enabled(fast) and not linear_chooser.is_enabled(plain)
    assert linear_chooser.enable(fast) == 0  # idempotent
    linear_chooser.disable(fast)
    assert not linear_chooser.is_enabled(fast)
    assert all("fl_copies" not in m.__dict__ for m in fast.modules())
    with pytest.raises(ValueError, match="unknown strategy"):
        linear_chooser.enable(fast, force="gemv")


@pytest.mark.parametrize("how", ["colmajor", "mkldnn", STREAMED])
def test_copy_follows_in_place_weight_changes(plain, how):
    fast = copy.deepcopy(plain)
    linear_chooser.enable(fast, force=how)
    ids = list(range(10, 18))
    _logits(fast, ids)  # the copies are in use
    with torch.no_grad():
        for m in (plain, fast):
            for mod in m.modules():
                if isinstance(mod, torch.nn.Linear):
                    mod.weight.mul_(0.5)  # e.g. quantize_rtn_ edits weights in place
    torch.testing.assert_close(_logits(fast, ids), _logits(plain, ids), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        for m in (plain, fast):
            for mod in m.modules():
                if isinstance(mod, torch.nn.Linear):
                    mod.weight.data = mod.weight.data * 2  # reassigned storage
    torch.testing.assert_close(_logits(fast, ids), _logits(plain, ids), rtol=1e-5, atol=1e-5)


def test_gradient_reaches_trainable_weights():
    lin = torch.nn.Linear(6, 5, bias=False).double()
    linear_chooser.enable(lin, force="colmajor")
    x = torch.randn(7, 6, dtype=torch.float64)
    lin(x).sum().backward()
    assert lin.weight.grad is not None and torch.allclose(lin.weight.grad, x.sum(0).expand(5, 6))


def test_float64_model_skips_the_float32_only_kernel():
    """oneDNN's prepacked kernel is float32 only: a float64 model never chooses it."""
    w = torch.randn(16, 8, dtype=torch.float64)
    assert not linear_chooser._usable("mkldnn", w, None)
    res = linear_chooser.measure_shape([w], repeats=1)
    assert "mkldnn" not in res["seconds"] and "mkldnn" not in res["choice"]


@pytest.mark.parametrize("how", ["colmajor", "mkldnn", STREAMED])
@pytest.mark.parametrize("tree", [None, (2, 3)])
def test_strict_decoding_on_a_measured_target_is_lossless(plain, how, tree):
    fast = copy.deepcopy(plain)
    linear_chooser.enable(fast, force=how)
    g = torch.Generator().manual_seed(7)
    for n in (3, 12):
        prompt = torch.randint(0, 256, (n,), generator=g).tolist()
        ref = greedy_generate(plain, prompt, 16, eos_token_id=[])
        assert greedy_generate(fast, prompt, 16, eos_token_id=[]) == ref
        res = speculative_generate(fast, "self:skip=1", prompt, "strict", k=4, tree=tree, max_new_tokens=16, eos_token_id=[])
        assert res.tokens == ref


def test_load_target_turns_it_on_only_for_models_that_fit(tmp_path, monkeypatch):
    """Auto (fast_linear=None): on for small CPU models, off once the copies would exceed the cap
    (they add up to two more copies of the linear weights); True/False force it."""
    model, tok = tiny_qwen3(seed=0)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    assert linear_chooser.is_enabled(loading.load_target(str(tmp_path / "m"))[0])
    assert not linear_chooser.is_enabled(loading.load_target(str(tmp_path / "m"), fast_linear=False)[0])
    monkeypatch.setattr(loading, "FAST_LINEAR_AUTO_MAX_BYTES", 1024)
    assert not linear_chooser.is_enabled(loading.load_target(str(tmp_path / "m"))[0])
    assert linear_chooser.is_enabled(loading.load_target(str(tmp_path / "m"), fast_linear=True)[0])


def test_timing_passes_run_the_model_in_order_within_a_byte_budget(monkeypatch):
    """measure_passes times the asked shapes inside passes over the layers in order; past the byte
    budget only the first layer of each shape not yet seen (a large model's LM head) is added."""
    mods = [torch.nn.Linear(16, 32, bias=False) for _ in range(4)] + [torch.nn.Linear(32, 8)]
    monkeypatch.setattr(linear_chooser, "TIMED_BYTES", 2 * 32 * 16 * 4)
    prefix = linear_chooser._timed_prefix(mods)
    assert prefix == [mods[0], mods[1], mods[4]]
    calls = []
    real = linear_chooser._apply
    monkeypatch.setattr(linear_chooser, "_apply", lambda how, x, w, b: calls.append((how, x.shape[0], tuple(x.shape))) or real(how, x, w, b))
    wanted = {((32, 16), torch.float32, False)}
    res = linear_chooser.measure_passes(mods, wanted, repeats=1, strategies=("rowmajor", "colmajor"), max_rows=3)
    assert set(res) == wanted
    r = res[((32, 16), torch.float32, False)]
    assert r["timed_layers"] == 2 and r["choice"][0] == "rowmajor" and len(r["seconds"]["colmajor"]) == 3
    # every pass ran the three layers in model order; the untimed shape always with rowmajor
    calls = [c for c in calls if c[1] <= 3]  # (not the usability check, on MAX_ROWS rows)
    assert len(calls) == 2 * 3 * 2 * 3  # (warm-up + 1 round) x 3 row counts x 2 strategies x 3 layers
    assert all(how == "rowmajor" for how, _, shape in calls if shape[1] == 32)
    assert {how for how, _, shape in calls if shape[1] == 16} == {"rowmajor", "colmajor"}
