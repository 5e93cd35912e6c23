"""``draftcert reproduce-paper``: the reference study's protocol, or an exact list of what is missing.

Protocol (our choice where the study leaves freedom):
  targets     Qwen/Qwen3-1.7B, Qwen/Qwen3-4B (no drafter: radii are properties of the target)
  prompts     HuggingFaceH4/ultrachat_200k, first 256 prompts (via draftcert.prompts.load_prompts)
  decoding    greedy, 128 new tokens, bfloat16, CUDA
  criteria    the profile defaults (strict, additive:0.1, multiplicative:0.5, topm:2,
              entropy:0.09:0.3, mars:0.5, tree:2, tree:4, tree:8); epsilons 0.05, 0.1, 0.3, 0.5
Each target's run goes to OUT/<model name>/ and is resumable like any profile run.  The report
of each run is the caller's (``on_run``; ``draftcert reproduce-paper`` writes it there).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch

from ..certificates import DEFAULT_EPSILONS
from ..criteria import DEFAULT_CRITERIA
from .run import ProfileResult, profile

PAPER_TARGETS = ("Qwen/Qwen3-1.7B", "Qwen/Qwen3-4B")
PAPER_PROMPTS = "HuggingFaceH4/ultrachat_200k"
PAPER_LIMIT = 256
PAPER_MAX_NEW_TOKENS = 128
MISSING_STATUS = 3


def _hub_reachable(repo_id: str, repo_type: str) -> tuple[bool, str]:
    """Cached locally, or the hub answers for this repository."""
    try:
        from huggingface_hub import HfApi, try_to_load_from_cache  # optional: comes with transformers (models extra)
    except ImportError:
        return False, "huggingface_hub is not installed (pip install huggingface_hub)"
    probe = "config.json" if repo_type == "model" else "README.md"
    try:
        cached = try_to_load_from_cache(repo_id, probe, repo_type=repo_type)
        if isinstance(cached, str):
            return True, "in the local cache"
    except Exception:
        pass
    try:
        api = HfApi()
        (api.model_info if repo_type == "model" else api.dataset_info)(repo_id, timeout=15)
        return True, "reachable"
    except Exception as exc:
        return False, f"not in the local cache and the hub did not answer ({type(exc).__name__}: {str(exc)[:160]})"


def check_requirements(targets=PAPER_TARGETS, dataset=PAPER_PROMPTS) -> list[str]:
    """Everything the protocol needs that this machine lacks, one line each (empty: ready)."""
    missing = []
    if not torch.cuda.is_available():
        missing.append(f"GPU: no CUDA device visible to torch {torch.__version__} (torch.cuda.is_available() is False)")
    for m in targets:
        ok, why = _hub_reachable(m, "model")
        if not ok:
            missing.append(f"hub access to model {m}: {why}")
    ok, why = _hub_reachable(dataset, "dataset")
    if not ok:
        missing.append(f"dataset {dataset}: {why}")
    return missing


def reproduce_paper(out="draftcert-paper", *, limit=PAPER_LIMIT, max_new_tokens=PAPER_MAX_NEW_TOKENS,
                    batch_size=32, check_only=False, targets=PAPER_TARGETS, dataset=PAPER_PROMPTS,
                    on_run: Callable[[ProfileResult], None] | None = None) -> int:
    """Run the protocol; returns a process exit status (0 ok, 1 soundness/run failure, 3 missing requirements).

    ``on_run(result)`` follows each target's finished run (the CLI writes its report there)."""
    missing = check_requirements(targets, dataset)
    if missing:
        print("reproduce-paper: cannot run the reference protocol here; missing:", file=sys.stderr)
        for line in missing:
            print(f"  - {line}", file=sys.stderr)
        print("Provide these (a CUDA GPU, HF hub access or a pre-filled HF cache with HF_HOME) and rerun; "
              "`draftcert profile` runs the same measurement on any model and prompt set.", file=sys.stderr)
        return MISSING_STATUS
    if check_only:
        print("reproduce-paper: all requirements present (GPU, models, dataset)")
        return 0
    status = 0
    for target in targets:
        sub = Path(out) / target.split("/")[-1]
        print(f"reproduce-paper: {target} -> {sub}")
        try:
            res = profile(target, None, dataset, out=sub, limit=limit, max_new_tokens=max_new_tokens,
                          criteria=DEFAULT_CRITERIA, epsilons=DEFAULT_EPSILONS, batch_size=batch_size,
                          device="cuda", dtype="bfloat16")
        except ValueError as exc:  # e.g. the dataset vanished between the check and the load
            print(f"reproduce-paper: {target}: {exc}", file=sys.stderr)
            status = 1
            continue
        print(f"reproduce-paper: {target}: {res.prompts} prompts, {res.steps} steps, "
              f"{res.nonfinite_steps} non-finite steps")
        if on_run is not None:
            on_run(res)
    return status
