"""Acceptance by depth on held-out USER prompts (``train.json``'s ``user_prompt_eval_fp16``).

The held-out metrics of training (``objective.evaluate``) are teacher-forced on held-out prompts
of the training source; with self-written prompts they flatter the drafter (0.49 at depth 1 where
MT-Bench / HumanEval decoding accepts 0.27-0.35).  This evaluation uses what users ask: a fixed
set spread evenly over MT-Bench, HumanEval and ShareGPT's held-out tenth (``user_eval_prompts``),
none of which is ever trained on, with the target's greedy answers (``data.answer_prompts``).

Per answer position, the drafter is unrolled ``depth`` steps exactly as it drafts (``objective.unrolled``):
row s has the target's feature at s and the verified token s + 1; step d feeds the drafter's own
feature of step d - 1 and (teacher forcing) the true token s + d, and drafts token s + d + 1.  While
the drafts of steps 1..d-1 were accepted, the true tokens ARE the drafted ones, so step d is exactly
what decoding would draft.  Counting the rows s >= n_prompt - 1 (drafts of answer tokens) where
token s + d + 1 exists::

    accept@d = #(drafts 1..d all equal the target's greedy tokens) / #(drafts 1..d-1 all equal them)

the acceptance at depth d given the path so far was accepted, ``a_d(1)`` of ``decode.draft_shape.shape``
(which reads these figures for ``-k auto``).  ``reach@d`` is the unconditional fraction (all d
accepted) and ``mean_run`` = sum_d reach@d, the expected accepted drafts per round of a chain of
``depth``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..fileio import atomic_path, write_json
from ..prompts import Prompt, load_prompts
from .distill_data import answer_prompts
from .objective import unrolled

__all__ = ["USER_EVAL_SOURCES", "USER_EVAL_KEY", "user_eval_prompts", "acceptance_by_depth",
           "evaluate_on_user_prompts", "merge_into_train_json"]

USER_EVAL_SOURCES = ("mt-bench", "humaneval", "sharegpt")  # never trained on (data.heldout_texts)
USER_EVAL_KEY = "user_prompt_eval_fp16"  # of the written (fp16) file, as heldout_eval_fp16


def user_eval_prompts(n: int) -> list[Prompt]:
    """``n`` prompts spread over ``USER_EVAL_SOURCES`` (n // 3 each, the remainder to the first ones),
    evenly spaced through each set (MT-Bench is ordered by category): fixed, no randomness."""
    if n < 1:
        raise ValueError(f"--user-eval-prompts: expected an integer >= 1 (0 disables), got {n}")
    out = []
    for k, src in enumerate(USER_EVAL_SOURCES):
        m = n // len(USER_EVAL_SOURCES) + (k < n % len(USER_EVAL_SOURCES))
        if m == 0:
            continue
        ps = load_prompts(src)
        out += [ps[(i * len(ps)) // m] for i in range(min(m, len(ps)))]
    return out


@torch.no_grad()
def acceptance_by_depth(drafter, examples, depth: int) -> dict:
    """``accept@d``, ``reach@d`` (d = 1..depth), ``mean_run`` and ``positions`` (see the module docstring)."""
    was = drafter.training
    drafter.eval()
    dtype = drafter.dtype
    dev = drafter.device
    head_w = drafter.head_layer()  # what decoding computes (the target's blocks where it runs from them)
    tried = torch.zeros(depth + 1, dtype=torch.long)  # tried[d]: rows whose drafts 1..d-1 were accepted, d exists
    hit = torch.zeros(depth + 1, dtype=torch.long)  # hit[d]: ... and draft d was accepted too
    for e in examples:
        ids = torch.tensor([e["ids"]], device=dev)  # [1, T]
        T = ids.shape[1]
        if T < 3:
            continue
        feats = e["features"][None].to(dtype=dtype, device=dev)  # [1, T, H]
        lo = max(e["n_prompt"] - 1, 0)  # rows before lo draft prompt tokens: context only
        s = torch.arange(lo, T - 1, device=dev)
        alive = torch.ones_like(s, dtype=torch.bool)
        for d, red, tail, _, _ in unrolled(drafter, ids, feats, torch.tensor([T], device=dev), depth, head_w):
            exists = s + d + 1 <= T - 1
            draft = drafter.full_logits(red[0, lo:], tail[0, lo:]).argmax(-1)  # [T - 1 - lo]: what decoding drafts
            truth = ids[0, (s + d + 1).clamp(max=T - 1)]
            alive = alive & exists
            tried[d] += int(alive.sum())
            alive = alive & (draft == truth)
            hit[d] += int(alive.sum())
    drafter.train(was)
    out = {}
    reach_total = 0.0
    for d in range(1, depth + 1):
        out[f"accept@{d}"] = float(hit[d]) / float(tried[d]) if tried[d] else float("nan")
    rows = int(tried[1])  # answer positions with a next token: the rounds a chain could start at
    for d in range(1, depth + 1):
        out[f"reach@{d}"] = float(hit[d]) / rows if rows else float("nan")
        reach_total += out[f"reach@{d}"]
    out["mean_run"] = reach_total
    out["positions"] = rows
    return out


def _eval_examples(target, tok, prompts, max_new_tokens, cache: Path | None, log, progress):
    """The target's greedy answers (with features) to ``prompts``; cached in ``cache`` (a .pt file)."""
    key = {"ids": [p.id for p in prompts], "max_new_tokens": max_new_tokens,
           "target": str(getattr(target.config, "_name_or_path", "")), "vocab": int(target.config.vocab_size)}
    if cache is not None and cache.is_file():
        rec = torch.load(cache, weights_only=False)
        if rec.get("key") == key:
            return rec["examples"]
    t0 = time.perf_counter()
    examples = answer_prompts(target, tok, [p.text for p in prompts], max_new_tokens=max_new_tokens, batch=8,
                              log=log, progress=progress)
    log(f"user-prompt evaluation: answers to {len(prompts)} prompts in {time.perf_counter() - t0:.0f} s")
    if cache is not None:
        with atomic_path(cache) as tmp:
            torch.save({"key": key, "examples": examples}, tmp)
    return examples


def evaluate_on_user_prompts(target, tok, drafter, prompts=None, *, n: int = 24, depth: int = 6,
                             max_new_tokens: int = 128, cache=None, log=print, progress: bool = False) -> dict:
    """Acceptance by depth of ``drafter`` (an ``EagleDrafter`` for ``target``) on user prompts.

    ``prompts``: ``Prompt``s (default: ``user_eval_prompts(n)``).  ``cache``: a file keeping the
    target's answers between calls (they cost ~1.5 s per prompt on a 2-core CPU; the drafter's
    part is a second).  Returns ``acceptance_by_depth``'s dict plus ``prompts`` (count),
    ``sources`` and ``max_new_tokens``.
    """
    if depth < 1:
        raise ValueError(f"user-prompt evaluation depth: expected an integer >= 1, got {depth}")
    prompts = list(prompts) if prompts is not None else user_eval_prompts(n)
    examples = _eval_examples(target, tok, prompts, max_new_tokens, Path(cache) if cache else None, log, progress)
    out = acceptance_by_depth(drafter, examples, depth)
    out.update({"prompts": len(prompts), "sources": sorted({p.id.split("/")[0] for p in prompts}),
                "max_new_tokens": max_new_tokens})
    return out


def merge_into_train_json(out_dir, ev: dict, drafter_path=None) -> Path:
    """Write ``ev`` as ``USER_EVAL_KEY`` into ``out_dir/train.json`` (created if missing; other keys kept)."""
    path = Path(out_dir) / "train.json"
    rec = json.loads(path.read_text()) if path.is_file() else {}
    if not isinstance(rec, dict):
        raise ValueError(f"{path}: expected a JSON object")
    rec[USER_EVAL_KEY] = ev
    if drafter_path is not None and "file" not in rec:
        rec["file"] = str(drafter_path)
    write_json(path, rec)
    return path
