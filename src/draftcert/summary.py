"""One pass over a batch of distributions: the statistics every certificate needs.

Every criterion in this library is decided by the *top of the sorted target
distribution* (and, for Medusa's rule, its entropy).  ``summarize`` reads each
row of ``(..., V)`` logits or probabilities once for the normaliser, the
entropy and the minimum (a fused kernel when the input is large), once for a
block partial sort (``topk_rows``), and keeps the top-``k`` probabilities in
float64.  Rows for which ``k`` turns out to be too few (the rejected token sits
deeper) are settled exactly on demand (:meth:`Summary.min_prob`,
:meth:`Summary.max_prob_where`, and for extremely flat rows
:meth:`Summary.sorted_rows`), so the answer never depends on ``k``; ``k`` only
trades speed.
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


# Elements per float64 conversion buffer in _sum_f64 (1 MiB: stays in L2, and one reused
# buffer instead of a fresh (N, V) float64 temporary per sum, whose page faults cost
# ~20x the arithmetic in the profile loop).
_SUM_CHUNK = 1 << 17


def _sum_f64(a: torch.Tensor, buf: torch.Tensor | None = None) -> torch.Tensor:
    """``a.sum(-1, dtype=torch.float64)`` for 2-D a, converting a few rows at a time into a
    reused buffer (the same exact conversion and float64 accumulation; the reduction order
    within a row may differ, so results agree to float64 rounding, ~1e-16 relative)."""
    if a.dtype == torch.float64 or a.device.type != "cpu":
        return a.sum(-1, dtype=torch.float64)
    n, V = a.shape
    step = max(1, min(n, _SUM_CHUNK // max(V, 1)))
    if buf is None:
        buf = torch.empty(step, V, dtype=torch.float64)
    out = torch.empty(n, dtype=torch.float64)
    for i in range(0, n, step):
        j = min(n, i + step)
        out[i:j] = buf[: j - i].copy_(a[i:j]).sum(-1)
    return out


def _logit_moments(x: torch.Tensor, m: torch.Tensor, want_entropy: bool, fused: bool = False):
    """s = sum exp(x - m);  d = sum exp(x - m) * (x - m)  (0 where exp underflows / x = -inf);
    and the row minimum (it settles "is any token rejected?" for every level-set rule).
    ``fused``: plain reductions, for torch.compile to fuse into one pass."""
    z = x - m
    e = torch.exp(z)
    # Accumulate in float64 whatever the input dtype: a float32 accumulator over a
    # 150k-token row (batched reductions are not pairwise) moves the entropy by ~1e-6,
    # which moves the entropy rule's threshold and hence its radius by ~1e-5 relative.
    sum64 = (lambda a: a.sum(-1, dtype=torch.float64)) if fused else _sum_f64
    s = sum64(e)
    lo = x.amin(-1)
    if not want_entropy:
        return s, None, lo
    if fused:  # one fused pass anyway: the plain guard is the cheapest form for inductor
        d = torch.where(e > 0, e * z, torch.zeros((), dtype=e.dtype, device=e.device)).sum(-1, dtype=torch.float64)
        return s, d, lo
    # e * z, with 0 * -inf (x = -inf, a masked token) counted as 0: nan_to_num_ turns z = -inf
    # into 0 in place, then the product reuses z's memory -- two cheap passes where the
    # where(e > 0, e * z, 0) above takes four in eager mode.  (It also maps NaN to 0 and +inf
    # to the float max, but those only occur in rows whose normaliser s is already NaN, which
    # are flagged downstream; elsewhere both forms give the same products.)
    d = sum64(z.nan_to_num_(neginf=0.0).mul_(e))
    return s, d, lo


def _logit_moments_eager(x: torch.Tensor, m: torch.Tensor, want_entropy: bool):
    """_logit_moments a few rows at a time through reused buffers (on the CPU; the same values
    up to float64 rounding of the sums): fresh
    (N, V) temporaries for every step's logits cost page faults that exceed the arithmetic."""
    n, V = x.shape
    step = max(1, min(n, _SUM_CHUNK // max(V, 1)))
    if x.device.type != "cpu" or step >= n:
        return _logit_moments(x, m, want_entropy)
    zb, eb = torch.empty(step, V, dtype=x.dtype), torch.empty(step, V, dtype=x.dtype)
    buf = torch.empty(step, V, dtype=torch.float64)
    s = torch.empty(n, dtype=torch.float64)
    d = torch.empty(n, dtype=torch.float64) if want_entropy else None
    for i in range(0, n, step):
        j = min(n, i + step)
        z, e, b = zb[: j - i], eb[: j - i], buf[: j - i]
        torch.sub(x[i:j], m[i:j], out=z)
        torch.exp(z, out=e)
        s[i:j] = b.copy_(e).sum(-1)  # float64 accumulation, as in _sum_f64
        if want_entropy:  # e * z with 0 * -inf counted as 0, as in _logit_moments
            d[i:j] = b.copy_(z.nan_to_num_(neginf=0.0).mul_(e)).sum(-1)
    return s, d, x.amin(-1)


def _logit_moments_fused(x: torch.Tensor, m: torch.Tensor, want_entropy: bool):
    return _logit_moments(x, m, want_entropy, fused=True)


def _prob_moments_eager(p: torch.Tensor, want_entropy: bool):
    """sum p, sum -p log p and min p of each row."""
    s = p.sum(-1, dtype=torch.float64)  # float64 accumulators, as for logits
    lo = p.amin(-1)
    if not want_entropy:
        return s, None, lo
    return s, torch.special.entr(p).sum(-1, dtype=torch.float64), lo


def _band_eager(x: torch.Tensor, rows: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor):
    """For rows x[rows]: the largest value below lo, how many values fall in [lo, hi], and
    the largest and smallest of those (-inf / +inf if none).
    (Compiled, the row gather is fused into the reduction instead of copying rows.)"""
    xr = x[rows]
    inf = torch.full((), torch.inf, dtype=x.dtype, device=x.device)
    below = torch.where(xr < lo, xr, -inf).amax(-1)
    band = (xr >= lo) & (xr <= hi)
    n_band = band.sum(-1)
    band_max, band_min = torch.full_like(below, -torch.inf), torch.full_like(below, torch.inf)
    some = (n_band > 0).nonzero().squeeze(1)
    if some.numel():  # eager: only the (rare) rows with tokens in the band pay two more passes
        xs, bs = xr[some], band[some]
        band_max[some] = torch.where(bs, xs, -inf).amax(-1)
        band_min[some] = torch.where(bs, xs, inf).amin(-1)
    return below, n_band, band_max, band_min


def _band_fused(x: torch.Tensor, rows: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor):
    """_band_eager as one fused reduction for torch.compile (no data-dependent branches)."""
    xr = x[rows]
    inf = torch.full((), torch.inf, dtype=x.dtype, device=x.device)
    below = torch.where(xr < lo, xr, -inf).amax(-1)
    band = (xr >= lo) & (xr <= hi)
    return below, band.sum(-1), torch.where(band, xr, -inf).amax(-1), torch.where(band, xr, inf).amin(-1)


@functools.lru_cache(maxsize=None)
def _compiled(fn_name: str):
    fn = {"logit": _logit_moments_fused, "prob": _prob_moments_eager, "band": _band_fused}[fn_name]
    return torch.compile(fn, dynamic=True)


_compile_broken = False


def _moments(kind: str, *args, **kw):
    """Fused single read of the (N, V) input when it is large: XLA-style fusion of
    exp, the two reductions and the -inf guard, via torch.compile.  Falls back to
    eager torch (same formulas, a few more passes) if compilation is unavailable."""
    global _compile_broken
    x = args[0]
    eager = {"logit": _logit_moments_eager, "prob": _prob_moments_eager, "band": _band_eager}[kind]
    use_compile = (
        not _compile_broken
        and os.environ.get("DRAFTCERT_COMPILE", "1") != "0"
        and x.numel() >= _COMPILE_MIN_NUMEL
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )
    if use_compile:
        try:
            return _compiled(kind)(*args, **kw)
        except Exception as exc:  # pragma: no cover - depends on the host toolchain
            _compile_broken = True
            warnings.warn(f"draftcert: torch.compile unavailable ({exc!s:.200}); using eager kernels", stacklevel=3)
    return eager(*args, **kw)


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
    row_min: torch.Tensor | None = field(default=None, repr=False)  # (N,) smallest source value
    tail_cache: torch.Tensor | None = field(default=None, repr=False)  # mass beyond the top-k, once computed

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

    def _to_prob(self, vals: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        v = vals.double()
        return torch.exp(v - self.log_norm[rows][:, None]) if self.is_logits else v

    def min_prob(self, rows: torch.Tensor) -> torch.Tensor:
        """float64 smallest probability of the selected rows, computed as top_probs is."""
        lo = self.row_min[rows] if self.row_min is not None else self.source[rows].amin(-1)
        return self._to_prob(lo[:, None], rows)[:, 0]

    def max_prob_where(self, rows: torch.Tensor, tau: torch.Tensor, inclusive: bool) -> torch.Tensor:
        """float64 b = max{p(y) : p(y) < tau} (``<=`` if inclusive) for each selected row.

        Logits are compared in their own dtype against log(tau) + log_norm with a
        safety margin of a few ulps; only the rare tokens inside the margin are
        evaluated exactly (as top_probs is), so the answer is exact at the cost of
        one fused pass over the selected rows.
        """
        if not self.is_logits:
            P = self.source[rows].double()
            rej = P <= tau[:, None] if inclusive else P < tau[:, None]
            return torch.where(rej, P, torch.full_like(P, -1.0)).amax(1).clamp_min(0)
        with torch.no_grad():
            x = self.source
            t = torch.log(tau) + self.log_norm[rows]  # float64, -inf when tau = 0
            # float32 -> float64 conversion of t and the float64 exp are far more accurate
            # than 8 float32 ulps, so values outside [lo, hi] are decided by comparison alone.
            margin = 8 * torch.finfo(x.dtype).eps * (1 + t.abs())
            lo, hi = (t - margin).to(x.dtype), (t + margin).to(x.dtype)
            below, n_band, band_max, band_min = _moments("band", x, rows, lo[:, None], hi[:, None])
            b = self._to_prob(below[:, None], rows)[:, 0]  # surely rejected: far below the threshold
            # Tokens within the margin are decided exactly, as top_probs would decide them.
            # Usually the band holds one distinct value (or none): decide it from the kernel's
            # band maximum, without touching the row again.
            one = (n_band > 0) & (band_max == band_min)
            if bool(one.any()):
                pv = self._to_prob(band_max[:, None], rows)[:, 0]
                rej = pv <= tau if inclusive else pv < tau
                b = torch.where(one & rej, torch.maximum(b, pv), b)
            near = ((n_band > 0) & ~one).nonzero().squeeze(1)
            if near.numel():  # several distinct values in the band (rare): each one exactly
                xs = self.source[rows[near]]
                r_idx, c_idx = ((xs >= (t[near] - margin[near]).to(xs.dtype)[:, None])
                                & (xs <= (t[near] + margin[near]).to(xs.dtype)[:, None])).nonzero(as_tuple=True)
                pv = torch.exp(xs[r_idx, c_idx].double() - self.log_norm[rows[near]][r_idx])
                tv = tau[near][r_idx]
                rej = pv <= tv if inclusive else pv < tv
                cand = torch.where(rej, pv, torch.full_like(pv, -1.0))
                b_near = b[near].scatter_reduce(0, r_idx, cand, reduce="amax")
                b[near] = b_near
        return b.clamp_min(0)

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
    top_vals, top_ids = topk_rows(x2, kk)
    if is_logits:
        m = top_vals[:, :1]
        s, d, row_min = _moments("logit", x2, m, want_entropy=entropy)
        s64 = s.double()
        log_norm = m[:, 0].double() + torch.log(s64)
        if validate:
            check_logits_rows(log_norm, arg)
        top = torch.exp(top_vals.double() - log_norm[:, None])
        ent = (torch.log(s64) - d.double() / s64) if entropy else None
    else:
        if validate:
            check_probs(x2, arg)
        _, h, row_min = _moments("prob", x2, want_entropy=entropy)
        log_norm = None
        top = top_vals.double()
        ent = h.double() if entropy else None
    return Summary(top, top_ids, ent, log_norm, V, out, x2, is_logits, row_min)


# Block size of topk_rows' candidate search (32-64 measured fastest at V = 49k and 152k).
_TOPK_BLOCK = 64


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k values (descending) and ids of each row of (N, V) x, lower id first among equal values.

    Same values as ``torch.topk(x, k)`` (a value multiset is unique), about twice as fast on
    large rows: split the row into blocks of B and keep only the k blocks with the largest
    maxima, plus the columns past the last whole block, as candidates.  Exact, because with
    v_k the k-th largest value (NaN ordered above everything, as topk and amax do):
    every block holding a value > v_k has its maximum > v_k, and there are fewer than k such
    blocks (each holds a distinct value > v_k), so all of them are kept; and either every
    value >= v_k is kept, or some block with maximum >= v_k was dropped, in which case all k
    kept blocks have maxima >= v_k and contribute k values >= v_k.  Either way the candidates
    hold all values > v_k and at least k values >= v_k, so their top-k values are the row's.
    """
    N, V = x.shape
    B = _TOPK_BLOCK
    nb = V // B
    if nb < 4 * k:  # too few blocks to skip most of the row: plain partial sort
        vals, ids = torch.topk(x, k, dim=-1, largest=True, sorted=True)
    else:
        bmax = x[:, : nb * B].reshape(N, nb, B).amax(-1)  # one cheap streaming pass
        blocks = torch.topk(bmax, k, dim=-1, sorted=False).indices
        cols = (blocks[:, :, None] * B + torch.arange(B, device=x.device)).reshape(N, k * B)
        if nb * B < V:  # the partial last block is always a candidate
            cols = torch.cat([cols, torch.arange(nb * B, V, device=x.device).expand(N, -1)], 1)
        vals, j = torch.topk(x.gather(1, cols), k, dim=-1, largest=True, sorted=True)
        ids = cols.gather(1, j)
    # topk does not promise lower-index-first among equal values; make it so.
    return _stable_tie_order(vals, ids)


def _stable_tie_order(vals: torch.Tensor, ids: torch.Tensor):
    """Reorder equal values so that lower token ids come first (numpy/torch argmax convention)."""
    # Sorting by id then stably by value (descending) gives value-desc, id-asc order.
    ids_sorted, perm = torch.sort(ids, dim=-1)
    vals_by_id = vals.gather(-1, perm)
    order = torch.sort(vals_by_id, dim=-1, descending=True, stable=True).indices
    return vals_by_id.gather(-1, order), ids_sorted.gather(-1, order)
