"""``draftcert.generate``: greedy speculative decoding inside transformers' ``generate``.

    out = model.generate(**inputs, custom_generate=draftcert.generate, drafter="prompt-lookup",
                         criterion="topm:2", max_new_tokens=64)

transformers (>= 4.57, ``MIN_TRANSFORMERS``) accepts a callable ``custom_generate``.  ``generate``
first does its own input preparation (generation config merged with the call's keywords, attention
mask, ``max_length = prompt + max_new_tokens``, stopping criteria built from it and from the EOS
ids), then calls::

    fn(model, input_ids, logits_processor=..., stopping_criteria=..., generation_config=...,
       **extra, **model_kwargs)

``extra`` holds the call's keywords that ``fn``'s signature names and ``GenerationMixin._sample``'s
does not (here ``drafter``, ``criterion``, ``k``, ``tree``, ``certificates``); ``model_kwargs``
holds the prepared model inputs (``attention_mask`` -- None when it is all ones --,
``position_ids``, a fresh cache, ...).  ``generate``'s own ``streamer`` and ``assistant_model``
parameters are *not* passed on (``_extract_generation_mode_kwargs`` replaces the dict that held
them); the prompt has already been put into the streamer.  ``held_back_arguments`` reads both from
the calling ``generate`` frame, so ``streamer=`` and ``assistant_model=`` work as with plain
``generate``.

Each row (left padding removed with the attention mask) is decoded from its own prompt: a batch
of one by ``decode.speculative_generate``, a larger batch by ``decode.batch_speculative_generate``
(one target pass per round for all rows, each row accepting its own number of tokens), or row
after row by ``speculative_generate`` when the drafter object given has no ``fork``.  The
acceptance rules and certificates are the engine's (docs/decoding.md); under ``strict`` every row
is exactly the model's greedy continuation.  ``generation_config``'s stopping criteria (max length, EOS, stop strings,
the caller's) are evaluated after every emitted token on the row as transformers sees it (left
padding included), as greedy ``generate`` does; a stopped row is padded on the right with
``pad_token_id`` up to the longest row.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import reduce

import torch
import transformers
from packaging.version import Version
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..decode import DecodeStats, batch_speculative_generate, make_drafter, speculative_generate
from ..drafting.make import DEFAULT_DRAFTER_TRAINED, DEFAULT_DRAFTER_UNTRAINED, FEATURE_K, MODEL_K
from ..models import DEFAULT_DRAFTER, PROMPT_LOOKUP, load_drafter

__all__ = ["generate", "DraftcertGenerateOutput", "MIN_TRANSFORMERS", "check_transformers", "default_drafter",
           "held_back_arguments"]

# 4.56 calls a callable custom_generate but rejects its extra keywords (drafter=, criterion=) as unused
# model kwargs; 4.57 passes them on (GenerationMixin._extract_generation_mode_kwargs), as 5.x does.
MIN_TRANSFORMERS = "4.57"

# Draft tokens per round when k is not given, as ``draftcert decode``: a feature drafter (the shipped
# default) is cheap but accepted at ~0.27 per token, so short chains pay best (docs/speed.md).

# Prepared model inputs of a decoder-only LM that the engine rebuilds itself (its own cache and
# positions, the mask read as which prompt tokens are real); any other model input (pixel values,
# token type ids, ...) would change the model's output and is refused.
_PREPARED = {"position_ids", "cache", "past_key_values", "use_cache", "logits_to_keep", "cache_position"}

_GREEDY = ("the acceptance rules and certificates of draftcert are defined for greedy decoding of the raw model "
           "logits (do_sample=False, num_beams=1, no logits processors or score outputs)")


@dataclass
class DraftcertGenerateOutput(GenerateDecoderOnlyOutput):
    """``generate(..., return_dict_in_generate=True)``'s output: transformers' decoder-only output
    (``sequences`` [B, prompt + new]; scores, logits, attentions, hidden states and cache stay None)
    plus the decode's statistics.

    ``draftcert_stats``: ``draftcert.decode.DecodeStats`` of the whole batch (the rows' counters added:
    ``.summary()``, ``.vllm_metrics()``, ``.mean_acceptance_length``, ``.certified_fraction``, ...);
    ``draftcert_row_stats``: one ``DecodeStats`` per row.
    """

    draftcert_stats: DecodeStats | None = None
    draftcert_row_stats: list[DecodeStats] | None = None


def check_transformers(version: str | None = None) -> None:
    """Raise RuntimeError when the installed transformers cannot call ``draftcert.generate``."""
    have = version if version is not None else transformers.__version__
    if Version(have) < Version(MIN_TRANSFORMERS):
        raise RuntimeError(
            f"draftcert.generate needs transformers >= {MIN_TRANSFORMERS} (a callable custom_generate that receives "
            f"its own keyword arguments); transformers {have} is installed. Upgrade it "
            f"(pip install -U 'transformers>={MIN_TRANSFORMERS}') or call draftcert.decode.speculative_generate."
        )


def held_back_arguments(depth: int = 2) -> dict:
    """``streamer`` and ``assistant_model`` of the transformers ``generate`` call that called us.

    transformers passes a callable ``custom_generate`` neither (module docstring); they are still
    locals of the calling ``generate`` frame.  ``depth`` counts frames up from this function's caller
    (``generate`` below is 1 frame under transformers' ``generate``).  Called directly, not from
    transformers' ``generate``, there is nothing held back: {}.
    """
    frame = sys._getframe(depth)
    code = frame.f_code
    if code.co_name != "generate" or "custom_generate" not in code.co_varnames:
        return {}
    names = ("streamer", "assistant_model")
    return {n: frame.f_locals.get(n) for n in names if frame.f_locals.get(n) is not None}


def default_drafter(model):
    """The drafter used when none is given, ``draftcert decode``'s default: the shipped feature drafter
    plus suffix-match candidates (``default+suffix``) when the feature drafter was trained for this
    model (the embedded SmolLM2-135M-Instruct: its fingerprint of the LM head and embedding
    matches), else suffix matching alone (``suffix``: prompt lookup over the prompt, the output and
    earlier outputs, with a draft length that follows the match), which needs no model and fits any
    target."""
    try:
        load_drafter(DEFAULT_DRAFTER, model, None)
    except ValueError:  # another target (architecture, sizes or weights differ): no trained drafter
        return DEFAULT_DRAFTER_UNTRAINED
    return DEFAULT_DRAFTER_TRAINED


def _refuse_non_greedy(gc, logits_processor) -> None:
    """One clear ValueError for any setting outside greedy decoding of the raw logits.  Sampling first, in
    words of its own: transformers turns ``do_sample=True`` into sampling warpers (top-k 50, ...), which are
    not the user's logits processors and must not be blamed."""
    if gc.do_sample:
        raise ValueError(
            "draftcert.generate: sampling (do_sample=True) is not supported: draftcert decodes greedily, with "
            "deterministic acceptance rules. Pass do_sample=False (with criterion='strict', the default, the output "
            "is exactly greedy generate's; a relaxed criterion such as 'topm:2' or 'entropy:0.09:0.3' accepts "
            "more drafts), or call model.generate without custom_generate to sample."
        )
    bad = []
    if (gc.num_beams or 1) > 1:
        bad.append(f"num_beams={gc.num_beams}")
    if (getattr(gc, "num_beam_groups", 1) or 1) > 1:
        bad.append(f"num_beam_groups={gc.num_beam_groups}")
    if (gc.num_return_sequences or 1) > 1:
        bad.append(f"num_return_sequences={gc.num_return_sequences}")
    if getattr(gc, "penalty_alpha", None):
        bad.append(f"penalty_alpha={gc.penalty_alpha} (contrastive search)")
    if getattr(gc, "dola_layers", None) is not None:
        bad.append(f"dola_layers={gc.dola_layers!r}")
    for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if getattr(gc, name, False):
            bad.append(f"{name}=True")
    if logits_processor:
        names = ", ".join(type(p).__name__ for p in logits_processor)
        bad.append(f"logits processors ({names}: from repetition_penalty, min_new_tokens, bad_words_ids, "
                   "logits_processor=, ...)")
    if bad:
        raise ValueError(
            f"draftcert.generate: {', '.join(bad)} is not supported: {_GREEDY}. Drop these settings, or call "
            "model.generate without custom_generate for sampling or beam search."
        )


def _refuse_model_inputs(model_kwargs: dict) -> None:
    other = sorted(k for k, v in model_kwargs.items() if k not in _PREPARED and v is not None)
    if other:
        raise ValueError(
            f"draftcert.generate: model inputs {other} are not supported; it decodes text-only decoder LMs from "
            "input_ids (and attention_mask). Pass only those, or call model.generate without custom_generate."
        )


def _eos_ids(gc) -> list[int]:
    eos = gc.eos_token_id
    if eos is None:
        return []
    if isinstance(eos, torch.Tensor):
        return [int(x) for x in eos.reshape(-1).tolist()]
    return [int(x) for x in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def _new_token_budget(gc, prompt_len: int) -> int:
    """New tokens allowed: transformers has set max_length = prompt + max_new_tokens already."""
    n = gc.max_length - prompt_len if gc.max_length is not None else gc.max_new_tokens  # None: a bare config
    if n is None or n < 1:
        raise ValueError(f"draftcert.generate: no room for new tokens (prompt of {prompt_len}, max_length "
                         f"{gc.max_length}); pass max_new_tokens=N")
    return int(n)


def _drafter_spec(model, drafter, assistant, gc):
    """(drafter, default k) from ``drafter=``, transformers' ``assistant_model=`` or
    ``prompt_lookup_num_tokens=``, else ``default_drafter``."""
    if drafter is not None and assistant is not None and drafter is not assistant:
        raise ValueError("draftcert.generate: both drafter= and assistant_model= are given; pass one of them")
    if drafter is not None:
        return drafter, None
    if assistant is not None:
        return assistant, None
    n = getattr(gc, "prompt_lookup_num_tokens", None)
    if n:
        return PROMPT_LOOKUP, int(n)  # transformers' prompt lookup: n tokens per round
    return default_drafter(model), None


def _rows(input_ids: torch.Tensor, attention_mask) -> list[list[int]]:
    """Each row's real tokens: the attention mask's zeros (left padding) dropped."""
    if attention_mask is None:
        return [r.tolist() for r in input_ids]
    return [r[m.bool()].tolist() for r, m in zip(input_ids, attention_mask)]


def _row_stop(prefix: list[int], stopping_criteria, streamer, device):
    """The engine's ``stop`` hook for one row: every new token is streamed, then transformers'
    stopping criteria are evaluated on prefix + new tokens so far ([1, len]), as greedy ``generate``
    does after each step; the first token that stops the row is kept, the rest dropped."""
    checked = 0

    def stop(new: list[int]) -> int | None:
        nonlocal checked
        while checked < len(new):
            checked += 1
            if streamer is not None:
                streamer.put(torch.tensor([new[checked - 1]]))
            if stopping_criteria:
                seq = torch.tensor([prefix + new[:checked]], dtype=torch.long, device=device)  # [1, len]
                if bool(stopping_criteria(seq, None).any()):
                    return checked
        return None

    return stop


def generate(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
             synced_gpus=False, streamer=None, *, drafter=None, criterion="strict", k=None, tree=None,
             certificates=True, **model_kwargs):
    """Greedy speculative decoding as a transformers ``custom_generate`` callable.

    Parameters (the first seven as transformers passes them; call through
    ``model.generate(..., custom_generate=draftcert.generate)``)
    ----------
    model : the target, a transformers causal LM.
    input_ids : [B, T] prompt ids, left-padded when rows differ in length (``attention_mask`` 0).
    model_kwargs : the prepared model inputs; ``attention_mask`` [B, T] (None: no padding) is read
        from here.  It is not a named parameter because transformers would then take the caller's
        mask out of the keywords it prepares (every name in this signature that ``_sample``'s lacks
        is handed over raw) and pass it twice.
    generation_config : max_new_tokens / max_length, eos_token_id (an id or a list), pad_token_id,
        ``prompt_lookup_num_tokens`` (prompt lookup, that many tokens per round),
        ``return_dict_in_generate``.  Sampling, beams, logits processors and score / logit /
        attention / hidden-state outputs raise ValueError (the rules are greedy).
    streamer : receives each emitted token (``put``), then ``end``; transformers puts the prompt.
    drafter : what ``draftcert decode --drafter`` takes (``default``, ``prompt-lookup``,
        ``self:skip=N``, ``self:quant=4``, ``eagle:NAME``, a path or hub id), a transformers causal LM
        sharing the target's vocabulary, or a draftcert drafter object.  transformers'
        ``assistant_model=`` is the same as passing that model here.  None: ``default_drafter``.
    criterion : acceptance rule spec (``strict``, ``additive:0.1``, ``topm:2``, ``tree:M``, ...).
    k : draft tokens per round (tree depth for ``tree:M``); default 1 with a feature drafter, else 4.
    tree : None (chain), ``(m, depth)`` or ``[w1, w2, ...]``, as ``speculative_generate``.
    certificates : compute the per-position certificates (``CertificateViolation`` if one fails).

    Returns ``sequences`` [B, T + new] (a row that stopped early padded on the right with
    ``pad_token_id``), or with ``return_dict_in_generate=True`` a ``DraftcertGenerateOutput``.
    """
    check_transformers()
    held = held_back_arguments()
    streamer = streamer if streamer is not None else held.get("streamer")
    gc = generation_config if generation_config is not None else model.generation_config
    _refuse_non_greedy(gc, logits_processor)
    attention_mask = model_kwargs.pop("attention_mask", None)  # [B, T]
    _refuse_model_inputs(model_kwargs)
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids: expected shape [batch, length], got {tuple(input_ids.shape)}")
    batch, prompt_len = input_ids.shape
    if streamer is not None and batch > 1:
        raise ValueError(f"draftcert.generate: a streamer needs batch size 1, got {batch} rows")
    budget = _new_token_budget(gc, prompt_len)
    eos = _eos_ids(gc)
    spec, k_default = _drafter_spec(model, drafter, held.get("assistant_model"), gc)
    draft_src = make_drafter(spec, model)  # one drafter object for every row (``start`` resets it)
    if k is None:
        k = k_default or (FEATURE_K if draft_src.needs_target_hidden else MODEL_K)

    rows = _rows(input_ids, attention_mask)
    stops = [_row_stop(padded, stopping_criteria, streamer, input_ids.device) for padded in input_ids.tolist()]
    run = _decode_batched if batch > 1 and draft_src.fork() is not None else _decode_one_by_one  # None: cannot fork
    new, row_stats, total = run(model, draft_src, rows, stops, criterion, k, tree, budget, eos, certificates)
    tokens = []
    for stop, t in zip(stops, new):
        keep = stop(t)  # a round ended by EOS is streamed and checked here (the engine calls stop only otherwise)
        tokens.append(t if keep is None else t[:keep])
    if streamer is not None:
        streamer.end()

    sequences = _assemble(input_ids, tokens, gc.pad_token_id, eos)
    if not gc.return_dict_in_generate:
        return sequences
    return DraftcertGenerateOutput(sequences=sequences, draftcert_stats=total, draftcert_row_stats=row_stats)


def _decode_batched(model, draft_src, rows, stops, criterion, k, tree, budget, eos, certificates):
    """Every row in one target pass per round (``batch_speculative_generate``; the drafter forked per row)."""
    res = batch_speculative_generate(model, draft_src, rows, criterion, k=k, tree=tree, max_new_tokens=budget,
                                     eos_token_id=eos, certificates=certificates,
                                     stop=lambda row, new: stops[row](new))
    return res.tokens, res.row_stats, res.stats


def _decode_one_by_one(model, draft_src, rows, stops, criterion, k, tree, budget, eos, certificates):
    """Row after row through ``speculative_generate`` (batch 1, or a drafter object without ``fork``)."""
    tokens, row_stats = [], []
    for prompt, stop in zip(rows, stops):
        res = speculative_generate(model, draft_src, prompt, criterion, k=k, tree=tree, max_new_tokens=budget,
                                   eos_token_id=eos, certificates=certificates, stop=stop)
        tokens.append(res.tokens)
        row_stats.append(res.stats)
    return tokens, row_stats, reduce(DecodeStats.merge, row_stats)


def _assemble(input_ids: torch.Tensor, tokens: list[list[int]], pad, eos: list[int]) -> torch.Tensor:
    """[B, T + longest row's new tokens]: rows that stopped earlier padded on the right."""
    width = max(len(t) for t in tokens)
    if pad is None and any(len(t) < width for t in tokens):
        if not eos:
            raise ValueError("draftcert.generate: rows ended at different lengths and there is no pad_token_id "
                             "to fill them; pass pad_token_id= (e.g. tokenizer.pad_token_id)")
        pad = eos[0]  # what transformers' greedy generate pads with when only EOS is set
    fill = 0 if pad is None else int(pad)
    new = torch.full((len(tokens), width), fill, dtype=input_ids.dtype)
    for b, t in enumerate(tokens):
        new[b, : len(t)] = torch.tensor(t, dtype=input_ids.dtype)
    return torch.cat([input_ids, new.to(input_ids.device)], dim=1)  # [B, T + width]
