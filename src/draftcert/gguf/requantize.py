"""A GGUF-sourced model's linear layers recomputed as other blocks: a cheaper drafter from the same file.

A drafting step of a model drafter reads every weight of the drafter once, so its cost follows the
bytes of its blocks.  The Qwen2.5-Coder-0.5B file stores its layers as Q5_0 and Q6_K (5.5 and 6.6
bits a weight) and its output layer as Q8_0 (8.5); as Q4_1 blocks (5 bits) the same network reads
a fifth fewer bytes a step, and the kernel decodes Q4_1 faster than Q5_0 and Q6_K.  The drafter
spec ``NAME@q4_1`` (``models.parse_drafter_spec``) asks for that::

    blocks(W) = quantize_TYPE(dequantize(W))        # every GGUFLinear: decoder layers and output layer

with gguf-py's own quantiser (what ``llama-quantize`` writes for the type).  The embedding stays as
stored (a step reads one row of it).  It is another drafter, not the file's: its greedy tokens can
differ from the stored model's where two logits nearly tie, so relaxed rules' outputs and the
certificates (which read its q) are this drafter's; strict decoding stays the target's greedy
decoding whatever the drafter.  ``benchmarks/bench_drafter_blocks.py`` measures the drafter's
step, its acceptance and ``-k auto``'s speed both ways.

Requantising the 0.5B model's 391 MB of blocks takes about 5 s (gguf-py's quantiser), so the
blocks are cached under ``<cache>/blocks/``, keyed by a digest of the stored blocks, their types
and shapes, the new type and gguf-py's version: a second load reads them back in well under a
second.  Only types that the native kernel computes and gguf-py can write are offered
(``REQUANT_TYPES``).
"""

from __future__ import annotations

import hashlib

import torch

from .._cache import cache_root
from ..fileio import atomic_path
from .blocks import block_type, decode_rows, quantize_rows
from .layers import CONTRACT, GGUFLinear, group_siblings

__all__ = ["REQUANT_TYPES", "requant_type", "requantize_linears"]

# GGML types a model may be requantised to: block_matmul computes them and gguf-py writes them
REQUANT_TYPES = {"q4_1": 3, "q5_0": 6, "q8_0": 8}


def requant_type(name: str, who: str = "requantize") -> int:
    """The GGML type number of ``name`` (``q4_1``, ``q5_0``, ``q8_0``; any case); ValueError otherwise."""
    qtype = REQUANT_TYPES.get(str(name).lower())
    if qtype is None:
        raise ValueError(f"{who}: cannot recompute a model as {name!r} blocks; the types the native kernel computes "
                         f"and gguf-py writes are {', '.join(sorted(REQUANT_TYPES))}")
    return qtype


def _linears(model) -> list[tuple[str, GGUFLinear]]:
    return [(name, mod) for name, mod in model.named_modules() if isinstance(mod, GGUFLinear)]


def _cache_file(linears, qtype: int):
    import gguf  # optional: models extra

    h = hashlib.blake2b(digest_size=16)
    h.update(f"requant-v1 {qtype} {getattr(gguf, '__version__', '?')}".encode())
    for name, mod in linears:
        h.update(f"{name} {mod.qtype} {mod.out_features} {mod.in_features}".encode())
        h.update(mod.qweight.cpu().contiguous().numpy().tobytes())
    return cache_root() / "blocks" / f"{h.hexdigest()}-{block_type(qtype).name.lower()}.pt"


def requantize_linears(model, type_name: str, *, who: str = "requantize", use_cache: bool = True) -> int:
    """Recompute every ``GGUFLinear`` of ``model`` as ``type_name`` blocks, in place (module docstring);
    each keeps its contract (``gguf-exact-f32`` or ``gguf-q8``) and its siblings are formed again.
    Returns the layers changed.  ValueError for a model without GGUF layers (a float32 checkpoint:
    ``--weights float32``, or a model that is not GGUF-sourced) or a type not in ``REQUANT_TYPES``."""
    qtype = requant_type(type_name, who)
    linears = _linears(model)
    if not linears:
        raise ValueError(f"{who}: @{type_name} recomputes a model kept as GGUF blocks, and this one has no GGUF "
                         "layers (a float32 checkpoint, e.g. under --weights float32); drop the @ suffix")
    todo = [(name, mod) for name, mod in linears if mod.qtype != qtype]
    if not todo:
        return 0
    path = _cache_file(linears, qtype) if use_cache else None
    stored = None
    if path is not None and path.is_file():
        try:
            stored = torch.load(path, weights_only=True)
        except Exception:  # a damaged cache file is made again
            stored = None
    if not isinstance(stored, dict) or any(name not in stored for name, _ in todo):
        stored = {name: quantize_rows(decode_rows(mod.qweight, mod.qtype, mod.in_features), qtype)
                  for name, mod in todo}
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(path) as tmp:
                torch.save(stored, tmp)
    for name, mod in todo:
        numerics = mod.numerics
        mod.set_numerics(CONTRACT)  # drops a gguf-q8 packing of the old blocks (and the siblings' group)
        mod.qweight, mod.qtype = stored[name].contiguous(), qtype
        mod.set_numerics(numerics)  # packs the new blocks again where it computes under gguf-q8
    group_siblings(model)
    return len(todo)
