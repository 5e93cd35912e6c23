"""``model.generate(custom_generate=draftcert.generate, ...)`` against transformers' own greedy ``generate``.

A tiny random Qwen3 in float64 (a k-token verification pass and 1-token steps agree to ~1e-15, so
strict identity is an exact test, as in tests/decode).  Under ``strict`` every configuration
(chain, tree, prompt lookup, EOS inside the batch, left-padded batches, stopping criteria, streamer,
the folder form) must give exactly the tensor greedy ``generate`` gives.  The embedded-model test is
``-m slow``.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation import (
    BaseStreamer,
    GenerateDecoderOnlyOutput,
    MaxLengthCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
)

import draftcert
from draftcert.decode import speculative_generate
from draftcert.generation import (
    HUB_FOLDER,
    DraftcertGenerateOutput,
    check_transformers,
    default_drafter,
    write_folder,
)
from draftcert.models import derive_drafter
from tests.tiny_models import tiny_qwen3

N_NEW = 20
PAD = 256


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    model, _ = tiny_qwen3(0, num_layers=4, hidden_size=48, intermediate_size=96, init_std=0.15)
    model.config._attn_implementation = "sdpa"
    model.to(torch.float64)
    model.generation_config.eos_token_id = None  # tests opt into EOS explicitly
    model.generation_config.pad_token_id = PAD
    return model


@pytest.fixture(scope="module")
def skip2(target):
    return derive_drafter(target, "self:skip=2")


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(0, 256, (max(n // 2, 1),), generator=g).tolist()
    return (body * 2)[:n]  # repeated half: prompt lookup finds n-grams to draft from


def _left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, width - len(r):] = torch.tensor(r)
        mask[b, width - len(r):] = 1
    return ids, mask


def _greedy(model, ids, mask=None, **kw):
    return model.generate(ids, attention_mask=mask, do_sample=False, **kw)


def _ours(model, ids, mask=None, **kw):
    return model.generate(ids, attention_mask=mask, custom_generate=draftcert.generate, **kw)


CONFIGS = {
    "chain": dict(k=4),
    "tree-m-depth": dict(tree=(2, 3)),
    "tree-coverage": dict(criterion="tree:3", k=3),
    "static-tree": dict(tree=[2, 2]),
    "prompt-lookup": dict(drafter="prompt-lookup", k=3),
}


def _config(name, skip2):
    kw = dict(CONFIGS[name])
    kw.setdefault("drafter", skip2)
    return kw


@pytest.mark.parametrize("name", list(CONFIGS))
def test_strict_equals_greedy_batch_one(target, skip2, name):
    ids = torch.tensor([_prompt(11, 1)])
    ref = _greedy(target, ids, max_new_tokens=N_NEW)
    out = _ours(target, ids, max_new_tokens=N_NEW, **_config(name, skip2))
    assert torch.equal(out, ref)


def _eos_inside(target, rows, at: int = 4) -> int:
    """A token greedy emits at position ``at`` of row 0 (and not before), used as EOS there."""
    ids = torch.tensor([rows[0]])
    new = _greedy(target, ids, max_new_tokens=N_NEW)[0, len(rows[0]):].tolist()
    for pos in range(at, N_NEW):
        if new[pos] not in new[:pos]:
            return new[pos]
    raise AssertionError("no fresh token in the greedy continuation")


@pytest.mark.parametrize("name", ["chain", "tree-m-depth", "prompt-lookup"])
def test_strict_equals_greedy_with_eos_inside_a_left_padded_batch(target, skip2, name):
    rows = [_prompt(9, 2), _prompt(14, 3), _prompt(5, 4)]
    eos = _eos_inside(target, rows)
    ids, mask = _left_pad(rows)
    ref = _greedy(target, ids, mask, max_new_tokens=N_NEW, eos_token_id=eos)
    out = _ours(target, ids, mask, max_new_tokens=N_NEW, eos_token_id=eos, **_config(name, skip2))
    assert torch.equal(out, ref)
    assert (out[0] == PAD).any()  # row 0 ended early and is padded on the right


@pytest.mark.parametrize("batch", [4, 8])
def test_strict_batch_mixed_lengths_equals_greedy(target, skip2, batch):
    rows = [_prompt(4 + 3 * b, 10 + b) for b in range(batch)]
    ids, mask = _left_pad(rows)
    ref = _greedy(target, ids, mask, max_new_tokens=12)
    out = _ours(target, ids, mask, max_new_tokens=12, drafter=skip2, k=3)
    assert torch.equal(out, ref)


def test_relaxed_rule_rows_equal_the_engine_at_batch_one(target, skip2):
    rows = [_prompt(6, 20), _prompt(12, 21)]
    ids, mask = _left_pad(rows)
    out = _ours(target, ids, mask, max_new_tokens=N_NEW, drafter=skip2, criterion="topm:2", k=3)
    for b, r in enumerate(rows):
        res = speculative_generate(target, skip2, r, "topm:2", k=3, max_new_tokens=N_NEW)
        assert out[b, ids.shape[1]:].tolist() == res.tokens


def test_return_dict_carries_sequences_and_statistics(target, skip2):
    rows = [_prompt(8, 5), _prompt(13, 6)]
    ids, mask = _left_pad(rows)
    ref = _greedy(target, ids, mask, max_new_tokens=N_NEW)
    out = _ours(target, ids, mask, max_new_tokens=N_NEW, drafter=skip2, return_dict_in_generate=True)
    assert isinstance(out, DraftcertGenerateOutput) and isinstance(out, GenerateDecoderOnlyOutput)
    assert torch.equal(out.sequences, ref)
    stats = out.draftcert_stats
    assert stats.criterion == "strict" and len(out.draftcert_row_stats) == 2
    assert stats.emitted == 2 * N_NEW == sum(s.emitted for s in out.draftcert_row_stats)
    assert stats.num_draft_tokens > 0 and stats.drift == 0.0
    assert stats.certified_positions <= stats.checked_positions and stats.checked_positions > 0
    assert out.scores is None and out.past_key_values is None


class StopAfter(StoppingCriteria):
    """Stops a row when its last token is ``token`` (as a user's stop-token criterion would)."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_stopping_criteria_equal_greedy(target, skip2):
    rows = [_prompt(10, 7), _prompt(6, 8)]
    ids, mask = _left_pad(rows)
    stop_tok = _eos_inside(target, rows, at=5)  # mid-round for k=4: the round is cut after it
    one = ids[:1, -len(rows[0]):]
    for x, m, crit in ((one, None, StopAfter(stop_tok)), (ids, mask, MaxLengthCriteria(max_length=ids.shape[1] + 7))):
        sc = StoppingCriteriaList([crit])
        ref = _greedy(target, x, m, max_new_tokens=N_NEW, stopping_criteria=sc)
        out = _ours(target, x, m, max_new_tokens=N_NEW, stopping_criteria=sc, drafter=skip2, k=4)
        assert torch.equal(out, ref), type(crit).__name__
    assert out.shape[1] == ids.shape[1] + 7


def test_a_row_a_criterion_stops_is_padded(target, skip2):
    """transformers lets a row its (non-EOS) criterion stopped run on until the batch ends; draftcert
    pads it (docs/generate.md): the tokens up to the stop are the same."""
    rows = [_prompt(10, 7), _prompt(6, 8)]
    ids, mask = _left_pad(rows)
    stop_tok = _eos_inside(target, rows, at=5)
    sc = StoppingCriteriaList([StopAfter(stop_tok)])
    ref = _greedy(target, ids, mask, max_new_tokens=N_NEW, stopping_criteria=sc)
    out = _ours(target, ids, mask, max_new_tokens=N_NEW, stopping_criteria=sc, drafter=skip2, k=4)
    assert out.shape == ref.shape and torch.equal(out[1], ref[1])
    cut = ids.shape[1] + ref[0, ids.shape[1]:].tolist().index(stop_tok) + 1
    assert torch.equal(out[0, :cut], ref[0, :cut]) and (out[0, cut:] == PAD).all()


class Collector(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.reshape(-1).tolist())

    def end(self):
        self.ended += 1


def test_streamer_sees_what_greedy_streams(target, skip2):
    ids = torch.tensor([_prompt(9, 9)])
    eos = _eos_inside(target, [ids[0].tolist()], at=3)
    ref_s, our_s = Collector(), Collector()
    ref = _greedy(target, ids, max_new_tokens=N_NEW, eos_token_id=eos, streamer=ref_s)
    out = _ours(target, ids, max_new_tokens=N_NEW, eos_token_id=eos, streamer=our_s, drafter=skip2)
    assert torch.equal(out, ref)
    assert our_s.puts == ref_s.puts and our_s.ended == ref_s.ended == 1
    assert our_s.puts[0] == ids[0].tolist()  # the prompt first, then one token per put


def test_assistant_model_is_the_drafter(target, skip2):
    ids = torch.tensor([_prompt(11, 12)])
    ref = _greedy(target, ids, max_new_tokens=N_NEW)
    out = _ours(target, ids, max_new_tokens=N_NEW, assistant_model=skip2, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.draftcert_stats.drafter_forwards > 0  # a model drafted (the tiny target's default has no model)
    with pytest.raises(ValueError, match="both drafter= and assistant_model="):
        _ours(target, ids, max_new_tokens=4, assistant_model=skip2, drafter="prompt-lookup")


def test_default_drafter_off_the_embedded_model_is_suffix_matching(target):
    assert default_drafter(target) == "suffix"
    ids = torch.tensor([_prompt(12, 13)])
    out = _ours(target, ids, max_new_tokens=N_NEW, return_dict_in_generate=True)
    assert torch.equal(out.sequences, _greedy(target, ids, max_new_tokens=N_NEW))
    assert out.draftcert_stats.drafter_forwards == 0


@pytest.mark.parametrize("settings", [
    dict(do_sample=True), dict(num_beams=2), dict(repetition_penalty=1.3), dict(output_scores=True,
                                                                               return_dict_in_generate=True),
])
def test_non_greedy_settings_are_refused(target, settings):
    ids = torch.tensor([_prompt(6, 14)])
    with pytest.raises(ValueError, match="greedy"):
        _ours(target, ids, max_new_tokens=4, **settings)


def test_sampling_is_refused_in_words_of_its_own(target):
    """Issue 51, item 4: do_sample=True said "logits processors (TopKLogitsWarper: from repetition_penalty,
    ...)": the warper transformers adds for sampling, not a setting of the user's."""
    ids = torch.tensor([_prompt(6, 14)])
    with pytest.raises(ValueError) as info:
        _ours(target, ids, max_new_tokens=4, do_sample=True)
    msg = str(info.value)
    assert msg.startswith("draftcert.generate: sampling (do_sample=True) is not supported")
    assert "do_sample=False" in msg and "without custom_generate to sample" in msg
    assert "Warper" not in msg and "repetition_penalty" not in msg


def test_generation_config_object_and_max_length(target, skip2):
    ids = torch.tensor([_prompt(7, 15)])
    gc = GenerationConfig(max_length=ids.shape[1] + 9, pad_token_id=PAD, eos_token_id=None)
    ref = _greedy(target, ids, generation_config=gc)
    out = _ours(target, ids, generation_config=gc, drafter=skip2)
    assert torch.equal(out, ref) and out.shape[1] == ids.shape[1] + 9


def test_lazy_attribute_and_version_check():
    from draftcert.generation import generate

    assert draftcert.generate is generate
    check_transformers("5.24.0")
    with pytest.raises(RuntimeError, match="transformers >= 4.57"):
        check_transformers("4.56.2")
    with pytest.raises(AttributeError):
        draftcert.no_such_name  # noqa: B018


def test_folder_form_loads_from_a_local_path(target, tmp_path):
    root = write_folder(tmp_path / "dc")
    written = root / "custom_generate" / "generate.py"
    assert written.read_text() == (HUB_FOLDER / "generate.py").read_text()
    assert "draftcert" in (root / "custom_generate" / "requirements.txt").read_text()
    rows = [_prompt(8, 16), _prompt(12, 17)]
    ids, mask = _left_pad(rows)
    ref = _greedy(target, ids, mask, max_new_tokens=N_NEW)
    out = target.generate(ids, attention_mask=mask, custom_generate=str(root), trust_remote_code=True,
                          drafter="self:skip=2", criterion="strict", max_new_tokens=N_NEW,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.draftcert_stats.num_draft_tokens > 0
    if "has_local_code=False" in inspect.getsource(type(target).load_custom_generate):
        # 5.x refuses a local folder's code without trust_remote_code (4.57 ran it unasked)
        with pytest.raises(ValueError, match="trust_remote_code"):
            target.generate(ids, attention_mask=mask, custom_generate=str(root), max_new_tokens=4)


def test_generate_on_load_targets_model_warns_nothing():
    """Issue 51, item 7: docs/generate.md's call (two left-padded prompts, the default drafter) on
    ``load_target()``'s model raised transformers' FutureWarning "`past_key_values` is deprecated" from
    lean.py: the written-out decoder's ``(*args, **kwargs)`` signature made ``cache_kwarg`` name the old
    argument.  Every cache is now passed as ``cache``, as transformers 5 names it; no warning at all."""
    import warnings

    from draftcert.models import ModelUnavailable
    from draftcert.models.hf import cache_kwarg

    from tests.test_docs import ROOT, python_blocks

    (_, code), *_ = python_blocks((ROOT / "docs" / "generate.md").read_text())
    assert "load_target()" in code and "PATH" not in code  # the page's first example runs as written
    scope: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            exec(compile(code, "docs/generate.md", "exec"), scope)  # prompt-lookup, topm:2, k=4
        except ModelUnavailable as exc:
            pytest.skip(f"embedded model unavailable: {exc}")
        model, enc = scope["model"], scope["inputs"]
        out = model.generate(**enc, custom_generate=draftcert.generate, max_new_tokens=8,
                             return_dict_in_generate=True)  # the default drafter: the feature drafter + suffix
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == []
    assert scope["out"].sequences.shape[0] == 2 and out.draftcert_stats.num_draft_tokens > 0
    assert torch.equal(out.sequences, model.generate(**enc, do_sample=False, max_new_tokens=8))
    assert cache_kwarg(model.model) == cache_kwarg(model) == "cache"  # the lean decoder reads as LlamaModel
    assert cache_kwarg(model.model.layers[0]) == "cache"


@pytest.mark.slow
def test_embedded_model_default_drafter_equals_greedy():
    """The embedded SmolLM2-135M-Instruct with the shipped feature drafter (the default), batch of 2."""
    from draftcert.models import load_target

    model, tok = load_target(None)
    tok.padding_side = "left"
    enc = tok(["The capital of France is", "Write a haiku about the sea."], return_tensors="pt", padding=True)
    ref = model.generate(**enc, do_sample=False, max_new_tokens=24)
    out = model.generate(**enc, custom_generate=draftcert.generate, max_new_tokens=24, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.draftcert_stats.num_draft_tokens > 0 and out.draftcert_stats.drift == 0.0


class NoFork:
    """A user's drafter object without ``fork``: a batch is then decoded row after row."""

    def __init__(self):
        from draftcert.decode import PromptLookupDrafter

        self.inner = PromptLookupDrafter()
        self.forwards = 0

    def start(self, prompt_ids):
        self.inner.start(prompt_ids)

    def propose(self, seq, widths, expand_all=False):
        return self.inner.propose(seq, widths, expand_all)

    def accept(self, path):
        self.inner.accept(path)


def test_batch_runs_batched_and_a_drafter_without_fork_row_by_row(target, monkeypatch):
    import draftcert.generation.custom as custom

    calls = []
    real = custom.batch_speculative_generate
    monkeypatch.setattr(custom, "batch_speculative_generate", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    rows = [_prompt(7, 30), _prompt(12, 31), _prompt(9, 32)]
    ids, mask = _left_pad(rows)
    ref = _greedy(target, ids, mask, max_new_tokens=N_NEW)
    assert torch.equal(_ours(target, ids, mask, max_new_tokens=N_NEW, drafter="prompt-lookup"), ref)
    assert calls == [1]
    assert torch.equal(_ours(target, ids, mask, max_new_tokens=N_NEW, drafter=NoFork()), ref)
    assert calls == [1]
