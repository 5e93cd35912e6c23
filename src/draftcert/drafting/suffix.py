"""Model-free candidates from suffix matches (SuffixDecoding-style), alone or in the model drafter's tree.

Text repeats: code re-uses identifiers, lists re-use their item template, answers quote the prompt,
and a process answering many requests writes the same phrases again.  Where the tail of the current
sequence occurred before, what followed it then is a free draft.

Index
-----
``NgramIndex`` maps every n-gram (``min_match <= n <= max_ngram``) of one token sequence to the
positions where it ends, built incrementally (``extend``: ``max_ngram - min_match + 1`` dict updates
per token).  ``SuffixIndex`` holds one for the current sequence (prompt + text generated so far) and
a ``SuffixStore``: the outputs of earlier sequences of this process (bounded: the last
``max_sequences`` outputs, at most ``max_tokens`` tokens; ``SHARED_STORE`` by default).  Outputs of
the *same* prompt are skipped, so timing repeats and warm-ups never draft from their own earlier run.

Proposal at the tail ``x[L - n : L]`` of the current sequence x (length L):

    match      the longest n (``max_ngram`` down to ``min_match``) whose n-gram occurs earlier
               (in x, ending before L, or in a stored output); at n = ``max_ngram`` the match is
               extended backwards on each occurrence, up to ``max_match`` tokens.  m = its length.
    candidates its most recent occurrences (at most ``max_candidates``), the current sequence
               first; each continues with the tokens that followed it (in x an overlapping
               match continues periodically, as LZ77 copies: x[e + j] is the j-th drafted token
               itself when e + j >= L).
    length     D = min(ceil(alpha * m), max_draft, limit): a longer match earns a longer draft.
    trie       the candidates' continuations (up to D tokens) merged into a trie counting how many
               candidates pass through each node; a node is drafted only while its share
               count / len(candidates) >= min_prob (the empirical probability that the text goes
               this way), children by count, the most recent first among equal counts.

``limit`` is the engine's remaining length budget (``depth_limit``, set before every round): a
suffix draft may run deeper than the model drafter's ``k``, never past ``max_new_tokens``.  Cost:
a few dict look-ups per round; ``benchmarks/bench_suffix.py`` measures it.

Drafters
--------
``SuffixDrafter`` (spec ``suffix``): the trie alone, like prompt lookup but with the store and the
adaptive length.  ``HybridDrafter`` (spec ``DRAFTER+suffix``): the model drafter's tree, with the
suffix chain grafted onto it (``graft``): the chain follows the model's nodes while its tokens
coincide with theirs and hangs the rest below the last shared node (no duplicate sibling tokens),
so the engine verifies both in one target pass.  Model nodes keep their indices (0 .. M - 1) and
their q rows; grafted nodes come after them, are never *expanded* and so carry no certificate
(like prompt-lookup nodes: they have no distribution).  A certificate at a model node stays
sound: extra children only add ways to pass.

After the round the wrapped drafter is told the accepted path's prefix that lies in its own tree
(``accept``): a ``ModelDrafter`` keeps those fed nodes in its KV cache and catches up on the
rest of the sequence next round; a ``FeatureDrafter`` drops every drafted node anyway and
re-feeds the accepted tokens with the target's true features (``observe``, passed through).
"""

from __future__ import annotations

import math
from collections import deque
from itertools import takewhile

from ..models.tree_attention import DraftTree
from .protocol import Drafter

__all__ = ["ngram_key", "NgramIndex", "SuffixStore", "SuffixIndex", "SuffixDrafter", "HybridDrafter", "graft", "SHARED_STORE"]


def ngram_key(tokens) -> int:
    """The key ``NgramIndex`` files an n-gram under: Python's hash of its tuple (deterministic for ints)."""
    return hash(tuple(tokens))


class NgramIndex:
    """End positions of every n-gram (``min_n <= n <= max_n``) of one growing token sequence.

    ``ends[key(ngram)]`` lists e (ascending) with ``tokens[e - n : e] == ngram``; keys are Python's
    hash of the n-gram tuple (deterministic for ints; a collision costs a wrong draft, never a wrong
    token: every draft is verified).
    """

    def __init__(self, min_n: int, max_n: int, tokens=()):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.ends: dict[int, list[int]] = {}
        self.tail_keys: dict[int, int] = {}  # n -> key of the n-gram ending at the last token (extend's last)
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens) -> None:
        toks, ends = self.tokens, self.ends
        for t in new_tokens:
            toks.append(int(t))
            e = len(toks)
            keys = self.tail_keys = {}
            for n in range(self.min_n, min(self.max_n, e) + 1):
                key = keys[n] = ngram_key(toks[e - n : e])
                hit = ends.get(key)
                if hit is None:
                    ends[key] = [e]
                else:
                    hit.append(e)

    def find(self, ngram: tuple) -> list[int]:
        """End positions of ``ngram`` (ascending); [] if it never occurs."""
        return self.ends.get(ngram_key(ngram), [])


class SuffixStore:
    """The outputs of earlier sequences (a bounded FIFO), each indexed once when it is added.

    ``max_sequences`` = 0 disables it.  Outputs are indexed with the store's n-gram range (``min_match``
    .. ``max_ngram``): an index with another range finds stored text only at the n it shares.  An
    output is stored with a fingerprint of its prompt so that a later decode of the same prompt does
    not draft from it (``SuffixIndex.start``).
    """

    def __init__(self, max_sequences: int = 64, max_tokens: int = 16384, min_match: int = 2, max_ngram: int = 8):
        if max_sequences < 0 or max_tokens < 0:
            raise ValueError(f"suffix store: max_sequences and max_tokens must be >= 0, got {max_sequences}, "
                             f"{max_tokens}")
        self.max_sequences, self.max_tokens = int(max_sequences), int(max_tokens)
        self.min_match, self.max_ngram = int(min_match), int(max_ngram)
        self.docs: deque[tuple[int, NgramIndex]] = deque()  # (prompt fingerprint, index of the output)
        self.n_tokens = 0
        # n-gram key -> how many stored outputs hold it: a tail no output holds is looked up in none of
        # them (a round's match tries up to max_ngram - min_match + 1 tails against up to 64 outputs)
        self.keys: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.docs)

    def add(self, prompt_key: int, output: list[int]) -> None:
        if not output or self.max_sequences == 0 or len(output) > self.max_tokens:
            return
        index = NgramIndex(self.min_match, self.max_ngram, output)
        self.docs.append((prompt_key, index))
        keys = self.keys
        for key in index.ends:
            keys[key] = keys.get(key, 0) + 1
        self.n_tokens += len(output)
        while len(self.docs) > self.max_sequences or self.n_tokens > self.max_tokens:
            old = self.docs.popleft()[1]
            self.n_tokens -= len(old)
            for key in old.ends:
                if keys[key] == 1:
                    del keys[key]
                else:
                    keys[key] -= 1

    def clear(self) -> None:
        self.docs.clear()
        self.keys.clear()
        self.n_tokens = 0


# The process-wide store every SuffixIndex shares unless it is given its own.
SHARED_STORE = SuffixStore()


class SuffixIndex:
    """The suffix candidates of one sequence: its own n-gram index plus a ``SuffixStore``.

    ``start(prompt)`` begins a sequence (storing the previous one's output); ``draft(seq, widths,
    expand_all, limit)`` returns the candidate tree (module docstring).  Parameters: ``min_match``
    (shortest n-gram that counts as a match), ``max_ngram`` (longest indexed n-gram), ``max_match``
    (cap of the backward extension), ``alpha`` (draft tokens per matched token), ``max_draft``
    (longest draft), ``min_prob`` (smallest share of the candidates a drafted node needs),
    ``max_candidates`` (occurrences considered), ``store`` (None: ``SHARED_STORE``; pass
    ``SuffixStore(0)`` for no memory across sequences).
    """

    def __init__(self, min_match: int = 2, max_ngram: int = 8, max_match: int = 32, alpha: float = 1.0,
                 max_draft: int = 16, min_prob: float = 0.1, max_candidates: int = 32,
                 store: SuffixStore | None = None):
        if not (1 <= int(min_match) <= int(max_ngram)):
            raise ValueError(f"suffix: need 1 <= min_match <= max_ngram, got {min_match}, {max_ngram}")
        if alpha <= 0 or max_draft < 1 or not 0 <= min_prob <= 1 or max_candidates < 1:
            raise ValueError(f"suffix: need alpha > 0, max_draft >= 1, 0 <= min_prob <= 1, max_candidates >= 1; got "
                             f"{alpha}, {max_draft}, {min_prob}, {max_candidates}")
        self.min_match, self.max_ngram = int(min_match), int(max_ngram)
        self.max_match = max(int(max_match), self.max_ngram)
        self.alpha, self.max_draft, self.min_prob = float(alpha), int(max_draft), float(min_prob)
        self.max_candidates = int(max_candidates)
        self.store = SHARED_STORE if store is None else store
        self.live = NgramIndex(self.min_match, self.max_ngram)
        self.n_prompt = 0
        self.prompt_key = 0

    def fork(self) -> "SuffixIndex":
        """An index with the same settings and the same store, starting empty (batching: one per row)."""
        return SuffixIndex(self.min_match, self.max_ngram, self.max_match, self.alpha, self.max_draft, self.min_prob,
                           self.max_candidates, self.store)

    def start(self, prompt_ids: list[int]) -> None:
        """A new sequence: the previous one's output goes to the store; index the prompt."""
        if len(self.live) > self.n_prompt:
            self.store.add(self.prompt_key, self.live.tokens[self.n_prompt :])
        self.prompt_key = hash(tuple(prompt_ids))
        self.n_prompt = len(prompt_ids)
        self.live = NgramIndex(self.min_match, self.max_ngram, prompt_ids)

    def sync(self, seq: list[int]) -> None:
        """Index the tokens appended to the sequence since the last call (within a sequence it only grows;
        anything else, as far as its length and last indexed token tell, is indexed afresh)."""
        n = len(self.live)
        if len(seq) < n or (n and seq[n - 1] != self.live.tokens[-1]):  # not a continuation: index afresh
            self.live = NgramIndex(self.min_match, self.max_ngram, seq)
        else:
            self.live.extend(seq[n:])

    def match(self, seq: list[int]) -> tuple[int, list[tuple[list[int], int, bool]]]:
        """(m, candidates): the longest match length m of the tail of ``seq`` (0: none) and its most recent
        occurrences as (tokens, end, in the current sequence), the current sequence first, stored
        outputs newest first.  ``sync(seq)`` first."""
        L = len(seq)
        stored = [d for key, d in reversed(self.store.docs) if key != self.prompt_key] if self.store.docs else []
        held = self.store.keys
        # the tail's keys as sync's extend filed them (seq is the live sequence), else hashed here
        tail = self.live.tail_keys if len(self.live) == L else {}
        for n in range(min(self.max_ngram, L - 1), self.min_match - 1, -1):
            key = tail.get(n)
            if key is None:
                key = ngram_key(seq[L - n :])
            docs = [self.live] + stored if key in held else (self.live,)
            cands: list[tuple[list[int], int, bool]] = []
            for d in docs:
                hit = d.ends.get(key)
                if not hit:
                    continue
                # an occurrence needs a continuation: it ends before the end of its text (excludes the tail
                # itself); the ends ascend, so only the last can be the text's end.  The most recent first.
                stop = len(hit) - (hit[-1] >= len(d))
                room = self.max_candidates - len(cands)
                toks, own = d.tokens, d is self.live
                cands += [(toks, e, own) for e in reversed(hit[max(0, stop - room): stop])]
                if len(cands) >= self.max_candidates:
                    break
            if not cands:
                continue
            m = n
            if n == self.max_ngram:  # the match may be longer than the longest indexed n-gram
                m = max(_match_back(seq, toks, e, self.max_match) for toks, e, _ in cands)
            return m, cands
        return 0, []

    def draft(self, seq: list[int], widths: list[int], expand_all: bool = False, limit: int | None = None) -> DraftTree:
        """The candidate tree at the tail of ``seq``: at most ``widths[d]`` children per node at depth d + 1
        (1 beyond ``widths``), only the best child continuing unless ``expand_all``, at most
        D = min(ceil(alpha * m), max_draft, limit) deep (``limit`` None: ``len(widths)``).  No q: no
        certificates."""
        self.sync(seq)
        tree = DraftTree()
        limit = len(widths) if limit is None else limit
        if limit < 1 or not widths:
            return tree
        m, cands = self.match(seq)
        if not m:
            return tree
        depth = min(math.ceil(self.alpha * m), self.max_draft, limit)
        trie: dict = {}  # token -> [count, subtrie]; insertion order = recency among equal counts
        for toks, e, own in cands:
            node = trie
            for tok in _continuation(toks, e, depth, own):
                entry = node.setdefault(tok, [0, {}])
                entry[0] += 1
                node = entry[1]
        need = self.min_prob * len(cands)
        front = [(-1, trie)]
        for d in range(depth):
            w = widths[d] if d < len(widths) else 1
            nxt = []
            for parent, sub in front:
                kids = sorted(sub.items(), key=lambda kv: -kv[1][0])[:w]  # stable: the most recent first among ties
                for i, (tok, (count, below)) in enumerate(kids):
                    if count < need:
                        break
                    node = tree.add(tok, parent)
                    if expand_all or (i == 0 and parent == front[0][0]):
                        nxt.append((node, below))
            if not nxt:
                break
            front = nxt
        return tree


def _match_back(seq: list[int], toks: list[int], e: int, cap: int) -> int:
    """Length of the common suffix of seq and toks[:e], at most cap."""
    L, n = len(seq), 0
    while n < cap and n < e and seq[L - 1 - n] == toks[e - 1 - n]:
        n += 1
    return n


def _continuation(toks: list[int], e: int, depth: int, own: bool) -> list[int]:
    """The tokens that followed the occurrence ending at e, up to ``depth``.  In the current sequence
    (``own``) a position at or past its end L is a drafted token itself: the match says x[L + j] =
    x[e + j], and for e + j >= L that is draft token e + j - L < j (LZ77 copy: an overlapping match
    continues its period)."""
    out = toks[e : e + depth]
    if own:
        L = len(toks)
        while len(out) < depth:
            out.append(out[e + len(out) - L])
    return out


class SuffixDrafter(Drafter):
    """Drafter interface (start / propose / accept) around a ``SuffixIndex``: model-free, no certificates.

    ``depth_limit`` is set by the engine before every round (the remaining length budget); the draft
    may run deeper than ``len(widths)`` up to it (None: ``len(widths)``).
    """

    def __init__(self, index: SuffixIndex | None = None, **kw):
        self.index = SuffixIndex(**kw) if index is None else index
        self.forwards = 0
        self.depth_limit: int | None = None

    def fork(self) -> "SuffixDrafter":
        """A fresh drafter with the same settings and store (batching)."""
        return SuffixDrafter(self.index.fork())

    def start(self, prompt_ids: list[int]) -> None:
        self.index.start(prompt_ids)

    def propose(self, seq: list[int], widths: list[int], expand_all: bool = False) -> DraftTree:
        return self.index.draft(seq, widths, expand_all, self.depth_limit)

    def accept(self, path: list[int]) -> None:
        pass


def graft(tree: DraftTree, chain: list[int], admit=None) -> int:
    """Add ``chain`` (tokens from the root down) to ``tree`` in place; returns the nodes added.

    The chain follows existing nodes while its tokens coincide with theirs, so the tree never holds
    two siblings with one token; the rest hangs below the last shared node (or the root), appended
    after every existing node (indices, ``expanded``, ``widths`` and ``q`` stay valid).
    ``admit(j, rows)``, where given, is asked before adding ``chain[j]`` as a new node (``rows``: the
    tree's nodes plus the pending token's row); where it says False the chain stops there.
    """
    children = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens))}
    node, added = -1, 0
    for j, tok in enumerate(chain):
        nxt = children.get((node, tok))
        if nxt is None:
            if admit is not None and not admit(j, 1 + len(tree)):
                break
            nxt = tree.add(tok, node)
            children[(node, tok)] = nxt
            added += 1
        node = nxt
    return added


# The graft's acceptance prior (``HybridDrafter.graft_acceptance``): a node's chance of being accepted
# once reached, counted as GRAFT_PRIOR_WEIGHT attempts, before this decode has tried any.
GRAFT_PRIOR = 0.7
GRAFT_PRIOR_WEIGHT = 2.0


class HybridDrafter(Drafter):
    """The model drafter's tree plus the suffix candidate chain, verified together (module docstring).

    ``suffix_drafted`` / ``suffix_accepted`` count the grafted nodes proposed and accepted (nodes the
    model drafter also proposed count as the model's); ``suffix_attempted`` the grafted nodes the
    acceptance walk reached.  With no suffix match the round's tree is the model drafter's, unchanged.

    **A graft priced node by node** (``keep_grafting``, set by ``-k auto``): the suffix chain
    c_1 .. c_D follows the model's nodes for free; each node it adds costs a verification row, so
    before adding c_j it asks ``keep_grafting(s ** j, rows)`` (``decode.draft_shape.adaptive``), where
    s = ``graft_acceptance()`` is the chance that a reached grafted node is accepted, a Beta posterior
    over this decode's grafted nodes (prior ``GRAFT_PRIOR``), and ``rows`` the round's rows so far.
    A long match whose continuations keep being accepted still drafts deep (s near 1); one whose
    grafts fail is cut to the rows it pays for.  Without ``keep_grafting`` the whole chain is grafted.
    A plain round of ``-k auto`` (its model drafts nothing) still grafts the priced chain, onto the root
    (``grafts_in_plain_rounds``): a copy from the prompt costs no drafter step.
    """

    grafts_in_plain_rounds = True

    def __init__(self, model_drafter, suffix: SuffixIndex | None = None):
        self.model_drafter = model_drafter
        self.suffix = SuffixIndex() if suffix is None else suffix
        self.needs_target_hidden = model_drafter.needs_target_hidden
        self.depth_limit: int | None = None
        self.keep_grafting = None
        self.n_model = 0  # nodes 0 .. n_model - 1 of this round's tree are the model drafter's
        self.suffix_drafted = self.suffix_accepted = self.suffix_attempted = 0
        self._grafted_parents: set[int] = set()  # this round's nodes (-1: the root) with a grafted child
        self._decode_start = (0, 0)  # (accepted, attempted) when this decode started: graft_acceptance's
        self._asked = False  # this round asked the model drafter (``propose`` with widths)

    @property
    def forwards(self) -> int:
        return self.model_drafter.forwards

    @property
    def min_margin(self) -> float | None:
        return self.model_drafter.min_margin

    @min_margin.setter
    def min_margin(self, value: float | None) -> None:  # the model drafter's chain stops; the suffix chain follows its match
        self.model_drafter.min_margin = value

    @property
    def keep_drafting(self):
        return self.model_drafter.keep_drafting

    @keep_drafting.setter
    def keep_drafting(self, value) -> None:  # as min_margin: the model drafter's chain only
        self.model_drafter.keep_drafting = value

    def fork(self) -> "HybridDrafter":
        """A fresh hybrid: the model drafter's fork (shared weights) and a fresh index on the same store."""
        inner = self.model_drafter.fork()
        return None if inner is None else HybridDrafter(inner, self.suffix.fork())

    def start(self, prompt_ids: list[int]) -> None:
        self.model_drafter.start(prompt_ids)
        self.suffix.start(prompt_ids)
        self._decode_start = (self.suffix_accepted, self.suffix_attempted)

    def observe(self, hidden) -> None:
        self.model_drafter.observe(hidden)

    def propose(self, seq: list[int], widths: list[int], expand_all: bool = False) -> DraftTree:
        """The model drafter's tree with the suffix chain grafted on; ``widths`` empty (a plain round of
        ``-k auto``, ``grafts_in_plain_rounds``): the suffix chain alone, the model drafter not asked."""
        self._asked = bool(widths)
        tree = self.model_drafter.propose(seq, widths, expand_all) if widths else DraftTree()
        self.n_model = len(tree)
        chain = self.suffix.draft(seq, [1] * max(1, len(widths)), False, self.depth_limit).tokens
        admit = None
        if self.keep_grafting is not None:  # c_j's row is worth it iff keep_grafting(s ** j, rows) (class docstring)
            s, keep = self.graft_acceptance(), self.keep_grafting
            admit = lambda j, rows: keep(s ** (j + 1), rows)  # noqa: E731
        self.suffix_drafted += graft(tree, chain, admit)
        self._grafted_parents = {tree.parents[i] for i in range(self.n_model, len(tree))}
        return tree

    def graft_acceptance(self) -> float:
        """The chance that a reached grafted node is accepted: the Beta posterior mean over this
        decode's grafted nodes (since ``start``; the counters themselves run over the drafter's life),
        ``(GRAFT_PRIOR * GRAFT_PRIOR_WEIGHT + accepted) / (GRAFT_PRIOR_WEIGHT + attempted)``."""
        accepted = self.suffix_accepted - self._decode_start[0]
        attempted = self.suffix_attempted - self._decode_start[1]
        return (GRAFT_PRIOR * GRAFT_PRIOR_WEIGHT + accepted) / (GRAFT_PRIOR_WEIGHT + attempted)

    def accept(self, path: list[int]) -> None:
        """The model drafter hears the accepted path's prefix in its own tree; it catches up on the rest.
        A grafted node is attempted where the walk reached its parent: accepted, or where the walk ended."""
        own = list(takewhile(lambda n: n < self.n_model, path))
        accepted = len(path) - len(own)
        self.suffix_accepted += accepted
        # the walk stopped below its last node (or the root): a grafted child there was tried and refused
        self.suffix_attempted += accepted + ((path[-1] if path else -1) in self._grafted_parents)
        if self._asked:  # a plain round's grafts: the model drafted nothing to keep or drop
            self.model_drafter.accept(own)
