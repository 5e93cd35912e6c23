"""One pass over a batch of distributions: the statistics every certificate needs.

Every criterion in this library is decided by the *top of the sorted target
distribution* (and, for Medusa's rule, its entropy).  ``summarize`` reads large
16/32-bit logits once (``_window_pass``: block maxima for the top-k, the minimum,
and the float64 normaliser and entropy in one compiled loop); other inputs once
for the normaliser, the entropy and the minimum and once for a block partial
sort (``topk_rows``).  It keeps the top-``k`` probabilities in float64.  Rows for which ``k`` turns out to be too few (the rejected token sits
deeper) are settled exactly on demand (the row minimum, :meth:`Summary.max_src_below`,
and for extremely flat rows
:meth:`Summary.sorted_rows`), so the answer never depends on ``k``; ``k`` only
trades speed.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass, field
from typing import Sequence

import math

import torch

from ._arrays import ArrayLike, OutputSpec, check_logits_rows, check_probs, output_spec, pick_input, to_tensor
from . import logit_pass
from ._fp import U, gamma, round_out

DEFAULT_TOPK = 16  # exactness never depends on it; 16 measured fastest for radii at V = 151,936 (benchmarks/bench_certificates.py)
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


def _logit_moments(x: torch.Tensor, m: torch.Tensor, want_entropy: bool):
    """s = sum exp(x - m);  d = sum exp(x - m) * (x - m)  (0 where exp underflows / x = -inf);
    and the row minimum (it settles "is any token rejected?" for every level-set rule).
    Everything in float64 whatever the input dtype: the exponentials too, so that the
    log-normaliser carries only float64 round-off (docs/theory.md, section 7: a float32
    exp would leave p summing to 1 - 1e-7 at V = 151,936).  ``m`` is float64 (N, 1).
    Plain reductions: ``_logit_moments_fused`` hands this very function to torch.compile,
    which fuses it into one pass."""
    z = x.to(torch.float64) - m
    e = torch.exp(z)
    s = e.sum(-1)
    lo = x.amin(-1)
    if not want_entropy:
        return s, None, lo
    d = torch.where(e > 0, e * z, torch.zeros((), dtype=e.dtype, device=e.device)).sum(-1)
    return s, d, lo


def _logit_moments_eager(x: torch.Tensor, m: torch.Tensor, want_entropy: bool):
    """_logit_moments a few rows at a time through reused float64 buffers (on the CPU; the
    same values up to float64 rounding of the sums): fresh (N, V) temporaries for every
    step's logits cost page faults that exceed the arithmetic."""
    n, V = x.shape
    step = max(1, min(n, _SUM_CHUNK // max(V, 1)))
    if x.device.type != "cpu" or step >= n:
        return _logit_moments(x, m, want_entropy)
    zb, eb = torch.empty(step, V, dtype=torch.float64), torch.empty(step, V, dtype=torch.float64)
    s = torch.empty(n, dtype=torch.float64)
    d = torch.empty(n, dtype=torch.float64) if want_entropy else None
    for i in range(0, n, step):
        j = min(n, i + step)
        z, e = zb[: j - i], eb[: j - i]
        z.copy_(x[i:j]).sub_(m[i:j])
        torch.exp(z, out=e)
        s[i:j] = e.sum(-1)
        if want_entropy:  # e * z with 0 * -inf counted as 0, as in _logit_moments
            d[i:j] = z.nan_to_num_(neginf=0.0).mul_(e).sum(-1)
    return s, d, x.amin(-1)


def _logit_moments_fused(x: torch.Tensor, m: torch.Tensor, want_entropy: bool):
    return _logit_moments(x, m, want_entropy)


def _prob_moments_eager(p: torch.Tensor, want_entropy: bool):
    """sum p, sum -p log p and min p of each row."""
    s = p.sum(-1, dtype=torch.float64)  # float64 accumulators, as for logits
    lo = p.amin(-1)
    if not want_entropy:
        return s, None, lo
    return s, torch.special.entr(p.double()).sum(-1), lo


def _below(x: torch.Tensor, rows: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
    """For rows x[rows]: the largest value < cut (per row; -inf if none).  One fused
    reduction when compiled (the row gather is fused in instead of copying the rows)."""
    xr = x[rows]
    neg = torch.full((), -torch.inf, dtype=x.dtype, device=x.device)
    return torch.where(xr < cut, xr, neg).amax(-1)


# The one-read pass for large 16/32-bit logits (``_window_pass``): each row is cut into
# windows of _WIN = 16 * _WIN_T columns, and block (w, c) of the top-k search is the _WIN_T
# columns w * _WIN + c + 16 t (t < _WIN_T) -- strided, so that a compiled loop over t keeps
# 16 block maxima and 16 partial sums per vector register and reads the window in order.
_WIN_T = 64
_WIN = 16 * _WIN_T
_REF_COLS = 2048  # the reference r of exp(x - r) is the maximum of this many leading columns
# rows whose maximum exceeds r by more than this are redone with r = max (the error bounds
# of docs/theory.md, section 7 grow with the gap; float64 exp(x - r) stays far from overflow)
MAX_REF_GAP = 64.0
# the gap assumed for a summary built without it (only the one-read pass leaves a gap, and
# only for V >= _WIN_MIN_V)
_WIN_MIN_V = 4 * _WIN


def _window_moments(x: torch.Tensor, r: torch.Tensor, want_entropy: bool):
    """Per strided block of the first R * _WIN columns: max, min, sum exp(x - r) and
    sum exp(x - r) (x - r) (float64; 0 where exp underflows or x = -inf), r (N, 1) float64.
    Written so that torch.compile emits a single loop nest: one read of x."""
    N, V = x.shape
    R = V // _WIN
    xb = x[:, : R * _WIN].view(N, R, _WIN_T, 16)
    z = xb.double() - r[:, :, None, None]
    s = torch.exp(z).sum(2)
    if not want_entropy:
        return xb.amax(2), xb.amin(2), s, None
    # a second, identical expression: a shared exp(z) with two consumers is materialised by
    # the compiler as an (N, V) float64 buffer; two copies are fused (and CSE'd) in one loop
    z2 = xb.double() - r[:, :, None, None]
    d = (torch.exp(z2) * z2.clamp_min(-1e300)).sum(2)
    return xb.amax(2), xb.amin(2), s, d


@functools.lru_cache(maxsize=None)
def _compiled(fn_name: str):
    fn = {"logit": _logit_moments_fused, "prob": _prob_moments_eager, "below": _below,
          "window": _window_moments}[fn_name]
    return torch.compile(fn, dynamic=True)


def _use_window(x: torch.Tensor, k: int) -> bool:
    V = x.shape[-1]
    return (
        not _compile_broken
        and os.environ.get("DRAFTCERT_COMPILE", "1") != "0"
        and x.numel() >= _COMPILE_MIN_NUMEL
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and V >= _WIN_MIN_V
        and 16 * (V // _WIN) >= 4 * k
    )


def _window_pass(x: torch.Tensor, k: int, want_entropy: bool):
    """Top-k, row minimum and the float64 moments of exp(x - r) of (N, V) logits from one read
    of x (docs/theory.md, sections 4 and 7).  Returns (top_vals, top_ids, s, d, row_min, r,
    gap) with gap = max(x) - r in [0, MAX_REF_GAP] (0 where a row was redone with r = max),
    or None when the compiler is unavailable (the caller takes the two-pass path)."""
    global _compile_broken
    N, V = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    R = V // _WIN
    r = x[:, : min(V, _REF_COLS)].amax(-1).double()
    r = torch.where(torch.isfinite(r), r, torch.zeros_like(r))
    try:
        bmax, bmin, sw, dw = _compiled("window")(x, r[:, None], want_entropy)
    except Exception as exc:  # pragma: no cover - depends on the host toolchain
        _compile_broken = True
        warnings.warn(f"draftcert: torch.compile unavailable ({exc!s:.200}); using eager kernels", stacklevel=3)
        return None
    s = sw.sum((1, 2))
    d = dw.sum((1, 2)) if want_entropy else None
    row_min = bmin.amin((1, 2))
    nb = 16 * R
    blocks = torch.topk(bmax.reshape(N, nb), k, dim=-1, sorted=False).indices
    t = torch.arange(_WIN_T, device=x.device) * 16
    # block b = 16 w + c starts at column 1024 w + c = b + 1008 w
    cols = (blocks + (blocks // 16) * (_WIN - 16))[:, :, None] + t
    cols = cols.reshape(N, k * _WIN_T)
    if R * _WIN < V:  # the columns past the last whole window: always candidates, summed here
        tail = x[:, R * _WIN :]
        ts, td, tlo = _logit_moments(tail, r[:, None], want_entropy)
        s = s + ts
        d = d + td if want_entropy else None
        row_min = torch.minimum(row_min, tlo)
        cols = torch.cat([cols, torch.arange(R * _WIN, V, device=x.device).expand(N, -1)], 1)
    # exact for any partition of the columns into blocks: the argument of topk_rows
    vals, j = torch.topk(x.gather(1, cols), k, dim=-1, largest=True, sorted=True)
    top_vals, top_ids = _stable_tie_order(vals, cols.gather(1, j))
    M = top_vals[:, 0].double()  # the row maximum (NaN ranks first)
    gap = M - r
    redo = ~(torch.isfinite(M) & (gap >= 0) & (gap <= MAX_REF_GAP) & torch.isfinite(s) & (s > 0))
    if bool(redo.any()):
        i = redo.nonzero().squeeze(1)
        m = torch.where(torch.isfinite(M[i]), M[i], torch.zeros_like(M[i]))
        s_i, d_i, _ = _logit_moments_eager(x[i], m[:, None], want_entropy)
        s, r, gap = s.clone(), r.clone(), gap.clone()
        s[i], r[i], gap[i] = s_i, m, 0.0
        if want_entropy:
            d = d.clone()
            d[i] = d_i
    gap = torch.where(torch.isfinite(gap), gap.clamp_min(0), torch.zeros_like(gap))
    return top_vals, top_ids, s, d, row_min, r, gap


_compile_broken = False


def _moments(kind: str, *args, **kw):
    """Fused single read of the (N, V) input when it is large ("below": the rows it reads):
    XLA-style fusion of exp, the two reductions and the -inf guard, via torch.compile; the
    logit moments of 16/32-bit CPU rows come from the native pass (``logit_pass``) first.  Falls back to
    eager torch (same formulas, a few more passes) if compilation is unavailable."""
    global _compile_broken
    x = args[0]
    eager = {"logit": _logit_moments_eager, "prob": _prob_moments_eager, "below": _below}[kind]
    if kind == "logit":
        fused = logit_pass.logit_moments(x, args[1], kw["want_entropy"])
        if fused is not None:
            return _fused_moments(x, args[1], kw["want_entropy"], fused)
    use_compile = (
        not _compile_broken
        and os.environ.get("DRAFTCERT_COMPILE", "1") != "0"
        and (x.numel() if kind != "below" else args[1].numel() * x.shape[-1]) >= _COMPILE_MIN_NUMEL
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
    )
    if use_compile:
        try:
            return _compiled(kind)(*args, **kw)
        except Exception as exc:  # pragma: no cover - depends on the host toolchain
            _compile_broken = True
            warnings.warn(f"draftcert: torch.compile unavailable ({exc!s:.200}); using eager kernels", stacklevel=3)
    return eager(*args, **kw)


def _fused_moments(x: torch.Tensor, m: torch.Tensor, want_entropy: bool, fused: torch.Tensor):
    """(s, d, min) from the native pass's [N, 3]; rows it flags (a NaN or +inf logit) get
    torch's values, so that a broken row reads the same whichever pass ran."""
    s, d, lo = fused.unbind(1)
    lo = lo.to(x.dtype)  # the minimum is one of the given values: exact in their dtype
    rows = torch.isnan(s).nonzero().squeeze(1)
    if rows.numel():
        ts, td, tlo = _logit_moments_eager(x[rows], m[rows], want_entropy)
        s[rows], lo[rows] = ts, tlo
        if want_entropy:
            d[rows] = td
    return s, d if want_entropy else None, lo


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

    Probabilities are renormalised in float64 (``p = x / sum(x)``); logits give
    ``p = exp(x - log_norm)``.  Either way every float64 value carries the error bounds
    of docs/theory.md, section 7 (:meth:`common_err`, :meth:`entry_err`).  The order of
    the tokens is exactly the order of the given values (``top_vals``), never of rounded
    probabilities.
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
    tail_cache: torch.Tensor | None = field(default=None, repr=False)  # upper bound on the mass beyond the top-k
    top_vals: torch.Tensor | None = field(default=None, repr=False)  # (N, k) source values of top_ids
    norm: torch.Tensor | None = field(default=None, repr=False)  # (N,) float64 row sums (probability input)
    lse_err: torch.Tensor | None = field(default=None, repr=False)  # (N,) bound on |log_norm - exact|
    entropy_tilde: torch.Tensor | None = field(default=None, repr=False)  # (N,) -sum p log(p + 1e-5)
    # logits: the normaliser was summed as s = sum exp(x - r) with r = max(x) - ref_gap; log_s =
    # log s, ent_q = sum exp(x - r) (x - r) / s (the entropy is log_s - ent_q).  None in a
    # summary built by hand: the error bounds then assume the worst gap (docs/theory.md, section 7)
    ref_gap: torch.Tensor | None = field(default=None, repr=False)
    log_s: torch.Tensor | None = field(default=None, repr=False)
    ent_q: torch.Tensor | None = field(default=None, repr=False)
    _memo: dict = field(default_factory=dict, repr=False)  # per-summary values every rule asks for

    def __post_init__(self):
        # the given values of the top-k (built from top_ids when a caller assembles a Summary
        # by hand; left None when its source does not hold the vocabulary)
        if self.top_vals is None and self.source is not None and self.source.shape[-1] == self.vocab_size:
            self.top_vals = self.source.gather(-1, self.top_ids)

    # Fields holding one entry (or one row) per distribution: what select/concat carry along.
    _ROW_FIELDS = ("top_probs", "top_ids", "entropy", "log_norm", "source", "row_min", "top_vals", "norm",
                   "lse_err", "entropy_tilde", "ref_gap", "log_s", "ent_q")

    def select(self, rows: torch.Tensor) -> "Summary":
        """The summary of the selected rows only (an index tensor or bool mask), with every
        per-row field and error bound carried along, so every radius, acceptance and
        certificate of a selected row is bit for bit the one of the full summary."""
        picked = {f: (None if getattr(self, f) is None else getattr(self, f)[rows]) for f in self._ROW_FIELDS}
        n = picked["top_probs"].shape[0]
        return Summary(vocab_size=self.vocab_size, is_logits=self.is_logits, out=self.out.flat(n), **picked)

    @staticmethod
    def concat(parts: "Sequence[Summary]") -> "Summary":
        """One summary over the rows of several, in order (same V, k and input kind; a
        per-row field present in one part must be present in all)."""
        if len(parts) == 1:
            return parts[0]
        p0 = parts[0]
        if any(s.vocab_size != p0.vocab_size or s.k != p0.k or s.is_logits != p0.is_logits for s in parts):
            raise ValueError("Summary.concat: parts differ in vocabulary size, k or input kind")
        fields = {}
        for f in Summary._ROW_FIELDS:
            vals = [getattr(s, f) for s in parts]
            fields[f] = None if any(v is None for v in vals) else torch.cat(vals)
        n = fields["top_probs"].shape[0]
        return Summary(vocab_size=p0.vocab_size, is_logits=p0.is_logits, out=p0.out.flat(n), **fields)

    @property
    def k(self) -> int:
        return self.top_probs.shape[-1]

    @property
    def complete(self) -> bool:
        """True when ``top_probs`` holds the whole sorted distribution."""
        return self.k == self.vocab_size

    # -- normalisation and its error bounds (docs/theory.md, section 7) -----------------
    def row_norm(self) -> torch.Tensor:
        """float64 row sums of probability input (what p is renormalised by)."""
        if self.norm is None:
            self.norm = self.source.sum(-1, dtype=torch.float64)
        return self.norm

    def _gap(self) -> torch.Tensor | float:
        """max(x) - r of the normaliser's sum (logits), or its worst case when unknown."""
        if self.ref_gap is not None:
            return self.ref_gap
        return MAX_REF_GAP if self.vocab_size >= _WIN_MIN_V else 0.0

    def _abs_log_s(self) -> torch.Tensor | float:
        """|log s| (logits), or its bound log V + gap when unknown (e^gap <= s <= V e^gap)."""
        if self.log_s is not None:
            return self.log_s.abs()
        return math.log(self.vocab_size) + self._gap()

    def log_norm_err(self) -> torch.Tensor:
        """(N,) bound on |log_norm - exact log-sum-exp| (logit input)."""
        if self.lse_err is None:
            self.lse_err = _lse_err(self.vocab_size, self.log_norm, self._abs_log_s(), self._gap())
        return self.lse_err

    def common_err(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """(N,) u_c: the computed probabilities are p_i * c * theta_i with |c - 1| <= u_c a
        factor common to the row (the normaliser's error) and |theta_i - 1| <= entry_err."""
        if rows is None and "uc" in self._memo:
            return self._memo["uc"]
        if self.is_logits:
            e = torch.expm1(self.log_norm_err())
        else:
            e = torch.full((self.top_probs.shape[0],), float(gamma(self.vocab_size + 2)), dtype=torch.float64,
                           device=self.top_probs.device)
        if rows is None:
            self._memo["uc"] = e
            return e
        return e[rows]

    def top_entry_err(self) -> torch.Tensor:
        """entry_err of the top-k (computed once per summary: every rule asks for it)."""
        if "es" not in self._memo:
            self._memo["es"] = self.entry_err(self.top_vals)
        return self._memo["es"]

    def top_zero_mask(self) -> torch.Tensor:
        if "zero" not in self._memo:
            self._memo["zero"] = self.zero_mask(self.top_vals)
        return self._memo["zero"]

    def entry_err(self, vals: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Relative per-entry error bound of the float64 probabilities of source values
        ``vals`` (N', K) of the given rows: 2U (|x - log_norm| + 4) for logits (the
        subtraction and a 1-ulp exp), 2U for probabilities (one division)."""
        if not self.is_logits:
            return torch.full(vals.shape, 2 * U, dtype=torch.float64, device=vals.device)
        ln = self.log_norm if rows is None else self.log_norm[rows]
        z = (vals.double() - ln[:, None]).abs()
        return 2 * U * (torch.where(torch.isinf(z), torch.zeros_like(z), z) + 4)

    def probs_f64(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Full float64 probabilities of the given rows (all rows if None)."""
        src = self.source if rows is None else self.source[rows]
        return self.to_prob(src, torch.arange(src.shape[0], device=src.device) if rows is None else rows)

    def sorted_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact full descending sort of the selected rows, by the given values (stable:
        lower id first among ties): (float64 probabilities, source values)."""
        vals = torch.sort(self.source[rows], dim=-1, descending=True, stable=True).values
        return self.to_prob(vals, rows), vals

    def to_prob(self, vals: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """float64 probabilities of given values ``vals`` [len(rows), j] of the selected rows,
        computed exactly as ``top_probs`` is (``exp(x - log_norm)`` or ``x / row sum``)."""
        v = vals.double()
        if self.is_logits:
            return torch.exp(v - self.log_norm[rows][:, None])
        return v / self.row_norm()[rows][:, None]

    def row_min_src(self, rows: torch.Tensor) -> torch.Tensor:
        return self.row_min[rows] if self.row_min is not None else self.source[rows].amin(-1)

    def max_src_below(self, rows: torch.Tensor, cut: torch.Tensor) -> torch.Tensor:
        """For each selected row the largest source value < cut (exact comparison in the
        values' own dtype; -inf if none): one pass over those rows."""
        return _moments("below", self.source, rows, cut[:, None])

    def prob_of(self, ids: torch.Tensor) -> torch.Tensor:
        """float64 probability of token ``ids[n]`` in row n, computed exactly as top_probs is."""
        v = self.source.gather(-1, ids[:, None])
        return self.to_prob(v, torch.arange(v.shape[0], device=v.device))[:, 0]

    def cut_dtype(self) -> torch.dtype:
        return torch.float64 if self.source.dtype == torch.float64 else torch.float32

    def cut_from_tau(self, tau_hi: torch.Tensor, inclusive: bool = True) -> torch.Tensor:
        """A cut c in the values' domain with {y : exact p(y) <= tau_hi} (``<`` if not
        inclusive) contained in {y : x_y < c}: the conservative rejection region of a
        threshold known only up to tau <= tau_hi (docs/theory.md, section 7).  Exact
        comparisons follow in the values' own dtype (a float32 cut for 32-bit and narrower
        values: they promote exactly)."""
        tau_hi = tau_hi.double()
        if self.is_logits:
            lt = torch.log(tau_hi.clamp_min(0))
            ln = self.log_norm
            t = lt + ln + self.log_norm_err() + 4 * U * (lt.abs() + ln.abs() + 1)
            t = torch.where(torch.isneginf(lt), lt, t)
        else:
            t = tau_hi * self.row_norm() * (1 + gamma(self.vocab_size + 2) + 4 * U)
        c = self.cut_up(t, inclusive)
        return torch.where(tau_hi < 0, torch.full_like(c, -torch.inf), c)

    def cut_up(self, t: torch.Tensor, inclusive: bool) -> torch.Tensor:
        """float64 bound t on the exact cut in the values' domain -> the cut in the cut
        dtype, rounded up; ``inclusive``: x <= t must imply x < cut."""
        c = round_out(t, self.cut_dtype(), "up")
        if inclusive:
            c = torch.nextafter(c, torch.full_like(c, torch.inf))
        return c

    def zero_mask(self, vals: torch.Tensor) -> torch.Tensor:
        """Source values whose probability is exactly 0 (a -inf logit, a 0 probability)."""
        return torch.isneginf(vals) if self.is_logits else vals == 0

    # -- entropies with their error bounds -----------------------------------------------
    def entropy_err(self) -> torch.Tensor:
        """(N,) bound on |entropy - exact Shannon entropy of the given values|.

        Logits (docs/theory.md, section 7): H = log s - q with s = sum e^z, q = sum e^z z / s,
        z = x - r and r = max(x) - gap, gap >= 0.  s carries a relative error sigma =
        gamma_{2V+8} + 2 U gap; q an absolute (c1 + sigma + 2U)|q| + 2 c1 gap, c1 = gamma_V +
        U (gap + 760) (each term e^z z is off by U (|z| + 7) relative, |z| <= 746 + gap where
        e^z does not underflow, and sum p |z| <= |q| + 2 gap); log s 4U |log s| more, and the
        final subtraction U |H|."""
        V = self.vocab_size
        H = self.entropy
        if not self.is_logits:
            return U * ((4 * V + 300) * (H + 1) + 2 * (math.log(V) + 20) ** 2)
        gap = self._gap()
        ls = self._abs_log_s()
        q = self.ent_q.abs() if self.ent_q is not None else (ls + H.abs()) * (1 + 4 * U)
        sigma = gamma(2 * V + 8) + 2 * U * gap
        c1 = gamma(V) + U * (gap + 760)
        e = sigma + 4 * U * ls + (c1 + sigma + 2 * U) * q + 2 * c1 * gap
        return e * (1 + 1e-6) + U * H.abs() * (1 + U) + 2.0**-1000

    def tilde_entropy(self) -> torch.Tensor:
        """(N,) H~ = -sum p log(p + 1e-5), the entropy of Medusa / vLLM's typical acceptance,
        in float64 (a second pass over the rows: it needs the normaliser first)."""
        if self.entropy_tilde is None:
            n = self.source.shape[0]
            out = torch.empty(n, dtype=torch.float64, device=self.source.device)
            step = max(1, min(n, _SUM_CHUNK // max(self.vocab_size, 1))) if self.source.device.type == "cpu" else n
            for i in range(0, n, step):
                j = min(n, i + step)
                P = self.probs_f64(torch.arange(i, j, device=self.source.device))
                out[i:j] = -(P * torch.log(P + TYPICAL_EPS)).sum(-1)
            self.entropy_tilde = out
        return self.entropy_tilde

    def tilde_entropy_err(self) -> torch.Tensor:
        """(N,) bound on |H~ - exact H~|: the common factor moves each term by at most
        u_c p |log(p + 1e-5) + p / (p + 1e-5)| <= 12.6 u_c p; per-entry errors likewise,
        and the float64 sum adds gamma_V sum |term|."""
        V = self.vocab_size
        uc = self.common_err()
        span = 2 * U * (math.log(V) + 4) if self.is_logits else 2 * U  # sum_i p_i theta_i, |log p| <= ...: H <= log V
        return 13 * (uc + span) + gamma(V + 8) * (self.tilde_entropy().abs() + 1e-5) + 64 * U


TYPICAL_EPS = 1e-5  # the constant inside Medusa's / vLLM's log(p + 1e-5)


def _lse_err(V: int, log_norm: torch.Tensor, abs_log_s, gap) -> torch.Tensor:
    """Bound on |log_norm - exact log-sum-exp| for log_norm = r + log s, s = sum exp(x - r)
    summed in float64, r = max(x) - gap (docs/theory.md, section 7): each term exp(x - r) is
    off by U (|x - r| + 4) relative, sum e^z |z| <= s (V/e + gap), the sum adds gamma_V."""
    if isinstance(abs_log_s, torch.Tensor):
        abs_log_s = abs_log_s.abs()
    return gamma(2 * V + 8) + 2 * U * gap + 4 * U * (log_norm.abs() + abs_log_s + 2)


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
        Probability rows are validated (sum within 1e-4 of 1) and renormalised in float64.
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
    win = _window_pass(x2, kk, entropy) if is_logits and _use_window(x2, kk) else None
    gap = ent_q = None
    if win is not None:
        top_vals, top_ids, s, d, row_min, r, gap = win
        if validate and not bool(torch.isfinite(top_vals[:, 0]).all()):
            check_logits_rows(top_vals[:, 0].double(), arg)
    else:
        top_vals, top_ids = topk_rows(x2, kk)
    if is_logits:
        if win is None:
            m = top_vals[:, :1].double()
            if validate and not bool(torch.isfinite(m).all()):
                check_logits_rows(m[:, 0], arg)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # broken rows: NaN below, flagged
            s, d, row_min = _moments("logit", x2, m, want_entropy=entropy)
            r, gap = m[:, 0], torch.zeros_like(m[:, 0])
        log_s = torch.log(s)
        log_norm = r + log_s
        if validate:
            check_logits_rows(log_norm, arg)
        lse_err = _lse_err(V, log_norm, log_s, gap)
        top = torch.exp(top_vals.double() - log_norm[:, None])
        if entropy:
            ent_q = d / s
            ent = log_s - ent_q
        else:
            ent = None
        norm = None
    else:
        norm = x2.sum(-1, dtype=torch.float64)
        if validate:
            check_probs(x2, arg, row_sum=norm)
        _, h, row_min = _moments("prob", x2, want_entropy=entropy)
        log_norm, lse_err = None, None
        top = top_vals.double() / norm[:, None]
        # H(x / S) = sum entr(x) / S + log S
        ent = (h / norm + torch.log(norm)) if entropy else None
    return Summary(top, top_ids, ent, log_norm, V, out, x2, is_logits, row_min,
                   top_vals=top_vals, norm=norm, lse_err=lse_err, ref_gap=gap,
                   log_s=log_s if is_logits else None, ent_q=ent_q)


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


def argmax_lowest(row: torch.Tensor) -> int:
    """The index of the largest value of a 1-D row, the lowest among equal values, a NaN above every
    number (its first copy wins): ``torch.argmax``'s documented rule.  A CPU float32/float64 row goes
    through numpy's ``argmax`` (the same rule): torch's CPU argmax takes about 70 us on a
    49,152-wide row and numpy's about 4, and a greedy step on the embedded target takes 9 ms."""
    if row.dim() == 1 and row.device.type == "cpu" and row.dtype in (torch.float32, torch.float64):
        return int(row.detach().numpy().argmax())
    return int(row.argmax())


def topk_lowest_ids(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_rows`` with the tie rule applied across the k-th value too: among equal values the
    lowest ids are kept (``topk_rows`` keeps *some* of them when a tie crosses the end of its list),
    i.e. the first k of the row stably sorted by value, descending.  A feature drafter gives every
    token outside its draft vocabulary one shared logit, so such ties are real there; the engine
    drafts with this order and the profile records it.  Costs a top-(k+1) instead of a top-k, and one
    vectorised pass over the rows where the tie crosses the end."""
    if k >= x.shape[-1]:
        return topk_rows(x, k)
    # One more than asked: the tie at the k-th value crosses the end of the list exactly when
    # the (k+1)-th value equals it (cheaper than counting the row's copies of it).
    vals, ids = topk_rows(x, k + 1)
    short = (vals[:, k] == vals[:, k - 1]).nonzero().flatten()
    vals, ids = vals[:, :k].contiguous(), ids[:, :k].contiguous()
    kth = vals[:, -1:]
    if short.numel():
        # Rows where the tie at the k-th value crosses the end of the list: keep every value
        # above it and the lowest-id copies of it, exactly k per row (one vectorised pass).
        xs, ks = x[short], kth[short]
        above = (xs > ks) | xs.isnan()  # NaN ranks above everything, as in topk and sort
        tied = xs == ks
        need = k - above.sum(1, keepdim=True)
        keep = above | (tied & (tied.cumsum(1) <= need))
        cols = keep.nonzero()[:, 1].reshape(-1, k)  # row-major: ascending ids within a row
        v, i = _stable_tie_order(xs.gather(1, cols), cols)
        vals[short], ids[short] = v, i
    return vals, ids


def _stable_tie_order(vals: torch.Tensor, ids: torch.Tensor):
    """Reorder equal values so that lower token ids come first (numpy/torch argmax convention)."""
    # Sorting by id then stably by value (descending) gives value-desc, id-asc order.
    ids_sorted, perm = torch.sort(ids, dim=-1)
    vals_by_id = vals.gather(-1, perm)
    order = torch.sort(vals_by_id, dim=-1, descending=True, stable=True).indices
    return vals_by_id.gather(-1, order), ids_sorted.gather(-1, order)
