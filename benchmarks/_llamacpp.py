"""llama.cpp as a peer in the speed benchmarks (``bench_pair.py``): its binaries, built once into
draftcert's cache, and one greedy run of each of its decoding modes with its own timings parsed.

The build: the sdist of ``llama-cpp-python==0.3.36`` (it vendors llama.cpp) is fetched with
``pip download --no-deps --no-binary :all:`` into ``<draftcert cache>/llamacpp/`` and extracted
there; ``vendor/llama.cpp`` is configured with CMake (Release, ``GGML_NATIVE=ON`` with the AMX
instructions switched off: on AMX Xeons a native build segfaults in ``ggml_backend_amx_mul_mat``
on multi-token batches; no curl, tests or server) and only ``llama-completion``,
``llama-speculative-simple``, ``llama-lookup`` and ``llama-bench`` are built, into
``vendor/llama.cpp/build/bin``.  A build already there is reused (one still running there,
started by anyone, is waited for; an interrupted one is resumed by CMake).  Nothing here is needed by the tests.

Timings are llama.cpp's own, never the process's wall time (which includes loading the model):

* ``llama-completion``: prompt eval + eval + sampling time from ``common_perf_print`` (the
  prompt's forward, the per-token forwards and the samplers; the model load, the warm-up run and
  the printing around them excluded);
* ``llama-speculative-simple`` and ``llama-lookup``: the ``encoded N tokens in X seconds`` plus
  ``decoded N tokens in Y seconds`` lines, wall clock around the prompt's processing (target and
  drafter) and the whole decoding loop (drafting, verification, sampling).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python's sdist; it vendors llama.cpp (0.5.0-dev, commit 0c1e570 for this one)
BINARIES = ("llama-completion", "llama-speculative-simple", "llama-lookup", "llama-bench")
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def llamacpp_root() -> Path:
    from draftcert._cache import cache_root

    return cache_root() / "llamacpp"


def source_dir(root: Path | None = None) -> Path:
    return (root or llamacpp_root()) / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"


def _found(bin_dir: Path, names=BINARIES) -> dict[str, Path] | None:
    paths = {n: bin_dir / n for n in names}
    return paths if all(p.is_file() and os.access(p, os.X_OK) for p in paths.values()) else None


def _log(msg: str) -> None:
    print(f"llama.cpp: {msg}", file=sys.stderr, flush=True)


def _build_running(build: Path) -> bool:
    """Whether another process (anyone's: make, the compilers, the linker) works inside ``build``
    now, from /proc: a build started elsewhere, e.g. by hand, in the same layout."""
    me, inside = os.getpid(), str(build.resolve())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if int(pid) != me and (cwd == inside or cwd.startswith(inside + os.sep)):
            return True
    return False


def binaries(spec: str = "auto", wait_s: float = 3600) -> dict[str, Path]:
    """``{name: path}`` of ``BINARIES``.  ``spec``: ``"auto"`` (the cached build, built first if
    missing; a build already running there is waited for, up to ``wait_s``, and reused) or a
    folder holding them (used as is; FileNotFoundError if one is missing)."""
    if spec != "auto":
        found = _found(Path(spec).expanduser())
        if found is None:
            raise FileNotFoundError(f"--llamacpp {spec}: needs {', '.join(BINARIES)} in that folder")
        return found
    root = llamacpp_root()
    out = source_dir(root) / "build"
    if _build_running(out):
        _log(f"a build is running in {out}; waiting for it")
        t0 = time.monotonic()
        while _build_running(out):
            if time.monotonic() - t0 > wait_s:
                raise RuntimeError(f"the build running in {out} did not end within {wait_s:.0f} s (or pass --llamacpp off)")
            time.sleep(10)
    if (found := _found(out / "bin")) is not None:
        return found
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".build.lock", "w") as lock:  # one builder among draftcert processes
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (found := _found(out / "bin")) is None:
            build(root)
    if (found := _found(out / "bin")) is None:
        raise RuntimeError(f"the llama.cpp build in {out} did not produce {', '.join(BINARIES)}")
    return found


def build(root: Path) -> None:
    """Fetch, extract, configure and build into ``root`` (see the module docstring); minutes."""
    src = source_dir(root)
    if not (src / "CMakeLists.txt").is_file():
        sdist = root / f"llama_cpp_python-{VERSION}.tar.gz"
        if not sdist.is_file():
            _log(f"downloading the llama-cpp-python=={VERSION} sdist (pip download --no-deps --no-binary :all:)")
            subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={VERSION}", "--no-deps",
                            "--no-binary", ":all:", "-d", str(root)], check=True)  # fmt: skip
        with tempfile.TemporaryDirectory(prefix=".tmp-src-", dir=root) as tmp:
            with tarfile.open(sdist) as tf:
                tf.extractall(tmp, filter="data")
            top = Path(tmp) / f"llama_cpp_python-{VERSION}"
            dest = root / top.name
            if dest.exists():  # a partial earlier extraction
                shutil.rmtree(dest)
            os.replace(top, dest)
    out = src / "build"
    if not (out / "CMakeCache.txt").is_file():
        _log(f"configuring {src}")
        subprocess.run(["cmake", "-S", str(src), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                        "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                        f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"], check=True)  # fmt: skip
    _log(f"building {', '.join(BINARIES)} in {out} (minutes)")
    subprocess.run(["cmake", "--build", str(out), f"-j{os.cpu_count() or 1}", "--target", *BINARIES], check=True)


# ---------------------------------------------------------------------------------------------
# one run and its output


@dataclass
class LlamaRun:
    """One llama.cpp generation: its text (stdout, prompt removed), the tokens it reports as
    generated, the seconds of its generation by its own timings (module docstring), and the
    prompt token ids it printed (``--verbose-prompt``, ``llama-completion`` only)."""

    text: str
    n_tokens: int
    seconds: float
    prompt_ids: list[int] | None = None
    stats: dict = field(default_factory=dict)


_F = r"([0-9]+(?:\.[0-9]+)?)"


def parse_timings(log: str) -> dict:
    """The figures llama.cpp prints at the end of a run (its stderr log), in seconds and counts:
    ``prompt_eval_s``/``prompt_tokens``, ``eval_s``/``eval_runs``, ``sampling_s``, ``load_s``
    (``common_perf_print``, the last such block: the target's), ``encoded_s``/``encoded_tokens``
    and ``decoded_s``/``decoded_tokens`` (speculative and lookup examples), ``n_draft``,
    ``n_drafted``, ``n_accept``; the keys whose line is absent are missing."""
    out: dict = {}

    def last(pattern):
        m = re.findall(pattern, log)
        return m[-1] if m else None

    for key, n_key, pat in (("prompt_eval_s", "prompt_tokens", rf"prompt eval time =\s*{_F} ms /\s*(\d+) tokens"),
                            ("eval_s", "eval_runs", rf"(?<!prompt) eval time =\s*{_F} ms /\s*(\d+) runs"),
                            ("encoded_s", "encoded_tokens", rf"encoded\s+(\d+) tokens in\s+{_F} seconds"),
                            ("decoded_s", "decoded_tokens", rf"decoded\s+(\d+) tokens in\s+{_F} seconds")):  # fmt: skip
        m = last(pat)
        if m is None:
            continue
        if key.endswith("coded_s"):  # "N tokens in X seconds"
            out[n_key], out[key] = int(m[0]), float(m[1])
        else:  # "X ms / N"
            out[key], out[n_key] = float(m[0]) / 1e3, int(m[1])
    for key, pat in (("sampling_s", rf"sampling time =\s*{_F} ms"), ("load_s", rf"load time =\s*{_F} ms")):
        m = last(pat)
        if m is not None:
            out[key] = float(m) / 1e3
    for key in ("n_draft", "n_drafted", "n_accept"):
        m = last(rf"\b{key}\s*=\s*(\d+)")
        if m is not None:
            out[key] = int(m)
    return out


def parse_prompt_ids(log: str) -> list[int] | None:
    """The prompt token ids ``llama-completion --verbose-prompt`` lists (``ID -> 'piece'`` lines
    after ``number of tokens in prompt = N``; log prefixes off), or None without that listing."""
    m = re.search(r"number of tokens in prompt = (\d+)\n", log)
    if m is None:
        return None
    ids = [int(i) for i in re.findall(r"^ *(\d+) -> '", log[m.end():], flags=re.M)][: int(m.group(1))]
    return ids if len(ids) == int(m.group(1)) else None


def generation_seconds(t: dict, mode: str) -> float:
    """Seconds of the generation by llama.cpp's own timings (module docstring)."""
    if mode == "target":
        return t["prompt_eval_s"] + t["eval_s"] + t.get("sampling_s", 0.0)
    return t["encoded_s"] + t["decoded_s"]


def strip_output(stdout: str, mode: str, prompt: str) -> str:
    """The generated text in a run's stdout.  ``llama-completion`` (``--no-display-prompt``)
    prints the text, `` [end of text]`` on an end-of-generation token, then ``\\n\\n``; the
    examples print ``\\n\\n``, the prompt's pieces, the text, ``\\n\\n`` and ``\\n\\n``."""
    if mode == "target":
        text = stdout[:-2] if stdout.endswith("\n\n") else stdout
        return text[: -len(" [end of text]\n")] if text.endswith(" [end of text]\n") else text
    text = stdout[:-4] if stdout.endswith("\n\n\n\n") else stdout
    head = "\n\n" + prompt
    if not text.startswith(head):
        raise RuntimeError("llama.cpp's output does not start with the prompt it was given (its pieces differ "
                           "from the text: the prompt does not round-trip through its tokenizer)")
    return text[len(head):]


def run(bins: dict[str, Path], mode: str, *, model: Path, prompt: str, n_new: int, threads: int,
        drafter: Path | None = None, n_draft: int | None = None, ctx: int = 4096, timeout: float = 1800) -> LlamaRun:
    """One greedy generation of ``n_new`` tokens after the raw ``prompt`` text (already templated;
    special tokens in it parsed as such, no chat mode, no escapes, no BOS added for Qwen2.5).
    ``mode``: ``"target"`` (``llama-completion``), ``"spec"`` (``llama-speculative-simple
    --spec-type draft-simple -md drafter --spec-draft-n-max n_draft``) or ``"lookup"``
    (``llama-lookup``, ``--spec-draft-n-max n_draft`` when given)."""
    common = ["-m", str(model), "-p", prompt, "--no-escape", "-t", str(threads), "-c", str(ctx),
              "--temp", "0", "--top-k", "1", "--seed", "0", "--color", "off", "--no-log-prefix",
              "--no-log-timestamps"]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="draftcert-llamacpp-") as tmp:
        if mode == "target":
            cmd = [str(bins["llama-completion"]), *common, "-n", str(n_new), "-no-cnv", "--no-display-prompt",
                   "--verbose-prompt"]  # fmt: skip
        elif mode == "spec":
            # the example stops once it has produced more than -n tokens (-n n_new-1: at least n_new);
            # its last draft is not trimmed to the budget, so it may overshoot by part of a draft
            cmd = [str(bins["llama-speculative-simple"]), *common, "-n", str(n_new - 1), "-md", str(drafter),
                   "--spec-type", "draft-simple", "--spec-draft-n-max", str(n_draft), "--spec-draft-n-min", "0",
                   "--spec-draft-p-min", "0"]  # fmt: skip
        elif mode == "lookup":
            # the same stopping rule (it may overshoot too); a fresh dynamic n-gram cache per run
            # (nothing learnt across runs or from other prompts)
            cmd = [str(bins["llama-lookup"]), *common, "-n", str(n_new - 1), "-lcd", str(Path(tmp) / "dynamic.bin")]
            if n_draft is not None:
                cmd += ["--spec-draft-n-max", str(n_draft)]
        else:
            raise ValueError(f"unknown llama.cpp mode {mode!r}")
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
    stdout, stderr = p.stdout.decode("utf-8", errors="replace"), p.stderr.decode("utf-8", errors="replace")
    if p.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} exited with {p.returncode}: {stderr.strip()[-2000:]}")
    t = parse_timings(stderr)
    n = t["eval_runs"] + 1 if mode == "target" else t["decoded_tokens"]  # completion: the last token is not evaluated
    return LlamaRun(text=strip_output(stdout, mode, prompt), n_tokens=n, seconds=generation_seconds(t, mode),
                    prompt_ids=parse_prompt_ids(stderr) if mode == "target" else None, stats=t)
