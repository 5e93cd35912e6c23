"""A user's own GGUF file as a target or drafter: checked, then loaded as the presets are.

:func:`load_gguf_file` is what ``models.load_target("PATH.gguf")`` (and ``--target`` / ``--drafter
PATH.gguf``) runs: :func:`check_gguf_file` first (``reader.read_gguf``: every size in the header
against the file, the architecture one transformers reads), then the transformers config and
tokenizer from the file's metadata (``gguf_file=``), then ``loader.load_gguf_causal_lm``, the loader
of the embedded model and the pair: weights of a type with a kernel computed from their blocks,
others dequantised at load (one line names them).  The config and tokenizer parsed from a file
are kept in ``<cache>/gguf/files/`` under the file's resolved path, size and modification time
(parsing a large vocabulary from GGUF metadata takes seconds); a cache that cannot be written is
skipped.  Any file that cannot be read as a model raises ``reader.GGUFFileError`` (a ValueError)
naming the file and what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

from .._cache import cache_root, install_dir_atomically
from .layers import CONTRACT
from .loader import load_gguf_causal_lm
from .reader import GGUFFileError, read_gguf

__all__ = ["GGUF_SUFFIX", "is_gguf_spec", "hub_gguf_spec", "check_gguf_file", "gguf_metadata_dir", "load_gguf_file",
           "load_gguf_dequantised"]

GGUF_SUFFIX = ".gguf"
# ORG/NAME:FILE.gguf (FILE may sit in a folder of the repository)
_HUB_GGUF = re.compile(r"^([A-Za-z0-9][\w.\-]*/[\w.\-]+):([\w.\-/]+\.gguf)$", re.IGNORECASE)


def is_gguf_spec(spec) -> bool:
    """True for a model spec naming a GGUF file: a path ending in ``.gguf`` or ``ORG/NAME:FILE.gguf``."""
    return isinstance(spec, (str, os.PathLike)) and os.fspath(spec).strip().lower().endswith(GGUF_SUFFIX)


def hub_gguf_spec(spec: str) -> tuple[str, str] | None:
    """``(ORG/NAME, FILE.gguf)`` of a hub GGUF spec ``ORG/NAME:FILE.gguf`` that is not an existing
    local path, else None."""
    s = str(spec).strip()
    m = _HUB_GGUF.match(s)
    if m is None or Path(s).expanduser().exists():
        return None
    return m.group(1), m.group(2)


# llama.cpp's names of architectures transformers reads under another name (its load_gguf_checkpoint)
_ARCH_ALIASES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2",
                 "t5encoder": "t5"}


def _transformers_archs() -> tuple[str, ...]:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES  # optional: models extra

    return tuple(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))


def check_gguf_file(path) -> dict:
    """The scalar metadata of GGUF file ``path`` once ``read_gguf`` found every size in it consistent
    with the file and the architecture is one transformers reads from GGUF; else ``GGUFFileError``."""
    path = Path(path).expanduser()
    if not path.exists():
        raise GGUFFileError(f"{path}: no such file")
    meta, _ = read_gguf(path, keep=False)  # the check; the loader maps the file again for its blocks
    parts = meta.get("split.count", 1)
    if isinstance(parts, int) and parts > 1:
        raise GGUFFileError(f"{path}: part {meta.get('split.no', 0) + 1} of a GGUF split into {parts} files; join "
                            "them first (llama.cpp: llama-gguf-split --merge FIRST_PART OUT.gguf)")
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise GGUFFileError(f"{path}: no general.architecture in its metadata (not a model file)")
    archs = _transformers_archs()
    if arch not in archs and _ARCH_ALIASES.get(arch) not in archs:
        raise GGUFFileError(f"{path}: architecture {arch!r} is not one transformers reads from GGUF files "
                            f"(it reads {', '.join(sorted(archs))})")
    return meta


def _cache_key(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode("utf-8", "surrogatepass"))
    return f"{re.sub(r'[^A-Za-z0-9._-]', '_', path.stem)[:60]}-{h.hexdigest()[:16]}"


def gguf_metadata_dir(path) -> Path:
    """Where the config and tokenizer parsed from GGUF file ``path`` are kept (may not exist yet)."""
    path = Path(path).expanduser()
    return cache_root() / "gguf" / "files" / _cache_key(path)


def _parse_metadata(path: Path, out: Path) -> None:
    """The transformers config and tokenizer of GGUF file ``path`` saved into ``out``."""
    from transformers import AutoConfig, AutoTokenizer  # optional: models extra

    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except GGUFFileError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers' and gguf-py's own errors on metadata they cannot use
        raise GGUFFileError(f"{path}: transformers cannot read its config or tokenizer from the metadata "
                            f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else e!r})") from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    (out / "draftcert.json").write_text(json.dumps({"gguf": str(path.resolve())}, indent=2) + "\n")


def _config_and_tokenizer(path: Path):
    from transformers import AutoConfig, AutoTokenizer  # optional: models extra

    final = gguf_metadata_dir(path)
    if not (final / "draftcert.json").is_file():
        try:
            install_dir_atomically(lambda tmp: _parse_metadata(path, tmp), final)
        except OSError:  # a cache that cannot be written: parse into a temporary folder instead
            with tempfile.TemporaryDirectory(prefix="draftcert-gguf-") as tmp:
                _parse_metadata(path, Path(tmp))
                return (AutoConfig.from_pretrained(tmp, local_files_only=True),
                        AutoTokenizer.from_pretrained(tmp, local_files_only=True))
    return (AutoConfig.from_pretrained(str(final), local_files_only=True),
            AutoTokenizer.from_pretrained(str(final), local_files_only=True))


def load_gguf_file(path, *, numerics: str = CONTRACT, quiet: bool = False):
    """``(model, tokenizer)`` from GGUF file ``path``: checked (:func:`check_gguf_file`), config and
    tokenizer from its metadata, built by ``load_gguf_causal_lm`` (blocks of a type with a kernel kept
    and computed under ``numerics``).  ``GGUFFileError`` for a file that cannot be read as a model."""
    path = Path(path).expanduser()
    check_gguf_file(path)
    config, tok = _config_and_tokenizer(path)
    try:
        model = load_gguf_causal_lm(path, config, quiet=quiet, numerics=numerics)
    except GGUFFileError:
        raise
    except (ValueError, KeyError, RuntimeError, NotImplementedError) as e:  # a tensor the model does not expect, a class transformers lacks
        msg = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        raise GGUFFileError(f"{path}: cannot be loaded as a causal LM ({msg.removeprefix(f'{path.name}: ')})") from None
    return model, tok


def load_gguf_dequantised(path, *, dtype, quiet: bool = False):
    """``(model, tokenizer)`` from GGUF file ``path`` with every weight dequantised to ``dtype``
    (``weights="float32"``, or another compute dtype): the same checks, then transformers' own GGUF
    loading."""
    from transformers import AutoModelForCausalLM  # optional: models extra

    path = Path(path).expanduser()
    check_gguf_file(path)
    _, tok = _config_and_tokenizer(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype,
                                                     local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers' and gguf-py's own errors
        msg = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        raise GGUFFileError(f"{path}: cannot be loaded as a causal LM ({msg})") from None
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tok
