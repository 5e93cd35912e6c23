"""forward/decoder_layers.py: Llama / Qwen2 / Qwen3 decoder layers written out give transformers' bits.

Every comparison is ``torch.equal`` between the same model with its layers switched and with them
given back (``restore_layers``), on the passes the engine and the profiler make: a prefill, one-row
decode steps, a chain verification, a tree pass (additive 4-D mask, own positions), the final hidden
states, and a left-padded batch; under each attention the loaders use (sdpa, the grouped sdpa,
row_attention) and for GGUF weights under both contracts (under ``gguf-q8`` with the native layer
off: ``test_native_layer.py`` tests that one).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from draftcert.forward import decoder_layers  # noqa: E402
from draftcert.kernels.attention import use_grouped_sdpa, use_row_invariant_attention  # noqa: E402
from draftcert.models.tree_attention import crop_cache  # noqa: E402
from draftcert.models.hf import forward_with_hidden, model_forward, new_cache  # noqa: E402

V = 96


def _config(family: str, **extra):
    import transformers

    common = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)
    if family == "qwen3":
        common["head_dim"] = 16
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[family]
    return cls(**{**common, **extra})


def tiny_lm(family: str, seed: int = 0, **extra):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = _config(family, **extra)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg).eval().requires_grad_(False)
    with torch.no_grad():  # norms away from 1, so a dropped or reordered norm operation shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model


def tree_pass(model, cache, n_cached: int):
    """pending token p, node a its child, nodes b and c both children of a: [4, V] logits."""
    allowed = torch.zeros(4, n_cached + 4, dtype=torch.bool)
    allowed[:, :n_cached + 1] = True  # the prefix and the pending token
    allowed[1:, n_cached + 1] = True  # a
    allowed[2, n_cached + 2] = allowed[3, n_cached + 3] = True  # b and c each see themselves only
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    pos = torch.tensor([[n_cached, n_cached + 1, n_cached + 2, n_cached + 2]])
    return model_forward(model, cache, [5, 17, 33, 60], 4, mask, pos)


def _passes(model) -> list[torch.Tensor]:
    """The outputs of every kind of pass, in order."""
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, V, (11,), generator=gen).tolist()
    out = []
    with torch.inference_mode():
        cache = new_cache(model)
        out.append(model_forward(model, cache, prompt, 3))  # prefill
        for t in (4, 9, 2):  # one-row decode steps
            out.append(model_forward(model, cache, [t], 1))
        for rows in (2, 5, 16):  # chain verifications of 2..16 rows, rolled back after each
            n = cache.get_seq_length()
            out.append(model_forward(model, cache, torch.randint(0, V, (rows,), generator=gen).tolist(), rows))
            crop_cache(cache, n)
        n = cache.get_seq_length()
        out.append(tree_pass(model, cache, n))
        crop_cache(cache, n)
        logits, hidden = forward_with_hidden(model, cache, [7, 8], 2)
        out += [logits, hidden]
        ids = torch.tensor([[0, 0, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]])  # a left-padded batch, teacher forced
        mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
        out.append(model(input_ids=ids, attention_mask=mask).logits)
        # transformers' generate: its decoder calls (a cache, token ids) run lean_model_forward
        g = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                           max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True,
                           pad_token_id=0)
        out += [g.sequences, torch.stack(g.scores)]
        g = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, output_scores=True,
                           return_dict_in_generate=True, pad_token_id=0)  # the left-padded batch
        out += [g.sequences, torch.stack(g.scores)]
    return out


def _same_bits_switched_and_not(model) -> None:
    n_layers = model.config.num_hidden_layers
    assert decoder_layers.use_lean_layers(model) == n_layers == decoder_layers.lean_layers(model)
    with torch.inference_mode():  # model_forward runs the decoder written out too
        assert decoder_layers.decoder_ready(model)
    # the switched layers must not hand back to transformers' forward here (equal bits would then prove
    # nothing), nor the switched decoder but for the batch called without a cache
    family, decoder = type(model.model.layers[0]).__mro__[1], type(model.model).__mro__[1]
    assert type(model.model) is not decoder and type(model.model).forward is decoder_layers.lean_model_forward
    assert decoder.__name__ in decoder_layers.DECODERS
    originals, fallbacks = (family.forward, decoder.forward), []

    def counted(original, who):
        def forward(self, *args, **kwargs):
            fallbacks.append(who)
            return original(self, *args, **kwargs)
        return forward

    family.forward, decoder.forward = counted(originals[0], "layer"), counted(originals[1], "decoder")
    try:
        switched = _passes(model)
    finally:
        family.forward, decoder.forward = originals
    assert fallbacks == ["decoder"]
    assert decoder_layers.restore_layers(model) == n_layers and decoder_layers.lean_layers(model) == 0
    with torch.inference_mode():
        assert not decoder_layers.decoder_ready(model)
    original = _passes(model)
    assert len(switched) == len(original)
    for i, (a, b) in enumerate(zip(switched, original)):
        assert torch.equal(a, b), f"pass {i}: max difference {(a - b).abs().max().item()}"


def use_attention(model, attention: str):
    """``model`` switched to one of the attentions the loaders use: ``sdpa`` (as built), ``grouped``
    (the grouped sdpa) or ``row_attention`` (skips the test where the kernel is unavailable)."""
    if attention == "grouped":
        assert use_grouped_sdpa(model)
    elif attention == "row_attention":
        from draftcert.kernels import row_attention

        if not row_attention.LIBRARY.available():
            pytest.skip(f"no row_attention kernel: {row_attention.LIBRARY.reason()}")
        assert use_row_invariant_attention(model) > 0
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("attention", ["sdpa", "grouped", "row_attention"])
def test_switched_layers_give_the_same_bits(family, attention):
    _same_bits_switched_and_not(use_attention(tiny_lm(family), attention))


def test_biases_and_a_scaled_rope_give_the_same_bits():
    # Qwen2's q/k/v biases; Llama with attention and MLP biases and a linear-scaled rope
    _same_bits_switched_and_not(tiny_lm("qwen2", seed=3))
    _same_bits_switched_and_not(tiny_lm("llama", seed=4, attention_bias=True, mlp_bias=True,
                                       rope_scaling={"rope_type": "linear", "factor": 2.0}))


@pytest.mark.parametrize("contract", ["gguf-exact-f32", "gguf-q8"])
def test_gguf_layers_give_the_same_bits(tmp_path, contract, monkeypatch):
    pytest.importorskip("gguf")
    from tests.tiny_gguf import tiny_gguf_llama

    # under gguf-q8 a layer runs natively (forward/native_layer.py, its own arithmetic: tested in
    # test_native_layer.py); the torch layer it replaces is checked here
    monkeypatch.setenv("DRAFTCERT_NATIVE_LAYERS", "0")
    _same_bits_switched_and_not(tiny_gguf_llama(tmp_path, numerics=contract))


def test_outside_the_written_out_case_the_original_forward_runs():
    model = tiny_lm("qwen2")
    decoder_layers.use_lean_layers(model)
    calls = []
    handle = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *a: calls.append(1))
    ids = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        hooked = model(ids).logits  # a hook on a child: that layer's children are called as modules
    assert len(calls) == 1
    handle.remove()
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, hooked) and len(calls) == 1  # switched again: the hook is gone anyway
    head_calls = []
    handle = model.lm_head.register_forward_hook(lambda *a: head_calls.append(1))
    with torch.inference_mode():  # a hook on the output layer: model_forward calls the model as a module
        assert not decoder_layers.decoder_ready(model)
        assert torch.equal(model_forward(model, new_cache(model), [1, 2, 3], 3), hooked[0]) and head_calls == [1]
    handle.remove()
    with torch.inference_mode():
        assert decoder_layers.decoder_ready(model)
    assert not decoder_layers.decoder_ready(model)  # autograd on
    with torch.enable_grad():  # autograd: the original forward (its graph is transformers')
        p = model.model.layers[0].mlp.up_proj.weight.requires_grad_(True)
        model(ids).logits.sum().backward()
        assert p.grad is not None and p.grad.abs().sum() > 0
        p.requires_grad_(False)
    model.config._attn_implementation = "eager"
    for layer in model.model.layers:
        layer.self_attn.config._attn_implementation = "eager"
    seen = []
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: seen.append(1))
    with torch.inference_mode():
        model(ids)
    assert seen == [1]
    handle.remove()


def test_which_layers_are_switched(monkeypatch):
    assert decoder_layers.use_lean_layers(tiny_lm("llama")) == 2
    model = tiny_lm("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    assert decoder_layers.use_lean_layers(model) == 0  # sliding windows are not written out
    gelu = tiny_lm("llama", hidden_act="gelu")
    assert decoder_layers.use_lean_layers(gelu) == 0
    monkeypatch.setenv("DRAFTCERT_LEAN", "0")
    assert not decoder_layers.enabled() and decoder_layers.use_lean_layers(tiny_lm("llama")) == 0


def test_a_switched_layer_keeps_its_class_name_and_survives_deepcopy():
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    model = tiny_lm("qwen2")
    decoder_layers.use_lean_layers(model)
    layer = model.model.layers[0]
    assert type(layer) is not Qwen2DecoderLayer and isinstance(layer, Qwen2DecoderLayer)
    assert type(layer).__name__ == "Qwen2DecoderLayer"
    twin = copy.deepcopy(model)
    assert decoder_layers.lean_layers(twin) == 2
    ids = torch.tensor([[4, 5, 6, 7]])
    with torch.inference_mode():
        assert torch.equal(twin(ids).logits, model(ids).logits)
    assert decoder_layers.use_lean_layers(model) == 2  # switching twice changes nothing


def test_loaded_models_are_switched():
    from draftcert.models import ModelUnavailable, load_target

    try:
        model, tok = load_target(weights="gguf")
    except ModelUnavailable as e:
        pytest.skip(f"embedded model unavailable: {e}")
    assert decoder_layers.lean_layers(model) == model.config.num_hidden_layers == 30
    from draftcert.models import load_drafter

    drafter = load_drafter("default", model, tok)  # the shipped feature drafter's one layer, too
    assert decoder_layers.lean_layers(drafter) == 1


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # called so on purpose below
def test_a_decoder_call_that_records_outputs_runs_transformers_forward():
    """Hidden states or attentions requested, embeddings given, no cache: the switched decoder hands
    the call to the original forward, which records what was asked for (the same bits)."""
    from transformers import DynamicCache

    model = tiny_lm("qwen2")
    twin = copy.deepcopy(model)
    decoder_layers.use_lean_layers(model)
    assert type(model.model).forward is decoder_layers.lean_model_forward and type(twin.model).forward is not decoder_layers.lean_model_forward
    ids = torch.tensor([[4, 5, 6, 7]])
    with torch.inference_mode():
        for kwargs in ({"output_hidden_states": True}, {"inputs_embeds": model.model.embed_tokens(ids)}, {}):
            call = {"input_ids": ids} if "inputs_embeds" not in kwargs else {}
            a = model(**call, **kwargs, cache=DynamicCache(config=model.config), use_cache=True)
            b = twin(**call, **kwargs, cache=DynamicCache(config=twin.config), use_cache=True)
            assert torch.equal(a.logits, b.logits)
            if kwargs.get("output_hidden_states"):
                assert len(a.hidden_states) == len(b.hidden_states) == 3
                assert all(torch.equal(x, y) for x, y in zip(a.hidden_states, b.hidden_states))
        # the decoder called with token ids positionally, or its cache under the old keyword
        for call in (lambda m: m.model(ids, cache=DynamicCache(config=m.config), use_cache=True),
                     lambda m: m.model(input_ids=ids, past_key_values=DynamicCache(config=m.config), use_cache=True)):
            a, b = call(model), call(twin)
            assert torch.equal(a.last_hidden_state, b.last_hidden_state)
            assert a.cache.get_seq_length() == b.cache.get_seq_length() == 4
