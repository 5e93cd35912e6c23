"""The family fixture (tests/decode/families.py) itself: every tiny family model builds, greedy
``generate`` runs on it at batch 1 with clear top-2 margins, its cache holds the layer kinds its
``KIND`` promises, and its windows are crossed by short inputs.  Greedy at batch 4 with left
padding equals each row decoded alone for one family per kind here, for every family under
``-m slow``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from .families import EOS, FAMILIES, KIND, MISSING, PAD, VOCAB, WINDOW, build

KINDS = {"full", "sliding", "hybrid", "recurrent", "alibi", "local"}
NEW = 24
LENS = (5, 9, 13, 17)
_g = torch.Generator().manual_seed(123)
PROMPTS = [torch.randint(3, VOCAB, (n,), generator=_g) for n in LENS]
# one family per kind, batch-4 checked in the default run
DEFAULT_BATCHED = ["llama", "qwen2_sliding", "qwen3_5", "mamba", "mpt", "gpt_neo"]


def _greedy(model, ids, mask):
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
            eos_token_id=EOS, output_scores=True, return_dict_in_generate=True,
        )


def _until_eos(tokens):
    tokens = list(tokens)
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


def test_every_family_has_a_kind():
    assert set(FAMILIES) | set(MISSING) == set(KIND)
    assert set(KIND.values()) <= KINDS
    assert not MISSING, f"the installed transformers lacks: {MISSING}"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_builds_and_greedy_generates(name):
    model = build(name)
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.config.vocab_size == VOCAB and model.generation_config.pad_token_id == PAD
    p = PROMPTS[1]
    out = _greedy(model, p[None], torch.ones(1, len(p), dtype=torch.long))
    new = out.sequences[0, len(p):].tolist()
    assert 1 <= len(new) <= NEW and (len(new) == NEW or new[-1] == EOS)
    gaps = torch.stack([s[0].topk(2).values for s in out.scores])
    gaps = gaps[:, 0] - gaps[:, 1]
    assert gaps.median() > 1e-2, f"{name}: near-tied greedy steps, median top-2 gap {gaps.median():.2g}"
    # same seed, same weights
    again = build(name)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_cache_layers_match_kind(name):
    model = build(name)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(PROMPTS[2][None], cache=cache, use_cache=True)
    kinds = [type(layer).__name__ for layer in cache.layers]
    recurrent = [k for k in kinds if "LinearAttention" in k]
    attention = [k for k in kinds if k.startswith("Dynamic") or "FullAttention" in k]
    kind = KIND[name]
    if kind == "recurrent":
        assert recurrent and not attention, kinds
    elif kind == "hybrid":
        assert recurrent and attention, kinds
    else:
        assert not recurrent, kinds
    if kind == "sliding":
        assert "DynamicSlidingWindowLayer" in kinds, kinds
        assert model.config.sliding_window == WINDOW
    if kind in ("full", "alibi", "local"):
        assert set(kinds) == {"DynamicLayer"}, kinds


def _batch_consistent(model):
    singles = []
    for p in PROMPTS:
        out = _greedy(model, p[None], torch.ones(1, len(p), dtype=torch.long))
        singles.append(_until_eos(out.sequences[0, len(p):].tolist()))
    width = max(LENS)
    ids = torch.full((len(LENS), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(LENS), width, dtype=torch.long)
    for i, p in enumerate(PROMPTS):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    rows = _greedy(model, ids, mask).sequences[:, width:].tolist()
    for i, (row, alone) in enumerate(zip(rows, singles)):
        assert row[: len(alone)] == alone and all(t == PAD for t in row[len(alone):]), (
            f"row {i} (prompt length {LENS[i]}) differs from the row decoded alone"
        )


@pytest.mark.parametrize("name", DEFAULT_BATCHED)
def test_left_padded_batch_equals_rows_alone(name):
    _batch_consistent(build(name))


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in DEFAULT_BATCHED])
def test_left_padded_batch_equals_rows_alone_every_family(name):
    _batch_consistent(build(name))


@pytest.mark.parametrize("name", [n for n in FAMILIES if KIND[n] in ("sliding", "local")])
def test_window_is_crossed_by_short_inputs(name):
    """40 tokens with the window of 8 differ from the same weights with no window."""
    import transformers

    model = build(name)
    cfg = FAMILIES[name]()
    if KIND[name] == "local":
        cfg.attention_types, cfg.attention_layers = [[["global"], cfg.num_layers]], ["global"] * cfg.num_layers
    else:  # same layer types (and so the same rotary per layer type), a window no input reaches
        cfg.sliding_window = 10**6
    unwindowed = type(model)._from_config(cfg, dtype=torch.float32).eval()
    unwindowed.load_state_dict(model.state_dict())
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a, b = model(ids).logits, unwindowed(ids).logits
    assert torch.allclose(a[:, :WINDOW], b[:, :WINDOW], atol=1e-4), transformers.__version__
    assert (a - b).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["qwen3", "mixtral", "qwen3_5_moe"])
def test_float64_build_generates(name):
    """float64 works, MoE included (build switches the experts off grouped_mm, which takes no float64)."""
    model = build(name, dtype=torch.float64)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    p = PROMPTS[0]
    out = _greedy(model, p[None], torch.ones(1, len(p), dtype=torch.long))
    assert out.sequences.shape[1] > len(p)
