"""The hand-written KV-cache loop against plain full-sequence forwards."""

import torch

from draftcert.profile.greedy_steps import GreedyRun, score_teacher_forced


def _reference_greedy(model, prompt, steps):
    """One prompt alone, no padding, no cache: full forward per step."""
    ids = list(prompt)
    logits_seq, toks = [], []
    with torch.no_grad():
        for _ in range(steps):
            lg = model(input_ids=torch.tensor([ids])).logits[0, -1]
            tok = int(torch.argmax(lg))
            logits_seq.append(lg)
            toks.append(tok)
            ids.append(tok)
    return toks, torch.stack(logits_seq)


def test_batched_cached_greedy_matches_unbatched(target):
    model, tok = target
    prompts = [tok(t)["input_ids"] for t in ["Hello there, how are you?", "Hi", "A medium prompt here"]]
    T = 6
    run = GreedyRun(model, prompts, T, eos_ids=set())
    got = {b: [] for b in range(3)}
    for t, logits, rows, tokens in run.steps():
        for j, b in enumerate(rows.tolist()):
            got[b].append(logits[j])
    for b, p in enumerate(prompts):
        toks, ref = _reference_greedy(model, p, T)
        assert run.continuations[b] == toks
        torch.testing.assert_close(torch.stack(got[b]), ref, atol=2e-4, rtol=1e-4)


def test_rows_stop_at_eos_and_leave_the_cache(target):
    model, tok = target
    prompts = [tok(t)["input_ids"] for t in ["Hello there, how are you?", "Hi"]]
    free = GreedyRun(model, prompts, 6, eos_ids=set())
    for _ in free.steps():
        pass
    eos = free.continuations[0][2]  # row 0 emits this at step 2
    run = GreedyRun(model, prompts, 6, eos_ids={eos})
    active = []
    for t, logits, rows, tokens in run.steps():
        active.append(rows.tolist())
    assert run.continuations[0] == free.continuations[0][:3]  # EOS recorded, then the row stops
    stop1 = free.continuations[1].index(eos) + 1 if eos in free.continuations[1] else 6
    assert run.continuations[1] == free.continuations[1][:stop1]
    assert all(0 not in a for a in active[3:])


def test_teacher_forced_scores_match_full_forward(target):
    model, tok = target
    prompts = [tok(t)["input_ids"] for t in ["Hello there, how are you?", "Hi"]]
    conts = [[5, 9, 33, 2], [7, 7]]
    logits, index = score_teacher_forced(model, prompts, conts)
    with torch.no_grad():
        for b, (p, c) in enumerate(zip(prompts, conts)):
            full = model(input_ids=torch.tensor([p + c])).logits[0]
            for t in range(len(c)):
                torch.testing.assert_close(logits[b, index[b] + t], full[len(p) - 1 + t], atol=2e-4, rtol=1e-4)
