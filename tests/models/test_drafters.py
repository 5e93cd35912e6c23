"""Derived drafters (layer skip, RTN requantisation), spec parsing and compatibility checks."""

import pytest
import torch

from draftcert.models import (
    check_compatible,
    load_drafter,
    parse_self_spec,
    quantize_rtn_,
)
from tests.tiny_models import tiny_qwen3

X = torch.tensor([[257, 117, 115, 101, 114, 10, 104, 105, 258, 10]])


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3(seed=0, num_layers=4)


def test_parse_self_spec():
    assert parse_self_spec("self:skip=15").skip == (15,)
    assert parse_self_spec("self:skip=10,11").skip == (10, 11)
    assert parse_self_spec("self:skip=12-14,3").skip == (3, 12, 13, 14)
    s = parse_self_spec("self:skip=15,quant=4")
    assert (s.skip, s.quant_bits, s.quant_group) == ((15,), 4, 0)
    s = parse_self_spec("self:quant=3,group=32")
    assert (s.skip, s.quant_bits, s.quant_group) == ((), 3, 32)
    for bad in ("self:", "self:skip=", "self:skip=a", "self:skip=3,3", "self:skip=5-2",
                "self:quant=0", "self:quant=4,5", "self:group=32", "self:foo=1", "skip=1"):
        with pytest.raises(ValueError):
            parse_self_spec(bad)


def test_skip_drafter_shapes_independence_and_layer_idx(target):
    model, tok = target
    before = {k: v.clone() for k, v in model.state_dict().items()}
    d = load_drafter("self:skip=1,2", model, tok)
    assert len(d.model.layers) == 2 and len(model.model.layers) == 4
    assert [layer.self_attn.layer_idx for layer in d.model.layers] == [0, 1]
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == [0, 1, 2, 3]
    assert d.config.num_hidden_layers == 2 and model.config.num_hidden_layers == 4
    assert len(d.config.layer_types) == 2 and len(model.config.layer_types) == 4
    # the surviving layers are copies of target layers 0 and 3
    assert torch.equal(d.model.layers[1].mlp.up_proj.weight, model.model.layers[3].mlp.up_proj.weight)
    assert d.model.layers[1].mlp.up_proj.weight.data_ptr() != model.model.layers[3].mlp.up_proj.weight.data_ptr()
    with torch.inference_mode():
        lt, ld = model(X).logits, d(X).logits
    assert lt.shape == ld.shape
    assert not torch.allclose(lt, ld)
    with torch.no_grad():
        d.model.layers[0].mlp.up_proj.weight.mul_(2.0)  # mutating the drafter ...
    for k, v in model.state_dict().items():  # ... never touches the target
        assert torch.equal(v, before[k]), k


def test_skip_drafter_kv_cache_generation_matches_no_cache_forward(target):
    model, tok = target
    d = load_drafter("self:skip=2", model, tok)
    steps = 12
    out = d.generate(
        X, attention_mask=torch.ones_like(X), max_new_tokens=steps, do_sample=False,
        output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=256,
    )
    seq = out.sequences
    assert seq.shape[1] == X.shape[1] + steps
    with torch.inference_mode():
        full = d(seq).logits[0, X.shape[1] - 1 : -1]  # no cache, one pass
    cached = torch.stack(out.logits, 1)[0]
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-4)
    assert torch.equal(full.argmax(-1), seq[0, X.shape[1]:])


def test_quant_drafter_changes_weights_keeps_shapes(target):
    model, tok = target
    for spec, levels in (("self:quant=4", 16), ("self:quant=2", 4), ("self:quant=4,group=16", None)):
        d = load_drafter(spec, model, tok)
        w_t = model.model.layers[0].self_attn.q_proj.weight
        w_d = d.model.layers[0].self_attn.q_proj.weight
        assert w_d.shape == w_t.shape and w_d.dtype == w_t.dtype
        assert not torch.equal(w_d, w_t)
        if levels is not None:  # per output channel: at most 2^bits distinct values per row
            assert max(row.unique().numel() for row in w_d) <= levels
        assert torch.equal(d.lm_head.weight, model.lm_head.weight)  # head untouched
        with torch.inference_mode():
            assert d(X).logits.shape == model(X).logits.shape
            assert not torch.equal(d(X).logits, model(X).logits)


def test_quantize_rtn_error_bound_and_exact_grid():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=g)
    orig = w.clone()
    quantize_rtn_(w, bits=4)
    step = (orig.amax(1) - orig.amin(1)) / 15
    # round to nearest: every weight moves by at most half a step; extremes are exact
    assert ((w - orig).abs() <= step[:, None] / 2 + 1e-6).all()
    torch.testing.assert_close(w.amax(1), orig.amax(1))
    torch.testing.assert_close(w.amin(1), orig.amin(1))
    # re-quantising an already-quantised tensor changes nothing (idempotent up to float rounding)
    again = w.clone()
    quantize_rtn_(again, bits=4)
    torch.testing.assert_close(again, w, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="divide"):
        quantize_rtn_(torch.zeros(2, 10), bits=4, group=3)


def test_skip_out_of_range_and_all_layers(target):
    model, tok = target
    with pytest.raises(ValueError, match="out of range"):
        load_drafter("self:skip=4", model, tok)
    with pytest.raises(ValueError, match="all 4"):
        load_drafter("self:skip=0-3", model, tok)


def test_check_compatible_refuses_mismatched_vocab(target, tmp_path):
    model, tok = target
    other, otok = tiny_qwen3(seed=1, num_layers=1, vocab_size=300)
    with pytest.raises(ValueError, match="vocab_size 259 .target. vs 300"):
        check_compatible(model, tok, other, otok)
    # same sizes, different token->id map
    from transformers import PreTrainedTokenizerFast

    swapped = tok.get_vocab()
    swapped["a"], swapped["b"] = swapped["b"], swapped["a"]
    from tokenizers import Tokenizer, models

    alt = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(swapped, unk_token="a")))
    same_shape, _ = tiny_qwen3(seed=2, num_layers=1)
    with pytest.raises(ValueError, match="differently"):
        check_compatible(model, tok, same_shape, alt)
    check_compatible(model, tok, same_shape, tok)  # identical vocabularies pass
    # a separately loaded drafter is compared in load_drafter (models.tokenizer_fit): the same tokenizer with
    # 41 more output rows, past every token, is padding, fitted to the target's rows; another tokenizer is refused
    other.save_pretrained(tmp_path)
    otok.save_pretrained(tmp_path)
    fitted = load_drafter(str(tmp_path), model, tok)
    assert fitted.get_output_embeddings().out_features == 259 == fitted.config.vocab_size
    alt.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="incompatible with the target: token id"):
        load_drafter(str(tmp_path), model, tok)


def test_load_drafter_from_path(target, tmp_path):
    model, tok = target
    small, _ = tiny_qwen3(seed=5, num_layers=1)
    small.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    d = load_drafter(str(tmp_path), model, tok)
    with torch.inference_mode():
        assert torch.equal(d(X).logits, small(X).logits)
    with pytest.raises(ValueError, match="needs options"):
        load_drafter("self", model, tok)
