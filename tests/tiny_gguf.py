"""Tiny GGUF files written in code with gguf-py's writer, for the GGUF and kernel tests (no downloads)."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402

from draftcert.gguf.loader import load_gguf_causal_lm  # noqa: E402
from draftcert.kernels import block_matmul  # noqa: E402

# fp16 scale fields: (byte offset, scale) per type, the rest of a block random bytes
SCALES = {3: [(0, 0.02), (2, 0.1)], 6: [(0, 0.02)], 8: [(0, 0.01)], 12: [(0, 0.002), (2, 0.002)], 14: [(208, 0.002)]}


def random_blocks(qtype: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid random blocks ``[n, row_bytes]``: random bytes, sane (finite, normal) fp16 scales."""
    rng = np.random.default_rng(seed)
    qk, qb = block_matmul.block_shape(qtype)
    b = rng.integers(0, 256, size=(n, k // qk, qb), dtype=np.uint8)
    for off, scale in SCALES[qtype]:
        v = (rng.standard_normal((n, k // qk)) * scale).astype(np.float16)
        b[..., off:off + 2] = v.view(np.uint8).reshape(n, k // qk, 2)
    return b.reshape(n, -1)


def permute_like_llama_cpp(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (transformers reverses it on load)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# A byte-level BPE vocabulary of 96 tokens: the 94 printable ASCII characters but space, "Ġ" (a space,
# GPT-2's byte map) and the end-of-text token, no merges
TINY_TOKENS = [chr(c) for c in range(33, 127)] + ["\u0120", "<|endoftext|>"]
TINY_MERGES: list[str] = []  # none: one token per character


def add_tiny_tokenizer(w, vocab: int = 96, *, eos: int | None = None, specials: bool = False, merges=(),
                       swap: tuple[int, int] | None = None, pad: int | None = None, extra_tokens=()) -> None:
    """Write a GPT-2 style tokenizer of ``TINY_TOKENS`` (``vocab`` >= 96 tokens: the rest are
    ``<extra_i>`` tokens) into GGUF writer ``w``; end of text (and bos) at ``eos`` (default 95);
    ``specials``: unknown and padding ids too (the end of text), as some architectures' tokenizers need;
    ``merges``: BPE merges of two tokens (``"h e"``: both and their join must be tokens); ``swap``: two
    ids whose tokens trade places; ``pad``: a padding id; ``extra_tokens``: ordinary tokens from id 96 on."""
    tokens = TINY_TOKENS + list(extra_tokens)
    tokens += [f"<extra_{i}>" for i in range(vocab - len(tokens))]
    if swap is not None:
        a, b = swap
        tokens[a], tokens[b] = tokens[b], tokens[a]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 95 + [3] + [1] * len(extra_tokens) + [4] * (vocab - 96 - len(extra_tokens)))
    w.add_token_merges(list(TINY_MERGES) + list(merges))
    w.add_token_scores([0.0] * vocab)
    w.add_bos_token_id(95 if eos is None else eos)
    w.add_eos_token_id(95 if eos is None else eos)
    if specials:
        w.add_unk_token_id(95 if eos is None else eos)
        w.add_pad_token_id(95 if eos is None else eos)
    elif pad is not None:
        w.add_pad_token_id(pad)


def write_tiny_llama(path, *, tied: bool, qtypes: dict[str, int], tokenizer: bool | dict = False, arch: str = "llama",
                     seed: int = 7, layers: int = 2, rows: int = 96):
    """A 2-layer llama GGUF: hidden 256 (the K-quants' block), 4 heads (2 kv), vocab 96. Weights of
    type Q8_0/Q4_1/Q5_0 are quantised from random floats; Q4_K/Q6_K are random blocks.  ``tokenizer``:
    with ``add_tiny_tokenizer``'s vocabulary (what loading it as a target needs; a dict: its arguments);
    ``rows``: the embedding's and output layer's rows (past 96: padding rows, no token)."""
    rng = np.random.default_rng(seed)
    H, I, V, L, nh, nkv = 256, 512, rows, layers, 4, 2
    hd = H // nh
    w = gguf.GGUFWriter(str(path), arch)
    if tokenizer:
        add_tiny_tokenizer(w, **(tokenizer if isinstance(tokenizer, dict) else {}))
    w.add_name("tiny-test")
    w.add_context_length(128)
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(I)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_rope_dimension_count(hd)

    def tensor(name, shape, kind):
        qt = qtypes.get(kind, 0)
        if qt in (12, 14):
            blocks = random_blocks(qt, shape[0], shape[1], seed=len(name) + shape[0])
            w.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=QT(qt))
            return
        x = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if kind in ("q", "k"):
            x = permute_like_llama_cpp(x, nh if kind == "q" else nkv)
        if qt:
            q = gguf.quants.quantize(x, QT(qt))
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=QT(qt))
        else:
            w.add_tensor(name, x)

    tensor("token_embd.weight", (V, H), "emb")
    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
        w.add_tensor(p + "ffn_norm.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
        tensor(p + "attn_q.weight", (H, H), "q")
        tensor(p + "attn_k.weight", (nkv * hd, H), "k")
        tensor(p + "attn_v.weight", (nkv * hd, H), "v")
        tensor(p + "attn_output.weight", (H, H), "o")
        tensor(p + "ffn_gate.weight", (I, H), "gate")
        tensor(p + "ffn_up.weight", (I, H), "up")
        tensor(p + "ffn_down.weight", (H, I), "down")
    w.add_tensor("output_norm.weight", np.ones(H, dtype=np.float32))
    if not tied:
        tensor("output.weight", (V, H), "out")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_gguf_llama(tmp_path, *, out_type: int = 14, numerics: str = "gguf-exact-f32"):
    """The 2-layer llama of ``write_tiny_llama`` (untied; every kernel type among its layers, the
    output layer of ``out_type``) written under ``tmp_path`` and loaded from its blocks; skips the
    test without the kernel."""
    from transformers import AutoConfig

    if not block_matmul.LIBRARY.available():
        pytest.skip(f"no block_matmul kernel: {block_matmul.LIBRARY.reason()}")
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, tied=False, qtypes={"emb": 8, "q": 12, "k": 3, "v": 6, "o": 14, "gate": 12, "up": 8,
                                                "down": 3, "out": out_type})
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    return load_gguf_causal_lm(path, config, quiet=True, numerics=numerics)
