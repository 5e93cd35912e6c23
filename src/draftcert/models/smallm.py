"""A native linear kernel for a few rows that streams the weight once (``smallm.c``).

A verification pass at batch 1 runs 2..16 rows (drafts, trees, suffix candidates) through every linear layer and is bound by reading
the weights; BLAS kernels for a small M re-pack or re-read them once M passes 3 or 4, so a pass of
4..9 rows can cost 2-3 passes of one row.  ``smallm.c`` holds the weight packed as
``[ceil(N / BW)][K][BW]`` (``BW`` output columns per block, a multiple of the vector width) and,
for every ``k``, feeds one load of a block to ``M`` register accumulators: the weight is read once
whatever ``M`` is (up to 16).  Arithmetic is plain float32 fused multiply-add in ``k`` order, so it
agrees with ``F.linear`` to float32 rounding (a different summation order, like any two GEMMs).

The kernel is compiled on first use with the machine's C compiler (``$CC``, else ``cc``) and
``-O3 -march=native`` (and ``$DRAFTCERT_NATIVE_CFLAGS``; plus ``-fopenmp`` where it links: blocks are split over torch's thread count,
in torch's own OpenMP runtime), into ``<cache_root>/kernels/``, keyed by the source, the compiler,
the extra flags and the CPU, then loaded with ``ctypes``.  Where no compiler works, or ``DRAFTCERT_NATIVE=0``,
:func:`available` is False with the reason in :func:`unavailable_reason`, and
``draftcert.models.fastlinear`` simply does not offer the candidate.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from .._cache import cache_root

__all__ = ["available", "unavailable_reason", "build_id", "block_width", "max_rows", "pack", "linear", "library_path"]

SOURCE = Path(__file__).with_name("smallm.c")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


def _extra_flags() -> list[str]:
    """``$DRAFTCERT_NATIVE_CFLAGS``: more compiler flags, e.g. ``-mno-avx512f`` for the AVX2 build on
    an AVX-512 machine (benchmarks/bench_smallm.py compares the two)."""
    return os.environ.get("DRAFTCERT_NATIVE_CFLAGS", "").split()


def library_path(cc: str) -> Path:
    """Where the compiled kernel for this source, compiler, flags and CPU lives."""
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    ident = SOURCE.read_bytes() + version.encode() + _cpu_flags().encode() + " ".join(_extra_flags()).encode()
    key = hashlib.sha256(ident).hexdigest()[:16]
    return cache_root() / "kernels" / f"smallm-{key}.so"


def _compile(cc: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    base = [cc, "-O3", "-march=native", *_extra_flags(), "-shared", "-fPIC", "-std=gnu11", str(SOURCE)]
    errors = []
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        for extra in (["-fopenmp"], []):  # without OpenMP the kernel runs on one thread
            r = subprocess.run(base + extra + ["-o", str(tmp_out)], capture_output=True, text=True, timeout=300)
            if r.returncode == 0:
                os.replace(tmp_out, out)  # atomic: a concurrent process sees the old file or the new one
                return
            errors.append(r.stderr.strip().splitlines()[-1:] or [f"exit {r.returncode}"])
    raise RuntimeError(f"{cc} could not build {SOURCE.name}: {errors[0][0]}")


@lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, str, str]:
    """(the loaded kernel, "", its build id) or (None, why it is unavailable, "")."""
    if os.environ.get("DRAFTCERT_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None, "disabled by DRAFTCERT_NATIVE=0", ""
    cc = _compiler()
    if cc is None:
        return None, f"no C compiler found ({os.environ.get('CC') or 'cc'} is not on PATH; set CC)", ""
    try:
        path = library_path(cc)
        if not path.exists():
            _compile(cc, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return None, str(e), ""
    lib.dc_linear.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
                              ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.dc_linear.restype = ctypes.c_int
    return lib, "", path.stem


def available() -> bool:
    """Is the kernel built (or buildable now) and loaded?"""
    return _library()[0] is not None


def unavailable_reason() -> str:
    """Why :func:`available` is False ("" when it is True)."""
    return _library()[1]


def build_id() -> str:
    """The loaded kernel's build (source, compiler, flags and CPU hashed), or "" where it is unavailable."""
    return _library()[2]


def block_width() -> int:
    """Output columns per packed block (``BW``)."""
    lib = _library()[0]
    if lib is None:
        raise RuntimeError(f"the smallm kernel is unavailable: {unavailable_reason()}")
    return lib.dc_block_width()


def max_rows() -> int:
    lib = _library()[0]
    return lib.dc_max_rows() if lib is not None else 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` (float32) as the kernel reads it: ``[ceil(N/BW), K, BW]``, zero padded."""
    if weight.dtype != torch.float32 or weight.ndim != 2:
        raise ValueError(f"smallm.pack: expected a 2-D float32 weight, got {weight.dtype} {tuple(weight.shape)}")
    bw = block_width()
    n, k = weight.shape
    nb = -(-n // bw)
    with torch.no_grad():
        padded = torch.zeros(nb * bw, k, dtype=torch.float32)
        padded[:n] = weight.detach()
        return padded.view(nb, bw, k).transpose(1, 2).contiguous()  # [nb, K, BW]


def linear(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for ``x`` of shape ``(..., K)`` with ``rows = x.numel() // K`` in
    ``1..max_rows()``, ``W`` given as ``pack(W)`` and its ``n`` output features.  Float32, CPU."""
    lib = _library()[0]
    k = x.shape[-1]
    rows = x.numel() // max(k, 1)
    if lib is None or not 1 <= rows <= lib.dc_max_rows():
        raise ValueError(f"smallm.linear: {rows} rows (the kernel takes 1..{max_rows()}; {unavailable_reason() or 'ok'})")
    if packed.shape[1] != k or x.dtype != torch.float32:
        raise ValueError(f"smallm.linear: x {tuple(x.shape)} {x.dtype} does not fit the packed weight {tuple(packed.shape)}")
    x2 = x.reshape(rows, k).contiguous()  # [rows, K]
    y = torch.empty(rows, n, dtype=torch.float32)  # [rows, N]
    b = bias.detach().contiguous() if bias is not None else None
    rc = lib.dc_linear(x2.data_ptr(), rows, k, packed.data_ptr(), n, b.data_ptr() if b is not None else None,
                       y.data_ptr(), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"smallm kernel refused {rows} rows")
    return y.view(*x.shape[:-1], n)
