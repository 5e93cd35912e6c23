"""The evaluation run on a tiny float64 target (exact: no near-tie flips): strict is greedy bit for bit,
a rule that accepts everything yields the drafter's text and its pass@1, a resumed run gives the
table of an uninterrupted one, and saved programs give the same verdict when run by hand."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from draftcert.cli import main
from draftcert.decode.engine import greedy_generate, speculative_generate
from draftcert.drafting.protocol import Drafter
from draftcert.evaluate.executor import PASS_MARKER, Limits
from draftcert.evaluate.scoreboard import FIGURE, mcnemar_exact, scoreboard_rows, write_scoreboard
from draftcert.evaluate.session import read_results, run_evaluation
from draftcert.evaluate.tasks import Problem
from draftcert.models import derive_drafter
from tests.chain_round import chain_draft
from draftcert.prompts import encode_prompt

from tests.tiny_models import tiny_qwen3

LIMITS = Limits(timeout=5.0, cpu_seconds=5)
EOS = 258  # the tiny tokenizer's <|im_end|>
SOLUTION = "def add(a, b):\n    return a + b\n"
PROBLEMS = [Problem("user/add", "Write add(a, b).", test="assert add(2, 3) == 5\n"),
            Problem("user/sum", "Write a function that sums a list.", test="def check(f):\n    assert f([1, 2]) == 3\n",
                    entry_point="total"),
            Problem("user/answer", "What is 6 x 7?", answer="42")]
SETTINGS = {"task": "test", "target": "tiny", "drafter": "test", "k": 3, "max_new_tokens": 40, "model_dtype": "float64",
            "draft_vocab": None, "timeout": 5.0, "memory_bytes": LIMITS.memory_bytes}


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    model, tok = tiny_qwen3(0, num_layers=3, hidden_size=48, intermediate_size=96, init_std=0.15)
    model.to(torch.float64)
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = 256
    return model, tok


class TextDrafter(Drafter):
    """Drafts the bytes of a fixed text per prompt (then EOS), whatever the target does."""

    def __init__(self, texts: dict[int, str], tok):
        self.script = {n: tok(t)["input_ids"] + [EOS] for n, t in texts.items()}
        self.forwards = 0

    def start(self, prompt_ids):
        self.n_prompt = len(prompt_ids)
        self.text = self.script.get(len(prompt_ids), [EOS])

    def propose(self, seq, widths, expand_all=False):
        t = len(seq) - self.n_prompt
        return chain_draft(self.text[t: t + len(widths)])

    def accept(self, path):
        pass

    def observe(self, hidden):
        pass

    def fork(self):
        return None


def _texts(tok):
    answers = {"user/add": "Here:\n```python\n" + SOLUTION + "```", "user/sum": "def total(xs):\n    return sum(xs)\n",
               "user/answer": "The answer is 42."}
    return {len(encode_prompt(tok, p.prompt)): answers[p.id] for p in PROBLEMS}


def _run(tiny, drafter, out, specs, k=3, max_new_tokens=40, **kw):
    model, tok = tiny
    return run_evaluation(model, tok, drafter, PROBLEMS, specs, out, k=k, max_new_tokens=max_new_tokens, limits=LIMITS,
                          settings={**SETTINGS, "k": k, "max_new_tokens": max_new_tokens}, **kw)


def test_strict_is_greedy_bit_for_bit_and_the_baseline_check_says_so(tiny, tmp_path):
    model, tok = tiny
    _run(tiny, derive_drafter(model, "self:skip=1"), tmp_path, ["strict", "additive:0.5"], baseline=True)
    strict = read_results(tmp_path, "strict")
    for p in PROBLEMS:
        assert strict[p.id]["tokens"] == greedy_generate(model, encode_prompt(tok, p.prompt), 40)
    doc = write_scoreboard(tmp_path, figure=False)
    assert doc["baseline_match"] is True and doc["baseline_compared"] == len(PROBLEMS)
    assert doc["rows"][0]["criterion"] == "strict" and doc["rows"][0]["drift"] == 0


def test_a_rule_accepting_everything_yields_the_drafters_text_and_its_pass_at_1(tiny, tmp_path):
    model, tok = tiny
    drafter = TextDrafter(_texts(tok), tok)
    # one round drafts the whole text and its EOS: all accepted, the output ends at the EOS (no target token)
    _run(tiny, drafter, tmp_path, ["strict", "topm:259"], k=64, max_new_tokens=80)
    everything = read_results(tmp_path, "topm:259")
    texts = _texts(tok)
    for p in PROBLEMS:
        assert everything[p.id]["completion"] == texts[len(encode_prompt(tok, p.prompt))]
        assert everything[p.id]["passed"], everything[p.id]
    rows, flips, _ = scoreboard_rows(tmp_path)
    strict_row, rule_row = rows
    assert rule_row["pass_at_1"] == 1.0 and rule_row["passed"] == 3
    assert strict_row["pass_at_1"] == 0.0  # the random tiny target writes no working code
    assert (rule_row["lost"], rule_row["gained"]) == (0, 3)
    assert rule_row["mcnemar_p"] == pytest.approx(0.25)  # 3 of 3 discordant pairs one way: 2 / 2**3
    assert {f["prompt_id"] for f in flips} == {p.id for p in PROBLEMS}
    steps = sorted(f["first_drift"]["step"] for f in flips)
    assert rule_row["first_drift_step_median"] == steps[1] and strict_row["first_drift_step_median"] is None
    strict = read_results(tmp_path, "strict")
    for f in flips:
        d = f["first_drift"]
        s, r = strict[f["prompt_id"]]["tokens"], everything[f["prompt_id"]]["tokens"]
        i = d["step"]
        assert s[:i] == r[:i] and s[i] != r[i] and d["greedy_token"] == s[i] and d["token"] == r[i]
        assert d["target_margin"] >= 0 and d["radius"] is None  # topm:V accepts everything: an infinite radius


def test_resume_after_an_interrupt_gives_the_same_table(tiny, tmp_path):
    model, _ = tiny
    drafter = derive_drafter(model, "self:skip=1")
    specs = ["strict", "additive:0.5", "tree:2"]
    _run(tiny, drafter, tmp_path / "whole", specs)
    done = []

    def stop_after_four(pid, spec, skipped):
        done.append((pid, spec, skipped))
        if len(done) == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run(tiny, drafter, tmp_path / "cut", specs, on_result=stop_after_four)
    done.clear()
    _run(tiny, drafter, tmp_path / "cut", specs, on_result=lambda *a: done.append(a))
    assert [a[2] for a in done] == [True] * 4 + [False] * (3 * len(PROBLEMS) - 4)  # the first four were kept
    timing = ("seconds", "tokens_per_second", "speedup")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in timing} for r in rows]  # noqa: E731
    assert strip(scoreboard_rows(tmp_path / "cut")[0]) == strip(scoreboard_rows(tmp_path / "whole")[0])


def test_rescore_scores_the_saved_completions_again_without_decoding(tiny, tmp_path):
    model, tok = tiny
    _run(tiny, TextDrafter(_texts(tok), tok), tmp_path, ["strict", "topm:259"], k=64, max_new_tokens=80)
    path = tmp_path / "results" / "topm_259" / "user_add.json"
    rec = json.loads(path.read_text())
    assert rec["passed"]
    path.write_text(json.dumps({**rec, "passed": False, "status": "failed"}))
    (tmp_path / rec["program"]).unlink()
    seen = []
    _run(tiny, TextDrafter({}, tok), tmp_path, ["strict", "topm:259"], k=64, max_new_tokens=80, rescore=True,
         on_result=lambda *a: seen.append(a[2]))
    assert seen == [True] * 6  # nothing decoded again
    again = json.loads(path.read_text())
    assert again["passed"] and again["status"] == "passed" and (tmp_path / again["program"]).exists()
    assert again["tokens"] == rec["tokens"]


def test_a_rerun_with_other_settings_is_refused(tiny, tmp_path):
    model, tok = tiny
    _run(tiny, TextDrafter({}, tok), tmp_path, ["strict"])
    with pytest.raises(ValueError, match="out: .*max_new_tokens: was 40, now 20"):
        run_evaluation(model, tok, TextDrafter({}, tok), PROBLEMS, ["strict"], tmp_path, k=3, max_new_tokens=20,
                       limits=LIMITS, settings={**SETTINGS, "max_new_tokens": 20})


def test_problem_ids_sharing_a_file_name_are_refused(tiny, tmp_path):
    model, tok = tiny
    twins = [Problem("a/b", "x", answer="1"), Problem("a_b", "y", answer="2")]
    with pytest.raises(ValueError, match="task: problem ids 'a/b' and 'a_b' share the file name"):
        run_evaluation(model, tok, TextDrafter({}, tok), twins, ["strict"], tmp_path, k=3, max_new_tokens=4,
                       limits=LIMITS, settings=SETTINGS)


def test_saved_programs_give_the_same_verdict_by_hand(tiny, tmp_path):
    model, tok = tiny
    _run(tiny, TextDrafter(_texts(tok), tok), tmp_path, ["strict", "topm:259"], k=64, max_new_tokens=80)
    checked = 0
    for spec in ("strict", "topm:259"):
        for rec in read_results(tmp_path, spec).values():
            if "program" not in rec:
                continue
            r = subprocess.run([sys.executable, "-I", "-S", str(tmp_path / rec["program"])], capture_output=True,
                               text=True, timeout=30, cwd=tmp_path)
            by_hand = r.returncode == 0 and r.stdout.rstrip("\n").split("\n")[-1] == PASS_MARKER
            assert by_hand == rec["passed"], (spec, rec["prompt_id"], r.stderr[-300:])
            checked += 1
    assert checked == 4
    assert main(["report", str(tmp_path), "-q"]) == 0  # draftcert report DIR: the evaluation's files
    assert json.loads((tmp_path / "evaluation.json").read_text())["rows"][1]["criterion"] == "topm:259"
    assert (tmp_path / FIGURE).stat().st_size > 0 and (tmp_path / "completions.parquet").exists()


@pytest.mark.parametrize("lost,gained", [(0, 0), (1, 0), (3, 1), (10, 2), (7, 7), (0, 25), (40, 21)])
def test_mcnemar_exact_matches_scipy_and_the_exact_sum(lost, gained, monkeypatch):
    from scipy.stats import binomtest

    from draftcert.evaluate import scoreboard

    n = lost + gained
    want = 1.0 if n == 0 else binomtest(lost, n, 0.5).pvalue
    assert mcnemar_exact(lost, gained) == pytest.approx(want, rel=1e-12)
    assert scoreboard._binom_two_sided(lost, n) == pytest.approx(want, rel=1e-12)  # the fallback without scipy


@pytest.mark.slow
def test_on_the_embedded_model_strict_is_greedy_bit_for_bit(tmp_path, capsys):
    """The command on the embedded target, 3 HumanEval problems: strict's completions are the target
    alone's greedy ones (--baseline's check; exit status 1 otherwise)."""
    out = tmp_path / "he"
    code = main(["evaluate", "--out", str(out), "--limit", "3", "--criteria", "strict,topm:2", "--max-new-tokens", "48",
                 "--baseline", "--execute-untrusted-code", "--no-progress"])
    doc = json.loads((out / "evaluation.json").read_text())
    assert code == 0 and doc["baseline_match"] is True and doc["baseline_compared"] == 3
    assert [r["criterion"] for r in doc["rows"]] == ["strict", "topm:2"] and doc["rows"][0]["identical"] == 3


PROSE = "Here:\n```python\n" + SOLUTION + "```\nIt adds a and b, e.g. add(2, 3) == 5, and add(1, 1) == 2 too.\n"


def test_a_decode_stops_right_after_the_closing_fence_and_counts_only_the_tokens_kept(tiny, tmp_path):
    model, tok = tiny
    n_add = len(encode_prompt(tok, PROBLEMS[0].prompt))
    drafter = TextDrafter({n_add: PROSE}, tok)
    # one round drafts 79 tokens of the text (all accepted), the target adds the 80th: the stop fires inside it
    _run(tiny, drafter, tmp_path / "stop", ["strict", "topm:259"], k=128, max_new_tokens=80)
    _run(tiny, drafter, tmp_path / "full", ["strict", "topm:259"], k=128, max_new_tokens=80, stop=False)
    stopped, full = (read_results(tmp_path / d, "topm:259")["user/add"] for d in ("stop", "full"))
    assert full["completion"].startswith(PROSE[:79]) and not full["stopped"] and full["emitted"] == 80
    assert stopped["completion"] == "Here:\n```python\n" + SOLUTION + "```\n" and stopped["stopped"]
    assert stopped["tokens"] == full["tokens"][:len(stopped["tokens"])]
    assert stopped["passed"] and full["passed"]  # the same verdict
    n = len(stopped["tokens"])
    assert stopped["emitted"] == n < stopped["decoded_tokens"] == 80  # the round's tail is not counted
    assert stopped["tokens_per_forward"] == pytest.approx(n / stopped["target_forwards"])
    assert stopped["tokens_per_second"] == pytest.approx(n / stopped["seconds"])
    assert json.loads((tmp_path / "stop" / "evaluate.json").read_text())["stop"] == "code-block"
    assert json.loads((tmp_path / "full" / "evaluate.json").read_text())["stop"] is None
    with pytest.raises(ValueError, match="out: .*stop: was 'code-block', now None"):  # no resume across the stop
        _run(tiny, drafter, tmp_path / "stop", ["strict", "topm:259"], k=128, max_new_tokens=80, stop=False)
    # a round ending at an accepted EOS is not shown to the stop during the decode: the result is cut after it
    _run(tiny, drafter, tmp_path / "eos", ["strict", "topm:259"], k=128, max_new_tokens=160)
    at_eos = read_results(tmp_path / "eos", "topm:259")["user/add"]
    assert at_eos["decoded_tokens"] == len(tok(PROSE)["input_ids"]) + 1 and at_eos["tokens"] == stopped["tokens"]
    answer = read_results(tmp_path / "stop", "topm:259")["user/answer"]
    assert not answer["stopped"]  # {prompt, answer}: no stop


class _TextOf:
    """A stand-in tokenizer for the stop: each token id's text from a table ("\\n" for the rest)."""

    def __init__(self, table):
        self.table = table

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.table.get(i, "\n") for i in ids)


def test_strict_is_greedy_bit_for_bit_under_a_stop_that_fires(tiny, tmp_path, monkeypatch):
    """The random target writes no code; a stand-in text for its greedy tokens puts a closed block
    defining the entry point in it, so that the stop fires inside a round."""
    from draftcert.evaluate import session
    from draftcert.evaluate.stopping import CodeBlockStop

    model, tok = tiny
    problem = PROBLEMS[1]  # entry point: total
    greedy = greedy_generate(model, encode_prompt(tok, problem.prompt), 40)
    assert EOS not in greedy[:30]
    firsts = [i for i, t in enumerate(greedy) if t not in greedy[:i]]  # first occurrences
    a = firsts[1]
    ends, drafter = [0], model  # the target as its own drafter: rounds of k + 1 = 4 tokens
    speculative_generate(model, drafter, encode_prompt(tok, problem.prompt), "strict", k=3, max_new_tokens=40,
                         on_round=lambda log: ends.append(ends[-1] + len(log.emitted)))
    b = next(i for i in firsts if i >= a + 2 and i + 1 not in ends)  # the stop fires inside a round
    text = _TextOf({greedy[a]: "```python\ndef total(xs):\n    return sum(xs)\n", greedy[b]: "```\n"})
    monkeypatch.setattr(session, "stop_for", lambda p, tokenizer: CodeBlockStop(text, p.entry_point) if p.test else None)
    _run(tiny, drafter, tmp_path, ["strict", "additive:0.5"], baseline=True)
    strict, alone = read_results(tmp_path, "strict")[problem.id], read_results(tmp_path, "greedy")[problem.id]
    assert strict["tokens"] == alone["tokens"] == greedy[:b + 1] and strict["stopped"] and alone["stopped"]
    assert alone["emitted"] == alone["target_forwards"] == b + 1
    assert strict["decoded_tokens"] > b + 1  # the round that stopped emitted more
    assert write_scoreboard(tmp_path, figure=False)["baseline_match"] is True
