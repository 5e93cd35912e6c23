"""Linear layers whose CPU kernel is chosen by measurement, per weight shape and row count.

Why: a speculative verification pass runs 2..9 rows (the pending token and the drafts) through
every linear layer.  At batch 1 a pass is bound by reading the weights, so in principle 9 rows
cost about one row; in practice the library kernel for a small M depends on the CPU, the BLAS and
M: MKL's ``F.linear`` streams an (N, K) row-major weight once for M <= 3 or 4 rows and then packs
it (a whole extra weight copy per call), a column-major copy of the weight helps on some CPUs and
hurts on others, oneDNN's prepacked weight is flat in M but has a fixed overhead.  No single
choice is best everywhere, so ``enable`` *times* the candidates on the machine at hand and keeps,
per (weight shape, rows = 1..MAX_ROWS), the fastest:

* ``rowmajor``: ``F.linear(x, W)`` on the parameter itself (the plain layer, bit for bit);
* ``colmajor``: ``F.linear(x, W_cm)`` with ``W_cm = W.t().contiguous().t()`` (same values);
* ``mkldnn``: ``torch.ops.mkldnn._linear_pointwise`` on a oneDNN-prepacked copy of W (float32 only);
* ``streamed``: draftcert's own kernel (``draftcert.kernels.packed_matmul``, compiled for this CPU on first
  use) on a block-packed copy of W, which it reads once for any rows (float32 only; offered only
  where a C compiler built it).

Timing (``measure_passes``): passes over the model's linear layers in order (up to ``TIMED_BYTES``
of weights), one per (rows in 1..MAX_ROWS, candidate), each layer of a shape run with the candidate
and timed, so that every kernel reads its weights after a pass's worth of other weights, as inside
the model; round robin ``repeats`` times after a warm-up, the fastest round decides (a neighbour
only ever adds time).  A candidate replaces ``rowmajor`` only when it is at least ``MARGIN`` faster
(noise does not flip the plain path).  A candidate that fails on this build or disagrees with
``F.linear`` beyond float32 rounding is dropped.  Rows above MAX_ROWS (prefills) run ``rowmajor``.

The choice is cached on disk, one JSON per (CPU model, torch version, thread count, dtype,
shape, build of the streamed kernel) under ``<cache_root>/linear_chooser/`` (``draftcert._cache.cache_root``); a file whose
recorded key differs from this machine's is never used.  It is made with the thread count
current when ``enable`` runs.

Only the kernel changes (the values are the same), so outputs agree with the plain layer to
float32 rounding, as any two GEMM kernels do; a row count that chose ``rowmajor`` (and 1 row,
always: the target alone runs the unmodified layer) runs exactly the original code path.  A copy is kept
only for the layouts some row count chose, and rebuilt on first use after the weight changes
(in place, reassigned, moved or cast).  ``disable`` restores the plain modules.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
import platform
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from .._cache import cache_root
from ..fileio import write_json
from . import packed_matmul

__all__ = ["enable", "disable", "is_enabled", "plan_of", "plain_kernels", "measure_passes", "measure_shape", "cpu_model", "STRATEGIES", "MAX_ROWS"]

STRATEGIES = ("rowmajor", "colmajor", "mkldnn", "streamed")
MAX_ROWS = 16  # rows timed and dispatched (a verification of up to 15 drafts: trees with suffix candidates); more: rowmajor
TIMED_BYTES = 768 << 20  # weights one timing pass reads (a 135M float32 model whole; a larger one's first layers)
MARGIN = 0.10  # another kernel must be >= 10 % faster than rowmajor to replace it (timing noise on a shared machine)
PLAN_VERSION = 8


def cpu_model() -> str:
    """The CPU's model string (``/proc/cpuinfo``'s model name, else ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


# ----------------------------------------------------------------------------- kernels


def _layout(w: torch.Tensor, how: str):
    """The weight as strategy ``how`` reads it (a copy for colmajor/mkldnn/streamed; for streamed,
    ``(packed, out_features)``)."""
    with torch.no_grad():
        w = w.detach()
        if how == "colmajor":
            return w.t().contiguous().t()
        if how == "mkldnn":
            return torch.ops.mkldnn._reorder_linear_weight(w)
        if how == "streamed":
            return packed_matmul.pack(w), w.shape[0]
        return w


def _apply(how: str, x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    if how == "mkldnn":
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    if how == "streamed":
        return packed_matmul.linear(x, w[0], w[1], bias)
    return F.linear(x, w, bias)


def _usable(how: str, w: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Does ``how`` run on this build and dtype, and agree with ``F.linear`` within float32 rounding?"""
    if how in ("mkldnn", "streamed") and (w.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32)):
        return False
    if how == "streamed" and (not packed_matmul.LIBRARY.available() or packed_matmul.max_rows() < MAX_ROWS):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(MAX_ROWS, w.shape[1], generator=g, dtype=w.dtype)
        with torch.no_grad():
            ref = F.linear(x, w, bias)
            got = _apply(how, x, _layout(w, how), bias)
        eps = torch.finfo(w.dtype).eps
        return got.shape == ref.shape and bool(((got - ref).abs() <= 64 * eps * (x.abs() @ w.abs().t() + 1)).all())
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False


def _group(mod: nn.Linear) -> tuple:
    return tuple(mod.weight.shape), mod.weight.dtype, mod.bias is not None


def _timed_prefix(mods: list[nn.Linear]) -> list[nn.Linear]:
    """The layers a timing pass runs: the model's linear layers in order up to ``TIMED_BYTES`` of
    weights, then the first layer of every shape not among them (a large model's LM head)."""
    out, total = [], 0
    for m in mods:
        size = m.weight.numel() * m.weight.element_size()
        if total + size <= TIMED_BYTES:
            out.append(m)
            total += size
    seen = {_group(m) for m in out}
    for m in mods:
        if _group(m) not in seen:
            out.append(m)
            seen.add(_group(m))
    return out


def measure_passes(mods: list[nn.Linear], timed: set | None = None, *, repeats: int = 3,
                   strategies=STRATEGIES, max_rows: int = MAX_ROWS) -> dict:
    """Time the kernels inside passes over ``mods`` in order, as a forward pass runs them.

    For every rows r in 1..max_rows and every strategy s, one pass applies every layer of ``mods``
    (up to ``TIMED_BYTES`` of weights, see ``_timed_prefix``) to r rows, each layer of a group in
    ``timed`` (default: all groups) with s where s is usable for it, every other layer with rowmajor;
    a group's time is the sum over its layers.  So each kernel reads its weights after a pass's worth
    of other weights, from memory, as in the model (timing one shape's weights alone kept them in a
    large cache and ranked the kernels unlike the model).  ``repeats`` rounds after a warm-up, round
    robin over (rows, strategy); the fastest round decides (a neighbour only ever adds time).

    Returns ``{group: {"seconds": {strategy: [s for rows 1..max_rows]}, "choice": [strategy per rows]}}``
    with ``group = (shape, dtype, has_bias)``.  One row always keeps ``rowmajor`` (the target alone
    runs the unmodified layer); another kernel replaces it only when at least ``MARGIN`` faster.
    """
    run_mods = _timed_prefix(mods)
    groups = {}
    for m in run_mods:
        groups.setdefault(_group(m), m)
    timed = set(groups) if timed is None else set(timed) & set(groups)
    usable = {g: [s for s in strategies if s == "rowmajor" or _usable(s, groups[g].weight, groups[g].bias)]
              for g in timed}
    lay = {}
    for m in run_mods:
        for s in usable.get(_group(m), ["rowmajor"]):
            lay[(id(m), s)] = m.weight.detach() if s == "rowmajor" else _layout(m.weight, s)
    gen = torch.Generator().manual_seed(0)
    xs = {}
    for m in run_mods:
        k, dt = m.weight.shape[1], m.weight.dtype
        for r in range(1, max_rows + 1):
            if (r, k, dt) not in xs:
                xs[(r, k, dt)] = torch.randn(r, k, generator=gen, dtype=dt)
    layers = [(m, _group(m), (m.weight.shape[1], m.weight.dtype)) for m in run_mods]  # (layer, group, x's K and dtype)
    order = [s for s in STRATEGIES if any(s in u for u in usable.values())] or ["rowmajor"]
    times = {(g, s, r): [] for g in timed for s in usable[g] for r in range(1, max_rows + 1)}
    with torch.no_grad():
        for rep in range(repeats + 1):  # the first round warms up and is dropped
            for r in range(1, max_rows + 1):
                for s in order:
                    acc = dict.fromkeys(timed, 0.0)
                    for m, g, xkey in layers:
                        how = s if g in timed and s in usable[g] else "rowmajor"
                        t0 = time.perf_counter()
                        _apply(how, xs[(r, *xkey)], lay[(id(m), how)], m.bias)
                        if how == s and g in timed:
                            acc[g] += time.perf_counter() - t0
                    if rep:
                        for g in timed:
                            if s in usable[g]:
                                times[(g, s, r)].append(acc[g])
    out = {}
    for g in timed:
        sec = {s: [min(times[(g, s, r)]) for r in range(1, max_rows + 1)] for s in usable[g]}
        choice = ["rowmajor"]
        for i in range(1, max_rows):
            best = min(usable[g], key=lambda s: sec[s][i])
            choice.append(best if sec[best][i] < (1 - MARGIN) * sec["rowmajor"][i] else "rowmajor")
        out[g] = {"seconds": sec, "choice": choice, "timed_layers": sum(_group(m) == g for m in run_mods)}
    return out


def measure_shape(weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None, *,
                  repeats: int = 3, strategies=STRATEGIES, max_rows: int = MAX_ROWS) -> dict:
    """``measure_passes`` on layers holding ``weights`` (one shape) alone:
    ``{"seconds": {strategy: [s for rows 1..max_rows]}, "choice": [strategy per rows]}``."""
    bs = list(biases) if biases is not None else [None] * len(weights)
    mods = []
    for w, b in zip(weights, bs):
        lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, dtype=w.dtype)
        lin.weight = nn.Parameter(w.detach(), requires_grad=False)
        if b is not None:
            lin.bias = nn.Parameter(b.detach(), requires_grad=False)
        mods.append(lin)
    res = measure_passes(mods, repeats=repeats, strategies=strategies, max_rows=max_rows)
    return res[_group(mods[0])]


# ----------------------------------------------------------------------------- the cached plan


def plan_key(shape: tuple[int, int], dtype: torch.dtype, bias: bool) -> dict:
    """What a cached choice is valid for: this CPU, torch build, thread count, dtype, shape and the
    build of draftcert's own kernel (another source or compiler is timed again)."""
    return {"cpu": cpu_model(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "dtype": str(dtype).removeprefix("torch."), "shape": list(shape), "bias": bias,
            "max_rows": MAX_ROWS, "version": PLAN_VERSION, "kernel": packed_matmul.LIBRARY.build_id()}


def plan_path(key: dict):
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "linear_chooser" / f"{'x'.join(map(str, key['shape']))}-{digest}.json"


def _cached_choice(key: dict) -> list[str] | None:
    path = plan_path(key)
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    choice = rec.get("choice") if isinstance(rec, dict) else None
    if rec.get("key") != key or not isinstance(choice, list) or len(choice) != MAX_ROWS or \
            any(c not in STRATEGIES for c in choice):
        return None  # another machine's (or build's, or thread count's) choice, or a damaged file
    return choice


def _plans(mods: list[nn.Linear], repeats: int, use_cache: bool) -> dict:
    """{(shape, dtype, bias): choice per rows}: cached, else measured now (and cached)."""
    groups: dict[tuple, list[nn.Linear]] = {}
    for mod in mods:
        groups.setdefault(_group(mod), []).append(mod)
    plans, todo = {}, []
    for g in groups:
        key = plan_key(*g)
        got = _cached_choice(key) if use_cache else None
        if got is None:
            todo.append(g)
        else:
            plans[g] = got
    if todo:
        t0 = time.perf_counter()
        print(f"draftcert: timing linear kernels for {len(todo)} weight shape(s) on this machine "
              f"({torch.get_num_threads()} thread(s); once, cached in {cache_root() / 'linear_chooser'})",
              file=sys.stderr, flush=True)
        measured = measure_passes(mods, set(todo), repeats=repeats)
        for g in todo:
            res = measured[g]
            plans[g] = res["choice"]
            key = plan_key(*g)
            if use_cache:
                try:
                    plan_path(key).parent.mkdir(parents=True, exist_ok=True)
                    write_json(plan_path(key), {"key": key, "choice": res["choice"], "seconds": res["seconds"],
                                                "timed_layers": res["timed_layers"], "repeats": repeats})
                except OSError:  # a read-only cache: the choice holds for this process only
                    pass
        print(f"draftcert: linear kernels timed in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return plans


# ----------------------------------------------------------------------------- the module


class MeasuredLinear(nn.Linear):
    """An ``nn.Linear`` that runs, for 1..MAX_ROWS rows, the kernel measured fastest for its shape
    (``fl_choice[rows - 1]``); copies of its weight for other layouts are plain attributes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        rows = x.numel() // max(x.shape[-1], 1)
        if not 1 <= rows <= MAX_ROWS or (self.weight.requires_grad and torch.is_grad_enabled()):
            return F.linear(x, self.weight, self.bias)  # (training: the gradient needs the parameter itself)
        how = self.__dict__["fl_choice"][rows - 1]
        if how == "rowmajor":
            return F.linear(x, self.weight, self.bias)
        return _apply(how, x, _copy(self, how), self.bias)

    def __getstate__(self):  # copy.deepcopy / pickle: the layout copies are rebuilt on first use
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        return {**state, "fl_copies": {}}


def _stamp(w: torch.Tensor) -> tuple:
    return (w.data_ptr(), w._version, w.device, w.dtype, tuple(w.shape))


def _copy(mod: nn.Linear, how: str) -> torch.Tensor:
    """``mod.weight`` in layout ``how``, rebuilt whenever the weight changed since it was made
    (in-place updates bump the tensor's version; ``.data =``, ``.to()`` change its storage)."""
    d = mod.__dict__
    copies = d.setdefault("fl_copies", {})
    stamp = _stamp(mod.weight)
    if how not in copies or copies[how][0] != stamp:
        copies[how] = (stamp, _layout(mod.weight, how))
    return copies[how][1]


def enable(model: nn.Module, *, force: str | None = None, repeats: int = 3, use_cache: bool = True) -> int:
    """Give every plain float ``nn.Linear`` of ``model`` on CPU its measured kernel choice, in place.

    ``force``: one strategy for every rows 2..MAX_ROWS without timing (tests, comparisons).
    Idempotent (already converted layers keep their plan); returns the number of layers converted.
    Modules on other devices and subclasses of ``nn.Linear`` (quantised layers, LoRA, ...) are left alone.
    """
    if force is not None and force not in STRATEGIES:
        raise ValueError(f"linear_chooser: unknown strategy {force!r}; expected one of {', '.join(STRATEGIES)}")
    mods = [m for m in model.modules() if type(m) is nn.Linear and m.weight.device.type == "cpu"
            and m.weight.is_floating_point() and m.weight.ndim == 2]
    if not mods:
        return 0
    if force is not None:
        if force == "streamed" and not packed_matmul.LIBRARY.available():
            raise ValueError(f"linear_chooser: strategy 'streamed' is unavailable here: {packed_matmul.LIBRARY.reason()}")
        plans = {None: ["rowmajor"] + [force] * (MAX_ROWS - 1)}
    else:
        plans = _plans(mods, repeats, use_cache)
    for mod in mods:
        choice = plans[None] if force is not None else plans[_group(mod)]
        mod.__class__ = MeasuredLinear
        mod.__dict__["fl_choice"] = tuple(choice)
        mod.__dict__["fl_copies"] = {}
        for how in set(choice) - {"rowmajor"}:
            _copy(mod, how)  # made now, not inside the first timed pass
    return len(mods)


def disable(model: nn.Module) -> int:
    """Undo ``enable``: plain ``nn.Linear`` modules again; returns the number restored."""
    n = 0
    for mod in model.modules():
        if type(mod) is MeasuredLinear:
            mod.__class__ = nn.Linear
            mod.__dict__.pop("fl_choice", None)
            mod.__dict__.pop("fl_copies", None)
            n += 1
    return n


def is_enabled(model: nn.Module) -> bool:
    return any(type(m) is MeasuredLinear for m in model.modules())


def plan_of(model: nn.Module) -> dict[str, list[str]]:
    """{"NxK": kernel per rows 1..MAX_ROWS} of the converted layers (what ``enable`` chose)."""
    return {"x".join(map(str, m.weight.shape)): list(m.__dict__["fl_choice"])
            for m in model.modules() if type(m) is MeasuredLinear}


@contextmanager
def plain_kernels(model: nn.Module):
    """Inside: every converted layer runs ``rowmajor`` (the plain layer) whatever it chose; the
    choices and copies are kept and back on exit (benchmarks compare both, interleaved)."""
    mods = [m for m in model.modules() if type(m) is MeasuredLinear]
    saved = [m.__dict__["fl_choice"] for m in mods]
    try:
        for m in mods:
            m.__dict__["fl_choice"] = ("rowmajor",) * MAX_ROWS
        yield
    finally:
        for m, c in zip(mods, saved):
            m.__dict__["fl_choice"] = c
