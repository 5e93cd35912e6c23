"""Batched greedy generation with a KV cache, and teacher-forced drafter scoring.

We drive ``model.forward`` ourselves (instead of ``model.generate``) so that
every step's logits pass through our hands exactly once, while they are still
on the device, and can be summarised into certificates right away.

Left padding: a batch of prompts of lengths P_b is padded on the left to
P = max P_b.  Padded slots get attention_mask = 0 and the real tokens get
position ids 0..P_b-1 (``cumsum(mask) - 1``), so every row sees exactly the
positions it would see alone.  Each decoding step appends one token per row
and position P_b + t.  A row stops after emitting an EOS token (which is
recorded) or after ``max_new_tokens``; finished rows are dropped from the KV
cache (``models.hf.select_cache_rows``, recurrent states too) so they cost nothing afterwards.
Models without attention layers (Mamba) get no attention mask after the prompt, as in
transformers' ``generate``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from ..models.hf import attention_free, cache_kwarg, left_pad, new_cache, select_cache_rows

__all__ = ["StepTimer", "GreedyRun", "score_teacher_forced", "pick_tokens"]


@dataclass
class StepTimer:
    """Wall-clock accumulators.  ``sync`` makes asynchronous devices (CUDA)
    finish before a clock is read, so model time and certificate time are not
    smeared into each other (CPU torch ops are synchronous already)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    totals: dict[str, float] = field(default_factory=dict)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def add(self, name: str, seconds: float) -> None:
        self.totals[name] = self.totals.get(name, 0.0) + seconds

    def section(self, name: str):
        return _Section(self, name)


class _Section:
    def __init__(self, timer: StepTimer, name: str):
        self.timer, self.name = timer, name

    def __enter__(self):
        self.timer.sync()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.timer.sync()
        self.timer.add(self.name, time.perf_counter() - self.t0)
        return False


def pick_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Greedy token per row: argmax with the lowest index among ties (torch's
    documented first-maximum rule).  NaN counts as -inf so a broken row still
    yields a deterministic token (the step itself is flagged ``nonfinite``)."""
    x = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    x = torch.nan_to_num(x, nan=-torch.inf)
    return torch.argmax(x, dim=-1)


class GreedyRun:
    """One batch of greedy continuations.  Iterate :meth:`steps` to receive, for
    t = 0, 1, ..., ``(t, logits, rows, tokens)``: the (A, V) next-token logits of
    the A still-active rows, their batch indices and the greedy tokens chosen
    from them.  Afterwards ``continuations[b]`` holds row b's generated ids."""

    def __init__(self, model, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_ids: set[int],
                 *, pad_id: int = 0, timer: StepTimer | None = None):
        if int(max_new_tokens) < 1:
            raise ValueError(f"max_new_tokens: expected an integer >= 1, got {max_new_tokens!r}")
        self.model = model
        self.prompts = [list(p) for p in prompts]
        self.max_new_tokens = int(max_new_tokens)
        self.eos = torch.tensor(sorted(eos_ids), dtype=torch.long)
        self.pad_id = int(pad_id)
        self.timer = timer or StepTimer()
        self.continuations: list[list[int]] = [[] for _ in self.prompts]

    @torch.inference_mode()
    def steps(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        model, timer = self.model, self.timer
        device = next(model.parameters()).device
        eos = self.eos.to(device)
        ids, mask, pos = left_pad(self.prompts, self.pad_id, device)
        cache = new_cache(model)
        no_attention = attention_free(cache)
        ckw = {cache_kwarg(model): cache}
        rows = torch.arange(len(self.prompts), device=device)  # batch index of each live cache row
        with timer.section("model"):
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                        logits_to_keep=1, **ckw)
            logits = out.logits[:, -1, :]
            tokens = pick_tokens(logits)
        next_pos = pos[:, -1] + 1
        for t in range(self.max_new_tokens):
            yield t, logits, rows, tokens
            with timer.section("model"):
                tok_list = tokens.tolist()
                for b, tok in zip(rows.tolist(), tok_list):
                    self.continuations[b].append(tok)
                if t + 1 == self.max_new_tokens:
                    break
                live = ~torch.isin(tokens, eos) if eos.numel() else torch.ones_like(tokens, dtype=torch.bool)
                if not bool(live.all()):
                    if not bool(live.any()):
                        break
                    keep = live.nonzero().squeeze(1)
                    select_cache_rows(cache, keep, len(rows))
                    rows, tokens, mask, next_pos = rows[keep], tokens[keep], mask[keep], next_pos[keep]
                mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], 1)
                step_mask = None if no_attention else mask  # Mamba: the states are masked already
                out = model(input_ids=tokens[:, None], attention_mask=step_mask, position_ids=next_pos[:, None],
                            use_cache=True, **ckw)
                logits = out.logits[:, -1, :]
                tokens = pick_tokens(logits)
                next_pos = next_pos + 1


@torch.inference_mode()
def score_teacher_forced(model, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
                         *, pad_id: int = 0, timer: StepTimer | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's next-token logits along the target's own continuations, one
    forward pass over prompt + continuation per row (batched, left-padded).

    Returns ``(logits, index)``: logits (B, T_max, V) where row b's step t
    (predicting continuation[b][t] from prompt + continuation[b][:t]) sits at
    ``logits[b, T_max - T_b + t]`` with T_b = len(continuations[b]); ``index``
    (B,) holds T_max - T_b so that step t of row b is ``logits[b, index[b] + t]``.
    """
    timer = timer or StepTimer()
    device = next(model.parameters()).device
    seqs = [list(p) + list(c) for p, c in zip(prompts, continuations)]
    lens = [len(c) for c in continuations]
    T = max(lens)
    with timer.section("model"):
        ids, mask, pos = left_pad(seqs, pad_id, device)
        # With left padding every row ends at the last column, so the positions
        # predicting the continuations are the last T + 1 columns minus the final one.
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=T + 1)
        logits = out.logits[:, :T, :]
    index = torch.tensor([T - n for n in lens], device=logits.device)
    return logits, index
