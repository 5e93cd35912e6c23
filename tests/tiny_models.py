"""A tiny, randomly initialised Qwen3 model (and a byte-level tokenizer) built entirely in code.

For tests and examples that need a real transformers causal LM (KV cache, generate(), chat
template) without downloading anything.  Qwen3 is the reference architecture of draftcert.
"""

from __future__ import annotations

import torch

# ChatML, the template family Qwen3 and SmolLM2 use.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def tiny_tokenizer():
    """Byte-level tokenizer: 256 byte tokens (GPT-2 byte alphabet, no merges) + 3 ChatML specials.

    Lossless on any text (every byte is a token), 259 tokens, ids 0..255 are bytes,
    256 = <|endoftext|> (pad/eos), 257 = <|im_start|>, 258 = <|im_end|>.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # optional: models extra
    from transformers import PreTrainedTokenizerFast  # optional: models extra

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    byte_to_unicode = _bytes_to_unicode()
    vocab = {byte_to_unicode[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(TINY_SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map (what ByteLevel pre-tokenization emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tiny_qwen3(
    seed: int = 0,
    vocab_size: int | None = None,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 64,
    *,
    with_tokenizer: bool = True,
    init_std: float = 0.2,
    max_position_embeddings: int = 2048,
):
    """``(model, tokenizer or None)``: a random Qwen3ForCausalLM built from a Qwen3Config in code.

    vocab_size defaults to the tokenizer's 259 tokens (or 259 without tokenizer); a larger value
    gives padded vocab rows the tokenizer never emits, as real Qwen3 checkpoints have.
    ``init_std`` is larger than Qwen3's 0.02 so that the random next-token distributions are
    peaked enough to be interesting (0.02 at hidden_size 32 gives near-uniform p).
    Same arguments + seed -> identical weights; the global torch RNG is left untouched.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM  # optional: models extra

    tok = tiny_tokenizer() if with_tokenizer else None
    n_tok = len(tok) if tok is not None else 259
    if vocab_size is None:
        vocab_size = n_tok
    if vocab_size < n_tok:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tiny tokenizer's {n_tok} tokens")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads}), and "
            f"num_heads by num_kv_heads ({num_kv_heads})"
        )
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=258,
        pad_token_id=256,
        use_sliding_window=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.to(torch.float32)
    model.eval()
    model.requires_grad_(False)
    return model, tok
