"""benchmarks/_llamacpp.py's parsing of llama.cpp's output, on captured samples: no llama.cpp,
no models (the benchmark itself is never needed by the tests)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "_llamacpp.py"
_spec = importlib.util.spec_from_file_location("_bench_llamacpp", _PATH)
L = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = L  # its dataclasses look their module up there
_spec.loader.exec_module(L)

# llama-completion --verbose-prompt --no-log-prefix --no-log-timestamps, stderr (abridged)
COMPLETION_LOG = """llama_completion: prompt: '<|im_start|>user
hi -> 'x'<|im_end|>
'
llama_completion: number of tokens in prompt = 4
151644 -> '<|im_start|>'
   872 -> 'user'
   198 -> '
'
  6023 -> 'hi'
sampler seed: 0
common_perf_print:    sampling time =       6.18 ms
common_perf_print:    samplers time =       2.38 ms /    65 tokens
common_perf_print:        load time =    7052.63 ms
common_perf_print: prompt eval time =     339.97 ms /    33 tokens (   10.30 ms per token,    97.07 tokens per second)
common_perf_print:        eval time =    1083.60 ms /    31 runs   (   34.95 ms per token,    28.61 tokens per second)
common_perf_print:       total time =    1433.98 ms /    64 tokens
common_perf_print: unaccounted time =       4.24 ms /   0.3 %      (total - sampling - prompt eval - eval) / (total)
"""

# llama-speculative-simple, stderr (abridged): the draft's perf block first, the target's last
SPEC_LOG = """encoded  147 tokens in    3.814 seconds, speed:   38.542 t/s
decoded   35 tokens in    6.848 seconds, speed:    5.111 t/s

n_draft   = 5
n_predict = 35
n_drafted = 36
n_accept  = 27
accept    = 75.000%

draft:

common_perf_print: prompt eval time =     900.00 ms /   180 tokens (    5.00 ms per token,   200.00 tokens per second)
common_perf_print:        eval time =     100.00 ms /    10 runs   (   10.00 ms per token,   100.00 tokens per second)

target:

common_perf_print:    sampling time =      13.82 ms
common_perf_print:        load time =    2787.65 ms
common_perf_print: prompt eval time =    7772.60 ms /   192 tokens (   40.48 ms per token,    24.70 tokens per second)
common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token,      inf tokens per second)
"""


def test_completion_timings_and_prompt_ids():
    t = L.parse_timings(COMPLETION_LOG)
    assert t["prompt_eval_s"] == pytest.approx(0.33997) and t["prompt_tokens"] == 33
    assert t["eval_s"] == pytest.approx(1.0836) and t["eval_runs"] == 31
    assert t["sampling_s"] == pytest.approx(0.00618) and t["load_s"] == pytest.approx(7.05263)
    assert "encoded_s" not in t and "n_accept" not in t
    # the load is excluded: prompt eval + eval + sampling
    assert L.generation_seconds(t, "target") == pytest.approx(0.33997 + 1.0836 + 0.00618)
    # the echoed prompt (with a "-> '" of its own) is skipped: ids come after the count
    assert L.parse_prompt_ids(COMPLETION_LOG) == [151644, 872, 198, 6023]
    assert L.parse_prompt_ids("no listing here") is None
    assert L.parse_prompt_ids("number of tokens in prompt = 3\n   1 -> 'a'\n") is None  # incomplete


def test_speculative_timings_take_the_examples_lines_and_the_targets_block():
    t = L.parse_timings(SPEC_LOG)
    assert (t["encoded_tokens"], t["decoded_tokens"]) == (147, 35)
    assert L.generation_seconds(t, "spec") == pytest.approx(3.814 + 6.848)
    assert (t["n_draft"], t["n_drafted"], t["n_accept"]) == (5, 36, 27)
    assert t["prompt_eval_s"] == pytest.approx(7.7726) and t["eval_runs"] == 1  # the last block: the target's


def test_strip_output():
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert L.strip_output("Hello\n\nthere\n\n", "target", prompt) == "Hello\n\nthere"
    assert L.strip_output("Hello. [end of text]\n\n\n", "target", prompt) == "Hello."
    assert L.strip_output("\n\n" + prompt + "Hi\n\n\n\n", "spec", prompt) == "Hi"
    with pytest.raises(RuntimeError, match="round-trip"):
        L.strip_output("\n\nsomething else\n\n\n\n", "lookup", prompt)
