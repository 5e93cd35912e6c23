"""The evaluation run: every problem decoded under every rule, scored, each result written atomically.

``run_evaluation(target, tokenizer, drafter, problems, specs, out_dir, ...)`` goes problem by problem;
for each it decodes under ``strict`` first (the control: the target's greedy completion), then under
every other rule (``decode.engine.speculative_generate``; ``tree:M`` drafts a width-M tree of depth
k), scores each completion (``score``) and writes ``out_dir/results/<rule>/<problem>.json``.
A rerun skips every result already written (resume; ``rescore`` scores their completions again), so an
interrupted run continues where it stopped; ``evaluate.json`` records the settings that make results comparable (target, drafter, k,
length limit, the stop, task, numerics) and a rerun with other settings is refused.

Every decode (the target alone's too) ends at EOS, the length limit, or where ``stopping.CodeBlockStop``
fires: right after the fence line that closes the code block the scored code is taken from (the
verdict is then the one the full completion would get; ``stop=False``: no stop).  A result's
``emitted``, ``tokens_per_forward`` and ``tokens_per_second`` count the tokens kept;
``decoded_tokens`` the tokens the rounds emitted (a stopped round is counted whole there and in the
drift and certificate counters), ``stopped`` whether the stop fired.  With ``baseline``, the
target's own greedy decoding (``engine.greedy_generate``) is run too and strict's tokens are checked
against it bit for bit by the report (``scoreboard``: ``baseline_match``; its tokens/s are the speedup's
reference).

Each scored program is saved as ``out_dir/programs/<rule>/<problem>.py``: ``python -I -S FILE`` gives
the same verdict by hand (it passes when it exits 0 with ``executor.PASS_MARKER`` as its last line).

Where a rule's completion differs from strict's, ``first_drift`` describes the first step where the
rule accepted a token that is not the target's greedy token (both completions agree before it, so
strict's token there is greedy's): the step, both tokens, the target's top-2 logit margin and the
rule's radius at that step (one prefill of the prompt and the common prefix), and the text on either
side.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Callable

import torch

from ..certificates import radius
from ..criteria import TreeCoverage, parse_criterion
from ..decode.engine import greedy_generate, speculative_generate
from ..fileio import atomic_write, settings_changes, write_json
from ..models.hf import model_forward, new_cache
from ..prompts import encode_prompt
from .executor import Limits, run_program
from .programs import answer_matches, humaneval_program, tests_program
from .stopping import STOP_RULE, stop_for
from .tasks import Problem

__all__ = ["run_evaluation", "slug", "SETTINGS_FILE", "RESULTS_DIR", "PROGRAMS_DIR", "GREEDY", "CONTROL",
           "read_results", "first_drift", "TEXT_CONTEXT"]

SETTINGS_FILE = "evaluate.json"
RESULTS_DIR = "results"
PROGRAMS_DIR = "programs"
GREEDY = "greedy"  # the target alone (--baseline): results/greedy/
CONTROL = "strict"
TEXT_CONTEXT = 160  # characters of text shown on either side of a first drift
# the settings a folder's results depend on: a rerun that changes one is refused
RESULT_KEYS = ("task", "target", "drafter", "k", "max_new_tokens", "stop", "model_dtype", "draft_vocab", "timeout",
               "memory_bytes")
# the DecodeStats.summary() figures kept per result (their names in decode --json)
KEPT = ("emitted", "target_forwards", "tokens_per_forward", "seconds", "tokens_per_second", "drift", "drift_tokens",
        "divergence_spent", "certified_fraction", "certified_positions", "checked_positions", "num_drafts",
        "num_draft_tokens", "num_accepted_tokens", "mean_acceptance_length", "draft_acceptance_rate")


def slug(name: str) -> str:
    """A file name for a rule or problem id: ``relaxed:2:0.1`` -> ``relaxed_2_0.1``, ``humaneval/0`` -> ``humaneval_0``."""
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", name)


def _result_path(out: Path, spec: str, pid: str) -> Path:
    return out / RESULTS_DIR / slug(spec) / f"{slug(pid)}.json"


def check_settings(out: Path, settings: dict) -> dict:
    """Create ``evaluate.json`` or check it against ``settings`` (the result keys must agree; rules
    and problems are merged: a rerun may add either).  Returns the settings written."""
    path = out / SETTINGS_FILE
    if path.exists():
        old = json.loads(path.read_text())
        diff = settings_changes(old, settings, RESULT_KEYS)
        if diff:
            raise ValueError(f"out: {str(out)!r} holds an evaluation with other settings ({diff}); pass a new --out "
                             "folder, or the same settings to resume it")
        settings = {**settings,
                    "criteria": list(dict.fromkeys([*old.get("criteria", []), *settings["criteria"]])),
                    "problems": list(dict.fromkeys([*old.get("problems", []), *settings["problems"]]))}
    out.mkdir(parents=True, exist_ok=True)
    write_json(path, settings)
    return settings


def score(problem: Problem, completion: str, limits: Limits, header: str = "") -> tuple[dict, str | None]:
    """(the verdict fields, the program run or None) for one completion."""
    if not problem.runs_code:
        ok = answer_matches(completion, problem.answer)
        return {"passed": ok, "status": "match" if ok else "no-match", "answer": problem.answer}, None
    if problem.humaneval:
        program = humaneval_program(problem.prompt, completion, problem.test, problem.entry_point, header)
    else:
        program = tests_program(completion, problem.test, problem.entry_point, header)
    r = run_program(program, limits)
    return {"passed": r.passed, "status": r.status, "returncode": r.returncode, "exec_seconds": r.seconds,
            "stdout_tail": r.stdout[-2000:], "stderr_tail": r.stderr[-2000:]}, program


def first_drift(target, tokenizer, prompt_ids: list[int], tokens: list[int], greedy: list[int], spec: str) -> dict | None:
    """The first step where ``tokens`` leave ``greedy`` (module docstring); None when they never do."""
    n = min(len(tokens), len(greedy))
    i = next((j for j in range(n) if tokens[j] != greedy[j]), None)
    if i is None:
        return None
    with torch.inference_mode():
        logits = model_forward(target, new_cache(target), prompt_ids + greedy[:i], 1)[0].double()
    top = torch.topk(logits, 2).values
    crit = parse_criterion(spec)
    rule = "strict" if isinstance(crit, TreeCoverage) else crit
    rad = float(radius(rule, logits=logits[None])[0])
    dec = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    return {"step": i, "token": tokens[i], "greedy_token": greedy[i],
            "target_margin": float(top[0] - top[1]),
            "logit_gap": float(logits[greedy[i]] - logits[tokens[i]]),
            "radius": rad if math.isfinite(rad) else None,
            "text_before": dec(greedy[:i])[-TEXT_CONTEXT:],
            "text_rule": dec(tokens[i:])[:TEXT_CONTEXT], "text_greedy": dec(greedy[i:])[:TEXT_CONTEXT]}


def _header(problem: Problem, spec: str) -> str:
    return (f"# draftcert evaluate: {problem.id} under {spec}.  Run: python -I -S THIS_FILE; it passes when it exits 0\n"
            "# and its last line of output is the pass line printed at the end (after the tests).\n")


def _stopped(tokens: list[int], stop) -> tuple[list[int], bool]:
    """``tokens`` cut where ``stop`` fires (a round or token ended by EOS is not shown to it during the
    decode), and whether it fired."""
    keep = None if stop is None else stop(tokens)
    return (tokens, False) if keep is None else (tokens[:keep], True)


def _decode(target, tokenizer, drafter, ids, spec: str, k: int, max_new_tokens: int, draft_margin,
            stop=None) -> tuple[list[int], dict]:
    crit = parse_criterion(spec)
    tree = (crit.m, k) if isinstance(crit, TreeCoverage) else None
    res = speculative_generate(target, drafter, ids, crit, k=k, tree=tree, max_new_tokens=max_new_tokens,
                               tokenizer=tokenizer, draft_margin=draft_margin, stop=stop)
    tokens, stopped = _stopped(res.tokens, stop)
    s = res.stats.summary()
    figures = {key: s[key] for key in KEPT}
    # the rounds emitted s["emitted"] tokens; a stopped decode keeps fewer (its last round counted whole in
    # the other counters): the speed figures count the tokens kept
    n, sec = len(tokens), s["seconds"]
    figures.update(emitted=n, decoded_tokens=s["emitted"], stopped=stopped,
                   tokens_per_forward=n / s["target_forwards"] if s["target_forwards"] else 0.0,
                   tokens_per_second=n / sec if sec > 0 else None)
    return tokens, figures


def _greedy(target, ids, max_new_tokens: int, stop=None) -> tuple[list[int], dict]:
    t0 = time.perf_counter()
    tokens = greedy_generate(target, ids, max_new_tokens, stop=stop)
    sec = time.perf_counter() - t0
    forwards = len(tokens)  # one target forward per token decoded
    tokens, stopped = _stopped(tokens, stop)
    return tokens, {"emitted": len(tokens), "decoded_tokens": forwards, "stopped": stopped, "target_forwards": forwards,
                    "tokens_per_forward": len(tokens) / forwards if forwards else 0.0, "seconds": sec,
                    "tokens_per_second": len(tokens) / sec if sec > 0 else None, "drift": 0.0, "drift_tokens": 0}


def _rescore(out: Path, problem: Problem, spec: str, rec: dict, limits: Limits) -> None:
    """Score ``rec["completion"]`` into ``rec`` (its verdict fields replaced), saving the program run."""
    verdict, program = score(problem, rec["completion"], limits, _header(problem, spec))
    for key in ("returncode", "exec_seconds", "stdout_tail", "stderr_tail", "answer", "program"):
        rec.pop(key, None)
    rec.update(verdict)
    if program is not None:
        prog_path = out / PROGRAMS_DIR / slug(spec) / f"{slug(problem.id)}.py"
        prog_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(prog_path, program)
        rec["program"] = str(prog_path.relative_to(out))


def read_results(out_dir, spec: str) -> dict[str, dict]:
    """Every result written for ``spec``: {problem id: record}."""
    folder = Path(out_dir) / RESULTS_DIR / slug(spec)
    recs = {}
    for f in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        rec = json.loads(f.read_text())
        recs[rec["prompt_id"]] = rec
    return recs


def run_evaluation(target, tokenizer, drafter, problems: list[Problem], specs: list[str], out_dir, *, k: int,
                   max_new_tokens: int, limits: Limits, settings: dict, baseline: bool = False,
                   draft_margin: float | None = None, on_result: Callable[[str, str, bool], None] | None = None,
                   rescore: bool = False, stop: bool = True) -> dict:
    """Decode and score every (problem, rule) not yet in ``out_dir`` (module docstring).  ``specs``
    must start with ``strict``.  ``rescore``: score the completions already written again (after a
    change to the scoring; nothing is decoded again).  ``stop``: every decode, the target alone's
    included, ends where ``stopping.CodeBlockStop`` fires (evaluate.json's ``"stop"``: ``"code-block"``,
    else null).  ``on_result(problem id, rule, skipped)`` after each.  Returns the
    settings written to ``evaluate.json``."""
    if not specs or specs[0] != CONTROL:
        raise ValueError("criteria: strict, the control, must come first")
    names: dict[str, str] = {}
    for p in problems:
        if names.setdefault(slug(p.id), p.id) != p.id:
            raise ValueError(f"task: problem ids {names[slug(p.id)]!r} and {p.id!r} share the file name {slug(p.id)!r}; "
                             "give them ids that differ in letters or digits")
    out = Path(out_dir)
    settings = check_settings(out, {**settings, "stop": STOP_RULE if stop else None, "criteria": list(specs),
                                    "problems": [p.id for p in problems]})
    runs = ([GREEDY] if baseline else []) + list(specs)
    for p in problems:
        ids = encode_prompt(tokenizer, p.prompt)
        strict_tokens = None
        for spec in runs:
            path = _result_path(out, spec, p.id)
            if path.exists():
                rec = json.loads(path.read_text())
                if spec == CONTROL:
                    strict_tokens = rec["tokens"]
                if rescore:
                    _rescore(out, p, spec, rec, limits)
                    write_json(path, rec)
                if on_result is not None:
                    on_result(p.id, spec, True)
                continue
            stopper = stop_for(p, tokenizer) if stop else None  # a new one per decode
            if spec == GREEDY:
                tokens, figures = _greedy(target, ids, max_new_tokens, stopper)
            else:
                tokens, figures = _decode(target, tokenizer, drafter, ids, spec, k, max_new_tokens, draft_margin,
                                          stopper)
            completion = tokenizer.decode(tokens, skip_special_tokens=True)
            rec = {"prompt_id": p.id, "criterion": spec, "completion": completion, "tokens": tokens, **figures}
            _rescore(out, p, spec, rec, limits)
            if spec == CONTROL:
                strict_tokens = tokens
            elif spec != GREEDY:
                rec["identical_to_strict"] = tokens == strict_tokens
                rec["first_drift"] = first_drift(target, tokenizer, ids, tokens, strict_tokens, spec)
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json(path, rec)
            if on_result is not None:
                on_result(p.id, spec, False)
    return settings
