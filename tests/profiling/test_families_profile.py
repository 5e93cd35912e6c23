"""The profiler's batched passes on every model family of the decode matrix (tests/decode/families.py).

``profile`` generates the target's greedy text in left-padded batches (``GreedyRun``: rows that hit
EOS leave the cache) and scores the drafter teacher-forced on it (``score_teacher_forced``).  Each
must give every row what it gives alone, on attention, sliding, hybrid, recurrent, ALiBi and local
layers alike; a model that keeps state on its own modules (RecurrentGemma) is profiled row by row
(``models.hf.module_states``), and alone it is exact too.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from draftcert.decode import greedy_generate
from draftcert.models.hf import module_states
from draftcert.profile.greedy_steps import GreedyRun, score_teacher_forced

from ..decode.families import EOS, FAMILIES, PAD, build

PROMPTS = [[5, 9, 17, 33, 5, 9, 17], [9, 17, 40, 3, 5, 9, 17, 33, 40, 3, 12], [21, 22, 23, 24, 25, 21, 22, 23]]
NEW = 12


@pytest.mark.parametrize("name", list(FAMILIES))
def test_profile_batches_equal_rows_alone(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build(name, seed=0)
    refs = [greedy_generate(model, p, NEW, eos_token_id=EOS) for p in PROMPTS]
    # a row ends early: the EOS is the 3rd token of the second row's text (and it has not come before)
    eos = {EOS, refs[1][2]} if refs[1][2] not in refs[1][:2] else {EOS}
    refs = [greedy_generate(model, p, NEW, eos_token_id=sorted(eos)) for p in PROMPTS]
    batches = [[i] for i in range(len(PROMPTS))] if module_states(model) else [list(range(len(PROMPTS)))]
    for rows in batches:
        prompts = [PROMPTS[i] for i in rows]
        run = GreedyRun(model, prompts, NEW, eos, pad_id=PAD)
        for _ in run.steps():
            pass
        assert run.continuations == [refs[i] for i in rows], f"{name}: batched greedy text differs"
        logits, index = score_teacher_forced(model, prompts, [refs[i] for i in rows], pad_id=PAD)
        for b, i in enumerate(rows):
            p, r = PROMPTS[i], refs[i]
            with torch.no_grad():
                alone = model(torch.tensor([p + r]), use_cache=False).logits[0, len(p) - 1:len(p) - 1 + len(r)]
            torch.testing.assert_close(logits[b, index[b]:index[b] + len(r)], alone, atol=1e-4, rtol=1e-4)
