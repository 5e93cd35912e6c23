"""The command line's refusals: a model that cannot be reached or does not exist, a misspelt
drafter, a bad --tree, option names in errors, --version, --threads, file permissions and
help text that fits a terminal.  Each refusal is one `draftcert: error:` line, exit 2, no
traceback, and nothing written."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

import draftcert
import draftcert.models
from draftcert.cli import build_parser, main, name_option
from draftcert.cli.checks import check_drafter, suggest_drafter
from draftcert.fileio import atomic_path, atomic_write
from tests.tiny_models import tiny_qwen3

NO_SUCH_HUB_ID = "no-such-org/no-such-model"


def _one_error_line(err: str, start: str) -> str:
    assert "Traceback" not in err and err.count("draftcert: error") == 1, err
    lines = err.strip().splitlines()
    last = lines[-1]  # transformers' own weight-loading bar may come before
    assert last.startswith(f"draftcert: error: {start}"), err
    return last


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No hub (as on a machine without network, but deterministic and instant) and a fresh cwd."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    f.write_text("hi\nyes\n")
    return f


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny Qwen3 checkpoint directory, as a user would pass to --target."""
    d = tmp_path_factory.mktemp("tiny-ckpt")
    model, tok = tiny_qwen3(0)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


# ----------------------------------------------------------------------------- item 1: unreachable models

@pytest.mark.parametrize("target", [NO_SUCH_HUB_ID, "./no/such/checkpoint"])
@pytest.mark.parametrize("argv", [
    ["decode", "--prompt", "hi", "--drafter", "prompt-lookup"],
    ["bench", "--drafter", "prompt-lookup", "--limit", "1", "--no-progress"],
    ["train-drafter", "--out", "runs/x", "--examples", "2", "--quiet"],
    ["profile", "--prompts", "PROMPT_FILE", "--out", "runs/p", "--no-progress"],
], ids=lambda a: a[0] if isinstance(a, list) else None)
def test_an_unreachable_target_is_one_error_line_and_writes_nothing(argv, target, prompt_file, offline, capsys):
    argv = [str(prompt_file) if a == "PROMPT_FILE" else a for a in argv]
    assert main([*argv, "--target", target]) == 2
    line = _one_error_line(capsys.readouterr().err, "--target:")
    assert f"target {target!r}" in line and "Pass" in line  # names the model and says what to do
    assert not (offline / "runs").exists()  # train-drafter used to leave an empty runs/x
    assert list(offline.iterdir()) == []


def test_replay_calibrate_with_an_unreachable_target_is_one_error_line(tiny_dir, offline, capsys):
    from draftcert.profile import profile

    out = offline / "run"
    profile(str(tiny_dir), "self:skip=1", ["hi", "yes"], out=out, max_new_tokens=3, criteria="strict",
            progress=False)
    run_json = out / "run.json"
    run = json.loads(run_json.read_text())
    run["target"] = NO_SUCH_HUB_ID  # as if the run came from a machine with the hub
    run_json.write_text(json.dumps(run))
    before = sorted(p.name for p in out.iterdir())
    rc = main(["replay", str(out), "--calibrate", "--repeats", "1", "-k", "1", "--trees", "", "--static", "",
               "--no-figures"])
    assert rc == 2
    line = _one_error_line(capsys.readouterr().err, "")
    assert f"target {NO_SUCH_HUB_ID!r}" in line and "hub is unreachable" in line
    assert sorted(p.name for p in out.iterdir()) == before  # no calibration.json, no replay.json


def test_the_loader_raises_a_value_error_naming_role_and_spec(offline):
    with pytest.raises(draftcert.models.ModelUnavailable, match=f"drafter {NO_SUCH_HUB_ID!r} is not in the local"):
        draftcert.models.load_target(NO_SUCH_HUB_ID, role="drafter")
    assert issubclass(draftcert.models.ModelUnavailable, ValueError)


# ----------------------------------------------------------------------------- item 8: smaller things

def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"draftcert {draftcert.__version__}"


@pytest.fixture
def no_model_load(monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    from draftcert.profile import run as run_mod

    monkeypatch.setattr(draftcert.models, "load_target", no_load)  # what decode/bench load with
    monkeypatch.setattr(run_mod, "load_target", no_load)  # what profile() loads with


@pytest.mark.parametrize("argv,hint", [
    (["decode", "--prompt", "x", "--drafter", "defualt"], "default"),
    (["bench", "--drafter", "prompt-lokup"], "prompt-lookup"),
    (["decode", "--prompt", "x", "--drafter", "self:skp=3"], "self:skip=3"),
    (["decode", "--prompt", "x", "--drafter", "slef:quant=4"], "self:quant=4"),
    (["profile", "--prompts", "p.txt", "--out", "runs/d", "--drafter", "defualt"], "default"),
])
def test_a_misspelt_drafter_gets_a_suggestion_before_any_model_loads(argv, hint, no_model_load, offline, capsys):
    assert main(argv) == 2
    line = _one_error_line(capsys.readouterr().err, "--drafter:")
    assert line.endswith(f"did you mean {hint!r}?")
    assert list(offline.iterdir()) == []


def test_drafter_specs_that_may_be_models_pass_the_check():
    for spec in ("default", "prompt-lookup", "pld:3", "self:skip=5", "self:quant=4", "gpt2", NO_SUCH_HUB_ID,
                 "runs/d/drafter.safetensors"):
        assert check_drafter(spec) is not None, spec
    assert check_drafter(None) is None
    assert suggest_drafter("qwen-something-else") is None  # nothing close: no suggestion


@pytest.mark.parametrize("tree,criterion,says", [
    ("4", "strict", "expected 'm,depth'"),
    ("2,3", "tree:4", "needs a tree of width 4"),
    ("0,3", "strict", ">= 1"),
])
def test_a_bad_tree_is_refused_before_the_model_loads(tree, criterion, says, no_model_load, capsys):
    assert main(["decode", "--prompt", "x", "--tree", tree, "--criterion", criterion]) == 2
    assert says in _one_error_line(capsys.readouterr().err, "--tree:")


def test_replay_takes_threads(monkeypatch, tmp_path, capsys):
    seen = []
    monkeypatch.setattr(torch, "set_num_threads", seen.append)
    assert main(["replay", str(tmp_path / "no-run"), "--threads", "3"]) == 2  # applied before the trace is read
    assert seen == [3]
    capsys.readouterr()
    assert main(["replay", str(tmp_path / "no-run"), "--threads", "0"]) == 2
    _one_error_line(capsys.readouterr().err, "--threads: expected an integer >= 1")


def test_errors_name_command_line_options_with_dashes(prompt_file, offline, capsys):
    # profile() (the library) says `limit: ...`; the command line says the option the user typed
    assert main(["profile", "--prompts", str(prompt_file), "--limit", "0", "--out", "o", "--no-progress"]) == 2
    _one_error_line(capsys.readouterr().err, "--limit: expected an integer >= 1")
    assert main(["profile", "--prompts", str(prompt_file), "--epsilons", "x", "--out", "o", "--no-progress"]) == 2
    _one_error_line(capsys.readouterr().err, "--epsilons:")
    args = build_parser().parse_args(["decode", "--prompt", "x"])
    assert name_option("max_new_tokens: too small", args) == "--max-new-tokens: too small"
    assert name_option("k: too small", args) == "-k: too small"
    assert name_option("trace: corrupt", args) == "trace: corrupt"  # not an option of the command
    assert name_option("prompt", args) == "prompt"


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_written_files_get_the_ordinary_mode(umask, tmp_path):
    """safetensors creates its file 0600; every file draftcert writes gets 0666 less the umask."""
    from safetensors.torch import save_file

    old = os.umask(umask)
    try:
        with atomic_path(tmp_path / "drafter.safetensors") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp))
        atomic_write(tmp_path / "run.json", "{}")
        torch.save({}, tmp_path / "plain.pt")  # what a plain open() gives, for comparison
    finally:
        os.umask(old)
    want = 0o666 & ~umask
    for name in ("drafter.safetensors", "run.json", "plain.pt"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == want, name


@pytest.mark.parametrize("command", ["demo", "profile", "reproduce-paper", "report", "decode", "bench", "train-drafter",
                                     "replay", "explain"])
def test_help_fits_80_columns(command, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        main([command, "--help"])
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 80, max(lines, key=len)
