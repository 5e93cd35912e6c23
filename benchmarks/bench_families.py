"""What the rollback of recurrent state costs: a hybrid model against a full-attention one.

Tiny random models from the family test matrix (``tests/decode/families.py``: 3 layers, hidden 64,
float32): Qwen3.5 (Gated DeltaNet + attention, the hybrid), Qwen3 (full attention, the baseline in
the same run) and Mamba (v1; its multi-token passes restart the SSM state, so it is verified token
by token).  Each decodes the same prompts under ``strict`` with the same drafter (prompt lookup,
k = 4, ``--new`` tokens), checked against its own greedy decoding, and reports:

* ``<family>_tokens_per_forward``: emitted tokens / target forwards (every forward counted by a hook
  on the model, stepwise catch-up passes included);
* ``<family>_tokens_per_round``: emitted tokens / verification rounds (what one pass per round
  would give: the two agree where no extra forward is paid);
* ``<family>_rows_per_forward``: tokens fed per target forward (a hybrid re-feeds the accepted
  tokens of a partly rejected draft as the next pass's pending rows);
* ``<family>_rollback_us_per_round``: time in ``CacheState.mark`` + ``keep`` per round (copying the
  recurrent state before the pass, putting it back and cropping after), and
  ``<family>_rollback_share``: that time / the decode's wall time;
* ``<family>_state_kib``: the recurrent state copied per round (KiB);
* ``hybrid_vs_full_tokens_per_forward`` (Qwen3.5 / Qwen3) and
  ``hybrid_vs_full_rollback`` (rollback time per round, Qwen3.5 / Qwen3).

Random models write different text, so tokens per forward differ between families by their own
acceptance; the rollback costs no forward where tokens_per_forward equals tokens_per_round.

    python benchmarks/bench_families.py [--new 64] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

from draftcert.decode import greedy_generate, speculative_generate
from draftcert.models.tree_attention import DraftTree
from draftcert.models.cache_state import CacheState, layout_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "decode"))
from families import EOS, build  # noqa: E402  (the test matrix's models, built from their Config classes)

FAMILIES = {"qwen3_5": "hybrid", "qwen3": "full", "mamba": "recurrent, stepwise"}
# prompts with repeated n-grams, so prompt lookup drafts; tokens 3..127 (0-2: pad, eos, bos)
PROMPTS = [
    [5, 9, 17, 33, 5, 9, 17, 33, 40, 3, 5, 9, 17],
    [21, 22, 23, 24, 25, 21, 22, 23, 24, 25, 21, 22, 23],
    [60, 61, 62, 70, 71, 60, 61, 62, 70, 71, 60, 61, 62, 70],
    [100, 7, 100, 8, 100, 7, 100, 8, 100, 7],
]


class ScriptedDrafter:
    """Drafts the target's own greedy text, wrong at every ``every``-th position of the sequence.

    The same accept/reject pattern on every model (a rejection wherever a draft reaches a wrong
    position), so tokens per round are equal across families and any difference in tokens per
    forward is the rollback's."""

    def __init__(self, text: list[int], every: int = 4):
        self.text, self.every, self.forwards = text, every, 0

    def start(self, prompt_ids):
        pass

    def propose(self, seq, widths, expand_all=False):
        tree, node = DraftTree(), -1
        for d in range(len(widths)):
            i = len(seq) + d
            if i >= len(self.text):
                break
            tok = self.text[i] if i % self.every else (self.text[i] + 1) % 128  # 128: the models' vocab
            node = tree.add(tok, node)
        tree.expanded = list(range(-1, node)) if node >= 0 else []
        tree.widths = [1] * len(tree.expanded)
        return tree

    def accept(self, path):
        pass


class Timer:
    """Wall time spent inside CacheState.mark / keep (the rollback), summed over a decode."""

    def __init__(self):
        self.seconds = 0.0
        self.state_bytes = 0
        self.marks = 0

    def wrap(self, fn, count_state=False):
        def timed(state, *args, **kwargs):
            t0 = time.perf_counter()
            out = fn(state, *args, **kwargs)
            self.seconds += time.perf_counter() - t0
            if count_state and state._marked is not None:
                self.marks += 1
                self.state_bytes += _bytes(state._marked)
            return out
        return timed


def _bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


def measure(name: str, drafter: str, new: int, repeats: int) -> dict[str, float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build(name, seed=0)
    layout_of(model)  # its capability probe's forwards run here, not inside the counted decodes
    calls = {"forwards": 0, "rows": 0}

    def count(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        calls["forwards"] += 1
        calls["rows"] += int(ids.shape[-1])

    timer = Timer()
    mark, keep = CacheState.mark, CacheState.keep
    CacheState.mark, CacheState.keep = timer.wrap(mark, count_state=True), timer.wrap(keep)
    emitted = rounds = 0
    seconds = []
    try:
        for prompt in PROMPTS:
            ref = greedy_generate(model, prompt, new, eos_token_id=EOS)
            best = None
            for _ in range(repeats):
                calls.update(forwards=0, rows=0)
                timer.seconds = 0.0
                handle = model.register_forward_pre_hook(count, with_kwargs=True)
                t0 = time.perf_counter()
                try:
                    d = ScriptedDrafter(prompt + ref) if drafter == "scripted" else drafter
                    res = speculative_generate(model, d, prompt, "strict", k=4, max_new_tokens=new,
                                               eos_token_id=EOS, certificates=False)
                finally:
                    handle.remove()
                wall = time.perf_counter() - t0
                if res.tokens != ref:
                    raise SystemExit(f"{name}: strict decoding differs from its greedy decoding on {prompt}")
                if best is None or wall < best[0]:
                    best = (wall, timer.seconds, dict(calls), res.stats)
            wall, rollback, c, st = best
            emitted += st.emitted
            rounds += st.num_rounds
            seconds.append((wall, rollback, c["forwards"], c["rows"], st.num_rounds))
    finally:
        CacheState.mark, CacheState.keep = mark, keep
    forwards = sum(s[2] for s in seconds)
    return {
        "tokens_per_forward": emitted / forwards,
        "tokens_per_round": emitted / rounds,
        "rows_per_forward": sum(s[3] for s in seconds) / forwards,
        "rollback_us_per_round": 1e6 * sum(s[1] for s in seconds) / rounds,
        "rollback_share": sum(s[1] for s in seconds) / sum(s[0] for s in seconds),
        "round_us": 1e6 * sum(s[0] for s in seconds) / rounds,
        "state_kib": (timer.state_bytes / timer.marks / 1024) if timer.marks else 0.0,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt (default 64)")
    ap.add_argument("--repeats", type=int, default=3, help="timed decodes per prompt, the fastest kept (default 3)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {}
    for drafter, tag in (("prompt-lookup", "pld"), ("scripted", "scripted")):
        for name, kind in FAMILIES.items():
            results[tag, name] = r = measure(name, drafter, args.new, args.repeats)
            print(f"{name} ({kind}), {drafter}: {r['tokens_per_forward']:.3f} tokens/forward, "
                  f"{r['tokens_per_round']:.3f} tokens/round, {r['rows_per_forward']:.2f} rows/forward, rollback "
                  f"{r['rollback_us_per_round']:.0f} us of a {r['round_us']:.0f} us round, {r['state_kib']:.1f} KiB "
                  "state copied per round", flush=True)
    for (tag, name), r in results.items():
        for key, value in r.items():
            print(f"{tag}_{name}_{key}={value:.4f}")
    for tag in ("pld", "scripted"):
        h, f = results[tag, "qwen3_5"], results[tag, "qwen3"]
        print(f"{tag}_hybrid_vs_full_tokens_per_forward={h['tokens_per_forward'] / f['tokens_per_forward']:.4f}")
        print(f"{tag}_hybrid_vs_full_rollback={h['rollback_us_per_round'] / f['rollback_us_per_round']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
