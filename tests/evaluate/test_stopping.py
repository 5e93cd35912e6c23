"""The evaluation's stop: it fires right after the fence line closing the scored code block, at the
same token however many tokens a call adds, never where the code could still change (the stopped
completion's program is the full one's), and not at all without such a block."""

from __future__ import annotations

import pytest

from draftcert.evaluate.executor import Limits, run_program
from draftcert.evaluate import programs
from draftcert.evaluate.programs import code_closed, extract_code, humaneval_program
from draftcert.evaluate.stopping import CodeBlockStop, stop_for
from draftcert.evaluate.tasks import Problem

from tests.tiny_models import tiny_tokenizer

PROMPT = 'def add(a, b):\n    """The sum of a and b."""\n'
TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n"
GOOD = "def add(a, b):\n    return a + b\n"
# (the full completion, the text the stop keeps or None where it never fires)
CASES = [
    # a chat answer: the function, then prose and an example block
    ("Here is the function:\n```python\n" + GOOD + "```\n\nExample:\n```python\nprint(add(1, 2))\n```\nIt prints 3.",
     "Here is the function:\n```python\n" + GOOD + "```\n"),
    # the code first and only a closing fence (SmolLM2's habit)
    (GOOD + "```\nThe function adds its arguments.", GOOD + "```\n"),
    # a first block that does not define the entry point, then a wrong one that does: kept wrong
    ("```python\nimport math\n```\nThen:\n```py\ndef add(a, b):\n    return a - b\n```\nand a second:\n```python\n" + GOOD
     + "```\n", "```python\nimport math\n```\nThen:\n```py\ndef add(a, b):\n    return a - b\n```\n"),
    # a closing fence line with trailing blanks, prose with characters cut between byte tokens
    ("Voilà — ünïcode ✓:\n```python\n" + GOOD + "```  \nSo add(2, 3) == 5 ✓.", "Voilà — ünïcode ✓:\n```python\n" + GOOD
     + "```  \n"),
    # no code block: the function body continued, examples after it
    ("    return a + b\n\nprint(add(2, 3))\n", None),
    # a block cut by the length limit before its closing fence
    ("Sure:\n```python\n" + GOOD + "\n# more", None),
    # the closing fence without its newline (the stop waits for the line's end)
    ("```python\n" + GOOD + "```", None),
]
LIMITS = Limits(timeout=5.0, cpu_seconds=5)


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _kept(tok, text, entry_point="add", chunk=1):
    """The text the stop keeps of ``text``'s tokens fed ``chunk`` at a time, and n (None: never fires)."""
    ids, stop = _ids(tok, text), CodeBlockStop(tok, entry_point)
    n = None
    for end in range(chunk, len(ids) + chunk, chunk):
        n = stop(ids[:end])
        if n is not None:
            break
    return (None if n is None else tok.decode(ids[:n])), n


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.mark.parametrize("full,want", CASES)
def test_the_stop_fires_right_after_the_closing_fence_line_whatever_the_chunks(tok, full, want):
    assert tok.decode(_ids(tok, full)) == full
    texts, ns = zip(*(_kept(tok, full, chunk=c) for c in (1, 2, 5, 64, 10_000)))
    assert set(texts) == {want} and len(set(ns)) == 1  # one token at a time (greedy) or rounds of any size
    if want is not None:
        assert ns[0] == len(_ids(tok, want))  # the first token whose text completes that line


@pytest.mark.parametrize("full,want", CASES)
def test_the_stopped_completion_gets_the_full_ones_program_and_verdict(tok, full, want):
    kept = want if want is not None else full  # no stop: the decode runs to its end, as before
    assert humaneval_program(PROMPT, kept, TEST, "add") == humaneval_program(PROMPT, full, TEST, "add")
    a = run_program(humaneval_program(PROMPT, kept, TEST, "add"), LIMITS)
    b = run_program(humaneval_program(PROMPT, full, TEST, "add"), LIMITS)
    assert a.passed == b.passed and a.status == b.status
    assert a.passed == ("return a + b" in extract_code(full, "add"))  # the cases' verdicts mean what they say


@pytest.mark.parametrize("full,_", CASES)
def test_wherever_code_closed_holds_the_extracted_code_is_final(full, _):
    for entry in ("add", None):
        for i in range(len(full) + 1):  # every prefix of the text, not only token boundaries
            if code_closed(full[:i], entry):
                assert extract_code(full[:i], entry) == extract_code(full, entry), (entry, i)
                assert programs.tests_program(full[:i], TEST, entry) == programs.tests_program(full, TEST, entry)


def test_code_closed_asks_for_the_closing_fence_lines_newline():
    block = "```python\n" + GOOD + "```"
    assert not code_closed(block, "add") and code_closed(block + "\n", "add")
    assert not code_closed("```python\nimport math\n```\n", "add")  # a later block may define it
    assert code_closed("```python\nimport math\n```\n", None) and not code_closed(GOOD, "add")


def test_a_test_task_without_an_entry_point_stops_after_its_first_nonempty_code_block(tok):
    full = "Empty:\n```\n```\nNow:\n```python\nassert 1 + 1 == 2\n```\nDone.\n```python\nx = 3\n```\n"
    assert _kept(tok, full, None)[0] == "Empty:\n```\n```\nNow:\n```python\nassert 1 + 1 == 2\n```\n"
    assert _kept(tok, full, "f")[0] is None  # with an entry point nothing defines, a later block might


def test_answer_tasks_get_no_stop_and_a_stop_serves_one_decode(tok):
    assert stop_for(Problem("a/1", "6 x 7?", answer="42"), tok) is None
    stop = stop_for(Problem("t/1", "add", test=TEST, entry_point="add"), tok)
    ids = _ids(tok, "```python\n" + GOOD + "```\nmore")
    assert stop(ids[:5]) is None
    with pytest.raises(ValueError, match="stop: called with tokens that do not extend"):
        stop(ids[1:9])
    n = stop(ids)
    assert n == len(_ids(tok, "```python\n" + GOOD + "```\n")) and stop(ids + ids) == n  # fired: stays fired
