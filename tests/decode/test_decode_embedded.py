"""Strict speculative decoding on the embedded SmolLM2-135M-Instruct (float32) is lossless.

Slow (several minutes on 2 CPU cores): ``pytest -m slow tests/decode/test_decode_embedded.py``.
A k-token verification pass and 1-token steps round differently in float32;
identity is still required here -- a flip would mean a near-tie, to be
investigated, not tolerated.
"""

from __future__ import annotations

import pytest
import torch

from draftcert.decode import greedy_generate, speculative_generate

pytestmark = pytest.mark.slow

N_NEW = 32


@pytest.fixture(scope="module")
def embedded():
    from draftcert.models import DEFAULT_DRAFTER, load_drafter, load_target
    from draftcert.prompts import encode_prompt, load_prompts

    target, tok = load_target(None)
    drafter = load_drafter(DEFAULT_DRAFTER, target, tok)
    ids = [encode_prompt(tok, p.text) for p in load_prompts("mt-bench", limit=3)]
    refs = [greedy_generate(target, p, N_NEW) for p in ids]
    return target, drafter, tok, ids, refs


def test_own_greedy_matches_transformers_generate(embedded):
    target, _, _, ids, refs = embedded
    for p, ref in zip(ids, refs):
        x = torch.tensor([p])
        out = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=N_NEW,
                              pad_token_id=target.generation_config.pad_token_id)
        assert out[0, len(p) :].tolist() == ref


@pytest.mark.parametrize("k", range(1, 7))
def test_strict_chain_lossless_on_embedded(embedded, k):
    target, drafter, tok, ids, refs = embedded
    for p, ref in zip(ids, refs):
        res = speculative_generate(target, drafter, p, "strict", k=k, max_new_tokens=N_NEW, tokenizer=tok)
        assert res.tokens == ref


@pytest.mark.parametrize("tree", [(2, 3), (4, 4), [3, 2]])
def test_strict_tree_lossless_on_embedded(embedded, tree):
    target, drafter, tok, ids, refs = embedded
    for p, ref in zip(ids, refs):
        res = speculative_generate(target, drafter, p, "strict", tree=tree, max_new_tokens=N_NEW, tokenizer=tok)
        assert res.tokens == ref


@pytest.mark.parametrize("spec", ["additive:0.1", "topm:2", "entropy:0.09:0.3", "mars:0.5"])
def test_relaxed_on_embedded_never_violates_certificates(embedded, spec):
    """The engine raises CertificateViolation on certified-but-rejected; here it must not."""
    target, drafter, tok, ids, _ = embedded
    res = speculative_generate(target, drafter, ids[0], spec, k=4, max_new_tokens=N_NEW, tokenizer=tok)
    assert res.stats.checked_positions > 0 and len(res.tokens) == N_NEW
