"""The native float64 passes over logit rows (``logit_pass.c``) behind the certificates' arithmetic.

Two passes read each float32 logit row once where torch makes a dozen float64 passes:

* :func:`pair_reductions` -- the divergence pass's row reductions (``divergences._logit_pair_pass``);
* :func:`logit_moments` -- the summary's normaliser and entropy sums (``summary.summarize``).

Both use their own vectorised float64 exp, within the 2 ulps that docs/theory.md, section 7
charges, and run only where ``logit_pass.c`` builds with AVX-512 (its scalar build is not
vectorised and was not measured against torch).  Switches: ``DRAFTCERT_NATIVE=0`` (every native
kernel), ``DRAFTCERT_FUSED_DIVERGENCE=0`` (the divergence pass), ``DRAFTCERT_FUSED_SUMMARY=0`` (the
summary's moments); :func:`reason` says why a pass is off.  Every function returns None where its
pass does not apply, and the caller runs torch's.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from .native import NativeLibrary

__all__ = ["LIBRARY", "reason", "pair_reductions", "logit_moments", "exp_fused", "exp_gradual"]

LIBRARY = NativeLibrary(Path(__file__).with_name("logit_pass.c"), "lp_", {
    "lp_pair_pass": ("PLPLLLIPPI", "L"), "lp_logit_moments": ("PLLLPIPPI", "L"), "lp_vector_width": ("", "I"),
    "lp_exp_array": ("PLP", "I"), "lp_exp_gradual_array": ("PLP", "I")})
_SWITCH = {"divergence": "DRAFTCERT_FUSED_DIVERGENCE", "summary": "DRAFTCERT_FUSED_SUMMARY"}
_OFF = ("0", "false", "no", "off")
_CHUNK = 8192  # logit_pass.c's CHUNK: the summary's partial sums


def _library() -> tuple[ctypes.CDLL | None, str]:
    lib = LIBRARY.lib
    if lib is None:
        return None, LIBRARY.reason()
    if lib.lp_vector_width() < 8:
        return None, "logit_pass.c built without AVX-512: torch's pass is used"
    return lib, ""


def _lib(kind: str) -> tuple[ctypes.CDLL | None, str]:
    var = _SWITCH[kind]
    if os.environ.get(var, "1").strip().lower() in _OFF:
        return None, f"disabled by {var}=0"
    return _library()


def reason(kind: str = "divergence") -> str:
    """"" where the fused ``kind`` pass ("divergence" or "summary") runs on float32, float16 and
    bfloat16 CPU rows, else why not."""
    return _lib(kind)[1]


_HALF = (torch.float16, torch.bfloat16, torch.float32)


def _rows(x: torch.Tensor) -> torch.Tensor:
    # float16 / bfloat16 values are exact in float32: the same values get the same bits in any of the three
    x = x.float()
    return x if x.stride(-1) == 1 else x.contiguous()


def pair_reductions(x: torch.Tensor, y: torch.Tensor, full: bool) -> torch.Tensor | None:
    """The divergence pass's row reductions [N, 8] (S_p, S_q, T, T_q, TV sum, max|a|, max|b|, max y;
    see ``logit_pass.c``), NaN in column 0 for a row with a non-finite logit; None where the pass does
    not apply (float64 or non-CPU rows, or no library)."""
    if x.device.type != "cpu" or x.dtype not in _HALF or y.dtype not in _HALF \
            or x.shape != y.shape or x.dim() != 2 or x.shape[-1] == 0:
        return None
    lib = _lib("divergence")[0]
    if lib is None:
        return None
    x, y = _rows(x), _rows(y)
    n, V = x.shape
    threads = max(1, min(torch.get_num_threads(), n))
    out = torch.empty(n, 8, dtype=torch.float64)
    scratch = torch.empty(threads if full else 1, 2 * V if full else 1, dtype=torch.float64)
    lib.lp_pair_pass(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), n, V, int(full),
                     out.data_ptr(), scratch.data_ptr(), threads)
    return out


def logit_moments(x: torch.Tensor, m: torch.Tensor, want_entropy: bool) -> torch.Tensor | None:
    """The summary's moments [N, 3] of logit rows x [N, V] with references m [N, 1] float64:
    (s = sum e^z, d = sum e^z z, min x), z = fl(x - m) (see ``logit_pass.c``), NaN in column 0 for a
    row with a NaN or +inf logit or a non-finite m; None where the pass does not apply."""
    if x.device.type != "cpu" or x.dtype not in _HALF or x.dim() != 2 or x.shape[-1] == 0:
        return None
    lib = _lib("summary")[0]
    if lib is None:
        return None
    x = _rows(x)
    n, V = x.shape
    m = m.reshape(n).to(torch.float64).contiguous()
    chunks = n * -(-V // _CHUNK)
    threads = max(1, min(torch.get_num_threads(), chunks))
    out = torch.empty(n, 3, dtype=torch.float64)
    part = torch.empty(chunks, 4, dtype=torch.float64)
    lib.lp_logit_moments(x.data_ptr(), x.stride(0), n, V, m.data_ptr(), int(want_entropy), out.data_ptr(),
                         part.data_ptr(), threads)
    return out


def _exp(name: str, a: torch.Tensor) -> torch.Tensor:
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"fused passes unavailable: {why}")
    a = a.detach().to(torch.float64).contiguous().cpu()
    out = torch.empty_like(a)
    getattr(lib, name)(a.data_ptr(), a.numel(), out.data_ptr())
    return out


def exp_fused(a: torch.Tensor) -> torch.Tensor:
    """The divergence pass's float64 exp on ``a`` (for its tests): relative error <= 2 U where
    e^a >= 2^-1021, 0 below a = -708.  RuntimeError where the library is unavailable."""
    return _exp("lp_exp_array", a)


def exp_gradual(a: torch.Tensor) -> torch.Tensor:
    """The summary pass's float64 exp on ``a`` (for its tests): relative error <= 2 U where
    e^a >= 2^-1022, one rounding into the subnormals below (absolute < 2^-1073), 0 below -760."""
    return _exp("lp_exp_gradual_array", a)
