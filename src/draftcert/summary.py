"""One pass over a batch of distributions: the statistics every certificate needs.

Every criterion in this library is decided by the *top of the sorted target
distribution* (and, for Medusa's rule, its entropy).  ``summarize`` reads each
row of ``(..., V)`` logits or probabilities once for the normaliser and the
entropy (a fused kernel when the input is large), once for a partial sort
(``torch.topk``), and keeps the top-``k`` probabilities in float64.  Rows for
which ``k`` turns out to be too few (the rejected token sits deeper) are
re-sorted exactly on demand by :meth:`Summary.sorted_rows`, so the answer never
depends on ``k``; ``k`` only trades speed.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass, field

import torch

from ._arrays import ArrayLike, OutputSpec, check_logits_rows, check_probs, output_spec, pick_input, to_tensor

DEFAULT_TOPK = 64
# Inputs at least this large go through the compiled one-pass kernel.
_COMPILE_MIN_NUMEL = 1 << 22


def _logit_moments_eager(x: torch.Tensor, m: torch.Tensor, want_entropy: bool):
    """s = sum exp(x - m);  d = sum exp(x - m) * (x - m)  (0 where exp underflows / x = -inf)."""
    z = x - m
    e = torch.exp(z)
    s = e.sum(-1, dtype=torch.float64) if x.dtype != torch.float32 else e.sum(-1)
    if not want_entropy:
        return s, None
    d = torch.where(e > 0, e * z, torch.zeros((), dtype=e.dtype, device=e.device)).sum(-1)
    return s, d


def _prob_moments_eager(p: torch.Tensor, want_entropy: bool):
    """sum p and sum -p log p of each row."""
    s = p.sum(-1)
    if not want_entropy:
        return s, None
    return s, torch.special.entr(p).sum(-1)


@functools.lru_cache(maxsize=None)
def _compiled(fn_name: str):
    fn = {"logit": _logit_moments_eager, "prob": _prob_moments_eager}[fn_name]
    return torch.compile(fn, dynamic=True)


_compile_broken = False


def _moments(kind: str, *args, want_entropy: bool):
    """Fused single read of the (N, V) input when it is large: XLA-style fusion of
    exp, the two reductions and the -inf guard, via torch.compile.  Falls back to
    eager torch (same formulas, a few more passes) if compilation is unavailable."""
    global _compile_broken
    x = args[0]
    eager = _logit_moments_eager if kind == "logit" else _prob_moments_eager
    use_compile = (
        not _compile_broken
        and os.environ.get("DRAFTCERT_COMPILE", "1") != "0"
        and x.numel() >= _COMPILE_MIN_NUMEL
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )
    if use_compile:
        try:
            return _compiled(kind)(*args, want_entropy=want_entropy)
        except Exception as exc:  # pragma: no cover - depends on the host toolchain
            _compile_broken = True
            warnings.warn(f"draftcert: torch.compile unavailable ({exc!s:.200}); using eager kernels", stacklevel=3)
    return eager(*args, want_entropy=want_entropy)


@dataclass
class Summary:
    """Top-k view of a batch of N distributions over V tokens (rows flattened).

    Attributes
    ----------
    top_probs : (N, k) float64, each row sorted descending (ties keep the lower token id first).
    top_ids   : (N, k) int64 token ids of ``top_probs``.
    entropy   : (N,) float64 Shannon entropy in nats, or None if not requested.
    log_norm  : (N,) float64 log-normaliser of logits (None for probability input).
    vocab_size: V.
    out       : how results are handed back to the caller.
    """

    top_probs: torch.Tensor
    top_ids: torch.Tensor
    entropy: torch.Tensor | None
    log_norm: torch.Tensor | None
    vocab_size: int
    out: OutputSpec
    source: torch.Tensor = field(repr=False)  # (N, V) original values, for exact fallbacks
    is_logits: bool = False

    @property
    def k(self) -> int:
        return self.top_probs.shape[-1]

    @property
    def complete(self) -> bool:
        """True when ``top_probs`` holds the whole sorted distribution."""
        return self.k == self.vocab_size

    def probs_f64(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Full float64 probabilities of the given rows (all rows if None)."""
        src = self.source if rows is None else self.source[rows]
        if self.is_logits:
            ln = self.log_norm if rows is None else self.log_norm[rows]
            return torch.exp(src.double() - ln[:, None])
        return src.double()

    def sorted_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Exact full descending sort (float64) of the selected rows: the fallback
        for rows whose decisive token lies beyond the top-k."""
        return torch.sort(self.probs_f64(rows), dim=-1, descending=True, stable=True).values

    def prob_of(self, ids: torch.Tensor) -> torch.Tensor:
        """float64 probability of token ``ids[n]`` in row n, computed exactly as top_probs is."""
        v = self.source.gather(-1, ids[:, None]).squeeze(-1).double()
        return torch.exp(v - self.log_norm) if self.is_logits else v


def summarize(
    probs: ArrayLike | None = None,
    *,
    logits: ArrayLike | None = None,
    k: int = DEFAULT_TOPK,
    entropy: bool = True,
    validate: bool = True,
    name: str = "probs",
) -> Summary:
    """Summarise a batch of distributions for certificate computation.

    Parameters
    ----------
    probs, logits : array (..., V); exactly one.  Logits may contain -inf (masked tokens).
    k : number of top probabilities kept (clipped to V).  Any k gives exact
        answers; it only decides how often the exact fallback runs.
    entropy : compute the Shannon entropy (needed by the entropy criterion).
    """
    if isinstance(probs, Summary):
        return probs
    arr, is_logits = pick_input(probs, logits, name)
    arg = "logits" if is_logits else name
    x, is_numpy = to_tensor(arr, arg)
    out = output_spec(x, is_numpy)
    V = x.shape[-1]
    x2 = x.reshape(-1, V)
    if x2.shape[0] == 0:
        raise ValueError(f"{arg}: empty batch (shape {tuple(x.shape)})")
    kk = max(1, min(int(k), V))
    top_vals, top_ids = torch.topk(x2, kk, dim=-1, largest=True, sorted=True)
    # topk does not promise lower-index-first among equal values; make it so.
    top_vals, top_ids = _stable_tie_order(top_vals, top_ids)
    if is_logits:
        m = top_vals[:, :1]
        s, d = _moments("logit", x2, m, want_entropy=entropy)
        s64 = s.double()
        log_norm = m[:, 0].double() + torch.log(s64)
        if validate:
            check_logits_rows(log_norm, arg)
        top = torch.exp(top_vals.double() - log_norm[:, None])
        ent = (torch.log(s64) - d.double() / s64) if entropy else None
    else:
        if validate:
            check_probs(x2, arg)
        _, h = _moments("prob", x2, want_entropy=entropy)
        log_norm = None
        top = top_vals.double()
        ent = h.double() if entropy else None
    return Summary(top, top_ids, ent, log_norm, V, out, x2, is_logits)


def _stable_tie_order(vals: torch.Tensor, ids: torch.Tensor):
    """Reorder equal values so that lower token ids come first (numpy/torch argmax convention)."""
    # Sorting by id then stably by value (descending) gives value-desc, id-asc order.
    ids_sorted, perm = torch.sort(ids, dim=-1)
    vals_by_id = vals.gather(-1, perm)
    order = torch.sort(vals_by_id, dim=-1, descending=True, stable=True).indices
    return vals_by_id.gather(-1, order), ids_sorted.gather(-1, order)
