"""Completions to programs and answers; a user's JSONL task; the command's refusals before any model loads."""

from __future__ import annotations

import json

import pytest

from draftcert.cli import main
from draftcert.evaluate.programs import answer_matches, extract_code, normalize_answer, sanitize
from draftcert.evaluate.tasks import load_task


@pytest.mark.parametrize("completion,answer,ok", [
    ("The answer is 1,234.", "1234", True), ("so 3 apples... #### 18", "18", True), ("#### 18.0", "18", True),
    ("It is 18, not 17", "18", False), ("no number", "5", False), ("  Paris. ", "paris", True),
    ("Paris is the capital", "Paris", False), ("$42", "42", True), ("-3", "-3", True),
])
def test_answers_match_after_normalisation(completion, answer, ok):
    assert answer_matches(completion, answer) is ok


def test_normalize_answer():
    assert normalize_answer('  "Paris".  ') == "paris"
    assert normalize_answer("The   Big\n Apple!") == "the big apple"


def test_extract_code_prefers_the_block_defining_the_entry_point_and_takes_a_cut_block():
    text = "```bash\nls\n```\n```python\nx = 1\n```\n```py\ndef f(a):\n    return a\n```"
    assert extract_code(text, "f") == "def f(a):\n    return a\n"
    assert extract_code(text) == "x = 1\n"
    assert extract_code("```python\ndef g():\n    pass") == "def g():\n    pass"  # cut by the length limit
    assert extract_code("    return 1\n") == "    return 1\n"  # a body continuation as it is


def test_code_before_a_lone_closing_fence_is_the_code():
    # SmolLM2's habit: the function, example calls, a closing fence, then prose
    text = "def f(a):\n    return a\n\nprint(f(1))\n```\n\nThis function returns `a`."
    assert extract_code(text, "f") == "def f(a):\n    return a\n\nprint(f(1))\n"
    assert extract_code("Sure:\n```python\nx = 1\n", None) == "x = 1\n"  # after an opening fence, cut
    assert extract_code("No code here.", "f") == "No code here."  # no fence: as it is


def test_sanitize_keeps_definitions_and_drops_calls_and_a_cut_tail():
    code = ("import math\nX = 2\n\ndef f(a):\n    return math.sqrt(a) * X\n\nprint(f(4))\n"
            "if __name__ == '__main__':\n    f(1)\nnums = [1, 2, 3,")
    assert sanitize(code) == "import math\n\nX = 2\n\ndef f(a):\n    return math.sqrt(a) * X\n"
    assert sanitize("def (") == "def ("  # nothing parses: as it is (the run fails with its SyntaxError)


def test_a_jsonl_task_reads_tests_and_answers(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text(json.dumps({"prompt": "p1", "test": "assert f() == 1", "entry_point": None}) + "\n\n"
                 + json.dumps({"id": "q", "prompt": "p2", "answer": 7}) + "\n")
    a, b = load_task(str(f))
    assert (a.id, a.runs_code, a.test) == ("mine/1", True, "assert f() == 1")
    assert (b.id, b.runs_code, b.answer) == ("q", False, "7")
    assert load_task(str(f), limit=1) == [a]


@pytest.mark.parametrize("line,msg", [
    ('{"prompt": "x"}', 'exactly one of "test"'), ('{"prompt": "x", "test": "t", "answer": 1}', 'exactly one of'),
    ('{"test": "t"}', 'non-empty "prompt"'), ("not json", "is not JSON"),
    ('{"prompt": "x", "test": "t", "entry_point": "a b"}', "entry_point"),
])
def test_a_bad_jsonl_line_is_one_error_naming_it(tmp_path, line, msg):
    f = tmp_path / "bad.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(ValueError, match=f"task: .*{msg}"):
        load_task(str(f))


def _err(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def test_running_code_needs_the_explicit_flag(capsys, tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"prompt": "x", "test": "assert True"}\n')
    code, err = _err(capsys, ["evaluate", "--task", str(f), "--out", str(tmp_path / "o")])
    assert code == 2 and len(err) == 1
    assert err[0].startswith("draftcert: error: --execute-untrusted-code: ") and "NOT a security sandbox" in err[0]
    assert not (tmp_path / "o").exists()  # refused before anything


@pytest.mark.parametrize("argv,start", [
    (["--task", "nope"], "--task: expected 'humaneval' or a .jsonl file"),
    (["--criteria", "aditive:0.1"], "--criteria: "), (["--limit", "0"], "--limit: "),
    (["--timeout", "0"], "--timeout: "), (["--task", "missing.jsonl"], "--task: no such file"),
])
def test_bad_options_are_one_line_naming_the_option(capsys, tmp_path, argv, start):
    code, err = _err(capsys, ["evaluate", "--out", str(tmp_path / "o"), *argv])
    assert code == 2 and len(err) == 1 and err[0].startswith(f"draftcert: error: {start}"), err


def test_the_help_says_it_is_not_a_sandbox(capsys):
    with pytest.raises(SystemExit):
        main(["evaluate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "NOT a security sandbox" in out and "--execute-untrusted-code" in out
