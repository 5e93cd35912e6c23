"""Output folders that cannot be written (issue 31, item 1): one `draftcert: error:` line, exit 2,
before any model loads, for `profile --out`, `train-drafter --out`, and for `report DIR`,
`replay DIR` and `explain DIR` on a run folder that cannot be written.

The suite may run as root, which ignores permission bits, so the folders here are ones that truly
cannot be written: a path under /proc (no file or folder can be created there, not even by root),
and a read-only mount simulated at the os level (``os.open``/``os.mkdir`` refuse with EROFS, as the
kernel does on a read-only mount), which is what the probe write meets."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

import draftcert.cli.profile as cli_profile
import draftcert.cli.report as cli_report
import draftcert.cli.train as cli_train
from draftcert.cli import main
from draftcert.fileio import atomic_path, check_writable_dir

UNDER_PROC = "/proc/draftcert-no-such-dir/run"


def _one_error_line(err: str, start: str) -> str:
    assert "Traceback" not in err and err.count("draftcert: error") == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"draftcert: error: {start}"), err
    return last


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model (profiling, training) fails the test: the refusal must come first."""
    def fail(*a, **kw):
        pytest.fail("a model was loaded before the output folder was checked")

    monkeypatch.setattr(cli_profile, "profile", fail)
    monkeypatch.setattr(cli_train, "train_drafter", fail)
    monkeypatch.setattr(cli_train, "load_target", fail)


@pytest.fixture
def read_only(monkeypatch, tmp_path):
    """``tmp_path/ro`` behaves like a read-only mount: creating anything in it fails with EROFS."""
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "figures").mkdir()
    (ro / "trace").mkdir()
    (ro / "trace" / "rank0-000000.parquet").write_bytes(b"")  # a run folder (the shard is never read)
    real_open, real_mkdir = os.open, os.mkdir

    def inside(path) -> bool:
        return str(os.path.abspath(os.fspath(path))).startswith(str(ro))

    def fake_open(path, flags, *a, **kw):
        if inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))
        return real_open(path, flags, *a, **kw)

    def fake_mkdir(path, *a, **kw):
        if inside(path):
            raise OSError(errno.EROFS, "Read-only file system", os.fspath(path))
        return real_mkdir(path, *a, **kw)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    return ro


def test_profile_out_under_proc_is_one_line_before_any_model(no_model, capsys):
    assert main(["profile", "--prompts", "mt-bench", "--limit", "2", "--out", UNDER_PROC]) == 2
    line = _one_error_line(capsys.readouterr().err, "--out:")
    assert UNDER_PROC in line and "cannot be created" in line and "write to" in line
    assert not Path(UNDER_PROC).parent.exists()


def test_train_drafter_out_under_proc_is_one_line_before_any_model(no_model, capsys):
    assert main(["train-drafter", "--out", UNDER_PROC]) == 2
    _one_error_line(capsys.readouterr().err, "--out:")
    assert main(["train-drafter", "--out", UNDER_PROC, "--evaluate-only", "default"]) == 2
    _one_error_line(capsys.readouterr().err, "--out:")


@pytest.mark.parametrize("sub", ["", "new/run"])
def test_profile_out_on_a_read_only_mount(no_model, read_only, capsys, sub):
    out = read_only / sub if sub else read_only
    assert main(["profile", "--prompts", "mt-bench", "--out", str(out)]) == 2
    line = _one_error_line(capsys.readouterr().err, "--out:")
    assert "Read-only file system" in line


@pytest.mark.parametrize("command", ["report", "replay", "explain"])
def test_a_read_only_run_folder_is_one_line(monkeypatch, read_only, capsys, command):
    monkeypatch.setattr(cli_report, "write_report", lambda *a, **kw: pytest.fail("wrote into a read-only folder"))
    assert main([command, str(read_only)]) == 2
    line = _one_error_line(capsys.readouterr().err, "DIR:")
    assert "Read-only file system" in line and f"draftcert {command} COPY" in line


def test_probe_leaves_nothing_behind(tmp_path):
    (tmp_path / "run").mkdir()
    assert check_writable_dir(tmp_path / "run") == tmp_path / "run"
    assert check_writable_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["run"]  # no probe, no created folder
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NotADirectoryError):
        check_writable_dir(f / "sub")


def test_atomic_path_on_a_read_only_folder_raises_the_write_error_only(monkeypatch, tmp_path):
    """On a read-only file system unlink() of the never-created temporary fails too (EROFS): the
    clean-up must not add a second error (the double traceback of `report` on a read-only run)."""
    def unlink(self, missing_ok=False):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "unlink", unlink)
    with pytest.raises(OSError) as info:
        with atomic_path(tmp_path / "fig.png") as tmp:
            raise OSError(errno.EROFS, "Read-only file system", str(tmp))
    assert info.value.filename == str(tmp) and info.value.__context__ is None


def test_a_folder_that_turns_unwritable_mid_command_is_one_line(monkeypatch, tmp_path, capsys):
    """The checks passed, then a write failed (a remount, a full disk): one line, not a traceback."""
    def write_report(out, **kw):
        raise OSError(errno.EROFS, "Read-only file system", str(Path(out) / "figures" / ".radius_cdf.png.1.tmp"))

    monkeypatch.setattr(cli_report, "write_report", write_report)
    monkeypatch.setattr(cli_report, "section_for_report", lambda out: None)
    (tmp_path / "trace").mkdir()
    (tmp_path / "trace" / "rank0-000000.parquet").write_bytes(b"")  # a run folder (the shard is never read)
    assert main(["report", str(tmp_path)]) == 2
    line = _one_error_line(capsys.readouterr().err, "cannot write")
    assert "radius_cdf" in line and "Read-only file system" in line
