"""tiny_qwen3 and load_target on local checkpoints (no network)."""

import pytest
import torch

from draftcert.models import ModelUnavailable, load_target

from tests.tiny_models import tiny_qwen3, tiny_tokenizer
from draftcert.prompts import encode_prompt


def test_tiny_qwen3_is_deterministic_and_leaves_global_rng():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    m1, tok = tiny_qwen3(seed=0)
    after = torch.rand(1)
    assert torch.equal(before, after)  # fork_rng: callers' randomness unaffected
    m2, _ = tiny_qwen3(seed=0)
    m3, _ = tiny_qwen3(seed=1)
    x = torch.tensor([[257, 104, 105, 258]])
    assert torch.equal(m1(x).logits, m2(x).logits)
    assert not torch.equal(m1(x).logits, m3(x).logits)
    assert type(m1).__name__ == "Qwen3ForCausalLM"
    assert m1.config.vocab_size == len(tok) == 259
    assert not m1.training


def test_tiny_tokenizer_roundtrip_and_chat_template():
    tok = tiny_tokenizer()
    text = "héllo, wörld! 123\n\tok"
    ids = tok(text)["input_ids"]
    assert ids[:2] == [104, 195]  # byte values ("h", first byte of "é")
    assert tok.decode(ids) == text
    ids = encode_prompt(tok, "hi")
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_qwen3_padded_vocab_and_bad_args():
    m, tok = tiny_qwen3(vocab_size=300, num_layers=1)
    assert m.config.vocab_size == 300 and m.get_output_embeddings().weight.shape[0] == 300
    with pytest.raises(ValueError, match="vocab_size"):
        tiny_qwen3(vocab_size=100)
    with pytest.raises(ValueError, match="divisible"):
        tiny_qwen3(hidden_size=30, num_heads=4)
    m, tok = tiny_qwen3(with_tokenizer=False)
    assert tok is None


def test_load_target_from_saved_tiny_qwen3(tmp_path):
    model, tok = tiny_qwen3(seed=3, num_layers=3)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, ltok = load_target(str(tmp_path))
    assert type(loaded).__name__ == "Qwen3ForCausalLM"
    assert loaded.dtype == torch.float32 and not loaded.training
    assert ltok.get_vocab() == tok.get_vocab()
    ids = torch.tensor([encode_prompt(ltok, "what is 2+2?")])
    assert encode_prompt(ltok, "what is 2+2?") == encode_prompt(tok, "what is 2+2?")
    with torch.inference_mode():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    half, _ = load_target(str(tmp_path), dtype="bfloat16")
    assert half.dtype == torch.bfloat16


def test_load_target_bad_specs(tmp_path):
    with pytest.raises(ValueError, match="no such directory"):
        load_target(str(tmp_path / "missing"))
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ValueError, match="not a transformers checkpoint"):
        load_target(str(tmp_path / "file.txt"))
    with pytest.raises(ValueError, match="not a transformers checkpoint"):
        load_target(str(tmp_path))  # a directory without config.json
    with pytest.raises(ValueError, match="dtype"):
        load_target(str(tmp_path), dtype="float33")
    with pytest.raises(ValueError, match="target spec"):
        load_target("")


def test_load_target_unreachable_hub_id_fails_fast(monkeypatch):
    # HF_HUB_OFFLINE makes the failure deterministic whether or not this machine has network;
    # the id is not in the local HF cache, so the loader must say how to proceed.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelUnavailable, match="pass a local path|Pass a local path"):  # a ValueError: one CLI line
        load_target("draftcert-test/no-such-model-xyz")
