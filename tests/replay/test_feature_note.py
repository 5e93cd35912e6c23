"""Replay of a feature drafter's trace is labelled: deeper drafts use the drafter's own features."""

from draftcert.replay.trace_reader import is_feature_drafter


def test_feature_drafters_are_recognised_and_token_drafters_are_not(tmp_path):
    assert is_feature_drafter("eagle:smollm2-135m-instruct")
    assert is_feature_drafter(str(tmp_path / "drafter.safetensors"))
    for spec in ("self:skip=5", "self:quant=4", "prompt-lookup", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        assert not is_feature_drafter(spec)
