"""The native small-M linear kernel (``draftcert.kernels.packed_matmul``): the same function as ``F.linear``
for every row count it takes, odd shapes, bias, threads; a clear "unavailable" where it cannot build."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from draftcert.kernels import linear_chooser, packed_matmul
from draftcert.native import cpu_flags

needs_kernel = pytest.mark.skipif(not packed_matmul.LIBRARY.available(), reason=f"packed_matmul kernel unavailable: {packed_matmul.LIBRARY.reason()}")


@needs_kernel
@pytest.mark.parametrize("n,k", [(48, 32), (37, 19), (1, 5), (200, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_f_linear_for_every_row_count(n, k, bias):
    g = torch.Generator().manual_seed(n * 100 + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    packed = packed_matmul.pack(w)
    assert packed.shape == (-(-n // packed_matmul.block_width()), k, packed_matmul.block_width())
    for rows in range(1, packed_matmul.max_rows() + 1):
        x = torch.randn(rows, k, generator=g)
        got = packed_matmul.linear(x, packed, n, b)
        ref = F.linear(x, w, b)
        # float32 rounding of another summation order: |err| <= ~K eps sum|x w|
        tol = 4 * k * torch.finfo(torch.float32).eps * (x.abs() @ w.abs().t() + (b.abs() if bias else 0) + 1)
        assert got.shape == ref.shape and bool(((got - ref).abs() <= tol).all()), rows


@needs_kernel
def test_kernel_is_not_trivially_right():
    """The comparison above can fail: a weight packed from another matrix gives other outputs."""
    w = torch.randn(40, 24)
    x = torch.randn(3, 24)
    assert not torch.allclose(packed_matmul.linear(x, packed_matmul.pack(w.flip(0)), 40), F.linear(x, w), atol=1e-3)


@needs_kernel
def test_kernel_keeps_leading_dims_and_uses_threads():
    w = torch.randn(96, 40)
    x = torch.randn(1, 7, 40)
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = packed_matmul.linear(x, packed_matmul.pack(w), 96)
            assert got.shape == (1, 7, 96)
            torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(saved)


@needs_kernel
def test_kernel_refuses_what_it_cannot_take():
    w = packed_matmul.pack(torch.randn(8, 4))
    with pytest.raises(ValueError, match="rows"):
        packed_matmul.linear(torch.randn(packed_matmul.max_rows() + 1, 4), w, 8)
    with pytest.raises(ValueError, match="does not fit"):
        packed_matmul.linear(torch.randn(2, 5), w, 8)
    with pytest.raises(ValueError, match="float32"):
        packed_matmul.pack(torch.randn(8, 4, dtype=torch.float64))


def test_unavailable_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTCERT_CACHE", str(tmp_path / "cache"))
    try:
        packed_matmul.LIBRARY.reset()
        monkeypatch.setenv("DRAFTCERT_NATIVE", "0")
        assert not packed_matmul.LIBRARY.available() and "DRAFTCERT_NATIVE" in packed_matmul.LIBRARY.reason()
        assert packed_matmul.LIBRARY.build_id() == "" and not linear_chooser._usable("streamed", torch.randn(8, 4), None)
        with pytest.raises(ValueError, match="unavailable here: disabled"):
            linear_chooser.enable(torch.nn.Linear(4, 8), force="streamed")
        packed_matmul.LIBRARY.reset()
        monkeypatch.setenv("DRAFTCERT_NATIVE", "1")
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
        assert not packed_matmul.LIBRARY.available() and "compiler" in packed_matmul.LIBRARY.reason()
        with pytest.raises(RuntimeError, match="unavailable"):
            packed_matmul.block_width()
    finally:
        monkeypatch.undo()
        packed_matmul.LIBRARY.reset()


def test_a_failing_compiler_is_reported(monkeypatch, tmp_path):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'fatal: no target' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("DRAFTCERT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(fake))
    try:
        packed_matmul.LIBRARY.reset()
        assert not packed_matmul.LIBRARY.available()
        assert "could not build" in packed_matmul.LIBRARY.reason() and "no target" in packed_matmul.LIBRARY.reason()
    finally:
        monkeypatch.undo()
        packed_matmul.LIBRARY.reset()


AVX2_CHECK = """
import torch, torch.nn.functional as F
from draftcert.kernels import packed_matmul
assert packed_matmul.LIBRARY.available(), packed_matmul.LIBRARY.reason()
assert packed_matmul.block_width() == 16, packed_matmul.block_width()  # the AVX2 build
g = torch.Generator().manual_seed(0)
for n, k in [(48, 32), (37, 19), (200, 64)]:
    w = torch.randn(n, k, generator=g)
    p = packed_matmul.pack(w)
    for rows in range(1, packed_matmul.max_rows() + 1):  # 10..16 rows: a block one vector at a time
        x = torch.randn(rows, k, generator=g)
        torch.testing.assert_close(packed_matmul.linear(x, p, n), F.linear(x, w), rtol=1e-5, atol=1e-5)
print("ok")
"""


@needs_kernel
@pytest.mark.skipif("avx512f" not in cpu_flags().split() or "avx2" not in cpu_flags().split(),
                    reason="needs a CPU with AVX-512 and AVX2 to build and run the AVX2 kernel beside the native one")
def test_the_avx2_build_agrees_too(tmp_path):
    """CI runs on AVX-512: build the AVX2 kernel as well (its block is split by vector past 9 rows)."""
    env = {**os.environ, "DRAFTCERT_NATIVE_CFLAGS": "-mno-avx512f", "DRAFTCERT_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-c", AVX2_CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
