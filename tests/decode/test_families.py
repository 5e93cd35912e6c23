"""Strict decoding is the target's greedy decoding on every model family, or refused before any work.

The matrix: one tiny random model per transformers family (``families.py``: full attention,
sliding windows crossed in every case, hybrid and recurrent layers, ALiBi, GPT-Neo's local
layers), each decoded under ``strict`` with a model drafter that disagrees with it part of the
time (a noisy copy: checked below), as

    chain at batch 1 (speculative_generate)       chain at batch 3, left padding, early EOS (batch_speculative_generate)
    tree (2, 2) at batch 1                        tree (2, 2) at batch 3
    generate(custom_generate=draftcert.generate) at batch 3, left-padded input

against transformers' own greedy ``generate`` of each prompt alone.  A case a family cannot run is
asserted as a refusal with its message (trees on recurrent, ALiBi and GPT-Neo-local models), raised
before the drafter or the target ran.  The suite fails if any family silently differs.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import draftcert
from draftcert.decode import batch_speculative_generate, speculative_generate
from draftcert.models.cache_state import layout_of

from .families import EOS, FAMILIES, KIND, PAD, build

NEW = 14
PROMPTS = [[5, 9, 17, 33, 5, 9, 17], [9, 17, 40, 3, 5, 9, 17, 33, 40, 3, 12], [21, 22, 23, 24, 25, 21, 22, 23, 24, 25, 21, 22, 23]]
# what each kind may not do, and the words its refusal must say
TREE_REFUSED = {"hybrid": "recurrent state", "recurrent": "recurrent state", "alibi": "by key column",
                "local": "by key column"}
SERIAL_BATCH = {"hybrid", "recurrent", "alibi", "local"}  # decoded row after row, with a warning
# families refused outright, before any work: RecurrentGemma's state lives on its modules, and its
# roll-back was not exact in every run order (one CI run differed at a 0.28 top-2 margin)
REFUSED = {"recurrent_gemma": "keeps its recurrent state on its own modules"}


def _noisy_copy(model, scale: float = 0.35, seed: int = 1):
    """The drafter: the target with every weight perturbed (agrees on most tokens, not all)."""
    d = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            if p.is_floating_point() and p.ndim >= 2:
                p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return d


def _agreement(target, drafter, seqs) -> float:
    """How often the drafter's argmax is the target's along the target's own greedy sequences."""
    hits = total = 0
    with torch.no_grad():
        for seq in seqs:
            ids = torch.tensor([seq])
            hits += int((target(ids).logits.argmax(-1) == drafter(ids).logits.argmax(-1)).sum())
            total += len(seq)
    return hits / total


def _drafter_for(target, seqs):
    """A noisy copy that agrees with the target on roughly 40-90 % of tokens (the largest noise that does)."""
    for scale in (0.35, 0.2, 0.1, 0.05, 0.02):
        d = _noisy_copy(target, scale)
        if _agreement(target, d, seqs) >= 0.4:
            return d
    return d


def _greedy(model, prompt, eos=EOS):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                         eos_token_id=eos)
    out = out[0, len(prompt):].tolist()
    return out[: out.index(eos) + 1] if eos in out else out


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    name = request.param
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        target = build(name, seed=0)
        refs = [_greedy(target, p) for p in PROMPTS]
        drafter = _drafter_for(target, [p + r for p, r in zip(PROMPTS, refs)])
        # batches end a row early: the EOS is a token the target writes 2nd or later after some prompt,
        # and not before (its 1st, where every row repeats one token)
        b, at = next(((b, i) for b, r in enumerate(refs) for i in range(1, len(r)) if r[i] not in r[:i]), (1, 0))
        eos = refs[b][at]
        refs_eos = [_greedy(target, p, eos) for p in PROMPTS]
    assert len(refs_eos[b]) == at + 1 < NEW
    return name, target, drafter, refs, (eos, refs_eos)


def _strict(target, drafter, prompt, **kw):
    return speculative_generate(target, drafter, prompt, "strict", max_new_tokens=NEW, eos_token_id=EOS,
                                certificates=True, **kw)


def test_chain_batch1(family):
    name, target, drafter, refs, _ = family
    if name in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[name]):
            _strict(target, drafter, PROMPTS[0], k=3)
        return
    drafted = accepted = 0
    for prompt, ref in zip(PROMPTS, refs):
        res = _strict(target, drafter, prompt, k=3)
        assert res.tokens == ref, f"{name}: strict chain differs from greedy generate"
        drafted += res.stats.num_draft_tokens
        accepted += res.stats.num_accepted_tokens
    # the drafter disagrees part of the time: both the accept and the reject paths of the rollback ran
    assert 0 < accepted < drafted, f"{name}: drafter accepted {accepted} of {drafted}"


def test_tree_batch1(family):
    name, target, drafter, refs, _ = family
    kind = KIND[name]
    if name in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[name]):
            _strict(target, drafter, PROMPTS[0], k=2, tree=(2, 2))
        return
    if kind in TREE_REFUSED:
        with pytest.raises(ValueError, match=TREE_REFUSED[kind]):
            _strict(target, drafter, PROMPTS[0], k=2, tree=(2, 2))
        with pytest.raises(ValueError, match=TREE_REFUSED[kind]):  # tree coverage is a tree too
            speculative_generate(target, drafter, PROMPTS[0], "tree:2", k=2, max_new_tokens=NEW)
        return
    for prompt, ref in zip(PROMPTS, refs):
        assert _strict(target, drafter, prompt, k=2, tree=(2, 2)).tokens == ref, f"{name}: strict tree differs"


@pytest.mark.parametrize("tree", [None, (2, 2)], ids=["chain", "tree"])
def test_batch3_left_padded(family, tree):
    name, target, drafter, _, (eos, refs) = family
    kind = KIND[name]
    if name in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[name]):
            batch_speculative_generate(target, drafter, PROMPTS, "strict", k=2, tree=tree, max_new_tokens=NEW)
        return
    if tree is not None and kind in TREE_REFUSED:
        with pytest.raises(ValueError, match=TREE_REFUSED[kind]):
            batch_speculative_generate(target, drafter, PROMPTS, "strict", k=2, tree=tree, max_new_tokens=NEW)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = batch_speculative_generate(target, drafter, PROMPTS, "strict", k=3 if tree is None else 2, tree=tree,
                                         max_new_tokens=NEW, eos_token_id=eos)
    assert res.tokens == refs, f"{name}: batched strict differs from greedy generate"
    serial = [w for w in caught if "row after row" in str(w.message)]
    assert bool(serial) == (kind in SERIAL_BATCH), f"{name}: {[str(w.message) for w in caught]}"


def test_generate_batch3(family):
    """transformers' generate with draftcert.generate, a left-padded batch with an attention mask."""
    name, target, drafter, _, (eos, refs) = family
    L = max(map(len, PROMPTS))
    ids = torch.tensor([[PAD] * (L - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in PROMPTS])
    if name in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[name]):
            target.generate(input_ids=ids, attention_mask=mask, custom_generate=draftcert.generate, drafter=drafter,
                            criterion="strict", k=3, max_new_tokens=NEW, pad_token_id=PAD, eos_token_id=eos)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = target.generate(input_ids=ids, attention_mask=mask, custom_generate=draftcert.generate, drafter=drafter,
                              criterion="strict", k=3, max_new_tokens=NEW, pad_token_id=PAD, eos_token_id=eos)
    for b, ref in enumerate(refs):
        row = out[b, L:].tolist()
        assert row[: len(ref)] == ref and all(t == PAD for t in row[len(ref):]), f"{name}: generate row {b} differs"


def test_layout_matches_kind(family):
    """The capability check classifies every family as the matrix expects (before any decoding)."""
    name, target, _, _, _ = family
    layout = layout_of(target)
    kind = KIND[name]
    assert layout.stateful == (kind in ("hybrid", "recurrent")), (name, layout)
    assert (layout.decode_refusal() is None) == (name not in REFUSED), (name, layout.decode_refusal())
    assert (layout.tree_refusal() is None) == (kind not in TREE_REFUSED), (name, layout.tree_refusal())
    assert (layout.batch_refusal() is None) == (kind not in SERIAL_BATCH), (name, layout.batch_refusal())
    if kind == "sliding" and name != "recurrent_gemma":
        assert layout.sliding and layout.window == 8


class _ScriptedDrafter:
    """Drafts ``text`` (the target's own greedy text) wrong at every 4th position: every round
    rejects something, so a recurrent target re-feeds accepted tokens round after round."""

    def __init__(self, text):
        self.text, self.forwards = text, 0

    def start(self, prompt_ids):
        pass

    def propose(self, seq, widths, expand_all=False):
        from draftcert.models.tree_attention import DraftTree

        tree, node = DraftTree(), -1
        for d in range(min(len(widths), len(self.text) - len(seq))):
            i = len(seq) + d
            node = tree.add(self.text[i] if i % 4 else (self.text[i] + 1) % 128, node)
        tree.expanded = list(range(-1, node))
        tree.widths = [1] * len(tree.expanded)
        return tree

    def accept(self, path):
        pass


@pytest.mark.parametrize("name", ["qwen3_5", "lfm2"])
def test_recurrent_refeed_is_bounded(name):
    """A draft rejected in every round: the re-fed rows stay within a pass's worth (round.MAX_PASS_ROWS),
    caught up in passes of their own (counted), and strict stays the greedy decoding."""
    from draftcert.decode.engine import greedy_generate
    from draftcert.decode.round import MAX_PASS_ROWS

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        target = build(name, seed=0)
    prompt, new = PROMPTS[1], 48
    ref = greedy_generate(target, prompt, new)
    layout_of(target)  # its capability probe's forwards before the counted ones
    rows = []
    handle = target.register_forward_pre_hook(lambda m, a, kw: rows.append(kw["input_ids"].shape[-1]), with_kwargs=True)
    try:
        res = speculative_generate(target, _ScriptedDrafter(prompt + ref), prompt, "strict", k=4, max_new_tokens=new)
    finally:
        handle.remove()
    assert res.tokens == ref
    st = res.stats
    assert st.num_accepted_tokens < st.num_draft_tokens  # rejections happened
    assert st.catchup_forwards > 0 and max(rows[1:]) <= MAX_PASS_ROWS, rows
    assert len(rows) == st.target_forwards == st.num_rounds + st.catchup_forwards


class _ObservingDrafter(_ScriptedDrafter):
    """The scripted drafter asking for the target's features, as a feature drafter does: it keeps
    every hidden row the engine hands it, in order."""

    needs_target_hidden = True

    def __init__(self, text):
        super().__init__(text)
        self.seen = []

    def observe(self, hidden):  # [n, H]: the features of the next n positions
        self.seen.append(hidden.clone())


def test_recurrent_catch_up_hands_a_feature_drafter_every_position_once():
    """Through catch-up passes and restores, a feature drafter sees the target's final hidden state
    of every position exactly once, in order, equal to a plain forward over the whole text."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        target = build("qwen3_5", seed=0)
    prompt, new = PROMPTS[1], 48
    from draftcert.decode.engine import greedy_generate

    ref = greedy_generate(target, prompt, new)
    drafter = _ObservingDrafter(prompt + ref)
    res = speculative_generate(target, drafter, prompt, "strict", k=4, max_new_tokens=new)
    assert res.tokens == ref and res.stats.catchup_forwards > 0
    seen = torch.cat(drafter.seen)  # [positions observed, H]
    with torch.no_grad():
        whole = target.get_decoder()(torch.tensor([prompt + ref]), use_cache=False).last_hidden_state[0]
    assert seen.shape[0] <= whole.shape[0] and seen.shape[0] >= len(prompt) + new - 5
    torch.testing.assert_close(seen, whole[: seen.shape[0]], atol=1e-4, rtol=1e-4)
