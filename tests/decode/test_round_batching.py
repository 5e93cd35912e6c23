"""A round's cheap paths: strict's walk without a summary (``round.accept_strict``) and certificates
computed several rounds at a time (``round.CertificateBatch``), each against the per-round code."""

from __future__ import annotations

import pytest
import torch

from draftcert.criteria import Additive, Strict
from draftcert.decode import CertificateViolation, speculative_generate
from draftcert.decode import round as round_mod
from draftcert.decode.round import CertificateBatch, RowBuffer, accept, certify, record
from draftcert.decode.stats import DecodeStats
from draftcert.models.tree_attention import DraftTree


class _Summarised(Strict):
    """Strict through the summary's walk (``accept`` takes the walk without a summary for ``Strict`` itself)."""


def _random_tree(g: torch.Generator, V: int, n: int, chain: bool) -> DraftTree:
    t = DraftTree()
    for i in range(n):
        parent = i - 1 if chain or i == 0 else int(torch.randint(-1, i, (1,), generator=g))
        t.add(int(torch.randint(0, V, (1,), generator=g)), parent)
    return t


def _verdict_fields(v, draft):
    """What the engine reads of a verdict: ``passed`` at the rows ``record`` (the reached rows with
    children) and the certificates (the expanded nodes' rows) read, and the walk's fields."""
    read = sorted(set(v.rows) | {e + 1 for e in draft.expanded})
    return [v.passed[r] for r in read], v.path, v.rows, v.emitted, v.drift, v.divergence_spent


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chain", [True, False])
def test_strict_walk_without_a_summary_is_the_summary_walk(dtype, chain):
    """On coarse logits (many exact ties: drafts that tie the maximum above its lowest index, rows
    whose every child ties), with EOS among the tokens, and with NaN and infinite rows, strict's
    walk from the rows' maxima gives the summary walk's verdict in every field the engine reads, and
    decides many of those rounds itself.  A non-finite row it reads is refused (the summary's walk
    raises); one it does not read (past the walk, not expanded) decides nothing."""
    g = torch.Generator().manual_seed(3)
    V, decided, unread = 12, 0, 0
    for case in range(400):
        n = int(torch.randint(1, 7, (1,), generator=g))
        draft = _random_tree(g, V, n, chain)
        logits = torch.randint(0, 4, (n + 1, V), generator=g).to(dtype)  # [1 + N, V] four values: ties everywhere
        for r in range(n + 1):  # make most drafted children a maximum, so walks go deep
            for c in draft.children_table()[r]:
                if torch.rand((), generator=g) < 0.7:
                    logits[r, draft.tokens[c]] = 3
        if case % 5 == 2:  # masked tokens (-inf) are allowed, drafted ones included
            logits[int(torch.randint(0, n + 1, (1,), generator=g)), int(torch.randint(0, V, (1,), generator=g))] = -torch.inf
        eos = frozenset({5}) if case % 3 == 0 else frozenset()
        if n > 1:  # the drafter's expanded nodes: the root, and (a chain) its first node
            draft.expanded.extend([-1, 0] if chain else [-1])
        if case % 50 in (7, 19):  # NaN or +inf in a row: refused by both walks where strict's walk reads it
            bad = int(torch.randint(0, n + 1, (1,), generator=g))
            finite = logits.clone()
            logits[bad, 0] = float("nan") if case % 50 == 7 else torch.inf
            with pytest.raises(ValueError, match="NaN or \\+inf"):
                accept(_Summarised(), logits, draft, 16, eos)
            fast = round_mod.accept_strict(logits, draft, eos)
            if fast is None:  # it read that row (deferring to the summary's walk, which refuses it)
                with pytest.raises(ValueError, match="NaN or \\+inf"):
                    accept(Strict(), logits, draft, 16, eos)
            else:  # a row no decision reads: the verdict of the same logits with that row finite
                assert bad not in set(fast.rows) | {e + 1 for e in draft.expanded} | {fast.path[-1] + 1 if fast.path else 0}
                assert _verdict_fields(fast, draft) == _verdict_fields(accept(_Summarised(), finite, draft, 16, eos), draft)
                unread += 1
            continue
        want = accept(_Summarised(), logits, draft, 16, eos)
        got = accept(Strict(), logits, draft, 16, eos)
        assert _verdict_fields(got, draft) == _verdict_fields(want, draft)
        decided += round_mod.accept_strict(logits, draft, eos) is not None
    assert decided > 100  # a third of these tie-heavy rounds; rounds without ties are all its own
    assert unread >= 2  # a non-finite row past the walk: decided without it


def _rounds(n_rounds: int, V: int = 300, seed: int = 0):
    """Random chain rounds as a drafter makes them (each drafted token its q row's argmax), with q
    near p on some rows and far on others: (logits [1 + N, V], draft) each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_rounds):
        n = int(torch.randint(1, 5, (1,), generator=g))
        logits = torch.randn(n + 1, V, generator=g, dtype=torch.float64) * 3  # [1 + N, V]
        noise = 0.05 if i % 3 else 3.0
        q = logits[:n] + noise * torch.randn(n, V, generator=g, dtype=torch.float64)  # [N, V] rows 0..N-1
        draft = DraftTree()
        for j in range(n):
            draft.add(int(q[j].argmax()), j - 1)
        draft.expanded, draft.widths, draft.q = list(range(-1, n - 1)), [1] * n, q
        out.append((logits, draft))
    return out


@pytest.mark.parametrize("rule", [Strict(), Additive(0.05)])
def test_a_batch_certifies_each_round_as_the_round_would(rule):
    """Rounds certified together in a ``CertificateBatch`` get the certificates ``certify`` gives each
    round alone, in their logs and in the statistics; ``on_round`` hears every round once, in order,
    only after its certificates are in (plain rounds between them wait their turn)."""
    rounds = _rounds(30)
    alone, together = DecodeStats("x", 4, None), DecodeStats("x", 4, None)
    heard, logs = [], []
    batch = CertificateBatch(rule, 16, together, heard.append, rows=7, seconds=1e9)
    for i, (logits, draft) in enumerate(rounds):
        verdict = accept(rule, logits, draft, 16)
        record(alone, draft, verdict, certify(rule, verdict, draft, logits, 16))
        log = record(together, draft, verdict, None)
        batch.add(verdict, draft, logits, log)
        batch.deliver(log)
        logs.append(log)
        if i % 4 == 1:  # a plain round in between
            plain = record(together, DraftTree(), accept(rule, logits[:1], DraftTree(), 16), None)
            batch.deliver(plain)
            logs.append(plain)
        assert all(h.checked_positions or not h.num_draft_tokens for h in heard)  # delivered: certified
        if batch.due():
            batch.flush()
        logits.fill_(float("nan"))  # the next pass may reuse the buffers: the batch holds copies
        draft.q.fill_(float("nan"))
    batch.flush()
    assert heard == logs  # each once, in order
    want = [r for r in alone.rounds]
    got = [log for log in together.rounds if log.num_draft_tokens]
    assert [x.certified for x in got] == [x.certified for x in want]
    flat = lambda logs, f: [v for x in logs for v in getattr(x, f)]  # noqa: E731
    assert flat(got, "kl") == pytest.approx(flat(want, "kl"), rel=1e-12)
    assert flat(got, "radius") == pytest.approx(flat(want, "radius"), rel=1e-12)
    assert (together.checked_positions, together.certified_positions, together.kl_count) == \
        (alone.checked_positions, alone.certified_positions, alone.kl_count)
    assert 0 < alone.certified_positions < alone.checked_positions


def test_a_row_buffer_holds_what_torch_cat_of_its_rows_would():
    """``RowBuffer``: rows appended (all of a tensor, a run of rows, or an index list in any order, from
    contiguous and strided sources) across growth, clears and a dtype promotion are ``torch.cat`` of
    the same selections, bit for bit."""
    g = torch.Generator().manual_seed(0)
    buf, want = RowBuffer(), []
    for step, (n, idx, dtype) in enumerate([(3, None, torch.float32), (5, [4, 0, 2], torch.float32), (1, None, torch.float32),
                                            (40, list(range(39, 0, -3)), torch.float32), ("clear", None, None),
                                            (2, [1, 1], torch.float32), (5, [1, 2, 3], torch.float32), (3, [], torch.float32),
                                            (4, [0, 1, 2], "strided"), (6, None, torch.float64), (3, [2], torch.float32)]):
        if n == "clear":
            buf.clear()
            want = []
            continue
        if dtype == "strided":  # a column-major source: rows that are not contiguous
            src = torch.randn(11, n, generator=g).t()
        else:
            src = torch.randn(n, 11, generator=g, dtype=torch.float64).to(dtype)
        buf.append(src, idx)
        want.append(src.clone() if idx is None else src[idx])
        ref = torch.cat(want)
        assert buf.rows().dtype == ref.dtype and torch.equal(buf.rows(), ref), step
        src.fill_(float("nan"))  # a copy, not a view
        assert torch.equal(buf.rows(), ref), step
    with pytest.raises(ValueError, match="rows of shape"):
        buf.append(torch.zeros(1, 12))


def test_a_batch_raises_on_a_certified_but_rejected_row(monkeypatch):
    (logits, draft), = _rounds(1, seed=5)
    logits[0].fill_(0.0)
    logits[0, (draft.tokens[0] + 1) % 300] = 1.0  # the root rejects the drafted token
    verdict = accept(Strict(), logits, draft, 16)
    assert not verdict.passed[0]
    monkeypatch.setattr(round_mod, "certify_summary", lambda rule, sub, q, widths: (
        [0.0] * len(widths), [1.0] * len(widths), [True] * len(widths)))  # a broken bound: certify everything
    batch = CertificateBatch(Strict(), 16, DecodeStats("strict", 1, None))
    batch.add(verdict, draft, logits, record(DecodeStats("strict", 1, None), draft, verdict, None))
    with pytest.raises(CertificateViolation, match="certified but rejected"):
        batch.flush()


def test_a_decode_streams_its_rounds_certified_and_in_order(tiny, prompts):
    """``speculative_generate``'s ``on_round`` hears every round once, in order, each with its
    certificates; the statistics count every certificate of the decode."""
    target, drafter, _ = tiny
    heard = []
    res = speculative_generate(target, drafter, prompts[1], "additive:0.05", k=3, max_new_tokens=40,
                               on_round=heard.append)
    st = res.stats
    assert heard == st.rounds and len(heard) == st.num_rounds
    drafted = [log for log in heard if log.num_draft_tokens]
    assert drafted and all(log.checked_positions >= 1 for log in drafted)
    assert all(c is not None for log in drafted for c in log.certified)
    assert st.checked_positions == sum(log.checked_positions for log in heard) > 0
    assert st.certified_positions == sum(log.certified_positions for log in heard)


def test_a_batch_waits_on_time_only_for_a_listener():
    """``due``: rows reaching the batch size always; the oldest row's wait only where ``on_round`` hears
    the rounds (its lag is bounded), not where nobody does (a decode drafting now and then then pays one
    batch's fixed cost, not one per round)."""
    rule = Strict()
    (logits, draft), = _rounds(1)
    for listener, want in ((None, False), ([].append, True)):
        batch = CertificateBatch(rule, 16, DecodeStats("x", 4, None), listener, rows=99, seconds=0.0)
        verdict = accept(rule, logits, draft, 16)
        batch.add(verdict, draft, logits, record(DecodeStats("x", 4, None), draft, verdict, None))
        assert batch.due() is want
        full = CertificateBatch(rule, 16, DecodeStats("x", 4, None), listener, rows=1, seconds=1e9)
        full.add(verdict, draft, logits, record(DecodeStats("x", 4, None), draft, verdict, None))
        assert full.due()
