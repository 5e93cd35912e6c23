"""Timings that survive a shared machine (issue 23, item 4): the decode and the target alone
timed in turns with repeats, medians, a speedup flagged unreliable when the repeats disagree,
and the console launcher's bounded OpenMP spin (set only when the user has not chosen a policy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import draftcert_launcher
from draftcert.cli import main
from draftcert.cli.decode import timing_note
from draftcert.decode import bench
from draftcert.decode.engine import DecodeResult
from draftcert.decode.stats import DecodeStats
from draftcert.decode.timing import interleave, reliable, spread

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- interleaving


def test_interleave_takes_turns_and_flips_the_order():
    calls = []

    def run(name, seconds):
        it = iter(seconds)

        def f():
            calls.append(name)
            return next(it)
        return f

    times = interleave([run("A", [1.0, 2.0, 3.0]), run("B", [4.0, 5.0, 6.0])], 3)
    assert calls == ["A", "B", "B", "A", "A", "B"]  # neither always goes first
    assert times == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    with pytest.raises(ValueError, match="repeats"):
        interleave([run("A", [])], 0)


def test_spread_and_reliable():
    assert spread([1.0]) is None and reliable([1.0]) is None  # one timing: unknown, not "fine"
    assert spread([1.0, 1.1, 1.05]) == pytest.approx(0.1 / 1.05)
    assert reliable([1.0, 1.1, 1.05]) is True
    assert reliable([1.0, 0.3, 1.05]) is False  # one contended run among three


def _stats(spec_s, base_s, emitted=10, base_tokens=10):
    st = DecodeStats("strict", 4, None, emitted=emitted, baseline_tokens=base_tokens)
    st.repeat_seconds, st.baseline_repeat_seconds = list(spec_s), list(base_s)
    return st


def test_speedup_is_the_median_paired_ratio_and_flagged_when_repeats_disagree():
    ok = _stats([1.0, 1.02, 0.98], [2.0, 2.0, 2.0])
    assert ok.speedup == pytest.approx(2.0)
    assert ok.timing_reliable is True and ok.summary()["timing_reliable"] is True
    # a neighbour took the CPU during one speculative run: 0.1x there; the median is unmoved but flagged
    bad = _stats([1.0, 20.0, 1.0], [2.0, 2.0, 2.1])
    assert bad.speedup == pytest.approx(2.0)
    assert bad.timing_reliable is False and bad.summary()["timing_spread"] > 0.2
    assert bad.summary()["repeats"] == 3
    one = _stats([1.0], [2.0])
    assert one.timing_reliable is None and one.speedup == pytest.approx(2.0)


def test_timing_note_says_unreliable_rather_than_a_plain_figure():
    s = _stats([1.0, 20.0, 1.0], [2.0, 2.0, 2.1]).summary()
    assert "UNRELIABLE speedup" in timing_note(s, True)
    assert "agree" in timing_note(_stats([1.0, 1.0, 1.0], [2.0, 2.0, 2.0]).summary(), True)
    assert "one run" in timing_note(_stats([1.0], [2.0]).summary(), True)


def test_timed_generate_repeats_decode_and_baseline_in_turns(tiny, prompts, monkeypatch):
    target, drafter, _ = tiny
    order = []
    real_greedy = bench.greedy_generate

    def greedy(*a, **k):
        order.append("B")
        return real_greedy(*a, **k)

    monkeypatch.setattr(bench, "greedy_generate", greedy)
    rounds = []
    res = bench.timed_generate(target, drafter, prompts[0], "strict", k=2, max_new_tokens=8, baseline=True,
                               repeats=3, on_round=lambda log: (rounds.append(log), order.append("A")))
    st = res.stats
    assert len(st.repeat_seconds) == 3 and len(st.baseline_repeat_seconds) == 3
    assert len(rounds) == st.num_rounds  # only the first decode streams; the counters are one decode's
    assert order[-2:] == ["B", "B"] and order.count("B") == 3  # A B | B A | A B: the first A streamed
    assert st.baseline_match is True and st.emitted == 8
    assert st.seconds == sorted(st.repeat_seconds)[1]
    with pytest.raises(ValueError, match="repeats"):
        bench.timed_generate(target, drafter, prompts[0], "strict", k=2, max_new_tokens=4, repeats=0)


def test_bench_rows_time_the_criteria_in_turns_and_star_disagreeing_rows(monkeypatch):
    calls = []
    seconds = {"strict": iter([1.0, 1.0, 1.0]), "additive:0.1": iter([1.0, 9.0, 1.0])}

    def fake(target, drafter, ids, crit, **kw):
        calls.append(crit.spec)
        st = DecodeStats(crit.spec, kw["k"], None, emitted=10, num_rounds=5)
        st.seconds = next(seconds[crit.spec])
        return DecodeResult(tokens=[], stats=st)

    monkeypatch.setattr(bench, "speculative_generate", fake)
    rows = bench.bench_rows(None, None, [[1, 2]], ["strict", "additive:0.1"], 2, 8, repeats=3)
    assert calls == ["strict", "additive:0.1", "additive:0.1", "strict", "strict", "additive:0.1"]
    by = {r["criterion"]: r for r in rows}
    assert by["strict"]["timing_reliable"] is True and by["strict"]["tokens_per_second"] == pytest.approx(10.0)
    assert by["additive:0.1"]["timing_reliable"] is False and by["additive:0.1"]["tokens_per_second"] == pytest.approx(10.0)
    table = bench.format_table(rows, width=200)
    assert "10.00*" in table and "10.00 " in table.replace("10.00*", "")
    assert "UNRELIABLE (additive:0.1)" in bench.timing_footnote(rows, width=200)
    assert max(map(len, bench.timing_footnote(rows).splitlines())) <= 80


def test_decode_cli_json_carries_the_repeats(ckpt, capsys):
    rc = main(["decode", "--target", ckpt, "--drafter", "self:skip=1", "--prompt", "hello", "-k", "2",
               "--max-new-tokens", "4", "--baseline", "--repeats", "2", "--json", "--no-warmup", "--no-progress"])
    assert rc == 0
    s = json.loads(capsys.readouterr().out.splitlines()[-1])["summary"]
    assert s["repeats"] == 2 and len(s["baseline_repeat_seconds"]) == 2
    assert "timing_reliable" in s and "timing_spread" in s
    assert main(["decode", "--target", ckpt, "--prompt", "hi", "--drafter", "self:skip=1", "--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the launcher


def test_launcher_bounds_the_spin_only_when_the_user_chose_nothing():
    env = {}
    assert draftcert_launcher.set_wait_policy(env) == {"GOMP_SPINCOUNT": draftcert_launcher.SPIN_COUNT}
    assert env == {"GOMP_SPINCOUNT": draftcert_launcher.SPIN_COUNT}
    for user in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "0"}, {"OMP_WAIT_POLICY": "PASSIVE"}):
        env = dict(user)
        assert draftcert_launcher.set_wait_policy(env) == {} and env == user


def test_console_script_is_the_launcher():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["draftcert"] == "draftcert_launcher:main"


_PROBE = ("import os, sys, draftcert_launcher; assert 'torch' not in sys.modules; sys.argv = ['draftcert']; "
          "rc = draftcert_launcher.main(); "
          "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules, rc)")


@pytest.mark.parametrize("user,expected", [
    ({}, ["None", draftcert_launcher.SPIN_COUNT]),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, ["ACTIVE", "None"]),
])
def test_launcher_sets_the_spin_before_torch_loads(user, expected):
    env = {k: v for k, v in os.environ.items() if k not in draftcert_launcher.USER_KNOBS}
    env["PYTHONPATH"] = str(ROOT / "src")
    env.update(user)
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[-4:] == expected + ["True", "2"], out.stderr


@pytest.mark.parametrize("first,user,expected", [
    ("", {}, f"None {draftcert_launcher.SPIN_COUNT}"),  # the Python API gets the command's bound (issue 31)
    ("", {"OMP_WAIT_POLICY": "PASSIVE"}, "PASSIVE None"),  # the user's choice stands
    ("", {"GOMP_SPINCOUNT": "300000"}, "None 300000"),
    ("import torch; ", {}, "None None"),  # too late once torch (libgomp) is loaded: nothing is set
])
def test_importing_the_library_bounds_the_spin_before_torch_loads(first, user, expected):
    env = {k: v for k, v in os.environ.items() if k not in draftcert_launcher.USER_KNOBS}
    env["PYTHONPATH"] = str(ROOT / "src")
    env.update(user)
    code = (f"import os, sys; {first}import draftcert; assert 'torch' in sys.modules; "
            "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == expected, out.stderr
