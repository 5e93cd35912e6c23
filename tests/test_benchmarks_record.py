"""benchmarks/record_run.py: a benchmark's output appended to its log in benchmarks/results/ with the
date, the CPU, the command and the commit; a failed run appends nothing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module(monkeypatch, here: Path):
    spec = importlib.util.spec_from_file_location("record_run", ROOT / "benchmarks" / "record_run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "HERE", here)
    return mod


def test_a_run_is_appended_to_its_log(tmp_path, monkeypatch, capsys):
    (tmp_path / "results").mkdir()
    (tmp_path / "bench_toy.py").write_text("import sys\nprint('toy_speedup=1.234')\nprint('args=' + ','.join(sys.argv[1:]))\n")
    mod = _module(monkeypatch, tmp_path)
    assert mod.main(["bench_toy.py", "--quick"]) == 0
    assert mod.main(["bench_toy.py", "--repeats", "2"]) == 0
    log = (tmp_path / "results" / "bench_toy_runs.md").read_text()
    assert log.startswith("# bench_toy.py: recorded runs") and log.count("\n## ") == 2
    assert "`python benchmarks/bench_toy.py --quick`" in log and "toy_speedup=1.234" in log and "args=--repeats,2" in log
    assert "toy_speedup=1.234" in capsys.readouterr().out  # shown as it ran


def test_a_failed_run_records_nothing(tmp_path, monkeypatch):
    (tmp_path / "results").mkdir()
    (tmp_path / "bench_bad.py").write_text("print('half a table')\nraise SystemExit(3)\n")
    mod = _module(monkeypatch, tmp_path)
    assert mod.main(["bench_bad.py"]) == 3
    assert not (tmp_path / "results" / "bench_bad_runs.md").exists()
    assert mod.main(["no_such_bench.py"]) == 2
