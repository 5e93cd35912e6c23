"""The transformers adapter (``models.hf``): cache argument, forward passes, EOS and pad ids, left
padding and dtype names, on a tiny Qwen3 built in code."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.tiny_models import tiny_qwen3
from draftcert.models.hf import (
    cache_kwarg,
    eos_token_ids,
    forward_with_hidden,
    left_pad,
    model_forward,
    new_cache,
    pad_token_id,
    parse_dtype,
    vocab_size_of,
)


@pytest.fixture(scope="module")
def tiny():
    model, tok = tiny_qwen3(0, vocab_size=300)
    return model.to(torch.float64), tok


def test_cache_kwarg_follows_the_forward_signature(tiny):
    model, _ = tiny
    assert cache_kwarg(model) == "cache" and cache_kwarg(model.get_decoder()) == "cache"  # transformers 5.x

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None):
            return input_ids

    assert cache_kwarg(Old()) == "past_key_values"


def test_forward_passes_agree_and_extend_the_cache(tiny):
    model, _ = tiny
    ids = [3, 14, 15, 92, 65]
    with torch.inference_mode():
        c1, c2 = new_cache(model), new_cache(model)
        a = model_forward(model, c1, ids, 2)
        b, hidden = forward_with_hidden(model, c2, ids, 2)
        full = model(torch.tensor([ids])).logits[0]
    assert a.shape == (2, 300) and hidden.shape == (5, model.config.hidden_size)
    assert torch.equal(a, b) and torch.allclose(a, full[-2:], atol=1e-12)
    assert c1.get_seq_length() == c2.get_seq_length() == 5
    assert vocab_size_of(model) == 300


def test_eos_ids_explicit_then_tokenizer_and_generation_config_then_model_config(tiny):
    model, tok = tiny
    assert eos_token_ids(model, tok, explicit=[]) == set() and eos_token_ids(model, explicit=7) == {7}
    gc = SimpleNamespace(eos_token_id=[1, 2])
    m = SimpleNamespace(generation_config=gc, config=SimpleNamespace(eos_token_id=9))
    assert eos_token_ids(m, SimpleNamespace(eos_token_id=5)) == {1, 2, 5}
    assert eos_token_ids(m) == {1, 2}
    gc.eos_token_id = None
    assert eos_token_ids(m) == {9}  # neither names one: the model config's
    assert eos_token_ids(SimpleNamespace(config=SimpleNamespace(eos_token_id=None))) == set()
    assert eos_token_ids(model, tok) == {tok.eos_token_id}  # the tiny tokenizer and config agree: <|im_end|>


def test_pad_id_and_left_padding(tiny):
    model, tok = tiny
    assert pad_token_id(tok, model) == tok.pad_token_id == 256
    assert pad_token_id(SimpleNamespace(pad_token_id=None, eos_token_id=4), model) == 4
    assert pad_token_id(None, SimpleNamespace(config=SimpleNamespace(pad_token_id=None))) == 0
    ids, mask, pos = left_pad([[7, 8, 9], [5]], 0, "cpu")
    assert ids.tolist() == [[7, 8, 9], [0, 0, 5]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert pos.tolist() == [[0, 1, 2], [0, 0, 0]]
    with pytest.raises(ValueError, match="at least one token"):
        left_pad([[1], []], 0, "cpu")


def test_parse_dtype_names_aliases_and_errors():
    assert parse_dtype(None) is None and parse_dtype("auto") is None
    assert parse_dtype(torch.float16) is torch.float16
    assert parse_dtype("bfloat16") is parse_dtype("BF16") is parse_dtype("torch.bfloat16") is torch.bfloat16
    assert parse_dtype("fp32") is parse_dtype("float32") is torch.float32
    with pytest.raises(ValueError, match="dtype"):
        parse_dtype("float33")
    with pytest.raises(ValueError, match="dtype"):
        parse_dtype(32)
