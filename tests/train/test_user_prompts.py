"""Training on user prompts (``--prompts``), the user-prompt evaluation and resumable data generation.

All on a tiny random Qwen3 target built in code (float64); the evaluation sets (MT-Bench,
HumanEval, ShareGPT) are replaced by in-memory prompts, so nothing is downloaded.
"""

from __future__ import annotations

import json

import pytest
import torch

from draftcert.cli import main
from draftcert.decode.draft_shape.shape import acceptance_of
from tests.tiny_models import tiny_qwen3
from draftcert.models.eagle import load_eagle
from draftcert.prompts import Prompt
from draftcert.train import TrainConfig, evaluate_on_user_prompts, train_drafter
from draftcert.train import distill_data as train_data
from draftcert.train import loop as train_loop
from draftcert.train import user_eval
from draftcert.train.distill_data import HeldOut, heldout_texts, select_prompts
from draftcert.train.user_eval import USER_EVAL_KEY, merge_into_train_json

TEXTS = [
    "Explain how a hash map handles collisions.",
    "Write a short poem about autumn leaves falling.",
    "What is the capital of France and why is it famous?",
    "List three ways to speed up a Python loop.",
    "Summarise the plot of a detective story in two lines.",
    "How do I reverse a linked list in place?",
    "Give me a recipe for a quick tomato soup.",
    "Why is the sky blue during the day?",
    "Describe the rules of chess for a beginner.",
    "Translate 'good morning' into three languages.",
]
HELD = [TEXTS[3], "def add(a, b):\n    \"\"\"Return a + b.\"\"\""]  # TEXTS[3] must never be trained on
USERS = [Prompt("mt-bench/81", "Tell me about the ocean tides."), Prompt("humaneval/0", "def inc(x):\n    return"),
         Prompt("sharegpt/abc", "hello, can you help me write an email to my boss?")]


def _target(seed=0):
    model, tok = tiny_qwen3(seed, num_layers=2, hidden_size=48, intermediate_size=96, init_std=0.15)
    model.to(torch.float64)
    model.generation_config.eos_token_id = 258
    return model, tok


def _cfg(**kw):
    base = dict(examples=6, heldout_examples=2, max_prompt_tokens=64, max_new_tokens=12, draft_vocab=64, epochs=2,
                batch_tokens=128, eval_every=1000, warmup=2, checkpoint_every=3, lr=3e-3, user_eval_prompts=0,
                gen_batch=2)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return _target()


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "asks.txt"
    path.write_text("\n".join(TEXTS) + "\n")
    return path


@pytest.fixture(scope="module")
def trained(tiny, prompt_file, tmp_path_factory):
    """A drafter trained on the prompt file, with the user-prompt evaluation in its train.json."""
    target, tok = tiny
    out = tmp_path_factory.mktemp("run")
    path = train_drafter(_cfg(prompts=str(prompt_file), user_eval_depth=3), out, target=target, tokenizer=tok,
                         heldout=HELD, user_prompts=USERS, progress=False, quiet=True)
    return path, out


def test_file_prompts_become_the_training_prompts(trained):
    _, out = trained
    data = torch.load(out / "data.pt", weights_only=False)
    prompts = [e["prompt"] for e in data["examples"]]
    assert len(prompts) == 8 and len(set(prompts)) == 8
    assert set(prompts) <= set(TEXTS) and TEXTS[3] not in prompts  # the held-out one is filtered
    assert data["info"]["dropped"]["heldout"] == 1 and data["config"]["prompts"].endswith("asks.txt")
    # the prompt tokens are the chat-templated text, then the target's greedy answer
    for e in data["examples"]:
        assert e["n_prompt"] < len(e["ids"]) and e["features"].shape[0] == len(e["ids"])
    assert not (out / "data.parts").exists()  # assembled into data.pt


def test_selection_is_a_deterministic_seeded_shuffle_with_truncation(tiny):
    _, tok = tiny
    a, _ = select_prompts(TEXTS, 5, tok, max_prompt_tokens=64, seed=1)
    b, _ = select_prompts(TEXTS, 5, tok, max_prompt_tokens=64, seed=1)
    c, _ = select_prompts(TEXTS, 5, tok, max_prompt_tokens=64, seed=2)
    assert a == b and a != c and set(a) <= set(TEXTS)
    cut, dropped = select_prompts(TEXTS, 3, tok, max_prompt_tokens=10, seed=1)
    assert all(len(tok(t, add_special_tokens=False)["input_ids"]) <= 10 for t in cut)
    assert dropped["truncated (kept)"] == 3 and [t[:6] for t in cut] == [t[:6] for t in a[:3]]
    with pytest.raises(ValueError, match="only 9 usable prompts"):
        select_prompts(TEXTS + ["short"], 11, tok, max_prompt_tokens=64, heldout=HeldOut(HELD), source="asks.txt")


def test_heldout_covers_every_evaluation_set(monkeypatch):
    monkeypatch.setattr(train_data, "load_prompts", lambda src: [Prompt(f"{src}/1", f"text of {src}")])
    assert heldout_texts() == ["text of mt-bench", "text of humaneval", "text of sharegpt"]


@pytest.mark.parametrize("source", ["sharegpt", "mt-bench", "HumanEval"])
def test_evaluation_sets_are_refused_as_training_prompts(tiny, tmp_path, source):
    target, tok = tiny
    with pytest.raises(ValueError, match="never trained on"):
        train_drafter(_cfg(prompts=source), tmp_path, target=target, tokenizer=tok, progress=False, quiet=True)
    assert not (tmp_path / "config.json").exists()


def test_heldout_containment_is_by_whole_words():
    h = HeldOut(["hi", "write a poem", "Compose an engaging travel blog post about a recent trip to Hawaii."])
    assert h.overlaps("Hi") and h.overlaps("Please write a poem about cats.") and h.overlaps("a recent trip")
    # a held-out "hi" must not drop every prompt containing "hi" or "this"
    assert not h.overlaps("hi there, this is a question about physics")
    assert not h.overlaps("write a poetry review")


def test_user_prompt_evaluation_is_read_by_k_auto(tiny, trained):
    target, _ = tiny
    path, out = trained
    rec = json.loads((out / "train.json").read_text())
    ev = rec[USER_EVAL_KEY]
    assert ev["prompts"] == 3 and ev["sources"] == ["humaneval", "mt-bench", "sharegpt"] and ev["positions"] > 0
    assert "accept@3" in ev and "accept@4" not in ev
    # a depth no row reaches (every draft before it rejected) is null: -k auto reads the depths before it
    acc = [ev[f"accept@{d}"] for d in (1, 2, 3)]
    measured = tuple(a for a in acc[: acc.index(None)] if a is not None) if None in acc else tuple(acc)
    assert measured and all(0.0 <= a <= 1.0 for a in measured)
    assert ev["reach@1"] >= ev["reach@2"] >= ev["reach@3"] and ev["reach@1"] == pytest.approx(acc[0])
    read = acceptance_of(str(path))
    assert read.by_depth == pytest.approx(measured) and USER_EVAL_KEY in read.source


def test_depth_one_acceptance_matches_a_plain_forward(tiny, trained, tmp_path):
    """accept@1 = how often the drafter's greedy token after a verified answer token is the target's next one."""
    target, tok = tiny
    path, out = trained
    d = load_eagle(path, target, dtype=torch.float64)
    ev = evaluate_on_user_prompts(target, tok, d, USERS, depth=2, max_new_tokens=64, cache=tmp_path / "ue.pt")
    examples = torch.load(tmp_path / "ue.pt", weights_only=False)["examples"]
    hits = rows = 0
    with torch.no_grad():
        for e in examples:
            ids = e["ids"]
            q = d(torch.tensor([ids])).logits[0]  # [T, V]: q[t] predicts token t + 1
            for s in range(e["n_prompt"] - 1, len(ids) - 2):  # drafter row s drafts token s + 2
                rows += 1
                hits += int(q[s + 1].argmax()) == ids[s + 2]
    assert hits >= 3  # else the comparison below could not tell a shifted row from the right one
    assert rows == ev["positions"] and ev["accept@1"] == pytest.approx(hits / rows)


@pytest.mark.parametrize("source", ["self", "file"])
def test_interrupted_data_generation_resumes_where_it_stopped(tiny, prompt_file, tmp_path, monkeypatch, source):
    target, tok = tiny
    cfg = _cfg(prompts="self" if source == "self" else str(prompt_file), max_prompt_tokens=16, epochs=0.5)
    whole = train_drafter(cfg, tmp_path / "whole", target=target, tokenizer=tok, heldout=HELD, progress=False, quiet=True)
    assert whole is not None
    real = train_data._batched_generate
    calls = {"answers": 0, "prompts": 0}

    def flaky(*a, **kw):
        key = "answers" if kw.get("features") else "prompts"
        calls[key] += 1
        if limit is not None and calls["answers"] > limit:
            raise KeyboardInterrupt  # Ctrl-C during the third chunk of answers
        return real(*a, **kw)

    monkeypatch.setattr(train_data, "_batched_generate", flaky)
    limit = 2
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train_drafter(cfg, run, target=target, tokenizer=tok, heldout=HELD, progress=False, quiet=True)
    saved = sorted(p.name for p in (run / "data.parts").glob("answers-*.pt"))
    assert saved == ["answers-00000.pt", "answers-00001.pt"] and not (run / "data.pt").exists()
    limit, calls["answers"], calls["prompts"] = None, 0, 0
    assert train_drafter(cfg, run, target=target, tokenizer=tok, heldout=HELD, progress=False, quiet=True) is not None
    assert calls == {"answers": 2, "prompts": 0}  # the two missing chunks only; the prompts were saved
    a = torch.load(tmp_path / "whole" / "data.pt", weights_only=False)["examples"]
    b = torch.load(run / "data.pt", weights_only=False)["examples"]
    assert [e["prompt"] for e in a] == [e["prompt"] for e in b] and [e["ids"] for e in a] == [e["ids"] for e in b]
    assert all(torch.equal(x["features"], y["features"]) for x, y in zip(a, b))


def test_a_stage_ends_cleanly_and_the_rerun_finishes(tiny, prompt_file, tmp_path):
    target, tok = tiny
    cfg = _cfg(prompts=str(prompt_file), epochs=0.5)
    assert train_drafter(cfg, tmp_path, target=target, tokenizer=tok, heldout=HELD, progress=False, quiet=True,
                         stage_minutes=1e-9) is None
    assert (tmp_path / "data.parts" / "selected.json").is_file() and not (tmp_path / "data.pt").exists()
    assert "rerun the same command" in (tmp_path / "train.log").read_text()
    assert train_drafter(cfg, tmp_path, target=target, tokenizer=tok, heldout=HELD, progress=False, quiet=True) is not None
    # a later stage reads the radii and the draft vocabulary back instead of recomputing them
    assert "radii and draft vocabulary from" not in (tmp_path / "train.log").read_text()
    assert train_drafter(cfg, tmp_path, target=target, tokenizer=tok, heldout=HELD, progress=False, quiet=True) is not None
    assert "radii and draft vocabulary from" in (tmp_path / "train.log").read_text()


def test_cli_trains_on_a_jsonl_file_and_evaluates_an_existing_drafter(tmp_path, monkeypatch, capsys):
    model, tok = _target(seed=2)
    model.to(torch.float32)
    model.save_pretrained(tmp_path / "ckpt")
    tok.save_pretrained(tmp_path / "ckpt")
    asks = tmp_path / "asks.jsonl"
    asks.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS))
    monkeypatch.setattr(train_loop, "heldout_texts", lambda: HELD)  # no download in CI
    monkeypatch.setattr(user_eval, "load_prompts", lambda src: [p for p in USERS if p.id.startswith(src)])
    rc = main(["train-drafter", "--target", str(tmp_path / "ckpt"), "--out", str(tmp_path / "run"), "--prompts",
               str(asks), "--examples", "6", "--heldout-examples", "2", "--max-new-tokens", "8", "--draft-vocab", "64",
               "--epochs", "1", "--batch-tokens", "128", "--user-eval-prompts", "3", "--user-eval-depth", "2", "--quiet"])
    assert rc == 0
    drafter = capsys.readouterr().out.strip()
    rec = json.loads((tmp_path / "run" / "train.json").read_text())
    assert rec["prompts"] == str(asks) and rec[USER_EVAL_KEY]["prompts"] == 3
    data = torch.load(tmp_path / "run" / "data.pt", weights_only=False)
    prompts = {e["prompt"] for e in data["examples"]}
    assert len(prompts) == 8 and prompts <= set(TEXTS) - {TEXTS[3]}
    # --evaluate-only: the same figures for the existing file, written into OUT/train.json
    rc = main(["train-drafter", "--target", str(tmp_path / "ckpt"), "--out", str(tmp_path / "eval"), "--evaluate-only",
               drafter, "--max-new-tokens", "8", "--user-eval-prompts", "3", "--user-eval-depth", "2", "--quiet"])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    again = json.loads((tmp_path / "eval" / "train.json").read_text())[USER_EVAL_KEY]
    assert printed[USER_EVAL_KEY] == again
    assert again["accept@1"] == pytest.approx(rec[USER_EVAL_KEY]["accept@1"])
    assert acceptance_of(drafter).by_depth == pytest.approx((again["accept@1"], again["accept@2"]))
    assert main(["train-drafter", "--out", str(tmp_path / "x"), "--evaluate-only", "self:skip=1"]) == 2
    assert "not a feature drafter" in capsys.readouterr().err


def test_merge_keeps_other_keys(tmp_path):
    (tmp_path / "train.json").write_text(json.dumps({"heldout_eval_fp16": {"accept@1": 0.5}}))
    merge_into_train_json(tmp_path, {"accept@1": 0.25})
    rec = json.loads((tmp_path / "train.json").read_text())
    assert rec == {"heldout_eval_fp16": {"accept@1": 0.5}, USER_EVAL_KEY: {"accept@1": 0.25}}
