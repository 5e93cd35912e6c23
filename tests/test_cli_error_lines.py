"""Error lines and help a command-line user can act on (issue 31, friction): each mistake names the
option and the fix, before any model loads; `demo` and `explain` explain what they print."""

from __future__ import annotations

import pytest

import draftcert.cli.profile as cli_profile
from draftcert.cli import build_parser, main
from draftcert.cli.demo import run_demo
from draftcert.replay.explain import CATEGORIES


def _one_error_line(err: str, start: str) -> str:
    assert "Traceback" not in err and err.count("draftcert: error") == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"draftcert: error: {start}"), err
    return last


@pytest.fixture
def no_profile(monkeypatch, tmp_path):
    monkeypatch.setattr(cli_profile, "profile", lambda *a, **kw: pytest.fail("profiled (and loaded a model) first"))
    return ["profile", "--prompts", "mt-bench", "--limit", "1", "--out", str(tmp_path / "run")]


def test_unknown_divergence_names_the_option_and_the_values(no_profile, capsys):
    assert main(no_profile + ["--divergences", "forward,kl"]) == 2
    line = _one_error_line(capsys.readouterr().err, "--divergences: unknown divergence 'kl'")
    assert "forward" in line and "reverse" in line and "tv" in line and "--divergences forward,reverse,tv" in line


def test_unknown_dtype_names_the_option_and_the_values(no_profile, capsys):
    assert main(no_profile + ["--dtype", "float8"]) == 2
    line = _one_error_line(capsys.readouterr().err, "--dtype: 'float8'")
    assert "float32, bfloat16 or float16" in line
    assert main(no_profile + ["--dtype", "int8"]) == 2  # a torch dtype, but not one models compute in
    _one_error_line(capsys.readouterr().err, "--dtype: 'int8'")


@pytest.mark.parametrize("drafter", ["prompt-lookup", "suffix", "default+suffix"])
def test_profile_with_a_model_free_drafter_points_to_the_cli(no_profile, capsys, drafter):
    assert main(no_profile + ["--drafter", drafter]) == 2
    line = _one_error_line(capsys.readouterr().err, "--drafter:")
    assert "speculative_generate" not in line and "draftcert decode --drafter" in line


@pytest.mark.parametrize("vocab", ["1", "0", "-3", "3"])
def test_demo_vocab_too_small_names_the_option(capsys, vocab):
    assert main(["demo", "--vocab", vocab]) == 2
    line = _one_error_line(capsys.readouterr().err, "--vocab:")
    assert ">= 4" in line and "negative dimensions" not in line


def test_replay_k_range_written_high_low(tmp_path, capsys):
    assert main(["replay", str(tmp_path), "-k", "8-1"]) == 2
    line = _one_error_line(capsys.readouterr().err, "-k: the range '8-1' is empty")
    assert "-k 1-8" in line and "got ()" not in line


def _help(command: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return sub.format_help()


def test_demo_help_has_examples():
    text = _help("demo")
    assert "examples:" in text and "draftcert demo --criteria" in text


def test_demo_explains_the_tied_top_row():
    text = run_demo(["strict", "tree:2"], ["forward"])
    assert "tied top" in text.split("Note")[0]  # the row is there ...
    note = text.split("Note (tied top)")[1]  # ... and so is why tree:2 is below strict on it
    assert "strict" in note and "tree:2" in note and "theory.md" in note


def test_explain_help_lists_every_category_it_prints():
    text = " ".join(_help("explain").split())
    for cat in CATEGORIES:
        assert cat.replace("_", " ") in text, cat


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: a prompt source is read, and refused, before any model loads."""
    import draftcert.models
    from draftcert.profile import run as run_mod

    def fail(*a, **k):
        raise AssertionError("a model was loaded before --prompts was read")

    monkeypatch.setattr(run_mod, "load_target", fail)
    monkeypatch.setattr(draftcert.models, "load_target", fail)


@pytest.mark.parametrize("command", [["profile", "--out", "OUT"], ["bench"]])
def test_prompt_source_errors_name_prompts(command, no_model, tmp_path, capsys):
    """Issue 51, item 4: a missing file, a bad JSON line and a mistyped set name each name --prompts
    (the set name with a did-you-mean, as the other specs)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{bad\n')
    argv = [str(tmp_path / "run") if a == "OUT" else a for a in command]
    for source, want in ((str(tmp_path / "missing.jsonl"), f"--prompts: prompt file '{tmp_path / 'missing.jsonl'}' does not exist"),
                         (str(bad), f"--prompts: {bad}:2: not valid JSON"),
                         ("mt-bnech", "--prompts: unknown prompt source 'mt-bnech'")):
        assert main(argv + ["--prompts", source]) == 2
        line = _one_error_line(capsys.readouterr().err, want)
        assert line.endswith("did you mean 'mt-bench'?") == (source == "mt-bnech"), line


@pytest.mark.parametrize("command", ["replay", "explain", "report"])
def test_run_folder_errors_name_dir(command, tmp_path, capsys):
    """Issue 51, item 4: `replay`, `explain` and `report` name DIR (what the user typed, not the library's
    out_dir), and a folder that holds no run, /proc included, is "not a run folder" (report said that
    /proc "cannot be written")."""
    assert main([command, str(tmp_path / "nowhere")]) == 2
    _one_error_line(capsys.readouterr().err, f"DIR: {tmp_path / 'nowhere'} is not a directory")
    for folder in (tmp_path, "/proc"):
        assert main([command, str(folder)]) == 2
        line = _one_error_line(capsys.readouterr().err, f"DIR: {folder} is not a run folder")
        assert "cannot be written" not in line and "out_dir" not in line
