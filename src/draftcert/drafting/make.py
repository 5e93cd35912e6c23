"""``make_drafter``: a drafter object from whatever a caller passes, and the engine's default drafters.

A spec string (the CLI's ``--drafter``) is parsed by ``models.parse_drafter_spec`` and built here;
a transformers causal LM becomes a ``ModelDrafter``, a feature-drafter network a ``FeatureDrafter``
(bound to its target), and a user's drafter object is declared once (``protocol.DeclaredDrafter``).
"""

from __future__ import annotations

import os

import torch

from ..models import load_drafter, parse_drafter_spec
from ..models.eagle import EagleDrafter
from .draft_vocab import DraftVocabulary, shipped_vocab
from .feature_drafter import FeatureDrafter
from .model_drafter import ModelDrafter
from .prompt_lookup import PromptLookupDrafter
from .protocol import DeclaredDrafter, Drafter
from .suffix import HybridDrafter, SuffixDrafter

__all__ = ["make_drafter", "as_drafter", "DEFAULT_DRAFTER_TRAINED", "DEFAULT_DRAFTER_UNTRAINED", "FEATURE_K", "MODEL_K"]

# Defaults of ``draftcert decode`` and ``draftcert.generate``: the drafter measured fastest against the target
# alone on held-out prompts (benchmarks/bench_suffix.py compares them; docs/decoding.md has its table).
# "trained": the target has a shipped feature drafter (the embedded SmolLM2); "untrained": any other target.
DEFAULT_DRAFTER_TRAINED, DEFAULT_DRAFTER_UNTRAINED = "default+suffix", "suffix"
# Fixed draft lengths (``bench``, ``-k`` omitted outside ``decode``): a feature drafter is cheap but rarely accepted
# past its first token on held-out prompts (models/weights/train.json), so its best chain is short; other drafters: 4.
FEATURE_K, MODEL_K = 1, 4


def make_drafter(drafter, target=None, tokenizer=None, *, dtype=None, draft_vocab=None):
    """A drafter object from whatever the caller passed.

    A spec string (or path) is resolved by ``models.parse_drafter_spec``, exactly as the CLI's
    ``--drafter``: ``default`` (the shipped feature drafter of the embedded target),
    ``prompt-lookup`` / ``pld`` (optionally ``:MAX_NGRAM``) -> PromptLookupDrafter; ``suffix`` ->
    ``suffix.SuffixDrafter``; ``DRAFTER+suffix`` -> ``suffix.HybridDrafter`` around DRAFTER; ``self:skip=N``,
    ``self:quant=4``, ``eagle:NAME``, a drafter file, a hub id or a path -> ``models.load_drafter``.
    A transformers model -> ModelDrafter; a feature drafter model -> FeatureDrafter (bound to
    ``target``); an object with ``start``/``propose`` is used as-is.  ``dtype``: the compute dtype of
    a drafter model loaded from a spec (``models.load_drafter``'s; None: its loader's default).
    ``draft_vocab``: a causal-LM drafter's draft vocabulary (``ModelDrafter``'s ``vocab``,
    ``draft_vocab.py``): an int N (the first N token ids), a token map file's path or a
    ``DraftVocabulary``, or ``"all"`` (every token); None: a preset drafter loaded from a spec gets its
    shipped token map (``draft_vocab.SHIPPED``), any other the whole vocabulary.  ValueError for a
    drafter without an output layer of its own.

    A drafter built from a spec string keeps it as ``.spec``, in its canonical form (``default`` ->
    ``eagle:smollm2-135m-instruct``): ``speculative_generate(..., drafter=obj, k="auto")`` then starts
    from that drafter's shipped acceptance and its cost curve, as with the string.
    """
    if draft_vocab is not None:
        made = make_drafter(drafter, target, tokenizer, dtype=dtype)
        inner = made.model_drafter
        if not isinstance(inner, ModelDrafter):
            raise ValueError(f"draft vocabulary: only a causal-LM drafter computes part of its output layer; "
                             f"this drafter is a {type(inner or made).__name__} (drop --draft-vocab)")
        if isinstance(draft_vocab, (str, os.PathLike)) and str(draft_vocab) != "all":
            draft_vocab = DraftVocabulary.load(draft_vocab)
        inner.vocab = ModelDrafter.checked_vocab(inner.model, None if draft_vocab == "all" else draft_vocab)
        return made
    if isinstance(drafter, Drafter) or (hasattr(drafter, "propose") and hasattr(drafter, "start")):
        return as_drafter(drafter)  # a drafter object: ours as it is, a user's declared once
    if isinstance(drafter, (str, os.PathLike)):
        spec = parse_drafter_spec(drafter)
        if spec.kind == "prompt-lookup":
            made = PromptLookupDrafter() if spec.max_ngram is None else PromptLookupDrafter(max_ngram=spec.max_ngram)
        elif spec.kind == "suffix":
            made = SuffixDrafter()
        elif target is None:
            raise ValueError(f"drafter {spec.spec!r}: loading it needs the target model (make_drafter(spec, target, tokenizer))")
        else:
            model = _wrap_model(load_drafter(spec.model_spec, target, tokenizer, dtype=dtype), target,
                                shipped_vocab(spec.source))  # a requantised preset (NAME@q4_1) keeps its token map
            made = HybridDrafter(model) if spec.suffix else model
        # the object remembers its spec: -k auto reads the shipped acceptance and keys its cost curve by it
        # (decode.engine.auto_draft) when the object is passed, not the string (built once, decoded with often)
        made.spec = spec.spec
        return made
    if isinstance(drafter, torch.nn.Module) and (hasattr(drafter, "config") or hasattr(drafter, "vocab_ids")):
        return _wrap_model(drafter, target)
    raise ValueError(
        "drafter: expected a spec string (default, self:skip=N, self:quant=4, prompt-lookup, eagle:NAME, a path or "
        "hub id), a transformers causal LM or a drafter object with start/propose/accept; "
        f"got {type(drafter).__name__}"
    )


def _wrap_model(model, target, vocab: DraftVocabulary | None = None):
    """A feature drafter (``models.eagle.EagleDrafter``, bound to ``target``) or a plain causal LM (over
    ``vocab``, its draft vocabulary: None for all tokens)."""
    if isinstance(model, EagleDrafter):
        if target is not None:
            model.bind(target)  # ValueError if it was trained for another target
        return FeatureDrafter(model)
    return ModelDrafter(model, vocab)


def as_drafter(obj) -> Drafter:
    """``obj`` as a :class:`protocol.Drafter`: one of ours as it is, a user's object with
    ``start``/``propose``/``accept`` declared by ``DeclaredDrafter`` (its optional parts read once)."""
    if Drafter in type(obj).__mro__:
        return obj
    return DeclaredDrafter(obj)
