"""The contract "gguf-q8" (block_matmul.linear_q8): activations quantised per block to 8 bits with
llama.cpp's formulas, integer block dot products, the scaled block sums added in float32 in one
fixed order.  Checked against an independent numpy reference (the quantisation exactly; the outputs
within the bound of the contract's float32 roundings), for batch, thread and build invariance."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from draftcert.kernels import block_matmul  # noqa: E402
from draftcert.gguf.blocks import KERNEL_TYPES, block_type  # noqa: E402
from draftcert.gguf.layers import GGUFLinear, numerics_of, set_numerics  # noqa: E402

from tests.tiny_gguf import random_blocks  # noqa: E402

needs_kernel = pytest.mark.skipif(not block_matmul.LIBRARY.available(), reason=f"no block_matmul kernel: {block_matmul.LIBRARY.reason()}")
TYPES = sorted(KERNEL_TYPES)
IDS = [block_type(t).name for t in TYPES]
U = 2.0 ** -24


def shapes(qtype: int):
    qk = block_matmul.block_shape(qtype)[0]
    return [(37, 3 * qk), (16, qk), (70, 2 * qk)] if qk == 32 else [(19, 512), (33, 256)]


def _fp16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).astype(np.float32)


def ref_quantize(x: np.ndarray, qtype: int) -> dict:
    """llama.cpp's x86 quantize_row_q8_0 / q8_1 and quantize_row_q8_K_ref, in numpy float32."""
    x = np.asarray(x, dtype=np.float32)
    m, k = x.shape
    if qtype in (12, 14):
        xb = x.reshape(m, k // 256, 256)
        idx = np.abs(xb).argmax(-1)  # the first of the largest |x|, as the strict > of the C loop
        mx = np.take_along_axis(xb, idx[..., None], -1)[..., 0]
        with np.errstate(divide="ignore"):
            iscale = np.where(mx != 0, np.float32(-127.0) / mx, np.float32(0)).astype(np.float32)
        q = np.minimum(127, np.rint(iscale[..., None] * xb)).astype(np.int8)
        d = np.where(mx != 0, np.float32(1.0) / np.where(iscale != 0, iscale, 1), 0).astype(np.float32)
        sub = 16 if qtype == 14 else 32
        sums = q.reshape(m, k // sub, sub).astype(np.int32).sum(-1)
        return {"q": q.reshape(m, k), "d": d, "sums": sums}
    xb = x.reshape(m, k // 32, 32)
    amax = np.abs(xb).max(-1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        iv = np.where(amax != 0, np.float32(127) / amax, 0).astype(np.float32)
    q = np.rint((xb * iv[..., None]).astype(np.float32)).astype(np.int8)
    sums = q.astype(np.int32).sum(-1)
    out = {"q": q.reshape(m, k), "d": _fp16(d), "sums": sums}
    if qtype == 3:
        out["s"] = _fp16((d * sums.astype(np.float32)).astype(np.float32))
    return out


def _with_fields(blocks: np.ndarray, qtype: int, values: dict[int, float]) -> np.ndarray:
    """The blocks with fp16 fields (byte offset -> value) replaced, e.g. d = 1 and dmin = 0."""
    qk, qb = block_matmul.block_shape(qtype)
    b = blocks.reshape(blocks.shape[0], -1, qb).copy()
    for off, v in values.items():
        b[..., off:off + 2] = np.frombuffer(np.float16(v).tobytes(), np.uint8)
    return b.reshape(blocks.shape)


# per type: (the fp16 scale fields' offsets, whether a second "min" part exists)
FIELDS = {3: (0, 2), 6: (0,), 8: (0,), 12: (0, 2), 14: (208,)}


def ref_linear(blocks: np.ndarray, qtype: int, n: int, k: int, x: np.ndarray):
    """(y in float64 from the exact integer block sums, the bound of the contract's roundings).

    The integer weights come from gguf-py's own dequantisation with the block scales set to 1 and 0:
    ``scale part`` = codes times sub-block scales (d = 1, dmin or m = 0), ``min part`` (d = 0, m = 1)."""
    qk = block_matmul.block_shape(qtype)[0]
    offs = FIELDS[qtype]
    ones = {o: (1.0 if i == 0 else 0.0) for i, o in enumerate(offs)}
    w1 = dequantize(_with_fields(blocks, qtype, ones), QT(qtype)).reshape(n, k).astype(np.int64)
    w2 = None
    if len(offs) == 2:
        w2 = dequantize(_with_fields(blocks, qtype, {offs[0]: 0.0, offs[1]: 1.0}), QT(qtype)).reshape(n, k).astype(np.int64)
    qb = block_matmul.block_shape(qtype)[1]
    raw = blocks.reshape(n, k // qk, qb)
    dw = raw[..., offs[0]:offs[0] + 2].copy().view(np.float16)[..., 0].astype(np.float32)
    dm = raw[..., offs[1]:offs[1] + 2].copy().view(np.float16)[..., 0].astype(np.float32) if w2 is not None else None
    a = ref_quantize(x, qtype)
    m = x.shape[0]
    qa = a["q"].astype(np.int64).reshape(m, k // qk, qk)
    I = np.einsum("nbk,mbk->mnb", w1.reshape(n, k // qk, qk), qa)  # exact integers
    t1 = (dw[None] * a["d"][:, None, :]).astype(np.float32).astype(np.float64) * I  # dw * da rounded once
    terms = [t1]
    if qtype == 3:  # Q4_1: + m * s (Q8_1's s, not da * sum q)
        terms.append(dm[None].astype(np.float64) * a["s"][:, None, :].astype(np.float64))
    elif w2 is not None:  # Q4_K: the mins (w2 = -m) times q, scaled by dmin * da
        Im = np.einsum("nbk,mbk->mnb", w2.reshape(n, k // qk, qk), qa)
        terms.append((dm[None] * a["d"][:, None, :]).astype(np.float32).astype(np.float64) * Im)
    y = sum(t.sum(-1) for t in terms)
    mass = sum(np.abs(t).sum(-1) for t in terms)
    steps = sum(t.shape[-1] for t in terms)  # one fma per term, in sequence, each term's int->float
    bound = mass * (steps + 2) * U / (1 - (steps + 2) * U)
    return y, bound


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_activations_are_quantised_as_llamacpp_does(qtype):
    g = torch.Generator().manual_seed(qtype)
    qk = block_matmul.block_shape(qtype)[0]
    x = torch.randn(6, 2 * 256, generator=g) * torch.tensor([1.0, 30.0, 1e-3, 1.0, 1.0, 1.0])[:, None]
    x[3, :qk] = 0  # an all-zero block
    x[4, 5] = 1e4  # an outlier
    x[5, ::7] = 0.5 / 127 * torch.arange(0, x.shape[1], 7).float().remainder(4)  # half-way roundings
    got = block_matmul.quantize_q8(x, qtype)
    want = ref_quantize(x.numpy(), qtype)
    assert set(got) == set(want)
    for key in want:
        assert np.array_equal(got[key].numpy(), want[key]), key


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_linear_q8_is_the_contract_within_its_roundings(qtype):
    g = torch.Generator().manual_seed(10 + qtype)
    for n, k in shapes(qtype):
        b = random_blocks(qtype, n, k, seed=n * k + 1)
        packed = block_matmul.pack_q8(torch.from_numpy(b), qtype, n, k)
        bias = torch.randn(n, generator=g)
        for m in (1, 2, 3, 4, 5, 8, 16):
            x = torch.randn(m, k, generator=g)
            y = block_matmul.linear_q8(x, packed, qtype, n, k)
            ref, bound = ref_linear(b, qtype, n, k, x.numpy())
            assert (np.abs(y.double().numpy() - ref) <= bound + 1e-300).all(), (n, k, m)
            yb = block_matmul.linear_q8(x, packed, qtype, n, k, bias)
            assert torch.equal(yb, y + bias)  # the bias: one float32 add after the sum
            # and it is close to the exact weights' result: the 8-bit activations' error only
            exact = x.double() @ torch.from_numpy(dequantize(b, QT(qtype))).reshape(n, k).double().T
            assert (y.double() - exact).abs().max() <= 0.02 * exact.abs().max()


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_rows_alone_and_in_passes_of_any_size_are_identical_q8(qtype):
    n, k = 70, 512
    b = torch.from_numpy(random_blocks(qtype, n, k, seed=4))
    packed = block_matmul.pack_q8(b, qtype, n, k)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([block_matmul.linear_q8(x[i:i + 1], packed, qtype, n, k, bias) for i in range(40)])
    for m in list(range(2, 17)) + [40]:
        for start in (0, 40 - m):
            assert torch.equal(block_matmul.linear_q8(x[start:start + m], packed, qtype, n, k, bias), alone[start:start + m]), m
    assert torch.equal(block_matmul.linear_q8_portable(x[:7], packed, qtype, n, k, bias), alone[:7])  # vector == portable
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(block_matmul.linear_q8(x[:9], packed, qtype, n, k, bias), alone[:9])
    finally:
        torch.set_num_threads(before)


# The x86 code paths of dq8_linear, each chosen at compile time by the flags after -march=native, and
# the CPU flags (/proc/cpuinfo) a build of it needs to run here; "" is the portable code.
X86_BUILDS = {
    "avx-vnni": ("-mno-avx512f", ("avx2", "fma", "f16c", "avx_vnni")),
    "avx2": ("-mno-avx512f -mno-avxvnni", ("avx2", "fma", "f16c")),
    "": ("-mno-avx512f -mno-avx2 -mno-fma -mno-f16c -mno-avxvnni", ()),
}

# The largest codes each type stores (byte offsets in a GGUF block -> byte), for the integer sums' bounds:
# Q4_1 15, Q5_0 31, Q8_0 -128 (|w| 128) or 127, Q4_K 15 with scales and mins 63, Q6_K 63 with scales -128 or 127.
EXTREMES = {3: [((4, 20), 0xFF)], 6: [((2, 22), 0xFF)], 8: [((2, 34), 0x80)], 12: [((4, 144), 0xFF)],
            14: [((0, 192), 0xFF), ((192, 208), 0x80)]}
FLIPPED = {8: [((2, 34), 0x7F)], 14: [((0, 192), 0xFF), ((192, 208), 0x7F)]}  # the other sign's extremes


def _extreme_blocks(qtype: int, n: int, k: int, seed: int, fills) -> np.ndarray:
    qk, qb = block_matmul.block_shape(qtype)
    b = random_blocks(qtype, n, k, seed=seed).reshape(n, k // qk, qb)
    for (lo, hi), byte in fills:
        b[..., lo:hi] = byte
    return b.reshape(n, -1)


def x86_cases() -> dict[str, tuple[int, int, int, np.ndarray, np.ndarray, np.ndarray | None]]:
    """name -> (qtype, n, k, blocks, x [M, k], bias or None): random blocks of every type on shapes with
    and without whole groups of 16 outputs, M = 1..16 and a prefill of 70 rows; then the largest codes
    against activations at +-127 (all of one sign, alternating, and random) for the int16 bounds."""
    rng = np.random.default_rng(47)
    cases = {}
    for t in TYPES:
        qk = block_matmul.block_shape(t)[0]
        for n, k in ([(37, 3 * qk), (16, 2 * qk), (70, 512)] if qk == 32 else [(19, 512), (33, 256)]):
            b = random_blocks(t, n, k, seed=n * k + t)
            x = (rng.standard_normal((70, k)) * rng.choice([1e-3, 1.0, 30.0], size=(70, 1))).astype(np.float32)
            bias = rng.standard_normal(n).astype(np.float32)
            for m in [*range(1, 17), 70]:
                cases[f"{t}_{n}x{k}_M{m}"] = (t, n, k, b, x[:m], bias if m % 2 else None)
        k = 2 * max(qk, 256)
        signs = np.ones((4, k), np.float32)
        signs[1] = -1
        signs[2, 1::2] = -1
        signs[3] = rng.choice([-1.0, 1.0], size=k)
        x = np.concatenate([signs, rng.standard_normal((3, k)).astype(np.float32)])
        for name, fills in (("max", EXTREMES[t]), ("maxflip", FLIPPED.get(t))):
            if fills is not None:
                cases[f"{t}_{name}"] = (t, 24, k, _extreme_blocks(t, 24, k, 5, fills), x, None)
    return cases


_WORKER = """
import sys, numpy as np, torch
from draftcert.kernels import block_matmul
want = sys.argv[3]
assert block_matmul.q8_vectorised() == want, (block_matmul.q8_vectorised(), want, block_matmul.LIBRARY.build_id())
d = np.load(sys.argv[1], allow_pickle=True)
out = {}
for name in d['names']:
    t, n, k = (int(v) for v in d[name + '/tnk'])
    packed = block_matmul.pack_q8(torch.from_numpy(d[name + '/b']), t, n, k)
    bias = torch.from_numpy(d[name + '/bias']) if name + '/bias' in d else None
    out[name] = block_matmul.linear_q8(torch.from_numpy(d[name + '/x']), packed, t, n, k, bias).numpy()
np.savez(sys.argv[2], **out)
"""


def _buildable(path: str) -> str:
    """"" where a build for the code ``path`` can run on this machine, else why not."""
    import platform

    from draftcert.native import cpu_flags

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "the x86 code paths are built for x86-64 only"
    have = set(cpu_flags().split())
    missing = [f for f in X86_BUILDS[path][1] if f not in have]
    return f"this CPU lacks {', '.join(missing)}: the {path or 'portable'} code cannot run here" if missing else ""


@pytest.fixture(scope="module")
def x86_builds(tmp_path_factory):
    """path -> every case of x86_cases() computed by linear_q8 in a subprocess whose kernel is built for
    that code (DRAFTCERT_NATIVE_CFLAGS), with this checkout's draftcert; or the reason it cannot run.
    The subprocesses run side by side (most of their time is importing torch)."""
    if not block_matmul.LIBRARY.available():
        pytest.skip("no block_matmul kernel")
    tmp = str(tmp_path_factory.mktemp("x86_builds"))
    cases = x86_cases()
    src = os.path.join(tmp, "in.npz")
    arrays = {"names": np.array(list(cases))}
    for name, (t, n, k, b, x, bias) in cases.items():
        arrays.update({f"{name}/tnk": np.array([t, n, k]), f"{name}/b": b, f"{name}/x": x})
        if bias is not None:
            arrays[f"{name}/bias"] = bias
    np.savez(src, **arrays)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(block_matmul.__file__))))  # src/
    pythonpath = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    runs, out = {}, {}
    for path, (flags, _) in X86_BUILDS.items():
        why = _buildable(path)
        if why:
            out[path] = why
            continue
        dst = os.path.join(tmp, f"out-{path or 'portable'}.npz")
        env = {**os.environ, "DRAFTCERT_NATIVE_CFLAGS": flags, "PYTHONPATH": pythonpath}
        runs[path] = (dst, subprocess.Popen([sys.executable, "-c", _WORKER, src, dst, path], env=env,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for path, (dst, proc) in runs.items():
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{path or 'portable'} build: {err[-2000:]}"
        out[path] = dict(np.load(dst))
    return out


def _assert_same_bits(got, path: str):
    if isinstance(got, str):
        pytest.skip(got)
    for name, (t, n, k, b, x, bias) in x86_cases().items():
        packed = block_matmul.pack_q8(torch.from_numpy(b), t, n, k)
        bt = torch.from_numpy(bias) if bias is not None else None
        mine = block_matmul.linear_q8(torch.from_numpy(x), packed, t, n, k, bt).numpy()
        portable = block_matmul.linear_q8_portable(torch.from_numpy(x), packed, t, n, k, bt).numpy()
        assert np.array_equal(mine.view(np.int32), portable.view(np.int32)), f"this build != portable: {name}"
        assert np.array_equal(got[name].view(np.int32), mine.view(np.int32)), f"{path or 'portable'} build differs: {name}"


@needs_kernel
def test_a_portable_build_gives_the_same_bits(x86_builds):
    """No AVX-512, AVX2, FMA or F16C: the kernel built for a plain x86-64 computes the same outputs."""
    if not block_matmul.q8_vectorised():
        pytest.skip("this build is already the portable one")
    _assert_same_bits(x86_builds[""], "")


@needs_kernel
@pytest.mark.parametrize("path", ["avx-vnni", "avx2"])
def test_the_256_bit_x86_builds_give_the_same_bits(path, x86_builds):
    """The AVX-VNNI build (-mno-avx512f) and the plain AVX2 build (also -mno-avxvnni) give the bits of
    this machine's own build and of the portable code, on random blocks of every type, 1..16 rows and a
    prefill, and on the largest codes against +-127 activations (where an int16 sum could saturate)."""
    _assert_same_bits(x86_builds[path], path)


@needs_kernel
def test_the_weight_stream_and_a_build_swapped_in_leave_the_bits():
    """The one-row tiles' non-temporal weight stream (Q8NTA) is a prefetch, not arithmetic: the build
    without it (-DQ8NTA=0), swapped in for a block by ``NativeLibrary.built_with``, gives the same bits
    for one row and for several; the build before is loaded again after the block, and after a failure."""
    before = block_matmul.LIBRARY.build_id()
    for qtype in TYPES:
        n, k = 48, 256
        packed = block_matmul.pack_q8(torch.from_numpy(random_blocks(qtype, n, k, seed=7)), qtype, n, k)
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(qtype))
        ours = [block_matmul.linear_q8(x[:m], packed, qtype, n, k) for m in (1, 3)]
        with block_matmul.LIBRARY.built_with("-DQ8NTA=0"):
            assert block_matmul.LIBRARY.build_id() != before  # another build runs inside
            other = [block_matmul.linear_q8(x[:m], packed, qtype, n, k) for m in (1, 3)]
        assert block_matmul.LIBRARY.build_id() == before
        assert all(torch.equal(a, b) for a, b in zip(ours, other)), QT(qtype).name
    with pytest.raises(RuntimeError, match="block_matmul.c with -DQ8NTA="):
        with block_matmul.LIBRARY.built_with("-DQ8NTA=)"):  # does not compile
            pass
    assert block_matmul.LIBRARY.build_id() == before


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_activations_never_quantise_to_minus_128(qtype):
    """The AVX2 code's Q8_0 dot product (|w| against sign(w) q) relies on |q| <= 127: q = rne(x * id)
    with |x| <= amax and id = fl(127 / amax) stays within 127 (1 + u)^2 < 127.5.  Blocks at the edges:
    the extreme at -amax among near-equal values, amax from subnormal to 3e38, infinities and NaN."""
    rng = np.random.default_rng(qtype)
    k = 256
    amax = np.exp2(rng.uniform(-149, 127.9, size=4000)).astype(np.float32)
    x = -amax[:, None] * (1 - rng.integers(0, 8, size=(4000, k)) * np.float32(2.0 ** -24))
    x = x.astype(np.float32)
    x[:, ::5] *= -1
    x[:100, 7] = -np.inf
    x[100:200, 9] = np.nan
    x[200:300, 3] = np.float32(3.4e38)
    q = block_matmul.quantize_q8(torch.from_numpy(x), qtype)["q"]
    assert int(q.min()) >= -127 and int(q.max()) <= 127


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_the_vector_quantiser_gives_the_scalar_codes_bits(qtype):
    """The AVX-512 quantiser (block_matmul.c's q8_quantize_block16) against the scalar code on blocks at
    the edges: ties of the largest |x| with both signs (Q8_K takes the first), half-way roundings,
    zeros, subnormals, +-inf, NaN anywhere (those blocks take the scalar code), values up to 3e38."""
    rng = np.random.default_rng(100 + qtype)
    k = 512
    x = (rng.standard_normal((300, k)) * np.exp2(rng.integers(-140, 120, size=(300, 1)))).astype(np.float32)
    x[0] = 0
    x[1, 10], x[1, 300] = -2.5, 2.5  # the largest |x| twice, signs apart
    x[1, 11], x[1, 301] = 2.5, -2.5
    x[2] = np.float32(127 / 4) * (np.arange(k) % 9 - 4) / 2  # multiples of half a step: ties to even
    x[3, :] = rng.choice([0.0, 1e-45, -1e-45, 1e-40], size=k)
    x[4:40, 5], x[40:80, 33], x[80:120, 255] = np.inf, -np.inf, np.nan
    x[120:160, rng.integers(0, k, 40)] = np.nan
    x[160:200, 7] = np.float32(3.4e38)
    xt = torch.from_numpy(x)
    vec, ref = block_matmul.quantize_q8(xt, qtype), block_matmul.quantize_q8(xt, qtype, portable=True)
    for key in ref:
        a, b = vec[key].numpy(), ref[key].numpy()
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"{key} differs"


@needs_kernel
def test_gguflinear_numerics():
    qtype, n, k = 12, 40, 512
    b = torch.from_numpy(random_blocks(qtype, n, k, seed=5))
    lay = GGUFLinear(b, qtype, k, n, bias=torch.randn(n))
    x = torch.randn(3, 7, k)
    exact = lay(x)
    seq = torch.nn.Sequential(lay)
    assert numerics_of(seq) == "gguf-exact-f32" and lay.q8weight is None
    set_numerics(seq, "gguf-q8")
    assert numerics_of(seq) == "gguf-q8" and "numerics=gguf-q8" in repr(lay)
    y = lay(x)
    assert torch.equal(y, block_matmul.linear_q8(x, lay.q8weight, qtype, n, k, lay.bias))
    assert torch.equal(y[1, 2:3], lay(x[1, 2:3]))
    assert not torch.equal(y, exact) and (y - exact).abs().max() <= 0.02 * exact.abs().max()
    assert torch.equal(lay.weight, torch.from_numpy(dequantize(b.numpy(), QT(qtype))).reshape(n, k))  # weights unchanged
    set_numerics(seq, "gguf-exact-f32")
    assert torch.equal(lay(x), exact) and lay.q8weight is None
    with pytest.raises(ValueError, match="numerics must be one of"):
        set_numerics(seq, "int4")
    with pytest.raises(ValueError, match="packed bytes"):
        block_matmul.linear_q8(x, torch.zeros(10, dtype=torch.uint8), qtype, n, k)


@needs_kernel
def test_tiny_gguf_file_under_q8(tmp_path):
    from transformers import AutoConfig

    from draftcert.decode import speculative_generate
    from draftcert.gguf.loader import load_gguf_causal_lm

    from tests.tiny_gguf import write_tiny_llama

    qtypes = {"emb": 8, "q": 12, "k": 3, "v": 6, "o": 14, "gate": 12, "up": 8, "down": 3, "out": 14}
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, tied=False, qtypes=qtypes)
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    exact = load_gguf_causal_lm(path, config, quiet=True)
    q8 = load_gguf_causal_lm(path, config, quiet=True, numerics="gguf-q8")
    assert numerics_of(exact) == "gguf-exact-f32" and numerics_of(q8) == "gguf-q8"
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = exact(ids).logits, q8(ids).logits
        one = q8(ids[1:]).logits
    assert torch.equal(one, b[1:])  # batch invariant
    assert (a - b).abs().max() <= 0.05 * a.abs().max()  # the 8-bit activations' error, two layers
    prompt = ids[:1]
    with torch.no_grad():
        greedy = q8.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                             pad_token_id=0)[0, prompt.shape[1]:]
    drafter = load_gguf_causal_lm(path, config, quiet=True)  # another computation as the drafter: rejections happen
    res = speculative_generate(q8, drafter, prompt, "strict", k=3, max_new_tokens=12)
    assert list(res.tokens) == greedy.tolist()[:len(res.tokens)] and len(res.tokens) == len(greedy)


@pytest.fixture(scope="module")
def embedded_q8():
    from draftcert.models import ModelUnavailable, load_target

    try:
        return load_target(weights="gguf-q8", fast_linear=False)
    except ModelUnavailable as e:
        pytest.skip(f"embedded model unavailable: {e}")


@needs_kernel
def test_strict_decoding_on_the_q8_target_is_its_greedy_decoding(embedded_q8):
    from draftcert.decode import speculative_generate
    from draftcert.prompts import encode_prompt

    q, tok = embedded_q8
    assert numerics_of(q) == "gguf-q8"
    ids = torch.tensor([encode_prompt(tok, "Name three primary colours.")])
    with torch.no_grad():
        greedy = q.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)[0, ids.shape[1]:]
    for k in (2, 4):
        res = speculative_generate(q, "default", ids, "strict", k=k, max_new_tokens=16)
        assert list(res.tokens) == greedy.tolist()[:len(res.tokens)] and len(res.tokens) == len(greedy)


def test_released_file_pages_read_back_the_same_bytes(tmp_path):
    from draftcert.gguf.reader import read_gguf, release_file_pages

    from tests.tiny_gguf import write_tiny_llama

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, tied=False, qtypes={"gate": 12, "up": 8})
    _, tensors = read_gguf(path)
    t = tensors["blk.0.ffn_gate.weight"]
    view = torch.from_numpy(t.data)
    before = view.clone()
    assert release_file_pages(view) in (True, False)  # True where the platform has madvise
    assert torch.equal(view, before)  # faulted back in from the file
    assert release_file_pages(before) is False  # a copy is not a file's pages: left alone


@needs_kernel
@pytest.mark.parametrize("numerics", ["gguf-exact-f32", "gguf-q8"])
def test_siblings_compute_one_pass_with_each_members_own_bits(numerics):
    """q/k/v (and gate/up) on one input: one stacked kernel call, each member's output bits as if it
    ran alone, whatever order and inputs the members are called with, under either contract."""
    from torch import nn

    from draftcert.gguf.layers import Siblings, dissolve_siblings, group_siblings

    def layer(qtype, n, k, seed, bias=True):
        b = torch.from_numpy(np.random.default_rng(seed).standard_normal(n).astype(np.float32)) if bias else None
        return GGUFLinear(torch.from_numpy(random_blocks(qtype, n, k, seed=seed)), qtype, k, n, bias=b, numerics=numerics)

    k = 256
    attn = nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = layer(12, 48, k, 1), layer(12, 32, k, 2), layer(12, 19, k, 3)
    mlp = nn.Module()
    mlp.gate_proj, mlp.up_proj = layer(14, 40, k, 4), layer(14, 40, k, 5)  # 40: not whole groups of 16 (q8's packing)
    odd = nn.Module()
    odd.q_proj, odd.k_proj, odd.v_proj = layer(12, 32, k, 6), layer(12, 32, k, 7), layer(8, 32, k, 8)  # v: another type
    root = nn.ModuleList([attn, mlp, odd])
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(0))
    x2 = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    alone = {n: m(x) for n, m in root.named_modules() if isinstance(m, GGUFLinear)}
    alone2 = {n: m(x2) for n, m in root.named_modules() if isinstance(m, GGUFLinear)}
    q8 = numerics == "gguf-q8"
    # q/k/v of attn; q/k of odd (v has another type); gate/up only where 40 outputs can stack (not q8)
    assert group_siblings(root) == (2 if q8 else 3)
    group = attn.q_proj.__dict__["_siblings"]
    assert isinstance(group, Siblings) and group.members == [attn.q_proj, attn.k_proj, attn.v_proj]
    w = (lambda m: m.q8weight) if q8 else (lambda m: m.qweight)
    assert w(attn.k_proj).data_ptr() == group.weight.data_ptr() + w(attn.q_proj).numel()  # views, no copy
    assert odd.v_proj.__dict__.get("_siblings") is None
    assert (mlp.up_proj.__dict__.get("_siblings") is None) == q8
    calls = []
    fn = "linear_q8" if q8 else "linear"
    real = getattr(block_matmul, fn)
    try:
        setattr(block_matmul, fn, lambda *a, **kw: calls.append(a[3]) or real(*a, **kw))
        for order in (("0.q_proj", "0.k_proj", "0.v_proj"), ("0.v_proj", "0.q_proj", "0.k_proj")):
            calls.clear()
            got = {n: root.get_submodule(n)(x) for n in order}
            assert calls == [99]  # one pass of 48 + 32 + 19 outputs
            for n in order:
                assert torch.equal(got[n], alone[n]), n
        calls.clear()  # another input between two members, a member twice: recomputed, still its own bits
        assert torch.equal(attn.q_proj(x), alone["0.q_proj"])
        assert torch.equal(attn.k_proj(x2), alone2["0.k_proj"])
        assert torch.equal(attn.k_proj(x), alone["0.k_proj"]) and torch.equal(attn.k_proj(x), alone["0.k_proj"])
        assert calls == [99, 99, 99, 99]
        with torch.inference_mode():  # inference tensors (no version counter) take the same path
            xi = x.clone()
            assert torch.equal(attn.v_proj(xi), alone["0.v_proj"]) and torch.equal(attn.q_proj(xi), alone["0.q_proj"])
        for n in ("2.q_proj", "2.k_proj", "2.v_proj", "1.gate_proj", "1.up_proj"):
            assert torch.equal(root.get_submodule(n)(x), alone[n]), n
    finally:
        setattr(block_matmul, fn, real)
    twin = copy.deepcopy(attn)  # e.g. a drafter layer initialised from the target's: its own group, same bits
    assert twin.q_proj.__dict__["_siblings"] is twin.k_proj.__dict__["_siblings"] is not group
    assert all(torch.equal(getattr(twin, n)(x), alone["0." + n]) for n in ("k_proj", "q_proj", "v_proj"))
    dissolve_siblings(attn.k_proj)
    assert all(m.__dict__.get("_siblings") is None for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert torch.equal(attn.k_proj(x), alone["0.k_proj"])  # alone again, on its view of the stacked packing
    attn.q_proj.set_numerics("gguf-q8" if not q8 else "gguf-exact-f32")  # a member leaving the contract leaves its group
    assert group_siblings(root) == (2 if q8 else 3) and attn.k_proj.__dict__["_siblings"].members == [attn.k_proj, attn.v_proj]
    assert torch.equal(attn.k_proj(x), alone["0.k_proj"]) and torch.equal(attn.v_proj(x), alone["0.v_proj"])


@needs_kernel
@pytest.mark.parametrize("numerics", ["gguf-exact-f32", "gguf-q8"])
def test_tiny_gguf_model_groups_its_siblings_with_the_same_logits(tmp_path, numerics):
    from transformers import AutoConfig

    from draftcert.gguf.layers import GGUFLinear as GL, dissolve_siblings

    from draftcert.gguf.loader import load_gguf_causal_lm

    from tests.tiny_gguf import write_tiny_llama

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, tied=True, qtypes={"emb": 8, "q": 12, "k": 12, "v": 14, "o": 14, "gate": 6, "up": 6, "down": 3})
    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    q8 = load_gguf_causal_lm(path, config, quiet=True, numerics=numerics)
    groups = {id(m.__dict__["_siblings"]) for m in q8.modules() if isinstance(m, GL) and m.__dict__.get("_siblings")}
    assert len(groups) == 2 * 2  # per layer q/k (v is Q6_K) and gate/up
    attn = q8.model.layers[0].self_attn
    group = attn.q_proj.__dict__["_siblings"]
    assert group.numerics == numerics and group.members == [attn.q_proj, attn.k_proj]
    if numerics == "gguf-exact-f32":  # the members' blocks are rows of the stacked copy
        assert attn.k_proj.qweight.data_ptr() == group.weight.data_ptr() + attn.q_proj.qweight.numel()
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        grouped = q8(ids).logits
        for m in q8.modules():
            if isinstance(m, GL):
                dissolve_siblings(m)
        alone = q8(ids).logits
        set_numerics(q8, numerics)  # groups again
        again = q8(ids).logits
    assert torch.equal(grouped, alone) and torch.equal(again, alone)
