"""`draftcert decode` / `bench` as a newcomer meets them: clear errors, honest timings,
JSON Lines, progress, and tables that fit 80 columns."""

from __future__ import annotations

import json
import re

import pytest

from draftcert.cli import main



def test_unreachable_drafter_is_one_clear_line(ckpt, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub id cannot be fetched: as with no network
    rc = main(["decode", "--target", ckpt, "--drafter", "no-such-org/no-such-drafter", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]  # (transformers' own weight-loading bar may come before)
    assert err.count("draftcert: error") == 1 and last.startswith("draftcert: error: --drafter:")
    assert "drafter 'no-such-org/no-such-drafter'" in err and "target 'no-such" not in err
    assert "self:skip" in err  # what to do instead


@pytest.mark.parametrize("argv,option,hint", [
    (["decode", "--prompt", "x", "--criterion", "aditive:0.1"], "--criterion", "additive:0.1"),
    (["decode", "--prompt", "x", "--criterion", "strcit"], "--criterion", "strict"),
    (["bench", "--criteria", "strict,treee:4"], "--criteria", "tree:4"),
])
def test_unknown_spec_is_refused_before_any_model_loads(argv, option, hint, capsys, monkeypatch):
    import draftcert.models

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the spec was checked")

    monkeypatch.setattr(draftcert.models, "load_target", no_load)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"draftcert: error: {option}:") and f"did you mean {hint!r}?" in err
    assert err.count("\n") == 1


def test_json_lines_null_radius_means_inf_and_warmup_is_separate(ckpt, capsys):
    # additive:1.0 never rejects (p(x) >= p(1st) - 1 always): every radius is +inf
    rc = main(["decode", "--target", ckpt, "--drafter", "self:skip=1", "--prompt", "hello", "-k", "2",
               "--max-new-tokens", "6", "--criterion", "additive:1.0", "--json"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Infinity" not in out and '"inf"' not in out
    lines = [json.loads(l) for l in out.splitlines()]  # JSON Lines: every line one object
    rounds, summary = lines[:-1], lines[-1]["summary"]
    radii = [r for rd in rounds for r in rd["radius"]]
    assert radii and all(r is None for r in radii)
    assert isinstance(summary["warmup_seconds"], float) and summary["warmup_seconds"] > 0
    assert summary["emitted"] == 6 == sum(len(rd["emitted"]) for rd in rounds)  # the warm-up emits nothing
    # finite radii stay numbers
    assert main(["decode", "--target", ckpt, "--drafter", "self:skip=1", "--prompt", "hello", "-k", "2",
                 "--max-new-tokens", "6", "--json", "--no-warmup"]) == 0
    lines = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert any(isinstance(r, float) for rd in lines[:-1] for r in rd["radius"])
    assert lines[-1]["summary"]["warmup_seconds"] is None


def test_decode_help_says_json_lines_and_null(capsys):
    with pytest.raises(SystemExit):
        main(["decode", "--help"])
    out = capsys.readouterr().out
    assert "JSON Lines" in out and "null" in out and "+inf" in out and "warm-up" in out


def test_decode_text_says_warmup_is_excluded(ckpt, capsys):
    assert main(["decode", "--target", ckpt, "--drafter", "self:skip=1", "--prompt", "hello", "-k", "2",
                 "--max-new-tokens", "6"]) == 0
    assert re.search(r"tokens/s \(an untimed warm-up round took \d+\.\d\ds\)", capsys.readouterr().err)


def test_bench_shows_progress_and_fits_80_columns(ckpt, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    specs = ["strict", "multiplicative:0.5", "entropy:0.09:0.3", "tree:2"]
    rc = main(["bench", "--target", ckpt, "--drafter", "self:skip=1", "--prompt", "one two", "--prompt", "three",
               "--criteria", ",".join(specs), "--max-new-tokens", "6", "-k", "2"])
    assert rc == 0
    cap = capsys.readouterr()
    n = (len(specs) + 1) * 2 + 1  # every criterion and the target alone on both prompts, + the warm-up
    assert "bench" in cap.err and f"{n}/{n}" in cap.err
    lines = cap.out.splitlines()
    assert max(map(len, lines)) <= 80
    rows = [[c.strip() for c in l.strip("|").split("|")] for l in lines if l.startswith("| ") and "criterion" not in l]
    by_spec: dict[str, list[str]] = {}
    for r in rows:
        by_spec.setdefault(r[0], []).extend(r[1:])
    assert list(by_spec) == ["target alone"] + specs
    assert main(["bench", "--target", ckpt, "--drafter", "self:skip=1", "--prompt", "one two", "--prompt", "three",
                 "--criteria", ",".join(specs), "--max-new-tokens", "6", "-k", "2", "--json", "--no-progress"]) == 0
    cap = capsys.readouterr()
    assert "bench" not in cap.err and "decode/s" not in cap.err  # --no-progress
    for r in map(json.loads, cap.out.splitlines()):
        cells = by_spec[r["criterion"]]
        assert cells[0] == r["draft"]
        # every number of the row appears whole (the timings differ between the two runs)
        if r["criterion"] == "target alone":  # no drafts, no certificates
            assert cells[1:5] == ["1.00", "-", "0.000", "n/a"]
            continue
        assert cells[1:5] == [f"{r['tokens_per_forward']:.2f}", f"{r['mean_acceptance_length']:.2f}", f"{r['drift']:.3f}",
                              f"{r['certified_fraction']:.3f}"]
        assert re.fullmatch(r"\d+\.\d\d", cells[5])


def test_bench_table_splits_rather_than_cuts():
    from draftcert.decode.bench import format_table

    rows = [{"criterion": "multiplicative:0.5", "draft": "tree m=4, depth=4", "tokens_per_forward": 4.36,
             "mean_acceptance_length": 3.36, "drift": 0.068, "certified_fraction": 0.613, "tokens_per_second": 12345.67}]
    for width in (50, 60, 80):
        text = format_table(rows, width=width)
        assert max(map(len, text.splitlines())) <= width
        for cell in ("multiplicative:0.5", "tree m=4, depth=4", "4.36", "3.36", "0.068", "0.613", "12345.67"):
            assert re.search(rf"\| {re.escape(cell)} +\||\| +{re.escape(cell)} \|", text), (width, cell, text)
    assert format_table(rows).splitlines()[0].startswith("| criterion | draft | tokens/forward |")  # the markdown form docs/decoding.md shows


def test_dtype_sets_the_target_and_the_drafter_model_and_baseline_uses_the_same_target(ckpt, capsys, monkeypatch):
    """`--dtype bfloat16`: the target and a drafter model loaded from a path both compute in bfloat16, and
    --baseline compares with that same bfloat16 target (strict stays identical to it)."""
    import torch

    import draftcert.models
    from draftcert.drafting import make as drafters_mod

    seen = {}
    real_target, real_drafter = draftcert.models.load_target, drafters_mod.load_drafter

    def load_target(*a, **k):
        model, tok = real_target(*a, **k)
        seen["target"] = model.dtype
        return model, tok

    def load_drafter(*a, **k):
        model = real_drafter(*a, **k)
        seen["drafter"] = model.dtype
        return model

    monkeypatch.setattr(draftcert.models, "load_target", load_target)
    monkeypatch.setattr(drafters_mod, "load_drafter", load_drafter)
    rc = main(["decode", "--target", ckpt, "--drafter", ckpt, "--dtype", "bfloat16", "--prompt", "hello there", "-k", "2",
               "--max-new-tokens", "6", "--baseline", "--repeats", "1", "--json", "--no-warmup"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])["summary"]
    assert seen == {"target": torch.bfloat16, "drafter": torch.bfloat16}
    assert summary["baseline_match"] is True


def test_a_bad_dtype_is_refused_before_any_model_loads(capsys, monkeypatch):
    import draftcert.models

    monkeypatch.setattr(draftcert.models, "load_target", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(["decode", "--prompt", "x", "--dtype", "bfloat61"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("draftcert: error: --dtype:") and "bfloat16" in err


def test_decode_baseline_prints_the_target_alone_tokens_per_second(ckpt, capsys):
    """Issue 51, item 3: `decode --baseline` names the target's own tokens/s next to the speed-up."""
    assert main(["decode", "--target", ckpt, "--drafter", "self:skip=1", "--prompt", "hello", "-k", "2",
                 "--max-new-tokens", "4", "--baseline", "--repeats", "1", "--no-progress"]) == 0
    err = capsys.readouterr().err
    m = re.search(r"speedup (\d+\.\d\d)x vs target alone \((\d+\.\d\d) tokens/s\)", err)
    assert m is not None, err
    spec = float(re.search(r"(\d+\.\d\d) tokens/s \(", err).group(1))  # the decode's own tokens/s
    assert float(m.group(1)) == pytest.approx(spec / float(m.group(2)), rel=0.02, abs=0.011)


def test_bench_header_says_where_positions_past_k_come_from(ckpt, capsys):
    """Issue 51, item 3: with suffix-match candidates the lines by position run past k; the header says
    why (and says nothing of the kind without them)."""
    from draftcert.cli.decode import bench_header

    text = bench_header("eagle:smollm2-135m-instruct+suffix", 3, 64, 1)
    assert "k=1 is the model drafter's draft length" in text and "positions past k are suffix drafts" in text
    assert max(map(len, text.splitlines())) <= 80
    assert "suffix" not in bench_header("self:skip=1", 3, 64, 2)
    argv = ["bench", "--target", ckpt, "--prompt", "a b a b a b a b", "--criteria", "strict", "-k", "1",
            "--max-new-tokens", "12", "--no-progress"]
    assert main(argv + ["--drafter", "self:skip=1+suffix"]) == 0
    out = capsys.readouterr().out
    assert "positions past k are suffix drafts" in out.replace("\n", " ")
    assert re.search(r"^\| target alone +\| none +\| +1\.00 \|", out, re.M), out  # the target-alone row
    assert main(argv + ["--drafter", "self:skip=1"]) == 0
    assert "suffix drafts" not in capsys.readouterr().out
