"""write_report / `draftcert report` on real synthetic traces, checked against
independent numpy computations."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from draftcert.cli import main as cli_main
from draftcert.report import write_report
from draftcert.report.run_summary import quantile

from . import tracegen

EPS = (0.05, 0.1, 0.3, 0.5)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def steps():
    return tracegen.make_steps(seed=0)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, steps):
    out = tmp_path_factory.mktemp("run")
    tracegen.write_run(out, steps)
    summary = write_report(out, verbose=False)
    return out, summary


def expected_quantile(r: np.ndarray, q: float):
    """numpy's linear quantile, with +inf stood in by a huge finite value; +inf as summary.json
    writes it (null: the JSON rule)."""
    v = float(np.quantile(np.where(np.isinf(r), 1e300, r), q))
    return None if v > 1e299 else v


def brute_run_length(steps: dict, spec: str, eps: float) -> float:
    """Mean over finite steps of the number of consecutive steps (same prompt,
    consecutive positions, finite, radius >= eps) starting there."""
    r, bad = steps[f"radius/{spec}"], steps["nonfinite"]
    total, count = 0, 0
    for pid in sorted(set(steps["prompt_id"])):
        rows = np.flatnonzero(steps["prompt_id"] == pid)
        rows = rows[np.argsort(steps["position"][rows])]
        pos = steps["position"][rows]
        for i in range(len(rows)):
            if bad[rows[i]]:
                continue
            length, j = 0, i
            while j < len(rows) and not bad[rows[j]] and r[rows[j]] >= eps and pos[j] == pos[i] + (j - i):
                length += 1
                j += 1
            total += length
            count += 1
    return total / count


def test_summary_matches_independent_numpy(run_dir, steps):
    out, summary = run_dir
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk == summary
    ok = ~steps["nonfinite"]
    assert summary["steps"] == len(steps["position"])
    assert summary["prompts"] == 4
    assert summary["nonfinite_steps"] == 1
    assert summary["draft_nonfinite_steps"] == 1 and summary["drafter_steps"] == summary["steps"] - 2
    assert summary["epsilons"] == list(EPS)
    assert summary["models"] == {"target": "synthetic-target", "drafter": "synthetic-drafter"}
    assert summary["command"][:2] == ["draftcert", "profile"]
    assert summary["versions"]["python"] == "3.11"
    assert summary["criteria"] == tracegen.CRITERIA
    saw_inf = False
    for spec in tracegen.CRITERIA:
        d = summary[spec]
        r = steps[f"radius/{spec}"][ok]
        for key, q in (("radius_q05", 0.05), ("radius_median", 0.5)):
            exp = expected_quantile(r, q)
            saw_inf |= exp is None
            assert d[key] is None if exp is None else d[key] == pytest.approx(exp, rel=1e-12, abs=1e-300)
        for prefix in ("radius_reverse", "radius_tv"):
            rr = steps[f"{prefix}/{spec}"][ok]
            exp = expected_quantile(rr, 0.05)
            assert d[f"{prefix}_q05"] is None if exp is None else d[f"{prefix}_q05"] == pytest.approx(exp, rel=1e-12)
        for e in EPS:
            assert d["certified_fraction"][str(e)] == pytest.approx(np.mean(r >= e), abs=1e-15)
            assert d["certified_length"][str(e)] == pytest.approx(brute_run_length(steps, spec, e), rel=1e-12)
        acc, cert = steps[f"accepted/{spec}"], steps[f"certified/{spec}"]
        dok = ok & ~steps["draft_nonfinite"]
        assert d["accept_rate"] == pytest.approx(acc[dok].mean(), abs=1e-15)
        assert d["certified_rate"] == pytest.approx(cert[dok].mean(), abs=1e-15)
        assert d["soundness_violations"] == 0
        assert 0 < d["certified_rate"] < d["accept_rate"] <= 1  # the synthetic drafter is neither perfect nor useless
    assert saw_inf, "test data should exercise +inf radii (additive:0.2 on flat targets)"
    # +inf radii are certified for every eps: the additive:0.2 run lengths must exceed the strict ones
    assert summary["additive:0.2"]["certified_length"]["0.5"] > summary["strict"]["certified_length"]["0.5"]


def test_margin_bins(run_dir, steps):
    _, summary = run_dir
    mb = summary["margin_bins"]
    ok = ~steps["nonfinite"]
    m = steps["target_margin"][ok]
    edges = np.asarray(mb["edges"])
    assert edges[0] == 0 and edges[-1] == 1
    b = np.clip(np.digitize(m, edges) - 1, 0, len(edges) - 2)
    assert mb["steps"] == np.bincount(b, minlength=len(edges) - 1).tolist()
    for spec in ("strict", "tree:4"):
        r = steps[f"radius/{spec}"][ok]
        dok = ~steps["draft_nonfinite"][ok]
        acc = steps[f"accepted/{spec}"][ok]
        got = mb["by_criterion"][spec]
        for i in range(len(edges) - 1):
            sel = b == i
            if not sel.any():
                assert got["certified_fraction"]["0.3"][i] is None
                continue
            assert got["certified_fraction"]["0.3"][i] == pytest.approx(np.mean(r[sel] >= 0.3))
            assert got["accept_rate"][i] == pytest.approx(acc[sel & dok].mean())


def test_files_written(run_dir):
    out, summary = run_dir
    figs = sorted(p.name for p in (out / "figures").iterdir())
    # with a drafter the replay section (draftcert.replay, tested in tests/replay) adds its figures
    assert sorted(f for f in figs if not f.startswith("replay_")) == sorted(["radius_cdf.png", "certified_by_margin.png", "certified_length.png", "kl_vs_radius.png", "rates_by_margin.png"])
    import matplotlib.image as mpimg

    for name in figs:
        data = (out / "figures" / name).read_bytes()
        assert data[:8] == PNG_MAGIC
        img = mpimg.imread(out / "figures" / name)
        assert img.shape[0] > 200 and img.shape[1] > 300
    assert not list(out.rglob("*.tmp*")), "temporary files left behind"
    md = (out / "report.md").read_text()
    assert "| criterion | radius q05 | radius median | certified frac @0.3 | certified length @0.3 | accept rate | certified rate | soundness violations |" in md
    for spec in summary["criteria"]:
        assert f"| {spec} |" in md
    assert "+inf" in md  # additive:0.2 median radius
    assert "How to read this" in md and "figures/radius_cdf.png" in md and "synthetic-target" in md
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(figs) and "<table" in html and "How to read this" in html
    assert "src='figures/" not in html  # self-contained


def _rewrite_shard(path: Path, column: str, fn) -> None:
    t = pq.read_table(path)
    i = t.schema.get_field_index(column)
    t = t.set_column(i, column, pa.array(fn(t.column(column).to_numpy())))
    pq.write_table(t, path)


def test_forged_violation_is_counted_via_cli(run_dir, tmp_path, capsys):
    """A certified-but-rejected row is counted; also runs `draftcert report` and a missing run.json."""
    out, summary = run_dir
    work = tmp_path / "forged"
    shutil.copytree(out / "trace", work / "trace")
    shard = sorted((work / "trace").glob("*.parquet"))[0]
    cert = pq.read_table(shard, columns=["certified/strict"]).column(0).to_numpy()
    row = int(np.flatnonzero(cert)[0])

    def forge(acc):
        acc = acc.copy()
        assert acc[row]
        acc[row] = False  # certified but (supposedly) rejected
        return acc

    _rewrite_shard(shard, "accepted/strict", forge)
    assert cli_main(["report", str(work)]) == 0
    text = capsys.readouterr().out
    assert "strict" in text and str(work / "summary.json") in text and "report.html" in text
    assert "run.json not found" in text
    s = json.loads((work / "summary.json").read_text())
    assert s["strict"]["soundness_violations"] == 1
    assert s["tree:4"]["soundness_violations"] == 0
    for key in ("radius_q05", "radius_median", "certified_fraction", "certified_length", "certified_rate"):
        assert s["strict"][key] == summary["strict"][key]
    assert s["strict"]["accept_rate"] == pytest.approx(summary["strict"]["accept_rate"] - 1 / summary["drafter_steps"])
    assert "notes" in s and "run.json" in s["notes"][0]  # no run.json copied: defaults, and it says so
    assert s["epsilons"] == [0.05, 0.1, 0.3, 0.5] and s["command"] is None
    assert "| note |" in (work / "report.md").read_text()


def test_no_drafter_and_custom_epsilons(tmp_path):
    steps = tracegen.make_steps(seed=3, lengths=(12, 9), drafter=False, nonfinite=())
    tracegen.write_run(tmp_path, steps, epsilons=(0.2, 0.02))
    run = json.loads((tmp_path / "run.json").read_text())
    (tmp_path / "run.json").write_text(json.dumps({**run, "status": "running"}))
    s = write_report(tmp_path, verbose=False)
    assert s["epsilons"] == [0.02, 0.2] and s["nonfinite_steps"] == 0 and s["prompts"] == 2
    assert "not complete" in s["notes"][0]
    for spec in tracegen.CRITERIA:
        assert "accept_rate" not in s[spec] and "soundness_violations" not in s[spec]
        assert set(s[spec]["certified_length"]) == {"0.02", "0.2"}
        assert s[spec]["certified_length"]["0.2"] == pytest.approx(brute_run_length(steps, spec, 0.2))
    assert sorted(p.name for p in (tmp_path / "figures").iterdir()) == ["certified_by_margin.png", "certified_length.png", "radius_cdf.png"]
    assert "| accept rate |" not in (tmp_path / "report.md").read_text()


def test_errors(tmp_path, run_dir):
    out, _ = run_dir
    with pytest.raises(ValueError, match="not a directory"):
        write_report(tmp_path / "nope", verbose=False)
    with pytest.raises(ValueError, match="is not a run folder \\(it has no trace/ folder\\)"):
        write_report(tmp_path, verbose=False)
    (tmp_path / "trace").mkdir()
    with pytest.raises(ValueError, match="no trace shards"):
        write_report(tmp_path, verbose=False)
    # a truncated shard: named, with the fix
    work = tmp_path / "trunc"
    shutil.copytree(out / "trace", work / "trace")
    shard = sorted((work / "trace").glob("*.parquet"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"{shard.name}.*delete it and rerun `draftcert profile`"):
        write_report(work, verbose=False)
    assert not (work / "summary.json").exists()
    # a shard written twice
    dup = tmp_path / "dup"
    shutil.copytree(out / "trace", dup / "trace")
    first = sorted((dup / "trace").glob("*.parquet"))[0]
    shutil.copy(first, dup / "trace" / "rank7-000000.parquet")
    with pytest.raises(ValueError, match="appears more than once"):
        write_report(dup, verbose=False)
    # bad run.json epsilons
    bad = tmp_path / "bad"
    shutil.copytree(out / "trace", bad / "trace")
    (bad / "run.json").write_text(json.dumps({"epsilons": [0.1, -1]}))
    with pytest.raises(ValueError, match="epsilons"):
        write_report(bad, verbose=False)


def test_cli_errors_and_help(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["report", "--help"])
    assert "summary.json" in capsys.readouterr().out


def test_quantile_handles_inf():
    inf = math.inf
    assert quantile(np.array([1.0, 2.0, inf, inf]), 0.5) == inf  # between 2 and inf
    assert quantile(np.array([1.0, 2.0, 3.0, inf]), 0.5) == 2.5
    assert quantile(np.array([0.0, inf]), 0.0) == 0.0
    assert quantile(np.array([inf, inf]), 0.3) == inf
    assert math.isnan(quantile(np.array([]), 0.5))
    x = np.random.default_rng(0).exponential(size=101)
    for q in (0.05, 0.5, 0.93):
        assert quantile(x, q) == pytest.approx(np.quantile(x, q), rel=1e-14)


def test_length_curve_is_exact(run_dir, steps):
    """The figure's continuous-eps curve (window attribution) equals
    certified_run_length's mean at every eps, including eps equal to a radius."""
    from draftcert.report.run_summary import RunGrid, read_trace
    from draftcert.tracefile import run_shards

    out, summary = run_dir
    tr = read_trace(run_shards(out))
    grid = RunGrid(tr)
    for spec in tracegen.CRITERIA:
        g = grid.grid(tr.radius["forward"][spec])
        f = grid.length_curve(g)
        r = tr.radius["forward"][spec]
        r = r[np.isfinite(r) & (r > 0)]
        eps = np.r_[np.logspace(-9, 1, 30), np.random.default_rng(0).choice(r, 15)]
        got = f(eps)
        for e, v in zip(eps, got):
            assert v == pytest.approx(grid.mean_length(g, e), rel=1e-12)
        assert got[0] == pytest.approx(brute_run_length(steps, spec, eps[0]), rel=1e-12)
        assert f([0.3])[0] == pytest.approx(summary[spec]["certified_length"]["0.3"], rel=1e-12)


def test_all_steps_nonfinite(tmp_path):
    """Nothing finite to summarise: statistics are null, steps are still counted, files still written."""
    steps = tracegen.make_steps(seed=4, lengths=(3,), drafter=False, nonfinite=((0, 0), (0, 1), (0, 2)))
    tracegen.write_run(tmp_path, steps)
    s = write_report(tmp_path, verbose=False)
    assert s["steps"] == 3 and s["nonfinite_steps"] == 3 and s["finite_steps"] == 0
    assert s["strict"]["radius_median"] is None and s["strict"]["certified_length"]["0.3"] is None
    assert (tmp_path / "report.html").exists() and len(list((tmp_path / "figures").glob("*.png"))) == 3


def test_sparse_positions(tmp_path):
    """Offset and gapped positions: a gap breaks a run, ordering is by position (not row order)."""
    steps = tracegen.make_steps(seed=6, lengths=(20, 15), drafter=False, nonfinite=((0, 3),))
    keep = np.ones(35, bool)
    keep[[5, 6, 12]] = False  # gaps in prompt 0
    steps = {k: v[keep] for k, v in steps.items()}
    steps["position"] = steps["position"] + 1000  # offset: positions need not start at 0
    tracegen.write_run(tmp_path, steps)
    s = write_report(tmp_path, verbose=False)
    for spec in ("strict", "additive:0.2"):
        for e in EPS:
            exp = brute_run_length(steps, spec, e)
            assert s[spec]["certified_length"][str(e)] == pytest.approx(exp, rel=1e-12)
    assert s["additive:0.2"]["certified_length"]["0.05"] > 1.5  # real multi-step runs are exercised
