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
