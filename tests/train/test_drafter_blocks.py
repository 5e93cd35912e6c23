"""A feature drafter on a GGUF target computes as the target does: Q8_0 blocks under the target's
contract, its head the draft vocabulary's rows of the target's own output blocks (models/eagle.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftcert.decode import greedy_generate, speculative_generate
from draftcert.gguf.blocks import decode_rows, quantize_rows
from draftcert.gguf.layers import GGUFLinear, set_numerics
from draftcert.models.eagle import DRAFTER_BLOCKS, EagleDrafter, load_eagle, save_eagle
from tests.tiny_gguf import tiny_gguf_llama

VOCAB_IDS = [1, 3, 4, 7, 10, 20, 33, 41, 50, 63, 70, 95]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.set_num_threads(1)
    return tiny_gguf_llama(tmp_path_factory.mktemp("tiny"), out_type=8)


def random_drafter(target, width=64, seed=0):
    """A drafter with random (not identity) weights: every linear matters to its output."""
    torch.manual_seed(seed)
    d = EagleDrafter(target, VOCAB_IDS, intermediate_size=width)
    with torch.no_grad():
        for name, lin in d.block_linears().items():
            lin.weight.normal_(0, 0.3 / lin.in_features ** 0.5)
        d.tail.bias.fill_(-2.0)
    return d.eval().requires_grad_(False)


def _block_drafter(target, tmp_path):
    """A block drafter as a file holds it, loaded for the target."""
    return load_eagle(save_eagle(random_drafter(target), tmp_path / "d.safetensors", blocks=True), target)


def test_saved_blocks_round_trip_and_are_what_runs(target, tmp_path):
    d = random_drafter(target)
    want = {name: quantize_rows(lin.weight, DRAFTER_BLOCKS) for name, lin in d.block_linears().items()}
    assert set(want) >= {"fc", "layer.self_attn.q_proj", "layer.mlp.down_proj"}
    f16 = save_eagle(d, tmp_path / "f16.safetensors")
    q8 = save_eagle(d, tmp_path / "q8.safetensors", blocks=True)
    assert q8.stat().st_size < 0.6 * f16.stat().st_size  # 34 bytes per 32 weights against 64
    back = load_eagle(q8, target)
    assert back.intermediate_size == 64 and back.layer.mlp.gate_proj.out_features == 64
    for name, lin in back.block_linears().items():
        assert isinstance(lin, GGUFLinear) and lin.qtype == DRAFTER_BLOCKS, name
        assert torch.equal(lin.qweight, want[name]), name  # the file's blocks, as stored
    # saved again, the same blocks (nothing re-quantised on the way)
    again = load_eagle(save_eagle(back, tmp_path / "again.safetensors", blocks=True), target)
    for name, lin in again.block_linears().items():
        assert torch.equal(lin.qweight, want[name]), name
    # a float16 file of the same drafter runs from blocks too, quantised at load
    from_f16 = load_eagle(f16, target)
    assert all(isinstance(m, GGUFLinear) for m in from_f16.block_linears().values())


def test_head_is_the_targets_own_rows(target, tmp_path):
    d = _block_drafter(target, tmp_path)
    head = d.head_layer()
    out = target.get_output_embeddings()
    assert isinstance(head, GGUFLinear) and head.qtype == out.qtype
    assert torch.equal(head.qweight, out.qweight[torch.tensor(VOCAB_IDS)])
    g = torch.randn(3, out.in_features)
    assert torch.equal(head(g), out(g)[:, VOCAB_IDS])  # a row's output depends on its blocks only


def test_block_drafter_computes_the_dequantised_weights(target, tmp_path):
    """Under gguf-exact-f32 the block drafter's step equals a float drafter holding the blocks' values,
    up to float32 summation order."""
    d = _block_drafter(target, tmp_path)
    ref = random_drafter(target)
    with torch.no_grad():
        for name, lin in ref.block_linears().items():
            lin.weight.copy_(decode_rows(quantize_rows(lin.weight, DRAFTER_BLOCKS), DRAFTER_BLOCKS, lin.in_features))
    rows = ref.head_weight()
    tokens = torch.tensor([[5, 9, 2, 40]])
    feats = torch.randn(1, 4, ref.hidden_size)
    pos = torch.arange(4)[None]
    mask = torch.triu(torch.full((4, 4), torch.finfo(torch.float32).min), 1)[None, None]
    set_numerics(target, "gguf-exact-f32")
    d.run_from_blocks("gguf-exact-f32")
    g1, red1, tail1 = d.step(tokens, feats, pos, mask)
    g2, red2, tail2 = ref.step(tokens, feats, pos, mask, head_weight=rows)
    torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(red1, F.linear(g1, rows), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(tail1, tail2, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("numerics", ["gguf-exact-f32", "gguf-q8"])
@pytest.mark.parametrize("tree", [None, (2, 2)])
def test_strict_with_a_block_drafter_is_greedy(target, numerics, tree, tmp_path):
    set_numerics(target, numerics)
    d = _block_drafter(target, tmp_path)
    assert d.fc.numerics == numerics and d.head_layer().numerics == numerics
    g = torch.Generator().manual_seed(1)
    for n in (3, 9):
        prompt = torch.randint(0, 96, (n,), generator=g).tolist()
        ref = greedy_generate(target, prompt, 16, eos_token_id=[])
        res = speculative_generate(target, d, prompt, "strict", k=3, tree=tree, max_new_tokens=16, eos_token_id=[])
        assert res.tokens == ref
        assert res.stats.drafter_forwards > 0
    set_numerics(target, "gguf-exact-f32")


def test_damaged_blocks_are_refused(target, tmp_path):
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    p = save_eagle(random_drafter(target), tmp_path / "d.safetensors", blocks=True)
    with safe_open(str(p), "pt") as f:
        meta = f.metadata()
    sd = load_file(str(p))
    sd["fc.weight"] = sd["fc.weight"][:, :-1].contiguous()  # a row one byte short
    bad = tmp_path / "bad.safetensors"
    save_file(sd, str(bad), metadata=meta)
    with pytest.raises(ValueError, match="fc.weight"):
        load_eagle(bad, target)
