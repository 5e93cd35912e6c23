"""``draftcert reproduce-paper``: the reference study's protocol, its published figures, and
runs of ours next to them.

The study: arXiv 2606.30265.  Its figures we compare against are ``PAPER_FIGURES`` (one place;
the docs quote them from here).

GPU protocol (``reproduce_paper``; our choice where the study leaves freedom):
  targets     Qwen/Qwen3-1.7B, Qwen/Qwen3-4B (no drafter: radii are properties of the target)
  prompts     HuggingFaceH4/ultrachat_200k, first 256 prompts (via draftcert.prompts.load_prompts)
  decoding    greedy, 128 new tokens, bfloat16, CUDA
  criteria    the profile defaults (strict, additive:0.1, multiplicative:0.5, topm:2, relaxed:2:0.1,
              entropy:0.09:0.3, mars:0.5, tree:2, tree:4, tree:8); epsilons 0.05, 0.1, 0.3, 0.5
Each target's run goes to OUT/<model name>/ and is resumable like any profile run.

CPU protocol on a named pair (``reproduce_pair``, e.g. the Qwen2.5-Coder 1.5B target drafted by
its 0.5B sibling): the same ``profile`` call on chat prompts (``sharegpt``, held-out ShareGPT
first turns, the nearest to the study's UltraChat) into OUT/chat and code prompts
(``humaneval``) into OUT/code; 4 prompts x 64 tokens per set by default, on the CPU.

The report of each run is the caller's (``on_run``; ``draftcert reproduce-paper`` writes it
there).  ``compare_runs`` reads finished runs (their ``summary.json`` and ``run.json``) and
sets them next to ``PAPER_FIGURES``, with the list of what differs from the study's protocol.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..certificates import DEFAULT_EPSILONS
from ..criteria import DEFAULT_CRITERIA
from ..models import PAIR_MODELS, get_pair
from ..prompts import DATASETS_INSTALL, datasets_missing
from ..textfit import compact_number, markdown_tables
from .run import ProfileResult, profile

PAPER_TARGETS = ("Qwen/Qwen3-1.7B", "Qwen/Qwen3-4B")
PAPER_PROMPTS = "HuggingFaceH4/ultrachat_200k"
PAPER_LIMIT = 256
PAPER_MAX_NEW_TOKENS = 128
PAPER_DTYPE = "bfloat16"
PAPER_DEVICE = "cuda"
PAPER_BATCH_SIZE = 32
MISSING_STATUS = 3

PAPER_ARXIV = "2606.30265"


@dataclass(frozen=True)
class PaperFigure:
    """One figure of a ``summary.json``, and the study's published value of it (None: the study
    gives none).  ``stat`` is a per-criterion key of summary.json (``radius_q05``,
    ``certified_length`` at ``eps``, ``accept_rate``, ...); ``spec`` None means a top-level
    drafter statistic (``drafter_kl_forward[stat]``)."""

    label: str
    spec: str | None
    stat: str
    eps: float | None = None
    study: str | None = None  # as published: "≈ 0.006", "0.53–0.66", "> 36"
    what: str = ""


# The study's published figures (arXiv 2606.30265; Qwen3-1.7B and Qwen3-4B as targets, UltraChat
# prompts, bfloat16 on GPUs), and the run figures shown next to them where it has none.
PAPER_FIGURES: tuple[PaperFigure, ...] = (
    PaperFigure("radius q05, strict", "strict", "radius_q05", study="≈ 0.006",
                what="5% quantile of the per-step acceptance radius (nats of KL(p‖q)) of strict greedy"),
    PaperFigure("radius q05, entropy:0.09:0.3", "entropy:0.09:0.3", "radius_q05", study="≈ 0.375",
                what="the same for Medusa's entropy-adaptive rule (epsilon 0.09, delta 0.3)"),
    PaperFigure("radius q05, tree:8", "tree:8", "radius_q05", study="0.53–0.66",
                what="the same for a tree with 8 children per node (the range spans the two targets)"),
    PaperFigure("certified length @ 0.3, strict", "strict", "certified_length", eps=0.3, study="≈ 2.9",
                what="mean run of consecutive steps whose radius is >= 0.3 nats, strict greedy"),
    PaperFigure("certified length @ 0.3, tree:8", "tree:8", "certified_length", eps=0.3, study="> 36",
                what="the same for tree:8"),
    PaperFigure("accept rate, strict", "strict", "accept_rate", what="the run's drafter: accepted proposals, strict"),
    PaperFigure("certified rate, strict", "strict", "certified_rate",
                what="the run's drafter: proposals with KL(p‖q) < radius, strict"),
    PaperFigure("accept rate, tree:8", "tree:8", "accept_rate", what="the run's drafter: accepted, tree:8"),
    PaperFigure("certified rate, tree:8", "tree:8", "certified_rate", what="the run's drafter: certified, tree:8"),
    PaperFigure("drafter KL(p‖q) median", None, "median", what="the run's drafter: its actual divergence per step"),
)
NO_FIGURE = "—"  # the study (or a run) has no such figure

# What the study's figures were measured with, for the "what differs" list (the prompt count
# and length are reproduce-paper's GPU protocol, which the study's setup leaves to us).
PAPER_SETUP = {
    "target": ", ".join(PAPER_TARGETS),
    "drafter": "none in these figures (radii and certified lengths are properties of the target)",
    "prompts": "UltraChat (HuggingFaceH4/ultrachat_200k) chat prompts",
    "precision": PAPER_DTYPE,
    "device": "CUDA GPU",
    "size": f"{PAPER_LIMIT} prompts x {PAPER_MAX_NEW_TOKENS} tokens per target (the GPU protocol)",
}
# Built-in prompt sets and model names said in words (a path or hub id speaks for itself).
_PROMPT_WORDS = {
    "sharegpt": "ShareGPT V3 first human turns, held-out tenth (chat)",
    "humaneval": "HumanEval problems (code)",
    "mt-bench": "MT-Bench first turns (chat)",
}
_EMBEDDED_WORDS = "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised)"

# The CPU protocol on a named pair: (sub-directory, prompt set), and its size per set.
PAIR_SETS = (("chat", "sharegpt"), ("code", "humaneval"))
PAIR_LIMIT = 4
PAIR_MAX_NEW_TOKENS = 64
PAIR_BATCH_SIZE = 8


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
    if datasets_missing():  # the prompts load through it; no extra of draftcert installs it
        missing.append(f"the `datasets` package, which loads {dataset}: not installed ({DATASETS_INSTALL})")
    return missing


def reproduce_paper(out="draftcert-paper", *, limit=PAPER_LIMIT, max_new_tokens=PAPER_MAX_NEW_TOKENS,
                    batch_size=PAPER_BATCH_SIZE, check_only=False, targets=PAPER_TARGETS, dataset=PAPER_PROMPTS,
                    on_run: Callable[[ProfileResult], None] | None = None) -> int:
    """Run the protocol; returns a process exit status (0 ok, 1 soundness/run failure, 3 missing requirements).

    ``on_run(result)`` follows each target's finished run (the CLI writes its report there)."""
    missing = check_requirements(targets, dataset)
    if missing:
        print("reproduce-paper: cannot run the reference protocol here; missing:", file=sys.stderr)
        for line in missing:
            print(f"  - {line}", file=sys.stderr)
        print("Provide these (a CUDA GPU, HF hub access or a pre-filled HF cache with HF_HOME, the packages "
              "named) and rerun; "
              "`draftcert profile` runs the same measurement on any model and prompt set.", file=sys.stderr)
        return MISSING_STATUS
    if check_only:
        print("reproduce-paper: all requirements present (GPU, models, dataset, the datasets package)")
        return 0
    status = 0
    for target in targets:
        sub = Path(out) / target.split("/")[-1]
        print(f"reproduce-paper: {target} -> {sub}")
        try:
            res = profile(target, None, dataset, out=sub, limit=limit, max_new_tokens=max_new_tokens,
                          criteria=DEFAULT_CRITERIA, epsilons=DEFAULT_EPSILONS, batch_size=batch_size,
                          device=PAPER_DEVICE, dtype=PAPER_DTYPE)
        except ValueError as exc:  # e.g. the dataset vanished between the check and the load
            print(f"reproduce-paper: {target}: {exc}", file=sys.stderr)
            status = 1
            continue
        print(f"reproduce-paper: {target}: {res.prompts} prompts, {res.steps} steps, "
              f"{res.nonfinite_steps} non-finite steps")
        if on_run is not None:
            on_run(res)
    return status


def reproduce_pair(pair: str, out, *, limit=PAIR_LIMIT, max_new_tokens=PAIR_MAX_NEW_TOKENS,
                   batch_size=PAIR_BATCH_SIZE, on_run: Callable[[ProfileResult], None] | None = None,
                   ) -> list[ProfileResult]:
    """The CPU protocol on the named pair (``models.PAIRS``): ``profile`` on each of ``PAIR_SETS``
    into OUT/<set>/ with the default criteria and epsilons, resumable like any profile run; the
    pair's own compute dtype (``models.PAIR_DTYPE``).  ``on_run(result)`` follows each finished
    run.  Returns the runs' results (their ``out_dir`` for ``compare_runs``)."""
    p = get_pair(pair)
    results = []
    for sub, prompts in PAIR_SETS:
        run_dir = Path(out) / sub
        print(f"reproduce-paper: {p.name} ({p.target} drafted by {p.drafter}) on {prompts} -> {run_dir}")
        res = profile(p.target, p.drafter, prompts, out=run_dir, limit=limit, max_new_tokens=max_new_tokens,
                      criteria=DEFAULT_CRITERIA, epsilons=DEFAULT_EPSILONS, batch_size=batch_size, device="cpu")
        print(f"reproduce-paper: {p.name} on {prompts}: {res.prompts} prompts, {res.steps} steps, "
              f"{res.soundness_violations} soundness violations")
        if on_run is not None:
            on_run(res)
        results.append(res)
    return results


# ----------------------------------------------------------------------------- comparison


@dataclass(frozen=True)
class RunFigures:
    """A finished profile run as the comparison reads it: ``summary.json`` and ``run.json``
    (empty when absent)."""

    path: Path
    summary: dict
    run: dict

    def figure(self, f: PaperFigure) -> float | None:
        """The run's value of ``f``; None where the run has none (criterion, epsilon or drafter
        not in the run).  summary.json writes +inf as null: a null radius quantile or drafter KL
        over at least one step is +inf (``report.run_summary``'s rule)."""
        if f.spec is None:
            d = self.summary.get("drafter_kl_forward")
            steps = self.summary.get("drafter_steps") or 0
        else:
            d = self.summary.get(f.spec)
            steps = self.summary.get("finite_steps") or 0
        if not isinstance(d, dict) or f.stat not in d:
            return None
        x = d[f.stat]
        if f.eps is not None:
            x = x.get(f"{f.eps:g}") if isinstance(x, dict) else None
            return None if x is None else float(x)
        if x is None:
            return math.inf if steps and (f.stat.startswith("radius_") or f.spec is None) else None
        return float(x)


def read_run(path) -> RunFigures:
    """A profile run directory's figures; ValueError naming the directory and the fix when it
    is not a finished, reported ``draftcert profile`` run."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"compare: {path} is not a directory; pass the --out directory of a `draftcert profile` "
                         "or `draftcert reproduce-paper --pair` run")
    summ = path / "summary.json"
    if not summ.is_file():
        hint = (f"run `draftcert report {path}` to write it" if (path / "run.json").is_file()
                else "is it the --out directory of a `draftcert profile` run?")
        raise ValueError(f"compare: {path} has no summary.json; {hint}")
    try:
        summary = json.loads(summ.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"compare: {summ} is unreadable ({exc}); run `draftcert report {path}` to rewrite it") from None
    if not isinstance(summary, dict) or not isinstance(summary.get("criteria"), list):
        raise ValueError(f"compare: {summ} is not a draftcert profile summary (no \"criteria\" list); "
                         f"run `draftcert report {path}` to rewrite it")
    run: dict = {}
    if (path / "run.json").is_file():
        try:
            run = json.loads((path / "run.json").read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"compare: {path / 'run.json'} is unreadable ({exc})") from None
        if not isinstance(run, dict):
            raise ValueError(f"compare: {path / 'run.json'} is not a draftcert run record (not a JSON object)")
    return RunFigures(path, summary, run)


def _model_words(spec) -> str:
    if spec is None:
        return "none"
    if spec == "embedded":
        return f"embedded {_EMBEDDED_WORDS}"
    if spec in PAIR_MODELS:
        return f"{spec} = {PAIR_MODELS[spec].title}"
    return str(spec)


def run_setup(r: RunFigures) -> dict[str, str]:
    """A run's setup in ``PAPER_SETUP``'s terms (``unknown`` where run.json does not say)."""
    run, s = r.run, r.summary
    models = s.get("models") or {}
    target = run.get("target", models.get("target"))
    drafter = run.get("drafter", models.get("drafter"))
    prompts = run.get("prompts")
    dtype = run.get("model_dtype") or (run.get("settings") or {}).get("dtype")
    tokens = run.get("max_new_tokens")
    return {
        "target": _model_words(target) if target is not None else "unknown",
        "drafter": _model_words(drafter) if run or "drafter" in models else "unknown",
        "prompts": (f"{prompts}: {_PROMPT_WORDS[prompts]}" if prompts in _PROMPT_WORDS else str(prompts))
                   if prompts is not None else "unknown",
        "precision": str(dtype) if dtype is not None else "unknown",
        "device": str(run.get("device", "unknown")),
        "size": (f"{s.get('prompts', '?')} prompts x {tokens if tokens is not None else '?'} tokens "
                 f"({s.get('steps', '?')} steps)"),
    }


def _same(key: str, ours: str) -> bool:
    """Whether a run's setup item matches the study's (a CUDA device of any index counts)."""
    if key == "device":
        return ours.startswith("cuda")
    if key == "precision":
        return ours == PAPER_DTYPE
    if key == "target":
        return ours in PAPER_TARGETS
    if key == "drafter":
        return ours == "none"
    if key == "prompts":
        return ours.startswith("HuggingFaceH4/ultrachat_200k")
    return False  # size: the study's own counts are not ours to match


def differences(r: RunFigures) -> list[str]:
    """What differs between a run's setup and the study's, one line each."""
    lines = []
    for key, ours in run_setup(r).items():
        if key == "size" or not _same(key, ours):
            lines.append(f"{key}: {ours}; study: {PAPER_SETUP[key]}")
    status = r.run.get("status")
    if not r.run:
        lines.append("run.json missing: the setup above is partly unknown")
    elif status not in (None, "complete"):
        lines.append(f"status: {status} (the run is not complete; its figures cover the steps traced so far)")
    return lines


def _labels(runs: Sequence[RunFigures]) -> list[str]:
    """Column titles: each directory's name, or the path as given when names repeat."""
    names = [r.path.name or str(r.path) for r in runs]
    return names if len(set(names)) == len(names) else [str(r.path) for r in runs]


def compare_table(runs: Sequence[RunFigures], width: int | None = None) -> str:
    """``PAPER_FIGURES``: the study's value next to each run's (markdown).  When one table would
    be wider than ``width`` (None: never), one table per run, each with the study's column."""
    labels = _labels(runs)
    values = [[NO_FIGURE if v is None else compact_number(v) for v in map(r.figure, PAPER_FIGURES)] for r in runs]

    def table(cols: Sequence[int]) -> str:
        head = ["figure", "study", *(labels[i] for i in cols)]
        rows = [[f.label, f.study or NO_FIGURE, *(values[i][k] for i in cols)] for k, f in enumerate(PAPER_FIGURES)]
        return markdown_tables(head, rows, None)

    text = table(range(len(runs)))
    if width is None or max(map(len, text.splitlines())) <= width or len(runs) == 1:
        return text
    return "\n\n".join(table([i]) for i in range(len(runs)))


def compare_runs(run_dirs: Sequence, width: int | None = None) -> str:
    """The side-by-side table of ``run_dirs`` against the study, and what differs for each run."""
    if not run_dirs:
        raise ValueError("compare: no run directory given")
    runs = [read_run(d) for d in run_dirs]
    out = [f"Against the reference study (\"study\": its published figures, arXiv {PAPER_ARXIV}; "
           f"{PAPER_SETUP['target']}, {PAPER_SETUP['prompts']}, {PAPER_DTYPE} on a GPU):", "",
           compare_table(runs, width), "",
           f"{NO_FIGURE}: no such figure (the study publishes none; or the run lacks the criterion, "
           "the epsilon or a drafter).", "", "What differs from the study's setup:"]
    for label, r in zip(_labels(runs), runs):
        out.append(f"{label} ({r.path}):")
        out += [f"  - {line}" for line in differences(r)]
    return "\n".join(out)
