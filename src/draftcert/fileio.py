"""Files that are never half-written, and the one JSON rule.

Every file draftcert writes (traces, checkpoints, ``run.json``, ``summary.json``, figures,
replay results) goes through :func:`atomic_write` or :func:`atomic_path`: the data goes to a
hidden temporary sibling, is flushed to disk, and only then takes the final name with
``os.replace``.  A run interrupted at any moment leaves either the old file or the new one,
never a torn one, so a rerun can trust every file it finds.

Before a command loads a model it can ask :func:`check_writable_dir` whether a folder can be
written at all (a read-only mount, ``/proc``, a folder without write permission), so that the
mistake costs no model load and ends with one line instead of a traceback.

JSON rule: draftcert writes strict JSON (no bare ``Infinity``/``NaN`` tokens, which most
parsers reject).  A non-finite float (+inf, -inf, NaN) is written as ``null``; numpy
scalars become Python numbers.  Where ``null`` can mean an infinite value (an infinite
radius: no drafter is ever rejected there), the field's documentation says so.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Iterator

__all__ = ["atomic_write", "atomic_path", "remove_stale_temporaries", "check_writable_dir", "settings_changes",
           "json_value", "dumps_json", "write_json"]


def _tmp_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0o666 less the process umask (0o644 for 0o022)."""
    umask = os.umask(0)  # the only portable way to read the umask is to set it and put it back
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` for a writer that wants a file name (pyarrow,
    safetensors, torch.save, matplotlib); on success it replaces ``path`` atomically, on
    any error it is removed and ``path`` is left as it was.

    The file gets the ordinary mode of a new file (0o666 less the umask) whatever the writer
    chose: safetensors, for one, creates its file 0o600."""
    path = Path(path)
    tmp = _tmp_sibling(path)
    try:
        yield tmp
        with open(tmp, "rb") as f:  # the writer may not have synced: make the bytes durable first
            os.fsync(f.fileno())
        os.chmod(tmp, _file_mode())
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):  # on a read-only file system even unlinking a missing file fails (EROFS)
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


def remove_stale_temporaries(folder, name_glob: str = "*") -> int:
    """Remove the temporary siblings that a killed process left behind for files named like
    ``name_glob`` in ``folder`` (they hold nothing: a file takes its name only when complete).
    Returns how many were removed."""
    stale = list(Path(folder).glob(f".{name_glob}.*.tmp"))
    for p in stale:
        p.unlink(missing_ok=True)
    return len(stale)


def check_writable_dir(path) -> Path:
    """``path`` if files can be written into it, creating it when missing; else the ``OSError``
    the first write would meet (its ``filename`` the folder that refused).

    Writes nothing that stays: an existing folder gets a probe file, a missing one a probe
    folder in its deepest existing ancestor (what creating it needs), each removed at once, with
    a unique name (ranks of one ``torchrun`` may probe the same folder together).  A file in the
    way raises ``NotADirectoryError``.  The root user passes permission bits, so only a real
    write tells (a read-only mount refuses root too)."""
    p = Path(os.path.expanduser(str(path)))
    q = p
    while not q.exists() and q.parent != q:
        q = q.parent
    if not q.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(q))
    try:
        if q == p:
            fd, probe = tempfile.mkstemp(prefix=".draftcert-probe-", dir=q)
            os.close(fd)
            os.unlink(probe)
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".draftcert-probe-", dir=q))
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror or str(exc), str(q)) from None
    return p


def settings_changes(old: dict, new: dict, keys=None) -> str:
    """How the settings a run folder records differ from this run's: ``"key: was A, now B; ..."``
    over ``keys`` (default: every key of either dict), empty when they agree.  The one wording of
    every "holds a run with other settings" refusal (profile's ``run.json``, train-drafter's
    ``config.json``)."""
    keys = list(dict.fromkeys([*old, *new])) if keys is None else keys
    return "; ".join(f"{k}: was {old.get(k)!r}, now {new.get(k)!r}" for k in keys if old.get(k) != new.get(k))


def atomic_write(path, data: bytes | str) -> Path:
    """Write ``data`` (str as UTF-8) to ``path`` atomically; returns the path."""
    path = Path(path)
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
    return path


def json_value(x):
    """``x`` with every non-finite float replaced by None (JSON ``null``), numpy scalars and
    arrays as Python numbers and lists, tuples as lists, dict keys as strings."""
    if isinstance(x, dict):
        return {str(k): json_value(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_value(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if hasattr(x, "tolist") and callable(x.tolist):  # numpy / torch scalars and arrays
        return json_value(x.tolist())
    return x


def dumps_json(obj, *, indent: int | None = 2) -> str:
    """Strict JSON text of ``obj`` under the rule above (a trailing newline included)."""
    return json.dumps(json_value(obj), indent=indent, allow_nan=False) + "\n"


def write_json(path, obj, *, indent: int | None = 2) -> Path:
    """``dumps_json(obj)`` written atomically to ``path``."""
    return atomic_write(path, dumps_json(obj, indent=indent))
