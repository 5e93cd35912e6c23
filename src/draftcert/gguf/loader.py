"""A transformers causal LM built from a GGUF file, its linear weights kept as blocks.

:func:`load_gguf_causal_lm` builds the model as transformers' own GGUF loading does (config, names,
the llama q/k row permutation) but installs a ``GGUFLinear`` for every linear weight of a type with
a kernel (``blocks.KERNEL_TYPES``) and a ``GGUFEmbedding`` for such an input embedding; everything
else (norms, biases, weights of other types, with one line naming them) is dequantised at load.
Where the native kernel is unavailable every weight is dequantised (one line says why).
:func:`write_gguf_metadata` / :func:`load_gguf_folder`: a cached folder holding ``model.gguf`` and
the config and tokenizer parsed from it once.
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..kernels import block_matmul
from .blocks import KERNEL_TYPES, block_type, dequantize_gguf
from .layers import CONTRACT, CONTRACTS, GGUFEmbedding, GGUFLinear, group_siblings, row_invariant_attention
from .reader import read_gguf

__all__ = ["load_gguf_causal_lm", "write_gguf_metadata", "load_gguf_folder", "GGUF_FILE", "MARKER"]


@contextmanager
def _parameters_on_meta():
    """Inside: new module parameters are created on the meta device (no memory, no init), buffers
    as usual (rotary tables are computed in ``__init__``)."""
    orig = nn.Module.register_parameter

    def register(self, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        orig(self, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = orig


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"draftcert: {msg}", file=sys.stderr, flush=True)


def _row_order(processor, name: str, n: int) -> np.ndarray | None:
    """The row permutation transformers' tensor processor applies to GGUF tensor ``name`` (llama's
    q/k un-permutation), found by running it on the row numbers; None when it does more than
    reorder rows."""
    idx = np.arange(n, dtype=np.float64).reshape(n, 1)
    try:
        out = processor.process(weights=idx, name=name, tensor_key_mapping={}, parsed_parameters={"tensors": {}})
    except Exception:  # noqa: BLE001 - a processor that needs the real tensor: not a pure permutation
        return None
    w = np.asarray(out.weights)
    if out.name != name or w.shape != (n, 1) or not np.array_equal(np.sort(w[:, 0]), idx[:, 0]):
        return None
    return w[:, 0].astype(np.int64)


def _set_param(model: nn.Module, hf_name: str, value: torch.Tensor) -> None:
    mod_name, _, attr = hf_name.rpartition(".")
    mod = model.get_submodule(mod_name)
    old = getattr(mod, attr)
    if tuple(old.shape) != tuple(value.shape):
        raise ValueError(f"GGUF tensor for {hf_name} has shape {tuple(value.shape)}, the model expects {tuple(old.shape)}")
    mod._parameters[attr] = nn.Parameter(value.to(old.dtype), requires_grad=False)


def _hf_names(model: nn.Module, arch: str, processor) -> dict[str, str]:
    """{GGUF tensor name: transformers parameter name} for ``model`` (what transformers'
    ``get_gguf_hf_weights_map`` computes, with gguf-py's name map built once instead of per module)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map  # optional: models extra (gguf, transformers)
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    key = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
    if key is None:
        return get_gguf_hf_weights_map(model, processor)
    tmap = get_tensor_name_map(key, model.config.num_hidden_layers)
    out = {}
    for hf_name in model.state_dict():
        base, dot, suffix = processor.preprocess_name(hf_name).rpartition(".")
        if suffix not in ("weight", "bias"):
            base, dot, suffix = hf_name, "", ""
        g = tmap.get_name(base)
        if g is None and base.startswith("transformer."):  # named as in the base model (Bloom's BloomModel)
            g = tmap.get_name(base.removeprefix("transformer."))
        if g is not None:
            out[g + dot + suffix] = hf_name
        else:  # one-to-many names (mixture-of-experts weights merged from several GGUF tensors)
            processor.perform_fallback_tensor_mapping(out, dot + suffix, "", hf_name)
    return out


def load_gguf_causal_lm(gguf_path: str | Path, config, *, quiet: bool = False, numerics: str = CONTRACT):
    """A transformers causal LM from the GGUF file ``gguf_path``, linear weights kept as blocks.

    ``config``: its transformers config (``AutoConfig.from_pretrained(dir, gguf_file=name)``, or
    that saved once).  Returns the model (CPU, eval, no grad), with ``model.draftcert_gguf``
    recording the file, the quantised layers and their types.  ``numerics``: the contract its
    quantised layers compute under (``CONTRACTS``; ``"gguf-q8"``: 8-bit activations).
    """
    if numerics not in CONTRACTS:
        raise ValueError(f"numerics must be one of {', '.join(CONTRACTS)}, got {numerics!r}")
    from gguf import GGMLQuantizationType  # optional: models extra (gguf, transformers)
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    gguf_path = Path(gguf_path)
    meta, tensors = read_gguf(gguf_path)  # copy on write: the blocks stay in the mapped file
    arch = meta.get("general.architecture", "")
    native = block_matmul.LIBRARY.available()
    if not native:
        _log(f"GGUF linear weights dequantised to float32 at load (no native kernel: {block_matmul.LIBRARY.reason()})", quiet)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    name_map = _hf_names(model, arch, processor)
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    names = {id(m): n for n, m in model.named_modules()}
    emb = model.get_input_embeddings()
    emb_name = names.get(id(emb)) if type(emb) is nn.Embedding else None  # a subclass (scaled, ...) stays float32
    emb_blocks: tuple[torch.Tensor, int] | None = None  # the embedding table kept as blocks
    quantised: dict[str, tuple[torch.Tensor, int]] = {}  # hf module name -> (blocks, qtype)
    other_types: dict[str, int] = {}
    by_hf = {}
    f32 = int(GGMLQuantizationType.F32)  # the one type a linear weight keeps as it is (F16 and BF16 are converted)
    parsed: dict = {"tensors": {}}  # what a processor assembles from several GGUF tensors (merged experts)
    merging = type(processor).perform_fallback_tensor_mapping is not TensorProcessor.perform_fallback_tensor_mapping
    for t in tensors.values():
        hf = name_map.get(t.name)
        if hf is None and merging:  # an expert tensor: the processor puts it into its merged parameter
            res = processor.process(weights=dequantize_gguf(t.data, t.qtype).reshape(t.shape), name=t.name,
                                    tensor_key_mapping=name_map, parsed_parameters=parsed)
            if res.name is None:
                continue
        if hf is None:
            continue
        by_hf[hf] = t
        mod_name = hf.removesuffix(".weight")
        if emb_name is not None and hf == emb_name + ".weight" and native and t.qtype in KERNEL_TYPES \
                and t.shape == (emb.num_embeddings, emb.embedding_dim):
            order = _row_order(processor, t.name, emb.num_embeddings)
            if order is not None and np.array_equal(order, np.arange(emb.num_embeddings)):
                emb_blocks = (torch.from_numpy(t.data), t.qtype)
                continue
        if hf.endswith(".weight") and mod_name in linears:
            lin = linears[mod_name]
            if native and t.qtype in KERNEL_TYPES and t.shape == (lin.out_features, lin.in_features):
                order = _row_order(processor, t.name, lin.out_features)
                if order is not None:
                    same = np.array_equal(order, np.arange(lin.out_features))
                    quantised[mod_name] = (torch.from_numpy(t.data if same else t.data[order]), t.qtype)
                    continue
            if t.qtype != f32 and t.qtype not in KERNEL_TYPES:
                name = GGMLQuantizationType(t.qtype).name
                other_types[name] = other_types.get(name, 0) + 1
        w = dequantize_gguf(t.data, t.qtype).reshape(t.shape)
        res = processor.process(weights=w, name=t.name, tensor_key_mapping=name_map, parsed_parameters=parsed)
        if res.name is None:  # taken into a merged parameter (set below)
            continue
        _set_param(model, hf, torch.from_numpy(np.ascontiguousarray(res.weights, dtype=np.float32)))
    for hf, value in parsed["tensors"].items():
        _set_param(model, hf, torch.as_tensor(value, dtype=torch.float32))
    if native and other_types:
        _log("GGUF linear weights of types without a kernel dequantised to float32 at load: "
             + ", ".join(f"{k} ({v})" for k, v in sorted(other_types.items())), quiet)
    # an output layer tied to the embedding (no output.weight in the file) computes from the embedding's blocks
    head = model.get_output_embeddings()
    head_name = names.get(id(head)) if head is not None else None
    head_tie = None
    if head is not None and head_name not in quantised and head.weight.device.type == "meta" and emb_blocks is not None:
        quantised[head_name] = emb_blocks  # both from the embedding's blocks (one copy, the file's)
    elif head is not None and head_name not in quantised and head.weight.device.type == "meta" \
            and emb is not None and emb.weight.device.type != "meta":
        head_tie = emb.weight
        t = by_hf.get(names[id(emb)] + ".weight")
        if native and t is not None and t.qtype in KERNEL_TYPES and t.shape == tuple(head.weight.shape):
            quantised[head_name] = (torch.from_numpy(t.data), t.qtype)
        else:
            head.weight = head_tie  # tied, dequantised (no kernel for its type)
    for mod_name, (blocks, qtype) in quantised.items():
        lin = linears[mod_name]
        bias = lin.bias  # set from its GGUF tensor above
        if bias is not None and bias.device.type == "meta":
            raise ValueError(f"{gguf_path.name}: no GGUF tensor for {mod_name}.bias")
        layer = GGUFLinear(blocks, qtype, lin.in_features, lin.out_features, bias=bias,
                           tied=head_tie if mod_name == head_name else None, numerics=numerics)
        parent_name, _, attr = mod_name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, layer)
    if emb_blocks is not None:
        parent_name, _, attr = emb_name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr,
                GGUFEmbedding(emb_blocks[0], emb_blocks[1], emb.num_embeddings, emb.embedding_dim, emb.padding_idx))
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ValueError(f"{gguf_path.name}: no GGUF tensor for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    model.eval()
    model.requires_grad_(False)
    if quantised:
        row_invariant_attention(model, numerics)
        group_siblings(model)
    model.draftcert_gguf = {"file": gguf_path.name, "quantised_layers": len(quantised),
                            "types": sorted({block_type(q).name for _, q in quantised.values()}),
                            "embedding": block_type(emb_blocks[1]).name if emb_blocks is not None else "float32"}
    return model


# ----------------------------------------------------------------------------- cached GGUF models

GGUF_FILE = "model.gguf"
MARKER = "draftcert.json"  # written last: the directory is complete


def write_gguf_metadata(folder: Path, record: dict) -> None:
    """Next to ``folder/model.gguf``: the transformers config and tokenizer parsed from it (once:
    parsing a large vocabulary from GGUF metadata takes seconds) and the marker ``draftcert.json``."""
    from transformers import AutoConfig, AutoTokenizer  # optional: models extra

    folder = Path(folder)
    config = AutoConfig.from_pretrained(str(folder), gguf_file=GGUF_FILE)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF_FILE).save_pretrained(str(folder))
    (folder / MARKER).write_text(json.dumps({**record, "weights": "gguf"}, indent=2) + "\n")


def load_gguf_folder(folder: str | Path, *, quiet: bool = False, numerics: str = CONTRACT):
    """``(model, tokenizer)`` from a folder made by :func:`write_gguf_metadata` (GGUF blocks kept)."""
    from transformers import AutoConfig, AutoTokenizer  # optional: models extra

    folder = Path(folder)
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return load_gguf_causal_lm(folder / GGUF_FILE, config, quiet=quiet, numerics=numerics), tok
