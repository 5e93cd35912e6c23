"""Feature (EAGLE-style) drafter: training objectives, save/load, resume, lossless decoding, errors.

All on a tiny random Qwen3 target built in code (float64, so that a k-token verification and
1-token decoding agree to ~1e-15 and strict losslessness is an exact test).
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

import draftcert as dc
from draftcert.cli import main
from draftcert.decode import greedy_generate, speculative_generate
from draftcert.drafting.feature_drafter import FeatureDrafter
from draftcert.models import load_drafter, load_target
from tests.tiny_models import tiny_qwen3
from draftcert.models.eagle import EagleDrafter, load_eagle, save_eagle, target_hidden
from draftcert.prompts import encode_prompt
from draftcert.train import TrainConfig, train_drafter
from draftcert.train import loop as train_loop
from draftcert.train.distill_data import HeldOut, collate, radii_of
from draftcert.train.objective import batch_loss, kl_full

HELD = ["Write a haiku about rain.", "def add(a, b):\n    \"\"\"Return a + b.\"\"\""]


def _target(seed=0):
    model, tok = tiny_qwen3(seed, num_layers=2, hidden_size=48, intermediate_size=96, init_std=0.15)
    model.to(torch.float64)
    model.generation_config.eos_token_id = 258
    return model, tok


def _cfg(**kw):
    base = dict(examples=6, heldout_examples=2, max_prompt_tokens=16, max_new_tokens=16, draft_vocab=64, epochs=4,
                batch_tokens=128, eval_every=1000, warmup=2, checkpoint_every=3, lr=3e-3,
                user_eval_prompts=0)  # the user-prompt evaluation downloads its sets: tests/train/test_user_prompts.py
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return _target()


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    """A drafter trained a few steps on self-generated data (and its data file)."""
    target, tok = tiny
    out = tmp_path_factory.mktemp("cert")
    path = train_drafter(_cfg(), out, target=target, tokenizer=tok, heldout=HELD, progress=False, quiet=True)
    return load_eagle(path, target, dtype=torch.float64), out


@pytest.mark.parametrize("objective", ["kl", "certificate"])
def test_a_few_steps_reduce_the_loss(tiny, trained, objective):
    target, tok = tiny
    data = torch.load(trained[1] / "data.pt", weights_only=False)
    ex = data["examples"]
    cfg = _cfg(objective=objective)
    radii_of(target, ex, cfg.criterion, lambda m: None)
    torch.manual_seed(0)
    d = EagleDrafter(target, torch.arange(64)).to(torch.float64)
    d.train()
    hw = d.head_weight().detach()
    batch = collate(ex, list(range(4)), torch.float64, "cpu")
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(15):
        loss = batch_loss(d, batch, cfg, hw, d.vocab_ids, 259)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("objective", ["kl", "certificate"])
def test_the_draft_vocabularys_teacher_terms_give_the_full_logits_loss(tiny, trained, objective):
    """Training's loss from the stored normaliser and negentropy and the draft vocabulary's logits
    alone equals the loss from the teacher's full [B, T, V] logits, value and gradient."""
    target, tok = tiny
    ex = torch.load(trained[1] / "data.pt", weights_only=False)["examples"]
    cfg = _cfg(objective=objective)
    radii_of(target, ex, cfg.criterion, lambda m: None)
    torch.manual_seed(0)
    d = EagleDrafter(target, torch.arange(0, 259, 3)).to(torch.float64)  # a draft vocabulary of every third token
    hw = d.head_weight().detach()
    batch = collate(ex, list(range(4)), torch.float64, "cpu")
    assert batch[5] is not None and batch[6] is not None
    grads = []
    for b in (batch, batch[:5]):  # with the stored terms; without them (the full logits)
        d.zero_grad()
        loss = batch_loss(d, b, cfg, hw, d.vocab_ids, 259)
        loss.backward()
        grads.append((float(loss.detach()), [p.grad.clone() for p in d.parameters() if p.grad is not None]))
    (l1, g1), (l2, g2) = grads
    assert l1 == pytest.approx(l2, rel=1e-5) and l1 > 0
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def test_a_bfloat16_autocast_trains_and_says_so(tiny, tmp_path):
    """``autocast="bfloat16"`` runs the drafter's steps under a CPU autocast to a finite held-out loss, and
    the log names it; an unknown value is refused before anything runs."""
    target, tok = tiny
    target32 = _target()[0].to(torch.float32)
    out = tmp_path / "bf16"
    path = train_drafter(_cfg(), out, target=target32, tokenizer=tok, heldout=HELD, progress=False, quiet=True,
                         autocast="bfloat16")
    log = (out / "train.log").read_text()
    assert path is not None and "steps in bfloat16" in log
    losses = [json.loads(line.split("eval ", 1)[1])["loss"] for line in log.splitlines() if " eval " in line]
    assert losses and all(math.isfinite(x) for x in losses)
    with pytest.raises(ValueError, match="--autocast"):
        train_drafter(_cfg(), tmp_path / "x", target=target32, tokenizer=tok, autocast="fp8")


def test_save_load_round_trips_bit_exactly(tiny, trained, tmp_path):
    target, _ = tiny
    d, _ = trained
    p1 = save_eagle(d, tmp_path / "a.safetensors", dtype=None)
    back = load_eagle(p1, target, dtype=torch.float64)
    for (k, a), (k2, b) in zip(sorted(d.trainable_state().items()), sorted(back.trainable_state().items())):
        assert k == k2 and a.dtype == b.dtype and torch.equal(a, b), k
    # fp16 (the shipped format): writing what was read gives the same bytes
    p2 = save_eagle(back, tmp_path / "b.safetensors")
    again = load_eagle(p2, target, dtype=torch.float64)
    p3 = save_eagle(again, tmp_path / "c.safetensors")
    from safetensors import safe_open

    with safe_open(str(p2), "pt") as f2, safe_open(str(p3), "pt") as f3:
        assert f2.metadata() == f3.metadata() and sorted(f2.keys()) == sorted(f3.keys())
        for k in f2.keys():
            a, b = f2.get_tensor(k), f3.get_tensor(k)
            assert a.dtype == b.dtype and torch.equal(a, b), k


@pytest.mark.parametrize("tree", [None, (2, 3), [2, 2, 1]])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_strict_decoding_with_trained_drafter_is_lossless(tiny, trained, tree, k):
    target, tok = tiny
    d, _ = trained
    g = torch.Generator().manual_seed(3)
    for n in (4, 11):
        prompt = torch.randint(0, 256, (n,), generator=g).tolist()
        ref = greedy_generate(target, prompt, 20, eos_token_id=[])
        res = speculative_generate(target, d, prompt, "strict", k=k, tree=tree, max_new_tokens=20, eos_token_id=[])
        assert res.tokens == ref
        assert res.stats.drafter_forwards > 0 and res.stats.checked_positions > 0


@pytest.mark.parametrize("criterion", ["additive:0.1", "topm:2", "entropy:0.09:0.3", "mars:0.5", "tree:2"])
def test_every_rule_runs_with_live_certificates(tiny, trained, criterion):
    target, tok = tiny
    d, _ = trained
    res = speculative_generate(target, d, [5, 6, 7, 8], criterion, k=3, max_new_tokens=16, eos_token_id=[])
    assert len(res.tokens) == 16 and res.stats.checked_positions > 0  # a violation would have raised


def test_reduced_vocabulary_gives_finite_divergences(tiny, trained):
    target, _ = tiny
    d, _ = trained
    assert d.n_draft_vocab < d.vocab_size
    ids = torch.tensor([[3, 9, 27, 81, 100, 200]])
    q = d(ids).logits[0, 1:]
    p = target(ids).logits[0, 1:]
    assert torch.isfinite(q).all()
    kl = dc.divergence(torch.softmax(p, -1), torch.softmax(q.double(), -1), "forward")
    assert torch.isfinite(torch.as_tensor(kl)).all()
    # out-of-vocabulary tokens share the tail mass equally and every token has q > 0
    qp = torch.softmax(q.double(), -1)
    oov = torch.ones(d.vocab_size, dtype=torch.bool)
    oov[d.vocab_ids] = False
    assert (qp > 0).all()
    assert torch.allclose(qp[:, oov], qp[:, oov][:, :1].expand(-1, int(oov.sum())))
    # the KL used in training equals the library's divergence on the full vocabulary
    red = q[:, d.vocab_ids]
    tail = torch.logsumexp(q[:, oov], -1)
    assert torch.allclose(kl_full(p, red, tail, d.vocab_ids, d.vocab_size).double(), torch.as_tensor(kl).double(), atol=1e-5)


def test_resumed_run_continues_from_its_checkpoint(tiny, tmp_path):
    target, tok = tiny
    cfg = _cfg(epochs=3)
    full = train_drafter(cfg, tmp_path / "full", target=target, tokenizer=tok, heldout=HELD, progress=False, quiet=True)
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full", part, ignore=shutil.ignore_patterns("checkpoint.pt", "drafter.safetensors", "train.*", "config.json"))
    cfg2 = _cfg(epochs=3, data=str(part / "data.pt"))
    assert train_drafter(cfg2, part, target=target, tokenizer=tok, progress=False, quiet=True, max_steps=4) is None
    st = torch.load(part / "checkpoint.pt", weights_only=False)
    assert st["step"] == 4
    resumed = train_drafter(cfg2, part, target=target, tokenizer=tok, progress=False, quiet=True)
    assert "resumed from" in (part / "train.log").read_text()
    a, b = load_eagle(full, target), load_eagle(resumed, target)
    for (k, x), (_, y) in zip(sorted(a.trainable_state().items()), sorted(b.trainable_state().items())):
        assert torch.equal(x, y), k  # the resumed run ends exactly where the uninterrupted one does


def test_the_radii_hand_freed_heap_pages_back_as_they_go(tiny, trained, monkeypatch):
    """``radii_of`` calls ``malloc_trim`` every RELEASE_EVERY examples (each example's [T, V] temporaries
    left a fragmented heap resident: a 24,000-example run grew past 24 GB), and the radii are the same."""
    from draftcert.train import distill_data

    target, _ = tiny
    data = torch.load(trained[1] / "data.pt", weights_only=False)["examples"]
    examples = [dict(e) for e in data] * 2
    for e in examples:
        e.pop("radius", None), e.pop("teacher_lse", None)
    calls = []
    monkeypatch.setattr(distill_data, "RELEASE_EVERY", 3)
    monkeypatch.setattr(distill_data, "_release_free_memory", lambda: calls.append(1))
    released = [dict(e) for e in examples]
    radii_of(target, released, "strict", lambda m: None)
    assert len(calls) == len(examples) // 3
    monkeypatch.undo()
    distill_data._release_free_memory()  # the real call: glibc's malloc_trim here, a no-op elsewhere
    plain = [dict(e) for e in examples]
    radii_of(target, plain, "strict", lambda m: None)
    for a, b in zip(released, plain):
        assert torch.equal(a["radius"], b["radius"]) and torch.equal(a["teacher_lse"], b["teacher_lse"])


def test_the_radii_stage_resumes_in_pieces_to_the_same_radii_and_vocabulary(tiny, trained, tmp_path, monkeypatch):
    """The radii stage saves pieces of RADII_CHUNK examples: one cut short by its deadline and rerun
    gives the radii and the draft vocabulary of one uninterrupted run (the vocabulary's running score is
    the same float64 sum as over every example at once), and keeps no example's [V] expected counts."""
    from draftcert.train.distill_data import draft_vocabulary
    from draftcert.models.hf import eos_token_ids, vocab_size_of

    target, tok = tiny
    data = torch.load(trained[1] / "data.pt", weights_only=False)["examples"]
    examples = [dict(e) for e in data] * 3  # 24 examples: pieces of 5 below
    cfg = _cfg()
    n_train = len(examples) - 2
    monkeypatch.setattr(train_loop, "RADII_CHUNK", 5)
    whole = [dict(e) for e in examples]
    radii_of(target, whole, cfg.criterion, lambda m: None)
    want = draft_vocabulary(whole[:n_train], cfg.draft_vocab, vocab_size_of(target), always=sorted(eos_token_ids(target, tok)))
    first = [dict(e) for e in examples]
    cache = tmp_path / "radii.pt"
    calls = []
    real = train_loop.radii_of

    def counted(target, chunk, *args, **kw):  # the deadline passes after two pieces
        calls.append(len(chunk))
        return real(target, chunk, *args, **kw)

    monkeypatch.setattr(train_loop, "radii_of", counted)
    import time as real_time
    from types import SimpleNamespace

    # loop.py's clock: past the deadline once two pieces are done
    fake = SimpleNamespace(monotonic=lambda: 10.0 if len(calls) >= 2 else 0.0, perf_counter=real_time.perf_counter)
    monkeypatch.setattr(train_loop, "time", fake)
    assert train_loop.radii_and_vocabulary(cfg, target, tok, first, n_train, cache, lambda m: None, False,
                                           deadline=5.0) is None
    assert calls == [5, 5] and len(list((tmp_path / "radii.parts").glob("radii-*.pt"))) == 2 and not cache.exists()
    monkeypatch.undo()
    monkeypatch.setattr(train_loop, "RADII_CHUNK", 5)
    again = [dict(e) for e in examples]
    got = train_loop.radii_and_vocabulary(cfg, target, tok, again, n_train, cache, lambda m: None, False)
    assert torch.equal(got, want) and cache.is_file() and not (tmp_path / "radii.parts").exists()
    for a, b in zip(again, whole):
        assert torch.equal(a["radius"], b["radius"]) and torch.equal(a["teacher_lse"], b["teacher_lse"])
        assert "mass" not in a


def test_mismatched_drafter_is_refused(trained, tmp_path):
    d, _ = trained
    other, tok = _target(seed=1)
    path = save_eagle(d, tmp_path / "d.safetensors")
    with pytest.raises(ValueError, match="another target"):
        load_eagle(path, other)
    with pytest.raises(ValueError, match="does not match"):
        speculative_generate(other, d, [1, 2, 3], "strict", max_new_tokens=4)
    bigger, _ = tiny_qwen3(0, num_layers=2, hidden_size=64, intermediate_size=96, init_std=0.15)
    with pytest.raises(ValueError, match="another target"):
        load_eagle(path, bigger)


def test_corrupt_or_foreign_files_are_refused(tiny, trained, tmp_path):
    target, _ = tiny
    d, _ = trained
    good = save_eagle(d, tmp_path / "d.safetensors").read_bytes()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError, match="not a readable safetensors"):
        load_eagle(bad, target)
    bad.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a readable safetensors"):
        load_eagle(bad, target)
    with pytest.raises(ValueError, match="no such file"):
        load_eagle(tmp_path / "missing.safetensors", target)
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(bad))
    with pytest.raises(ValueError, match="format"):
        load_eagle(bad, target)
    # through the drafter spec used by the CLI
    with pytest.raises(ValueError):
        load_drafter(str(bad), target, None)


def test_training_prompts_never_overlap_heldout(tiny, trained):
    _, out = trained
    data = torch.load(out / "data.pt", weights_only=False)
    held = HeldOut(HELD)
    assert data["examples"] and not any(held.overlaps(e["prompt"]) for e in data["examples"])
    # the filter itself: equal, contained, containing, or sharing an 8-word run
    h = HeldOut(["Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences."])
    assert h.overlaps("compose an engaging travel blog post about a recent trip to hawaii, highlighting cultural experiences")
    assert h.overlaps("Please: Compose an engaging travel blog post about a recent trip to Hawaii now")
    assert h.overlaps("a recent trip")
    assert not h.overlaps("Write a poem about the sea and the sky at night.")


def test_embedded_heldout_sets_are_excluded_from_training(monkeypatch, tiny, tmp_path):
    """The default held-out set is every MT-Bench and HumanEval prompt, and generation filters on it."""
    seen = {}
    real = train_loop.HeldOut

    def spy(texts, n=8):
        seen["texts"] = list(texts)
        return real(texts, n)

    monkeypatch.setattr(train_loop, "heldout_texts", lambda: ["mt-bench prompt one two three", "humaneval prompt"])
    monkeypatch.setattr(train_loop, "HeldOut", spy)
    target, tok = tiny
    train_drafter(_cfg(epochs=0.1), tmp_path, target=target, tokenizer=tok, progress=False, quiet=True)
    assert seen["texts"] == ["mt-bench prompt one two three", "humaneval prompt"]


def test_feature_drafter_first_round_is_the_prefill(tiny, trained):
    target, _ = tiny
    d, _ = trained
    res = speculative_generate(target, d, [1, 2, 3], "strict", k=4, max_new_tokens=10, eos_token_id=[])
    assert res.stats.rounds[0].num_draft_tokens == 0 and res.stats.rounds[1].num_draft_tokens == 4
    assert isinstance(dc.decode.make_drafter(d, target), FeatureDrafter)


# ----------------------------------------------------------------------------- command line


@pytest.fixture(scope="module")
def ckpt_and_drafter(tmp_path_factory):

    model, tok = _target(seed=2)
    model.to(torch.float32)
    root = tmp_path_factory.mktemp("cli")
    model.save_pretrained(root / "ckpt")
    tok.save_pretrained(root / "ckpt")
    real = train_loop.heldout_texts
    train_loop.heldout_texts = lambda: HELD  # no download in CI
    try:
        rc = main(["train-drafter", "--target", str(root / "ckpt"), "--out", str(root / "run"), "--examples", "6",
                   "--heldout-examples", "2", "--max-new-tokens", "12", "--draft-vocab", "64", "--epochs", "2",
                   "--batch-tokens", "128", "--user-eval-prompts", "0", "--quiet"])
    finally:
        train_loop.heldout_texts = real
    assert rc == 0
    assert (root / "run" / "train.log").is_file() and (root / "run" / "train.json").is_file()
    return str(root / "ckpt"), str(root / "run" / "drafter.safetensors")


def test_cli_decode_with_trained_drafter_is_lossless(ckpt_and_drafter, capsys):
    ckpt, drafter = ckpt_and_drafter
    for extra in ([], ["--tree", "2,3"]):
        rc = main(["decode", "--target", ckpt, "--drafter", drafter, "--prompt", "hello there", "-k", "3",
                   "--max-new-tokens", "12", "--json", *extra])
        assert rc == 0
        lines = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
        toks = [t for r in lines[:-1] for t in r["emitted"]]
        model, tok = load_target(ckpt)
        ref = greedy_generate(model, encode_prompt(tok, "hello there"), 12)
        assert toks == ref[: len(toks)] and len(toks) == len(ref)


def test_cli_profile_with_trained_drafter(ckpt_and_drafter, tmp_path, capsys):
    ckpt, drafter = ckpt_and_drafter
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello there\nwrite a list\n")
    rc = main(["profile", "--target", ckpt, "--drafter", drafter, "--prompts", str(prompts), "--max-new-tokens", "6",
               "--out", str(tmp_path / "prof")])
    assert rc == 0
    assert list((tmp_path / "prof" / "trace").glob("*.parquet"))


def test_cli_refuses_corrupt_or_mismatched_drafter(ckpt_and_drafter, tmp_path, capsys):
    ckpt, drafter = ckpt_and_drafter
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 64)
    assert main(["decode", "--target", ckpt, "--drafter", str(bad), "--prompt", "hi", "--max-new-tokens", "4"]) == 2
    assert "not a readable safetensors" in capsys.readouterr().err
    other, tok = _target(seed=5)
    other.save_pretrained(tmp_path / "other")
    tok.save_pretrained(tmp_path / "other")
    assert main(["decode", "--target", str(tmp_path / "other"), "--drafter", drafter, "--prompt", "hi", "--max-new-tokens", "4"]) == 2
    assert "another target" in capsys.readouterr().err


def test_features_collected_while_generating_match_a_teacher_forced_pass(tiny, trained):
    """The stored features are the target's final hidden states at every kept position."""
    target, _ = tiny
    data = torch.load(trained[1] / "data.pt", weights_only=False)
    for e in data["examples"][:3]:
        f = target_hidden(target, torch.tensor([e["ids"]]))
        logits = f @ target.get_output_embeddings().weight.T
        assert e["features"].shape == (len(e["ids"]), f.shape[-1])
        assert torch.allclose(e["features"].double(), f[0].double(), atol=1e-6)
        # and the response is the target's greedy continuation: argmax at each response position
        resp = e["ids"][e["n_prompt"]:]
        assert logits[0, e["n_prompt"] - 1 : len(e["ids"]) - 1].argmax(-1).tolist() == resp


@pytest.mark.parametrize("tree", [None, [8, 2]])
def test_tokens_outside_the_draft_vocabulary_are_never_proposed(tiny, trained, tree):
    """A drafter whose tail logit outranks its whole draft vocabulary (bias +100) still proposes only
    draft-vocabulary tokens, in a chain and in a tree of width PROPOSAL_WIDTH; the cap binds there,
    and q stays a distribution on the full vocabulary."""
    import copy

    from draftcert.models.eagle import PROPOSAL_WIDTH

    target, _ = tiny
    d = copy.deepcopy(trained[0]).bind(target)
    with torch.no_grad():
        d.tail.bias.fill_(100.0)
    assert tree is None or tree[0] == PROPOSAL_WIDTH
    seen = []

    class Spy(FeatureDrafter):
        def propose(self, *a, **kw):
            t = super().propose(*a, **kw)
            seen.extend(t.tokens)
            return t

    prompt = list(range(5, 14))
    ref = greedy_generate(target, prompt, 12, eos_token_id=[])
    res = speculative_generate(target, Spy(d), prompt, "strict", k=3, tree=tree, max_new_tokens=12, eos_token_id=[])
    assert res.tokens == ref and seen
    assert set(seen) <= set(d.vocab_ids.tolist())
    # the cap is what kept them out: uncapped, the tail's share per token outranks every draft logit
    ids = torch.tensor([prompt])
    f = target_hidden(target, ids)
    T = len(prompt) - 1
    mask = torch.triu(torch.full((T, T), torch.finfo(d.dtype).min, dtype=d.dtype), 1)[None, None]
    g, red, tail = d.step(ids[:, 1:], f[:, :-1], torch.arange(T)[None], mask)
    raw = d.tail(g).squeeze(-1)
    spread = math.log(d.vocab_size - d.n_draft_vocab)
    assert bool((raw - spread > red.max(-1).values).all()) and bool((tail < raw).all())
    q = torch.softmax(d.full_logits(red, tail), -1)
    torch.testing.assert_close(q.sum(-1), torch.ones_like(q.sum(-1)))
    assert bool((q > 0).all())


def test_a_decodes_cached_embedding_and_rotary_rows_are_the_same_bits(tiny, trained):
    """Outside autograd, one-token steps read the target's embedding rows and the rotary (cos, sin)
    from per-drafter caches: every q row a decode drafts from equals the uncached step's, bit for bit,
    and a rebind drops the cache (rows of another target are never read)."""
    import copy

    target, _ = tiny
    d = copy.deepcopy(trained[0]).bind(target)
    prompt = list(range(5, 14))
    rows: dict[str, list] = {"cached": [], "plain": []}

    class Spy(FeatureDrafter):
        def _step(self, *a, **kw):
            g, q = super()._step(*a, **kw)
            rows[self.kind].append(q.clone())
            return g, q

    def run(kind):
        spy = Spy(d)
        spy.kind = kind
        return speculative_generate(target, spy, prompt, "strict", k=3, max_new_tokens=12, eos_token_id=[]).tokens

    out = run("cached")
    assert d.__dict__["_row_caches"]["embed"][1] and d.__dict__["_row_caches"]["rope"][1]
    d._embed, d._rope = (lambda ids: d.target.get_input_embeddings()(ids).to(d.dtype),
                         lambda x, pos: d.rotary(x, position_ids=pos))
    assert run("plain") == out
    assert len(rows["cached"]) == len(rows["plain"]) > 2
    assert all(torch.equal(a, b) for a, b in zip(rows["cached"], rows["plain"]))
    del d._embed, d._rope
    d.bind(target)
    assert "_row_caches" not in d.__dict__
