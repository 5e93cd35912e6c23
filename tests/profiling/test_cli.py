"""`draftcert profile` / `draftcert reproduce-paper` through the real CLI entry point."""

from __future__ import annotations

import json
import os
from pathlib import Path
import socket
import subprocess
import sys

import pytest
import torch

from draftcert.cli import main

from .conftest import PROMPTS




def test_help_lists_the_options_and_examples(capsys):
    for cmd in ("profile", "reproduce-paper"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--target", "--drafter", "--prompts", "--criteria", "--epsilons", "--divergences", "--batch-size",
                 "--device", "--dtype", "examples:", "torchrun", "Qwen/Qwen3-4B"):
        assert flag in out


def test_profile_from_checkpoint_dir_with_self_drafter(tiny_dir, prompt_file, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["profile", "--target", str(tiny_dir), "--drafter", "self:skip=1", "--prompts", str(prompt_file),
            "--limit", "3", "--max-new-tokens", "4", "--criteria", "strict,tree:2", "--epsilons", "0.1",
            "--batch-size", "2", "--out", str(out), "--no-progress", "--no-report"]
    assert main(args) == 0
    meta = json.loads((out / "run.json").read_text())
    assert meta["drafter"] == "self:skip=1" and meta["target"] == str(tiny_dir) and meta["epsilons"] == [0.1]
    assert meta["stats"]["prompts"] == 3 and meta["stats"]["soundness_violations"] == 0
    assert meta["command"][:2] == ["draftcert", "profile"]
    assert "3 prompts" in capsys.readouterr().out
    # rerun: resumes, nothing left to do
    assert main(args) == 0
    assert "0 prompts / 0 steps new" in capsys.readouterr().out


def test_clear_errors_exit_2(tiny_dir, prompt_file, tmp_path, capsys):
    base = ["--max-new-tokens", "2", "--no-progress", "--no-report"]
    assert main(["profile", "--target", "no-such-org/no-such-model", "--prompts", str(prompt_file),
                 "--out", str(tmp_path / "a"), *base]) == 2
    err = capsys.readouterr().err
    assert "no-such-org/no-such-model" in err and ("local path" in err or "embedded" in err)
    assert main(["profile", "--target", str(tiny_dir), "--prompts", str(tmp_path / "missing.txt"),
                 "--out", str(tmp_path / "b"), *base]) == 2
    assert "missing.txt" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    assert main(["profile", "--target", str(tiny_dir), "--prompts", str(empty), "--out", str(tmp_path / "c"), *base]) == 2
    assert "no prompts" in capsys.readouterr().err
    assert main(["profile", "--target", str(tiny_dir), "--prompts", str(prompt_file), "--criteria", "tree:x",
                 "--out", str(tmp_path / "d"), *base]) == 2
    assert "tree:x" in capsys.readouterr().err


def test_reproduce_paper_says_exactly_what_is_missing(monkeypatch, capsys):
    from draftcert.profile import paper

    monkeypatch.setattr(paper.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(paper, "_hub_reachable", lambda repo, kind: (False, "the hub did not answer"))
    assert main(["reproduce-paper", "--out", "unused"]) == 3
    err = capsys.readouterr().err
    for what in ("GPU", "Qwen/Qwen3-1.7B", "Qwen/Qwen3-4B", "HuggingFaceH4/ultrachat_200k"):
        assert what in err
    # with everything present, --check reports readiness instead
    monkeypatch.setattr(paper.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(paper, "_hub_reachable", lambda repo, kind: (True, "cached"))
    monkeypatch.setattr(paper, "datasets_missing", lambda: False)  # CI's venv has no `datasets`
    assert main(["reproduce-paper", "--check"]) == 0


def test_reproduce_paper_writes_each_targets_report_from_the_cli(monkeypatch, tmp_path):
    """The profiler never writes the report (it sits a layer below it): the command does, once per target."""
    from draftcert.cli import profile as cli_profile
    from draftcert.profile import paper
    from draftcert.profile.run import ProfileResult

    ran, reported = [], []

    def fake_profile(target, drafter, prompts, *, out, **kw):
        ran.append(target)
        return ProfileResult(out, 4, 1, 0, 0, {}, 1, 4, {})

    monkeypatch.setattr(paper, "check_requirements", lambda *a: [])
    monkeypatch.setattr(paper, "profile", fake_profile)
    monkeypatch.setattr(cli_profile, "write_report", lambda out, **kw: reported.append(out))
    assert main(["reproduce-paper", "--out", str(tmp_path)]) == 0
    assert ran == list(paper.PAPER_TARGETS)
    assert reported == [tmp_path / t.split("/")[-1] for t in paper.PAPER_TARGETS]


@pytest.mark.slow
def test_torchrun_two_processes(tiny_dir, prompt_file, tmp_path):
    """The real launcher: torchrun --nproc_per_node 2 -m draftcert profile (gloo on CPU)."""
    out = tmp_path / "tr"
    # Only the package's own source dir: the tests/ dir on the child's path would shadow
    # top-level modules (stdlib `profile`, and `models` inside transformers' lazy imports).
    import draftcert

    src_dir = str(Path(draftcert.__file__).resolve().parents[1])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=src_dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "-m", "draftcert", "profile", "--target", str(tiny_dir), "--drafter", "self:skip=1",
           "--prompts", str(prompt_file), "--max-new-tokens", "4", "--out", str(out), "--no-progress",
           "--no-report"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, start_new_session=True)
    assert r.returncode == 0, r.stderr[-3000:]
    names = sorted(p.name for p in (out / "trace").glob("*.parquet"))
    assert any(n.startswith("rank0-") for n in names) and any(n.startswith("rank1-") for n in names)
    meta = json.loads((out / "run.json").read_text())
    assert meta["world_size"] == 2 and meta["stats"]["prompts"] == len(PROMPTS)
    assert meta["stats"]["soundness_violations"] == 0


def test_a_soundness_violation_is_loud_counted_and_fails_the_run(tiny_dir, prompt_file, tmp_path, monkeypatch, capsys):
    """Inject a bug (tree:2 never accepts) and check the run reports it as one."""
    from draftcert.profile import trace

    real = trace.accepts_from_topk

    def broken(criteria, *args):
        out = real(criteria, *args)
        out["tree:2"] = torch.zeros_like(out["tree:2"])
        return out

    monkeypatch.setattr(trace, "accepts_from_topk", broken)
    out = tmp_path / "v"
    rc = main(["profile", "--target", str(tiny_dir), "--drafter", "self:skip=1", "--prompts", str(prompt_file),
               "--max-new-tokens", "6", "--criteria", "strict,tree:2,tree:8", "--out", str(out), "--no-progress",
               "--no-report"])
    meta = json.loads((out / "run.json").read_text())
    n = meta["stats"]["violations_by_criterion"]["tree:2"]
    assert n > 0 and meta["stats"]["soundness_violations"] == n and rc == 1
    err = capsys.readouterr().err
    assert "SOUNDNESS VIOLATION" in err and "\033[" in err and "tree:2" in err
