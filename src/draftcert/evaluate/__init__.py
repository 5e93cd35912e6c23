"""``draftcert evaluate``: what a relaxed rule costs in answers.

A task's problems (HumanEval, or a user's JSONL) are decoded under several rules in one run, each
completion scored (its program run by ``executor.py``, or its answer compared), and the rules
compared with strict, the control: pass@1 with an exact McNemar test, tokens per forward, tokens/s,
drift, certified fraction, and the flips with the step where the rule first left greedy.

* ``executor.py``   run one model-written program in a subprocess under limits (NOT a security sandbox)
* ``programs.py``   a completion -> the program that runs the tests, or the answer compared
* ``tasks.py``      the problems: HumanEval from the pinned wheel, a user's JSONL
* ``stopping.py``   the stop every decode uses: right after the fence line closing the scored code block
* ``session.py``    the resumable run: one decode per problem and rule, scored, written atomically
* ``scoreboard.py`` the table, McNemar's test, the flips, evaluation.json / .parquet / .md, the figure
"""
