"""Compiling and loading this package's C sources: once, cached by source, compiler, flags and CPU.

``build_native(source)`` runs ``$CC`` (else ``cc``) with :data:`FLAGS` (``-O3 -march=native
-ffp-contract=off``, plus ``$DRAFTCERT_NATIVE_CFLAGS``; ``-fopenmp`` where it links) into
``<cache_root>/kernels/`` and loads the library with ``ctypes``; ``DRAFTCERT_NATIVE=0``, no compiler or a
failed build give (None, the reason, "").  Used by the kernels in ``draftcert.models`` and by the
fused divergence pass (``divpass.c``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ._cache import cache_root

__all__ = ["FLAGS", "extra_flags", "library_path", "build_native"]

FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-Werror=implicit-function-declaration")


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def extra_flags() -> list[str]:
    """``$DRAFTCERT_NATIVE_CFLAGS`` (shared with smallm): e.g. ``-mno-avx512f`` for the AVX2 build."""
    return os.environ.get("DRAFTCERT_NATIVE_CFLAGS", "").split()


def library_path(cc: str, source: Path) -> Path:
    """Where the compiled kernel for this source, compiler, flags and CPU lives."""
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    ident = b"\0".join([source.read_bytes(), version.encode(), _cpu_flags().encode(),
                        " ".join([*FLAGS, *extra_flags()]).encode()])
    return cache_root() / "kernels" / f"{source.stem}-{hashlib.sha256(ident).hexdigest()[:16]}.so"


def _compile(cc: str, out: Path, source: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    base = [cc, *FLAGS, *extra_flags(), "-shared", "-fPIC", "-std=gnu11", str(source)]
    errors = []
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        for extra in (["-fopenmp"], []):  # without OpenMP the kernel runs on one thread
            r = subprocess.run(base + extra + ["-o", str(tmp_out)], capture_output=True, text=True, timeout=300)
            if r.returncode == 0:
                os.replace(tmp_out, out)  # atomic: a concurrent process sees the old file or the new one
                return
            errors.append(r.stderr.strip().splitlines()[-1:] or [f"exit {r.returncode}"])
    raise RuntimeError(f"{cc} could not build {source.name}: {errors[0][0]}")


def build_native(source: Path) -> tuple[ctypes.CDLL | None, str, str]:
    """Compile (once, cached by source, compiler, flags and CPU) and load a C source of this package
    with the kernels' flags: (the library, "", its build id) or (None, why it is unavailable, "")."""
    if os.environ.get("DRAFTCERT_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None, "disabled by DRAFTCERT_NATIVE=0", ""
    cc = shutil.which(os.environ.get("CC") or "cc")
    if cc is None:
        return None, f"no C compiler found ({os.environ.get('CC') or 'cc'} is not on PATH; set CC)", ""
    try:
        path = library_path(cc, source)
        if not path.exists():
            _compile(cc, path, source)
        return ctypes.CDLL(str(path)), "", path.stem
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return None, str(e), ""
