"""``--weights gguf|float32`` (issue 30): every command that loads the embedded target or a pair takes it,
it becomes load_target's default for the command ($DRAFTCERT_WEIGHTS), a profile run refuses traces of
other numerics, and decode --json records the numerics (the embedded GGUF model, when it is cached)."""

from __future__ import annotations

import json
import os

import pytest

import draftcert.models
from draftcert.cli import build_parser, main
from draftcert.cli.checks import apply_weights
from draftcert.kernels import block_matmul
from draftcert.models.loading import WEIGHTS_ENV
from draftcert.profile.settings import check_resume_numerics

COMMANDS = [["decode", "--prompt", "x"], ["bench"], ["profile", "--prompts", "mt-bench", "--out", "o"],
            ["reproduce-paper"], ["train-drafter", "--out", "o"]]


@pytest.mark.parametrize("argv", COMMANDS, ids=[a[0] for a in COMMANDS])
def test_every_loading_command_takes_weights(argv, monkeypatch):
    monkeypatch.setenv(WEIGHTS_ENV, "")  # restored afterwards (the commands set it)
    args = build_parser().parse_args([*argv, "--weights", "GGUF"])
    assert args.weights == "gguf"
    apply_weights(args)
    assert os.environ[WEIGHTS_ENV] == "gguf"
    args = build_parser().parse_args(argv)
    assert args.weights is None
    apply_weights(args)  # not given: $DRAFTCERT_WEIGHTS (here still gguf) or load_target's default decides
    assert os.environ[WEIGHTS_ENV] == "gguf"
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--weights", "int8"])


def test_decode_passes_weights_to_the_loader(monkeypatch):
    monkeypatch.setenv(WEIGHTS_ENV, "")  # restored afterwards (the commands set it)
    seen = {}

    def no_load(*a, **k):
        seen["env"] = os.environ.get(WEIGHTS_ENV)
        raise draftcert.models.ModelUnavailable("stub")

    monkeypatch.setattr(draftcert.models, "load_target", no_load)
    assert main(["decode", "--prompt", "x", "--weights", "float32", "--no-progress"]) == 2
    assert seen["env"] == "float32"


def test_a_profile_run_refuses_traces_of_other_numerics(tmp_path):
    (tmp_path / "trace").mkdir()
    (tmp_path / "run.json").write_text(json.dumps({"model_dtype": "float32"}))
    check_resume_numerics(tmp_path, "gguf-exact-f32")  # no shards yet: nothing to mix with
    (tmp_path / "trace" / "rank0-0.parquet").write_bytes(b"")
    check_resume_numerics(tmp_path, "float32")
    with pytest.raises(ValueError, match=r"computed under float32; this run computes under gguf-exact-f32.*--weights float32"):
        check_resume_numerics(tmp_path, "gguf-exact-f32")
    (tmp_path / "run.json").write_text(json.dumps({"model_dtype": "gguf-exact-f32"}))
    with pytest.raises(ValueError, match="--weights gguf"):
        check_resume_numerics(tmp_path, "float32")


@pytest.mark.skipif(not block_matmul.LIBRARY.available(), reason="no native block_matmul kernel here")
def test_decode_json_records_the_numerics(capsys, monkeypatch):
    from draftcert.models.loading import embedded_gguf_dir
    from draftcert.gguf.loader import MARKER

    if not (embedded_gguf_dir() / MARKER).is_file():
        pytest.skip("the embedded GGUF is not cached (first use downloads it)")
    monkeypatch.setenv(WEIGHTS_ENV, "")  # restored afterwards (the commands set it)
    code = main(["decode", "--prompt", "Hi", "--weights", "gguf", "--json", "--no-progress", "--no-warmup",
                 "-k", "1", "--drafter", "suffix", "--max-new-tokens", "4"])
    assert code == 0
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])["summary"]
    assert summary["model_dtype"] == "gguf-exact-f32"
    first = next(ln for ln in err.splitlines() if "computes under" in ln)  # which contract, the other, two targets
    assert "computes under gguf (" in first and "--weights gguf-q8" in first and "greedy texts can differ" in first


def test_the_default_gives_way_to_a_dtype_or_device_and_an_explicit_choice_does_not(monkeypatch):
    from draftcert.models import loading

    def path(name):
        def fail(*a, **k):
            raise RuntimeError(f"{name} path")
        return fail

    monkeypatch.setattr(loading, "ensure_embedded_checkpoint", path("float32"))
    monkeypatch.setattr(loading, "ensure_embedded_gguf", path("gguf"))
    monkeypatch.setattr(loading, "DEFAULT_WEIGHTS", "gguf")
    monkeypatch.setenv(WEIGHTS_ENV, "")

    def which(**kw):
        with pytest.raises(draftcert.models.ModelUnavailable) as info:
            loading.load_target(**kw)
        return str(info.value).rsplit(": ", 1)[-1]

    assert which() == "gguf path"
    assert which(dtype="bfloat16") == "float32 path" and which(device="meta") == "float32 path"
    assert which(weights="float32") == "float32 path"
    with pytest.raises(ValueError, match="computes in float32"):
        loading.load_target(weights="gguf", dtype="bfloat16")
    monkeypatch.setenv(WEIGHTS_ENV, "gguf")  # as --weights gguf sets it: explicit
    with pytest.raises(ValueError, match="computes in float32"):
        loading.load_target(dtype="bfloat16")
