"""The engine's cost curve (``draftcert.decode.draft_shape.costs``) and ``-k auto``'s choice of draft shape
(``draftcert.decode.draft_shape.shape``): the best predicted tokens/s on synthetic curves, the formula for
expected tokens per round, and a cache that never uses another machine's curve."""

from __future__ import annotations

import json

import pytest
import torch

from draftcert.decode.draft_shape import costs as costs_mod
from draftcert.decode.draft_shape.costs import Costs, engine_costs, round_seconds
from draftcert.drafting.make import make_drafter
from draftcert.decode.draft_shape.shape import CANDIDATES, Acceptance, acceptance_of, choose, expected_tokens
from tests.tiny_models import tiny_qwen3


def _curve(t_of_n, drafter=0.002, overhead=0.0005, step=None) -> Costs:
    """A synthetic cost curve: verification T(n) = t_of_n(n) seconds for n = 1..9 (tree mask alike)."""
    t = {n: t_of_n(n) for n in range(1, 10)}
    return Costs("calibrated", target=t, drafter={1: drafter}, target_tree=dict(t),
                 overhead={n: overhead * n for n in range(1, 10)}, target_step=step or t[1])


def _brute_best(c: Costs, acc: Acceptance) -> tuple[int, ...]:
    """The best candidate by direct arithmetic: chain/tree E over T(1 + nodes) + O + D * depth."""
    def rate(w):
        m, d = w[0], len(w)
        e, reach = 1.0, 1.0
        for i in range(1, d + 1):
            a1 = acc.by_depth[min(i, len(acc.by_depth)) - 1]
            am = 1 - (1 - a1) ** (1 + (m - 1) / 2)
            e += reach * am
            reach *= a1
        n = 1 + sum(w)
        return e / (c.target[n] + c.overhead[n] + d * c.drafter[1])
    return max(CANDIDATES, key=rate)


def test_k1_wins_when_every_extra_row_costs_a_pass():
    c = _curve(lambda n: 0.05 * n)  # a BLAS that re-reads the weights per row
    ch = choose(c, Acceptance((0.4,), "test"))
    assert ch.best.widths == (1,) == _brute_best(c, Acceptance((0.4,), "test"))
    assert ch.best.engine_args() == {"k": 1, "tree": None}
    assert ch.best.rate < ch.baseline_rate  # speculation predicted slower than the target alone here
    assert ch.slower_than_target and "No shape is predicted to beat the target alone" in ch.why()


def test_a_long_chain_wins_when_verification_is_flat_and_acceptance_high():
    c = _curve(lambda n: 0.05 + 0.0005 * n)
    acc = Acceptance((0.95, 0.9), "test")
    ch = choose(c, acc)
    assert ch.best.widths == (1,) * 6 == _brute_best(c, acc)
    assert ch.best.rate > ch.runner_up.rate and ch.best.rate > ch.baseline_rate
    assert not ch.slower_than_target and "No shape" not in ch.why()


def test_a_tree_wins_when_width_buys_more_than_depth():
    c = _curve(lambda n: 0.05 + 0.0005 * n)  # flat verification, low acceptance: width pays, depth does not
    acc = Acceptance((0.3,), "test")
    ch = choose(c, acc)
    assert max(ch.best.widths) > 1 and ch.best.widths == _brute_best(c, acc)
    assert ch.best.engine_args() == {"k": len(ch.best.widths), "tree": (ch.best.widths[0], len(ch.best.widths))}
    assert "runner-up" in ch.why() and ch.best.label in ch.why()


@pytest.mark.parametrize("seed", range(6))
def test_the_choice_is_the_best_predicted_rate_on_random_curves(seed):
    g = torch.Generator().manual_seed(seed)
    steps = torch.rand(9, generator=g) * 0.02
    base = 0.03 + float(torch.rand(1, generator=g)) * 0.05
    c = _curve(lambda n: base + float(steps[:n].sum()), drafter=float(torch.rand(1, generator=g)) * 0.01)
    acc = Acceptance(tuple(float(x) for x in torch.rand(3, generator=g)), "test")
    assert choose(c, acc).best.widths == _brute_best(c, acc)


def test_expected_tokens_per_round():
    assert expected_tokens(Acceptance((1.0,), "t"), 1, 4) == 5.0
    assert expected_tokens(Acceptance((0.0,), "t"), 2, 4) == 1.0
    assert expected_tokens(Acceptance((0.5,), "t"), 1, 2) == pytest.approx(1 + 0.5 + 0.25)
    a = Acceptance((0.5, 0.4), "t")  # the last depth's acceptance carries on
    assert expected_tokens(a, 1, 3) == pytest.approx(1 + 0.5 + 0.5 * 0.4 + 0.5 * 0.4 * 0.4)
    with pytest.raises(ValueError, match="probabilities"):
        Acceptance((1.2,), "t")


def test_round_seconds_prices_a_round_as_the_replay_does():
    c = _curve(lambda n: 0.01 * n, drafter=0.003)
    assert round_seconds(c, 3, [1, 1, 1], False, "1,1,1") == pytest.approx(0.04 + 0.002 + 0.009)
    c.drafter_round = {"1,1": 0.5}  # drafting timed whole wins over per-step D
    assert round_seconds(c, 2, [1, 1], False, "1,1") == pytest.approx(0.03 + 0.0015 + 0.5)
    with pytest.raises(ValueError, match="no drafting time"):
        round_seconds(c, 3, [1, 1, 1], False, "1,1,1")


def test_acceptance_comes_from_user_prompt_evaluations_only(tmp_path):
    # the shipped drafter's own figures on held-out user prompts (train.json's user_prompt_eval_fp16), never
    # its teacher-forced heldout_eval figures on the training source (optimistic)
    from draftcert.models.eagle import resolve_spec

    shipped = json.loads((resolve_spec("eagle:smollm2-135m-instruct").parent / "train.json").read_text())
    want = shipped["user_prompt_eval_fp16"]
    got = acceptance_of("eagle:smollm2-135m-instruct")
    assert got.by_depth == tuple(want[f"accept@{d}"] for d in range(1, len(got.by_depth) + 1))
    assert got.by_depth[0] != shipped["heldout_eval_fp16"]["accept@1"] and "user_prompt_eval" in got.source
    assert acceptance_of("self:skip=3").source.startswith("default")
    weights = tmp_path / "drafter.safetensors"
    weights.write_bytes(b"")
    (tmp_path / "train.json").write_text(json.dumps({
        "heldout_eval_fp16": {"accept@1": 0.9, "accept@2": 0.8},
        "user_prompt_eval": {"accept@1": 0.4, "accept@2": 0.25, "loss": 2.0}}))
    acc = acceptance_of(str(weights))
    assert acc.by_depth == (0.4, 0.25) and "user_prompt_eval" in acc.source
    assert acc.at(5) == 0.25  # the last measured depth carries on
    assert acceptance_of(f"{weights}+suffix") == acc  # suffix candidates add no figures of their own
    assert acceptance_of("default+suffix") == acceptance_of("default") == acceptance_of("eagle:smollm2-135m-instruct")
    assert acceptance_of("HybridDrafter").source.startswith("default")  # a drafter object's class name: the prior
    pair = acceptance_of("qwen2.5-coder-0.5b")  # the Qwen pair's drafter: measured by reproduce-paper --pair
    assert pair.by_depth == (0.813,) and "reproduce-paper" in pair.source
    assert acceptance_of("qwen2.5-coder-0.5b+suffix").by_depth == (0.813,)
    assert acceptance_of("qwen2.5-coder-0.5b@q4_1") == pair  # recomputed blocks start from the stored model's figure


@pytest.fixture()
def tiny_pair(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTCERT_CACHE", str(tmp_path / "cache"))
    torch.set_num_threads(1)
    target, _ = tiny_qwen3(0, num_layers=2, hidden_size=48, intermediate_size=96)
    return target.eval().requires_grad_(False), make_drafter("self:skip=1", target)


SHAPES = [((1,), False), ((1, 1), False), ((2, 2), False)]


def test_engine_costs_measures_once_then_reads_the_cache(tiny_pair, monkeypatch):
    target, drafter = tiny_pair
    c, src = engine_costs(target, drafter, "self:skip=1", SHAPES, repeats=1)
    assert src.startswith("measured now") and "cached at" in src
    assert set(c.target) == {1, 2, 3} and set(c.target_tree) == {5} and set(c.drafter_round) == {"1", "1,1", "2,2"}
    assert c.target_step > 0 and all(v > 0 for v in c.target.values())
    monkeypatch.setattr(costs_mod, "measure", lambda *a, **k: pytest.fail("measured again although cached"))
    again, src2 = engine_costs(target, drafter, "self:skip=1", SHAPES)
    assert src2.startswith("cached at") and again == c


def test_another_machines_curve_is_never_used(tiny_pair, monkeypatch):
    target, drafter = tiny_pair
    c, _ = engine_costs(target, drafter, "self:skip=1", SHAPES, repeats=1)
    key = costs_mod.costs_key(target, drafter, "self:skip=1", SHAPES)
    path = costs_mod.costs_path(key)
    rec = json.loads(path.read_text())
    rec["key"]["cpu"] = "Another CPU"  # the same file, recorded on another machine
    path.write_text(json.dumps(rec))
    assert costs_mod.cached_costs(key) is None
    calls = []
    monkeypatch.setattr(costs_mod, "measure", lambda *a, **k: calls.append(1) or c)
    _, src = engine_costs(target, drafter, "self:skip=1", SHAPES)
    assert calls and src.startswith("measured now")
    # and another thread count is another key
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    assert costs_mod.costs_key(target, drafter, "self:skip=1", SHAPES) != key


def test_decode_cli_picks_the_shape_and_says_why_in_one_line(ckpt, tmp_path, monkeypatch, capsys):
    """`draftcert decode` without -k: -k auto measures the curve once (then reads the cache), prints
    one line with the adaptive draft length's start, the target alone's predicted rate and where the
    figures came from, and stays lossless."""
    from draftcert.cli import main

    monkeypatch.setenv("DRAFTCERT_CACHE", str(tmp_path / "cache"))
    argv = ["decode", "--target", ckpt, "--drafter", "self:skip=1", "--prompt", "hello there",
            "--max-new-tokens", "8", "--json", "--no-warmup"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "-k auto:" in ln]
    assert len(lines) == 1 and "adaptive draft length" in lines[0] and "the target alone" in lines[0]
    assert "costs measured now" in lines[0] and "acceptance from default" in lines[0]
    assert main(argv) == 0
    again = [ln for ln in capsys.readouterr().err.splitlines() if "-k auto:" in ln]
    assert len(again) == 1 and "costs cached at" in again[0]
    assert lines[0].split(" (predicted")[0] == again[0].split(" (predicted")[0]  # the same curve, the same start


def test_speculative_generate_k_auto_is_the_clis_choice(tiny_pair):
    """`speculative_generate(..., k="auto")` decides as `draftcert decode -k auto` does: a chain rule gets
    the adaptive draft length (recorded in the stats), a tree:M rule the best tree of its width (the same
    cost curve and acceptance); both stay lossless, and an explicit tree is refused."""
    from draftcert.decode import greedy_generate, speculative_generate
    from draftcert.decode.draft_shape.adaptive import MAX_K
    from draftcert.decode.draft_shape.shape import auto_shape

    target, _ = tiny_pair
    prompt = [3, 14, 15, 92, 65, 35]
    res = speculative_generate(target, "self:skip=1", prompt, "strict", k="auto", max_new_tokens=8)
    assert res.stats.adaptive and res.stats.k == MAX_K and sum(res.stats.draft_lengths) == res.stats.num_rounds
    assert res.tokens == greedy_generate(target, prompt, max_new_tokens=8)
    res = speculative_generate(target, "self:skip=1", prompt, "tree:2", k="auto", max_new_tokens=8)
    choice, _ = auto_shape(target, make_drafter("self:skip=1", target), "self:skip=1", tree_width=2)  # cached
    assert not res.stats.adaptive and res.stats.tree == [2] * choice.best.engine_args()["k"]
    assert res.tokens == greedy_generate(target, prompt, max_new_tokens=8)
    with pytest.raises(ValueError, match="k='auto'"):
        speculative_generate(target, "self:skip=1", prompt, "strict", k="auto", tree=(2, 2), max_new_tokens=2)


def test_time_interleaved_runs_round_robin_drops_the_warm_up_and_times_only_run(monkeypatch):
    """The one timer of the cost curve and replay's calibrate: jobs in turns, repeats + 1 passes, the first
    dropped, before/after outside the timed span, the median kept, progress counted job by job."""
    clock = iter(range(1000))
    monkeypatch.setattr(costs_mod.time, "perf_counter", lambda: float(next(clock)))
    order, progress = [], []
    spans = {"a": [5, 1, 3, 2], "b": [9, 4, 6, 8]}  # per pass: pass 0 (the warm-up) is dropped

    def run(job):
        order.append(job)
        for _ in range(spans[job][order.count(job) - 1] - 1):  # the clock ticks once per perf_counter call
            next(clock)

    med = costs_mod.time_interleaved(["a", "b"], run, 3, before=lambda j: order.append("<"),
                                     after=lambda j: order.append(">"), on_progress=lambda d, t: progress.append((d, t)))
    assert [o for o in order if o in "ab"] == ["a", "b"] * 4
    assert order[:3] == ["<", "a", ">"]
    assert med == {"a": 2.0, "b": 6.0}  # medians of passes 1..3: (1, 3, 2) and (4, 6, 8)
    assert progress == [(i, 8) for i in range(1, 9)]


def test_a_model_drafters_catch_up_is_timed_and_a_model_free_drafters_is_not(tiny_pair):
    """``drafter_catch_up``: the one-token round with the drafter CATCH_UP_TOKENS further behind, per
    extra token; a drafter without a cache of its own (prompt lookup) has none."""
    target, drafter = tiny_pair
    c = costs_mod.measure(target, drafter.fork(), SHAPES, repeats=1)
    assert c.drafter_catch_up is not None and c.drafter_catch_up >= 0.0
    assert Costs.from_dict(json.loads(json.dumps(c.as_dict()))).drafter_catch_up == c.drafter_catch_up
    lookup = costs_mod.measure(target, make_drafter("prompt-lookup", target), [((1,), False)], repeats=1)
    assert lookup.drafter_catch_up is None


def test_the_target_rows_are_fitted_non_decreasing():
    """``rows_non_decreasing``: a curve that already rises is kept as measured; a greedy step timed dearer than
    the passes of 1-3 rows (the curve that made every draft look free) is pooled with them; and on random
    curves the fit is scipy's isotonic regression (an independent least-squares solver), non-decreasing, with
    the same total."""
    import numpy as np

    from draftcert.decode.draft_shape.costs import rows_non_decreasing

    assert rows_non_decreasing(5.0, {1: 5.2, 2: 5.5, 4: 6.0}) == (5.0, {1: 5.2, 2: 5.5, 4: 6.0})
    step, rows = rows_non_decreasing(8.79, {1: 7.01, 2: 6.906, 3: 7.064, 4: 8.106, 5: 8.431})
    pooled = (8.79 + 7.01 + 6.906 + 7.064) / 4
    assert step == pytest.approx(pooled) and [rows[n] for n in (1, 2, 3)] == pytest.approx([pooled] * 3)
    assert (rows[4], rows[5]) == (8.106, 8.431)
    try:
        from scipy.optimize import isotonic_regression
    except ImportError:  # scipy < 1.12
        pytest.skip("scipy.optimize.isotonic_regression needs scipy >= 1.12")
    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(1, 12))
        v = (5 + np.arange(n + 1) * 0.3 + rng.normal(0, 1.0, n + 1)).tolist()
        step, rows = rows_non_decreasing(v[0], dict(zip(range(1, n + 1), v[1:])))
        got = [step] + [rows[k] for k in range(1, n + 1)]
        assert np.allclose(got, isotonic_regression(v).x, rtol=0, atol=1e-12)
        assert all(a <= b + 1e-12 for a, b in zip(got, got[1:])) and sum(got) == pytest.approx(sum(v))
