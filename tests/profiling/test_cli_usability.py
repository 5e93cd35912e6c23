"""`draftcert profile` as a newcomer meets it: clear errors, run.json after an interrupt,
extending a run by raising --limit, and a table that fits 80 columns."""

from __future__ import annotations

import json
import os
import re
import signal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from draftcert.cli import main
from draftcert.profile import profile

from .conftest import PROMPTS, tiny_qwen3

QUIET = ["--no-progress", "--no-report"]




def _one_error_line(err: str, start: str) -> str:
    assert "Traceback" not in err and err.count("draftcert: error") == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"draftcert: error: {start}"), err
    return last


def test_out_is_a_file(tiny_dir, prompt_file, tmp_path, capsys):
    f = tmp_path / "a-file"
    f.write_text("x")
    for out in (f, f / "sub"):
        rc = main(["profile", "--target", str(tiny_dir), "--prompts", str(prompt_file), "--max-new-tokens", "2",
                   "--out", str(out), *QUIET])
        assert rc == 2
        line = _one_error_line(capsys.readouterr().err, "--out:")
        assert "a-file" in line and "not a directory" in line
    with pytest.raises(ValueError, match="out: .* is a file"):  # the API says it too
        profile((tiny_qwen3(0), None), prompts=["x"], out=f)


def test_unreachable_drafter_is_called_a_drafter(tiny_dir, prompt_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc = main(["profile", "--target", str(tiny_dir), "--drafter", "no-such-org/no-such-drafter", "--prompts",
               str(prompt_file), "--max-new-tokens", "2", "--out", str(tmp_path / "d"), *QUIET])
    assert rc == 2
    line = _one_error_line(capsys.readouterr().err, "--drafter:")
    assert "drafter 'no-such-org/no-such-drafter'" in line and "target 'no-such" not in line
    assert "self:skip" in line


def test_unknown_criteria_refused_before_loading_with_a_suggestion(prompt_file, tmp_path, capsys, monkeypatch):
    from draftcert.profile import run as run_mod

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before --criteria was checked")

    monkeypatch.setattr(run_mod, "load_target", no_load)  # the name profile() loads the target with
    rc = main(["profile", "--prompts", str(prompt_file), "--criteria", "strict,multiplicativ:0.5",
               "--out", str(tmp_path / "c"), *QUIET])
    assert rc == 2
    line = _one_error_line(capsys.readouterr().err, "--criteria:")
    assert "did you mean 'multiplicative:0.5'?" in line
    assert not (tmp_path / "c").exists()


def _status(out):
    return json.loads((out / "run.json").read_text())["status"]


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_run_json_says_interrupted(how, tiny_dir, prompt_file, tmp_path):
    out = tmp_path / how
    kw = dict(target=str(tiny_dir), prompts=str(prompt_file), out=out, max_new_tokens=3, batch_size=2,
              progress=False)

    def stop(info):
        if how == "ctrl-c":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)  # delivered at once: the handler raises in this thread

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        profile(on_batch=stop, **kw)
    assert signal.getsignal(signal.SIGTERM) is before  # the run's SIGTERM handler is gone again
    meta = json.loads((out / "run.json").read_text())
    assert meta["status"] == "interrupted" and "stats" not in meta
    assert len(list((out / "trace").glob("*.parquet"))) == 1
    res = profile(**kw)  # the same command resumes and completes
    assert _status(out) == "complete" and res.prompts == len(PROMPTS) and res.new_prompts == len(PROMPTS) - 2


@pytest.fixture
def python_sigint(monkeypatch):
    """SIGINT handled as in a plain `draftcert` process (KeyboardInterrupt), whatever the test runner set."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def _ctrl_c_in_first_batch(monkeypatch, presses: int):
    """Ctrl-C pressed ``presses`` times as the first batch starts decoding (issue 51, item 2)."""
    from draftcert.profile import batches

    real, seen = batches._decode, []

    def decode(*a, **k):
        if not seen:
            seen.append(1)
            for _ in range(presses):
                os.kill(os.getpid(), signal.SIGINT)  # handled at once, in this (the main) thread
        return real(*a, **k)

    monkeypatch.setattr(batches, "_decode", decode)


def test_ctrl_c_in_the_first_batch_keeps_it(tiny_dir, prompt_file, tmp_path, monkeypatch, capfd, python_sigint):
    """One Ctrl-C during the first batch: that batch is finished and written, then the run stops as
    interrupted; the rerun profiles only the rest and equals an uninterrupted run."""
    out = tmp_path / "c"
    kw = dict(target=str(tiny_dir), prompts=str(prompt_file), max_new_tokens=3, batch_size=2, progress=False)
    _ctrl_c_in_first_batch(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        profile(out=out, **kw)
    assert "finishing the batch in flight" in capfd.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # ours is gone again
    assert json.loads((out / "run.json").read_text())["status"] == "interrupted"
    shards = list((out / "trace").glob("*.parquet"))
    assert len(shards) == 1 and pq.read_table(shards[0]).num_rows == 2 * 3  # the first batch, whole
    monkeypatch.undo()
    res = profile(out=out, **kw)
    assert (res.new_prompts, res.prompts, _status(out)) == (len(PROMPTS) - 2, len(PROMPTS), "complete")
    profile(out=tmp_path / "whole", **kw)
    assert _trace(out).equals(_trace(tmp_path / "whole"))


def test_second_ctrl_c_stops_at_once(tiny_dir, prompt_file, tmp_path, monkeypatch, python_sigint):
    out = tmp_path / "c2"
    _ctrl_c_in_first_batch(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        profile(target=str(tiny_dir), prompts=str(prompt_file), max_new_tokens=3, batch_size=2, progress=False, out=out)
    assert json.loads((out / "run.json").read_text())["status"] == "interrupted"
    assert list((out / "trace").glob("*.parquet")) == []  # the batch in flight, given up
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_interrupt_line_promises_a_resume_only_where_there_is_one(tmp_path, capsys, monkeypatch):
    """decode, bench and replay keep nothing: their Ctrl-C line says "interrupted", not "rerun to resume"."""
    from draftcert.cli import decode as decode_cli, profile as profile_cli

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(decode_cli, "_load", stop)
    monkeypatch.setattr(profile_cli, "profile", stop)
    for argv, line in ((["decode", "--prompt", "Hi"], "interrupted"),
                       (["bench", "--prompt", "Hi"], "interrupted"),
                       (["profile", "--prompts", "mt-bench", "--out", str(tmp_path / "p")],
                        "interrupted; rerun the same command to resume")):
        assert main(argv) == 130
        assert capsys.readouterr().err.strip().splitlines()[-1] == line, argv


def test_a_settings_mismatch_names_the_options_not_internal_settings(tiny_dir, prompt_file, tmp_path, capsys):
    """Issue 51, item 4: changing --drafter on a run with a feature drafter listed "rollout: was [8, 8],
    now None", a setting no option has; the refusal names the options the user typed, and says when
    another version of draftcert wrote the run."""
    from draftcert.profile.settings import trace_settings_changes

    old = {"format": "draftcert-trace/3", "target": "embedded", "drafter": "eagle:smollm2-135m-instruct",
           "prompts": "mt-bench", "max_new_tokens": 64, "criteria": ["strict", "tree:4"], "divergences": ["forward"],
           "dtype": "default", "topk": 16, "rollout": [8, 8]}
    new = {**old, "drafter": "self:skip=5", "rollout": None}
    assert trace_settings_changes(old, new) == "--drafter was eagle:smollm2-135m-instruct, now self:skip=5"
    assert trace_settings_changes(old, {**old, "criteria": ["strict"], "rollout": [8, 16]}) == (
        "--criteria was strict,tree:4, now strict")
    assert trace_settings_changes(old, {**old, "format": "draftcert-trace/4"}) == (
        "the trace was recorded by another version of draftcert (draftcert-trace/3, now draftcert-trace/4)")
    assert trace_settings_changes(old, dict(old)) == ""
    out = tmp_path / "r"
    base = ["profile", "--target", str(tiny_dir), "--prompts", str(prompt_file), "--limit", "1", "--out", str(out), *QUIET]
    assert main(base + ["--max-new-tokens", "2"]) == 0
    capsys.readouterr()
    assert main(base + ["--max-new-tokens", "3", "--drafter", "self:skip=1"]) == 2
    line = _one_error_line(capsys.readouterr().err, "--out:")
    assert "(--drafter was none, now self:skip=1; --max-new-tokens was 2, now 3)" in line and "rollout" not in line


def test_a_failed_setup_never_rewrites_another_runs_run_json(tiny_dir, prompt_file, tmp_path):
    out = tmp_path / "r"
    kw = dict(target=str(tiny_dir), prompts=str(prompt_file), out=out, max_new_tokens=2, progress=False)
    profile(limit=1, **kw)
    before = (out / "run.json").read_bytes()
    with pytest.raises(ValueError, match="different settings"):
        profile(limit=1, criteria="strict", **kw)
    assert (out / "run.json").read_bytes() == before


def _trace(out):
    t = pa.concat_tables([pq.read_table(p) for p in sorted((out / "trace").glob("*.parquet"))])
    t = t.replace_schema_metadata(None)
    return t.sort_by([("prompt_id", "ascending"), ("position", "ascending")])


@pytest.mark.parametrize("batch", [1, 2])
def test_raising_limit_extends_the_run(batch, tiny_dir, prompt_file, tmp_path, capsys):
    base = ["profile", "--target", str(tiny_dir), "--drafter", "self:skip=1", "--prompts", str(prompt_file),
            "--max-new-tokens", "5", "--criteria", "strict,tree:2", "--batch-size", str(batch), *QUIET]
    ext, fresh = tmp_path / "ext", tmp_path / "fresh"
    assert main([*base, "--limit", "2", "--out", str(ext)]) == 0
    first = {p.name: p.read_bytes() for p in (ext / "trace").glob("*.parquet")}
    capsys.readouterr()
    assert main([*base, "--limit", "4", "--out", str(ext)]) == 0
    assert "4 prompts" in (o := capsys.readouterr().out) and re.search(r"\(2 prompts / \d+ steps new", o)
    after = {p.name: p.read_bytes() for p in (ext / "trace").glob("*.parquet")}
    assert all(after[n] == b for n, b in first.items())  # the shards it had are reused untouched
    meta = json.loads((ext / "run.json").read_text())
    assert meta["status"] == "complete" and meta["limit"] == 4 and meta["stats"]["prompts"] == 4
    assert main([*base, "--limit", "4", "--out", str(fresh)]) == 0
    a, b = _trace(ext), _trace(fresh)
    assert a.column_names == b.column_names and a.num_rows == b.num_rows
    for name in a.column_names:
        x, y = a.column(name).to_pylist(), b.column(name).to_pylist()
        floats = pa.types.is_floating(a.schema.field(name).type) or (
            pa.types.is_list(a.schema.field(name).type) and pa.types.is_floating(a.schema.field(name).type.value_type))
        if batch == 1 or not floats:
            assert x == y, name  # the same batches as a fresh run: identical, bit for bit
        else:  # other batch compositions: the same tokens and decisions, floats equal to rounding
            np.testing.assert_allclose(np.array(x, float), np.array(y, float), rtol=1e-4, atol=1e-6, err_msg=name)
    # a smaller limit would drop prompts: refused, with what to do
    capsys.readouterr()
    assert main([*base, "--limit", "3", "--out", str(ext)]) == 2
    line = _one_error_line(capsys.readouterr().err, "--out:")  # the library's `out:`, named as the option
    assert "4 prompts" in line and "--limit 4 or more" in line


def test_extending_needs_the_same_first_prompts(tiny_dir, prompt_file, tmp_path, capsys):
    out = tmp_path / "p"
    other = tmp_path / "other.txt"
    other.write_text("\n".join(["A different first prompt."] + [t for _, t in PROMPTS[1:]]) + "\n")
    # same file name stem -> same prompt ids, different text
    (tmp_path / "o").mkdir()
    moved = tmp_path / "o" / prompt_file.name
    moved.write_text(prompt_file.read_text())
    base = ["profile", "--target", str(tiny_dir), "--max-new-tokens", "2", "--out", str(out), *QUIET]
    assert main([*base, "--prompts", str(moved), "--limit", "2"]) == 0
    moved.write_text(other.read_text())
    capsys.readouterr()
    assert main([*base, "--prompts", str(moved), "--limit", "3"]) == 2
    assert "not the first 2 prompts" in _one_error_line(capsys.readouterr().err, "--out:")


def test_profile_table_fits_80_columns(tiny_dir, prompt_file, tmp_path, capsys, monkeypatch):
    from draftcert.report.render import table_rows

    monkeypatch.setenv("COLUMNS", "80")
    out = tmp_path / "t"
    assert main(["profile", "--target", str(tiny_dir), "--drafter", "self:skip=1", "--prompts", str(prompt_file),
                 "--limit", "3", "--max-new-tokens", "6", "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    lines = [l for l in text.splitlines() if str(out) not in l]  # lines naming a path may soft-wrap
    assert any(l.startswith("profile: model ") for l in lines)
    assert max(map(len, lines)) <= 80 and "…" not in text
    summary = json.loads((out / "summary.json").read_text())
    assert "replay" in summary and "## Replay" in (out / "report.md").read_text()  # a drafter: the replay section too
    _, rows = table_rows(summary, digits=3)
    for r in rows:
        shown = [t for l in lines if l.startswith("│") for c in [re.split(r"[\s│]+", l.strip("│ "))] if c[0] == r[0]
                 for t in c[1:]]
        assert shown == r[1:], (r, shown)  # every number whole, in order


def test_a_run_from_before_extension_resumes_and_extends(tiny_dir, prompt_file, tmp_path):
    """Run directories written before runs could be extended (shards hashed with the limit and
    the prompt list; run.json without n_prompts) still resume, and extend."""
    from draftcert.profile.settings import LEGACY_TRACE_KEYS, settings_sha
    from draftcert.tracefile import SHARD_META_SETTINGS

    out = tmp_path / "old"
    kw = dict(target=str(tiny_dir), prompts=str(prompt_file), out=out, max_new_tokens=3, progress=False)
    profile(limit=2, **kw)
    meta = json.loads((out / "run.json").read_text())
    for key in ("n_prompts", "shard_sha256"):
        del meta["settings"][key]
    (out / "run.json").write_text(json.dumps(meta))
    legacy = settings_sha(meta["settings"], LEGACY_TRACE_KEYS).encode()
    for p in (out / "trace").glob("*.parquet"):
        t = pq.read_table(p)
        pq.write_table(t.replace_schema_metadata({**t.schema.metadata, SHARD_META_SETTINGS: legacy}), p)
    assert profile(limit=2, **kw).new_prompts == 0  # resumes: nothing to do
    res = profile(limit=3, **kw)  # extends
    assert res.new_prompts == 1 and res.prompts == 3
