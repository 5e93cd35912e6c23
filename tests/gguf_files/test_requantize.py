"""A GGUF-sourced drafter recomputed as other blocks (``gguf.requantize``, the drafter spec ``NAME@q4_1``):
every linear layer holds gguf-py's quantisation of its stored values, under either contract, its
siblings formed again; the blocks come back from the cache; strict decoding with the requantised
drafter is the target's greedy decoding; a bad spec is one clear error."""

from __future__ import annotations

import json

import pytest
import torch

from draftcert.cli import main
from draftcert.decode import greedy_generate, speculative_generate
from draftcert.gguf import requantize
from draftcert.gguf.blocks import decode_rows, quantize_rows
from draftcert.gguf.layers import GGUFLinear, Siblings
from draftcert.models import load_drafter, load_target, parse_drafter_spec
from draftcert.models.hf import model_forward, new_cache
from tests.test_cli_errors import _one_error_line
from tests.tiny_gguf import tiny_gguf_llama, write_tiny_llama

Q8 = {k: 8 for k in ("emb", "q", "k", "v", "o", "gate", "up", "down", "out")}


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTCERT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("DRAFTCERT_WEIGHTS", "")  # unset, and restored after the test (the CLI's --weights sets it)
    return tmp_path / "cache"


def _blocks(model):
    return {n: (m.qtype, m.qweight.clone()) for n, m in model.named_modules() if isinstance(m, GGUFLinear)}


@pytest.mark.parametrize("numerics", ["gguf-exact-f32", "gguf-q8"])
def test_every_linear_holds_the_requantised_values_under_its_contract(tmp_path, cache, numerics):
    model = tiny_gguf_llama(tmp_path, numerics=numerics)
    before = _blocks(model)
    assert len({q for q, _ in before.values()}) > 2  # Q4_1, Q5_0, Q8_0, Q4_K, Q6_K among them
    changed = requantize.requantize_linears(model, "Q4_1")
    assert changed == sum(q != 3 for q, _ in before.values()) > 0
    for name, mod in model.named_modules():
        if not isinstance(mod, GGUFLinear):
            continue
        qtype, old = before[name]
        want = old if qtype == 3 else quantize_rows(decode_rows(old, qtype, mod.in_features), 3)
        assert mod.qtype == 3 and mod.numerics == numerics and torch.equal(mod.qweight, want), name
        assert (mod.q8weight is not None) == (numerics == "gguf-q8")
    assert any(isinstance(m.__dict__.get("_siblings"), Siblings) for m in model.modules())  # q/k/v grouped again
    # the model computes from the new blocks: a fresh load of the same file, requantised, gives the same logits
    other = tiny_gguf_llama(tmp_path, numerics=numerics)
    requantize.requantize_linears(other, "q4_1")
    ids = [5, 9, 17, 33, 2]
    with torch.inference_mode():
        a = model_forward(model, new_cache(model), ids, len(ids))
        b = model_forward(other, new_cache(other), ids, len(ids))
    assert torch.isfinite(a).all() and torch.equal(a, b)


def test_the_blocks_come_back_from_the_cache_and_a_damaged_file_is_made_again(tmp_path, cache, monkeypatch):
    ref = tiny_gguf_llama(tmp_path)
    requantize.requantize_linears(ref, "q4_1")
    files = list((cache / "blocks").glob("*-q4_1.pt"))
    assert len(files) == 1
    model = tiny_gguf_llama(tmp_path)

    def refuse(*a, **k):
        raise AssertionError("quantised again: the cache was not read")

    monkeypatch.setattr(requantize, "quantize_rows", refuse)
    requantize.requantize_linears(model, "q4_1")
    assert all(torch.equal(a[1], b[1]) for a, b in zip(_blocks(ref).values(), _blocks(model).values()))
    files[0].write_bytes(b"not a torch file")
    monkeypatch.undo()
    monkeypatch.setenv("DRAFTCERT_CACHE", str(cache))
    again = tiny_gguf_llama(tmp_path)
    requantize.requantize_linears(again, "q4_1")
    assert all(torch.equal(a[1], b[1]) for a, b in zip(_blocks(ref).values(), _blocks(again).values()))
    assert torch.load(files[0], weights_only=True)  # rewritten


def test_spec_strings():
    s = parse_drafter_spec("qwen2.5-coder-0.5b@Q4_1+suffix")
    assert (s.spec, s.blocks, s.source, s.model_spec, s.suffix) == (
        "qwen2.5-coder-0.5b@q4_1+suffix", "q4_1", "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b@q4_1", True)
    assert parse_drafter_spec("org/model@main").blocks is None  # a hub revision-like tail is not a block type
    with pytest.raises(ValueError, match="q4_1, q5_0, q8_0"):
        parse_drafter_spec("qwen2.5-coder-0.5b@q4_0")  # no kernel computes Q4_0
    with pytest.raises(ValueError, match="not a feature drafter"):
        parse_drafter_spec("default@q4_1")
    with pytest.raises(ValueError, match="not a self drafter"):
        parse_drafter_spec("self:skip=2@q8_0")


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("requant-pair")
    write_tiny_llama(d / "target.gguf", tied=False, qtypes=Q8, tokenizer=True)
    write_tiny_llama(d / "drafter.gguf", tied=True, qtypes={**Q8, "down": 6, "gate": 14}, layers=1, seed=3,
                     tokenizer=True)
    return d


def test_strict_decoding_with_a_requantised_drafter_is_greedy(pair_files, cache):
    target, tok = load_target(str(pair_files / "target.gguf"))
    drafter = load_drafter(f"{pair_files / 'drafter.gguf'}@q4_1", target, tok)
    assert {m.qtype for m in drafter.modules() if isinstance(m, GGUFLinear)} == {3}
    prompt = [5, 9, 17, 33, 2, 40]
    ref = greedy_generate(target, prompt, 16, eos_token_id=[])
    for k in (1, 3):
        res = speculative_generate(target, drafter, prompt, "strict", k=k, max_new_tokens=16, eos_token_id=[])
        assert res.tokens == ref


def test_the_cli_decodes_with_it_and_names_a_bad_type(pair_files, cache, capsys):
    args = ["decode", "--target", str(pair_files / "target.gguf"), "--prompt", "the cat", "-k", "2",
            "--max-new-tokens", "6", "--no-progress", "--no-warmup", "--baseline"]
    assert main(args + ["--drafter", f"{pair_files / 'drafter.gguf'}@q4_1", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]
    assert summary["baseline_match"] is True
    assert main(args + ["--drafter", f"{pair_files / 'drafter.gguf'}@q4_0"]) == 2
    line = _one_error_line(capsys.readouterr().err, "--drafter:")
    assert "q4_1, q5_0, q8_0" in line, line
    assert main(args + ["--drafter", f"{pair_files / 'drafter.gguf'}@q4_1", "--weights", "float32"]) == 2
    line = _one_error_line(capsys.readouterr().err, "--drafter:")
    assert "no GGUF layers" in line, line
