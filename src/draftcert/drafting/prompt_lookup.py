"""Prompt-lookup decoding: drafts copied from what followed earlier occurrences of the context's tail."""

from __future__ import annotations

from ..models.tree_attention import DraftTree
from .protocol import Drafter

__all__ = ["PromptLookupDrafter"]


class PromptLookupDrafter(Drafter):
    """Prompt-lookup decoding (n-gram drafter, no model).

    Proposes what followed the most recent earlier occurrence of the context's
    last n tokens (n from ``max_ngram`` down to ``min_ngram``).  For trees,
    distinct continuations from several matches are merged into a trie
    (at most ``widths[d]`` children per node at depth d + 1).  It has no
    distribution, so its drafts carry no certificates.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_matches: int = 32):
        if not (1 <= int(min_ngram) <= int(max_ngram)):
            raise ValueError(f"prompt lookup: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.max_matches = int(max_ngram), int(min_ngram), int(max_matches)
        self.forwards = 0

    def fork(self) -> "PromptLookupDrafter":
        """A drafter with the same settings (it keeps no state between rounds)."""
        return PromptLookupDrafter(self.max_ngram, self.min_ngram, self.max_matches)

    def start(self, prompt_ids: list[int]) -> None:
        pass

    def continuations(self, seq: list[int], length: int):
        """Continuations (up to ``length`` tokens) of earlier matches of the last n-gram, best first."""
        n_seq = len(seq)
        seen = 0
        for n in range(min(self.max_ngram, n_seq - 1), self.min_ngram - 1, -1):
            tail = seq[n_seq - n :]
            # Most recent match first; a match must end before the tail itself starts.
            for end in range(n_seq - 1, n - 1, -1):
                if seq[end - n : end] == tail:
                    cont = seq[end : end + length]
                    if cont:
                        yield cont
                        seen += 1
                        if seen >= self.max_matches:
                            return

    def propose(self, seq: list[int], widths: list[int], expand_all: bool = False) -> DraftTree:
        tree = DraftTree()
        if not widths:
            return tree
        children: dict[int, dict[int, int]] = {-1: {}}
        for cont in self.continuations(seq, len(widths)):
            node = -1
            for d, tok in enumerate(cont):
                kids = children[node]
                if tok in kids:
                    node = kids[tok]
                    continue
                if len(kids) >= widths[d]:
                    break
                new = tree.add(tok, node)
                kids[tok] = new
                children[new] = {}
                node = new
            if len(children[-1]) >= widths[0] and widths == [1] * len(widths):
                break  # a chain: the best match is all we need
        tree.expanded = [n for n, kids in children.items() if kids]
        tree.widths = [len(children[n]) for n in tree.expanded]
        return tree

    def accept(self, path: list[int]) -> None:
        pass
