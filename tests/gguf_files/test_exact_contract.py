"""GGUF blocks computed as stored (kernels/block_matmul.c, the gguf package): exact weights, the derived
float32 bound, batch invariance, the fallback without a kernel, and GGUF files through both paths.

The bound (block_matmul.error_bound): the kernel sums the K products of an output in VW lanes by fused
multiply-add in k order, then a pairwise tree over the lanes, so each product is rounded at most
n = K / VW + log2(VW) times and |y_kernel - y_exact| <= gamma_n sum_k |w_k x_k| (gamma_n =
n u / (1 - n u), u = 2^-24); against F.linear (order unknown, at most gamma_K) the two differ by at
most (gamma_n + gamma_K) sum_k |w_k x_k|.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from draftcert.kernels import block_matmul  # noqa: E402
from draftcert.gguf.layers import KEPT_ROWS_CALL, GGUFEmbedding, GGUFLinear, numerics_of  # noqa: E402
from draftcert.gguf.blocks import KERNEL_TYPES, block_type, dequantize_gguf  # noqa: E402
from draftcert.gguf.loader import load_gguf_causal_lm  # noqa: E402
from draftcert.gguf.reader import read_gguf  # noqa: E402

from tests.tiny_gguf import random_blocks, write_tiny_llama  # noqa: E402

needs_kernel = pytest.mark.skipif(not block_matmul.LIBRARY.available(), reason=f"no block_matmul kernel: {block_matmul.LIBRARY.reason()}")
TYPES = sorted(KERNEL_TYPES)
def shapes(qtype: int):
    qk = block_matmul.block_shape(qtype)[0]
    return [(37, 3 * qk), (64, 2 * qk), (5, qk)] if qk == 32 else [(19, 512), (64, 256)]


def _ref(blocks: np.ndarray, qtype: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(blocks, QT(qtype))).reshape(blocks.shape[0], -1)


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES, ids=[block_type(t).name for t in TYPES])
def test_decode_is_gguf_dequantize_bit_for_bit(qtype):
    for n, k in shapes(qtype):
        b = random_blocks(qtype, n, k, seed=n + k)
        got = block_matmul.dequantize(torch.from_numpy(b), qtype, n, k)
        assert torch.equal(got.view(torch.int32), _ref(b, qtype).view(torch.int32))
        assert np.array_equal(dequantize_gguf(b, qtype).view(np.int32), _ref(b, qtype).numpy().view(np.int32))


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES, ids=[block_type(t).name for t in TYPES])
def test_linear_within_the_derived_bound(qtype):
    g = torch.Generator().manual_seed(qtype)
    for n, k in shapes(qtype):
        b = random_blocks(qtype, n, k, seed=n * k)
        w = _ref(b, qtype)
        bias = torch.randn(n, generator=g)
        for m in range(1, 17):
            x = torch.randn(m, k, generator=g)
            for bb in (None, bias):
                y = block_matmul.linear(x, torch.from_numpy(b), qtype, n, k, bb)
                exact = x.double() @ w.double().T + (0 if bb is None else bb.double())
                mass = x.double().abs() @ w.double().abs().T + (0 if bb is None else bb.double().abs())
                bound = block_matmul.error_bound(mass, k, extra_roundings=int(bb is not None)) + 1e-300
                assert ((y.double() - exact).abs() <= bound).all(), (n, k, m)
                lin = F.linear(x, w, bb)
                both = bound + mass * (k * 2.0 ** -24 / (1 - k * 2.0 ** -24))
                assert ((y.double() - lin.double()).abs() <= both).all(), (n, k, m)


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES, ids=[block_type(t).name for t in TYPES])
def test_rows_alone_and_in_passes_of_any_size_are_identical(qtype):
    n, k = 70, 512  # 70 rows: every tail of the row groups; 512: the K-quants' 2 blocks
    b = torch.from_numpy(random_blocks(qtype, n, k, seed=3))
    x = torch.randn(80, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([block_matmul.linear(x[i:i + 1], b, qtype, n, k, bias) for i in range(80)])
    for m in list(range(2, 17)) + [65, 80]:  # 65, 80: past one group of inputs (MGROUP = 64)
        for start in (0, 80 - m):
            assert torch.equal(block_matmul.linear(x[start:start + m], b, qtype, n, k, bias), alone[start:start + m]), m
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # outputs split over threads: each still computed whole by one
        assert torch.equal(block_matmul.linear(x[:9], b, qtype, n, k, bias), alone[:9])
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_gguflinear_module():
    qtype, n, k = 12, 40, 512
    b = torch.from_numpy(random_blocks(qtype, n, k, seed=5))
    bias = torch.randn(n)
    lay = GGUFLinear(b, qtype, k, n, bias=bias)
    w = _ref(b.numpy(), qtype)
    assert torch.equal(lay.weight, w) and lay.qtype_name == "Q4_K"
    x = torch.randn(3, 7, k)
    y = lay(x)
    assert y.shape == (3, 7, n)
    assert torch.equal(y[1, 2:3], lay(x[1, 2:3]))  # batch invariant through the module
    mass = x.double().abs() @ w.double().abs().T + bias.double().abs()
    assert ((y.double() - (x.double() @ w.double().T + bias.double())).abs()
            <= block_matmul.error_bound(mass, k, extra_roundings=1)).all()
    yb = lay(x.to(torch.bfloat16))  # another dtype: the dequantised weights through F.linear
    assert yb.dtype == torch.bfloat16 and torch.allclose(yb.float(), y, rtol=0.05, atol=0.5)
    with pytest.raises(ValueError):
        GGUFLinear(b[:, :-1].contiguous(), qtype, k, n)
    emb = torch.nn.Parameter(w.clone(), requires_grad=False)
    assert GGUFLinear(b, qtype, k, n, tied=emb).weight is emb


def test_native_disabled_falls_back_with_the_reason():
    code = ("from draftcert.kernels import block_matmul; from draftcert.gguf import layers; import torch, numpy as np\n"
            "print(block_matmul.LIBRARY.available(), '|', block_matmul.LIBRARY.reason())\n"
            "b = torch.zeros(4, 34, dtype=torch.uint8)\n"
            "lay = layers.GGUFLinear(b, 8, 32, 4)\n"
            "print(tuple(lay(torch.ones(2, 32)).shape), layers.numerics_of(torch.nn.Sequential(lay)))\n")
    env = {**os.environ, "DRAFTCERT_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()[:2]
    assert first == "False | disabled by DRAFTCERT_NATIVE=0"
    assert second == "(2, 4) float32"


# ----------------------------------------------------------------------------- GGUF files


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES, ids=[block_type(t).name for t in TYPES])
def test_gguf_embedding_looks_up_the_dequantised_rows_bit_for_bit(qtype):
    V, D = 37, 512
    blocks = random_blocks(qtype, V, D, seed=qtype)
    table = torch.from_numpy(np.asarray(dequantize(blocks, QT(qtype)), dtype=np.float32).reshape(V, D))  # gguf-py's decode
    emb = GGUFEmbedding(torch.from_numpy(blocks), qtype, V, D)
    assert torch.equal(emb.weight, table) and torch.equal(emb.to_embedding().weight, table)
    ids = torch.tensor([[0, 36, 5, 5], [17, 2, 36, 0]])  # [B, T], repeats and both ends of the table
    out = emb(ids)  # [B, T, D]
    assert out.shape == (2, 4, D) and out.dtype == torch.float32
    assert torch.equal(out, F.embedding(ids, table))
    assert torch.equal(emb(ids[1, 2]), table[36]) and emb(ids[:, :0]).shape == (2, 0, D)
    with pytest.raises(IndexError, match=r"\[0, 37\)"):
        emb(torch.tensor([3, 37]))
    with pytest.raises(IndexError, match=r"\[0, 37\)"):
        emb(torch.tensor([-1]))
    many = torch.arange(V).repeat(2)  # past KEPT_ROWS_CALL: one lookup of the blocks, the same rows
    assert many.numel() > KEPT_ROWS_CALL and torch.equal(emb(many), table[many])
    first = emb(ids[0])
    first.add_(1)  # a caller writing into what it got leaves the kept rows alone
    assert torch.equal(emb(ids[0]), table[ids[0]])
    with torch.no_grad():  # blocks changed in place: rows decoded again
        emb.qweight[5] = emb.qweight[6]
    assert torch.equal(emb(torch.tensor([5])), table[6:7])
    with pytest.raises(ValueError, match="do not hold"):
        GGUFEmbedding(torch.from_numpy(blocks[:, :-1]), qtype, V, D)


@needs_kernel
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tiny_gguf_files_give_the_float32_logits_within_the_bound(tmp_path, tied):
    from transformers import AutoConfig, AutoModelForCausalLM

    qtypes = {"emb": 8, "q": 12, "k": 3, "v": 6, "o": 14, "gate": 12, "up": 8, "down": 3, "out": 14}
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, tied=tied, qtypes=qtypes)
    meta, tensors = read_gguf(path)
    reader = gguf.GGUFReader(str(path))
    assert meta["general.architecture"] == "llama" and len(tensors) == len(reader.tensors)
    for t in reader.tensors:  # the tensor table read as gguf's own reader reads it
        assert int(t.tensor_type) == tensors[t.name].qtype and np.array_equal(np.asarray(t.data), tensors[t.name].data)
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    model = load_gguf_causal_lm(path, config, quiet=True)
    quant = {n: m for n, m in model.named_modules() if isinstance(m, GGUFLinear)}
    assert len(quant) == 2 * 7 + 1 and numerics_of(model) == "gguf-exact-f32"
    assert isinstance(model.lm_head, GGUFLinear) and model.lm_head.qtype == (8 if tied else 14)
    for name, m in quant.items():  # exact weights, the llama q/k rows un-permuted as transformers does
        assert torch.equal(m.weight, ref.get_submodule(name).weight), name
    emb = model.get_input_embeddings()  # the table kept as its Q8_0 blocks, the values dequantised as transformers does
    assert isinstance(emb, GGUFEmbedding) and emb.qtype == 8 and model.draftcert_gguf["embedding"] == "Q8_0"
    assert torch.equal(emb.weight, ref.get_input_embeddings().weight)
    if tied:  # the head computes from the embedding's own blocks: one copy, the file's
        assert model.lm_head.qweight.data_ptr() == emb.qweight.data_ptr()
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(ids).logits, ref(ids).logits
        one = model(ids[1:]).logits
    # the logits' error: float32 GEMMs through 2 layers, softmax and norms; the kernel's own share is
    # gamma_n (n = K / VW + 4) of sum |w x| per layer. A loose float32 tolerance tied to that:
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
    # a prompt alone and in a batch of two: identical bits.  (Not yet across query lengths: torch's
    # attention sums in an order that depends on the number of query rows; the linears do not.)
    assert torch.equal(one, a[1:])


@needs_kernel
def test_self_quant_drafter_of_a_gguf_target_requantises_its_float32_weights(tmp_path):
    from transformers import AutoConfig

    from draftcert.models.drafter_loading import derive_drafter

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, tied=True, qtypes={"emb": 8, "q": 12, "k": 3, "v": 6, "o": 14, "gate": 12, "up": 8, "down": 3})
    model = load_gguf_causal_lm(path, AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name), quiet=True)
    before = {n: m.qweight.clone() for n, m in model.named_modules() if isinstance(m, GGUFLinear)}
    d = derive_drafter(model, "self:quant=2")
    q_proj = model.model.layers[0].self_attn.q_proj
    dq = d.model.layers[0].self_attn.q_proj
    assert type(dq) is torch.nn.Linear and not torch.equal(dq.weight, q_proj.weight)  # 2 bits: other values
    assert isinstance(q_proj, GGUFLinear)  # the target keeps its blocks, unchanged
    assert all(torch.equal(m.qweight, before[n]) for n, m in model.named_modules() if isinstance(m, GGUFLinear))


@needs_kernel
def test_unsupported_types_are_dequantised_with_one_line(tmp_path, capsys):
    from transformers import AutoConfig

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, tied=True, qtypes={"emb": 8, "q": 2, "k": 2, "up": 8})  # Q4_0: no kernel
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    model = load_gguf_causal_lm(path, config)
    err = capsys.readouterr().err
    assert err.count("without a kernel dequantised to float32 at load: Q4_0 (4)") == 1
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert isinstance(model.model.layers[0].mlp.up_proj, GGUFLinear)


# ----------------------------------------------------------------------------- the embedded model


@pytest.fixture(scope="module")
def embedded_both():
    from draftcert.models import ModelUnavailable, load_target

    try:
        q = load_target(weights="gguf", fast_linear=False)
        f = load_target(weights="float32", fast_linear=False)
    except ModelUnavailable as e:
        pytest.skip(f"embedded model unavailable: {e}")
    return q, f


@needs_kernel
def test_embedded_gguf_is_the_float32_model_computed_from_its_blocks(embedded_both):
    from draftcert.models.eagle import target_fingerprint
    from draftcert.prompts import encode_prompt

    (q, tok), (f, _) = embedded_both
    assert numerics_of(q) == "gguf-exact-f32" and numerics_of(f) == "float32"
    layers = {n: m for n, m in q.named_modules() if isinstance(m, GGUFLinear)}
    assert len(layers) == 30 * 7 + 1 and {m.qtype_name for m in layers.values()} == {"Q4_1", "Q8_0"}
    emb = q.get_input_embeddings()  # the tied table kept once, as the file's Q8_0 blocks
    assert isinstance(emb, GGUFEmbedding) and q.lm_head.qtype_name == "Q8_0" == emb.qtype_name
    assert q.lm_head.qweight.data_ptr() == emb.qweight.data_ptr()
    assert torch.equal(emb.weight, f.get_input_embeddings().weight)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.7.self_attn.k_proj", "model.layers.29.mlp.down_proj"):
        assert torch.equal(layers[name].weight, f.get_submodule(name).weight), name  # exact, q/k rows un-permuted
    assert target_fingerprint(q) == target_fingerprint(f)  # the shipped drafter binds to it
    ids = torch.tensor([encode_prompt(tok, "What is the capital of France?")])
    with torch.no_grad():
        a, b = q(ids).logits, f(ids).logits
    # 30 layers of float32 sums in two orders (each layer within (gamma_n + gamma_K) sum |w x|)
    assert (a - b).abs().max() <= 1e-4 * b.abs().max()


@needs_kernel
def test_vocabulary_checks_read_the_head_size_without_decoding_its_blocks(embedded_both, monkeypatch):
    # every speculative_generate call checks the two vocabularies: a full decode of a GGUF head there
    # cost 0.5 s per look on the pair's 151,936 x 1,536 output layer (eight looks a call)
    from draftcert.models.drafter_loading import check_compatible
    from draftcert.models.hf import output_rows, vocab_size_of

    (q, tok), _ = embedded_both

    def no_decode(self):
        raise AssertionError("the head's blocks were decoded")

    from draftcert.models import load_drafter

    drafter = load_drafter("default", q, tok)  # binding hashes the full head once (its fingerprint)
    ids = drafter.vocab_ids
    expect = q.lm_head.weight.index_select(0, ids)
    monkeypatch.setattr(GGUFLinear, "dequantized", no_decode)
    assert output_rows(q) == vocab_size_of(q) == 49152
    check_compatible(q, tok, q, tok)
    # a decode's start gathers the draft vocabulary's head rows: only those rows' blocks are decoded
    assert torch.equal(q.lm_head.weight_rows(ids), expect)
    assert torch.equal(drafter.head_weight(), expect) and drafter.head_weight() is drafter.head_weight()


@needs_kernel
def test_strict_decoding_on_the_gguf_target_is_its_greedy_decoding(embedded_both):
    from draftcert.decode import speculative_generate
    from draftcert.prompts import encode_prompt

    (q, tok), _ = embedded_both
    ids = torch.tensor([encode_prompt(tok, "Name three primary colours.")])
    with torch.no_grad():
        greedy = q.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)[0, ids.shape[1]:]
    res = speculative_generate(q, "default", ids, "strict", k=3, max_new_tokens=16)
    assert list(res.tokens) == greedy.tolist()[:len(res.tokens)] and len(res.tokens) == len(greedy)


def test_weights_option(monkeypatch):
    from draftcert.models import load_target
    from draftcert.kernels import block_matmul
    from draftcert.models.loading import default_weights, resolve_weights

    monkeypatch.delenv("DRAFTCERT_WEIGHTS", raising=False)
    assert resolve_weights(None) == default_weights() and resolve_weights("GGUF") == "gguf"
    assert default_weights() == ("gguf-q8" if block_matmul.q8_vectorised() else "gguf")
    monkeypatch.setenv("DRAFTCERT_WEIGHTS", "gguf")
    assert resolve_weights(None) == "gguf" and resolve_weights("float32") == "float32"
    with pytest.raises(ValueError, match="weights must be one of"):
        resolve_weights("int8")
    with pytest.raises(ValueError, match="computes in float32"):
        load_target(weights="gguf", dtype="bfloat16")


def test_target_fingerprint_is_computed_once_and_follows_weight_changes(monkeypatch):
    # loading and binding a feature drafter looks the fingerprint up several times per decode call;
    # hashing (and, on GGUF layers, decoding) the head and the embedding each time cost 0.4 s a look
    from draftcert.models import eagle
    from tests.tiny_models import tiny_qwen3

    model = tiny_qwen3()[0]  # (model, tokenizer)
    first = eagle.target_fingerprint(model)
    calls = []
    real = eagle.hashlib.sha256
    monkeypatch.setattr(eagle.hashlib, "sha256", lambda *a: calls.append(1) or real(*a))
    assert eagle.target_fingerprint(model) == first and not calls  # unchanged weights: the cached answer
    w = model.get_input_embeddings().weight
    old = w[3, 0].item()
    with torch.no_grad():
        w[3, 0] += 1.0  # an in-place edit
    changed = eagle.target_fingerprint(model)
    assert calls and changed["weights_sha256"] != first["weights_sha256"]
    with torch.no_grad():
        w[3, 0] = old  # back to the same values: the same hash again
    assert eagle.target_fingerprint(model) == first
