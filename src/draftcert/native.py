"""Compiling and loading this package's C sources: one build path for every native library.

A :class:`NativeLibrary` names a C source, the prefix of the symbols it exports and their
signatures.  On first use it runs ``$CC`` (else ``cc``) with :data:`FLAGS` (``-O3 -march=native
-ffp-contract=off``, plus ``$DRAFTCERT_NATIVE_CFLAGS``; ``-fopenmp`` where it links) into
``<cache_root>/kernels/<stem>-<hash>.so``, keyed by the source, the compiler, the flags and the CPU,
loads it with ``ctypes`` and declares its functions.  ``DRAFTCERT_NATIVE=0``, no compiler or a failed
build leave it unavailable, with the reason in :meth:`NativeLibrary.reason`; callers then run torch.

Libraries (each exports only ``<prefix>*`` symbols): ``logit_pass.c`` (``lp_``, the certificates'
float64 row pass), ``kernels/block_matmul.c`` (``dq``: ``dq_`` and ``dq8_``), ``kernels/packed_matmul.c``
(``pm_``), ``kernels/row_attention.c`` (``ra_``), ``forward/layer_kernel.c`` (``dl_``: a decoder layer
under ``gguf-q8``, with ``block_matmul.c`` and ``row_attention.c`` included and hidden).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ._cache import cache_root

__all__ = ["FLAGS", "NativeLibrary", "cpu_flags", "extra_flags", "library_path", "build_native", "native_disabled"]

FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-Werror=implicit-function-declaration")
# ctypes types of the one-letter signature codes: L long, P pointer, I int, F float, D double
_CTYPES = {"L": ctypes.c_long, "P": ctypes.c_void_p, "I": ctypes.c_int, "F": ctypes.c_float, "D": ctypes.c_double}


def cpu_flags() -> str:
    """The CPU feature flags (/proc/cpuinfo's flags line), "" where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def extra_flags() -> list[str]:
    """``$DRAFTCERT_NATIVE_CFLAGS``: e.g. ``-mno-avx512f`` for the AVX2 build on an AVX-512 machine."""
    return os.environ.get("DRAFTCERT_NATIVE_CFLAGS", "").split()


def native_disabled() -> bool:
    """``DRAFTCERT_NATIVE=0`` (or false / no / off): no native library is built or loaded."""
    return os.environ.get("DRAFTCERT_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")


def _flags(source_flags: tuple[str, ...]) -> list[str]:
    return [*FLAGS, *source_flags, *extra_flags()]


def library_path(cc: str, source: Path, source_flags: tuple[str, ...] = (), includes: tuple[Path, ...] = ()) -> Path:
    """Where the compiled library for this source (and the files it includes), compiler, flags and CPU lives."""
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    ident = b"\0".join([source.read_bytes(), *(Path(f).read_bytes() for f in includes), version.encode(), cpu_flags().encode(),
                        " ".join(_flags(source_flags)).encode()])
    return cache_root() / "kernels" / f"{source.stem}-{hashlib.sha256(ident).hexdigest()[:16]}.so"


def _compile(cc: str, out: Path, source: Path, source_flags: tuple[str, ...]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    base = [cc, *_flags(source_flags), "-shared", "-fPIC", "-std=gnu11", str(source)]
    errors = []
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        for extra in (["-fopenmp"], []):  # without OpenMP the library runs on one thread
            r = subprocess.run(base + extra + ["-o", str(tmp_out)], capture_output=True, text=True, timeout=300)
            if r.returncode == 0:
                os.replace(tmp_out, out)  # atomic: a concurrent process sees the old file or the new one
                return
            errors.append(r.stderr.strip().splitlines()[-1:] or [f"exit {r.returncode}"])
    raise RuntimeError(f"{cc} could not build {source.name}: {errors[0][0]}")


def build_native(source: Path, source_flags: tuple[str, ...] = (),
                 includes: tuple[Path, ...] = ()) -> tuple[ctypes.CDLL | None, str, str]:
    """Compile (once, cached) and load ``source``: (the library, "", its build id) or (None, why
    it is unavailable, "").  ``source_flags`` go after :data:`FLAGS` (a later flag wins); ``includes``:
    the sources it ``#include``s (part of the build's key: editing one rebuilds it)."""
    if native_disabled():
        return None, "disabled by DRAFTCERT_NATIVE=0", ""
    cc = shutil.which(os.environ.get("CC") or "cc")
    if cc is None:
        return None, f"no C compiler found ({os.environ.get('CC') or 'cc'} is not on PATH; set CC)", ""
    try:
        path = library_path(cc, source, source_flags, includes)
        if not path.exists():
            _compile(cc, path, source, source_flags)
        return ctypes.CDLL(str(path)), "", path.stem
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return None, str(e), ""


class NativeLibrary:
    """One C source of this package, compiled and loaded on first use.

    ``signatures``: ``{symbol: (argument codes, return code)}`` in the codes of ``_CTYPES`` (``"PLLI"``
    is pointer, long, long, int); every symbol starts with ``prefix``.  A symbol the loaded build
    lacks (an older source, for benchmarks) is left undeclared.  ``source_flags``: compiler flags of
    this source only, after :data:`FLAGS`; ``includes``: the sources it ``#include``s.
    """

    def __init__(self, source: Path, prefix: str, signatures: dict[str, tuple[str, str]],
                 source_flags: tuple[str, ...] = (), includes: tuple[Path, ...] = ()):
        bad = [name for name in signatures if not name.startswith(prefix)]
        if bad:
            raise ValueError(f"{source.name}: symbols {bad} lack the library's prefix {prefix!r}")
        self.source, self.prefix, self.signatures, self.source_flags = Path(source), prefix, signatures, source_flags
        self.includes = tuple(Path(f) for f in includes)
        self._loaded: tuple[ctypes.CDLL | None, str, str] | None = None

    def _declare(self, lib: ctypes.CDLL) -> ctypes.CDLL:
        for name, (args, ret) in self.signatures.items():
            if hasattr(lib, name):
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = [_CTYPES[c] for c in args], _CTYPES[ret]
        return lib

    def _load(self) -> tuple[ctypes.CDLL | None, str, str]:
        if self._loaded is None:
            lib, why, ident = build_native(self.source, self.source_flags, self.includes)
            self._loaded = (self._declare(lib) if lib is not None else None), why, ident
        return self._loaded

    @property
    def lib(self) -> ctypes.CDLL | None:
        """The loaded library (functions declared), or None where it is unavailable."""
        return self._load()[0]

    def available(self) -> bool:
        """Is the library built (or buildable now) and loaded?"""
        return self._load()[0] is not None

    def reason(self) -> str:
        """Why :meth:`available` is False ("" when it is True)."""
        return self._load()[1]

    def build_id(self) -> str:
        """The loaded build (``<stem>-<hash of source, compiler, flags and CPU>``), or "" where unavailable."""
        return self._load()[2]

    def reset(self) -> None:
        """Forget the loaded state: the next use builds or loads again (after an environment change)."""
        self._loaded = None

    def require(self) -> ctypes.CDLL:
        """The loaded library; RuntimeError naming the source and the reason where it is unavailable."""
        lib = self._load()[0]
        if lib is None:
            raise RuntimeError(f"the native kernel {self.source.name} is unavailable: {self.reason()}")
        return lib

    @contextlib.contextmanager
    def built_with(self, *flags: str):
        """This source built with ``flags`` after its own is the loaded library inside the block,
        then the build before again (benchmarks: two builds in one process, in turns, where timing
        them in two processes would measure the processes).  Objects the other build made stay
        valid: the builds share the source, so its structures are the same."""
        before = self._load()
        lib, why, ident = build_native(self.source, (*self.source_flags, *flags), self.includes)
        if lib is None:
            raise RuntimeError(f"{self.source.name} with {' '.join(flags)}: {why}")
        self._loaded = (self._declare(lib), "", ident)
        try:
            yield self._loaded[0]
        finally:
            self._loaded = before

    def load_other(self, source: str | Path) -> ctypes.CDLL:
        """Another revision of this source (for benchmarks against it), built and declared as this
        library is; RuntimeError if it does not build."""
        lib, why, _ = build_native(Path(source), self.source_flags, self.includes)
        if lib is None:
            raise RuntimeError(f"{source}: {why}")
        return self._declare(lib)
