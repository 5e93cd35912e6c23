"""Damaged GGUF files given as --target or --drafter: each is one `draftcert: error:` line naming the
option, the file and what is wrong, exit 2, no traceback and no crash.  Every file is written here by
gguf-py's writer (tests/tiny_gguf.py) and then damaged byte by byte, so the reader's checks
(draftcert.gguf.reader.read_gguf) are what stands between the bytes and the kernels."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from draftcert.cli import main
from draftcert.gguf.reader import GGUFFileError, read_gguf
from tests.test_cli_errors import _one_error_line
from tests.tiny_gguf import QT, gguf, write_tiny_llama

Q8 = {k: 8 for k in ("emb", "q", "k", "v", "o", "gate", "up", "down", "out")}


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> bytes:
    """The bytes of a valid tiny llama GGUF with a tokenizer (every weight Q8_0)."""
    path = tmp_path_factory.mktemp("good") / "good.gguf"
    write_tiny_llama(path, tied=False, qtypes=Q8, tokenizer=True)
    return path.read_bytes()


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTCERT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _tensor_info(data: bytes, name: str) -> int:
    """Offset of tensor ``name``'s n_dims field in the tensor table."""
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.find(key)
    assert at > 0, name
    return at + len(key)


def _set(data: bytes, at: int, fmt: str, *values) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, at, *values)
    return bytes(b)


def _value_at(data: bytes, key: str) -> int:
    """Offset of metadata ``key``'s value type field."""
    k = struct.pack("<Q", len(key)) + key.encode()
    at = data.find(k)
    assert at > 0, key
    return at + len(k)


def _dims_of(data: bytes, name: str):
    at = _tensor_info(data, name)
    (nd,) = struct.unpack_from("<I", data, at)
    return at, nd, struct.unpack_from(f"<{nd}Q", data, at + 4)


def _bert_file(good: bytes) -> bytes:
    """A GGUF of an architecture gguf-py knows and transformers does not read (bert)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "bert.gguf"
        w = gguf.GGUFWriter(str(p), "bert")
        w.add_block_count(1)
        w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return p.read_bytes()


def _with_key(good: bytes, key: str, value: int) -> bytes:
    """``good`` with one more uint16 metadata key (the key count raised, the tensor table shifted: its
    data offsets are relative to the aligned end of the table, so the padding is adjusted)."""
    (n_tensors, n_kv) = struct.unpack_from("<QQ", good, 8)
    entry = struct.pack("<Q", len(key)) + key.encode() + struct.pack("<IH", 2, value)
    b = bytearray(good[:24] + entry + good[24:])
    struct.pack_into("<Q", b, 16, n_kv + 1)
    # the data section starts at the next multiple of 32 after the table: re-pad it
    table_end = _tensor_table_end(good)
    start = -(-table_end // 32) * 32
    new_end = table_end + len(entry)
    new_start = -(-new_end // 32) * 32
    return bytes(b[:new_end]) + b"\0" * (new_start - new_end) + good[start:]


def _tensor_table_end(data: bytes) -> int:
    """Offset just past the last tensor entry of the table (the writer's order: the last added tensor)."""
    at, nd, _ = _dims_of(data, "output.weight")
    return at + 4 + 8 * nd + 12


def _damage(good: bytes, case: str) -> tuple[bytes, str]:
    """(the damaged bytes, a phrase the error line must hold)."""
    if case == "text-file":
        return b"this is a text file, not a model\n" * 4, "not a GGUF file"
    if case == "empty":
        return b"", "not a GGUF file"
    if case == "safetensors-bytes":
        return struct.pack("<Q", 2) + b"{}" + b"\0" * 64, "not a GGUF file"
    if case == "header-cut":
        return good[:20], "not a GGUF file"
    if case == "version-1":
        return _set(good, 4, "<I", 1), "GGUF version 1"
    if case == "cut-in-metadata":
        return good[:300], "truncated"
    if case == "cut-in-tensor-table":
        at = _tensor_info(good, "blk.1.ffn_up.weight")
        return good[:at + 2], "truncated"
    if case == "cut-in-data":
        return good[: len(good) * 2 // 3], "past the end of the file"
    if case == "one-byte-short":
        return good[:-1], "past the end of the file"
    if case == "tensor-count-huge":
        return _set(good, 8, "<Q", 1 << 40), "more than its"
    if case == "kv-count-huge":
        return _set(good, 16, "<Q", 1 << 59), "more than its"
    if case == "key-length-huge":
        return _set(good, 24, "<Q", 1 << 62), "truncated"
    if case == "token-array-count-huge":  # a string array claiming 2**50 items: refused, not looped over
        at = _value_at(good, "tokenizer.ggml.tokens")
        return _set(good, at + 8, "<Q", 1 << 50), "truncated"
    if case == "unknown-value-type":
        return _set(good, _value_at(good, "general.architecture"), "<I", 77), "unknown value type 77"
    if case == "unknown-tensor-type":
        at, nd, _ = _dims_of(good, "blk.0.attn_q.weight")
        return _set(good, at + 4 + 8 * nd, "<I", 99), "unknown type 99"
    if case == "too-many-dims":
        at = _tensor_info(good, "blk.0.attn_q.weight")
        return _set(good, at, "<I", 9), "9 dimensions"
    if case == "zero-dim":
        at, nd, dims = _dims_of(good, "blk.0.attn_k.weight")
        return _set(good, at + 4, "<Q", 0), "dimensions"
    if case == "row-not-whole-blocks":
        at, nd, dims = _dims_of(good, "blk.0.attn_q.weight")
        return _set(good, at + 4, "<Q", dims[0] - 8), "not whole Q8_0 blocks"
    if case == "data-shorter-than-shape":  # more rows than the bytes before the next tensor hold
        at, nd, dims = _dims_of(good, "blk.0.attn_q.weight")
        return _set(good, at + 4 + 8, "<Q", dims[1] * 2), "shorter than its shape and type need"
    if case == "offset-past-end":
        at, nd, _ = _dims_of(good, "blk.0.attn_v.weight")
        return _set(good, at + 4 + 8 * nd + 4, "<Q", 1 << 40), "past the end of the file"
    if case == "offset-misaligned":
        at, nd, _ = _dims_of(good, "blk.0.attn_v.weight")
        (off,) = struct.unpack_from("<Q", good, at + 4 + 8 * nd + 4)
        return _set(good, at + 4 + 8 * nd + 4, "<Q", off + 3), "not a multiple of the alignment"
    if case == "unknown-architecture":
        at = _value_at(good, "general.architecture")
        (n,) = struct.unpack_from("<Q", good, at + 4)
        b = bytearray(good)
        b[at + 12:at + 12 + n] = b"z" * n
        return bytes(b), "architecture 'zzzzz' is not one transformers reads"
    if case == "architecture-transformers-lacks":
        return _bert_file(good), "architecture 'bert' is not one transformers reads"
    if case == "split-file":  # the first of two parts (llama-gguf-split): its tensors are not all here
        return _with_key(good, "split.count", 2), "part 1 of a GGUF split into 2 files"
    if case == "shape-the-model-does-not-expect":  # same bytes, transposed shape: the checks pass, the model refuses it
        at, nd, dims = _dims_of(good, "blk.0.ffn_up.weight")
        return _set(good, at + 4, "<2Q", dims[1], dims[0]), "cannot be loaded"
    raise AssertionError(case)


CASES = ["text-file", "empty", "safetensors-bytes", "header-cut", "version-1", "cut-in-metadata", "cut-in-tensor-table",
         "cut-in-data", "one-byte-short", "tensor-count-huge", "kv-count-huge", "key-length-huge",
         "token-array-count-huge", "unknown-value-type", "unknown-tensor-type", "too-many-dims", "zero-dim",
         "row-not-whole-blocks", "data-shorter-than-shape", "offset-past-end", "offset-misaligned",
         "unknown-architecture", "architecture-transformers-lacks", "split-file", "shape-the-model-does-not-expect"]


@pytest.mark.parametrize("case", CASES)
def test_a_damaged_target_file_is_one_error_line(case, good, cache, capsys):
    data, phrase = _damage(good, case)
    path = cache / f"{case}.gguf"
    path.write_bytes(data)
    assert main(["decode", "--target", str(path), "--drafter", "prompt-lookup", "--prompt", "hi",
                 "--max-new-tokens", "2", "--no-progress"]) == 2
    line = _one_error_line(capsys.readouterr().err, "--target:")
    assert str(path) in line and phrase in line, line


def test_the_undamaged_file_loads(good, cache):
    """The control: the bytes every case damages read and load."""
    from draftcert.models import load_target

    path = cache / "good.gguf"
    path.write_bytes(good)
    model, tok = load_target(str(path))
    assert model.draftcert_gguf["types"] == ["Q8_0"] and len(tok) == 96


@pytest.mark.parametrize("case", ["cut-in-data", "unknown-tensor-type", "unknown-architecture"])
def test_a_damaged_drafter_file_is_one_error_line(case, good, cache, capsys):
    data, phrase = _damage(good, case)
    target, drafter = cache / "target.gguf", cache / f"{case}.gguf"
    target.write_bytes(good)
    drafter.write_bytes(data)
    assert main(["decode", "--target", str(target), "--drafter", str(drafter), "--prompt", "hi",
                 "--max-new-tokens", "2", "--no-progress"]) == 2
    line = _one_error_line(capsys.readouterr().err, "--drafter:")
    assert str(drafter) in line and phrase in line, line


@pytest.mark.parametrize("argv", [
    ["profile", "--prompts", "PROMPTS", "--out", "runs/p", "--no-progress", "--drafter", "self:skip=1"],
    ["bench", "--drafter", "prompt-lookup", "--limit", "1", "--no-progress"],
    ["train-drafter", "--out", "runs/x", "--examples", "2", "--quiet"],
], ids=lambda a: a[0])
def test_every_command_refuses_a_damaged_target_in_one_line(argv, good, cache, capsys):
    data, _ = _damage(good, "one-byte-short")
    path = cache / "short.gguf"
    path.write_bytes(data)
    (cache / "prompts.txt").write_text("hi\n")
    argv = [str(cache / "prompts.txt") if a == "PROMPTS" else a for a in argv]
    assert main([*argv, "--target", str(path)]) == 2
    line = _one_error_line(capsys.readouterr().err, "--target:")
    assert "past the end of the file" in line and not (cache / "runs").exists()


def test_one_more_metadata_key_keeps_the_file_whole(good, tmp_path):
    """The control of the split-file case: the helper that adds a key leaves every tensor's bytes as they were."""
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(good)
    b.write_bytes(_with_key(good, "test.extra", 7))
    (_, ta), (mb, tb) = read_gguf(a), read_gguf(b)
    assert mb["test.extra"] == 7 and all(np.array_equal(ta[k].data, tb[k].data) for k in ta)


def test_read_gguf_raises_gguf_file_error_a_value_error(good, tmp_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(good[:-100])
    with pytest.raises(GGUFFileError, match="past the end of the file") as e:
        read_gguf(path)
    assert isinstance(e.value, ValueError)
    path.write_bytes(good)
    _, tensors = read_gguf(path)
    assert tensors["blk.0.attn_q.weight"].qtype == int(QT.Q8_0)


@pytest.mark.parametrize("call", ["linear", "dequantize", "pack_q8"])
def test_the_kernels_refuse_blocks_shorter_than_the_shape_says(call):
    """The last guard: block_matmul's wrappers check the bytes against [n, k] before the C code runs."""
    import torch

    from draftcert.kernels import block_matmul

    if not block_matmul.LIBRARY.available():
        pytest.skip(f"no block_matmul kernel: {block_matmul.LIBRARY.reason()}")
    n, k, qtype = 8, 64, int(QT.Q8_0)
    short = torch.zeros(n, k // 32 * 34 - 1, dtype=torch.uint8)  # one byte short per row
    with pytest.raises(ValueError, match="expected contiguous uint8 blocks"):
        if call == "linear":
            block_matmul.linear(torch.zeros(1, k), short, qtype, n, k)
        elif call == "dequantize":
            block_matmul.dequantize(short, qtype, n, k)
        else:
            block_matmul.pack_q8(short, qtype, n, k)
