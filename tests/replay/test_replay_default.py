"""`draftcert replay` of the README's own kind of run (issue 51, item 1).

The README's main command profiles the embedded target with `--drafter default` on the default cache,
which holds the GGUF file only (`--weights gguf`, the default, writes no float32 checkpoint).  `draftcert
replay DIR` then simulates `draftcert decode`'s default drafter, default+suffix.  Two faults hid there:

* the replay looked for the tokenizer in the float32 checkpoint's folder, found none and replayed the
  drafter alone (no suffix candidates: not what decode runs);
* a suffix chain runs deeper than the model's draft (up to the length budget), below the deepest
  recorded rollout of the feature drafter, and a relaxed rule's walk down it indexed past the rollouts
  (IndexError).

Here: a real profile run of the embedded model (2 prompts x 32 tokens, every default rule), on a cache
holding only the GGUF folder; `draftcert replay DIR` with its defaults succeeds and replays
default+suffix; and for every draft length replay offers (-k 1-8) and every shape decode's `-k auto`
chooses from, its strict rounds equal the engine's with default+suffix, round by round."""

from __future__ import annotations

import json

import pytest
import torch

from draftcert.decode import HybridDrafter, SuffixIndex, SuffixStore, make_drafter, speculative_generate
from draftcert.decode.draft_shape.shape import CANDIDATES
from draftcert.prompts import encode_prompt
from draftcert.replay import Shape, load_replay_trace, replay
from draftcert.replay.walk import DEFAULT_KS

# the second one's output repeats itself ("1, 2, 3, ..."): its suffix chains run deeper than the
# feature drafter's recorded rollouts (depth 8), where the replay crashed
TEXTS = ["Repeat exactly, twice: the quick brown fox jumps over the lazy dog.",
         "Write the numbers from 1 to 30 separated by commas."]
N = 32


@pytest.fixture(scope="module")
def gguf_only(tmp_path_factory):
    """(cache, run dir, target, tokenizer): the README's main command's kind of run, profiled from a cache
    that holds the embedded GGUF folder and no float32 checkpoint."""
    from draftcert._cache import cache_root
    from draftcert.cli import main
    from draftcert.models import load_target
    from draftcert.models.loading import EMBEDDED_NAME, ensure_embedded_gguf

    try:
        real = ensure_embedded_gguf(quiet=True)  # the user's cache (downloaded once)
    except (OSError, RuntimeError) as exc:
        pytest.skip(f"embedded model unavailable: {exc}")
    root = cache_root()
    cache = tmp_path_factory.mktemp("gguf-only-cache")
    (cache / "gguf").mkdir()
    (cache / "gguf" / EMBEDDED_NAME).symlink_to(real, target_is_directory=True)
    for name in ("kernels", "fastlinear"):  # compiled kernels and kernel plans: no need to build them again
        if (root / name).is_dir():
            (cache / name).symlink_to(root / name, target_is_directory=True)
    tmp = tmp_path_factory.mktemp("readme-run")
    (tmp / "prompts.txt").write_text("\n".join(TEXTS) + "\n")
    run = tmp / "run"
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DRAFTCERT_CACHE", str(cache))
        assert main(["profile", "--drafter", "default", "--prompts", str(tmp / "prompts.txt"), "--max-new-tokens",
                     str(N), "--out", str(run), "--no-progress", "--no-report", "--threads", "1"]) == 0
        target, tok = load_target()
        yield cache, run, target, tok
    torch.set_num_threads(threads)


def test_replay_defaults_on_the_readme_run(gguf_only, capsys):
    """`draftcert replay DIR` as the README's run leaves it: exit 0, decode's default drafter replayed."""
    from draftcert.cli import main

    cache, run, _, _ = gguf_only
    capsys.readouterr()
    assert main(["replay", str(run), "--no-figures"]) == 0  # IndexError before
    out = capsys.readouterr().out
    rj = json.loads((run / "replay.json").read_text())
    assert rj["drafter"] == "eagle:smollm2-135m-instruct+suffix", out  # the drafter alone before
    assert rj["prompt_order"] == ["prompts/1", "prompts/2"]
    assert "not available offline" not in out and "replayed the drafter alone" not in out
    assert sorted(rj["rules"]) == sorted(json.loads((run / "run.json").read_text())["criteria"])
    chains = [c["shape"]["label"] for c in rj["rules"]["strict"]["configs"] if c["shape"]["kind"] == "chain"]
    assert chains == [f"chain k={k}" for k in DEFAULT_KS]
    for args in (["-k", "1-4"], ["-k", "1-8", "--trees", "", "--static", ""]):  # the other commands
        assert main(["replay", str(run), "--no-figures", *args]) == 0
    assert not (cache / "models").exists()  # no float32 checkpoint was made on the way


def _engine(target, tok, spec, shape):
    """Per prompt, the engine's stats with `draftcert decode`'s default drafter, default+suffix: one
    HybridDrafter (a fresh suffix store) decoding the prompts in the profile's order."""
    hybrid = HybridDrafter(make_drafter("default", target, tok), SuffixIndex(store=SuffixStore()))
    return [speculative_generate(target, hybrid, encode_prompt(tok, t), spec, max_new_tokens=N,
                                 **shape.engine_args(spec)).stats for t in TEXTS], hybrid


SHAPES = [Shape((1,) * k) for k in DEFAULT_KS] + [Shape(c) for c in CANDIDATES if max(c) > 1]


def test_replay_equals_decode_at_every_k(gguf_only):
    """strict (decode's default rule) on every chain k replay offers and every tree `-k auto` may pick:
    the replayed rounds are the engine's, round by round, suffix counters included; a relaxed rule on
    the deepest chain agrees on every round replayed exactly (the rounds before it leaves the path)."""
    _, run, target, tok = gguf_only
    trace = load_replay_trace(run)
    assert trace.rollout == (8, 8) and max(DEFAULT_KS) == 8
    grafted = 0
    for spec, shape in [("strict", s) for s in SHAPES] + [("additive:0.1", Shape((1,) * 8))]:
        res = replay(trace, rules=spec, shapes=[shape], drafter="default+suffix")
        rep = res.configs[spec][0]
        stats, hybrid = _engine(target, tok, spec, shape)
        for pid, st in zip(res.prompt_order, stats):
            real = [r.num_accepted_tokens for r in st.rounds]
            rounds = rep.rounds[pid]
            n_exact = next((i for i, r in enumerate(rounds) if not r.exact), len(rounds))
            assert real[:n_exact] == rep.accepted_lengths(pid)[:n_exact], (spec, shape.label, pid)
            if spec == "strict":
                assert n_exact == len(rounds) and len(real) == len(rounds), (shape.label, pid)
                assert [r.depth_accepted for r in st.rounds] == [r.depth_accepted for r in rounds]
                assert [r.num_draft_tokens for r, x in zip(st.rounds, rounds) if x.nodes_exact] == [
                    x.nodes for x in rounds if x.nodes_exact], (shape.label, pid)
        if spec == "strict":
            assert res.rows[spec][0]["suffix_accepted"] == hybrid.suffix_accepted, shape.label
            grafted += hybrid.suffix_accepted
    assert grafted > 0  # the suffix candidates mattered
