"""The stop every decode of an evaluation uses: end a completion once its code is final.

A chat model writes its function in a fenced block, then prose and examples up to the length limit.
``CodeBlockStop(tokenizer, entry_point)`` is a decode's ``stop(new_tokens)`` (``decode.config``):
it returns n, the first n new tokens are kept, at the first n where the text of those n tokens
(``tokenizer.decode(..., skip_special_tokens=True)``, the completion that is scored) passes
``programs.code_closed``: the piece of the completion that ``programs.extract_code`` takes (the
first defining ``entry_point``; without an entry point, the first code block) is followed by a
complete fence line.  No text after that changes the extracted code, so the stopped completion gets
the verdict the full one would (``code_closed``).  A completion with no such block runs on to EOS or
the length limit, as without the stop.  For ``{prompt, answer}`` tasks there is no stop (later text
may change the answer: ``answer_matches`` reads the last number).

It is cheap: the new tokens are decoded incrementally (each token's text from a window of the last
few tokens, as streaming detokenizers do; a token whose bytes end inside a character waits for the
next), and the whole text is decoded, and ``code_closed`` asked, only at a token that completes a
fence line.  The decision depends on the first n tokens alone and is taken at the first n that
passes, however many tokens a round adds: greedy decoding stopped after each token and a
speculative decode stopped after each round keep the same tokens whenever their tokens agree
(strict = greedy, bit for bit, under the stop).
"""

from __future__ import annotations

import re

from .programs import code_closed

__all__ = ["CodeBlockStop", "STOP_RULE", "stop_for"]

STOP_RULE = "code-block"  # evaluate.json's "stop" (null: every decode ran to EOS or the length limit)
_FENCE = re.compile(r"^[ \t]*```", re.MULTILINE)


class CodeBlockStop:
    """One decode's stop (module docstring); a new one per decode.  ``fired``: the n it returned, else None."""

    def __init__(self, tokenizer, entry_point: str | None):
        self.tokenizer = tokenizer
        self.entry_point = entry_point
        self.ids: list[int] = []
        self.text = ""  # the text of ids[:read]
        self.prefix, self.read = 0, 0  # the window ids[prefix:] is decoded; ids[:read] are in text
        self.line_start = 0  # where text's last unfinished line begins
        self.fired: int | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _feed(self, tok: int) -> bool:
        """Add one token; True when the text now completes a fence line."""
        self.ids.append(tok)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return False  # no text yet (a special token), or a character cut between tokens
        start = len(self.text)
        self.text += after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        fence = False
        while (nl := self.text.find("\n", max(start, self.line_start))) >= 0:
            fence = fence or _FENCE.match(self.text, self.line_start, nl) is not None
            self.line_start = start = nl + 1
        return fence

    def __call__(self, new_tokens: list[int]) -> int | None:
        if self.fired is not None:
            return self.fired
        if new_tokens[:len(self.ids)] != self.ids:
            raise ValueError("stop: called with tokens that do not extend the ones it has seen (one CodeBlockStop per decode)")
        for tok in new_tokens[len(self.ids):]:
            if self._feed(tok) and code_closed(self._decode(self.ids), self.entry_point):
                self.fired = len(self.ids)
                return self.fired
        return None


def stop_for(problem, tokenizer) -> CodeBlockStop | None:
    """A new stop for one decode of ``problem`` (an ``evaluate.tasks.Problem``); None where there is
    none (a ``{prompt, answer}`` problem)."""
    return CodeBlockStop(tokenizer, problem.entry_point) if problem.runs_code else None
