"""forward/native_layer.py + forward/layer_kernel.c: a gguf-q8 decoder layer in two native calls.

Its arithmetic is its own (the norms and the activation are not torch's), so the checks are:
the kernel's norm and activation against their stated definitions; a row's logits the same bits
alone (one-row decode steps) and inside a chain, a tree and a batch (what strict = greedy needs);
stacked and separate projections the same bits; and the whole model close to the written-out torch
layer on the same GGUF layers (transformers' bits), for Llama, Qwen2 (biases) and Qwen3 (head norms).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from draftcert.forward import decoder_layers, layer_kernel, native_layer  # noqa: E402
from draftcert.gguf.layers import GGUFLinear, dissolve_siblings, group_siblings, row_invariant_attention  # noqa: E402
from draftcert.models.hf import forward_with_hidden, model_forward, new_cache  # noqa: E402
from draftcert.models.tree_attention import crop_cache  # noqa: E402

from tests.cpu_kernels.test_decoder_layers import tiny_lm, tree_pass  # noqa: E402

pytestmark = pytest.mark.skipif(not layer_kernel.LIBRARY.available(),
                                reason=f"no layer_kernel: {layer_kernel.LIBRARY.reason()}")


# ----------------------------------------------------------------------------- the kernel's own operations


def _rms_reference(h: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """layer_kernel.c's rms, step by step in numpy (IEEE float64 / float32 operations, the same order)."""
    n = h.shape[-1]
    out = np.empty_like(h)
    for r, row in enumerate(h):
        lanes = np.zeros(8)
        full = n // 8 * 8
        for v in range(0, full, 8):
            lanes += row[v:v + 8].astype(np.float64) ** 2
        s = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]))
        for i in range(full, n):
            s += float(row[i]) ** 2
        var = np.float32(s / n)
        rr = np.float32(1.0) / np.sqrt(np.float32(var + np.float32(eps)))
        out[r] = w * (row * rr)
    return out


@pytest.mark.parametrize("n", [1, 7, 64, 100, 1536])
def test_rms_is_its_definition(n):
    gen = torch.Generator().manual_seed(n)
    h = torch.randn(5, n, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 1e4, 1.0])[:, None]
    w = 1 + 0.3 * torch.randn(n, generator=gen)
    got = layer_kernel.rms(h, w, 1e-6).numpy()
    assert np.array_equal(got, _rms_reference(h.numpy(), w.numpy(), 1e-6))
    # and close to the norm's value in float64
    h64 = h.double()
    ref = w.double() * h64 / torch.sqrt((h64 ** 2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(torch.from_numpy(got).double(), ref, rtol=2e-6, atol=0)


def test_silu_is_within_a_few_ulps_and_the_same_at_every_position():
    gen = torch.Generator().manual_seed(0)
    g = torch.cat([torch.randn(300, generator=gen) * 4, torch.tensor([0.0, -0.0, 1e-30, -1e-30, 50.0, -50.0, 103.9,
                                                                      -103.9, 104.5, -104.5, 200.0, -200.0, 88.0, -88.0])])
    u = torch.randn(g.shape, generator=gen)
    got = layer_kernel.silu_mul(g, u)
    g64 = g.double()
    ref = g64 * torch.sigmoid(g64) * u.double()
    ulp = torch.finfo(torch.float32).eps
    # below float32's normal range (|silu| < 1e-38: g < -87) the exp's subnormal result is inexact
    assert ((got.double() - ref).abs() <= 6 * ulp * ref.abs() + 1e-36).all()
    # the vector lanes and the scalar tail compute the same values: each element alone is the same bits
    alone = torch.stack([layer_kernel.silu_mul(g[i:i + 1], u[i:i + 1])[0] for i in range(len(g))])
    assert torch.equal(alone, got)


# ----------------------------------------------------------------------------- models


def _to_q8(model, qtype: int = 8) -> torch.nn.Module:
    """Every decoder projection and the output layer of a tiny transformers model replaced by a GGUFLinear of its weights
    quantised to ``qtype`` (Q8_0 / Q4_1 / Q5_0), under gguf-q8; row-invariant attention."""
    from gguf import GGMLQuantizationType as QT

    parents = [(model, ["lm_head"])] + [(p, None) for layer in model.model.layers for p in (layer.self_attn, layer.mlp)]
    for parent, names in parents:  # the output layer too: F.linear's bits follow the number of rows
        for name, mod in list(parent.named_children()):
            if isinstance(mod, torch.nn.Linear) and (names is None or name in names):
                w = mod.weight.detach().float().numpy()
                blocks = torch.from_numpy(gguf.quants.quantize(w, QT(qtype)).copy())
                bias = mod.bias.detach().float() if mod.bias is not None else None
                setattr(parent, name, GGUFLinear(blocks, qtype, w.shape[1], w.shape[0], bias, numerics="gguf-q8"))
    row_invariant_attention(model, "gguf-q8")
    decoder_layers.use_lean_layers(model)
    return model


def _counting(monkeypatch) -> list:
    """A list that gets an entry for every native call: a layer (True where it ran natively) or a
    whole decoder in one call (True)."""
    calls = []
    original, original_all = native_layer.forward, layer_kernel.layers

    def counted(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append(out is not None)
        return out

    def counted_all(*args, **kwargs):
        calls.append(True)
        return original_all(*args, **kwargs)

    monkeypatch.setattr(native_layer, "forward", counted)
    monkeypatch.setattr(layer_kernel, "layers", counted_all)
    return calls


def _row_invariance(model) -> None:
    """One-row steps == the rows of a chain verification, a tree pass and a batch, bit for bit."""
    V = model.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, V, (9,), generator=gen).tolist()
    toks = torch.randint(0, V, (5,), generator=gen).tolist()
    with torch.inference_mode():
        cache = new_cache(model)
        model_forward(model, cache, prompt, 1)
        n = cache.get_seq_length()
        chain = model_forward(model, cache, toks, len(toks))  # [5, V]
        crop_cache(cache, n)
        steps = torch.cat([model_forward(model, cache, [t], 1) for t in toks])
        assert torch.equal(chain, steps)
        crop_cache(cache, n)
        tree = tree_pass(model, cache, n)  # [p, a, b, c]: b and c children of a
        crop_cache(cache, n)
        ab = model_forward(model, cache, [5, 17, 33], 3)
        crop_cache(cache, n)
        ac = model_forward(model, cache, [5, 17, 60], 3)
        crop_cache(cache, n)
        assert torch.equal(tree[:3], ab) and torch.equal(tree[3], ac[2])
        # a batch of two prompts (the same length) == each alone
        other = torch.randint(0, V, (9,), generator=gen).tolist()
        both = model(input_ids=torch.tensor([prompt, other])).logits
        alone = [model(input_ids=torch.tensor([p])).logits[0] for p in (prompt, other)]
        assert torch.equal(both[0], alone[0]) and torch.equal(both[1], alone[1])
        # final hidden states through forward_with_hidden: the same pass
        cache = new_cache(model)
        logits, hidden = forward_with_hidden(model, cache, prompt, 1)
        assert torch.equal(logits, model_forward(model, new_cache(model), prompt, 1))


def _close_to_torch_layers(model, monkeypatch, calls: list, rel: float) -> None:
    """The native layers' logits within ``rel`` (of the largest logit) of the written-out torch layer's
    (``calls``: ``_counting``'s list, to see which ran)."""
    V = model.config.vocab_size
    prompt = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(5)).tolist()

    def passes():
        with torch.inference_mode():
            cache = new_cache(model)
            out = [model_forward(model, cache, prompt, 4)]
            out += [model_forward(model, cache, [t], 1) for t in (3, 8, 1)]
            out.append(model_forward(model, cache, [4, 5, 6], 3))
            return torch.cat(out)

    n = len(calls)
    native = passes()
    assert len(calls) > n and all(calls)
    monkeypatch.setenv("DRAFTCERT_NATIVE_LAYERS", "0")
    native_layer.forget(model)
    n = len(calls)
    torch_layers = passes()
    assert len(calls) == n  # the torch layer ran (its 8-bit roundings mostly absorb the last bits that differ)
    monkeypatch.delenv("DRAFTCERT_NATIVE_LAYERS")
    native_layer.forget(model)
    scale = torch_layers.abs().max()
    assert (native - torch_layers).abs().max() <= rel * scale
    assert (native.argmax(-1) == torch_layers.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_rows_split_over_threads_give_the_same_bits(family, monkeypatch):
    """Where it is large (DL_PARALLEL_FLOATS) the per-row work (norms, rotary, the activation, the residual
    adds) is split over the threads, and dl_layers keeps one scratch for every layer: a prefill's logits
    and a batch's are the same bits on 1, 2 and 3 threads.  (A wider model than the others here: at
    hidden 64 no pass of these sizes is large enough to be split.)"""
    model = _to_q8(tiny_lm(family, seed=4, hidden_size=512, intermediate_size=1024, num_attention_heads=8))
    calls = _counting(monkeypatch)
    V = model.config.vocab_size
    gen = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, V, (120,), generator=gen).tolist()  # 120 rows x 512 > 2^15 floats
    batch = torch.randint(0, V, (4, 30), generator=gen)
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            with torch.inference_mode():
                outs.append((model_forward(model, new_cache(model), prompt, len(prompt)), model(input_ids=batch).logits))
    finally:
        torch.set_num_threads(before)
    assert calls and all(calls)
    for prefill, batched in outs[1:]:
        assert torch.equal(prefill, outs[0][0]) and torch.equal(batched, outs[0][1])


@pytest.mark.parametrize("family,extra", [("llama", {}), ("qwen2", {}), ("qwen3", {}),
                                          ("llama", {"attention_bias": True, "mlp_bias": True})])
def test_native_layers_on_transformers_models(family, extra, monkeypatch):
    model = _to_q8(tiny_lm(family, seed=2, **extra))
    calls = _counting(monkeypatch)
    _row_invariance(model)
    assert calls and all(calls)
    _close_to_torch_layers(model, monkeypatch, calls, rel=0.02)


def test_native_layers_on_a_gguf_file(tmp_path, monkeypatch):
    from tests.tiny_gguf import tiny_gguf_llama

    model = tiny_gguf_llama(tmp_path, numerics="gguf-q8")  # q, k, v, gate, up of different types: one call each
    assert decoder_layers.use_lean_layers(model) == 2
    calls = _counting(monkeypatch)
    _row_invariance(model)
    assert calls and all(calls)
    _close_to_torch_layers(model, monkeypatch, calls, rel=0.02)


def test_stacked_and_separate_projections_give_the_same_bits(tmp_path):
    from draftcert.gguf.loader import load_gguf_causal_lm
    from tests.tiny_gguf import write_tiny_llama
    from transformers import AutoConfig

    path = tmp_path / "same.gguf"  # every projection one type: q/k/v and gate/up stack
    write_tiny_llama(path, tied=False, qtypes={k: 8 for k in ("emb", "q", "k", "v", "o", "gate", "up", "down", "out")})
    model = load_gguf_causal_lm(path, AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name), quiet=True,
                                numerics="gguf-q8")
    assert decoder_layers.use_lean_layers(model) == 2
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.__dict__.get("_siblings") is not None
    plan = native_layer.plan_of(layer)
    assert plan is not None and len(plan.linears) == 4  # qkv, o, gate_up, down
    ids = list(range(3, 20))
    with torch.inference_mode():
        stacked = model_forward(model, new_cache(model), ids, len(ids))
        for mod in model.modules():
            if isinstance(mod, GGUFLinear):
                dissolve_siblings(mod)
        plan = native_layer.plan_of(layer)  # made again: the projections' groups changed
        assert len(plan.linears) == 7
        separate = model_forward(model, new_cache(model), ids, len(ids))
        group_siblings(model)
        assert len(native_layer.plan_of(layer).linears) == 4
    assert torch.equal(stacked, separate)


def test_layers_not_all_q8_run_the_torch_layer(tmp_path):
    from tests.tiny_gguf import tiny_gguf_llama

    model = tiny_gguf_llama(tmp_path, numerics="gguf-exact-f32")
    assert all(native_layer.plan_of(layer) is None for layer in model.model.layers)
    float_model = tiny_lm("llama")
    decoder_layers.use_lean_layers(float_model)
    assert native_layer.plan_of(float_model.model.layers[0]) is None


def test_an_evaluation_records_whether_the_layers_run_natively(tmp_path, monkeypatch):
    """``evaluate``'s ``model_dtype``: a folder decoded with the torch layers is not resumed with the native ones."""
    from draftcert.cli.evaluate import arithmetic_of
    from draftcert.gguf.layers import set_numerics

    from tests.tiny_gguf import tiny_gguf_llama

    model = tiny_gguf_llama(tmp_path, numerics="gguf-q8")
    assert arithmetic_of(model) == "gguf-q8+native-layers"
    monkeypatch.setenv("DRAFTCERT_NATIVE_LAYERS", "0")
    native_layer.forget(model)
    assert arithmetic_of(model) == "gguf-q8"
    set_numerics(model, "gguf-exact-f32")
    assert arithmetic_of(model) == "gguf-exact-f32"
    assert arithmetic_of(tiny_lm("llama")) == "float32"


def test_a_plan_is_made_again_when_a_tensor_it_reads_is_replaced():
    model = _to_q8(tiny_lm("qwen2", seed=4))  # q/k/v biases
    layer = model.model.layers[0]
    ids = list(range(3, 14))

    def logits():
        with torch.inference_mode():
            return model_forward(model, new_cache(model), ids, len(ids))

    before, plan = logits(), native_layer.plan_of(layer)
    assert plan is not None and native_layer.plan_of(layer) is plan  # kept while nothing changes
    with torch.no_grad():  # a module's _apply swaps a parameter's storage under the same object
        layer.input_layernorm.weight.data = layer.input_layernorm.weight.data * 1.5
        layer.self_attn.q_proj.bias.data = layer.self_attn.q_proj.bias.data + 0.25
    changed = logits()
    assert native_layer.plan_of(layer) is not plan and not torch.equal(before, changed)
    native_layer.forget(model)
    assert torch.equal(changed, logits())  # the plan made again reads the new values
    new_proj = copy.deepcopy(layer.mlp.down_proj)
    layer.mlp.down_proj = new_proj  # a module replaced: made again too
    assert native_layer.plan_of(layer).linears[-1].packed.data_ptr() == new_proj.q8weight.data_ptr()
    layer.self_attn.o_proj.set_numerics("gguf-exact-f32")  # a projection leaves gguf-q8: the torch layer
    assert native_layer.plan_of(layer) is None


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])  # biases; head norms
def test_the_decoders_plans_are_kept_only_while_all_they_read_holds(family):
    """decoder_layers keeps the decoder's list of plans with a snapshot of what it read; every change the
    per-layer checks see (a child replaced, a hook, training mode, a parameter or its storage swapped, a
    projection's computation, forget) makes it decide again."""
    model = _to_q8(tiny_lm(family, seed=4))
    base = model.model
    layers = list(base.layers)
    first = decoder_layers._native_plans(base, layers)
    assert first is not None and decoder_layers._native_plans(base, layers) is first  # kept
    last = layers[-1]

    def again() -> list | None:
        plans = decoder_layers._native_plans(base, layers)
        assert plans is not first
        return plans

    handle = last.self_attn.o_proj.register_forward_pre_hook(lambda *a: None)
    assert again() is None  # a hooked child: the torch layer runs
    handle.remove()
    first = decoder_layers._native_plans(base, layers)
    handle = last.mlp.act_fn.register_forward_hook(lambda *a: None)
    assert again() is None
    handle.remove()
    first = decoder_layers._native_plans(base, layers)
    model.train()
    assert again() is None
    model.eval()
    first = decoder_layers._native_plans(base, layers)
    with torch.no_grad():  # storage swapped under the same object
        norm = last.self_attn.k_norm.weight if family == "qwen3" else last.self_attn.q_proj.bias
        norm.data = norm.data * 1.5
    plans = again()
    assert plans[-1] is native_layer.plan_of(last) and plans[-1] is not first[-1] and plans[0] is first[0]
    first = plans
    last.post_attention_layernorm.weight = torch.nn.Parameter(last.post_attention_layernorm.weight.detach() + 1)
    first = again()
    last.mlp.down_proj = copy.deepcopy(last.mlp.down_proj)  # a module replaced
    plans = again()
    assert plans[-1].linears[-1].packed.data_ptr() == last.mlp.down_proj.q8weight.data_ptr()
    first = plans
    native_layer.forget(model)
    first = again()
    assert decoder_layers._native_plans(base, layers[::-1]) is not first  # other layers: not the snapshot's
    first = decoder_layers._native_plans(base, layers)
    layers[0].self_attn.v_proj.set_numerics("gguf-exact-f32")  # gguf.layers.generation() moves
    assert again() is None


def test_a_pass_reuses_the_last_passs_layer_table_while_the_buffers_have_room():
    """forward_layers keeps the int64 table it hands dl_layers on the cache: a pass whose layers keep their
    buffers (with room for its rows) only writes the new length into it; a reallocation makes it again.
    (That the bits are the per-layer path's either way: test_all_layers_in_one_call_give_the_per_layer_bits.)"""
    model = _to_q8(tiny_lm("llama", seed=6))
    with torch.inference_mode():
        cache = new_cache(model)
        model_forward(model, cache, list(range(3, 13)), 1)
        first = cache.__dict__[native_layer._IO]
        model_forward(model, cache, [5], 1)
        kept = cache.__dict__[native_layer._IO]
        assert kept is first and int(kept[6][0, 9]) == 10  # the same table, the new length written in
        room = kept[2]
        model_forward(model, cache, [t % model.config.vocab_size for t in range(room)], 1)  # past the room: buffers made again
        assert cache.__dict__[native_layer._IO] is not first


@pytest.mark.parametrize("head_dim,rope", [(16, None), (64, None), (128, {"rope_type": "llama3", "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 64}), (64, {"rope_type": "linear", "factor": 2.0})])
def test_a_rotary_tables_rows_are_the_modules_bits(head_dim, rope):
    """position_rows (what the native decoder reads) against rotary_rows of the module's own call for the same
    positions: a one-row step's, a chain's, a tree's (a repeated position), across a table block and far out."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    extra = {"rope_parameters": {"rope_theta": 10000.0, **rope}} if rope else {}
    cfg = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                                   max_position_embeddings=4096, **extra)
    rotary = LlamaRotaryEmbedding(cfg)
    x = torch.zeros(1, 1, 4 * head_dim)
    with torch.inference_mode():
        for ids in ([0], [7], list(range(3, 12)), [250, 251, 252, 252, 253, 256, 257], [1500], list(range(900, 1000))):
            pos = torch.tensor([ids])
            cos, sin = native_layer.position_rows(rotary, pos, x)
            ref_cos, ref_sin = native_layer.rotary_rows(rotary(x, pos), 1, len(ids))
            assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin), ids
            pair = native_layer.position_pair(rotary, pos, x)  # the module's (cos, sin), its rows kept on sin
            assert all(torch.equal(a, b) for a, b in zip(pair, rotary(x, pos)))
            rows = native_layer.rotary_rows(pair, 1, len(ids))
            assert torch.equal(rows[0], ref_cos) and torch.equal(rows[1], ref_sin)
        assert rotary.__dict__[native_layer._TABLE][1] == 1536  # grown in blocks, to the highest position seen
        with torch.no_grad():  # the frequencies changed in place: a new table
            rotary.inv_freq.mul_(0.5)
        cos, _ = native_layer.position_rows(rotary, torch.tensor([[40]]), x)
        assert torch.equal(cos, native_layer.rotary_rows(rotary(x, torch.tensor([[40]])), 1, 1)[0])
        assert rotary.__dict__[native_layer._TABLE][1] == native_layer.TABLE_BLOCK
        assert native_layer.position_rows(rotary, torch.tensor([[-1, 0]]), x) is None
        assert native_layer.position_rows(rotary, torch.tensor([[1, 2]]), torch.zeros(2, 2, 4 * head_dim)) is None  # a batch
    rotary.rope_type = "dynamic"  # frequencies that follow the sequence length: the module's call
    assert native_layer.position_rows(rotary, torch.tensor([[3]]), x) is None


def test_a_rotary_module_made_under_inference_mode_keeps_a_right_table():
    """A module made inside ``torch.inference_mode`` (a model loaded there) holds inference tensors, which
    keep no version counter: its table is kept while the frequencies' values are the same, made again when
    they change in place, and every row is still the module's own bits."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=512)
    x = torch.zeros(1, 1, 64)
    with torch.inference_mode():
        rotary = LlamaRotaryEmbedding(cfg)
        assert rotary.inv_freq.is_inference()
        pos = torch.tensor([[5, 6, 7]])
        cos, _ = native_layer.position_rows(rotary, pos, x)
        assert torch.equal(cos, native_layer.rotary_rows(rotary(x, pos), 1, 3)[0])
        table = rotary.__dict__[native_layer._TABLE]
        native_layer.position_rows(rotary, pos, x)
        assert rotary.__dict__[native_layer._TABLE] is table  # the same values: kept
        rotary.inv_freq.mul_(0.5)  # in place, and no version counter says so
        cos, _ = native_layer.position_rows(rotary, pos, x)
        assert rotary.__dict__[native_layer._TABLE] is not table
        assert torch.equal(cos, native_layer.rotary_rows(rotary(x, pos), 1, 3)[0])


def test_a_model_made_under_inference_mode_decodes_natively():
    """A q8 model whose every tensor was made inside ``torch.inference_mode`` (its embedding's blocks, its
    rotary frequencies) decodes: the same logits as the same model made outside it."""
    outside = _to_q8(tiny_lm("llama", seed=11))
    with torch.inference_mode():
        inside = _to_q8(tiny_lm("llama", seed=11))
    ids = list(range(3, 12))
    out = []
    for model in (outside, inside):
        with torch.inference_mode():
            cache = new_cache(model)
            rows = [model_forward(model, cache, ids, 2)] + [model_forward(model, cache, [t], 1) for t in (5, 9, 2)]
        out.append(rows)
    assert all(torch.equal(a, b) for a, b in zip(*out))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_all_layers_in_one_call_give_the_per_layer_bits(family, monkeypatch):
    """forward_layers (one C call for the decoder, k and v written into kv_buffer's buffers) against the
    per-layer calls: the same logits and cache, bit for bit, over a prefill, steps, a chain, a tree
    and buffers that grow (reallocate) on the way."""
    from draftcert.forward import kv_buffer

    monkeypatch.setattr(kv_buffer, "MIN_SPARE", 2)  # reallocate often
    model = _to_q8(tiny_lm(family, seed=6))
    V = model.config.vocab_size
    gen = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, V, (10,), generator=gen).tolist()
    steps = torch.randint(0, V, (6,), generator=gen).tolist()

    def run():
        out = []
        with torch.inference_mode():
            cache = new_cache(model)
            out.append(model_forward(model, cache, prompt, 3))
            for t in steps:
                out.append(model_forward(model, cache, [t], 1))
            n = cache.get_seq_length()
            out.append(model_forward(model, cache, steps[:4], 4))
            crop_cache(cache, n)
            out.append(tree_pass(model, cache, n))
            out.append(forward_with_hidden(model, cache, [7, 8], 2)[1])
            out += [layer.keys.clone() for layer in cache.layers] + [layer.values.clone() for layer in cache.layers]
        return out

    calls = []
    original = layer_kernel.layers
    monkeypatch.setattr(layer_kernel, "layers", lambda *a: (calls.append(1), original(*a))[1])
    one_call = run()
    assert len(calls) >= len(steps) + 3  # every pass above took the one-call path
    monkeypatch.setattr(native_layer, "ALL_LAYERS_IN_ONE_CALL", False)
    n = len(calls)
    per_layer = run()
    assert len(calls) == n
    assert len(one_call) == len(per_layer)
    for i, (a, b) in enumerate(zip(one_call, per_layer)):
        assert torch.equal(a, b), i
