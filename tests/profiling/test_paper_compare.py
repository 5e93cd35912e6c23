"""`draftcert reproduce-paper --compare` and `--pair`: profile runs next to the study's published
figures (``profile.paper.PAPER_FIGURES``), the list of what differs from its setup, one clear
error for a directory that is no reported run, and the pair's CPU protocol (two ``profile``
calls, chat and code, each reported, then compared) with ``profile`` stubbed out."""

from __future__ import annotations

import json
import math
import re

import pytest

from draftcert.cli import main
from draftcert.fileio import write_json
from draftcert.profile import paper
from draftcert.profile.paper import PAPER_FIGURES, RunFigures, compare_runs
from draftcert.profile.run import ProfileResult

SPECS = ["strict", "entropy:0.09:0.3", "tree:8"]


def _summary(scale: float, *, drafter: bool = True) -> dict:
    """A summary.json as ``report.run_summary.summarize_trace`` writes it (the keys the comparison
    reads, and a few around them), with distinct numbers per criterion and statistic."""
    s: dict = {"steps": 256, "finite_steps": 256, "prompts": 4, "nonfinite_steps": 0, "criteria": SPECS,
               "epsilons": [0.05, 0.1, 0.3, 0.5], "models": {"target": "qwen2.5-coder-1.5b",
                                                             "drafter": "qwen2.5-coder-0.5b" if drafter else None}}
    for i, spec in enumerate(SPECS):
        d = {"radius_q05": scale * (i + 1) * 0.001, "radius_median": scale * (i + 1) * 0.1, "inf_fraction": 0.0,
             "certified_fraction": {"0.3": 0.5}, "certified_length": {"0.05": 9.0, "0.3": scale * (i + 1) * 1.5}}
        if drafter:
            d.update(accept_rate=0.7 + 0.01 * i, certified_rate=0.4 + 0.01 * i, soundness_violations=0)
        s[spec] = d
    if drafter:
        s["drafter_steps"] = 256
        s["drafter_kl_forward"] = {"q05": 0.001, "median": 0.0421, "mean": 0.2}
    return s


def _run_json(prompts: str, *, dtype: str = "float32", device: str = "cpu") -> dict:
    return {"format": "draftcert-trace/3", "status": "complete", "target": "qwen2.5-coder-1.5b",
            "drafter": "qwen2.5-coder-0.5b", "prompts": prompts, "limit": 4, "max_new_tokens": 64,
            "settings": {"dtype": "default", "n_prompts": 4}, "device": device, "model_dtype": dtype}


def _write_run(d, summary: dict, run: dict | None):
    d.mkdir(parents=True)
    write_json(d / "summary.json", summary)  # the JSON rule: +inf -> null, as the report writes it
    if run is not None:
        write_json(d / "run.json", run)
    return d


def _row(out: str, label: str) -> list[str]:
    """The cells of the table row called ``label``."""
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == label:
            return cells[1:]
    raise AssertionError(f"no row {label!r} in:\n{out}")


def test_compare_sets_each_runs_figures_next_to_the_studys(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one table
    chat = _write_run(tmp_path / "chat", _summary(1.0), _run_json("sharegpt"))
    code = _write_run(tmp_path / "code", _summary(2.0), _run_json("humaneval"))
    assert main(["reproduce-paper", "--compare", str(chat), str(code)]) == 0
    out = capsys.readouterr().out
    assert "2606.30265" in out
    head = _row(out, "figure")
    assert head == ["study", "chat", "code"]
    # the study's published figures, from the one table
    assert _row(out, "radius q05, strict") == ["≈ 0.006", "0.001", "0.002"]
    assert _row(out, "radius q05, entropy:0.09:0.3") == ["≈ 0.375", "0.002", "0.004"]
    assert _row(out, "radius q05, tree:8") == ["0.53–0.66", "0.003", "0.006"]
    assert _row(out, "certified length @ 0.3, strict") == ["≈ 2.9", "1.5", "3"]
    assert _row(out, "certified length @ 0.3, tree:8") == ["> 36", "4.5", "9"]
    # the runs' drafter figures, where the study has none
    assert _row(out, "accept rate, strict") == ["—", "0.7", "0.7"]
    assert _row(out, "certified rate, tree:8") == ["—", "0.42", "0.42"]
    assert _row(out, "drafter KL(p‖q) median") == ["—", "0.0421", "0.0421"]
    # what differs: models, prompts, precision, device, size
    diff = out[out.index("What differs"):]
    chat_part, code_part = diff.split("code (")
    for part, prompts in ((chat_part, "sharegpt"), (code_part, "humaneval")):
        assert "Qwen2.5-Coder-1.5B-Instruct" in part and "qwen2.5-coder-0.5b" in part
        assert "Qwen/Qwen3-1.7B" in part  # the study's side of each line
        assert re.search(rf"prompts: {prompts}\b.*; study: UltraChat", part)
        assert re.search(r"precision: float32; study: bfloat16", part)
        assert re.search(r"device: cpu; study: CUDA GPU", part)
        assert "4 prompts x 64 tokens (256 steps)" in part


def test_what_matches_the_study_is_not_listed_and_wide_tables_split_per_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "66")
    run = dict(_run_json("HuggingFaceH4/ultrachat_200k", dtype="bfloat16", device="cuda:0"),
               target="Qwen/Qwen3-4B", drafter=None)
    a = _write_run(tmp_path / "qwen3-4b-run", _summary(3.0, drafter=False), run)
    b = _write_run(tmp_path / "pair-chat-12", _summary(1.0), _run_json("sharegpt"))
    assert main(["reproduce-paper", "--compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    tables = out.split("What differs")[0]
    assert tables.count("| figure") == 2 and tables.count("≈ 0.006") == 2  # each run with the study's column
    assert max(len(line) for line in tables.splitlines() if line.startswith("|")) <= 66
    assert _row(out, "accept rate, strict") == ["—", "—"]  # no drafter: no rate (first table)
    first = out[out.index("qwen3-4b-run ("):out.index("pair-chat-12 (")]
    for same in ("target:", "drafter:", "prompts:", "precision:", "device:"):
        assert same not in first
    assert "size: 4 prompts x 64 tokens" in first


def test_null_radius_is_infinite_and_missing_figures_are_dashes(tmp_path):
    s = _summary(1.0)
    s["tree:8"]["radius_q05"] = math.inf  # written as null
    s["strict"]["certified_length"].pop("0.3")  # the run had other epsilons
    del s["entropy:0.09:0.3"]  # nor this criterion
    d = _write_run(tmp_path / "r", s, None)
    assert json.loads((d / "summary.json").read_text())["tree:8"]["radius_q05"] is None
    r = paper.read_run(d)
    by = {f.label: r.figure(f) for f in PAPER_FIGURES}
    assert by["radius q05, tree:8"] == math.inf
    assert by["certified length @ 0.3, strict"] is None and by["radius q05, entropy:0.09:0.3"] is None
    out = compare_runs([d])
    assert _row(out, "radius q05, tree:8")[1] == "inf"
    assert _row(out, "radius q05, entropy:0.09:0.3")[1] == "—"
    assert "run.json missing" in out and "target: qwen2.5-coder-1.5b" in out
    # no step at all: a null radius stays unknown
    s2 = dict(_summary(1.0), finite_steps=0)
    s2["strict"] = dict(s2["strict"], radius_q05=None)
    assert RunFigures(d, s2, {}).figure(PAPER_FIGURES[0]) is None


def test_runs_of_the_same_name_are_told_apart_by_their_paths(tmp_path):
    a = _write_run(tmp_path / "a" / "chat", _summary(1.0), _run_json("sharegpt"))
    b = _write_run(tmp_path / "b" / "chat", _summary(2.0), _run_json("sharegpt"))
    assert _row(compare_runs([a, b]), "figure") == ["study", str(a), str(b)]


def test_a_directory_that_is_no_reported_run_is_one_clear_error(tmp_path, capsys):
    good = _write_run(tmp_path / "good", _summary(1.0), _run_json("sharegpt"))
    unreported = tmp_path / "unreported"
    unreported.mkdir()
    write_json(unreported / "run.json", _run_json("sharegpt"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "summary.json").write_text("{not json")
    alien = _write_run(tmp_path / "alien", {"hello": 1}, None)
    cases = [(tmp_path / "nowhere", "is not a directory"), (unreported, f"draftcert report {unreported}"),
             (tmp_path, "no summary.json"), (broken, "unreadable"), (alien, "not a draftcert profile summary")]
    for bad, says in cases:
        assert main(["reproduce-paper", "--compare", str(good), str(bad)]) == 2
        cap = capsys.readouterr()
        assert cap.out == ""  # nothing half-printed
        err = cap.err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("draftcert: error: --compare: ") and str(bad) in err[0], err
        assert says in err[0]
    assert main(["reproduce-paper", "--compare", str(good), "--pair", "qwen2.5-coder"]) == 2
    assert "drop --pair" in capsys.readouterr().err


def test_pair_profiles_chat_and_code_reports_each_then_compares(tmp_path, monkeypatch, capsys):
    """The CPU protocol: profile twice (sharegpt into OUT/chat, humaneval into OUT/code) exactly as
    the GPU protocol calls it, the CLI writes each report, and the comparison follows."""
    from draftcert.cli import profile as cli_profile

    calls, reported = [], []

    def fake_profile(target, drafter, prompts, *, out, **kw):
        calls.append(dict(target=target, drafter=drafter, prompts=prompts, out=out, **kw))
        out.mkdir(parents=True)
        write_json(out / "run.json", _run_json(prompts))
        violations = 1 if out.parent.name == "bug" and prompts == "humaneval" else 0
        return ProfileResult(out, 256, 4, 0, violations, {}, 4, 256, {})

    def fake_report(out, **kw):
        reported.append(out)
        write_json(out / "summary.json", _summary(1.0 if out.name == "chat" else 2.0))

    monkeypatch.setattr(paper, "check_requirements", lambda *a: pytest.fail("the pair needs no GPU check"))
    monkeypatch.setattr(paper, "profile", fake_profile)
    monkeypatch.setattr(cli_profile, "write_report", fake_report)
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["reproduce-paper", "--pair", "qwen2.5-coder", "--out", str(tmp_path)]) == 0
    assert [(c["target"], c["drafter"], c["prompts"], c["out"]) for c in calls] == [
        ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "sharegpt", tmp_path / "chat"),
        ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "humaneval", tmp_path / "code")]
    for c in calls:
        assert (c["limit"], c["max_new_tokens"], c["device"]) == (4, 64, "cpu")
        assert list(c["criteria"]) == list(paper.DEFAULT_CRITERIA) and list(c["epsilons"]) == list(paper.DEFAULT_EPSILONS)
    assert reported == [tmp_path / "chat", tmp_path / "code"]
    out = capsys.readouterr().out
    assert _row(out, "figure") == ["study", "chat", "code"]
    assert _row(out, "radius q05, strict") == ["≈ 0.006", "0.001", "0.002"]
    assert "precision: float32; study: bfloat16" in out

    # a soundness violation in either run fails the command, as it fails `draftcert profile`
    assert main(["reproduce-paper", "--pair", "qwen2.5-coder", "--out", str(tmp_path / "bug")]) == 1
    assert "code (" in capsys.readouterr().out  # still compared

    calls.clear()
    monkeypatch.setattr(cli_profile, "write_report", lambda out, **kw: None)  # summaries stay from above
    assert main(["reproduce-paper", "--pair", "qwen2.5-coder", "--out", str(tmp_path / "again"), "--limit", "2",
                 "--max-new-tokens", "8", "--batch-size", "1"]) == 2  # no summary: the report "failed"
    assert [(c["limit"], c["max_new_tokens"], c["batch_size"]) for c in calls] == [(2, 8, 1)] * 2
    assert "draftcert report" in capsys.readouterr().err


def test_pair_option_errors(tmp_path, capsys):
    assert main(["reproduce-paper", "--pair", "no-such-pair", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--pair: unknown pair 'no-such-pair'" in err and "qwen2.5-coder" in err  # the known pairs
    assert main(["reproduce-paper", "--pair", "qwen2.5-coder", "--check"]) == 2
    assert "drop --check" in capsys.readouterr().err


def test_compare_reads_a_real_profile_run(tiny_dir, prompt_file, tmp_path, capsys, monkeypatch):
    """The schema as the profiler and the report write it (a tiny model, 2 prompts x 4 tokens;
    summary.json built as ``write_report`` builds it, without the figures)."""
    from draftcert.fileio import json_value
    from draftcert.report.run_summary import read_trace, summarize_trace
    from draftcert.textfit import compact_number
    from draftcert.tracefile import load_run, run_epsilons, run_shards

    out = tmp_path / "tiny"
    assert main(["profile", "--target", str(tiny_dir), "--drafter", "self:skip=1", "--prompts", str(prompt_file),
                 "--limit", "2", "--max-new-tokens", "4", "--out", str(out), "--no-progress", "--no-report"]) == 0
    run = load_run(out)
    summary, _ = summarize_trace(read_trace(run_shards(out)), run, run_epsilons(run))
    write_json(out / "summary.json", json_value(summary))
    capsys.readouterr()
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["reproduce-paper", "--compare", str(out)]) == 0
    text = capsys.readouterr().out
    for f in PAPER_FIGURES:
        if f.spec is None:
            want = summary["drafter_kl_forward"][f.stat]
        elif f.eps is not None:
            want = summary[f.spec][f.stat]["0.3"]
        else:
            want = summary[f.spec][f.stat]
        assert _row(text, f.label) == [f.study or "—", compact_number(want)], f.label
    diff = text[text.index("What differs"):]
    for says in (f"target: {tiny_dir}", "drafter: self:skip=1", f"prompts: {prompt_file}", "precision: float32",
                 "device: cpu", "2 prompts x 4 tokens (8 steps)"):
        assert says in diff, says


def test_the_docs_quote_the_studys_figures_from_the_one_table():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "profiling.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| reference study"))
    assert [c.strip() for c in row.strip("|").split("|")][1:] == [f.study for f in PAPER_FIGURES if f.study]
